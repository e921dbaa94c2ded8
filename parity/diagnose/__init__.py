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

Layout: `parity.diagnose.inputs` (tap names and order, plants, lr position, the worker request and the
workers' output files), `parity.diagnose.compare` (the per-kind rules and the tensor comparison), and here
the driver `diagnose` with its result.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from parity import schedule, weights
from parity.diagnose.compare import RULES, Rule, TensorDiff, compare_outputs, compare_tensor  # noqa: F401
from parity.diagnose.inputs import (  # noqa: F401
    DIAGNOSE_WORKERS, INPUTS_METADATA_KEY, OUTPUT_FILE, PLANT_KINDS, PLANTS_KEY, REQUEST_KEY, WHERE_METADATA_KEY,
    WorkerRequest, _metadata, _read_outputs, apply_weight_plants, check_plan, forward_taps, lr_position, param_order,
    parse_plants, read_request, side_inputs, tap_order, write_outputs)
from parity.protocol import DEBUG_KEYS
from parity.spec import RunSpec, SpecError
from parity.tolerances import tolerance

__all__ = ["Rule", "RULES", "TensorDiff", "DiagnoseResult", "diagnose", "tap_order", "forward_taps",
           "param_order", "parse_plants", "apply_weight_plants", "lr_position", "compare_tensor",
           "compare_outputs", "check_plan", "side_inputs", "DIAGNOSE_WORKERS", "PLANTS_KEY", "REQUEST_KEY", "OUTPUT_FILE",
           "PLANT_KINDS", "read_request", "write_outputs"]

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

