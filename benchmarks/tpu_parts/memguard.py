"""A host-memory guard for a benchmark's process tree: when the host's memory runs low, the largest process of the
tree is killed, so one part fails and is recorded instead of the machine's own limit ending the whole command.

A TPU run that holds a large premapped region (TPU_PREMAPPED_BUFFER_SIZE: pinned, resident from the moment a process
opens the chip) beside the step's host buffers can take a VM's memory; where the VM has a memory cap,
crossing it ends every process at once and nothing is written. The guard polls the used memory (the cgroup's where
its files are readable, less its inactive file cache: the page cache the kernel reclaims before the cgroup's limit
bites, left out as the kubelet's working set leaves it; else MemTotal - MemAvailable), and past `limit - floor` it
kills the process of the tree below the leader with the largest resident set (SIGKILL: one that is out of memory
cannot be asked), logs one line, and keeps watching. It kills no other while that one is still exiting: its memory
comes back only as it ends, and a kill at the next read would take the next process, at last the leader, for memory
already on its way back. A process is named by its pid and start time and signalled through a pidfd after its start
time is read again, so a pid reused since the scan is never hit. The limit is the smaller of the machine's memory,
the cgroup's limit and --host-limit-mib (a cap the guard cannot read). The tree is found by parent
links, not by session: each part runs in a session of its own (harness.lifetime), and the leader is the driver that
records the part.
"""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Callable

POLL_S = 0.25
"""Seconds between reads. A process filling pinned memory at ~10 GB/s takes ~0.3 s per floor of 3 GiB."""

CGROUP_FILES = (("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.stat",
                 "inactive_file"),
                ("/sys/fs/cgroup/memory/memory.usage_in_bytes", "/sys/fs/cgroup/memory/memory.limit_in_bytes",
                 "/sys/fs/cgroup/memory/memory.stat", "total_inactive_file"))
"""(usage, limit, stat file, its reclaimable file-cache key) of cgroup v2, then v1."""


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


def _stat_field(path: str, key: str) -> int:
  """One `key value` line of a cgroup's memory.stat, 0 where the file or the key is missing."""
  try:
    lines = Path(path).read_text().splitlines()
  except OSError:
    return 0
  for line in lines:
    name, _, value = line.partition(" ")
    if name == key and value.strip().isdigit():
      return int(value)
  return 0


def used_and_limit(cap: int | None = None) -> tuple[int, int]:
  """(bytes used, bytes limit) of this machine's memory, as the module docstring reads them."""
  info = _meminfo(Path("/proc/meminfo").read_text())
  used, limit = info["MemTotal"] - info.get("MemAvailable", info.get("MemFree", 0)), info["MemTotal"]
  for usage_file, limit_file, stat_file, cache_key in CGROUP_FILES:
    usage, group_limit = _read_int(usage_file), _read_int(limit_file)
    if usage is not None:
      used = max(0, usage - _stat_field(stat_file, cache_key))
      if group_limit is not None:
        limit = min(limit, group_limit)
      break
  return used, min(limit, cap) if cap else limit


def _stat(pid: int) -> tuple[str, int, int] | None:
  """(state, parent pid, start time in clock ticks) of `pid` from /proc/PID/stat; None once it is gone."""
  try:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return fields[0], int(fields[1]), int(fields[19])  # fields 3, 4 and 22 of stat
  except (OSError, ValueError, IndexError):
    return None


def _holds_memory(stat: tuple[str, int, int] | None) -> bool:
  """A process still there and not yet past freeing its memory (a zombie 'Z' or dead 'X' one has freed it)."""
  return stat is not None and stat[0] not in ("Z", "X")


