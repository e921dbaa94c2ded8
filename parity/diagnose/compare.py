"""`parity diagnose` comparison: the per-kind tolerance rules and the tensor-by-tensor comparison. Numpy only."""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import numpy as np

from parity import weights
from parity.protocol.diagnose import tap_order
from parity.spec import ModelSpec, TrainSpec
from parity.verdict.tolerances import tolerance

# ----------------------------------------------------------------------------- tolerance rule


@dataclasses.dataclass(frozen=True, slots=True)
class Rule:
  """A tensor passes when max|cand - ref| <= atol + rtol * scale (+ ulps * eps32 * max|init| for updates).

  scale: max|ref| over the whole tensor (forward, loss, grad), or for updates the largest distance
  either side moved the tensor from its initial value.
  """
  atol: float
  rtol: float
  reason: str
  ulps: float = 0.0


RULES: dict[str, Rule] = {
    "forward": Rule(1e-30, tolerance("fp32", "logits").rtol, (
        "fp32 activations, relative to the tensor's largest magnitude. Matched JAX vs torch at step 0, worst "
        "tap: 8.7e-7 on gpt2-tiny (h.1.mlp.out), 1.29e-6 on gpt2-small-cpu (h.3.attn.scores); other tap kinds "
        "0 (embed) to 1.2e-6. 1.5e-5 is 11.6x the worst; the smallest planted effect, GELU tanh vs erf at "
        "h.0.mlp.act, is 8.3e-5 (gpt2-tiny) and 1.65e-4 (gpt2-small-cpu); LayerNorm eps 1e-5 vs 1e-6 is "
        "6.9e-3 at h.0.ln_1, attention scale 0.2 vs 1/sqrt(32) 0.12 at h.0.attn.scores.")),
    "loss": Rule(1e-5, 0.0, (
        "The step's loss, nats: the bound of parity.verdict.tolerances fp32 'loss' (matched stacks agree to <= 4.3e-6 "
        "over 100 steps); one step measured 0 (gpt2-tiny) and 9e-8 (gpt2-small-cpu).")),
    "grad": Rule(1e-30, 2e-5, (
        "Accumulated pre-clip gradient relative to the tensor's largest |grad|. Matched worst: 4.8e-7 "
        "(gpt2-tiny, wpe) and 6.1e-7 (gpt2-small-cpu, h.0.ln_2.bias); 2e-5 is 33x that. The attention key bias "
        "has a true gradient of exactly zero (parity.weights.zero_grad_slices): its rows are rounding noise "
        "(~1e-10), compared at the scale of the whole qkv.bias gradient, so noise passes and a real gradient "
        "there does not.")),
    "update": Rule(0.0, 1e-3, (
        "Params after one optimizer step, elementwise: |Δ| <= rtol * moved + 4 float32 ulps of max|init| + "
        "lr * kappa. moved: the largest distance either side moved the tensor. The ulps: a value near 1.0 "
        "rounds in 1.2e-7 steps, 4e-4 of a 3e-4 lr step. kappa = min(2, eps * c * delta / (c * |g| + eps)^2) "
        "is what the tolerated gradient error delta (the 'grad' rule: rtol * max|g|) can change a first Adam "
        "step lr * g / (|g| + eps) by (c: the clip factor): elements whose gradient is rounding noise, "
        "such as the attention key bias (true gradient 0) or sums that cancel to ~eps, get Adam's bound 2 lr "
        "(parity.verdict.tolerances 'params_zero_grad'). Matched worst |Δ| / allowed: 0.02 (gpt2-tiny), 0.083 "
        "(gpt2-small-cpu); a decay-mask error moves a norm scale by lr * wd * 1 = 0.1 of the step (91x rtol)."),
        ulps=4.0),
}


def _rule_kind(name: str) -> str:
  if name == "loss":
    return "loss"
  if name.startswith("grad/"):
    return "grad"
  if name.startswith("update/"):
    return "update"
  return "forward"


# ----------------------------------------------------------------------------- comparison


