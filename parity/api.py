"""`parity.compare(...)`: one comparison from Python, returning the Report."""
from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Mapping, Sequence

from parity import weights
from parity.checks import compare_sides, verdict
from parity.protocol import FINAL_MOMENTS, read_moments, read_steps
from parity.report import Report, build_report, write_all
from parity.run import claim_run_dir, default_run_dir, parse_perturb, prepare_run_dir

__all__ = ["compare"]


def compare(preset: str | None = None, *, config: str | Path | Mapping | None = None,
            overrides: Mapping[str, object] | Sequence[str] = (),
            steps: int | None = None, sides: Sequence[str] | None = None, data: str | None = None,
            out: str | Path | None = None, perturb: Sequence[str] | Mapping[str, Mapping] = (),
            timeout_s: float | None = None, progress: bool = False, hf_model: str | Path | None = None,
            deepspeed_config: str | Path | None = None, plan: str | None = None,
            hardware: str = "H100", noise_envelope: bool | None = None, determinism_steps: int = 8,
            resume_at: int | None = None, force: bool = False, command: str | None = None) -> Report:
  """Runs every side of a comparison, each in its own process, and returns the report.

  Args:
    preset: a name from parity.spec.PRESETS (default 'gpt2-small-cpu').
    config: a run config file (YAML/JSON) or mapping, merged over the preset.
    overrides: dotted `section.key=value` strings, applied last.
    steps, sides, data: shortcuts for train.steps, sides and data.
    out: run folder (default runs/<time>-<preset>-<hash>): new, or empty. It is locked while the run writes it
      (parity.run.claim_run_dir): a folder in use by a live run, or holding an earlier run, is refused.
    force: move an earlier run found in `out` aside to `<out>.old-<time>` (never deleted, never mixed).
    command: the command line recorded in the folder's lock (default sys.argv).
    perturb: per-side debug changes, `side:key=value` strings or {side: {key: value}}
      (see parity.run.parse_perturb); they make the sides differ on purpose.
    timeout_s: per-side wall-clock limit, seconds (default: the spec's timeout_s).
    progress: show a progress bar (rich) on the terminal.
    hf_model: a local Hugging Face checkpoint folder (GPT2LMHeadModel, LlamaForCausalLM, ...); its
      config.json replaces the model section and its weights are the initial weights of every side.
    deepspeed_config: a DeepSpeed JSON config. The DeepSpeed side runs that very file (its "auto"
      values filled from the run spec, as the HF Trainer would); the JAX and torch sides run its
      port (`parity port`); the key-by-key migration report is written to migration.json/.md.
    plan: a plan pair of parity.plans.PLANS applied to both sides, or 'auto' for the fastest pair that
      fits `hardware` by the memory model (parity.plans.choose_plan); the choice is recorded in the report.
    hardware: a parity.plans.HARDWARE preset, for plan='auto'.
    noise_envelope: rerun every side that finished with the batches' rows in reverse order, and hold
      each pair's loss-difference curve against the noisier side's rerun difference
      (parity.checks.envelope_check). None: only for bf16/fp16 runs.
    determinism_steps: rerun each side that finished for its first N steps in a new process and
      state whether the records are bit-identical (reported; does not gate the verdict). 0: skip.
    resume_at: also save a checkpoint at this step in that rerun, resume from it in a new process
      and check the rest of the run is bit-identical to the uninterrupted one (gates the verdict).
  Returns:
    The Report (also written as report.json, report.md, metrics.jsonl, loss.png in the run folder).
  Raises:
    SpecError, DataError: bad input, before any side starts (RunFolderError: `out` cannot be used; nothing of
      this run is left behind).
    RunIOError: the run's input files could not be written (disk full, read-only folder); later write failures
      do not raise: the report goes wherever it can and `report.data['write_errors']` names what failed (exit 1).
  """
  t0 = time.time()
  from parity.resolve import resolve_run
  run = resolve_run(preset, config=config, hf_model=hf_model, plan=plan, hardware=hardware,
                    deepspeed_config=deepspeed_config, steps=steps, sides=sides, data=data, overrides=overrides)
  spec, name, plan_choice, init, port = run.spec, run.preset, run.plan, run.init_params, run.port
  ds_cfg = dict(run.deepspeed_config) if run.deepspeed_config is not None else None
  pert = parse_perturb(list(perturb), spec.sides) if not isinstance(perturb, Mapping) else dict(perturb)
  _check_run_options(spec, pert, timeout_s, determinism_steps, resume_at)
  run_dir = Path(out) if out is not None else default_run_dir(spec, name)
  from parity.inputs import check_resources
  check_resources(spec, run_dir)  # sizes that cannot fit are refused before any folder or array exists
  claim = claim_run_dir(out if out is not None else run_dir, force=force, command=command)  # '' refused, not '.'
  try:
    prep = prepare_run_dir(spec, run_dir, perturb=pert, init_params=init,
                           deepspeed_config=ds_cfg if port is not None else None, run_id=claim.run_id)
    if port is not None:
      from parity.run import write_new
      write_new(run_dir / "migration.json", port.report.to_json())
      write_new(run_dir / "migration.md", port.report.to_markdown())
    init = weights.load(run_dir / "init.safetensors")  # the run's own, read once, before any side can touch it
  except BaseException:  # refused or failed before any side started: leave nothing of this run behind
    claim.abandon()
    raise
  try:
    report = _run_and_report(run_dir, spec, name, claim, prep, pert, init, plan_choice, t0, timeout_s, progress,
                             noise_envelope, determinism_steps, resume_at)
  finally:
    claim.release()
  if isinstance(report, BaseException):
    raise report
  return report


