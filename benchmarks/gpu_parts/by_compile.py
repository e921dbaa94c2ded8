"""Sizes found by compiling, and the run that confirms one (imports neither jax nor torch).

A TPU's compiler refuses a program that does not fit its HBM (RESOURCE_EXHAUSTED, "Ran out of memory in memory space
hbm"), and the compiled executable's `memory_analysis()` gives the step's device bytes (common.compiled_device_peak),
so the largest model a plan trains is found by compiling the step for increasing depths, with no weights made
(benchmarks/gpu_parts/jax_largest.py). `compile_probe` turns one compile into a probe record for
sizing.search_largest; `fit_down` finds the deepest model at or below a prediction that fits (the train grid's size);
`confirm_run` then runs the answer for real in a process of its own, with a timeout, and names how it ended: a run
past the device's memory has been seen to sit in XLA's failure-signal handler until killed, so a timeout is
recorded as HUNG, not waited on.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.gpu_parts.common import classify_failure, compiled_device_peak, tail

HUNG = "hung (timed out; XLA failure handler?)"
OOM_AT_RUN = "oom at run"
FIT_BY = {"sum": "peak_bytes", "xla": "device_bytes", "compile": None}
"""What a compiled probe's fit is judged by (--fit-by): the compiler's sum argument + output + temp - alias (the
default: on a TPU it over-reads, counting temporaries the runtime does not hold at once, so it refuses some depths
that run), XLA's own peak_memory_in_bytes less the step's host buffers (common.compiled_device_peak 'device_bytes':
XLA's peak counts an offload program's pinned_host buffers, which are not device memory), or nothing past XLA's
acceptance of the program (on a TPU its compiler refuses a program that does not fit; on a GPU it does not, so
'compile' there accepts every depth)."""
COMPILE_OOM = ("RESOURCE_EXHAUSTED", "Ran out of memory in memory space")
"""What XLA says when a program does not fit the device (on a TPU at compile time)."""


def _size(n: int) -> str:
  return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def classify_compile_error(text: str) -> str:
  """'oom' for a compile refused for memory (COMPILE_OOM), else 'error'."""
  return "oom" if any(p in text for p in COMPILE_OOM) else "error"


def compile_probe(compile_fn: Callable[[int], dict[str, Any]], n_layers: int, bytes_limit: int | None,
                  usable_fraction: float = 1.0, fit_by: str = "sum") -> dict[str, Any]:
  """One depth compiled: `compile_fn(n_layers)` -> {'memory_analysis': the executable's fields, ...extra} (raises
  when XLA refuses it). Returns the probe record: status 'ok' (compiled, its FIT_BY[fit_by] peak <= bytes_limit x
  usable_fraction, or no limit known), 'oom' (refused for memory, or that peak over the limit) or 'error'; fits
  (bool, None for an error), compile_s, the peaks (common.compiled_device_peak), detail, and the extra."""
  t0 = time.perf_counter()
  try:
    got = dict(compile_fn(n_layers))
  except Exception as exc:  # XLA's refusal is the answer; anything else is recorded, not raised
    text = f"{type(exc).__name__}: {exc}"
    status = classify_compile_error(text)
    return {"status": status, "fits": False if status == "oom" else None, "compile_s": time.perf_counter() - t0,
            "detail": ("does not fit (compile: " if status == "oom" else "compile failed (") + tail(text, 3, 400) + ")"}
  took = time.perf_counter() - t0
  peak = compiled_device_peak(got.pop("memory_analysis", None))
  limit = None if bytes_limit is None else int(bytes_limit * usable_fraction)
  key = FIT_BY[fit_by]
  judged = peak.get(key) if key else None
  over = limit is not None and judged is not None and judged > limit
  if over:
    detail = f"does not fit: compiled device peak ({fit_by}) {_size(judged)} > {_size(limit)}"
  else:
    detail = "fits" + ("" if limit is not None and key else " (compiled; no peak checked: " + (
        "no device limit known)" if limit is None else "--fit-by compile)"))
  return {"status": "oom" if over else "ok", "fits": not over, "compile_s": took, **peak, "limit_bytes": limit,
          "detail": detail, **got}


def fit_down(probe: Callable[[int], dict[str, Any]], start: int, *, max_probes: int,
             time_left: Callable[[], float]) -> dict[str, Any]:
  """The deepest n_layers in [1, start] whose probe is 'ok': `start` first (the memory model's prediction), then
  bisection below it on 'oom'; any other status ends the search. Returns {'depth' (0: none found), 'probes',
  'stopped'}."""
  probes: list[dict[str, Any]] = []
  lo, hi, n, stopped = 0, start + 1, start, ""
  while n >= 1 and len(probes) < max_probes and time_left() > 0:
    res = probe(n)
    probes.append({"n_layers": n, **res})
    if res["status"] == "ok":
      lo = n
      if n == start:
        break
    elif res["status"] == "oom":
      hi = n
    else:
      stopped = f"probe at {n} layers: {res['status']}"
      break
    if hi - lo <= max(1, lo // 8):
      break
    n = (lo + hi) // 2
  if not stopped:
    stopped = ("the prediction fits" if lo == start else f"bracket [{lo}, {hi}) closed" if hi - lo <= max(1, lo // 8)
               else "probe cap or time reached")
  return {"depth": lo, "probes": probes, "stopped": stopped}


def _complete(path: Path) -> dict[str, Any] | None:
  """The part's JSON at `path` when it is its final write ('complete'), else None."""
  try:
    data = json.loads(Path(path).read_text())
  except (OSError, ValueError):
    return None
  return data if data.get("complete") else None


def confirm_run(module: str, args: list[str], json_path: Path, timeout_s: float,
                env: dict[str, str] | None = None) -> dict[str, Any]:
  """Runs `python -m module args` (harness.launch: bound to this process, its tree killed at the timeout) and names
  how it ended: {'status': 'ok' | OOM_AT_RUN | HUNG | 'error', 'wall_s', 'detail', 'stderr_tail', 'result' (the
  part's JSON at json_path, when ok)}."""
  from harness.launch import LaunchTimeout, run_module
  t0 = time.monotonic()
  try:
    fin = run_module(module, args, timeout_s=timeout_s, env=env)
  except LaunchTimeout as exc:
    done = _complete(json_path)
    if done is not None:  # it wrote its whole result; only its exit overran
      return {"status": "ok", "wall_s": time.monotonic() - t0, "detail": f"ran (stopped at its {timeout_s:.0f} s "
              "limit after writing its result)", "stderr_tail": tail(exc.stderr_tail), "result": done}
    return {"status": HUNG, "wall_s": time.monotonic() - t0, "detail": f"killed after {timeout_s:.0f} s",
            "stderr_tail": tail(exc.stderr_tail)}
  text = fin.stdout + fin.stderr
  out = {"wall_s": time.monotonic() - t0, "stderr_tail": tail(text)}
  if fin.returncode == 0 and Path(json_path).exists():
    return {**out, "status": "ok", "detail": "ran", "result": json.loads(Path(json_path).read_text())}
  kind = classify_failure(fin.returncode, text, False)
  return {**out, "status": OOM_AT_RUN if kind == "oom" else "error", "detail": f"exit {fin.returncode}"}
