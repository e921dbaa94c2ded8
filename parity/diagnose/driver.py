"""The `parity diagnose` driver: prepare (or reuse) the folder, run both sides' diagnose workers, compare their
tensors in order and write diagnose.json / diagnose.md. The method is described in `parity.diagnose`."""
from __future__ import annotations

import dataclasses
import json
import shutil
import math
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from harness import lifetime, runner
from parity import weights
from parity.diagnose.compare import (PRECISION_RULE, RULES, UNIT_ROUNDOFF, PrecisionDiff, TensorDiff, compare_outputs,
                                     compare_precision)
from parity.diagnose.inputs import lr_position, parse_plants
from parity.protocol.diagnose import (INPUTS_METADATA_KEY, OUTPUT_FILE, PLANTS_KEY, REFERENCE_FILE, REQUEST_KEY,
                                      check_plan, output_metadata, read_outputs, side_inputs)
from parity.protocol.layout import DEBUG_KEYS, PLANT_KEYS
from parity.protocol.workers import DIAGNOSE_WORKERS
from parity.inputs import load_json
from parity.pipeline.folder import default_run_dir, parse_perturb, prepare_run_dir
from parity.pipeline.perturb import plan_perturbations  # the fields each side applies (tied ones included)
from parity.pipeline.resolve import check_fsdp_overrides_are_read, resolve_run
from parity.sizing.resources import check_resources
from parity.spec import RunSpec, SpecError, from_dict

__all__ = ["DiagnoseResult", "diagnose"]

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
    precision: train.precision of the run. In bf16/fp16 `tensors` compares the two sides' fp32 runs of the
      step (on the rounded master weights) with `RULES`, and `precision_tensors` holds each side's
      reduced-precision error against its own fp32 run (`PRECISION_RULE`); `first` is the first fp32
      difference if there is one, else the first tensor where one side's error is off (`first_precision`).
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
  precision: str = "fp32"
  precision_tensors: list[PrecisionDiff] = dataclasses.field(default_factory=list)
  first_precision: PrecisionDiff | None = None

  @property
  def passed(self) -> bool:
    return self.first is None and all(s == "ok" for s in self.side_status.values())

  @property
  def exit_code(self) -> int:
    return 0 if self.passed else 1

  def to_json(self) -> dict:
    """The result as diagnose.json's data (schema parity.diagnose/1): verdict, first differing tensor, per-tensor
    rows, side status, plants and perturbations."""
    return {"schema": "parity.diagnose/1", "passed": self.passed, "message": self.message,
            "sides": list(self.sides), "step": self.step, "lr_step": self.lr_step, "lr": self.lr,
            "first": None if self.first is None else self.first.to_json(),
            "side_status": self.side_status, "side_errors": self.side_errors, "plants": self.plants,
            "perturb": self.perturb, "wall_s": self.wall_s,
            "rules": {k: dataclasses.asdict(r) for k, r in RULES.items()},
            "tensors": [t.to_json() for t in self.tensors],
            "precision": self.precision,
            **({"reference": "each side's own fp32 run of the same step on the same rounded weights",
                "precision_rule": dataclasses.asdict(PRECISION_RULE),
                "unit_roundoff": UNIT_ROUNDOFF[self.precision],
                "first_precision": None if self.first_precision is None else self.first_precision.to_json(),
                "precision_tensors": [t.to_json() for t in self.precision_tensors]}
               if self.precision != "fp32" else {})}

  def to_markdown(self) -> str:
    """The result as diagnose.md: verdict line, update position, the first difference and the per-tensor table."""
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
    if self.precision != "fp32":
      at = lines.index("## Worst relative error by kind")
      lines[at] = "## fp32 runs of both sides (rounded weights): worst by kind"
      lines += _precision_markdown(self)
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


