"""Our Linformer against lucidrains' ``linformer`` package at equal work, the trainer's path beside.

``python -m bench.peer_bench`` times one training step (forward, backward, AdamW) of

* ``ours``: :class:`LinformerForMaskedLM`, logits for every position ``[B, N, V]``;
* ``lucidrains``: the same model with lucidrains' ``Linformer`` (pip ``linformer``) as the
  encoder body: the same embeddings (token + position, LayerNorm), the same final LayerNorm and
  the same MLM head (our :class:`MLMHead`, decoder tied to the token embeddings), full logits;
* ``ours-trainer``: :class:`LinformerForMaskedLMPretraining`, the head on the labelled positions
  only (what ``linformer_ds.train`` runs);
* ``ours-dense`` and ``hf-bert`` (not in the default ``--models``): our model with
  ``projection: dense`` (softmax attention through ``scaled_dot_product_attention``) and Hugging
  Face's ``BertForMaskedLM`` with ``attn_implementation="sdpa"`` at the same sizes (no dropout,
  one token type, decoder tied to the token embeddings, full logits, the same loss and
  optimizer): the dense baseline every "Linformer vs dense" speed-up divides by, against the
  reference implementation. Equal matrix-multiply FLOPs (tested); BERT is post-LN (ours pre-LN,
  one more LayerNorm) and adds a token-type embedding row; the sharing mode does not apply.

for every sharing mode in ``--sharings`` (each a group of its own). Equal work: same layers,
width, heads, k, FFN size (lucidrains' is ``4 x hidden``), vocabulary; pre-LN blocks; keys and
values per head (their ``one_kv_head=False``); no dropout in either (lucidrains drops attention
probabilities and FFN activations, we drop residual branches: ``p = 0`` makes them the same
work); the same loss (mean cross-entropy of the labelled 15 %, from full logits) and the same
optimizer step. Each of our sharing modes against its closest lucidrains configuration
(:data:`PEER_CONFIGS`):

* ``headwise`` (one E and one F per layer for all heads): their default ``share_kv=False``.
  Equal work.
* ``kv`` (one projection per layer for keys and values, E = F): ``share_kv=False`` with each
  layer's ``proj_v`` tied to its ``proj_k``. Equal work. (Their ``share_kv=True`` also drops
  the value projection ``to_v``, one ``d x d`` GEMM less per layer: less work, not used.)
* ``layerwise`` (one projection for keys and values of every layer): ``share_kv=False`` with
  every layer's ``proj_k`` and ``proj_v`` tied to one ``[N, k]`` parameter. Equal work.
* ``none`` (an E and an F per head, ``[h, k, N]`` each): lucidrains has no per-head
  projection; the closest is ``share_kv=False``. The same matrix-multiply FLOPs
  (``h x k x n x d = k x n x D``), but ours has ``h`` times the E/F parameters, so its E/F
  gradients and its optimizer step are ``h`` times larger: **not equal work** (ours does more).

The only parameters that differ under equal work are our q/k/v biases (``3 x hidden`` per layer;
lucidrains' ``to_q/to_k/to_v`` have none); the matrix-multiply FLOPs are the same.

Memory state (``--isolation``): ``process`` (default) builds every model of a group in a process
of its own (spawned; parameters, optimizer state and allocator untouched by the others) and the
parent drives their steps over pipes, so the turns still interleave; between turns a process
waits on its pipe (no CPU). Each row records its process's peak RSS. ``shared``: all models of a
group in this process (the first version's way; at 16k the others' memory distorted a model's
time), for tests and quick looks. Either way a group's models are freed before the next group.

Precision ``bf16`` (default): bf16 parameters with fp32 master weights updated by AdamW
(DeepSpeed's bf16 mode, :class:`bench.model_bench.MasterWeightAdamW`); ``autocast``: fp32
parameters under bf16 autocast; ``fp32``. The models' timed steps alternate within each round
(the order rotates every round), so machine drift hits all of them alike; a model's step time is
the median of its timed steps, and ``speedup`` is the median of the per-round ratios
lucidrains / ours. Model FLOPs come from ``flops_per_token`` in ``linformer_ds/model/heads.py``; MFU is
against the best GEMM rate measured in the run's own precision (bf16 for bf16 and autocast,
fp32 for fp32), before and after the timed steps. The machine, the load average before and
after every group and ``--beside`` (what else ran) go into the results.

Writes ``results.json`` and ``results.md`` to ``--out``.
"""

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bench.common import (
    BenchError,
    ModelSizes,
    add_size_options,
    environment,
    mlm_batch,
    write_results,
)
from bench.model_bench import ADAMW, MasterWeightAdamW, _adamw, resolve_device
from linformer_ds.model import (
    LinformerForMaskedLM,
    LinformerForMaskedLMPretraining,
    MLMHead,
    ModelConfig,
    flops_per_token,
    init_weights,
)
from linformer_ds.perf import measure_matmul_peak_tflops, time_call

