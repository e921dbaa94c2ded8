"""DeepSpeed side part: the project's engine (torch_impl.engine.DeepSpeedTrainer) on one RunSpec.

  python -m benchmarks.gpu_parts.ds_train --spec RUN.json --json OUT [--steps 3] [--warmup 1] [--fast-init]
  python -m benchmarks.gpu_parts.ds_train --build-op --json OUT      # load (or JIT-build) cpu_adam, timed

Builds the engine as `parity compare`'s DeepSpeed worker does (ds_config from the RunSpec: ZeRO stage, offload,
bf16, DeepSpeedCPUAdam under offload_optimizer), runs --warmup untimed and --steps timed optimizer steps
(`torch_step`: forward, engine.backward, engine.step; a CUDA synchronize around each) on random token ids, and
reports step seconds, tokens/s, the peak device bytes of the steps (torch.cuda.max_memory_allocated, reset
after the engine is built; the build's own peak beside it), the peak host RSS from the engine build on (VmHWM
reset, then read) and the engine's state bytes per memory kind (torch_impl.memory). Without CUDA the engine runs
on DeepSpeed's CPU accelerator (DS_ACCELERATOR=cpu, set by torch_impl.engine.setup_distributed). Never imports jax.
"""
from __future__ import annotations

import sys
import time


from benchmarks.gpu_parts.common import (fast_params, part_parser, peak_rss_bytes, read_spec, reset_peak_rss,
                                         timed_steps, timing, write_json)
from parity.weights import init_params, n_params


def measure(run, steps: int, warmup: int, fast_init: bool, torch_adam: bool = False) -> dict:
  """Builds the engine and times its steps; returns the figures of the module docstring. torch_adam: the config's
  optimizer gets `torch_adam: true` (torch.optim.AdamW instead of DeepSpeed's FusedAdam, whose CUDA op needs nvcc
  and a JIT build of minutes); ignored under offload_optimizer, where DeepSpeedCPUAdam runs."""
  import torch
  from torch_impl import memory, ops  # the framework: torch/DeepSpeed after the benchmark set its env
  from torch_impl.engine import DeepSpeedTrainer, ds_config, optimizer_classes

  t0 = time.perf_counter()
  params = fast_params(run.model) if fast_init else init_params(run.model, run.train.seed)
  init_s = time.perf_counter() - t0
  config = ds_config(run)
  torch_adam = torch_adam and run.deepspeed.offload_optimizer == "none"
  if torch_adam:
    config["optimizer"]["params"]["torch_adam"] = True
  reset_peak_rss()
  t0 = time.perf_counter()
  trainer = DeepSpeedTrainer(run, params, config)
  del params
  build_s = time.perf_counter() - t0
  cuda = trainer.device.type == "cuda"
  sync = torch.cuda.synchronize if cuda else (lambda: None)
  build_peak = int(torch.cuda.max_memory_allocated(trainer.device)) if cuda else None
  if cuda:
    torch.cuda.reset_peak_memory_stats(trainer.device)
  t = run.train
  shape = (t.grad_accum_steps, t.micro_batch_size, t.seq_len + 1)
  times, metrics = timed_steps(trainer.step, run.model.vocab_size, shape, steps, warmup, sync, probe_first=True)
  tokens = t.grad_accum_steps * t.micro_batch_size * t.seq_len
  tim = timing(times)
  return {
      "side": "deepspeed", "backend": trainer.device.type,
      "device": torch.cuda.get_device_name(trainer.device) if cuda else "cpu",
      "n_params": n_params(run.model), "tokens_per_step": tokens, "step_s": times, **tim,
      "tokens_per_s": tokens / tim["median_s"], "loss": metrics.get("loss"),
      "init_s": init_s, "build_s": build_s, "op_build_s": ops.build_s(),
      "peak_device_bytes": int(torch.cuda.max_memory_allocated(trainer.device)) if cuda else None,
      "peak_device_bytes_build": build_peak,
      "device_bytes_limit": int(torch.cuda.get_device_properties(trainer.device).total_memory) if cuda else None,
      "peak_host_rss_bytes": peak_rss_bytes(),
      "state_bytes_by_memory_kind": memory.by_memory_kind(trainer.state_bytes()),
      "zero_stage": trainer.engine.zero_optimization_stage(),
      "optimizer": optimizer_classes(trainer.engine)["optimizer"] + (" (torch_adam)" if torch_adam else ""),
  }


def build_op() -> dict:
  """Loads DeepSpeed's cpu_adam op, JIT-building it on first use (torch_impl.ops.build_ops)."""
  from torch_impl import ops  # the framework: torch/DeepSpeed after the benchmark set its env
  t0 = time.perf_counter()
  took = ops.build_ops(["cpu_adam"], say=lambda m: print(m, flush=True))
  return {"part": "ds_build_op", "ops_s": took, "wall_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
  ap = part_parser(__doc__, spec_required=False)
  ap.add_argument("--build-op", action="store_true", help="only load/build cpu_adam")
  ap.add_argument("--torch-adam", action="store_true", help="no offload: torch.optim.AdamW, not FusedAdam")
  args = ap.parse_args(argv)
  if args.build_op:
    write_json(args.json, build_op())
    return 0
  if not args.spec:
    ap.error("--spec is required (or --build-op)")
  run = read_spec(args.spec)
  res = measure(run, args.steps, args.warmup, args.fast_init, args.torch_adam)
  import deepspeed
  import torch
  res["versions"] = {"torch": torch.__version__, "deepspeed": deepspeed.__version__}
  write_json(args.json, {**res, "complete": True})
  return 0


if __name__ == "__main__":
  sys.exit(main())
