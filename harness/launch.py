"""One launcher for short helper processes (`parity port --verify`, the DeepSpeed acceptance oracle).

The harness is the one place that starts processes. `run_module` starts `python -m harness.boot MODULE ARGS...` the
way `harness.runner.run_side` starts a worker: the workers' environment (`harness.env.worker_env`: this environment's
ninja and TORCH_EXTENSIONS_DIR, so an op is never rebuilt because --verify and compare alternate; the repository on
PYTHONPATH; unbuffered output), the launch time in `parity.protocol.LAUNCH_ENV`, bound to this process
(`harness.lifetime.spawn`: its own process group, dies with its parent and by its own deadline), and a wall-clock
limit past which the whole group is killed. Never imports jax or torch.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
import time

from harness import env as _env
from harness import lifetime
from parity.protocol import LAUNCH_ENV

__all__ = ["Finished", "LaunchTimeout", "run_module", "worker_env", "ROOT"]

ROOT = _env.ROOT
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
  """The environment of a process the harness starts: `harness.env.worker_env(env)` plus LAUNCH_ENV (str -> str)."""
  return _env.worker_env({**(env or {}), LAUNCH_ENV: repr(time.time())})


def run_module(module: str, args: list[str], *, timeout_s: float, env: dict[str, str] | None = None,
               python: str = sys.executable) -> Finished:
  """Runs `python -m module *args` (through harness.boot) from the repository root to completion.

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
    proc = lifetime.spawn([python, "-m", "harness.boot", module, *args], stdout=so, stderr=se, cwd=str(ROOT),
                          env=worker_env(env), timeout_s=timeout_s)
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
    finally:
      lifetime.release(proc)
    so.seek(0)
    se.seek(0)
    return Finished(proc.returncode, so.read().decode("utf-8", "replace"), se.read().decode("utf-8", "replace"),
                    time.time() - t0)


def _kill_group(proc: subprocess.Popen) -> None:
  """Kills the process's group and every descendant (a DeepSpeed op build's compilers run in groups of their own)."""
  lifetime.kill_tree(proc.pid)
  proc.wait()
