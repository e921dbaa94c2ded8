"""JAX side part: the project's jitted training step (jax_impl.step.Trainer) on one RunSpec.

  python -m benchmarks.gpu_parts.jax_train --spec RUN.json --json OUT [--steps 3] [--warmup 1] [--fast-init]

Builds the Trainer as `parity compare`'s JAX worker does (init weights -> Trainer.build -> compile), runs
--warmup untimed and --steps timed optimizer steps on random token ids, and reports: step seconds (median),
tokens/s (micro batch x grad accum x seq_len / median step), peak device bytes (the allocator's
`peak_bytes_in_use`; None on CPU), peak host RSS from after the weights were drawn (VmHWM reset, then read),
state bytes per memory kind, and the host<->device bytes per step the compiled step moves for offloaded state
(`Trainer.offload_evidence`, from its S(5) entry buffers). --fast-init fills the weights with constants
(largest-model probes: values change neither memory nor time). Never imports torch.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from benchmarks.gpu_parts.common import (peak_rss_bytes, fast_params, read_spec, reset_peak_rss, timing,
                                         write_json)
from parity.weights import init_params, n_params


def measure(run, steps: int, warmup: int, fast_init: bool) -> dict:
  """Builds, compiles and times the step; returns the figures of the module docstring."""
  import jax
  from jax_impl import offload  # the framework: jax is imported after the benchmark set its flags
  from jax_impl.step import Trainer  # the framework: jax is imported after the benchmark set its flags

  t0 = time.perf_counter()
  params = fast_params(run.model) if fast_init else init_params(run.model, run.train.seed)
  init_s = time.perf_counter() - t0
  reset_peak_rss()
  t0 = time.perf_counter()
  trainer = Trainer.build(run, params)
  del params
  build_s = time.perf_counter() - t0
  t = run.train
  shape = (t.grad_accum_steps, t.micro_batch_size, t.seq_len + 1)
  trainer.compile(shape, None)
  rng = np.random.default_rng(0)
  times, metrics = [], {}
  for i in range(warmup + steps):
    batch = rng.integers(0, run.model.vocab_size, shape).astype(np.uint16)
    s0 = time.perf_counter()
    metrics = trainer.step(batch)
    if i >= warmup:
      times.append(time.perf_counter() - s0)
  dev = trainer.placement.mesh.devices.flat[0]
  stats = dev.memory_stats() or {}
  evidence = trainer.offload_evidence()
  moved = {g: evidence[g] for g in ("offload_params", "offload_opt_state") if g in evidence}
  tokens = t.grad_accum_steps * t.micro_batch_size * t.seq_len
  tim = timing(times)
  return {
      "side": "jax", "backend": jax.default_backend(), "device": dev.device_kind,
      "n_params": n_params(run.model), "tokens_per_step": tokens, "step_s": times, **tim,
      "tokens_per_s": tokens / tim["median_s"], "loss": metrics.get("loss"),
      "init_s": init_s, "build_s": build_s, "compile_s": trainer.compile_s,
      "peak_device_bytes": int(stats["peak_bytes_in_use"]) if "peak_bytes_in_use" in stats else None,
      "device_bytes_limit": int(stats["bytes_limit"]) if "bytes_limit" in stats else None,
      "peak_host_rss_bytes": peak_rss_bytes(),
      "state_bytes_by_memory_kind": offload.bytes_by_memory_kind(trainer.state, dev),
      "offload_moves": moved,
      "moved_bytes_per_step": sum(v["moved_bytes_per_step"] for v in moved.values()),
      "memory_analysis": trainer.memory_analysis,
  }


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--spec", required=True, help="RunSpec JSON (parity.spec.to_dict)")
  ap.add_argument("--json", required=True)
  ap.add_argument("--steps", type=int, default=3)
  ap.add_argument("--warmup", type=int, default=1)
  ap.add_argument("--fast-init", action="store_true")
  args = ap.parse_args(argv)
  run = read_spec(args.spec)
  import jax
  res = measure(run, args.steps, args.warmup, args.fast_init)
  res["versions"] = {"jax": jax.__version__}
  write_json(args.json, res)
  return 0


if __name__ == "__main__":
  sys.exit(main())
