"""Assembling report.json from a run folder."""
from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from parity.environment import cpu_model
from parity.protocol.layout import (RERUN_DIRS)
from parity.protocol.placement import PLACEMENT_FILE
from parity.protocol.semantics import SEMANTICS_FILE, read_card
from parity.report.perturbations import LR_KEYS, perturbations_ran, ran_value  # noqa: F401 (read from here too)
from parity.report.placement_view import placement_section
from parity.report.run_record import REPORT_SCHEMA, RunRecord
from parity.semantics import DIFFED, diff_cards
from parity.sizing.measured import predicted_vs_measured
from parity.spec import RunSpec, config_hash, to_dict
from parity.verdict.check import Check
from parity.verdict.sides import Verdict
from parity.verdict.tolerances import TOLERANCES

__all__ = ["Report", "EXIT_INCOMPLETE", "exit_code", "build_report", "REPORT_SCHEMA", "RUN_ARTIFACTS",
           "EXAMPLE_ARTIFACTS", "SIDE_ARTIFACTS", "RERUN_ARTIFACTS",
           "artifact_paths", "artifact_hashes", "file_digest", "series_json", "verdict_json", "params_table_json",
           "run_inputs", "perturbations_ran", "ran_value", "semantics_section"]

EXAMPLE_ARTIFACTS = ("loss_mask.npy", "segment_ids.npy", "positions.npy", "val_loss_mask.npy", "val_segment_ids.npy",
                     "val_positions.npy")
"""The example arrays of a padded/packed run (parity.pipeline.examples_input): inputs the sides read as they read
batches.npy."""
RUN_ARTIFACTS = ("request.json", "init.safetensors", "batches.npy", "val_batches.npy", *EXAMPLE_ARTIFACTS,
                 "deepspeed_config.given.json", "deepspeed_config.resolved.json")  # the last two: --deepspeed-config
SIDE_ARTIFACTS = ("steps.jsonl", "summary.json", "final.safetensors", "final_moments.safetensors", SEMANTICS_FILE,
                  PLACEMENT_FILE)
RERUN_ARTIFACTS = ("steps.jsonl", "summary.json", "final.safetensors")
"""The files a verdict rests on (the inputs both sides read, each side's outputs the checks read or the report
renders: placement.json of a JAX side, parity.report.placement_view; and the outputs of
the noise/determinism/resume reruns their checks read, in noise/, repeat/ and resume/<side>/); report.json records
their sha256 and size at write time so that `parity report` can say which changed since the run."""
EXIT_INCOMPLETE = 3
"""The exit code of a run that passed but ran fewer sides than were asked: sides the user did not name (the default
sides) left out because their framework is not installed here or this machine refuses the sockets they need."""


def exit_code(*, passed: bool, asked: int, ran: int) -> int:
  """A finished run's exit code: 1 when it did not pass (parity does not hold, a side failed, a report file could not
  be written, the --baseline gate moved), else EXIT_INCOMPLETE (3) when fewer of the `asked` sides `ran`, else 0.
  Bad input exits 2 before a run exists, so it never reaches here. A user who names one side (`--sides jax`) asked for
  one: ONE SIDE, 0.

  >>> exit_code(passed=True, asked=3, ran=1), exit_code(passed=False, asked=3, ran=1), exit_code(passed=True,
  ...                                                                                             asked=1, ran=1)
  (3, 1, 0)
  """
  if not passed:
    return 1
  return EXIT_INCOMPLETE if ran < asked else 0


SERIES_KEYS = ("loss", "grad_norm", "lr", "loss_scale", "skipped", "step_time_s", "tokens")


