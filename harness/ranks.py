"""A side with several ranks (`parity compare --nproc N`): the engines' own launchers, watched as one side. Which
launcher starts a side is its record's (parity.sides, `SideRecord.launcher`, from its framework):

  torchrun           (framework 'torch': deepspeed, torch, fsdp) torch.distributed.run starts the N ranks: one host
                     `--standalone` (a free port on localhost), several hosts `--nnodes K --node-rank R --master-addr
                     H --master-port P`. A side whose record names a hostfile_launcher (DeepSpeed) goes through it
                     with a hostfile instead (`deepspeed --hostfile F --master_addr H --master_port P --module ...`).
                     Each rank reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT from the launcher; on
                     CPU gloo, on CUDA nccl (fsdp: gloo for its CPU tensors too, torch_impl.fsdp.device_mesh).
  jax.distributed    (framework 'jax': jax) JAX's multi-controller runtime has no launcher: the harness starts the N
                     processes itself, each with RANK, WORLD_SIZE and PARITY_COORDINATOR (host:port), and each calls
                     `jax.distributed.initialize(coordinator, num_processes, process_id)` (jax_impl/distributed.py).

The launcher (torchrun) or every JAX rank is started by `harness.lifetime.spawn` (own session, bound to this
process, own deadline); torchrun's ranks are its children, so killing the tree (`lifetime.kill_tree`) ends them.
When a rank exits non-zero, torchrun stops the others and exits (its "Root Cause" block names the rank); for JAX the
harness kills the other ranks itself. `fold_ranks` then names the failed rank in the side's summary: rank id, exit
code or signal, the tail of its run_dir/<side>/rank<k>.stderr. Every rank's peak RSS (its rank<k>.json) goes into
summary.json as `ranks`. Imports neither jax nor torch (docs/multirank.md has the exact commands).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import time
from pathlib import Path
from typing import Callable

from harness import lifetime
from parity import phase
from parity.protocol.layout import PLANTED_HANG, PLANTED_KILL, count_lines, tail_text
from parity.protocol.ranks import COORDINATOR_ENV, rank_file, read_rank_records, rank_stderr
from parity.sides import side_record

__all__ = ["world_size", "torch_command", "jax_rank_envs", "launch_side", "fold_ranks", "Launched"]

POLL_S = 0.1
TAIL_CHARS = 3000
_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)
"""torchrun's report of the first rank that failed (torch.distributed.elastic ChildFailedError.format_msg)."""


def world_size(launch: dict) -> int:
  """Ranks of a side in all: nproc per host x hosts."""
  return int(launch["nproc"]) * int(launch["nnodes"])


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _host_port(coordinator: str) -> tuple[str, str]:
  host, _, port = coordinator.rpartition(":")
  return host, port


def torch_command(python: str, side: str, worker: str, request: str, launch: dict) -> list[str]:
  """argv that starts the ranks of a torch side (deepspeed, torch or fsdp) through the engine's launcher.

  Args:
    python: interpreter; worker: the side's worker module; request: run_dir/request.json.
    launch: parity.protocol.ranks.read_launch's fields (nproc, nnodes, node_rank, coordinator, hostfile).
  Returns:
    [python, -m, harness.boot, torch.distributed.run, ...] (or, with a hostfile, the side record's
    hostfile_launcher: deepspeed.launcher.runner for the DeepSpeed side), ending in `-m harness.boot WORKER REQUEST
    --side SIDE`: each rank goes through harness.boot, which binds it to the launcher (harness.lifetime.LAUNCHED_ENV).
  """
  tail = ["harness.boot", worker, request, "--side", side]  # each rank bound to the launcher (lifetime.LAUNCHED_ENV)
  boot = [python, "-m", "harness.boot"]
  hostfile_launcher = side_record(side).hostfile_launcher  # DeepSpeed's own launcher, for a hostfile
  if hostfile_launcher and launch.get("hostfile"):
    cmd = boot + [hostfile_launcher, "--hostfile", str(launch["hostfile"]),
                  "--num_gpus", str(launch["nproc"])]
    if launch.get("coordinator"):
      host, port = _host_port(launch["coordinator"])
      cmd += ["--master_addr", host, "--master_port", port]
    return cmd + ["--module"] + tail
  cmd = boot + ["torch.distributed.run", "--nproc-per-node", str(launch["nproc"]), "--max-restarts", "0"]
  if int(launch["nnodes"]) > 1 or launch.get("coordinator"):
    host, port = _host_port(launch.get("coordinator") or "127.0.0.1:29500")
    cmd += ["--nnodes", str(launch["nnodes"]), "--node-rank", str(launch["node_rank"]), "--master-addr", host,
            "--master-port", port]
  else:
    cmd += ["--standalone"]
  return cmd + ["-m"] + tail


