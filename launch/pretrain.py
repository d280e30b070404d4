"""Pretrain a Linformer encoder with DeepSpeed.

deepspeed launch/pretrain.py --config configs/base_4096.yaml [key=value ...]
torchrun --nproc_per_node 2 launch/pretrain.py --config configs/tiny_cpu.yaml
srun python launch/pretrain.py --config ...      (ranks from SLURM variables)
mpirun -np 2 python launch/pretrain.py --config ...
"""

import gc
import os
import signal
import sys

# Start-up without the cyclic garbage collector: importing torch, DeepSpeed and dynamo allocates
# hundreds of thousands of long-lived objects and little garbage, and the collector's passes
# over them took 0.6 of a tiny one-rank run's 3.6 CPU-s (BENCHMARKS.md). start_trainer
# (linformer_ds.train) turns it back on once the trainer is built.
gc.disable()


class _EarlySignals:
    """SIGINT/SIGTERM/SIGUSR1 from the first line on (importing torch takes seconds): until the
    trainer installs its own handler nothing is written, so the process ends at once, exit 75
    (EX_TEMPFAIL: the last checkpoint is current) with one line. Under SLURM a signal kept for
    a step-1 checkpoint made a rank wait for the cluster's KillWait when another one was gone."""

    def __call__(self, signum, frame) -> None:  # noqa: ARG002
        env = os.environ
        rank = next((env[v] for v in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
                     if v in env), "0")  # fmt: skip
        os.write(2, f"error: rank {rank}: {signal.Signals(signum).name} during start-up "
                    "(received before it began): stopped before the first step (the last "
                    "checkpoint is current)\n".encode())  # fmt: skip
        os._exit(75)  # linformer_ds.trainer.EXIT_PREEMPTED (not imported yet)


_early = _EarlySignals()
for _s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):  # SIGUSR1's handler last: all are set
    signal.signal(_s, _early)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# OpenMP reads OMP_WAIT_POLICY only when torch loads: decided here, before (torch-free module)
from linformer_ds.cpu_threads import prepare_openmp  # noqa: E402

prepare_openmp()

from linformer_ds.train import run_and_exit  # noqa: E402

if __name__ == "__main__":
    run_and_exit()