@dataclasses.dataclass
class TensorDiff:
  """The comparison of one tensor between the reference and the candidate side.

  Attributes:
    name: canonical tap name ('h.0.attn.q', 'loss', 'grad/<param>', 'update/<param>').
    kind: rule kind ('forward', 'loss', 'grad', 'update').
    shape: the tensor's shape (the reference's when shapes differ).
    max_abs_err: max |cand - ref| (NaN when finiteness differs, inf when shapes differ).
    max_rel_err: max_abs_err / scale: the quantity the rule bounds by rtol.
    scale: max|ref|, or for updates the distance moved from the initial value.
    tolerance: the allowed |cand - ref| at worst_index (uniform except for updates, see RULES).
    worst_index: index of the element furthest over its tolerance (largest |cand - ref| / allowed; for
      forward, loss and grad tensors the largest |cand - ref|), None for scalars or a shape mismatch.
    ref_value, cand_value: the two values there.
    worst_abs_err: |cand - ref| there.
    passed: within tolerance and no NaN mismatch.
    where: side -> where that side computed the tensor (Flax path / torch module or parameter).
    note: extra detail (zero-gradient slice, shape mismatch, missing).
  """
  name: str
  kind: str
  shape: tuple[int, ...]
  max_abs_err: float
  max_rel_err: float
  scale: float
  tolerance: float
  worst_index: tuple[int, ...] | None
  ref_value: float | None
  cand_value: float | None
  passed: bool
  worst_abs_err: float = 0.0
  where: dict[str, str] = dataclasses.field(default_factory=dict)
  note: str = ""

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d["shape"] = list(self.shape)
    d["worst_index"] = None if self.worst_index is None else list(self.worst_index)
    for k in ("max_abs_err", "max_rel_err", "scale", "tolerance", "ref_value", "cand_value", "worst_abs_err"):
      if isinstance(d[k], float) and not math.isfinite(d[k]):
        d[k] = str(d[k])
    return d


def compare_tensor(name: str, ref: np.ndarray, cand: np.ndarray, *, init: np.ndarray | None = None,
                   grad: np.ndarray | None = None, lr: float = 0.0, adam_eps: float = 1e-8,
                   clip_factor: float = 1.0) -> TensorDiff:
  """Applies the diagnose rule (`RULES`) to one tensor.

  Args:
    name: canonical tap name; its prefix picks the rule.
    ref, cand: the two sides' values, float32, same shape.
    init: for 'update/' tensors, the shared initial value of the param.
    grad: for 'update/' tensors, the reference side's gradient of the param (pre-clip).
    lr: for 'update/' tensors, the learning rate of the step.
    adam_eps: Adam's epsilon (train.eps).
    clip_factor: the reference's clip multiplier min(1, clip / (||g|| + 1e-6)) (1 without clipping).
  Returns:
    A TensorDiff. Shape mismatches and one-sided non-finite values fail.
  """
  kind = _rule_kind(name)
  rule = RULES[kind]
  a, b = np.asarray(ref, dtype=np.float64), np.asarray(cand, dtype=np.float64)
  if a.shape != b.shape:
    return TensorDiff(name, kind, tuple(a.shape), math.inf, math.inf, 0.0, 0.0, None, None, None, False,
                      note=f"shape {tuple(a.shape)} on the reference vs {tuple(b.shape)} on the candidate")
  same_nonfinite = (~np.isfinite(a)) & (~np.isfinite(b)) & ((np.isnan(a) & np.isnan(b)) | (a == b))
  with np.errstate(invalid="ignore"):
    diff = np.where(same_nonfinite, 0.0, np.abs(a - b))
  diff = np.where(np.isnan(diff), np.inf, diff)  # NaN on one side only: the worst possible difference
  note = ""
  if kind == "update":
    p0 = np.asarray(init, dtype=np.float64)
    with np.errstate(invalid="ignore"):
      moved = np.maximum(np.abs(a - p0), np.abs(b - p0))
    scale = float(np.max(np.where(np.isfinite(moved), moved, 0.0), initial=0.0))
    g = np.abs(np.asarray(grad, dtype=np.float64)) * clip_factor
    delta = RULES["grad"].rtol * float(np.max(g, initial=0.0))
    kappa = np.minimum(2.0, adam_eps * delta / (g + adam_eps) ** 2)
    allowed = (rule.rtol * scale + rule.ulps * float(np.finfo(np.float32).eps) * float(np.max(np.abs(p0), initial=0.0))
               + lr * kappa)
    noisy = int(np.sum(kappa > rule.rtol))
    if noisy:
      note = (f"{noisy} of {a.size} elements have a noise-level gradient (Adam step ill-conditioned; allowed up to "
              f"lr·kappa, at most 2·lr)")
  else:
    scale = float(np.max(np.abs(a[np.isfinite(a)]), initial=0.0))
    allowed = np.full(a.shape, rule.atol + rule.rtol * scale)
    if kind == "grad" and name.endswith(".attn.qkv.bias"):
      note = "includes the key-bias rows (true gradient 0): compared at the whole tensor's scale"
  with np.errstate(invalid="ignore", divide="ignore"):
    ratio = np.where(diff == 0, 0.0, diff / allowed)
  flat = int(np.argmax(ratio)) if ratio.size else 0
  idx = tuple(int(i) for i in np.unravel_index(flat, a.shape)) if a.ndim else None
  max_abs = float(np.max(diff, initial=0.0))
  passed = bool(np.all(diff <= allowed))
  rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
  return TensorDiff(name, kind, tuple(a.shape), max_abs, rel, scale,
                    float(allowed.reshape(-1)[flat]) if a.size else 0.0,
                    idx, float(a.reshape(-1)[flat]) if a.size else None, float(b.reshape(-1)[flat]) if b.size else None,
                    passed, worst_abs_err=float(diff.reshape(-1)[flat]) if a.size else 0.0, note=note)


