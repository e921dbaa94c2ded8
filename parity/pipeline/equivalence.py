"""Equivalence checks a user asks for (`--equivalence ga,ranks,packing`): each side of the comparison trained again
on the same examples in another, mathematically equivalent shape, and held against its own main run.

  ga       gradient accumulation k x micro batch m  against  GA 1 x micro batch k*m (train.grad_accum_steps > 1)
  ranks    N ranks against 1 rank (a 1-rank run against 2 ranks)
  packing  examples packed (train.layout=packed) against the same examples padded one per row, or the reverse
           (padded/packed example data only: `--data X.jsonl` with a layout, or `--preset sft-tiny`)
The rerun folders and arrays: parity.pipeline.equivalence_inputs (the same examples at every optimizer step, checked).

What the check is and its report section: parity.verdict.equivalence (`equivalence_outcome`, `equivalence_section`,
re-exported here), which parity.report.reverify recomputes a finished run's reruns with.
"""
from __future__ import annotations

from typing import Sequence

from harness.runner import run_side
from parity.pipeline.equivalence_inputs import EquivalenceInputError, prepare_equivalence
from parity.protocol.outputs import rerun_outputs
from parity.protocol.ranks import check_nproc
from parity.spec import RunSpec, SpecError
from parity.verdict.equivalence import (DISTANCE_METRICS, EQUIVALENCE_LOSS, equivalence_metric, equivalence_outcome,
                                        equivalence_section, not_prepared)

__all__ = ["EQUIVALENCES", "EQUIVALENCE_LOSS", "DISTANCE_METRICS", "parse_equivalence", "check_equivalence",
           "equivalence_metric", "equivalence_outcome", "equivalence_section", "run_equivalence", "rerun_outputs"]

EQUIVALENCES = ("ga", "ranks", "packing")


def parse_equivalence(value: str | Sequence[str] | None) -> tuple[str, ...]:
  """The kinds asked for, in EQUIVALENCES' order, from 'ga,ranks' or ['ga', 'ranks'] (None, '' or []: none).

  Raises:
    SpecError: an unknown kind, named with the valid ones; a value that names no kind (','), or an empty or
      repeated item ('ga,', 'ga,ga').
  """
  if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
    return ()
  items = value.split(",") if isinstance(value, str) else [str(v) for item in value for v in str(item).split(",")]
  kinds = {k.strip() for k in items if k.strip()}
  if not kinds:  # ',' or ' ': asked for checks and named none (it once ran none, said nothing)
    given = value if isinstance(value, str) else ",".join(str(v) for v in value)
    raise SpecError(f"--equivalence {given!r} names no check; choose from {', '.join(EQUIVALENCES)} "
                    "(comma-separated, e.g. --equivalence ga,packing), or leave the option out")
  given = value if isinstance(value, str) else ",".join(str(v) for v in value)
  named = [k.strip() for k in items]
  if "" in named or len(named) != len(kinds):  # 'ga,' or 'ga,ga': a slip; which check was meant is not known
    raise SpecError(f"--equivalence {given!r} has an empty or repeated item; name each check once, comma-separated, "
                    f"from {', '.join(EQUIVALENCES)} (e.g. --equivalence ga,packing)")
  unknown = sorted(kinds - set(EQUIVALENCES))
  if unknown:
    raise SpecError(f"--equivalence {', '.join(unknown)}: not an equivalence check; choose from "
                    f"{', '.join(EQUIVALENCES)} (comma-separated, e.g. --equivalence ga,packing)")
  return tuple(k for k in EQUIVALENCES if k in kinds)


def check_equivalence(spec: RunSpec, kinds: Sequence[str], *, nproc: int = 1, nnodes: int = 1) -> None:
  """Refuses, before any side starts, an equivalence check that cannot apply to this run.

  Raises:
    SpecError: 'ga' with train.grad_accum_steps 1 (nothing accumulates); 'packing' on the stream layout (no
      examples to lay out); 'ranks' over several hosts, or a micro batch that 2 ranks cannot split; each naming
      the option and the fix.
  """
  t = spec.train
  if "ga" in kinds and t.grad_accum_steps == 1:
    raise SpecError("--equivalence ga compares GA k x micro batch m against GA 1 x micro batch k*m, but "
                    "train.grad_accum_steps is 1; set --set train.grad_accum_steps=2 (or more), or drop ga")
  if "packing" in kinds and t.layout not in ("padded", "packed"):
    raise SpecError(f"--equivalence packing compares packed against padded examples, but train.layout is "
                    f"{t.layout!r} (windows of a token stream); give example data (--data X.jsonl --set "
                    "train.layout=packed, or --preset sft-tiny), or drop packing")
  if "ranks" in kinds:
    if nnodes > 1:
      raise SpecError("--equivalence ranks reruns each side on this host; it is not run with --nnodes > 1")
    if nproc == 1:
      try:
        check_nproc(t, 2, jax_data_parallel=spec.jax.data_parallel)
      except SpecError as exc:
        raise SpecError(f"--equivalence ranks reruns the 1-rank run on 2 ranks: {exc}") from None


def run_equivalence(ctx, kinds: Sequence[str], *, tokenizer: str | None = None, result=None):
  """Runs the equivalence reruns of every finished side (parity.verdict.reruns.RerunContext ctx), kind by kind.

  Returns:
    `result` (a parity.verdict.reruns.RerunResult) with one Check per kind and side, section {kind: ...}, and the
    reruns' busy seconds; a Ctrl-C is kept in result.interrupted and stops the rest.
  """
  result.section = {}
  for kind in kinds:
    try:
      prepared = prepare_equivalence(ctx.run_dir, kind, ctx.spec, tokenizer=tokenizer)
    except (EquivalenceInputError, OSError, ValueError) as exc:
      checks = [not_prepared(kind, s, ctx.spec, exc) for s in ctx.ok_sides]
      result.checks += checks
      result.section[kind] = equivalence_section(kind, ctx.spec, None, {
          c.sides[0]: {"status": None, "error": c.detail, "passed": False, "gating": c.gating} for c in checks})
      continue
    entries = {}
    for side in ctx.ok_sides:
      try:
        sr = run_side(prepared["folder"], side, timeout_s=ctx.timeout_s)
      except KeyboardInterrupt as exc:
        result.interrupted = exc
        break
      result.count(sr)
      c, entries[side] = equivalence_outcome(
          kind, side, ctx.side_data[side], sr,
          *rerun_outputs(prepared["folder"], side, sr, ctx.run_id, ctx.spec.train.steps), ctx.spec, ctx.init)
      result.checks.append(c)
    result.section[kind] = equivalence_section(kind, ctx.spec, prepared, entries)
    if result.interrupted is not None:
      break
  return result
