"""A pytest plugin (registered by tests/conftest.py) that fails every test which starts a process without saying so.

A test that starts a process (a worker, `python -m parity.cli ...`, a spawned helper, a multiprocessing child) must
carry the `process` marker; one that can start DeepSpeed (a worker of the deepspeed side, `port --verify`, a
`--deepspeed-config` run, the op build) must also carry `requires_deepspeed`, the marker the op-build fixture keys
off. The check is made where every process starts, not in the test's text: subprocess's fork_exec,
_posixsubprocess.fork_exec (multiprocessing), os.fork/forkpty/posix_spawn/system are wrapped once, at import, and
consult the test running now. The start is refused with UnmarkedProcess, and the test fails after the phase
(setup, call or teardown) even where the code under test caught the error: a test cannot pass by swallowing it.
Fixtures count for the test whose setup runs them (a session fixture that starts processes marks its first user).
"""
from __future__ import annotations

import _posixsubprocess
import contextlib
import os
import subprocess
import threading

import pytest


class UnmarkedProcess(RuntimeError):
  """A process start in a test that lacks the marker it needs (the message names the test, the command, the fix)."""


PROBES = frozenset({"git", "uname"})
"""Read-only probes that need no marker: the environment block of every run asks `git status --porcelain` and
`git rev-parse` (parity/environment.py), and platform.processor() runs `uname -p` once per process; each takes
milliseconds and leaves nothing running, so charging them would mark every in-process pipeline test `process`.
Anything else (python, bash, sleep, ninja, chromium, a worker) needs the marker."""

_LOCK = threading.RLock()
_STATE: dict = {"test": None, "process": True, "deepspeed": True, "allowed": 0, "seen": []}
"""The test running now (nodeid), whether it may start a process / a DeepSpeed process, the depth of allowed(), and
the refusals seen in the current phase."""


@contextlib.contextmanager
def allowed():
  """Lets the code inside start processes whatever test is running (conftest's own once-per-session op build)."""
  with _LOCK:
    _STATE["allowed"] += 1
  try:
    yield
  finally:
    with _LOCK:
      _STATE["allowed"] -= 1


def starts_deepspeed(argv: list[str]) -> bool:
  """True when `argv` (a command line, strings) starts DeepSpeed: a worker of the deepspeed side, the op build,
  `port --verify`, a `--deepspeed-config` run, or a compare/diagnose whose sides (default: all three) include it."""
  args = [str(a) for a in argv]
  if any(a in ("torch_impl.port_verify", "torch_impl.ops", "--deepspeed-config", "build-ops") for a in args):
    return True
  if any(a == "--side" and b == "deepspeed" for a, b in zip(args, args[1:])):
    return True
  if "parity.cli" in args or any(a.endswith("/parity") for a in args):
    if "port" in args and "--verify" in args:
      return True
    if "compare" in args or "diagnose" in args:
      sides = [b for a, b in zip(args, args[1:]) if a == "--sides"] + [a[8:] for a in args if a.startswith("--sides=")]
      return not sides or "deepspeed" in sides[-1]
  return False


def _check(what: str, argv) -> None:
  with _LOCK:
    test = _STATE["test"]
    if test is None or _STATE["allowed"]:
      return
    cmd = " ".join(str(a) for a in (argv or [what]))[:200]
    if argv and os.path.basename(str(argv[0])) in PROBES:
      return
    if not _STATE["process"]:
      msg = (f"{test} started a process ({what}: {cmd}) without the `process` marker: mark the test "
             f"@pytest.mark.process (tests/process_guard.py)")
    elif not _STATE["deepspeed"] and argv and starts_deepspeed(list(argv)):
      msg = (f"{test} started DeepSpeed ({cmd}) without the `requires_deepspeed` marker: mark the test "
             f"@requires_deepspeed (tests/conftest.py builds DeepSpeed's ops once for the tests so marked)")
    else:
      return
    _STATE["seen"].append(msg)
  raise UnmarkedProcess(msg)


def _wrap(owner, name: str, argv_of):
  real = getattr(owner, name, None)
  if real is None or getattr(real, "_process_guard", False):
    return

  def guarded(*args, **kwargs):
    _check(name, argv_of(args))
    return real(*args, **kwargs)
  guarded._process_guard = True
  setattr(owner, name, guarded)


_wrap(subprocess, "_fork_exec", lambda a: a[0])
_wrap(_posixsubprocess, "fork_exec", lambda a: a[0])
_wrap(os, "fork", lambda a: None)
_wrap(os, "forkpty", lambda a: None)
_wrap(os, "posix_spawn", lambda a: a[1])
_wrap(os, "posix_spawnp", lambda a: a[1])
_wrap(os, "system", lambda a: [a[0]])


@contextlib.contextmanager
def _watching(item):
  """The guard's state for one phase of `item`; fails the phase if a start was refused in it (caught or not)."""
  with _LOCK:
    before = dict(_STATE, seen=list(_STATE["seen"]))
    _STATE.update(test=item.nodeid, process=item.get_closest_marker("process") is not None,
                  deepspeed=item.get_closest_marker("requires_deepspeed") is not None, seen=[])
  try:
    yield
  finally:
    with _LOCK:
      seen = _STATE["seen"]
      _STATE.update(before)
    if seen:
      pytest.fail("\n".join(seen), pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
  with _watching(item):
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
  with _watching(item):
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
  with _watching(item):
    return (yield)