def _clip_factor(grads: Mapping[str, np.ndarray], clip: float) -> float:
  """DeepSpeed's clip multiplier 1 / max(1, (||g|| + 1e-6) / clip) of a canonical gradient (1 when clip == 0)."""
  if clip <= 0:
    return 1.0
  norm = math.sqrt(sum(float(np.sum(np.asarray(g, dtype=np.float64) ** 2)) for g in grads.values()))
  return 1.0 / max(1.0, (norm + 1e-6) / clip)


def compare_outputs(spec: ModelSpec, train: TrainSpec, ref: Mapping[str, np.ndarray], cand: Mapping[str, np.ndarray],
                    init: Mapping[str, np.ndarray], lr: float) -> list[TensorDiff]:
  """Compares two sides' diagnose tensors in `tap_order`; a tensor missing on a side fails.

  Args:
    spec: the model spec (names and order).
    train: the training spec (Adam eps, gradient clipping) of the run.
    ref, cand: tap name -> float32 array, as the workers wrote them.
    init: canonical initial params (before any plant).
    lr: the update's learning rate.
  """
  grads = {n[len("grad/"):]: v for n, v in ref.items() if n.startswith("grad/")}
  clip = _clip_factor(grads, train.grad_clip)
  out = []
  for name in tap_order(spec):
    if name not in ref or name not in cand:
      missing = [s for s, d in (("reference", ref), ("candidate", cand)) if name not in d]
      out.append(TensorDiff(name, _rule_kind(name), (), math.inf, math.inf, 0.0, 0.0, None, None, None, False,
                            note=f"missing on the {' and '.join(missing)} side"))
      continue
    param = name.split("/", 1)[1] if name.startswith("update/") else None
    if param is not None and param not in grads:
      out.append(TensorDiff(name, "update", (), math.inf, math.inf, 0.0, 0.0, None, None, None, False,
                            note=f"grad/{param} is missing on the reference side"))
      continue
    out.append(compare_tensor(name, ref[name], cand[name], init=init.get(param) if param else None,
                              grad=grads.get(param) if param else None, lr=lr, adam_eps=train.eps, clip_factor=clip))
  return out




# ----------------------------------------------------------------------------- bf16 / fp16: errors vs fp32


UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
"""Half an ulp of 1.0 in the compute dtype: the largest relative error of one rounding (8 / 11 significand bits)."""


@dataclasses.dataclass(frozen=True, slots=True)
class PrecisionRule:
  """bf16/fp16 rule: flag a tensor where one side's error vs the fp32 reference is `factor` x the other's.

  A side is off at a tensor when its rms relative error (`PrecisionDiff`) exceeds `factor` times the other
  side's and also `floor_u` units of roundoff of the compute dtype (below that both sides are exact to well
  within one rounding, and the ratio of two tiny errors means nothing).
  """
  factor: float
  floor_u: float
  reason: str


PRECISION_RULE = PrecisionRule(2.0, 0.25, (
    "bf16, gpt2-tiny and the LLaMA-family test spec, step 0, each side against its own fp32 run: once JAX rounds "
    "where torch's kernels round (jax_impl/model.py), every forward tap and every gradient but torch's LayerNorm "
    "weight/bias gradients is within 1.25x between the sides (forward 1.00-1.03x). Departures it found: JAX's "
    "rounded normalised attention probs 12-19x, its bias gradients summed in bf16 3.6-7.2x, and torch's CPU "
    "LayerNorm backward, which sums the weight and bias gradients in bf16 (per thread), 1.6-4x with 2 threads "
    "(6.4x seen with one): reported, torch off. The floor, a quarter of one rounding (9.8e-4 in bf16), keeps "
    "ratios of errors far below one rounding (the loss, ~1e-6 relative; fp32 taps such as the attention probs) "
    "from counting."))


