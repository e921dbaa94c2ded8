"""Reading a finished run's report.json back (`parity report DIR`): every section the summary needs is checked
first, so a truncated, hand-edited or foreign file is refused by name instead of failing half-way."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from parity.inputs import InputError, load_json
from parity.report.build import REPORT_SCHEMA, Report

__all__ = ["load_report"]

_CHECK_KEYS = ("name", "value", "tolerance", "passed", "first_failing_step")


def _need(ok: bool, path: Path, what: str) -> None:
  if not ok:
    raise InputError(f"{path}: {what}; the file is incomplete or not written by `parity compare` "
                     "(rerun the comparison to get a fresh report)")


def load_report(run_dir: str | Path) -> Report:
  """The Report of a finished run folder, with its report.json checked section by section.

  Args:
    run_dir: the folder `parity compare` wrote.
  Returns:
    Report(data=the parsed report.json, run_dir).
  Raises:
    InputError: no such folder or report.json; not UTF-8 JSON; wrong schema; a missing or mistyped section
      (verdict, sides, checks; each side's status, summary and series) named with the key.
  """
  run_dir = Path(run_dir)
  path = run_dir / "report.json"
  if not run_dir.is_dir():
    raise InputError(f"{run_dir} is not a folder: pass the folder of a finished `parity compare` run")
  if not path.exists():
    raise InputError(f"{path} does not exist: pass the folder of a finished `parity compare` run (it may have "
                     "been interrupted before the report was written)")
  try:
    data: Any = load_json(path, what="report")
  except InputError as exc:
    raise InputError(f"{exc} (the run may have been interrupted while writing it)") from None
  _need(isinstance(data, dict) and data.get("schema") == REPORT_SCHEMA, path,
        f"not a parity report (expected schema {REPORT_SCHEMA!r})")
  v = data.get("verdict")
  _need(isinstance(v, dict) and isinstance(v.get("passed"), bool) and isinstance(v.get("message"), str), path,
        "section 'verdict' must hold 'passed' (true/false) and 'message' (text)")
  sides = data.get("sides")
  _need(isinstance(sides, dict), path, "section 'sides' is missing or not a mapping")
  for name, s in sides.items():
    _need(isinstance(s, dict) and isinstance(s.get("status"), str) and isinstance(s.get("summary"), dict),
          path, f"sides.{name} must hold 'status' (text) and 'summary' (mapping)")
    series = s.get("series")
    _need(isinstance(series, dict) and isinstance(series.get("loss"), list)
          and isinstance(series.get("val_loss"), list), path,
          f"sides.{name}.series must hold 'loss' and 'val_loss' (lists)")
  checks = data.get("checks")
  _need(isinstance(checks, list), path, "section 'checks' is missing or not a list")
  for i, ch in enumerate(checks):
    _need(isinstance(ch, dict) and all(k in ch for k in _CHECK_KEYS), path,
          f"checks[{i}] must hold {', '.join(_CHECK_KEYS)}")
  det = data.get("determinism")
  _need(det is None or (isinstance(det, dict) and all(isinstance(x, dict) and "deterministic" in x
                                                      for x in det.values())), path,
        "section 'determinism' must map each side to {deterministic, ...}")
  return Report(data=data, run_dir=run_dir)
