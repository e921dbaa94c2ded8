"""The optimizer: DeepSpeed's gradient clipping, AdamW and WarmupCosineLR, as one optax chain.

    tx = chain(clip_by_global_norm_deepspeed(train.grad_clip),
               adamw(schedule, b1, b2, eps, eps_root=0, weight_decay, mask=decay_mask(spec)))

Mapping to DeepSpeed (ZeRO-1/2, DeepSpeedCPUAdam in adamw_mode, WarmupCosineLR):
  * clipping: g * (1 / max(1, (||g|| + 1e-6) / clip)), skipped when clip == 0
    (`DeepSpeedZeroOptimizer.unscale_and_clip_grads`);
  * AdamW: p <- p * (1 - lr * wd) - lr * m_hat / (sqrt(v_hat) + eps); optax and DeepSpeed agree
    to rounding (shared/NUMERICS.md); weight decay only where `parity.weights.decays(name)`;
  * learning rate: optimizer step k (0-based, = optax's update count) uses
    `parity.schedule.train_lr(train, k)`: 0 at steps 0 and 1, then linear warmup and cosine.

The pre-clip global gradient norm is kept in the clip transform's state, so the step can
report exactly the norm the clip used (DeepSpeed's `engine.get_global_grad_norm()`).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from parity import schedule as schedule_ref
from parity.spec import ModelSpec, TrainSpec
from parity.weights import decays, param_shapes

from jax_impl.model import tree_from_canonical

__all__ = ["ClipState", "clip_by_global_norm_deepspeed", "warmup_cosine_schedule", "decay_mask",
           "make_optimizer", "grad_norm_of", "step_count_of", "DEEPSPEED_CLIP_EPS"]

DEEPSPEED_CLIP_EPS = 1e-6
"""Added to the global norm before dividing by the clip value (DeepSpeed ZeRO-1/2)."""


class ClipState(NamedTuple):
  """State of `clip_by_global_norm_deepspeed`."""
  grad_norm: jax.Array  # shape=(), dtype=float32: global L2 norm of the last input, before clipping


def clip_by_global_norm_deepspeed(max_norm: float) -> optax.GradientTransformation:
  """Clips the gradient by its global L2 norm with DeepSpeed's formula, and records that norm.

  g <- g * (1 / s),  s = max(1, (||g|| + 1e-6) / max_norm); the identity when max_norm == 0.

  Args:
    max_norm: DeepSpeed `gradient_clipping` (>= 0); 0 disables clipping (the norm is still recorded).
  Returns:
    A GradientTransformation whose state is a ClipState.
  Raises:
    ValueError: max_norm is negative.

  References:
    DeepSpeed `runtime/zero/stage_1_and_2.py`, `DeepSpeedZeroOptimizer.unscale_and_clip_grads`.

  >>> tx = clip_by_global_norm_deepspeed(1.0)
  >>> g, s = tx.update({"w": jnp.array([3.0, 4.0])}, tx.init(None))
  >>> float(s.grad_norm), [round(float(x), 4) for x in g["w"]]
  (5.0, [0.6, 0.8])
  """
  if max_norm < 0:
    raise ValueError(f"gradient clipping must be >= 0 (0 disables it); got {max_norm}")

  def init_fn(params: Any) -> ClipState:
    del params
    return ClipState(grad_norm=jnp.zeros((), jnp.float32))

  def update_fn(updates: Any, state: ClipState, params: Any = None) -> tuple[Any, ClipState]:
    del state, params
    norm = optax.tree.norm(updates).astype(jnp.float32)
    if max_norm > 0:
      scale = jnp.maximum((norm + DEEPSPEED_CLIP_EPS) / max_norm, 1.0)
      inv_scale = 1.0 / scale  # DeepSpeed multiplies by 1 / combined_scale
      updates = jax.tree.map(lambda g: g * inv_scale.astype(g.dtype), updates)
    return updates, ClipState(grad_norm=norm)

  return optax.GradientTransformation(init_fn, update_fn)


def warmup_cosine_schedule(train: TrainSpec) -> optax.Schedule:
  """DeepSpeed WarmupCosineLR (linear warmup) as a jnp function of optax's update count.

  Update k (0-based) uses `parity.schedule.train_lr(train, k)`: DeepSpeed's scheduler starts
  at iteration -1 (ratio 0) and steps after each optimizer step, so k uses ratio(k - 1), with
  warmup clamped to >= 2:
    i < 0:       0
    i < warmup:  min_ratio + (1 - min_ratio) * i / warmup
    otherwise:   max(0, cos_min + (1 - cos_min) * (1 + cos(pi * p)) / 2),
                 p = min(1, (i - warmup + 1) / max(1, total - warmup)).

  The values come from `parity.schedule` itself, evaluated in float64 once per update index
  and rounded once to float32; the jnp function indexes that table. This is bit-exact with
  the float32 lr DeepSpeedCPUAdam receives, where a float32 re-derivation of the formula is
  up to ~100 ulp off near the end of the cosine (1 + cos(pi p) cancels). From index
  max(steps, warmup) + 1 on the schedule is constant (p = 1), so clamping the index is exact
  for every count >= 0.

  Args:
    train: lr (peak, same unit as the result), steps (total), warmup_steps, warmup_min_ratio,
      cos_min_ratio.
  Returns:
    count (integer scalar, 0-based update index) -> learning rate (float32 scalar).

  References:
    DeepSpeed `runtime/lr_schedules.py` WarmupCosineLR; `parity.schedule.lr_at_step`.
  """
  n = max(train.steps, train.warmup_steps, 2) + 2
  table_k = np.asarray([schedule_ref.train_lr(train, k) for k in range(n)], dtype=np.float32)

  def schedule(count: jax.Array) -> jax.Array:
    k = jnp.clip(jnp.asarray(count, jnp.int32), 0, n - 1)
    return jnp.asarray(table_k)[k]

  return schedule


def decay_mask(spec: ModelSpec, scan_layers: bool = False) -> dict[str, Any]:
  """Flax-layout pytree of bools: True where AdamW weight decay applies (`parity.weights.decays`).

  With `scan_layers`, one bool per stacked block tensor (the same for every layer).
  """
  values = {name: decays(name) for name in param_shapes(spec)}
  return tree_from_canonical(values, n_layers=spec.n_layers if scan_layers else None)


def make_optimizer(spec: ModelSpec, train: TrainSpec, *, scan_layers: bool = False
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Builds the DeepSpeed-equivalent optimizer for this model and training spec.

  Args:
    spec, train: the model and training specs.
    scan_layers: the params use the layer-stacked layout (`model.stack_layers`).

  Returns:
    (tx, schedule): the optax chain (state: (ClipState, adamw state)) and its learning-rate
    schedule, so the step can report the lr it applies.
  """
  schedule = warmup_cosine_schedule(train)
  tx = optax.chain(
      clip_by_global_norm_deepspeed(train.grad_clip),
      optax.adamw(learning_rate=schedule, b1=train.beta1, b2=train.beta2, eps=train.eps, eps_root=0.0,
                  weight_decay=train.weight_decay, mask=decay_mask(spec, scan_layers)))
  return tx, schedule


def _find(opt_state: Any, cls: type) -> Any:
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, cls)) if isinstance(x, cls)]
  if len(found) != 1:
    raise ValueError(f"expected exactly one {cls.__name__} in the optimizer state, found {len(found)}")
  return found[0]


def grad_norm_of(opt_state: Any) -> jax.Array:
  """Pre-clip global gradient norm of the last update (float32 scalar), from a `make_optimizer` state."""
  return _find(opt_state, ClipState).grad_norm


def step_count_of(opt_state: Any) -> jax.Array:
  """Number of updates applied so far (int32 scalar) = the index of the next optimizer step."""
  return _find(opt_state, optax.ScaleByScheduleState).count
