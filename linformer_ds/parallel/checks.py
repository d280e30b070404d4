"""Which sequence-parallel settings can run: every reason a setting cannot, as one-line
messages naming the key (``config_errors``, ``isolation_errors``), and the error they raise.
"""

from __future__ import annotations

from typing import Any

from linformer_ds.errors import LinformerError
from linformer_ds.model import ModelConfig, get_projection, layer_kinds, projection_stride

KEY = "parallel.sequence_parallel_size"
SHARD_KEY = "parallel.shard_sequence_parameters"


class SequenceParallelConfigError(LinformerError, ValueError):
    """An impossible sequence-parallel setting; the message names the key."""


def config_errors(
    sp_size: int,
    *,
    world_size: int | None,
    seq_len: int,
    model: ModelConfig,
    zero_stage: int = 0,
    zero_reduce_scatter: bool = True,
    shard: Any = False,
    precision: str = "fp32",
) -> list[str]:
    """Every reason ``sp_size`` cannot run, as one-line messages (empty: it can).

    ``seq_len`` is the data's sequence length N (every row is N tokens, right-padded);
    ``zero_reduce_scatter`` is ``zero_optimization.reduce_scatter`` of the DeepSpeed config;
    ``shard``: ``parallel.shard_sequence_parameters`` (E/F columns and position rows sharded;
    ``"auto"``: decided later, so no rule of sharding applies); ``precision``:
    ``deepspeed.precision``.
    """
    shard = shard != "auto" and bool(shard)
    p = int(sp_size)
    if p < 1:
        return [f"{KEY}: must be >= 1, got {p}"]
    if p == 1:
        return []
    errors = []
    if world_size is not None and world_size % p:
        errors.append(f"{KEY}: {p} does not divide the world size {world_size}")
    if seq_len % p:
        errors.append(f"{KEY}: {p} does not divide the sequence length N={seq_len}")
    if model.max_seq_len < seq_len:
        errors.append(
            f"{KEY}: {p} > 1 needs model.max_seq_len >= N (got max_seq_len={model.max_seq_len}, "
            f"N={seq_len}): every slice takes its positions and E columns at its global offset"
        )
    n_local = seq_len // p
    r = model.local_mixer_kernel // 2
    if model.local_mixer != "none" and seq_len % p == 0 and n_local < r:
        errors.append(
            f"{KEY}: the slice length N/P={n_local} is shorter than the local mixer's reach "
            f"{r} (model.local_mixer_kernel {model.local_mixer_kernel}); lower P or the kernel"
        )
    w = model.local_window // 2
    if w and seq_len % p == 0 and n_local < w:
        errors.append(
            f"{KEY}: the slice length N/P={n_local} is shorter than the window's reach {w} "
            f"(model.local_window {model.local_window}: W/2 keys each side come from the "
            f"neighbouring rank); use local_window <= {2 * n_local} or a lower P"
        )
    schedule = model.projection_schedule()
    for i, kind in enumerate(schedule):  # the registered kind's own support and stride
        if not get_projection(kind).sequence_parallel:
            errors.append(
                f"{KEY}: layer {i}: the {kind} projection does not support sequence parallelism "
                "(its kind is registered without sequence_parallel=True); use P=1"
            )
            break
        r = projection_stride(model, i)
        if r is not None and seq_len % p == 0 and n_local % r:
            rule = get_projection(kind).stride_rule
            errors.append(
                f"{KEY}: {kind} layer {i}: the slice length N/P={n_local} is not a multiple of "
                f"the {kind} stride {r}{f' ({rule})' if rule else ''}; pick N, P or k so it is"
            )
            break
    full = sorted({k.name for k in layer_kinds(model) if k.full_attention})
    if full and model.num_heads % p:
        errors.append(
            f"{KEY}: {'/'.join(full)} layers (DeepSpeed-Ulysses) need num_heads divisible by P, got "
            f"num_heads={model.num_heads}, P={p}"
        )
    if shard and seq_len != model.max_seq_len:
        errors.append(
            f"{SHARD_KEY}: sharding needs model.max_seq_len == N (got max_seq_len="
            f"{model.max_seq_len}, N={seq_len}): each rank holds the E/F columns and position "
            f"rows of its slice; set model.max_seq_len={seq_len} or {SHARD_KEY}=false"
        )
    if shard and zero_stage == 0 and precision in ("bf16", "fp16"):
        errors.append(
            f"{SHARD_KEY}: zero.stage=0 with {precision} is not supported sharded: DeepSpeed "
            "0.19's BF16_Optimizer reports a wrong gradient norm under the model-parallel mpu "
            f"(docs/sequence_parallel.md); use zero.stage >= 1, fp32, or {SHARD_KEY}=false"
        )
    if shard and model.max_seq_len % p:
        errors.append(f"{SHARD_KEY}: {p} does not divide model.max_seq_len={model.max_seq_len}")
    if zero_stage == 3 and not zero_reduce_scatter and not shard:
        errors.append(
            f"{KEY}: {p} > 1 with zero.stage=3 needs zero_optimization.reduce_scatter=true: with "
            "it off, DeepSpeed 0.19 divides the gradients of parameters that fit a reduce bucket "
            "by DP and of larger ones by DP x P, so no single loss scale is right"
        )
    return errors


ISOLATION_KEY = "data.document_isolation"


def isolation_errors(sp_size: int, model: ModelConfig, shard: Any) -> list[str]:
    """Why document isolation cannot run with ``sp_size`` ranks per sequence (empty: it can):
    linear layers sum each document's partial summaries over the group, dense layers mask the
    gathered documents; conv windows that cross a slice boundary are not implemented, and
    documents need the whole position table and E/F on every rank (no sharding). A kind
    registered with ``isolation_under_sp=False`` (conv) is refused with its reason."""
    if int(sp_size) == 1:
        return []
    errors = []
    for kind in layer_kinds(model):
        if not kind.isolation_under_sp:
            why = f" ({kind.isolation_sp_reason})" if kind.isolation_sp_reason else ""
            errors.append(
                f"{ISOLATION_KEY}: {kind.name} layers under sequence parallelism (P={sp_size}) "
                f"are not supported with document isolation{why}; use P=1 or no {kind.name}"
            )
            break
    if shard is True:
        errors.append(
            f"{ISOLATION_KEY}: documents start anywhere, so every rank needs every position "
            f"and E/F column; set {SHARD_KEY}=false"
        )
    return errors


def check_config(sp_size: int, **kwargs: Any) -> None:
    """Raise :class:`SequenceParallelConfigError` with the first of :func:`config_errors`."""
    errors = config_errors(sp_size, **kwargs)
    if errors:
        raise SequenceParallelConfigError(errors[0])
