"""What sequence parallelism hands to collectives: the formula per layer and a counter.

Measurement tools for the benchmark (bench/sp_bench.py) and the tests, kept out of the library:
:func:`collective_bytes_per_layer` is the payload one rank hands to collectives per layer (the
derivation is in docs/sequence_parallel.md); :class:`count_collectives` counts what is actually
passed to ``torch.distributed``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def collective_bytes_per_layer(
    kind: str,
    *,
    seq_len: int,
    sp_size: int,
    batch_size: int,
    hidden_size: int,
    k: int | None = None,
    stride: int | None = None,
    with_mask: bool = True,
    bytes_per_element: int = 4,
) -> dict[str, int]:
    """Bytes one rank hands to collectives for one layer, ``{"forward", "backward"}``.

    Payload = the input tensor of each call (what :func:`count_collectives` measures); the ring
    algorithms put about ``2 (P-1)/P`` (all-reduce), ``(P-1)/P`` (all-to-all, reduce-scatter)
    or ``P-1`` (all-gather) times that on the wire. ``kind``: linear (k needed), conv (stride
    needed) or dense (Ulysses). Independent of the sharing mode (keys and values are projected
    and exchanged either way). Masks go as one byte per element.
    """
    p, b, d, e = sp_size, batch_size, hidden_size, bytes_per_element
    if p == 1:
        return {"forward": 0, "backward": 0}
    n_local = seq_len // p
    if kind == "linear":
        if k is None:
            raise ValueError("linear: k is needed")
        one = b * k * 2 * d * e  # projected keys and values [B, k, 2h, d]
        return {"forward": one, "backward": one}
    if kind == "conv":
        if stride is None:
            raise ValueError("conv: stride is needed")
        c_local = n_local // stride
        fwd = b * c_local * 2 * d * e + (b * c_local if with_mask else 0)
        return {"forward": fwd, "backward": b * c_local * p * 2 * d * e}
    if kind == "dense":
        a2a = b * n_local * d * e  # q, k, v in and the output back, each [B, N/P, h, d]
        return {"forward": 4 * a2a + (b * n_local if with_mask else 0), "backward": 4 * a2a}
    raise ValueError(f"kind must be linear, conv or dense, got {kind!r}")


class count_collectives:
    """Context manager counting the payload bytes of torch.distributed collectives by kind.

    ``with count_collectives() as c: ...``; ``c.bytes`` maps ``all_reduce``, ``all_gather``,
    ``reduce_scatter``, ``all_to_all`` to bytes handed in (input tensors), ``c.calls`` to counts.
    Wraps ``torch.distributed`` functions, which DeepSpeed's comm layer also calls.
    """

    _NAMES = {
        "all_reduce": "all_reduce",
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter",
        "all_to_all_single": "all_to_all",
    }

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {v: 0 for v in self._NAMES.values()}
        self.calls: dict[str, int] = {v: 0 for v in self._NAMES.values()}
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> count_collectives:
        for name, kind in self._NAMES.items():
            fn = getattr(dist, name)
            self._saved[name] = fn
            setattr(dist, name, self._wrap(fn, name, kind))
        return self

    def _wrap(self, fn: Any, name: str, kind: str) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if name == "all_reduce":
                t = kwargs.get("tensor", args[0] if args else None)
            else:  # (output, input, ...)
                t = kwargs.get(
                    "input", kwargs.get("input_tensor", args[1] if len(args) > 1 else None)
                )
            self.bytes[kind] += int(t.numel() * t.element_size())
            self.calls[kind] += 1
            return fn(*args, **kwargs)

        return wrapped

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())
