"""The reruns of a comparison, each holding one side against itself: the noise envelope, determinism and resume.

Each rerun runs in a subfolder of the run folder (harness.self_runs) and returns a `RerunResult`: its checks, its
section of report.json and the seconds its workers were busy. A Ctrl-C or a file that cannot be written stops the
reruns; what finished is kept (`run_reruns`).

  noise_envelope  every side that finished, rerun with reversed reduction order; each pair's difference curves are
                  held against the noisier side's rerun difference (section 'noise_envelope'). In bf16/fp16 the
                  pointwise checks an envelope covers stop gating (RerunResult.decides).
  determinism     each side's first N steps rerun in a new process: bit-identical or not (reported, not gating).
  equivalence     each side trained again in an equivalent shape (--equivalence ga,ranks,packing) and held against
                  its main run (parity.pipeline.equivalence; section 'equivalence').
  resume          the same rerun saves a checkpoint at step R; a new process resumes from it; the rest of the run
                  must be bit-identical to the uninterrupted one (gating).
  backend         fp32, sides on different backends: each accelerator side rerun on the host CPU; its shift bounds
                  itself and widens its pairs' table (parity.verdict.backend; section 'backend').
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

from harness import self_runs
from harness.runner import SideRun
from parity.verdict.check import Check
from parity.verdict.envelope import ENVELOPE_METRICS, envelope_check, envelope_params_check, rerun_differences
from parity.verdict.backend import (BACKEND_METRICS, backend_pair_check, backend_shift_check, device_class,
                                    on_accelerator, shifts)
from parity.verdict.gating import ALWAYS_REPORTED_ONLY, mark_backend_decided, mark_envelope_decided
from parity.numerics.adam import adam_step_sum
from parity.verdict.params import param_ratios
from parity.verdict.steps import repeat_check, steps_by_index
from parity.pipeline.collect import side_outputs
from parity.pipeline.equivalence import run_equivalence
from parity.spec import RunSpec
from parity.verdict.tolerances import envelope_rule

__all__ = ["RerunContext", "RerunResult", "Reruns", "run_reruns", "noise_envelope", "backend_sides", "backend_reruns",
           "backend_result", "repeat_and_resume", "envelope_result",
           "determinism_outcome", "determinism_section", "resume_outcome", "resume_section"]


@dataclasses.dataclass(frozen=True)
class RerunContext:
  """What every rerun needs of the main run: its folder, spec, run id, per-side limit (seconds), initial weights
  (canonical name -> float32 array) and the collected sides (parity.pipeline.collect.collect_sides)."""
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

  def count(self, sr: SideRun) -> None:
    """Adds a rerun worker's busy seconds, counted as build_report counts the main runs."""
    summ = sr.summary or {}
    own = sum(float(summ.get(k) or 0.0) for k in ("init_s", "compile_s", "train_s"))
    self.busy_s += own if sr.status == "ok" else sr.wall_s


@dataclasses.dataclass
class Reruns:
  """All reruns of a comparison: their checks, report sections {'noise_envelope', 'determinism', 'resume'}, busy
  seconds in all, and the Ctrl-C that stopped them (re-raise it once the report is written)."""
  checks: list[Check] = dataclasses.field(default_factory=list)
  sections: dict[str, Any] = dataclasses.field(
      default_factory=lambda: {"noise_envelope": None, "determinism": {}, "resume": {}, "equivalence": {},
                               "backend": None})
  busy_s: float = 0.0
  interrupted: KeyboardInterrupt | None = None

  def add(self, name: str, result: RerunResult) -> None:
    self.checks += result.checks
    self.sections[name] = result.section if result.section is not None else self.sections[name]
    self.busy_s += result.busy_s
    self.interrupted = self.interrupted or result.interrupted