def _precision_markdown(r: DiagnoseResult) -> list[str]:
  a, b = r.sides
  rule, floor = PRECISION_RULE, PRECISION_RULE.floor_u * UNIT_ROUNDOFF[r.precision]
  lines = [f"## {r.precision}: each side's error against its own fp32 run", "",
           f"rms relative error (rms(x - ref) / rms(ref); updates: relative to the fp32 step) and max relative error "
           f"(max|x - ref| / max|ref|). A side is off where its rms error is > {rule.factor:g}x the other side's and "
           f"> {floor:.3g} ({rule.floor_u:g} unit roundoff of {r.precision}).", "",
           "Updates are judged instead by each side's update against a first AdamW step from its own gradient "
           "(`adam a / b`: max error / allowed, off above 1).", "",
           f"| tensor | {a} rms | {b} rms | ratio | {a} max | {b} max | adam {a} / {b} | off |",
           "|---|---|---|---|---|---|---|---|"]
  for t in r.precision_tensors:
    if t.note:
      lines.append(f"| `{t.name}` | | | | | | | {t.note} |")
      continue
    adam = " / ".join(f"{t.adam_residual[s]:.2g}" for s in (a, b)) if t.adam_residual else ""
    lines.append(f"| `{t.name}` | {t.rms_err[a]:.3g} | {t.rms_err[b]:.3g} | {t.ratio:.2f} | {t.max_err[a]:.3g} | "
                 f"{t.max_err[b]:.3g} | {adam} | {'**' + t.off + '**' if t.off else ''} |")
  return lines + [""]


def _precision_first(pd: PrecisionDiff, sides: tuple[str, str], low: Mapping[str, Mapping[str, Any]],
                     ref: Mapping[str, Mapping[str, Any]], init: Mapping[str, Any], precision: str) -> TensorDiff:
  """A flagged PrecisionDiff as a TensorDiff (what the CLI prints): |Δ| is the off side's rms relative error,
  the tolerance `factor` x the other side's (or the floor); the worst element is the off side's largest error."""
  import numpy as np
  off = pd.off
  other = sides[1] if off == sides[0] else sides[0]
  x, r = np.asarray(low[off][pd.name], np.float64), np.asarray(ref[off][pd.name], np.float64)
  d = np.abs(x - r)
  flat = int(np.argmax(np.where(np.isfinite(d), d, np.inf))) if d.size else 0
  idx = tuple(int(i) for i in np.unravel_index(flat, d.shape)) if d.ndim else None
  floor = PRECISION_RULE.floor_u * UNIT_ROUNDOFF[precision]
  if pd.kind == "update":
    note = (f"{off}'s {precision} update is {pd.adam_residual[off]:.3g}x the allowed distance from a first AdamW "
            f"step on its own {precision} gradient ({other}: {pd.adam_residual[other]:.3g}x): its optimizer step "
            "differs, not its gradient (|Δ| and tolerance are these ratios)")
    err, tol = pd.adam_residual[off], 1.0
  else:
    note = (f"{precision} vs each side's own fp32 run, rms relative error: {off} {pd.rms_err[off]:.3g}, {other} "
            f"{pd.rms_err[other]:.3g} ({pd.ratio:.3g}x > {PRECISION_RULE.factor:g}x): {off} rounds differently here "
            f"(|Δ| and tolerance are these rms errors; worst element: {off}'s largest error)")
    err, tol = pd.rms_err[off], max(PRECISION_RULE.factor * pd.rms_err[other], floor)
  return TensorDiff(pd.name, pd.kind, pd.shape, float(np.max(d, initial=0.0)), pd.max_err[off],
                    float(np.max(np.abs(r), initial=0.0)), tol, idx,
                    float(np.asarray(low[sides[0]][pd.name]).reshape(-1)[flat]) if d.size else None,
                    float(np.asarray(low[sides[1]][pd.name]).reshape(-1)[flat]) if d.size else None, False,
                    worst_abs_err=err, note=note)


