"""benchmarks/tpu_parts/memguard.py: the host-memory guard kills the largest process of a run's tree (never the
leader while it has children) once the host is past its floor, and leaves the tree alone below it. And a compiled
probe whose host buffers the host cannot hold beside the TPU runtime is a host limit
(jax_largest.compiled_host_problem)."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from benchmarks.tpu_parts import memguard

GIB = 2**30


def test_meminfo_reads_kib_fields():
  info = memguard._meminfo("MemTotal:       47185920 kB\nMemAvailable:   43117260 kB\nHugePages_Total:       0\n")
  assert info["MemTotal"] == 47185920 * 1024 and info["MemAvailable"] == 43117260 * 1024
  assert info["HugePages_Total"] == 0


def test_used_and_limit_applies_a_cap():
  used, limit = memguard.used_and_limit()
  assert 0 < used <= limit
  _, capped = memguard.used_and_limit(cap=1 << 20)
  assert capped == 1 << 20


def test_victim_prefers_the_largest_child():
  assert memguard.victim({10: 5 * GIB, 11: 1 * GIB, 12: 3 * GIB}, leader=10) == 12
  assert memguard.victim({10: 5 * GIB}, leader=10) == 10
  assert memguard.victim({}, leader=10) is None


PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "b = bytearray(64 << 20); import time; time.sleep(60)"],
                         start_new_session=True)  # as harness.lifetime starts a part: a session of its own
print(child.pid, flush=True)
child.wait()
print("child", child.returncode, flush=True)
"""


@pytest.mark.process
def test_guard_kills_the_child_in_its_own_session_past_the_floor_and_spares_it_below():
  proc = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, start_new_session=True)
  try:
    child = int(proc.stdout.readline())
    deadline = time.monotonic() + 20
    while child not in memguard.tree_rss(proc.pid) and time.monotonic() < deadline:
      time.sleep(0.05)
    rss = memguard.tree_rss(proc.pid)
    assert set(rss) >= {proc.pid, child}
    lines: list[str] = []
    calm = memguard.Guard(proc.pid, 2 * GIB, read=lambda: (10 * GIB, 40 * GIB), log=lines.append)
    assert calm.check() is None and not lines and proc.poll() is None
    tight = memguard.Guard(proc.pid, 2 * GIB, read=lambda: (39 * GIB, 40 * GIB), log=lines.append)
    line = tight.check()
    assert line and f"killed pid {child}" in line and "39.00 GiB used of 40.00 GiB" in line
    assert proc.stdout.readline().strip() == "child -9"  # the leader lives on and sees its child killed
    assert proc.wait(timeout=20) == 0 and tight.killed == [line] and tight.peak_used == 39 * GIB
  finally:
    if proc.poll() is None:
      proc.kill()


def test_a_compiled_step_whose_host_buffers_the_host_cannot_hold_is_a_host_limit(monkeypatch):
  from benchmarks.gpu_parts import sizing
  from benchmarks.gpu_parts.jax_largest import compiled_host_problem
  monkeypatch.setenv("TPU_PREMAPPED_BUFFER_SIZE", str(256 << 20))
  overhead = sizing.tpu_host_overhead()
  assert compiled_host_problem(None, 40 * GIB, "tpu") is None
  assert compiled_host_problem(40 * GIB - overhead, 40 * GIB, "tpu") is None
  why = compiled_host_problem(40 * GIB - overhead + 1, 40 * GIB, "tpu")
  assert why and f"+ {overhead / GIB:.2f} GiB the TPU runtime holds > the host's 40.00 GiB" in why
  assert compiled_host_problem(40 * GIB - overhead + 1, 40 * GIB, "gpu") is None  # no TPU runtime beside it
  assert "> the host's 16.00 GiB" in compiled_host_problem(20 * GIB, 16 * GIB, "gpu")


@pytest.mark.parametrize("option,value", [("--host-floor-mib", "-1"), ("--host-limit-mib", "0"),
                                          ("--premapped-mib", "-5")])
def test_bench_refuses_a_guard_or_region_that_cannot_mean_anything(option, value, capsys):
  from benchmarks.tpu_parts import bench
  with pytest.raises(SystemExit) as exc:
    bench.parse(["--out", "/tmp/unused", option, value])
  assert exc.value.code == 2 and f"{option} must be" in capsys.readouterr().err


