"""The PyTorch sides of the one loop: `TorchSide`, `parity.protocol.loop.Side` over a trainer (the protocol
`torch_impl.trainer.Trainer`): the DeepSpeed engine (`torch_impl.engine.DeepSpeedTrainer`, side 'deepspeed') or the
plain-torch baseline (`torch_impl.baseline.TorchTrainer`, side 'torch'). `torch_impl.worker` runs it
(`run_train(io, TorchSide())`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from parity.protocol.loop import Side, SideSummary
from parity.protocol.side import SideIO
from torch_impl import checkpoint, doctor, memory, ops, transfers
from torch_impl.baseline import TorchTrainer
from torch_impl.distributed import leave_process_group, world_mean
from torch_impl.engine import DeepSpeedTrainer
from torch_impl.layers import set_model_plants
from torch_impl.semantics import semantics_card
from torch_impl.trainer import Trainer

__all__ = ["TorchSide"]


def _determinism(seed: int) -> None:
  """Seeds torch and asks for deterministic kernels (warn-only where none exists).

  Deterministic mode also NaN-fills every `torch.empty` by default; DeepSpeed
  allocates its ZeRO buckets (reduce_bucket_size, 5e8 elements) that way on each
  step, which made a ZeRO-2 offload step ~300x slower and cost 2 GB of RSS. The
  fill only exposes reads of uninitialised memory, so it is turned off.
  """
  os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
  torch.manual_seed(seed)
  torch.use_deterministic_algorithms(True, warn_only=True)
  torch.utils.deterministic.fill_uninitialized_memory = False


class TorchSide(Side):
  """`parity.protocol.loop.Side` over a `torch_impl.trainer.Trainer`: `DeepSpeedTrainer` or `TorchTrainer` (picked by
  `io.side`; FsdpSide builds an FsdpTrainer); eager (no compile), this rank's rows of each batch as host arrays
  (Side.rank_batch)."""

  trainer: Trainer
  """The side's built model and optimizer: every method here but `build` goes through the Trainer protocol."""

  def build(self, io: SideIO) -> None:
    """Seeds and makes torch deterministic, then builds the side's trainer from the initial weights.

    Raises:
      ValueError: a side other than 'deepspeed' or 'torch'.
    """
    if io.side not in ("deepspeed", "torch"):
      raise ValueError(f"torch_impl.worker runs the 'deepspeed' and 'torch' sides; got --side {io.side}")
    self.io = io
    set_model_plants(io.plants)  # before the model is built: a planted family porting bug, if any
    _determinism(io.run.train.seed)
    params = io.init_params()
    self.trainer = (DeepSpeedTrainer(io.run, params, io.request.get("deepspeed_config"), plants=io.plants)
                    if io.side == "deepspeed" else TorchTrainer(io.run, params, plants=io.plants))
    self.cuda = self.trainer.device.type == "cuda"

  def semantics(self, io: SideIO) -> dict[str, Any]:
    """The semantics card of the built trainer (torch_impl.semantics: each item probed on its own objects)."""
    return semantics_card(self.trainer, io.side, io.plants)

  def restore(self, folder: Path, meta: dict[str, Any]) -> None:
    checkpoint.restore(self.trainer, folder, meta)

  def op_build_s(self) -> float:
    return ops.build_s()  # time in DeepSpeed op builds (op_build_s in the summary)

  def synchronize(self) -> None:
    if self.cuda:
      torch.cuda.synchronize()

  def step(self, batch: np.ndarray, *, probe: bool, force_overflow: bool, arrays=None) -> dict[str, float | bool]:
    extra = {} if arrays is None else {"arrays": arrays}  # padded/packed only: the stream call is unchanged
    metrics = self.trainer.step(batch, probe=probe, force_overflow=force_overflow, **extra)
    metrics["loss"] = world_mean(metrics["loss"])  # several ranks: the whole micro batch's loss (rank means averaged)
    return metrics

  def eval_loss(self, val: np.ndarray, arrays=None) -> float:
    return self.trainer.eval_loss(val) if arrays is None else self.trainer.eval_loss(val, arrays)

  def canonical_params(self) -> dict[str, np.ndarray]:
    return self.trainer.canonical_params()

  def canonical_moments(self) -> dict[str, np.ndarray]:
    return self.trainer.canonical_moments()

  def poison(self) -> None:
    self.trainer.poison()

  def save(self, folder: Path, step: int) -> dict[str, Any]:
    return checkpoint.save(self.trainer, folder, step)

  def versions(self) -> dict[str, str]:
    return self.trainer.describe()["versions"]

  def close(self) -> None:
    """Leaves the process group after the run's files are written (torch_impl.distributed.leave_process_group:
    DeepSpeed's, the plain-torch side's and FSDP2's group alike)."""
    leave_process_group()

  def summary(self) -> SideSummary:
    """versions/device/memory/thread fields of summary.json, from the trainer (`threads`: torch_impl.doctor)."""
    t = self.trainer
    info, state = t.describe(), t.state_bytes()
    return SideSummary(
        versions=info.pop("versions"),
        device=f"cuda ({torch.cuda.get_device_name(t.device)})" if self.cuda else "cpu",
        peak_device_bytes=int(torch.cuda.max_memory_allocated(t.device)) if self.cuda else None,
        state_bytes_by_memory_kind=memory.by_memory_kind(state),
        extra={"state_bytes_by_category": state, "op_build_s": self.op_build_s(),
               "threads": doctor.thread_settings(torch), **self._side_extra(), **info})

  def _side_extra(self) -> dict[str, Any]:
    """summary.json fields only some torch sides write: here `transfers` (FsdpSide writes none)."""
    return {"transfers": self._transfers()}

  def _transfers(self) -> dict[str, Any]:
    """summary.json's `transfers` (torch_impl.transfers): the DeepSpeed engine's counted bytes and CPU Adam time; the
    plain-torch side offloads nothing, so zero bytes."""
    if isinstance(self.trainer, DeepSpeedTrainer):
      return self.trainer.transfers()
    return transfers.no_offload(
        "plain torch: the module, its gradients and the optimizer state stay where the module computes",
        ["nothing is offloaded: no tensor of the training state crosses host<->device in a step (the batch's token "
         "ids aside)", "cpu_adam_s is null: the plain-torch side runs torch's optimizer, not DeepSpeedCPUAdam"])