def tree_rss(leader: int, starts: dict[int, int] | None = None) -> dict[int, int]:
  """{pid: resident bytes} of `leader` and every process it started, however deep, found by parent links (a part may
  run in a session of its own, so the session id would miss it); zombies left out (they hold no memory). `starts`,
  when given, receives each pid's start time (what names it beyond a pid the system may reuse)."""
  page = os.sysconf("SC_PAGE_SIZE")
  parent, rss, start = {}, {}, {}
  for entry in Path("/proc").iterdir():
    if not entry.name.isdigit():
      continue
    stat = _stat(int(entry.name))
    try:
      if _holds_memory(stat):
        rss[int(entry.name)] = int((entry / "statm").read_text().split()[1]) * page
        parent[int(entry.name)], start[int(entry.name)] = stat[1], stat[2]
    except (OSError, ValueError, IndexError):
      continue  # the process ended while it was read
  out = {}
  for pid in rss:
    p, seen = pid, 0
    while p and p != leader and seen < 64:  # up the chain to the leader or the root
      p, seen = parent.get(p, 0), seen + 1
    if p == leader:
      out[pid] = rss[pid]
      if starts is not None:
        starts[pid] = start[pid]
  return out


def victims(rss: dict[int, int], leader: int) -> list[int]:
  """The processes to kill, in the order to try them: the largest first, never the leader (it records the failed
  part) but when it is all there is."""
  others = {p: r for p, r in rss.items() if p != leader}
  pool = others or rss
  return sorted(pool, key=lambda p: (-pool[p], p))


def victim(rss: dict[int, int], leader: int) -> int | None:
  """The first of `victims`, None when there is none."""
  order = victims(rss, leader)
  return order[0] if order else None


def kill(pid: int, start: int) -> bool:
  """SIGKILL to `pid` if it is still the process that started at `start` (a pidfd holds it while that is checked,
  where the system has pidfds); False when it is gone, was replaced, or may not be signalled (another user's)."""
  try:
    fd = os.pidfd_open(pid)
  except AttributeError:
    fd = None
  except OSError:
    return False  # gone
  try:
    stat = _stat(pid)
    if not _holds_memory(stat) or stat[2] != start:
      return False
    if fd is None:
      os.kill(pid, signal.SIGKILL)
    else:
      signal.pidfd_send_signal(fd, signal.SIGKILL)
    return True
  except OSError:  # ended meanwhile (ProcessLookupError), or not ours (PermissionError)
    return False
  finally:
    if fd is not None:
      os.close(fd)


class Guard:
  """Watches the process tree of `leader` (its pid and everything started below it) from a thread; `start()`, then
  `stop()`. `killed` lists what it killed, as lines; `log` receives each line as it happens, and once the first
  error that stopped a read (the thread keeps watching)."""

  def __init__(self, leader: int, floor_bytes: int, cap_bytes: int | None = None,
               log: Callable[[str], None] = print, read: Callable[[], tuple[int, int]] | None = None):
    self.leader, self.floor, self.cap, self.log = leader, floor_bytes, cap_bytes, log
    self.read = read or (lambda: used_and_limit(self.cap))
    self.killed: list[str] = []
    self.peak_used = 0
    self.errors = 0
    self._dying: tuple[int, int] | None = None  # (pid, start) of the last process killed
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._watch, daemon=True)

  def check(self) -> str | None:
    """One read; kills and returns the line when the host is past its floor, else None. While the process it killed
    last is still exiting, none other is killed."""
    used, limit = self.read()
    self.peak_used = max(self.peak_used, used)
    if used <= limit - self.floor:
      return None
    if self._dying:
      stat = _stat(self._dying[0])
      if _holds_memory(stat) and stat[2] == self._dying[1]:
        return None  # its memory is on its way back
      self._dying = None
    starts: dict[int, int] = {}
    rss = tree_rss(self.leader, starts)
    pid = next((p for p in victims(rss, self.leader) if kill(p, starts[p])), None)
    if pid is None:
      return None
    self._dying = (pid, starts[pid])
    line = (f"host memory {used / 2**30:.2f} GiB used of {limit / 2**30:.2f} GiB (floor {self.floor / 2**30:.2f} "
            f"GiB): killed pid {pid} ({rss[pid] / 2**30:.2f} GiB resident)")
    self.killed.append(line)
    self.log(line)
    return line

  def _watch(self) -> None:
    while not self._stop.wait(POLL_S):
      try:
        self.check()
      except Exception as exc:  # a read that failed (/proc, a cgroup file) must not end the watch
        self.errors += 1
        if self.errors == 1:
          self.log(f"host memory guard: a read failed ({type(exc).__name__}: {exc}); still watching")

  def start(self) -> "Guard":
    self._thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()
    self._thread.join(timeout=2 * POLL_S + 1)
