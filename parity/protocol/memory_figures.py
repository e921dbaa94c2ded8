"""The memory figures a side reports of itself beside the raw peaks: peak device memory that holds on every backend,
with the compiled step's host buffers kept apart as host memory, and host RSS less the mapping the accelerator runtime
makes when it opens its device.

Peak device memory, three readings, each reported with its source:

- The runtime's (`RUNTIME_HOLD`, measured): `device.memory_stats()`. Its `peak_bytes_in_use` is the allocator's peak
  of live arrays (and the loaded program's code); on a TPU it leaves out the region the runtime reserves at the bottom
  of HBM for the loaded program's temporaries (`bytes_reserved`; a refused load reads "Attempting to reserve 8.00G at
  the bottom of memory"). What the device holds during the step is the two together: `runtime_device_bytes` =
  bytes_in_use + bytes_reserved read after the step. On a TPU v5e (tests/data/tpu_v5e/kernels/
  run6-headroom-agree.json) that sum lies, for each of four layouts, inside the bracket a ballast bisection found
  for what the step needs (0.21-0.26 GB wide). Where memory_stats has no `bytes_reserved` there is no runtime
  figure; where it reads 0 (an allocator that holds the temporaries itself) the side's figure is the allocator's
  peak (`device_memory_fields` takes the larger).
- The allocator's alone (`ALLOCATOR_PEAK`): `peak_bytes_in_use` where `bytes_reserved` was not recorded (a 220M-param
  model read 2.8 GB on a TPU where its step needs 6.9-8.2 GB).
- The compiled step's (`COMPILED_ANALYSIS`): XLA's `CompiledMemoryStats`, split by memory space
  (`compiled_memory`). XLA's `peak_memory_in_bytes` (its heap simulation's peak) counts the step's host-resident
  buffers too: the pinned_host arguments and outputs, `host_argument + host_output - host_alias` (the state, held once
  where donated). The device figure is that peak less those buffers (`XLA_PEAK_LESS_HOST`); the host temporaries
  (`host_temp_size_in_bytes`) are not in the peak. Derived on the chip's records (tests/test_memory_figures_fit.py):
  at 103 layers of gpt2-1.5b's width with params and moments in pinned_host the peak reads 53.76 GB on a 16.91 GB
  chip, of which 39.24 GB are the host buffers; the 14.52 GB left is 2.1% under the 14.83 GB the runtime held for the
  same program. On ten other TPU programs (no offload; moments, or params and moments, offloaded) the peak less the
  host buffers is 0.1-1.5% under the runtime's hold; less the host temporaries as well, the four programs that have
  some would read 10-41% under.
  The compiled figure is not a bound: for a 51-layer program of the same plan it read 8.03 GB where the runtime held
  9.12 GB (12% under), so the runtime's figure is preferred where it was recorded. Where XLA gives no peak, the
  device fields' argument + output + temp - alias + generated code (`XLA_SUM_FIELDS`): an upper reading on a TPU,
  whose `temp_size_in_bytes` counts buffers the runtime does not hold at once (the sum read 17.04 GB for a step the
  16.91 GB chip ran, holding 13.67 GB), so never preferred.

The side reports (`device_memory_fields`) the runtime's hold where it was recorded, else the larger of the allocator's
and the compiled device figure, naming it (`peak_device_source`), with every reading kept beside it and the compiled
step's host buffers as `host_bytes_compiled` (never counted as device memory).

Host RSS. Opening an accelerator can map memory that VmRSS counts: the TPU runtime's mapping reads ~14 GB right
after the chip opens (on a sandboxed TPU VM whose /proc/self/status has VmRSS and VmHWM only, so the kind of memory
cannot be told apart there). The JAX worker reads VmRSS before and after the backend opens; a jump of at least
`RUNTIME_MAPPING_MIN_BYTES` on a backend other than the CPU is `host_rss_runtime_mapping_bytes`, and the report
shows the side's own RSS as the raw peak less it. summary.json keeps the raw peak (`peak_host_rss_bytes`).

Imports neither jax nor torch.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["ALLOCATOR_PEAK", "COMPILED_ANALYSIS", "RUNTIME_HOLD", "XLA_PEAK_FIELD", "XLA_PEAK_LESS_HOST",
           "XLA_SUM_FIELDS", "RUNTIME_MAPPING_MIN_BYTES", "compiled_memory", "compiled_peak_bytes",
           "compiled_host_bytes", "runtime_device_bytes", "choose_peak", "device_memory_fields", "peak_device",
           "vm_rss_bytes", "runtime_mapping_bytes", "host_rss_fields", "own_host_rss"]

ALLOCATOR_PEAK = "allocator peak"
COMPILED_ANALYSIS = "compiled memory analysis"
RUNTIME_HOLD = "runtime memory_stats"
"""The sources of a device figure: the allocator's peak alone, the compiled step's device figure, and the runtime's
hold (bytes in use + the program's reserved region, `runtime_device_bytes`)."""
XLA_PEAK_FIELD = "peak_memory_in_bytes"
XLA_PEAK_LESS_HOST = "peak_memory_in_bytes less host buffers"
XLA_SUM_FIELDS = "argument+output+temp-alias+generated_code"
"""How the compiled device figure was had (`peak_device_compiled_from`): XLA's peak (no host buffers in the step),
XLA's peak less the step's host buffers, or the device fields' sum where XLA gives no peak."""
RUNTIME_MAPPING_MIN_BYTES = 256 * 2**20
"""A VmRSS jump across the backend's start below this (256 MiB) is not named as a runtime mapping: the CPU
backend's own start (a thread pool, a few allocations) stays well under it, the TPU runtime's mapping is ~14 GB."""

_SUM_KEYS = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
             "generated_code_size_in_bytes")
