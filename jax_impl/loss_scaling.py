"""fp16 loss scaling of the optimizer chain: DeepSpeed's dynamic loss scaler, traced (`loss_scaled`).

Split out of jax_impl.optim (which re-exports every name here); see `loss_scaled` for DeepSpeed's order.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from parity.spec import TrainSpec

__all__ = ["LossScaleState", "LossScaledState", "LossScaleConfig", "loss_scaled", "next_loss_scale",
           "loss_scale_of", "loss_scale_state_of", "overflow_at_minimum", "all_finite"]


class LossScaleConfig(NamedTuple):
  """Static settings of DeepSpeed's loss scaler (`parity.numerics.loss_scale.LossScaler` field for field)."""
  initial_scale: float  # 2**initial_scale_power (dynamic) or the static scale
  dynamic: bool  # train.loss_scale == 0
  window: int  # train.loss_scale_window, >= 1
  hysteresis: int  # train.hysteresis, >= 1
  consecutive_hysteresis: bool
  min_scale: float  # train.min_loss_scale, > 0

  @classmethod
  def from_train(cls, train: TrainSpec) -> "LossScaleConfig":
    dynamic = train.loss_scale == 0
    return cls(initial_scale=float(2 ** train.initial_scale_power) if dynamic else float(train.loss_scale),
               dynamic=dynamic, window=train.loss_scale_window, hysteresis=train.hysteresis,
               consecutive_hysteresis=train.consecutive_hysteresis, min_scale=float(train.min_loss_scale))


class LossScaleState(NamedTuple):
  """DeepSpeed `DynamicLossScaler`'s mutable fields."""
  scale: jax.Array  # shape=(), dtype=float32: loss scale of the next step
  cur_hysteresis: jax.Array  # shape=(), dtype=int32: overflows left before the next halving
  cur_iter: jax.Array  # shape=(), dtype=int32: steps seen (skipped ones included)
  last_overflow_iter: jax.Array  # shape=(), dtype=int32: cur_iter of the last overflow, -1 before any


class LossScaledState(NamedTuple):
  """State of `loss_scaled`: the loss scale and the wrapped optimizer's state."""
  loss_scale: LossScaleState
  inner: Any


def next_loss_scale(state: LossScaleState, overflow: jax.Array, cfg: LossScaleConfig) -> LossScaleState:
  """One step of DeepSpeed's loss-scale rule, traced (`parity.numerics.loss_scale.LossScaler.update`).

  At the minimum the scale stays at cfg.min_scale here (a jitted step cannot raise); the caller
  detects that case with `overflow_at_minimum` and raises on the host as DeepSpeed does.

  Args:
    state: the scaler state before the step.
    overflow: bool scalar, the step's scaled gradient was not finite.
    cfg: the settings.
  Returns:
    The state after the step.
  References:
    deepspeed/runtime/fp16/loss_scaler.py `DynamicLossScaler.update_scale` (deepspeed 0.19.8).
  """
  it = state.cur_iter
  last = jnp.where(overflow, it, state.last_overflow_iter)
  if not cfg.dynamic:
    return state._replace(cur_iter=it + 1, last_overflow_iter=last)
  halve = overflow & ((cfg.hysteresis == 1) | (state.cur_hysteresis == 1))
  stable = it - state.last_overflow_iter - 1
  grow = ~overflow & (stable > 0) & (stable % cfg.window == 0)
  scale = jnp.where(halve, jnp.maximum(state.scale / 2, jnp.float32(cfg.min_scale)),
                    jnp.where(grow, state.scale * 2, state.scale))
  refill = ~overflow & (grow | cfg.consecutive_hysteresis)
  hyst = jnp.where(overflow & ~halve, state.cur_hysteresis - 1,
                   jnp.where(refill, jnp.int32(cfg.hysteresis), state.cur_hysteresis))
  return LossScaleState(scale=scale.astype(jnp.float32), cur_hysteresis=hyst.astype(jnp.int32),
                        cur_iter=it + 1, last_overflow_iter=last)


def overflow_at_minimum(state: LossScaleState, overflow: jax.Array, cfg: LossScaleConfig) -> jax.Array:
  """bool scalar: this overflow would halve a scale already at cfg.min_scale (DeepSpeed raises here)."""
  if not cfg.dynamic:
    return jnp.zeros((), bool)
  halve = overflow & ((cfg.hysteresis == 1) | (state.cur_hysteresis == 1))
  return halve & (state.scale == jnp.float32(cfg.min_scale))


