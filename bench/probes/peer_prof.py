"""Probe (issue 31): ours and lucidrains' equal-work models in one process, forward + backward of
the full-logits loss (no optimizer), interleaved rounds, then one profiled step of each with the
top ops by self CPU time (GEMMs and SDPA left out with --no-gemm).

    python bench/probes/peer_prof.py SHARING N ROUNDS [--no-gemm]
"""

import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.peer_bench import PeerConfig, build, full_logits_loss, our_config  # noqa: E402

sharing, n, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
no_gemm = "--no-gemm" in sys.argv
torch.manual_seed(0)
cfg = our_config(PeerConfig(), n, sharing)
models = {m: build(m, cfg).to(torch.bfloat16) for m in ("ours", "lucidrains")}
ids = torch.randint(5, cfg.vocab_size, (1, n))
labels = torch.where(torch.rand(1, n) < 0.15, ids, torch.full_like(ids, -100))


def step(name: str) -> None:
    m = models[name]
    logits = m(ids).logits if name == "ours" else m(ids)
    full_logits_loss(logits, labels).backward()
    m.zero_grad(set_to_none=True)


times = {m: [] for m in models}
for r in range(rounds):
    for name in list(models) if r % 2 else list(models)[::-1]:
        t = time.perf_counter()
        step(name)
        if r >= 1:  # the first round warms up
            times[name].append(time.perf_counter() - t)
print({k: round(statistics.median(v), 4) for k, v in times.items()}, flush=True)
for name in ("lucidrains", "ours"):
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        step(name)
    rows = sorted(
        ((e.self_cpu_time_total / 1e3, e.key, str(e.input_shapes)[:90], e.count)
         for e in p.key_averages(group_by_input_shape=True)),
        reverse=True,
    )  # fmt: skip
    print(f"== {name}: profiled self total {sum(r[0] for r in rows):.0f} ms")
    keep = [r for r in rows if not (no_gemm and ("mm" in r[1] or "scaled" in r[1]))]
    for r in keep[:14]:
        print(f"{r[0]:8.1f} ms x{r[3]:3d} {r[1]:34s} {r[2]}")
