"""The doctor's JAX rows (parity.cli.doctor.rows): the chip, the host link, and on a TPU the runtime's host-buffer
settings and the numerics flags in force; plus the sockets row every machine gets. Pure: they read the environment
block (harness.doctor.environment_block) as written, so a block recorded on another machine renders the same here.
"""
from __future__ import annotations

from parity import sockets

__all__ = ["jax_rows", "chip_text", "host_link_text", "tpu_rows", "pool_text_tpu", "sockets_row", "STANDALONE"]

STANDALONE = "standalone puts (fresh pinned allocation each time)"
"""How the doctor labels the single device_put figures: each maps new pinned memory, unlike a train step's
donated, reused buffers (the step round trip), so they understate the link a step sees."""
_PUTS = (("numpy_to_device", "numpy to device"), ("device_to_pinned_host", "device to pinned host"),
         ("pinned_host_to_device", "pinned host to device"))
_UNSET = "unset: runtime default"
HOST_BUFFERS = ("TPU_PREMAPPED_BUFFER_SIZE", "TPU_PREMAPPED_BUFFER_TRANSFER_THRESHOLD_BYTES")
"""The TPU runtime's host-buffer settings (jax_impl.doctor.TPU_HOST_SETTINGS's first two)."""
NUMERICS = ("LIBTPU_INIT_ARGS", "XLA_FLAGS", "JAX_DEFAULT_MATMUL_PRECISION")
"""The settings that can change a TPU's numerics (the rest of jax_impl.doctor.TPU_HOST_SETTINGS)."""


def jax_rows(jx: dict) -> list[tuple[str, str]]:
  """The rows of a jax probe that answered: backend, platforms, chip, memory kinds, host link, and on a TPU its
  host buffers and numerics flags (`tpu_rows`)."""
  mk = jx.get("memory_kinds", {})
  out = [("jax backend", f"{jx.get('backend')}: " + ", ".join(f"{d['platform']}:{d['id']} {d['kind']}"
                                                             for d in jx.get("devices", []))),
         ("jax platforms", ", ".join(f"{k}: {v}" for k, v in (jx.get("platforms") or {}).items())),
         ("jax chip", chip_text(jx)),
         ("jax memory kinds", ", ".join(f"{k} {'accepted' if v is True else v}"
                                        for k, v in (mk.get("accepted") or {}).items())
          + f" (default {mk.get('default')})"),
         ("jax host link", host_link_text(jx.get("bandwidth"), jx.get("backend")))]
  return out + (tpu_rows(jx) if jx.get("backend") == "tpu" else [])


def chip_text(jx: dict) -> str:
  """'TPU v5 lite x 1, 15.75 GiB device memory each (memory_stats bytes_limit)'; on the CPU backend, that its device
  memory is the host's RAM; 'not recorded' for a probe written before the chip was read."""
  acc = jx.get("accelerator")
  if not isinstance(acc, dict):
    return "not recorded (a probe from before the chip facts)"
  head = f"{acc.get('kind')} x {acc.get('count')}"
  limit = acc.get("bytes_limit")
  if isinstance(limit, (int, float)) and limit > 0:
    return f"{head}, {limit / 2**30:.2f} GiB device memory each (memory_stats bytes_limit)"
  if jx.get("backend") == "cpu":
    return f"{head}: the CPU backend, whose device memory is the host's RAM"
  return f"{head}, device memory not reported by the backend"


def host_link_text(bw: dict | None, backend: str | None) -> str:
  """The host <-> device link: the step round trip first (donated, reused pinned_host buffers: what a train step
  moves), then the standalone puts, labelled as such (STANDALONE); on the CPU backend, that they are RAM copies."""
  if not bw:
    return "not measured (--quick)"
  if "error" in bw:
    return str(bw["error"])
  trip = bw.get("step_round_trip")
  if isinstance(trip, dict) and isinstance(trip.get("gb_per_s"), (int, float)):
    first = (f"step round trip {trip['gb_per_s']:g} GB/s ({(trip.get('bytes_both_ways') or 0) / 2**20:,.0f} MiB both "
             f"ways: {trip.get('how')})")
  elif isinstance(trip, dict):
    first = f"step round trip not measured: {trip.get('error')}"
  elif isinstance(bw.get("device_to_pinned_host"), str):  # no pinned_host here: no round trip to time
    first = f"step round trip {bw['device_to_pinned_host']}"
  else:
    first = "step round trip not recorded (a probe from before it)"
  puts = ", ".join(f"{words} {bw[k]}" + (" GB/s" if isinstance(bw[k], (int, float)) else "")
                   for k, words in _PUTS if k in bw)
  out = f"{first}; {STANDALONE}: {puts or 'none'}"
  if backend == "cpu":
    out += "; on the CPU backend every memory kind is the same RAM: memory-copy speeds, not a bus"
  return out


def _setting(settings: dict, key: str) -> str:
  value = settings.get(key)
  return f"{key} {_UNSET}" if value is None or not str(value).strip() else f"{key}={str(value).strip()}"


def tpu_rows(jx: dict) -> list[tuple[str, str]]:
  """On a TPU: the runtime's host-buffer settings (its premapped region is a staging area pinned when a process
  opens the chip; pinned_host arrays are host memory beside it) and the numerics flags in force, as the probe's
  process saw them."""
  acc = jx.get("accelerator") if isinstance(jx.get("accelerator"), dict) else {}
  settings = acc.get("settings") if isinstance(acc.get("settings"), dict) else None
  if settings is None:
    return [("tpu host buffers", "not recorded (a probe from before the TPU settings)")]
  flags = "; ".join(_setting(settings, k) for k in NUMERICS)
  return [("tpu host buffers", "; ".join(_setting(settings, k) for k in HOST_BUFFERS)
           + " (a staging region pinned at start; pinned_host arrays are host memory beside it)"),
          ("tpu numerics flags", f"{flags} (jax default_matmul_precision: {acc.get('default_matmul_precision')})")]


def pool_text_tpu(var: str, jx: dict) -> str:
  """The 'jax pinned-host pool' row on a TPU: the GPU rule does not apply; where TPU pinned_host arrays live."""
  acc = jx.get("accelerator") if isinstance(jx.get("accelerator"), dict) else {}
  size = _setting(acc.get("settings") if isinstance(acc.get("settings"), dict) else {}, HOST_BUFFERS[0])
  return (f"{var}: the GPU pinned-pool rule does not apply on TPU (XLA's GPU client reads it); TPU pinned_host "
          f"arrays are host memory beside the runtime's premapped region ({size})")


def sockets_row(block: dict) -> tuple[str, str]:
  """('sockets', whether this machine allows them and what that means for DeepSpeed, torch.distributed and
  jax.distributed: parity.sockets.meaning); 'not recorded' for a block written before the check."""
  rec = block.get("sockets")
  if not isinstance(rec, dict):
    return ("sockets", "not recorded (a block written before the loopback check)")
  return ("sockets", sockets.meaning(None if rec.get("allowed") else (rec.get("error") or "refused")))