@dataclasses.dataclass
class Report:
  """A finished comparison. `data` is exactly what report.json holds (written by build_report and parity.report.write
  only); `record` is how everything else reads it (parity.report.run_record.RunRecord); `post` what ran after it was
  written (parity.history.after.PostRunResult: the --baseline gate, --tracker mirroring), None when nothing was
  asked."""
  data: dict[str, Any]
  run_dir: Path
  post: Any = dataclasses.field(default=None, repr=False, compare=False)

  @property
  def record(self) -> RunRecord:
    """report.json as a RunRecord, read from `data` as it is now (the writer adds write_errors to it)."""
    return RunRecord.of(self.data)

  @property
  def passed(self) -> bool:
    return bool(self.record.verdict.passed)

  @property
  def message(self) -> str:
    return self.record.verdict.message

  @property
  def left_out(self) -> dict[str, str]:
    """The sides asked for but left out before anything started, because this machine cannot run them (their
    framework is not installed, or it refuses the sockets they need): side -> the line recorded for it. Only
    default sides are left out: a named side is refused (exit 2) or kept and recorded as not run (exit 1)."""
    rec = self.record
    return {s: w.reason or "" for s, w in rec.sides_not_run.items() if not w.named and s not in rec.sides}

  @property
  def exit_code(self) -> int:
    """0 when parity holds and every report file was written; 1 when parity does not hold, or a report file could
    not be written (`write_errors`: a result nobody can cite), or the --baseline gate found a metric that moved;
    3 (EXIT_INCOMPLETE) when it holds but fewer sides ran than were asked (`left_out`); bad input exits 2 before a
    report exists (`exit_code`, the function, is the rule)."""
    gate_ok = self.post is None or self.post.passed
    ran = len(self.record.sides)
    return exit_code(passed=self.passed and not self.record.write_errors and gate_ok,
                     asked=ran + len(self.left_out), ran=ran)

  def incomplete_line(self) -> str | None:
    """The line saying which sides were left out, why, and that the run exits 3; None when none was.

    'incomplete: 1 of 3 asked sides ran (jax); left out: deepspeed (PyTorch is not installed here), torch (PyTorch
    is not installed here); exit code 3. ...'"""
    out = self.left_out
    if not out:
      return None
    ran = list(self.record.sides)
    why = ", ".join(f"{s} ({_why(s, line)})" for s, line in out.items())
    return (f"incomplete: {len(ran)} of {len(ran) + len(out)} asked sides ran ({', '.join(ran)}); left out: {why}; "
            f"exit code {EXIT_INCOMPLETE}. Make them runnable here (the lines above say how), or ask for only these "
            f"sides: --sides {','.join(ran)}")

  @property
  def checks(self) -> list[dict]:
    """The checks as stored (report.json checks)."""
    return [c.json for c in self.record.checks]

  def set_write_errors(self, errors: list[dict]) -> None:
    """report.json's write_errors ([{file, error}]: parity.report.write records its own; a `parity report` re-render
    sets its own, in memory only, for the summary it prints)."""
    self.data["write_errors"] = list(errors)

  def set_written_to(self, folder: Path) -> None:
    """report.json's report_written_to: the fallback folder the report went to (parity.report.write)."""
    self.data["report_written_to"] = str(folder)

  def side(self, name: str) -> dict:
    """One side as stored (report.json sides.<name>); KeyError for a side the run does not have."""
    return self.record.sides[name].json

  def __repr__(self) -> str:
    return f"Report({self.run_dir}, {self.message!r})"


def _why(side: str, line: str) -> str:
  """The reason in a left-out side's line ("deepspeed: not run: PyTorch is not installed here, which ..." ->
  "PyTorch is not installed here": parity.installed.not_installed_line, parity.sockets.not_run_line)."""
  text = line.split(f"{side}: not run: ", 1)[-1]
  return text.split(", which ", 1)[0].strip() or "not run here"


def _versions() -> dict[str, str]:
  out = {}
  for pkg in ("parity", "numpy", "safetensors", "jax", "jaxlib", "flax", "optax", "torch", "deepspeed"):
    try:
      out[pkg] = metadata.version(pkg)
    except metadata.PackageNotFoundError:
      pass
  return out


def _git_state() -> dict[str, Any] | None:
  """{rev, dirty} of the git checkout holding this package (dirty: uncommitted changes to tracked files), or None
  when it is not a checkout or git is missing (an installed wheel)."""
  root = Path(__file__).resolve().parents[2]
  if not (root / ".git").exists():
    return None
  try:
    rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    st = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                        capture_output=True, text=True, timeout=20)
  except (OSError, subprocess.TimeoutExpired):
    return None
  if rev.returncode != 0:
    return None
  return {"rev": rev.stdout.strip(), "dirty": bool(st.stdout.strip()) if st.returncode == 0 else None}