def all_finite(tree: Any) -> jax.Array:
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.ones((), bool)


def loss_scaled(inner: optax.GradientTransformation, cfg: LossScaleConfig,
                overflow: jax.Array | None = None) -> optax.GradientTransformation:
  """Wraps an optimizer for fp16 training with DeepSpeed's (dynamic) loss scaling.

  The update takes the gradient of (loss * scale), scale = `loss_scale_of(state)` (the step
  multiplies the loss). It divides the gradient by the scale and runs `inner` on it, unless
  any element of the scaled gradient is non-finite: then the update is zero and `inner`'s state
  is kept as it was (moments, Adam count, so the LR schedule does not advance; DeepSpeed skips
  `optimizer.step()` and `lr_scheduler.step()` on overflow). Either way the scale moves by
  `next_loss_scale`.

  DeepSpeed's order, kept here on purpose: `DeepSpeedZeroOptimizer.step` updates the scale
  (`_update_scale`) *before* `unscale_and_clip_grads`, which divides by the updated
  `self.loss_scale`. On a step where the scale grows (every `window` clean steps) the gradient
  reaching Adam and the clip is therefore divided by 2 x the scale the loss was multiplied by:
  half the true gradient. ZeRO-1/2 report the norm with the scale before the update (the true
  norm; stage 0 `FP16_Optimizer` and stage 3 divide that by the updated scale too). Stage 0 and
  stage 3 (`_loss_scale_update_and_overflow_cleanup` before `unscale_and_clip_grads`) unscale
  the same way. `clip_state.grad_norm` here is the norm of that
  divided gradient; the step reports it times new_scale / old_scale (exact: powers of two).

  Args:
    inner: the optimizer (clip + AdamW chain), fed the unscaled float32 gradient.
    cfg: loss-scale settings.
    overflow: bool scalar: use this instead of checking the update's input (the layer-streamed
      update checks the whole gradient once, `global_stats`).
  Returns:
    A GradientTransformation with a LossScaledState.
  References:
    deepspeed/runtime/zero/stage_1_and_2.py `DeepSpeedZeroOptimizer.step` (overflow check,
    `_update_scale`, skip); deepspeed/runtime/engine.py `_take_model_step` (no scheduler step).
  """

  def init_fn(params: Any) -> LossScaledState:
    ls = LossScaleState(scale=jnp.full((), cfg.initial_scale, jnp.float32),
                        cur_hysteresis=jnp.full((), cfg.hysteresis, jnp.int32),
                        cur_iter=jnp.zeros((), jnp.int32), last_overflow_iter=jnp.full((), -1, jnp.int32))
    return LossScaledState(loss_scale=ls, inner=inner.init(params))

  def update_fn(scaled_grads: Any, state: LossScaledState, params: Any = None) -> tuple[Any, LossScaledState]:
    found = ~all_finite(scaled_grads) if overflow is None else overflow
    loss_scale = next_loss_scale(state.loss_scale, found, cfg)
    divisor = loss_scale.scale  # DeepSpeed unscales with the scale *after* its update (see the docstring)
    grads = jax.tree.map(lambda g: g / divisor.astype(g.dtype), scaled_grads)
    updates, new_inner = inner.update(grads, state.inner, params)
    keep = lambda new, old: jnp.where(found, old, new)
    updates = jax.tree.map(lambda u: jnp.where(found, jnp.zeros_like(u), u), updates)
    new_inner = jax.tree.map(keep, new_inner, state.inner)
    return updates, LossScaledState(loss_scale=loss_scale, inner=new_inner)

  return optax.GradientTransformation(init_fn, update_fn)


def loss_scale_state_of(opt_state: Any) -> LossScaleState | None:
  """The LossScaleState of a `make_optimizer` state, or None when the run is not fp16."""
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, LossScaleState))
           if isinstance(x, LossScaleState)]
  return found[0] if found else None


def loss_scale_of(opt_state: Any) -> jax.Array:
  """Loss scale the next step multiplies its loss by (float32 scalar; 1.0 when the run is not fp16)."""
  ls = loss_scale_state_of(opt_state)
  return jnp.ones((), jnp.float32) if ls is None else ls.scale
