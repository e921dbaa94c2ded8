"""torch.distributed for the torch sides: the process group (`setup_distributed`) and the reductions a multi-rank
side needs (`world_mean`). One rank or many (torchrun / the deepspeed launcher set RANK, WORLD_SIZE, MASTER_*).

Split out of torch_impl.engine (which re-exports setup_distributed). Imports torch and deepspeed only.
"""
from __future__ import annotations

import os
import socket

import torch

from parity.buildenv import build_environ
from torch_impl import ops

__all__ = ["setup_distributed", "init_process_group", "world_mean", "rank_and_world", "leave_process_group"]


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def setup_distributed() -> str:
  """Prepares this process for DeepSpeed and initialises torch.distributed.

  Without CUDA, sets DS_ACCELERATOR=cpu (it must be set before deepspeed is
  imported) and uses the gloo backend; with CUDA, nccl. The single-process
  rendezvous variables (MASTER_ADDR=127.0.0.1, a free MASTER_PORT, RANK=0,
  WORLD_SIZE=1, LOCAL_RANK=0) are set only where absent, so processes started
  by `deepspeed` or `torchrun` keep theirs. The op-build environment is
  `parity.buildenv.build_environ`'s, and op builds go through `torch_impl.ops`'s
  hooks (stale locks removed, progress reported). Idempotent.

  Returns:
    The torch.distributed backend name ('gloo' or 'nccl').
  """
  cuda = torch.cuda.is_available()
  if not cuda:
    os.environ["DS_ACCELERATOR"] = "cpu"
  # DeepSpeed JIT-builds its ops into TORCH_EXTENSIONS_DIR with the first ninja on PATH: the one environment
  # every process of this virtualenv builds in (harness.env), so no call path rebuilds another's ops.
  build_environ(os.environ)
  os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
  if "MASTER_PORT" not in os.environ:
    os.environ["MASTER_PORT"] = str(_free_port())
  for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
    os.environ.setdefault(key, value)
  import deepspeed  # deepspeed: after DS_ACCELERATOR and the op-build environment are set above
  ops.install_build_hooks()  # stale build locks cleared, builds shown in the progress line and kept off the clock
  backend = "nccl" if cuda else "gloo"
  if cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
  deepspeed.init_distributed(dist_backend=backend)
  return backend


def rank_and_world() -> tuple[int, int]:
  """(rank, world size) of this process's group, (0, 1) when torch.distributed is not initialised."""
  import torch.distributed as dist  # torch.distributed: on first use
  if not dist.is_available() or not dist.is_initialized():
    return 0, 1
  return dist.get_rank(), dist.get_world_size()


def world_mean(value: float) -> float:
  """The mean of a float over every rank (float64 all-reduce); `value` itself with one rank.

  Each rank's loss is the mean over its equal share of the micro batch's rows, so the mean over ranks is the
  loss of the whole micro batch (the 1-rank run's, up to summation order)."""
  _, world = rank_and_world()
  if world == 1:
    return value
  import torch.distributed as dist  # torch.distributed: on first use
  t = torch.tensor([value], dtype=torch.float64)
  dist.all_reduce(t)
  return float(t.item()) / world


def init_process_group() -> int:
  """The plain-torch side's process group: with WORLD_SIZE > 1 (torchrun's environment) gloo on CPU, nccl on CUDA,
  initialised once; nothing with one rank. Returns the world size."""
  import torch.distributed as dist  # torch.distributed: on first use
  world = int(os.environ.get("WORLD_SIZE", "1"))
  if world > 1 and not dist.is_initialized():
    cuda = torch.cuda.is_available()
    if cuda:
      torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if cuda else "gloo")
  return world


def leave_process_group() -> bool:
  """Ends this rank's part of a multi-rank run: a barrier (every rank has finished its last collective and rank 0
  has written the run's files), then `destroy_process_group`. Without it a rank that exits first closes its gloo
  sockets while a peer's background thread still reads them, and that peer can abort ('Connection reset by peer',
  SIGABRT): torchrun then reports a finished run as killed. Nothing with one rank or no group.

  Returns:
    True when a process group was left.
  """
  import torch.distributed as dist  # torch.distributed: on first use
  if not dist.is_available() or not dist.is_initialized():
    return False
  if dist.get_world_size() > 1:
    dist.barrier()
  dist.destroy_process_group()
  return True
