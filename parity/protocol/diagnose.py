"""The worker end of `parity diagnose`: the request a diagnose worker reads, the files it writes, and the one
diagnose loop (`run_diagnose(io, side)`) over a side's `DiagnoseSide`.

Files: run_dir/<side>/diagnose.safetensors (OUTPUT_FILE, the run's precision) and, for bf16/fp16 runs,
diagnose.fp32.safetensors (REFERENCE_FILE): float32 tensors keyed by canonical tap names (`tap_order`), with the
side's `where` map and `side_inputs` in the metadata. The driver (`parity.diagnose`) writes the request and reads
the files; the workers (`jax_impl.diagnose`, `torch_impl.diagnose`) import only this module, not the driver.
Numpy only: imports neither jax nor torch.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping, Protocol, runtime_checkable

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from parity import weights
from parity.protocol.layout import PLANT_KEYS
from parity.protocol.side import ExampleArrays, SideIO
from parity.spec import ModelSpec, RunSpec, SpecError

__all__ = ["PLANTS_KEY", "REQUEST_KEY", "OUTPUT_FILE", "REFERENCE_FILE", "WHERE_METADATA_KEY", "INPUTS_METADATA_KEY",
           "forward_taps", "param_order", "tap_order", "apply_weight_plants", "check_plan", "WorkerRequest",
           "read_request", "side_inputs", "write_outputs", "read_outputs", "output_metadata", "DiagnoseStep",
           "DiagnoseSide", "run_diagnose", "example_arrays"]

PLANTS_KEY = "diagnose_plants"
"""request.json key: side -> {'no_causal_mask': bool, 'decay_all': bool, 'transpose': [names], 'offset': [names]}."""
PLANT_OFFSET = 0.05
"""Added to each element of an `offset=NAME` plant's tensor (parity.diagnose.inputs.OFFSET is this value)."""
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


def forward_taps(spec: ModelSpec) -> list[str]:
  """Canonical forward tap names in execution order (see the module docstring). The model-family blocks add, where the
  spec has them: `attn.ln_q` / `attn.ln_k` (qk_norm: q/k after their norm, before rotary, (B, heads, T, hd)),
  `attn.scores_capped` (attn_softcap: the soft-capped scores, before the mask), `ln_1_post` / `ln_2_post`
  (post_norms: each branch's normed output, before its residual add) and `logits_capped` (final_softcap)."""
  out = ["embed"]
  mlp = ["mlp.fc"] if spec.mlp == "gelu" else ["mlp.gate", "mlp.up"]
  qk = ["attn.ln_q", "attn.ln_k"] if spec.qk_norm else []
  capped = ["attn.scores_capped"] if spec.attn_softcap is not None else []
  post_1, post_2 = (["ln_1_post"], ["ln_2_post"]) if spec.post_norms else ([], [])
  for i in range(spec.n_layers):
    out += [f"h.{i}.{t}" for t in ("ln_1", *qk, "attn.q", "attn.k", "attn.v", "attn.scores", *capped, "attn.probs",
                                   "attn.context", "attn.out", *post_1, "resid_mid", "ln_2", *mlp, "mlp.act",
                                   "mlp.out", *post_2, "out")]
  return out + ["ln_f", "logits"] + (["logits_capped"] if spec.final_softcap is not None else [])


def param_order(spec: ModelSpec) -> list[str]:
  """Canonical param names in backward order: reverse of param_shapes (head, ln_f, last layer ... wte)."""
  return list(reversed(weights.param_shapes(spec)))


def tap_order(spec: ModelSpec) -> list[str]:
  """Every tensor a diagnose worker writes, in comparison order: forward, loss, grads, updates."""
  params = param_order(spec)
  return forward_taps(spec) + ["loss"] + [f"grad/{n}" for n in params] + [f"update/{n}" for n in params]