MODELS = ("ours", "lucidrains", "ours-trainer", "ours-dense", "hf-bert")
DEFAULT_MODELS = ("ours", "lucidrains", "ours-trainer")
DENSE_MODELS = ("ours-dense", "hf-bert")
PRECISIONS = ("bf16", "autocast", "fp32")
SHARINGS = ("none", "headwise", "kv", "layerwise")
ISOLATIONS = ("process", "shared")
# our sharing mode -> (lucidrains' configuration, equal work?)
PEER_CONFIGS: dict[str, tuple] = {
    "none": ("share_kv=False (no per-head E/F in lucidrains)", False),
    "headwise": ("share_kv=False", True),
    "kv": ("share_kv=False, proj_v tied to proj_k", True),
    "layerwise": ("share_kv=False, one proj for K, V of all layers", True),
}


@dataclass
class PeerConfig(ModelSizes):
    """Everything one run depends on (stored in results.json)."""

    seq_lens: list[int] = field(default_factory=lambda: [4096, 16384])
    models: list[str] = field(default_factory=lambda: list(DEFAULT_MODELS))
    sharings: list[str] = field(default_factory=lambda: list(SHARINGS))
    isolation: str = "process"
    beside: str = ""
    dropout: float = 0.0
    batch: int = 1
    warmup: int = 1
    iters: int = 5
    precision: str = "bf16"
    mlm_fraction: float = 0.15
    device: str = "auto"
    gemm_n: int = 4096
    gemm_budget_s: float = 20.0
    seed: int = 0
    out: str = "bench/results/peer"

    def validate(self) -> None:
        """Raise BenchError naming the first bad option."""
        self.validate_sizes()
        if "lucidrains" in self.models and self.intermediate != 4 * self.hidden:
            raise BenchError(
                f"--intermediate {self.intermediate}: lucidrains' FFN is 4 x hidden = "
                f"{4 * self.hidden}; give that for equal work"
            )
        if self.dropout != 0.0 or self.attention_dropout != 0.0:
            raise BenchError("dropout: the two models drop different tensors; equal work is p=0")
        if not self.models or any(m not in MODELS for m in self.models):
            raise BenchError(f"--models: choose one or more of {MODELS}, got {self.models}")
        if not self.sharings or any(m not in SHARINGS for m in self.sharings):
            raise BenchError(f"--sharings: choose one or more of {SHARINGS}, got {self.sharings}")
        if self.isolation not in ISOLATIONS:
            raise BenchError(f"--isolation: must be one of {ISOLATIONS}, got {self.isolation!r}")
        if not self.seq_lens or any(n < self.k for n in self.seq_lens):
            raise BenchError(f"--seq-lens: give lengths >= k={self.k}, got {self.seq_lens}")
        for name in ("batch", "iters"):
            if getattr(self, name) < 1:
                raise BenchError(f"--{name}: must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise BenchError(f"--warmup: must be >= 0, got {self.warmup}")
        if self.precision not in PRECISIONS:
            raise BenchError(f"--precision: must be one of {PRECISIONS}, got {self.precision!r}")
        if not 0.0 < self.mlm_fraction <= 1.0:
            raise BenchError(f"--mlm-fraction: must be in (0, 1], got {self.mlm_fraction}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise BenchError(f"--device: must be auto, cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise BenchError("--device cuda: torch.cuda.is_available() is False")


def our_config(pc: PeerConfig, n: int, sharing: str = "headwise") -> ModelConfig:
    """Our model at ``pc``'s sizes: linear projection in every layer, pre-LN, no dropout."""
    return ModelConfig(
        vocab_size=pc.vocab,
        max_seq_len=n,
        hidden_size=pc.hidden,
        num_layers=pc.layers,
        num_heads=pc.heads,
        intermediate_size=pc.intermediate,
        dropout=0.0,
        attention_dropout=0.0,
        projection="linear",
        k=pc.k,
        sharing=sharing,
    )


# ==================================================================================== the peer
class LucidrainsMLM(nn.Module):
    """lucidrains' ``Linformer`` body between our embeddings and our MLM head (equal work).

    ``forward(input_ids [B, n]) -> logits [B, n, V]``. Their ``LinformerLM`` has no embedding or
    final LayerNorm and a bare untied decoder; those are ours here so that both models do the
    same work outside the attention blocks too. ``config.sharing`` picks the E/F tying of
    :data:`PEER_CONFIGS` (their ``share_kv=False`` body, parameters tied after construction).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        from linformer import Linformer

        if config.sharing not in PEER_CONFIGS:
            raise ValueError(f"no lucidrains configuration for sharing={config.sharing!r}")
        d = config.hidden_size
        self.token_embeddings = nn.Embedding(config.vocab_size, d)
        self.position_embeddings = nn.Embedding(config.max_seq_len, d)
        self.embed_ln = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.apply(lambda m: init_weights(m, config.initializer_range))
        self.body = Linformer(
            dim=d,
            seq_len=config.max_seq_len,
            depth=config.num_layers,
            k=config.k,
            heads=config.num_heads,
            one_kv_head=False,
            share_kv=False,
            dropout=0.0,
        )
        attns = [layer[0].fn for layer in self.body.net.layers]  # PreNorm(attention).fn
        for attn in attns:
            if config.sharing == "kv":  # E = F within a layer; to_k and to_v stay apart
                attn.proj_v = attn.proj_k
            elif config.sharing == "layerwise":  # one E = F for every layer
                attn.proj_k = attn.proj_v = attns[0].proj_k
        self.final_ln = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.lm_head = MLMHead(config)
        init_weights(self.lm_head.dense, config.initializer_range)
        self.lm_head.decoder.weight = self.token_embeddings.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed_ln(self.token_embeddings(input_ids) + self.position_embeddings(pos)[None])
        return self.lm_head(self.final_ln(self.body(x)))


class HFBertMLM(nn.Module):
    """Hugging Face ``BertForMaskedLM`` (SDPA attention) at ``config``'s sizes, no dropout;
    ``forward(input_ids) -> logits [B, n, V]``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        from transformers import BertConfig, BertForMaskedLM

        bert = BertConfig(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
            intermediate_size=config.intermediate_size,
            max_position_embeddings=config.max_seq_len, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, type_vocab_size=1,
            layer_norm_eps=config.layer_norm_eps, initializer_range=config.initializer_range,
            tie_word_embeddings=True, attn_implementation="sdpa",
        )  # fmt: skip
        self.bert = BertForMaskedLM(bert)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=input_ids).logits


def full_logits_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the labelled positions from full ``[B, n, V]`` logits (our
    ``mlm_loss``, written out so that both models share it)."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
    )