def _environment() -> dict[str, Any]:
  """The harness's environment (report.json 'environment'): Python, OS, CPU, load, versions, git state."""
  try:
    load = [round(x, 2) for x in os.getloadavg()]
  except OSError:
    load = None
  return {"python": platform.python_version(), "platform": platform.platform(), "machine": platform.machine(),
          "cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "load_avg_1_5_15": load,
          "hostname": platform.node(), "versions": _versions(), "git": _git_state()}


def _migration(run_dir: Path) -> dict[str, Any] | None:
  """{source, status, file, entries, loss_normalization (what the config implies, text, or None)} of the DeepSpeed
  config port (migration.json) the run was given, or None."""
  try:
    m = json.loads((Path(run_dir) / "migration.json").read_text())
  except (OSError, ValueError):
    return None
  ln = m.get("loss_normalization")  # parity.migrate._loss_norm; absent from an older port's migration.json
  return {"source": m.get("source"), "status": m.get("status"), "file": "migration.md",
          "entries": len(m.get("entries") or []), "loss_normalization": ln.get("why") if isinstance(ln, dict) else None}


def series_json(steps: list[dict]) -> dict[str, list]:
  """report.json sides.<side>.series from a side's StepRecords: step, SERIES_KEYS, val_step and val_loss (lists;
  a non-finite number as None (NaN) or its text (inf))."""
  s = {"step": [r["step"] for r in steps]}
  for k in SERIES_KEYS:
    s[k] = [_num(r.get(k)) for r in steps]
  s["val_step"] = [r["step"] for r in steps if "val_loss" in r]
  s["val_loss"] = [_num(r["val_loss"]) for r in steps if "val_loss" in r]
  return s


def params_table_json(table: list[dict]) -> list[dict]:
  """report.json params_table from parity.verdict.sides.compare_sides' table (a non-finite number as None or text)."""
  return [{k: _num(v) for k, v in row.items()} for row in table]


def _num(v):
  if isinstance(v, float) and not math.isfinite(v):
    return None if math.isnan(v) else str(v)
  return v


def build_report(*, spec: RunSpec, preset_name: str, run_dir: Path, data_info: dict, side_runs: dict,
                 side_steps: dict[str, list[dict]], checks: list[Check], params_table: list[dict],
                 verdict: Verdict, wall_s: float, prepare_s: float, plan: dict | None = None,
                 reruns: dict[str, Any] | None = None, reruns_s: float = 0.0, run_folder: dict | None = None,
                 interrupted: bool = False, side_loads: dict[str, dict] | None = None,
                 checkpoint: str | None = None, sides_not_run: dict[str, dict] | None = None) -> Report:
  """Assembles report.json (schema in parity.report), the one place its data is made: nothing is patched afterwards.

  Args:
    spec, preset_name, run_dir, data_info: the run, its name, folder and corpus (PreparedRun.data_info).
    side_runs: side -> harness.runner.SideRun; side_steps: side -> StepRecords.
    checks, params_table, verdict: parity.verdict.sides.compare_sides + reruns' checks, and their verdict.
    wall_s: seconds from the call to now; prepare_s: seconds writing the inputs.
    plan: the plan pair chosen (parity.pipeline.resolve.ResolvedRun.plan) or None.
    reruns: {'noise_envelope', 'determinism', 'resume'} sections (parity.pipeline.reruns.Reruns.sections); reruns_s: the
      seconds their workers were busy. timing.overhead_ratio = wall_s / (sum(sides_s) + reruns_s), computed here.
    run_folder: {run_id, moved_aside_to, stale_lock_taken_over} of the claimed folder.
    interrupted: a Ctrl-C stopped the run: the verdict fails and its message says so.
    side_loads: side -> {start, end}: os.getloadavg() (1/5/15-minute load) when the side started and ended
      (the sides run one after another on a shared machine: their timings are only as good as the load).
    checkpoint: the Hugging Face checkpoint folder the initial weights and model came from (`--hf-model`), or None.
    sides_not_run: side -> {'reason', 'named'} of each side that never started because this machine cannot run it
      (parity.sockets.plan_sides: a side the user named is also in `sides`, status not_run; one they did not name
      is left out of the run and recorded only here). None: every side could start.
  Returns:
    The Report (JSON-ready data; not written: parity.report.write_all).
  """
  sides, sides_s = _sides(side_runs, side_steps, side_loads)
  data = {
      "schema": REPORT_SCHEMA,
      "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
      "run_dir": str(run_dir),
      "preset": preset_name,
      "checkpoint": checkpoint_record(checkpoint),
      "config_hash": config_hash(spec),
      "run": to_dict(spec),
      "data": data_info,
      "environment": _environment(),
      "migration": _migration(run_dir),
      "verdict": verdict_json(verdict, interrupted),
      "tolerances": {p: {m: dataclasses.asdict(t) for m, t in tab.items()} for p, tab in TOLERANCES.items()
                     if p == spec.train.precision},
      "checks": [c.to_json() for c in checks],
      "params_table": params_table_json(params_table),
      "sides": sides, "sides_not_run": dict(sides_not_run or {}),
      "timing": _timing(wall_s, prepare_s, sides_s, reruns_s),
      "plan": plan,
      **_rerun_sections(reruns),
      "memory": None,
      "run_folder": run_folder,
      "semantics": semantics_section(run_dir, list(sides), (run_folder or {}).get("run_id")),
      "placement": placement_section(run_dir, sides),
      "artifacts": artifact_hashes(run_dir, list(sides)),
      **run_inputs(run_dir),
  }
  data["perturbations"] = perturbations_ran(run_dir, json.loads(json.dumps(sides, default=str)))
  data = json.loads(json.dumps(data, default=str))
  data["memory"] = {"predicted_vs_measured": predicted_vs_measured(data),  # reads the sides' summaries
                    "note": MEMORY_NOTE}
  return Report(data=data, run_dir=run_dir)


