"""`python -m jax_impl.doctor [--bandwidth] [--size-mb N]`: what JAX sees here, as one JSON object on stdout.

The JAX half of `parity doctor` (harness.doctor runs it in its own process, with a timeout, and merges the JSON):
jax/jaxlib versions, the default backend and its devices, which other platforms initialize (and the error of
those that do not: a CUDA plugin that cannot find its driver says why here), which memory kinds the first
device addresses and which of them accept an array (`device_put` to each), and optionally the copy bandwidth
between the device and `pinned_host` (the path the offload plans use). Never imports torch.
Exit 0 with the JSON; a failure to import jax is reported in the JSON too ({"error": ...}), exit 0, so the
driver always has something to show.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # a probe takes no 75% of a GPU's memory

_STARTED = time.time()  # probe_s counts the framework import too (the package __init__ may import it)

__all__ = ["probe", "main"]

PLATFORMS = ("cpu", "cuda", "rocm")
"""Platforms tried one by one (`jax.devices(p)`), so a GPU plugin that is installed but fails is named (not 'tpu':
with libtpu installed on a machine without a TPU its initialization can wait on a metadata server for minutes)."""


def _devices(jax) -> list[dict[str, object]]:
  return [{"id": d.id, "platform": d.platform, "kind": d.device_kind, "process_index": d.process_index}
          for d in jax.devices()]


def _platforms(jax) -> dict[str, str]:
  """platform -> 'N device(s)' or the first line of the error that platform's initialization raised."""
  out = {}
  for p in PLATFORMS:
    try:
      out[p] = f"{len(jax.devices(p))} device(s)"
    except Exception as exc:  # RuntimeError: unknown or failed backend; the message is the diagnosis
      out[p] = f"unavailable: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__}"
  return out


def _memory_kinds(jax, device) -> dict[str, object]:
  """The memory kinds `device` addresses, its default one, and for each whether a device_put there is accepted."""
  import numpy as np
  from jax.sharding import SingleDeviceSharding  # jax inside the probe: a failed import is reported in the JSON
  kinds = sorted({m.kind for m in device.addressable_memories()})
  accepted = {}
  for kind in kinds:
    try:
      a = jax.device_put(np.arange(8, dtype=np.float32), SingleDeviceSharding(device, memory_kind=kind))
      a.block_until_ready()
      accepted[kind] = a.sharding.memory_kind == kind or f"placed in {a.sharding.memory_kind}"
    except Exception as exc:  # the backend refused this kind: the reason is the answer
      accepted[kind] = f"refused: {type(exc).__name__}: {str(exc)[:200]}"
  return {"addressable": kinds, "default": device.default_memory().kind, "accepted": accepted}


def _best_s(fn, repeats: int) -> float:
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - t0)
  return best


def _bandwidth(jax, device, size_mb: int, repeats: int = 3) -> dict[str, object]:
  """GB/s (1e9 bytes/s) of `size_mb` MiB float32 copies, best of `repeats`: numpy -> device, device ->
  pinned_host, pinned_host -> device (each blocked until ready). On the CPU backend every kind is the same RAM,
  so the figures are memory-copy speeds, not a bus."""
  import numpy as np
  from jax.sharding import SingleDeviceSharding  # jax inside the probe: a failed import is reported in the JSON
  nbytes = size_mb * 2**20
  host = np.ones(nbytes // 4, dtype=np.float32)
  dev_s = SingleDeviceSharding(device, memory_kind=device.default_memory().kind)
  out: dict[str, object] = {"bytes": nbytes, "repeats": repeats, "unit": "GB/s (best of repeats)"}
  on_dev = jax.device_put(host, dev_s).block_until_ready()
  out["numpy_to_device"] = round(nbytes / _best_s(lambda: jax.device_put(host, dev_s).block_until_ready(),
                                                   repeats) / 1e9, 2)
  if "pinned_host" not in {m.kind for m in device.addressable_memories()}:
    out["device_to_pinned_host"] = out["pinned_host_to_device"] = "n/a: no pinned_host memory on this backend"
    return out
  pin_s = SingleDeviceSharding(device, memory_kind="pinned_host")
  on_host = jax.device_put(on_dev, pin_s).block_until_ready()
  out["device_to_pinned_host"] = round(nbytes / _best_s(lambda: jax.device_put(on_dev, pin_s).block_until_ready(),
                                                        repeats) / 1e9, 2)
  out["pinned_host_to_device"] = round(nbytes / _best_s(lambda: jax.device_put(on_host, dev_s).block_until_ready(),
                                                        repeats) / 1e9, 2)
  out["step_round_trip"] = _step_round_trip(jax, on_host, dev_s, pin_s, repeats)
  return out


def _step_round_trip(jax, on_host, dev_s, pin_s, repeats: int) -> dict[str, object]:
  """The host link as a train step uses it: one jitted function that takes a pinned_host buffer (donated), brings
  it to the device, updates it there and writes it back to pinned_host, called again on its own output, so XLA
  reuses the pinned buffers instead of allocating fresh ones (a standalone device -> pinned_host `device_put`
  allocates and maps new pinned memory every time: on TPU v5e 0.5-0.9 GB/s against ~16 GB/s for the same bytes
  inside a donated step). GB/s counts both directions' bytes over the call's wall time."""
  import jax.numpy as jnp  # jax inside the probe: a failed import is reported in the JSON

  def bump(x):
    y = jax.device_put(x, jax.memory.Space.Device) + jnp.float32(1)
    return jax.device_put(y, jax.memory.Space.Host)

  try:
    fn = jax.jit(bump, in_shardings=pin_s, out_shardings=pin_s, donate_argnums=0)
    buf = jax.device_put(on_host, pin_s)
    buf = fn(buf)
    buf.block_until_ready()
    best = float("inf")
    for _ in range(max(repeats, 3)):
      t0 = time.perf_counter()
      buf = fn(buf)
      buf.block_until_ready()
      best = min(best, time.perf_counter() - t0)
    nbytes = 2 * on_host.nbytes
    return {"gb_per_s": round(nbytes / best / 1e9, 2), "bytes_both_ways": nbytes,
            "how": "jit(donated pinned_host -> device, +1, -> pinned_host), reused buffers, best of repeats"}
  except Exception as exc:  # a backend that cannot compile host moves in jit: the reason is the answer
    return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}


