"""The run folder's files and their readers (one half of the run protocol; `parity.protocol` has the map).

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
                                lr_t / (sqrt(v_hat_t) + eps) (parity.verdict.params.AdamSensitivity); read by the params
                                rule (parity.verdict.params.param_checks); optional

A worker (`parity.protocol.workers`) writes them through `parity.protocol.side.SideIO`, so both frameworks write
identical records.

StepRecord keys (units in names): step (0-based), loss (mean token cross-entropy,
nats, averaged over the micro batches of the step), grad_norm (global L2 norm of
the gradient before clipping), lr (learning rate applied in this step),
loss_scale (fp16 loss scale, 1.0 otherwise), skipped (update skipped on
overflow), step_time_s (wall seconds of the step, host-synchronised), tokens
(tokens consumed by the step), val_loss (held-out loss after the step, only on
eval steps).

Run control keys of a request: `parity.protocol.control`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from parity import weights

__all__ = ["REQUEST_SCHEMA", "SUMMARY_SCHEMA", "LAUNCH_ENV", "DEBUG_KEYS", "STEP_LIST_KEYS", "FINAL_MOMENTS",
           "MOMENT_KINDS", "CHECKPOINT_DIR", "CHECKPOINT_META", "CHECKPOINT_SCHEMA", "parse_debug_value",
           "read_steps", "read_summary", "read_moments", "read_checkpoint_meta", "PLANTED_KILL",
           "PLANTED_HANG", "tail_text", "count_lines"]

REQUEST_SCHEMA = "parity.request/1"
SUMMARY_SCHEMA = "parity.summary/1"
LAUNCH_ENV = "PARITY_LAUNCH_TIME"
"""Environment variable holding time.time() when the harness spawned the worker."""
PLANTED_KILL = "[parity] planted kill"
"""What a worker writes to stderr just before the fault injection kill_at_step kills it, so the harness reports the
kill as planted, not as one from outside or the OOM killer."""
PLANTED_HANG = "[parity] planted hang"
"""What a worker writes to stderr when the fault injection hang_at_step stops it, so a hang is named as planted."""
DEBUG_KEYS = ("nan_at_step", "kill_at_step", "hang_at_step", "raise_at_step", "overflow_at_steps", "fault_rank")
"""Fault injections a request may carry per side (besides model./train. overrides), for testing failure paths.
Each takes a step number (0-based optimizer step); `overflow_at_steps` takes a list of them: at those steps
the side makes its (loss-scaled) gradient overflow, as an fp16 run with too large a loss scale would.
`fault_rank` (a rank number) limits kill/hang/raise_at_step to that rank of a multi-rank side (docs/multirank.md)."""
STEP_LIST_KEYS = ("overflow_at_steps",)
"""DEBUG_KEYS whose value is a list of steps."""


FINAL_MOMENTS = "final_moments.safetensors"
"""In run_dir/<side>/: per canonical param (float32, the param's shape) 'grad_rms/<name>' (Adam's bias-corrected
sqrt(v_hat) at the end of the run) and 'sensitivity/<name>' (sum_t lr_t / (sqrt(v_hat_t) + eps), units
param / gradient), written by every side whose optimizer keeps a second moment."""
MOMENT_KINDS = ("grad_rms", "sensitivity")

CHECKPOINT_DIR = "checkpoint"
"""Folder, inside run_dir/<side>/, of the checkpoint `save_checkpoint_at_step` writes."""
CHECKPOINT_META = "meta.json"
"""The checkpoint's description, written after its framework files: a folder without it is incomplete."""
CHECKPOINT_SCHEMA = "parity.checkpoint/1"


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
    raise ValueError(f"{key} takes a {'rank' if key == 'fault_rank' else 'step'} number (an integer >= 0); "
                     f"got {value!r}")
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


def tail_text(path: Path, n: int) -> str:
  """The last `n` bytes of a worker's log as text (undecodable bytes replaced); "" when the file cannot be read."""
  try:
    return Path(path).read_bytes()[-n:].decode("utf-8", "replace")
  except OSError:
    return ""


def count_lines(path: Path) -> int:
  """Lines in a file (records a worker has appended to steps.jsonl so far); 0 when it cannot be read."""
  try:
    with open(path, "rb") as f:
      return sum(1 for _ in f)
  except OSError:
    return 0

