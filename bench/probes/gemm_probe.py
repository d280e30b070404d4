"""Time each GEMM of the trainer step at N=4096 (bf16), forward + both backward products,
and SDPA vs explicit math for the Linformer attention shape. Prints ms and TFLOP/s."""

import time

import torch
import torch.nn.functional as F

torch.manual_seed(0)
bf = torch.bfloat16
N, D, K, V, L, FF, H = 4096, 768, 256, 16000, 614, 3072, 12


def t(fn, it=7):
    fn()
    fn()
    ts = []
    for _ in range(it):
        s = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - s)
    ts.sort()
    return ts[len(ts) // 2]


def mm_case(name, m, k, n, strided=False):
    a = torch.randn(m, k, dtype=bf)
    b = torch.randn(k, n, dtype=bf)
    g = torch.randn(m, n, dtype=bf)
    f = t(lambda: a @ b)
    # backward: dA = g @ b^T, dB = a^T @ g
    da = t(lambda: g @ b.t())
    db = t(lambda: a.t() @ g)
    fl = 2 * m * k * n
    print(
        f"{name:28s} fwd {f * 1e3:7.2f} ms {fl / f / 1e12:5.3f} | dA {da * 1e3:7.2f} {fl / da / 1e12:5.3f} | dB {db * 1e3:7.2f} {fl / db / 1e12:5.3f} TF/s",
        flush=True,
    )
    return f + da + db


def linear_case(name, m, k, n):
    x = torch.randn(m, k, dtype=bf, requires_grad=True)
    w = torch.randn(n, k, dtype=bf, requires_grad=True)
    bias = torch.randn(n, dtype=bf, requires_grad=True)
    g = torch.randn(m, n, dtype=bf)

    def step():
        y = F.linear(x, w, bias)
        y.backward(g)

    s = t(step)
    fl = 6 * m * k * n
    print(f"{name:28s} linear fwd+bwd {s * 1e3:7.2f} ms {fl / s / 1e12:5.3f} TF/s", flush=True)
    return s


tot = 0
tot += 2 * linear_case("qkv 4096x768x2304", N, D, 3 * D)
tot += 2 * linear_case("out 4096x768x768", N, D, D)
tot += 2 * linear_case("ffn up 4096x768x3072", N, D, FF)
tot += 2 * linear_case("ffn down 4096x3072x768", N, FF, D)
tot += linear_case("head dense 614x768x768", L, D, D)
tot += linear_case("decoder 614x768x16000", L, D, V)
# E projection: E[256,4096] @ kv[4096,1536] where kv is a strided view of qkv
qkv = torch.randn(N, 3 * D, dtype=bf, requires_grad=True)
E = torch.randn(K, N, dtype=bf, requires_grad=True)
gp = torch.randn(K, 2 * D, dtype=bf)


def eproj():
    y = torch.mm(E, qkv[:, D:])
    y.backward(gp)


s = t(eproj)
fl = 6 * K * N * 2 * D
print(
    f"{'E proj strided 256x4096x1536':28s} fwd+bwd {s * 1e3:7.2f} ms {fl / s / 1e12:5.3f} TF/s",
    flush=True,
)
kvc = torch.randn(N, 2 * D, dtype=bf, requires_grad=True)


def eproj2():
    y = torch.mm(E, kvc)
    y.backward(gp)


s2 = t(eproj2)
print(
    f"{'E proj contiguous':28s} fwd+bwd {s2 * 1e3:7.2f} ms {fl / s2 / 1e12:5.3f} TF/s", flush=True
)
tot += 2 * s
# attention
q = torch.randn(1, H, N, 64, dtype=bf, requires_grad=True)
k = torch.randn(1, H, K, 64, dtype=bf, requires_grad=True)
v = torch.randn(1, H, K, 64, dtype=bf, requires_grad=True)
go = torch.randn(1, H, N, 64, dtype=bf)


def sdpa():
    y = F.scaled_dot_product_attention(q, k, v)
    y.backward(go)


def math():
    a = torch.softmax((q @ k.transpose(-1, -2)) * 0.125, dim=-1)
    y = a @ v
    y.backward(go)


def math_f32sm():
    a = torch.softmax((q @ k.transpose(-1, -2)) * 0.125, dim=-1, dtype=torch.float32).to(bf)
    y = a @ v
    y.backward(go)


fl = 3 * 2 * 2 * H * N * K * 64
for nm, f in (("sdpa", sdpa), ("math bf16 softmax", math), ("math fp32 softmax", math_f32sm)):
    s = t(f)
    print(f"attention {nm:18s} fwd+bwd {s * 1e3:7.2f} ms {fl / s / 1e12:5.3f} TF/s", flush=True)
    if nm == "sdpa":
        tot += 2 * s
# peak
a = torch.randn(2048, 2048, dtype=bf)
b = torch.randn(2048, 2048, dtype=bf)
s = t(lambda: a @ b)
print(f"peak probe 2048^3 {2 * 2048**3 / s / 1e12:.3f} TF/s")
print(f"sum of the step's GEMM+SDPA at these timings: {tot * 1e3:.0f} ms")
