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
                      ops (`parity.phase.extend_deadline`), which the harness does not count against the timeout
                      either. So a worker whose parent is alive but no longer watching still ends.

The worker side is one call, `watch_parent()`, first thing in each worker's main. Without these
variables (a worker started by hand or by a test) it does nothing.

The harness side also decides what a Ctrl-C (SIGINT) or SIGTERM of the `parity` process stops (`stop_signals`):
  - the first one raises KeyboardInterrupt where the process is, unless what it is doing is *held* (`activity(...,
    hold=True)`: comparing records, writing the report); a held one is kept and takes effect when the held
    activity ends (KeyboardInterrupt), before anything new starts (`check_stop`), or where the code takes it
    (`take_stop`: a loop over the sides stops there and reports);
  - every later one is ignored, with a line on stderr: the first one's shutdown (kill the worker, write the report
    of what ran) is never cut short. Ctrl-\\ (SIGQUIT) or kill -9 still end the process at once.
What the process was doing at the first one, whether it was held, the later ones, and what the command says is on
disk (`on_disk`) are kept in `stop_state()` for the message the command ends with. Imports neither jax nor torch.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Iterator

from parity import phase

__all__ = ["PARENT_PID_ENV", "PARENT_FD_ENV", "DEADLINE_ENV", "DEADLINE_GRACE_S", "spawn", "workers_started",
           "kill_tree", "release", "watch_parent", "LAUNCHED_ENV", "StopState", "stop_signals", "activity",
           "stop_state", "check_stop",
           "take_stop", "on_disk"]

PARENT_PID_ENV, PARENT_FD_ENV, DEADLINE_ENV = "PARITY_PARENT_PID", "PARITY_PARENT_FD", "PARITY_DEADLINE"
LAUNCHED_ENV = "PARITY_BIND_TO_LAUNCHER"
"""Set ('1') on an engine launcher parity starts (torchrun, DeepSpeed's runner), and inherited by the ranks it
starts: a rank, which has no PARENT_PID_ENV of its own (the launcher's watch_parent removed it), then dies with its
launcher (PR_SET_PDEATHSIG with SIGKILL, which a stopped or blocked rank cannot hold off; harness.ranks also kills
any rank still alive once the launcher has ended). torchrun starts each rank in a session of its own, so killing the
launcher's process group does not reach them: without this a launcher killed by SIGKILL left its FSDP2 ranks
training, and writing into a run folder whose report was already written."""
DEADLINE_GRACE_S = 30.0
"""The worker's own deadline is this much later than the harness's timeout, so that while the harness is
alive its timeout (which writes the 'timeout' summary) always fires first; 30 s covers a harness poll
(0.1 s) plus a SIGKILL and reap of a large process (seconds) with margin."""
PR_SET_PDEATHSIG = 1
PARENT_DEATH_SIGNAL = signal.SIGTERM
"""What the kernel sends a worker whose parent died: catchable, so the worker kills its descendants first."""

_started = 0


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


def _set_pdeathsig(sig: int = PARENT_DEATH_SIGNAL) -> bool:
  if not sys.platform.startswith("linux"):
    return False
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
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
    left = deadline + phase.deadline_extension() - time.time()
    if left <= 0:
      _die("past its deadline (the side's timeout plus grace); the harness is no longer watching it")
    time.sleep(min(left, 1.0))


def watch_parent(environ=os.environ) -> dict[str, object]:
  """Binds this worker to the harness that started it: dies with it, and by its own deadline.

  Reads (and removes, so grandchildren do not inherit them) the variables `spawn` set; without them, a rank started by
  an engine launcher parity started (LAUNCHED_ENV) is bound to that launcher by PR_SET_PDEATHSIG, and anything else
  is left alone. Returns what was armed: {'pdeathsig': bool, 'pipe': bool, 'deadline': epoch seconds or None}.
  Raises nothing: a malformed variable disarms that mechanism only.
  """
  pid, fd, deadline = (environ.pop(k, None) for k in (PARENT_PID_ENV, PARENT_FD_ENV, DEADLINE_ENV))
  armed: dict[str, object] = {"pdeathsig": False, "pipe": False, "deadline": None}
  if pid is None:
    if environ.get(LAUNCHED_ENV) == "1":  # a rank of an engine launcher that parity started: dies with the launcher,
      armed["pdeathsig"] = _set_pdeathsig(signal.SIGKILL)  # by SIGKILL: a rank stopped (SIGSTOP) or blocked in a C
      if os.getppid() == 1:  # collective runs no handler; the launcher died before the prctl
        _die("its launcher was gone before it started")
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


# ----------------------------------------------------------------------------- stopping the parity process itself
@dataclasses.dataclass
class _Activity:
  what: str | None
  hold: bool
  on_stop: str
  within: str


