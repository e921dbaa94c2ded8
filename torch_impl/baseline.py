"""The plain-PyTorch side: torch.optim.AdamW with DeepSpeed's schedule, accumulation and clipping.

It reproduces what the DeepSpeed engine does, with no DeepSpeed import:
  * the same param groups (`parity.weights.decays`), AdamW hyper-parameters passed explicitly;
  * the learning rate of step k is `parity.schedule.train_lr(train, k)` (WarmupCosineLR as
    the engine applies it: step 0 runs with lr 0);
  * gradient accumulation by backpropagating loss / grad_accum_steps per micro batch;
  * clipping by DeepSpeed ZeRO-1/2's formula, not torch's `clip_grad_norm_` (see `clip_like_deepspeed`).
With precision 'bf16' the forward runs under `torch.autocast(dtype=bfloat16)`; params,
gradients and Adam moments stay float32.
"""
from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from parity import schedule
from parity.spec import RunSpec
from torch_impl import memory
from torch_impl.model import build_model, decay_groups, lm_loss, to_canonical

__all__ = ["clip_like_deepspeed", "global_grad_norm", "TorchTrainer"]

CLIP_EPS = 1e-6
"""Added to the gradient norm before dividing by the clip threshold (DeepSpeed ZeRO-1/2)."""


def global_grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
  """Global L2 norm of the gradients, accumulated in float64 as DeepSpeed ZeRO does.

  Args:
    params: tensors whose `.grad` is set (None grads are skipped).
  Returns:
    A float32 scalar tensor: sqrt(sum_i ||g_i||^2), per-tensor norms in float64.
  References:
    deepspeed/runtime/zero/stage_1_and_2.py `complete_grad_norm_calculation_for_cpu_offload`.
  """
  sq = sum(float(p.grad.double().norm(2)) ** 2 for p in params if p.grad is not None)
  return torch.tensor(sq ** 0.5, dtype=torch.float32)


def clip_like_deepspeed(params: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> float:
  """Scales gradients in place by DeepSpeed's clipping rule.

  g <- g * (1 / max(1, (||g|| + 1e-6) / max_norm)), computed in float32 tensors in
  DeepSpeed's order. torch's `clip_grad_norm_` instead multiplies by
  min(1, max_norm / (||g|| + 1e-6)); the two differ in rounding only, but this side
  reproduces DeepSpeed.

  Args:
    params: tensors whose `.grad` is scaled.
    max_norm: clip threshold (train.grad_clip); 0 disables clipping.
    total_norm: float32 scalar, the pre-clip global norm.
  Returns:
    The divisor applied (1.0 when no clipping happened).
  References:
    deepspeed/runtime/zero/stage_1_and_2.py `unscale_and_clip_grads` (loss scale 1).
  """
  if max_norm <= 0:
    return 1.0
  divisor = torch.clamp(((total_norm / 1.0) + CLIP_EPS) / max_norm, min=1.0)
  inv = 1.0 / divisor
  for p in params:
    if p.grad is not None:
      p.grad.mul_(inv.to(p.grad.device))
  return float(divisor)


class TorchTrainer:
  """Plain torch training of the same model, behind the interface the worker drives.

  Args:
    run: the resolved run spec.
    params: canonical float32 initial weights.
  """

  side = "torch"

  def __init__(self, run: RunSpec, params: dict[str, np.ndarray]):
    t = run.train
    self.run = run
    self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    self.model = build_model(run.model, params, device=self.device)
    self.optimizer = torch.optim.AdamW(decay_groups(self.model, t.weight_decay), lr=0.0,
                                       betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay,
                                       foreach=False)
    self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
    self.step_index = 0
    self._snapshots: list[memory.StateBytes] = []

  def _autocast(self):
    if self.run.train.precision == "bf16":
      return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()

  def step(self, micro_batches: np.ndarray, *, probe: bool = False) -> dict[str, float]:
    """One optimizer step over (grad_accum_steps, micro_batch_size, seq_len + 1) uint16 tokens.

    Returns loss (mean over micro batches, nats), grad_norm (pre-clip) and lr (applied).
    Raises ValueError when the number of micro batches differs from train.grad_accum_steps.
    """
    t = self.run.train
    if len(micro_batches) != t.grad_accum_steps:
      raise ValueError(f"got {len(micro_batches)} micro batches; train.grad_accum_steps={t.grad_accum_steps}")
    lr = schedule.train_lr(t, self.step_index)
    for g in self.optimizer.param_groups:
      g["lr"] = lr
    self.optimizer.zero_grad(set_to_none=True)
    losses = []
    for mb in micro_batches:
      tokens = torch.from_numpy(np.asarray(mb, dtype=np.int64)).to(self.device)
      with self._autocast():
        logits = self.model(tokens[:, :-1])
      loss = lm_loss(logits, tokens[:, 1:])
      (loss / t.grad_accum_steps).backward()
      losses.append(float(loss.detach()))
    norm = global_grad_norm(self.params)
    clip_like_deepspeed(self.params, t.grad_clip, norm)
    if probe:
      self._snapshots.append(self._measure())
    self.optimizer.step()
    if probe:
      self._snapshots.append(self._measure())
    self.step_index += 1
    return {"loss": sum(losses) / len(losses), "grad_norm": float(norm), "lr": lr}

  @torch.no_grad()
  def eval_loss(self, val_batches: np.ndarray) -> float:
    """Mean token cross-entropy over held-out micro batches, nats."""
    losses = []
    for mb in val_batches:
      tokens = torch.from_numpy(np.asarray(mb, dtype=np.int64)).to(self.device)
      with self._autocast():
        logits = self.model(tokens[:, :-1])
      losses.append(float(lm_loss(logits, tokens[:, 1:])))
    return sum(losses) / len(losses)

  def poison(self) -> None:
    """Fills the token embedding with NaN; the next loss is NaN."""
    with torch.no_grad():
      self.model.wte.weight.fill_(float("nan"))

  def final_params(self) -> dict[str, np.ndarray]:
    return to_canonical(self.model)

  def _measure(self) -> memory.StateBytes:
    return memory.state_bytes(self.model, self.optimizer)

  def state_bytes(self) -> memory.StateBytes:
    return memory.merge_max(*(self._snapshots or [self._measure()]))

  def describe(self) -> dict[str, Any]:
    from importlib import metadata
    try:
      ds_version = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
      ds_version = None
    return {"optimizer": {"optimizer": type(self.optimizer).__name__, "foreach": False,
                          "group_weight_decay": [g["weight_decay"] for g in self.optimizer.param_groups],
                          "clipping": "deepspeed: g / max(1, (||g|| + 1e-6) / clip)"},
            "versions": {"torch": torch.__version__, "deepspeed": ds_version}}
