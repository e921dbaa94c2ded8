"""What a running comparison shows on the terminal: the port's filled-in values, then progress per side."""
from __future__ import annotations

import contextlib
import json
import sys
import time
from typing import Any, Sequence

__all__ = ["progress_display", "run_notes"]


def run_notes(run: Any) -> list[str]:
  """Lines a user should see before a run starts: the values a DeepSpeed config port filled in (the DeepSpeed
  defaults it implies and the "auto" values it resolved from the run spec). `run` is a ResolvedRun."""
  port = getattr(run, "port", None)
  if port is None:
    return []
  out = [f"filled in {i['key']} = {json.dumps(i['value'], default=str)} ({i['reason']})" for i in port.report.implied]
  out += [f"filled in \"auto\" {e.key} = {json.dumps(e.resolved, default=str)} (from the run spec)"
          for e in port.report.entries.values() if e.value == "auto"]
  return out


@contextlib.contextmanager
def progress_display(enabled: bool, spec, notes: Sequence[str] = ()):
  """A context yielding on_progress(side, steps_done, note=None) for harness.runner, or None when not `enabled`.

  On a terminal: one rich progress bar per side, whose label shows the phase outside the steps (a DeepSpeed op
  build). In a log file: a plain line at the start and at every quarter of the steps. `notes` are printed first
  (to stderr), e.g. the values a DeepSpeed config port filled in.
  """
  if not enabled:
    yield None
    return
  for line in notes:
    print(f"parity compare: {line}", file=sys.stderr)
  from rich.console import Console
  from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
  if not Console().is_terminal:  # a log file: plain lines at start and every quarter of the steps
    shown: dict[str, int] = {}
    total = spec.train.steps

    def on_line(side: str, n: int, note: str | None = None) -> None:
      if note:  # the worker is outside its steps (a DeepSpeed op build): say so instead of 0/N steps
        print(f"[{time.strftime('%H:%M:%S')}] {side}: {note}", flush=True)
        return
      quarter = (4 * n) // total if total else 4
      if shown.get(side) != quarter:
        shown[side] = quarter
        print(f"[{time.strftime('%H:%M:%S')}] {side}: {n}/{total} steps", flush=True)
    yield on_line
    return
  cols = (TextColumn("{task.description:>10}"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
          TimeElapsedColumn())
  with Progress(*cols, transient=False) as prog:
    tasks = {s: prog.add_task(s, total=spec.train.steps, start=False) for s in spec.sides}

    def on_progress(side: str, n: int, note: str | None = None) -> None:
      if note is not None:  # "deepspeed: building DeepSpeed op cpu_adam (first use, ~1 min)"; "" when it ends
        prog.update(tasks[side], description=f"{side}: {note}" if note else side)
        if note:
          return
      prog.start_task(tasks[side])
      prog.update(tasks[side], completed=n)
    yield on_progress
