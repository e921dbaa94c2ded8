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
           "write_placement"]

PLACEMENT_FILE = "placement.json"
"""In run_dir/<side>/: the compiled step's placement (jax_impl.placement.placement_record)."""
PLACEMENT_SCHEMA = "parity.placement/1"
PLACEMENT_WORKER = "jax_impl.worker"
"""The worker module that writes placement.json (its step is compiled ahead of time)."""


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
