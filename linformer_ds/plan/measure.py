"""The measured side of the planner: the live bytes of tensor storage, counted at every
operator, and their peak (:class:`LiveBytes`). Not the resident set: a storage counts from the
operator that makes it until it is freed, whatever the allocator keeps, so the figure is the
same on every run of the same step."""

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes(tensors) as m: step()``: ``m.peak`` is the most bytes of tensor
    storage alive at once inside (``tensors``: those alive before, e.g. the parameters, counted
    from the start); ``m.now`` the bytes alive at the end. Tensors made on this thread only
    (the CPU autograd engine runs backward on the caller's thread)."""

    def __init__(self, tensors: Any = ()) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0
        for t in tensors:
            self._add(t)

    def _release(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def _add(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        s = t.untyped_storage()
        key, size = s.data_ptr(), s.nbytes()
        if size == 0 or key in self.live:
            return
        self.live[key] = size
        self.now += size
        self.peak = max(self.peak, self.now)
        weakref.finalize(s, self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._add(t)
        return out
