"""The final-parameter check of a pair of sides: the per-element Adam rule (fp32, with both sides' moments) or the
per-tensor fallback, the zero-gradient slices held to Adam's step bound, and the per-element Adam sensitivity each
worker accumulates for it (parity.numerics.adam). Numpy only; tolerances from parity.verdict.tolerances.

The per-element Adam rule of `param_checks`, derived.

The rule, per element i of a tensor T (fp32 with both sides' moments, parity.protocol.FINAL_MOMENTS):

    |a_i - b_i| <= rtol * moved_T + min(2 * sum_t lr_t, kappa * g_i * S_i)

rtol * moved_T is the dynamics term (params.rtol times the larger distance either side moved T from init).
The second term is how far Adam carries a gradient perturbation, derived per element:
1. Sensitivity. Adam's update is u_t = lr_t * m_hat_t / (sqrt(v_hat_t) + eps) (Kingma & Ba 2015, Algorithm 1).
   To first order a perturbation delta of the element's gradients changes m_hat_t by at most delta and moves
   u_t by at most lr_t * delta / (sqrt(v_hat_t,i) + eps) (the v_hat part of the derivative has the opposite sign
   and is no larger), so |delta theta_i| <= delta * S_i with S_i = max over the sides of sum_t lr_t /
   (sqrt(v_hat_t,i) + eps), the sensitivity each worker accumulates (parity.numerics.adam.AdamSensitivity).
2. Ill-conditioning. Where |g_i| is within a few delta of 0, or sqrt(v_hat) ~ eps, that first-order figure is
   huge and meaningless: rounding decides the update's sign (at step 1 u = lr * g / (|g| + eps) = +-lr). What
   bounds it is Adam's step bound: one side moves an element by at most sum_t c_t * lr_t (adam_step_sum), two
   sides differ by at most twice that. Hence min(2 * sum_t c_t lr_t, .).
3. The perturbation. A gradient element is a sum over the L tokens of the step; two frameworks sum in different
   orders and blockings, so the rounding of g_i differs by ~u * sqrt(L) of the scale of its partial sums (u =
   2^-24). That scale is not |g_i|: an element can be 270x below its tensor's RMS through cancellation while its
   partial sums are not, and a bound from its own ulp(g_i) * sqrt(L) (~u * sqrt(L) * sum lr: 2.4e-9 at the
   gpt2-small-cpu drift element, L = 512) is 600x below the gap measured there (1.55e-6 over the dynamics term). It is
   the tensor's gradient scale g_i = g_T (the larger side's RMS over T of the final sqrt(v_hat); on a vocabulary-row
   tensor max(g_T, g_row_i), below). From step 2 on, g_i also answers the parameter differences the earlier steps left
   (drift; among them the up-to-2·lr steps of item 2 on rounding-level elements). So delta = kappa * g_i, kappa =
   params_grad_noise.rtol: rounding (<= u * sqrt(L); measured 6.8e-8 on the grids) plus drift (measured 3.3e-6), 1e-5
   (the entry's reason gives the cells).
4. The premise. Items 1-3 assume both sides fed Adam the same gradients up to delta. A bug that scales every
   gradient of a side by one factor c (a clipping threshold 0.5 vs 1.0 with clipping active, a loss scaled on one
   side) moves m_hat and sqrt(v_hat) by c and so the update only through eps: u = lr * m_hat / (sqrt(v_hat) + eps
   / c), |delta theta_i| ~ eps * |c_a / c_b - 1| * S_i, exactly the shape of item 3's term with delta = eps (a
   gpt2-tiny tensor with g_T ~ 1e-3 needs kappa > 5e-6 to excuse it). It shows at full size in the moments,
   though: each tensor's g_T differs by |1 - c_b / c_a| (0.5) where correct sides agree to 2.2e-6. So the noise
   term applies to a tensor only when the two sides' g_T agree within params_moments.rtol
   (parity.numerics.adam.moments_gap); elsewhere it is withheld (the detail names those tensors), leaving the
   dynamics term. An element with a large gradient gets ~kappa * sum lr * g_i / sqrt(v_hat_i) on top of the
   dynamics term, far below a real bug's effect. This holds for any lr schedule.

g_T is an RMS over the tensor, so on a tensor whose rows are the vocabulary (shape[0] == model.vocab_size: wte,
an untied lm_head) it is diluted by the rows a run never feeds: n fed rows of V give g_T ~ sqrt(n / V) * g_row.
The rounding noise of a fed row's element scales with that row's own sums (its tokens' input gradients, and the
tied head's sum_n (p_nj - y_nj) h_n), not with rows that got nothing. Measured (gpt2-tiny, V = 151,936,
byte ids, 3 steps): g_T 1.5e-4 vs the fed row's 1.9e-3, and the worst element (|g| 3e-7 in row 79) needed kappa
3.4e-6 against g_T but 2.6e-7 against its row. So on such tensors the scale is g_i = max(g_T, g_row_i), g_row_i
the larger side's RMS of sqrt(v_hat) over element i's row: a fed row's own scale, never below g_T (a vocabulary
every row of which is fed, e.g. 256 bytes, gets no tighter bound than before; a row never fed keeps g_T, and its
rounding-level elements the step bound). Zero-gradient slices (parity.weights.zero_grad_slices) are the S_i -> sum
lr / eps limit: they get the step bound 2 * sum lr in their own 'params_zero_grad' check.

Fallback (said in the detail): without moments from both sides, or in bf16/fp16 (kappa unmeasured there; their
params entry is a gross bound and the noise envelope decides), every tensor must satisfy
max|a - b| / max(max|a - init|, max|b - init|) <= params.rtol.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from parity.numerics.adam import element_scores, moments_cover, moments_gap
from parity.verdict.check import Check
from parity.verdict.tolerances import tolerance
from parity.weights import zero_grad_slices

__all__ = ["param_checks", "param_ratios", "FINAL_MOMENTS_NAME", "PairRule", "pair_rule", "masked_diff"]

FINAL_MOMENTS_NAME = "final_moments.safetensors"
"""parity.protocol.FINAL_MOMENTS (named here for messages; the verdict does not import the protocol)."""


@dataclasses.dataclass(frozen=True)
class PairRule:
  """How one pair's final params are judged: the per-element Adam rule (`adam`) or the per-tensor fallback.

  rtol: the dynamics term's factor (params.rtol, or an envelope's bound_T set per tensor by the caller);
  kappa: params_grad_noise.rtol (0 without the Adam rule); ma, mb: both sides' moments; missing: the sides that
  wrote none (named in the fallback's detail); vocab_size: model.vocab_size (the noise scale of vocabulary-row
  tensors, parity.numerics.adam.noise_scale; None: g_T for every tensor); moments_rtol: params_moments.rtol, the
  most the two sides' gradient scales of a tensor may differ for its noise term to apply (None: not checked, the
  envelope rules)."""
  adam: bool
  rtol: float
  kappa: float
  lr_sum: float
  ma: dict | None
  mb: dict | None
  missing: tuple[str, ...]
  vocab_size: int | None = None
  moments_rtol: float | None = None


def pair_rule(a_side: str, b_side: str, names, moments: dict | None, precision: str | None, lr_sum: float,
               rtol: float, adam_ok: bool, vocab_size: int | None = None) -> PairRule:
  """The rule for one pair: Adam per element when `adam_ok` and both sides' moments cover every tensor of `names`."""
  moments = moments or {}
  ma, mb = moments.get(a_side), moments.get(b_side)
  missing = tuple(s for s, m in ((a_side, ma), (b_side, mb)) if m is None)
  adam = adam_ok and not missing and moments_cover(ma, mb, names)
  kappa = tolerance(precision, "params_grad_noise").rtol if adam else 0.0
  mtol = tolerance(precision, "params_moments").rtol if adam and precision == "fp32" else None
  return PairRule(adam, rtol, kappa, lr_sum, ma, mb, missing, vocab_size, mtol)


