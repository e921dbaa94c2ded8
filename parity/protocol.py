"""The run protocol between the harness and a side's worker process.

Files of one run (DESIGN.md):

  run_dir/request.json          RunRequest (schema 'parity.request/1'), written by the harness
  run_dir/init.safetensors      canonical initial weights (parity.weights)
  run_dir/batches.npy           uint16 (steps, grad_accum_steps, micro_batch_size, seq_len + 1)
  run_dir/val_batches.npy       uint16 (eval_batches, micro_batch_size, seq_len + 1)
  run_dir/<side>/steps.jsonl    one StepRecord per optimizer step, flushed as it is written
  run_dir/<side>/summary.json   Summary, written once at the end (also on failure when possible)
  run_dir/<side>/final.safetensors  canonical final fp32 (master) params
  run_dir/<side>/final_moments.safetensors  float32, per canonical param: 'grad_rms/<name>' = Adam's
                                bias-corrected sqrt(v_hat) at the end, 'sensitivity/<name>' = sum over updates of
                                lr_t / (sqrt(v_hat_t) + eps) (parity.checks.AdamSensitivity); read by the params
                                rule (parity.checks.param_checks); optional

A worker is `python -m <package>.worker run_dir/request.json --side <side>`; it
uses `SideIO` for everything above, so both frameworks write identical records.

StepRecord keys (units in names): step (0-based), loss (mean token cross-entropy,
nats, averaged over the micro batches of the step), grad_norm (global L2 norm of
the gradient before clipping), lr (learning rate applied in this step),
loss_scale (fp16 loss scale, 1.0 otherwise), skipped (update skipped on
overflow), step_time_s (wall seconds of the step, host-synchronised), tokens
(tokens consumed by the step), val_loss (held-out loss after the step, only on
eval steps).

Run control (optional top-level request keys, read through `SideIO.control()`; RunControl):

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

`derive_request` writes such a request in a subfolder of a prepared run folder, sharing its inputs.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import resource
import shutil
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np

from parity import schedule, weights
from parity.spec import RunSpec, apply_overrides, config_hash, from_dict, to_dict

__all__ = ["SideIO", "SIDE_WORKERS", "REQUEST_SCHEMA", "LAUNCH_ENV", "DEBUG_KEYS", "STEP_LIST_KEYS", "parse_debug_value",
           "read_steps", "read_summary", "CONTROL_KEYS", "RunControl", "ControlError", "derive_request",
           "CHECKPOINT_DIR", "CHECKPOINT_META", "CHECKPOINT_SCHEMA", "read_checkpoint_meta", "FINAL_MOMENTS",
           "read_moments"]

REQUEST_SCHEMA = "parity.request/1"
SUMMARY_SCHEMA = "parity.summary/1"
LAUNCH_ENV = "PARITY_LAUNCH_TIME"
"""Environment variable holding time.time() when the harness spawned the worker."""
SIDE_WORKERS = {"jax": "jax_impl.worker", "deepspeed": "torch_impl.worker", "torch": "torch_impl.worker"}
"""Side name -> worker module."""
DEBUG_KEYS = ("nan_at_step", "kill_at_step", "hang_at_step", "raise_at_step", "overflow_at_steps")
"""Fault injections a request may carry per side (besides model./train. overrides), for testing failure paths.
Each takes a step number (0-based optimizer step); `overflow_at_steps` takes a list of them: at those steps
the side makes its (loss-scaled) gradient overflow, as an fp16 run with too large a loss scale would."""
STEP_LIST_KEYS = ("overflow_at_steps",)
"""DEBUG_KEYS whose value is a list of steps."""


FINAL_MOMENTS = "final_moments.safetensors"
"""In run_dir/<side>/: per canonical param (float32, the param's shape) 'grad_rms/<name>' (Adam's bias-corrected
sqrt(v_hat) at the end of the run) and 'sensitivity/<name>' (sum_t lr_t / (sqrt(v_hat_t) + eps), units
param / gradient), written by every side whose optimizer keeps a second moment."""
MOMENT_KINDS = ("grad_rms", "sensitivity")


def read_moments(path: str | Path) -> dict[str, dict[str, np.ndarray]] | None:
  """Reads a FINAL_MOMENTS file: {'grad_rms': name -> array, 'sensitivity': name -> array} (float32, >= 0).

  Returns None when the file does not exist, cannot be read, or holds negative or non-finite values: the side
  then counts as one that could not provide moments, and the params rule falls back to its per-tensor form for
  its pairs and says so in the check's detail. Never raises for the file's content.
  """
  path = Path(path)
  try:
    out = weights.load(path)
  except Exception:  # missing, truncated or foreign: the fallback covers it
    return None
  if not all(np.all(np.isfinite(a)) and not np.any(a < 0) for a in out.values()):
    return None
  split: dict[str, dict[str, np.ndarray]] = {k: {} for k in MOMENT_KINDS}
  for key, arr in out.items():
    kind, _, name = key.partition("/")
    if kind not in split or not name:
      return None
    split[kind][name] = arr
  return split if split["grad_rms"] and set(split["grad_rms"]) == set(split["sensitivity"]) else None


CONTROL_KEYS = ("stop_after_step", "save_checkpoint_at_step", "resume_from")
"""Optional top-level request keys that cut a run short, checkpoint it, or resume it (module docstring)."""
CHECKPOINT_DIR = "checkpoint"
"""Folder, inside run_dir/<side>/, of the checkpoint `save_checkpoint_at_step` writes."""
CHECKPOINT_META = "meta.json"
"""The checkpoint's description, written after its framework files: a folder without it is incomplete."""
CHECKPOINT_SCHEMA = "parity.checkpoint/1"
_INPUT_KEYS = ("init_weights", "batches", "val_batches")
"""Request keys naming input files relative to the folder holding request.json."""
STATE_LAYOUT_KEYS = {"jax": ("scan_layers",), "deepspeed": None, "torch": ()}
"""Per side, the plan fields (of RunSpec.jax / RunSpec.deepspeed) a checkpoint must share with the run resuming
it: JAX restores into this run's shardings and memory kinds, so only the params layout (scan_layers) matters;
a DeepSpeed checkpoint is ZeRO-partitioned, so the whole `deepspeed` plan must match (None); torch has no plan."""


