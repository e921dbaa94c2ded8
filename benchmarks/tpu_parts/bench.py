"""The accelerator benchmark suite on a TPU VM: benchmarks/gpu.py with TPU defaults, within one budget, tarred.

Run by `benchmarks/tpu.sh bench [--budget-s 420] [--premapped-mib N] [gpu.py options...]` after its install. The
budget counts from benchmarks/tpu.sh's start (TPU_SH_T0: the install is inside it); gpu.py gets what is left less
TAR_MARGIN_S and is stopped (its process tree killed) if it overruns by GRACE_S. gpu.py's own defaults on a TPU:
the grid flow (device named by one short process that opens the chip; jax_raw; the largest model per plan by
compiling, confirmed by 2-step runs; the JAX plans x gradient accumulation grid); torch_raw and DeepSpeed are
recorded as not run (torch is a CPU build there, and the VM refuses sockets). Set here, where unset:
  * JAX_COMPILATION_CACHE_DIR: a fresh folder for this run (removed at the end), so a train or confirming run reuses
    the executable the compile part made for the same program; the compile part's own compile times stay real.
  * TPU_PREMAPPED_BUFFER_SIZE only with --premapped-mib: the staging region the runtime maps and pins each time a
    process opens the chip (4 GiB by default; 256 MiB opened it in 3.5 s against 10.9 s for the default,
    benchmarks/results/2026-12-06-tpu-v5e-matrix.md). pinned_host arrays are host memory beside it (measured:
    benchmarks/results/2026-12-06-tpu-v5e-largest.md), so a small region leaves the host to the offloaded state;
    gpu.py counts the region among the runtime's host bytes (sizing.tpu_host_overhead).
  * a host-memory guard (memguard.py, --host-floor-mib, --host-limit-mib): past the floor, the run's largest process
    is killed and recorded, so a VM's memory cap does not end the whole command with nothing written.
Writes OUT/bench/ (gpu.json, gpu.md, parts/, logs/, host_memory.json: the guard's peak and what it killed) and
OUT/bench.tgz. Exit status: gpu.py's (1 when it was stopped at the budget). Also runs on a CPU machine (`--tiny`
among the options), which is how it is tested.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from benchmarks.tpu_parts import memguard  # noqa: E402

TAR_MARGIN_S = 15.0
"""Seconds kept after gpu.py for the tar and the shell's last lines."""
GRACE_S = 30.0
"""Seconds past its budget gpu.py may take (it writes its files after its last part) before it is stopped."""
STOP_WAIT_S = 10.0
"""Seconds gpu.py gets after SIGINT to write its files before SIGKILL."""
RAW_MIB = 256
"""MiB per bandwidth copy on the TPU: a standalone device -> pinned_host put runs at ~0.9 GB/s there, so 1 GiB copies
would take ~8 s of the raw part's share for one figure."""


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--budget-s", type=float, default=float(os.environ.get("BUDGET_S") or 420),
                  help="seconds for the whole command from tpu.sh's start, install included (default BUDGET_S or 420)")
  ap.add_argument("--premapped-mib", type=int, help="TPU_PREMAPPED_BUFFER_SIZE in MiB (default: the runtime's)")
  ap.add_argument("--host-floor-mib", type=int, default=2048,
                  help="host memory kept free: below it the largest process of the run is killed (memguard)")
  ap.add_argument("--host-limit-mib", type=int,
                  help="the host memory this run may use where the guard cannot read it (a VM's cap it cannot see)")
  a, rest = ap.parse_known_args(argv)
  if a.host_floor_mib < 0:
    ap.error(f"--host-floor-mib must be >= 0 (MiB kept free); got {a.host_floor_mib}")
  if a.host_limit_mib is not None and a.host_limit_mib <= 0:
    ap.error(f"--host-limit-mib must be > 0 (MiB this run may use); got {a.host_limit_mib}")
  if a.premapped_mib is not None and a.premapped_mib <= 0:
    ap.error(f"--premapped-mib must be > 0; got {a.premapped_mib}")
  return a, rest


def environment(a: argparse.Namespace, cache: str) -> dict[str, str]:
  """gpu.py's environment: this one, plus the compilation cache and the premapped buffer (module docstring)."""
  env = dict(os.environ)
  env.setdefault("JAX_COMPILATION_CACHE_DIR", cache)
  env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  if a.premapped_mib:
    env["TPU_PREMAPPED_BUFFER_SIZE"] = str(a.premapped_mib << 20)
  return env