def _run_and_report(run_dir: Path, spec, name: str, claim, prep: dict, pert: dict, init: dict, plan_choice, t0: float,
                    timeout_s, progress: bool, noise_envelope, determinism_steps: int, resume_at):
  """Runs the sides and the reruns in the claimed folder and writes the report; returns the Report, or the
  KeyboardInterrupt to re-raise once the report is written."""
  from harness.runner import not_run, run_side  # harness depends on parity, not the reverse
  limit = timeout_s if timeout_s is not None else spec.timeout_s
  side_runs, interrupted = {}, None
  with _progress(progress, spec) as on_progress:
    for side in spec.sides:
      if interrupted is not None:
        side_runs[side] = not_run(side, "not started: the run was interrupted")
        continue
      try:
        side_runs[side] = run_side(run_dir, side, timeout_s=limit, on_progress=on_progress)
      except KeyboardInterrupt as exc:  # the side was killed and has a summary; report, then re-raise
        interrupted = exc
        side_runs[side] = _interrupted_run(run_dir, side)
  side_data, steps_by_side = {}, {}
  for side, sr in side_runs.items():
    st, final = side_outputs(run_dir / side, sr, claim.run_id, expected_steps=spec.train.steps)
    steps_by_side[side] = st
    side_data[side] = {"status": sr.status, "steps": st, "final": final}
    side_data[side]["moments"] = read_moments(run_dir / side / FINAL_MOMENTS) if side_data[side]["final"] else None
  checks, table = compare_sides(side_data, spec=spec, init=init)
  self_info: dict = {"noise_envelope": None, "determinism": {}, "resume": {}, "self_runs_s": 0.0}
  if interrupted is None:
    try:  # results land in self_info and checks as each rerun finishes, so an interrupt keeps them
      _self_runs(run_dir, spec, side_data, checks, limit, self_info, noise_envelope=noise_envelope,
                 determinism_steps=determinism_steps, resume_at=resume_at, init=init, run_id=claim.run_id)
    except KeyboardInterrupt as exc:
      interrupted = exc
    except (OSError, ValueError) as exc:  # a rerun's files could not be written or read: its checks fail, said why
      from parity.checks import Check
      checks.append(Check(name="reruns", metric="reruns", sides=tuple(spec.sides[:2]), value=float("nan"),
                          tolerance=0.0, passed=False, detail=f"the noise/determinism/resume reruns stopped: {exc}",
                          reason="A rerun that could not run cannot vouch for the verdict."))
  v = verdict(checks, {s: sr.status for s, sr in side_runs.items()})
  report = build_report(spec=spec, preset_name=name, run_dir=run_dir, data_info=prep["corpus"],
                        side_runs=side_runs, side_steps=steps_by_side, checks=checks, params_table=table,
                        verdict=v, wall_s=time.time() - t0, prepare_s=prep["prepare_s"])
  report.data["plan"] = plan_choice
  extra_s = self_info.pop("self_runs_s", 0.0)
  report.data.update(self_info)
  timing = report.data["timing"]
  busy_total = sum(timing["sides_s"].values()) + extra_s
  timing.update(self_runs_s=extra_s, overhead_ratio=timing["wall_s"] / busy_total if busy_total > 0 else None)
  from parity import memory
  report.data["memory"] = {"predicted_vs_measured": memory.predicted_vs_measured(report.data),
                           "note": "predicted by parity.memory (parity estimate); measured from the live "
                                   "state arrays / engine tensors of each side"}
  if interrupted is not None:
    msg = report.data["verdict"]["message"]
    report.data["verdict"]["message"] = ("INTERRUPTED: stopped before every run and check finished; so far: "
                                         + (msg.replace("PASS: ", "", 1) if msg.startswith("PASS") else msg))
    report.data["verdict"]["passed"] = False
  report.data["run_folder"] = {"run_id": claim.run_id, "moved_aside_to": str(claim.moved_to) if claim.moved_to else None,
                                "stale_lock_taken_over": claim.stale_lock}
  write_all(report)
  return interrupted if interrupted is not None else report


