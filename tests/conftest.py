"""Shared fixtures: tiny run folders built with the real contract code."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

import process_guard  # noqa: E402  (before anything can start a process: its wrappers go in at import)
from harness.env import thread_environ  # noqa: E402  (after the path: the worktree's harness)

THREADS = thread_environ(os.environ)
"""The test processes' thread settings, the workers' own (harness.env.thread_environ), set before any test imports
torch: this process and every process a test starts run with them (OpenMP's spinning default ran a torch side 3-6x
slower on a busy machine: benchmarks/results/torch_contention.md); a user's OMP_* variables are kept."""


def _has(mod: str) -> bool:
  import importlib.util
  return importlib.util.find_spec(mod) is not None


HAS_JAX = _has("jax") and _has("flax") and _has("optax")
HAS_TORCH = _has("torch")
HAS_DEEPSPEED = HAS_TORCH and _has("deepspeed")
_REQUIRES = {"requires_jax": (HAS_JAX, "jax/flax/optax not installed"),
             "requires_torch": (HAS_TORCH, "torch not installed"),
             "requires_deepspeed": (HAS_DEEPSPEED, "deepspeed not installed")}
"""The package markers (pyproject.toml) and what each needs: pytest_runtest_setup skips a marked test, saying why,
where its package is missing. `requires_deepspeed` is also what deepspeed_ops_built looks for: every test that can
start DeepSpeed carries it (a worker of the deepspeed side, `port --verify`, a `--deepspeed-config` run)."""
requires_jax = pytest.mark.requires_jax
requires_torch = pytest.mark.requires_torch
requires_deepspeed = pytest.mark.requires_deepspeed


def requires_all(obj):
  """Marks a test function or class requires_jax and requires_deepspeed (a run of all three sides)."""
  return requires_jax(requires_deepspeed(obj))


def pytest_configure(config):
  config.pluginmanager.register(process_guard, "process_guard")
  if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    # a suite started as a background job (`nohup pytest &`: the shell ignores SIGINT for it) would hand the
    # ignored SIGINT to every worker and every process a test starts, and parity keeps an ignored SIGINT ignored on
    # purpose (harness.lifetime.stop_signals); the Ctrl-C tests need it delivered, so the suite starts from Python's
    # default, as in a terminal (tests that want it ignored set SIG_IGN themselves)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_runtest_setup(item):
  for name, (present, reason) in _REQUIRES.items():
    if not present and item.get_closest_marker(name) is not None:
      pytest.skip(reason)


def process_alive(pid: int) -> bool:
  """True while `pid` runs (a zombie waiting to be reaped counts as gone)."""
  try:
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
  except (OSError, IndexError):
    return False
  return state not in ("Z", "X")


@pytest.fixture
def tiny_run_dir(tmp_path):
  """A prepared run folder for the gpt2-tiny preset (few steps), with a factory for variants."""
  from parity.pipeline.folder import prepare_run_dir
  from parity.pipeline.resolve import resolve

  def make(steps: int = 4, overrides=(), perturb=None, sides=None):
    spec = resolve("gpt2-tiny", steps=steps, overrides=overrides, sides=sides)
    rd = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    prepare_run_dir(spec, rd, perturb=perturb or {})
    return rd, spec
  return make


def pytest_xdist_auto_num_workers(config):
  """`-n auto` (pyproject.toml's addopts): one pytest worker per CPU this process may use (affinity mask), at most 4,
  none (everything in this process) on one CPU. Most of the suite's time is processes that import a framework and
  compile one small step, one CPU each for much of it, so two workers on 2 cores overlap one test's start-up with
  another's compute; past 4, several three-side compares at once cost more memory than they save time (each ~1-3
  GB). Each worker runs whole modules (`--dist loadfile`)."""
  usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
  return 0 if usable < 2 else min(usable, 4)


