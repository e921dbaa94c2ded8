"""`python -m torch_impl.doctor [--bandwidth] [--build]`: what torch and DeepSpeed see here, as one JSON object.

The PyTorch half of `parity doctor` (harness.doctor runs it in its own process, with a timeout, and merges the
JSON): torch's version and the CUDA it was built for (None: a CPU-only build), whether CUDA is available and its
devices, the CPU capability and the thread settings (`thread_settings`), DeepSpeed's version, and whether
DeepSpeed's CPU Adam op is built in this environment's TORCH_EXTENSIONS_DIR and its library loads into this torch
(it is loaded directly, so nothing is ever built unless `--build` asks: then `torch_impl.ops.build_ops`, what
`parity build-ops` runs). With `--bandwidth` and a CUDA device: host -> device and device -> host copy bandwidth
from pinned and from pageable memory. Never imports jax. A failure to import torch is reported in the JSON
({"error": ...}), exit 0.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

from parity.buildenv import build_environ
from torch_impl import ops

_STARTED = time.time()  # probe_s counts the framework import too (the package __init__ may import it)

__all__ = ["probe", "cpu_adam_state", "thread_settings", "main"]

OP = "cpu_adam"
CHOICE_ENV = "PARITY_THREADS_CHOICE"
"""Where harness.env.thread_environ leaves its choice (JSON) for the process it starts (harness.env.THREADS_CHOICE;
named again here so that a side imports nothing of the harness for it)."""
THREAD_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS")


def thread_settings(torch) -> dict[str, object]:
  """What this torch process runs its CPU work with, and why: the thread variables of its environment (None:
  unset), torch's intra-op threads (`torch.get_num_threads()`, the pool of every CPU kernel, MKL and DeepSpeed's CPU
  Adam) and inter-op threads, and from the harness's choice (harness.env.choose_threads) who set each variable
  ('parity' or 'user'), the inputs it was chosen from and the reason; a process not started through
  harness.env.worker_env says so. `torch` is the imported module (so this module never imports it at load)."""
  try:
    choice = json.loads(os.environ.get(CHOICE_ENV) or "null")
  except ValueError:
    choice = None
  choice = choice if isinstance(choice, dict) else {}
  return {**{k: os.environ.get(k) for k in THREAD_VARS},
          "torch_num_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
          "set_by": choice.get("set_by", {k: "user" for k in THREAD_VARS if k in os.environ}),
          "user": choice.get("user", {}), "inputs": choice.get("inputs"),
          "reason": choice.get("reason") or f"no {CHOICE_ENV}: not started through harness.env.worker_env; the "
                                            "variables are this process's own environment's"}


def _devices(torch) -> list[dict[str, object]]:
  out = []
  for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    out.append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}", "memory_bytes": p.total_memory,
                "multiprocessors": p.multi_processor_count})
  return out


def cpu_adam_state(build: bool = False) -> dict[str, object]:
  """Whether DeepSpeed's CPU Adam op is usable here: {'state': 'loads' | 'not built' | 'fails to load' |
  'build failed', 'library': path or None, 'detail': str}. Loads the built library itself (importlib), so a
  missing or stale build is reported, never started; `build=True` builds it first (minutes on a small CPU)."""
  d = ops.extensions_dir() / OP
  detail = ""
  if build:
    try:
      took = ops.build_ops([OP], say=lambda m: print(m, file=sys.stderr, flush=True))
      detail = f"built/loaded by DeepSpeed in {took[OP]:.0f} s; "
    except Exception as exc:  # a compiler error: the state says so, the compiler output went to stderr
      return {"state": "build failed", "library": None, "detail": f"{type(exc).__name__}: {str(exc)[:300]}"}
  libs = sorted(d.glob(f"{OP}*.so"))
  lock_state, lock_detail = ops.lock_state(d)
  if not libs:
    why = f"no {OP}*.so in {d}" + (f"; a build is running ({lock_detail})" if lock_state == "live" else "")
    return {"state": "not built", "library": None,
            "detail": f"{why}: run `parity build-ops` (or `parity doctor --build`); the DeepSpeed side would "
                      "otherwise build it on first use (~1-3 min)"}
  try:
    spec = importlib.util.spec_from_file_location(OP, libs[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  except Exception as exc:  # ImportError/OSError: built against another torch, or a partial file
    return {"state": "fails to load", "library": str(libs[0]),
            "detail": f"{type(exc).__name__}: {str(exc)[:300]}; rebuild: remove {d} and run `parity build-ops`"}
  return {"state": "loads", "library": str(libs[0]),
          "detail": detail + ("has adam_update" if hasattr(module, "adam_update") else "no adam_update symbol")}


def _gbps(torch, dst, src, repeats: int) -> float:
  best = float("inf")
  for _ in range(repeats):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    best = min(best, time.perf_counter() - t0)
  return round(src.numel() * src.element_size() / best / 1e9, 2)


def _bandwidth(torch, size_mb: int, repeats: int = 3) -> dict[str, object]:
  """GB/s (1e9 bytes/s) of `size_mb` MiB copies on CUDA device 0, best of `repeats`; 'n/a' without a device."""
  if not torch.cuda.is_available():
    return {"host_to_device_pinned": "n/a: no CUDA device", "device_to_host_pinned": "n/a: no CUDA device"}
  n = size_mb * 2**20 // 4
  pinned, pageable = torch.ones(n, pin_memory=True), torch.ones(n)
  dev = torch.empty(n, device="cuda")
  return {"bytes": n * 4, "repeats": repeats, "unit": "GB/s (best of repeats)",
          "host_to_device_pinned": _gbps(torch, dev, pinned, repeats),
          "device_to_host_pinned": _gbps(torch, pinned, dev, repeats),
          "host_to_device_pageable": _gbps(torch, dev, pageable, repeats),
          "device_to_host_pageable": _gbps(torch, pageable, dev, repeats)}


def probe(bandwidth: bool = False, build: bool = False, ops: bool = True, size_mb: int = 64) -> dict[str, object]:
  """The torch/DeepSpeed report (module docstring) as a JSON-able dict; {'error': ...} when torch cannot load.

  Args:
    bandwidth: time the CUDA copies (`size_mb` MiB each); 'n/a' entries without a device.
    build: build the CPU Adam op first when it is not built (minutes); default: only report.
    ops: report the CPU Adam op at all (False: devices only, what the CPU-fallback check needs).
  """
  t0 = min(time.time(), _STARTED)
  try:
    import torch  # torch inside the probe: a failed import is reported in the JSON
  except Exception as exc:  # not installed or broken: said, not raised
    return {"error": f"import torch failed: {type(exc).__name__}: {exc}"}
  from importlib import metadata
  cuda = torch.cuda.is_available()
  out: dict[str, object] = {
      "torch": torch.__version__, "built_for_cuda": torch.version.cuda, "cuda_available": cuda,
      "devices": _devices(torch) if cuda else [],
      "cudnn": torch.backends.cudnn.version() if cuda else None,
      "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
      "thread_settings": thread_settings(torch), "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}
  try:
    out["deepspeed"] = metadata.version("deepspeed")
  except metadata.PackageNotFoundError:
    out["deepspeed"] = None
  out["deepspeed_accelerator"] = "cuda" if cuda else "cpu (DS_ACCELERATOR=cpu, as the DeepSpeed side sets it)"
  if ops and out["deepspeed"]:
    out["cpu_adam"] = cpu_adam_state(build)
  if bandwidth:
    out["bandwidth"] = _bandwidth(torch, size_mb)
  out["probe_s"] = round(time.time() - t0, 2)
  return out


def main(argv: list[str] | None = None) -> int:
  """`python -m torch_impl.doctor`: prints what torch and DeepSpeed see on this machine as one JSON object (run by
  harness/doctor.py in its own process). Returns the exit code: 0."""
  ap = argparse.ArgumentParser(prog="python -m torch_impl.doctor", description="what torch/DeepSpeed see, as JSON")
  ap.add_argument("--bandwidth", action="store_true", help="time pinned/pageable host <-> CUDA device copies")
  ap.add_argument("--build", action="store_true", help="build DeepSpeed's CPU Adam op if it is not built")
  ap.add_argument("--devices-only", action="store_true", help="skip the op check (the CPU-fallback check)")
  ap.add_argument("--size-mb", type=int, default=64, help="MiB per bandwidth copy (default 64)")
  args = ap.parse_args(argv)
  if not args.devices_only:
    build_environ(os.environ)  # the op folder every worker builds into
  print(json.dumps(probe(args.bandwidth, args.build, not args.devices_only, args.size_mb)), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