def masked_diff(pa: np.ndarray, pb: np.ndarray, p0: np.ndarray, zslice: tuple[int, int] | None
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
               rule: PairRule) -> tuple[dict, tuple[float, float]]:
  """One tensor's table row under `rule` (max_abs_diff, max_abs_moved, ratio, rule, score, passed) and, for the
  detail, (|Δ|, allowed) at its worst point: the worst element (Adam rule) or the tensor (per-tensor rule)."""
  mask, d, moved = masked_diff(pa, pb, p0, zslice)
  maxd = float(np.max(d, initial=0.0))
  finite = bool(np.all(np.isfinite(pa)) and np.all(np.isfinite(pb)))
  if not finite:
    maxd = float("nan")
  ratio = maxd / moved if moved > 0 else (0.0 if maxd == 0 else float("inf"))
  gap, withheld = 0.0, False
  if rule.adam:
    gap = moments_gap(name, rule.ma, rule.mb, mask)
    withheld = rule.moments_rtol is not None and not gap <= rule.moments_rtol
    scores, allowed = element_scores(d, moved, rule.rtol, name, rule.ma, rule.mb, mask, rule.lr_sum,
                                     0.0 if withheld else rule.kappa, rule.vocab_size)
    k = int(np.argmax(scores)) if scores.size else 0
    score = float(scores[k]) if finite and scores.size else (0.0 if finite else float("nan"))
    at = (float(d[k]) if d.size else 0.0, float(allowed[k]) if d.size else 0.0)
  else:
    score = ratio / rule.rtol if rule.rtol > 0 else (0.0 if ratio == 0 else float("inf"))
    at = (maxd, rule.rtol * moved)
  return {"max_abs_diff": maxd, "max_abs_moved": moved, "ratio": ratio, "rule": "adam" if rule.adam else "per_tensor",
          "score": score, "passed": bool(score <= 1.0), "moments_gap": gap, "noise_withheld": withheld}, at


