"""Collecting what the sides left in a run folder: their step records, final params and moments, trusted only when
whole and of this run (the rule is on the files, `side_outputs`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.runner import SideRun
from parity import weights
from parity.protocol.layout import FINAL_MOMENTS, read_moments, read_steps, read_summary
from parity.protocol.placement import PLACEMENT_FILE, read_placement, writes_placement
from parity.protocol.semantics import SEMANTICS_FILE, read_card

__all__ = ["side_outputs", "collect_sides", "interrupted_run", "placement_entry"]


def collect_sides(run_dir: Path, side_runs: dict[str, SideRun], run_id: str | None,
                  expected_steps: int) -> dict[str, dict[str, Any]]:
  """Reads every side's outputs in run_dir/<side>/ (`side_outputs`; a side whose files are not whole is downgraded).

  Returns:
    {side: {'status': str, 'steps': [StepRecord], 'final': {name: float32 array} | None,
    'moments': parity.protocol.read_moments output | None, 'semantics': the side's card of this run (run_dir/<side>/
    semantics.json, parity.protocol.semantics.read_card) | None, 'placement': `placement_entry`, 'device':
    summary.json's device name | None}}: what
    parity.verdict.sides.compare_sides takes.
  """
  data = {}
  for side, sr in side_runs.items():
    steps, final = side_outputs(run_dir / side, sr, run_id, expected_steps=expected_steps)
    data[side] = {"status": sr.status, "steps": steps, "final": final,
                  "moments": read_moments(run_dir / side / FINAL_MOMENTS) if final else None,
                  "semantics": read_card(run_dir / side / SEMANTICS_FILE, run_id),
                  "placement": placement_entry(run_dir / side, side, sr.summary, run_id),
                  "device": (sr.summary or {}).get("device")}
  return data


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


def interrupted_run(run_dir: Path, side: str) -> SideRun:
  """The SideRun of a side stopped by Ctrl-C (status 'killed'), with the summary run_side left for it."""
  summ = read_summary(run_dir / side / "summary.json") or {"side": side, "status": "killed"}
  return SideRun(side=side, status="killed", returncode=None, wall_s=0.0, peak_rss_bytes=None, summary=summ,
                 error=summ.get("error"))
