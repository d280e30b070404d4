"""The N = 128 attempts of docs/capability.md ("Making dense solve the probe"), dense alone on
the old base (4 heads, init std 0.02, rotary base 10,000) plus each attempt's model options:

    python studies/capability/solve_attempts/quick.py N STEPS ITEMS 'LABEL;LR;FILLER;MODEL_JSON[;TASK]' ...

e.g. ``quick.py 128 300 8 'h1;3e-3;1;{"num_heads":1,"rope_base":1e8,"initializer_range":0.1}'``
(quickA-G.log: what it printed; 32 held-out rows, seed 0, batch 16, no curriculum)."""

import json
import sys
import time

import torch

from linformer_ds.capability.probe import parse_kinds, run_probe
from linformer_ds.capability.tasks import Vocab

OLD_BASE = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 256,
            "dropout": 0.0, "attention_dropout": 0.0, "k": 128, "sharing": "layerwise",
            "positions": "rope", "rope_base": 10000.0, "initializer_range": 0.02,
            "local_mixer": "layers"}  # fmt: skip

if __name__ == "__main__":
    torch.set_num_threads(1)
    n, steps, items = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    for spec in sys.argv[4:]:
        label, lr, filler, model, task = (spec.split(";") + ["induction"])[:5]
        t = time.time()
        res = run_probe(parse_kinds("dense"), [task], [n], steps, 16, float(lr), 0, 32,
                        {**OLD_BASE, **json.loads(model)}, Vocab(32, 16, int(filler)), items,
                        16, None, curriculum=0.0)  # fmt: skip
        r = res["runs"][0]
        print(label, f"acc {r['accuracy']:.3f} bag {r['bag_accuracy']:.3f}",
              f"loss {r['final_train_loss']:.3f}",
              " ".join(f"{b['from']}:{b['accuracy']:.2f}" for b in r["buckets"]),
              f"{time.time() - t:.0f}s", flush=True)  # fmt: skip
