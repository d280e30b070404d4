"""How far a warm-started Linformer is from its source (issue 32 item 1): relative error of the
last hidden states and MLM logits against a Hugging Face BERT, and the MLM loss of both on the
same masked rows, at n <= k and at n = 512 (BERT's length); at n = 4096 (no source there) the
converted model's loss on real text.

The source is a small BERT (the data's vocabulary) either as initialised (``random``) or after
``--train-steps`` of MLM on the 512-token data (``trained``). The converted models: dense in
every layer (the exact mapping), and linear layers with E/F from ``model.projection_init``.

python scripts/warm_start_deviation.py --data512 DIR --data4096 DIR --out results.json
(data: data_prep outputs with --seq-len 512 and 4096, the same tokenizer)
"""

import argparse
import json
import math
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from linformer_ds.data.shards import ShardDataset  # noqa: E402
from linformer_ds.model import LinformerForMaskedLM, ModelConfig  # noqa: E402
from linformer_ds.warm_start import load_into, model_section  # noqa: E402

MASK_ID, PAD_ID = 4, 0


def rows(path: str, n: int, count: int, split: str = "valid") -> torch.Tensor:
    """``count`` rows of the split cut to ``n`` tokens: ``[count, n]``."""
    ds = ShardDataset(path, split)
    return torch.stack([ds[i % len(ds)][:n] for i in range(count)])


def masked(ids: torch.Tensor, seed: int) -> "tuple[torch.Tensor, torch.Tensor]":
    """BERT masking of 15 % of the non-pad tokens (all replaced by the mask id)."""
    g = torch.Generator().manual_seed(seed)
    pick = (torch.rand(ids.shape, generator=g) < 0.15) & (ids != PAD_ID)
    labels = torch.where(pick, ids, torch.full_like(ids, -100))
    return torch.where(pick, torch.full_like(ids, MASK_ID), ids), labels


def make_source(vocab: int, hidden: int, layers: int):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 16, intermediate_size=4 * hidden,
        max_position_embeddings=512, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForMaskedLM(cfg)


def train_source(model, data: str, steps: int, batch: int) -> list:
    """MLM on the 512-token rows (AdamW 1e-3, 10 % warm-up); the loss every 50 steps."""
    ds = ShardDataset(data, "train")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (steps / 10)))
    model.train()
    log = []
    for step in range(steps):
        ids = torch.stack([ds[(step * batch + i) % len(ds)] for i in range(batch)])
        inp, labels = masked(ids, step)
        loss = model(input_ids=inp, attention_mask=(ids != PAD_ID).long(), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            log.append((step, round(loss.item(), 4)))
    return log


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def compare(src, ours, ids: torch.Tensor, seed: int) -> dict:
    """Relative errors over the real tokens (the last 3 of each row's 4 padded away in row 1)
    and both MLM losses on the same masks."""
    mask = (ids != PAD_ID).long()
    mask[1, ids.shape[1] * 3 // 4 :] = 0  # one padded row
    inp, labels = masked(ids, seed)
    inp = torch.where(mask.bool(), inp, torch.full_like(inp, PAD_ID))
    labels = torch.where(mask.bool(), labels, torch.full_like(labels, -100))
    with torch.no_grad():
        out = src(input_ids=inp, attention_mask=mask, output_hidden_states=True, labels=labels)
        hidden = ours.encoder(inp, mask)
        logits = ours.lm_head(hidden)
    real = mask.bool()
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           labels.reshape(-1), ignore_index=-100)  # fmt: skip
    return {
        "hidden_rel": rel(hidden[real], out.hidden_states[-1][real]),
        "logits_rel": rel(logits[real], out.logits[real]),
        "loss_source": round(out.loss.item(), 4),
        "loss_ours": round(ce.item(), 4),
    }


# E/F patterns tried here that are not model options (set on the loaded model): slot j takes
# position j alone ("identity": positions >= k feed nothing), or every position p with
# p mod k = j ("strided": their sum; "strided_mean": their mean over N_max / k of them)
EXPERIMENTS = ("identity", "strided", "strided_mean")


def experimental_projection(k: int, n_max: int, kind: str) -> torch.Tensor:
    """``[k, n_max]`` E of the pattern ``kind`` (one of EXPERIMENTS)."""
    pos = torch.arange(n_max)
    if kind == "identity":
        return (pos[None, :] == torch.arange(k)[:, None]).float()
    w = (pos[None, :] % k == torch.arange(k)[:, None]).float()
    return w * k / n_max if kind == "strided_mean" else w


def ours_from(path: str, max_seq_len: int, **linformer) -> LinformerForMaskedLM:
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    experiment = linformer.pop("experiment", None)
    opts = {"max_seq_len": max_seq_len, "dropout": 0.0, "attention_dropout": 0.0, **linformer}
    model = LinformerForMaskedLM(ModelConfig(**model_section(hf, **opts)))
    load_into(model, f"hf:{path}")
    if experiment:
        e = model.encoder.shared_linear.weight  # sharing: layerwise (the default)
        with torch.no_grad():
            e.copy_(experimental_projection(e.shape[1], e.shape[2], experiment)[None])
    return model.eval()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data512", required=True)
    p.add_argument("--data4096", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--train-steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ks", default="64,256")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--keep", help="save the trained source here (and reuse it when present)")
    p.add_argument("--sources", default="random,trained")
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    vocab = ShardDataset(args.data512, "train").vocab_size
    results: dict = {"setup": vars(args), "sources": {}}
    ks = [int(k) for k in args.ks.split(",")]
    t0 = time.time()
    for kind in args.sources.split(","):
        src = make_source(vocab, args.hidden, args.layers)
        entry: dict = {}
        kept = args.keep and os.path.isfile(os.path.join(args.keep, "config.json"))
        if kind == "trained" and kept:
            import transformers

            src = transformers.BertForMaskedLM.from_pretrained(args.keep)
            entry["train_log"] = f"loaded from {args.keep}"
        elif kind == "trained":
            entry["train_log"] = train_source(src, args.data512, args.train_steps, args.batch)
            if args.keep:
                src.save_pretrained(args.keep)
        src.eval()
        with tempfile.TemporaryDirectory() as d:
            src.save_pretrained(d)
            variants = {"dense": dict(projection="dense")}
            for k in ks:
                for init in ("normal", "pooling"):
                    variants[f"linear k={k} {init}"] = dict(projection="linear", k=k,
                                                            projection_init=init)  # fmt: skip
                for ex in EXPERIMENTS:
                    variants[f"linear k={k} {ex}"] = dict(projection="linear", k=k, experiment=ex)
            for name, opts in variants.items():
                model = ours_from(d, 4096, **opts)
                k = opts.get("k")
                lengths = sorted({n for n in (k // 2 if k else None, k, 512) if n})
                for n in lengths:
                    ids = rows(args.data512, n, args.rows)
                    entry[f"{name} n={n}"] = compare(src, model, ids, seed=n)
                long = rows(args.data4096, 4096, 2)
                inp, labels = masked(long, 4096)
                with torch.no_grad():
                    out = model(inp, (long != PAD_ID).long(), labels=labels)
                entry[f"{name} n=4096 loss"] = round(out.loss.item(), 4)
                assert math.isfinite(out.loss.item())
                print(name, {k2: v for k2, v in entry.items() if k2.startswith(name)}, flush=True)
        results["sources"][kind] = entry
    results["seconds"] = round(time.time() - t0, 1)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
