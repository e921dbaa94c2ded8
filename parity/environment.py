"""What this machine and environment are, read without starting a process or importing jax/torch.

The cheap half of the environment block (`harness.doctor.environment_block`): the host (CPU model, cores, NUMA
nodes, memory, load), the OS and Python, the installed versions of the packages a run depends on (from their
metadata: nothing is imported), the repository's git revision (read from .git), and whether a CUDA driver is
visible (`cuda_evidence`: device files only). What needs a process (the frameworks' own view of their devices,
`git status`, `nvidia-smi`) is in `harness.doctor`, the one place that starts processes. Linux paths (/proc, /sys)
are read where present; elsewhere those fields are None.
"""
from __future__ import annotations

import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path

__all__ = ["PACKAGES", "CUDA_FILES", "cuda_evidence", "package_versions", "cpu_model", "host_info", "numa_nodes",
           "git_revision", "usable_cpus", "cpu_quota", "load_1min", "runnable_now"]

PACKAGES = ("parity", "jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "jax-cuda13-pjrt",
            "jax-cuda12-pjrt", "flax", "optax", "orbax-checkpoint", "torch", "deepspeed", "numpy", "ml_dtypes",
            "safetensors", "pydantic", "transformers", "ninja", "py-cpuinfo")
"""Distributions whose versions every environment block records (absent ones as None): the two frameworks and
their CUDA plugins, the libraries the sides are built on, and the op-build tools."""

CUDA_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/proc/driver/nvidia/version")
"""Files an NVIDIA driver creates: any of them means CUDA is present on this machine (`cuda_evidence`)."""


def cuda_evidence(files: tuple[str, ...] = CUDA_FILES) -> str | None:
  """The first driver file in `files` that exists ('/dev/nvidia0 exists'), or None: no NVIDIA driver is visible.

  Costs a few stat calls (no process, no import), so a CPU machine pays nothing for the CPU-fallback check
  (`harness.backend`); that module also runs `nvidia-smi` when it is on PATH and no file was found.
  """
  for f in files:
    if os.path.exists(f):
      return f"{f} exists"
  return None


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
  """Installed version of each distribution in `names` (None: not installed), from package metadata only."""
  out: dict[str, str | None] = {}
  for name in names:
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      out[name] = None
  return out


def _read(path: str) -> str | None:
  try:
    return Path(path).read_text(errors="replace")
  except OSError:
    return None


def _read_strip(path: Path) -> str | None:
  text = _read(str(path))
  return None if text is None else text.strip()


def usable_cpus() -> int:
  """CPUs this process may run on (os.sched_getaffinity; os.cpu_count() where that is missing), >= 1."""
  try:
    return max(1, len(os.sched_getaffinity(0)))
  except (AttributeError, OSError):
    return max(1, os.cpu_count() or 1)


def _quota_v2(root: Path, cgroup: str) -> float | None:
  """The tightest cpu.max ('QUOTA PERIOD' or 'max PERIOD') from this process's cgroup up to `root`, in CPUs."""
  best, d = None, root / cgroup.lstrip("/")
  while True:
    parts = (_read_strip(d / "cpu.max") or "").split()
    if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit() and int(parts[1]) > 0:  # 'max': no limit
      q = int(parts[0]) / int(parts[1])
      best = q if best is None else min(best, q)
    if d == root or root not in d.parents:
      return best
    d = d.parent


