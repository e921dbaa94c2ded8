"""Checkpoint / resume of the PyTorch sides' complete training state (parity.protocol run control).

A checkpoint folder is run_dir/<side>/checkpoint/ (`SideIO.save_checkpoint` creates it and writes
meta.json after the files below):

  deepspeed:  deepspeed/<tag>/...        `engine.save_checkpoint(folder/deepspeed, tag="step_<K>")`:
                                         module, ZeRO optimizer partitions (fp32 master weights, Adam
                                         moments and step, loss scaler, clip setting), lr scheduler,
                                         global_steps / global_samples / skipped_steps; client_state
                                         adds parity_step, the torch RNG state and any trainer.loss_scaler
  torch:      torch_state.pt             torch.save of model and optimizer state dicts, step_index,
                                         trainer.loss_scaler.state_dict() (when the trainer has one)
                                         and the torch RNG state

Restoring goes through the trainer's public attributes (DeepSpeedTrainer.engine; TorchTrainer.model,
.optimizer, .step_index, .loss_scaler); the trainers themselves are not changed.

DeepSpeedCPUAdam keeps beta1^t and beta2^t in its C++ optimizer object, not in any state dict. A
fresh run grows them by one float32 multiplication per step; a freshly built optimizer that meets
step K + 1 recomputes them with std::pow instead, which can differ in the last bit and moves every
later update by an ulp (deepspeed/ops/csrc/includes/cpu_adam.h `IncrementStep`). `_replay_cpu_adam_steps`
replays steps 1..K on a one-element dummy tensor, so the C++ object holds the same products as in
the uninterrupted run; the model's tensors are not touched.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from torch_impl.trainer import Trainer

__all__ = ["save", "restore", "DEEPSPEED_DIR", "TORCH_FILE"]

DEEPSPEED_DIR = "deepspeed"
"""Subfolder of the checkpoint given to `engine.save_checkpoint` / `engine.load_checkpoint`."""
TORCH_FILE = "torch_state.pt"
"""The torch baseline's checkpoint file."""


def _tag(step: int) -> str:
  return f"step_{step}"


def _scaler_state(trainer) -> dict[str, Any] | None:
  """state_dict() of the trainer's `loss_scaler` (any object with state_dict/load_state_dict), or None."""
  scaler = getattr(trainer, "loss_scaler", None)
  return None if scaler is None else scaler.state_dict()


def _load_scaler(trainer, state: dict[str, Any] | None, where: Path) -> None:
  scaler = getattr(trainer, "loss_scaler", None)
  if (scaler is None) != (state is None):
    have = "has" if scaler is not None else "has no"
    saved = "holds" if state is not None else "holds no"
    raise ValueError(f"{where}: the checkpoint {saved} loss-scaler state but this trainer {have} loss_scaler "
                     "(another precision mode?)")
  if scaler is not None:
    scaler.load_state_dict(state)


def save(trainer: Trainer, folder: str | Path, step: int) -> dict[str, Any]:
  """Writes the trainer's complete training state after optimizer step `step` into `folder`.

  Args:
    trainer: a DeepSpeedTrainer (side 'deepspeed') or TorchTrainer (side 'torch').
    folder: the empty checkpoint folder (SideIO.save_checkpoint passes it).
    step: the optimizer step just completed, 0-based.
  Returns:
    Fields for meta.json: format, and for DeepSpeed the tag and engine counters.
  Raises:
    ValueError: a trainer of another side.
  """
  folder = Path(folder)
  rng = torch.get_rng_state()
  if trainer.side == "deepspeed":
    engine = trainer.engine
    client = {"parity_step": step, "torch_rng_state": rng, "loss_scaler": _scaler_state(trainer)}
    engine.save_checkpoint(str(folder / DEEPSPEED_DIR), tag=_tag(step), client_state=client, save_latest=True)
    return {"format": "deepspeed.save_checkpoint", "tag": _tag(step), "global_steps": int(engine.global_steps),
            "global_samples": int(engine.global_samples), "skipped_steps": int(engine.skipped_steps)}
  if trainer.side == "torch":
    torch.save({"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
                "step_index": trainer.step_index, "loss_scaler": _scaler_state(trainer),
                "torch_rng_state": rng, "parity_step": step}, folder / TORCH_FILE)
    return {"format": "torch.save", "file": TORCH_FILE, "step_index": trainer.step_index}
  raise ValueError(f"torch_impl.checkpoint saves the 'deepspeed' and 'torch' sides; got a trainer of side "
                   f"{getattr(trainer, 'side', None)!r}")