def _rerun_sections(reruns: dict[str, Any] | None) -> dict[str, Any]:
  """report.json's noise_envelope, determinism, resume, equivalence and backend sections, in that order (None: no
  reruns; backend None: no side ran on an accelerator in an fp32 run)."""
  reruns = reruns or {}
  return {"noise_envelope": reruns.get("noise_envelope"), "determinism": reruns.get("determinism", {}),
          "resume": reruns.get("resume", {}), "equivalence": reruns.get("equivalence") or {},
          "backend": reruns.get("backend")}


MEMORY_NOTE = ("predicted by parity.sizing.memory (parity estimate); measured from the live state arrays / engine "
               "tensors of each side")
"""report.json memory.note: where the predicted and the measured figures come from."""


def semantics_section(run_dir: Path, sides: list[str], run_id: str | None) -> dict[str, Any]:
  """report.json 'semantics': {'cards': {side: its card of this run (run_dir/<side>/semantics.json,
  parity.protocol.semantics.read_card) or None}, 'rows': [{item, values {side: value}, agree}] for every
  parity.semantics.DIFFED item over the sides with a card (agree: all equal as parity.semantics.diff_cards holds
  them; an item none of the cards holds, cards of an older parity, has no row)}. What the 'semantics' checks rest
  on; report.md/.html render it and card.json carries it."""
  cards = {s: read_card(Path(run_dir) / s / SEMANTICS_FILE, run_id) for s in sides}
  have = {s: c for s, c in cards.items() if c is not None}
  rows = []
  for item in DIFFED:
    if have and not any(item in (c.get("items") or {}) for c in have.values()):
      continue  # cards of an older parity, written before the item existed: no row (as diff_cards compares)
    values = {s: (c.get("items") or {}).get(item) for s, c in have.items()}
    first = next(iter(have.values()), None)
    agree = all(not any(k == item for k, _, _ in diff_cards(first, c)) for c in have.values()) if first else True
    rows.append({"item": item, "values": values, "agree": agree})
  return {"cards": cards, "rows": rows}


def _timing(wall_s: float, prepare_s: float, sides_s: dict[str, float], reruns_s: float) -> dict[str, Any]:
  """report.json timing (seconds): overhead_ratio = wall_s / (sum(sides_s) + reruns_s), None when nothing ran."""
  busy_total = sum(sides_s.values()) + reruns_s
  return {"wall_s": wall_s, "prepare_s": prepare_s, "sides_s": sides_s, "self_runs_s": reruns_s,
          "overhead_ratio": (wall_s / busy_total) if busy_total > 0 else None}