def jax_rank_envs(launch: dict) -> list[dict[str, str]]:
  """The environment of each JAX rank on this host: RANK (= node_rank * nproc + local rank), WORLD_SIZE,
  LOCAL_RANK and PARITY_COORDINATOR (the launch's coordinator, or 127.0.0.1 and a free port)."""
  nproc, world = int(launch["nproc"]), world_size(launch)
  coordinator = launch.get("coordinator") or f"127.0.0.1:{_free_port()}"
  first = int(launch["node_rank"]) * nproc
  return [{"RANK": str(first + k), "WORLD_SIZE": str(world), "LOCAL_RANK": str(k), COORDINATOR_ENV: coordinator}
          for k in range(nproc)]


@dataclasses.dataclass
class Launched:
  """What the harness saw of a multi-rank side.

  Attributes:
    returncode: the launcher's exit code (torch sides) or the failed rank's (JAX; 0 when all exited 0).
    rusage: the launcher's rusage (torch) or the largest JAX rank's, or None.
    timed_out: the side ran past its timeout and was killed.
    rank_codes: rank -> exit code seen directly (JAX ranks; torchrun's report for the torch sides).
    rank_rss: rank -> peak RSS bytes from wait4 (JAX ranks only: the kernel's figure).
    failed_rank: the first rank that exited non-zero, or None.
    launcher: the launcher module of a torch side, or None.
  """
  returncode: int | None
  rusage: object
  timed_out: bool
  rank_codes: dict[int, int] = dataclasses.field(default_factory=dict)
  rank_rss: dict[int, int] = dataclasses.field(default_factory=dict)
  failed_rank: int | None = None
  launcher: str | None = None
  """The torch sides' launcher module (torch.distributed.run, deepspeed.launcher.runner); None for JAX ranks."""


def launch_side(side: str, cmd: list[str], launch: dict, *, out: Path, env: dict[str, str], timeout_s: float,
                watch: Callable, on_progress=None) -> Launched:
  """Starts a multi-rank side and waits for its end (the whole side is killed when one rank fails or hangs).

  Args:
    side: side name; cmd: the single-rank worker argv (`python -m harness.boot WORKER REQUEST --side S`).
    launch: the launch fields; out: run_dir/<side>; env: the workers' environment.
    timeout_s: the side's limit, seconds. watch: `harness.runner._watch` (polls one process, op builds off the clock).
  Returns:
    Launched. Raises whatever interrupts it (Ctrl-C) after killing every rank.
  """
  t0 = time.time()
  with open(out / "stdout.log", "ab") as so, open(out / "stderr.log", "ab") as se:
    if side_record(side).launcher == "torchrun":  # else jax.distributed: the harness starts every rank itself
      python, worker, request = cmd[0], cmd[3], cmd[4]
      argv = torch_command(python, side, worker, request, launch)
      # the ranks build DeepSpeed ops without moving the launcher's own deadline (phase.extend_deadline is
      # per process): it gets the build allowance up front; the harness's watch still enforces timeout_s
      proc = lifetime.spawn(argv, stdout=so, stderr=se, env={**env, lifetime.LAUNCHED_ENV: "1"},
                            timeout_s=timeout_s + phase.BUILD_LIMIT_S)
      return _wait_launcher(proc, side, out, t0, timeout_s, watch, on_progress, request, argv[3])
    procs = [lifetime.spawn(cmd, stdout=so, stderr=se, env={**env, **renv}, timeout_s=timeout_s)
             for renv in jax_rank_envs(launch)]
  first = int(launch["node_rank"]) * int(launch["nproc"])
  return _wait_ranks({first + k: p for k, p in enumerate(procs)}, side, out, t0, timeout_s, on_progress)


STATES_FILE = "rank_states.json"
"""run_dir/<side>/rank_states.json: each rank's process state (/proc/<pid>/stat) at the side's timeout, just before
the kill; `fold_ranks` names a rank that was stopped (state T: SIGSTOP, a debugger) as the one that hung."""


def _recorded_pids(out: Path) -> dict[int, int]:
  """{rank: pid} as the ranks wrote them in out/rank<k>.json; a file that cannot be read, or holds no pid, is left
  out (a rank that never started)."""
  pids = {}
  for f in sorted(out.glob("rank*.json")):
    try:
      rec = json.loads(f.read_text())
      pids[int(rec["rank"])] = int(rec["pid"])
    except (OSError, ValueError, KeyError, TypeError):
      continue
  return pids