def model_config(name: str, config: ModelConfig) -> ModelConfig:
    """The configuration model ``name`` runs at ``config``'s sizes: softmax attention for the
    dense pair (no E/F; their FLOPs are the dense model's), ``config`` itself otherwise."""
    return replace(config, projection="dense") if name in DENSE_MODELS else config


def build(name: str, config: ModelConfig) -> nn.Module:
    """The model ``name`` (one of MODELS) at ``config``'s sizes, in training mode."""
    config = model_config(name, config)
    if name == "ours":
        return LinformerForMaskedLM(config).train()
    if name == "ours-trainer":
        return LinformerForMaskedLMPretraining(config).train()
    if name == "ours-dense":
        return LinformerForMaskedLM(config).train()
    if name == "hf-bert":
        return HFBertMLM(config).train()
    return LucidrainsMLM(config).train()


def loss_of(name: str, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The training loss of ``model``: full logits for ours and lucidrains, the trainer's
    labelled-only head for ours-trainer."""
    if name == "ours-trainer":
        return model(ids, labels=labels).loss
    logits = model(ids).logits if name in ("ours", "ours-dense") else model(ids)
    return full_logits_loss(logits, labels)


def unique_parameters(model: nn.Module) -> int:
    """Elements of the distinct parameters (a tied one counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def peak_rss_gib() -> float:
    """This process's peak resident memory so far (GiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class Runner:
    """One model + optimizer + a fixed batch; ``step()`` is one training step."""

    def __init__(
        self, name: str, pc: PeerConfig, n: int, device: torch.device, sharing: str = "headwise"
    ):
        self.name, self.device = name, device
        self.config = model_config(name, our_config(pc, n, sharing))
        torch.manual_seed(pc.seed)
        self.model = build(name, self.config).to(device)
        params = list(self.model.parameters())
        self.autocast: Callable[[], Any] = contextlib.nullcontext
        if pc.precision == "bf16":
            self.model.to(torch.bfloat16)
            self.opt: Any = MasterWeightAdamW(params, **ADAMW)
        else:
            self.opt = _adamw(params, **ADAMW)
            if pc.precision == "autocast":
                self.autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16)
        rows = mlm_batch(pc.vocab, pc.batch, n, pc.mlm_fraction, seed=pc.seed + n)
        self.ids, self.labels = rows["input_ids"].to(device), rows["labels"].to(device)
        labelled = int((rows["labels"] != -100).sum()) / rows["labels"].numel()
        self.tokens = pc.batch * n
        self.params = unique_parameters(self.model)
        # both full-logit models run the head on every position; the trainer on the labelled
        self.flops_per_token = flops_per_token(
            self.config, n, labelled if name == "ours-trainer" else 1.0
        )

    def step(self) -> float:
        with self.autocast():
            loss = loss_of(self.name, self.model, self.ids, self.labels)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def timed_step(self) -> float:
        """Seconds of one ``step()``."""
        return time_call(self.step, self.device)

    def info(self) -> dict[str, Any]:
        return {
            "params": self.params,
            "tokens": self.tokens,
            "flops_per_token": self.flops_per_token,
        }

    def close(self) -> dict[str, Any]:
        """Free the model; what the row records about this runner's memory (none in-process)."""
        del self.model, self.opt
        return {}


def _worker(conn: Any, name: str, pc: dict[str, Any], n: int, sharing: str, threads: int) -> None:
    """A process that owns one :class:`Runner`: answers ``step`` with its seconds and ``stop``
    with its peak RSS; an exception goes back as ``("error", traceback)``."""
    try:
        torch.set_num_threads(threads)
        cfg = PeerConfig(**pc)
        runner = Runner(name, cfg, n, resolve_device(cfg.device), sharing)
        conn.send(("ok", runner.info()))
        while True:
            cmd = conn.recv()
            if cmd == "step":
                conn.send(("ok", runner.timed_step()))
            else:
                conn.send(("ok", {"peak_rss_gib": peak_rss_gib()}))
                return
    except Exception:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", traceback.format_exc()))


class ProcessRunner:
    """A :class:`Runner` in a spawned process of its own; the same interface, over a pipe."""

    def __init__(self, name: str, pc: PeerConfig, n: int, sharing: str):
        self.name = name
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_worker,
            args=(child, name, asdict(pc), n, sharing, torch.get_num_threads()),
            daemon=True,
        )
        self.proc.start()
        child.close()
        self._info = self._recv()

    def _recv(self) -> Any:
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"{self.name}: worker died (exit {self.proc.exitcode})") from None
        if status != "ok":
            raise RuntimeError(f"{self.name}: worker failed:\n{value}")
        return value

    @property
    def params(self) -> int:
        return self._info["params"]

    @property
    def tokens(self) -> int:
        return self._info["tokens"]

    @property
    def flops_per_token(self) -> float:
        return self._info["flops_per_token"]

    def timed_step(self) -> float:
        self.conn.send("step")
        return self._recv()

    def close(self) -> dict[str, Any]:
        self.conn.send("stop")
        out = self._recv()
        self.proc.join(timeout=60)
        return out


