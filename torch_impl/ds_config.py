"""The DeepSpeed config a RunSpec stands for (`ds_config`), its fp16 block, and its per-rank form (`per_rank_config`).

Split out of torch_impl.engine (which re-exports every name here). Imports torch (is CUDA there, for Lamb) only.
"""
from __future__ import annotations

from typing import Any

import torch

from parity.numerics.ds_json import deepspeed_json
from parity.spec import RunSpec

__all__ = ["MSG_LAMB_CPU", "MSG_FP16_STAGE0", "ds_config", "has_optimizer_section", "per_rank_config"]

MSG_LAMB_CPU = ("train.optimizer='lamb' on the DeepSpeed side: DeepSpeed's Lamb is FusedLamb, a CUDA-only op, and this "
                "machine has no CUDA device; run --sides jax,torch (both run DeepSpeed's Lamb formula) or use a GPU.")


def ds_config(run: RunSpec) -> dict[str, Any]:
  """The DeepSpeed config dict equivalent to a RunSpec.

  Args:
    run: the resolved run (model, train, deepspeed plan).
  Returns:
    A JSON-ready dict for `deepspeed.initialize(config=...)`. The optimizer block is
    `parity.numerics.schedule.deepspeed_optimizer(run.train)`; the scheduler block is
    `parity.numerics.schedule.deepspeed_scheduler(run.train)` (by default WarmupCosineLR with
    linear warmup over train.steps). The global batch is left for DeepSpeed to derive
    (micro x accumulation x world size).
  Raises:
    ValueError: train.optimizer 'lamb' without CUDA (MSG_LAMB_CPU).
  """
  if run.train.optimizer == "lamb" and not torch.cuda.is_available():
    raise ValueError(MSG_LAMB_CPU)
  return deepspeed_json(run)  # the one builder, shared with the reverse port (parity.numerics.ds_json)


MSG_FP16_STAGE0 = ("train.precision='fp16' with deepspeed.zero_stage=0: DeepSpeed 0.19.8 then wraps the optimizer in "
                   "FP16_Optimizer and does not run a loss-scaled fp16 step: engine.backward scales the loss only for "
                   "the ZeRO optimizers, yet FP16_Optimizer.step divides the gradient by the loss scale (and never "
                   "reads fp16.hysteresis), unlike the DynamicLossScaler of ZeRO stages 1-3 that the other sides "
                   "reproduce (parity.migrate._port.MSG_FP16_STAGE0 has the details). Use deepspeed.zero_stage >= 1 "
                   "(e.g. 1: on one rank it partitions nothing) for an fp16 comparison.")


def has_optimizer_section(config: dict[str, Any]) -> bool:
  """True when DeepSpeed builds the optimizer from the config (an `optimizer` object with a `type`)."""
  return isinstance(config.get("optimizer"), dict) and "type" in config["optimizer"]


def per_rank_config(config: dict[str, Any], world: int) -> dict[str, Any]:
  """The config one of `world` data-parallel ranks runs, with the global batch of the 1-rank run kept.

  train.micro_batch_size is the global micro batch (docs/multirank.md): each rank takes micro_batch_size / world
  rows of it, so `train_micro_batch_size_per_gpu` is divided by `world`, `gradient_accumulation_steps` is kept and
  `train_batch_size` (when the config has one) stays micro x accumulation of the 1-rank run.

  Args:
    config: a DeepSpeed config (numbers resolved, no "auto"); world: ranks (>= 1).
  Returns:
    A new dict (the same dict's values when world is 1).
  Raises:
    ValueError: the micro batch does not split over `world` ranks (the message names both and the fix).
  """
  if world <= 1:
    return config
  micro = int(config.get("train_micro_batch_size_per_gpu", 1))
  if micro % world:
    raise ValueError(f"train_micro_batch_size_per_gpu={micro} (the global micro batch) does not split over {world} "
                     f"ranks; use a multiple of {world} or another --nproc")
  out = {**config, "train_micro_batch_size_per_gpu": micro // world}
  if "train_batch_size" in out:
    out["train_batch_size"] = micro * int(config.get("gradient_accumulation_steps", 1))
  return out
