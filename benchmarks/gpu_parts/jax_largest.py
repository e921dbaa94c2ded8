"""JAX part: the largest model each plan fits, and the train grid's depth, found by compiling the train step.

  python -m benchmarks.gpu_parts.jax_largest --json OUT --base RUN.json --plans zero0,scan-offload --budget-s 150 \
      [--bytes-limit N] [--host-bytes N] [--max-probes 6] [--grid-plans zero0,zero2-offload-scan --grid-ga 8 \
      --grid-micro-tokens 4096 --grid-start 11]

One process (one process at a time may hold a TPU) compiles the project's train step (jax_impl.step: make_train_step,
jitted with the state's in/out shardings and donation as Trainer.build does; `abstract_trainer`) from abstract
inputs: no weights are made, so a depth the host could not hold is compiled as easily as a small one. Each compile is
a probe (by_compile.compile_probe): XLA's refusal (RESOURCE_EXHAUSTED at compile time on a TPU) or a compiled device
peak (memory_analysis: argument + output + temp - alias) over the device's bytes_limit is "does not fit".

  * grid (when --grid-plans): the deepest model at or below --grid-start (the memory model's) at which every grid
    plan fits with the planner's 10 % reserve, at --grid-ga micro batches of --grid-micro-tokens (by_compile.fit_down).
  * largest, per plan of --plans: doubling from the memory model's prediction, then bisection to --resolution
    (sizing.search_largest), at micro batch 1; a depth whose predicted host bytes (memory model; the confirm run
    fills its state in place, sizing.FAST_BUILD_COPIES) exceed --host-bytes is not compiled ('host-limit'): the
    answer must be trainable here, and the run that confirms it (by_compile.confirm_run, started by the driver)
    needs the host.
The budget is shared out as the part goes (the grid check at most 40 %, then each plan an equal share of what is
left, at least one compile's time while the budget lasts), a probe is not started when the last compile's time is
not left, and OUT is rewritten after every probe, so a part killed at its timeout still leaves what it found. Never
imports torch.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

from benchmarks.gpu_parts import sizing
from benchmarks.gpu_parts.by_compile import FIT_BY, compile_probe, fit_down
from benchmarks.gpu_parts.common import read_spec, write_json
from parity.weights import n_params


def abstract_trainer(run):
  """A jax_impl.step.Trainer of `run` whose state is abstract (jax.ShapeDtypeStruct leaves, no buffers): the
  placement, optimizer, state shardings and jitted step as Trainer.build makes them (tests/test_gpu_bench.py checks
  that both lower to the same program), so `Trainer.compile`, `memory_analysis` and `offload_evidence` work on it."""
  import jax
  import jax.numpy as jnp
  from jax_impl import optim
  from jax_impl.model import GPT
  from jax_impl.offload import TrainState, make_placement
  from jax_impl.step import Trainer, make_train_step

  placement = make_placement(run.jax, model=run.model)  # the model: which moments a partial offload puts where
  scan = run.jax.scan_layers
  tx, schedule = optim.make_optimizer(run.model, run.train, scan_layers=scan)
  init = lambda: GPT(run.model, scan_layers=scan).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
  params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), jax.eval_shape(init))  # to_flax: fp32
  state = TrainState(params=params, opt_state=jax.eval_shape(tx.init, params))
  shardings = placement.state_shardings(state)
  step = make_train_step(run, tx, schedule, placement, shardings)
  metrics = placement.replicated()
  extra = (metrics,) if run.train.precision == "fp16" else ()  # the overflow factor
  jit_step = jax.jit(step, in_shardings=(shardings, placement.batch_sharding(), *extra),
                     out_shardings=(shardings, metrics), donate_argnums=(0,))
  return Trainer(run=run, placement=placement, state=state, shardings=shardings, jit_step=jit_step, jit_eval=None,
                 tx=tx, schedule=schedule)


def compile_step(run) -> dict[str, Any]:
  """Compiles `run`'s train step from abstract inputs; {'memory_analysis', 'n_params', 'moved_bytes_per_step' (the
  host<->device bytes of its offloaded state, Trainer.offload_evidence)}. Raises what XLA raises."""
  import jax
  t = run.train
  trainer = abstract_trainer(run)
  trainer.compile((t.grad_accum_steps, t.micro_batch_size, t.seq_len + 1), None)
  ev = trainer.offload_evidence()
  moved = sum(ev[g]["moved_bytes_per_step"] for g in ("offload_params", "offload_opt_state") if g in ev)
  out = {"memory_analysis": dict(trainer.memory_analysis), "n_params": n_params(run.model),
         "moved_bytes_per_step": moved}
  del trainer
  jax.clear_caches()  # the executables of earlier depths are not needed again in this process
  return out


def compiled_host_need(compiled_host: int, kind: str | None) -> int:
  """Host bytes a probe's confirming run needs: its compiled host buffers, plus on a TPU what the runtime holds
  beside them (sizing.tpu_host_overhead)."""
  return compiled_host + (sizing.tpu_host_overhead() if kind == "tpu" else 0)


def compiled_host_problem(compiled_host: int | None, host_bytes: int, kind: str | None) -> str | None:
  """Why a compiled step's host-memory buffers (arguments + outputs + temporaries - aliases, from its
  memory_analysis: common.compiled_device_peak's 'host_bytes') cannot be held, None when they can: over the host
  memory a process may use, less on a TPU what its runtime holds beside them (sizing.tpu_host_overhead). The
  memory model's host check comes before the compile; this one reads what XLA planned, so a host temporary the
  model does not list stops the depth here instead of the confirming run taking the machine's memory."""
  if compiled_host is None:
    return None
  overhead = compiled_host_need(compiled_host, kind) - compiled_host
  if compiled_host + overhead <= host_bytes:
    return None
  return (f"its compiled host buffers {compiled_host / 2**30:.2f} GiB"
          + (f" + {overhead / 2**30:.2f} GiB the TPU runtime holds" if overhead else "")
          + f" > the host's {host_bytes / 2**30:.2f} GiB")


