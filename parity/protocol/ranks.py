"""Multi-rank sides (`parity compare --nproc N`): the launch file, the per-rank files, and the global-batch rule.

Files (docs/multirank.md):
  run_dir/launch.json          {"schema", "nproc", "coordinator", "hostfile", "nnodes", "node_rank"}: how the harness
                               starts each side; absent means one process per side (today's path). `derive_request`
                               copies it into reruns' folders, so a rerun runs with the same ranks.
  run_dir/<side>/rank<k>.json  what rank k reports of itself: pid at start, then status and peak RSS at its end.
  run_dir/<side>/rank<k>.stderr  rank k's stderr (the worker moves its fd 2 there first thing).

The global batch is the 1-rank run's for every N: batches.npy is the same file, and rank k of N trains on rows
[k*m, (k+1)*m) of every micro batch, m = train.micro_batch_size / N (`rank_rows`); gradients are averaged over
ranks, so the N-rank step is the 1-rank step up to reduction order. A micro batch N does not divide is refused
(`check_nproc`). Only rank 0 writes steps.jsonl, summary.json and the final files. Imports neither jax nor torch.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from parity.errors import SpecError
from parity.inputs import ascii_number

__all__ = ["LAUNCH_FILE", "LAUNCH_SCHEMA", "COORDINATOR_ENV", "write_launch", "read_launch", "check_nproc",
           "check_coordinator", "MULTIRANK_CHECKPOINTS", "multirank_checkpoint_refusal",
           "rank_env", "rank_rows", "rank_file", "rank_stderr", "write_rank_record", "read_rank_records"]

LAUNCH_FILE = "launch.json"
LAUNCH_SCHEMA = "parity.launch/1"
COORDINATOR_ENV = "PARITY_COORDINATOR"
"""host:port of JAX's coordinator (jax.distributed.initialize), set by the harness for every JAX rank."""
_DEFAULT = {"nproc": 1, "coordinator": None, "hostfile": None, "nnodes": 1, "node_rank": 0}


def write_launch(run_dir: str | Path, *, nproc: int = 1, coordinator: str | None = None,
                 hostfile: str | None = None, nnodes: int = 1, node_rank: int = 0) -> Path | None:
  """Writes run_dir/launch.json when the launch differs from one process per side; returns its path (or None).

  Args:
    nproc: ranks per side on this host (>= 1).
    coordinator: 'host:port' every host reaches (torchrun --rdzv-endpoint, jax.distributed.initialize); None: a
      free port on 127.0.0.1 per side.
    hostfile: a DeepSpeed hostfile, passed to the `deepspeed` launcher of the DeepSpeed side (absolute path).
    nnodes, node_rank: hosts in the job and this host's index (torchrun --nnodes/--node-rank; JAX process ids).
  """
  launch = {"nproc": int(nproc), "coordinator": coordinator, "hostfile": hostfile, "nnodes": int(nnodes),
            "node_rank": int(node_rank)}
  if launch == _DEFAULT:
    return None
  path = Path(run_dir) / LAUNCH_FILE
  path.write_text(json.dumps({"schema": LAUNCH_SCHEMA, **launch}, indent=2))
  return path


def read_launch(run_dir: str | Path) -> dict[str, Any]:
  """run_dir/launch.json's fields (the defaults where the file is absent).

  Raises:
    ValueError: a file that is not a parity launch file (names it).
  """
  path = Path(run_dir) / LAUNCH_FILE
  if not path.exists():
    return dict(_DEFAULT)
  data = json.loads(path.read_text())
  if not isinstance(data, dict) or data.get("schema") != LAUNCH_SCHEMA:
    raise ValueError(f"{path}: not a parity launch file (schema {LAUNCH_SCHEMA!r}); remove it or use a fresh "
                     "run folder")
  return {k: data.get(k, v) for k, v in _DEFAULT.items()}


def check_nproc(train: Any, nproc: int, *, nnodes: int = 1, jax_data_parallel: int = 1) -> None:
  """Refuses a rank count the run's global batch cannot be split over.

  Args:
    train: the run's TrainSpec (micro_batch_size is the global micro batch, the 1-rank run's).
    nproc: ranks per host; nnodes: hosts (world size nproc * nnodes).
    jax_data_parallel: jax.data_parallel (devices per JAX process; only 1 is combined with ranks).
  Raises:
    SpecError: naming the values and the fix.
  """
  if nproc < 1 or nnodes < 1:
    raise SpecError(f"--nproc must be >= 1 and --nnodes >= 1; got --nproc {nproc} --nnodes {nnodes}")
  world = nproc * nnodes
  mb = train.micro_batch_size
  if mb % world:
    raise SpecError(f"--nproc {nproc} (world size {world}): train.micro_batch_size={mb} is the global micro batch "
                    f"and must split evenly over the ranks; set train.micro_batch_size to a multiple of {world} (e.g. "
                    f"--set train.micro_batch_size={world * max(1, mb // world)}) or pick an --nproc that divides {mb}")
  if world > 1 and jax_data_parallel > 1:
    raise SpecError(f"--nproc {nproc} with jax.data_parallel={jax_data_parallel}: the JAX mesh already spans the "
                    "ranks' processes; set jax.data_parallel=1 (or run --nproc 1)")