def diagnose(preset: str | None = None, *, config: str | Path | Mapping | None = None, overrides: Sequence[str] = (),
             hf_model: str | Path | None = None, step: int = 0, sides: Sequence[str] = ("jax", "torch"),
             perturb: Sequence[str] = (), plants: Sequence[str] = (), out: str | Path | None = None,
             timeout_s: float = 600.0, run_dir: str | Path | None = None, reuse: bool = False) -> DiagnoseResult:
  """Runs both sides' diagnose workers on one step and finds the first tensor that differs.

  Args:
    preset, config, overrides, hf_model: the run, as for `parity.compare`.
    step: which batch (batches.npy[step]) and schedule position to diagnose (0-based).
    sides: (reference, candidate), each 'jax' or 'torch'.
    perturb: `side:key=value` numeric changes of one side (parity.pipeline.folder.parse_perturb).
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
    KeyboardInterrupt: re-raised once diagnose.json/.md say which side was interrupted and which never started.
  """
  t0 = time.time()
  sides = tuple(sides)
  if len(sides) != 2 or len(set(sides)) != 2 or not all(s in DIAGNOSE_WORKERS for s in sides):
    raise SpecError(f"--sides {','.join(sides)}: diagnose compares two different sides among "
                    f"{', '.join(DIAGNOSE_WORKERS)} (DeepSpeed runs the torch model: diagnose it as 'torch')")
  if reuse and run_dir is None:
    raise SpecError("reuse=True needs run_dir: a folder prepared by an earlier diagnose")
  folder, spec, given = _resolve(preset, config, overrides, hf_model, sides, out, run_dir)
  check_plan(spec)
  if spec.train.steps <= step or step < 0:
    raise SpecError(f"--step {step}: the run has train.steps={spec.train.steps} (steps 0..{spec.train.steps - 1})")
  lr_step, lr = lr_position(spec.train, step)
  pert = _perturbations(perturb, sides, spec.train.precision, spec)
  plant_map = parse_plants(list(plants), sides, spec.model)
  request = _write_request(folder, spec, given, run_dir is None, pert, step, lr_step, plant_map)
  files = (OUTPUT_FILE, REFERENCE_FILE) if spec.train.precision != "fp32" else (OUTPUT_FILE,)
  runs, interrupted = _run_workers(folder, sides, request, files, timeout_s, reuse)
  status, errors = {s: r.status for s, r in runs.items()}, {s: r.error for s, r in runs.items()}
  found = _compare_sides(spec, folder, sides, files, [s for s in sides if status[s] == "ok"], lr)
  result = DiagnoseResult(run_dir=folder, sides=sides, step=step, lr_step=lr_step, lr=lr, tensors=found["tensors"],
                          first=found["first"], side_status=status, side_errors=errors,
                          message=_message(found, status, errors, sides, spec.train.precision, step), plants=plant_map,
                          perturb=pert, wall_s=time.time() - t0, precision=spec.train.precision,
                          precision_tensors=found["ptensors"], first_precision=found["pfirst"])
  (folder / "diagnose.json").write_text(json.dumps(result.to_json(), indent=2))
  (folder / "diagnose.md").write_text(result.to_markdown())
  lifetime.on_disk(f"diagnose.json and diagnose.md in {folder} say what ran")  # the message a stop ends with
  if interrupted is not None:
    raise interrupted
  return result


def _write_request(folder: Path, spec: RunSpec, given: Any, fresh: bool, pert: dict, step: int, lr_step: int,
                   plant_map: dict) -> dict:
  """The request of this diagnose call: a fresh folder is prepared first (resources checked, weights, batches,
  request.json); then request.json's perturb, step and plant keys are rewritten for this call. Returns it."""
  if fresh:
    check_resources(spec, folder)  # sizes that cannot fit are refused before anything is allocated
    made = not folder.exists()
    try:
      prepare_run_dir(spec, folder, perturb=pert, init_params=given)
    except BaseException:  # a refused input (bad data file, ...) leaves no folder this call made (newcomer, 2026-12-02)
      if made:
        shutil.rmtree(folder, ignore_errors=True)
      raise
  request = json.loads((folder / "request.json").read_text())
  request.update({"perturb": plan_perturbations(spec, pert).perturb, REQUEST_KEY: {"step": step, "lr_step": lr_step},
                  PLANTS_KEY: plant_map})
  (folder / "request.json").write_text(json.dumps(request, indent=2))
  return request


