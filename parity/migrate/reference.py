"""Pure-Python reference of DeepSpeed 0.19.8 learning-rate schedules, optimizers and loss scaling.

No jax, no torch: these functions are what the JAX side (`jax_impl/schedules.py`) and
DeepSpeed itself are both checked against in tests.

Step convention (deepspeed/runtime/engine.py `_take_model_step`): every DeepSpeed
scheduler is built with `last_batch_iteration = -1` and `scheduler.step()` runs only
after an *applied* optimizer step (a step skipped on fp16 overflow does not advance
it). So the optimizer step that follows `count` applied steps runs with the value the
scheduler computes at iteration `count - 1`. All functions below take `count`, the
number of applied optimizer steps so far (optax's `count`), and return the value used
by the next step.

References:
  deepspeed/runtime/lr_schedules.py (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle,
  LRRangeTest), deepspeed/runtime/fp16/loss_scaler.py (DynamicLossScaler),
  deepspeed/ops/csrc/lamb/fused_lamb_cuda_kernel.cu, deepspeed/runtime/zero/stage_1_and_2.py
  (`unscale_and_clip_grads`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

from parity.numerics.schedule import SCHEDULER_DEFAULTS, lr_at, momentum_at  # the one implementation
from parity.numerics.loss_scale import LossScaler

__all__ = ["lr_at", "momentum_at", "clip_factor", "numpy_update", "LossScaleState", "loss_scale_update",
           "SCHEDULER_DEFAULTS"]

def clip_factor(global_norm: float, max_norm: float) -> float:
  """DeepSpeed's gradient-clipping multiplier: 1 / max(1, (norm + 1e-6) / max_norm); 1 when max_norm == 0."""
  if max_norm <= 0:
    return 1.0
  return 1.0 / max(1.0, (global_norm + 1e-6) / max_norm)


def numpy_update(opt: Mapping[str, Any], params: list[np.ndarray], grads: list[np.ndarray], state: dict,
                 *, lr: float, beta1: float | None = None, max_norm: float = 0.0) -> list[np.ndarray]:
  """One optimizer step in float64 numpy, DeepSpeed semantics. Mutates and returns `state`-tracked params.

  Args:
    opt: ported optimizer {'type': 'adamw'|'adam'|'lamb'|'sgd', 'params': {...}}.
    params, grads: lists of same-shape float arrays.
    state: dict, empty before the first step.
    lr: learning rate of this step; beta1: overrides params.betas[0] (OneCycle momentum).
    max_norm: gradient_clipping (0 = off).
  Returns:
    The new params.
  """
  kind, p = opt["type"], opt["params"]
  norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads))
  c = clip_factor(norm, max_norm)
  grads = [g.astype(np.float64) * c for g in grads]
  params = [x.astype(np.float64) for x in params]
  t = state["t"] = state.get("t", 0) + 1
  if kind == "sgd":
    out = []
    for i, (x, g) in enumerate(zip(params, grads)):
      if p["weight_decay"]:
        g = g + p["weight_decay"] * x
      if p["momentum"]:
        buf = state.get(("buf", i))
        buf = g if buf is None else p["momentum"] * buf + (1 - p["dampening"]) * g
        state[("buf", i)] = buf
        g = g + p["momentum"] * buf if p["nesterov"] else buf
      out.append(x - lr * g)
    return out
  b1 = p["betas"][0] if beta1 is None else beta1
  b2 = p["betas"][1]
  eps, wd = p["eps"], p["weight_decay"]
  out = []
  for i, (x, g) in enumerate(zip(params, grads)):
    if kind == "adam" and wd:
      g = g + wd * x
    m = state[("m", i)] = b1 * state.get(("m", i), 0.0) + (1 - b1) * g
    v = state[("v", i)] = b2 * state.get(("v", i), 0.0) + (1 - b2) * g * g
    if kind in ("adam", "adamw"):
      if p["bias_correction"]:
        upd = (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
      else:
        upd = m / (np.sqrt(v) + eps)
      if kind == "adamw" and wd:
        x = x * (1 - lr * wd)
      out.append(x - lr * upd)
    else:  # lamb: fused_lamb_cuda_kernel.cu
      step_size = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) if p["bias_correction"] else lr
      denom = np.sqrt(v + eps) if p["eps_inside_sqrt"] else np.sqrt(v) + eps
      upd = m / denom + wd * x
      w_norm, u_norm = float(np.sqrt(np.sum(x * x))), float(np.sqrt(np.sum(upd * upd)))
      coeff = 1.0
      if w_norm != 0 and u_norm != 0:
        coeff = min(max(w_norm / u_norm, p["min_coeff"]), p["max_coeff"])
      out.append(x - step_size * coeff * upd)
  return out


@dataclasses.dataclass
class LossScaleState:
  """DeepSpeed DynamicLossScaler state (loss_scaler.py)."""
  scale: float
  hysteresis: int
  cur_iter: int = 0
  last_overflow_iter: int = -1


def loss_scale_update(s: LossScaleState, overflow: bool, *, window: int, min_scale: float, delayed_shift: int,
                      consecutive_hysteresis: bool) -> LossScaleState:
  """DynamicLossScaler.update_scale, as a pure function (raising at the minimum scale is left to the caller).

  One implementation: this steps `parity.numerics.loss_scale.LossScaler` (checked against DeepSpeed's class in
  tests/test_loss_scale.py) from `s`.
  """
  scaler = LossScaler(scale=s.scale, window=window, hysteresis=delayed_shift, min_scale=min_scale,
                      consecutive_hysteresis=consecutive_hysteresis, raise_at_min=False, cur_hysteresis=s.hysteresis,
                      cur_iter=s.cur_iter, last_overflow_iter=s.last_overflow_iter)
  scaler.update(overflow)
  return LossScaleState(scaler.scale, scaler.cur_hysteresis, scaler.cur_iter, scaler.last_overflow_iter)
