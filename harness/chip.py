"""One parity side at a time on a TPU chip.

The TPU runtime lets one process hold a chip: a second JAX process that opens it fails at start ("The TPU is
already in use by process ..."). Two `parity compare` runs started together on a TPU VM (a grid of cells, a plant
table, a user's second terminal) would each lose a side that way. So a side that opens the chip holds an exclusive
lock on a file shared by every parity process on the machine (`LOCK_PATH`) from before its worker starts until it
has exited; another side that needs the chip waits for it, saying who holds it, and its time limit starts when it
gets the chip. Sides that never open it (PyTorch on the host CPU, JAX pinned to the CPU by JAX_PLATFORMS, any side
on a machine that is no TPU VM) never touch the lock. A process outside parity that holds the chip is not seen
here: the JAX side then fails at start and its error says so.

Never imports jax or torch.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
import time
from pathlib import Path
from typing import Callable, Iterator

from harness import lifetime
from parity.sides import side_record

__all__ = ["LOCK_ENV", "LOCK_PATH", "ChipWaitInterrupted", "ChipLockError", "holds_chip", "chip_turn", "busy_hint"]

LOCK_ENV = "PARITY_CHIP_LOCK"  # another lock file (tests; a machine whose /tmp is not shared by its users)
LOCK_PATH = Path("/tmp/parity-tpu.lock")  # /tmp, not $TMPDIR: the chip is the machine's, as libtpu's own lock file
POLL_S = 0.2
# what the TPU runtime says when another process holds the chip (its wording has changed across libtpu versions)
_BUSY = re.compile(r"TPU is already in use(?: by process with pid (\d+))?|multi-process lockfile|"
                   r"libtpu\.so already in use|/dev/(?:accel|vfio/)\d+\S*: Device or resource busy", re.IGNORECASE)
_HELD: list[int] = []  # lock fds this process holds: a nested turn (one process, one chip) does not wait on itself


class ChipLockError(OSError):
  """The chip lock file cannot be used (a folder, a symlink, another program's file, no permission); `str` names it
  and the fix."""


class ChipWaitInterrupted(KeyboardInterrupt):
  """A stop signal came while the side waited for the chip; `holder` (str) says who held it."""

  def __init__(self, holder: str):
    super().__init__(holder)
    self.holder = holder


def holds_chip(side: str, env: dict[str, str], evidence: Callable[[], str | None] | None = None) -> bool:
  """Whether `side`, started with environment `env`, opens a TPU chip.

  Args:
    side: side name.
    env: the worker's full environment (JAX_PLATFORMS there decides: 'cpu' keeps JAX off the chip).
    evidence: `harness.doctor.tpu_evidence` (or a test's stand-in): why this machine is a TPU VM, or None.
  """
  if not side_record(side).opens_chip:  # its worker never opens JAX's default backend
    return False
  platforms = env.get("JAX_PLATFORMS", "").strip().lower()
  if platforms and "tpu" not in platforms.split(","):
    return False
  if evidence is None:
    from harness.doctor import tpu_evidence as evidence
  return evidence() is not None


def _lock_path(env: dict[str, str]) -> Path:
  return Path(env.get(LOCK_ENV) or os.environ.get(LOCK_ENV) or LOCK_PATH)


def _open_lock(path: Path) -> int:
  """The lock file's descriptor: created (mode 0666, so every user of the machine can take it) or an existing parity
  lock, never through a symlink and never another program's file. Raises ChipLockError naming the path."""
  fix = f"point {LOCK_ENV} at a file parity may create, or remove {path} if no parity run holds it"
  try:
    try:
      fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
      with contextlib.suppress(OSError):  # a umask must not lock the next user out
        os.fchmod(fd, 0o666)
      return fd
    except FileExistsError:
      fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
  except OSError as exc:
    raise ChipLockError(f"the TPU lock file {path} cannot be opened ({exc.strerror or exc}): {fix}") from None
  st = os.fstat(fd)
  text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() if stat.S_ISREG(st.st_mode) else None
  ok = text == "" or (text is not None and re.fullmatch(r'\{"pid": \d+, "side": .*\}', text) is not None)
  if not ok:
    os.close(fd)
    raise ChipLockError(f"the TPU lock file {path} is not a parity chip lock (a "
                        f"{'file with other content' if text is not None else 'special file'}): {fix}")
  return fd


def _holder(fd: int) -> str:
  """Who holds the lock, from what the holder wrote in the file ('parity pid N (side jax of runs/x)')."""
  try:
    info = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace") or "{}")
    return f"parity pid {info['pid']} (side {info['side']} of {info['run']})"
  except (OSError, ValueError, KeyError, TypeError):
    return "another parity run"


@contextlib.contextmanager
def chip_turn(side: str, run: str, env: dict[str, str], *,
              on_wait: Callable[[str], None] | None = None,
              evidence: Callable[[], str | None] | None = None) -> Iterator[float]:
  """Holds the machine's chip lock for the block when `side` opens the chip (`holds_chip`); else does nothing.

  Args:
    side, env: as `holds_chip`.
    run: the run folder, written into the lock file for those who wait.
    on_wait: called once with a line ('waiting for the TPU: parity pid 12 (side jax of runs/a) holds it') when
      the chip is taken, and with '' once it is this side's.
    evidence: as `holds_chip`.
  Yields:
    seconds waited for the chip (0.0 when it was free or not needed).
  Raises:
    ChipWaitInterrupted: a stop signal (Ctrl-C, SIGTERM) came while it waited; the side never started.
  """
  if not holds_chip(side, env, evidence):
    yield 0.0
    return
  if _HELD:  # this process already holds the chip
    yield 0.0
    return
  path = _lock_path(env)
  fd = _open_lock(path)
  try:
    t0, said, holder = time.time(), False, ""
    while True:
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        break
      except BlockingIOError:
        holder = _holder(fd)
        if not said and on_wait is not None:
          on_wait(f"waiting for the TPU: {holder} holds it")
        said = True
      try:
        with lifetime.activity(f"side {side} was waiting for the TPU ({holder})", on_stop="it never started"):
          lifetime.check_stop()
          time.sleep(POLL_S)
      except KeyboardInterrupt:
        raise ChipWaitInterrupted(holder) from None
    waited = time.time() - t0
    _HELD.append(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "side": side, "run": run}).encode(), 0)
    if said and on_wait is not None:
      on_wait("")
    try:
      yield waited
    finally:
      _HELD.remove(fd)
      with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
      fcntl.flock(fd, fcntl.LOCK_UN)
  finally:
    os.close(fd)


def busy_hint(text: str) -> str | None:
  """The line to put before a side's error when the TPU runtime refused it because another process held the chip
  (read from the side's error and stderr), or None."""
  m = _BUSY.search(text or "")
  if m is None:
    return None
  who = f"process {m.group(1)}" if m.group(1) else "another process"
  return (f"the TPU was held by {who}, not a parity side (parity's sides wait for each other): stop that process, "
          "or run this side on the host CPU with JAX_PLATFORMS=cpu")