def checkpoint_record(folder: str | None) -> dict | None:
  """report.json 'checkpoint': {path, architecture} of the `--hf-model` folder (architecture: config.json's
  architectures[0], None when unreadable); None for a run from seeded initial weights."""
  if folder is None:
    return None
  try:
    arch = (json.loads((Path(folder) / "config.json").read_text()).get("architectures") or [None])[0]
  except (OSError, ValueError, AttributeError, IndexError, TypeError):
    arch = None
  return {"path": str(folder), "architecture": arch if isinstance(arch, str) else None}


def _sides(side_runs: dict, side_steps: dict[str, list[dict]], side_loads: dict[str, dict] | None
           ) -> tuple[dict[str, dict], dict[str, float]]:
  """report.json's 'sides' (status, error, summary, per-step series, load) and each side's busy seconds: its own
  init + compile + train times, or the wall time the harness saw for a side that did not finish."""
  sides, sides_s = {}, {}
  for name, sr in side_runs.items():
    summ = sr.summary or {}
    sides[name] = {"status": sr.status, "error": sr.error, "returncode": sr.returncode, "wall_s": sr.wall_s,
                   "harness_peak_rss_bytes": sr.peak_rss_bytes, "summary": summ,
                   "series": series_json(side_steps.get(name, [])), "load": (side_loads or {}).get(name)}
    busy = sum(float(summ.get(k) or 0.0) for k in ("init_s", "compile_s", "train_s"))
    sides_s[name] = busy if sr.status == "ok" else sr.wall_s
  return sides, sides_s


def verdict_json(verdict: Verdict, interrupted: bool) -> dict:
  """The verdict as report.json holds it; an interrupted run never passes, and its message says it stopped early."""
  out = verdict.to_json()
  if interrupted:
    msg = out["message"]
    out["message"] = ("INTERRUPTED: stopped before every run and check finished; so far: "
                      + (msg.replace("PASS: ", "", 1) if msg.startswith("PASS") else msg))
    out["passed"] = False
  return out


def file_digest(path: Path) -> dict[str, Any]:
  """{'sha256': hex digest, 'bytes': size} of a file, read in 8 MiB blocks (~1 s per GB on one core).
  Raises OSError when it cannot be read."""
  h, n = hashlib.sha256(), 0
  with open(path, "rb") as f:
    while block := f.read(8 * 2**20):
      h.update(block)
      n += len(block)
  return {"sha256": h.hexdigest(), "bytes": n}


def artifact_paths(sides: list[str]) -> list[str]:
  """The relative paths report.json['artifacts'] covers for a run of `sides`: RUN_ARTIFACTS, each side's
  SIDE_ARTIFACTS and each rerun folder's (parity.protocol.layout.RERUN_DIRS: noise/, repeat/, resume/, backend/)
  RERUN_ARTIFACTS per side (those that exist are recorded)."""
  return [*RUN_ARTIFACTS, *(f"{side}/{name}" for side in sides for name in SIDE_ARTIFACTS),
          *(f"{sub}/{side}/{name}" for sub in RERUN_DIRS for side in sides for name in RERUN_ARTIFACTS)]


def artifact_hashes(run_dir: Path, sides: list[str]) -> dict[str, dict]:
  """relative path -> file_digest for each `artifact_paths` file of `run_dir` that exists (a side that failed early
  has no final.safetensors, a run without reruns no noise/: simply not listed); a file that cannot be read is
  listed as {'error': strerror}."""
  out: dict[str, dict] = {}
  for rel in artifact_paths(sides):
    p = Path(run_dir) / rel
    if p.is_file():
      try:
        out[rel] = file_digest(p)
      except OSError as exc:
        out[rel] = {"error": exc.strerror or str(exc)}
  return out


def _request(run_dir: Path) -> dict[str, Any]:
  try:
    return json.loads((Path(run_dir) / "request.json").read_text())
  except (OSError, ValueError):
    return {}


def run_inputs(run_dir: Path) -> dict[str, Any]:
  """report.json's 'inputs' (the data, its tokens and the checkpoint: parity.pipeline.folder.inputs_record) and
  'deepspeed_files' (the DeepSpeed config copied into the run folder as given and as the DeepSpeed side ran it,
  each {file, sha256, bytes}), from request.json; None each when the request has none."""
  req = _request(run_dir)
  return {"inputs": req.get("inputs"), "deepspeed_files": req.get("deepspeed_files")}

