"""DeepSpeed's learning-rate schedulers as plain functions of the optimizer step: the one implementation.

Every side derives its learning rate from here: the torch baseline sets it per step, the JAX
side looks it up from a table of these values (bit-exact with DeepSpeed), the DeepSpeed side
gets the same scheduler block in its config (`deepspeed_scheduler`), and `parity port --verify`
checks these functions and the JAX formulas against DeepSpeed's own classes.

Step convention (deepspeed/runtime/engine.py `_take_model_step`, DeepSpeed 0.19.8): every
scheduler is built with last_batch_iteration = -1 and `scheduler.step()` runs only *after* an
applied optimizer step (a step skipped on fp16 overflow does not advance it). So the optimizer
step that follows `count` applied steps runs with the value at iteration `count - 1`:
WarmupCosineLR gives lr 0 at step 0, and with linear warmup from ratio 0 also at step 1.
warmup_num_steps is clamped to at least 2 (all warmup schedulers).

References: deepspeed/runtime/lr_schedules.py (WarmupLR, WarmupDecayLR, WarmupCosineLR,
OneCycle, LRRangeTest).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from parity.errors import SpecError

__all__ = ["lr_at_step", "train_lr", "lr_at", "momentum_at", "SCHEDULER_DEFAULTS",
           "scheduler_params", "deepspeed_scheduler", "COMPARE_SCHEDULERS", "OPTIMIZERS", "optimizer_of",
           "deepspeed_optimizer", "cycles_momentum", "train_betas", "adam_beta2"]


def lr_at_step(step: int, *, lr: float, total_steps: int, warmup_steps: int, warmup_min_ratio: float,
               cos_min_ratio: float) -> float:
  """Learning rate DeepSpeed's WarmupCosineLR (linear warmup) applies at optimizer step `step` (0-based).

  Raises:
    SpecError: warmup_steps < 1 (DeepSpeed raises the same).
  """
  if warmup_steps < 1:
    raise SpecError(f"WarmupCosineLR warmup_num_steps must be a positive integer, got {warmup_steps}")
  return lr_at("WarmupCosineLR", {"total_num_steps": total_steps, "warmup_min_ratio": warmup_min_ratio,
                                  "warmup_num_steps": warmup_steps, "cos_min_ratio": cos_min_ratio,
                                  "warmup_type": "linear"}, lr, step)


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


_NONE_MEANS_DEFAULT = frozenset({"cycle_second_step_size", "cycle_second_stair_count"})
"""OneCycle params whose None is DeepSpeed's own default (the first phase's value), not a missing value."""


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
  raise SpecError(f"unknown scheduler type {kind!r}; expected one of {', '.join(SCHEDULER_DEFAULTS)}")


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



COMPARE_SCHEDULERS = ("WarmupCosineLR", "WarmupLR", "WarmupDecayLR", "OneCycle", "LRRangeTest", "Constant")
"""Schedulers `parity compare` runs on every side: all of DeepSpeed's that `parity port` accepts, and none.
OneCycle with cycle_momentum also cycles Adam/Lamb's beta1 (`momentum_at`) and fixes beta2 at 0.99."""


def scheduler_params(train) -> tuple[str, dict[str, Any]]:
  """(DeepSpeed scheduler type, params with every default filled) of a TrainSpec.

  With `train.lr_schedule_params` unset, WarmupCosineLR is built from the TrainSpec fields
  (linear warmup); otherwise the given params (DeepSpeed names) over DeepSpeed's defaults.
  Raises:
    SpecError: unknown scheduler type, or a required param (e.g. WarmupLR warmup_max_lr) missing.
  """
  kind = train.lr_schedule
  if kind not in SCHEDULER_DEFAULTS:
    raise SpecError(f"train.lr_schedule {kind!r} is not a DeepSpeed scheduler; expected one of "
                     f"{', '.join(SCHEDULER_DEFAULTS)}")
  if train.lr_schedule_params is None and kind == "WarmupCosineLR":
    given = {"total_num_steps": train.steps, "warmup_min_ratio": train.warmup_min_ratio,
             "warmup_num_steps": train.warmup_steps, "cos_min_ratio": train.cos_min_ratio, "warmup_type": "linear"}
  else:
    given = dict(train.lr_schedule_params or {})
  unknown = sorted(set(given) - set(SCHEDULER_DEFAULTS[kind]))
  if unknown:
    raise SpecError(f"train.lr_schedule_params: {unknown} are not {kind} params; expected "
                    f"{sorted(SCHEDULER_DEFAULTS[kind])}")
  params = {**SCHEDULER_DEFAULTS[kind], **given}
  if kind == "WarmupLR" and params["warmup_max_lr"] is None:
    params["warmup_max_lr"] = train.lr  # DeepSpeed takes it from the optimizer lr
  missing = [k for k, v in params.items() if v is None and k not in _NONE_MEANS_DEFAULT]
  if missing:
    raise SpecError(f"train.lr_schedule_params: {kind} needs {missing}")
  return kind, params


