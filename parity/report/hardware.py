"""Where each side of a report computed, in words, and the caveat that follows for its tokens/s
(parity.report.side_table.throughput_note's first part).

JAX can run on an accelerator while the torch sides run on the host CPU (a TPU VM: JAX on the chip, torch and
DeepSpeed on the CPU), so "CPU backend" alone is wrong there: the caveat names each side's device, and says the
figures of sides on different hardware are not comparable. Read from each side's summary.json `device` (jax:
'cpu:0', 'cuda:0', 'TPU_0(process=0,(0,0,0,0))'; torch: 'cpu', 'cuda (NVIDIA H200)'), its `device_kind` where a
side records one ('TPU v5 lite'), and a torch side's `threads.torch_num_threads`. Pure.
"""
from __future__ import annotations

from parity.report.run_record import RunRecord, SideRecord

__all__ = ["side_hardware", "hardware_caveat"]

CPU_ONLY = "throughput is not representative of GPU training"
MIXED = "tokens/s of sides on different hardware are not comparable"


def side_hardware(s: SideRecord) -> tuple[str, str] | None:
  """(class, words) of where a report side computed: ('cpu', 'the host CPU (13 threads)'), ('tpu', 'TPU v5 lite'
  or 'TPU (TPU_0)' where no kind is recorded), ('gpu', 'GPU NVIDIA H200' or the device text); None when the side's
  summary has no device (a side that did not finish)."""
  summ = s.summary
  dev = s.device.strip()
  if not dev:
    return None
  kind, low = summ.get("device_kind"), dev.lower()
  if low.startswith("cpu"):
    threads = summ.get("threads").get("torch_num_threads") if isinstance(summ.get("threads"), dict) else None
    return "cpu", "the host CPU" + (f" ({threads} threads)" if isinstance(threads, int) else "")
  if low.startswith("tpu"):
    return "tpu", str(kind) if kind else f"TPU ({dev.split('(')[0]})"
  if any(k in low for k in ("cuda", "gpu", "rocm")):
    return "gpu", f"GPU {kind}" if kind else (dev if "gpu" in low else f"GPU {dev}")
  return low, dev


def hardware_caveat(rec: RunRecord) -> str | None:
  """The hardware part of the throughput caveat: every side that recorded a device on the CPU: 'CPU backend (jax,
  torch): throughput is not representative of GPU training'; sides on different hardware: 'jax on TPU v5 lite;
  torch on the host CPU (13 threads): tokens/s of sides on different hardware are not comparable'; None when they
  share one kind of accelerator (or none recorded a device). rec: the run (parity.report.run_record)."""
  known = {n: hw for n, s in rec.sides.items() if (hw := side_hardware(s)) is not None}
  classes = {c for c, _ in known.values()}
  if classes == {"cpu"}:
    return f"CPU backend ({', '.join(sorted(known))}): {CPU_ONLY}"
  if len(classes) < 2:
    return None
  return "; ".join(f"{n} on {words}" for n, (_, words) in known.items()) + f": {MIXED}"