def run_reruns(ctx: RerunContext, main_checks: list[Check], *, noise: bool | None, determinism_steps: int,
               resume_at: int | None, equivalence: Sequence[str] = (), tokenizer: str | None = None) -> Reruns:
  """Runs the reruns asked for, in order noise envelope, determinism + resume, equivalence; stops at a Ctrl-C (kept
  in Reruns.interrupted) or when a rerun's files cannot be written or read (a failing 'reruns' check says why).

  Args:
    main_checks: the pairwise checks of the main runs; in bf16/fp16 those a noise-envelope check decides instead
      are marked non-gating here (their detail says so).
    noise: the noise envelope; None: only for bf16/fp16 runs of two sides or more (True: a one-side run too, the
      half of a run `parity join` joins, its side's envelope for the joined pairs).
    determinism_steps: steps of the determinism rerun (0: none); resume_at: the checkpoint step (None: no resume).
    equivalence: the --equivalence kinds (parity.pipeline.equivalence); tokenizer: the run's tokenizer folder
      (the packing rerun reads text examples again).
  """
  out, t = Reruns(), ctx.spec.train
  try:
    if backend_sides(ctx):
      result = backend_reruns(ctx)
      out.add("backend", result)
      mark_backend_decided(main_checks, result.decides)
    # one side: only when asked for (--noise-envelope), as one half of a run split over machines (parity join)
    paired_or_asked = len(ctx.side_data) > 1 or noise is True
    asked = t.precision != "fp32" if noise is None else noise
    if out.interrupted is None and asked and paired_or_asked and ctx.ok_sides:
      result = noise_envelope(ctx)
      out.add("noise_envelope", result)
      mark_envelope_decided(main_checks, result.decides, t.precision)  # the envelope decides; the table is reported
    if out.interrupted is None:
      for name, result in repeat_and_resume(ctx, determinism_steps, resume_at).items():
        out.add(name, result)
    if out.interrupted is None and equivalence and ctx.ok_sides:
      out.add("equivalence", run_equivalence(ctx, equivalence, tokenizer=tokenizer, result=RerunResult()))
    if equivalence and out.interrupted is None:
      out.checks.extend(equivalence_not_run(ctx, equivalence))
  except (OSError, ValueError) as exc:  # a rerun's files could not be written or read: its checks fail, said why
    out.checks.append(Check(name="reruns", metric="reruns", sides=tuple(ctx.spec.sides[:2]), value=float("nan"),
                            tolerance=0.0, passed=False, detail=f"the noise/determinism/resume reruns stopped: {exc}",
                            reason="A rerun that could not run cannot vouch for the verdict."))
  return out


def _device(ctx: RerunContext, side: str) -> str:
  return str(ctx.side_data[side].get("device") or "")


def backend_sides(ctx: RerunContext) -> list[str]:
  """The finished sides that ran on an accelerator in an fp32 run, unless two sides or more all ran on the same kind
  of device (the table then holds as measured): those the backend rerun holds (parity.verdict.backend). A run of one
  side gets its rerun too, so that a join with a folder from another machine (`parity join`) has the shift. In
  bf16/fp16 the noise envelope decides, far above any backend's rounding."""
  if ctx.spec.train.precision != "fp32":
    return []
  devices = {s: _device(ctx, s) for s in ctx.ok_sides}
  if len(devices) > 1 and len({device_class(d) for d in devices.values()}) < 2:
    return []  # every side on the same kind of device: the table was measured for that
  return [s for s, d in devices.items() if on_accelerator(d)]


def backend_reruns(ctx: RerunContext) -> RerunResult:
  """Reruns each accelerator side on the host CPU (harness.self_runs.run_backend) and returns `backend_result`."""
  busy, outputs = _rerun_each(ctx, backend_sides(ctx), self_runs.run_backend, self_runs.BACKEND_DIR)
  if busy.interrupted is not None:
    return busy
  res = backend_result(ctx, {s: (sr, steps) for s, (sr, steps, _) in outputs.items()})
  res.busy_s = busy.busy_s
  return res


