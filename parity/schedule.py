"""DeepSpeed's WarmupCosineLR, as a plain function of the optimizer step.

Every side derives its learning rate from `lr_at_step`, so the torch baseline
(LambdaLR) and the JAX side (an optax schedule in jnp, checked against this
function in tests) follow DeepSpeed's engine exactly, including its step-0
behaviour.

DeepSpeed semantics (deepspeed/runtime/lr_schedules.py, WarmupCosineLR, 0.19.8):
  * the scheduler is built with last_batch_iteration = -1, for which the ratio is
    0.0, and the engine calls `scheduler.step()` only *after* each optimizer
    step. So optimizer step k (0-based) runs with ratio(k - 1): step 0 always
    uses lr = 0, step 1 uses the first warmup value;
  * warmup_num_steps is clamped to at least 2;
  * warmup (linear): ratio(i) = min_ratio + (1 - min_ratio) * i / warmup, i < warmup;
  * cosine: p = min(1, (i - warmup + 1) / max(1, total - warmup));
    ratio(i) = max(0, cos_min + (1 - cos_min) * (1 + cos(pi * p)) / 2).
"""
from __future__ import annotations

import math

__all__ = ["warmup_cosine_ratio", "lr_at_step"]


def warmup_cosine_ratio(iteration: int, *, total_steps: int, warmup_steps: int, warmup_min_ratio: float,
                        cos_min_ratio: float, warmup_type: str = "linear") -> float:
  """LR multiplier of DeepSpeed WarmupCosineLR at scheduler iteration `iteration` (-1 before the first step).

  Raises:
    ValueError: warmup_steps < 1 (DeepSpeed raises the same) or an unknown warmup_type.
  """
  if warmup_steps < 1:
    raise ValueError(f"WarmupCosineLR warmup_num_steps must be a positive integer, got {warmup_steps}")
  if iteration < 0:
    return 0.0
  warmup = max(2, warmup_steps)
  if iteration < warmup:
    if warmup_type == "linear":
      r = iteration / warmup
    elif warmup_type == "log":
      r = math.log(iteration + 1) / math.log(warmup)
    else:
      raise ValueError(f"warmup_type must be 'linear' or 'log'; got {warmup_type!r}")
    return warmup_min_ratio + r * (1.0 - warmup_min_ratio)
  progress = min(1.0, (iteration - warmup + 1) / max(1, total_steps - warmup))
  return max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)


def lr_at_step(step: int, *, lr: float, total_steps: int, warmup_steps: int, warmup_min_ratio: float,
               cos_min_ratio: float) -> float:
  """Learning rate (same unit as `lr`) that DeepSpeed's engine applies at optimizer step `step` (0-based)."""
  return lr * warmup_cosine_ratio(step - 1, total_steps=total_steps, warmup_steps=warmup_steps,
                                  warmup_min_ratio=warmup_min_ratio, cos_min_ratio=cos_min_ratio)


def train_lr(train, step: int) -> float:
  """`lr_at_step` with the fields of a TrainSpec."""
  return lr_at_step(step, lr=train.lr, total_steps=train.steps, warmup_steps=train.warmup_steps,
                    warmup_min_ratio=train.warmup_min_ratio, cos_min_ratio=train.cos_min_ratio)