def cpu_quota(root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") -> float | None:
  """The cgroup CPU limit of this process in CPUs (1.5: one and a half cores' time per period), None: no limit.

  cgroup v2: cpu.max of the process's cgroup (from `self_cgroup`'s '0::PATH' line) and of each parent up to `root`;
  cgroup v1: root/cpu/cpu.cfs_quota_us / cpu.cfs_period_us (-1: no limit). What a container's --cpus sets;
  sched_getaffinity does not see it, and OpenMP would start a thread per host CPU."""
  base = Path(root)
  lines = (_read_strip(Path(self_cgroup)) or "").splitlines()
  v2 = next((ln.split("::", 1)[1] for ln in lines if ln.startswith("0::")), None)
  quota = _quota_v2(base, v2) if v2 is not None else None
  if quota is not None:
    return quota
  for sub in ("cpu", "cpu,cpuacct"):
    quota, period = _read_strip(base / sub / "cpu.cfs_quota_us"), _read_strip(base / sub / "cpu.cfs_period_us")
    if quota and period and quota.lstrip("-").isdigit() and period.isdigit() and int(quota) > 0 < int(period):
      return int(quota) / int(period)
  return None


def load_1min() -> float | None:
  """The 1-minute load average (runnable + uninterruptible tasks, whole machine), None where it cannot be read."""
  try:
    return round(os.getloadavg()[0], 2)
  except (AttributeError, OSError):
    return None


def runnable_now(samples: int = 5, period_s: float = 0.01, stat: str = "/proc/stat") -> float | None:
  """Tasks running or ready to run on the whole machine now, less the one reading (procs_running of /proc/stat),
  the mean of `samples` reads `period_s` seconds apart (~0.05 s in all); None where /proc/stat is not there.
  Unlike the load average it has no memory: a side that just ended no longer counts."""
  seen = []
  for i in range(samples):
    for line in (_read(stat) or "").splitlines():
      if line.startswith("procs_running"):
        seen.append(max(0, int(line.split()[1]) - 1))
    if i + 1 < samples:
      time.sleep(period_s)
  return round(sum(seen) / len(seen), 2) if seen else None


def cpu_model() -> str | None:
  """The CPU model name from /proc/cpuinfo ('model name', or 'Model'/'Hardware' on ARM), else platform's."""
  text = _read("/proc/cpuinfo") or ""
  for key in ("model name", "Model", "Hardware", "cpu model"):
    for line in text.splitlines():
      k, sep, v = line.partition(":")
      if sep and k.strip() == key and v.strip():
        return v.strip()
  return platform.processor() or None


def numa_nodes(root: str = "/sys/devices/system/node") -> list[dict[str, object]] | None:
  """NUMA nodes: [{'node': 0, 'cpus': '0-15', 'mem_total_bytes': int | None}, ...], or None where /sys does
  not show them (not Linux, or a container hiding them)."""
  base = Path(root)
  if not base.is_dir():
    return None
  nodes = []
  for d in sorted(base.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
    mem = None
    for line in (_read(str(d / "meminfo")) or "").splitlines():
      if "MemTotal:" in line:
        mem = int(line.split()[-2]) * 1024  # "Node 0 MemTotal:  131072 kB"
    nodes.append({"node": int(d.name[4:]), "cpus": (_read(str(d / "cpulist")) or "").strip() or None,
                  "mem_total_bytes": mem})
  return nodes or None


def _mem_total() -> int | None:
  for line in (_read("/proc/meminfo") or "").splitlines():
    if line.startswith("MemTotal:"):
      return int(line.split()[1]) * 1024
  return None


def host_info() -> dict[str, object]:
  """The host and interpreter: hostname, OS, kernel, Python (version, implementation, executable, prefix), CPU
  model, logical cores (all, and usable by this process: the affinity mask), the cgroup CPU quota (in CPUs, None:
  no limit), load average (1/5/15 min), memory total in bytes, NUMA
  nodes and the time the block was read (UTC, ISO 8601). Values that cannot be read are None."""
  try:
    load = [round(x, 2) for x in os.getloadavg()]
  except OSError:
    load = None
  return {
      "hostname": platform.node() or None,
      "os": platform.platform(),
      "kernel": platform.release(),
      "python": platform.python_version(),
      "python_implementation": platform.python_implementation(),
      "python_executable": sys.executable,
      "prefix": sys.prefix,
      "cpu_model": cpu_model(),
      "cpu_cores_logical": os.cpu_count(),
      "cpu_cores_usable": usable_cpus(),
      "cpu_quota": cpu_quota(),
      "load_average": load,
      "mem_total_bytes": _mem_total(),
      "numa_nodes": numa_nodes(),
      "read_at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
  }


def _git_dir(root: Path) -> Path | None:
  g = root / ".git"
  if g.is_file():  # a worktree or submodule: "gitdir: <path>"
    text = _read(str(g)) or ""
    if text.startswith("gitdir:"):
      p = Path(text.split(":", 1)[1].strip())
      return p if p.is_absolute() else (root / p).resolve()
    return None
  return g if g.is_dir() else None


def git_revision(root: str | Path) -> dict[str, str | None] | None:
  """The commit checked out in the repository at `root`: {'commit': 40 hex, 'branch': name or None (detached)},
  read from .git (HEAD, the ref's file, packed-refs) without running git; None when `root` is not a checkout.
  Whether the tree is dirty needs `git status` (harness.doctor adds it)."""
  gd = _git_dir(Path(root))
  if gd is None:
    return None
  head = (_read(str(gd / "HEAD")) or "").strip()
  if not head.startswith("ref:"):
    return {"commit": head or None, "branch": None}
  ref = head.split(":", 1)[1].strip()
  common = gd
  if (gd / "commondir").is_file():
    common = (gd / (_read(str(gd / "commondir")) or "").strip()).resolve()
  commit = None
  for base in (gd, common):
    text = _read(str(base / ref))
    if text:
      commit = text.strip()
      break
  if commit is None:
    for line in (_read(str(common / "packed-refs")) or "").splitlines():
      parts = line.split()
      if len(parts) == 2 and parts[1] == ref:
        commit = parts[0]
  return {"commit": commit, "branch": ref.removeprefix("refs/heads/")}
