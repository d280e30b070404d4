"""Validation during pretraining: MLM loss, accuracy and perplexity on a fixed slice."""

import math
from typing import Dict, Optional

import torch

from linformer_ds.config import JobConfig
from linformer_ds.context_meter import UnigramMeter, figures
from linformer_ds.data.masking import MLMMasking
from linformer_ds.data.stream import to_device
from linformer_ds.engine import all_reduce_sum
from linformer_ds.metrics import STAT_CORRECT, STAT_COUNT, STAT_LOSS, step_stats
from linformer_ds.sequence_parallel import shard_batch


@torch.no_grad()
def evaluate(
    engine, valid_ds, cfg: JobConfig, rank: int, world: int, device, sp_group=None,
    unigram: Optional[UnigramMeter] = None,
    document_isolation: bool = False,
) -> Dict[str, float]:
    """The same rows and masks at every evaluation (masking seeded by ``train.seed + 1``), and
    the same rows in every layout: ``train.eval_batches`` global batches (``train_batch_size``
    rows each), split over the replicas in micro-batches; the figures are sums over all of
    them divided by the global labelled count.

    ``rank`` / ``world`` are the replica's (data-parallel) rank and count; with a
    sequence-parallel ``sp_group`` every rank of the group evaluates its slice of the rows.

    ``unigram``: the context meter (linformer_ds.context_meter) of the train split, scored on
    exactly the labels the model is scored on; adds ``unigram_loss``, ``unigram_accuracy``,
    ``context_gain_nats`` and ``context_gain_accuracy`` to the figures. ``document_isolation``:
    the rows' documents are isolated (``position_ids`` restarting after every sep), as in
    training."""
    import deepspeed.comm as dist


    masker = MLMMasking(
        valid_ds.vocab_size,
        valid_ds.mask_id,
        valid_ds.special_ids,
        mlm_probability=cfg.data.mlm_probability,
        seed=cfg.train.seed + 1,
        pad_id=valid_ds.pad_id,
        document_sep_id=valid_ds.sep_id if document_isolation else None,
    )
    mb = cfg.train.micro_batch_size
    global_batch = mb * cfg.train.gradient_accumulation_steps * world
    n_rows = min(len(valid_ds), cfg.train.eval_batches * global_batch)
    mine = list(range(rank, n_rows - (n_rows % world), world))
    engine.eval()
    stats = torch.zeros(4, dtype=torch.float64, device=device)
    meter = [0.0, 0.0]  # the context-free predictor's summed loss and correct count (host)
    for start in range(0, len(mine), mb):
        idx = mine[start : start + mb]
        tokens = torch.stack([valid_ds[i] for i in idx])
        batch = masker(tokens, torch.tensor(idx), 0)
        if sp_group is not None:
            batch, _ = shard_batch(batch, dist.get_rank(sp_group), dist.get_world_size(sp_group))
        if unigram is not None:  # this rank's labels (its slice under sequence parallelism)
            meter = [a + b for a, b in zip(meter, unigram.stats(batch["labels"]))]
        batch = to_device(batch, device)  # with the labelled positions of this rank's slice
        extra = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
        out = engine(batch["input_ids"], batch["attention_mask"], labels=batch["labels"],
                     labelled_index=batch["labelled_index"], **extra)  # fmt: skip
        stats += step_stats(out.loss, out.labelled_logits, out.labelled_targets)
    engine.train()
    if unigram is not None:
        stats = torch.cat([stats, torch.tensor(meter, dtype=torch.float64, device=device)])
    stats = all_reduce_sum(stats, torch.device(device)).tolist()  # the one read to the host
    loss = stats[STAT_LOSS] / max(stats[STAT_COUNT], 1)
    result = {
        "loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "mlm_accuracy": stats[STAT_CORRECT] / max(stats[STAT_COUNT], 1),
    }
    if unigram is not None:
        result.update(figures(stats[4], stats[5], stats[STAT_COUNT], loss, result["mlm_accuracy"]))
    return result