def record_rank_states(out: Path, pids: dict[int, int] | None = None) -> dict[int, str]:
  """{rank: process state letter} of `pids` (rank -> pid; None: the pids the ranks wrote, `_recorded_pids`),
  written to out/STATES_FILE. A process that is gone is left out. Raises nothing: this runs on the way to a kill."""
  pids = _recorded_pids(out) if pids is None else pids
  states = {}
  for rank, pid in pids.items():
    try:
      states[rank] = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
      continue
  try:
    (out / STATES_FILE).write_text(json.dumps({str(k): v for k, v in sorted(states.items())}))
  except OSError:
    pass
  return states


def _stopped_ranks(out: Path) -> list[int]:
  """Ranks recorded in out/STATES_FILE as stopped (T, or t: stopped by a tracer)."""
  try:
    states = json.loads((out / STATES_FILE).read_text())
    return sorted(int(k) for k, v in states.items() if v in ("T", "t"))
  except (OSError, ValueError, AttributeError):
    return []


def kill_leftover_ranks(out: Path, request: str) -> list[int]:
  """SIGKILLs every rank recorded in out/rank<k>.json that still runs once its launcher has ended, and returns their
  ranks. A pid counts as that rank only while its command line names this run's `request` file (a pid the system
  reused is left alone). The ranks die with their launcher by PR_SET_PDEATHSIG; this is the harness's own check."""
  killed = []
  for rank, pid in _recorded_pids(out).items():
    try:
      cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
      continue
    if request in cmdline:
      try:
        os.kill(pid, signal.SIGKILL)
        killed.append(rank)
      except (ProcessLookupError, PermissionError):
        pass
  return killed


def _wait_launcher(proc, side, out, t0, timeout_s, watch, on_progress, request: str, launcher: str) -> Launched:
  try:
    rc, rusage, timed_out = watch(proc, side, out, t0, timeout_s, on_progress,
                                  before_kill=lambda: record_rank_states(out))
  except BaseException:
    lifetime.kill_tree(proc.pid)
    os.wait4(proc.pid, 0)
    raise
  finally:
    lifetime.release(proc)
    kill_leftover_ranks(out, request)
  found = _ROOT_CAUSE.search(_tail(out / "stderr.log", 20000))
  codes = {int(found.group(1)): int(found.group(2))} if found else {}
  failed = next(iter(codes), None)
  return Launched(rc, rusage, timed_out, rank_codes=codes, failed_rank=failed, launcher=launcher)


def _wait_ranks(procs: dict, side: str, out: Path, t0: float, timeout_s: float, on_progress) -> Launched:
  """Polls every JAX rank; the first one to exit non-zero (or the timeout) kills all of them."""
  codes, rss, failed, timed_out, last, usages = {}, {}, None, False, -1, {}
  try:
    while len(codes) < len(procs):
      for rank, p in procs.items():
        if rank in codes:
          continue
        pid, status, usage = os.wait4(p.pid, os.WNOHANG)
        if pid:
          codes[rank], usages[rank] = os.waitstatus_to_exitcode(status), usage
          rss[rank] = usage.ru_maxrss * 1024
          if codes[rank] != 0 and failed is None and not timed_out:  # past the timeout, the harness killed it
            failed = rank
            _kill_all(procs, codes)
      if not timed_out and time.time() - t0 > timeout_s:
        timed_out = True
        record_rank_states(out, {r: p.pid for r, p in procs.items() if r not in codes})
        _kill_all(procs, codes)
      n = count_lines(out / "steps.jsonl")
      if on_progress is not None and n != last:
        on_progress(side, n)
        last = n
      time.sleep(POLL_S)
  except BaseException:
    _kill_all(procs, codes)
    for rank, p in procs.items():
      if rank not in codes:
        os.wait4(p.pid, 0)
    raise
  finally:
    for p in procs.values():
      lifetime.release(p)
  rc = codes[failed] if failed is not None else max(codes.values(), key=abs)
  biggest = max(usages.values(), key=lambda u: u.ru_maxrss) if usages else None
  return Launched(rc, biggest, timed_out, rank_codes=codes, rank_rss=rss, failed_rank=failed)


def _rewrite(path: Path, record: dict) -> None:
  """Writes `record` over a rank's file (temp file, then rename); a failure leaves the file as it was."""
  tmp = path.with_suffix(".json.tmp")
  try:
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)
  except OSError:
    tmp.unlink(missing_ok=True)


