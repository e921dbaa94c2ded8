#!/usr/bin/env bash
# GPU benchmark suite in one command (benchmarks/gpu.py; docs/benchmarks.md): installs the carried wheels, sets the
# environment, writes gpu.json + gpu.md under ${OUT:-benchmarks/results/gpu-<date>}. Extra arguments go to gpu.py
# (e.g. --tiny on a CPU machine, --parts largest --budget-s 300). PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
  echo "[gpu.sh] installing the carried wheels from .whl into .site"
  "$PY" -m pip install -q --no-index --no-deps --upgrade --target .site .whl/*.whl
fi
if [ -d .site ]; then
  export PYTHONPATH="$PWD/.site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="$PWD/.site/bin:$PATH"  # ninja's script too
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1                  # progress lines as they happen
export XLA_PYTHON_CLIENT_PREALLOCATE=false # JAX takes memory as it needs it: its peaks are the run's, not 75 %
export JAX_DEFAULT_MATMUL_PRECISION=highest # fp32 matmuls in full fp32 (parity with torch, TF32 off); bf16 unchanged
# XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB is not exported here: gpu.py sizes XLA's pinned-host pool for each JAX part from
# that part's plan (parity.sizing.host_limits.jax_pool, the rule `parity plan` states), or keeps a value set already.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-${TMPDIR:-/tmp}/parity-torch-extensions}  # DeepSpeed op builds
export OUT=${OUT:-benchmarks/results/gpu-$(date -u +%Y-%m-%d)}
"$PY" - <<'PYEOF'
import importlib.util
need = ("numpy", "jax", "flax", "optax", "torch", "deepspeed", "pydantic", "hjson", "cpuinfo", "ninja", "msgpack",
        "einops", "psutil", "tqdm")
missing = [m for m in need if importlib.util.find_spec(m) is None]
print("[gpu.sh] missing modules (the parts that need them will be recorded as failed): " + (", ".join(missing) or
      "none"), flush=True)
PYEOF
exec "$PY" benchmarks/gpu.py --out "$OUT" "$@"