def deepspeed_scheduler(train) -> dict[str, Any] | None:
  """The `scheduler` block of a DeepSpeed config for a TrainSpec (None for Constant: no scheduler)."""
  kind, params = scheduler_params(train)
  return None if kind == "Constant" else {"type": kind, "params": params}


def train_lr(train, step: int) -> float:
  """Learning rate DeepSpeed's engine applies at optimizer step `step` (0-based, no skipped steps) of a TrainSpec."""
  kind, params = scheduler_params(train)
  return lr_at(kind, params, train.lr, step)


OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam", "lamb": "Lamb", "sgd": "SGD"}
"""train.optimizer -> DeepSpeed optimizer type. 'adam' is Adam with L2 regularisation (DeepSpeed Adam with
adam_w_mode false: g += wd * p before the moments); 'adamw' decoupled decay; 'lamb' DeepSpeed FusedLamb;
'sgd' torch.optim.SGD (DeepSpeed builds it by name)."""


def optimizer_of(train) -> dict[str, Any]:
  """The optimizer a TrainSpec describes, as a ported optimizer: {'type': lowercase kind, 'params': {...}}.

  Params under DeepSpeed's names, as `parity.migrate` ports them and `parity.migrate.reference.numpy_update`,
  `jax_impl.optim.optimizer_update` and the torch sides read them: adam/adamw/lamb take lr, betas, eps,
  weight_decay, bias_correction (always true: compare runs bias-corrected moments); lamb adds max_coeff,
  min_coeff, eps_inside_sqrt; sgd takes lr, momentum, dampening, weight_decay, nesterov.
  Raises:
    SpecError: train.optimizer is not one of OPTIMIZERS.
  """
  kind = train.optimizer
  if kind not in OPTIMIZERS:
    raise SpecError(f"train.optimizer {kind!r}: expected one of {', '.join(OPTIMIZERS)}")
  if kind == "sgd":
    return {"type": kind, "params": {"lr": train.lr, "momentum": train.momentum, "dampening": train.dampening,
                                     "weight_decay": train.weight_decay, "nesterov": train.nesterov}}
  p = {"lr": train.lr, "betas": [train.beta1, train.beta2], "eps": train.eps, "weight_decay": train.weight_decay,
       "bias_correction": True}
  if kind == "lamb":
    p.update(max_coeff=train.lamb_max_coeff, min_coeff=train.lamb_min_coeff, eps_inside_sqrt=train.eps_inside_sqrt)
  return {"type": kind, "params": p}


def deepspeed_optimizer(train) -> dict[str, Any]:
  """The `optimizer` block of a DeepSpeed config for a TrainSpec (the one DeepSpeed-JSON optimizer builder).

  AdamW keeps exactly the block the default run always had (lr, betas, eps, weight_decay); Adam adds
  adam_w_mode false (L2); Lamb and SGD carry their own params.
  """
  o = optimizer_of(train)
  params = {k: v for k, v in o["params"].items() if k != "bias_correction"}
  if o["type"] == "adam":
    params["adam_w_mode"] = False
  return {"type": OPTIMIZERS[o["type"]], "params": params}


def cycles_momentum(train) -> bool:
  """True when OneCycle cycles beta1 on this run: cycle_momentum set and the optimizer has betas
  (DeepSpeed `_initialize_momentum` disables the cycling, with a warning, for an optimizer without them: SGD)."""
  if train.lr_schedule != "OneCycle" or train.optimizer == "sgd":
    return False
  return bool(scheduler_params(train)[1]["cycle_momentum"])


def train_betas(train, step: int) -> tuple[float, float]:
  """(beta1, beta2) DeepSpeed applies at optimizer step `step` (0-based, no skipped steps).

  With OneCycle momentum cycling: (momentum_at(params, step), 0.99); otherwise (train.beta1, train.beta2).
  """
  if cycles_momentum(train):
    return momentum_at(scheduler_params(train)[1], step), 0.99
  return train.beta1, train.beta2


def adam_beta2(train) -> float:
  """The beta2 Adam's second moment decays with on this run (0.99 under OneCycle momentum cycling)."""
  return train_betas(train, 0)[1]