def _rerun_each(ctx: RerunContext, sides: Sequence[str], run: Any, folder: str
                ) -> tuple[RerunResult, dict[str, tuple[SideRun, list[dict], dict | None]]]:
  """Runs `run(run_dir, side, timeout_s=...)` (a harness.self_runs rerun) for each side in turn and reads what each
  left in run_dir/<folder>/<side>: (a RerunResult holding the busy seconds, or the Ctrl-C that stopped the loop;
  side -> (its SideRun, StepRecords, final params or None))."""
  outputs: dict[str, tuple[SideRun, list[dict], dict | None]] = {}
  busy = RerunResult()
  for side in sides:
    try:
      sr, _ = run(ctx.run_dir, side, timeout_s=ctx.timeout_s)
    except KeyboardInterrupt as exc:
      busy.interrupted = exc
      return busy, outputs
    steps, final = side_outputs(ctx.run_dir / folder / side, sr, ctx.run_id, expected_steps=ctx.spec.train.steps)
    busy.count(sr)
    outputs[side] = (sr, steps, final)
  return busy, outputs


def backend_result(ctx: RerunContext, outputs: dict[str, tuple[SideRun, list[dict]]]) -> RerunResult:
  """The backend checks and section from each accelerator side's CPU rerun (what `backend_reruns` computes, and what
  parity.report.reverify recomputes from run_dir/backend/): a 'backend_shift' check per side, and per pair with a
  shift a '<metric>_backend' check that decides the pair's table check. A rerun that did not finish gets a failing
  'backend_rerun' check (its pairs keep the table, which then FAILs or PASSes as measured on one CPU)."""
  res, precision = RerunResult(), ctx.spec.train.precision
  shift: dict[str, dict[str, dict[int, float]]] = {}
  runs = {}
  for side, (sr, steps) in outputs.items():
    runs[side] = {"status": sr.status, "error": sr.error, "device": _device(ctx, side)}
    if sr.status != "ok":
      res.checks.append(Check(name=f"backend_rerun {side}", metric="backend_rerun", sides=(side, f"{side}#cpu"),
                              value=float("nan"), tolerance=0.0, passed=False,
                              detail=f"the host-CPU rerun of {side} did not finish ({sr.status}): {sr.error}",
                              reason="A pair on two backends is judged by the accelerator side's measured shift."))
      continue
    shift[side] = shifts(ctx.side_data[side]["steps"], steps)
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
  res.section = {"method": "each side that ran on an accelerator, rerun on the host CPU with the same request, "
                           "batches and weights (JAX_PLATFORMS=cpu)", "runs": runs,
                 "sides": {s: {"steps": sorted(v["loss"]), "abs_loss_shift": [v["loss"][k] for k in sorted(v["loss"])]}
                           for s, v in shift.items()}}
  return res


def equivalence_not_run(ctx: RerunContext, equivalence: Sequence[str]) -> list[Check]:
  """A failing 'reruns' check naming the --equivalence kinds asked for and the sides they were not run for (a side
  whose main run did not finish has nothing to hold an equivalent run against); [] when every side ran them. The
  report would otherwise show no equivalence row for those sides, as if none had been asked for."""
  missing = [s for s in ctx.side_data if s not in ctx.ok_sides]
  if not missing:
    return []
  why = ", ".join(f"{s} ({ctx.side_data[s]['status']})" for s in missing)
  return [Check(name="reruns", metric="reruns", sides=tuple(ctx.spec.sides[:2]), value=float("nan"), tolerance=0.0,
                passed=False, detail=f"--equivalence {','.join(equivalence)} was not run for {why}: the main run of "
                "that side did not finish, so there is nothing to hold an equivalent run against",
                reason="A check that was asked for and could not run cannot vouch for the verdict.")]


def noise_envelope(ctx: RerunContext) -> RerunResult:
  """Reruns every finished side on reversed batches and holds each pair against the noisier side's envelope
  (`envelope_result` on what the reruns left in run_dir/noise/)."""
  busy, outputs = _rerun_each(ctx, ctx.ok_sides, self_runs.run_noise, self_runs.NOISE_DIR)
  if busy.interrupted is not None:
    return busy
  res = envelope_result(ctx, outputs)
  res.busy_s = busy.busy_s
  return res


