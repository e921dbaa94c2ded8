"""Reading a finished run's report.json back (`parity report DIR`) and verifying it: `load_report` (every section the
summary needs is checked first, parity.report.run_record.read_run, so a truncated, hand-edited or foreign file is
refused by name instead of failing half-way) and `verify_report` (its files re-hashed, its checks recomputed)."""
from __future__ import annotations

import math
from pathlib import Path

from parity.inputs import ascii_number
from parity.report import build
from parity.report.build import Report
from parity.report.reverify import Unverifiable, differences, recompute
from parity.report.run_record import read_run
from parity.verdict.gating import ALWAYS_REPORTED_ONLY, ENVELOPE_DECIDES, reported_only_allowed

__all__ = ["load_report", "verify_report", "check_contradictions", "finite_number", "peak_load"]

def load_report(run_dir: str | Path) -> Report:
  """The Report of a finished run folder: report.json read and checked section by section
  (parity.report.run_record.read_run; Report.record is the typed run).

  Raises:
    InputError: no such folder or report.json; not UTF-8 JSON; wrong schema; a missing or mistyped section
      (verdict, sides, checks; each side's status, summary and series) named with the key.
  """
  return Report(data=read_run(run_dir).json, run_dir=Path(run_dir))


_AT_LEAST = ("completed", "updates")  # checks that pass when value >= tolerance (steps run, updates compared)


def finite_number(v) -> float | None:
  """A figure report.json (or a card) stores, as a float: None for a missing one, text ('inf', 'nan': how
  report.json keeps a non-finite number), a bool, or a non-finite value."""
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    return None
  return float(v) if math.isfinite(v) else None


def peak_load(load) -> float | None:
  """The highest 1-minute load average recorded around a side (report.json sides.<side>.load: {start: [1, 5, 15],
  end: [...]} of os.getloadavg()), None when none was recorded."""
  vals = [x[0] for x in (load or {}).values() if isinstance(x, list) and x and finite_number(x[0]) is not None]
  return max(vals) if vals else None


def _number(v) -> float:
  if isinstance(v, str):  # 'inf', 'nan': how report.json keeps a non-finite number; ASCII only
    return ascii_number(v, float)
  return float(v) if isinstance(v, (int, float)) else float("nan")


def check_contradictions(checks: list[dict], precision: str | None = None) -> list[str]:
  """The stored checks whose flags their own figures contradict: a check marked passed whose value is NaN or beyond
  its tolerance (value <= tolerance for difference checks; value >= tolerance for 'completed' and 'updates'), or a
  check stored as reported only where parity.verdict.gating allows none (determinism always; in bf16/fp16 a
  pointwise check whose noise-envelope check for the same pair is there). A failing flag with figures inside the
  tolerance is not flagged here (params checks pass per tensor; the recomputation in verify_report catches it)."""
  out = []
  for i, c in enumerate(checks):
    if c.get("gating") is False and not reported_only_allowed(c, checks, precision):
      out.append(f"checks[{i}] ({c.get('name')}) is stored as not gating, which only {ALWAYS_REPORTED_ONLY} "
                 f"checks are, and in bf16/fp16 the {', '.join(ENVELOPE_DECIDES)} checks of a pair its noise "
                 "envelope decides")
    if c.get("passed") is not True:
      continue
    v, t = _number(c.get("value")), _number(c.get("tolerance"))
    # NaN compares False: a NaN never passes. The checks decide on a ratio (|Δ|/allowed <= 1), so a pass may sit one
    # rounding step past value <= tolerance: 1e-9 relative slack, far below any edit that changes a verdict
    ok = v >= t * (1 - 1e-9) if c.get("metric") in _AT_LEAST else v <= t + 1e-9 * abs(t)
    if not ok:
      rule = ">=" if c.get("metric") in _AT_LEAST else "<="
      out.append(f"checks[{i}] ({c.get('name')}) is marked passed but its value {c.get('value')} is not "
                 f"{rule} its tolerance {c.get('tolerance')}")
  return out


