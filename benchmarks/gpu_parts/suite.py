"""The benchmark driver's state and its one way to run a part (imports neither jax nor torch).

`run_part` starts `python -m benchmarks.gpu_parts.<module> --json <out> ...` through the harness (harness.launch:
bound to the driver, its whole tree killed at its timeout), with the remaining budget as its limit, on a TPU holding
the machine's chip lock (harness.chip: one process at a time may open the chip; another parity run waits for it,
and so does this one), and records how it ended. A part that wrote its JSON before it was killed (jax_largest
rewrites it after every probe) keeps what it wrote (`partial`). `not_run` records a part this machine cannot run,
with the reason, which is not a failure.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import threading
import time
from pathlib import Path

from benchmarks.gpu_parts.common import classify_failure, tail
from harness.launch import LaunchTimeout, run_module

CHIP_MODULES = ("jax_raw", "jax_train", "jax_largest", "jax_device")
"""Parts that open JAX's default backend: on a TPU, one at a time holds the chip."""


@dataclasses.dataclass
class Suite:
  """What the driver knows while it runs: options, the deadline, where files go, every part's record."""
  args: argparse.Namespace
  out: Path
  deadline: float
  records: dict = dataclasses.field(default_factory=dict)
  op_build: subprocess.Popen | None = None
  local: threading.local = dataclasses.field(default_factory=threading.local)
  device: dict = dataclasses.field(default_factory=dict)
  not_run: dict = dataclasses.field(default_factory=dict)
  """part family ('torch', 'deepspeed') -> why it cannot run here (device.not_run_reasons)."""

  def left(self) -> float:
    """Seconds to this chain's deadline (a side's share of the budget), else the suite's."""
    return getattr(self.local, "deadline", self.deadline) - time.monotonic()

  @property
  def tiny(self) -> bool:
    return self.args.tiny

  @property
  def tpu(self) -> bool:
    return self.device.get("kind") == "tpu"


def say(msg: str) -> None:
  print(f"[gpu-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def not_run(name: str, reason: str) -> dict:
  """The record of a part this machine cannot run (not a failure)."""
  say(f"{name}: {reason}")
  return {"ok": None, "not_run": reason}


def chip(suite: Suite, module: str, env: dict | None = None):
  """The machine's chip lock for a part that opens JAX's backend (harness.chip.chip_turn: taken on a TPU VM only,
  where one process at a time may hold the chip; elsewhere it does nothing)."""
  from contextlib import nullcontext
  if module.rsplit(".", 1)[-1] not in CHIP_MODULES:
    return nullcontext()
  from harness.chip import chip_turn
  return chip_turn("jax", str(suite.out), {**os.environ, **(env or {})}, on_wait=lambda line: line and say(line))


def _launch(suite: Suite, module: str, args: list[str], timeout: float, env: dict | None):
  """(returncode or None on timeout, output text) of one part, holding the chip lock on a TPU."""
  with chip(suite, module, env):
    try:
      fin = run_module(f"benchmarks.gpu_parts.{module}", args, timeout_s=timeout, env=env)
      return fin.returncode, fin.stdout + fin.stderr
    except LaunchTimeout as exc:
      return None, exc.stderr_tail


def run_part(suite: Suite, name: str, module: str, argv: list[str], timeout: float,
             env: dict[str, str] | None = None) -> dict:
  """Runs a part with `env` added to its environment; returns its record: {'ok': True, 'result', 'wall_s'} or
  {'ok': False, 'failure': 'timeout'|'oom'|'error'|'skipped', 'detail', 'stderr_tail'} (with 'partial': the JSON
  it wrote before it was stopped, when it wrote one). A part stopped at its limit after it wrote its final JSON
  (marked 'complete': every part marks its last write) is ok, with a note. Output: logs/<name>.log."""
  timeout = min(timeout, suite.left())
  if timeout < suite.args.min_part_s:
    rec = {"ok": False, "failure": "skipped", "detail": f"suite budget spent ({suite.left():.0f} s left)"}
    say(f"{name}: skipped ({rec['detail']})")
    return rec
  res_path = suite.out / "parts" / f"{name}.json"
  res_path.unlink(missing_ok=True)
  args = ["--json", str(res_path), *argv]
  say(f"{name}: start (timeout {timeout:.0f} s)")
  t0 = time.monotonic()
  rc, text = _launch(suite, module, args, timeout, env)
  wall = time.monotonic() - t0
  (suite.out / "logs" / f"{name}.log").write_text(f"{module} {' '.join(args)}\n{text}")
  if rc == 0 and res_path.exists():
    rec = {"ok": True, "wall_s": wall, "result": json.loads(res_path.read_text())}
  else:
    detail = f"timed out after {timeout:.0f} s" if rc is None else f"exit {rc}"
    rec = {"ok": False, "wall_s": wall, "failure": classify_failure(rc, text, rc is None), "detail": detail,
           "stderr_tail": tail(text)}
    if res_path.exists():
      try:
        rec["partial"] = json.loads(res_path.read_text())
      except ValueError:  # cut while writing
        pass
    if rc is None and rec.get("partial", {}).get("complete"):  # its result was written; its exit overran
      rec = {"ok": True, "wall_s": wall, "result": rec["partial"],
             "note": f"stopped at its {timeout:.0f} s limit after it wrote its whole result (the process's exit "
                     "overran)"}
  say(f"{name}: {'ok' if rec['ok'] else 'FAILED (' + rec['failure'] + ', ' + rec['detail'] + ')'} ({wall:.0f} s)")
  return rec


def reserve_timeout(suite: Suite, nominal: float, reserved_later: float) -> float:
  """A part's time limit: its nominal limit, less nothing of what the later parts' shares need (`reserved_later`
  seconds stay in the budget for them); at least 0."""
  return max(0.0, min(nominal, suite.left() - reserved_later))
