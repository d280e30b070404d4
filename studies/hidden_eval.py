"""The context meter, re-scored from outside the trainer on exported models: MLM cross-entropy
per kind of label (hidden: input <mask>; random: input a wrong token; kept: input the answer)
beside the unigram (context-free) cross-entropy of the same labels, on the first rows of a
data_prep output's valid split, with the trainer's masking (``MLMMasking``, seed 1 unless given).

    python studies/hidden_eval.py --data DATA_DIR [--rows 64] [--isolated] EXPORT [EXPORT ...]

``--isolated``: position_ids restart after every ``</s>`` (document isolation, as the trainer
evaluates an isolated run). Prints one line per export and kind; ``--json FILE`` writes them.
The gain on the hidden labels is what the trainer's ``context_gain_nats`` now reports; the gain
over every label (``all``) is what it reported until 2026-12-01.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linformer_ds.context_meter import UnigramMeter  # noqa: E402
from linformer_ds.data.masking import MLMMasking
from linformer_ds.data.shards import ShardDataset  # noqa: E402
from linformer_ds.loss import IGNORE_INDEX  # noqa: E402

KINDS = ("hidden", "random", "kept", "all")


def score(path: str, data: str, rows: int, isolated: bool, seed: int) -> dict:
    """``{kind: {"n", "model", "unigram", "gain"}}`` of one export."""
    from transformers import AutoModelForMaskedLM

    valid, train = ShardDataset(data, "valid"), ShardDataset(data, "train")
    meter = UnigramMeter.for_dataset(train, None, write_cache=False)
    masker = MLMMasking(
        valid.vocab_size,
        valid.mask_id,
        valid.special_ids,
        seed=seed,
        pad_id=valid.pad_id,
        document_sep_id=valid.sep_id if isolated else None,
    )
    n = min(rows, len(valid))
    tokens = torch.stack([valid[i] for i in range(n)])
    batch = masker(tokens, torch.arange(n), 0)
    model = AutoModelForMaskedLM.from_pretrained(path, trust_remote_code=True).eval()
    losses = []
    with torch.no_grad():
        for i in range(0, n, 4):
            kw = {"attention_mask": batch["attention_mask"][i : i + 4]}
            if isolated:
                kw["position_ids"] = batch["position_ids"][i : i + 4]
            logits = model(input_ids=batch["input_ids"][i : i + 4], **kw).logits.float()
            losses.append(torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), tokens[i : i + 4], reduction="none"))  # fmt: skip
    loss = torch.cat(losses)
    labelled = batch["labels"] != IGNORE_INDEX
    shown = batch["input_ids"]
    kinds = {
        "hidden": labelled & (shown == valid.mask_id),
        "random": labelled & (shown != valid.mask_id) & (shown != tokens),
        "kept": labelled & (shown == tokens),
        "all": labelled,
    }
    uni = torch.from_numpy(-meter.log_prob)[tokens.clamp(max=len(meter.log_prob) - 1)]
    out = {}
    for k in KINDS:
        m = kinds[k]
        mod, u = float(loss[m].mean()), float(uni[m].mean())
        out[k] = {"n": int(m.sum()), "model": mod, "unigram": u, "gain": u - mod}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("exports", nargs="+")
    ap.add_argument("--data", required=True)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--isolated", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    results = {}
    for path in args.exports:
        r = score(path, args.data, args.rows, args.isolated, args.seed)
        results[path] = r
        for k in KINDS:
            v = r[k]
            print(f"{Path(path).name} {k:6s} n={v['n']:6d} model={v['model']:.4f} "
                  f"unigram={v['unigram']:.4f} gain={v['gain']:+.4f}", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
