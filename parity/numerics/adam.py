"""Adam's per-element kernels, numpy only: what every side accumulates while it trains (AdamSensitivity), how far one
Adam update sequence can move an element (adam_step_sum), and the per-element params rule both the final-params
check (parity.verdict.params) and the noise envelope (parity.verdict.envelope) apply (element_scores).

The rule. Adam (Kingma & Ba 2015, "Adam: A Method for Stochastic Optimization", Algorithm 1; AdamW's decoupled
weight decay, Loshchilov & Hutter 2019, is the same on both sides and drops out of a difference) updates element i
at step t by lr_t * m_hat_t,i / (sqrt(v_hat_t,i) + eps). Two sides that see the same data differ in an element's
gradient by rounding noise of about g_i (the gradient's scale, from sqrt(v_hat)); to first order that noise moves the
parameter by at most g_i * S_i with S_i = sum_t lr_t / (sqrt(v_hat_t,i) + eps) (AdamSensitivity). So, per element,

    |a_i - b_i| <= allowed_i = rtol * moved + min(2 * sum_t c_t lr_t, kappa * g_i * S_i)

moved the larger distance either side moved the tensor from init (the dynamics term, rtol = params.rtol), 2 *
sum_t c_t lr_t the most two Adam sequences can separate an element (adam_step_sum, Cauchy-Schwarz bound), kappa =
params_grad_noise.rtol (parity.verdict.tolerances, measured). The derivation and the measurements behind kappa:
parity.verdict.params (its module docstring) and benchmarks/params_rule.py.
"""
from __future__ import annotations

import numpy as np

__all__ = ["moments_cover", "noise_scale", "moments_gap", "element_scores", "adam_step_sum", "AdamSensitivity",
           "adam_forms", "classify_adam"]


def moments_cover(ma, mb, names) -> bool:
  """Both sides' moments (parity.protocol.read_moments) hold grad_rms and sensitivity for every tensor in `names`."""
  return all(m is not None and set(m["grad_rms"]) >= set(names) and set(m["sensitivity"]) >= set(names)
             for m in (ma, mb))


def noise_scale(name: str, ma, mb, mask: np.ndarray, vocab_size: int | None) -> np.ndarray | float:
  """The gradient scale g_i the noise term multiplies, over the masked elements of one tensor: g_T, the larger
  side's RMS of sqrt(v_hat) over the tensor, and for a tensor whose axis 0 is the vocabulary (shape[0] ==
  vocab_size, 2-D: wte, an untied lm_head) max(g_T, g_row), g_row the larger side's RMS of sqrt(v_hat) over the
  element's row (a float64 array over the mask then; why: parity.verdict.params, its module docstring)."""
  rms = [m["grad_rms"][name].astype(np.float64) for m in (ma, mb)]
  g = max(float(np.sqrt(np.mean(np.square(r)))) for r in rms)
  if vocab_size is None or rms[0].ndim != 2 or rms[0].shape[0] != vocab_size:
    return g
  row = np.maximum(*(np.sqrt(np.mean(np.square(r), axis=1)) for r in rms))
  return np.maximum(g, np.broadcast_to(row[:, None], rms[0].shape)[mask])


def moments_gap(name: str, ma, mb, mask: np.ndarray) -> float:
  """How far apart the two sides' gradient scales of one tensor are: |g_a - g_b| / max(g_a, g_b), g the RMS of
  the final sqrt(v_hat) over the masked elements (zero-gradient slices left out), 0.0 when both are 0. Unitless.

  The premise of the Adam noise term (element_scores) is that both sides fed the optimizer the same gradients up to
  rounding; their second moments then agree to rounding too (measured <= 2.2e-6 relative, gpt2-small-cpu; see
  parity.verdict.tolerances params_moments). A bug that rescales every gradient by one factor (a different
  clipping threshold, a loss scaled on one side) is invisible to an element's update except through eps, with the
  very shape of rounding noise (eps * (c_a / c_b - 1) * S_i, below), but shows here at its full size."""
  g = [float(np.sqrt(np.mean(np.square(m["grad_rms"][name].astype(np.float64)[mask])))) if mask.any() else 0.0
       for m in (ma, mb)]
  top = max(g)
  return abs(g[0] - g[1]) / top if top > 0 else 0.0