def side_outputs(out: Path, sr, run_id: str | None, *, expected_steps: int | None) -> tuple[list[dict], dict | None]:
  """Reads what a side left in `out` (run_dir/<side>), trusting an 'ok' only when its files are whole and this run's.

  A side that reports 'ok' is downgraded to 'crashed' (sr.status, sr.error and sr.summary updated; the message names
  the file) when: its summary carries another run's id; steps.jsonl is missing, truncated or holds another number
  of records than `expected_steps`; or final.safetensors is missing or unreadable. The rule is on the files, not on
  how they went missing (deleted, truncated, disk full, an earlier run's leftovers).
  Args:
    out: the side's folder.
    sr: its harness.runner.SideRun (mutated on a downgrade).
    run_id: this run's id (None: not checked).
    expected_steps: StepRecords an 'ok' run must have left (None: not checked).
  Returns:
    (StepRecords, final params or None).
  """
  try:
    steps = read_steps(out / "steps.jsonl")
  except (OSError, UnicodeDecodeError) as exc:
    steps, problem = [], f"{out / 'steps.jsonl'} cannot be read ({exc})"
  else:
    problem = None
  if sr.status != "ok":
    return steps, None
  theirs = (sr.summary or {}).get("run_id")
  final = None
  if run_id is not None and theirs is not None and theirs != run_id:
    problem = f"{out / 'summary.json'} belongs to another run (run_id {theirs}, this run {run_id})"
  elif problem is None and not (out / "steps.jsonl").is_file():
    problem = f"{out / 'steps.jsonl'} is missing (deleted while the run was going?)"
  elif problem is None and expected_steps is not None and len(steps) != expected_steps:
    problem = (f"{out / 'steps.jsonl'} holds {len(steps)} whole step records, {expected_steps} expected "
               "(truncated or overwritten while the run was going?)")
  if problem is None:
    try:
      final = weights.load(out / "final.safetensors")
    except Exception as exc:  # missing, truncated, foreign: any reason makes the side's result untrustworthy
      problem = f"{out / 'final.safetensors'} cannot be read ({type(exc).__name__}: {exc})"
  if problem is not None:
    sr.status, sr.error = "crashed", f"the side reported 'ok' but its output is not whole: {problem}"
    sr.summary = {**(sr.summary or {}), "status": "crashed", "error": sr.error}
    return steps, None
  return steps, final


def _check_run_options(spec, pert: dict, timeout_s: float | None, determinism_steps: int,
                       resume_at: int | None) -> None:
  """Refuses, before any side starts, options that would only fail later (SpecError naming the option)."""
  from parity.protocol import STEP_LIST_KEYS
  from parity.spec import SpecError
  t = spec.train
  if timeout_s is not None and not timeout_s > 0:
    raise SpecError(f"--timeout must be > 0 seconds; got {timeout_s}")
  if determinism_steps < 0:
    raise SpecError(f"--determinism-steps must be >= 0 (0 skips the rerun); got {determinism_steps}")
  if resume_at is not None and not 0 <= resume_at <= t.steps - 2:
    raise SpecError(f"--resume-at must be a step in [0, train.steps - 2 = {t.steps - 2}] (the resumed run needs "
                    f"at least one step left); got {resume_at}")
  for side, kv in pert.items():
    for key, value in kv.items():
      steps = value if key in STEP_LIST_KEYS else [value] if key.endswith("_at_step") else None
      if steps is None:
        continue
      if not steps:
        raise SpecError(f"--perturb {side}:{key}: an empty list injects nothing; give at least one step")
      if max(steps) >= t.steps:
        raise SpecError(f"--perturb {side}:{key}={value}: step {max(steps)} is never reached (train.steps = {t.steps})")
    precision = kv.get("train.precision", t.precision)
    if "overflow_at_steps" in kv and precision != "fp16":
      raise SpecError(f"--perturb {side}:overflow_at_steps needs loss scaling: that side runs "
                      f"train.precision={precision!r}; use 'fp16'")


