"""What a comparison does after its report is written, when asked: the regression gate (`--baseline`) and the
tracker mirror (`--tracker`). Both are checked before any side starts (`PostRun.prepare`: a baseline that cannot be
read or a tracker that is not installed is bad input, exit 2), and applied to the finished run (`PostRun.apply`),
never changing report.json: the gate writes gate.json/gate.md beside it. The pipeline does not import this module:
its callers (`parity compare`, parity.compare) hand it `PostRun.for_options` (parity.pipeline.compare.AfterStep)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

from parity.history.gate import GateResult, check_against, write_gate
from parity.history.snapshot import Snapshot, load_baseline, snapshot_from_report
from parity.report.trackers import check_trackers, mirror_run, open_tracker

__all__ = ["PostRun", "PostRunResult", "baseline_as_moved"]


@dataclasses.dataclass
class PostRunResult:
  """gate: parity.history.gate.GateResult (None without --baseline); gate_files: name -> path written (gate.json,
  gate.md); messages: one line per tracker mirrored or failed, or a gate file that could not be written."""
  gate: GateResult | None = None
  gate_files: dict[str, Path] = dataclasses.field(default_factory=dict)
  messages: list[str] = dataclasses.field(default_factory=list)

  @property
  def passed(self) -> bool:
    """False when the gate found a metric outside its gate (a tracker that failed does not change it)."""
    return self.gate is None or bool(self.gate.passed)


@dataclasses.dataclass
class PostRun:
  """The checked --baseline (a parity.history.snapshot.Snapshot) and --tracker specs [(kind, target)]."""
  baseline: Snapshot | None = None
  trackers: list[tuple[str, str]] = dataclasses.field(default_factory=list)

  @classmethod
  def prepare(cls, baseline: str | Path | None, trackers: Sequence[str] = ()) -> "PostRun":
    """Reads the baseline (parity.history.snapshot.load_baseline) and checks every tracker is installed
    (parity.report.trackers.check_trackers). Raises InputError naming the flag, the value and the fix."""
    return cls(baseline=None if baseline is None else load_baseline(baseline), trackers=check_trackers(trackers))

  @classmethod
  def for_options(cls, options) -> "PostRun":
    """`prepare` from a comparison's options (parity.pipeline.compare.RunOptions: baseline, trackers): the
    after-report step the callers of the pipeline give it (parity.pipeline.compare.AfterStep)."""
    return cls.prepare(options.baseline, options.trackers)

  @property
  def empty(self) -> bool:
    return self.baseline is None and not self.trackers

  def apply(self, report) -> PostRunResult:
    """Gates `report` (parity.report.build.Report) against the baseline, writing gate.json/gate.md into its folder,
    and mirrors its sides' steps.jsonl to each tracker. Never raises for a file or tracker error: it is a message."""
    out = PostRunResult()
    if self.baseline is not None:
      out.gate = check_against(snapshot_from_report(report), baseline_as_moved(self.baseline, report))
      try:
        out.gate_files = write_gate(out.gate, report.run_dir)
      except OSError as exc:
        out.messages.append(f"gate.json/gate.md could not be written in {report.run_dir}: {exc.strerror or exc}")
    for kind, target in self.trackers:
      try:
        t = open_tracker(kind, target, Path(report.run_dir).name)
        n = mirror_run(report.run_dir, [t], sides=list(report.record.sides))
        out.messages.append(f"tracker {kind}:{target}: {n} step records mirrored")
      except Exception as exc:  # a tracker's own failure must not lose the run's result
        out.messages.append(f"tracker {kind}:{target} failed: {type(exc).__name__}: {str(exc)[:200]}")
    return out


def baseline_as_moved(baseline, report):
  """The baseline Snapshot named where it now lies: with `--out X --baseline X --force` the old run X (read before
  the run started) was moved aside to report.json's run_folder.moved_aside_to, and X is the new run, so the gate
  must not call the baseline "X"."""
  moved = report.record.run_folder.moved_aside_to
  src, rd = Path(baseline.source), Path(report.run_dir).resolve()
  if not moved:
    return baseline
  if src.resolve() == rd:
    return dataclasses.replace(baseline, source=Path(moved))
  if src.resolve().parent == rd:  # X/card.json
    return dataclasses.replace(baseline, source=Path(moved) / src.name)
  return baseline
