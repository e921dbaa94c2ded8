"""Reading a finished run's report.json back (`parity report DIR`): every section the summary needs is checked
first, so a truncated, hand-edited or foreign file is refused by name instead of failing half-way."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from parity.inputs import InputError, load_json
from parity.report.build import REPORT_SCHEMA, Report

__all__ = ["load_report", "verify_report"]

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
  if not path.exists() and any((run_dir / n).exists() for n in ("diagnose.md", "diagnose.json")):
    raise InputError(f"{run_dir} holds a `parity diagnose` run, not a comparison: its result is in "
                     f"{run_dir / 'diagnose.md'} (and diagnose.json); `parity report` reads `parity compare` folders")
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


def _check_from_json(d: dict):
  """A parity.verdict.check.Check back from its to_json form (non-finite value/tolerance were stored as None or text)."""
  import dataclasses
  from parity.verdict.check import Check
  fields = {f.name for f in dataclasses.fields(Check)}
  kw = {k: v for k, v in d.items() if k in fields}
  for k in ("value", "tolerance"):
    v = kw.get(k)
    kw[k] = float("nan") if v is None else float(v) if isinstance(v, str) else v
  kw["sides"] = tuple(kw.get("sides") or ("?", "?"))
  return Check(**kw)


_AT_LEAST = ("completed", "updates")  # checks that pass when value >= tolerance (steps run, updates compared)
_NON_GATING = ("determinism",)  # the only checks parity.pipeline.reruns stores as reported-only (gating False)


def _check_contradictions(checks: list[dict]) -> list[str]:
  """The stored checks whose pass flag their own figures contradict: a check marked passed whose value is NaN or
  beyond its tolerance (value <= tolerance for difference checks; value >= tolerance for 'completed' and
  'updates'), or a gating check stored as reported-only. A failing flag with figures inside the tolerance is not
  flagged (params checks pass per tensor, so the worst figures alone cannot prove a pass)."""
  out = []
  for i, c in enumerate(checks):
    if c.get("gating") is False and c.get("metric") not in _NON_GATING:
      out.append(f"checks[{i}] ({c.get('name')}) is stored as not gating, which only {_NON_GATING} checks are")
    if c.get("passed") is not True:
      continue
    v, t = c.get("value"), c.get("tolerance")
    v = float("nan") if v is None else float(v) if isinstance(v, (str, int, float)) else float("nan")
    t = float("nan") if t is None else float(t) if isinstance(t, (str, int, float)) else float("nan")
    # NaN compares False: a NaN never passes. The checks decide on a ratio (|Δ|/allowed <= 1), so a pass may sit one
    # rounding step past value <= tolerance: 1e-9 relative slack, far below any edit that changes a verdict
    ok = v >= t * (1 - 1e-9) if c.get("metric") in _AT_LEAST else v <= t + 1e-9 * abs(t)
    if not ok:
      rule = ">=" if c.get("metric") in _AT_LEAST else "<="
      out.append(f"checks[{i}] ({c.get('name')}) is marked passed but its value {c.get('value')} is not "
                 f"{rule} its tolerance {c.get('tolerance')}")
  return out


def verify_report(report: Report) -> list[str]:
  """What no longer holds in a loaded report: one line per problem, [] when it is consistent and untouched.

  Two rules: (1) the stored verdict is the one parity.verdict.sides.verdict gives for the stored checks and side statuses
  (an interrupted run never passes), so a hand-edited check or verdict is caught; (2) every artifact recorded in
  report.json['artifacts'] (relative path -> sha256, bytes) still has that size and hash, so a side's output or
  an input changed, truncated or removed since the run is named. A report without 'artifacts' (written before
  they were recorded) is checked by rule 1 only.
  """
  from parity.verdict.sides import verdict
  from parity.report.build import file_digest
  d, rd, out = report.data, Path(report.run_dir), []
  path = rd / "report.json"
  try:
    recomputed = verdict([_check_from_json(c) for c in d["checks"]],
                         {name: s["status"] for name, s in d["sides"].items()})
  except (TypeError, ValueError) as exc:
    return [f"{path}: its checks cannot be re-read ({exc}); the report was edited or is not from `parity compare`"]
  try:
    contradictions = _check_contradictions(d["checks"])
  except (TypeError, ValueError) as exc:
    contradictions = [f"its checks' values cannot be read ({exc})"]
  if contradictions:
    out.append(f"{path}: report.json does not match its checks: {'; '.join(contradictions)}; the report was "
               "edited (rerun `parity compare` for a verdict)")
  interrupted = d["verdict"]["message"].startswith("INTERRUPTED")
  expected = recomputed.passed and not interrupted
  if d["verdict"]["passed"] != expected and not contradictions:
    out.append(f"{path}: the stored verdict says {'PASS' if d['verdict']['passed'] else 'FAIL'} but its own checks "
               f"and side statuses give {recomputed.message!r}; the report was edited or is inconsistent")
  arts = d.get("artifacts")
  if not isinstance(arts, dict):
    return out
  changed = []
  for rel, rec in sorted(arts.items()):
    if not isinstance(rec, dict) or "sha256" not in rec:
      continue
    p = rd / rel
    if not p.is_file():
      changed.append(f"{rel} (missing)")
      continue
    try:
      now = file_digest(p)
    except OSError as exc:
      changed.append(f"{rel} (unreadable: {exc.strerror})")
      continue
    if now["bytes"] != rec.get("bytes"):
      changed.append(f"{rel} ({rec.get('bytes')} -> {now['bytes']} bytes)")
    elif now["sha256"] != rec["sha256"]:
      changed.append(f"{rel} (same size, different content)")
  if changed:
    out.append(f"{rd}: files the verdict rests on changed since the run: {', '.join(changed)}; the stored verdict "
               "no longer describes these files (rerun `parity compare` for a verdict on them)")
  return out