@dataclasses.dataclass
class Budget:
  """The part's deadline and the last compile's seconds (a probe starts only when that much is left)."""
  deadline: float
  min_probe_s: float
  last_compile_s: float = 0.0

  def left(self, until: float | None = None) -> float:
    """Seconds to `until` (default the deadline)."""
    return min(until or self.deadline, self.deadline) - time.monotonic()

  def per_probe(self) -> float:
    """Seconds one more compile is taken to need: the last one's, at least --min-probe-s."""
    return max(self.last_compile_s, self.min_probe_s)


def grid_search(a, base, limit: int | None, budget: Budget, save) -> dict[str, Any]:
  """The train grid's depth: fit_down from --grid-start, every grid plan compiled at each depth."""
  plans = a.grid_plans.split(",")
  until = time.monotonic() + 0.4 * (budget.deadline - time.monotonic())

  def probe(n: int) -> dict[str, Any]:
    per = {}
    for plan in plans:
      run = sizing.grid_run(base, plan, a.grid_micro_tokens, a.grid_ga, n)
      per[plan] = compile_probe(lambda _n, r=run: compile_step(r), n, limit, 1 - sizing.RESERVE, a.fit_by)
      budget.last_compile_s = max(budget.last_compile_s, per[plan]["compile_s"])
      if per[plan]["status"] != "ok":
        break
    status = next((p["status"] for p in per.values() if p["status"] != "ok"), "ok")
    return {"status": status, "plans": per}

  res = fit_down(probe, a.grid_start, max_probes=a.max_probes,
                 time_left=lambda: budget.left(until) - budget.per_probe() * len(plans))
  res.update(plans=plans, grad_accum=a.grid_ga, micro_tokens=a.grid_micro_tokens, start=a.grid_start)
  save()
  return res


