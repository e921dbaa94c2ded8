"""A host-memory guard for a benchmark's process tree: when the host's memory runs low, the largest process of the
tree is killed, so one part fails and is recorded instead of the machine's own limit ending the whole command.

A TPU run that holds a large premapped region (TPU_PREMAPPED_BUFFER_SIZE: pinned, resident from the moment a process
opens the chip) beside the step's host buffers can take a VM's memory; where the VM is a sandbox with a memory cap,
crossing it ends every process at once and nothing is written. The guard polls the used memory (the cgroup's where
its files are readable, else MemTotal - MemAvailable), and past `limit - floor` it kills the process of the tree
below the leader with the largest resident set (SIGKILL: one that is out of memory cannot be asked), logs one line,
and keeps watching. The limit is the smaller of the machine's memory, the cgroup's limit and --host-limit-mib (a cap
the guard cannot read, as a sandbox's). The tree is found by parent links, not by session:
each part runs in a session of its own (harness.lifetime), and the leader is the driver that records the part.
"""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Callable

POLL_S = 0.25
"""Seconds between reads. A process filling pinned memory at ~10 GB/s takes ~0.3 s per floor of 3 GiB."""

CGROUP_FILES = (("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.max"),
                ("/sys/fs/cgroup/memory/memory.usage_in_bytes", "/sys/fs/cgroup/memory/memory.limit_in_bytes"))
"""(usage, limit) of cgroup v2, then v1."""


def _meminfo(text: str) -> dict[str, int]:
  """/proc/meminfo's fields in bytes."""
  out = {}
  for line in text.splitlines():
    name, _, rest = line.partition(":")
    parts = rest.split()
    if parts and parts[0].isdigit():
      out[name.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
  return out


def _read_int(path: str) -> int | None:
  try:
    raw = Path(path).read_text().strip()
  except OSError:
    return None
  return int(raw) if raw.isdigit() else None


def used_and_limit(cap: int | None = None) -> tuple[int, int]:
  """(bytes used, bytes limit) of this machine's memory, as the module docstring reads them."""
  info = _meminfo(Path("/proc/meminfo").read_text())
  used, limit = info["MemTotal"] - info.get("MemAvailable", info.get("MemFree", 0)), info["MemTotal"]
  for usage_file, limit_file in CGROUP_FILES:
    usage, group_limit = _read_int(usage_file), _read_int(limit_file)
    if usage is not None:
      used = usage
      if group_limit is not None:
        limit = min(limit, group_limit)
      break
  return used, min(limit, cap) if cap else limit


def tree_rss(leader: int) -> dict[int, int]:
  """{pid: resident bytes} of `leader` and every process it started, however deep, found by parent links (a part may
  run in a session of its own, so the session id would miss it)."""
  page = os.sysconf("SC_PAGE_SIZE")
  parent, rss = {}, {}
  for entry in Path("/proc").iterdir():
    if not entry.name.isdigit():
      continue
    try:
      stat = (entry / "stat").read_text()
      fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
      parent[int(entry.name)] = int(fields[1])  # field 4 of stat: the parent's pid
      rss[int(entry.name)] = int((entry / "statm").read_text().split()[1]) * page
    except (OSError, ValueError, IndexError):
      continue  # the process ended while it was read
  out = {}
  for pid in rss:
    p, seen = pid, 0
    while p and p != leader and seen < 64:  # up the chain to the leader or the root
      p, seen = parent.get(p, 0), seen + 1
    if p == leader:
      out[pid] = rss[pid]
  return out


def victim(rss: dict[int, int], leader: int) -> int | None:
  """The process to kill: the largest that is not the leader (the leader records the failed part); the leader
  only when it is all there is."""
  others = {p: r for p, r in rss.items() if p != leader}
  pool = others or rss
  return max(pool, key=pool.get) if pool else None


class Guard:
  """Watches the process tree of `leader` (its pid and everything started below it) from a thread; `start()`, then
  `stop()`. `killed` lists what it killed, as lines; `log` receives each line as it happens."""

  def __init__(self, leader: int, floor_bytes: int, cap_bytes: int | None = None,
               log: Callable[[str], None] = print, read: Callable[[], tuple[int, int]] | None = None):
    self.leader, self.floor, self.cap, self.log = leader, floor_bytes, cap_bytes, log
    self.read = read or (lambda: used_and_limit(self.cap))
    self.killed: list[str] = []
    self.peak_used = 0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._watch, daemon=True)

  def check(self) -> str | None:
    """One read; kills and returns the line when the host is past its floor, else None."""
    used, limit = self.read()
    self.peak_used = max(self.peak_used, used)
    if used <= limit - self.floor:
      return None
    rss = tree_rss(self.leader)
    pid = victim(rss, self.leader)
    if pid is None:
      return None
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      return None
    line = (f"host memory {used / 2**30:.2f} GiB used of {limit / 2**30:.2f} GiB (floor {self.floor / 2**30:.2f} "
            f"GiB): killed pid {pid} ({rss[pid] / 2**30:.2f} GiB resident)")
    self.killed.append(line)
    self.log(line)
    return line

  def _watch(self) -> None:
    while not self._stop.wait(POLL_S):
      self.check()

  def start(self) -> "Guard":
    self._thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()
    self._thread.join(timeout=2 * POLL_S + 1)
