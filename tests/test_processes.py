"""Process lifetime and DeepSpeed op builds.

7: no worker outlives the `parity` process (kill -9 included), its pipe, or its own deadline.
8: a stale op-build lock is detected and removed, a live one is waited on (and removed when its builder dies),
   a build is shown as a phase and kept off the side's clock, and every process builds in one environment.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import process_alive as _alive, requires_jax, requires_torch
from parity import phase

ROOT = Path(__file__).resolve().parents[1]


def _wait_gone(pids: list[int], within_s: float) -> list[int]:
  t_end = time.time() + within_s
  while time.time() < t_end and any(_alive(p) for p in pids):
    time.sleep(0.1)
  return [p for p in pids if _alive(p)]


def _sleeper(tmp_path: Path, body: str) -> dict[str, str]:
  """A module `sleeper` in tmp_path (returns the env that finds it)."""
  (tmp_path / "sleeper.py").write_text(textwrap.dedent(body))
  from harness.env import worker_env
  return worker_env({"PYTHONPATH": str(tmp_path)})


# ----------------------------------------------------------------------------- item 7

@pytest.mark.process
@requires_jax
@requires_torch
def test_kill_9_of_parity_ends_its_worker(tmp_path):
  """kill -9 of `parity compare` mid-run: the worker (hung on purpose) is gone within a few seconds."""
  out = tmp_path / "run"
  proc = subprocess.Popen([sys.executable, "-m", "parity.cli", "compare", "--preset", "gpt2-tiny", "--steps", "4",
                           "--sides", "jax,torch", "--out", str(out), "--timeout", "600", "--no-progress",
                           "--perturb", "jax:hang_at_step=0"], cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  try:
    pid_file = out / "jax" / "pid"
    t_end = time.time() + 120
    while not pid_file.exists() and time.time() < t_end and proc.poll() is None:
      time.sleep(0.2)
    assert pid_file.exists(), "the jax worker never started"
    worker = int(pid_file.read_text())
    assert _alive(worker)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _wait_gone([worker], 5.0) == [], f"worker {worker} still runs after its parity process was killed"
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


@pytest.mark.process
def test_closed_pipe_ends_worker_and_its_children(tmp_path):
  """The portable fallback: when the harness's end of the pipe closes, the worker kills itself and its children
  (one in a session of its own included), though its parent process is still alive (so PDEATHSIG never fires)."""
  from harness import lifetime
  env = _sleeper(tmp_path, """
    import subprocess, sys, time
    child = subprocess.Popen(["sleep", "120"], start_new_session=True)  # as ninja starts its compilers
    print(child.pid, flush=True)
    time.sleep(120)
  """)
  proc = lifetime.spawn([sys.executable, "-m", "harness.boot", "sleeper"], env=env, timeout_s=600,
                        stdout=subprocess.PIPE)
  child = int(proc.stdout.readline())
  assert _alive(proc.pid) and _alive(child)
  lifetime.release(proc)
  assert proc.wait(timeout=10) == -signal.SIGKILL
  assert _wait_gone([child], 5.0) == [], "the worker's own child survived"


@pytest.mark.process
def test_worker_ends_by_its_own_deadline(tmp_path, monkeypatch):
  """A worker whose parent is alive but no longer watching ends by itself past timeout + grace."""
  from harness import lifetime
  monkeypatch.setattr(lifetime, "DEADLINE_GRACE_S", 0.5)
  env = _sleeper(tmp_path, "import time\ntime.sleep(120)\n")
  t0 = time.time()
  proc = lifetime.spawn([sys.executable, "-m", "harness.boot", "sleeper"], env=env, timeout_s=1.0,
                        stderr=subprocess.PIPE)
  try:
    rc = proc.wait(timeout=30)
  finally:
    lifetime.release(proc)
  assert rc == -signal.SIGKILL and time.time() - t0 < 30
  assert b"past its deadline" in proc.stderr.read()


def test_worker_started_by_hand_is_not_bound(monkeypatch):
  """Without the harness's variables (a worker run by hand or by a test) nothing is armed."""
  from harness import lifetime
  for key in (lifetime.PARENT_PID_ENV, lifetime.PARENT_FD_ENV, lifetime.DEADLINE_ENV):
    monkeypatch.delenv(key, raising=False)
  assert lifetime.watch_parent({}) == {"pdeathsig": False, "pipe": False, "deadline": None}


