"""FSDP2 side part: the project's FSDP2 trainer (torch_impl.fsdp.FsdpTrainer) on one RunSpec.

  python -m benchmarks.gpu_parts.fsdp_train --spec RUN.json --json OUT [--steps 3] [--warmup 1] [--fast-init]

Builds the trainer as `parity compare`'s FSDP2 worker does (torch_impl.fsdp_side.FsdpSide.build: `fully_shard` on
every block and the root over a one-rank device mesh, the run's `fsdp` plan: CPUOffloadPolicy where it offloads,
MixedPrecisionPolicy for bf16, the for-loop AdamW), runs --warmup untimed and --steps timed optimizer steps
(`FsdpTrainer.step`: forward, backward, reduce-scatter, clipping, the optimizer step; a CUDA synchronize around
each) on random token ids, and reports step seconds, tokens/s, the peak device bytes of the steps
(torch.cuda.max_memory_allocated, reset after the trainer is built; the build's own peak beside it), the peak host
RSS from the build on (VmHWM reset, then read), the trainer's state bytes per memory kind (torch_impl.memory) and the
FSDP2 settings as built (`FsdpTrainer.describe`). Its process group (torch.distributed, gloo on the CPU, nccl and
gloo on CUDA: torch_impl.fsdp.device_mesh) meets over a loopback socket even with one rank. Never imports jax.
"""
from __future__ import annotations

import sys
import time


from benchmarks.gpu_parts.common import (fast_params, part_parser, peak_rss_bytes, read_spec, reset_peak_rss,
                                         timed_steps, timing, write_json)
from parity.weights import init_params, n_params


def measure(run, steps: int, warmup: int, fast_init: bool) -> dict:
  """Builds the FSDP2 trainer and times its steps; returns the figures of the module docstring."""
  import torch
  from torch_impl import memory  # the framework: torch after the benchmark set its env
  from torch_impl.fsdp import FsdpTrainer

  t0 = time.perf_counter()
  params = fast_params(run.model) if fast_init else init_params(run.model, run.train.seed)
  init_s = time.perf_counter() - t0
  reset_peak_rss()
  t0 = time.perf_counter()
  trainer = FsdpTrainer(run, params)
  del params
  build_s = time.perf_counter() - t0
  dev = trainer.device
  cuda = dev.type == "cuda"
  sync = torch.cuda.synchronize if cuda else (lambda: None)
  build_peak = int(torch.cuda.max_memory_allocated(dev)) if cuda else None
  if cuda:
    torch.cuda.reset_peak_memory_stats(dev)
  t = run.train
  shape = (t.grad_accum_steps, t.micro_batch_size // trainer.world, t.seq_len + 1)
  times, metrics = timed_steps(trainer.step, run.model.vocab_size, shape, steps, warmup, sync, probe_first=True)
  tokens = t.grad_accum_steps * t.micro_batch_size * t.seq_len
  tim = timing(times)
  info = trainer.describe()
  return {
      "side": "fsdp", "backend": dev.type, "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
      "world": trainer.world, "n_params": n_params(run.model), "tokens_per_step": tokens, "step_s": times, **tim,
      "tokens_per_s": tokens / tim["median_s"], "loss": metrics.get("loss"), "init_s": init_s, "build_s": build_s,
      "peak_device_bytes": int(torch.cuda.max_memory_allocated(dev)) if cuda else None,
      "peak_device_bytes_build": build_peak,
      "device_bytes_limit": int(torch.cuda.get_device_properties(dev).total_memory) if cuda else None,
      "peak_host_rss_bytes": peak_rss_bytes(),
      "state_bytes_by_memory_kind": memory.by_memory_kind(trainer.state_bytes()),
      "optimizer": f"{info['optimizer']['optimizer']} ({info['optimizer']['implementation']})",
      "fsdp": info["fsdp"],
  }


def main(argv: list[str] | None = None) -> int:
  args = part_parser(__doc__).parse_args(argv)
  run = read_spec(args.spec)
  res = measure(run, args.steps, args.warmup, args.fast_init)
  import torch
  import torch.distributed as dist
  res["versions"] = {"torch": torch.__version__}
  write_json(args.json, {**res, "complete": True})
  if dist.is_initialized():
    dist.destroy_process_group()
  return 0


if __name__ == "__main__":
  sys.exit(main())