def _kill_all(procs: dict, done: dict) -> None:
  for rank, p in procs.items():
    if rank not in done:
      lifetime.kill_tree(p.pid)


def _tail(path: Path, n: int = TAIL_CHARS) -> str:
  return tail_text(path, n)


def _code_text(code: int | None) -> str:
  if code is None:
    return "ended without a report"
  if code < 0:
    name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
    return f"was killed by signal {name}"
  return f"exited with code {code}"


def fold_ranks(summary: dict, status: str, error: str | None, launched: Launched, out: Path,
               world: int) -> tuple[str, str | None, dict]:
  """Adds `nproc` and `ranks` (one entry per rank: status, pid, peak RSS, exit code) to a side's summary, and names
  the rank that failed or hung in its status and error.

  Returns:
    (status, error, summary): status 'killed' (a rank died by a signal), 'crashed' (a rank exited non-zero),
    'timeout' (a rank hung: the side ran past its limit) or the side's own; error names the rank.
  """
  records = read_rank_records(out, world)
  for rec in records:
    k = rec["rank"]
    if k in launched.rank_codes:
      rec["exit_code"] = launched.rank_codes[k]
    if k in launched.rank_rss:
      rec["peak_rss_bytes_wait4"] = launched.rank_rss[k]
    if rec.get("status") in (None, "running"):  # it wrote no end: what the harness or the launcher saw of it
      code = rec.get("exit_code")
      rec["status"] = ("not_started" if "pid" not in rec else "killed" if code is not None and code < 0
                       else "crashed" if code else "stopped")
      if "pid" in rec:  # its own file once said 'running' for ever after: the end is written there
        rec["ended_by"] = "the harness: the rank wrote no end (killed, or stopped with the side)"
        _rewrite(rank_file(out, k), rec)
  failed, hung, running = launched.failed_rank, None, ""
  if failed is None and status != "ok" and not launched.timed_out:
    failed = next((r["rank"] for r in records if PLANTED_KILL in _tail(rank_stderr(out, r["rank"]))), None)
  summary = {**summary, "nproc": world, "ranks": records}
  if launched.timed_out and failed is None:  # the side ran past its limit: 'timeout', naming who was still there
    status = "timeout"
    hung = next((r["rank"] for r in records if PLANTED_HANG in _tail(rank_stderr(out, r["rank"]))), None)
    stopped = _stopped_ranks(out) if hung is None else []
    hung = stopped[0] if len(stopped) == 1 else hung  # one rank stopped (SIGSTOP) while the others waited on it
    still = [r["rank"] for r in records if r["status"] in ("stopped", "killed")]
    running = (f"ranks still running at the timeout: {still} (a rank that hangs stalls the others at the next "
               "collective)")
    error = summary["error"] = f"{error or 'side exceeded its timeout and was killed'}; {running}"
    summary["status"] = status
  who = failed if failed is not None else hung
  if who is None and status == "killed" and launched.launcher and launched.returncode is not None \
      and launched.returncode < 0:  # no rank failed first: the launcher itself was killed, and its ranks with it
    error = summary["error"] = (f"its launcher ({launched.launcher}) {_code_text(launched.returncode)}; every rank "
                                "was stopped with it (no rank had failed)")
  if who is None or status == "ok":
    return status, error, summary
  stderr = _tail(rank_stderr(out, who))
  code = launched.rank_codes.get(who)
  if failed is not None:
    what = _code_text(code) + (" (the planted --perturb kill_at_step)" if PLANTED_KILL in stderr else "")
    status = "killed" if code is not None and code < 0 else "crashed"
  else:
    what = ("hung (the planted --perturb hang_at_step)" if PLANTED_HANG in stderr else
            "hung: it was stopped (process state T: SIGSTOP or a debugger) when the side timed out"
            if who in _stopped_ranks(out) else "hung") + f"; {running}"
  own = next((r.get("error") for r in records if r["rank"] == who and isinstance(r.get("error"), str)), None)
  said = f": {own.strip().splitlines()[0][:400]}" if own and own.strip() else ""  # the rank's own reason, one line
  error = (f"rank {who} of {world} {what}{said}; the whole side was stopped. Its stderr ({rank_stderr(out, who)}) "
           + (f"ends:\n{stderr[-1500:]}" if stderr.strip() else "is empty"))
  summary.update(status=status, error=error, failed_rank={"rank": who, "exit_code": code, "stderr_tail": stderr})
  return status, error, summary
