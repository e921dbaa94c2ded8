"""The bf16/fp16 noise envelope: each side's reduction-order rerun measures how far rounding alone moves it, and a
pair is held against the noisier of its two sides, per-step metrics window by window (`envelope_check`) and final
params per tensor or per element (`envelope_params_check`). Numpy only; rules from parity.verdict.tolerances."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from parity.numerics.adam import element_scores
from parity.verdict.check import Check
from parity.verdict.params import FINAL_MOMENTS_NAME, PairRule, masked_diff, pair_rule, param_ratios
from parity.verdict.steps import relative_diff, steps_by_index
from parity.verdict.tolerances import EnvelopeRule, tolerance
from parity.weights import zero_grad_slices

__all__ = ["ENVELOPE_METRICS", "windowed_rms", "rerun_differences", "envelope_check", "envelope_params_check"]

ENVELOPE_METRICS = ("loss", "grad_norm", "val_loss")
"""Per-step metrics held against a noise envelope (grad_norm on relative differences)."""


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
    rms_k(envelope_b)) + floor (rule.grad_norm_floor for grad_norm) at the worst window (largest ratio);
    first_failing_step is the first step of the first window over its bound. Skipped steps (fp16 overflow) are left out
    when both sides skipped them.
  """
  name, kind = f"{metric}_envelope {a_side}~{b_side}", f"{metric}_envelope"
  relative = metric == "grad_norm"  # norms span orders of magnitude over a run: compare relative differences
  floor = rule.grad_norm_floor if relative else rule.floor
  envs = [noise[s] for s in (a_side, b_side) if s in noise]
  skipped = {int(r["step"]) for r in (*a, *b) if r.get("skipped")}
  sa, sb = steps_by_index(a, metric), steps_by_index(b, metric)
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


def _envelope_row(name: str, r: float, bound: float, params: tuple, zslice: tuple[int, int] | None,
                  prule: PairRule) -> tuple[float, str, float, float, float, float]:
  """One tensor of the params envelope: (score, name, ratio r, bound_T, value, allowed), value/allowed being the
  worst element's |a_i - b_i| and its bound (Adam rule) or r and bound_T (per-tensor rule, or a non-finite r).
  params: (a, b, init) arrays of the tensor."""
  if not prule.adam or not math.isfinite(r):
    return (r / bound if math.isfinite(r) else math.inf, name, r, bound, r, bound)
  pa, pb, p0 = (np.asarray(x, dtype=np.float64) for x in params)
  mask, d, moved = masked_diff(pa, pb, p0, zslice)
  scores, allowed = element_scores(d, moved, bound, name, prule.ma, prule.mb, mask, prule.lr_sum, prule.kappa)
  if not scores.size:
    return (0.0, name, r, bound, 0.0, 0.0)
  k = int(np.argmax(scores))
  return (float(scores[k]), name, r, bound, float(d[k]), float(allowed[k]))


def _envelope_params_detail(worst: tuple, over: int, n: int, rule: EnvelopeRule, prule: PairRule,
                            precision: str | None, adam_updates: bool) -> tuple[str, str]:
  """(detail, reason) of the params envelope check from its worst row (`_envelope_row`) and the count over."""
  score, name, r, bound, value, allowed = worst
  base = f"{rule.factor:g}x the noisier rerun's + {rule.params_floor:g}"
  if prule.adam:
    detail = (f"worst tensor {name}: element |Δ| = {value:.3g} vs allowed {allowed:.3g} ({score:.3g}x; "
              f"{bound:.3g}·moved + min(2·Σc_t·lr_t, {prule.kappa:.3g}·g·S_i), {bound:.3g} = {base}); tensor max |Δ| / "
              f"moved = {r:.3g}; {over} of {n} tensors over; rule: envelope + Adam per element (moments of "
              "both sides)")
    return detail, rule.reason + " " + tolerance(precision, "params_grad_noise").reason
  why = ("no precision given" if precision is None else "the optimizer is not Adam" if not adam_updates else
         f"{', '.join(prule.missing)} wrote no {FINAL_MOMENTS_NAME}" if prule.missing else
         "a moments file lacks some tensors")
  detail = (f"worst tensor {name}: max |Δ| / moved = {r:.3g} vs bound {bound:.3g} ({base}); {over} of "
            f"{n} tensors over; rule: per-tensor fallback ({why})")
  return detail, rule.reason


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
  prule = pair_rule(a_side, b_side, a, moments, precision, lr_sum, 0.0,
                    adam_ok=precision is not None and adam_updates)
  zslices = zero_grad_slices(spec)
  rows = []
  for name, r in param_ratios(a, b, init, spec).items():
    bound = rule.factor * max(e.get(name, 0.0) for e in envs) + rule.params_floor
    rows.append(_envelope_row(name, r, bound, (a[name], b[name], init[name]), zslices.get(name), prule))
  rows.sort(key=lambda x: (-x[0] if not math.isnan(x[0]) else -math.inf, x[1]))
  score, name, r, bound, value, allowed = rows[0]
  over = sum(not x[0] <= 1.0 for x in rows)
  detail, reason = _envelope_params_detail(rows[0], over, len(rows), rule, prule, precision, adam_updates)
  nonfinite = [x[1] for x in rows if not math.isfinite(x[2])]
  if nonfinite:
    detail += f"; non-finite values in {nonfinite[:3]}"
  return Check(name=f"params_envelope {a_side}~{b_side}", metric="params_envelope", sides=(a_side, b_side),
               value=value, tolerance=allowed, passed=over == 0, worst=name, detail=detail, reason=reason)
