"""What a worker tells the harness while it is busy outside its steps (a DeepSpeed op build): the phase line and the
time kept off its clock. Both halves of the binding import this module, so a side never imports the harness:
the side writes the line (`set_phase`) and moves its own deadline (`extend_deadline`); the harness shows the line
instead of `0/N steps` and stops the side's clock meanwhile (harness.runner), and the worker's deadline watcher
(harness.lifetime.watch_parent, armed by harness.boot in the same process) adds `deadline_extension()`.
Standard library only; imports neither jax nor torch.
"""
from __future__ import annotations

import os
import threading

__all__ = ["PHASE_ENV", "PHASE_FILE", "BUILD_LIMIT_S", "set_phase", "extend_deadline", "deadline_extension"]

PHASE_ENV, PHASE_FILE = "PARITY_PHASE_FILE", "phase"
"""run_dir/<side>/phase: one line saying what a worker is doing outside its steps (a DeepSpeed op build);
absent or empty otherwise. The harness shows it instead of `0/N steps` and stops the side's clock meanwhile.
The harness passes its path in PHASE_ENV (a worker started by hand has none and reports nothing)."""
BUILD_LIMIT_S = 1800.0
"""The most time a side may spend building DeepSpeed ops before its clock runs again. Measured here (2 cores,
load 5): cpu_adam 177 s, deepspeed_shm_comm 125 s, fused_adam 146 s, 7.5 min for all three (cpu_adam ~60 s idle);
30 minutes is 4x the three built in turn on a busy machine."""

_extra_s = 0.0
_lock = threading.Lock()


def extend_deadline(seconds: float) -> None:
  """Moves this worker's own deadline by `seconds` (later when positive): time spent building ops, not training.
  A build extends by BUILD_LIMIT_S when it starts and by (its duration - BUILD_LIMIT_S) when it ends."""
  global _extra_s
  with _lock:
    _extra_s += float(seconds)


def deadline_extension() -> float:
  """Seconds this worker's deadline has been moved so far (the sum of `extend_deadline` calls; 0.0 at start)."""
  with _lock:
    return _extra_s


def set_phase(text: str | None, path: str | None = None) -> None:
  """Writes (or with None clears) the phase file, the line the harness shows for this side.

  Args:
    text: one line, e.g. "building DeepSpeed op cpu_adam (first use, 1-4 min)"; None or "" clears it.
    path: the file; default os.environ[PHASE_ENV]; nothing happens without either.
  """
  path = path or os.environ.get(PHASE_ENV)
  if not path:
    return
  try:
    if text:
      with open(path + ".tmp", "w") as f:
        f.write(text.strip() + "\n")
      os.replace(path + ".tmp", path)
    elif os.path.exists(path):
      os.unlink(path)
  except OSError:
    pass  # the progress line is a courtesy; never fail a side over it
