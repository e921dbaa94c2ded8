"""`parity.compare(...)`: one comparison from Python, returning the Report.

The pipeline, top to bottom (`run_comparison`): resolve (parity.pipeline.resolve) -> prepare the run folder (parity.pipeline.folder) ->
run the sides (harness.runner) -> collect (parity.pipeline.collect) -> compare (parity.verdict.sides) -> reruns (parity.pipeline.reruns) ->
build the report -> write it (parity.report). `compare` is its keyword form for notebooks and the CLI.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

from harness import backend, doctor, runner
from parity.verdict.sides import compare_sides, verdict
from parity.pipeline.collect import collect_sides, interrupted_run
from parity.protocol.layout import STEP_LIST_KEYS
from parity.protocol.ranks import check_coordinator, check_nproc, write_launch
from parity.report import Report, build_report, write_all
from parity.report.after import PostRun
from parity.report.progress import progress_display, run_notes, show_reruns
from parity.pipeline.reruns import RerunContext, Reruns, run_reruns
from parity.pipeline.resolve import ResolvedRun, resolve_run
from parity.pipeline.folder import check_perturb, open_run_folder, parse_perturb
from parity.spec import RunSpec, SpecError

__all__ = ["compare", "run_comparison", "RunOptions", "check_run_options"]


@dataclasses.dataclass(frozen=True)
class RunOptions:
  """How to run a resolved comparison (what is run is the ResolvedRun); `compare` takes the same names.

  Attributes:
    out: run folder (default runs/<time>-<preset>-<hash>): new, or empty. It is locked while the run writes it
      (parity.pipeline.folder.claim_run_dir): a folder in use by a live run, or holding an earlier run, is refused.
    force: move an earlier run found in `out` aside to `<out>.old-<time>` (never deleted, never mixed).
    command: the command line recorded in the folder's lock (default sys.argv).
    perturb: per-side debug changes, `side:key=value` strings or {side: {key: value}}
      (see parity.pipeline.folder.parse_perturb); they make the sides differ on purpose.
    timeout_s: per-side wall-clock limit, seconds (default: the spec's timeout_s).
    progress: show a progress bar (rich) on the terminal.
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
      (parity.report.gate; gate.json/gate.md in the run folder, Report.post.gate; exit 1 when a metric moved).
    trackers: 'KIND:TARGET' specs (tensorboard:DIR, wandb:PROJECT, mlflow:EXPERIMENT) to mirror each side's
      steps.jsonl to after the run (parity.report.trackers). Both are checked before any side starts.
  """
  out: str | Path | None = None
  perturb: Sequence[str] | Mapping[str, Mapping] = ()
  timeout_s: float | None = None
  progress: bool = False
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


def compare(preset: str | None = None, *, config: str | Path | Mapping | None = None,
            overrides: Mapping[str, object] | Sequence[str] = (),
            steps: int | None = None, sides: Sequence[str] | None = None, data: str | None = None,
            out: str | Path | None = None, perturb: Sequence[str] | Mapping[str, Mapping] = (),
            timeout_s: float | None = None, progress: bool = True, hf_model: str | Path | None = None,
            deepspeed_config: str | Path | None = None, plan: str | None = None,
            hardware: str = "H100", noise_envelope: bool | None = None, determinism_steps: int = 8,
            resume_at: int | None = None, force: bool = False, command: str | None = None, nproc: int = 1,
            nnodes: int = 1, node_rank: int = 0, coordinator: str | None = None,
            hostfile: str | None = None,
            allow_cpu: bool = False, baseline: str | Path | None = None, trackers: Sequence[str] = ()) -> Report:
  """Runs every side of a comparison, each in its own process, and returns the report: `resolve_run` then
  `run_comparison`, the keyword form for notebooks and the CLI.

  Args:
    preset: a name from parity.presets.PRESETS (default 'gpt2-small-cpu').
    config: a run config file (YAML/JSON) or mapping, merged over the preset.
    overrides: dotted `section.key=value` strings or a {key: value} mapping, applied last.
    steps, sides, data: shortcuts for train.steps, sides and data.
    hf_model: a local Hugging Face checkpoint folder (GPT2LMHeadModel, LlamaForCausalLM, ...); its
      config.json replaces the model section and its weights are the initial weights of every side.
    deepspeed_config: a DeepSpeed JSON config. The DeepSpeed side runs that very file (its "auto"
      values filled from the run spec, as the HF Trainer would); the JAX and torch sides run its
      port (`parity port`); the key-by-key migration report is written to migration.json/.md.
    plan: a plan pair of parity.sizing.plans.PLANS applied to both sides, or 'auto' for the fastest pair that
      fits `hardware` by the memory model (parity.sizing.plans.choose_plan); the choice is recorded in the report.
    hardware: a parity.sizing.plans.HARDWARE preset, for plan='auto'.
    baseline, trackers: the regression gate and the tracker mirror run after the report (RunOptions fields).
    out, perturb, timeout_s, progress, noise_envelope, determinism_steps, resume_at, force, command, nproc, nnodes,
      node_rank, coordinator, hostfile: how it runs, the RunOptions fields of the same names. progress is on by
      default (a bar on a terminal, a timestamped line per side and phase elsewhere, e.g. a notebook); pass
      progress=False for a quiet call.
  Returns:
    The Report (also written as report.json, report.md, metrics.jsonl, loss.png in the run folder).
  Raises:
    SpecError, DataError: bad input, before any side starts (RunFolderError: `out` cannot be used; nothing of
      this run is left behind).
    RunIOError: the run's input files could not be written (disk full, read-only folder); later write failures
      do not raise: the report goes wherever it can and `report.data['write_errors']` names what failed (exit 1).
    KeyboardInterrupt: re-raised once the report of what ran is written (its verdict says INTERRUPTED).
  """
  options = RunOptions(out=out, perturb=perturb, timeout_s=timeout_s, progress=progress, noise_envelope=noise_envelope,
                       determinism_steps=determinism_steps, resume_at=resume_at, force=force, command=command,
                       started_s=time.time(), nproc=nproc, nnodes=nnodes, node_rank=node_rank,
                       coordinator=coordinator, hostfile=hostfile,
                       allow_cpu=allow_cpu, baseline=baseline, trackers=tuple(trackers))
  run = resolve_run(preset, config=config, hf_model=hf_model, plan=plan, hardware=hardware,
                    deepspeed_config=deepspeed_config, steps=steps, sides=sides, data=data, overrides=overrides)
  return run_comparison(run, options)


def run_comparison(run: ResolvedRun, options: RunOptions) -> Report:
  """Runs a resolved comparison: every side in its own process, the reruns, the report (written to the run folder).

  Args:
    run: parity.pipeline.resolve.resolve_run's result. options: RunOptions.
  Returns, Raises: as `compare`; a Ctrl-C is re-raised once the report of what ran is written.
  """
  t0 = options.started_s if options.started_s is not None else time.time()
  spec = run.spec
  if isinstance(options.perturb, Mapping):  # the mapping form skips parse_perturb, which validates the strings
    pert = dict(options.perturb)
    check_perturb(pert, spec)
  else:
    pert = parse_perturb(list(options.perturb), spec.sides, spec)
  check_run_options(spec, pert, options)
  post = PostRun.prepare(options.baseline, options.trackers)  # a bad --baseline/--tracker: refused before any side
  folder = _open_folder(run, options, pert)  # inputs, launch.json (docs/multirank.md), environment.json
  limit = options.timeout_s if options.timeout_s is not None else spec.timeout_s
  try:
    with progress_display(options.progress, spec, notes=run_notes(run)) as on_progress:
      loads: dict[str, dict] = {}

      def one_side(side: str):  # the machine's load around each side: its timings are only as good as that
        loads[side] = {"start": _load()}
        try:
          return runner.run_side(folder.path, side, timeout_s=limit, on_progress=on_progress)
        finally:
          loads[side]["end"] = _load()
      side_runs, interrupted = runner.run_each_side(spec.sides, one_side,
                                                    on_interrupt=lambda side: interrupted_run(folder.path, side))
    side_data = collect_sides(folder.path, side_runs, folder.claim.run_id, spec.train.steps)
    checks, table = compare_sides(side_data, spec=spec, init=folder.init)
    if interrupted is None:
      show_reruns(options.progress, spec, options.noise_envelope, options.determinism_steps, options.resume_at)
    reruns = Reruns() if interrupted is not None else run_reruns(
        RerunContext(folder.path, spec, folder.claim.run_id, limit, folder.init, side_data), checks,
        noise=options.noise_envelope, determinism_steps=options.determinism_steps, resume_at=options.resume_at)
    interrupted = interrupted or reruns.interrupted
    checks += reruns.checks
    claim = folder.claim
    report = build_report(
        spec=spec, preset_name=run.preset, run_dir=folder.path, data_info=folder.data_info, side_runs=side_runs,
        side_steps={s: d["steps"] for s, d in side_data.items()}, checks=checks, params_table=table,
        verdict=verdict(checks, {s: sr.status for s, sr in side_runs.items()}), wall_s=time.time() - t0,
        prepare_s=folder.prepare_s, plan=run.plan, reruns=reruns.sections, reruns_s=reruns.busy_s,
        run_folder={"run_id": claim.run_id, "moved_aside_to": str(claim.moved_to) if claim.moved_to else None,
                    "stale_lock_taken_over": claim.stale_lock,
                    "command": options.command if options.command is not None else " ".join(sys.argv)},
        interrupted=interrupted is not None, side_loads=loads)
    write_all(report)
    report.post = None if interrupted is not None or post.empty else post.apply(report)  # gate.json, trackers
  finally:
    folder.claim.release()
  if interrupted is not None:
    raise interrupted
  return report


def _load() -> list[float] | None:
  """os.getloadavg() (1/5/15-minute load averages), None where the OS has none."""
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except OSError:
    return None


def check_run_options(spec: RunSpec, pert: dict, options: RunOptions) -> None:
  """Refuses, before any side starts, options that would only fail later.

  Raises:
    SpecError: naming the option (--timeout, --determinism-steps, --resume-at, --perturb) and the range it takes.
  """
  t, timeout_s, resume_at = spec.train, options.timeout_s, options.resume_at
  determinism_steps = options.determinism_steps
  if timeout_s is not None and not timeout_s > 0:
    raise SpecError(f"--timeout must be > 0 seconds; got {timeout_s}")
  if determinism_steps < 0:
    raise SpecError(f"--determinism-steps must be >= 0 (0 skips the rerun); got {determinism_steps}")
  if resume_at is not None and not 0 <= resume_at <= t.steps - 2:
    raise SpecError(f"--resume-at must be a step in [0, train.steps - 2 = {t.steps - 2}] (the resumed run needs "
                    f"at least one step left); got {resume_at}")
  _check_ranks(spec, pert, options)
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
  folder = open_run_folder(run, options.out, pert, force=options.force, command=options.command)
  try:
    write_launch(folder.path, nproc=options.nproc, coordinator=options.coordinator, nnodes=options.nnodes,
                 node_rank=options.node_rank,
                 hostfile=str(Path(options.hostfile).resolve()) if options.hostfile else None)
    doctor.write_environment(folder.path, doctor.run_environment(devices), folder.claim.run_id)
  except BaseException:
    folder.claim.release()
    raise
  return folder


def _check_ranks(spec: RunSpec, pert: dict, options: RunOptions) -> None:
  """--nproc and its companions (parity.protocol.ranks.check_nproc), --resume-at and fault_rank against them."""
  check_nproc(spec.train, options.nproc, nnodes=options.nnodes, jax_data_parallel=spec.jax.data_parallel)
  world = options.nproc * options.nnodes
  if options.nproc > 1:  # before anything runs: N processes per side must fit this host's cores/GPUs and memory
    from parity.sizing.resources import check_rank_count, check_resources
    check_rank_count(options.nproc)
    check_resources(spec, Path(options.out) if options.out else Path("runs"), nproc=options.nproc)
  if not 0 <= options.node_rank < options.nnodes:
    raise SpecError(f"--node-rank must be in [0, --nnodes - 1 = {options.nnodes - 1}]; got {options.node_rank}")
  check_coordinator(options.coordinator, nnodes=options.nnodes)
  if options.hostfile is not None and not Path(options.hostfile).is_file():
    raise SpecError(f"--hostfile {options.hostfile}: no such file (a DeepSpeed hostfile: 'host slots=N' per line)")
  if world > 1 and options.resume_at is not None:
    raise SpecError(f"--resume-at with --nproc {options.nproc}: checkpoints of multi-rank sides are not supported "
                    "yet; run the resume check with --nproc 1")
  for side, kv in pert.items():
    if "fault_rank" in kv and not kv["fault_rank"] < world:
      raise SpecError(f"--perturb {side}:fault_rank={kv['fault_rank']}: the side has ranks 0..{world - 1} "
                      f"(--nproc {options.nproc})")
