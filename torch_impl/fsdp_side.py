"""The FSDP2 side of the one loop: `FsdpSide`, `parity.protocol.loop.Side` over `torch_impl.fsdp.FsdpTrainer`, and its
checkpoints through DCP (`torch.distributed.checkpoint`). `torch_impl.fsdp_worker` runs it (`run_train(io,
FsdpSide())`).

A checkpoint folder (run_dir/fsdp/checkpoint/, `SideIO.save_checkpoint` creates it and writes meta.json) holds
  dcp/              `dcp.save` of {'model', 'optim'}: the sharded model and optimizer state dicts of
                    `torch.distributed.checkpoint.state_dict.get_state_dict` (each rank writes its shards; DCP loads
                    them into any sharding, so a resume need not share the plan: its record's state_layout is ())
  fsdp_trainer.pt   torch.save (rank 0) of parity_step, step_index (the schedule position), the fp16 loss scaler's
                    state_dict (or None) and the torch RNG state
Restoring builds the trainer from the initial weights, then `dcp.load`s into its state dicts and `set_state_dict`s
them; `get_state_dict` first gives the fresh optimizer its state tensors by one step at lr 0 on zero gradients
(torch's `_init_optim_state`), all of which the load then overwrites.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from parity.protocol.side import SideIO
from torch_impl.fsdp import FsdpTrainer
from torch_impl.layers import set_model_plants
from torch_impl.semantics import semantics_card
from torch_impl.side import TorchSide, _determinism

__all__ = ["FsdpSide", "save", "restore", "DCP_DIR", "TRAINER_FILE"]

DCP_DIR = "dcp"
"""Subfolder of the checkpoint given to `torch.distributed.checkpoint.save` / `load`."""
TRAINER_FILE = "fsdp_trainer.pt"
"""The trainer's own counters, scaler and RNG state (rank 0)."""


def save(trainer: FsdpTrainer, folder: str | Path, step: int) -> dict[str, Any]:
  """Writes the trainer's complete training state after optimizer step `step` (0-based) into the empty `folder`
  (a collective: every rank calls it). Returns meta.json's fields: format, folder, file, step_index."""
  from torch.distributed import checkpoint as dcp
  from torch.distributed.checkpoint.state_dict import get_state_dict
  folder = Path(folder)
  model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
  dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / DCP_DIR))
  if trainer.mesh.get_rank() == 0:
    scaler = trainer.loss_scaler
    torch.save({"parity_step": step, "step_index": trainer.step_index, "torch_rng_state": torch.get_rng_state(),
                "loss_scaler": None if scaler is None else scaler.state_dict()}, folder / TRAINER_FILE)
  return {"format": "torch.distributed.checkpoint", "folder": DCP_DIR, "file": TRAINER_FILE,
          "step_index": trainer.step_index}


def restore(trainer: FsdpTrainer, folder: str | Path, meta: dict[str, Any]) -> None:
  """Restores a state `save` wrote into a freshly built trainer of the same run (a collective).

  Args:
    folder: the checkpoint folder; meta: its meta.json (`step`: the step saved after).
  Raises:
    FileNotFoundError: dcp/ or fsdp_trainer.pt is missing.
    ValueError: the files hold another step, or fp16 loss-scaler state where this run has none (or the reverse).
  """
  from torch.distributed import checkpoint as dcp
  from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
  folder, step = Path(folder), int(meta["step"])
  path = folder / TRAINER_FILE
  if not (folder / DCP_DIR).is_dir() or not path.is_file():
    raise FileNotFoundError(f"{folder}: no FSDP2 checkpoint ({DCP_DIR}/ and {TRAINER_FILE}) in the checkpoint folder")
  state = torch.load(path, weights_only=True)
  if state.get("parity_step") != step or state.get("step_index") != step + 1:
    raise ValueError(f"{path}: holds step {state.get('parity_step')} (step_index {state.get('step_index')}); "
                     f"meta.json says step {step}")
  scaler, saved = trainer.loss_scaler, state.get("loss_scaler")
  if (scaler is None) != (saved is None):
    raise ValueError(f"{path}: the checkpoint {'holds' if saved is not None else 'holds no'} loss-scaler state but "
                     f"this trainer {'has' if scaler is not None else 'has no'} loss scaler (another precision?)")
  model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
  dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / DCP_DIR))
  set_state_dict(trainer.model, trainer.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
  trainer.step_index = int(state["step_index"])
  if scaler is not None:
    scaler.load_state_dict(saved)
  torch.set_rng_state(state["torch_rng_state"].cpu())


class FsdpSide(TorchSide):
  """`parity.protocol.loop.Side` over `FsdpTrainer`: eager, this rank's rows of each batch (Side.rank_batch), the
  step's loss averaged over the ranks (TorchSide.step), params and moments gathered whole (collectives)."""

  def build(self, io: SideIO) -> None:
    """Seeds and makes torch deterministic, then builds the FSDP2 trainer from the initial weights.

    Raises:
      ValueError: a side other than 'fsdp'.
    """
    if io.side != "fsdp":
      raise ValueError(f"torch_impl.fsdp_worker runs the 'fsdp' side; got --side {io.side}")
    self.io = io
    set_model_plants(io.plants)  # before the model is built: a planted family porting bug, if any
    _determinism(io.run.train.seed)
    self.trainer = FsdpTrainer(io.run, io.init_params(), plants=io.plants)
    self.cuda = self.trainer.device.type == "cuda"

  def semantics(self, io: SideIO) -> dict[str, Any]:
    """The semantics card of the built trainer (torch_impl.semantics; the FSDP2 dtypes and offload in its info)."""
    return semantics_card(self.trainer, io.side, io.plants)

  def restore(self, folder: Path, meta: dict[str, Any]) -> None:
    restore(self.trainer, folder, meta)

  def op_build_s(self) -> float:
    return 0.0  # no DeepSpeed ops

  def save(self, folder: Path, step: int) -> dict[str, Any]:
    return save(self.trainer, folder, step)

  def _side_extra(self) -> dict[str, Any]:
    return {}  # no DeepSpeed offload copies to count: summary.json has no `transfers`