_HOST_KEYS = ("host_argument_size_in_bytes", "host_output_size_in_bytes", "host_alias_size_in_bytes",
              "host_temp_size_in_bytes")


def _count(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def compiled_memory(memory_analysis: dict | None) -> dict[str, Any]:
  """The compiled step's memory by memory space, from summary.json's `memory_analysis` (XLA's field names):
  'device' (bytes) and 'device_from' (how: `XLA_PEAK_FIELD`, `XLA_PEAK_LESS_HOST` or `XLA_SUM_FIELDS`, module
  docstring), 'host_resident' (host argument + output - alias: the pinned_host buffers live across the step, which
  XLA's peak counts), 'host_temp' (host temporaries) and 'host' (the two: the step's host buffers); each None where
  it cannot be had (no analysis, a field missing, a figure of 0 or less)."""
  ma = memory_analysis or {}
  hosts = [ma.get(k) for k in _HOST_KEYS]
  have_host = all(_count(h) for h in hosts)
  h_arg, h_out, h_alias, h_temp = hosts if have_host else (0, 0, 0, None)
  resident = h_arg + h_out - h_alias if have_host else None
  device, how = None, None
  peak = ma.get(XLA_PEAK_FIELD)
  if _count(peak) and peak > 0:
    less = resident or 0
    device, how = (peak - less, XLA_PEAK_LESS_HOST if less else XLA_PEAK_FIELD) if peak - less > 0 else (None, None)
  if device is None:
    parts = [ma.get(k) for k in _SUM_KEYS]
    if all(_count(p) for p in parts):
      arg, out, temp, alias, code = parts
      total = arg + out + temp - alias + code
      device, how = (total, XLA_SUM_FIELDS) if total > 0 else (None, None)
  return {"device": device, "device_from": how, "host_resident": resident, "host_temp": h_temp if have_host else None,
          "host": resident + h_temp if have_host else None}


def compiled_peak_bytes(memory_analysis: dict | None) -> tuple[int | None, str | None]:
  """(bytes, how) of the compiled step's device peak (`compiled_memory`'s 'device' and 'device_from'): never the
  host buffers; (None, None) where it cannot be had."""
  got = compiled_memory(memory_analysis)
  return got["device"], got["device_from"]


def compiled_host_bytes(memory_analysis: dict | None) -> int | None:
  """The compiled step's host buffers (pinned_host arguments, outputs and temporaries), bytes; None unrecorded."""
  return compiled_memory(memory_analysis)["host"]


def runtime_device_bytes(stats: dict | None) -> int | None:
  """What the device held for the step by the runtime's `memory_stats()` read after it: bytes_in_use +
  bytes_reserved (the live arrays and the loaded program's reserved region); None where either was not recorded
  (the allocator's figure alone misses a TPU program's temporaries)."""
  st = stats or {}
  used, reserved = st.get("bytes_in_use"), st.get("bytes_reserved")
  if not _count(used) or not _count(reserved):
    return None
  return used + reserved if used + reserved > 0 else None


def choose_peak(allocator: int | None, compiled: int | None,
                runtime: int | None = None) -> tuple[int | None, str | None]:
  """(bytes, source) of the peak device memory: the runtime's hold where it was recorded (a measurement that counts
  the program's region), else the larger of the allocator's and the compiled step's device figure (a tie goes to the
  allocator, a measurement), with its source (`RUNTIME_HOLD` / `ALLOCATOR_PEAK` / `COMPILED_ANALYSIS`); the one
  there is when the other is missing; (None, None) with none."""
  if _count(runtime) and runtime > 0:
    return runtime, RUNTIME_HOLD
  have = [(v, s) for v, s in ((allocator, ALLOCATOR_PEAK), (compiled, COMPILED_ANALYSIS)) if _count(v) and v > 0]
  if not have:
    return None, None
  return max(have, key=lambda c: c[0])  # max keeps the first of equals: the allocator


def device_memory_fields(allocator: int | None, memory_analysis: dict | None, platform: str,
                         stats: dict | None = None) -> dict[str, Any]:
  """summary.json's device memory fields of a side on backend `platform` ('cpu', 'gpu', 'tpu').

  On the CPU only `peak_device_bytes` = the allocator's figure (None there: no device memory figure, as before).
  Elsewhere: `peak_device_bytes` (`choose_peak`), `peak_device_source`, `peak_device_bytes_allocator`,
  `peak_device_bytes_runtime` (`runtime_device_bytes` of `stats`, the device's memory_stats after the steps, or the
  allocator's peak where that is larger),
  `peak_device_bytes_compiled` and `peak_device_compiled_from` (`compiled_peak_bytes`: device memory only) and
  `host_bytes_compiled` (the step's host buffers, `compiled_host_bytes`), each None when not had.
  """
  if platform == "cpu":
    return {"peak_device_bytes": allocator}
  compiled, how = compiled_peak_bytes(memory_analysis)
  runtime = runtime_device_bytes(stats)
  if runtime is not None and _count(allocator):
    runtime = max(runtime, allocator)  # arrays held earlier in the run (a build's copies) beyond the step's hold
  value, source = choose_peak(allocator, compiled, runtime)
  return {"peak_device_bytes": value, "peak_device_source": source, "peak_device_bytes_allocator": allocator,
          "peak_device_bytes_runtime": runtime, "peak_device_bytes_compiled": compiled,
          "peak_device_compiled_from": how, "host_bytes_compiled": compiled_host_bytes(memory_analysis)}


def peak_device(summ: dict) -> tuple[int | None, str | None]:
  """(bytes, source) of a side's peak device memory as a report shows it, chosen again (`choose_peak`) from the
  summary's readings: its runtime hold, its allocator peak and its compiled device figure, recomputed from its
  `memory_analysis` where it has one (a summary written before the figure left the host buffers out keeps its
  readings and drops the host part); one without a device figure (the CPU) stays (None, None)."""
  if "peak_device_source" in summ:
    allocator = summ.get("peak_device_bytes_allocator")
    if summ.get("peak_device_source") == ALLOCATOR_PEAK and not _count(allocator):
      allocator = summ.get("peak_device_bytes")
  else:
    allocator = summ.get("peak_device_bytes")
    if not _count(allocator):
      return None, None
  ma = summ.get("memory_analysis")
  compiled = compiled_peak_bytes(ma)[0] if ma else summ.get("peak_device_bytes_compiled")
  got = choose_peak(allocator, compiled, summ.get("peak_device_bytes_runtime"))
  if got == (None, None) and "peak_device_source" in summ:
    return summ.get("peak_device_bytes"), summ.get("peak_device_source")
  return got


def vm_rss_bytes(status: str | Path = "/proc/self/status") -> int | None:
  """This process's resident set now, bytes: VmRSS of `status` (kB; Linux), else None (not recorded)."""
  try:
    for line in Path(status).read_text().splitlines():
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return None


def runtime_mapping_bytes(before: int | None, opened: int | None, platform: str,
                          threshold: int = RUNTIME_MAPPING_MIN_BYTES) -> int | None:
  """The VmRSS jump across the backend's start (`opened` - `before`, bytes) when it is an accelerator's (not
  'cpu') and at least `threshold`; None otherwise (a reading missing, the CPU, a jump too small to name)."""
  if platform == "cpu" or not _count(before) or not _count(opened):
    return None
  jump = opened - before
  return jump if jump >= threshold else None


def host_rss_fields(readings: dict[str, int | None], platform: str) -> dict[str, Any]:
  """summary.json's host RSS fields: `host_rss_readings_bytes` (VmRSS 'before_backend', 'backend_opened', 'end'),
  `host_rss_backend` (the platform that opened) and `host_rss_runtime_mapping_bytes` (`runtime_mapping_bytes`)."""
  return {"host_rss_readings_bytes": dict(readings), "host_rss_backend": platform,
          "host_rss_runtime_mapping_bytes": runtime_mapping_bytes(readings.get("before_backend"),
                                                                  readings.get("backend_opened"), platform)}


def own_host_rss(summ: dict, peak: int | None = None) -> tuple[int | None, int | None]:
  """(own, mapping) bytes of a side's host RSS: the peak (`peak`, else summary.json's `peak_host_rss_bytes`) less
  its `host_rss_runtime_mapping_bytes` (never below 0), and that mapping; (peak, None) where none was recorded."""
  peak = peak if _count(peak) else summ.get("peak_host_rss_bytes")
  mapping = summ.get("host_rss_runtime_mapping_bytes")
  if not _count(peak) or not _count(mapping) or mapping <= 0:
    return peak, None
  return max(peak - mapping, 0), mapping