def apply_weight_plants(params: Mapping[str, np.ndarray], plants: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """The canonical weights with this side's `transpose` and `offset` plants applied (a copy; float32; an offset adds
  parity.diagnose.inputs.OFFSET, 0.05, to every element)."""
  out = dict(params)
  for name in plants.get("transpose", ()):
    out[name] = np.ascontiguousarray(np.asarray(params[name]).T)
  for name in plants.get("offset", ()):
    out[name] = (np.asarray(out[name], dtype=np.float32) + np.float32(PLANT_OFFSET)).astype(np.float32)
  return out


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
  """What a diagnose worker reads from the request (besides SideIO's run and weights). data_plants: the side's
  planted data bugs (request 'perturb', parity.protocol.layout.PLANT_KEYS; `SideIO.plants`), applied as its
  training step applies them."""
  step: int
  lr_step: int
  plants: dict[str, Any]
  data_plants: frozenset = frozenset()


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
  perturb = (request.get("perturb") or {}).get(side) or {}
  return WorkerRequest(step=int(d["step"]), lr_step=int(d["lr_step"]),
                       plants={"no_causal_mask": bool(plants.get("no_causal_mask", False)),
                               "decay_all": bool(plants.get("decay_all", False)),
                               "transpose": list(plants.get("transpose", [])),
                               "offset": list(plants.get("offset", []))},
                       data_plants=frozenset(k for k in PLANT_KEYS if perturb.get(k)))


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
  path = Path(out_dir) / file
  save_file({k: np.ascontiguousarray(np.asarray(v, dtype=np.float32)) for k, v in tensors.items()}, str(path),
            metadata={WHERE_METADATA_KEY: json.dumps(dict(where)), INPUTS_METADATA_KEY: inputs})
  return path


def read_outputs(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
  """A worker's file (`write_outputs`): (tap name -> float32 array, tap name -> where the side computed it)."""
  return load_file(str(path)), json.loads(output_metadata(path).get(WHERE_METADATA_KEY, "{}"))


def output_metadata(path: Path) -> dict[str, str]:
  """The safetensors metadata of a worker's file (WHERE_METADATA_KEY, INPUTS_METADATA_KEY)."""
  with safe_open(str(path), framework="numpy") as f:
    return f.metadata() or {}


@dataclasses.dataclass
class DiagnoseStep:
  """One diagnosed step of a side.

  Attributes:
    tensors: canonical tap name -> float32 numpy array (every name of `tap_order`).
    where: tap name -> where the side computed it (a Flax path, a torch module).
    lr: the learning rate the update applied.
    loss: the step's loss (mean over its micro batches, nats), as the side reports it.
  """
  tensors: dict[str, np.ndarray]
  where: dict[str, str]
  lr: float
  loss: float


@runtime_checkable
class DiagnoseSide(Protocol):
  """What a side provides to `run_diagnose` (`jax_impl.diagnose.JaxDiagnose`, `torch_impl.diagnose.TorchDiagnose`)."""

  def check(self, io: SideIO) -> None:
    """Refuses what this side cannot diagnose (a plan, a side name), before anything is computed."""

  def one_step(self, run: RunSpec, params: dict[str, np.ndarray], req: WorkerRequest, batch: np.ndarray,
               arrays: ExampleArrays | None = None) -> DiagnoseStep:
    """One step in `run.train.precision` from canonical float32 `params` (this side's plants applied; bf16/fp16:
    the side rounds its masters with `parity.weights.master_weights`, which leaves fp32 unchanged) on `batch`
    (A, M, T + 1) token ids, from a fresh optimizer state at schedule position `req.lr_step`. arrays: padded/packed
    only, the step's ExampleArrays (A, M, T; weights A * w, `example_arrays`), given to the model and loss as the
    training step gives them, with `req.data_plants`.

    Raises:
      RuntimeError: fp16, the gradient overflowed at the initial loss scale (the update would be skipped).
    """

  def versions(self) -> dict[str, str]:
    """Framework -> version string."""

  def device(self) -> str:
    """Where the side computed, in words."""


def example_arrays(io: SideIO, batches_shape: tuple[int, ...], step: int) -> ExampleArrays | None:
  """Step `step`'s ExampleArrays of a padded/packed run (None on stream), weights A * w: one process, so the
  factor of every side (`Side.loss_weight_factor`: A on JAX, A * W on torch) is A (W = 1)."""
  train, _ = io.example_arrays(float(io.run.train.grad_accum_steps), batches_shape, None)
  return None if train is None else train.at(step)


def run_diagnose(io: SideIO, side: DiagnoseSide) -> int:
  """Writes this side's diagnose tensors (and, in bf16/fp16, the same step in fp32 from the same rounded master
  weights: the error reference) and its summary; returns the exit code (0).

  Raises:
    ValueError: the request has no diagnose section; whatever `side.check` / `side.one_step` raise.
  """
  side.check(io)
  req = read_request(io.request, io.side)
  run = io.run
  params = apply_weight_plants(io.init_params(), req.plants)
  batches = io.batches()
  batch = np.ascontiguousarray(batches[req.step])  # (A, M, T + 1)
  arrays = example_arrays(io, batches.shape, req.step)
  io.ready()
  main = side.one_step(run, params, req, batch, arrays)
  inputs = side_inputs(io.request, io.side)
  write_outputs(io.out, main.tensors, main.where, inputs)
  precision = run.train.precision
  if precision != "fp32":
    fp32 = dataclasses.replace(run, train=dataclasses.replace(run.train, precision="fp32"))
    ref = side.one_step(fp32, weights.master_weights(params, precision), req, batch, arrays)
    write_outputs(io.out, ref.tensors, ref.where, inputs, file=REFERENCE_FILE)
  io.finish("ok", versions=side.versions(), device=side.device(),
            extra={"diagnose": {"step": req.step, "lr_step": req.lr_step, "lr": main.lr, "loss": main.loss,
                                "precision": precision, "plants": req.plants,
                                "data_plants": sorted(req.data_plants), "tensors": len(main.tensors)}})
  return 0
