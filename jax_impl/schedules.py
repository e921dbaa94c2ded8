"""DeepSpeed 0.19.8 learning-rate schedules as optax-compatible jnp functions of the step count.

Each builder returns `schedule(count) -> lr`, a pure function of optax's `count` (applied optimizer
steps so far). DeepSpeed steps its scheduler only after an applied step, starting from iteration -1, so
the step after `count` applied steps runs with the scheduler value at iteration `count - 1`; wrapped
in `optax.apply_if_finite` (or any transform that leaves `count` alone on a skipped step) a skipped fp16
step does not advance the schedule, as in DeepSpeed. Values are computed in the dtype of jnp default
floats: enable `jax_enable_x64` for the 1e-12 comparison in `parity port --verify`.

Reference: deepspeed/runtime/lr_schedules.py; the pure-Python twin is parity.migrate.reference.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import jax.numpy as jnp

__all__ = ["lr_schedule", "momentum_schedule"]

Schedule = Callable[[Any], Any]


def _f(count):
  return jnp.asarray(count, dtype=jnp.result_type(float))


def _warmup_gamma(it, warmup: int, warmup_type: str):
  if warmup_type == "log":
    return (1.0 / math.log(warmup)) * jnp.log(jnp.maximum(it + 1.0, 1.0))
  return it / warmup


def _warmup_lr(p: Mapping[str, Any], decay: bool) -> Schedule:
  lo, hi = p["warmup_min_lr"], p["warmup_max_lr"]
  warmup = max(2, int(p["warmup_num_steps"]))
  total = p.get("total_num_steps")

  def schedule(count):
    it = _f(count) - 1.0
    gamma = _warmup_gamma(it, warmup, p["warmup_type"])
    if decay:
      after = jnp.maximum(0.0, (total - it) / float(max(1.0, total - warmup)))
    else:
      after = jnp.ones_like(it)
    gamma = jnp.where(it < warmup, gamma, after)
    return jnp.where(it < 0, lo, lo + (hi - lo) * gamma)
  return schedule


def _warmup_cosine(p: Mapping[str, Any], base_lr: float) -> Schedule:
  warmup = max(2, int(p["warmup_num_steps"]))
  wmin, cmin, total = p["warmup_min_ratio"], p["cos_min_ratio"], p["total_num_steps"]

  def schedule(count):
    it = _f(count) - 1.0
    warm = wmin + _warmup_gamma(it, warmup, p["warmup_type"]) * (1.0 - wmin)
    progress = jnp.minimum(1.0, (it - warmup + 1) / max(1, total - warmup))
    cos = jnp.maximum(0.0, cmin + (1.0 - cmin) * ((1 + jnp.cos(math.pi * progress)) / 2))
    ratio = jnp.where(it < warmup, warm, cos)
    return jnp.where(it < 0, 0.0, base_lr * ratio)
  return schedule


def _one_cycle_scale(it, p: Mapping[str, Any]):
  first = float(p["cycle_first_step_size"])
  second = float(p["cycle_second_step_size"]) if p["cycle_second_step_size"] is not None else first
  total = first + second
  ratio = first / total
  s1 = p["cycle_first_stair_count"]
  s2 = s1 if p["cycle_second_stair_count"] is None else p["cycle_second_stair_count"]
  bi = it + 1.0
  cycle = jnp.floor(1 + bi / total)
  x = 1. + bi / total - cycle
  up = x <= ratio
  scale = jnp.where(up, x / ratio, (x - 1) / (ratio - 1) if ratio != 1 else 0.0)
  if s1 > 0 or s2 > 0:  # stairs: quantise from the integer offset inside the cycle (lr_schedules.py)
    stairs = jnp.where(up, float(s1), float(s2))
    ci = jnp.mod(bi, total)
    pos = jnp.where(ci <= first, ci * stairs / first, (total - ci) * stairs / (second if second > 0 else 1.0))
    scale = jnp.where(stairs > 0, jnp.floor(pos) / jnp.maximum(stairs, 1.0), scale)
  return scale, total


def _one_cycle(p: Mapping[str, Any]) -> Schedule:
  lo, hi = p["cycle_min_lr"], p["cycle_max_lr"]
  skip = math.isclose(p["decay_step_size"], 0) or math.isclose(p["decay_lr_rate"], 0)

  def schedule(count):
    it = _f(count) - 1.0
    scale, total = _one_cycle_scale(it, p)
    cyc = lo + (hi - lo) * scale
    dec = lo if skip else lo / (1 + p["decay_lr_rate"] * ((it - total + 1) / p["decay_step_size"]))
    return jnp.where(it < 0, lo, jnp.where(it < total, cyc, dec))
  return schedule


def _range_test(p: Mapping[str, Any]) -> Schedule:
  def schedule(count):
    interval = _f(count) / p["lr_range_test_step_size"]
    if p["lr_range_test_staircase"]:
      interval = jnp.floor(interval)
    return p["lr_range_test_min_lr"] * (1 + p["lr_range_test_step_rate"] * interval)
  return schedule


def lr_schedule(kind: str, params: Mapping[str, Any], base_lr: float) -> Schedule:
  """optax schedule equal to DeepSpeed's scheduler `kind` at every step.

  Args:
    kind: 'Constant', 'WarmupLR', 'WarmupDecayLR', 'WarmupCosineLR', 'OneCycle' or 'LRRangeTest'.
    params: the ported scheduler params (DeepSpeed names, every default filled in).
    base_lr: optimizer lr (Constant and WarmupCosineLR scale it).
  Returns:
    count -> learning rate (jnp scalar).
  Raises:
    ValueError: unknown kind.
  """
  if kind == "Constant":
    return lambda count: jnp.full((), base_lr, dtype=jnp.result_type(float))
  if kind in ("WarmupLR", "WarmupDecayLR"):
    return _warmup_lr(params, decay=kind == "WarmupDecayLR")
  if kind == "WarmupCosineLR":
    return _warmup_cosine(params, base_lr)
  if kind == "OneCycle":
    return _one_cycle(params)
  if kind == "LRRangeTest":
    return _range_test(params)
  raise ValueError(f"unknown scheduler type {kind!r}")


def momentum_schedule(params: Mapping[str, Any]) -> Schedule:
  """OneCycle's beta1 as a function of count (cycle_momentum=true); beta2 is fixed at 0.99 by DeepSpeed."""
  lo, hi = params["cycle_min_mom"], params["cycle_max_mom"]
  skip = math.isclose(params["decay_step_size"], 0) or math.isclose(params["decay_mom_rate"], 0)

  def schedule(count):
    it = _f(count) - 1.0
    scale, total = _one_cycle_scale(it, params)
    cyc = hi - (hi - lo) * scale
    dec = hi if skip else hi * (1 + params["decay_mom_rate"] * ((it - total + 1) / params["decay_step_size"]))
    return jnp.where(it < 0, lo, jnp.where(it < total, cyc, dec))
  return schedule
