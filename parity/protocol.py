"""The run protocol between the harness and a side's worker process.

Files of one run (DESIGN.md):

  run_dir/request.json          RunRequest (schema 'parity.request/1'), written by the harness
  run_dir/init.safetensors      canonical initial weights (parity.weights)
  run_dir/batches.npy           uint16 (steps, grad_accum_steps, micro_batch_size, seq_len + 1)
  run_dir/val_batches.npy       uint16 (eval_batches, micro_batch_size, seq_len + 1)
  run_dir/<side>/steps.jsonl    one StepRecord per optimizer step, flushed as it is written
  run_dir/<side>/summary.json   Summary, written once at the end (also on failure when possible)
  run_dir/<side>/final.safetensors  canonical final fp32 (master) params

A worker is `python -m <package>.worker run_dir/request.json --side <side>`; it
uses `SideIO` for everything above, so both frameworks write identical records.

StepRecord keys (units in names): step (0-based), loss (mean token cross-entropy,
nats, averaged over the micro batches of the step), grad_norm (global L2 norm of
the gradient before clipping), lr (learning rate applied in this step),
loss_scale (fp16 loss scale, 1.0 otherwise), skipped (update skipped on
overflow), step_time_s (wall seconds of the step, host-synchronised), tokens
(tokens consumed by the step), val_loss (held-out loss after the step, only on
eval steps).
"""
from __future__ import annotations

import json
import math
import os
import platform
import resource
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np

from parity import schedule, weights
from parity.spec import RunSpec, apply_overrides, from_dict

__all__ = ["SideIO", "SIDE_WORKERS", "REQUEST_SCHEMA", "LAUNCH_ENV", "DEBUG_KEYS", "STEP_LIST_KEYS", "parse_debug_value",
           "read_steps", "read_summary"]

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
    self.run = apply_overrides(base, [f"{k}={json.dumps(v)}" for k, v in perturb.items()]) if perturb else base
    self.perturbed = perturb
    self._steps = open(self.out / "steps.jsonl", "w")
    self._step_times: list[float] = []
    self._t_ready: float | None = None
    self.compile_s = 0.0
    self.steps_done = 0
    (self.out / "pid").write_text(str(os.getpid()))

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
    """Appends one StepRecord and flushes it. Returns False when loss or grad norm is not finite."""
    rec = {"step": step, "loss": float(loss), "grad_norm": float(grad_norm), "lr": float(lr),
           "loss_scale": float(loss_scale), "skipped": bool(skipped), "step_time_s": float(step_time_s),
           "tokens": self.run.train.tokens_per_step}
    if val_loss is not None:
      rec["val_loss"] = float(val_loss)
    self._steps.write(json.dumps(rec) + "\n")
    self._steps.flush()
    self._step_times.append(step_time_s)
    self.steps_done = step + 1
    return math.isfinite(rec["loss"]) and math.isfinite(rec["grad_norm"])

  def finish(self, status: str, *, final_params: dict[str, np.ndarray] | None = None, error: str | None = None,
             versions: dict[str, str] | None = None, device: str = "cpu", peak_device_bytes: int | None = None,
             state_bytes_by_memory_kind: dict[str, int] | None = None, extra: dict[str, Any] | None = None) -> dict:
    """Writes final.safetensors (when given) and summary.json. Returns the summary."""
    if final_params is not None:
      weights.save(final_params, self.out / "final.safetensors",
                   metadata={"side": self.side, **weights.spec_metadata(self.run.model)})
    times = self._step_times
    warm = times[2:] if len(times) > 3 else times[1:] or times
    med = statistics.median(warm) if warm else None
    t_ready = self._t_ready or time.time()
    summary = {
        "schema": SUMMARY_SCHEMA,
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
        **(extra or {}),
    }
    self._steps.close()
    (self.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary

  def fail(self, exc: BaseException, **kw) -> dict:
    """Writes a 'crashed' summary carrying the traceback."""
    return self.finish("crashed", error="".join(traceback.format_exception(exc))[-4000:], **kw)


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
