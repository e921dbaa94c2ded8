"""One launcher for short helper processes (`parity port --verify`, the DeepSpeed acceptance oracle).

The harness is the one place that starts processes. `run_module` starts `python -m MODULE ARGS...` the way
`harness.runner.run_side` starts a worker: the repository on PYTHONPATH, unbuffered output, the launch time in
`parity.protocol.LAUNCH_ENV`, its own process group (so a timeout kills the whole group, never leaving a DeepSpeed
op build or a gloo rank behind), and a wall-clock limit. Never imports jax or torch.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from parity.protocol import LAUNCH_ENV

__all__ = ["Finished", "LaunchTimeout", "run_module", "worker_env"]

ROOT = Path(__file__).resolve().parents[1]
POLL_S = 0.1


class LaunchTimeout(RuntimeError):
  """The process was still running at its limit; its process group was killed.

  Attributes: module (str), timeout_s (float, seconds), stderr_tail (str, the last 3000 characters).
  """

  def __init__(self, module: str, timeout_s: float, stderr_tail: str):
    super().__init__(f"{module} did not finish within {timeout_s:g} s and was stopped")
    self.module, self.timeout_s, self.stderr_tail = module, timeout_s, stderr_tail


@dataclasses.dataclass
class Finished:
  """A process that exited: returncode (negative: killed by that signal), stdout/stderr (str), wall_s (seconds)."""
  returncode: int
  stdout: str
  stderr: str
  wall_s: float


def worker_env(env: dict[str, str] | None = None) -> dict[str, str]:
  """The environment every process the harness starts gets: os.environ + `env`, LAUNCH_ENV, PYTHONUNBUFFERED, and the
  repository first on PYTHONPATH. Framework settings (DS_ACCELERATOR, TORCH_EXTENSIONS_DIR, this environment's ninja
  first on PATH) are made by the process itself (torch_impl.engine.setup_distributed), identically for every caller."""
  full = {**os.environ, **(env or {}), LAUNCH_ENV: repr(time.time()), "PYTHONUNBUFFERED": "1"}
  full["PYTHONPATH"] = str(ROOT) + (os.pathsep + full["PYTHONPATH"] if full.get("PYTHONPATH") else "")
  return full


def run_module(module: str, args: list[str], *, timeout_s: float, env: dict[str, str] | None = None,
               python: str = sys.executable) -> Finished:
  """Runs `python -m module *args` from the repository root to completion.

  Args:
    module: dotted module name.
    args: its command-line arguments.
    timeout_s: wall-clock limit in seconds; past it the process group gets SIGKILL.
    env: extra environment variables.
    python: interpreter.
  Returns:
    Finished (whatever the exit code; the caller judges it).
  Raises:
    LaunchTimeout: the limit passed (the process group is dead when it is raised).
    KeyboardInterrupt: re-raised after killing the process group.
  """
  t0 = time.time()
  with tempfile.TemporaryFile() as so, tempfile.TemporaryFile() as se:
    proc = subprocess.Popen([python, "-m", module, *args], stdout=so, stderr=se, cwd=str(ROOT),
                            env=worker_env(env), start_new_session=True)
    try:
      while proc.poll() is None:
        if time.time() - t0 > timeout_s:
          _kill_group(proc)
          se.seek(0)
          raise LaunchTimeout(module, timeout_s, se.read().decode("utf-8", "replace")[-3000:])
        time.sleep(POLL_S)
    except BaseException:
      _kill_group(proc)
      raise
    so.seek(0)
    se.seek(0)
    return Finished(proc.returncode, so.read().decode("utf-8", "replace"), se.read().decode("utf-8", "replace"),
                    time.time() - t0)


def _kill_group(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  proc.wait()
