"""One side at a time on a TPU chip (harness.chip): who takes the lock, that a second side waits for the first and
its time limit starts when it gets the chip, and that a stop while waiting leaves a summary. The TPU is stood in for
by `harness.doctor.tpu_evidence`; the lock file is a test's own (PARITY_CHIP_LOCK)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from harness import chip

pytestmark = pytest.mark.process  # each test but the first starts a holder process

TPU = lambda: "/dev/accel0 present"  # a TPU VM, as harness.doctor.tpu_evidence says it
NO_TPU = lambda: None


@pytest.mark.parametrize("side, env, evidence, expected", [
  ("jax", {}, TPU, True),
  ("jax", {"JAX_PLATFORMS": "tpu,cpu"}, TPU, True),
  ("jax", {"JAX_PLATFORMS": "cpu"}, TPU, False),  # the host-CPU rerun of the JAX side never opens the chip
  ("jax", {"JAX_PLATFORMS": " CPU "}, TPU, False),
  ("jax", {}, NO_TPU, False),  # a CPU or GPU machine
  ("torch", {}, TPU, False),
  ("deepspeed", {}, TPU, False),
])
def test_which_sides_hold_the_chip(side, env, evidence, expected):
  assert chip.holds_chip(side, env, evidence) is expected


def _holder(lock, seconds: float) -> subprocess.Popen:
  """Another parity process holding the chip for `seconds` (prints 'held' once it has it)."""
  code = textwrap.dedent(f"""
    import time
    from harness import chip
    with chip.chip_turn("jax", "runs/first", {{"{chip.LOCK_ENV}": {str(lock)!r}}}, evidence=lambda: "tpu"):
      print("held", flush=True)
      time.sleep({seconds})
  """)
  proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == "held"
  return proc


def test_a_second_side_waits_and_is_told_who_holds_the_chip(tmp_path):
  lock = tmp_path / "chip.lock"
  env = {chip.LOCK_ENV: str(lock)}
  first = _holder(lock, 1.5)
  lines: list[str] = []
  t0 = time.time()
  with chip.chip_turn("jax", "runs/second", env, on_wait=lines.append, evidence=TPU) as waited:
    got = time.time() - t0
    assert json.loads(lock.read_text()) == {"pid": __import__("os").getpid(), "side": "jax", "run": "runs/second"}
  first.wait(10)
  assert got >= 0.8 and waited >= 0.8, "the second side did not wait for the first"
  assert lines[0] == f"waiting for the TPU: parity pid {first.pid} (side jax of runs/first) holds it"
  assert lines[-1] == "", "the wait line is not cleared once the side has the chip"
  assert lock.read_text() == "", "the holder's line outlived its turn"


def test_sides_off_the_chip_never_wait(tmp_path):
  lock = tmp_path / "chip.lock"
  first = _holder(lock, 3.0)
  try:
    t0 = time.time()
    for side, env in (("torch", {}), ("jax", {"JAX_PLATFORMS": "cpu"})):
      with chip.chip_turn(side, "runs/x", {**env, chip.LOCK_ENV: str(lock)}, evidence=TPU) as waited:
        assert waited == 0.0
    assert time.time() - t0 < 1.0
  finally:
    first.kill()
    first.wait()


@pytest.mark.process
def test_run_side_limit_starts_when_the_side_has_the_chip(tmp_path, monkeypatch):
  """A 2 s side behind a 2.5 s holder, with a 3 s limit: it waits, then runs to completion instead of timing out."""
  import harness.doctor
  from harness.runner import run_side
  monkeypatch.setattr(harness.doctor, "tpu_evidence", TPU)
  lock = tmp_path / "chip.lock"
  (tmp_path / "request.json").write_text("{}")
  (tmp_path / "twosec.py").write_text(textwrap.dedent("""
    import json, pathlib, sys, time
    time.sleep(2)
    out = pathlib.Path(sys.argv[1]).parent / "jax"
    (out / "summary.json").write_text(json.dumps({"side": "jax", "status": "ok", "steps_completed": 0}))
  """))
  first = _holder(lock, 2.5)
  notes: list[tuple] = []
  t0 = time.time()
  sr = run_side(tmp_path, "jax", timeout_s=3, module="twosec", on_progress=lambda *a: notes.append(a),
                env={"PYTHONPATH": str(tmp_path), chip.LOCK_ENV: str(lock)})
  first.wait(10)
  assert sr.status == "ok", sr.error
  assert time.time() - t0 >= 4.0
  assert sr.wall_s < 3.5, "the wait for the chip was counted as the side's run time"
  assert any("waiting for the TPU" in str(n[-1]) for n in notes)


def test_a_stop_while_waiting_leaves_a_summary(tmp_path, monkeypatch):
  import harness.doctor
  from harness import lifetime
  from harness.runner import run_side
  monkeypatch.setattr(harness.doctor, "tpu_evidence", TPU)
  lock = tmp_path / "chip.lock"
  (tmp_path / "request.json").write_text("{}")
  first = _holder(lock, 5.0)
  try:
    timer = threading.Timer(0.5, lambda: setattr(lifetime._stop, "pending", True))  # a held Ctrl-C
    timer.start()
    with pytest.raises(KeyboardInterrupt):
      run_side(tmp_path, "jax", timeout_s=3, module="never_started", env={chip.LOCK_ENV: str(lock)})
    summary = json.loads((tmp_path / "jax" / "summary.json").read_text())
    assert summary["status"] == "killed"
    assert f"parity pid {first.pid}" in summary["error"] and "never started" in summary["error"]
  finally:
    lifetime._stop.pending = False
    first.kill()
    first.wait()


@pytest.mark.parametrize("text, who", [
  ("jaxlib.xla_extension.XlaRuntimeError: ABORTED: The TPU is already in use by process with pid 4242. Not "
   "attempting to load libtpu.so in this process.", "process 4242"),
  ("RuntimeError: Unable to initialize backend 'tpu': ... libtpu multi-process lockfile ...", "another process"),
  ("Unable to initialize backend 'tpu': open(/dev/accel0): Device or resource busy", "another process"),
])
def test_a_chip_held_outside_parity_is_named(text, who):
  assert chip.busy_hint(text).startswith(f"the TPU was held by {who}, not a parity side")
  assert chip.busy_hint("ValueError: shapes (3,) and (4,) not aligned") is None
  assert chip.busy_hint("could not open /tmp/libtpu_lockfile: Permission denied") is None  # not "in use"


def test_run_side_names_a_chip_held_outside_parity(tmp_path):
  from harness.runner import run_side
  (tmp_path / "request.json").write_text("{}")
  (tmp_path / "busy.py").write_text("raise RuntimeError('ABORTED: The TPU is already in use by process with pid 7')\n")
  sr = run_side(tmp_path, "torch", timeout_s=30, module="busy", env={"PYTHONPATH": str(tmp_path)})
  assert sr.status == "crashed"
  assert sr.error.startswith("the TPU was held by process 7, not a parity side")
  assert json.loads((tmp_path / "torch" / "summary.json").read_text())["error"] == sr.error


def test_the_lock_never_follows_a_symlink_or_takes_over_another_file(tmp_path):
  victim = tmp_path / "victim.txt"
  victim.write_text("data")
  victim.chmod(0o600)
  (tmp_path / "link.lock").symlink_to(victim)
  for path in (tmp_path / "link.lock", victim, tmp_path):  # a symlink, another program's file, a folder
    why = rf"the TPU lock file {re.escape(str(path))} (cannot be opened|is not a parity)"
    with pytest.raises(chip.ChipLockError, match=why):
      with chip.chip_turn("jax", "r", {chip.LOCK_ENV: str(path)}, evidence=TPU):
        pass
  assert victim.read_text() == "data" and (victim.stat().st_mode & 0o777) == 0o600


def test_an_unusable_lock_leaves_the_side_not_run_with_a_summary(tmp_path, monkeypatch):
  import harness.doctor
  from harness.runner import run_side
  monkeypatch.setattr(harness.doctor, "tpu_evidence", TPU)
  (tmp_path / "request.json").write_text("{}")
  sr = run_side(tmp_path, "jax", timeout_s=3, module="never_started",
                env={chip.LOCK_ENV: str(tmp_path / "missing" / "chip.lock")})
  assert sr.status == "not_run" and "the TPU lock file" in sr.error and chip.LOCK_ENV in sr.error
  assert json.loads((tmp_path / "jax" / "summary.json").read_text())["status"] == "not_run"


def test_a_nested_turn_in_the_holding_process_does_not_wait_on_itself(tmp_path):
  env = {chip.LOCK_ENV: str(tmp_path / "chip.lock")}
  with chip.chip_turn("jax", "outer", env, evidence=TPU):
    t0 = time.time()
    with chip.chip_turn("jax", "inner", env, evidence=TPU) as waited:
      assert waited == 0.0
    assert time.time() - t0 < 1.0
