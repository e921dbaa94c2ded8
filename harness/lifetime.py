"""No process the harness starts outlives its parent or its deadline.

The harness side (`spawn`) starts a worker in its own session (so the harness can kill its whole
process group) and hands it three things through the environment:

  PARITY_PARENT_PID   the harness's pid. The worker asks Linux for SIGTERM when the thread that
                      started it dies (prctl PR_SET_PDEATHSIG; the harness starts workers from the
                      thread that then waits for them), and exits at once if its parent is already
                      gone when it asks (the parent died between fork and prctl). The signal is a
                      catchable one on purpose: its handler (`_die`) SIGKILLs the worker's descendants
                      before the worker itself. A SIGKILL would end the worker before it could, and
                      ninja starts each compiler in a process group of its own, so a DeepSpeed op
                      build's `ninja`/`c++`/`cc1plus` would run on as orphans (PPID 1) for minutes.
  PARITY_PARENT_FD    the read end of a pipe whose only write end the harness holds. When the harness
                      dies, however it dies (kill -9 included), the kernel closes that end and the
                      worker reads EOF: a daemon thread then kills the worker's process group. This is
                      the portable fallback (macOS has no PDEATHSIG) and also covers a worker whose
                      parent thread outlives the harness's interest in it.
  PARITY_DEADLINE     epoch seconds past which the worker kills its own process group: the side's
                      timeout plus DEADLINE_GRACE_S, moved later by the time spent building DeepSpeed
                      ops (`extend_deadline`), which the harness does not count against the timeout
                      either. So a worker whose parent is alive but no longer watching still ends.

The worker side is one call, `watch_parent()`, first thing in each worker's main. Without these
variables (a worker started by hand or by a test) it does nothing. Imports neither jax nor torch.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO

__all__ = ["PARENT_PID_ENV", "PARENT_FD_ENV", "DEADLINE_ENV", "PHASE_ENV", "PHASE_FILE", "DEADLINE_GRACE_S",
           "BUILD_LIMIT_S", "spawn", "workers_started", "kill_tree", "release", "watch_parent", "extend_deadline",
           "set_phase"]

PARENT_PID_ENV, PARENT_FD_ENV, DEADLINE_ENV = "PARITY_PARENT_PID", "PARITY_PARENT_FD", "PARITY_DEADLINE"
PHASE_ENV, PHASE_FILE = "PARITY_PHASE_FILE", "phase"
"""run_dir/<side>/phase: one line saying what a worker is doing outside its steps (a DeepSpeed op build);
absent or empty otherwise. The harness shows it instead of `0/N steps` and stops the side's clock meanwhile.
The harness passes its path in PHASE_ENV (a worker started by hand has none and reports nothing)."""
DEADLINE_GRACE_S = 30.0
"""The worker's own deadline is this much later than the harness's timeout, so that while the harness is
alive its timeout (which writes the 'timeout' summary) always fires first; 30 s covers a harness poll
(0.1 s) plus a SIGKILL and reap of a large process (seconds) with margin."""
BUILD_LIMIT_S = 1800.0
"""The most time a side may spend building DeepSpeed ops before its clock runs again. Measured here (2 cores,
load 5): cpu_adam 177 s, deepspeed_shm_comm 125 s, fused_adam 146 s, 7.5 min for all three (cpu_adam ~60 s idle);
30 minutes is 4x the three built in turn on a busy machine."""
PR_SET_PDEATHSIG = 1
PARENT_DEATH_SIGNAL = signal.SIGTERM
"""What the kernel sends a worker whose parent died: catchable, so the worker kills its descendants first."""

_extra_s = 0.0
_started = 0
_lock = threading.Lock()


def spawn(cmd: list[str], *, env: dict[str, str], timeout_s: float, stdout: IO | int | None = None,
          stderr: IO | int | None = None, cwd: str | None = None) -> subprocess.Popen:
  """Starts `cmd` in a new session, bound to this process (see the module docstring).

  Args:
    cmd: argv; the program should call `watch_parent()` early (all parity workers do).
    env: its environment (the binding variables are added).
    timeout_s: the caller's timeout, seconds; the child's own deadline is DEADLINE_GRACE_S later.
    stdout, stderr, cwd: as subprocess.Popen.
  Returns:
    The Popen; pass it to `release` once it has been reaped (closes the pipe's write end).
  """
  r, w = os.pipe()  # both ends non-inheritable; only r is passed, so w lives in this process alone
  env = {**env, PARENT_PID_ENV: str(os.getpid()), PARENT_FD_ENV: str(r),
         DEADLINE_ENV: repr(time.time() + float(timeout_s) + DEADLINE_GRACE_S)}
  try:
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env, cwd=cwd, start_new_session=True,
                            pass_fds=(r,))
  except BaseException:
    os.close(w)
    raise
  finally:
    os.close(r)
  global _started
  _started += 1
  proc._parity_parent_w = w  # type: ignore[attr-defined]
  return proc


def workers_started() -> int:
  """How many workers `spawn` has started in this process (0: nothing ran yet, so nothing was killed or reported)."""
  return _started


def release(proc: subprocess.Popen) -> None:
  """Closes the binding pipe of a child started by `spawn` (idempotent)."""
  w = getattr(proc, "_parity_parent_w", None)
  if w is not None:
    proc._parity_parent_w = None  # type: ignore[attr-defined]
    os.close(w)


def _descendants(pid: int) -> list[int]:
  """Every live descendant of `pid` (from /proc; [] where there is none). ninja starts each compiler in a process
  group of its own, so killing a worker's group alone leaves its compilers running."""
  children: dict[int, list[int]] = {}
  try:
    names = os.listdir("/proc")
  except OSError:
    return []
  for name in names:
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/stat", "rb") as f:
        ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
      continue
    children.setdefault(ppid, []).append(int(name))
  out, todo = [], [pid]
  while todo:
    for c in children.get(todo.pop(), []):
      out.append(c)
      todo.append(c)
  return out


def kill_tree(pid: int) -> None:
  """SIGKILL to the process group led by `pid` and to every descendant of `pid`, in whatever group (a DeepSpeed op
  build's compilers included). Descendants are listed first: once their parent dies they are re-parented."""
  rest = _descendants(pid)
  for target in (lambda: os.killpg(pid, signal.SIGKILL), *(lambda c=c: os.kill(c, signal.SIGKILL) for c in rest)):
    try:
      target()
    except (ProcessLookupError, PermissionError):
      pass


def _die(why: str) -> None:
  """Kills this worker and everything it started (its process group, when it leads one), else exits."""
  try:
    sys.stderr.write(f"[parity] worker {os.getpid()} ending: {why}\n")
    sys.stderr.flush()
  except (OSError, ValueError):
    pass
  for c in _descendants(os.getpid()):  # children first: this process dies with its group below
    try:
      os.kill(c, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
  if os.getpgrp() == os.getpid():
    os.killpg(os.getpid(), signal.SIGKILL)
  os._exit(137)


def _set_pdeathsig() -> bool:
  if not sys.platform.startswith("linux"):
    return False
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0) == 0
  except (OSError, AttributeError):
    return False


def _on_parent_death_signal(signum, frame) -> None:
  """The handler of PARENT_DEATH_SIGNAL (and of a plain SIGTERM, which asks for the same): the tree goes first."""
  _die(f"signal {signal.Signals(signum).name}: its parity process is gone or asked it to stop")


def _arm_parent_death_signal() -> bool:
  """Installs the handler, then asks the kernel for the signal. Without a handler (not the main thread) a SIGTERM
  would end the worker as SIGKILL did, orphaning its compilers: then only the pipe watcher ends the tree."""
  try:
    signal.signal(PARENT_DEATH_SIGNAL, _on_parent_death_signal)
  except ValueError:  # not the main thread
    return False
  return _set_pdeathsig()


def _watch_pipe(fd: int) -> None:
  try:
    while os.read(fd, 1):
      pass
  except OSError:
    pass
  _die("the parity process that started it is gone (its pipe closed)")


def _watch_deadline(deadline: float) -> None:
  while True:
    with _lock:
      left = deadline + _extra_s - time.time()
    if left <= 0:
      _die("past its deadline (the side's timeout plus grace); the harness is no longer watching it")
    time.sleep(min(left, 1.0))


def watch_parent(environ=os.environ) -> dict[str, object]:
  """Binds this worker to the harness that started it: dies with it, and by its own deadline.

  Reads (and removes, so grandchildren do not inherit them) the variables `spawn` set; without them does
  nothing. Returns what was armed: {'pdeathsig': bool, 'pipe': bool, 'deadline': epoch seconds or None}.
  Raises nothing: a malformed variable disarms that mechanism only.
  """
  pid, fd, deadline = (environ.pop(k, None) for k in (PARENT_PID_ENV, PARENT_FD_ENV, DEADLINE_ENV))
  armed: dict[str, object] = {"pdeathsig": False, "pipe": False, "deadline": None}
  if pid is None:
    return armed
  armed["pdeathsig"] = _arm_parent_death_signal()
  try:
    if os.getppid() != int(pid):
      _die(f"its parent {pid} was gone before it started")
  except ValueError:
    pass
  try:
    threading.Thread(target=_watch_pipe, args=(int(fd),), name="parity-parent-pipe", daemon=True).start()
    armed["pipe"] = True
  except (TypeError, ValueError):
    pass
  try:
    armed["deadline"] = float(deadline)
    threading.Thread(target=_watch_deadline, args=(float(deadline),), name="parity-deadline", daemon=True).start()
  except (TypeError, ValueError):
    armed["deadline"] = None
  return armed


def extend_deadline(seconds: float) -> None:
  """Moves this worker's own deadline by `seconds` (later when positive): time spent building ops, not training.
  A build extends by BUILD_LIMIT_S when it starts and by (its duration - BUILD_LIMIT_S) when it ends."""
  global _extra_s
  with _lock:
    _extra_s += float(seconds)


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
