"""Run control: the request keys that cut a run short, checkpoint it or resume it, and their checks.

Optional top-level request keys, read by a worker through `SideIO.control()` (`parse_control` -> RunControl):

  stop_after_step: S          train steps 0..S, then end normally (status 'ok', final.safetensors = params
                              after step S, summary `stopped_after_step`); the LR schedule still spans
                              train.steps: the run is a prefix of the full run, not a shorter one.
  save_checkpoint_at_step: K  after step K (and its eval), save the side's complete training state to
                              run_dir/<side>/checkpoint/ (framework files, then meta.json, written last);
                              summary `checkpoint`.
  resume_from: "<folder>"     a side's checkpoint folder, relative to run_dir or absolute; '{side}' in it is
                              replaced by the side name, so one request can resume every side. The side
                              restores the state and trains steps K+1.. (K from meta.json), recording only
                              those; summary `resumed_from_step`. Refused (status 'crashed', the error names
                              the key, the request file and the folder) when the folder or its meta.json is
                              missing, it was written by another side, or its model/train spec (or the
                              state-layout part of the side's plan) differs from this run's.

`derive_request` (the harness end) writes such a request in a subfolder of a prepared run folder, sharing its inputs.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from parity.protocol.layout import (CHECKPOINT_DIR, CHECKPOINT_META, REQUEST_SCHEMA,  # noqa: F401 (the doctest)
                                    read_checkpoint_meta, read_summary)
from parity.protocol.ranks import LAUNCH_FILE
from parity.sides import find_side
from parity.spec import RunSpec, to_dict

__all__ = ["CONTROL_KEYS", "ControlError", "RunControl", "derive_request", "parse_control", "check_resume"]

CONTROL_KEYS = ("stop_after_step", "save_checkpoint_at_step", "resume_from")
"""Optional top-level request keys that cut a run short, checkpoint it, or resume it (module docstring)."""
_INPUT_KEYS = ("init_weights", "batches", "val_batches")
"""Request keys naming input files relative to the folder holding request.json."""


class ControlError(ValueError):
  """A run-control key of the request (CONTROL_KEYS) is malformed or cannot be honoured."""



def _step_value(key: str, value: Any, where: str) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ControlError(f"{key} in {where} takes a step number (an integer >= 0); got {value!r}")
  return value



def _diff_keys(mine: Any, theirs: Any, prefix: str) -> list[str]:
  """Dotted keys whose values differ between two JSON dicts, as 'key: checkpoint X != run Y'."""
  if isinstance(mine, dict) and isinstance(theirs, dict):
    out = []
    for k in sorted(set(mine) | set(theirs)):
      out += _diff_keys(mine.get(k), theirs.get(k), f"{prefix}.{k}" if prefix else k)
    return out
  return [] if mine == theirs else [f"{prefix}: checkpoint {theirs!r} != this run {mine!r}"]


@dataclasses.dataclass(frozen=True)
class RunControl:
  """What part of the run a side trains, and where it checkpoints (the request's CONTROL_KEYS, checked).

  Attributes:
    first_step: first optimizer step to run (0, or K + 1 when resuming from a checkpoint of step K).
    last_step: last optimizer step to run, inclusive (stop_after_step, else train.steps - 1).
    stop_after_step: the request's stop_after_step, or None.
    save_at: step after which to save a checkpoint (save_checkpoint_at_step), or None.
    resume_dir: absolute checkpoint folder to restore before training, or None.
    resume_meta: that checkpoint's meta.json, or None.
  """
  first_step: int
  last_step: int
  stop_after_step: int | None = None
  save_at: int | None = None
  resume_dir: Path | None = None
  resume_meta: dict[str, Any] | None = None

  @property
  def resumed_from_step(self) -> int | None:
    """Step K of the checkpoint resumed from (its state is the one after step K), or None."""
    return None if self.resume_meta is None else int(self.resume_meta["step"])

  def steps(self) -> range:
    """The optimizer steps this side runs, in order."""
    return range(self.first_step, self.last_step + 1)


def derive_request(run_dir: str | Path, sub_dir: str | Path, *, batches: str | None = None,
                   perturb: dict[str, dict[str, Any]] | None = None, **keys: Any) -> Path:
  """Writes `run_dir/<sub_dir>/request.json`: the run's request plus run-control keys, sharing its inputs.

  The derived run is the same run (spec, perturbations, DeepSpeed config) in its own folder, so a repeat,
  a stopped-and-checkpointed run or a resumed run sits beside the main one and is run like it
  (`harness.runner.run_side(run_dir / sub_dir, side)`). Its input paths point back at the parent's files
  (e.g. "../init.safetensors"); control keys of the parent's request are not inherited.

  Args:
    run_dir: a prepared run folder (holds request.json, see `parity.pipeline.folder.prepare_run_dir`).
    sub_dir: relative folder inside run_dir for the derived run, e.g. "resume" or "checks/repeat".
    batches: a batches file of the derived run's own (relative to run_dir/<sub_dir>, or absolute) instead of
      the parent's, e.g. the reduction-order rerun's reversed batches (harness.self_runs.run_noise).
    perturb: per-side perturbations replacing the parent's (parity.pipeline.folder.parse_perturb's form).
    **keys: CONTROL_KEYS to set: stop_after_step=S and save_checkpoint_at_step=K (ints >= 0),
      resume_from="<folder>" (relative to run_dir/<sub_dir>, the folder of the derived request, or absolute;
      '{side}' is replaced by each side's name, e.g. resume_from="../stop/{side}/checkpoint"). None omits a key.
  Returns:
    The path of the derived request.json.
  Raises:
    ControlError: an unknown key, a malformed value, or a sub_dir that is absolute or leaves run_dir.
    FileNotFoundError: run_dir holds no request.json.

  >>> import tempfile
  >>> d = Path(tempfile.mkdtemp())
  >>> _ = (d / "request.json").write_text(json.dumps({"schema": REQUEST_SCHEMA, "batches": "batches.npy"}))
  >>> req = json.loads(derive_request(d, "stop", stop_after_step=3).read_text())
  >>> req["batches"], req["stop_after_step"], req["derived_from"]
  ('../batches.npy', 3, '../request.json')
  """
  run_dir = Path(run_dir)
  parent = run_dir / "request.json"
  if not parent.is_file():
    raise FileNotFoundError(f"{parent} not found; prepare the run folder first "
                            "(parity.pipeline.folder.prepare_run_dir)")
  sub = Path(sub_dir)
  _check_control_keys(run_dir, sub, keys)
  request = {k: v for k, v in json.loads(parent.read_text()).items() if k not in CONTROL_KEYS}
  out = run_dir / sub
  out.mkdir(parents=True, exist_ok=True)
  theirs = read_summary(out / "request.json")  # a request already there must be this very run's (same run_id)
  if theirs is not None and theirs.get("run_id") != request.get("run_id"):
    raise ControlError(f"derive_request: {out / 'request.json'} belongs to another run (run_id "
                       f"{theirs.get('run_id')!r}, this run {request.get('run_id')!r}); a run never reuses another "
                       "run's files: use a fresh run folder")
  _rebase_inputs(request, run_dir, out)
  request.update({k: v for k, v in keys.items() if v is not None})
  if batches is not None:
    request["batches"] = batches
  if perturb is not None:
    _check_derived_perturb(request, perturb, run_dir)
    request["perturb"] = {side: dict(kv) for side, kv in perturb.items()}
    request["perturbations"] = None  # the parent's records describe its own perturbations, not these
  path = out / "request.json"
  path.write_text(json.dumps(request, indent=2))
  launch = run_dir / LAUNCH_FILE  # a rerun runs with the ranks of the run it derives from
  if launch.exists():
    (out / LAUNCH_FILE).write_text(launch.read_text())
  return path


def _check_derived_perturb(request: dict[str, Any], perturb: dict[str, dict[str, Any]], run_dir: Path) -> None:
  """A run with a user's DeepSpeed config carries the DeepSpeed side's perturbations inside that config
  (request.json 'deepspeed_config', parity.pipeline.perturb), so a derived request may not change them: the side
  would run the parent's config with other perturbations claimed. Raises ControlError naming the folder."""
  if request.get("deepspeed_config") is None:
    return
  mine, theirs = dict(perturb.get("deepspeed") or {}), dict((request.get("perturb") or {}).get("deepspeed") or {})
  if mine != theirs:
    raise ControlError(f"derive_request: {run_dir / 'request.json'} runs a user's DeepSpeed config with the "
                       f"DeepSpeed side's perturbations {theirs} written into it; a derived run cannot change them "
                       f"(asked: {mine}): prepare a new run folder with those perturbations")


def _rebase_inputs(request: dict[str, Any], run_dir: Path, out: Path) -> None:
  """Points the request's relative input paths (and `derived_from`) from run_dir at the derived folder `out`, in
  place: "init.safetensors" becomes "../init.safetensors" for out = run_dir/"stop"."""
  up = Path(os.path.relpath(run_dir, out))
  for key in _INPUT_KEYS:
    if isinstance(request.get(key), str) and not Path(request[key]).is_absolute():
      request[key] = (up / request[key]).as_posix()
  request["derived_from"] = (up / "request.json").as_posix()
  examples = request.get("examples")  # padded/packed: the arrays beside the batches (parity.pipeline.examples_input)
  for key in ("arrays", "val_arrays"):
    if isinstance(examples, dict) and isinstance(examples.get(key), dict):
      examples[key] = {k: v if Path(v).is_absolute() else (up / v).as_posix() for k, v in examples[key].items()}


def _check_control_keys(run_dir: Path, sub: Path, keys: dict[str, Any]) -> None:
  """derive_request's argument checks. Raises ControlError naming the key (or sub_dir) and what it takes."""
  if sub.is_absolute() or ".." in sub.parts or str(sub) in ("", "."):
    raise ControlError(f"derive_request: sub_dir must be a relative folder inside {run_dir}; got {str(sub)!r}")
  unknown = sorted(set(keys) - set(CONTROL_KEYS))
  if unknown:
    raise ControlError(f"derive_request: unknown key(s) {unknown}; the run-control keys are {list(CONTROL_KEYS)}")
  where = f"derive_request({str(sub)!r})"
  for key in ("stop_after_step", "save_checkpoint_at_step"):
    if keys.get(key) is not None:
      _step_value(key, keys[key], where)
  if keys.get("resume_from") is not None and not (isinstance(keys["resume_from"], str) and keys["resume_from"]):
    raise ControlError(f"resume_from in {where} takes a checkpoint folder path (a string); got {keys['resume_from']!r}")


def parse_control(request: dict[str, Any], request_path: Path, side: str, run: RunSpec) -> RunControl:
  """The request's CONTROL_KEYS, checked against the run and (when resuming) the checkpoint.

  Args:
    request: the parsed request.json.
    request_path: its path (named in messages; `resume_from` is relative to its folder).
    side: the side reading it.
    run: that side's RunSpec (perturbations applied).
  Raises:
    ControlError: a malformed key, a stop/save step outside the steps this run trains, or a resume_from checkpoint
      that `check_resume` refuses; the message names the key, the request file and the folder.
  """
  where, steps = str(request_path), run.train.steps
  stop, save = request.get("stop_after_step"), request.get("save_checkpoint_at_step")
  stop = None if stop is None else _step_value("stop_after_step", stop, where)
  save = None if save is None else _step_value("save_checkpoint_at_step", save, where)
  resume_dir, meta = check_resume(request, request_path, side, run)
  first = 0 if meta is None else int(meta["step"]) + 1
  if first > steps - 1:
    raise ControlError(f"resume_from={request['resume_from']!r} in {where}: the checkpoint at {resume_dir} is of "
                       f"step {first - 1}, the last of train.steps={steps}; nothing is left to train")
  if stop is not None and not first <= stop < steps:
    raise ControlError(f"stop_after_step={stop} in {where} must be in [{first}, {steps - 1}] (the steps this run "
                       f"trains: train.steps={steps}" + (f", resumed after step {first - 1})" if first else ")"))
  last = steps - 1 if stop is None else stop
  if save is not None and not first <= save <= last:
    raise ControlError(f"save_checkpoint_at_step={save} in {where} is never reached: this run trains steps "
                       f"{first}..{last}; pick a step in that range")
  return RunControl(first_step=first, last_step=last, stop_after_step=stop, save_at=save,
                    resume_dir=resume_dir, resume_meta=meta)


def check_resume(request: dict[str, Any], request_path: Path, side: str,
                 run: RunSpec) -> tuple[Path | None, dict[str, Any] | None]:
  """Resolves and checks the request's `resume_from`; returns (absolute checkpoint folder, its meta) or (None, None).

  Raises:
    ControlError: not a string; no checkpoint there (or no meta.json); a checkpoint of another side; or one saved by
      a run whose model/train spec, state layout (the side record's state_layout) or data differ from this one (each
      key named).
  """
  raw = request.get("resume_from")
  if raw is None:
    return None, None
  where = f"resume_from={raw!r} in {request_path}"
  if not isinstance(raw, str) or not raw:
    raise ControlError(f"{where}: takes a checkpoint folder path (a string)")
  folder = Path(raw.replace("{side}", side))
  folder = (folder if folder.is_absolute() else Path(request_path).parent / folder).resolve()
  try:
    meta = read_checkpoint_meta(folder)
  except (OSError, ValueError) as exc:
    raise ControlError(f"{where}: {exc}. Point resume_from at run_dir/<side>/{CHECKPOINT_DIR} of a run "
                       "saved with save_checkpoint_at_step.") from None
  if meta.get("side") != side:
    raise ControlError(f"{where}: {folder} is a checkpoint of side {meta.get('side')!r}; this is side "
                       f"{side!r}, which can only resume its own checkpoints")
  if not isinstance(meta.get("step"), int) or not isinstance(meta.get("run"), dict):
    raise ControlError(f"{where}: {folder / CHECKPOINT_META} lacks an integer 'step' or the 'run' spec")
  mine, theirs = to_dict(run), meta["run"]
  diffs = _diff_keys(mine["model"], theirs.get("model"), "model") + \
      _diff_keys(mine["train"], theirs.get("train"), "train")
  record = find_side(side)  # the plan fields a checkpoint must share: its record's state_layout (parity.sides)
  plan, layout = (record.plan, record.state_layout) if record is not None else (None, ())
  if plan is not None:
    keys = mine[plan].keys() if layout is None else layout
    diffs += _diff_keys({k: mine[plan].get(k) for k in keys},
                        {k: (theirs.get(plan) or {}).get(k) for k in keys}, plan)
  ours, theirs_sha = (request.get("data") or {}).get("sha256"), meta.get("data_sha256")
  if ours and theirs_sha and ours != theirs_sha:
    diffs.append(f"data.sha256: checkpoint {theirs_sha!r} != this run {ours!r}")
  if diffs:
    raise ControlError(f"{where}: {folder} was saved by a different run; it cannot continue this one:\n  "
                       + "\n  ".join(diffs))
  return folder, meta
