"""What each rerun of a comparison finds, from what its workers left: the noise envelope (`envelope_result`), the
host-CPU backend rerun (`backend_result`), determinism (`determinism_outcome`) and resume (`resume_outcome`), each with
its report.json section. Pure: the pipeline runs the reruns (parity.pipeline.reruns) and calls these on their
outputs; parity.report.reverify calls the same functions on a finished folder's rerun files, so a report is
re-verified by the very code that wrote it."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Protocol

from parity.numerics.adam import adam_step_sum
from parity.spec import RunSpec
from parity.verdict.backend import BACKEND_METRICS, backend_pair_check, backend_shift_check, one_backend_check, shifts
from parity.verdict.check import Check
from parity.verdict.envelope import ENVELOPE_METRICS, envelope_check, envelope_params_check, rerun_differences
from parity.verdict.gating import ALWAYS_REPORTED_ONLY
from parity.verdict.params import param_ratios
from parity.verdict.steps import repeat_check, steps_by_index
from parity.verdict.tolerances import envelope_rule

__all__ = ["SideOutcome", "RerunContext", "RerunResult", "envelope_result", "backend_result", "determinism_outcome",
           "determinism_section", "resume_outcome", "resume_section", "side_device"]


class SideOutcome(Protocol):
  """What these functions read of a rerun worker as the harness saw it (parity.protocol.outputs.SideRun)."""
  status: str
  error: str | None
  wall_s: float
  summary: dict


@dataclasses.dataclass(frozen=True)
class RerunContext:
  """What every rerun needs of the main run: its folder, spec, run id, per-side limit (seconds), initial weights
  (canonical name -> float32 array) and the collected sides ({side: {status, steps, final, moments, ...}}:
  parity.pipeline.collect.collect_sides, or parity.report.reverify from a finished folder)."""
  run_dir: Path
  spec: RunSpec
  run_id: str | None
  timeout_s: float
  init: dict[str, Any]
  side_data: dict[str, dict[str, Any]]

  @property
  def ok_sides(self) -> list[str]:
    return [s for s, d in self.side_data.items() if d["status"] == "ok"]


@dataclasses.dataclass
class RerunResult:
  """One rerun's outcome. checks: its Checks. section: its report.json section (None: not run). busy_s: seconds its
  workers spent (init + compile + train of a finished one, the harness's wall time otherwise). decides: (metric, a, b)
  of the main checks its checks replace in the verdict. interrupted: the Ctrl-C that stopped it, if any."""
  checks: list[Check] = dataclasses.field(default_factory=list)
  section: Any = None
  busy_s: float = 0.0
  decides: set = dataclasses.field(default_factory=set)
  interrupted: KeyboardInterrupt | None = None

  def count(self, sr: SideOutcome) -> None:
    """Adds a rerun worker's busy seconds, counted as build_report counts the main runs."""
    summ = sr.summary or {}
    own = sum(float(summ.get(k) or 0.0) for k in ("init_s", "compile_s", "train_s"))
    self.busy_s += own if sr.status == "ok" else sr.wall_s


def side_device(ctx: RerunContext, side: str) -> str:
  """The device name a main-run side recorded (summary.json device), '' when none."""
  return str(ctx.side_data[side].get("device") or "")


def backend_result(ctx: RerunContext, outputs: dict[str, tuple[SideOutcome, list[dict]]]) -> RerunResult:
  """The backend checks and section from each accelerator side's CPU rerun (what parity.pipeline.reruns.backend_reruns
  computes, and what parity.report.reverify recomputes from run_dir/backend/): a 'backend_shift' check per side, and
  per pair with a shift a '<metric>_backend' check that decides the pair's table check, and a '<metric>_one_backend'
  check of the pair on the host CPU alone (parity.verdict.backend). A rerun that did not finish
  gets a failing 'backend_rerun' check (its pairs keep the table, which then FAILs or PASSes as measured on one
  CPU)."""
  res, precision = RerunResult(), ctx.spec.train.precision
  shift: dict[str, dict[str, dict[int, float]]] = {}
  on_cpu: dict[str, list[dict]] = {}
  runs = {}
  for side, (sr, steps) in outputs.items():
    runs[side] = {"status": sr.status, "error": sr.error, "device": side_device(ctx, side)}
    if sr.status != "ok":
      res.checks.append(Check(name=f"backend_rerun {side}", metric="backend_rerun", sides=(side, f"{side}#cpu"),
                              value=float("nan"), tolerance=0.0, passed=False,
                              detail=f"the host-CPU rerun of {side} did not finish ({sr.status}): {sr.error}",
                              reason="A pair on two backends is judged by the accelerator side's measured shift."))
      continue
    shift[side] = shifts(ctx.side_data[side]["steps"], steps)
    on_cpu[side] = list(steps)
    for metric in BACKEND_METRICS:  # every metric whose pair bound takes the shift has the shift bounded
      c = backend_shift_check(side, runs[side]["device"], shift[side][metric], precision, metric,
                              steps_by_index(ctx.side_data[side]["steps"], metric))
      if c is not None:
        res.checks.append(c)
  names, data = list(ctx.side_data), ctx.side_data
  for i, a in enumerate(names):
    for b in names[i + 1:]:
      if not ({a, b} & set(shift)) or data[a]["status"] != "ok" or data[b]["status"] != "ok":
        continue
      for metric in BACKEND_METRICS:
        c = backend_pair_check(metric, a, data[a]["steps"], b, data[b]["steps"],
                               {s: shift[s][metric] for s in (a, b) if s in shift}, precision)
        if c is not None:
          res.checks.append(c)
          res.decides.add((metric, a, b))
        one = one_backend_check(metric, a, on_cpu.get(a, data[a]["steps"]), b, on_cpu.get(b, data[b]["steps"]),
                                sorted(on_cpu), precision)  # a pair reaches here only with a rerun side
        if one is not None:
          res.checks.append(one)
  res.section = {"method": "each side that ran on an accelerator, rerun on the host CPU with the same request, "
                           "batches and weights (JAX_PLATFORMS=cpu)", "runs": runs,
                 "sides": {s: {"steps": sorted(v["loss"]), "abs_loss_shift": [v["loss"][k] for k in sorted(v["loss"])]}
                           for s, v in shift.items()}}
  return res


def envelope_result(ctx: RerunContext, outputs: dict[str, tuple[SideOutcome, list[dict], dict | None]]) -> RerunResult:
  """The noise-envelope checks and section from each finished side's reduction-order rerun: what
  parity.pipeline.reruns.noise_envelope computes once the reruns ran, and what parity.report.reverify recomputes from
  run_dir/noise/ (no process started).

  Args:
    outputs: side -> (its rerun's SideRun, StepRecords, final params or None; parity.protocol.outputs.side_outputs)
      for each side of ctx.ok_sides, in that order.
  Returns:
    RerunResult (busy_s 0): a side whose rerun did not finish gets a failing 'noise_rerun' check (its pairs keep the
    fixed table: the verdict never silently falls back to it). Section: {method, rule, runs: {side: {status,
    wall_s, error}}, sides: {side: {steps, abs_loss_diff, grad_norm_rel_diff, params_ratio_max}}}.
  """
  res, rule = RerunResult(), envelope_rule(ctx.spec.train.precision)
  env: dict[str, dict[str, dict]] = {m: {} for m in ENVELOPE_METRICS}
  penv: dict[str, dict[str, float]] = {}
  runs = {}
  for side, (sr, noise_steps, noise_final) in outputs.items():
    runs[side] = {"status": sr.status, "wall_s": sr.wall_s, "error": sr.error}
    if sr.status != "ok":
      res.checks.append(Check(name=f"noise_rerun {side}", metric="noise_rerun", sides=(side, f"{side}#noise"),
                              value=float("nan"), tolerance=0.0, passed=False,
                              detail=f"the reduction-order rerun of {side} did not finish ({sr.status}): {sr.error}; "
                                     "its pairs have no noise envelope",
                              reason="The bf16/fp16 verdict rests on each side's noise envelope."))
      continue
    for metric, diffs in rerun_differences(ctx.side_data[side]["steps"], noise_steps).items():
      env[metric][side] = diffs
    if ctx.side_data[side]["final"] is not None and noise_final is not None:
      penv[side] = param_ratios(ctx.side_data[side]["final"], noise_final, ctx.init, ctx.spec.model)
  res.section = {
      "method": "each side rerun with every step's micro batches in reverse order and every micro batch's rows "
                "reordered (reversed; on several ranks dealt across them first, so every rank sums other rows: "
                "harness.self_runs.noise_row_order); the same loss and gradient in exact arithmetic, only the "
                "reduction order changes",
      "rule": dataclasses.asdict(rule), "runs": runs,
      "sides": {s: {"steps": sorted(e), "abs_loss_diff": [e[k] for k in sorted(e)],
                    "grad_norm_rel_diff": [env["grad_norm"][s].get(k) for k in sorted(e)],
                    "params_ratio_max": max(penv[s].values()) if penv.get(s) else None}
                for s, e in env["loss"].items()}}
  _envelope_checks(ctx, env, penv, rule, res)
  return res


def _envelope_checks(ctx: RerunContext, env: dict, penv: dict, rule, res: RerunResult) -> None:
  """Each pair of sides whose reruns both finished: its envelope checks (per-step metrics, then params)."""
  names, data = list(ctx.side_data), ctx.side_data
  for i, a in enumerate(names):
    for b in names[i + 1:]:
      if a not in env["loss"] or b not in env["loss"]:
        continue  # a rerun failed (see noise_envelope.runs): this pair keeps the fixed table
      for metric, noise in env.items():
        c = envelope_check(a, data[a]["steps"], b, data[b]["steps"], noise, rule, metric=metric)
        if c is not None:
          res.checks.append(c)
          res.decides.add((metric, a, b))
      if a in penv and b in penv:
        lr_sum = adam_step_sum([r["lr"] for r in data[a]["steps"] if not r.get("skipped")], ctx.spec.train.beta1,
                               ctx.spec.train.beta2)  # the most one Adam side can move an element
        c = envelope_params_check(a, data[a]["final"], b, data[b]["final"], ctx.init, ctx.spec.model, penv, rule,
                                  moments={s: data[s].get("moments") for s in (a, b)}, lr_sum=lr_sum,
                                  precision=ctx.spec.train.precision,
                                  adam_updates=ctx.spec.train.optimizer in ("adam", "adamw"))
        if c is not None:
          res.checks.append(c)
          res.decides.add(("params", a, b))


def determinism_outcome(ctx: RerunContext, side: str, prefix: int, again: list[dict]) -> Check:
  """One side's determinism check (reported only: parity.verdict.gating) from its repeat run's StepRecords
  (run_dir/repeat/<side>/steps.jsonl): what `repeat_and_resume` computes once the rerun ran, and what
  parity.report.reverify recomputes from the folder (no process started). prefix: steps compared (>= 1)."""
  return repeat_check("determinism", side, ctx.side_data[side]["steps"], [r for r in again if r["step"] < prefix],
                      gating="determinism" not in ALWAYS_REPORTED_ONLY)


def determinism_section(c: Check, prefix: int, repeat: SideOutcome) -> dict:
  """report.json determinism[side] for one side's determinism check."""
  return {"deterministic": c.passed, "steps_checked": prefix, "detail": c.detail, "status": repeat.status}


def resume_outcome(ctx: RerunContext, side: str, resume_at: int, repeat: SideOutcome,
                   resumed: tuple[SideOutcome, list[dict], dict | None] | None) -> Check:
  """One side's resume check (gating): the resumed run's records and final params against the main run's.

  Args:
    resume_at: the checkpoint step; repeat: the checkpointing (repeat) run's SideRun.
    resumed: (SideRun, StepRecords from resume_at + 1 on, final params or None; parity.protocol.outputs.side_outputs
      of run_dir/resume/<side>) of the resumed run, None when it did not start (the repeat run did not finish).
  """
  main = ctx.side_data[side]
  if repeat.status != "ok" or resumed is None:
    c = repeat_check("resume", side, main["steps"], [], from_step=resume_at + 1, gating=True)
    c.detail = f"the checkpointing run did not finish ({repeat.status}): {repeat.error}"
    return c
  rr, rest, final_b = resumed
  c = repeat_check("resume", side, main["steps"], rest, from_step=resume_at + 1, final_a=main["final"],
                   final_b=final_b, gating=True)
  if rr.status != "ok":
    c.passed, c.detail = False, f"the resumed run did not finish ({rr.status}): {rr.error}"
  return c


def resume_section(c: Check, resume_at: int) -> dict:
  """report.json resume[side] for one side's resume check."""
  return {"resumed_at_step": resume_at + 1, "bit_identical": c.passed, "detail": c.detail}
