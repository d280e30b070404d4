"""The pretraining command line and its process: arguments, plugins and the job config, the
process's side of a run (stop signals, the start-up watchdog), the exit codes and the exit itself.
The run is a :class:`~linformer_ds.trainer.Trainer` (linformer_ds/trainer.py), built here with
the process's side and the test hooks the job config asks for.

Run through any launcher (``deepspeed``, ``torchrun``, ``srun``, ``mpirun``)::

    deepspeed launch/pretrain.py --config configs/base_4096.yaml [key=value ...]

Exit codes: 0 done, 2 bad input (one line: ``config error: ...`` or ``error: ...``, any
:class:`~linformer_ds.errors.LinformerError`), 3 non-finite loss (``train.nonfinite=stop``),
75 stopped by a signal (a checkpoint at the next step; during start-up at once).
"""

import argparse
import gc
import json
import os
import signal
import sys

import torch

from linformer_ds.config import ConfigError, JobConfig, load_config, to_yaml
from linformer_ds.cpu_threads import wait_policy_restart
from linformer_ds.data.stages import Stage, resolve_stages
from linformer_ds.dist_env import setup_distributed_env
from linformer_ds.engine import final_deepspeed_config
from linformer_ds.errors import LinformerError
from linformer_ds.log import get_logger, setup_logging
from linformer_ds.plugins import import_plugins
from linformer_ds.resolve import resolve
from linformer_ds.testing import trainer_hooks
from linformer_ds.trainer import EXIT_NONFINITE, EXIT_PREEMPTED, Process, Trainer
from linformer_ds.watchdog import disarm_watchdog, start_watchdog

EXIT_BAD_INPUT = 2  # a LinformerError: bad config, data, paths or environment (one line)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Pretrain a Linformer encoder with DeepSpeed.",
        epilog="Overrides: key=value pairs, e.g. train.max_steps=100 model.k=128",
    )
    p.add_argument("--config", help="YAML job config (see configs/)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE (a dotted name or a .py file) on every rank before the config is "
        "read: it registers sinks, source or projection kinds (docs/extending.md); repeatable",
    )
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    # intermixed: overrides before, between and after the options (``--plugin M a=1 b=2``)
    return p.parse_intermixed_args(argv)


log = get_logger(__name__)


# Signals that stop a run with a checkpoint at the next step (exit 75): a scheduler's notice
# (SIGUSR1), SIGTERM, and Ctrl-C (SIGINT: a KeyboardInterrupt would lose the steps since the
# last save).
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


class SignalFlag:
    """Records SIGUSR1/SIGTERM/SIGINT; the loop checks it at step boundaries (all ranks agree)."""

    def __init__(self, enabled: bool):
        # (before this, launch/pretrain.py's handler ends the process at once: exit 75)
        self.signum: int | None = None
        for s in STOP_SIGNALS:
            signal.signal(s, self._handle if enabled else signal.SIG_DFL)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        self.signum = signum


def start_process(cfg: JobConfig) -> Process:
    """The process's side of a run (:class:`~linformer_ds.trainer.Process`), made by the Trainer
    once the versions are checked: the stop signals' handler first (a preemption notice is never
    lost), the launcher's ranks, then the start-up watchdog: start-up waits end on a signal at
    once (one recorded before too: under SLURM another rank may be gone, no step could run),
    and a rank leaves when its launcher dies."""
    flag = SignalFlag(cfg.train.save_on_signal)
    env = setup_distributed_env()
    watchdog = start_watchdog(
        EXIT_PREEMPTED,
        env["launcher"] != "single",
        cfg.parallel.init_timeout_s,
        pending=lambda: flag.signum,
    )
    watchdog.pause_at = cfg.debug.pause_at  # a test instrument
    return Process(env, lambda: flag.signum, watchdog)