@dataclasses.dataclass
class PrecisionDiff:
  """One tensor of a bf16/fp16 diagnose: each side's error against its own fp32 run of the same step.

  Errors are relative: rms_err = rms(x - ref) / rms(ref) and max_err = max|x - ref| / max|ref| over the
  tensor (for 'update/' tensors ref - p0 replaces ref in the denominators: the error relative to the
  step the fp32 reference took). Keys of the dicts are the side names.

  Attributes:
    name, kind, shape: the tap.
    rms_err, max_err: side -> relative error (see above).
    ratio: the larger rms_err over the smaller (inf when the smaller is 0 and the larger is not).
    off: the side whose error breaks the rule, or None.
    note: why a tensor could not be measured (missing, shape), else ''.
    adam_residual: updates only: side -> max over elements of |p1 - first AdamW step from the side's own
      gradient| / allowed (`adamw_first_step`; allowed as the fp32 update rule without kappa); > 1 is off.
      Updates are judged by this, not by `ratio`: a first Adam step is ~lr·sign(g), so where rounding
      flips the sign of a small gradient element the update moves by 2 lr, and the ratio of two such
      counts is noise that the gradient check has already judged.
  """
  name: str
  kind: str
  shape: tuple[int, ...]
  rms_err: dict[str, float]
  max_err: dict[str, float]
  ratio: float
  off: str | None
  note: str = ""
  adam_residual: dict[str, float] = dataclasses.field(default_factory=dict)

  @property
  def passed(self) -> bool:
    return self.off is None and not self.note

  def to_json(self) -> dict:
    fin = lambda v: v if math.isfinite(v) else str(v)
    return {"name": self.name, "kind": self.kind, "shape": list(self.shape), "passed": self.passed,
            "rms_err": {k: fin(v) for k, v in self.rms_err.items()},
            "max_err": {k: fin(v) for k, v in self.max_err.items()}, "ratio": fin(self.ratio), "off": self.off,
            "adam_residual": {k: fin(v) for k, v in self.adam_residual.items()}, "note": self.note}


def precision_errors(x: np.ndarray, ref: np.ndarray, init: np.ndarray | None = None) -> tuple[float, float]:
  """(rms relative error, max relative error) of `x` against `ref` (see `PrecisionDiff`).

  Args:
    x: a side's reduced-precision value, float32.
    ref: the fp32 reference, same shape.
    init: for updates, the params before the step: errors are then relative to the reference's step ref - init.
  Returns:
    Both errors; inf where x is non-finite and ref is not; 0 when x equals ref, inf when ref's scale is 0 and
    x differs.
  """
  a, r = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  d = a - r
  if not np.all(np.isfinite(d)):
    return math.inf, math.inf
  base = r if init is None else r - np.asarray(init, np.float64)
  rms_d, max_d = float(np.sqrt(np.mean(d * d))) if d.size else 0.0, float(np.max(np.abs(d), initial=0.0))
  rms_b, max_b = float(np.sqrt(np.mean(base * base))) if base.size else 0.0, float(np.max(np.abs(base), initial=0.0))
  rel = lambda num, den: num / den if den > 0 else (0.0 if num == 0 else math.inf)
  return rel(rms_d, rms_b), rel(max_d, max_b)


def adamw_first_step(p0: np.ndarray, grad: np.ndarray, lr: float, train: TrainSpec, decay: bool,
                     clip_factor: float) -> np.ndarray:
  """The params after a first AdamW step from fresh moments, float64 (torch AdamW / optax adamw to rounding).

  With bias correction m_hat = g and v_hat = g², so p1 = p0 (1 - lr wd) - lr g / (|g| + eps) with g the
  clipped gradient (the decay only where `decay`). Used to judge bf16/fp16 updates against each side's own
  gradient.

  Args:
    p0: params before the step.
    grad: the pre-clip gradient (float32 values).
    lr: learning rate of the step.
    train: eps and weight_decay.
    decay: whether this tensor is decayed (`parity.weights.decays`).
    clip_factor: DeepSpeed's clip multiplier of the whole gradient.
  """
  g = np.asarray(grad, np.float64) * clip_factor
  p = np.asarray(p0, np.float64)
  return p * (1.0 - lr * train.weight_decay if decay else 1.0) - lr * g / (np.abs(g) + train.eps)


