"""Pairwise parity checks between sides, and the verdict.

Numpy only. Inputs are what the workers wrote (parity.protocol): per-step
records and final canonical params. Every check compares two sides, names its
metric, the largest difference, the tolerance (parity.verdict.tolerances), and the
first step at which it broke.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Sequence

import numpy as np

from parity.verdict.tolerances import EnvelopeRule, tolerance
from parity.weights import zero_grad_slices

__all__ = ["Check", "Verdict", "series_check", "param_checks", "compare_sides", "verdict", "envelope_check",
           "envelope_params_check", "param_ratios", "relative_diff", "rerun_differences", "ENVELOPE_METRICS",
           "windowed_rms", "repeat_check", "BITWISE_KEYS", "AdamSensitivity"]

SERIES_METRICS = ("loss", "grad_norm", "lr", "val_loss")
FINAL_MOMENTS_NAME = "final_moments.safetensors"
"""parity.protocol.FINAL_MOMENTS (named here for messages; checks does not import the protocol)."""
FP16_SERIES = ("loss_scale", "skipped")
"""Compared exactly between sides in fp16 runs: the dynamic loss scale of each step and whether it was skipped."""
METRIC_ORDER = {m: i for i, m in enumerate(("completed", "skipped", "loss_scale", *SERIES_METRICS, "loss_envelope", "grad_norm_envelope",
                                            "val_loss_envelope", "params", "params_envelope", "params_zero_grad",
                                            "noise_rerun", "resume", "determinism"))}
BITWISE_KEYS = ("loss", "grad_norm", "lr", "loss_scale", "skipped", "val_loss")
"""StepRecord fields that must be bit-identical between two runs of the same side (determinism, resume)."""


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
    gating: whether a failure fails the verdict (False: reported only, e.g. determinism, which
      GPU kernels do not promise).
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
  gating: bool = True

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
  detail = (f"max |Δ{metric}| = {value:.3g} at step {common[worst_i]} "
            f"(tolerance {worst_allowed:.3g}) over {len(common)} steps")
  if nan_mismatch:
    detail += f"; {nan_mismatch} step(s) finite on one side only"
  return Check(name=f"{metric} {a_side}~{b_side}", metric=metric, sides=(a_side, b_side), value=value,
               tolerance=worst_allowed, passed=not bad.any(), first_failing_step=first,
               worst=common[worst_i], detail=detail, reason=tol.reason)


def _moments_cover(ma, mb, names) -> bool:
  """Both sides' moments (parity.protocol.read_moments) hold grad_rms and sensitivity for every tensor in `names`."""
  return all(m is not None and set(m["grad_rms"]) >= set(names) and set(m["sensitivity"]) >= set(names)
             for m in (ma, mb))


def _adam_element_scores(d: np.ndarray, moved: float, bound: float, name: str, ma, mb, mask: np.ndarray,
                         lr_sum: float, kappa: float) -> tuple[np.ndarray, np.ndarray]:
  """(|a_i - b_i| / allowed_i, allowed_i) over the masked elements of one tensor, for the per-element Adam rule
  allowed_i = bound·moved + min(2·Σlr, kappa·g_T·S_i): g_T the larger side's RMS of sqrt(v_hat) over the tensor,
  S_i the larger side's Σ_t lr_t/(sqrt(v_hat_t)+eps) (derivation in `param_checks`). An element with allowed 0 scores
  0 when equal, inf otherwise."""
  g = max(float(np.sqrt(np.mean(np.square(m["grad_rms"][name].astype(np.float64))))) for m in (ma, mb))
  sens = np.maximum(ma["sensitivity"][name], mb["sensitivity"][name]).astype(np.float64)[mask]
  allowed = bound * moved + np.minimum(2.0 * lr_sum, kappa * g * sens)
  with np.errstate(invalid="ignore", divide="ignore"):
    scores = np.where(allowed > 0, d / np.maximum(allowed, 1e-300), np.where(d == 0, 0.0, np.inf))
  return scores, allowed