class ControlError(ValueError):
  """A run-control key of the request (CONTROL_KEYS) is malformed or cannot be honoured."""


def parse_debug_value(key: str, value: Any) -> int | tuple[int, ...]:
  """Checks one debug value: a step (int >= 0), or for STEP_LIST_KEYS a list of steps (or one step).

  Raises:
    ValueError: naming the key and what it takes.
  """
  if key in STEP_LIST_KEYS:
    items = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in items):
      raise ValueError(f"{key} takes a list of step numbers (integers >= 0); got {value!r}")
    return tuple(sorted(set(items)))
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ValueError(f"{key} takes a step number (an integer >= 0); got {value!r}")
  return value


def read_steps(path: str | Path) -> list[dict[str, Any]]:
  """Reads a steps.jsonl; a truncated last line (a killed writer) is dropped."""
  out = []
  p = Path(path)
  if not p.exists():
    return out
  for line in p.read_text().splitlines():
    try:
      out.append(json.loads(line))
    except json.JSONDecodeError:
      break
  return out


def read_summary(path: str | Path) -> dict[str, Any] | None:
  p = Path(path)
  if not p.exists():
    return None
  try:
    return json.loads(p.read_text())
  except json.JSONDecodeError:
    return None


def _step_value(key: str, value: Any, where: str) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ControlError(f"{key} in {where} takes a step number (an integer >= 0); got {value!r}")
  return value


