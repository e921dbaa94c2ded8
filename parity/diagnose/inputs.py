"""`parity diagnose` inputs and outputs: tap names and order, planted bugs, the lr position, the worker
request and the workers' safetensors output. Numpy only."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from parity import weights

from parity.numerics import schedule
from parity.protocol.workers import DIAGNOSE_WORKERS  # noqa: F401  (re-exported: parity.diagnose's face)
from parity.spec import ModelSpec, RunSpec, SpecError, TrainSpec

# DIAGNOSE_WORKERS: side -> diagnose worker module (job 'diagnose' of the one registry, parity.protocol.workers).
# DeepSpeed runs the torch model; diagnose its arithmetic as `torch`.
PLANTS_KEY = "diagnose_plants"
"""request.json key: side -> {'no_causal_mask': bool, 'decay_all': bool, 'transpose': [names]}."""
REQUEST_KEY = "diagnose"
"""request.json key: {'step': batch index, 'lr_step': schedule position of the update}."""
OUTPUT_FILE = "diagnose.safetensors"
"""A worker's tensors in the run's precision."""
REFERENCE_FILE = "diagnose.fp32.safetensors"
"""bf16/fp16 runs only: the same worker's step in fp32 on the same (rounded) weights, the error reference."""
WHERE_METADATA_KEY = "parity_diagnose_where"
"""safetensors metadata key: JSON of tap name -> where the side computed it (Flax path / torch module)."""
INPUTS_METADATA_KEY = "parity_diagnose_inputs"
"""safetensors metadata key: `side_inputs` of the request the tensors were computed from (for reuse)."""
PLANT_KINDS = ("no_causal_mask", "transpose=<canonical square weight>", "decay_all")


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
                  inputs: str = "", file: str = OUTPUT_FILE) -> Path:
  """Writes a worker's tensors (float32, contiguous) with its `where` map and `side_inputs`.

  Args:
    out_dir: the side's folder.
    tensors: canonical tap name -> array.
    where: tap name -> where the side computed it.
    inputs: `side_inputs` of the request (for reuse).
    file: OUTPUT_FILE (the run's precision) or REFERENCE_FILE (the fp32 reference of a bf16/fp16 run).
  """
  from safetensors.numpy import save_file
  path = Path(out_dir) / file
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