@pytest.mark.process
def test_timeout_kills_grandchildren_in_their_own_groups(tmp_path):
  """A side timed out while building: the harness kills the worker's group and its descendants in other groups
  (ninja runs each compiler in a process group of its own; before, they ran on after the timeout)."""
  from harness.runner import run_side
  (tmp_path / "request.json").write_text("{}")
  (tmp_path / "compiles.py").write_text(textwrap.dedent("""
    import os, subprocess, time
    child = subprocess.Popen(["sleep", "120"], start_new_session=True)
    open(os.environ["GRANDCHILD_PID"], "w").write(str(child.pid))
    time.sleep(120)
  """))
  sr = run_side(tmp_path, "torch", timeout_s=3, module="compiles",
                env={"PYTHONPATH": str(tmp_path), "GRANDCHILD_PID": str(tmp_path / "grandchild.pid")})
  assert sr.status == "timeout"
  grandchild = int((tmp_path / "grandchild.pid").read_text())
  assert _wait_gone([grandchild], 5.0) == [], "a compiler-like grandchild outlived the side's timeout"


# ----------------------------------------------------------------------------- item 8: locks

@pytest.fixture
def ext_dir(tmp_path, monkeypatch):
  d = tmp_path / "torch_extensions"
  (d / "cpu_adam").mkdir(parents=True)
  monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(d))
  return d


@requires_torch
def test_stale_lock_is_removed_with_a_message(ext_dir):
  from torch_impl import ops
  lock = ext_dir / "cpu_adam" / "lock"
  lock.touch()
  said = []
  assert ops.lock_state(lock.parent)[0] == "stale"
  assert ops.clear_stale_lock(lock.parent, said.append) and not lock.exists()
  assert said and "removed stale DeepSpeed op build lock" in said[0] and str(lock) in said[0]
  assert ops.lock_state(lock.parent) == ("free", "no lock")


@pytest.mark.process
@requires_torch
def test_live_lock_is_kept_and_removed_once_its_builder_dies(ext_dir):
  """A lock held open by a live process (the builder, as torch's FileBaton holds it) is live; kill the
  builder and it is stale."""
  from torch_impl import ops
  lock = ext_dir / "cpu_adam" / "lock"
  holder = subprocess.Popen([sys.executable, "-c", "import os, sys, time\n"
                             f"fd = os.open({str(lock)!r}, os.O_CREAT | os.O_EXCL)\nprint('held', flush=True)\n"
                             "time.sleep(120)"], stdout=subprocess.PIPE)
  try:
    assert holder.stdout.readline().strip() == b"held"
    state, detail = ops.lock_state(lock.parent)
    assert state == "live" and f"pid {holder.pid} holds the lock" in detail
    assert not ops.clear_stale_lock(lock.parent, print) and lock.exists()
  finally:
    holder.kill()
    holder.wait()
  assert ops.lock_state(lock.parent)[0] == "stale"


class _FakeBuilder:
  """Emulates torch's JIT build of one op: wait on the lock while it exists (FileBaton.wait), else take it,
  'compile' (writes <op>.so), release; then import the library (ImportError when there is none)."""
  name = "cpu_adam"
  seen_phase: list = []

  def __init__(self, ext_dir: Path, build_s: float = 0.3):
    self.dir, self.build_s = ext_dir / self.name, build_s

  def jit_load(self, verbose=True):
    lock = self.dir / "lock"
    try:
      fd = os.open(lock, os.O_CREAT | os.O_EXCL)
    except FileExistsError:
      while lock.exists():
        time.sleep(0.05)
    else:
      _FakeBuilder.seen_phase.append(Path(os.environ["PARITY_PHASE_FILE"]).read_text().strip())
      time.sleep(self.build_s)
      (self.dir / f"{self.name}.so").write_text("built")
      os.close(fd)
      lock.unlink()
    if not (self.dir / f"{self.name}.so").exists():
      raise ImportError(f"no {self.name}.so")
    return "module"


@requires_torch
def test_build_hook_recovers_a_stale_lock_and_reports_the_build(ext_dir, tmp_path, monkeypatch):
  """Before: a stale lock made every later process wait forever. Now the hook removes it, the phase file says
  'building DeepSpeed op cpu_adam (first use, 1-4 min)' during the build, and the build time is counted."""
  from torch_impl import ops
  cls = type("Builder", (_FakeBuilder,), {})
  monkeypatch.setenv(phase.PHASE_ENV, str(tmp_path / "phase"))
  (ext_dir / "cpu_adam" / "lock").touch()  # left by an interrupted build
  said, before = [], ops.build_s()
  _FakeBuilder.seen_phase = []
  ops.install_build_hooks(said.append, cls=cls)
  assert cls(ext_dir).jit_load() == "module"
  assert _FakeBuilder.seen_phase == ["building DeepSpeed op cpu_adam (first use, 1-4 min)"]
  assert any("removed stale DeepSpeed op build lock" in m for m in said)
  assert not (tmp_path / "phase").exists(), "the phase is cleared after the build"
  assert ops.build_s() - before >= 0.3