def test_the_cgroup_use_leaves_out_the_reclaimable_file_cache_and_a_max_limit_is_the_machines(tmp_path, monkeypatch):
  """memory.current counts the page cache the kernel reclaims before memory.max bites: its inactive file pages are
  not use the guard should kill for. A limit of 'max' is no limit: the machine's memory bounds it."""
  cur, top, stat = tmp_path / "memory.current", tmp_path / "memory.max", tmp_path / "memory.stat"
  cur.write_text(f"{10 * GIB}\n")
  top.write_text(f"{20 * GIB}\n")
  stat.write_text(f"anon {6 * GIB}\nfile {4 * GIB}\nactive_file {GIB}\ninactive_file {3 * GIB}\n")
  monkeypatch.setattr(memguard, "CGROUP_FILES", ((str(cur), str(top), str(stat), "inactive_file"),))
  total = memguard._meminfo(open("/proc/meminfo").read())["MemTotal"]
  assert memguard.used_and_limit() == (7 * GIB, min(total, 20 * GIB))
  top.write_text("max\n")
  stat.unlink()  # no memory.stat: the whole use counts
  assert memguard.used_and_limit() == (10 * GIB, total)


ZOMBIE = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "pass"])
print(child.pid, flush=True)
time.sleep(60)  # never reaps it: a zombie
"""


@pytest.mark.process
def test_a_zombie_holds_no_memory_and_is_no_victim():
  proc = subprocess.Popen([sys.executable, "-c", ZOMBIE], stdout=subprocess.PIPE, text=True, start_new_session=True)
  try:
    child = int(proc.stdout.readline())
    deadline = time.monotonic() + 20
    while (memguard._stat(child) or ("Z",))[0] != "Z" and time.monotonic() < deadline:
      time.sleep(0.05)
    assert memguard._stat(child)[0] == "Z"
    assert set(memguard.tree_rss(proc.pid)) == {proc.pid}  # a kill sent to it would free nothing
  finally:
    proc.kill()
    proc.wait()


@pytest.mark.process
def test_a_kill_names_the_process_by_its_start_time():
  """A pid the system reused since the scan is another process: its start time differs, and it is not signalled."""
  proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
  try:
    start = memguard._stat(proc.pid)[2]
    assert not memguard.kill(proc.pid, start + 1) and proc.poll() is None
    assert memguard.kill(proc.pid, start) and proc.wait(timeout=20) == -9
    assert not memguard.kill(proc.pid, start)  # gone
  finally:
    if proc.poll() is None:
      proc.kill()


def test_no_second_kill_while_the_first_is_still_exiting(monkeypatch):
  """Memory comes back only as a killed process ends: until then the next read still sees it used, and a kill then
  would take the next process (at last the leader, the driver that records the failed part)."""
  leader, child = 100, 101
  state = {"child": "R"}
  sent = []
  monkeypatch.setattr(memguard, "tree_rss", lambda pid, starts=None: (
      starts.update({leader: 1, child: 2}) if starts is not None else None,
      {leader: GIB} | ({child: 30 * GIB} if state["child"] == "R" else {}))[1])
  monkeypatch.setattr(memguard, "_stat", lambda pid: (state["child"], leader, 2) if pid == child else ("S", 1, 1))
  monkeypatch.setattr(memguard, "kill", lambda pid, start: sent.append(pid) or True)
  guard = memguard.Guard(leader, 2 * GIB, read=lambda: (39 * GIB, 40 * GIB), log=lambda line: None)
  assert f"killed pid {child}" in guard.check() and sent == [child]
  assert guard.check() is None and guard.check() is None and sent == [child]  # still exiting: wait for it
  state["child"] = "Z"  # it ended, and the host is still past its floor: the leader is all that is left
  assert f"killed pid {leader}" in guard.check() and sent == [child, leader] and len(guard.killed) == 2


def test_a_failed_read_does_not_end_the_watch(monkeypatch):
  monkeypatch.setattr(memguard, "POLL_S", 0.01)
  lines, reads = [], []

  def read():
    reads.append(1)
    raise FileNotFoundError("/proc/meminfo")
  guard = memguard.Guard(1, GIB, read=read, log=lines.append).start()
  deadline = time.monotonic() + 20
  while len(reads) < 5 and time.monotonic() < deadline:
    time.sleep(0.01)
  alive = guard._thread.is_alive()
  guard.stop()
  assert alive and guard.errors >= 5 and len(lines) == 1 and "FileNotFoundError" in lines[0]


@pytest.mark.process
def test_bench_writes_the_guards_record_when_gpu_py_is_stopped_at_its_budget(tmp_path):
  import argparse
  import json
  import os

  from benchmarks.tpu_parts import bench
  a = argparse.Namespace(out=str(tmp_path), host_floor_mib=0, host_limit_mib=None)
  status = bench.run([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ), 0.5, a)
  rec = json.loads((tmp_path / "bench" / "host_memory.json").read_text())
  assert status == 1 and rec["killed"] == [] and rec["floor_bytes"] == 0 and rec["cap_bytes"] is None
  assert "inactive file cache" in rec["source"]  # the guard read the host at 0.25 s intervals meanwhile