def start_trainer(cfg: JobConfig, stages: list[Stage] | None = None) -> Trainer:
    """The Trainer as the command line runs it: with the process's side (:func:`start_process`)
    and the test hooks the job config's ``debug.*`` keys ask for.

    A process that paused the cyclic garbage collector for its start-up (launch/pretrain.py
    does, before importing torch) gets it back here: one collection of the start-up's garbage,
    what is left frozen (it lives as long as the process: the collector does not scan it
    again), the collector on. A caller with the collector on keeps it as it was."""
    trainer = Trainer(cfg, stages, start_process=start_process, hooks=trainer_hooks(cfg))
    if not gc.isenabled():
        gc.collect()
        gc.freeze()
        gc.enable()
    return trainer


# ========================================================================================= main
def main(argv: list[str] | None = None, restart: bool = False) -> int:
    """Run a job; returns the process exit code. Bad input exits 2 with a one-line reason.
    ``restart``: the process may restart itself once for an explicit ``train.omp_wait_policy``
    (the command-line entry point; see linformer_ds.cpu_threads). Otherwise (a caller in its
    own process: a notebook, a test) the process gets its signal handling back on return: the
    handlers of SIGUSR1/SIGTERM/SIGINT as they were, and the start-up watchdog disarmed (a
    Ctrl-C after a failed start ended the caller's process with exit 75)."""

    saved = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    try:
        setup_logging()  # the one console handler; LINFORMER_DS_LOG_LEVEL
        return _main(argv, restart)
    except LinformerError as e:  # bad input of any kind: one line
        prefix = "config error" if isinstance(e, ConfigError) else "error"
        log.error(f"{prefix}: {e}")
        return EXIT_BAD_INPUT
    finally:
        if not restart:
            disarm_watchdog()
            for s, handler in saved.items():
                if handler is not None:  # None: not installed from Python, nothing to restore
                    signal.signal(s, handler)


def run_and_exit(argv: list[str] | None = None) -> None:
    """The command-line entry point: :func:`main`, then leave the process without teardown.

    After a clean end (done, preempted, non-finite stop: every rank got there) the ranks meet
    at a barrier and leave through ``os._exit``. A normal interpreter exit (or
    ``destroy_process_group``) after ZeRO-3 runs destroys gloo's process group while its
    threads are still live and aborts the process ("terminate called without an active
    exception", exit 250, in some 2-rank ZeRO-3 runs) after all work was done.
    Everything this trainer writes is closed and flushed before main returns.
    """
    code = main(argv, restart=True)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        if code in (0, EXIT_PREEMPTED, EXIT_NONFINITE):
            dist.barrier()  # every rank got here: leave together
        # An error after the process group started (exit 2 from one or all ranks) takes the
        # same exit: no barrier (the other ranks may not come), no gloo teardown abort (250).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def print_config(cfg: JobConfig) -> int:
    """``--print-config``: the resolved job config and the DeepSpeed JSON derived from it."""

    setup_distributed_env()
    world = int(os.environ["WORLD_SIZE"])
    cfg = resolve(cfg, world)  # N unknown here: model.max_seq_len
    rank0 = int(os.environ["RANK"]) == 0  # the command's result: stdout, whatever the log level
    if rank0:
        print(to_yaml(cfg), flush=True)
    ds = final_deepspeed_config(cfg, world)
    if rank0:
        print("# derived DeepSpeed config\n" + json.dumps(ds, indent=2), flush=True)
    return 0


def _main(argv: list[str] | None = None, restart: bool = False) -> int:
    args = parse_args(argv)
    import_plugins(args.plugin)  # what they register is there when the config names it
    cfg = load_config(args.config, args.overrides)
    if restart:  # OpenMP reads its wait policy only when torch loads: once, before any work
        wait_policy_restart(cfg.train.omp_wait_policy)
    stages = resolve_stages(cfg)  # checked before any work (--print-config), resolved once
    if args.print_config:
        return print_config(cfg)
    trainer = start_trainer(cfg, stages)
    try:
        return trainer.train()
    finally:
        trainer.close()


if __name__ == "__main__":
    run_and_exit()
