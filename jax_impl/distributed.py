"""The JAX side as several processes: JAX's multi-controller runtime, one process per rank (docs/multirank.md).

The harness starts N copies of `jax_impl.worker`, each with RANK, WORLD_SIZE and PARITY_COORDINATOR (host:port).
`initialize` turns them into one JAX job (`jax.distributed.initialize(coordinator, num_processes, process_id)`; on
CPU with gloo collectives, `jax_cpu_collectives_implementation`), `global_mesh` is a `data` mesh over every process's
devices, and each rank hands only its rows of a batch to `global_batch`
(`jax.make_array_from_process_local_data`): rank k of N owns rows [k*m, (k+1)*m) of each micro batch, which is
exactly the shard the batch sharding (micro axis over `data`) gives its device, so the global array is the 1-rank
run's batch. The jitted step is unchanged: XLA inserts the cross-process reductions; the state keeps its plan
(e.g. the optimizer state in pinned_host, sharded over the processes under jax.zero_stage >= 1).

Reading the state back (final params, Adam moments) needs every element on every process: `Gathered` replicates
the state with one jitted identity (a collective: every rank calls it). Never imports torch.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_impl.offload import DATA_AXIS, DEVICE_KIND
from parity.protocol.ranks import COORDINATOR_ENV, rank_env, rank_rows

__all__ = ["initialize", "global_mesh", "global_batch", "Gathered"]


def initialize(environ=os.environ) -> tuple[int, int]:
  """Joins this process to the side's JAX job when WORLD_SIZE > 1; call before any JAX computation. Each process
  owns one device, local device LOCAL_RANK (on a GPU node: one GPU per rank, as torchrun's ranks).

  Returns:
    (rank, world size); (0, 1) and nothing done with one rank.
  Raises:
    ValueError: WORLD_SIZE > 1 without PARITY_COORDINATOR (a rank started by hand: set it to host:port).
  """
  rank, world = rank_env(environ)
  if world == 1:
    return 0, 1
  coordinator = environ.get(COORDINATOR_ENV)
  if not coordinator:
    raise ValueError(f"WORLD_SIZE={world} but {COORDINATOR_ENV} is unset: every JAX rank needs the coordinator's "
                     "host:port (the harness sets it; see docs/multirank.md)")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU backend only; GPUs use NCCL
  local = int(environ.get("LOCAL_RANK", 0))  # one device per process: GPU LOCAL_RANK on a GPU node (the CPU: its own)
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=world, process_id=rank,
                             local_device_ids=[local])
  return rank, world


def global_mesh() -> Mesh:
  """The `data` mesh over every device of every process (jax.devices(), process by process)."""
  return Mesh(np.array(jax.devices()), (DATA_AXIS,))


def global_batch(rows: np.ndarray, sharding: NamedSharding, global_shape: tuple[int, ...], rank: int,
                 world: int) -> jax.Array:
  """This rank's rows of a (A, M, T + 1) host batch as its part of the global (A, M, T + 1) array.

  Args:
    rows: the whole host batch (a memory map: only this rank's rows are read) or already just this rank's rows.
    sharding: the batch sharding (micro axis over `data`); global_shape: (A, M, T + 1) of the 1-rank batch.
    rank, world: this process's rank and the number of ranks (M % world == 0: parity.protocol.ranks.check_nproc).
  """
  local = rows if rows.shape[1] != global_shape[1] else rows[:, rank_rows(global_shape[1], rank, world)]
  with jax.transfer_guard("allow"):  # an explicit host-to-device move (the worker's loop disallows implicit ones)
    return jax.make_array_from_process_local_data(sharding, np.ascontiguousarray(local), global_shape)


class Gathered:
  """Reads a multi-process trainer's state on every rank: `call(trainer, fn)` runs `fn()` (e.g.
  trainer.canonical_moments) with the state replicated into device memory, then puts the live state back.

  Args:
    trainer: a jax_impl.step.Trainer whose mesh spans processes.
  """

  def __init__(self, trainer: Any):
    rep = NamedSharding(trainer.placement.mesh, P(), memory_kind=DEVICE_KIND)
    self._copy = jax.jit(lambda s: s, out_shardings=jax.tree.map(lambda _: rep, trainer.shardings))

  def call(self, trainer: Any, fn: Callable[[], Any]) -> Any:
    """fn() on the replicated state (a collective: every rank must call it at the same point)."""
    live = trainer.state
    trainer.state = self._copy(live)
    try:
      return fn()
    finally:
      trainer.state = live
