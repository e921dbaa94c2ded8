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

__all__ = ["lr_at", "momentum_at", "clip_factor", "numpy_update", "LossScaleState", "loss_scale_update",
           "SCHEDULER_DEFAULTS"]

SCHEDULER_DEFAULTS: dict[str, dict[str, Any]] = {
    # DeepSpeed constructor defaults, 0.19.8 (None = required or taken from the optimizer lr).
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupDecayLR": {"total_num_steps": None, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                      "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupCosineLR": {"total_num_steps": None, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": "log"},
    "OneCycle": {"cycle_min_lr": None, "cycle_max_lr": None, "decay_lr_rate": 0.0, "cycle_first_step_size": 2000,
                 "cycle_second_step_size": None, "cycle_first_stair_count": 0, "cycle_second_stair_count": None,
                 "decay_step_size": 0, "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
                 "decay_mom_rate": 0.0},
    "LRRangeTest": {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2000, "lr_range_test_step_rate": 1.0,
                    "lr_range_test_staircase": False},
    "Constant": {},
}


def _warmup_gamma(it: int, warmup: int, warmup_type: str) -> float | None:
  """Warmup fraction at iteration `it` (>= 0), or None once warmup is over. `warmup` is already clamped to >= 2."""
  if it < warmup:
    if warmup_type == "log":
      return (1.0 / math.log(warmup)) * math.log(it + 1)
    return it / warmup
  return None


def _one_cycle_scale(it: int, p: Mapping[str, Any]) -> float:
  first = float(p["cycle_first_step_size"])
  second = float(p["cycle_second_step_size"]) if p["cycle_second_step_size"] is not None else first
  total = first + second
  step_ratio = first / total
  first_stairs = p["cycle_first_stair_count"]
  second_stairs = first_stairs if p["cycle_second_stair_count"] is None else p["cycle_second_stair_count"]
  batch_iteration = it + 1
  cycle = math.floor(1 + batch_iteration / total)
  x = 1. + batch_iteration / total - cycle
  if x <= step_ratio:
    scale, stairs = x / step_ratio, first_stairs
  else:
    scale, stairs = (x - 1) / (step_ratio - 1), second_stairs
  if stairs > 0:
    cycle_iteration = batch_iteration % total
    if cycle_iteration <= first:
      position = cycle_iteration * stairs / first
    else:
      position = (total - cycle_iteration) * stairs / second
    scale = math.floor(position) / stairs
  return scale


def _one_cycle_total(p: Mapping[str, Any]) -> float:
  first = float(p["cycle_first_step_size"])
  return first + (float(p["cycle_second_step_size"]) if p["cycle_second_step_size"] is not None else first)


def lr_at(kind: str, p: Mapping[str, Any], base_lr: float, count: int) -> float:
  """Learning rate DeepSpeed applies at the optimizer step that follows `count` applied steps.

  Args:
    kind: scheduler type as in DeepSpeed ('WarmupLR', ...) or 'Constant' (no scheduler).
    p: scheduler params with every DeepSpeed default filled in (see SCHEDULER_DEFAULTS).
    base_lr: optimizer.params.lr (used by Constant and WarmupCosineLR).
    count: applied optimizer steps so far, >= 0.
  Returns:
    The learning rate, a Python float.
  """
  it = count - 1
  if kind == "Constant":
    return base_lr
  if kind in ("WarmupLR", "WarmupDecayLR"):
    lo, hi = p["warmup_min_lr"], p["warmup_max_lr"]
    if it < 0:
      return lo
    warmup = max(2, p["warmup_num_steps"])
    gamma = _warmup_gamma(it, warmup, p["warmup_type"])
    if gamma is None:
      if kind == "WarmupLR":
        gamma = 1.0
      else:
        total = p["total_num_steps"]
        gamma = max(0.0, float(total - it) / float(max(1.0, total - warmup)))
    return lo + (hi - lo) * gamma
  if kind == "WarmupCosineLR":
    if it < 0:
      return 0.0
    warmup = max(2, p["warmup_num_steps"])
    gamma = _warmup_gamma(it, warmup, p["warmup_type"])
    if gamma is not None:
      ratio = p["warmup_min_ratio"] + gamma * (1. - p["warmup_min_ratio"])
    else:
      progress = min(1.0, (it - warmup + 1) / max(1, p["total_num_steps"] - warmup))
      ratio = max(0.0, p["cos_min_ratio"] + (1. - p["cos_min_ratio"]) * ((1 + math.cos(math.pi * progress)) / 2))
    return base_lr * ratio
  if kind == "OneCycle":
    lo, hi = p["cycle_min_lr"], p["cycle_max_lr"]
    if it < 0:
      return lo
    total = _one_cycle_total(p)
    if it < total:
      return lo + (hi - lo) * _one_cycle_scale(it, p)
    if math.isclose(p["decay_step_size"], 0) or math.isclose(p["decay_lr_rate"], 0):
      return lo
    interval = (it - total + 1) / p["decay_step_size"]
    return lo / (1 + p["decay_lr_rate"] * interval)
  if kind == "LRRangeTest":
    interval = float(it + 1) / p["lr_range_test_step_size"]
    if p["lr_range_test_staircase"]:
      interval = math.floor(interval)
    return p["lr_range_test_min_lr"] * (1 + p["lr_range_test_step_rate"] * interval)
  raise ValueError(f"unknown scheduler type {kind!r}; expected one of {', '.join(SCHEDULER_DEFAULTS)}")


def momentum_at(p: Mapping[str, Any], count: int) -> float:
  """Adam beta1 that OneCycle (cycle_momentum=true) sets for the step after `count` applied steps.

  OneCycle also forces beta2 = 0.99 on every param group (lr_schedules.py `_initialize_momentum`).
  At construction it writes cycle_min_mom; from the first scheduler step on it cycles from cycle_max_mom.
  """
  it = count - 1
  lo, hi = p["cycle_min_mom"], p["cycle_max_mom"]
  if it < 0:
    return lo
  if it < _one_cycle_total(p):
    return hi - (hi - lo) * _one_cycle_scale(it, p)
  if math.isclose(p["decay_step_size"], 0) or math.isclose(p["decay_mom_rate"], 0):
    return hi
  interval = (it - _one_cycle_total(p) + 1) / p["decay_step_size"]
  return hi * (1 + p["decay_mom_rate"] * interval)


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
  """DynamicLossScaler.update_scale, as a pure function (raising at the minimum scale is left to the caller)."""
  scale, hyst, last = s.scale, s.hysteresis, s.last_overflow_iter
  if overflow:
    if delayed_shift == 1 or hyst == 1:
      scale = max(scale / 2.0, min_scale)
    else:
      hyst -= 1
    last = s.cur_iter
  else:
    if consecutive_hysteresis:
      hyst = delayed_shift
    stable = (s.cur_iter - last) - 1
    if stable > 0 and stable % window == 0:
      if not consecutive_hysteresis:
        hyst = delayed_shift
      scale *= 2.0
  return LossScaleState(scale, hyst, s.cur_iter + 1, last)
