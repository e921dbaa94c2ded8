"""`parity.compare(...)`: one comparison from Python, returning the Report."""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Mapping, Sequence

from parity import weights
from parity.checks import compare_sides, verdict
from parity.protocol import read_steps
from parity.report import Report, build_report, write_all
from parity.run import default_run_dir, parse_perturb, prepare_run_dir, resolve
from parity.spec import DEFAULT_PRESET

__all__ = ["compare"]


def compare(preset: str | None = None, *, config: str | Path | Mapping | None = None, overrides: Sequence[str] = (),
            steps: int | None = None, sides: Sequence[str] | None = None, data: str | None = None,
            out: str | Path | None = None, perturb: Sequence[str] | Mapping[str, Mapping] = (),
            timeout_s: float | None = None, progress: bool = False, hf_model: str | Path | None = None,
            deepspeed_config: str | Path | None = None, plan: str | None = None,
            hardware: str = "H100") -> Report:
  """Runs every side of a comparison, each in its own process, and returns the report.

  Args:
    preset: a name from parity.spec.PRESETS (default 'gpt2-small-cpu').
    config: a run config file (YAML/JSON) or mapping, merged over the preset.
    overrides: dotted `section.key=value` strings, applied last.
    steps, sides, data: shortcuts for train.steps, sides and data.
    out: run folder (default runs/<time>-<preset>-<hash>).
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
  Returns:
    The Report (also written as report.json, report.md, metrics.jsonl, loss.png in the run folder).
  Raises:
    SpecError, DataError: bad input, before any side starts.
  """
  from harness.runner import not_run, run_side  # harness depends on parity, not the reverse

  t0 = time.time()
  name = preset or DEFAULT_PRESET
  spec = resolve(preset, config=config, overrides=overrides, steps=steps, sides=sides, data=data)
  plan_choice = None
  if plan is not None:
    spec, plan_choice = _apply_plan(spec, plan, hardware)
  init = None
  if hf_model is not None:
    from parity import convert, hf
    from parity.spec import SpecError
    try:
      spec, init = hf.run_spec_from_hf(hf_model, spec, bin_reader=convert.read_bin)
    except (ValueError, FileNotFoundError) as exc:  # HFFormatError is a SpecError (a ValueError)
      raise SpecError(f"--hf-model {hf_model}: {exc}") from None
  port = None
  if deepspeed_config is not None:
    from parity.migrate import read_deepspeed_config
    from parity.migrate._reverse import port_for_compare
    spec, ds_cfg, port = port_for_compare(read_deepspeed_config(deepspeed_config), spec,
                                          source=str(deepspeed_config))
  pert = parse_perturb(list(perturb), spec.sides) if not isinstance(perturb, Mapping) else dict(perturb)
  run_dir = Path(out) if out is not None else default_run_dir(spec, name)
  prep = prepare_run_dir(spec, run_dir, perturb=pert, init_params=init,
                         deepspeed_config=ds_cfg if port is not None else None)
  if port is not None:
    (run_dir / "migration.json").write_text(port.report.to_json())
    (run_dir / "migration.md").write_text(port.report.to_markdown())
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
    st = read_steps(run_dir / side / "steps.jsonl")
    steps_by_side[side] = st
    final = run_dir / side / "final.safetensors"
    side_data[side] = {"status": sr.status, "steps": st,
                       "final": weights.load(final) if sr.status == "ok" and final.exists() else None}
  init = weights.load(run_dir / "init.safetensors")
  checks, table = compare_sides(side_data, spec=spec, init=init)
  v = verdict(checks, {s: sr.status for s, sr in side_runs.items()})
  report = build_report(spec=spec, preset_name=name, run_dir=run_dir, data_info=prep["corpus"],
                        side_runs=side_runs, side_steps=steps_by_side, checks=checks, params_table=table,
                        verdict=v, wall_s=time.time() - t0, prepare_s=prep["prepare_s"])
  report.data["plan"] = plan_choice
  from parity import memory
  report.data["memory"] = {"predicted_vs_measured": memory.predicted_vs_measured(report.data),
                           "note": "predicted by parity.memory (parity estimate); measured from the live "
                                   "state arrays / engine tensors of each side"}
  if interrupted is not None:
    report.data["verdict"]["message"] = "INTERRUPTED: " + report.data["verdict"]["message"]
    report.data["verdict"]["passed"] = False
  write_all(report)
  if interrupted is not None:
    raise interrupted
  return report


def _interrupted_run(run_dir: Path, side: str):
  from harness.runner import SideRun
  from parity.protocol import read_summary
  summ = read_summary(run_dir / side / "summary.json") or {"side": side, "status": "killed"}
  return SideRun(side=side, status="killed", returncode=None, wall_s=0.0, peak_rss_bytes=None, summary=summ,
                 error=summ.get("error"))


def _apply_plan(spec, plan: str, hardware: str):
  """(spec with the plan pair applied, {name, why}) for `--plan NAME|auto`."""
  from parity import plans
  from parity.spec import SpecError
  if plan != "auto":
    return plans.apply_plan(spec, plan), {"name": plan, "chosen_by": "user"}
  if hardware not in plans.HARDWARE:
    raise SpecError(f"--hardware {hardware!r} is not a preset; known: {', '.join(plans.HARDWARE)}")
  best, ranked = plans.choose_plan(spec.model, spec.train, plans.HARDWARE[hardware], sides=tuple(
      s for s in spec.sides if s in ("jax", "deepspeed")) or ("jax",))
  if best is None:
    raise SpecError(f"--plan auto: no plan pair fits {hardware}: " + "; ".join(plans.explain(best, ranked)))
  return plans.apply_plan(spec, best.name), {"name": best.name, "chosen_by": f"planner ({hardware})",
                                             "why": plans.explain(best, ranked)}


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

    def on_line(side: str, n: int) -> None:
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

    def on_progress(side: str, n: int) -> None:
      prog.start_task(tasks[side])
      prog.update(tasks[side], completed=n)
    yield on_progress
