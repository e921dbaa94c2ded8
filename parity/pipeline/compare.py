"""`parity.compare(...)`: one comparison from Python, returning the Report.

The pipeline, top to bottom (`run_comparison`): resolve (parity.pipeline.resolve) -> prepare the run folder
(parity.pipeline.folder) -> run the sides (harness.runner) -> collect (parity.pipeline.collect) -> compare
(parity.verdict.sides) -> reruns (parity.pipeline.reruns) -> build the report -> write it (parity.report). `compare` is
its keyword form for notebooks: its keywords are resolve_run's parameters (what is run) and RunOptions' fields (how it
runs, listed and documented once, there); the CLI builds the same two (parity.cli.compare).
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

from harness import backend, doctor, lifetime, runner, self_runs
from parity import installed, sockets
from parity.verdict.sides import compare_sides, verdict
from parity.pipeline.collect import collect_sides, interrupted_run
from parity.protocol.layout import STEP_LIST_KEYS
from parity.protocol.ranks import check_coordinator, check_nproc, multirank_checkpoint_refusal, write_launch
from parity.report import Report, build_report, write_all
from parity.report.progress import (data_notes, progress_display, rerun_parts, run_notes, show_not_run,
                                    show_op_build, show_reruns)
from parity.pipeline.equivalence import check_equivalence, parse_equivalence
from parity.pipeline.reruns import RerunContext, Reruns, run_reruns
from parity.pipeline.resolve import ResolvedRun, check_fsdp_overrides_are_read, resolve_run
from parity.pipeline.folder import check_perturb, open_run_folder, parse_perturb, write_environment
from parity.spec import RunSpec, SpecError
from parity.sizing.resources import check_rank_count, check_resources

__all__ = ["compare", "run_comparison", "RunOptions", "OPTION_FIELDS", "SOURCE_KEYWORDS", "split_keywords",
           "check_run_options", "socket_plan", "AfterReport", "AfterStep"]


@dataclasses.dataclass(frozen=True)
class RunOptions:
  """How to run a resolved comparison: the one list of the run options (what is run is the ResolvedRun, built by
  parity.pipeline.resolve.resolve_run from the run's sources). `parity compare` builds it from its flags
  (parity.cli.compare.run_options; `--timeout` is timeout_s, `--no-progress` progress=False, each `--tracker` one
  of trackers, the other flags have the fields' names), and `compare(preset, **keywords)` from its keywords.

  Attributes:
    out: run folder (default runs/<time>-<preset>-<hash>): new, or empty. It is locked while the run writes it
      (parity.pipeline.claim.claim_run_dir): a folder in use by a live run, or holding an earlier run, is refused.
    force: move an earlier run found in `out` aside to `<out>.old-<time>` (never deleted, never mixed).
    command: the command line recorded in the folder's lock and report (default sys.argv).
    perturb: per-side debug changes, `side:key=value` strings (one string: one change) or {side: {key: value}}
      (see parity.pipeline.folder.parse_perturb); they make the sides differ on purpose.
    timeout_s: per-side wall-clock limit, seconds, > 0 (default: the spec's timeout_s).
    progress: on by default: a bar per side on a terminal, a timestamped line per side and phase elsewhere (a log,
      a notebook); False for a quiet call.
    noise_envelope: rerun every side that finished with the batches' rows in reverse order, and hold
      each pair's loss-difference curve against the noisier side's rerun difference
      (parity.verdict.envelope.envelope_check). None: only for bf16/fp16 runs.
    determinism_steps: rerun each side that finished for its first N steps in a new process and
      state whether the records are bit-identical (reported; does not gate the verdict). 0: skip.
    resume_at: also save a checkpoint at this step in that rerun, resume from it in a new process
      and check the rest of the run is bit-identical to the uninterrupted one (gates the verdict).
    started_s: time.time() when the caller began (resolving included; timing.wall_s counts from it); None: when
      run_comparison starts.
    allow_cpu: run even where CUDA is present but a side would run on the CPU (harness.backend.check_backends;
      PARITY_ALLOW_CPU=1 does the same).
    nproc, nnodes, node_rank, coordinator, hostfile: ranks per side (docs/multirank.md): nproc ranks on this host,
      the global batch kept; several hosts through the engines' launchers (parity.protocol.ranks.write_launch).
    baseline: a finished run folder or card.json to gate this run against once its report is written
      (parity.history.gate; gate.json/gate.md in the run folder, Report.post.gate; exit 1 when a metric moved). It
      and `trackers` are done by the after-report step the caller gives run_comparison (`AfterStep`).
    equivalence: equivalence checks to run after the main run, 'ga', 'ranks', 'packing' (a comma string or a
      sequence; parity.pipeline.equivalence): each side trained again as GA 1 x micro batch k*m, on 1 rank (2 when
      the run has 1), or in the other example layout, and held against its main run, one check per kind and side
      (gating with loss_normalization 'tokens' in fp32, reported only otherwise). One that cannot apply is refused.
    train_anyway_on_card_diff: a side whose semantics card (parity.protocol.semantics: the conventions its step runs)
      differs from an earlier side's trains anyway (request.json 'train_anyway_on_card_diff'); the 'semantics'
      check still FAILs at step 0. Default False: that side stops before step 1 (crashed, naming the items).
    trackers: 'KIND:TARGET' specs (tensorboard:DIR, wandb:PROJECT, mlflow:EXPERIMENT; one string: one tracker) to
      mirror each side's steps.jsonl to after the run (parity.report.trackers). Both are checked before any side
      starts.
  Raises:
    TypeError: a keyword that is not a field (Python's own message names it).
  """
  out: str | Path | None = None
  perturb: Sequence[str] | Mapping[str, Mapping] = ()
  timeout_s: float | None = None
  progress: bool = True
  noise_envelope: bool | None = None
  determinism_steps: int = 8
  resume_at: int | None = None
  force: bool = False
  command: str | None = None
  started_s: float | None = None
  nproc: int = 1
  nnodes: int = 1
  node_rank: int = 0
  coordinator: str | None = None
  hostfile: str | None = None
  allow_cpu: bool = False
  baseline: str | Path | None = None
  trackers: Sequence[str] = ()
  equivalence: str | Sequence[str] = ()
  train_anyway_on_card_diff: bool = False

  def __post_init__(self):  # a lone string is one item, not a sequence of characters; lists become tuples (frozen)
    for name in ("perturb", "trackers"):
      value = getattr(self, name)
      if isinstance(value, str):
        object.__setattr__(self, name, (value,))
      elif not isinstance(value, Mapping):
        object.__setattr__(self, name, tuple(value))
    if self.equivalence is None:
      object.__setattr__(self, "equivalence", ())
    elif isinstance(self.equivalence, str):  # 'ga,packing': the command line's form; '' or ',' kept, so that
      # parse_equivalence refuses a value that names no check instead of running none
      object.__setattr__(self, "equivalence", tuple(k.strip() for k in self.equivalence.split(",")))


class AfterReport(Protocol):
  """What runs once the report is written (parity.history.after.PostRun: the --baseline gate, gate.json/gate.md,
  and the --tracker mirrors). `empty`: nothing was asked; `apply(report)` never raises for a file or tracker error,
  and its result becomes Report.post."""

  @property
  def empty(self) -> bool: ...

  def apply(self, report: Report) -> Any: ...


AfterStep = Callable[[RunOptions], AfterReport]
"""Prepares the after-report step from the options before any side starts (a baseline that cannot be read, a tracker
that is not installed: bad input, exit 2): parity.history.after.PostRun.for_options. The callers above the pipeline
give it (`parity compare`, parity.compare, parity.run_comparison); the pipeline never imports the history."""


OPTION_FIELDS = tuple(f.name for f in dataclasses.fields(RunOptions))
"""The keywords of `compare` that say how it runs: RunOptions' fields."""
SOURCE_KEYWORDS = tuple(n for n in inspect.signature(resolve_run).parameters if n != "preset_name")
"""The keywords of `compare` that say what is run: resolve_run's parameters (its docstring documents them)."""


def split_keywords(keywords: Mapping[str, object]) -> tuple[dict[str, object], dict[str, object]]:
  """`compare`'s keywords as (resolve_run's keywords, RunOptions' fields), each by its names.

  Raises:
    TypeError: a keyword that is neither, named with the closest valid name and both lists.
  """
  unknown = [k for k in keywords if k not in SOURCE_KEYWORDS and k not in OPTION_FIELDS]
  if unknown:
    valid = SOURCE_KEYWORDS + OPTION_FIELDS
    hints = [f"{k!r}" + (f" (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, valid, 1)) else "")
             for k in unknown]
    raise TypeError(f"parity.compare() got unknown keyword(s) {', '.join(hints)}; what is run: "
                    f"{', '.join(SOURCE_KEYWORDS)} (parity.pipeline.resolve.resolve_run); how it runs: "
                    f"{', '.join(OPTION_FIELDS)} (parity.pipeline.compare.RunOptions)")
  return ({k: v for k, v in keywords.items() if k in SOURCE_KEYWORDS},
          {k: v for k, v in keywords.items() if k in OPTION_FIELDS})


def compare(preset: str | None = None, *, after: AfterStep | None = None, **keywords) -> Report:
  """Runs every side of a comparison, each in its own process, and returns the report: `resolve_run` then
  `run_comparison` (with `after`, the after-report step), the keyword form for notebooks (parity.compare gives it
  the history's step).

  Args:
    preset: a name from parity.presets.PRESETS (default: the config's `preset:`, else 'gpt2-small-cpu').
    **keywords: what is run, resolve_run's parameters (SOURCE_KEYWORDS, e.g. config, overrides, steps, sides,
      data, hf_model, deepspeed_config, plan), and how it runs, RunOptions' fields (OPTION_FIELDS, e.g. out,
      perturb, timeout_s, progress), each documented there, once.
  Returns:
    The Report (also written as report.json, report.md, metrics.jsonl, loss.png in the run folder).
  Raises:
    TypeError: a keyword that is neither (`split_keywords` names it and the valid ones).
    SpecError, DataError: bad input, before any side starts (RunFolderError: `out` cannot be used; nothing of
      this run is left behind).
    RunIOError: the run's input files could not be written (disk full, read-only folder); later write failures
      do not raise: the report goes wherever it can and `report.data['write_errors']` names what failed (exit 1).
    KeyboardInterrupt: re-raised once the report of what ran is written (its verdict says INTERRUPTED).
  """
  source, how = split_keywords(keywords)
  if isinstance(source.get("sides"), str):  # one string is a comma list, as on the command line ('jax,torch')
    source["sides"] = [s.strip() for s in source["sides"].split(",")]
  options = RunOptions(**{"started_s": time.time(), **how})
  return run_comparison(resolve_run(preset, **source), options, after=after)


def _after_step(options: RunOptions, after: AfterStep | None) -> AfterReport | None:
  """The prepared after-report step; None when none is given and none is asked for.

  Raises:
    TypeError: options.baseline or options.trackers without a step to do them (a caller's slip, never a user's:
      parity.compare and `parity compare` give parity.history.after.PostRun.for_options).
  """
  if after is not None:
    return after(options)
  if options.baseline is not None or options.trackers:
    raise TypeError("run_comparison: RunOptions.baseline/trackers need the after-report step; pass "
                    "after=parity.history.after.PostRun.for_options (parity.compare and parity.run_comparison do)")
  return None


def run_comparison(run: ResolvedRun, options: RunOptions, after: AfterStep | None = None) -> Report:
  """Runs a resolved comparison: every side in its own process, the reruns, the report (written to the run folder).

  A Ctrl-C or SIGTERM stops the side or rerun worker that is running (killed, the report marks the run
  INTERRUPTED); one that comes while no worker runs (records being compared, the report being written) is held
  until that is done (harness.lifetime.stop_signals); later ones are ignored, so the report is always written.

  Args:
    run: parity.pipeline.resolve.resolve_run's result. options: RunOptions.
    after: the after-report step (`AfterStep`: the --baseline gate and --tracker mirrors), prepared before any side
      starts and applied once the report is written, while the folder is still held; None: nothing after the
      report (options.baseline and options.trackers must then be unset).
  Returns, Raises: as `compare`; a Ctrl-C is re-raised once the report of what ran is written.
  """
  t0 = options.started_s if options.started_s is not None else time.time()
  check_fsdp_overrides_are_read(run.spec, run.overrides)
  run, not_run = socket_plan(run, options)  # before anything reads the sides: a side left out is gone from here on
  spec = run.spec
  if isinstance(options.perturb, Mapping):  # the mapping form skips parse_perturb, which validates the strings
    pert = dict(options.perturb)
    check_perturb(pert, spec)
  else:
    pert = parse_perturb(list(options.perturb), spec.sides, spec)
  check_run_options(spec, pert, options)
  post = _after_step(options, after)  # a bad --baseline/--tracker: refused before any side
  show_not_run(list(not_run.not_run.values()))  # one line per side left out or not run (parity.installed, .sockets)
  with lifetime.stop_signals():
    folder = _open_folder(run, options, pert)  # inputs, launch.json (docs/multirank.md), environment.json
    lifetime.on_disk(f"no report was written; {folder.path} holds the run's inputs only")
    try:
      asked = post is not None and not post.empty
      report, interrupted = _run_and_report(run, options, folder, t0, post_asked=asked, not_run=not_run)
      if interrupted is None and asked:
        with lifetime.activity("the --baseline gate or the --tracker mirrors were running (after the report)",
                               on_stop="they were stopped: gate.json, gate.md and the trackers may be incomplete"):
          report.post = post.apply(report)  # gate.json, trackers
    finally:
      folder.claim.release()
  if interrupted is not None:
    raise interrupted
  return report


def _run_and_report(run: ResolvedRun, options: RunOptions, folder, t0: float, *, post_asked: bool,
                    not_run: sockets.SidePlan) -> tuple[Report, KeyboardInterrupt | None]:
  """The sides, the reruns and the written report; returns it and the Ctrl-C that stopped a side or rerun (None).
  Only a worker is stopped at once: the rest is held (harness.lifetime.activity), and a stop held while the
  records are compared skips the reruns (the run is INTERRUPTED); one held while the report is written is raised
  once it is complete (so the gate and trackers, `post_asked`, do not run)."""
  spec = run.spec
  limit = options.timeout_s if options.timeout_s is not None else spec.timeout_s
  with progress_display(options.progress, spec, notes=run_notes(run) + data_notes(folder.data_info)) as on_progress:
    loads: dict[str, dict] = {}

    def one_side(side: str):  # the machine's load around each side: its timings are only as good as that
      if side in not_run.not_run:  # a named side this machine cannot start (parity.sockets.plan_sides)
        return runner.not_run(side, not_run.not_run[side])
      loads[side] = {"start": _load()}
      show_op_build(side, spec)  # a DeepSpeed side whose ops are not built yet: minutes with no step progress
      try:
        return runner.run_side(folder.path, side, timeout_s=limit, on_progress=on_progress)
      finally:
        loads[side]["end"] = _load()
    side_runs, interrupted = runner.run_each_side(spec.sides, one_side,
                                                  on_interrupt=lambda side: interrupted_run(folder.path, side))
  with lifetime.activity(None, hold=True):
    with lifetime.activity("the sides' records were being compared (no side was running)", hold=True,
                           on_stop="that was finished first and no rerun was started"):
      side_data = collect_sides(folder.path, side_runs, folder.claim.run_id, spec.train.steps)
      checks, table = compare_sides(side_data, spec=spec, init=folder.init)
    interrupted = interrupted or lifetime.take_stop()
    kinds = parse_equivalence(options.equivalence)
    asked = (options.noise_envelope, options.determinism_steps, options.resume_at, kinds)
    if interrupted is None:
      show_reruns(options.progress, spec, *asked)
    names = ", ".join(n for n, _ in rerun_parts(spec, *asked)) or "none asked for"
    with lifetime.activity("the reruns were between two workers (none was running)", hold=True,
                           on_stop="no rerun was started after that",
                           within=f"in the reruns ({names}; the main run had finished)"):
      reruns = Reruns() if interrupted is not None else run_reruns(
          RerunContext(folder.path, spec, folder.claim.run_id, limit, folder.init, side_data), checks,
          noise=options.noise_envelope, determinism_steps=options.determinism_steps, resume_at=options.resume_at,
          equivalence=kinds, tokenizer=getattr(run, "tokenizer", None) or run.init_source)
    interrupted = interrupted or reruns.interrupted
    with lifetime.activity("the report was being written (no side was running)", hold=True,
                           on_stop="that was finished first" + (
                               "; the --baseline gate and --tracker mirrors were not run" if post_asked else "")):
      report = _build(run, options, folder, side_runs, side_data, checks + reruns.checks, table, reruns, loads,
                      interrupted is not None, t0, not_run)
      write_all(report)
    lifetime.on_disk(_report_on_disk(report))
  return report, interrupted


def _build(run: ResolvedRun, options: RunOptions, folder, side_runs, side_data, checks, table, reruns, loads,
           interrupted: bool, t0: float, not_run: sockets.SidePlan) -> Report:
  """build_report with everything the run gathered."""
  spec, claim = run.spec, folder.claim
  return build_report(
      spec=spec, preset_name=run.preset, run_dir=folder.path, data_info=folder.data_info, side_runs=side_runs,
      side_steps={s: d["steps"] for s, d in side_data.items()}, checks=checks, params_table=table,
      verdict=verdict(checks, {s: sr.status for s, sr in side_runs.items()}), wall_s=time.time() - t0,
      prepare_s=folder.prepare_s, plan=run.plan, reruns=reruns.sections, reruns_s=reruns.busy_s,
      run_folder={"run_id": claim.run_id, "moved_aside_to": str(claim.moved_to) if claim.moved_to else None,
                  "stale_lock_taken_over": claim.stale_lock,
                  "command": options.command if options.command is not None else " ".join(sys.argv)},
      interrupted=interrupted, side_loads=loads, checkpoint=run.init_source,
      sides_not_run={s: {"reason": why, "named": not_run.named} for s, why in not_run.not_run.items()})


def _report_on_disk(report: Report) -> str:
  """One sentence on what a written report left: where, complete or not, and its verdict's first word."""
  rec = report.record
  where = Path(rec.report_written_to or report.run_dir)
  errors = rec.write_errors
  if errors:
    return (f"the report is incomplete: {len(errors)} file(s) could not be written (first {errors[0].get('file')}: "
            f"{errors[0].get('error')}); what could be written is in {where}")
  word = rec.verdict.message.split(":", 1)[0]  # PASS, FAIL, INTERRUPTED
  what = "the report of what ran" if word == "INTERRUPTED" else "the report"
  return f"{what} is written, verdict {word}: {where / 'report.html'}, with report.json, report.md and card.json"


def socket_plan(run: ResolvedRun, options: RunOptions) -> tuple[ResolvedRun, sockets.SidePlan]:
  """The run with the sides this machine can start, decided once, here, before anything starts.

  First the frameworks (parity.installed.plan_sides): a side the user named whose framework is not installed is
  refused (SpecError, exit 2, naming the install: "side 'torch' needs PyTorch, which is not installed here: pip install
  'parity[torch]'", parity.installed.pip_install); one they did not name is left out with one line (the run then
  exits 3 if it holds: parity.report.build.EXIT_INCOMPLETE). Then sockets, where this machine refuses them
  (parity.sockets.loopback_refusal): a side the user did not name that needs them (DeepSpeed, FSDP2) is left out of
  the run; a named one stays, to be recorded as not run (the verdict then fails: exit 1). Returns (the run, the
  SidePlan whose not_run holds the lines of both). Raises SpecError (exit 2): a named side not installed, no side
  left, several ranks per side or --equivalence ranks where sockets are refused."""
  have = installed.plan_sides(run.spec.sides, named=run.sides_named)
  error = sockets.loopback_refusal()
  if error is not None and "ranks" in parse_equivalence(options.equivalence):
    raise SpecError(f"--equivalence ranks reruns each side on 2 ranks, which meet over sockets, and this machine "
                    f"refuses them ({sockets.PROBE}: {error}); leave 'ranks' out here, or run on a machine that "
                    "allows sockets")
  plan = sockets.plan_sides(have.sides, world=options.nproc * options.nnodes, named=run.sides_named,
                            error=error)
  plan = dataclasses.replace(plan, not_run={**have.not_run, **plan.not_run})
  if plan.sides == run.spec.sides:
    return run, plan
  return dataclasses.replace(run, spec=dataclasses.replace(run.spec, sides=plan.sides).validate()), plan


def _load() -> list[float] | None:
  """os.getloadavg() (1/5/15-minute load averages), None where the OS has none."""
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except OSError:
    return None


def check_run_options(spec: RunSpec, pert: dict, options: RunOptions) -> None:
  """Refuses, before any side starts, options that would only fail later.

  Raises:
    SpecError: naming the option (--timeout, --determinism-steps, --resume-at, --perturb, --equivalence) and the
      range it takes.
  """
  t, timeout_s, resume_at = spec.train, options.timeout_s, options.resume_at
  determinism_steps = options.determinism_steps
  if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                or not timeout_s > 0):
    raise SpecError(f"--timeout must be > 0 seconds; got {timeout_s}")
  if determinism_steps < 0:
    raise SpecError(f"--determinism-steps must be >= 0 (0 skips the rerun); got {determinism_steps}")
  if resume_at is not None and not 0 <= resume_at <= t.steps - 2:
    raise SpecError(f"--resume-at must be a step in [0, train.steps - 2 = {t.steps - 2}] (the resumed run needs "
                    f"at least one step left); got {resume_at}")
  _check_ranks(spec, pert, options)
  _check_noise_measurable(spec, options)
  check_equivalence(spec, parse_equivalence(options.equivalence), nproc=options.nproc, nnodes=options.nnodes)
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


def _open_folder(run: ResolvedRun, options: RunOptions, pert: dict):
  """The CPU-fallback check (harness.backend.check_backends: CUDA here but a side would run on the CPU is refused,
  exit 2, before the folder exists), parity.pipeline.folder.open_run_folder, then run_dir/launch.json from the rank
  options (parity.protocol.ranks.write_launch; none for one rank) and run_dir/environment.json (harness.doctor's
  quick block). Returns the PreparedRun; its claim is released if a file after it cannot be written."""
  devices = backend.check_backends(run.spec.sides, options.allow_cpu)
  folder = open_run_folder(run, options.out, pert, force=options.force, command=options.command,
                           train_anyway_on_card_diff=options.train_anyway_on_card_diff,
                           world=options.nproc * options.nnodes)
  try:
    write_launch(folder.path, nproc=options.nproc, coordinator=options.coordinator, nnodes=options.nnodes,
                 node_rank=options.node_rank,
                 hostfile=str(Path(options.hostfile).resolve()) if options.hostfile else None)
    write_environment(folder.path, doctor.run_environment(devices, run.spec, pert), folder.claim.run_id)
  except BaseException:
    folder.claim.release()
    raise
  return folder


def _check_noise_measurable(spec: RunSpec, options: RunOptions) -> None:
  """Refuses a noise envelope (on by default in bf16/fp16 with two sides or more, or --noise-envelope) on a batch
  shape where the reduction-order rerun cannot change any rounding (harness.self_runs.noise_blind_reason): its
  envelope would be 0 and every pair judged by the floors alone. Raises SpecError naming the keys and the fixes."""
  t = spec.train
  asked = options.noise_envelope if options.noise_envelope is not None else (
      t.precision != "fp32" and len(spec.sides) > 1)
  if not asked:
    return
  world = options.nproc * options.nnodes * spec.jax.data_parallel
  why = self_runs.noise_blind_reason(t.micro_batch_size, t.grad_accum_steps, world,
                                     across_ranks=t.loss_normalization == "tokens")
  if why is not None:
    raise SpecError(f"the noise envelope cannot be measured on this batch shape (train.micro_batch_size="
                    f"{t.micro_batch_size}, train.grad_accum_steps={t.grad_accum_steps}, {world} rank(s)): {why}. Give "
                    "each rank 3 rows or more (train.micro_batch_size), or 3 micro batches a step "
                    "(train.grad_accum_steps), or pass --no-noise-envelope (the fixed table then decides)")


def _check_ranks(spec: RunSpec, pert: dict, options: RunOptions) -> None:
  """--nproc and its companions (parity.protocol.ranks.check_nproc), --resume-at and fault_rank against them."""
  check_nproc(spec.train, options.nproc, nnodes=options.nnodes, jax_data_parallel=spec.jax.data_parallel)
  world = options.nproc * options.nnodes
  if options.nproc > 1:  # before anything runs: N processes per side must fit this host's cores/GPUs and memory
    check_rank_count(options.nproc)
    check_resources(spec, Path(options.out) if options.out else Path("runs"), nproc=options.nproc)
  if not 0 <= options.node_rank < options.nnodes:
    raise SpecError(f"--node-rank must be in [0, --nnodes - 1 = {options.nnodes - 1}]; got {options.node_rank}")
  check_coordinator(options.coordinator, nnodes=options.nnodes)
  if options.hostfile is not None and not Path(options.hostfile).is_file():
    raise SpecError(f"--hostfile {options.hostfile}: no such file (a DeepSpeed hostfile: 'host slots=N' per line)")
  if world > 1 and options.resume_at is not None:
    raise SpecError(multirank_checkpoint_refusal(f"--resume-at with --nproc {options.nproc}", world))
  for side, kv in pert.items():
    if side == "fsdp" and kv.get("fsdp_shard_unsynced") and world < 2:  # other sides: parity.pipeline.plants
      raise SpecError(f"--perturb {side}:fsdp_shard_unsynced=true changes nothing the {side} side trains: it leaves "
                      f"rank 1's shard of a param behind, and the side has one rank (--nproc {options.nproc}); run it "
                      f"with --nproc 2 or more")
    if "fault_rank" in kv and not kv["fault_rank"] < world:
      raise SpecError(f"--perturb {side}:fault_rank={kv['fault_rank']}: the side has ranks 0..{world - 1} "
                      f"(--nproc {options.nproc})")
