"""tests/process_guard.py: a test that starts a process without the `process` marker fails, however it starts it
and even when it catches the refusal; one that starts DeepSpeed without `requires_deepspeed` fails too; the
read-only probes (process_guard.PROBES: git, uname) need no marker.

Shown on planted tests run by an inner pytest (its own process, so the outer test carries the marker)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from process_guard import starts_deepspeed

TESTS = Path(__file__).resolve().parent

PLANTED = '''
import multiprocessing, os, subprocess
import pytest

def test_unmarked_subprocess():
  subprocess.run(["true"])

def test_unmarked_that_swallows_the_refusal():
  try:
    subprocess.run(["true"])
  except Exception:
    pass

def test_unmarked_fork():
  pid = os.fork()
  if pid == 0:
    os._exit(0)
  os.waitpid(pid, 0)

def test_unmarked_multiprocessing():
  p = multiprocessing.get_context("spawn").Process(target=os.getpid)
  p.start()
  p.join()

@pytest.fixture
def started():
  return subprocess.run(["true"]).returncode

def test_unmarked_with_a_fixture_that_starts_one(started):
  assert started == 0

def test_in_process_only():
  assert sum(range(4)) == 6

def test_unmarked_probe():
  assert subprocess.run(["git", "--version"], capture_output=True).returncode == 0

@pytest.mark.process
def test_marked():
  assert subprocess.run(["true"]).returncode == 0

@pytest.mark.process
def test_marked_process_starting_deepspeed_unmarked():
  subprocess.run(["true", "-m", "harness.boot", "torch_impl.worker", "request.json", "--side", "deepspeed"])

@pytest.mark.process
@pytest.mark.requires_deepspeed
def test_marked_for_deepspeed():
  subprocess.run(["true", "-m", "harness.boot", "torch_impl.worker", "request.json", "--side", "deepspeed"])
'''

CONFTEST = f'''
import sys
sys.path.insert(0, {str(TESTS)!r})
import process_guard

def pytest_configure(config):
  config.pluginmanager.register(process_guard, "process_guard")
  config.addinivalue_line("markers", "process: starts a process")
  config.addinivalue_line("markers", "requires_deepspeed: may start DeepSpeed")
'''


@pytest.mark.process
def test_planted_unmarked_tests_fail_and_marked_ones_pass(tmp_path):
  (tmp_path / "pytest.ini").write_text("[pytest]\n")
  (tmp_path / "conftest.py").write_text(textwrap.dedent(CONFTEST))
  (tmp_path / "test_planted.py").write_text(textwrap.dedent(PLANTED))
  r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "test_planted.py"],
                     cwd=tmp_path, capture_output=True, text=True, timeout=120)
  out = r.stdout
  outcome = {line.split()[1].split("::")[1]: line.split()[0] for line in out.splitlines()
             if line.split()[:1] in (["PASSED"], ["FAILED"], ["ERROR"]) and "::" in line}
  assert outcome == {
      "test_unmarked_subprocess": "FAILED", "test_unmarked_that_swallows_the_refusal": "FAILED",
      "test_unmarked_fork": "FAILED", "test_unmarked_multiprocessing": "FAILED",
      "test_unmarked_with_a_fixture_that_starts_one": "ERROR", "test_in_process_only": "PASSED",
      "test_unmarked_probe": "PASSED",
      "test_marked": "PASSED", "test_marked_process_starting_deepspeed_unmarked": "FAILED",
      "test_marked_for_deepspeed": "PASSED"}, out
  assert r.returncode == 1, out
  assert "test_unmarked_that_swallows_the_refusal started a process (_fork_exec: true) without the `process` " \
         "marker: mark the test @pytest.mark.process" in out, out
  assert "started DeepSpeed (true -m harness.boot torch_impl.worker request.json --side deepspeed) without the " \
         "`requires_deepspeed` marker" in out, out


@pytest.mark.parametrize("argv,starts", [
    (["py", "-m", "harness.boot", "torch_impl.worker", "r.json", "--side", "deepspeed"], True),
    (["py", "-m", "harness.boot", "torch_impl.worker", "r.json", "--side", "torch"], False),
    (["py", "-m", "harness.boot", "jax_impl.worker", "r.json", "--side", "jax"], False),
    (["py", "-m", "torch_impl.port_verify", "cfg.json"], True),
    (["py", "-m", "torch_impl.ops"], True),
    (["py", "-m", "parity.cli", "compare", "--steps", "4"], True),  # default sides: all three
    (["py", "-m", "parity.cli", "compare", "--sides", "jax,torch"], False),
    (["py", "-m", "parity.cli", "compare", "--sides=deepspeed"], True),
    (["py", "-m", "parity.cli", "compare", "--sides", "jax", "--deepspeed-config", "ds.json"], True),
    (["py", "-m", "parity.cli", "port", "ds.json", "--verify"], True),
    (["py", "-m", "parity.cli", "port", "ds.json"], False),
    (["py", "-m", "parity.cli", "report", "run"], False),
    (["/venv/bin/parity", "diagnose", "--preset", "gpt2-tiny"], True),
])
def test_starts_deepspeed_reads_the_command_line(argv, starts):
  assert starts_deepspeed(argv) is starts
