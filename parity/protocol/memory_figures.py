"""The memory figures a side reports of itself beside the raw peaks: peak device memory that holds on every backend,
and host RSS less the mapping the accelerator runtime makes when it opens its device.

Peak device memory. The allocator's `peak_bytes_in_use` (`device.memory_stats()`) is what the runtime's allocator
saw; on TPU it leaves out the compiled program's temporaries (a 220M-param model read 2.8 GB where the compiled step
needs 6.9-8.2 GB). The compiled figure is XLA's `CompiledMemoryStats` of the train step: `peak_memory_in_bytes`
(the heap simulation's peak of the step's live device buffers: arguments, outputs and temporaries at the step's
most loaded point) where XLA gives it, else argument + output + temp - alias + generated code (alias: output bytes
that share an argument's buffer, donation; generated code: the program itself). The two are not nested: on the TPU
fixtures `temp_size_in_bytes` alone exceeds `peak_memory_in_bytes`, so that sum is the fallback, never preferred,
and for a tiny model the allocator (which also holds buffers outside the step) reads more than the compiled peak.
The side reports the larger as `peak_device_bytes`, naming it (`peak_device_source`) and keeping both.

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

__all__ = ["ALLOCATOR_PEAK", "COMPILED_ANALYSIS", "XLA_PEAK_FIELD", "XLA_SUM_FIELDS", "RUNTIME_MAPPING_MIN_BYTES",
           "compiled_peak_bytes", "choose_peak", "device_memory_fields", "peak_device", "vm_rss_bytes",
           "runtime_mapping_bytes", "host_rss_fields", "own_host_rss"]

ALLOCATOR_PEAK = "allocator peak"
COMPILED_ANALYSIS = "compiled memory analysis"
XLA_PEAK_FIELD = "peak_memory_in_bytes"
XLA_SUM_FIELDS = "argument+output+temp-alias+generated_code"
"""How the compiled figure was had (`peak_device_compiled_from`): XLA's peak, or the sum where XLA gives none."""
RUNTIME_MAPPING_MIN_BYTES = 256 * 2**20
"""A VmRSS jump across the backend's start below this (256 MiB) is not named as a runtime mapping: the CPU
backend's own start (a thread pool, a few allocations) stays well under it, the TPU runtime's mapping is ~14 GB."""

_SUM_KEYS = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
             "generated_code_size_in_bytes")


def _count(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def compiled_peak_bytes(memory_analysis: dict | None) -> tuple[int | None, str | None]:
  """(bytes, how) of the compiled step's device peak from summary.json's `memory_analysis` (XLA's field names):
  `peak_memory_in_bytes` where it is given and > 0, else argument + output + temp - alias + generated code;
  (None, None) where neither can be had (no analysis, a field missing, a sum of 0)."""
  ma = memory_analysis or {}
  peak = ma.get(XLA_PEAK_FIELD)
  if _count(peak) and peak > 0:
    return peak, XLA_PEAK_FIELD
  parts = [ma.get(k) for k in _SUM_KEYS]
  if not all(_count(p) for p in parts):
    return None, None
  arg, out, temp, alias, code = parts
  total = arg + out + temp - alias + code
  return (total, XLA_SUM_FIELDS) if total > 0 else (None, None)


def choose_peak(allocator: int | None, compiled: int | None) -> tuple[int | None, str | None]:
  """(bytes, source) of the peak device memory: the larger of the allocator's and the compiled step's figure
  (a tie goes to the allocator, a measurement), with its source (`ALLOCATOR_PEAK` / `COMPILED_ANALYSIS`); the one
  there is when the other is missing; (None, None) with neither."""
  have = [(v, s) for v, s in ((allocator, ALLOCATOR_PEAK), (compiled, COMPILED_ANALYSIS)) if _count(v) and v > 0]
  if not have:
    return None, None
  return max(have, key=lambda c: c[0])  # max keeps the first of equals: the allocator


def device_memory_fields(allocator: int | None, memory_analysis: dict | None, platform: str) -> dict[str, Any]:
  """summary.json's device memory fields of a side on backend `platform` ('cpu', 'gpu', 'tpu').

  On the CPU only `peak_device_bytes` = the allocator's figure (None there: no device memory figure, as before).
  Elsewhere: `peak_device_bytes` (the larger, `choose_peak`), `peak_device_source`, `peak_device_bytes_allocator`,
  `peak_device_bytes_compiled` and `peak_device_compiled_from` (`compiled_peak_bytes`), each None when not had.
  """
  if platform == "cpu":
    return {"peak_device_bytes": allocator}
  compiled, how = compiled_peak_bytes(memory_analysis)
  value, source = choose_peak(allocator, compiled)
  return {"peak_device_bytes": value, "peak_device_source": source, "peak_device_bytes_allocator": allocator,
          "peak_device_bytes_compiled": compiled, "peak_device_compiled_from": how}


def peak_device(summ: dict) -> tuple[int | None, str | None]:
  """(bytes, source) of a side's peak device memory as a report shows it. A summary with `peak_device_source` gives
  its own; an older one with an allocator peak is recomputed with its `memory_analysis` (`choose_peak`); one without
  a device figure (the CPU) stays (None, None)."""
  if "peak_device_source" in summ:
    return summ.get("peak_device_bytes"), summ.get("peak_device_source")
  allocator = summ.get("peak_device_bytes")
  if not _count(allocator):
    return None, None
  return choose_peak(allocator, compiled_peak_bytes(summ.get("memory_analysis"))[0])


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
