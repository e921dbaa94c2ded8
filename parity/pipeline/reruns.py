"""The reruns of a comparison, each holding one side against itself: the noise envelope, determinism and resume.

Each rerun runs in a subfolder of the run folder (harness.self_runs) and returns a `RerunResult`: its checks, its
section of report.json and the seconds its workers were busy. What a rerun finds is computed from its workers' files
by parity.verdict.reruns (re-exported here), the functions parity.report.reverify recomputes a finished run with. A
Ctrl-C or a file that cannot be written stops the reruns; what finished is kept (`run_reruns`).

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
from typing import Any, Sequence

from harness import self_runs
from parity.protocol.layout import BACKEND_DIR, NOISE_DIR
from parity.protocol.outputs import SideRun, side_outputs
from parity.verdict.backend import device_class, on_accelerator
from parity.verdict.check import Check
from parity.verdict.gating import mark_backend_decided, mark_envelope_decided
from parity.verdict.reruns import (RerunContext, RerunResult, backend_result, determinism_outcome,
                                   determinism_section, envelope_result, resume_outcome, resume_section, side_device)
from parity.pipeline.equivalence import run_equivalence

__all__ = ["RerunContext", "RerunResult", "Reruns", "run_reruns", "noise_envelope", "backend_sides", "backend_reruns",
           "backend_result", "repeat_and_resume", "envelope_result",
           "determinism_outcome", "determinism_section", "resume_outcome", "resume_section"]


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


def backend_sides(ctx: RerunContext) -> list[str]:
  """The finished sides that ran on an accelerator in an fp32 run, unless two sides or more all ran on the same kind
  of device (the table then holds as measured): those the backend rerun holds (parity.verdict.backend). A run of one
  side gets its rerun too, so that a join with a folder from another machine (`parity join`) has the shift. In
  bf16/fp16 the noise envelope decides, far above any backend's rounding."""
  if ctx.spec.train.precision != "fp32":
    return []
  devices = {s: side_device(ctx, s) for s in ctx.ok_sides}
  if len(devices) > 1 and len({device_class(d) for d in devices.values()}) < 2:
    return []  # every side on the same kind of device: the table was measured for that
  return [s for s, d in devices.items() if on_accelerator(d)]


def backend_reruns(ctx: RerunContext) -> RerunResult:
  """Reruns each accelerator side on the host CPU (harness.self_runs.run_backend) and returns `backend_result`."""
  busy, outputs = _rerun_each(ctx, backend_sides(ctx), self_runs.run_backend, BACKEND_DIR)
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
  busy, outputs = _rerun_each(ctx, ctx.ok_sides, self_runs.run_noise, NOISE_DIR)
  if busy.interrupted is not None:
    return busy
  res = envelope_result(ctx, outputs)
  res.busy_s = busy.busy_s
  return res


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
