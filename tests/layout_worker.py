"""One rank of tests/test_layout_invariance.py: train several layouts of the same job, one after
the other, in one process group (the launch and imports are paid once per world size).

    python tests/layout_worker.py SPEC.json      (RANK, WORLD_SIZE, MASTER_* set per rank)

SPEC: ``{"out": DIR, "runs": [{"name": ..., "overrides": [...]}, ...]}``. Each run trains
through the real :class:`linformer_ds.trainer.Trainer`, built as the command line builds it
(:func:`linformer_ds.train.start_trainer`), with ``logging.dir = DIR/name`` (its
metrics.jsonl holds the per-step loss and grad norm; its output follows a line
``[layout_worker] run NAME``); rank 0 then writes the whole final
parameters to ``DIR/name/params.pt`` (gathered from ZeRO-3 partitions and sequence shards).
A run with ``"perturb_frozen": true`` builds its model with every frozen parameter 1.0 off its
initial value (as if the initialisation had changed): a resume must restore the saved ones.
A run with ``"zero3_holdings": true`` prints, once its trainer is built, what each rank holds of
the shared projections (``[zero3] rank R holds n/N of NAME``).
"""

import gc
import json
import os
import sys

gc.disable()  # as launch/pretrain.py: the start-up without the collector (start_trainer)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from linformer_ds import engine as eng  # noqa: E402
from linformer_ds.config import load_config  # noqa: E402
from linformer_ds.train import start_trainer  # noqa: E402
from linformer_ds.trainer import Trainer  # noqa: E402
from tests.pretrain_utils import RUN_MARK, TEST_OVERRIDES, TINY_CONFIG  # noqa: E402

BUILD_MODEL = eng.build_model


def full_parameters(trainer: Trainer) -> dict:
    """Every parameter whole, on every rank (collective): ZeRO-3 partitions gathered, and
    sequence-sharded parameters (if any) gathered over the sequence-parallel group."""
    import deepspeed

    model = trainer.engine.module
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=trainer.cfg.deepspeed.zero.stage == 3):
        if trainer.sp_group is not None:
            from linformer_ds.parallel.sharding import full_state_dict

            sd = full_state_dict(model, trainer.sp_group)
        else:
            sd = model.state_dict()
        names = {n for n, _ in model.named_parameters()}
        return {k: v.detach().clone().float() for k, v in sd.items() if k in names}


def perturbed_frozen(cfg):
    """``engine.build_model`` with every frozen parameter moved by 1.0."""
    model = BUILD_MODEL(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad:
                p.add_(1.0)
    return model


def print_zero3_holdings(trainer: Trainer) -> None:
    """One line per rank, ``[zero3] rank R holds n/N of NAME``, for each shared projection:
    what tests/test_train.py checks of ZeRO-3's partitioning."""
    for name, p in trainer.model.named_parameters():
        if name.startswith("encoder.shared_"):
            held = f"{p.ds_tensor.numel()}/{p.ds_numel}"
            print(f"[zero3] rank {trainer.rank} holds {held} of {name}", flush=True)


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    for run in spec["runs"]:
        run_dir = os.path.join(spec["out"], run["name"])
        print(f"{RUN_MARK}{run['name']}", flush=True)  # where this run's output starts
        overrides = TEST_OVERRIDES + [f"logging.dir={run_dir}"] + run["overrides"]
        eng.build_model = perturbed_frozen if run.get("perturb_frozen") else BUILD_MODEL
        trainer = start_trainer(load_config(TINY_CONFIG, overrides))
        if run.get("zero3_holdings"):
            print_zero3_holdings(trainer)
        try:
            code = trainer.train()
            params = full_parameters(trainer)
        finally:
            trainer.close()
        if code != 0:
            raise SystemExit(f"{run['name']}: exit {code}")
        if trainer.rank == 0:
            torch.save(params, os.path.join(run_dir, "params.pt"))
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)  # no gloo teardown after ZeRO-3 (see linformer_ds.train.run_and_exit)


if __name__ == "__main__":
    main(sys.argv[1])