def command(a: argparse.Namespace, rest: list[str], budget: float) -> list[str]:
  """gpu.py's command line: the TPU defaults, then the caller's options (which win: argparse keeps the last)."""
  out = Path(a.out) / "bench"
  mib = min(RAW_MIB, max(1, a.premapped_mib // 8)) if a.premapped_mib else RAW_MIB  # the copies use the region
  return [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--out", str(out), "--budget-s", f"{budget:.0f}",
          "--raw-mib", str(mib), *rest]


def stop(proc: subprocess.Popen) -> None:
  """SIGINT first (gpu.py then kills its running part and writes what it has), SIGKILL STOP_WAIT_S later."""
  for sig, wait in ((signal.SIGINT, STOP_WAIT_S), (signal.SIGKILL, None)):
    try:
      os.killpg(proc.pid, sig)
      proc.wait(timeout=wait)
      return
    except subprocess.TimeoutExpired:
      continue
    except ProcessLookupError:
      return


def run(cmd: list[str], env: dict[str, str], limit: float, a: argparse.Namespace | None = None) -> int:
  """Runs gpu.py in a session of its own (its parts are bound to it: harness.lifetime); past `limit` seconds it is
  stopped (status 1). A memguard.Guard watches the host's memory meanwhile (--host-floor-mib, --host-limit-mib)."""
  proc = subprocess.Popen(cmd, env=env, cwd=str(ROOT), start_new_session=True)
  floor = (a.host_floor_mib if a else 2048) << 20
  cap = (a.host_limit_mib << 20) if a and a.host_limit_mib else None
  guard = memguard.Guard(proc.pid, floor, cap, log=lambda line: print(f"[bench] {line}", flush=True)).start()
  try:
    return proc.wait(timeout=limit)
  except subprocess.TimeoutExpired:
    print(f"[bench] gpu.py still running after {limit:.0f} s: stopping it", flush=True)
    stop(proc)
    return 1
  except KeyboardInterrupt:
    stop(proc)
    raise
  finally:
    guard.stop()
    print(f"[bench] host memory: peak {guard.peak_used / 2**30:.2f} GiB used while gpu.py ran; "
          f"{len(guard.killed)} process(es) killed by the guard", flush=True)
    if a is not None:
      folder = Path(a.out) / "bench"
      folder.mkdir(parents=True, exist_ok=True)
      (folder / "host_memory.json").write_text(json.dumps(
          {"peak_used_bytes": guard.peak_used, "floor_bytes": floor, "cap_bytes": cap, "killed": guard.killed,
           "source": "memguard: the cgroup's use less its inactive file cache where readable, else MemTotal - "
                     f"MemAvailable, every {memguard.POLL_S} s"}, indent=1))


def main(argv: list[str] | None = None) -> int:
  a, rest = parse(argv)
  t0 = float(os.environ.get("TPU_SH_T0") or time.time())
  budget = a.budget_s - (time.time() - t0) - TAR_MARGIN_S
  if budget < 60:
    print(f"[bench] {budget:.0f} s left of --budget-s {a.budget_s:.0f} after the install: too little to measure; "
          "give a larger --budget-s (or BUDGET_S)", file=sys.stderr)
    return 2
  Path(a.out).mkdir(parents=True, exist_ok=True)
  cache = tempfile.mkdtemp(prefix="parity-bench-jax-cache-")
  try:
    cmd = command(a, rest, budget)
    print(f"[bench] {' '.join(cmd[1:])}", flush=True)
    status = run(cmd, environment(a, cache), budget + GRACE_S, a)
  finally:
    shutil.rmtree(cache, ignore_errors=True)
  folder = Path(a.out) / "bench"
  if folder.is_dir():
    with tarfile.open(Path(a.out) / "bench.tgz", "w:gz") as tar:
      tar.add(folder, arcname="bench")
    print(f"[bench] {Path(a.out) / 'bench.tgz'} ({os.path.getsize(Path(a.out) / 'bench.tgz') / 1e6:.2f} MB), "
          f"{time.time() - t0:.0f} s since tpu.sh started; gpu.py exit {status}", flush=True)
  return status


if __name__ == "__main__":
  sys.exit(main())