@dataclasses.dataclass
class StopState:
  """What happened to this process's stop signals (SIGINT, SIGTERM) while `stop_signals` was armed.

  Attributes:
    signal: the first one's name ('SIGINT', 'SIGTERM'); None while none came.
    doing: the `activity` texts open when it came, innermost first (those without text left out).
    within: the `within` phrases of the activities around the innermost one with a text, innermost first.
    on_stop: what stopping did to the innermost of them (e.g. "it was killed with its child processes"); "" if unsaid.
    held: it came while a held activity ran, which was finished before the stop took effect.
    later: the names of the signals after the first, in order; each was ignored.
    on_disk: the command's last word on what it has left on disk (`on_disk`); None if it said nothing.
  """
  signal: str | None = None
  doing: tuple[str, ...] = ()
  within: tuple[str, ...] = ()
  on_stop: str = ""
  held: bool = False
  later: list[str] = dataclasses.field(default_factory=list)
  on_disk: str | None = None
  pending: bool = False
  """A held signal not yet turned into KeyboardInterrupt."""


_stop = StopState()
_activities: list[_Activity] = []
_armed = False
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _say(text: str) -> None:
  """One line on stderr from a signal handler (os.write: print may be in the middle of a write itself)."""
  try:
    os.write(2, text.encode("utf-8", "replace"))
  except OSError:
    pass


def _on_stop_signal(signum, frame) -> None:
  name = signal.Signals(signum).name
  st = _stop
  if st.signal is not None:
    st.later.append(name)
    _say(f"parity: {name} again: ignored, it is already stopping (after the first {st.signal}) and finishes what "
         f"it must write first; Ctrl-\\ or `kill -9 {os.getpid()}` ends it now, leaving what is written so far\n")
    return
  st.signal = name
  st.doing = tuple(a.what for a in reversed(_activities) if a.what)
  inner = max((i for i, a in enumerate(_activities) if a.what), default=None)
  if inner is not None:  # the words of the innermost activity that has some, and of those around it
    st.within = tuple(a.within for a in reversed(_activities[:inner]) if a.within)
    st.on_stop = _activities[inner].on_stop
  if _activities and _activities[-1].hold:
    st.held = st.pending = True
    what = st.doing[0] if st.doing else "what it is doing"
    _say(f"parity: {name} received while {what}; it stops once that is finished\n")
    return
  raise KeyboardInterrupt


def _deliver() -> None:
  _stop.pending = False
  raise KeyboardInterrupt


@contextlib.contextmanager
def stop_signals() -> Iterator[StopState]:
  """Arms the stop rule of the module docstring for SIGINT and SIGTERM while the block runs (a fresh StopState),
  then restores the handlers there were; a signal this process ignores (SIG_IGN: a shell's background job is
  started with SIGINT ignored) stays ignored. Nested, or outside the main thread (where Python cannot set handlers),
  it arms nothing and yields the state in use.

  Yields:
    The StopState, which the block reads when KeyboardInterrupt reaches it.
  """
  global _stop, _armed
  if _armed:
    yield _stop
    return
  if threading.current_thread() is not threading.main_thread():
    _stop = StopState()  # no handler: only its on_disk is ever filled in
    yield _stop
    return
  old = {s: signal.getsignal(s) for s in STOP_SIGNALS}
  _stop, _armed = StopState(), True
  _activities.clear()
  try:
    for s, handler in old.items():
      if handler is not signal.SIG_IGN:  # a signal ignored on purpose (a background job's SIGINT) stays ignored
        signal.signal(s, _on_stop_signal)
    yield _stop
  finally:
    for s, handler in old.items():
      signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: set outside Python; default it
    _armed = False


@contextlib.contextmanager
def activity(what: str | None, *, hold: bool = False, on_stop: str = "", within: str = "") -> Iterator[None]:
  """Marks what the process does during the block, for the stop rule and the message.

  Args:
    what: a clause that completes "interrupted while ...", e.g. "side jax was running (runs/x/jax)"; None: none.
    hold: a first stop signal in the block (with no activity nested inside it that is not held) is kept: when the
      block ends it raises KeyboardInterrupt, unless an enclosing activity is held too or the block took it
      (`take_stop`). A block that starts something new calls `check_stop` first.
    on_stop: what a stop does to this activity, for the message ("it was killed with its child processes").
    within: a phrase placing an activity inside this one ("in the reruns"), for the message.
  Raises:
    KeyboardInterrupt: as `hold` says.
  """
  _activities.append(_Activity(what, hold, on_stop, within))
  try:
    yield
  finally:
    _activities.pop()
  if hold and _stop.pending and not any(a.hold for a in _activities):
    _deliver()


def check_stop() -> None:
  """Raises KeyboardInterrupt if a stop signal was held and has not taken effect: call it before starting anything
  new (a worker), so that nothing starts once the user asked to stop."""
  if _stop.pending:
    _deliver()


def take_stop() -> KeyboardInterrupt | None:
  """Takes a held stop signal: the caller finishes what it does (its report says it was interrupted) and re-raises
  the KeyboardInterrupt returned; None when none is held."""
  if not _stop.pending:
    return None
  _stop.pending = False
  return KeyboardInterrupt()


def stop_state() -> StopState:
  """The current StopState (a fresh one for each `stop_signals` block)."""
  return _stop


def on_disk(text: str) -> None:
  """Records what the command has left on disk so far, in one sentence, for the message a stop ends it with."""
  _stop.on_disk = text