def envelope_result(ctx: RerunContext, outputs: dict[str, tuple[SideRun, list[dict], dict | None]]) -> RerunResult:
  """The noise-envelope checks and section from each finished side's reduction-order rerun: what `noise_envelope`
  computes once the reruns ran, and what parity.report.reverify recomputes from run_dir/noise/ (no process started).

  Args:
    outputs: side -> (its rerun's SideRun, StepRecords, final params or None; parity.pipeline.collect.side_outputs)
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
      "method": "each side rerun with every step's micro batches and every micro batch's rows in reverse "
                "order (the same loss and gradient in exact arithmetic; only the reduction order changes)",
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


def repeat_and_resume(ctx: RerunContext, determinism_steps: int, resume_at: int | None) -> dict[str, RerunResult]:
  """One rerun per finished side of steps 0..max(determinism_steps - 1, resume_at), saving a checkpoint at
  resume_at; then, with resume_at, a new process resumes from it to the end.

  Returns:
    {'determinism': sections {side: {deterministic, steps_checked, detail, status}}, non-gating checks;
     'resume': sections {side: {resumed_at_step, bit_identical, detail}}, gating checks}. The repeat run's busy
    seconds are counted under 'determinism', the resumed run's under 'resume'.
  """
  det, res = RerunResult(section={}), RerunResult(section={})
  prefix, steps = min(determinism_steps, ctx.spec.train.steps), ctx.spec.train.steps
  stop = max(prefix - 1, resume_at if resume_at is not None else -1)
  for side in ctx.ok_sides if stop >= 0 else ():
    try:
      sr, again = self_runs.run_repeat(ctx.run_dir, side, stop_after_step=stop, save_checkpoint_at_step=resume_at,
                                       timeout_s=ctx.timeout_s)
      det.count(sr)
      if prefix > 0:
        det.checks.append(c := determinism_outcome(ctx, side, prefix, again))
        det.section[side] = determinism_section(c, prefix, sr)
      if resume_at is None:
        continue
      resumed = None
      if sr.status == "ok":
        rr, _, out = self_runs.run_resume(ctx.run_dir, side, timeout_s=ctx.timeout_s)
        res.count(rr)
        rest, final_b = side_outputs(out, rr, ctx.run_id, expected_steps=steps - resume_at - 1)
        resumed = (rr, rest, final_b)
      res.checks.append(c := resume_outcome(ctx, side, resume_at, sr, resumed))
      res.section[side] = resume_section(c, resume_at)
    except KeyboardInterrupt as exc:
      det.interrupted = exc
      break
  return {"determinism": det, "resume": res}


def determinism_outcome(ctx: RerunContext, side: str, prefix: int, again: list[dict]) -> Check:
  """One side's determinism check (reported only: parity.verdict.gating) from its repeat run's StepRecords
  (run_dir/repeat/<side>/steps.jsonl): what `repeat_and_resume` computes once the rerun ran, and what
  parity.report.reverify recomputes from the folder (no process started). prefix: steps compared (>= 1)."""
  return repeat_check("determinism", side, ctx.side_data[side]["steps"], [r for r in again if r["step"] < prefix],
                      gating="determinism" not in ALWAYS_REPORTED_ONLY)


def determinism_section(c: Check, prefix: int, repeat: SideRun) -> dict:
  """report.json determinism[side] for one side's determinism check."""
  return {"deterministic": c.passed, "steps_checked": prefix, "detail": c.detail, "status": repeat.status}


def resume_outcome(ctx: RerunContext, side: str, resume_at: int, repeat: SideRun,
                   resumed: tuple[SideRun, list[dict], dict | None] | None) -> Check:
  """One side's resume check (gating): the resumed run's records and final params against the main run's.

  Args:
    resume_at: the checkpoint step; repeat: the checkpointing (repeat) run's SideRun.
    resumed: (SideRun, StepRecords from resume_at + 1 on, final params or None; parity.pipeline.collect.side_outputs
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
