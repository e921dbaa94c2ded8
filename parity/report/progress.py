"""What a running comparison shows on the terminal: the port's filled-in values, then progress per side."""
from __future__ import annotations

import contextlib
import json
import sys
import time
from typing import Any, Sequence

from parity import buildenv, environment
from parity.sides import find_side

__all__ = ["progress_display", "data_notes", "run_notes", "rerun_line", "rerun_parts", "show_reruns", "show_not_run",
           "op_build_line", "show_op_build", "STARTING"]

STARTING = "starting (imports, model init, compile) before step 0"
"""What a side does between its start and its first step record: the label shown instead of a silent 0/N."""


def rerun_parts(spec, noise: bool | None, determinism_steps: int, resume_at: int | None,
                equivalence: Sequence[str] = ()) -> list[tuple[str, str]]:
  """The reruns a run asked for, in the order they run, as (short name, what each side reruns): noise envelope
  (default on in bf16/fp16), determinism, resume, and each --equivalence kind."""
  t = spec.train
  noise_on = noise if noise is not None else t.precision in ("bf16", "fp16")
  parts = [("noise envelope", f"{t.steps} steps per side, batch rows reversed")] if noise_on else []
  if determinism_steps:
    parts.append(("determinism", f"first {min(determinism_steps, t.steps)} steps per side in a new process: a side "
                  "that does not repeat itself bit for bit makes any verdict on it chance; --determinism-steps 0 "
                  "skips it"))
  if resume_at is not None:
    parts.append(("resume", f"from step {resume_at}"))
  parts += [(f"equivalence {k}", f"{t.steps} steps per side") for k in equivalence]
  return parts


def rerun_line(spec, noise: bool | None, determinism_steps: int, resume_at: int | None,
               equivalence: Sequence[str] = ()) -> str | None:
  """The line shown before the reruns start (they run without a bar, for minutes on a large run): which reruns,
  of how many steps each; None when there are none."""
  parts = rerun_parts(spec, noise, determinism_steps, resume_at, equivalence)
  return f"rerunning each side that finished: {'; '.join(f'{n} ({w})' for n, w in parts)}" if parts else None


def data_notes(data_info: dict | None) -> list[str]:
  """Lines about the data a user should see before the sides start, not only in the report's data card: examples
  that 'truncate' cut to a row (newcomer, 2026-12-02: 329 of 512 examples cut, 48,972 tokens dropped, said only in
  the card), and the tokenizer's notes (a special token the vocabulary lacked, added as transformers adds it).
  [] for a stream run or when there is nothing to say."""
  card = (data_info or {}).get("card") if isinstance(data_info, dict) else None
  told = [f"data: {n}" for n in (card or {}).get("tokenizer_notes") or []] if isinstance(card, dict) else []
  cut = (card or {}).get("truncation") if isinstance(card, dict) else None
  if not isinstance(cut, dict) or not cut.get("examples_cut") or cut.get("mode") != "truncate":
    return told
  total = card.get("examples")
  of = f" of {total:,}" if isinstance(total, int) else ""
  return told + [f"data: {cut['examples_cut']:,}{of} examples are longer than a row and were "
          f"cut (train.truncation=truncate): {cut.get('tokens_dropped', 0):,} tokens dropped, "
          f"{cut.get('loss_tokens_dropped', 0):,} of them with loss; --set train.truncation=split keeps them as more "
          "pieces, a longer train.seq_len as longer rows"]


def run_notes(run: Any) -> list[str]:
  """Lines a user should see before a run starts: the values a DeepSpeed config port filled in (the DeepSpeed
  defaults it implies, the "auto" values it resolved from the run spec and, on padded/packed data, the loss
  normalisation the run trains beside what the config implies) and the port's warnings (e.g. a section the training
  stack never lets DeepSpeed read, the stack's own lr scheduler the config does not show). `run` is a ResolvedRun;
  each line is also in the run folder (migration.json / migration.md, report.json)."""
  port = getattr(run, "port", None)
  if port is None:
    return []
  out = [f"filled in {i['key']} = {json.dumps(i['value'], default=str)} ({i['reason']})" for i in port.report.implied]
  out += [f"filled in \"auto\" {e.key} = {json.dumps(e.resolved, default=str)} (from the run spec)"
          for e in port.report.entries.values() if e.value == "auto"]
  ln, spec = port.report.loss_normalization, getattr(run, "spec", None)
  if ln is not None and spec is not None and spec.train.layout != "stream":  # on a stream both are one loss
    out.append(f"loss normalisation: this run trains train.loss_normalization={spec.train.loss_normalization}; "
               f"the DeepSpeed config: {ln['why']}")
  return out + [f"port warning: {w}" for w in port.report.warnings]