def param_checks(a_side: str, a: dict[str, np.ndarray], b_side: str, b: dict[str, np.ndarray],
                 init: dict[str, np.ndarray], spec, precision: str, lr_sum: float,
                 moments: dict[str, dict | None] | None = None, adam_updates: bool = True
                 ) -> tuple[list[Check], list[dict]]:
  """Final-parameter checks of one pair, and the per-tensor table.

  The rule, per element i of a tensor T (fp32 with both sides' moments, parity.protocol.FINAL_MOMENTS):

      |a_i - b_i| <= rtol * moved_T + min(2 * sum_t lr_t, kappa * g_T * S_i)

  rtol * moved_T is the dynamics term (params.rtol times the larger distance either side moved T from init).
  The second term is how far Adam can carry gradient rounding noise: each update is lr_t * m_hat / (sqrt(v_hat)
  + eps), at most ~lr_t in size (Kingma & Ba 2015, sec. 2.1), so two sides differ by at most 2 * sum_t lr_t;
  and a gradient perturbation delta moves it by about lr_t * delta / (sqrt(v_hat_t,i) + eps). With delta ~
  kappa * g_T (g_T: the tensor's gradient scale, the RMS over T of the final sqrt(v_hat), larger side; kappa:
  params_grad_noise.rtol, measured) and S_i = max over the sides of sum_t lr_t / (sqrt(v_hat_t,i) + eps),
  the element's accumulated sensitivity, the noise term is kappa * g_T * S_i, capped by the step bound. An element
  whose gradient was ever at rounding level (at step 1 Adam's update is lr * g / (|g| + eps) = +-lr) gets up to
  2 * sum lr; an element with a large gradient gets ~kappa * sum lr * g_T / |g_i|, far below a real bug's effect.
  This holds for any lr schedule. Zero-gradient slices (parity.weights.zero_grad_slices) are the S_i -> sum
  lr / eps limit: they get the step bound 2 * sum lr in their own 'params_zero_grad' check.

  Fallback (said in the detail): without moments from both sides, or in bf16/fp16 (kappa unmeasured there; their
  params entry is a gross bound and the noise envelope decides), every tensor must satisfy
  max|a - b| / max(max|a - init|, max|b - init|) <= params.rtol.

  Args:
    a, b, init: canonical float32 params (name -> array), same names and shapes.
    spec: the ModelSpec (for the zero-gradient slices).
    lr_sum: sum of the learning rates applied over the run.
    moments: side -> {'grad_rms': name -> array, 'sensitivity': name -> array} (parity.protocol.read_moments) or
      None for a side that wrote none.
    adam_updates: the optimizer is an Adam (train.optimizer adam/adamw), whose per-step update is at most ~lr.
      False (Lamb: trust-ratio scaled steps up to max_coeff * lr * sqrt(1 - b2^t) / (1 - b1^t); SGD: lr * g,
      no lr bound): no Adam step bound holds, so zero-gradient slices stay in the per-tensor rule (their workers
      write no moments, so the whole check is the per-tensor fallback).
  Returns:
    (checks, table): table rows carry tensor, sides, max_abs_diff, max_abs_moved, ratio (the per-tensor ratio
    above), rule ('adam' or 'per_tensor'), score (largest |a_i - b_i| / allowed_i under the rule) and passed.
  Raises:
    ValueError: the two sides' tensors differ in names or shapes.
  """
  if set(a) != set(b):
    raise ValueError(f"final params of {a_side} and {b_side} name different tensors: "
                     f"{sorted(set(a) ^ set(b))[:5]}")
  tol, ztol = tolerance(precision, "params"), tolerance(precision, "params_zero_grad")
  moments = moments or {}
  ma, mb = moments.get(a_side), moments.get(b_side)
  missing = [s for s, m in ((a_side, ma), (b_side, mb)) if m is None]
  use_adam = precision == "fp32" and not missing and _moments_cover(ma, mb, a)
  kappa = tolerance(precision, "params_grad_noise").rtol if use_adam else 0.0
  zslices = zero_grad_slices(spec) if adam_updates else {}
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
    finite = bool(np.all(np.isfinite(pa)) and np.all(np.isfinite(pb)))
    if not finite:
      nan_tensors.append(name)
      maxd = float("nan")
    ratio = maxd / moved if moved > 0 else (0.0 if maxd == 0 else float("inf"))
    if use_adam:
      scores, allowed = _adam_element_scores(d, moved, tol.rtol, name, ma, mb, mask, lr_sum, kappa)
      k = int(np.argmax(scores)) if scores.size else 0
      score = float(scores[k]) if finite and scores.size else (0.0 if finite else float("nan"))
      at = (float(d[k]) if d.size else 0.0, float(allowed[k]) if d.size else 0.0)
    else:
      score = ratio / tol.rtol if tol.rtol > 0 else (0.0 if ratio == 0 else float("inf"))
      at = (maxd, tol.rtol * moved)
    table.append({"tensor": name, "sides": [a_side, b_side], "max_abs_diff": maxd, "max_abs_moved": moved,
                  "ratio": ratio, "rule": "adam" if use_adam else "per_tensor", "score": score,
                  "passed": bool(score <= 1.0)})
    if worst is None or not score <= worst[1]:
      worst = (name, score, maxd, moved, ratio, *at)
  checks = []
  if worst is not None:
    passed = all(t["passed"] for t in table)
    over = f"{sum(not t['passed'] for t in table)} of {len(table)} tensors over"
    if use_adam:
      detail = (f"worst tensor {worst[0]}: element |Δ| = {worst[5]:.3g} vs allowed {worst[6]:.3g} "
                f"({worst[1]:.3g}x; {tol.rtol:g}·moved {worst[3]:.3g} + min(2·Σlr, {kappa:g}·g·S_i)); tensor max |Δ| "
                f"{worst[2]:.3g}; {over}; rule: Adam per element (moments of both sides)")
      value, bound = worst[5], worst[6]
    else:
      why = (f"{', '.join(missing)} wrote no {FINAL_MOMENTS_NAME}" if missing else
             f"{precision}: the per-element rule is measured in fp32 only" if precision != "fp32" else
             "a moments file lacks some tensors")
      detail = (f"worst tensor {worst[0]}: max |Δ| = {worst[2]:.3g}, moved {worst[3]:.3g} from init "
                f"(ratio {worst[4]:.3g}); {over}; rule: per-tensor fallback ({why})")
      value, bound = float(worst[4]), tol.rtol
    if nan_tensors:
      detail += f"; non-finite values in {nan_tensors[:3]}"
      value = float("nan")
    reason = tol.reason + (" " + tolerance(precision, "params_grad_noise").reason if use_adam else "")
    checks.append(Check(name=f"params {a_side}~{b_side}", metric="params", sides=(a_side, b_side),
                        value=value, tolerance=bound, passed=passed, worst=worst[0],
                        detail=detail, reason=reason))
  if zworst is not None:
    bound = 2.0 * lr_sum
    checks.append(Check(name=f"params_zero_grad {a_side}~{b_side}", metric="params_zero_grad",
                        sides=(a_side, b_side), value=zworst[1], tolerance=bound, passed=zworst[1] <= bound,
                        worst=zworst[0], detail=f"key-bias slices: max |Δ| = {zworst[1]:.3g} "
                        f"(Adam step bound 2·Σlr = {bound:.3g}) at {zworst[0]}", reason=ztol.reason))
  return checks, table


