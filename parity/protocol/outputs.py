"""What one side left in its folder, as the harness saw it run (`SideRun`) and as its files hold it (`side_outputs`:
trusted only when whole and of this run). Read by the pipeline as the run goes, and again by parity.report.reverify
from a finished folder: the rule is on the files, in one place."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from parity import weights
from parity.protocol.layout import FINAL_MOMENTS, FINAL_PARAMS, STEPS_FILE, SUMMARY_FILE, read_moments, read_steps, \
  read_summary
from parity.protocol.placement import PLACEMENT_FILE, read_placement, writes_placement

__all__ = ["SideRun", "side_outputs", "placement_entry", "stored_side_run", "rerun_outputs"]


@dataclasses.dataclass
class SideRun:
  """What the harness observed of one side (harness.runner.run_side makes it; a finished folder's is read back from
  its summary.json, `stored_side_run`).

  Attributes:
    side: side name.
    status: one of harness.runner.STATUSES ('ok', 'nan', 'crashed', 'killed', 'timeout', 'not_run').
    returncode: process exit code (negative: killed by that signal); None if never started.
    wall_s: seconds from spawn to exit, as seen by the harness.
    peak_rss_bytes: the child's peak resident set size from wait4 (kernel accounting,
      independent of what the worker reports).
    summary: the worker's summary.json (written by the harness when the worker could not).
    error: what went wrong, or None.
  """
  side: str
  status: str
  returncode: int | None
  wall_s: float
  peak_rss_bytes: int | None
  summary: dict
  error: str | None = None


def stored_side_run(folder: Path, side: str, default_status: str = "missing") -> SideRun:
  """The SideRun of a side that ran in folder/<side>, from the summary.json it left (the harness writes the status it
  decided there; nothing is run); status `default_status` when there is no summary."""
  summ = read_summary(Path(folder) / side / SUMMARY_FILE) or {"side": side, "status": default_status}
  return SideRun(side=side, status=summ.get("status", default_status), returncode=None, wall_s=0.0,
                 peak_rss_bytes=None, summary=summ, error=summ.get("error"))


def placement_entry(out: Path, side: str, summary: dict | None, run_id: str | None) -> dict[str, Any] | None:
  """What the 'placement' check of `side` reads (parity.verdict.placement.placement_check): None for a side whose
  worker writes no placement.json (parity.protocol.placement.writes_placement), else {'record': its placement.json
  of this run or None, 'problem': why it is None (missing, unreadable, another run's; with the side's own
  summary.json `placement_error` when it recorded one)}."""
  if not writes_placement(side):
    return None
  record, problem = read_placement(out / PLACEMENT_FILE, run_id)
  why = (summary or {}).get("placement_error")
  if record is None and why:
    problem = f"{problem}; the side could not write it: {why}"
  return {"record": record, "problem": problem}


def side_outputs(out: Path, sr, run_id: str | None, *, expected_steps: int | None) -> tuple[list[dict], dict | None]:
  """Reads what a side left in `out` (run_dir/<side>), trusting an 'ok' only when its files are whole and this run's.

  A side that reports 'ok' is downgraded to 'crashed' (sr.status, sr.error and sr.summary updated; the message names
  the file) when: its summary carries another run's id; steps.jsonl is missing, truncated or holds another number
  of records than `expected_steps`; or final.safetensors is missing or unreadable. The rule is on the files, not on
  how they went missing (deleted, truncated, disk full, an earlier run's leftovers).
  Args:
    out: the side's folder.
    sr: its SideRun (mutated on a downgrade).
    run_id: this run's id (None: not checked).
    expected_steps: StepRecords an 'ok' run must have left (None: not checked).
  Returns:
    (StepRecords, final params or None).
  """
  try:
    steps = read_steps(out / STEPS_FILE)
  except (OSError, UnicodeDecodeError) as exc:
    steps, problem = [], f"{out / STEPS_FILE} cannot be read ({exc})"
  else:
    problem = None
  if sr.status != "ok":
    return steps, None
  theirs = (sr.summary or {}).get("run_id")
  final = None
  if run_id is not None and theirs is not None and theirs != run_id:
    problem = f"{out / SUMMARY_FILE} belongs to another run (run_id {theirs}, this run {run_id})"
  elif problem is None and not (out / STEPS_FILE).is_file():
    problem = f"{out / STEPS_FILE} is missing (deleted while the run was going?)"
  elif problem is None and expected_steps is not None and len(steps) != expected_steps:
    problem = (f"{out / STEPS_FILE} holds {len(steps)} whole step records, {expected_steps} expected "
               "(truncated or overwritten while the run was going?)")
  if problem is None:
    try:
      final = weights.load(out / FINAL_PARAMS)
    except Exception as exc:  # missing, truncated, foreign: any reason makes the side's result untrustworthy
      problem = f"{out / FINAL_PARAMS} cannot be read ({type(exc).__name__}: {exc})"
  if problem is not None:
    sr.status, sr.error = "crashed", f"the side reported 'ok' but its output is not whole: {problem}"
    sr.summary = {**(sr.summary or {}), "status": "crashed", "error": sr.error}
    return steps, None
  return steps, final


def rerun_outputs(folder: Path, side: str, sr, run_id: str | None, steps: int):
  """(StepRecords, final params or None, moments or None) a rerun left in folder/<side> (`side_outputs`)."""
  rerun_steps, final = side_outputs(Path(folder) / side, sr, run_id, expected_steps=steps)
  moments = read_moments(Path(folder) / side / FINAL_MOMENTS) if final is not None else None
  return rerun_steps, final, moments
