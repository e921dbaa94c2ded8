"""run_dir/<side>/placement.json: where a side's compiled train step keeps each tensor class (written by the JAX worker
after it compiles, `jax_impl.placement`; checked against the plan by parity.verdict.placement).

The file's fields are listed in docs/plans.md "Placement from the compiled step". This module holds its name, schema
tag, which sides write one, its reader (trusting only this run's file) and its writer (a new file: O_EXCL, never
over an earlier one). Imports neither jax nor torch.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from parity.protocol.workers import SIDE_WORKERS

__all__ = ["PLACEMENT_FILE", "PLACEMENT_SCHEMA", "PLACEMENT_WORKER", "writes_placement", "read_placement",
           "write_placement", "BOOKKEEPING_BYTES", "split_host_compute", "host_compute_mismatch", "judged_mismatches"]

PLACEMENT_FILE = "placement.json"
"""In run_dir/<side>/: the compiled step's placement (jax_impl.placement.placement_record)."""
PLACEMENT_SCHEMA = "parity.placement/1"
PLACEMENT_WORKER = "jax_impl.worker"
"""The worker module that writes placement.json (its step is compiled ahead of time)."""


BOOKKEEPING_BYTES = 8
"""A host-memory op whose result is at most this many bytes (one scalar: a float32/int32 count, a predicate, a 64-bit
value) is bookkeeping, listed and not failed. XLA:TPU computes such scalars in host memory when their operands live
there: measured on a TPU v5e (tests/data/tpu_v5e, five plans and families), every one of the 32-59 host ops of a step
was a 4-byte add/maximum/power/convert (the Adam bias-correction terms of the offloaded update count) or a 1-byte
compare, 136-236 bytes per step in all. What the plan is about (params, gradients, moments, activations) is tensors
of KiB and up, so a bulk op in host memory is never this small."""

_ASYNC_PARTS = ("-start", "-done", "-update")
"""Opcode suffixes of an async op's halves (custom-call-done of a host-offload move, copy-done, ...): the completion
of a move that lands in host memory, not compute. A real host computation of jax's compute_on is marked
_xla_compute_type="host" and is listed by its own opcode."""


def split_host_compute(ops: Any) -> tuple[list[dict], list[dict], list[dict]]:
  """(bulk, bookkeeping, moves) of placement.json's transfers.host_compute: the ops computing in host memory that
  contradict the plan, the scalar ones listed only (BOOKKEEPING_BYTES), and the async halves of moves."""
  bulk, small, moves = [], [], []
  for op in ops if isinstance(ops, list) else []:
    if not isinstance(op, dict):
      continue
    opcode, size = str(op.get("opcode")), op.get("bytes")
    if opcode.endswith(_ASYNC_PARTS):
      moves.append(op)
    elif isinstance(size, (int, float)) and not isinstance(size, bool) and 0 <= size <= BOOKKEEPING_BYTES:
      small.append(op)
    else:
      bulk.append(op)
  return bulk, small, moves


def host_compute_mismatch(op: dict[str, Any]) -> dict[str, Any]:
  """The placement mismatch of one bulk op that computes in host memory."""
  return {"class": op.get("class") or "unknown", "role": "compute", "expected": "device", "compiled": "host",
          "detail": f"the compiled step computes {op.get('opcode')} {op.get('name')} ({op.get('bytes')} bytes, "
                    f"{op.get('tensor')}) in host memory; the plan moves host-resident state to the device to "
                    "compute (jax_impl.offload.Placement.to_device)"}


def judged_mismatches(rec: dict[str, Any]) -> list[dict[str, Any]]:
  """The record's mismatches with the host-compute ones judged anew from transfers.host_compute (split_host_compute:
  only bulk ops count), so a record written before the rule (every host op a mismatch) reads the same as a new one."""
  rows = [m for m in rec.get("mismatches") or [] if isinstance(m, dict) and m.get("role") != "compute"]
  bulk, _, _ = split_host_compute((rec.get("transfers") or {}).get("host_compute"))
  return rows + [host_compute_mismatch(op) for op in bulk]


def writes_placement(side: str) -> bool:
  """Whether `side`'s training worker writes placement.json (the JAX worker does; DeepSpeed and torch do not)."""
  return SIDE_WORKERS.get(side) == PLACEMENT_WORKER


def read_placement(path: str | Path, run_id: str | None = None) -> tuple[dict[str, Any] | None, str | None]:
  """Reads a placement.json; never raises for its content.

  Returns:
    (the record, None), or (None, why it is not usable): missing, not JSON, another schema, or another run's
    (run_id given and not the file's).
  """
  path = Path(path)
  try:
    rec = json.loads(path.read_text())
  except FileNotFoundError:
    return None, f"{path} is missing"
  except (OSError, ValueError) as exc:
    return None, f"{path} cannot be read ({type(exc).__name__}: {exc})"
  if not isinstance(rec, dict) or rec.get("schema") != PLACEMENT_SCHEMA:
    got = rec.get("schema") if isinstance(rec, dict) else type(rec).__name__
    return None, f"{path} has schema {got!r}, not {PLACEMENT_SCHEMA!r}"
  if run_id is not None and rec.get("run_id") != run_id:
    return None, f"{path} belongs to another run (run_id {rec.get('run_id')}, this run {run_id})"
  return rec, None


def write_placement(path: str | Path, record: dict[str, Any]) -> None:
  """Writes `record` as JSON to `path`, a file that must not exist yet (O_EXCL: a run never writes over an earlier
  run's or a user's file).

  Raises:
    FileExistsError: the file exists (the message names it).
    OSError: it cannot be written; the partial file is removed.
  """
  path = Path(path)
  try:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
  except FileExistsError:
    raise FileExistsError(f"{path} exists already (an earlier run's or a user's file); placement.json is never "
                          "written over: choose a new or empty run folder") from None
  try:
    with os.fdopen(fd, "w") as f:
      f.write(json.dumps(record, indent=1, default=str) + "\n")
  except OSError:
    path.unlink(missing_ok=True)
    raise
