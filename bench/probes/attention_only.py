"""Probe (issue 31): the pre-LN attention block alone, ours vs lucidrains, at equal work.

x + attention(LayerNorm(x)) forward + backward in bf16, x [1, N, 768], 12 heads, k 256, for
ours (``EncoderLayer.attention_block`` of ``bench.peer_bench.build('ours', ...)``) and
lucidrains (``PreNorm(LinformerSelfAttention)`` of ``LucidrainsMLM``, E/F tied as peer_bench
ties them), the blocks taken from the very models peer_bench times. The rest of a layer
(FFN, LayerNorms outside the block, embeddings, head, loss, optimizer) is the same code in both
models, so this is where any equal-work difference between them lives.
Run: python bench/probes/attention_only.py [N ...]; median of 7 interleaved
rounds after 2 warm-ups; prints JSON lines.
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.peer_bench import PeerConfig, build, our_config  # noqa: E402

torch.manual_seed(0)
ROUNDS, WARMUP = 7, 2
for n in [int(a) for a in sys.argv[1:]] or [4096, 16384]:
    for sharing in ("headwise", "layerwise"):
        cfg = our_config(PeerConfig(), n, sharing)
        ours = build("ours", cfg).to(torch.bfloat16)
        luc = build("lucidrains", cfg).to(torch.bfloat16)
        layer = ours.encoder.layers[0]
        shared = ours.encoder.shared_linear
        theirs = luc.body.net.layers[0][0]  # PreNorm(LinformerSelfAttention)
        blocks = {
            "ours": lambda x, a=layer, s=shared: a.attention_block(x, None, s, None, None),
            "lucidrains": lambda x, a=theirs: x + a(x),
        }
        x = torch.randn(1, n, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(1, n, cfg.hidden_size, dtype=torch.bfloat16)
        times = {k: [] for k in blocks}
        for r in range(WARMUP + ROUNDS):
            for name in list(blocks)[:: 1 if r % 2 else -1]:
                t0 = time.perf_counter()
                blocks[name](x).backward(g)
                dt = time.perf_counter() - t0
                if r >= WARMUP:
                    times[name].append(dt)
        ratios = [lu / o for lu, o in zip(times["lucidrains"], times["ours"])]
        print(
            json.dumps(
                {
                    "n": n,
                    "sharing": sharing,
                    "ours_s": round(statistics.median(times["ours"]), 4),
                    "lucidrains_s": round(statistics.median(times["lucidrains"]), 4),
                    "ours_vs_lucidrains": round(statistics.median(ratios), 3),
                }
            ),
            flush=True,
        )
        del ours, luc, layer, theirs, blocks
