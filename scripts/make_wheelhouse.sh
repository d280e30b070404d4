#!/usr/bin/env bash
# Wheels for the GPU machine (docs/gpu.md): the packages this project imports that the device's
# CUDA image lacks (deepspeed, omegaconf, datasets, pydantic, hjson, lucidrains' linformer
# for the peer comparison, and their missing dependencies), for its Python (3.12, x86-64 manylinux), at the versions this checkout's venv
# runs, into gpu_carry/wheels/ (ignored; it travels with the working tree). DeepSpeed ships only
# an sdist: it is built here into a pure-Python wheel (DS_BUILD_OPS=0: its CUDA ops are JIT-built
# on first use there, with the image's nvcc). Checks that every wheel's requirements are carried
# or on the image, and prints the sizes against the 64 MiB the device accepts.
#   usage: bash scripts/make_wheelhouse.sh [OUT_DIR]      (PYTHON: the venv's python)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu_carry/wheels}
py=${PYTHON:-python}
target_py=3.12   # the device image's python3 (KINDS.md: Python 3.12.3)

# Missing on the image (KINDS.md's package list), with what they need that it also lacks.
pure=(omegaconf hjson pydantic annotated-types typing-inspection typing-extensions
      datasets dill multiprocess linformer)
binary=(pydantic-core)
sdist=deepspeed
ver() { "$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pins=()
for name in "${pure[@]}" "${binary[@]}"; do pins+=("$name==$(ver "$name")"); done
echo "[wheelhouse] downloading for cp${target_py/./} manylinux x86_64: ${pins[*]}"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$target_py" \
    --implementation cp --abi "cp${target_py/./}" --abi abi3 --abi none "${platforms[@]}" \
    -d "$tmp/whl" "${pins[@]}"
ds="$sdist==$(ver "$sdist")"
echo "[wheelhouse] building $ds (pure Python, ops JIT-built on first use)"
"$py" -m pip download -q --no-deps --no-binary=:all: -d "$tmp/sdist" "$ds"
DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$tmp/whl" "$tmp"/sdist/*

rm -rf "$out" && mkdir -p "$out" && mv "$tmp"/whl/*.whl "$out"/

# Every requirement of a carried wheel (markers for python 3.12 on Linux) must be carried or be
# on the image; the binary wheel must match cp312; one version of each package.
"$py" - "$out" "$target_py" <<'PY'
import email.parser
import pathlib
import sys
import zipfile

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

# KINDS.md "Python packages already there" (device kind nvidia-h200, read there 2026-11-17).
IMAGE = {
    "absl-py", "accelerate", "aiofiles", "aiohappyeyeballs", "aiohttp", "aiosignal",
    "annotated-doc", "anyio", "attrs", "botorch", "build", "certifi", "charset-normalizer",
    "chex", "click", "cloudpickle", "cmake", "colorama", "contourpy", "coverage", "cuda-bindings",
    "cuda-core", "cuda-pathfinder", "cuda-toolkit", "cupy-cuda13x", "cycler", "cython", "diffrax",
    "e3nn", "einops", "equinox", "etils", "execnet", "filelock", "flatbuffers", "flax",
    "fonttools", "formulaic", "frozenlist", "fsspec", "gpytorch", "grpcio", "h11", "h5py",
    "hf-xet", "httpcore", "httpx", "huggingface-hub", "humanize", "hypothesis", "idna", "imageio",
    "iniconfig", "interface-meta", "jax", "jax-cuda13-pjrt", "jax-cuda13-plugin", "jaxlib",
    "jaxtyping", "jinja2", "joblib", "kiwisolver", "lazy-loader", "lightning",
    "lightning-utilities", "linear-operator", "lineax", "llvmlite", "lxml", "markdown",
    "markdown-it-py", "markupsafe", "matplotlib", "mdurl", "meson", "ml-dtypes", "mpi4py",
    "mpmath", "msgpack", "multidict", "multipledispatch", "mypy-extensions", "nanobind",
    "narwhals", "networkx", "ninja", "numba", "numba-cuda", "numpy", "numpyro", "nvidia-cublas",
    "nvidia-cuda-cupti", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "nvidia-cudnn-cu13",
    "nvidia-cufft", "nvidia-cufile", "nvidia-curand", "nvidia-cusolver", "nvidia-cusparse",
    "nvidia-cusparselt-cu13", "nvidia-ml-py", "nvidia-nccl-cu13", "nvidia-nvjitlink",
    "nvidia-nvshmem-cu13", "nvidia-nvtx", "onnx", "onnx-ir", "onnxruntime", "onnxscript",
    "opencv-python-headless", "optax", "opt-einsum", "opt-einsum-fx", "optimistix",
    "orbax-checkpoint", "packaging", "pandas", "pathspec", "patsy", "peft", "pillow", "pip",
    "pluggy", "portalocker", "prometheus-client", "propcache", "protobuf", "psutil", "pyarrow",
    "pybind11", "py-cpuinfo", "pygments", "pyparsing", "pyproject-hooks", "pyre-extensions",
    "pytest", "pytest-benchmark", "pytest-cov", "pytest-mock", "pytest-timeout", "pytest-xdist",
    "python-dateutil", "pytorch-lightning", "pyyaml", "regex", "requests", "rich", "sacrebleu",
    "safetensors", "scikit-build-core", "scikit-image", "scikit-learn", "scipy", "seaborn",
    "sentencepiece", "sentence-transformers", "setuptools", "shellingham", "simplejson", "six",
    "sortedcontainers", "statsmodels", "sympy", "tabulate", "tensorboard",
    "tensorboard-data-server", "tensorstore", "threadpoolctl", "tifffile", "tiktoken", "timm",
    "tokenizers", "toolz", "torch", "torchaudio", "torchdiffeq", "torch-geometric",
    "torchmetrics", "torchvision", "tqdm", "transformers", "treescope", "triton", "typer",
    "typing-extensions", "typing-inspect", "urllib3", "uvloop", "wadler-lindig", "werkzeug",
    "wheel", "wrapt", "xarray", "xxhash", "yarl", "zipp",
}
out, target = pathlib.Path(sys.argv[1]), sys.argv[2]
env = default_environment()
env.update(python_version=target, python_full_version=target + ".3", extra="")
carried, problems, total = {}, [], 0
for whl in sorted(out.glob("*.whl")):
    name, version, _, tags = parse_wheel_filename(whl.name)
    if name in carried:
        problems.append(f"two versions of {name}")
    carried[name] = version
    interp = {t.interpreter for t in tags}
    if not interp & {"py3", "py" + target.replace(".", ""), "cp" + target.replace(".", "")}:
        problems.append(f"{whl.name}: no tag for Python {target} ({sorted(interp)})")
    total += whl.stat().st_size
for whl in sorted(out.glob("*.whl")):
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    for line in msg.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        dep = canonicalize_name(req.name)
        if dep in carried:
            if carried[dep] not in req.specifier:
                problems.append(f"{whl.name} needs {req}, carried {dep} {carried[dep]}")
        elif dep not in IMAGE:
            problems.append(f"{whl.name} needs {req}: neither carried nor on the image")
# The project's own requirements (pyproject.toml dependencies) must be there too.
import tomllib

deps = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]["dependencies"]
for line in deps:
    dep = canonicalize_name(Requirement(line).name)
    if dep not in carried and dep not in IMAGE:
        problems.append(f"pyproject.toml needs {line}: neither carried nor on the image")
for name, version in sorted(carried.items()):
    print(f"  {name} {version}")
print(f"[wheelhouse] {len(carried)} wheels, {total / 2**20:.1f} MiB in {out}")
if problems:
    print("[wheelhouse] PROBLEMS:\n  " + "\n  ".join(problems), file=sys.stderr)
    sys.exit(1)
PY
# The same check pip makes on the device: every wheel installs for cp312 manylinux x86_64.
"$py" -m pip install -q --dry-run --no-index --no-deps --ignore-installed \
    --target "$tmp/site" --python-version "$target_py" --implementation cp \
    --only-binary=:all: "${platforms[@]}" "$out"/*.whl
echo "[wheelhouse] cp${target_py/./} install check passed"
carry_mib=$(du -sm --apparent-size gpu_carry 2>/dev/null | cut -f1)
tree_mib=$(git ls-files -z | du -cm --apparent-size --files0-from=- | tail -1 | cut -f1)
echo "[wheelhouse] gpu_carry/ in all: ${carry_mib} MiB (+ ${tree_mib} MiB of tracked files;" \
  "the device accepts 64 MiB)"
if [ $((carry_mib + tree_mib)) -ge 64 ]; then
  echo "error: gpu_carry/ + tracked files exceed 64 MiB" >&2
  exit 1
fi