def _params_check(a_side: str, b_side: str, table: list[dict], at: dict[str, tuple[float, float]], rule: PairRule,
                  precision: str, slices_apart: bool = False) -> Check:
  """The pair's 'params' Check from its per-tensor table: the worst tensor (largest score, NaN first) decides the
  value and the tolerance; the detail names the rule and, for the fallback, why it applied. slices_apart: the
  zero-gradient slices were left out of the table (params_zero_grad checks them), which the detail then says, so
  "all N tensors within tolerance" does not read as covering them."""
  worst = None
  for t in table:
    if worst is None or not t["score"] <= worst["score"]:
      worst = t
  tol = tolerance(precision, "params")
  over = f"{sum(not t['passed'] for t in table)} of {len(table)} tensors over"
  name, (at_d, at_allowed) = worst["tensor"], at[worst["tensor"]]
  if rule.adam:
    detail = (f"worst tensor {name}: element |Δ| = {at_d:.3g} vs allowed {at_allowed:.3g} "
              f"({worst['score']:.3g}x; {tol.rtol:g}·moved {worst['max_abs_moved']:.3g} + min(2·Σc_t·lr_t, "
              f"{rule.kappa:g}·g·S_i)); tensor max |Δ| {worst['max_abs_diff']:.3g}; {over}; rule: Adam per element "
              "(moments of both sides)")
    withheld = [t for t in table if t.get("noise_withheld")]
    if withheld:
      w = max(withheld, key=lambda t: t["moments_gap"])
      detail += (f"; noise term withheld on {len(withheld)} tensors whose two sides' gradient scales differ beyond "
                 f"{rule.moments_rtol:g} (worst {w['tensor']}: {w['moments_gap']:.3g} relative; the optimizers saw "
                 "different gradients: a clipping threshold, a loss or gradient scale, a gradient bug)")
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
  if slices_apart:
    detail += "; key-bias slices (zero true gradient) left out here: params_zero_grad checks them"
  reason = tol.reason + (" " + tolerance(precision, "params_grad_noise").reason if rule.adam else "")
  if rule.moments_rtol is not None:
    reason += " " + tolerance(precision, "params_moments").reason
  return Check(name=f"params {a_side}~{b_side}", metric="params", sides=(a_side, b_side), value=value,
               tolerance=bound, passed=all(t["passed"] for t in table), worst=name, detail=detail, reason=reason)