@pytest.mark.process
@requires_torch
def test_build_hook_builds_when_the_builder_it_waited_on_dies(ext_dir, tmp_path, monkeypatch):
  """Another process holds the lock (live), then dies mid-build: the waiting process removes the lock it left
  and builds the op itself, instead of waiting forever."""
  from torch_impl import ops
  monkeypatch.setattr(ops, "RECHECK_S", 0.2)
  monkeypatch.setenv(phase.PHASE_ENV, str(tmp_path / "phase"))
  cls = type("Builder", (_FakeBuilder,), {})
  lock = ext_dir / "cpu_adam" / "lock"
  holder = subprocess.Popen([sys.executable, "-c", "import os, time\n"
                             f"fd = os.open({str(lock)!r}, os.O_CREAT | os.O_EXCL)\nprint('held', flush=True)\n"
                             "time.sleep(120)"], stdout=subprocess.PIPE)
  assert holder.stdout.readline().strip() == b"held"
  said = []
  ops.install_build_hooks(said.append, cls=cls)
  _FakeBuilder.seen_phase = []
  phase_file = tmp_path / "phase"  # the builder dies once the waiter says it waits
  killer = subprocess.Popen(["sh", "-c", f"while [ ! -s {phase_file} ]; do sleep 0.05; done; sleep 0.3; "
                                         f"kill -9 {holder.pid}"])
  t0 = time.time()
  try:
    assert cls(ext_dir).jit_load() == "module"
  finally:
    holder.kill()
    holder.wait()
    killer.wait()
  assert time.time() - t0 < 15
  assert said[0].startswith("waiting for DeepSpeed op cpu_adam: another process is building it (pid ")
  assert any("removed stale DeepSpeed op build lock" in m for m in said)
  assert (ext_dir / "cpu_adam" / "cpu_adam.so").read_text() == "built"


# ----------------------------------------------------------------------------- item 8: harness, environment

@pytest.mark.process
@pytest.mark.requires_deepspeed  # run_side(..., "deepspeed"): the guard counts it as a DeepSpeed start (a fake build)
def test_build_phase_is_shown_and_off_the_clock(tmp_path):
  """A worker 'building' for 2.5 s under a 1.5 s timeout is not timed out, and the progress callback gets the
  phase as a note (the line says it instead of 0/N steps)."""
  from harness.runner import run_side
  (tmp_path / "request.json").write_text("{}")
  (tmp_path / "fakebuild.py").write_text(textwrap.dedent("""
    import os, time
    from parity import phase
    phase.set_phase("building DeepSpeed op cpu_adam (first use, ~1 min)")
    time.sleep(2.5)
    phase.set_phase(None)
  """))
  notes = []
  sr = run_side(tmp_path, "deepspeed", timeout_s=1.5, module="fakebuild", env={"PYTHONPATH": str(tmp_path)},
                on_progress=lambda side, n, note=None: notes.append(note) if note is not None else None)
  assert sr.status != "timeout", sr.error
  assert "building DeepSpeed op cpu_adam (first use, ~1 min)" in notes and notes[-1] == ""
  assert not (tmp_path / "deepspeed" / "phase").exists()


