"""JAX side part: the project's jitted training step (jax_impl.step.Trainer) on one RunSpec.

  python -m benchmarks.gpu_parts.jax_train --spec RUN.json --json OUT [--steps 3] [--warmup 1] [--fast-init]

Builds the Trainer as `parity compare`'s JAX worker does (init weights -> Trainer.build -> compile), runs
--warmup untimed and --steps timed optimizer steps on random token ids, and reports: step seconds (median),
tokens/s (micro batch x grad accum x seq_len / median step), peak device bytes (the allocator's
`peak_bytes_in_use`; None on CPU), peak host RSS from after the weights were drawn (VmHWM reset, then read),
state bytes per memory kind, and the host<->device bytes per step the compiled step moves for offloaded state
(`Trainer.offload_evidence`, from its S(5) entry buffers). --fast-init fills the state with constants in place,
one leaf per jitted program (largest-model probes: values change neither memory nor time; no numpy copy of the
weights, so the host holds the state once). The compiled step's device peak (its
memory_analysis: argument + output + temp - alias, common.compiled_device_peak) comes beside the allocator's: on a
TPU `peak_bytes_in_use` leaves the program's temporaries out.

  python -m benchmarks.gpu_parts.jax_train --spec RUN.json --json OUT --grad-accum 1,8 [...]

times one model and plan at several gradient accumulations in one process (the TPU flow's grid: one build, one
compile per accumulation; the state is the same, only the batch's leading axis changes): {'runs': [one record per
accumulation: tokens/s, step time, compile seconds, compiled device peak, bytes moved per step, or its error], and
the figures the runs share}. A compile that XLA refuses for memory is recorded for its accumulation and the next one
is tried; a step that fails ends the part's runs (its donated state is gone). Never imports torch.
"""
from __future__ import annotations

import sys
import time


from benchmarks.gpu_parts.by_compile import classify_compile_error
from benchmarks.gpu_parts.common import (classify_failure, compiled_device_peak, fast_value, part_parser,
                                         peak_rss_bytes, read_spec, reset_peak_rss, tail, timed_steps, timing,
                                         write_json)
from parity.weights import init_params, n_params


RUNTIME_STATS = ("bytes_in_use", "peak_bytes_in_use", "bytes_reserved", "peak_bytes_reserved", "bytes_limit",
                 "largest_alloc_size")
"""The device's `memory_stats()` the record keeps (`device_memory_stats`): on a TPU the allocator's bytes in use
leave out the region the runtime reserves for the loaded program's temporaries (`bytes_reserved`), so what the
device holds during the step is the two together (parity.protocol.memory_figures.runtime_device_bytes)."""


def _moves(trainer) -> dict:
  """The compiled step's offload moves per option, their sum, and its compiled device peak."""
  evidence = trainer.offload_evidence()
  moved = {g: evidence[g] for g in ("offload_params", "offload_opt_state") if g in evidence}
  return {"offload_moves": moved, "moved_bytes_per_step": sum(v["moved_bytes_per_step"] for v in moved.values()),
          "memory_analysis": dict(trainer.memory_analysis), "compiled": compiled_device_peak(trainer.memory_analysis)}


def filled_trainer(run):
  """A Trainer of `run` whose state is made in place by jitted fills, one leaf per program where it is large
  (`jax_impl.offload.materialize`): the weights constants (norm scales 1, biases 0, the rest init_std, as
  `fast_params`, rounded to the compute dtype as Trainer.build rounds bf16/fp16 masters), the optimizer state its
  init. No weights pass through numpy, so the host holds the state once, in
  its own memory kind (a probe's bound on a host that must also hold the offloaded state: sizing.FAST_BUILD_COPIES)."""
  import jax
  import jax.numpy as jnp
  from benchmarks.gpu_parts.jax_largest import abstract_trainer
  from jax_impl.model import compute_dtype
  from jax_impl.offload import TrainState, materialize
  trainer = abstract_trainer(run)
  shapes = trainer.state.params
  half = compute_dtype(run.train.precision)  # bf16/fp16 masters start rounded (parity.weights.master_weights)

  def value(path, a):
    last = str(getattr(path[-1], "key", path[-1]))
    return jnp.full(a.shape, jnp.asarray(fast_value(run.model, last == "scale", last == "bias"), half), a.dtype)

  params = materialize(lambda: jax.tree_util.tree_map_with_path(value, shapes), trainer.shardings.params)
  zeros = lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
  opt_state = materialize(lambda: trainer.tx.init(zeros()), trainer.shardings.opt_state)
  trainer.state = TrainState(params=params, opt_state=opt_state)
  return trainer


def build(run, fast_init: bool):
  """(Trainer, init seconds, build seconds) with the peak RSS reset after the weights were made (--fast-init: the
  state filled in place, `filled_trainer`; its seconds are the build's)."""
  from jax_impl.step import Trainer  # the framework: jax is imported after the benchmark set its flags
  if fast_init:
    reset_peak_rss()
    t0 = time.perf_counter()
    return filled_trainer(run), 0.0, time.perf_counter() - t0
  t0 = time.perf_counter()
  params = init_params(run.model, run.train.seed)
  init_s = time.perf_counter() - t0
  reset_peak_rss()
  t0 = time.perf_counter()
  trainer = Trainer.build(run, params)
  return trainer, init_s, time.perf_counter() - t0


