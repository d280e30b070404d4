import sys, time, json
import torch
torch.set_num_threads(1)
from linformer_ds.capability.probe import run_probe, parse_kinds
from linformer_ds.capability.tasks import Vocab
n, steps, items = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
for spec in sys.argv[4:]:
    # spec: label;lr;filler;model-json
    label, lr, filler, model, task = (spec.split(";") + ["induction"])[:5]
    t=time.time()
    res = run_probe(parse_kinds("dense"), [task], [n], steps, 16, float(lr), 0, 32,
                    json.loads(model), Vocab(32, 16, int(filler)), items, 16, None)
    r = res["runs"][0]
    print(label, f"acc {r['accuracy']:.3f} bag {r['bag_accuracy']:.3f} loss {r['final_train_loss']:.3f}",
          " ".join(f"{b['from']}:{b['accuracy']:.2f}" for b in r["buckets"]), f"{time.time()-t:.0f}s", flush=True)
