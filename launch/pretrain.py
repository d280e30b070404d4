"""Pretrain a Linformer encoder with DeepSpeed.

deepspeed launch/pretrain.py --config configs/base_4096.yaml [key=value ...]
torchrun --nproc_per_node 2 launch/pretrain.py --config configs/tiny_cpu.yaml
srun python launch/pretrain.py --config ...      (ranks from SLURM variables)
mpirun -np 2 python launch/pretrain.py --config ...
"""

import os
import signal
import sys


class _EarlySignals:
    """Records SIGUSR1/SIGTERM/SIGINT from the first line on (importing torch takes seconds, and the
    default action would kill the rank); the trainer's SignalFlag adopts ``pending``."""

    def __init__(self) -> None:
        self.pending: list = []

    def __call__(self, signum, frame) -> None:  # noqa: ARG002
        self.pending.append(signum)


_early = _EarlySignals()
for _s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
    signal.signal(_s, _early)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from linformer_ds.train import run_and_exit  # noqa: E402

if __name__ == "__main__":
    run_and_exit()
