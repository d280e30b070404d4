"""An independent learning-rate reference for the English recipe: Hugging Face
``BertForMaskedLM`` of the english_cpu size trained on the same data_prep rows with its own
masking (15 %, 80/10/10) and the recipe's optimizer settings (AdamW, betas 0.9/0.98, weight
decay 0.01 off biases and LayerNorms, clipping 1.0, linear warm-up then linear decay, bf16
autocast); every 100 steps the masked-token loss on the first 64 validation rows beside the
unigram cross-entropy of the same positions (the train split's counts), i.e. the context gain.

    python studies/hf_bert_reference.py --data data/english/data --steps 300 --rows 8
"""

import argparse
import time

import numpy as np
import torch
from transformers import BertConfig, BertForMaskedLM

MASK, FIRST_REGULAR = 4, 5  # data_prep's fixed ids: <mask> = 4, ids below 5 are special


def mask_rows(x: torch.Tensor, vocab: int, g: torch.Generator):
    """BERT masking of ``x [B, N]``: ``(inputs, labels)`` with -100 where not predicted."""
    x = x.clone()
    labels = torch.full_like(x, -100)
    chosen = (torch.rand(x.shape, generator=g) < 0.15) & (x >= FIRST_REGULAR)
    labels[chosen] = x[chosen]
    r = torch.rand(x.shape, generator=g)
    x[chosen & (r < 0.8)] = MASK
    rnd = chosen & (r >= 0.8) & (r < 0.9)
    x[rnd] = torch.randint(FIRST_REGULAR, vocab, x.shape, generator=g)[rnd]
    return x, labels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="data/english/data")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rows", type=int, default=8, help="rows a step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--vocab", type=int, default=8000)
    args = ap.parse_args()
    torch.manual_seed(0)
    train = np.load(f"{args.data}/train/shard_00000.npy").astype(np.int64)
    valid = np.load(f"{args.data}/valid/shard_00000.npy").astype(np.int64)[:64]
    cfg = BertConfig(
        vocab_size=args.vocab, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=1024, max_position_embeddings=train.shape[1], hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, type_vocab_size=1, pad_token_id=0,
    )  # fmt: skip
    model = BertForMaskedLM(cfg)
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
    decay = [p for n, p in model.named_parameters() if not (n.endswith("bias") or "LayerNorm" in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.98), eps=1e-8,
    )  # fmt: skip
    steps, warm = args.steps, args.warmup
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, max(0.0, (steps - s) / max(1, steps - warm)))
    )
    vx, vl = mask_rows(torch.from_numpy(valid), args.vocab, torch.Generator().manual_seed(123))
    counts = np.load(f"{args.data}/unigram_counts.npy").astype(np.float64)
    p = counts / counts.sum()
    unigram = float(-np.log(np.maximum(p[vl[vl >= 0].numpy()], 1e-12)).mean())

    def evaluate() -> float:
        model.eval()
        total = n = 0.0
        with torch.no_grad():
            for i in range(0, len(vx), 8):
                out = model(input_ids=vx[i : i + 8], labels=vl[i : i + 8])
                k = int((vl[i : i + 8] >= 0).sum())
                total, n = total + out.loss.item() * k, n + k
        model.train()
        return total / n

    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(train), generator=g)
    t0 = time.time()
    for s in range(steps):
        rows = torch.from_numpy(train[order[s * args.rows : (s + 1) * args.rows].numpy()])
        x, y = mask_rows(rows, args.vocab, g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if (s + 1) % 100 == 0:
            e = evaluate()
            print(f"step {s + 1} train {loss.item():.3f} eval {e:.4f} unigram {unigram:.4f} "
                  f"gain {unigram - e:.4f} {time.time() - t0:.0f}s", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
