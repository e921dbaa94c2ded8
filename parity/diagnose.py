"""`parity diagnose`: the first tensor where two sides differ, for one step on identical inputs.

Both sides get the same canonical initial weights and the same batch (`batches.npy[step]`, all micro
batches). Each side's diagnose worker (`jax_impl.diagnose`, `torch_impl.diagnose`) writes
`run_dir/<side>/diagnose.safetensors`: float32 tensors keyed by canonical tap names (`tap_order`):

  forward (first micro batch)  embed, h.{i}.ln_1, h.{i}.attn.{q,k,v,scores,probs,context,out},
                               h.{i}.resid_mid, h.{i}.ln_2, h.{i}.mlp.{fc | gate,up}, h.{i}.mlp.{act,out},
                               h.{i}.out, ln_f, logits
  loss                         the step's loss (mean over its micro batches), shape ()
  grad/<param>                 the accumulated pre-clip gradient (DeepSpeed style: sum of grad(loss_i / A))
  update/<param>               the param after one step of the side's real optimizer

Gradients and updates are in backward order (the reverse of parity.weights.param_shapes: the head and
ln_f first, embeddings last). This module compares the files in that order and names the first tensor
that breaks its rule (`RULES`). It imports neither jax nor torch.

The update. A step's optimizer state is fresh on both sides (Adam moments zero, bias correction of a
first step), so any step is diagnosed on identical state; `step` picks the batch and the learning-rate
position. The lr is DeepSpeed's schedule at that position (`parity.schedule.train_lr`); when it is 0
there (WarmupCosineLR gives 0 at steps 0 and 1) the position moves to the first later step with lr > 0,
recorded as `lr_step` (gpt2-tiny: step 2, lr 3.3e-4). An lr of 0 would make every update the identity
and hide optimizer bugs such as a wrong decay mask.

Planted bugs for testing the tool (`--plant SIDE:KIND`, request key `diagnose_plants`): `no_causal_mask`,
`transpose=<canonical square weight>` (transposed when that side loads it), `decay_all` (weight decay
on every tensor, norms and biases included). Numeric settings go through `--perturb` as in compare.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from parity import schedule, weights
from parity.protocol import DEBUG_KEYS
from parity.spec import ModelSpec, RunSpec, SpecError, TrainSpec
from parity.tolerances import tolerance

__all__ = ["Rule", "RULES", "TensorDiff", "DiagnoseResult", "diagnose", "tap_order", "forward_taps",
           "param_order", "parse_plants", "apply_weight_plants", "lr_position", "compare_tensor",
           "compare_outputs", "check_plan", "side_inputs", "DIAGNOSE_WORKERS", "PLANTS_KEY", "REQUEST_KEY", "OUTPUT_FILE",
           "PLANT_KINDS", "read_request", "write_outputs"]

DIAGNOSE_WORKERS = {"jax": "jax_impl.diagnose", "torch": "torch_impl.diagnose"}
"""Side -> diagnose worker module. DeepSpeed runs the torch model; diagnose its arithmetic as `torch`."""
PLANTS_KEY = "diagnose_plants"
"""request.json key: side -> {'no_causal_mask': bool, 'decay_all': bool, 'transpose': [names]}."""
REQUEST_KEY = "diagnose"
"""request.json key: {'step': batch index, 'lr_step': schedule position of the update}."""
OUTPUT_FILE = "diagnose.safetensors"
WHERE_METADATA_KEY = "parity_diagnose_where"
"""safetensors metadata key: JSON of tap name -> where the side computed it (Flax path / torch module)."""
INPUTS_METADATA_KEY = "parity_diagnose_inputs"
"""safetensors metadata key: `side_inputs` of the request the tensors were computed from (for reuse)."""
PLANT_KINDS = ("no_causal_mask", "transpose=<canonical square weight>", "decay_all")


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


# ----------------------------------------------------------------------------- names and order


def forward_taps(spec: ModelSpec) -> list[str]:
  """Canonical forward tap names in execution order (see the module docstring)."""
  out = ["embed"]
  mlp = ["mlp.fc"] if spec.mlp == "gelu" else ["mlp.gate", "mlp.up"]
  for i in range(spec.n_layers):
    out += [f"h.{i}.{t}" for t in ("ln_1", "attn.q", "attn.k", "attn.v", "attn.scores", "attn.probs",
                                   "attn.context", "attn.out", "resid_mid", "ln_2", *mlp, "mlp.act",
                                   "mlp.out", "out")]
  return out + ["ln_f", "logits"]


def param_order(spec: ModelSpec) -> list[str]:
  """Canonical param names in backward order: reverse of param_shapes (head, ln_f, last layer ... wte)."""
  return list(reversed(weights.param_shapes(spec)))


def tap_order(spec: ModelSpec) -> list[str]:
  """Every tensor a diagnose worker writes, in comparison order: forward, loss, grads, updates."""
  params = param_order(spec)
  return forward_taps(spec) + ["loss"] + [f"grad/{n}" for n in params] + [f"update/{n}" for n in params]


# ----------------------------------------------------------------------------- plants


def parse_plants(items: Sequence[str], sides: Sequence[str], spec: ModelSpec) -> dict[str, dict[str, Any]]:
  """Parses `--plant SIDE:KIND` items (planted bugs for testing diagnose itself).

  Kinds: `no_causal_mask`; `transpose=NAME` (a square canonical weight, transposed when loaded);
  `decay_all` (AdamW decay on every tensor).
  Returns:
    side -> {'no_causal_mask': bool, 'decay_all': bool, 'transpose': [names]} for sides with plants.
  Raises:
    SpecError: malformed item, a side not run, an unknown kind, or a name that is not a square weight.
  """
  out: dict[str, dict[str, Any]] = {}
  shapes = weights.param_shapes(spec)
  for item in items:
    side, sep, kind = item.partition(":")
    if not sep or not kind:
      raise SpecError(f"--plant {item!r} must look like SIDE:KIND, e.g. jax:no_causal_mask; kinds: "
                      f"{', '.join(PLANT_KINDS)}")
    if side not in sides:
      raise SpecError(f"--plant {item!r}: side {side!r} is not among the sides run ({', '.join(sides)})")
    p = out.setdefault(side, {"no_causal_mask": False, "decay_all": False, "transpose": []})
    key, eq, value = kind.partition("=")
    if key in ("no_causal_mask", "decay_all") and not eq:
      p[key] = True
    elif key == "transpose" and eq:
      if value not in shapes:
        raise SpecError(f"--plant {item!r}: {value!r} is not a canonical parameter of this model; e.g. "
                        f"h.0.attn.proj.weight")
      shape = shapes[value]
      if len(shape) != 2 or shape[0] != shape[1]:
        raise SpecError(f"--plant {item!r}: {value} has shape {shape}; only a square weight can be transposed "
                        "in place (e.g. h.0.attn.proj.weight)")
      p["transpose"].append(value)
    else:
      raise SpecError(f"--plant {item!r}: unknown plant {kind!r}; use one of {', '.join(PLANT_KINDS)}")
  return out


def apply_weight_plants(params: Mapping[str, np.ndarray], plants: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """The canonical weights with this side's `transpose` plants applied (a copy; float32)."""
  out = dict(params)
  for name in plants.get("transpose", ()):
    out[name] = np.ascontiguousarray(np.asarray(params[name]).T)
  return out


