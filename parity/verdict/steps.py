"""Scalar per-step checks between two sides: one per-step metric of a pair (loss, grad norm, lr, val loss, fp16's
loss scale and skips), whether both sides ran every step, and the bitwise determinism/resume comparison of two runs
of one side. Numpy only; tolerances from parity.verdict.tolerances."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from parity.verdict.check import Check
from parity.verdict.tolerances import tolerance

__all__ = ["SERIES_METRICS", "FP16_SERIES", "BITWISE_KEYS", "series_check", "completion_check", "updates_check",
           "repeat_check",
           "relative_diff", "steps_by_index"]

SERIES_METRICS = ("loss", "grad_norm", "lr", "val_loss")
FP16_SERIES = ("loss_scale", "skipped")
"""Compared exactly between sides in fp16 runs: the dynamic loss scale of each step and whether it was skipped."""
BITWISE_KEYS = ("loss", "grad_norm", "lr", "loss_scale", "skipped", "val_loss")
"""StepRecord fields that must be bit-identical between two runs of the same side (determinism, resume)."""


def steps_by_index(records: Sequence[dict], metric: str) -> dict[int, float]:
  return {int(r["step"]): float(r[metric]) for r in records if r.get(metric) is not None}


def series_check(metric: str, a_side: str, a: Sequence[dict], b_side: str, b: Sequence[dict],
                 precision: str) -> Check | None:
  """Compares one per-step metric of two sides over the steps both recorded.

  Returns None when neither side recorded the metric (e.g. val_loss with eval off).
  A step where exactly one side is NaN/inf, or both are but differ, fails.
  """
  tol = tolerance(precision, metric)
  sa, sb = steps_by_index(a, metric), steps_by_index(b, metric)
  common = sorted(set(sa) & set(sb))
  if not common:
    return None
  va = np.array([sa[s] for s in common], dtype=np.float64)
  vb = np.array([sb[s] for s in common], dtype=np.float64)
  both_same_nonfinite = (~np.isfinite(va)) & (~np.isfinite(vb)) & (np.isnan(va) == np.isnan(vb)) & \
      (np.isnan(va) | (va == vb))
  with np.errstate(invalid="ignore"):  # inf - inf on fp16 skipped steps (both sides inf): a match, diff 0
    diff = np.where(both_same_nonfinite, 0.0, np.abs(va - vb))
  allowed = tol.atol + tol.rtol * np.abs(np.where(np.isfinite(va), va, 0.0))  # inf on one side only: fails
  bad = ~(diff <= allowed) & ~both_same_nonfinite
  nan_mismatch = int(np.sum(np.isfinite(va) != np.isfinite(vb)))
  with np.errstate(invalid="ignore", divide="ignore"):
    ratio = np.where(np.isfinite(diff), diff / np.maximum(allowed, 1e-300), np.inf)
  worst_i = int(np.nanargmax(ratio)) if np.any(np.isfinite(ratio)) or np.any(np.isinf(ratio)) else 0
  first = common[int(np.argmax(bad))] if bad.any() else None
  value = float(diff[worst_i]) if np.isfinite(diff[worst_i]) else float("nan")
  worst_allowed = float(allowed[worst_i]) if np.isfinite(allowed[worst_i]) else tol.atol
  finite = np.where(np.isfinite(diff), diff, -np.inf)
  i_max = int(np.argmax(finite))
  if tol.rtol > 0 and np.isfinite(diff[i_max]) and diff[i_max] > diff[worst_i]:
    # a relative bound: the step nearest it is not the largest difference; say both (design review, 2026-12-02:
    # "max |Δgrad_norm| = 2.38e-07 at step 0" where steps.jsonl's largest was 4.77e-07 at step 3)
    detail = (f"|Δ{metric}| = {value:.3g} at step {common[worst_i]}, the step nearest its tolerance "
              f"({worst_allowed:.3g} there); largest |Δ{metric}| = {float(diff[i_max]):.3g} at step {common[i_max]}; "
              f"over {len(common)} steps")
  else:
    detail = (f"max |Δ{metric}| = {value:.3g} at step {common[worst_i]} "
              f"(tolerance {worst_allowed:.3g}) over {len(common)} steps")
  if nan_mismatch:
    detail += f"; {nan_mismatch} step(s) finite on one side only"
  return Check(name=f"{metric} {a_side}~{b_side}", metric=metric, sides=(a_side, b_side), value=value,
               tolerance=worst_allowed, passed=not bad.any(), first_failing_step=first,
               worst=common[worst_i], detail=detail, reason=tol.reason)


def completion_check(a_side: str, a_status: str, a_steps: int, b_side: str, b_status: str, b_steps: int,
                     total: int) -> Check:
  """Whether both sides of a pair finished ('ok') with all `total` steps recorded.

  Returns:
    A 'completed' Check: value = the fewer steps either side recorded, tolerance = total; first_failing_step that
    count when it failed.
  """
  passed = a_status == "ok" and b_status == "ok" and a_steps == total and b_steps == total
  first = None if passed else min(a_steps, b_steps)
  detail = f"{a_side}: {a_status}, {a_steps}/{total} steps; {b_side}: {b_status}, {b_steps}/{total} steps"
  return Check(name=f"completed {a_side}~{b_side}", metric="completed", sides=(a_side, b_side),
               value=float(min(a_steps, b_steps)), tolerance=float(total), passed=passed,
               first_failing_step=first, detail=detail,
               reason="Both sides must run every step to be compared; a crash, kill, timeout or NaN fails parity.")


def updates_check(a_side: str, a_steps: Sequence[dict], b_side: str, b_steps: Sequence[dict],
                  total: int | None = None) -> Check:
  """Whether the pair compared at least one optimizer update: a step with lr > 0 on both sides.

  With lr = 0 on every step (DeepSpeed's WarmupLR and WarmupCosineLR give lr 0 at steps 0 and 1), no weight moves,
  so the params checks compare the initial weights with themselves and the optimizer (Adam moments, weight decay,
  clipping, the update itself) is never compared: a PASS would vouch for nothing. This check fails such a run.
  total: the steps the run was configured for; when fewer were recorded (a side stopped early), the detail blames
    the stop, not the configuration (its advice to run more steps holds only for a run configured that short).
  Returns:
    An 'updates' Check: value = the number of steps both sides ran with lr > 0, tolerance = 1 (the fewest that
    compares an update); passed when value >= tolerance. Skipped by the caller when either side recorded no step.
  """
  n = min(len(a_steps), len(b_steps))
  moving = sum(1 for ra, rb in zip(a_steps[:n], b_steps[:n]) if ra.get("lr") and rb.get("lr"))
  passed = moving >= 1
  stopped = total is not None and n < total
  detail = (f"{moving} of {n} steps updated the weights (lr > 0 on both sides)" if passed else
            f"lr was 0 on all {n} steps both sides ran: no optimizer update was compared, because a side stopped "
            f"after {n} of {total} steps (see the completed check), still in the warmup" if stopped else
            f"lr was 0 on all {n} steps: no optimizer update was compared; run more steps than the warmup "
            "(train.steps > 2 with DeepSpeed's warmup schedules) or give train.lr a nonzero start")
  return Check(name=f"updates {a_side}~{b_side}", metric="updates", sides=(a_side, b_side), value=float(moving),
               tolerance=1.0, passed=passed, first_failing_step=None if passed else n - 1, detail=detail,
               reason="A run whose learning rate is 0 on every step moves no weight, so it cannot show the "
                      "optimizers agree; at least one step with lr > 0 must be compared.")


def repeat_check(kind: str, side: str, first: Sequence[dict], again: Sequence[dict], *, from_step: int = 0,
                 final_a: dict[str, np.ndarray] | None = None, final_b: dict[str, np.ndarray] | None = None,
                 gating: bool) -> Check:
  """Bit-for-bit comparison of two runs of the same side (determinism or checkpoint/resume).

  Args:
    kind: 'determinism' (a rerun of a prefix) or 'resume' (a run resumed from a checkpoint).
    first, again: StepRecords of the original run and of the rerun.
    from_step: the first step the rerun recorded (resume: the checkpoint step + 1).
    final_a, final_b: final params of both, compared bitwise when both are given.
    gating: whether a mismatch fails the verdict.
  Returns:
    A Check with value = the largest absolute difference over BITWISE_KEYS (0.0 when identical)
    and tolerance 0. A rerun that recorded no step fails.
  """
  sa = {int(r["step"]): r for r in first}
  sb = {int(r["step"]): r for r in again if int(r["step"]) >= from_step}
  steps = sorted(set(sa) & set(sb))
  label = f"{side} {kind}"
  reason = ("Same side, same inputs, same machine: every recorded field must be bit-identical "
            + ("(CPU kernels are deterministic; GPU kernels need not be, so this does not gate the verdict)."
               if kind == "determinism" else "after restoring a checkpoint in a new process."))
  if not steps:
    return Check(name=label, metric=kind, sides=(side, f"{side}#{kind}"), value=float("nan"), tolerance=0.0,
                 passed=False, detail=f"the {kind} run recorded no step from {from_step} on", reason=reason,
                 gating=gating)
  worst, first_bad = 0.0, None
  for s in steps:
    for k in BITWISE_KEYS:
      x, y = sa[s].get(k), sb[s].get(k)
      if x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)):
        continue
      first_bad = s if first_bad is None else first_bad
      try:
        worst = max(worst, abs(float(x) - float(y)))
      except (TypeError, ValueError):
        worst = float("inf")
  tensors_bad = []
  if final_a is not None and final_b is not None:
    tensors_bad = [n for n in final_a if n not in final_b or not np.array_equal(final_a[n], final_b[n])]
    for n in tensors_bad:
      if n in final_b and final_a[n].shape == final_b[n].shape:
        worst = max(worst, float(np.max(np.abs(final_a[n].astype(np.float64) - final_b[n]))))
  same = first_bad is None and not tensors_bad
  what = f"steps {steps[0]}-{steps[-1]}" + (" and final params" if final_a is not None and final_b is not None else "")
  detail = (f"bit-identical over {what}" if same else
            f"differs: first at step {first_bad}" if first_bad is not None else "records identical")
  if tensors_bad:
    detail += f"; final params differ in {len(tensors_bad)} tensors (e.g. {tensors_bad[0]})"
  if not same:
    detail += f"; max |Δ| {worst:.3g}"
  return Check(name=label, metric=kind, sides=(side, f"{side}#{kind}"), value=worst, tolerance=0.0, passed=same,
               first_failing_step=first_bad, worst=first_bad, detail=detail, reason=reason, gating=gating)


def relative_diff(x: float, y: float) -> float:
  """|x - y| / max(|x|, |y|), 0 when both are 0."""
  scale = max(abs(x), abs(y))
  return abs(x - y) / scale if scale > 0 else 0.0
