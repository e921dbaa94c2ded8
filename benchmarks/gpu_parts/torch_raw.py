"""torch part: host<->device copy bandwidth through pinned buffers, and matmul throughput.

  python -m benchmarks.gpu_parts.torch_raw --json OUT [--mib 1024] [--n 8192] [--reps 5]

Bandwidth: `dst.copy_(src, non_blocking=True)` of --mib MiB between a pinned (page-locked) host tensor and a device
tensor, each direction, timed with a synchronize after each copy; also a pageable host source for reference.
GB/s = bytes / seconds / 1e9, best and median of --reps. Without CUDA there is no host<->device link: the figure
is a host memcpy of the same size, marked as such.
Matmul: an n x n @ n x n product in bf16, fp32 with TF32 off (torch's default) and fp32 with TF32 allowed;
FLOP/s = 2 n^3 / seconds, median of --reps after 2 warm-ups.
"""
from __future__ import annotations

import statistics
import sys
import time

from benchmarks.gpu_parts.common import raw_args, timing, write_json


def _copy_gbs(dst, src, reps: int, sync) -> dict[str, float]:
  nbytes = src.numel() * src.element_size()
  dst.copy_(src, non_blocking=True)
  sync()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    sync()
    times.append(time.perf_counter() - t0)
  return {"bytes": nbytes, "best_gbs": nbytes / min(times) / 1e9, "median_gbs": nbytes / statistics.median(times) / 1e9,
          **timing(times)}


def bandwidth(mib: int, reps: int) -> dict:
  """Pinned (and pageable) host<->device copy bandwidth, or a host memcpy without CUDA."""
  import torch
  n = mib * 2**20
  if not torch.cuda.is_available():
    a, b = torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    return {"kind": "cpu memcpy (no CUDA device: no host<->device link)",
            "host_to_host": _copy_gbs(b, a, reps, lambda: None)}
  dev, sync = torch.device("cuda"), torch.cuda.synchronize
  pinned = torch.ones(n, dtype=torch.uint8).pin_memory()
  pageable = torch.ones(n, dtype=torch.uint8)
  on_dev = torch.empty(n, dtype=torch.uint8, device=dev)
  out = {"kind": "torch pinned host <-> cuda", "device": torch.cuda.get_device_name(dev),
         "host_to_device_pinned": _copy_gbs(on_dev, pinned, reps, sync),
         "device_to_host_pinned": _copy_gbs(pinned, on_dev, reps, sync),
         "host_to_device_pageable": _copy_gbs(on_dev, pageable, reps, sync)}
  return out


def matmul(n: int, reps: int) -> dict:
  """FLOP/s of an n x n matmul per dtype mode."""
  import torch
  cuda = torch.cuda.is_available()
  dev = torch.device("cuda" if cuda else "cpu")
  sync = torch.cuda.synchronize if cuda else (lambda: None)
  out = {"n": n, "device": torch.cuda.get_device_name(dev) if cuda else "cpu"}
  modes = [("bf16", torch.bfloat16, False), ("fp32", torch.float32, False)] + ([("tf32", torch.float32, True)]
                                                                              if cuda else [])
  for name, dtype, tf32 in modes:
    torch.backends.cuda.matmul.allow_tf32 = tf32
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(2):
      a @ b
    sync()
    times = []
    for _ in range(reps):
      t0 = time.perf_counter()
      a @ b
      sync()
      times.append(time.perf_counter() - t0)
    out[name] = {"tflops": 2 * n**3 / statistics.median(times) / 1e12, **timing(times)}
  torch.backends.cuda.matmul.allow_tf32 = False
  return out


def main(argv: list[str] | None = None) -> int:
  args = raw_args(__doc__.split("\n\n")[0], argv)
  import torch
  t0 = time.perf_counter()
  res = {"part": "torch_raw", "torch": torch.__version__, "cuda": torch.version.cuda,
         "bandwidth": bandwidth(args.mib, args.reps)}
  res["matmul"] = matmul(args.n, args.reps)
  res["wall_s"] = time.perf_counter() - t0
  write_json(args.json, {**res, "complete": True})
  return 0


if __name__ == "__main__":
  sys.exit(main())
