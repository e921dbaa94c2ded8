"""What a comparison does after its report is written, when asked: the regression gate (`--baseline`) and the
tracker mirror (`--tracker`). Both are checked before any side starts (`PostRun.prepare`: a baseline that cannot be
read or a tracker that is not installed is bad input, exit 2), and applied to the finished run (`PostRun.apply`),
never changing report.json: the gate writes gate.json/gate.md beside it."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

__all__ = ["PostRun", "PostRunResult", "print_gate"]


@dataclasses.dataclass
class PostRunResult:
  """gate: parity.report.gate.GateResult (None without --baseline); gate_files: name -> path written (gate.json,
  gate.md); messages: one line per tracker mirrored or failed, or a gate file that could not be written."""
  gate: object | None = None
  gate_files: dict[str, Path] = dataclasses.field(default_factory=dict)
  messages: list[str] = dataclasses.field(default_factory=list)

  @property
  def passed(self) -> bool:
    """False when the gate found a metric outside its gate (a tracker that failed does not change it)."""
    return self.gate is None or bool(self.gate.passed)


@dataclasses.dataclass
class PostRun:
  """The checked --baseline (a parity.report.gate.Snapshot) and --tracker specs [(kind, target)]."""
  baseline: object | None = None
  trackers: list[tuple[str, str]] = dataclasses.field(default_factory=list)

  @classmethod
  def prepare(cls, baseline: str | Path | None, trackers: Sequence[str] = ()) -> "PostRun":
    """Reads the baseline (parity.report.gate.load_baseline) and checks every tracker is installed
    (parity.report.trackers.check_trackers). Raises InputError naming the flag, the value and the fix."""
    from parity.report.gate import load_baseline
    from parity.report.trackers import check_trackers
    return cls(baseline=None if baseline is None else load_baseline(baseline), trackers=check_trackers(trackers))

  @property
  def empty(self) -> bool:
    return self.baseline is None and not self.trackers

  def apply(self, report) -> PostRunResult:
    """Gates `report` (parity.report.build.Report) against the baseline, writing gate.json/gate.md into its folder,
    and mirrors its sides' steps.jsonl to each tracker. Never raises for a file or tracker error: it is a message."""
    from parity.report.gate import check_against, snapshot_from_report, write_gate
    from parity.report.trackers import mirror_run, open_tracker
    out = PostRunResult()
    if self.baseline is not None:
      out.gate = check_against(snapshot_from_report(report), _moved_baseline(self.baseline, report))
      try:
        out.gate_files = write_gate(out.gate, report.run_dir)
      except OSError as exc:
        out.messages.append(f"gate.json/gate.md could not be written in {report.run_dir}: {exc.strerror or exc}")
    for kind, target in self.trackers:
      try:
        t = open_tracker(kind, target, Path(report.run_dir).name)
        n = mirror_run(report.run_dir, [t], sides=list(report.data["sides"]))
        out.messages.append(f"tracker {kind}:{target}: {n} step records mirrored")
      except Exception as exc:  # noqa: BLE001  a tracker's own failure must not lose the run's result
        out.messages.append(f"tracker {kind}:{target} failed: {type(exc).__name__}: {str(exc)[:200]}")
    return out


def _moved_baseline(baseline, report):
  """The baseline Snapshot named where it now lies: with `--out X --baseline X --force` the old run X (read before
  the run started) was moved aside to report.json's run_folder.moved_aside_to, and X is the new run, so the gate
  must not call the baseline "X"."""
  import dataclasses as dc
  moved = (report.data.get("run_folder") or {}).get("moved_aside_to")
  src, rd = Path(baseline.source), Path(report.run_dir).resolve()
  if not moved:
    return baseline
  if src.resolve() == rd:
    return dc.replace(baseline, source=Path(moved))
  if src.resolve().parent == rd:  # X/card.json
    return dc.replace(baseline, source=Path(moved) / src.name)
  return baseline


def print_gate(result, con) -> None:
  """The gate's table (metric, side, baseline, new, change, gate, result), its notes and the one-line outcome."""
  from rich.table import Table
  t = Table(title=f"regression gate — {result.new} against {result.baseline}")
  for col in ("metric", "side", "baseline", "new", "change", "gate", "result"):
    t.add_column(col)
  for r in result.rows:
    res = f"[red]{r.status}[/red]" if r.status in ("MOVED", "FAIL") else r.status
    t.add_row(r.metric, r.side, r.baseline, r.new, r.change, r.gate, res + (f" ({r.note})" if r.note else ""))
  con.print(t)
  for n in result.notes:
    con.print(f"- {n}", soft_wrap=True)
  style = "bold green" if result.passed else "bold red"
  con.print(f"[{style}]{result.message()}[/{style}]", soft_wrap=True)