def _self_runs(run_dir: Path, spec, side_data: dict, checks: list, limit: float, info: dict, *,
               noise_envelope: bool | None, determinism_steps: int, resume_at: int | None,
               init: dict | None = None, run_id: str | None = None) -> None:
  """Noise envelope, determinism and resume runs (harness.self_runs); their checks are appended to `checks`
  and their report fields (`noise_envelope`, `determinism`, `resume`, `self_runs_s`) set in `info` as each
  finishes, so an interrupt keeps what finished.

  In bf16/fp16, the pointwise checks that an envelope check covers are marked non-gating; a side whose noise
  rerun did not finish gets a failing 'noise_rerun' check (the verdict never falls back to the loose table).
  Options are checked by `_check_run_options` before any side starts.
  """
  from harness import self_runs
  from parity.checks import (ENVELOPE_METRICS, Check, envelope_check, envelope_params_check, param_ratios,
                             repeat_check, rerun_differences)
  from parity.tolerances import envelope_rule
  t = spec.train
  ok = [s for s, d in side_data.items() if d["status"] == "ok"]
  main_checks = list(checks)

  def busy(sr) -> None:  # what the side itself spent (as build_report counts the main runs)
    summ = sr.summary or {}
    own = sum(float(summ.get(k) or 0.0) for k in ("init_s", "compile_s", "train_s"))
    info["self_runs_s"] += own if sr.status == "ok" else sr.wall_s

  if noise_envelope is None:
    noise_envelope = t.precision != "fp32"
  if noise_envelope and len(side_data) > 1 and ok:
    rule = envelope_rule(t.precision)
    env: dict[str, dict[str, dict]] = {m: {} for m in ENVELOPE_METRICS}
    penv: dict[str, dict[str, float]] = {}
    runs = {}
    init = init if init is not None else weights.load(run_dir / "init.safetensors")
    for side in ok:
      sr, _ = self_runs.run_noise(run_dir, side, timeout_s=limit)
      noise_steps, noise_final = side_outputs(run_dir / self_runs.NOISE_DIR / side, sr, run_id, expected_steps=t.steps)
      busy(sr)
      runs[side] = {"status": sr.status, "wall_s": sr.wall_s, "error": sr.error}
      if sr.status != "ok":
        checks.append(Check(name=f"noise_rerun {side}", metric="noise_rerun", sides=(side, f"{side}#noise"),
                            value=float("nan"), tolerance=0.0, passed=False,
                            detail=f"the reduction-order rerun of {side} did not finish ({sr.status}): {sr.error}; "
                                   "its pairs have no noise envelope",
                            reason="The bf16/fp16 verdict rests on each side's noise envelope."))
        continue
      for metric, diffs in rerun_differences(side_data[side]["steps"], noise_steps).items():
        env[metric][side] = diffs
      if side_data[side]["final"] is not None and noise_final is not None:
        penv[side] = param_ratios(side_data[side]["final"], noise_final, init, spec.model)
    info["noise_envelope"] = {
        "method": "each side rerun with every step's micro batches and every micro batch's rows in reverse "
                  "order (the same loss and gradient in exact arithmetic; only the reduction order changes)",
        "rule": dataclasses.asdict(rule), "runs": runs,
        "sides": {s: {"steps": sorted(e), "abs_loss_diff": [e[k] for k in sorted(e)],
                      "grad_norm_rel_diff": [env["grad_norm"][s].get(k) for k in sorted(e)],
                      "params_ratio_max": max(penv[s].values()) if penv.get(s) else None}
                  for s, e in env["loss"].items()}}
    names = list(side_data)
    enveloped = set()
    for i, a in enumerate(names):
      for b in names[i + 1:]:
        if a not in env["loss"] or b not in env["loss"]:
          continue  # a rerun failed (see noise_envelope.runs): this pair keeps the fixed table
        for metric, noise in env.items():
          c = envelope_check(a, side_data[a]["steps"], b, side_data[b]["steps"], noise, rule, metric=metric)
          if c is not None:
            checks.append(c)
            enveloped.add((metric, a, b))
        if a in penv and b in penv:
          lr_sum = float(sum(r["lr"] for r in side_data[a]["steps"] if not r.get("skipped")))
          c = envelope_params_check(a, side_data[a]["final"], b, side_data[b]["final"], init, spec.model, penv, rule,
                                    moments={s: side_data[s].get("moments") for s in (a, b)}, lr_sum=lr_sum,
                                    precision=t.precision)
          if c is not None:
            checks.append(c)
            enveloped.add(("params", a, b))
    if t.precision != "fp32":  # the envelope decides; the fixed table (fp32's is measured tight) is reported
      for c in main_checks:
        if (c.metric, *c.sides) in enveloped:
          c.gating = False
          c.detail += f" (reported only: in {t.precision} the noise envelope decides)"
  prefix = min(determinism_steps, t.steps)
  stop = max(prefix - 1, resume_at if resume_at is not None else -1)
  for side in ok if stop >= 0 else ():
    sr, again = self_runs.run_repeat(run_dir, side, stop_after_step=stop, save_checkpoint_at_step=resume_at,
                                     timeout_s=limit)
    busy(sr)
    if prefix > 0:
      c = repeat_check("determinism", side, side_data[side]["steps"], [r for r in again if r["step"] < prefix],
                       gating=False)
      checks.append(c)
      info["determinism"][side] = {"deterministic": c.passed, "steps_checked": prefix, "detail": c.detail,
                                   "status": sr.status}
    if resume_at is not None:
      if sr.status != "ok":
        c = repeat_check("resume", side, side_data[side]["steps"], [], from_step=resume_at + 1, gating=True)
        c.detail = f"the checkpointing run did not finish ({sr.status}): {sr.error}"
      else:
        rr, _, out = self_runs.run_resume(run_dir, side, timeout_s=limit)
        busy(rr)
        rest, final_b = side_outputs(out, rr, run_id, expected_steps=t.steps - resume_at - 1)
        c = repeat_check("resume", side, side_data[side]["steps"], rest, from_step=resume_at + 1,
                         final_a=side_data[side]["final"], final_b=final_b, gating=True)
        if rr.status != "ok":
          c.passed, c.detail = False, f"the resumed run did not finish ({rr.status}): {rr.error}"
      checks.append(c)
      info["resume"][side] = {"resumed_at_step": resume_at + 1, "bit_identical": c.passed, "detail": c.detail}