class AdamSensitivity:
  """Per element, S_i = sum over Adam updates t of lr_t / (sqrt(v_hat_t,i) + eps): how far rounding noise in that
  element's gradient can move its parameter (the params rule, `param_checks`). Numpy only; every side feeds it.
  Cost: per update, one host copy of sqrt(v_hat) and one float64 pass over the params (gpt2-tiny: ~1 ms; a model
  of P params: ~8 P bytes of host memory and O(P) work per step, beside the step itself).

  Args:
    eps: Adam's epsilon (train.eps).
  """

  def __init__(self, eps: float):
    self.eps = float(eps)
    self.total: dict[str, np.ndarray] = {}

  def add(self, grad_rms: dict[str, np.ndarray], lr: float) -> None:
    """One applied update: grad_rms = name -> sqrt(v_hat) after it (any float dtype, the param's shape); lr its
    learning rate. Skipped updates (fp16 overflow) are not added."""
    for name, r in grad_rms.items():
      inc = float(lr) / (np.asarray(r, dtype=np.float64) + self.eps)
      self.total[name] = self.total[name] + inc if name in self.total else inc

  def result(self, names) -> dict[str, np.ndarray]:
    """name -> float32 S_i for `names` (zeros shaped like nothing added when no update was applied: pass the
    final grad_rms dict, whose shapes are used)."""
    return {n: self.total[n].astype(np.float32) if n in self.total else np.zeros_like(names[n], dtype=np.float32)
            for n in names}