def largest_search(a, base, plan: str, limit: int | None, budget: Budget, until: float, save,
                   out: dict[str, Any]) -> None:
  """One plan's largest depth by compiling (doubling from the memory model's prediction, then bisection)."""
  kind = a.kind
  start = max(1, sizing.predicted_largest(base, "jax", limit, a.host_bytes, plan=plan, kind=kind,
                                          copies=sizing.FAST_BUILD_COPIES)) if limit else base.model.n_layers
  out.update(plan=plan, start=start, probes=[], start_why=(
      "the memory model's largest n_layers (micro batch 1)" if limit else "no device limit: the base's depth"))

  def probe(n: int) -> dict[str, Any]:
    run = sizing.with_plan(base, plan, micro_batch=1, n_layers=n)
    ok, why = sizing.predicted_fits(run, "jax", None, a.host_bytes, kind, sizing.FAST_BUILD_COPIES)
    if not ok:
      rec = {"status": "host-limit", "fits": None, "detail": f"not compiled: {why}", "n_params": n_params(run.model)}
      out["probes"].append({"n_layers": n, **rec})
      return rec
    rec = compile_probe(lambda _n: compile_step(run), n, limit, fit_by=a.fit_by)
    budget.last_compile_s = rec["compile_s"]
    why = compiled_host_problem(rec.get("host_bytes"), a.host_bytes, kind) if rec["status"] == "ok" else None
    if why:  # the figures let the search aim its next probe (sizing.compiler_guess)
      rec.update(status="host-limit", fits=False, detail=f"compiled, but {why}", host_allowed_bytes=a.host_bytes,
                 host_need_bytes=compiled_host_need(rec["host_bytes"], kind))
    out["probes"].append({"n_layers": n, **rec})  # saved as it goes (search_largest returns the same list)
    save()
    return rec

  res = sizing.search_largest(probe, start, max_probes=a.max_probes, min_probe_s=budget.per_probe,
                              resolution=a.resolution,
                              time_left=lambda: budget.left(until))
  out.update(res)
  if res["largest_ok"]:
    out["largest_params"] = next(p["n_params"] for p in res["probes"] if p["n_layers"] == res["largest_ok"])
  save()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--json", required=True)
  ap.add_argument("--base", required=True, help="RunSpec JSON: the width, sequence and precision searched")
  ap.add_argument("--plans", default=",".join(sizing.LARGEST_PLANS), help="plans to search (parity.sizing.plans)")
  ap.add_argument("--budget-s", type=float, default=150.0)
  ap.add_argument("--bytes-limit", type=int, help="device bytes (default: memory_stats bytes_limit)")
  ap.add_argument("--host-bytes", type=int, required=True, help="host memory a training process may use")
  ap.add_argument("--kind", default="tpu", help="the device: gpu (XLA's pinned-pool rule applies), tpu or cpu")
  ap.add_argument("--max-probes", type=int, default=6, help="per plan")
  ap.add_argument("--resolution", type=float, default=0.125,
                  help="the bisection stops when its bracket is within this share of the largest that trained")
  ap.add_argument("--min-probe-s", type=float, default=5.0, help="time a compile is assumed to take at first")
  ap.add_argument("--fit-by", default="sum", choices=FIT_BY,
                  help="what must stay within the limit: the compiled peak (sum), XLA's own peak (xla), or only "
                       "XLA's acceptance of the program (compile)")
  ap.add_argument("--grid-plans", default="", help="the train grid's plans: find its depth first")
  ap.add_argument("--grid-ga", type=int, default=max(sizing.GRID_GRAD_ACCUM))
  ap.add_argument("--grid-micro-tokens", type=int, default=sizing.GRID_MICRO_TOKENS)
  ap.add_argument("--grid-start", type=int, default=0)
  return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
  a = parse_args(argv)
  t0 = time.monotonic()
  budget = Budget(t0 + a.budget_s, a.min_probe_s)
  base = read_spec(a.base)
  import jax
  dev = jax.devices()[0]
  stats = (dev.memory_stats() or {}) if jax.default_backend() != "cpu" else {}
  limit = a.bytes_limit or stats.get("bytes_limit")
  res: dict[str, Any] = {"part": "jax_largest", "device": dev.device_kind, "backend": jax.default_backend(),
                         "bytes_limit": limit, "bytes_limit_source": "--bytes-limit" if a.bytes_limit else
                         "memory_stats" if limit else None, "host_bytes": a.host_bytes, "budget_s": a.budget_s,
                         "d_model": base.model.d_model, "seq_len": base.train.seq_len, "largest": {}}
  save = lambda: write_json(a.json, {**res, "wall_s": time.monotonic() - t0})
  save()
  if a.grid_plans and a.grid_start > 0:
    res["grid"] = grid_search(a, base, limit, budget, save)
  plans = [p for p in a.plans.split(",") if p]
  for i, plan in enumerate(plans):  # an equal share of what is left, at least one compile while the budget lasts
    now = time.monotonic()
    until = now + max((budget.deadline - now) / (len(plans) - i), budget.per_probe())
    res["largest"][plan] = {}
    largest_search(a, base, plan, limit, budget, until, save, res["largest"][plan])
  res["complete"] = True
  save()
  return 0


if __name__ == "__main__":
  sys.exit(main())