def op_build_line(ops: Sequence[str]) -> str | None:
  """The line said before a side builds DeepSpeed's C++ ops (`ops`: those missing), or None when none is."""
  if not ops:
    return None
  return (f"building DeepSpeed's C++ ops once ({', '.join(ops)}): a few minutes on a fresh machine (up to 12 min on "
          "2 busy cores), with no step progress meanwhile; later runs reuse them (`parity build-ops` builds them "
          "ahead of a run)")


def show_op_build(side: str, spec, command: str = "compare") -> None:
  """Prints op_build_line to stderr, before `side` starts, when its worker loads DeepSpeed (its record's modules)
  and the ops it loads (parity.buildenv.deepspeed_ops) are not built in this environment yet; else nothing."""
  record = find_side(side)
  if record is None or "deepspeed" not in record.modules:
    return
  cuda = environment.cuda_evidence() is not None  # no driver: DeepSpeed's CPU accelerator, which needs the shm op
  line = op_build_line(buildenv.missing_ops(buildenv.deepspeed_ops(spec, cuda=cuda)))
  if line:
    print(f"[{time.strftime('%H:%M:%S')}] parity {command}: {side}: {line}", file=sys.stderr, flush=True)


def show_not_run(lines: Sequence[str]) -> None:
  """Prints the line of each side this machine cannot start (parity.sockets.not_run_line) to stderr, before anything
  starts and whatever --no-progress says: it changes what the run compares."""
  for line in lines:
    print(f"parity compare: {line}", file=sys.stderr, flush=True)


def show_reruns(enabled: bool, spec, noise: bool | None, determinism_steps: int, resume_at: int | None,
                equivalence: Sequence[str] = ()) -> None:
  """Prints rerun_line (to stderr, timestamped) when `enabled` and there are reruns."""
  line = rerun_line(spec, noise, determinism_steps, resume_at, equivalence) if enabled else None
  if line:
    print(f"[{time.strftime('%H:%M:%S')}] parity compare: {line}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def progress_display(enabled: bool, spec, notes: Sequence[str] = ()):
  """A context yielding on_progress(side, steps_done, note=None) for harness.runner, or None when not `enabled`.

  On a terminal: one rich progress bar per side, whose label shows the phase outside the steps (a DeepSpeed op
  build). In a log file: a plain line at the start and at every quarter of the steps. `notes` are printed first
  (to stderr) whether or not `enabled` (--no-progress hides the bar, not them: docs/migration.md promises the
  "filled in" lines), e.g. the values a DeepSpeed config port filled in and what truncation cut.
  """
  for line in notes:
    print(f"parity compare: {line}", file=sys.stderr, flush=True)
  if not enabled:
    yield None
    return
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
        what = f"{n}/{total} steps" if n else STARTING
        print(f"[{time.strftime('%H:%M:%S')}] {side}: {what}", flush=True)
    yield on_line
    return
  cols = (TextColumn("{task.description:>10}"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
          TimeElapsedColumn())
  with Progress(*cols, transient=False) as prog:
    tasks = {s: prog.add_task(s, total=spec.train.steps, start=False) for s in spec.sides}

    def on_progress(side: str, n: int, note: str | None = None) -> None:
      if note is not None:  # "deepspeed: building DeepSpeed op cpu_adam (first use, 1-4 min)"; "" when it ends
        prog.update(tasks[side], description=f"{side}: {note}" if note else side)
        if note:
          return
      prog.start_task(tasks[side])
      # before its first step a side loads, builds its model and compiles (JAX: XLA; no phase file says so)
      prog.update(tasks[side], completed=n, description=side if n else f"{side}: {STARTING}")
    yield on_progress
