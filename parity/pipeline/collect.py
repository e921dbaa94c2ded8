"""Collecting what the sides left in a run folder: their step records, final params and moments, trusted only when
whole and of this run (the rule is on the files: parity.protocol.outputs.side_outputs, re-exported here)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from parity.protocol.layout import FINAL_MOMENTS, read_moments, read_summary
from parity.protocol.outputs import SideRun, placement_entry, side_outputs
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


def interrupted_run(run_dir: Path, side: str) -> SideRun:
  """The SideRun of a side stopped by Ctrl-C (status 'killed'), with the summary run_side left for it."""
  summ = read_summary(run_dir / side / "summary.json") or {"side": side, "status": "killed"}
  return SideRun(side=side, status="killed", returncode=None, wall_s=0.0, peak_rss_bytes=None, summary=summ,
                 error=summ.get("error"))