def _artifact_changes(rd: Path, run, sides: list[str]) -> list[str]:
  """The recorded artifacts (parity.report.build.artifact_paths) that are missing, unreadable, of another size (not
  hashed: the size already shows it) or of another sha256 now, and those present but not recorded."""
  changed = []
  for rel in build.artifact_paths(sides):
    p, rec = rd / rel, run.artifact(rel)
    if rec is None:
      if p.is_file():
        changed.append(f"{rel} (present, but report.json records no hash for it)")
      continue
    if not isinstance(rec, dict) or "sha256" not in rec:
      continue  # recorded as unreadable when the report was written: the checks saw it so
    if not p.is_file():
      changed.append(f"{rel} ({'not a file' if p.exists() else 'missing'})")
      continue
    try:
      size = p.stat().st_size
      if size != rec.get("bytes"):
        changed.append(f"{rel} ({rec.get('bytes')} -> {size} bytes; not hashed: the size shows it changed)")
      elif build.file_digest(p)["sha256"] != rec["sha256"]:  # build.: a test counts the files hashed
        changed.append(f"{rel} (same size, different content)")
    except OSError as exc:
      changed.append(f"{rel} (unreadable: {exc.strerror})")
  return changed


def verify_report(report: Report) -> list[str]:
  """What no longer holds in a loaded report: one line per problem, [] when every statement it makes about the
  verdict follows from the run's own files. The rule (docs/report-compare.md, "Verification"):

  1. report.json must record 'artifacts' (relative path -> sha256, bytes; parity.report.build.artifact_paths):
     without it the run is UNVERIFIED. Every recorded file must still have its size (a file of another size is
     not hashed) and hash; a file present but not recorded is named too.
  2. No stored flag may contradict its own figures (`check_contradictions`).
  3. Every check, the params table, each side's status and series, the rerun sections and the verdict are
     recomputed from the run's records by the functions `parity compare` used (parity.report.reverify.recompute)
     and must equal what report.json stores. A record that is missing or unreadable makes the run UNVERIFIED.
  Steps 2-3 run only when step 1 found every file as recorded.
  """
  rec, rd = report.record, Path(report.run_dir)
  path = rd / "report.json"
  if not rec.artifacts:
    return [f"{path}: report.json records no 'artifacts' (the sha256 of the files its verdict rests on), so its "
            "verdict cannot be checked against the run's files: UNVERIFIED (rerun `parity compare` for a verdict)"]
  changed = _artifact_changes(rd, rec, list(rec.sides))
  if changed:
    return [f"{rd}: files changed since the run (files the verdict rests on): {', '.join(changed)}; the stored "
            "verdict no longer describes these files (rerun `parity compare` for a verdict on them)"]
  out = []
  try:
    contradictions = check_contradictions([c.json for c in rec.checks], rec.precision)
  except (TypeError, ValueError, AttributeError) as exc:
    contradictions = [f"its checks' values cannot be read ({exc})"]
  if contradictions:
    out.append(f"{path}: report.json does not match its checks: {'; '.join(contradictions)}; the report was "
               "edited (rerun `parity compare` for a verdict)")
  try:
    diffs = differences(rec, recompute(report))
  except Unverifiable as exc:
    return out + [f"{rd}: the checks cannot be recomputed from the run's records: {exc}; the stored verdict is "
                  "UNVERIFIED (rerun `parity compare` for a verdict)"]
  except Exception as exc:  # a forged or foreign report.json: any failure to recompute leaves it unverified
    return out + [f"{path}: its checks cannot be recomputed ({type(exc).__name__}: {exc}); the report was edited "
                  "or is not from `parity compare`: UNVERIFIED"]
  if diffs:
    out.append(f"{path}: report.json is not what the run's records give: {'; '.join(diffs)}; the report was edited "
               "or is inconsistent (rerun `parity compare` for a verdict)")
  return out