def check_coordinator(coordinator: str | None, *, nnodes: int = 1) -> None:
  """Refuses a --coordinator that is not HOST:PORT, and a multi-host job without one.

  Args:
    coordinator: 'host:port' (host non-empty, port an integer in 1..65535; '[::1]:29500' for IPv6), or None.
    nnodes: hosts in the job; with more than one, every host must be told the same rendezvous (no default exists:
      each host would pick its own free port and wait for the others until the side's timeout).
  Raises:
    SpecError: naming --coordinator, the value and an example.
  """
  example = "e.g. --coordinator 10.0.0.1:29500 (the address of host 0, a free port every host reaches)"
  if coordinator is None:
    if nnodes > 1:
      raise SpecError(f"--nnodes {nnodes} needs --coordinator HOST:PORT, the same on every host; {example}")
    return
  host, sep, port = coordinator.rpartition(":")
  try:
    number = ascii_number(port, sign=False) if port.strip() == port else 0  # '²' passed isdigit, not int()
  except ValueError:
    number = 0
  if not sep or not host or not 1 <= number <= 65535:
    raise SpecError(f"--coordinator {coordinator!r}: expected HOST:PORT with a non-empty host and a port in "
                    f"1..65535; {example}")


MULTIRANK_CHECKPOINTS = ("checkpoints of multi-rank sides are not supported yet; run the resume check (--resume-at) "
                         "with --nproc 1")
"""Why a checkpoint with several ranks per side is refused (each rank would write its own): the one text of the
harness's refusal (parity.pipeline.compare, before anything runs) and the workers' (parity.protocol.loop)."""


def multirank_checkpoint_refusal(what: str, world: int) -> str:
  """The refusal message: `what` (e.g. '--resume-at with --nproc 2') and MULTIRANK_CHECKPOINTS, naming the ranks."""
  return f"{what} ({world} ranks per side): {MULTIRANK_CHECKPOINTS}"


def rank_env(environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
  """(rank, world size) of this process: RANK and WORLD_SIZE (set by torchrun, the deepspeed launcher and, for JAX
  ranks, the harness); (0, 1) without them."""
  try:
    return ascii_number(environ.get("RANK", "0")), ascii_number(environ.get("WORLD_SIZE", "1"))
  except ValueError:
    return 0, 1


def rank_rows(micro_batch_size: int, rank: int, world: int) -> slice:
  """Rows of a (.., micro_batch_size, ..) micro batch that rank `rank` of `world` trains on (check_nproc first)."""
  m = micro_batch_size // world
  return slice(rank * m, (rank + 1) * m)


def rank_file(out: str | Path, rank: int) -> Path:
  """run_dir/<side>/rank<k>.json."""
  return Path(out) / f"rank{rank}.json"


def rank_stderr(out: str | Path, rank: int) -> Path:
  """run_dir/<side>/rank<k>.stderr."""
  return Path(out) / f"rank{rank}.stderr"


def write_rank_record(out: str | Path, rank: int, **fields: Any) -> None:
  """Merges `fields` into run_dir/<side>/rank<k>.json (written whole each time; a rank writes only its own)."""
  path = rank_file(out, rank)
  try:
    old = json.loads(path.read_text()) if path.exists() else {}
  except ValueError:
    old = {}
  tmp = path.with_suffix(".json.tmp")
  tmp.write_text(json.dumps({**old, "rank": rank, **fields}, default=str))
  os.replace(tmp, path)


def read_rank_records(out: str | Path, world: int) -> list[dict[str, Any]]:
  """[rank<k>.json for k in range(world)], {'rank': k} where a rank wrote none (or an unreadable one)."""
  records = []
  for k in range(world):
    try:
      rec = json.loads(rank_file(out, k).read_text())
    except (OSError, ValueError):
      rec = {}
    records.append({**(rec if isinstance(rec, dict) else {}), "rank": k})
  return records
