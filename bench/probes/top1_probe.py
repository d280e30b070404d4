"""Why ``linformer_ds.metrics.top1`` is ``max(-1).indices`` and not ``argmax(-1)``.

``python -m bench.probes.top1_probe``: one thread, thread CPU time, best of 3 rounds of 10, over a
``[M, 8000]`` block of logits (M: the labelled positions of one micro-batch of the English
recipe, 40 % of 2,048 tokens, and of a 4,096-token row batch), bf16 and fp32: ``argmax``,
``max().indices`` and the cross-entropy the trainer takes beside them. Prints milliseconds.
"""

import time

import torch


def best_ms(f, reps: int = 10, rounds: int = 3) -> float:
    f()
    best = float("inf")
    for _ in range(rounds):
        t = time.thread_time()
        for _ in range(reps):
            f()
        best = min(best, (time.thread_time() - t) / reps * 1e3)
    return best


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for m in (820, 3300):
            x = torch.randn(m, 8000, generator=g).to(dtype)
            t = torch.randint(0, 8000, (m,), generator=g)
            assert torch.equal(x.argmax(-1), x.max(-1).indices)
            a = best_ms(lambda x=x: x.argmax(-1))
            b = best_ms(lambda x=x: x.max(-1).indices)
            ce = best_ms(lambda x=x, t=t: torch.nn.functional.cross_entropy(x, t))
            print(
                f"{str(dtype):15s} M={m:5d}  argmax {a:7.2f} ms  max().indices {b:7.2f} ms "
                f"({a / b:.1f}x)  cross_entropy {ce:7.2f} ms"
            )


if __name__ == "__main__":
    main()