# ----------------------------------------------------------------------------- step and lr


def lr_position(train: TrainSpec, step: int) -> tuple[int, float]:
  """(schedule position, lr) of the diagnosed update: `step`, or the first later step with lr > 0.

  Raises:
    SpecError: step is outside [0, train.steps), or the lr is 0 from `step` to the end of the run.
  """
  if not 0 <= step < train.steps:
    raise SpecError(f"--step {step}: the run has train.steps={train.steps} (steps 0..{train.steps - 1})")
  for k in range(step, train.steps):
    lr = schedule.train_lr(train, k)
    if lr > 0:
      return k, float(lr)
  raise SpecError(f"--step {step}: the learning rate is 0 at every step from {step} to {train.steps - 1}; "
                  "an update would be the identity. Pick an earlier step or a schedule with lr > 0")


def check_plan(run: RunSpec) -> None:
  """Diagnose taps need unrolled layers and no remat on the JAX side.

  Raises:
    SpecError: naming jax.scan_layers or jax.remat.
  """
  if run.jax.scan_layers:
    raise SpecError("parity diagnose needs jax.scan_layers=false (the taps are recorded per block module); "
                    "the plan does not change the arithmetic, so diagnose the unrolled model")
  if run.jax.remat != "none":
    raise SpecError(f"parity diagnose needs jax.remat=none; got {run.jax.remat!r} (remat recomputes the same "
                    "arithmetic, so diagnose without it)")


@dataclasses.dataclass(frozen=True)
class WorkerRequest:
  """What a diagnose worker reads from the request (besides SideIO's run and weights)."""
  step: int
  lr_step: int
  plants: dict[str, Any]