def completion_check(a_side: str, a_status: str, a_steps: int, b_side: str, b_status: str, b_steps: int,
                     total: int) -> Check:
  passed = a_status == "ok" and b_status == "ok" and a_steps == total and b_steps == total
  first = None if passed else min(a_steps, b_steps)
  detail = f"{a_side}: {a_status}, {a_steps}/{total} steps; {b_side}: {b_status}, {b_steps}/{total} steps"
  return Check(name=f"completed {a_side}~{b_side}", metric="completed", sides=(a_side, b_side),
               value=float(min(a_steps, b_steps)), tolerance=float(total), passed=passed,
               first_failing_step=first, detail=detail,
               reason="Both sides must run every step to be compared; a crash, kill, timeout or NaN fails parity.")


def windowed_rms(steps: Sequence[int], values: np.ndarray, window: int) -> list[tuple[int, int, float]]:
  """RMS of `values` over consecutive windows of `window` steps.

  Args:
    steps: sorted step numbers, one per value.
    values: float64 array, same length.
    window: steps per window (>= 1); a last window shorter than half a window joins the previous one.
  Returns:
    [(first step, last step, rms)] per window.
  """
  n = len(values)
  bounds = list(range(0, n, window)) + [n]
  if len(bounds) > 2 and bounds[-1] - bounds[-2] < max(1, window // 2):
    bounds.pop(-2)
  return [(int(steps[lo]), int(steps[hi - 1]), float(np.sqrt(np.mean(np.square(values[lo:hi])))))
          for lo, hi in zip(bounds[:-1], bounds[1:])]


def envelope_check(a_side: str, a: Sequence[dict], b_side: str, b: Sequence[dict],
                   noise: dict[str, dict[int, float]], rule: EnvelopeRule, metric: str = "loss",
                   window: int | None = None) -> Check | None:
  """The difference curve of one per-step metric of two sides against their measured noise envelopes.

  Args:
    a, b: StepRecords of the two sides.
    noise: side -> (step -> |metric_side - metric_rerun|, relative (`relative_diff`) for grad_norm) of each
      side's reduction-order rerun (harness.self_runs.run_noise); the pair is held against the noisier of its
      two sides, window by window, or against the one side measured when only one is.
    rule: factor, floor and window (parity.verdict.tolerances.ENVELOPE_RULES).
    metric: 'loss' (nats), 'grad_norm' or 'val_loss' (nats; few steps, so one window by default).
    window: steps per window (default rule.window; for val_loss all eval steps in one window).
  Returns:
    A '<metric>_envelope' Check, or None when neither side has an envelope or no step is shared. Per
    window k, value = rms_k|Δ| (relative for grad_norm) and tolerance = factor · max(rms_k(envelope_a),
    rms_k(envelope_b)) + floor (rule.grad_norm_floor for grad_norm) at the worst window (largest ratio); first_failing_step is the first step of the first
    window over its bound. Skipped steps (fp16 overflow) are left out when both sides skipped them.
  """
  name, kind = f"{metric}_envelope {a_side}~{b_side}", f"{metric}_envelope"
  relative = metric == "grad_norm"  # norms span orders of magnitude over a run: compare relative differences
  floor = rule.grad_norm_floor if relative else rule.floor
  envs = [noise[s] for s in (a_side, b_side) if s in noise]
  skipped = {int(r["step"]) for r in (*a, *b) if r.get("skipped")}
  sa, sb = _steps_by_index(a, metric), _steps_by_index(b, metric)
  common = sorted((set(sa) & set(sb).intersection(*envs)) - skipped) if envs else []
  if not common:
    return None
  width = window or (len(common) if metric == "val_loss" else rule.window)
  d = np.array([relative_diff(sa[s], sb[s]) if relative else abs(sa[s] - sb[s]) for s in common], dtype=np.float64)
  ns = [np.array([e[s] for s in common], dtype=np.float64) for e in envs]
  finite = np.isfinite(d) & np.all([np.isfinite(n) for n in ns], axis=0)
  if not finite.all():
    bad = common[int(np.argmax(~finite))]
    return Check(name=name, metric=kind, sides=(a_side, b_side), value=float("nan"), tolerance=floor,
                 passed=False, first_failing_step=bad, worst=bad,
                 detail=f"non-finite {metric} difference or envelope at step {bad}", reason=rule.reason)
  wd = windowed_rms(common, d, width)
  wn = [max(w) for w in zip(*[windowed_rms(common, n, width) for n in ns])]
  noise_label = "/".join(s for s in (a_side, b_side) if s in noise)
  allowed = [rule.factor * x[2] + floor for x in wn]
  ratios = [x[2] / lim if lim > 0 else (0.0 if x[2] == 0 else math.inf) for x, lim in zip(wd, allowed)]
  worst = int(np.argmax(ratios))
  failing = [i for i, r in enumerate(ratios) if r > 1.0]
  first = wd[failing[0]][0] if failing else None
  lo, hi, rms = wd[worst]
  detail = (f"worst window steps {lo}-{hi}: rms |Δ{metric}| {rms:.3g} vs envelope rms {wn[worst][2]:.3g} "
            f"(bound {rule.factor:g}x + {floor:g} = {allowed[worst]:.3g}); {len(failing)} of {len(wd)} windows "
            f"over; envelope: noisier of {noise_label} reruns with reversed batch order")
  return Check(name=name, metric=kind, sides=(a_side, b_side), value=rms, tolerance=allowed[worst],
               passed=not failing, first_failing_step=first, worst=f"steps {lo}-{hi}", detail=detail,
               reason=rule.reason)


def relative_diff(x: float, y: float) -> float:
  """|x - y| / max(|x|, |y|), 0 when both are 0."""
  scale = max(abs(x), abs(y))
  return abs(x - y) / scale if scale > 0 else 0.0


ENVELOPE_METRICS = ("loss", "grad_norm", "val_loss")
"""Per-step metrics held against a noise envelope (grad_norm on relative differences)."""


def rerun_differences(main: Sequence[dict], rerun: Sequence[dict]) -> dict[str, dict[int, float]]:
  """Step-by-step difference between a run and its reduction-order rerun: the envelope of that side.

  Args:
    main, rerun: StepRecords of the same side (harness.self_runs.run_noise).
  Returns:
    metric -> (step -> |main - rerun|) for ENVELOPE_METRICS, relative (`relative_diff`) for grad_norm; steps
    the rerun skipped (fp16 overflow) or did not record the metric at are left out.
  """
  ref = {int(r["step"]): r for r in main}
  out: dict[str, dict[int, float]] = {m: {} for m in ENVELOPE_METRICS}
  for r in rerun:
    k = int(r["step"])
    if k not in ref or r.get("skipped"):
      continue
    for m in ENVELOPE_METRICS:
      if r.get(m) is not None and ref[k].get(m) is not None:
        out[m][k] = relative_diff(ref[k][m], r[m]) if m == "grad_norm" else abs(ref[k][m] - r[m])
  return out


def param_ratios(final: dict[str, np.ndarray], other: dict[str, np.ndarray], init: dict[str, np.ndarray],
                 spec) -> dict[str, float]:
  """Per tensor: max|final - other| / the larger distance either moved from init, zero-gradient slices left out.

  Args:
    final, other, init: canonical params (name -> array) with the same names and shapes.
    spec: the ModelSpec (parity.weights.zero_grad_slices).
  Returns:
    name -> ratio (0.0 when neither moved and they are equal; inf when they differ without moving).
  """
  zslices = zero_grad_slices(spec)
  out = {}
  for name in final:
    pa, pb, p0 = (np.asarray(x, dtype=np.float64) for x in (final[name], other[name], init[name]))
    mask = np.ones(pa.shape, dtype=bool)
    if name in zslices:
      mask[slice(*zslices[name])] = False
    d = float(np.max(np.abs(pa - pb)[mask], initial=0.0))
    moved = max(float(np.max(np.abs(pa - p0)[mask], initial=0.0)), float(np.max(np.abs(pb - p0)[mask], initial=0.0)))
    out[name] = d / moved if moved > 0 else (0.0 if d == 0 else math.inf)
  return out


def envelope_params_check(a_side: str, a: dict[str, np.ndarray], b_side: str, b: dict[str, np.ndarray],
                          init: dict[str, np.ndarray], spec, noise: dict[str, dict[str, float]],
                          rule: EnvelopeRule, *, moments: dict[str, dict | None] | None = None,
                          lr_sum: float = 0.0, precision: str | None = None,
                          adam_updates: bool = True) -> Check | None:
  """Final params of two sides against the final params of their reduction-order reruns.

  Per tensor T, bound_T = factor * max(noise ratio of a, noise ratio of b) + params_floor, where a side's noise
  ratio is max|side - its rerun| / distance moved (`param_ratios`, zero-gradient slices left out). With both
  sides' moments (parity.protocol.FINAL_MOMENTS) each element i must satisfy

      |a_i - b_i| <= bound_T * moved_T + min(2 * sum_t lr_t, kappa * g_T * S_i)

  the envelope's dynamics term plus the Adam noise term of the fp32 params rule (`param_checks`: g_T the RMS of
  the final sqrt(v_hat) over T, larger side; S_i = max over the sides of sum_t lr_t / (sqrt(v_hat_t,i) + eps);
  kappa = params_grad_noise.rtol of `precision`, fp32's scaled by the unit roundoff). It admits what the rerun
  cannot show: an element whose gradient sat at rounding level in some update moves by up to lr_t with a sign
  set by rounding, in any lr schedule (with Constant lr, the tensor's max over such elements is up to 2 * sum lr
  while its movement is ~sum lr). Fallback (said in the detail): without moments from both sides, or without
  `precision`, every tensor must satisfy max|a - b| / moved_T <= bound_T.

  Args:
    a, b, init: canonical float32 params (name -> array), same names and shapes.
    spec: the ModelSpec (zero-gradient slices, parity.weights.zero_grad_slices).
    noise: side -> (tensor -> noise ratio), for the sides whose rerun finished.
    rule: the precision's EnvelopeRule.
    moments: side -> parity.protocol.read_moments output, or None for a side that wrote none.
    lr_sum: sum of the learning rates of the updates applied (skipped fp16 steps left out).
    precision: 'fp32' | 'bf16' | 'fp16', selects kappa; None keeps the per-tensor rule.
    adam_updates: the optimizer is an Adam (train.optimizer adam/adamw); otherwise the Adam term does not hold and
      the per-tensor rule applies.
  Returns:
    A 'params_envelope' Check, or None when neither side has a rerun's final params. value / tolerance: the worst
    element's |a_i - b_i| and its allowed bound (per element rule), or the worst tensor's ratio and bound_T
    (fallback).
  Raises:
    KeyError: `precision` has no params_grad_noise entry.
  """
  envs = [noise[s] for s in (a_side, b_side) if s in noise]
  if not envs:
    return None
  moments = moments or {}
  ma, mb = moments.get(a_side), moments.get(b_side)
  missing = [s for s, m in ((a_side, ma), (b_side, mb)) if m is None]
  use_adam = precision is not None and adam_updates and not missing and _moments_cover(ma, mb, a)
  kappa = tolerance(precision, "params_grad_noise").rtol if use_adam else 0.0
  pair = param_ratios(a, b, init, spec)
  zslices = zero_grad_slices(spec)
  rows = []
  for name, r in pair.items():
    bound = rule.factor * max(e.get(name, 0.0) for e in envs) + rule.params_floor
    if not use_adam or not math.isfinite(r):
      rows.append((r / bound if math.isfinite(r) else math.inf, name, r, bound, r, bound))
      continue
    pa, pb, p0 = (np.asarray(x, dtype=np.float64) for x in (a[name], b[name], init[name]))
    mask = np.ones(pa.shape, dtype=bool)
    if name in zslices:
      mask[slice(*zslices[name])] = False
    d = np.abs(pa - pb)[mask]
    moved = max(float(np.max(np.abs(pa - p0)[mask], initial=0.0)), float(np.max(np.abs(pb - p0)[mask], initial=0.0)))
    scores, allowed = _adam_element_scores(d, moved, bound, name, ma, mb, mask, lr_sum, kappa)
    if not scores.size:
      rows.append((0.0, name, r, bound, 0.0, 0.0))
      continue
    k = int(np.argmax(scores))
    rows.append((float(scores[k]), name, r, bound, float(d[k]), float(allowed[k])))
  rows.sort(key=lambda x: (-x[0] if not math.isnan(x[0]) else -math.inf, x[1]))
  score, name, r, bound, value, allowed = rows[0]
  over = sum(not x[0] <= 1.0 for x in rows)
  base = f"{rule.factor:g}x the noisier rerun's + {rule.params_floor:g}"
  if use_adam:
    detail = (f"worst tensor {name}: element |Δ| = {value:.3g} vs allowed {allowed:.3g} ({score:.3g}x; "
              f"{bound:.3g}·moved + min(2·Σlr, {kappa:.3g}·g·S_i), {bound:.3g} = {base}); tensor max |Δ| / "
              f"moved = {r:.3g}; {over} of {len(rows)} tensors over; rule: envelope + Adam per element (moments of "
              "both sides)")
    reason = rule.reason + " " + tolerance(precision, "params_grad_noise").reason
  else:
    why = ("no precision given" if precision is None else "the optimizer is not Adam" if not adam_updates else
           f"{', '.join(missing)} wrote no {FINAL_MOMENTS_NAME}" if missing else "a moments file lacks some tensors")
    detail = (f"worst tensor {name}: max |Δ| / moved = {r:.3g} vs bound {bound:.3g} ({base}); {over} of "
              f"{len(rows)} tensors over; rule: per-tensor fallback ({why})")
    reason = rule.reason
  nonfinite = [x[1] for x in rows if not math.isfinite(x[2])]
  if nonfinite:
    detail += f"; non-finite values in {nonfinite[:3]}"
  return Check(name=f"params_envelope {a_side}~{b_side}", metric="params_envelope", sides=(a_side, b_side),
               value=value, tolerance=allowed, passed=over == 0, worst=name, detail=detail, reason=reason)


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
               if kind == "determinism" else "after restoring a checkpoint in a new process (issue #5)."))
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


