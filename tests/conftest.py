"""Shared fixtures: tiny run folders built with the real contract code."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))


def _has(mod: str) -> bool:
  import importlib.util
  return importlib.util.find_spec(mod) is not None


HAS_JAX = _has("jax") and _has("flax") and _has("optax")
HAS_TORCH = _has("torch")
HAS_DEEPSPEED = HAS_TORCH and _has("deepspeed")
requires_jax = pytest.mark.skipif(not HAS_JAX, reason="jax/flax/optax not installed")
requires_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
requires_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed not installed")
requires_all = pytest.mark.skipif(not (HAS_JAX and HAS_DEEPSPEED), reason="needs jax, torch and deepspeed")


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


_STARTS_DEEPSPEED = ("torch_impl.engine", "import deepspeed", "port_verify", "--verify", "--deepspeed-config")
"""Module text that means its tests can load a DeepSpeed op without saying so in a marker (setup_distributed loads
deepspeed_shm_comm; port --verify builds fused_adam)."""


def _needs_deepspeed_ops(item) -> bool:
  """A test that can start a DeepSpeed process: marked requires_deepspeed, skipped unless deepspeed is installed
  (requires_deepspeed / requires_all above), or in a module that reaches DeepSpeed (_STARTS_DEEPSPEED)."""
  for mark in item.iter_markers():
    if mark.name == "requires_deepspeed":
      return True
    if mark.name == "skipif" and "deepspeed" in str(mark.kwargs.get("reason", "")):
      return True
  try:
    text = Path(str(item.fspath)).read_text(errors="replace")
  except OSError:
    return False
  return any(needle in text for needle in _STARTS_DEEPSPEED)


@pytest.fixture(scope="session", autouse=True)
def deepspeed_ops_built(request):
  """Builds DeepSpeed's JIT ops (cpu_adam, deepspeed_shm_comm, fused_adam) once, before the first test, when the
  session collected a test that can start DeepSpeed: no test then builds one inside its own timeout, and no op is
  built twice (every process uses harness.env's one build environment). ~7 s when all are built (check and load);
  on a fresh environment ~3-8 min on 2 cores (README, 'DeepSpeed ops'). A failed build is reported and left to the
  tests that need the op."""
  if not HAS_DEEPSPEED or not any(_needs_deepspeed_ops(i) for i in request.session.items):
    yield None
    return
  import subprocess
  import time
  from harness.env import worker_env
  import contextlib
  reporter = request.config.pluginmanager.get_plugin("terminalreporter")
  capture = request.config.pluginmanager.get_plugin("capturemanager")

  def say(msg: str) -> None:  # shown even under output capture: the wait is the user's to see
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
      reporter.write_line(msg) if reporter is not None else print(msg)
  say("conftest: building DeepSpeed ops once for this session (first use ~3-8 min on 2 cores; ~7 s when built)")
  t0 = time.time()
  proc = subprocess.run([sys.executable, "-m", "torch_impl.ops"], cwd=ROOT, env=worker_env(), capture_output=True,
                        text=True, timeout=1800)
  lines = (proc.stdout + proc.stderr).strip().splitlines()
  say(f"conftest: {lines[-1] if lines else 'no output'} ({'ok' if proc.returncode == 0 else 'FAILED, exit '}"
      f"{'' if proc.returncode == 0 else proc.returncode}; {time.time() - t0:.0f} s)")
  yield proc.returncode == 0
