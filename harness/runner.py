"""Starts one worker process per side, watches it, and collects what it left.

The harness never imports jax or torch: a side is `python -m <worker> request.json
--side S` in its own process group, with its own timeout, bound to this process
(`harness.lifetime`: it dies with the harness, kill -9 included, and by its own
deadline), in the one op-build environment (`harness.env`). Time a worker spends
building DeepSpeed ops (its `phase` file says so) is shown instead of its step
count and is not counted against the timeout (up to phase.BUILD_LIMIT_S). Whatever happens to
the process (exit, crash, SIGKILL, hang, NaN), `run_side` returns a SideRun and
leaves `run_dir/<side>/summary.json` describing it, so the report always has
every side. A run folder that vanishes (deleted or moved while the run runs) is noticed before each side starts
and after each ends (`folder_gone`): the side that was running is 'crashed' saying so, and no later side starts.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from harness import chip, lifetime, ranks
from parity import phase
from harness.env import host_pool_environ, side_spec, worker_env
from parity.protocol.disk_full import DISK_FULL, disk_full_at, disk_full_in, disk_full_reason
from parity.protocol.layout import (FOLDER_GONE, LAUNCH_ENV, PLANTED_KILL, count_lines, read_steps, read_summary,
                                    tail_text)
from parity.protocol.outputs import SideRun  # what a side left, as the harness saw it run (the report reads it too)
from parity.protocol.ranks import read_launch
from parity.protocol.workers import worker_module
from parity.sides import side_record

__all__ = ["SideRun", "run_side", "run_each_side", "not_run", "build_ops", "folder_gone", "STATUSES",
           "FOLDER_GONE"]

STATUSES = ("ok", "nan", "crashed", "killed", "timeout", "not_run")
"""ok: all steps ran; nan: a non-finite loss or grad norm stopped the side; crashed: the worker
raised or exited non-zero; killed: ended by a signal (SIGKILL, e.g. the OOM killer);
timeout: still running at the limit, then killed; not_run: never started."""
POLL_S = 0.1
STDERR_TAIL_CHARS = 4000


def _tail(path: Path, n: int = STDERR_TAIL_CHARS) -> str:
  return tail_text(path, n)


def _classify(rc: int | None, timed_out: bool, summary: dict | None, stderr: str) -> tuple[str, str | None]:
  if timed_out:
    return "timeout", "side exceeded its timeout and was killed"
  if rc is not None and rc < 0:
    sig = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
    hint = " (SIGKILL: killed from outside, or by the kernel's OOM killer)" if -rc == signal.SIGKILL else ""
    if PLANTED_KILL in stderr:  # the fault injected on purpose, not a real kill
      hint = " (the planted --perturb kill_at_step)"
    return "killed", f"worker killed by signal {sig}{hint}"
  if summary and summary.get("status") in ("ok", "nan", "crashed"):
    status = summary["status"]
    if status == "ok" and rc != 0:
      return "crashed", f"worker wrote an 'ok' summary but exited with code {rc}:\n{stderr}"
    return status, summary.get("error")
  return "crashed", f"worker exited with code {rc} without a summary:\n{stderr}"


def _disk_full_first(status: str, error: str | None, summary: dict | None, stderr: str, out: Path) -> str | None:
  """`error` with a full disk named on its first line where one stopped a crashed side (parity.protocol.disk_full):
  ENOSPC in its error, traceback or stderr, or, when it left no summary, a disk with no free space (its summary and
  stderr.log could not be written: the reason was blank)."""
  if status != "crashed" or (error or "").startswith(DISK_FULL):
    return error
  reason = disk_full_in(f"{error or ''}\n{(summary or {}).get('traceback') or ''}\n{stderr}", out)
  if reason is None and summary is None and disk_full_at(out):
    reason = disk_full_reason(out)
  return f"{reason}\n{error}" if reason else error


def run_side(run_dir: str | Path, side: str, *, timeout_s: float,
             on_progress: Callable[..., None] | None = None,
             python: str = sys.executable, env: dict[str, str] | None = None,
             job: str = "train", module: str | None = None) -> SideRun:
  """Runs one side to completion (or failure) and returns what happened.

  Args:
    run_dir: folder holding request.json (see parity.protocol).
    side: a side with a 'train' worker (parity.protocol.workers).
    timeout_s: wall-clock limit, seconds, not counting time the worker reports building DeepSpeed ops (at most
      phase.BUILD_LIMIT_S of it); past it the process group gets SIGKILL.
    on_progress: called with (side, steps recorded so far) while the side runs, and with (side, steps, note)
      while the worker reports a phase outside its steps (note: e.g. "building DeepSpeed op cpu_adam (first use,
      ~1 min)"; an empty note when that phase ends).
    python: interpreter for the worker.
    env: extra environment variables for the worker.
    job: which worker of the side to run (parity.protocol.workers: 'train', or 'diagnose' for `parity diagnose`,
      through the same protocol).
    module: a worker module to run instead of the registry's (`python -m MODULE`), e.g. a test's fake worker.
  Returns:
    SideRun; run_dir/<side>/summary.json always exists afterwards.
  """
  lifetime.check_stop()  # a stop held while the caller was busy: no new worker starts
  run_dir = Path(run_dir)
  out = run_dir / side
  gone = folder_gone(run_dir)
  if gone is not None:  # never recreate a folder someone removed, nor start a worker on inputs that are gone
    return not_run(side, f"not started: {gone}")
  sr = _start(run_dir, side, out, timeout_s, on_progress, python, env, job, module)
  gone = folder_gone(run_dir)
  if gone is not None and sr.status != "not_run":
    was = f" (the worker: {sr.status}, {first_line(sr.error)})" if sr.error else f" (the worker: {sr.status})"
    sr.summary = {**sr.summary, "status": "crashed", "error": f"{gone}, while {side} ran{was}"}
    sr.status, sr.error = "crashed", sr.summary["error"]
  return sr


def folder_gone(run_dir: Path) -> str | None:
  """FOLDER_GONE naming run_dir when its request.json is no longer a file there (the folder deleted, moved or
  emptied under the run), else None."""
  return None if (Path(run_dir) / "request.json").is_file() else FOLDER_GONE.format(folder=run_dir)


def first_line(text: str | None) -> str:
  return (text or "").strip().splitlines()[0][:200] if (text or "").strip() else ""


def _start(run_dir: Path, side: str, out: Path, timeout_s: float, on_progress, python: str,
           env: dict[str, str] | None, job: str, module: str | None) -> SideRun:
  """run_side once the folder is known to be there: prepare run_dir/<side>, start the worker(s), watch, classify."""
  try:
    launch = _prepare(run_dir, out)
  except (OSError, ValueError) as exc:  # disk full, read-only folder: the side cannot run; say where and why
    why = (disk_full_reason(out) if getattr(exc, "errno", None) == errno.ENOSPC else
           getattr(exc, "strerror", None) or exc)
    return not_run(side, f"cannot prepare {out} ({why}): the folder must be writable with free space")
  worker = module or worker_module(side, job)
  cmd = [python, "-m", "harness.boot", worker, str(run_dir / "request.json"), "--side", side]
  full_env = worker_env({**(env or {}), phase.PHASE_ENV: str(out / phase.PHASE_FILE)}, python,
                        ranks=int(launch["nproc"]))  # the ranks on this host share its CPUs
  _host_pool(full_env, run_dir, side)
  waiting = (lambda line: on_progress(side, 0, line)) if on_progress is not None else None
  try:
    with chip.chip_turn(side, str(run_dir), full_env, on_wait=waiting):  # one side at a time on a TPU chip
      t0 = time.time()  # the limit starts once the side has the chip, and so does the worker's own clock
      full_env[LAUNCH_ENV] = repr(t0)  # stamped here, after any wait, not when the environment was built
      world = ranks.world_size(launch)
      if world > 1:
        return _run_ranks(side, cmd, launch, out, full_env, timeout_s, on_progress, t0)
      return _run_one(side, cmd, out, full_env, timeout_s, on_progress, t0)
  except chip.ChipLockError as exc:
    summary = _harness_summary(side, "not_run", f"not started: {exc}", out, None)
    _write_summary(out, summary)
    return not_run(side, summary["error"])
  except chip.ChipWaitInterrupted as exc:
    _write_summary(out, _harness_summary(side, "killed", f"interrupted ({_signal_words()}) while waiting for the "
                                         f"TPU, which {exc.holder} held: the side never started", out, None))
    raise


def _host_pool(env: dict[str, str], run_dir: Path, side: str) -> None:
  """The JAX worker's pinned-host pool, set in `env` before JAX starts (harness.env.host_pool_environ, from
  run_dir/request.json); nothing for a side of another framework (its record's), or a request that is no run (a
  test's fake worker)."""
  if side_record(side).framework != "jax":
    return
  try:
    spec = side_spec(json.loads((run_dir / "request.json").read_text()), side)
  except (OSError, ValueError, KeyError, TypeError):
    return
  host_pool_environ(env, spec)


def _run_one(side: str, cmd: list[str], out: Path, env: dict[str, str], timeout_s: float,
             on_progress: Callable[..., None] | None, t0: float) -> SideRun:
  """run_side for one process: spawn, watch, classify; a Ctrl-C kills the worker and leaves a 'killed' summary."""
  with open(out / "stdout.log", "wb") as so, open(out / "stderr.log", "wb") as se:
    proc = lifetime.spawn(cmd, stdout=so, stderr=se, env=env, timeout_s=timeout_s)
  try:
    with lifetime.activity(_running(side, out), on_stop=KILLED):
      rc, rusage, timed_out = _watch(proc, side, out, t0, timeout_s, on_progress)
  except BaseException:  # Ctrl-C / SIGTERM of the harness: never leave a worker behind
    _kill_group(proc.pid)
    _, status, _ = os.wait4(proc.pid, 0)
    lifetime.release(proc)
    summary = _harness_summary(side, "killed", f"interrupted: the harness was stopped ({_signal_words()}) "
                               "and killed this side", out, read_summary(out / "summary.json"))
    _write_summary(out, summary)
    raise
  lifetime.release(proc)
  (out / phase.PHASE_FILE).unlink(missing_ok=True)
  wall = time.time() - t0
  if on_progress is not None:
    on_progress(side, count_lines(out / "steps.jsonl"))
  stderr = _tail(out / "stderr.log")
  summary = read_summary(out / "summary.json")
  status, error = _classify(rc, timed_out, summary, stderr)
  busy = chip.busy_hint(f"{error or ''}\n{stderr}") if status == "crashed" else None
  if busy:
    error = f"{busy}\n{error}"
  full = _disk_full_first(status, error, summary, stderr, out)
  if summary is None or summary.get("status") != status or busy or full != error:
    error = full
    summary = _harness_summary(side, status, error, out, summary)
    _write_summary(out, summary)
  peak = rusage.ru_maxrss * 1024 if rusage is not None else None
  return SideRun(side=side, status=status, returncode=rc, wall_s=wall, peak_rss_bytes=peak,
                 summary=summary, error=error)


def _run_ranks(side: str, cmd: list[str], launch: dict, out: Path, env: dict[str, str], timeout_s: float,
               on_progress, t0: float) -> SideRun:
  """run_side for a side of several ranks (harness.ranks): launched, watched and summarised as one side."""
  for log in ("stdout.log", "stderr.log"):
    (out / log).write_bytes(b"")
  try:
    with lifetime.activity(_running(side, out), on_stop=KILLED):
      launched = ranks.launch_side(side, cmd, launch, out=out, env=env, timeout_s=timeout_s, watch=_watch,
                                   on_progress=on_progress)
  except BaseException:  # Ctrl-C / SIGTERM: every rank is already killed
    summary = _harness_summary(side, "killed", f"interrupted: the harness was stopped ({_signal_words()}) "
                               "and killed this side", out, read_summary(out / "summary.json"))
    _write_summary(out, summary)
    raise
  (out / phase.PHASE_FILE).unlink(missing_ok=True)
  wall = time.time() - t0
  if on_progress is not None:
    on_progress(side, count_lines(out / "steps.jsonl"))
  summary = read_summary(out / "summary.json")
  rc = launched.returncode
  stderr = _tail(out / "stderr.log")
  status, error = _classify(rc, launched.timed_out, summary, stderr)
  status, error, folded = ranks.fold_ranks(summary or {}, status, error, launched, out, ranks.world_size(launch))
  full = _disk_full_first(status, error, summary, stderr, out)
  if full != error:
    error = folded["error"] = full
  if summary is None or summary.get("status") != status:
    folded = _harness_summary(side, status, error, out, folded)
  _write_summary(out, folded)
  peak = launched.rusage.ru_maxrss * 1024 if launched.rusage is not None else None
  return SideRun(side=side, status=status, returncode=rc, wall_s=wall, peak_rss_bytes=peak, summary=folded,
                 error=error)


KILLED = "it was killed with its child processes"
"""What a stop does to a running side (the message's words; harness.lifetime.activity)."""


def _running(side: str, out: Path) -> str:
  return f"side {side} was running ({out})"


def _prepare(run_dir: Path, out: Path) -> dict:
  """Clears what an earlier attempt left in run_dir/<side> and returns the run's launch (parity.protocol.ranks).
  Raises OSError (an unwritable folder, or run_dir gone: it is never recreated) or ValueError (a malformed
  launch.json)."""
  out.mkdir(exist_ok=True)
  for stale in ("summary.json", "steps.jsonl", "final.safetensors", phase.PHASE_FILE):
    (out / stale).unlink(missing_ok=True)
  for stale in [*out.glob("rank*.json"), *out.glob("rank*.stderr")]:
    stale.unlink()
  (out / "stderr.log").touch()
  return read_launch(run_dir)


def _watch(proc, side: str, out: Path, t0: float, timeout_s: float, on_progress,
           before_kill=None) -> tuple[int, object, bool]:
  """Polls the worker until it exits; kills its process group past the timeout. Returns (rc, rusage, timed_out).

  While the worker's phase file is non-empty (a DeepSpeed op build) its clock stops, for at most
  phase.BUILD_LIMIT_S in all, and on_progress gets the phase as a note. `before_kill()`, when given, runs at the
  timeout before the kill (harness.ranks records what each rank was doing)."""
  last, note, timed_out, paused, t_prev = -1, "", False, 0.0, time.time()
  while True:
    pid, status, rusage = os.wait4(proc.pid, os.WNOHANG)
    if pid:
      if note and on_progress is not None:  # the phase ended with the process: the line shows steps again
        on_progress(side, count_lines(out / "steps.jsonl"), "")
      return os.waitstatus_to_exitcode(status), rusage, timed_out
    now = time.time()
    shown = _read_phase(out)
    if shown:
      paused = min(phase.BUILD_LIMIT_S, paused + (now - t_prev))
    t_prev = now
    if on_progress is not None:
      n = count_lines(out / "steps.jsonl")
      if shown != note:
        on_progress(side, n, shown)
        note, last = shown, n
      elif n != last:
        on_progress(side, n)
        last = n
    if now - t0 - paused > timeout_s and not timed_out:
      timed_out = True
      if before_kill is not None:
        before_kill()
      _kill_group(proc.pid)
    time.sleep(POLL_S)


def _read_phase(out: Path) -> str:
  try:
    return (out / phase.PHASE_FILE).read_text(errors="replace").strip()[:200]
  except OSError:
    return ""


def _kill_group(pid: int) -> None:
  """Kills the worker's process group and every descendant of it (op-build compilers run in groups of their own)."""
  lifetime.kill_tree(pid)


def _harness_summary(side: str, status: str, error: str | None, out: Path, worker: dict | None) -> dict:
  """A summary written by the harness for a side that could not write (or contradicted) its own."""
  steps = read_steps(out / "steps.jsonl")
  base = dict(worker or {})
  base.update({"schema": "parity.summary/1", "side": side, "status": status, "error": error,
               "steps_completed": len(steps), "written_by": "harness"})
  return base


def _write_summary(out: Path, summary: dict) -> None:
  """Writes the harness's summary.json; a folder that cannot take it (disk full, read-only, removed) is noted in the
  summary the report gets instead of raising."""
  try:
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
  except OSError as exc:
    summary["summary_not_written"] = (disk_full_reason(out / "summary.json") if exc.errno == errno.ENOSPC else
                                      f"{out / 'summary.json'}: {exc.strerror or exc}")


def build_ops(names: list[str], *, timeout_s: float = phase.BUILD_LIMIT_S, python: str = sys.executable) -> int:
  """`parity build-ops`: builds DeepSpeed's ops up front in a worker (`python -m torch_impl.ops NAMES`), so that no
  side builds inside a timed run. Its lines go straight to this process's stdout/stderr.

  Args:
    names: op names (empty: all of torch_impl.ops.OPS); an unknown one makes the worker exit 2 naming it.
    timeout_s: wall-clock limit, seconds; past it the worker's process group is killed (its stale lock is
      removed by the next build).
  Returns:
    The worker's exit code: 0 built, 1 a build failed, 2 bad op name or extensions folder; 1 on timeout and 130 on
    Ctrl-C/SIGTERM, each with a message (the worker and its compilers are killed; the next build removes the lock).
  """
  cmd = [python, "-m", "harness.boot", "torch_impl.ops", *names]
  proc = lifetime.spawn(cmd, env=worker_env(None, python), timeout_s=timeout_s)
  t0 = time.time()
  try:
    while proc.poll() is None:
      if time.time() - t0 > timeout_s:
        _kill_group(proc.pid)
        proc.wait()
        print(f"parity build-ops: error: the build did not finish within {timeout_s:g} s and was stopped; "
              "run it again (the lock it left is removed) or raise --timeout", file=sys.stderr)
        return 1
      time.sleep(POLL_S)
  except KeyboardInterrupt:
    _kill_group(proc.pid)
    proc.wait()
    print("parity build-ops: interrupted; the build was stopped (the next build removes the lock it left)",
          file=sys.stderr)
    return 130
  except BaseException:
    _kill_group(proc.pid)
    proc.wait()
    raise
  finally:
    lifetime.release(proc)
  return proc.returncode if proc.returncode >= 0 else 1


def run_each_side(sides: Sequence[str], start: Callable[[str], SideRun], *, on_interrupt: Callable[[str], SideRun],
                  what: str = "run") -> tuple[dict[str, SideRun], KeyboardInterrupt | None]:
  """Runs the sides one after another, and turns a Ctrl-C into a result rather than losing the others.

  Args:
    sides: side names, in order.
    start: runs one side to its end (usually `run_side`, which kills its worker on Ctrl-C and re-raises).
    on_interrupt: the SideRun of the side that was running when Ctrl-C came (e.g. read from its summary).
    what: the name of the whole ('run', 'diagnose') in the reason given to the sides never started.
  Returns:
    ({side: SideRun} for every side, in order: sides after the interrupted one are `not_run`, the reason naming
    the interrupt), and the KeyboardInterrupt for the caller to re-raise once its report is written (None).
    A stop signal while no worker runs (a side being prepared or read) is held (harness.lifetime.activity): that
    side's result is kept whole and the sides after it are `not_run`.
  """
  runs: dict[str, SideRun] = {}
  interrupted: KeyboardInterrupt | None = None
  with lifetime.activity(f"no side was running (the {what} was starting a side or reading what one left)",
                         hold=True, on_stop="no side was started after that"):  # only a worker is stopped at once
    for side in sides:
      interrupted = interrupted or lifetime.take_stop()
      if interrupted is not None:
        runs[side] = not_run(side, f"not started: the {what} was interrupted ({_signal_words()})")
        continue
      try:
        runs[side] = start(side)
      except KeyboardInterrupt as exc:  # the side's worker was killed and has a summary: report, then re-raise
        interrupted = exc
        runs[side] = on_interrupt(side)
    interrupted = interrupted or lifetime.take_stop()
  return runs, interrupted


def _signal_words() -> str:
  """'Ctrl-C' for SIGINT (or a KeyboardInterrupt raised in the code), else the signal's name (SIGTERM)."""
  sig = lifetime.stop_state().signal
  return "Ctrl-C" if sig in (None, "SIGINT") else sig


def not_run(side: str, reason: str) -> SideRun:
  """A SideRun for a side that never started (status 'not_run'; `reason` is its error and its summary's)."""
  return SideRun(side=side, status="not_run", returncode=None, wall_s=0.0, peak_rss_bytes=None,
                 summary={"side": side, "status": "not_run", "error": reason, "steps_completed": 0}, error=reason)
