"""Run a training script with NCCL process groups that also take CPU tensors (the GPU kit's
workaround; docs/gpu.md).

    python scripts/gpu_pretrain_shim.py launch/pretrain.py --config ... [key=value ...]
    deepspeed scripts/gpu_pretrain_shim.py launch/pretrain.py --config ...

The trainer all-reduces small CPU tensors (step statistics, the stop flag), and a process group
made with ``init_process_group("nccl")`` refuses those ("No backend type associated with device
type cpu"). This wrapper turns a plain ``"nccl"`` into ``"cpu:gloo,cuda:nccl"`` (CUDA tensors
still go through NCCL) and then runs the script as ``__main__``. scripts/gpu_check.py uses it
only when its preflight sees NCCL refuse a CPU tensor; fixing the trainer makes it unneeded.
"""

import runpy
import sys
from typing import List, Optional, Tuple


def mixed_backend(backend: Optional[str]) -> Optional[str]:
    """``"nccl"`` -> ``"cpu:gloo,cuda:nccl"``; anything else unchanged."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def split_argv(argv: List[str]) -> Tuple[str, List[str]]:
    """(script, its argv): the first ``*.py`` argument is the script; the launcher's options
    before it (``--local_rank=0``) are passed on to it."""
    for i, arg in enumerate(argv):
        if arg.endswith(".py") and not arg.startswith("-"):
            return arg, [arg] + argv[:i] + argv[i + 1 :]
    raise SystemExit("usage: gpu_pretrain_shim.py SCRIPT.py [args ...]")


def patch() -> None:
    """Route ``torch.distributed.init_process_group("nccl")`` to the mixed backend."""
    import torch.distributed as dist

    original = dist.init_process_group

    def init_process_group(*args, **kwargs):
        if "backend" in kwargs:
            kwargs["backend"] = mixed_backend(kwargs["backend"])
        elif args:
            args = (mixed_backend(args[0]), *args[1:])
        return original(*args, **kwargs)

    dist.init_process_group = init_process_group


if __name__ == "__main__":
    script, sys.argv = split_argv(sys.argv[1:])
    patch()
    runpy.run_path(script, run_name="__main__")
