"""The protocol of a torch side's trainer: what `torch_impl.side.TorchSide` (and `FsdpSide`, `torch_impl.checkpoint`,
`torch_impl.semantics`) call on `self.trainer`. Three classes implement it: `torch_impl.engine.DeepSpeedTrainer`
(side 'deepspeed'), `torch_impl.baseline.TorchTrainer` ('torch') and `torch_impl.fsdp.FsdpTrainer` ('fsdp'). A new
torch side writes a class with these members and a `TorchSide` subclass whose `build` makes it
(docs/adding-a-side.md); `parity.protocol.loop.Side` is the protocol one level up, which TorchSide writes once over
any Trainer.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from parity.spec import RunSpec
from torch_impl.memory import StateBytes

__all__ = ["Trainer"]


@runtime_checkable
class Trainer(Protocol):
  """A built model and optimizer of one torch side, on this rank.

  Attributes:
    side: the side's name ('deepspeed', 'torch', 'fsdp'): torch_impl.checkpoint and torch_impl.semantics pick the
      framework calls that read its state by it.
    run: the resolved RunSpec it was built from.
    plants: this side's planted bugs (parity.protocol.layout.PLANT_KEYS ...) its steps and evals apply.
    device: the torch device its module computes on (cuda:k or cpu).
  """

  side: str
  run: RunSpec
  plants: frozenset

  @property
  def device(self) -> torch.device: ...

  def step(self, micro_batches: np.ndarray, *, probe: bool = False, force_overflow: bool = False,
           arrays: Any = None) -> dict[str, float | bool]:
    """One optimizer step over this rank's micro batches (A, M, T + 1) token ids; `probe`: measure the state bytes
    around the update (`state_bytes`); `force_overflow`: an fp16 overflow on this step; `arrays`: a padded/packed
    run's parity.protocol.side.ExampleArrays (None on stream). Returns {loss, grad_norm, lr} (+ loss_scale,
    skipped in fp16): the loss is this rank's mean (TorchSide averages the ranks)."""
    ...

  def eval_loss(self, val_batches: np.ndarray, arrays: Any = None) -> float:
    """Mean loss over the validation batches (E, M, T + 1), no update."""
    ...

  def poison(self) -> None:
    """Makes the next loss NaN (the debug plant nan_at_step)."""
    ...

  def canonical_params(self) -> dict[str, np.ndarray]:
    """The fp32 master params, whole, canonical names and the torch layout (a collective with several ranks)."""
    ...

  def canonical_moments(self) -> dict[str, np.ndarray]:
    """Adam's bias-corrected per-element gradient RMS, canonical, float32, whole; KeyError without Adam moments."""
    ...

  def state_bytes(self) -> StateBytes:
    """category -> memory kind -> bytes of this rank's training state (torch_impl.memory), max over probed steps."""
    ...

  def describe(self) -> dict[str, Any]:
    """Summary extras of summary.json, 'versions' among them ({package: version})."""
    ...