def read_request(request: Mapping[str, Any], side: str) -> WorkerRequest:
  """The diagnose part of a request.json, for one side.

  Raises:
    ValueError: the request has no `diagnose` section (not written by `parity diagnose`).
  """
  d = request.get(REQUEST_KEY)
  if not isinstance(d, Mapping) or "step" not in d or "lr_step" not in d:
    raise ValueError(f"request.json has no valid {REQUEST_KEY!r} section ({{'step': N, 'lr_step': K}}); "
                     "a diagnose worker runs only in a folder prepared by `parity diagnose`")
  plants = dict(request.get(PLANTS_KEY, {}).get(side, {}))
  return WorkerRequest(step=int(d["step"]), lr_step=int(d["lr_step"]),
                       plants={"no_causal_mask": bool(plants.get("no_causal_mask", False)),
                               "decay_all": bool(plants.get("decay_all", False)),
                               "transpose": list(plants.get("transpose", []))})


def side_inputs(request: Mapping[str, Any], side: str) -> str:
  """Canonical JSON of everything in a request that determines one side's diagnose tensors.

  The run (config hash), the step and lr position, and this side's perturb and plants; the shared
  files (init.safetensors, batches.npy) are fixed by the config hash. Equal strings mean a side's
  earlier output can be reused (`diagnose(..., reuse=True)`).
  """
  d = request.get(REQUEST_KEY, {})
  return json.dumps({"config_hash": request.get("config_hash"), "step": d.get("step"), "lr_step": d.get("lr_step"),
                     "perturb": request.get("perturb", {}).get(side, {}),
                     "plants": request.get(PLANTS_KEY, {}).get(side, {})}, sort_keys=True)


def write_outputs(out_dir: str | Path, tensors: Mapping[str, np.ndarray], where: Mapping[str, str],
                  inputs: str = "") -> Path:
  """Writes a worker's diagnose.safetensors (float32, contiguous) with its `where` map and `side_inputs`."""
  from safetensors.numpy import save_file
  path = Path(out_dir) / OUTPUT_FILE
  save_file({k: np.ascontiguousarray(np.asarray(v, dtype=np.float32)) for k, v in tensors.items()}, str(path),
            metadata={WHERE_METADATA_KEY: json.dumps(dict(where)), INPUTS_METADATA_KEY: inputs})
  return path