def pytest_collection_modifyitems(session, config, items):
  """Runs the modules with no `requires_deepspeed` test first (each module's tests stay together and in order), so
  the op build `deepspeed_ops_built` starts in the background overlaps them instead of holding the first test: on a
  fresh environment the build took 892 s at load 7 (fused_adam 499 s), most of it one compiler on one core."""
  needs = {item.module.__name__ for item in items if item.get_closest_marker("requires_deepspeed") is not None
           and getattr(item, "module", None) is not None}
  items.sort(key=lambda item: getattr(getattr(item, "module", None), "__name__", "") in needs)  # stable


class _OpBuild:
  """The once-per-session build of DeepSpeed's JIT ops (`python -m torch_impl.ops`), started at the session's first
  test and waited for by the first test marked requires_deepspeed (`wait`)."""

  def __init__(self, request):
    import subprocess
    import tempfile
    import time
    from harness.env import worker_env
    self.request, self.t0, self.result = request, time.time(), None
    self.log = tempfile.TemporaryFile(mode="w+")
    with process_guard.allowed():  # conftest's own build, whichever test happens to be first
      self.proc = subprocess.Popen([sys.executable, "-m", "torch_impl.ops"], cwd=ROOT, env=worker_env(),
                                   stdout=self.log, stderr=subprocess.STDOUT, text=True)
    self.say("conftest: building DeepSpeed ops in the background for this session (first use ~3-8 min on 2 cores; "
             "~7 s when built); the first test that needs DeepSpeed waits for it")

  def say(self, msg: str) -> None:  # shown even under output capture: the wait is the user's to see
    import contextlib
    reporter = self.request.config.pluginmanager.get_plugin("terminalreporter")
    capture = self.request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
      reporter.write_line(msg) if reporter is not None else print(msg)

  def wait(self) -> bool:
    """True when every op built (or loaded); a failed build is reported once and left to the tests that need it."""
    import time
    if self.result is None:
      try:
        code = self.proc.wait(timeout=max(1.0, 1800 - (time.time() - self.t0)))
      except BaseException:  # timeout or Ctrl-C: no build left running behind the session
        self.proc.kill()
        self.proc.wait()
        raise
      self.log.seek(0)
      lines = self.log.read().strip().splitlines()
      self.say(f"conftest: {lines[-1] if lines else 'no output'} ({'ok' if code == 0 else 'FAILED, exit '}"
               f"{'' if code == 0 else code}; {time.time() - self.t0:.0f} s since the session started)")
      self.result = code == 0
    return self.result

  def close(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait()
    self.log.close()


@pytest.fixture(scope="session", autouse=True)
def deepspeed_ops_built(request):
  """Builds DeepSpeed's JIT ops (cpu_adam, deepspeed_shm_comm, fused_adam) once per session, in the background from
  the first test on, when the session collected a test marked requires_deepspeed (every test that can start
  DeepSpeed): no test then builds one inside its own timeout, and no op is built twice (every process uses
  harness.env's one build environment). ~7 s when all are built (check and load); on a fresh environment ~3-8 min on
  2 cores (README, 'DeepSpeed ops'). Yields the `_OpBuild` (None without such a test)."""
  if not HAS_DEEPSPEED or not any(i.get_closest_marker("requires_deepspeed") for i in request.session.items):
    yield None
    return
  build = _OpBuild(request)
  try:
    yield build
  finally:
    build.close()


@pytest.fixture(autouse=True)
def _deepspeed_ops_ready(request, deepspeed_ops_built):
  """Before a test marked requires_deepspeed: the session's op build has finished (the first such test waits)."""
  if deepspeed_ops_built is not None and request.node.get_closest_marker("requires_deepspeed") is not None:
    deepspeed_ops_built.wait()
  yield


@pytest.fixture
def fake_sides(monkeypatch):
  """harness.runner.run_side replaced by test_pipeline's fake worker (files as a worker writes them, in-process)."""
  import harness.runner
  import harness.self_runs
  from test_pipeline import _fake_run_side

  def install(interrupt_on: str | None = None):
    fake = _fake_run_side([], interrupt_on)
    monkeypatch.setattr(harness.runner, "run_side", fake)
    monkeypatch.setattr(harness.self_runs, "run_side", fake)
  return install