def compare_sides(sides: dict[str, dict], *, spec, init: dict[str, np.ndarray]) -> tuple[list[Check], list[dict]]:
  """All pairwise checks.

  Args:
    sides: side -> {'status': str, 'steps': list of StepRecord dicts, 'final': params dict or None, and
      optionally 'moments': parity.protocol.read_moments output or None}.
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
    for metric in SERIES_METRICS + (FP16_SERIES if precision == "fp16" else ()):
      c = series_check(metric, na, a["steps"], nb, b["steps"], precision)
      if c is not None:
        checks.append(c)
    if a.get("final") is not None and b.get("final") is not None:
      lr_sum = float(sum(r["lr"] for r in a["steps"]))
      pc, pt = param_checks(na, a["final"], nb, b["final"], init, spec.model, precision, lr_sum,
                            moments={na: a.get("moments"), nb: b.get("moments")},
                            adam_updates=spec.train.optimizer in ("adam", "adamw"))
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
  failing = [c for c in checks if not c.passed and c.gating]
  bad_sides = {s: st for s, st in statuses.items() if st != "ok"}
  if len(statuses) == 1:
    (side, st), = statuses.items()
    if failing:  # e.g. a resume check of the one side
      first = min(failing, key=lambda c: METRIC_ORDER.get(c.metric, 99))
      return Verdict(False, first, f"FAIL: {side}: {first.name}: {first.detail}")
    return Verdict(st == "ok", None, f"ONE SIDE: {side} {'ran ok' if st == 'ok' else 'did not finish (' + st + ')'}; "
                   "nothing to compare (run two or more sides for a parity verdict)")
  if not failing and not bad_sides:
    gating = sum(c.gating for c in checks)
    extra = len(checks) - gating
    more = f" (+{extra} reported only)" if extra else ""
    return Verdict(True, None, f"PASS: {gating} checks within tolerance across {len(statuses)} sides{more}")
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
