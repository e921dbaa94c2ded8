"""`parity diagnose` comparison: the per-kind tolerance rules and the tensor-by-tensor comparison. Numpy only."""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import numpy as np

from parity import weights
from parity.diagnose.inputs import tap_order
from parity.spec import ModelSpec, TrainSpec
from parity.tolerances import tolerance

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
        "The step's loss, nats: the bound of parity.tolerances fp32 'loss' (matched stacks agree to <= 4.3e-6 "
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
        "(parity.tolerances 'params_zero_grad'). Matched worst |Δ| / allowed: 0.02 (gpt2-tiny), 0.083 "
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
  return TensorDiff(name, kind, tuple(a.shape), max_abs, rel, scale, float(allowed.reshape(-1)[flat]) if a.size else 0.0,
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