def restore(trainer: Trainer, folder: str | Path, meta: dict[str, Any]) -> None:
  """Restores a state written by `save` into a freshly built trainer of the same run.

  Args:
    trainer: a new DeepSpeedTrainer / TorchTrainer (built from the run's initial weights).
    folder: the checkpoint folder (run_dir/<side>/checkpoint/).
    meta: its meta.json (`parity.protocol.read_checkpoint_meta`); `step` is the step saved after.
  Raises:
    FileNotFoundError: the framework files are missing from the folder.
    ValueError: the files belong to another step, or the engine's counters after loading disagree
      with the checkpoint's step.
  """
  folder, step = Path(folder), int(meta["step"])
  if trainer.side == "deepspeed":
    _restore_deepspeed(trainer, folder, step, meta.get("tag", _tag(step)))
  elif trainer.side == "torch":
    _restore_torch(trainer, folder, step)
  else:
    raise ValueError(f"torch_impl.checkpoint restores the 'deepspeed' and 'torch' sides; got a trainer of side "
                     f"{getattr(trainer, 'side', None)!r}")


def _restore_torch(trainer, folder: Path, step: int) -> None:
  path = folder / TORCH_FILE
  if not path.is_file():
    raise FileNotFoundError(f"{path}: no torch training state in the checkpoint folder")
  state = torch.load(path, map_location=trainer.device, weights_only=True)
  if state.get("parity_step") != step or state.get("step_index") != step + 1:
    raise ValueError(f"{path}: holds step {state.get('parity_step')} (step_index {state.get('step_index')}); "
                     f"meta.json says step {step}")
  trainer.model.load_state_dict(state["model"], strict=True)
  trainer.optimizer.load_state_dict(state["optimizer"])
  trainer.step_index = int(state["step_index"])
  _load_scaler(trainer, state.get("loss_scaler"), path)
  if getattr(trainer, "half_model", None) is not None:
    trainer.refresh_half_model()  # fp16: the float16 compute copy follows the restored masters
  torch.set_rng_state(state["torch_rng_state"].cpu())


def _restore_deepspeed(trainer, folder: Path, step: int, tag: str) -> None:
  engine = trainer.engine
  load_dir = folder / DEEPSPEED_DIR
  if not (load_dir / tag).is_dir():
    raise FileNotFoundError(f"{load_dir / tag}: no DeepSpeed checkpoint with tag {tag!r} in the checkpoint folder")
  load_path, client = engine.load_checkpoint(str(load_dir), tag=tag, load_optimizer_states=True,
                                             load_lr_scheduler_states=True)
  if load_path is None:
    raise FileNotFoundError(f"{load_dir / tag}: DeepSpeed found no checkpoint files to load")
  if client.get("parity_step") != step or engine.global_steps != step + 1:
    raise ValueError(f"{load_dir / tag}: holds step {client.get('parity_step')} (engine.global_steps="
                     f"{engine.global_steps}); meta.json says step {step}, so global_steps should be {step + 1}")
  # Not in DeepSpeed's checkpoint: micro_steps counts micro batches (its value modulo the accumulation
  # steps picks the update boundary); the uninterrupted run has done (step + 1) * GAS of them here.
  engine.micro_steps = (step + 1) * engine.gradient_accumulation_steps()
  _load_scaler(trainer, client.get("loss_scaler"), load_dir / tag)
  torch.set_rng_state(client["torch_rng_state"].cpu())
  _replay_cpu_adam_steps(engine)


def _replay_cpu_adam_steps(engine) -> int:
  """Brings DeepSpeedCPUAdam's C++ beta powers to where the uninterrupted run has them (module docstring).

  Returns:
    The number of steps replayed (0 when the optimizer is not DeepSpeedCPUAdam).
  Raises:
    ValueError: the param groups' Adam states disagree on the step count.
  """
  opt = getattr(engine.optimizer, "optimizer", engine.optimizer)
  if type(opt).__name__ != "DeepSpeedCPUAdam" or not hasattr(opt, "ds_opt_adam"):
    return 0
  counts = {int(s["step"]) for s in opt.state.values() if "step" in s}
  if len(counts) > 1:
    raise ValueError(f"DeepSpeedCPUAdam states hold different step counts {sorted(counts)} after loading")
  steps = counts.pop() if counts else 0
  group = opt.param_groups[0]
  beta1, beta2 = group["betas"]
  dummy = [torch.zeros(1, dtype=torch.float32) for _ in range(4)]  # param, grad, exp_avg, exp_avg_sq
  for k in range(1, steps + 1):  # lr 0: the dummy moves nowhere; only the C++ step and beta powers advance
    opt.ds_opt_adam.adam_update(opt.opt_id, k, 0.0, beta1, beta2, group["eps"], 0.0, group["bias_correction"],
                                *dummy)
  return steps
