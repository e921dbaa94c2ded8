"""JAX part: host<->device bandwidth through pinned_host, outside and inside jit, and matmul throughput.

  python -m benchmarks.gpu_parts.jax_raw --json OUT [--mib 1024] [--n 8192] [--reps 5]

Bandwidth (--mib MiB of float32, best and median of --reps, GB/s = bytes / s / 1e9):
  * device_put_pinned_to_device / device_put_device_to_pinned: `jax.device_put` of an array between a
    `pinned_host` and a `device` SingleDeviceSharding, then block_until_ready;
  * device_put_numpy_to_device: a numpy (pageable) array to the device;
  * jit_pinned_to_device / jit_device_to_pinned: the same moves inside one jitted function
    (`jax.device_put(x, sharding.with_memory_kind(...))` with in/out shardings in the two kinds), as the
    training step moves offloaded state (jax_impl.offload); each call allocates its output afresh;
  * jit_round_trip_donated: one jitted function that takes a donated pinned_host buffer, brings it to the device,
    adds 1 and writes it back to pinned_host, called again on its own output (jax_impl.doctor's step round trip):
    the pinned buffers are reused as a train step's donated offloaded state is, so this is the in-step rate (bytes
    both ways / seconds) the suite divides a step's moved bytes by. A standalone device -> pinned_host put maps
    fresh pinned memory every time (on a TPU v5e 0.9 GB/s against 13 GB/s for this round trip).
The CPU backend keeps every memory kind in the same RAM: there the figures are host copies (or none when XLA
elides the move), marked as such.
Matmul: n x n @ n x n in bf16 (under the process's own jax_default_matmul_precision, as the bf16 training step
runs), and fp32 under `jax.default_matmul_precision` 'float32' (full fp32, what `highest` gives) and
'tensorfloat32'; FLOP/s = 2 n^3 / median seconds.
"""
from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from benchmarks.gpu_parts.common import raw_args, timing, write_json


def _timed(fn, reps: int, nbytes: int) -> dict[str, float]:
  fn().block_until_ready()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = fn()
    out.block_until_ready()
    times.append(time.perf_counter() - t0)
    del out
  return {"bytes": nbytes, "best_gbs": nbytes / min(times) / 1e9, "median_gbs": nbytes / statistics.median(times) / 1e9,
          **timing(times)}


def bandwidth(mib: int, reps: int) -> dict:
  """Each move of the module docstring; {'error': ...} for the pinned ones when the device has no pinned_host."""
  import jax
  dev = jax.devices()[0]
  kinds = sorted({m.kind for m in dev.addressable_memories()})
  nbytes = mib * 2**20
  host = np.ones(nbytes // 4, np.float32)
  on_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
  out = {"kind": f"jax {jax.default_backend()} ({dev.device_kind})", "memory_kinds": kinds,
         "device_put_numpy_to_device": _timed(lambda: jax.device_put(host, on_dev), reps, nbytes)}
  if jax.default_backend() == "cpu":
    out["kind"] += ": every memory kind is the same RAM, so these are host copies, not a host<->device link"
  if "pinned_host" not in kinds:
    out["error"] = f"device {dev} has no pinned_host memory (it has {kinds})"
    return out
  pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
  x_host = jax.device_put(host, pinned)
  x_dev = jax.device_put(host, on_dev)
  out["device_put_pinned_to_device"] = _timed(lambda: jax.device_put(x_host, on_dev), reps, nbytes)
  out["device_put_device_to_pinned"] = _timed(lambda: jax.device_put(x_dev, pinned), reps, nbytes)
  up = jax.jit(lambda x: jax.device_put(x, on_dev), in_shardings=pinned, out_shardings=on_dev)
  down = jax.jit(lambda x: jax.device_put(x, pinned), in_shardings=on_dev, out_shardings=pinned)
  out["jit_pinned_to_device"] = _timed(lambda: up(x_host), reps, nbytes)
  out["jit_device_to_pinned"] = _timed(lambda: down(x_dev), reps, nbytes)
  out["jit_round_trip_donated"] = round_trip(x_host, pinned, reps, nbytes)
  return out


def round_trip(x_host, pinned, reps: int, nbytes: int) -> dict:
  """The donated in-jit round trip of the module docstring: GB/s of both directions' bytes (2 x nbytes)."""
  import jax
  import jax.numpy as jnp

  def bump(x):
    return jax.device_put(jax.device_put(x, jax.memory.Space.Device) + jnp.float32(1), jax.memory.Space.Host)
  fn = jax.jit(bump, in_shardings=pinned, out_shardings=pinned, donate_argnums=0)
  buf = fn(jax.device_put(x_host, pinned))
  buf.block_until_ready()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    buf = fn(buf)
    buf.block_until_ready()
    times.append(time.perf_counter() - t0)
  moved = 2 * nbytes
  return {"bytes": moved, "best_gbs": moved / min(times) / 1e9, "median_gbs": moved / statistics.median(times) / 1e9,
          **timing(times)}


def matmul(n: int, reps: int) -> dict:
  """FLOP/s of an n x n matmul: bf16, fp32 at 'float32' and 'tensorfloat32' matmul precision."""
  import jax
  import jax.numpy as jnp
  dev = jax.devices()[0]
  out = {"n": n, "device": dev.device_kind}
  key_a, key_b = jax.random.split(jax.random.key(0))
  ambient = getattr(jax.config, "jax_default_matmul_precision", None)  # bf16 as the run's own step gets it
  for name, dtype, precision in (("bf16", jnp.bfloat16, ambient), ("fp32", jnp.float32, "float32"),
                                 ("tf32", jnp.float32, "tensorfloat32")):
    if name == "tf32" and jax.default_backend() == "cpu":
      continue  # no TF32 on CPU: the same kernel as fp32
    a = jax.random.normal(key_a, (n, n), dtype)
    b = jax.random.normal(key_b, (n, n), dtype)
    with jax.default_matmul_precision(precision):
      f = jax.jit(lambda x, y: x @ y)
      f(a, b).block_until_ready()
      times = []
      for _ in range(reps):
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        times.append(time.perf_counter() - t0)
    out[name] = {"tflops": 2 * n**3 / statistics.median(times) / 1e12, "precision": str(precision), **timing(times)}
  return out


def main(argv: list[str] | None = None) -> int:
  args = raw_args(__doc__.split("\n\n")[0], argv)
  import jax
  import jaxlib
  t0 = time.perf_counter()
  dev = jax.devices()[0]
  res = {"part": "jax_raw", "jax": jax.__version__, "jaxlib": jaxlib.__version__, "backend": jax.default_backend(),
         "device": dev.device_kind, "device_count": jax.device_count(),
         "default_matmul_precision": str(getattr(jax.config, "jax_default_matmul_precision", None)),
         "bandwidth": bandwidth(args.mib, args.reps)}
  write_json(args.json, {**res, "wall_s": time.perf_counter() - t0})  # kept if the matmuls overrun the part's limit
  res["matmul"] = matmul(args.n, args.reps)
  res["wall_s"] = time.perf_counter() - t0
  write_json(args.json, {**res, "complete": True})
  return 0


if __name__ == "__main__":
  sys.exit(main())
