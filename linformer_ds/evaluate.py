"""Validation during pretraining: MLM loss, accuracy and perplexity on a fixed slice."""

import math

import torch
import torch.nn.functional as F

from linformer_ds.config import JobConfig
from linformer_ds.context_meter import UnigramMeter, figures
from linformer_ds.data.masking import MLMMasking
from linformer_ds.data.stream import to_device
from linformer_ds.engine import all_reduce_sum
from linformer_ds.log import get_logger
from linformer_ds.metrics import STAT_CORRECT, STAT_COUNT, STAT_LOSS, step_stats, top1
from linformer_ds.parallel.sharding import shard_batch

log = get_logger(__name__)


@torch.no_grad()
def evaluate(
    engine,
    valid_ds,
    cfg: JobConfig,
    rank: int,
    world: int,
    device,
    sp_group=None,
    unigram: UnigramMeter | None = None,
    document_isolation: bool = False,
) -> dict[str, float]:
    """The same rows and masks at every evaluation (masking seeded by ``train.seed + 1``), and
    the same rows in every layout: ``train.eval_batches`` global batches (``train_batch_size``
    rows each), split over the replicas in micro-batches; the figures are sums over all of
    them divided by the global labelled count.

    ``rank`` / ``world`` are the replica's (data-parallel) rank and count; with a
    sequence-parallel ``sp_group`` every rank of the group evaluates its slice of the rows.

    ``unigram``: the context meter (linformer_ds.context_meter) of the train split, scored on
    the hidden labels (those whose input is the mask token; the 10 % kept unchanged show the
    model its answer, the 10 % replaced a wrong one); adds ``hidden_loss``, ``hidden_accuracy``
    (the model on those labels), ``unigram_loss``, ``unigram_accuracy``, ``context_gain_nats``
    and ``context_gain_accuracy`` to the figures. ``document_isolation``:
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
    stats = torch.zeros(7, dtype=torch.float64, device=device)  # STAT_* + hidden loss, ok, n
    meter = [0.0, 0.0]  # the context-free predictor's summed loss and correct count (host)
    for start in range(0, len(mine), mb):
        idx = mine[start : start + mb]
        tokens = torch.stack([valid_ds[i] for i in idx])
        batch = masker(tokens, torch.tensor(idx), 0)
        if sp_group is not None:
            batch, _ = shard_batch(batch, dist.get_rank(sp_group), dist.get_world_size(sp_group))
        if unigram is not None:  # this rank's hidden labels (its slice under sequence parallelism)
            hidden = hidden_labels(batch["labels"], batch["input_ids"], valid_ds.mask_id)
            meter = [a + b for a, b in zip(meter, unigram.stats(hidden))]
        batch = to_device(batch, device)  # with the labelled positions of this rank's slice
        extra = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
        out = engine(batch["input_ids"], batch["attention_mask"], labels=batch["labels"],
                     labelled_index=batch["labelled_index"], **extra)  # fmt: skip
        stats[:4] += step_stats(out.loss, out.labelled_logits, out.labelled_targets)
        if unigram is not None:
            shown = batch["input_ids"].reshape(-1).index_select(0, batch["labelled_index"])
            stats[4:] += hidden_stats(out.labelled_logits, out.labelled_targets,
                                      shown == valid_ds.mask_id)  # fmt: skip
    engine.train()
    if unigram is not None:
        stats = torch.cat([stats, torch.tensor(meter, dtype=torch.float64, device=device)])
    else:
        stats = stats[:4]
    stats = all_reduce_sum(stats, torch.device(device)).tolist()  # the one read to the host
    loss = stats[STAT_LOSS] / max(stats[STAT_COUNT], 1)
    result = {
        "loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "mlm_accuracy": stats[STAT_CORRECT] / max(stats[STAT_COUNT], 1),
    }
    if unigram is not None:
        n_hidden = max(stats[6], 1.0)
        h_loss, h_acc = stats[4] / n_hidden, stats[5] / n_hidden
        result.update({"hidden_loss": h_loss, "hidden_accuracy": h_acc})
        result.update(figures(stats[7], stats[8], stats[6], h_loss, h_acc))
    if cfg.eval.context_windows:
        result.update(context_figures(engine, valid_ds, cfg, device, unigram, document_isolation))
    return result


def context_figures(engine, valid_ds, cfg: JobConfig, device, unigram, document_isolation: bool
                    ) -> dict[str, float]:  # fmt: skip
    """``eval.context_windows``: the context curve (linformer_ds.context_curve) of the model on
    ``eval.context_rows`` rows of ``valid_ds``, masked as the evaluation masks (seed
    ``train.seed + 1``); every rank computes the same figures (under ZeRO-3 the forward passes
    gather the weights on all ranks alike). Nothing when no document is long enough (said once)."""
    from linformer_ds.context_curve import ContextCurveError, curve, eval_figures

    model = getattr(engine, "module", engine)
    model = getattr(model, "_orig_mod", model)  # (torch.compile)
    try:
        res = curve(model, valid_ds, cfg.eval.context_windows, cfg.eval.context_rows,
                    cfg.train.seed + 1, document_isolation, unigram, device,
                    mlm_probability=cfg.data.mlm_probability)  # fmt: skip
    except ContextCurveError as e:
        if not getattr(valid_ds, "_context_curve_said", False):
            valid_ds._context_curve_said = True
            log.info(f"[eval] eval.context_windows: no context curve: {e}")
        return {}
    return eval_figures(res)


def hidden_labels(labels: torch.Tensor, input_ids: torch.Tensor, mask_id: int) -> torch.Tensor:
    """``labels`` with every position whose input is not ``mask_id`` set to ignored (-100):
    the labels the model has to infer from context."""
    return torch.where(input_ids == mask_id, labels, torch.full_like(labels, -100))


def hidden_stats(logits: torch.Tensor, targets: torch.Tensor, hidden: torch.Tensor
                 ) -> torch.Tensor:  # fmt: skip
    """``[3]`` float64: summed cross-entropy, correct count and count of the labelled positions
    (``logits [M, V]``, ``targets [M]``) flagged ``hidden [M]`` (input was the mask token)."""
    ce = F.cross_entropy(logits.float(), targets, reduction="none")
    h = hidden.to(ce.dtype)
    ok = (top1(logits) == targets).to(ce.dtype)
    return torch.stack([(ce * h).sum(), (ok * h).sum(), h.sum()]).double()