def _interrupted_run(run_dir: Path, side: str):
  from harness.runner import SideRun
  from parity.protocol import read_summary
  summ = read_summary(run_dir / side / "summary.json") or {"side": side, "status": "killed"}
  return SideRun(side=side, status="killed", returncode=None, wall_s=0.0, peak_rss_bytes=None, summary=summ,
                 error=summ.get("error"))


@contextlib.contextmanager
def _progress(enabled: bool, spec):
  if not enabled:
    yield None
    return
  from rich.console import Console
  from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
  if not Console().is_terminal:  # a log file: plain lines at start and every quarter of the steps
    shown: dict[str, int] = {}
    total = spec.train.steps

    def on_line(side: str, n: int, note: str | None = None) -> None:
      if note:  # the worker is outside its steps (a DeepSpeed op build): say so instead of 0/N steps
        print(f"[{time.strftime('%H:%M:%S')}] {side}: {note}", flush=True)
        return
      quarter = (4 * n) // total if total else 4
      if shown.get(side) != quarter:
        shown[side] = quarter
        print(f"[{time.strftime('%H:%M:%S')}] {side}: {n}/{total} steps", flush=True)
    yield on_line
    return
  cols = (TextColumn("{task.description:>10}"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
          TimeElapsedColumn())
  with Progress(*cols, transient=False) as prog:
    tasks = {s: prog.add_task(s, total=spec.train.steps, start=False) for s in spec.sides}

    def on_progress(side: str, n: int, note: str | None = None) -> None:
      if note is not None:  # "deepspeed: building DeepSpeed op cpu_adam (first use, ~1 min)"; "" when it ends
        prog.update(tasks[side], description=f"{side}: {note}" if note else side)
        if note:
          return
      prog.start_task(tasks[side])
      prog.update(tasks[side], completed=n)
    yield on_progress