def shared(trainer, run, init_s: float, build_s: float) -> dict:
  """The figures every run of one process shares: device, params, state per memory kind, peaks so far."""
  import jax
  from jax_impl import offload  # the framework: jax is imported after the benchmark set its flags
  dev = trainer.placement.mesh.devices.flat[0]
  stats = dev.memory_stats() or {}
  return {"side": "jax", "backend": jax.default_backend(), "device": dev.device_kind, "n_params": n_params(run.model),
          "init_s": init_s, "build_s": build_s,
          "peak_device_bytes": int(stats["peak_bytes_in_use"]) if "peak_bytes_in_use" in stats else None,
          "device_bytes_limit": int(stats["bytes_limit"]) if "bytes_limit" in stats else None,
          "peak_host_rss_bytes": peak_rss_bytes(),
          "device_memory_stats": {k: int(stats[k]) for k in RUNTIME_STATS if k in stats},
          "state_bytes_by_memory_kind": offload.bytes_by_memory_kind(trainer.state, dev)}


def measure(run, steps: int, warmup: int, fast_init: bool, on_compiled=None) -> dict:
  """Builds, compiles and times the step; returns the figures of the module docstring. `on_compiled(record)` gets
  what is known once the step compiled (its memory and moves), before any step runs: main writes it as the
  incomplete record, so a process killed during its steps (the host out of memory) still says what it planned."""
  trainer, init_s, build_s = build(run, fast_init)
  t = run.train
  shape = (t.grad_accum_steps, t.micro_batch_size, t.seq_len + 1)
  trainer.compile(shape, None)
  if on_compiled:
    on_compiled({**shared(trainer, run, init_s, build_s), "compile_s": trainer.compile_s, **_moves(trainer)})
  times, metrics = timed_steps(trainer.step, run.model.vocab_size, shape, steps, warmup)
  tokens = t.grad_accum_steps * t.micro_batch_size * t.seq_len
  tim = timing(times)
  return {**shared(trainer, run, init_s, build_s), "tokens_per_step": tokens, "step_s": times, **tim,
          "tokens_per_s": tokens / tim["median_s"], "loss": metrics.get("loss"), "compile_s": trainer.compile_s,
          **_moves(trainer)}


def _one_accumulation(trainer, run, ga: int, steps: int, warmup: int) -> tuple[dict, bool]:
  """(record, the state is still usable) of one gradient accumulation: compile, then time."""
  t = run.train
  shape = (ga, t.micro_batch_size, t.seq_len + 1)
  rec = {"grad_accum": ga, "tokens_per_step": ga * t.micro_batch_size * t.seq_len}
  t0 = time.perf_counter()
  try:
    trainer.compile(shape, None)
  except Exception as exc:  # XLA refused it (a TPU: RESOURCE_EXHAUSTED at compile time): recorded, the next is tried
    text = f"{type(exc).__name__}: {exc}"
    return {**rec, "status": classify_compile_error(text), "error": tail(text, 4, 600)}, True
  rec.update(compile_s=time.perf_counter() - t0, **_moves(trainer))
  try:
    times, metrics = timed_steps(trainer.step, run.model.vocab_size, shape, steps, warmup)
  except Exception as exc:  # the donated state may be gone: no further accumulation runs
    text = f"{type(exc).__name__}: {exc}"
    return {**rec, "status": "oom" if classify_failure(1, text, False) == "oom" else "error",
            "error": tail(text, 4, 600)}, False
  tim = timing(times)
  return {**rec, "status": "ok", "step_s": times, **tim, "tokens_per_s": rec["tokens_per_step"] / tim["median_s"],
          "loss": metrics.get("loss")}, True


def measure_grid(run, grad_accums: list[int], steps: int, warmup: int, fast_init: bool) -> dict:
  """One build, then each gradient accumulation compiled and timed (module docstring)."""
  trainer, init_s, build_s = build(run, fast_init)
  runs = []
  for ga in grad_accums:
    rec, usable = _one_accumulation(trainer, run, ga, steps, warmup)
    runs.append(rec)
    if not usable:
      break
  return {**shared(trainer, run, init_s, build_s), "micro_batch": run.train.micro_batch_size,
          "seq_len": run.train.seq_len, "runs": runs}


def main(argv: list[str] | None = None) -> int:
  ap = part_parser(__doc__)
  ap.add_argument("--grad-accum", help="comma-separated accumulations to time in this process (the grid)")
  args = ap.parse_args(argv)
  run = read_spec(args.spec)
  import jax
  if args.grad_accum:
    gas = [int(x) for x in args.grad_accum.split(",") if x.strip()]
    res = measure_grid(run, gas, args.steps, args.warmup, args.fast_init)
  else:
    res = measure(run, args.steps, args.warmup, args.fast_init,
                  on_compiled=lambda rec: write_json(args.json, {**rec, "phase": "compiled", "complete": False}))
  res["versions"] = {"jax": jax.__version__}
  write_json(args.json, {**res, "complete": True})
  return 0


if __name__ == "__main__":
  sys.exit(main())