def read_checkpoint_meta(folder: str | Path) -> dict[str, Any]:
  """Reads `<folder>/meta.json` of a checkpoint written by `SideIO.save_checkpoint`.

  Raises:
    FileNotFoundError: no folder, or no meta.json in it (an interrupted save writes none).
    ValueError: meta.json is not JSON or has another schema.
  """
  folder = Path(folder)
  if not folder.is_dir():
    raise FileNotFoundError(f"no checkpoint folder at {folder}")
  path = folder / CHECKPOINT_META
  if not path.is_file():
    raise FileNotFoundError(f"{folder} holds no {CHECKPOINT_META}: not a parity checkpoint, or its save was "
                            "interrupted (meta.json is written last)")
  try:
    meta = json.loads(path.read_text())
  except json.JSONDecodeError as exc:
    raise ValueError(f"{path}: not valid JSON ({exc})") from None
  if not isinstance(meta, dict) or meta.get("schema") != CHECKPOINT_SCHEMA:
    got = meta.get("schema") if isinstance(meta, dict) else type(meta).__name__
    raise ValueError(f"{path}: schema {got!r}, expected {CHECKPOINT_SCHEMA!r}")
  return meta


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
    run_dir: a prepared run folder (holds request.json, see `parity.run.prepare_run_dir`).
    sub_dir: relative folder inside run_dir for the derived run, e.g. "resume" or "checks/repeat".
    batches: a batches file of the derived run's own (relative to run_dir/<sub_dir>, or absolute) instead of
      the parent's, e.g. the reduction-order rerun's reversed batches (harness.self_runs.run_noise).
    perturb: per-side perturbations replacing the parent's (parity.run.parse_perturb's form).
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
    raise FileNotFoundError(f"{parent} not found; prepare the run folder first (parity.run.prepare_run_dir)")
  sub = Path(sub_dir)
  if sub.is_absolute() or ".." in sub.parts or str(sub) in ("", "."):
    raise ControlError(f"derive_request: sub_dir must be a relative folder inside {run_dir}; got {str(sub_dir)!r}")
  unknown = sorted(set(keys) - set(CONTROL_KEYS))
  if unknown:
    raise ControlError(f"derive_request: unknown key(s) {unknown}; the run-control keys are {list(CONTROL_KEYS)}")
  where = f"derive_request({str(sub_dir)!r})"
  for key in ("stop_after_step", "save_checkpoint_at_step"):
    if keys.get(key) is not None:
      _step_value(key, keys[key], where)
  if keys.get("resume_from") is not None and not (isinstance(keys["resume_from"], str) and keys["resume_from"]):
    raise ControlError(f"resume_from in {where} takes a checkpoint folder path (a string); got {keys['resume_from']!r}")
  request = {k: v for k, v in json.loads(parent.read_text()).items() if k not in CONTROL_KEYS}
  out = run_dir / sub
  out.mkdir(parents=True, exist_ok=True)
  theirs = read_summary(out / "request.json")  # a request already there must be this very run's (same run_id)
  if theirs is not None and theirs.get("run_id") != request.get("run_id"):
    raise ControlError(f"derive_request: {out / 'request.json'} belongs to another run (run_id "
                       f"{theirs.get('run_id')!r}, this run {request.get('run_id')!r}); a run never reuses another "
                       "run's files: use a fresh run folder")
  up = Path(os.path.relpath(run_dir, out))
  for key in _INPUT_KEYS:
    if isinstance(request.get(key), str) and not Path(request[key]).is_absolute():
      request[key] = (up / request[key]).as_posix()
  request["derived_from"] = (up / "request.json").as_posix()
  request.update({k: v for k, v in keys.items() if v is not None})
  if batches is not None:
    request["batches"] = batches
  if perturb is not None:
    request["perturb"] = {side: dict(kv) for side, kv in perturb.items()}
  path = out / "request.json"
  path.write_text(json.dumps(request, indent=2))
  return path