@pytest.mark.process
def test_one_build_environment_whatever_the_callers_path(tmp_path):
  """Cause of the double rebuilds: the system ninja (1.11) reads the venv ninja's (1.13) .ninja_log as foreign and
  rebuilds everything. Every launch path gets this environment's ninja first and one TORCH_EXTENSIONS_DIR, and
  build_environ is idempotent, so an op built once is up to date for every later process."""
  from parity.buildenv import build_environ, env_bin, extensions_dir
  from harness.env import worker_env
  venv_ninja = os.path.join(env_bin(), "ninja")
  if not os.path.exists(venv_ninja):
    pytest.skip("this environment has no ninja of its own")
  scrubbed = {"PATH": "/usr/local/bin:/usr/bin:/bin"}  # `.venv/bin/python -m pytest` without activating
  env = build_environ(dict(scrubbed))
  assert shutil.which("ninja", path=env["PATH"]) == venv_ninja
  assert env["TORCH_EXTENSIONS_DIR"] == extensions_dir()
  assert build_environ(dict(env)) == env
  old_path = os.environ.get("PATH", "")
  try:
    os.environ["PATH"] = scrubbed["PATH"]
    assert shutil.which("ninja", path=worker_env()["PATH"]) == venv_ninja
  finally:
    os.environ["PATH"] = old_path
  built = Path(extensions_dir()) / "deepspeed_shm_comm"
  if not any(built.glob("*.so")) or (built / "lock").exists():
    return
  copy = tmp_path / "op"
  shutil.copytree(built, copy, symlinks=True)  # copytree keeps mtimes: ninja's view of the build is unchanged
  (copy / "lock").unlink(missing_ok=True)
  dry = subprocess.run([shutil.which("ninja", path=env["PATH"]), "-n"], cwd=copy, capture_output=True, text=True,
                       env=env, timeout=60)
  assert "no work to do" in dry.stdout, dry.stdout[-500:]


