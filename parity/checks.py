"""Pairwise parity checks between sides, and the verdict.

Numpy only. Inputs are what the workers wrote (parity.protocol): per-step
records and final canonical params. Every check compares two sides, names its
metric, the largest difference, the tolerance (parity.tolerances), and the
first step at which it broke.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Sequence

import numpy as np

from parity.tolerances import tolerance
from parity.weights import zero_grad_slices

__all__ = ["Check", "Verdict", "series_check", "param_checks", "compare_sides", "verdict"]

SERIES_METRICS = ("loss", "grad_norm", "lr", "val_loss")
METRIC_ORDER = {m: i for i, m in enumerate(("completed", *SERIES_METRICS, "params", "params_zero_grad"))}


@dataclasses.dataclass
class Check:
  """One pairwise check.

  Attributes:
    name: '<metric> <a>~<b>'.
    metric: 'completed', 'loss', 'grad_norm', 'lr', 'val_loss', 'params' or 'params_zero_grad'.
    sides: (reference side, candidate side).
    value: the largest difference found (absolute for series; for 'params' the largest
      per-tensor ratio max|a - b| / max|final - init|); NaN when a NaN mismatch occurred.
    tolerance: the allowed value at the worst point (atol + rtol * |reference| for series).
    passed: value within tolerance everywhere, no NaN mismatch.
    first_failing_step: first step (0-based) that broke tolerance; None when passed or not per-step.
    worst: where the largest difference is (step number or tensor name).
    detail: one line for humans.
    reason: why the tolerance is what it is (from the tolerance table).
  """
  name: str
  metric: str
  sides: tuple[str, str]
  value: float
  tolerance: float
  passed: bool
  first_failing_step: int | None = None
  worst: Any = None
  detail: str = ""
  reason: str = ""

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d["sides"] = list(self.sides)
    for k in ("value", "tolerance"):
      if isinstance(d[k], float) and not math.isfinite(d[k]):
        d[k] = None if math.isnan(d[k]) else str(d[k])
    return d


def _steps_by_index(records: Sequence[dict], metric: str) -> dict[int, float]:
  return {int(r["step"]): float(r[metric]) for r in records if r.get(metric) is not None}


def series_check(metric: str, a_side: str, a: Sequence[dict], b_side: str, b: Sequence[dict],
                 precision: str) -> Check | None:
  """Compares one per-step metric of two sides over the steps both recorded.

  Returns None when neither side recorded the metric (e.g. val_loss with eval off).
  A step where exactly one side is NaN/inf, or both are but differ, fails.
  """
  tol = tolerance(precision, metric)
  sa, sb = _steps_by_index(a, metric), _steps_by_index(b, metric)
  common = sorted(set(sa) & set(sb))
  if not common:
    return None
  va = np.array([sa[s] for s in common], dtype=np.float64)
  vb = np.array([sb[s] for s in common], dtype=np.float64)
  diff = np.abs(va - vb)
  allowed = tol.atol + tol.rtol * np.abs(va)
  both_same_nonfinite = (~np.isfinite(va)) & (~np.isfinite(vb)) & (np.isnan(va) == np.isnan(vb)) & \
      (np.isnan(va) | (va == vb))
  bad = ~(diff <= allowed) & ~both_same_nonfinite
  nan_mismatch = int(np.sum(np.isfinite(va) != np.isfinite(vb)))
  with np.errstate(invalid="ignore", divide="ignore"):
    ratio = np.where(np.isfinite(diff), diff / np.maximum(allowed, 1e-300), np.inf)
  worst_i = int(np.nanargmax(ratio)) if np.any(np.isfinite(ratio)) or np.any(np.isinf(ratio)) else 0
  first = common[int(np.argmax(bad))] if bad.any() else None
  value = float(diff[worst_i]) if np.isfinite(diff[worst_i]) else float("nan")
  worst_allowed = float(allowed[worst_i]) if np.isfinite(allowed[worst_i]) else tol.atol
  detail = (f"max |Δ{metric}| = {value:.3g} at step {common[worst_i]} "
            f"(tolerance {worst_allowed:.3g}) over {len(common)} steps")
  if nan_mismatch:
    detail += f"; {nan_mismatch} step(s) finite on one side only"
  return Check(name=f"{metric} {a_side}~{b_side}", metric=metric, sides=(a_side, b_side), value=value,
               tolerance=worst_allowed, passed=not bad.any(), first_failing_step=first,
               worst=common[worst_i], detail=detail, reason=tol.reason)


def param_checks(a_side: str, a: dict[str, np.ndarray], b_side: str, b: dict[str, np.ndarray],
                 init: dict[str, np.ndarray], spec, precision: str, lr_sum: float) -> tuple[list[Check], list[dict]]:
  """Final-parameter checks of one pair, and the per-tensor table.

  Every tensor: max|a - b| / max(max|a - init|, max|b - init|) <= params.rtol, excluding
  zero-gradient slices (parity.weights.zero_grad_slices), which get Adam's step bound
  |a - b| <= 2 * lr_sum instead.

  Args:
    a, b, init: canonical float32 params (name -> array), same names and shapes.
    spec: the ModelSpec (for the zero-gradient slices).
    lr_sum: sum of the learning rates applied over the run.
  Raises:
    ValueError: the two sides' tensors differ in names or shapes.
  """
  if set(a) != set(b):
    raise ValueError(f"final params of {a_side} and {b_side} name different tensors: "
                     f"{sorted(set(a) ^ set(b))[:5]}")
  tol, ztol = tolerance(precision, "params"), tolerance(precision, "params_zero_grad")
  zslices = zero_grad_slices(spec)
  table, worst, zworst = [], None, None
  nan_tensors = []
  for name in a:
    pa, pb, p0 = (np.asarray(x, dtype=np.float64) for x in (a[name], b[name], init[name]))
    if pa.shape != pb.shape:
      raise ValueError(f"{name}: shape {pa.shape} on {a_side} vs {pb.shape} on {b_side}")
    mask = np.ones(pa.shape, dtype=bool)
    if name in zslices:
      lo, hi = zslices[name]
      mask[lo:hi] = False
      zdiff = float(np.max(np.abs(pa[lo:hi] - pb[lo:hi])))
      if zworst is None or not zdiff <= zworst[1]:
        zworst = (name, zdiff)
    d = np.abs(pa - pb)[mask]
    moved = max(float(np.max(np.abs(pa - p0)[mask], initial=0.0)), float(np.max(np.abs(pb - p0)[mask], initial=0.0)))
    maxd = float(np.max(d, initial=0.0))
    if not (np.all(np.isfinite(pa)) and np.all(np.isfinite(pb))):
      nan_tensors.append(name)
      maxd = float("nan")
    ratio = maxd / moved if moved > 0 else (0.0 if maxd == 0 else float("inf"))
    table.append({"tensor": name, "sides": [a_side, b_side], "max_abs_diff": maxd, "max_abs_moved": moved,
                  "ratio": ratio, "passed": bool(ratio <= tol.rtol)})
    if worst is None or not ratio <= worst[1]:
      worst = (name, ratio, maxd, moved)
  checks = []
  if worst is not None:
    passed = all(t["passed"] for t in table)
    detail = (f"worst tensor {worst[0]}: max |Δ| = {worst[2]:.3g}, moved {worst[3]:.3g} from init "
              f"(ratio {worst[1]:.3g}); {sum(not t['passed'] for t in table)} of {len(table)} tensors over")
    if nan_tensors:
      detail += f"; non-finite values in {nan_tensors[:3]}"
    checks.append(Check(name=f"params {a_side}~{b_side}", metric="params", sides=(a_side, b_side),
                        value=float(worst[1]), tolerance=tol.rtol, passed=passed, worst=worst[0],
                        detail=detail, reason=tol.reason))
  if zworst is not None:
    bound = 2.0 * lr_sum
    checks.append(Check(name=f"params_zero_grad {a_side}~{b_side}", metric="params_zero_grad",
                        sides=(a_side, b_side), value=zworst[1], tolerance=bound, passed=zworst[1] <= bound,
                        worst=zworst[0], detail=f"key-bias slices: max |Δ| = {zworst[1]:.3g} "
                        f"(Adam step bound 2·Σlr = {bound:.3g}) at {zworst[0]}", reason=ztol.reason))
  return checks, table


def completion_check(a_side: str, a_status: str, a_steps: int, b_side: str, b_status: str, b_steps: int,
                     total: int) -> Check:
  passed = a_status == "ok" and b_status == "ok" and a_steps == total and b_steps == total
  first = None if passed else min(a_steps, b_steps)
  detail = f"{a_side}: {a_status}, {a_steps}/{total} steps; {b_side}: {b_status}, {b_steps}/{total} steps"
  return Check(name=f"completed {a_side}~{b_side}", metric="completed", sides=(a_side, b_side),
               value=float(min(a_steps, b_steps)), tolerance=float(total), passed=passed,
               first_failing_step=first, detail=detail,
               reason="Both sides must run every step to be compared; a crash, kill, timeout or NaN fails parity.")


def compare_sides(sides: dict[str, dict], *, spec, init: dict[str, np.ndarray]) -> tuple[list[Check], list[dict]]:
  """All pairwise checks.

  Args:
    sides: side -> {'status': str, 'steps': list of StepRecord dicts, 'final': params dict or None}.
      Insertion order decides the reference of each pair (the earlier side).
    spec: the RunSpec.
    init: canonical initial params.
  Returns:
    (checks, per-tensor param table).
  """
  precision = spec.train.precision
  checks, table = [], []
  for (na, a), (nb, b) in itertools.combinations(sides.items(), 2):
    checks.append(completion_check(na, a["status"], len(a["steps"]), nb, b["status"], len(b["steps"]),
                                   spec.train.steps))
    for metric in SERIES_METRICS:
      c = series_check(metric, na, a["steps"], nb, b["steps"], precision)
      if c is not None:
        checks.append(c)
    if a.get("final") is not None and b.get("final") is not None:
      lr_sum = float(sum(r["lr"] for r in a["steps"]))
      pc, pt = param_checks(na, a["final"], nb, b["final"], init, spec.model, precision, lr_sum)
      checks.extend(pc)
      table.extend(pt)
  return checks, table


@dataclasses.dataclass
class Verdict:
  """passed: every side ran and every check held. first_failure: the failing check that broke
  earliest (by step, then by metric order), None when passed. message: one line."""
  passed: bool
  first_failure: Check | None
  message: str

  def to_json(self) -> dict:
    return {"passed": self.passed, "message": self.message,
            "first_failure": None if self.first_failure is None else {
                "check": self.first_failure.name, "metric": self.first_failure.metric,
                "sides": list(self.first_failure.sides), "step": self.first_failure.first_failing_step,
                "value": self.first_failure.to_json()["value"], "tolerance": self.first_failure.tolerance}}


def verdict(checks: Sequence[Check], statuses: dict[str, str]) -> Verdict:
  """The run's verdict from its checks and each side's status."""
  failing = [c for c in checks if not c.passed]
  bad_sides = {s: st for s, st in statuses.items() if st != "ok"}
  if len(statuses) == 1:
    (side, st), = statuses.items()
    return Verdict(st == "ok", None, f"ONE SIDE: {side} {'ran ok' if st == 'ok' else 'did not finish (' + st + ')'}; "
                   "nothing to compare (run two or more sides for a parity verdict)")
  if not failing and not bad_sides:
    return Verdict(True, None, f"PASS: {len(checks)} checks within tolerance across {len(statuses)} sides")
  inf = float("inf")
  failing.sort(key=lambda c: (c.first_failing_step if c.first_failing_step is not None else inf,
                              METRIC_ORDER.get(c.metric, 99)))
  first = failing[0] if failing else None
  parts = []
  if bad_sides:
    parts.append("side(s) did not finish: " + ", ".join(f"{s} ({st})" for s, st in bad_sides.items()))
  if first is not None:
    where = f" at step {first.first_failing_step}" if first.first_failing_step is not None else ""
    parts.append(f"{first.metric} {first.sides[0]} vs {first.sides[1]} first breaks tolerance{where}: {first.detail}")
  return Verdict(False, first, "FAIL: " + "; ".join(parts))
