"""Quality sweeps: train a grid of pretraining runs from one YAML and report validation quality.

A sweep file names a base job config, overrides shared by every run, named variants (override
sets such as ``dense = [model.projection=dense]``) and one or more grids (variant x N x k x
learning rate x seed). Every grid point runs the real trainer (``launch/pretrain.py``) as its
own process, in sequence here or as one task of a SLURM job array, and leaves
``<out>/runs/<point id>/{metrics.jsonl, tensorboard/, train.log, result.json}``. The report
(``report.md``, ``results.json``, ``results.csv`` and PNG plots) is built from the
``result.json`` files, so it can be rebuilt at any time and points that finished are skipped
on a rerun.

Divergence: a run is marked ``diverged`` (and the sweep goes on) when the trainer exits with
``EXIT_NONFINITE``, when any logged loss is non-finite, when a loss exceeds
``divergence.max_loss``, or when the last validation loss is more than ``divergence.max_rise``
nats above the best one. Other non-zero exits are ``failed`` and rerun on the next invocation.

Data: every sequence length N needs a data_prep output with ``--seq-len N``; they are built on
demand under ``data.cache_dir`` and share one SentencePiece tokenizer (``--tokenizer``), or
``data.path`` names a prebuilt output; a variant's ``data_path`` replaces it for that variant
(e.g. ``--packing pad`` data beside ``full``).

The parts: ``config`` (the sweep file), ``data`` (shards per N, unigram reference), ``runs``
(one trainer process per point, classification), ``slurm`` (the job array), ``report`` and
``plots`` (rebuilt from result.json files), ``inference`` (encoder forward timing).
"""

from studies.sweep.config import (
    FINISHED,
    REPO,
    SWEEP_CLI,
    DataSpec,
    Grid,
    Point,
    SweepConfig,
    SweepError,
    Variant,
    load_sweep,
    point_id,
)
from studies.sweep.data import data_dir, ensure_data, prebuilt_data, unigram_perplexity
from studies.sweep.inference import inference_table, time_inference
from studies.sweep.report import display_path, write_report
from studies.sweep.runs import classify, collect, point_overrides, run_dir, run_point, run_sweep
from studies.sweep.slurm import slurm_script, write_slurm

__all__ = [
    "FINISHED",
    "REPO",
    "SWEEP_CLI",
    "DataSpec",
    "Grid",
    "Point",
    "SweepConfig",
    "SweepError",
    "Variant",
    "classify",
    "collect",
    "data_dir",
    "display_path",
    "ensure_data",
    "inference_table",
    "load_sweep",
    "point_id",
    "point_overrides",
    "prebuilt_data",
    "run_dir",
    "run_point",
    "run_sweep",
    "slurm_script",
    "time_inference",
    "unigram_perplexity",
    "write_report",
    "write_slurm",
]