# ========================================================================================== run
def gemm_peak(pc: PeerConfig, device: torch.device) -> float:
    """FLOP/s of the best square GEMM in the run's own precision."""
    dtype = torch.float32 if pc.precision == "fp32" else torch.bfloat16
    return measure_matmul_peak_tflops(dtype, device, pc.gemm_n, budget_s=pc.gemm_budget_s) * 1e12


def interleaved_times(runners: Sequence[Any], warmup: int, iters: int) -> dict[str, list[float]]:
    """Seconds per step of each runner: ``warmup + iters`` rounds, one step of each runner per
    round, the order rotated every round (ABC, BCA, CAB, ...); warm-up rounds are dropped."""
    times: dict[str, list[float]] = {r.name: [] for r in runners}
    for rnd in range(warmup + iters):
        order = [runners[(rnd + j) % len(runners)] for j in range(len(runners))]
        for r in order:
            t = r.timed_step()
            if rnd >= warmup:
                times[r.name].append(t)
    return times


def run_group(
    pc: PeerConfig, n: int, sharing: str, device: torch.device, log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """The rows of one (N, sharing) group: its models built, timed interleaved, freed."""
    load_before = os.getloadavg()
    if pc.isolation == "process":
        runners: list[Any] = [ProcessRunner(m, pc, n, sharing) for m in pc.models]
    else:
        runners = [Runner(m, pc, n, device, sharing) for m in pc.models]
    try:
        times = interleaved_times(runners, pc.warmup, pc.iters)
    finally:
        closed = [r.close() for r in runners]
    load_after = os.getloadavg()
    peer, equal = PEER_CONFIGS[sharing]
    rows = []
    for r, memory in zip(runners, closed):
        ts = times[r.name]
        step = statistics.median(ts)
        row = {
            "n": n,
            "sharing": sharing,
            "model": r.name,
            "lucidrains_config": None if r.name in DENSE_MODELS else peer,
            "equal_work": True if r.name in DENSE_MODELS else equal,  # dense: with each other
            "params": r.params,
            "step_s_median": step,
            "step_s_min": min(ts),
            "step_s_all": ts,
            "tokens_per_s": r.tokens / step,
            "flops_per_token": r.flops_per_token,
            "model_tflops": r.flops_per_token * r.tokens / step / 1e12,
            "load_avg_before": load_before,
            "load_avg_after": load_after,
            **memory,
        }
        # each model against its peer: per-round ratios peer / ours and their median
        for peer_name, applies, key, rounds_key in (
            ("lucidrains", r.name not in ("lucidrains",) + DENSE_MODELS,
             "speedup_vs_lucidrains", "speedup_per_round"),
            ("hf-bert", r.name == "ours-dense", "speedup_vs_hf_bert", "speedup_vs_hf_bert_per_round"),
        ):  # fmt: skip
            if applies and peer_name in times:
                ratios = [a / b for a, b in zip(times[peer_name], ts)]
                row[key], row[rounds_key] = statistics.median(ratios), ratios
        rows.append(row)
        log(
            f"N={n:>6} {sharing:<9} {r.name:<13} {step:8.3f} s (min {min(ts):.3f}) "
            f"{row['model_tflops']:.3f} TFLOP/s"
            + (f" x{row['speedup_vs_lucidrains']:.3f}" if "speedup_vs_lucidrains" in row else "")
            + (f" x{row['speedup_vs_hf_bert']:.3f} vs HF" if "speedup_vs_hf_bert" in row else "")
            + f"  load {load_before[0]:.1f}->{load_after[0]:.1f}"
        )
    return rows


def run_benchmark(
    pc: PeerConfig, log: Callable[[str], None] = print, partial: Path | None = None
) -> dict[str, Any]:
    """Every N and sharing mode: build the models, time them interleaved; the results dict.
    ``partial``: a directory that gets the rows so far (``partial.json``) after every group."""
    pc.validate()
    device = resolve_device(pc.device)
    env = environment("bench.peer_bench", device)
    env["beside"] = pc.beside
    log(f"device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    peaks = [gemm_peak(pc, device)]
    log(f"GEMM peak ({pc.precision}): {peaks[0] / 1e12:.3f} TFLOP/s")
    rows: list[dict[str, Any]] = []
    for n in pc.seq_lens:
        for sharing in pc.sharings:
            rows += run_group(pc, n, sharing, device, log)
            if partial is not None:
                partial.mkdir(parents=True, exist_ok=True)
                done = {"config": asdict(pc), "environment": env, "rows": rows}
                (partial / "partial.json").write_text(json.dumps(done, indent=1) + "\n")
    peaks.append(gemm_peak(pc, device))
    peak = max(peaks)
    for row in rows:
        row["mfu"] = row["model_tflops"] * 1e12 / peak
    env["load_avg_end"] = os.getloadavg()
    if "lucidrains" in pc.models:
        import linformer

        env["linformer"] = getattr(linformer, "__version__", _dist_version("linformer"))
    if "hf-bert" in pc.models:
        env["transformers"] = _dist_version("transformers")
    return {
        "config": asdict(pc),
        "environment": env,
        "gemm_peak_flops": peak,
        "gemm_flops_all": peaks,
        "gemm_dtype": "float32" if pc.precision == "fp32" else "bfloat16",
        "rows": rows,
    }


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _load(x: Sequence[float]) -> str:
    return "/".join(f"{v:.1f}" for v in x)


def markdown_table(results: dict[str, Any]) -> str:
    c, env = results["config"], results["environment"]
    lines = [
        f"{c['layers']} layers, d={c['hidden']}, {c['heads']} heads, k={c['k']}, "
        f"FFN {c['intermediate']}, V={c['vocab']}, {c['precision']}, "
        f"batch {c['batch']}; {env.get('gpu') or env['cpu']} ({env['cpu_count']} CPUs, "
        f"{env['torch_threads']} threads), torch {env['torch']}, linformer {env.get('linformer')}"
        + (f", transformers {env['transformers']}" if env.get("transformers") else "")
        + "; "
        f"median of {c['iters']} interleaved steps (fwd + bwd + AdamW) after {c['warmup']} "
        f"warm-up; isolation {c.get('isolation', 'shared')}; GEMM peak "
        f"{results['gemm_peak_flops'] / 1e12:.2f} TFLOP/s ({results['gemm_dtype']}); "
        f"load average (1/5/15 min) {_load(env['load_avg_start'])} at start, "
        f"{_load(env['load_avg_end'])} at end; beside: {env.get('beside') or 'not recorded'}",
        "",
        "| N | sharing | model | lucidrains config | step (s) | min (s) | tokens/s | TFLOP/s "
        "| MFU | peak RSS (GiB) | vs lucidrains | vs HF BERT |",
        "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["rows"]:
        sp, hf = r.get("speedup_vs_lucidrains"), r.get("speedup_vs_hf_bert")
        dense = r["model"] in DENSE_MODELS
        peer = (
            "- (dense)"
            if dense
            else r.get("lucidrains_config", "")
            + ("" if r.get("equal_work", True) else " (NOT equal work)")
        )
        rss = r.get("peak_rss_gib")
        lines.append(
            f"| {r['n']} | {r.get('sharing', 'headwise')} | {r['model']} | {peer} | "
            f"{r['step_s_median']:.3f} | {r['step_s_min']:.3f} | {r['tokens_per_s']:.0f} | "
            f"{r['model_tflops']:.3f} | {r['mfu'] * 100:.1f} % | "
            + (f"{rss:.2f} | " if rss is not None else "- | ")
            + (f"{sp:.3f}x | " if sp is not None else "- | ")
            + (f"{hf:.3f}x |" if hf is not None else "- |")
        )
    return "\n".join(lines) + "\n"


# ========================================================================================== CLI
def parse_args(argv: Sequence[str] | None = None) -> PeerConfig:
    d = PeerConfig()
    p = argparse.ArgumentParser(
        prog="python -m bench.peer_bench", description=__doc__.split("\n")[0]
    )
    p.add_argument("--seq-lens", type=int, nargs="+", default=d.seq_lens)
    p.add_argument("--models", nargs="+", default=d.models, help=f"some of {MODELS}")
    p.add_argument("--sharings", nargs="+", default=d.sharings, help=f"some of {SHARINGS}")
    p.add_argument(
        "--isolation", default=d.isolation,
        help="process: one process per model (default); shared: all in this one",
    )  # fmt: skip
    p.add_argument("--beside", default=d.beside, help="what else ran on the machine (recorded)")
    add_size_options(p, d, "batch")
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--iters", type=int, default=d.iters, help="timed rounds")
    p.add_argument("--precision", default=d.precision, help=f"one of {PRECISIONS}")
    p.add_argument("--mlm-fraction", type=float, default=d.mlm_fraction)
    p.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    p.add_argument("--gemm-n", type=int, default=d.gemm_n)
    p.add_argument("--gemm-budget-s", type=float, default=d.gemm_budget_s)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=d.out)
    pc = PeerConfig(**vars(p.parse_args(argv)))
    pc.validate()
    return pc


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m bench.peer_bench``."""
    try:
        pc = parse_args(argv)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if "lucidrains" in pc.models:
            import linformer  # noqa: F401
    except ImportError:
        print(
            "error: lucidrains' linformer is not installed: pip install -e '.[bench]'",
            file=sys.stderr,
        )
        return 2
    results = run_benchmark(pc, partial=Path(pc.out))
    for path in write_results(results, Path(pc.out), markdown_table):
        print(f"wrote {path}")
    (Path(pc.out) / "partial.json").unlink(missing_ok=True)  # results.json has every row
    print(markdown_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