@pytest.mark.process
@pytest.mark.requires_deepspeed
def test_build_ops_refuses_an_unknown_op():
  proc = subprocess.run([sys.executable, "-m", "parity.cli", "build-ops", "cpu_adamm"], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr
  assert ("parity build-ops: error: unknown DeepSpeed op(s) cpu_adamm; known: cpu_adam, deepspeed_shm_comm, "
          "fused_adam") in proc.stderr
  assert "Traceback" not in proc.stderr


@pytest.mark.process
@pytest.mark.requires_deepspeed
def test_build_ops_refuses_an_extensions_dir_that_is_a_file(tmp_path):
  """TORCH_EXTENSIONS_DIR naming a file was a NotADirectoryError (exit 1); it is bad input: exit 2, named, with
  the fix."""
  (tmp_path / "file").write_text("")
  env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "file"))
  proc = subprocess.run([sys.executable, "-m", "parity.cli", "build-ops", "cpu_adam"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr
  assert f"TORCH_EXTENSIONS_DIR={tmp_path / 'file'} is not a folder; point TORCH_EXTENSIONS_DIR at" in proc.stderr
  assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------------------- stopping parity itself
def _compare(out: Path, *extra: str) -> subprocess.Popen:
  """`parity compare` of gpt2-tiny, 4 steps, the jax side only, no reruns: the shortest real run."""
  return subprocess.Popen([sys.executable, "-m", "parity.cli", "compare", "--preset", "gpt2-tiny", "--steps", "4",
                           "--sides", "jax", "--determinism-steps", "0", "--out", str(out), "--no-progress", *extra],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(proc: subprocess.Popen, ready, what: str, within_s: float = 300.0) -> None:
  """Polls (5 ms) until ready() holds; fails naming `what` if the process ends or the time runs out first."""
  t_end = time.time() + within_s
  while not ready():
    if proc.poll() is not None or time.time() > t_end:
      proc.kill()
      out, err = proc.communicate()
      pytest.fail(f"never saw {what} (exit {proc.returncode}): {err[-2000:]}")
    time.sleep(0.005)


@pytest.mark.process
@requires_jax
def test_a_second_ctrl_c_during_the_shutdown_does_not_lose_the_report(tmp_path):
  """Two Ctrl-C: the first while the side runs (hung at step 1), the second once the report is being written (its
  first file, metrics.jsonl, is there and report.json is not). The report of what ran is written, INTERRUPTED, the
  worker is gone, and the message says what was running, what was killed, what is on disk and that the second
  signal was ignored. (It used to leave no report while saying 'the report marks it'.)"""
  out = tmp_path / "run"
  proc = _compare(out, "--perturb", "jax:hang_at_step=1")
  steps = out / "jax" / "steps.jsonl"
  _wait_for(proc, lambda: steps.exists() and steps.read_text().count("\n") >= 1, "the jax side's first step")
  worker = int((out / "jax" / "pid").read_text())
  proc.send_signal(signal.SIGINT)
  _wait_for(proc, (out / "metrics.jsonl").exists, "the report's first file", within_s=120)
  assert not (out / "report.json").exists(), "the report was already written: the second signal came too late"
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, err
  assert _wait_gone([worker], 5.0) == []
  rep = json.loads((out / "report.json").read_text())
  assert rep["verdict"]["message"].startswith("INTERRUPTED") and rep["sides"]["jax"]["status"] == "killed"
  assert (out / "report.md").exists() and (out / "card.json").exists() and (out / "report.html").exists()
  last = err.strip().splitlines()[-1]
  assert last.startswith(f"parity compare: interrupted by Ctrl-C (SIGINT) while side jax was running ({out / 'jax'})"
                         ": it was killed with its child processes; the report of what ran is written, verdict "
                         f"INTERRUPTED: {out / 'report.html'}"), last
  assert last.endswith("1 more signal(s) (SIGINT) came while it was stopping and were ignored, so that it could "
                       "finish"), last
  assert "parity: SIGINT again: ignored, it is already stopping" in err and "Traceback" not in err


@pytest.mark.process
@requires_jax
def test_sigterm_while_the_report_is_written_lets_it_finish_and_says_so(tmp_path):
  """SIGTERM once the report is being written (every side done): the report is finished, complete and not marked
  INTERRUPTED, and the message says the signal came while the report was written, with no side running (it used
  to say 'the running side was killed')."""
  out = tmp_path / "run"
  proc = _compare(out)
  _wait_for(proc, (out / "metrics.jsonl").exists, "the report's first file")
  assert not (out / "report.json").exists(), "the report was already written: the signal came too late"
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, err
  rep = json.loads((out / "report.json").read_text())
  assert rep["verdict"]["message"].startswith("ONE SIDE: jax ran ok") and rep["sides"]["jax"]["status"] == "ok"
  assert (out / "report.md").exists() and (out / "card.json").exists() and (out / "report.html").exists()
  last = err.strip().splitlines()[-1]
  assert last == ("parity compare: SIGTERM came while the report was being written (no side was running); that was "
                  f"finished first; the report is written, verdict ONE SIDE: {out / 'report.html'}, with report.json, "
                  "report.md and card.json"), last
  assert "killed" not in err


def test_a_signal_while_the_records_are_compared_skips_the_reruns(tmp_path, monkeypatch, capsys):
  """In process, fake sides (no framework): SIGTERM arrives while the sides' records are compared. That finishes,
  no rerun starts, the report is written marked INTERRUPTED, and the message says so (exit 130)."""
  from test_pipeline import _fake_run_side
  import harness.runner
  import harness.self_runs
  from parity import cli
  from parity.pipeline import compare as pipeline
  calls: list = []
  monkeypatch.setattr(harness.runner, "run_side", _fake_run_side(calls))
  monkeypatch.setattr(harness.self_runs, "run_side", _fake_run_side(calls))
  real = pipeline.compare_sides

  def compare_sides(*a, **kw):
    signal.raise_signal(signal.SIGTERM)
    return real(*a, **kw)
  monkeypatch.setattr(pipeline, "compare_sides", compare_sides)
  out = tmp_path / "r"
  assert cli.main(["compare", "--preset", "gpt2-tiny", "--steps", "4", "--sides", "jax,torch", "--out", str(out),
                   "--no-progress"]) == 130
  assert calls == [("r", "jax"), ("r", "torch")]  # the determinism reruns (8 steps by default) never started
  rep = json.loads((out / "report.json").read_text())
  assert rep["verdict"]["message"].startswith("INTERRUPTED") and rep["determinism"] == {}
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert err == ("parity compare: SIGTERM came while the sides' records were being compared (no side was running); "
                 "that was finished first and no rerun was started; the report of what ran is written, verdict "
                 f"INTERRUPTED: {out / 'report.html'}, with report.json, report.md and card.json"), err


def test_stop_rule_first_signal_raises_unless_held_later_ones_are_ignored(capfd):
  """harness.lifetime.stop_signals with real signals to this process: a held one waits for its block; one in a
  worker's (not held) block raises at once; later ones are ignored with a line each; handlers are restored.
  signal.raise_signal, not os.kill(getpid): the kernel may hand a process-directed signal to another thread (xdist's
  execnet thread), and the main thread then runs the handler only when its eval loop next checks for pending
  signals; raise() delivers to the calling thread, so the handler has run when the next line asserts."""
  from harness import lifetime
  before = signal.getsignal(signal.SIGINT)
  with lifetime.stop_signals() as stop:
    with pytest.raises(KeyboardInterrupt):
      with lifetime.activity("the report was being written", hold=True, on_stop="that was finished first"):
        signal.raise_signal(signal.SIGTERM)
        finished = True  # still running: the signal is held
    assert finished and stop.held and stop.signal == "SIGTERM" and stop.doing == ("the report was being written",)
    signal.raise_signal(signal.SIGINT)  # a later one: ignored
    assert stop.later == ["SIGINT"]
  assert signal.getsignal(signal.SIGINT) is before
  with lifetime.stop_signals() as stop:  # a fresh state; a worker's block inside a held one is stopped at once
    with lifetime.activity("between workers", hold=True, within="in the reruns"):
      with pytest.raises(KeyboardInterrupt):
        with lifetime.activity("side jax was running", on_stop="it was killed"):
          signal.raise_signal(signal.SIGINT)
          time.sleep(5)
      assert stop.signal == "SIGINT" and not stop.held and stop.on_stop == "it was killed"
      assert stop.doing[0] == "side jax was running" and stop.within == ("in the reruns",)
      assert lifetime.take_stop() is None
  with lifetime.stop_signals() as stop:  # held, then taken: the block does not raise; nothing new starts
    with lifetime.activity("comparing", hold=True):
      signal.raise_signal(signal.SIGTERM)
      with pytest.raises(KeyboardInterrupt):
        lifetime.check_stop()
      signal.raise_signal(signal.SIGTERM)
      assert lifetime.take_stop() is None and stop.later == ["SIGTERM"]
  assert "parity: SIGINT again: ignored" in capfd.readouterr().err  # written with os.write (a signal handler)
  old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job's SIGINT is ignored: it stays so
  try:
    with lifetime.stop_signals() as stop:
      signal.raise_signal(signal.SIGINT)
      assert stop.signal is None
  finally:
    signal.signal(signal.SIGINT, old)


# ----------------------------------------------------------------------------- kill -9 and a grandchild's own group


def _fake_build_tree(tmp_path: Path, hold_pipe: bool) -> tuple[subprocess.Popen, int, int, int | None]:
  """A fake `parity build-ops`: a process that spawns a worker through harness.boot; the worker starts a grandchild
  in a session of its own, as ninja starts its compilers, then waits in subprocess.run (as torch's cpp_extension
  waits on ninja). With `hold_pipe`, a forked helper keeps the binding pipe's write end open after the parent dies,
  so only the kernel's parent-death signal can end the worker. Returns (parent, worker, grandchild, helper)."""
  (tmp_path / "fakebuild.py").write_text(textwrap.dedent("""
    import subprocess
    child = subprocess.Popen(["sleep", "300"], start_new_session=True)
    print(child.pid, flush=True)
    subprocess.run(["sleep", "300"])
  """))
  (tmp_path / "fakeparity.py").write_text(textwrap.dedent(f"""
    import os, subprocess, sys, time
    sys.path.insert(0, {str(ROOT)!r})
    from harness import lifetime
    from harness.env import worker_env
    env = worker_env({{"PYTHONPATH": {str(tmp_path)!r} + ":" + {str(ROOT)!r}}})
    proc = lifetime.spawn([sys.executable, "-m", "harness.boot", "fakebuild"], env=env, timeout_s=600,
                          stdout=subprocess.PIPE)
    helper = 0
    if {hold_pipe!r}:
      helper = os.fork()
      if helper == 0:  # holds every fd of the parent, the pipe's write end included
        time.sleep(60)
        os._exit(0)
    print(proc.pid, proc.stdout.readline().decode().strip(), helper, flush=True)
    proc.wait()
  """))
  parent = subprocess.Popen([sys.executable, str(tmp_path / "fakeparity.py")], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
  worker, grandchild, helper = (int(x) for x in parent.stdout.readline().split())
  return parent, worker, grandchild, helper or None


@pytest.mark.process
@pytest.mark.parametrize("hold_pipe", [True, False], ids=["parent-death-signal-only", "signal-and-pipe"])
def test_kill_9_of_parity_leaves_no_grandchild_in_its_own_group(tmp_path, hold_pipe):
  """kill -9 of the process that spawned the worker: within 5 s neither the worker nor its grandchild in a group of
  its own runs. With the pipe held open elsewhere the old SIGKILL parent-death signal always orphaned the
  grandchild (the worker died before it could kill it); without, the pipe watcher only sometimes won that race."""
  parent, worker, grandchild, helper = _fake_build_tree(tmp_path, hold_pipe)
  try:
    time.sleep(0.5)  # the worker is in subprocess.run now
    assert _alive(worker) and _alive(grandchild)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    left = _wait_gone([worker, grandchild], 5.0)
    assert not left, f"still running after kill -9 of their parity process: {left}"
  finally:
    for p in (worker, grandchild, helper):
      if p and _alive(p):
        os.kill(p, signal.SIGKILL)