def _resolve(preset, config, overrides, hf_model, sides, out, run_dir) -> tuple[Path, RunSpec, Any]:
  """(folder, spec, initial weights or None): an earlier diagnose's folder (run_dir), or a new run resolved by
  parity.pipeline.resolve.resolve_run in `out` (default runs/<time>-diagnose-<hash>)."""
  if run_dir is None:
    resolved = resolve_run(preset, config=config, hf_model=hf_model, overrides=overrides, sides=sides)
    check_fsdp_overrides_are_read(resolved.spec, resolved.overrides, "diagnose")
    return (Path(out) if out is not None else default_run_dir(resolved.spec, "diagnose"), resolved.spec,
            resolved.init_params)
  folder = Path(run_dir)
  req_path = folder / "request.json"
  if not req_path.exists():
    raise SpecError(f"{req_path} does not exist: pass a folder prepared by `parity diagnose`")
  request = load_json(req_path, what="request")  # UTF-8 JSON, no deep nesting, finite numbers
  if not isinstance(request, dict) or not isinstance(request.get("run"), dict):
    raise SpecError(f"{req_path}: has no 'run' section; pass a folder prepared by `parity diagnose`")
  return folder, from_dict(RunSpec, request["run"], path="run"), None


def _perturbations(perturb: Sequence[str], sides: tuple[str, str], precision: str,
                   spec: RunSpec | None = None) -> dict[str, dict[str, Any]]:
  """parity.pipeline.folder.parse_perturb, minus what diagnose cannot honour (fault injections, a per-side precision);
  the planted data bugs (PLANT_KEYS) reach the worker as in a compare."""
  pert = parse_perturb(list(perturb), sides, spec)
  for side, kv in pert.items():
    for key, value in kv.items():
      if key in DEBUG_KEYS and key not in PLANT_KEYS:
        raise SpecError(f"--perturb {side}:{key}: fault injections are for `parity compare`; diagnose runs one "
                        "step (plant a model bug with --plant instead)")
      if key == "train.precision" and value != precision:
        raise SpecError(f"--perturb {side}:train.precision={value!r}: both sides run the run's precision "
                        f"({precision!r}); set it for both with --set 'train.precision=\"bf16\"'")
  return pert


def _run_workers(folder: Path, sides: tuple[str, str], request: dict, files: tuple[str, ...], timeout_s: float,
                 reuse: bool) -> tuple[dict[str, runner.SideRun], KeyboardInterrupt | None]:
  """Each side's diagnose worker in turn (harness.runner.run_each_side: Ctrl-C -> that side 'interrupted', the
  rest 'not_run'); with `reuse`, a side whose output files were computed from the same inputs is not rerun."""

  def start(side: str) -> runner.SideRun:
    paths = [folder / side / f for f in files]
    inputs = side_inputs(request, side)
    if reuse and all(p.exists() and output_metadata(p).get(INPUTS_METADATA_KEY) == inputs for p in paths):
      return runner.SideRun(side, "ok", None, 0.0, None, {"side": side, "status": "ok", "reused": True})
    for p in paths:
      p.unlink(missing_ok=True)
    sr = runner.run_side(folder, side, timeout_s=timeout_s, job="diagnose")
    if sr.status == "ok" and not all(p.exists() for p in paths):
      sr.status, sr.error = "crashed", f"worker finished without writing {', '.join(map(str, paths))}"
    return sr

  def on_interrupt(side: str) -> runner.SideRun:  # run_side killed the worker; the report says so
    return runner.SideRun(side, "interrupted", None, 0.0, None, {}, "interrupted by the user (Ctrl-C)")

  return runner.run_each_side(sides, start, on_interrupt=on_interrupt, what="diagnose")