TPU_HOST_SETTINGS = ("TPU_PREMAPPED_BUFFER_SIZE", "TPU_PREMAPPED_BUFFER_TRANSFER_THRESHOLD_BYTES", "LIBTPU_INIT_ARGS",
                     "XLA_FLAGS", "JAX_DEFAULT_MATMUL_PRECISION")
"""The runtime's host-buffer settings and the flags that change numerics, read from the environment as the process
sees them (unset: the runtime's default). On TPU the runtime pins a premapped staging region of
TPU_PREMAPPED_BUFFER_SIZE bytes when a process opens the chip; pinned_host arrays are host memory beside it (the GPU
pinned-pool rule, XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, does not apply)."""


def _accelerator(jax, device) -> dict[str, object]:
  """The chip: its kind, device memory (bytes_limit of memory_stats, where the backend gives it), the count, and the
  host-buffer and numerics settings in force (TPU_HOST_SETTINGS)."""
  try:
    stats = device.memory_stats() or {}
  except Exception:  # CPU devices raise or return None: no device memory figure
    stats = {}
  return {"kind": device.device_kind, "count": jax.device_count(), "bytes_limit": stats.get("bytes_limit"),
          "settings": {k: os.environ.get(k) for k in TPU_HOST_SETTINGS},
          "default_matmul_precision": str(jax.config.jax_default_matmul_precision)}


def probe(bandwidth: bool = False, size_mb: int = 64) -> dict[str, object]:
  """The JAX report (module docstring) as a JSON-able dict; {'error': ...} when jax cannot be imported.

  Args:
    bandwidth: also time the copies (`size_mb` MiB each, ~1 s on a CPU; a GPU's bus in well under that).
    size_mb: array size for the bandwidth copies, MiB.
  """
  t0 = min(time.time(), _STARTED)
  try:
    import jax  # jax inside the probe: a failed import is reported in the JSON
  except Exception as exc:  # not installed, or a broken install: said, not raised
    return {"error": f"import jax failed: {type(exc).__name__}: {exc}"}
  import jaxlib  # jax inside the probe: a failed import is reported in the JSON
  dev = jax.devices()[0]
  out: dict[str, object] = {
      "jax": jax.__version__, "jaxlib": getattr(jaxlib, "__version__", None),
      "backend": jax.default_backend(), "devices": _devices(jax), "platforms": _platforms(jax),
      "memory_kinds": _memory_kinds(jax, dev), "accelerator": _accelerator(jax, dev)}
  if bandwidth:
    out["bandwidth"] = _bandwidth(jax, dev, size_mb)
  out["probe_s"] = round(time.time() - t0, 2)
  return out


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m jax_impl.doctor", description="what JAX sees here, as JSON")
  ap.add_argument("--bandwidth", action="store_true", help="also time device <-> pinned_host copies")
  ap.add_argument("--size-mb", type=int, default=64, help="MiB per bandwidth copy (default 64)")
  args = ap.parse_args(argv)
  print(json.dumps(probe(args.bandwidth, args.size_mb)), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
