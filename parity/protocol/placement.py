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
           "write_placement", "BOOKKEEPING_BYTES", "BOOKKEEPING_TOTAL_BYTES", "split_host_compute", "host_ops_of",
           "host_compute_mismatch", "judged_mismatches"]

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

BOOKKEEPING_TOTAL_BYTES = 1024
"""At most this many bytes of scalar host ops in one step are bookkeeping (measured 136-236 on a TPU v5e: 4x); more
is a computation done on the host one scalar at a time, and every one of them counts as bulk."""
BOOKKEEPING_CLASSES = (None, "opt_state")
"""The classes whose scalars may be bookkeeping: untraced values and the optimizer state (its update count). A scalar
op on params, the batch or the metrics is not bookkeeping of the offloaded state."""
_MOVE_ASYNC = ("copy-start", "copy-done", "custom-call-start", "custom-call-update", "custom-call-done")
"""The async halves of a move that lands in host memory (copy-done; custom-call-done of a host-offload move, whose
-start carries the MoveToHost target): moves, not compute, whatever their size. Other async ops (async-done, which
also wraps jax's compute_on host computations, or a collective's -done) are judged like any op."""


def _size(op: dict) -> int | None:
  v = op.get("bytes")
  return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 else None


def split_host_compute(ops: Any) -> tuple[list[dict], list[dict], list[dict]]:
  """(bulk, bookkeeping, moves) of placement.json's transfers.host_compute: the ops computing in host memory that
  contradict the plan, the scalar ones listed only (BOOKKEEPING_BYTES each, BOOKKEEPING_TOTAL_BYTES in all, of
  BOOKKEEPING_CLASSES), and the async halves of moves (_MOVE_ASYNC). An op marked to compute on the host, of unknown
  size, or of another class is bulk."""
  bulk, small, moves = [], [], []
  for op in ops if isinstance(ops, list) else []:
    if not isinstance(op, dict):
      continue
    size = _size(op)
    if op.get("host_marked"):
      bulk.append(op)
    elif str(op.get("opcode")) in _MOVE_ASYNC:
      moves.append(op)
    elif size is not None and size <= BOOKKEEPING_BYTES and op.get("class") in BOOKKEEPING_CLASSES:
      small.append(op)
    else:
      bulk.append(op)
  if sum(_size(op) or 0 for op in small) > BOOKKEEPING_TOTAL_BYTES:
    bulk, small = bulk + small, []
  return bulk, small, moves


def host_ops_of(rec: Any) -> Any:
  tr = rec.get("transfers") if isinstance(rec, dict) else None
  return tr.get("host_compute") if isinstance(tr, dict) else None


def host_compute_mismatch(op: dict[str, Any]) -> dict[str, Any]:
  """The placement mismatch of one bulk op that computes in host memory."""
  return {"class": op.get("class") or "unknown", "role": "compute", "expected": "device", "compiled": "host",
          "detail": f"the compiled step computes {op.get('opcode')} {op.get('name')} ({op.get('bytes')} bytes, "
                    f"{op.get('tensor')}) in host memory; the plan moves host-resident state to the device to "
                    "compute (jax_impl.offload.Placement.to_device)"}


def judged_mismatches(rec: dict[str, Any]) -> list[dict[str, Any]]:
  """The record's mismatches with the host-compute ones judged anew from transfers.host_compute (split_host_compute:
  only bulk ops count), so a record written before the rule (every host op a mismatch) reads the same as a new one."""
  listed = rec.get("mismatches") if isinstance(rec, dict) else None
  rows = [m for m in listed if isinstance(m, dict) and m.get("role") != "compute"] if isinstance(listed, list) else []
  bulk, _, _ = split_host_compute(host_ops_of(rec))
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