def _zero_grad_check(a_side: str, a: dict[str, np.ndarray], b_side: str, b: dict[str, np.ndarray],
                     zslices: dict[str, tuple[int, int]], lr_sum: float, precision: str) -> Check | None:
  """The 'params_zero_grad' Check: the zero-gradient slices held to Adam's step bound 2·lr_sum (lr_sum: adam_step_sum
  of the run, the most one side can move an element); None without slices."""
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
               detail=f"key-bias slices: max |Δ| = {zworst[1]:.3g} (Adam step bound 2·Σ c_t·lr_t = {bound:.3g}) at "
               f"{zworst[0]}", reason=tolerance(precision, "params_zero_grad").reason)


def _param_table(a_side: str, a: dict[str, np.ndarray], b_side: str, b: dict[str, np.ndarray],
                 init: dict[str, np.ndarray], zslices: dict[str, tuple[int, int]], rule: PairRule
                 ) -> tuple[list[dict], dict[str, tuple[float, float]]]:
  """The pair's per-tensor table under `rule` (one `_param_row` per tensor of `a`, in its order, as float64) and,
  per tensor, (|Δ|, allowed) at its worst point. Raises ValueError naming a tensor whose two shapes differ."""
  table, at = [], {}
  for name in a:
    pa, pb, p0 = (np.asarray(x, dtype=np.float64) for x in (a[name], b[name], init[name]))
    if pa.shape != pb.shape:
      raise ValueError(f"{name}: shape {pa.shape} on {a_side} vs {pb.shape} on {b_side}")
    row, at[name] = _param_row(name, pa, pb, p0, zslices.get(name), rule)
    table.append({"tensor": name, "sides": [a_side, b_side], **row})
  return table, at


def param_checks(a_side: str, a: dict[str, np.ndarray], b_side: str, b: dict[str, np.ndarray],
                 init: dict[str, np.ndarray], spec, precision: str, lr_sum: float,
                 moments: dict[str, dict | None] | None = None, adam_updates: bool = True
                 ) -> tuple[list[Check], list[dict]]:
  """Final-parameter checks of one pair, and the per-tensor table.

  The rule, per element i of a tensor T (fp32 with both sides' moments, parity.protocol.FINAL_MOMENTS):

      |a_i - b_i| <= rtol * moved_T + min(2 * sum_t lr_t, kappa * g_i * S_i)

  rtol * moved_T is the dynamics term; the second term is how far Adam carries a gradient perturbation kappa * g_i
  (g_i the tensor's gradient scale, on a vocabulary-row tensor max(g_T, g_row_i); S_i the Adam sensitivity), capped
  by the step bound, and withheld on a tensor whose two sides' gradient scales differ beyond params_moments.rtol.
  Zero-gradient slices get the step bound 2 * sum lr in their own 'params_zero_grad' check. Fallback (said in the
  detail): without moments from both sides, or in bf16/fp16, every tensor must satisfy
  max|a - b| / max(max|a - init|, max|b - init|) <= params.rtol. The derivation (items 1-4, the vocabulary rows,
  the fallback): this module's docstring.

  Args:
    a, b, init: canonical float32 params (name -> array), same names and shapes.
    spec: the ModelSpec (for the zero-gradient slices).
    lr_sum: the most one Adam side can move an element over the run, adam_step_sum (sum_t c_t * lr_t; the caller
      passes it so that the 2 * sum_t lr_t step bound above holds for any betas).
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
  rule = pair_rule(a_side, b_side, a, moments, precision, lr_sum, tolerance(precision, "params").rtol,
                    adam_ok=precision == "fp32", vocab_size=getattr(spec, "vocab_size", None))
  zslices = zero_grad_slices(spec) if adam_updates else {}
  table, at = _param_table(a_side, a, b_side, b, init, zslices, rule)
  checks = [_params_check(a_side, b_side, table, at, rule, precision, slices_apart=bool(zslices))] if table else []
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
    _, diff, moved = masked_diff(pa, pb, p0, zslices.get(name))
    d = float(np.max(diff, initial=0.0))
    out[name] = d / moved if moved > 0 else (0.0 if d == 0 else math.inf)
  return out