def _read_outputs(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
  from safetensors.numpy import load_file
  return load_file(str(path)), json.loads(_metadata(path).get(WHERE_METADATA_KEY, "{}"))


def _metadata(path: Path) -> dict[str, str]:
  from safetensors import safe_open
  with safe_open(str(path), framework="numpy") as f:
    return f.metadata() or {}


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


# ----------------------------------------------------------------------------- result


@dataclasses.dataclass
class DiagnoseResult:
  """The outcome of `diagnose`.

  Attributes:
    run_dir: the folder holding request.json, the sides' outputs, diagnose.json and diagnose.md.
    sides: (reference, candidate).
    step: the batch diagnosed (batches.npy[step]).
    lr_step, lr: schedule position and learning rate of the update (see the module docstring).
    tensors: every TensorDiff, in comparison order.
    first: the first tensor that broke its rule, or None.
    side_status: side -> worker status ('ok', 'crashed', ...), with `side_errors` for failures.
    message: one line for humans.
  """
  run_dir: Path
  sides: tuple[str, str]
  step: int
  lr_step: int
  lr: float
  tensors: list[TensorDiff]
  first: TensorDiff | None
  side_status: dict[str, str]
  side_errors: dict[str, str | None]
  message: str
  plants: dict[str, Any] = dataclasses.field(default_factory=dict)
  perturb: dict[str, Any] = dataclasses.field(default_factory=dict)
  wall_s: float = 0.0

  @property
  def passed(self) -> bool:
    return self.first is None and all(s == "ok" for s in self.side_status.values())

  @property
  def exit_code(self) -> int:
    return 0 if self.passed else 1

  def to_json(self) -> dict:
    return {"schema": "parity.diagnose/1", "passed": self.passed, "message": self.message,
            "sides": list(self.sides), "step": self.step, "lr_step": self.lr_step, "lr": self.lr,
            "first": None if self.first is None else self.first.to_json(),
            "side_status": self.side_status, "side_errors": self.side_errors, "plants": self.plants,
            "perturb": self.perturb, "wall_s": self.wall_s,
            "rules": {k: dataclasses.asdict(r) for k, r in RULES.items()},
            "tensors": [t.to_json() for t in self.tensors]}

  def to_markdown(self) -> str:
    a, b = self.sides
    lines = [f"# parity diagnose: {a} vs {b}, step {self.step}", "",
             f"**{'PASS' if self.passed else 'FAIL'}**: {self.message}", "",
             f"Update at schedule position {self.lr_step} (lr {self.lr:.3g}); fresh optimizer state on both sides.",
             ""]
    if self.first is not None:
      f = self.first
      lines += ["## First tensor over tolerance", "", f"- tensor: `{f.name}` ({f.kind}, shape {list(f.shape)})"]
      lines += [f"- {side}: `{w}`" for side, w in f.where.items()]
      lines += [f"- max abs error {f.max_abs_err:.3g}, max rel error {f.max_rel_err:.3g} (scale {f.scale:.3g})",
                f"- worst element {f.worst_index}: {a} {f.ref_value}, {b} {f.cand_value}, |Δ| {f.worst_abs_err:.3g} "
                f"> tolerance {f.tolerance:.3g}"]
      if f.note:
        lines.append(f"- {f.note}")
      lines.append("")
    kinds: dict[str, list[TensorDiff]] = {}
    for t in self.tensors:
      kinds.setdefault(t.kind, []).append(t)
    lines += ["## Worst relative error by kind", "", "| kind | tensors | failing | worst tensor | max rel err | rtol |",
              "|---|---|---|---|---|---|"]
    for kind, ts in kinds.items():
      w = max(ts, key=lambda t: t.max_rel_err if math.isfinite(t.max_rel_err) else math.inf)
      lines.append(f"| {kind} | {len(ts)} | {sum(not t.passed for t in ts)} | `{w.name}` | {w.max_rel_err:.3g} | "
                   f"{RULES[kind].rtol:g} |")
    lines += ["", "Rule: |Δ| <= atol + rtol · scale (scale = max|reference|; for updates elementwise: rtol · distance "
              "moved + 4 float32 ulps + lr · kappa). Reasons: diagnose.json `rules`; docs/diagnose.md.", ""]
    return "\n".join(lines)


def _first_message(first: TensorDiff, sides: tuple[str, str]) -> str:
  where = "; ".join(f"{s}: {w}" for s, w in first.where.items())
  at = f" at {list(first.worst_index)}" if first.worst_index is not None else ""
  vals = f" ({sides[0]} {first.ref_value:.6g}, {sides[1]} {first.cand_value:.6g})" if first.ref_value is not None \
      and first.cand_value is not None else ""
  return (f"first difference at {first.name} [{where}]: max abs error {first.max_abs_err:.3g}, max rel error "
          f"{first.max_rel_err:.3g}; worst element{at}: |Δ| {first.worst_abs_err:.3g} > tolerance "
          f"{first.tolerance:.3g}{vals}"
          + (f"; {first.note}" if first.note else ""))


def diagnose(preset: str | None = None, *, config: str | Path | Mapping | None = None, overrides: Sequence[str] = (),
             hf_model: str | Path | None = None, step: int = 0, sides: Sequence[str] = ("jax", "torch"),
             perturb: Sequence[str] = (), plants: Sequence[str] = (), out: str | Path | None = None,
             timeout_s: float = 600.0, run_dir: str | Path | None = None, reuse: bool = False) -> DiagnoseResult:
  """Runs both sides' diagnose workers on one step and finds the first tensor that differs.

  Args:
    preset, config, overrides, hf_model: the run, as for `parity.compare`.
    step: which batch (batches.npy[step]) and schedule position to diagnose (0-based).
    sides: (reference, candidate), each 'jax' or 'torch'.
    perturb: `side:key=value` numeric changes of one side (parity.run.parse_perturb).
    plants: `side:kind` planted bugs (`parse_plants`).
    out: the output folder (default runs/<time>-diagnose-<hash>).
    timeout_s: per-side wall-clock limit, seconds.
    run_dir: reuse a folder already prepared by an earlier `diagnose` (its weights and batches); the
      request's perturb/plant keys are rewritten for this call. Overrides preset/config/out.
    reuse: with run_dir, do not rerun a side whose diagnose.safetensors was computed from the same
      inputs (`side_inputs`: run, step, that side's perturb and plants); e.g. after a matched run, a
      plant on one side reruns only that side.
  Returns:
    DiagnoseResult (also written as diagnose.json and diagnose.md in the folder).
  Raises:
    SpecError: bad input (unknown side, key, plant, step out of range, unsupported plan).
  """
  from harness.runner import run_side  # harness depends on parity, not the reverse
  from parity.run import default_run_dir, parse_perturb, prepare_run_dir, resolve

  t0 = time.time()
  sides = tuple(sides)
  if len(sides) != 2 or len(set(sides)) != 2 or not all(s in DIAGNOSE_WORKERS for s in sides):
    raise SpecError(f"--sides {','.join(sides)}: diagnose compares two different sides among "
                    f"{', '.join(DIAGNOSE_WORKERS)} (DeepSpeed runs the torch model: diagnose it as 'torch')")
  if run_dir is not None:
    folder = Path(run_dir)
    req_path = folder / "request.json"
    if not req_path.exists():
      raise SpecError(f"{req_path} does not exist: pass a folder prepared by `parity diagnose`")
    request = json.loads(req_path.read_text())
    from parity.spec import from_dict
    spec = from_dict(RunSpec, request["run"])
  else:
    spec = resolve(preset, config=config, overrides=overrides, sides=sides)
    if hf_model is not None:
      from parity import convert, hf
      try:
        spec, init_given = hf.run_spec_from_hf(hf_model, spec, bin_reader=convert.read_bin)
      except (ValueError, FileNotFoundError) as exc:
        raise SpecError(f"--hf-model {hf_model}: {exc}") from None
    else:
      init_given = None
    folder = Path(out) if out is not None else default_run_dir(spec, "diagnose")
  check_plan(spec)
  if spec.train.precision != "fp32":
    raise SpecError(f"parity diagnose compares fp32 arithmetic; got train.precision={spec.train.precision!r} "
                    "(bf16 differs everywhere by design: see NUMERICS.md)")
  if spec.train.steps <= step or step < 0:
    raise SpecError(f"--step {step}: the run has train.steps={spec.train.steps} (steps 0..{spec.train.steps - 1})")
  if reuse and run_dir is None:
    raise SpecError("reuse=True needs run_dir: a folder prepared by an earlier diagnose")
  lr_step, lr = lr_position(spec.train, step)
  pert = parse_perturb(list(perturb), sides)
  for side, kv in pert.items():
    for key, value in kv.items():
      if key in DEBUG_KEYS:
        raise SpecError(f"--perturb {side}:{key}: fault injections are for `parity compare`; diagnose runs one "
                        "step (plant a model bug with --plant instead)")
      if key == "train.precision" and value != "fp32":
        raise SpecError(f"--perturb {side}:train.precision={value!r}: parity diagnose compares fp32 steps only")
  plant_map = parse_plants(list(plants), sides, spec.model)
  if run_dir is None:
    prepare_run_dir(spec, folder, perturb=pert, init_params=init_given)
  request = json.loads((folder / "request.json").read_text())
  request["perturb"] = pert
  request[REQUEST_KEY] = {"step": step, "lr_step": lr_step}
  request[PLANTS_KEY] = plant_map
  (folder / "request.json").write_text(json.dumps(request, indent=2))

  status, errors, outputs, where = {}, {}, {}, {}
  for side in sides:
    path = folder / side / OUTPUT_FILE
    if reuse and path.exists() and _metadata(path).get(INPUTS_METADATA_KEY) == side_inputs(request, side):
      status[side], errors[side] = "ok", None
      outputs[side], where[side] = _read_outputs(path)
      continue
    path.unlink(missing_ok=True)
    sr = run_side(folder, side, timeout_s=timeout_s, module=DIAGNOSE_WORKERS[side])
    status[side], errors[side] = sr.status, sr.error
    if sr.status == "ok" and path.exists():
      outputs[side], where[side] = _read_outputs(path)
    elif sr.status == "ok":
      status[side], errors[side] = "crashed", f"worker finished without writing {path}"
  tensors, first = [], None
  a, b = sides
  if len(outputs) == 2:
    init = weights.load(folder / "init.safetensors")
    tensors = compare_outputs(spec.model, spec.train, outputs[a], outputs[b], init, lr)
    for t in tensors:
      t.where = {s: where[s].get(t.name, "?") for s in sides}
    first = next((t for t in tensors if not t.passed), None)
  bad = {s: st for s, st in status.items() if st != "ok"}
  if bad:
    message = "side(s) did not finish: " + "; ".join(f"{s} ({st}): {(errors[s] or '')[-600:]}" for s, st in bad.items())
  elif first is None:
    message = f"no tensor breaks tolerance: {len(tensors)} tensors of {a} and {b} agree (step {step})"
  else:
    message = _first_message(first, sides)
  result = DiagnoseResult(run_dir=folder, sides=(a, b), step=step, lr_step=lr_step, lr=lr, tensors=tensors,
                          first=first, side_status=status, side_errors=errors, message=message, plants=plant_map,
                          perturb=pert, wall_s=time.time() - t0)
  (folder / "diagnose.json").write_text(json.dumps(result.to_json(), indent=2))
  (folder / "diagnose.md").write_text(result.to_markdown())
  return result
