"""`python benchmarks/tpu_parts/probe_numerics.py OUT.json`: the elementwise functions the semantics card probes,
evaluated on this JAX backend in float32, beside their float64 values (numpy/math), so that a probe's margin can be
set against what each backend's rounding really does. Runs the nonlinearities over a grid of x, the norm probes'
inputs, the soft-cap at its probe input, and records jax's default matmul precision and the numerics flags in force.
Never imports torch.
"""
from __future__ import annotations

import json
import math
import os
import sys

import numpy as np


def _proc(path: str, keys) -> dict:
  """Fields of a /proc status-style file (kB values as text), all of them when `keys` is None."""
  try:
    rows = [line.split(":", 1) for line in open(path).read().splitlines() if ":" in line]
  except OSError as exc:
    return {"error": str(exc)}
  return {k.strip(): v.strip() for k, v in rows if keys is None or k.strip() in keys}


def main(out: str) -> int:
  import jax
  import jax.numpy as jnp

  xs = np.array([-4.0, -3.0, -2.5, -2.0, -1.5, -1.0, -0.5, 0.5, 1.0, 1.5, 2.0, 3.0], np.float32)
  x = jnp.asarray(xs)
  forms = {"tanh": jax.nn.gelu(x, approximate=True), "erf": jax.nn.gelu(x, approximate=False),
           "silu": jax.nn.silu(x)}
  exact = {
      "tanh": [0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3))) for v in map(float, xs)],
      "erf": [0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in map(float, xs)],
      "silu": [v / (1 + math.exp(-v)) for v in map(float, xs)]}
  rows = {k: {"backend": np.asarray(v, np.float64).tolist(), "float64": exact[k]} for k, v in forms.items()}
  rel = {k: float(np.max(np.abs(np.array(r["backend"]) - np.array(r["float64"])) / np.abs(np.array(r["float64"]))))
         for k, r in rows.items()}
  transc = {}
  grid = jnp.linspace(-6.0, 6.0, 4097, dtype=jnp.float32)
  g64 = np.asarray(grid, np.float64)
  for name, fj, fn in (("exp", jnp.exp, np.exp), ("tanh", jnp.tanh, np.tanh), ("erf", jax.scipy.special.erf, None),
                       ("log1p_exp", jax.nn.softplus, lambda v: np.log1p(np.exp(v))), ("rsqrt", jax.lax.rsqrt, None)):
    got = np.asarray(fj(grid if name != "rsqrt" else jnp.abs(grid) + 1.0), np.float64)
    if fn is None:
      ref = (np.array([math.erf(v) for v in g64]) if name == "erf" else 1.0 / np.sqrt(np.abs(g64) + 1.0))
    else:
      ref = fn(g64)
    transc[name] = float(np.max(np.abs(got - ref) / np.maximum(np.abs(ref), 1e-30)))
  a = jax.random.normal(jax.random.PRNGKey(0), (256, 256), jnp.float32)
  b = jax.random.normal(jax.random.PRNGKey(1), (256, 256), jnp.float32)
  ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
  mm = {}
  for prec in ("default", "high", "highest"):
    got = np.asarray(jnp.matmul(a, b, precision=prec), np.float64)
    mm[prec] = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
  rec = {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__,
         "default_matmul_precision": str(jax.config.jax_default_matmul_precision),
         "env": {k: os.environ.get(k) for k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "JAX_DEFAULT_MATMUL_PRECISION",
                                                 "TPU_PREMAPPED_BUFFER_SIZE")},
         "x": xs.tolist(), "forms": rows, "forms_max_rel_error": rel, "transcendentals_max_rel_error": transc,
         "matmul_256_rel_error_of_max": mm}
  rec["memory_stats"] = {k: int(v) for k, v in (jax.devices()[0].memory_stats() or {}).items()
                         if isinstance(v, (int, np.integer))}
  rec["proc_status"] = _proc("/proc/self/status", ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem", "VmPin",
                                                    "VmLck"))
  rec["smaps_rollup"] = _proc("/proc/self/smaps_rollup", None)
  with open(out, "w") as f:
    json.dump(rec, f, indent=1)
  print(json.dumps({"forms_max_rel_error": rel, "transcendentals": transc, "matmul": mm}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1]))