def _compare_sides(spec: RunSpec, folder: Path, sides: tuple[str, str], files: tuple[str, ...], ok: list[str],
                   lr: float) -> dict[str, Any]:
  """The tensors of both sides compared in order: {'tensors', 'first', 'ptensors', 'pfirst'} (empty when a side did
  not finish). In bf16/fp16 the fp32 runs are compared with RULES first, then each side's rounding (module doc)."""
  found: dict[str, Any] = {"tensors": [], "first": None, "ptensors": [], "pfirst": None}
  if len(ok) != 2:
    return found
  a, b = sides
  precision, reduced = spec.train.precision, len(files) == 2
  outputs, refs, where = {}, {}, {}
  for side in sides:
    outputs[side], where[side] = read_outputs(folder / side / files[0])
    if reduced:
      refs[side], _ = read_outputs(folder / side / files[1])
  # bf16/fp16: both sides start from the master weights rounded to the compute dtype (DeepSpeed's layout)
  init = weights.master_weights(weights.load(folder / "init.safetensors"), precision)
  train32 = dataclasses.replace(spec.train, precision="fp32")
  tensors = compare_outputs(spec.model, train32, (refs if reduced else outputs)[a], (refs if reduced else outputs)[b],
                            init, lr)
  for t in tensors:
    t.where = {s: where[s].get(t.name, "?") for s in sides}
  first = next((t for t in tensors if not t.passed), None)
  found.update(tensors=tensors, first=first)
  if not reduced:
    return found
  ptensors = compare_precision(spec.model, spec.train, precision, (a, b), outputs, refs, init, lr)
  pfirst = next((t for t in ptensors if not t.passed), None)
  found.update(ptensors=ptensors, pfirst=pfirst)
  if first is not None:
    first.note = ("the two sides' fp32 runs of this step already differ here (a bug of any precision, not a "
                  f"{precision} rounding)" + (f"; {first.note}" if first.note else ""))
  elif pfirst is not None:
    if pfirst.note:  # missing or misshapen on some run
      first = TensorDiff(pfirst.name, pfirst.kind, pfirst.shape, math.inf, math.inf, 0.0, 0.0, None, None, None,
                         False, note=pfirst.note)
    else:
      first = _precision_first(pfirst, (a, b), outputs, refs, init, precision)
    first.where = {s: where[s].get(first.name, "?") for s in sides}
    found["first"] = first
  return found


def _message(found: dict[str, Any], status: dict[str, str], errors: dict[str, str | None], sides: tuple[str, str],
             precision: str, step: int) -> str:
  """The one line a user reads: which side did not finish, the first tensor that differs, or that none does."""
  bad = {s: st for s, st in status.items() if st != "ok"}
  tensors, first, a, b = found["tensors"], found["first"], *sides
  if bad:
    return "side(s) did not finish: " + "; ".join(f"{s} ({st}): {(errors[s] or '')[-600:]}" for s, st in bad.items())
  if first is None and precision != "fp32":
    floor = PRECISION_RULE.floor_u * UNIT_ROUNDOFF[precision]
    judged = [t for t in found["ptensors"] if t.kind != "update" and max(t.rms_err.values()) > floor]
    worst = max(judged, key=lambda t: t.ratio, default=None)
    largest = f"largest ratio above the floor {worst.ratio:.2f} at {worst.name}; " if worst else ""
    return (f"no tensor breaks tolerance: the fp32 runs agree ({len(tensors)} tensors) and in {precision} neither "
            f"side's error vs its fp32 run is > {PRECISION_RULE.factor:g}x the other's ({largest}updates within "
            f"a first AdamW step of their own gradients; step {step})")
  if first is None:
    return f"no tensor breaks tolerance: {len(tensors)} tensors of {a} and {b} agree (step {step})"
  in_fp32 = precision != "fp32" and first is next((t for t in tensors if not t.passed), None)
  return (f"[fp32 runs of the {precision} step] " if in_fp32 else "") + _first_message(first, sides)