def peak_rss_bytes() -> int:
  """Peak resident set size of this process, bytes (getrusage ru_maxrss is KiB on Linux)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class SideIO:
  """A worker's view of one run: its inputs, and the writers of its outputs.

  Args:
    request_path: run_dir/request.json.
    side: 'jax', 'deepspeed' or 'torch'.
  Attributes:
    run: the RunSpec for this side, with this side's debug overrides applied.
    debug: this side's fault injections (subset of DEBUG_KEYS -> step).
    out: run_dir/<side>/.
  """

  def __init__(self, request_path: str | Path, side: str):
    self.launch_time = float(os.environ.get(LAUNCH_ENV, time.time()))
    self.request_path = Path(request_path)
    self.run_dir = self.request_path.parent
    self.request = json.loads(self.request_path.read_text())
    if self.request.get("schema") != REQUEST_SCHEMA:
      raise ValueError(f"{request_path}: schema {self.request.get('schema')!r}, expected {REQUEST_SCHEMA!r}")
    self.side = side
    self.out = self.run_dir / side
    self.out.mkdir(parents=True, exist_ok=True)
    perturb = dict(self.request.get("perturb", {}).get(side, {}))
    self.debug = {k: parse_debug_value(k, perturb.pop(k)) for k in DEBUG_KEYS if k in perturb}
    base = from_dict(RunSpec, self.request["run"])
    self.run = apply_overrides(base, perturb) if perturb else base
    self.perturbed = perturb
    self._steps = open(self.out / "steps.jsonl", "w")
    self._step_times: list[float] = []
    self._t_ready: float | None = None
    self.compile_s = 0.0
    self.steps_done = 0
    self._control: RunControl | None = None
    self._checkpoint_info: dict[str, Any] | None = None
    (self.out / "pid").write_text(str(os.getpid()))

  # ------------------------------------------------------------------ run control
  def control(self) -> RunControl:
    """The request's run-control keys, checked against the run and (when resuming) the checkpoint.

    Call it first in a worker, so a refusal becomes a 'crashed' summary naming the key.
    Raises:
      ControlError: a malformed key, a stop/save step outside the steps this run trains, or a
        resume_from checkpoint that is missing, incomplete, from another side, or of another
        model/train spec or state layout; the message names the key, the request file and the folder.
    """
    if self._control is None:
      self._control = self._parse_control()
      self.steps_done = self._control.first_step  # a resumed run starts with the checkpoint's steps done
    return self._control

  def _parse_control(self) -> RunControl:
    req, where, steps = self.request, str(self.request_path), self.run.train.steps
    stop = req.get("stop_after_step")
    save = req.get("save_checkpoint_at_step")
    stop = None if stop is None else _step_value("stop_after_step", stop, where)
    save = None if save is None else _step_value("save_checkpoint_at_step", save, where)
    resume_dir, meta = self._resume_checkpoint(req.get("resume_from"))
    first = 0 if meta is None else int(meta["step"]) + 1
    if first > steps - 1:
      raise ControlError(f"resume_from={req['resume_from']!r} in {where}: the checkpoint at {resume_dir} is of "
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

  def _resume_checkpoint(self, raw: Any) -> tuple[Path | None, dict[str, Any] | None]:
    """Resolves and checks `resume_from`; returns (absolute folder, meta) or (None, None)."""
    if raw is None:
      return None, None
    where = f"resume_from={raw!r} in {self.request_path}"
    if not isinstance(raw, str) or not raw:
      raise ControlError(f"{where}: takes a checkpoint folder path (a string)")
    folder = Path(raw.replace("{side}", self.side))
    folder = (folder if folder.is_absolute() else self.run_dir / folder).resolve()
    try:
      meta = read_checkpoint_meta(folder)
    except (OSError, ValueError) as exc:
      raise ControlError(f"{where}: {exc}. Point resume_from at run_dir/<side>/{CHECKPOINT_DIR} of a run "
                         "saved with save_checkpoint_at_step.") from None
    if meta.get("side") != self.side:
      raise ControlError(f"{where}: {folder} is a checkpoint of side {meta.get('side')!r}; this is side "
                         f"{self.side!r}, which can only resume its own checkpoints")
    if not isinstance(meta.get("step"), int) or not isinstance(meta.get("run"), dict):
      raise ControlError(f"{where}: {folder / CHECKPOINT_META} lacks an integer 'step' or the 'run' spec")
    mine, theirs = to_dict(self.run), meta["run"]
    diffs = _diff_keys(mine["model"], theirs.get("model"), "model") + \
        _diff_keys(mine["train"], theirs.get("train"), "train")
    plan, layout = {"jax": "jax", "deepspeed": "deepspeed"}.get(self.side), STATE_LAYOUT_KEYS.get(self.side, ())
    if plan is not None:
      keys = mine[plan].keys() if layout is None else layout
      diffs += _diff_keys({k: mine[plan].get(k) for k in keys},
                          {k: (theirs.get(plan) or {}).get(k) for k in keys}, plan)
    ours, theirs_sha = (self.request.get("data") or {}).get("sha256"), meta.get("data_sha256")
    if ours and theirs_sha and ours != theirs_sha:
      diffs.append(f"data.sha256: checkpoint {theirs_sha!r} != this run {ours!r}")
    if diffs:
      raise ControlError(f"{where}: {folder} was saved by a different run; it cannot continue this one:\n  "
                         + "\n  ".join(diffs))
    return folder, meta

  @property
  def checkpoint_dir(self) -> Path:
    """run_dir/<side>/checkpoint/, where `save_checkpoint` writes."""
    return self.out / CHECKPOINT_DIR

  def save_checkpoint(self, step: int, write: Callable[[Path], dict[str, Any] | None],
                      versions: dict[str, str] | None = None) -> Path:
    """Saves the side's training state after `step`: replaces checkpoint/, calls `write`, then writes meta.json.

    Args:
      step: the optimizer step just completed (0-based); a resumed run continues at step + 1.
      write: writes the framework's files into the (empty) folder it is given; returns extra
        JSON-ready fields for meta.json (e.g. format, tag) or None.
      versions: framework versions, stored in meta.json.
    Returns:
      The checkpoint folder.
    """
    folder = self.checkpoint_dir
    if folder.exists():
      shutil.rmtree(folder)
    folder.mkdir(parents=True)
    t0 = time.time()
    extra = write(folder) or {}
    save_s = time.time() - t0
    meta = {"schema": CHECKPOINT_SCHEMA, "side": self.side, "step": step, "steps_completed": step + 1,
            "run": to_dict(self.run), "config_hash": config_hash(self.run),
            "data_sha256": (self.request.get("data") or {}).get("sha256"),
            "versions": {"python": platform.python_version(), **(versions or {})},
            "created_unix_s": time.time(), "save_s": save_s, **extra}
    (folder / CHECKPOINT_META).write_text(json.dumps(meta, indent=2, default=str))
    self._checkpoint_info = {"step": step, "path": str(folder), "save_s": save_s}
    return folder

  def _control_summary(self, status: str) -> dict[str, Any]:
    """Summary fields of the run-control keys (none when the request has none or they were refused)."""
    ctl, out = self._control, {}
    if ctl is None:
      return out
    if ctl.stop_after_step is not None and status == "ok":
      out["stopped_after_step"] = ctl.stop_after_step
    if ctl.resume_dir is not None:
      out["resumed_from_step"] = ctl.resumed_from_step
      out["resumed_from"] = str(ctl.resume_dir)
    if self._checkpoint_info is not None:
      out["checkpoint"] = self._checkpoint_info
    return out

  # ------------------------------------------------------------------ inputs
  def init_params(self) -> dict[str, np.ndarray]:
    """Canonical float32 initial weights, checked against this side's model spec."""
    return weights.load(self.run_dir / self.request["init_weights"], self.run.model)

  def batches(self) -> np.ndarray:
    """uint16 (steps, grad_accum_steps, micro_batch_size, seq_len + 1), memory-mapped."""
    return np.load(self.run_dir / self.request["batches"], mmap_mode="r")

  def val_batches(self) -> np.ndarray:
    """uint16 (eval_batches, micro_batch_size, seq_len + 1)."""
    return np.load(self.run_dir / self.request["val_batches"])

  def forced_overflow(self, step: int) -> bool:
    """True when this side must make step `step`'s gradient overflow (debug `overflow_at_steps`)."""
    return step in self.debug.get("overflow_at_steps", ())

  def lr(self, step: int) -> float:
    """Learning rate DeepSpeed's WarmupCosineLR applies at optimizer step `step`."""
    return schedule.train_lr(self.run.train, step)

  def is_eval_step(self, step: int) -> bool:
    t = self.run.train
    return t.eval_every > 0 and ((step + 1) % t.eval_every == 0 or step == t.steps - 1)

  # ------------------------------------------------------------------ hooks
  def ready(self) -> None:
    """Marks the end of initialisation (imports, model build, weight load)."""
    self._t_ready = time.time()

  def before_step(self, step: int, poison: Callable[[], None] | None = None) -> None:
    """Applies injected faults scheduled for this step (testing only)."""
    if self.debug.get("kill_at_step") == step:
      self._steps.flush()
      os.kill(os.getpid(), signal.SIGKILL)
    if self.debug.get("hang_at_step") == step:
      while True:
        time.sleep(3600)
    if self.debug.get("raise_at_step") == step:
      raise RuntimeError(f"injected failure at step {step} (perturb raise_at_step)")
    if self.debug.get("nan_at_step") == step and poison is not None:
      poison()

  # ------------------------------------------------------------------ outputs
  def record(self, step: int, *, loss: float, grad_norm: float, lr: float, step_time_s: float,
             loss_scale: float = 1.0, skipped: bool = False, val_loss: float | None = None) -> bool:
    """Appends one StepRecord and flushes it.

    Returns False when the loss is not finite, or the grad norm is not finite on a step that was not
    skipped (an fp16 step skipped on overflow reports grad_norm inf, as DeepSpeed does).
    """
    rec = {"step": step, "loss": float(loss), "grad_norm": float(grad_norm), "lr": float(lr),
           "loss_scale": float(loss_scale), "skipped": bool(skipped), "step_time_s": float(step_time_s),
           "tokens": self.run.train.tokens_per_step}
    if val_loss is not None:
      rec["val_loss"] = float(val_loss)
    self._steps.write(json.dumps(rec) + "\n")
    self._steps.flush()
    self._step_times.append(step_time_s)
    self.steps_done = step + 1
    # an fp16 step skipped on overflow reports grad_norm inf, as DeepSpeed does: that is not a failure
    return math.isfinite(rec["loss"]) and (rec["skipped"] or math.isfinite(rec["grad_norm"]))

  def finish(self, status: str, *, final_params: dict[str, np.ndarray] | None = None, error: str | None = None,
             final_moments: dict[str, dict[str, np.ndarray]] | None = None, versions: dict[str, str] | None = None, device: str = "cpu", peak_device_bytes: int | None = None,
             state_bytes_by_memory_kind: dict[str, int] | None = None, extra: dict[str, Any] | None = None) -> dict:
    """Writes final.safetensors and FINAL_MOMENTS (each when given; moments only with params) and summary.json.

    final_moments: {'grad_rms': ..., 'sensitivity': ...}, each canonical name -> float32 array (FINAL_MOMENTS).
    Returns the summary.
    """
    if final_params is not None:
      weights.save(final_params, self.out / "final.safetensors",
                   metadata={"side": self.side, **weights.spec_metadata(self.run.model)})
      if final_moments is not None:
        flat = {f"{kind}/{name}": arr for kind, tree in final_moments.items() for name, arr in tree.items()}
        weights.save(flat, self.out / FINAL_MOMENTS, metadata={"side": self.side, "kind": "adam_moments"})
      else:  # never leave an earlier run's moments beside these params
        (self.out / FINAL_MOMENTS).unlink(missing_ok=True)
    times = self._step_times
    warm = times[2:] if len(times) > 3 else times[1:] or times
    med = statistics.median(warm) if warm else None
    t_ready = self._t_ready or time.time()
    summary = {
        "schema": SUMMARY_SCHEMA,
        "run_id": self.request.get("run_id"),  # the harness reads only summaries of its own run
        "side": self.side,
        "status": status,
        "error": error,
        "steps_completed": self.steps_done,
        "versions": {"python": platform.python_version(), **(versions or {})},
        "device": device,
        "host": {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
                 "cpu_count": os.cpu_count(), "platform": platform.platform()},
        "init_s": t_ready - self.launch_time,
        "compile_s": self.compile_s,
        "train_s": float(sum(times)),
        "step_time_s_median": med,
        "tokens_per_s": (self.run.train.tokens_per_step / med) if med else None,
        "peak_device_bytes": peak_device_bytes,
        "peak_host_rss_bytes": peak_rss_bytes(),
        "state_bytes_by_memory_kind": state_bytes_by_memory_kind or {},
        "perturbed": {**self.perturbed, **{k: list(v) if isinstance(v, tuple) else v for k, v in self.debug.items()}},
        **self._control_summary(status),
        **(extra or {}),
    }
    self._steps.close()
    (self.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary

  def fail(self, exc: BaseException, **kw) -> dict:
    """Writes a 'crashed' summary: `error` is the exception's own one-line message (what a user reads in the
    report), `traceback` its last 8000 characters (the full one is in the side's stderr.log)."""
    headline = f"{type(exc).__name__}: {exc}".strip().splitlines()
    extra = {**(kw.pop("extra", None) or {}), "traceback": "".join(traceback.format_exception(exc))[-8000:]}
    return self.finish("crashed", error=" ".join(x.strip() for x in headline)[:2000], extra=extra, **kw)


def main_guard(side_main: Callable[[SideIO], int], argv: list[str] | None = None) -> int:
  """Shared worker entry: parses `request.json --side S`, runs `side_main`, reports crashes."""
  import argparse
  ap = argparse.ArgumentParser(description="parity worker: runs one side of a comparison")
  ap.add_argument("request", help="run_dir/request.json")
  ap.add_argument("--side", required=True, choices=sorted(SIDE_WORKERS))
  args = ap.parse_args(argv)
  io = SideIO(args.request, args.side)
  try:
    return side_main(io)
  except Exception as exc:  # reported in summary.json; the harness reads it
    io.fail(exc)
    print(f"[{args.side}] crashed: {exc!r}", file=sys.stderr)
    traceback.print_exc()
    return 1