def element_scores(d: np.ndarray, moved: float, bound: float, name: str, ma, mb, mask: np.ndarray,
                         lr_sum: float, kappa: float, vocab_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(|a_i - b_i| / allowed_i, allowed_i) over the masked elements of one tensor, for the per-element Adam rule
  allowed_i = bound·moved + min(2·lr_sum, kappa·g_i·S_i): g_i the gradient scale of `noise_scale` (g_T, or on a
  vocabulary-row tensor max(g_T, g_row)), S_i the larger side's Σ_t lr_t/(sqrt(v_hat_t)+eps) (derivation: this module's
  docstring and that of parity.verdict.params). An element with allowed 0 scores 0 when equal, inf otherwise."""
  g = noise_scale(name, ma, mb, mask, vocab_size)
  sens = np.maximum(ma["sensitivity"][name], mb["sensitivity"][name]).astype(np.float64)[mask]
  allowed = bound * moved + np.minimum(2.0 * lr_sum, kappa * g * sens)
  with np.errstate(invalid="ignore", divide="ignore"):
    scores = np.where(allowed > 0, d / np.maximum(allowed, 1e-300), np.where(d == 0, 0.0, np.inf))
  return scores, allowed


def adam_step_sum(lrs, beta1: float, beta2: float) -> float:
  """The most one bias-corrected Adam/AdamW update sequence can move an element: sum_t lr_t * c_t (same unit as lr).

  Adam's update is lr_t * m_hat_t / (sqrt(v_hat_t) + eps) (plus decoupled weight decay, the same on both sides). For
  any gradients g_1..g_t, Cauchy-Schwarz on m_t = sum_k a_k g_k against v_t = sum_k b_k g_k^2, with
  a_k = (1 - beta1) beta1^(t-k) and b_k = (1 - beta2) beta2^(t-k), gives the tight bound

      |m_hat_t| / sqrt(v_hat_t) <= c_t = sqrt(sum_k a_k^2 / b_k) * sqrt(1 - beta2^t) / (1 - beta1^t),

  equality for g_k proportional to a_k / b_k. c_1 = 1 and c_t grows with t toward its limit (for (0.9, 0.95) at most
  1.17; for (0.9, 0.999) 1.16 at step 20, 3.1 at step 200, 7.3 in the limit). Kingma & Ba (2015, sec. 2.1) quote |step|
  <= lr for (1 - beta1) <= sqrt(1 - beta2) and lr (1 - beta1)/sqrt(1 - beta2) otherwise, for a gradient at one step
  only; this is the bound over every gradient sequence, which the zero-gradient slices (rounding noise, any sign) need.

  Args:
    lrs: the learning rate of each update applied, in order (skipped fp16 steps left out: t counts updates).
    beta1, beta2: Adam's decay rates, each in [0, 1).
  Returns:
    sum_t lr_t * c_t (float; 0.0 for no updates).
  """
  lr = np.asarray(list(lrs), dtype=np.float64)
  if lr.size == 0:
    return 0.0
  if beta2 <= 0.0:  # v_hat = g_t^2: m_hat / sqrt(v_hat) has no bound (a tiny g_t after large ones)
    return float("inf")
  t = np.arange(1, lr.size + 1, dtype=np.float64)
  r = beta1 * beta1 / beta2
  # sum_{k<t} r^k in closed form (r == 1 and r > 1 kept exact by the geometric formula's float64 form)
  geo = t if abs(r - 1.0) < 1e-12 else (1.0 - r ** t) / (1.0 - r)
  c = (1.0 - beta1) / np.sqrt(1.0 - beta2) * np.sqrt(geo) * np.sqrt(1.0 - beta2 ** t) / (1.0 - beta1 ** t)
  return float(np.sum(lr * np.maximum(c, 1.0)))


class AdamSensitivity:
  """Per element, S_i = sum over Adam updates t of lr_t / (sqrt(v_hat_t,i) + eps): how far rounding noise in that
  element's gradient can move its parameter (the params rule, parity.verdict.params.param_checks). Numpy only; every
  side feeds it.
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


def adam_forms(g: float, eps: float, beta1: float, beta2: float, t: int) -> dict[tuple[str, bool], float]:
  """The normalised first-update value u = -delta / lr of Adam from zero moments, for a gradient g at update t
  (1-based), under each convention: {(eps placement 'outside' | 'inside', bias correction): u}.

  m = (1 - b1) g, v = (1 - b2) g^2; with bias correction m / (1 - b1^t), v / (1 - b2^t); outside: m / (sqrt(v) +
  eps), inside: m / sqrt(v + eps) (DeepSpeed's eps_inside_sqrt, Lamb)."""
  m, v = (1 - beta1) * g, (1 - beta2) * g * g
  out = {}
  for bc in (True, False):
    mh, vh = (m / (1 - beta1 ** t), v / (1 - beta2 ** t)) if bc else (m, v)
    out[("outside", bc)] = mh / (np.sqrt(vh) + eps)
    out[("inside", bc)] = mh / np.sqrt(vh + eps)
  return out


def classify_adam(u: float, g: float, eps: float, beta1: float, beta2: float, t: int
                  ) -> tuple[str | None, bool | None]:
  """(eps placement, bias correction) of an optimizer whose first update from zero moments at update t, gradient g
  (g ~ eps separates the forms), moved a parameter by u * lr; (None, None) when no Adam form is within 1 %
  (not an Adam: SGD, or a rule this does not know)."""
  forms = adam_forms(g, eps, beta1, beta2, t)
  (placement, bc), best = min(forms.items(), key=lambda kv: abs(kv[1] - u))
  if not np.isfinite(u) or abs(best - u) > 1e-2 * abs(best):
    return None, None
  return placement, bc