def compare_precision(spec: ModelSpec, train: TrainSpec, precision: str, sides: tuple[str, str],
                      low: Mapping[str, Mapping[str, np.ndarray]], ref: Mapping[str, Mapping[str, np.ndarray]],
                      init: Mapping[str, np.ndarray], lr: float,
                      rule: PrecisionRule = PRECISION_RULE) -> list[PrecisionDiff]:
  """Each side's bf16/fp16 error against its own fp32 run, tensor by tensor in `tap_order`.

  Forward taps, loss and gradients are flagged by `rule` (one side's rms error > factor x the other's and
  above the floor); updates by `PrecisionDiff.adam_residual` (each side's update against a first AdamW step
  from its own gradient).

  Args:
    spec: the model spec (names and order).
    train: the training spec (Adam eps, weight decay, clipping).
    precision: 'bf16' or 'fp16' (its unit roundoff sets the floor).
    sides: the two side names.
    low: side -> tap name -> the side's reduced-precision tensors.
    ref: side -> tap name -> the same side's fp32 tensors of the same step on the same weights.
    init: canonical params the step started from (the rounded master weights), for the update errors.
    lr: the update's learning rate.
    rule: the flagging rule.
  Returns:
    One PrecisionDiff per tap name; a tensor missing on any of the four runs gets a note and fails.
  """
  floor = rule.floor_u * UNIT_ROUNDOFF[precision]
  clip = {s: _clip_factor({n[5:]: v for n, v in low[s].items() if n.startswith("grad/")}, train.grad_clip)
          for s in sides}
  out = []
  for name in tap_order(spec):
    kind = _rule_kind(name)
    runs = [(s, d) for s in sides for d in (low[s], ref[s])]
    missing = [s for s, d in runs if name not in d]
    if missing:
      out.append(PrecisionDiff(name, kind, (), {}, {}, math.inf, None,
                               note=f"missing on {', '.join(sorted(set(missing)))}"))
      continue
    shapes = {tuple(np.shape(d[name])) for _, d in runs}
    if len(shapes) != 1:
      out.append(PrecisionDiff(name, kind, (), {}, {}, math.inf, None, note=f"shapes differ: {sorted(shapes)}"))
      continue
    p0 = init.get(name.split("/", 1)[1]) if kind == "update" else None
    rms, mx = {}, {}
    for s in sides:
      rms[s], mx[s] = precision_errors(low[s][name], ref[s][name], p0)
    (lo_side, lo), (hi_side, hi) = sorted(rms.items(), key=lambda kv: kv[1])
    if math.isinf(lo):
      ratio = 1.0
    else:
      ratio = hi / lo if lo > 0 else (1.0 if hi == 0 else math.inf)
    if kind != "update":
      off = hi_side if (hi > floor and (ratio > rule.factor or math.isinf(hi))) else None
      out.append(PrecisionDiff(name, kind, next(iter(shapes)), rms, mx, ratio, off))
      continue
    param = name.split("/", 1)[1]
    residual = {s: _adam_residual(low[s].get(f"grad/{param}"), low[s][name], p0, param, lr, train, clip[s])
                for s in sides}
    worst = max(sides, key=lambda s: residual[s])
    off = worst if residual[worst] > 1.0 else None
    out.append(PrecisionDiff(name, kind, next(iter(shapes)), rms, mx, ratio, off, adam_residual=residual))
  return out

def _adam_residual(g: np.ndarray | None, got: np.ndarray, p0: np.ndarray, param: str, lr: float, train: TrainSpec,
                   clip: float) -> float:
  """One side's update error against a first AdamW step from its own gradient `g`, as a fraction of the allowed
  error (RULES['update']: rtol of the distance moved + ulps of the fp32 weight); inf without a gradient or when the
  error is not finite."""
  if g is None:
    return math.inf
  upd = RULES["update"]
  want = adamw_first_step(p0, g, lr, train, weights.decays(param, train.decay_mask), clip)
  moved = float(np.max(np.abs(want - np.asarray(p0, np.float64)), initial=0.0))
  allowed = upd.rtol * moved + upd.ulps * float(np.finfo(np.float32).eps) * float(np.max(np.abs(p0), initial=0.0))
  with np.errstate(invalid="ignore"):
    err = float(np.max(np.abs(np.asarray(got, np.float64) - want), initial=0.0))
  if not math.isfinite(err):
    return math.inf
  return err / allowed if allowed > 0 else (0.0 if err == 0 else math.inf)
