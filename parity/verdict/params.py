"""The final-parameter check of a pair of sides: the per-element Adam rule (fp32, with both sides' moments) or the
per-tensor fallback, the zero-gradient slices held to Adam's step bound, and the per-element Adam sensitivity each
worker accumulates for it (AdamSensitivity). Numpy only; tolerances from parity.verdict.tolerances."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from parity.verdict.check import Check
from parity.verdict.tolerances import tolerance
from parity.weights import zero_grad_slices

__all__ = ["param_checks", "param_ratios", "AdamSensitivity", "FINAL_MOMENTS_NAME"]

FINAL_MOMENTS_NAME = "final_moments.safetensors"
"""parity.protocol.FINAL_MOMENTS (named here for messages; the verdict does not import the protocol)."""


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


@dataclasses.dataclass(frozen=True)
class _PairRule:
  """How one pair's final params are judged: the per-element Adam rule (`adam`) or the per-tensor fallback.

  rtol: the dynamics term's factor (params.rtol, or an envelope's bound_T set per tensor by the caller);
  kappa: params_grad_noise.rtol (0 without the Adam rule); ma, mb: both sides' moments; missing: the sides that
  wrote none (named in the fallback's detail)."""
  adam: bool
  rtol: float
  kappa: float
  lr_sum: float
  ma: dict | None
  mb: dict | None
  missing: tuple[str, ...]


def _pair_rule(a_side: str, b_side: str, names, moments: dict | None, precision: str | None, lr_sum: float,
               rtol: float, adam_ok: bool) -> _PairRule:
  """The rule for one pair: Adam per element when `adam_ok` and both sides' moments cover every tensor of `names`."""
  moments = moments or {}
  ma, mb = moments.get(a_side), moments.get(b_side)
  missing = tuple(s for s, m in ((a_side, ma), (b_side, mb)) if m is None)
  adam = adam_ok and not missing and _moments_cover(ma, mb, names)
  kappa = tolerance(precision, "params_grad_noise").rtol if adam else 0.0
  return _PairRule(adam, rtol, kappa, lr_sum, ma, mb, missing)


def _masked_diff(pa: np.ndarray, pb: np.ndarray, p0: np.ndarray, zslice: tuple[int, int] | None
                 ) -> tuple[np.ndarray, np.ndarray, float]:
  """(mask, |a - b| over the mask, moved): the mask leaves out a zero-gradient slice (lo, hi) of axis 0; moved is
  the larger distance either side moved from init over the mask (0.0 for an empty mask). float64 inputs."""
  mask = np.ones(pa.shape, dtype=bool)
  if zslice is not None:
    mask[slice(*zslice)] = False
  d = np.abs(pa - pb)[mask]
  moved = max(float(np.max(np.abs(pa - p0)[mask], initial=0.0)), float(np.max(np.abs(pb - p0)[mask], initial=0.0)))
  return mask, d, moved


def _param_row(name: str, pa: np.ndarray, pb: np.ndarray, p0: np.ndarray, zslice: tuple[int, int] | None,
               rule: _PairRule) -> tuple[dict, tuple[float, float]]:
  """One tensor's table row under `rule` (max_abs_diff, max_abs_moved, ratio, rule, score, passed) and, for the
  detail, (|Δ|, allowed) at its worst point: the worst element (Adam rule) or the tensor (per-tensor rule)."""
  mask, d, moved = _masked_diff(pa, pb, p0, zslice)
  maxd = float(np.max(d, initial=0.0))
  finite = bool(np.all(np.isfinite(pa)) and np.all(np.isfinite(pb)))
  if not finite:
    maxd = float("nan")
  ratio = maxd / moved if moved > 0 else (0.0 if maxd == 0 else float("inf"))
  if rule.adam:
    scores, allowed = _adam_element_scores(d, moved, rule.rtol, name, rule.ma, rule.mb, mask, rule.lr_sum,
                                           rule.kappa)
    k = int(np.argmax(scores)) if scores.size else 0
    score = float(scores[k]) if finite and scores.size else (0.0 if finite else float("nan"))
    at = (float(d[k]) if d.size else 0.0, float(allowed[k]) if d.size else 0.0)
  else:
    score = ratio / rule.rtol if rule.rtol > 0 else (0.0 if ratio == 0 else float("inf"))
    at = (maxd, rule.rtol * moved)
  return {"max_abs_diff": maxd, "max_abs_moved": moved, "ratio": ratio, "rule": "adam" if rule.adam else "per_tensor",
          "score": score, "passed": bool(score <= 1.0)}, at


def _params_check(a_side: str, b_side: str, table: list[dict], at: dict[str, tuple[float, float]], rule: _PairRule,
                  precision: str) -> Check:
  """The pair's 'params' Check from its per-tensor table: the worst tensor (largest score, NaN first) decides the
  value and the tolerance; the detail names the rule and, for the fallback, why it applied."""
  worst = None
  for t in table:
    if worst is None or not t["score"] <= worst["score"]:
      worst = t
  tol = tolerance(precision, "params")
  over = f"{sum(not t['passed'] for t in table)} of {len(table)} tensors over"
  name, (at_d, at_allowed) = worst["tensor"], at[worst["tensor"]]
  if rule.adam:
    detail = (f"worst tensor {name}: element |Δ| = {at_d:.3g} vs allowed {at_allowed:.3g} "
              f"({worst['score']:.3g}x; {tol.rtol:g}·moved {worst['max_abs_moved']:.3g} + min(2·Σlr, {rule.kappa:g}"
              f"·g·S_i)); tensor max |Δ| {worst['max_abs_diff']:.3g}; {over}; rule: Adam per element (moments of "
              "both sides)")
    value, bound = at_d, at_allowed
  else:
    why = (f"{', '.join(rule.missing)} wrote no {FINAL_MOMENTS_NAME}" if rule.missing else
           f"{precision}: the per-element rule is measured in fp32 only" if precision != "fp32" else
           "a moments file lacks some tensors")
    detail = (f"worst tensor {name}: max |Δ| = {worst['max_abs_diff']:.3g}, moved {worst['max_abs_moved']:.3g} "
              f"from init (ratio {worst['ratio']:.3g}); {over}; rule: per-tensor fallback ({why})")
    value, bound = float(worst["ratio"]), tol.rtol
  nan_tensors = [t["tensor"] for t in table if math.isnan(t["max_abs_diff"])]
  if nan_tensors:
    detail += f"; non-finite values in {nan_tensors[:3]}"
    value = float("nan")
  reason = tol.reason + (" " + tolerance(precision, "params_grad_noise").reason if rule.adam else "")
  return Check(name=f"params {a_side}~{b_side}", metric="params", sides=(a_side, b_side), value=value,
               tolerance=bound, passed=all(t["passed"] for t in table), worst=name, detail=detail, reason=reason)


def _zero_grad_check(a_side: str, a: dict[str, np.ndarray], b_side: str, b: dict[str, np.ndarray],
                     zslices: dict[str, tuple[int, int]], lr_sum: float, precision: str) -> Check | None:
  """The 'params_zero_grad' Check: the zero-gradient slices held to Adam's step bound 2·Σlr; None without slices."""
  zworst = None
  for name in a:
    if name in zslices:
      lo, hi = zslices[name]
      pa, pb = (np.asarray(x[name], dtype=np.float64) for x in (a, b))
      zdiff = float(np.max(np.abs(pa[lo:hi] - pb[lo:hi])))
      if zworst is None or not zdiff <= zworst[1]:
        zworst = (name, zdiff)
  if zworst is None:
    return None
  bound = 2.0 * lr_sum
  return Check(name=f"params_zero_grad {a_side}~{b_side}", metric="params_zero_grad", sides=(a_side, b_side),
               value=zworst[1], tolerance=bound, passed=zworst[1] <= bound, worst=zworst[0],
               detail=f"key-bias slices: max |Δ| = {zworst[1]:.3g} (Adam step bound 2·Σlr = {bound:.3g}) at "
               f"{zworst[0]}", reason=tolerance(precision, "params_zero_grad").reason)


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
  rule = _pair_rule(a_side, b_side, a, moments, precision, lr_sum, tolerance(precision, "params").rtol,
                    adam_ok=precision == "fp32")
  zslices = zero_grad_slices(spec) if adam_updates else {}
  table, at = [], {}
  for name in a:
    pa, pb, p0 = (np.asarray(x, dtype=np.float64) for x in (a[name], b[name], init[name]))
    if pa.shape != pb.shape:
      raise ValueError(f"{name}: shape {pa.shape} on {a_side} vs {pb.shape} on {b_side}")
    row, at[name] = _param_row(name, pa, pb, p0, zslices.get(name), rule)
    table.append({"tensor": name, "sides": [a_side, b_side], **row})
  checks = [_params_check(a_side, b_side, table, at, rule, precision)] if table else []
  zero = _zero_grad_check(a_side, a, b_side, b, zslices, lr_sum, precision)
  return checks + ([zero] if zero is not None else []), table


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
    _, diff, moved = _masked_diff(pa, pb, p0, zslices.get(name))
    d = float(np.max(diff, initial=0.0))
    out[name] = d / moved if moved > 0 else (0.0 if d == 0 else math.inf)
  return out


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
