"""DeepSpeed's fp16 loss scaling as a plain-Python state machine: the reference every side follows.

    scaler = LossScaler.from_train(train)   # dynamic (train.loss_scale == 0) or static
    scale = scaler.scale                    # multiply the loss by this before backward
    scaler.update(overflow)                 # after the step: overflow = any non-finite gradient

An overflowing step is skipped by the optimizer (params, moments, step counts and the LR
schedule unchanged); the scaler is the only state that moves on such a step.

The dynamic rule is DeepSpeed's `DynamicLossScaler.update_scale`
(deepspeed/runtime/fp16/loss_scaler.py, deepspeed 0.19.8), the scaler of the ZeRO-1/2/3
optimizers (`DeepSpeedZeroOptimizer`, `DeepSpeedZeroOptimizer_Stage3`, built by
`CreateLossScaler`):

  overflow:  if hysteresis == 1 or cur_hysteresis == 1:
               scale <- max(scale / 2, min_scale)   (DeepSpeed raises at scale == min_scale; see below)
             else:
               cur_hysteresis <- cur_hysteresis - 1
             last_overflow_iter <- cur_iter
  clean:     if consecutive_hysteresis: cur_hysteresis <- hysteresis
             stable = cur_iter - last_overflow_iter - 1
             if stable > 0 and stable % window == 0:
               if not consecutive_hysteresis: cur_hysteresis <- hysteresis
               scale <- scale * 2
  always:    cur_iter <- cur_iter + 1

Note `stable` counts clean steps *before* this one since the last overflow, so the first doubling
after an overflow happens on the (window + 1)-th clean step, and with no overflow yet
(last_overflow_iter = -1) on step `window` (0-based).

At the minimum: DeepSpeed's `DynamicLossScaler` is built with `raise_error_at_min_scale=True`
and raises "Current loss scale already at minimum" when an overflow would halve a scale that
already equals min_scale. This module does the same (`LossScaleAtMinimum`), so a run that would
abort in DeepSpeed aborts here too instead of silently skipping every remaining step.

ZeRO stage 0 is not modelled: DeepSpeed wraps the optimizer in `FP16_Optimizer`, whose
`_update_scale` (deepspeed/runtime/fp16/fused_optimizer.py) halves on *every* overflow (no
hysteresis) and floors at min_scale without raising (this machine with hysteresis = 1 and
`raise_at_min=False`, tested in tests/test_loss_scale.py). But in DeepSpeed 0.19.8 the engine never
multiplies the loss by that scale (engine.backward scales only for the ZeRO optimizers) while
`FP16_Optimizer.step` still divides the gradient by it, so the step run there is not a loss-scaled
fp16 step at all: `parity compare` and `parity port` refuse fp16 at stage 0
(parity.migrate._port.MSG_FP16_STAGE0).

A static scale (train.loss_scale > 0) never changes; DeepSpeed's `LossScaler` still skips a
step whose gradient overflows (the ZeRO optimizers check overflow regardless of the scaler).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

__all__ = ["LossScaler", "LossScaleAtMinimum", "predict_scales", "SCALE_FACTOR"]

SCALE_FACTOR = 2.0
"""Growth and back-off factor (DeepSpeed `DynamicLossScaler.scale_factor`, fixed at 2)."""


class LossScaleAtMinimum(RuntimeError):
  """An overflow at the minimum loss scale: DeepSpeed ends the run here (raise_error_at_min_scale)."""


MSG_AT_MINIMUM = ("fp16 gradient overflow at step {step} with the loss scale already at its minimum "
                  "(train.min_loss_scale={min_scale}); DeepSpeed's DynamicLossScaler raises here "
                  "('Current loss scale already at minimum'). Lower train.min_loss_scale, or the gradient "
                  "is not finite at any scale (a NaN in the model or data).")


@dataclasses.dataclass
class LossScaler:
  """DeepSpeed's fp16 loss scale, one optimizer step at a time.

  Attributes:
    scale: the loss scale of the next step (float, a power of two for dynamic scaling).
    dynamic: whether the scale moves (train.loss_scale == 0).
    window: clean steps between doublings (DeepSpeed scale_window / fp16.loss_scale_window), >= 1.
    hysteresis: overflows tolerated before halving (DeepSpeed delayed_shift / fp16.hysteresis), >= 1.
    consecutive_hysteresis: refill cur_hysteresis on every clean step.
    min_scale: floor of the dynamic scale (DeepSpeed min_scale / fp16.min_loss_scale), > 0.
    raise_at_min: raise LossScaleAtMinimum on an overflow at min_scale (ZeRO-1/2/3: True; stage 0: False).
    cur_hysteresis: overflows left before the next halving.
    cur_iter: steps seen (DeepSpeed cur_iter).
    last_overflow_iter: cur_iter of the last overflow, -1 before the first.
  """

  scale: float
  dynamic: bool = True
  window: int = 1000
  hysteresis: int = 2
  consecutive_hysteresis: bool = False
  min_scale: float = 1.0
  raise_at_min: bool = True
  cur_hysteresis: int = -1
  cur_iter: int = 0
  last_overflow_iter: int = -1

  def __post_init__(self) -> None:
    if self.window < 1 or self.hysteresis < 1 or not self.min_scale > 0 or not self.scale > 0:
      raise ValueError(f"loss scaler needs window >= 1, hysteresis >= 1, min_scale > 0 and scale > 0; got "
                       f"window={self.window}, hysteresis={self.hysteresis}, min_scale={self.min_scale}, "
                       f"scale={self.scale}")
    if self.cur_hysteresis < 0:
      self.cur_hysteresis = self.hysteresis

  @classmethod
  def from_train(cls, train: Any, *, raise_at_min: bool = True) -> "LossScaler":
    """The scaler a TrainSpec asks for (fp16 fields; `precision` is not checked here).

    Args:
      train: a parity.spec.TrainSpec (loss_scale, initial_scale_power, loss_scale_window, hysteresis,
        consecutive_hysteresis, min_loss_scale).
      raise_at_min: see the class docstring.
    Returns:
      A static scaler (scale train.loss_scale) when train.loss_scale > 0, else a dynamic one at
      2**train.initial_scale_power (DeepSpeed `DeepSpeedFP16Config.dynamic_loss_scale_args`).
    """
    if train.loss_scale > 0:
      return cls(scale=float(train.loss_scale), dynamic=False)
    return cls(scale=float(2 ** train.initial_scale_power), dynamic=True, window=train.loss_scale_window,
               hysteresis=train.hysteresis, consecutive_hysteresis=train.consecutive_hysteresis,
               min_scale=float(train.min_loss_scale), raise_at_min=raise_at_min)

  def update(self, overflow: bool) -> float:
    """Advances one optimizer step.

    Args:
      overflow: the step's scaled gradient had a non-finite element (the update was skipped).
    Returns:
      The scale of the next step.
    Raises:
      LossScaleAtMinimum: dynamic, raise_at_min, and an overflow would halve a scale == min_scale.
    References:
      deepspeed/runtime/fp16/loss_scaler.py `DynamicLossScaler.update_scale` (deepspeed 0.19.8).
    """
    if not self.dynamic:
      self.cur_iter += 1
      return self.scale
    if overflow:
      if self.hysteresis == 1 or self.cur_hysteresis == 1:
        if self.scale == self.min_scale and self.raise_at_min:
          raise LossScaleAtMinimum(MSG_AT_MINIMUM.format(step=self.cur_iter, min_scale=self.min_scale))
        self.scale = max(self.scale / SCALE_FACTOR, self.min_scale)
      else:
        self.cur_hysteresis -= 1
      self.last_overflow_iter = self.cur_iter
    else:
      if self.consecutive_hysteresis:
        self.cur_hysteresis = self.hysteresis
      stable = self.cur_iter - self.last_overflow_iter - 1
      if stable > 0 and stable % self.window == 0:
        if not self.consecutive_hysteresis:
          self.cur_hysteresis = self.hysteresis
        self.scale *= SCALE_FACTOR
    self.cur_iter += 1
    return self.scale

  def state_dict(self) -> dict[str, Any]:
    """JSON-ready state: every field (settings included, so a resume can check them)."""
    return dataclasses.asdict(self)

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Restores `state_dict()` output.

    Raises:
      ValueError: a key is missing or unknown, or a setting differs from this scaler's (a resume
        with different fp16 settings).
    """
    fields = {f.name for f in dataclasses.fields(self)}
    if set(state) != fields:
      raise ValueError(f"loss scaler state has keys {sorted(state)}; expected {sorted(fields)}")
    settings = ("dynamic", "window", "hysteresis", "consecutive_hysteresis", "min_scale", "raise_at_min")
    changed = [f"{k}: saved {state[k]!r}, now {getattr(self, k)!r}" for k in settings if state[k] != getattr(self, k)]
    if changed:
      raise ValueError("loss scaler settings differ from the checkpoint's: " + "; ".join(changed))
    for k in ("scale", "cur_hysteresis", "cur_iter", "last_overflow_iter"):
      setattr(self, k, type(getattr(self, k))(state[k]))


def predict_scales(train: Any, overflows: list[bool], *, raise_at_min: bool = True) -> list[float]:
  """The loss scale each step uses, given which steps overflow.

  Args:
    train: a parity.spec.TrainSpec (fp16 fields).
    overflows: per optimizer step, whether its gradient overflows.
    raise_at_min: see `LossScaler`.
  Returns:
    scales[k]: the scale step k multiplies its loss by (len(overflows) entries).
  Raises:
    LossScaleAtMinimum: as `LossScaler.update`.

  >>> from types import SimpleNamespace as NS
  >>> t = NS(loss_scale=0, initial_scale_power=4, loss_scale_window=2, hysteresis=2,
  ...        consecutive_hysteresis=False, min_loss_scale=1)
  >>> predict_scales(t, [True, True, False, False, False, False])
  [16.0, 16.0, 8.0, 8.0, 8.0, 16.0]
  """
  scaler = LossScaler.from_train(train, raise_at_min=raise_at_min)
  out = []
  for overflow in overflows:
    out.append(scaler.scale)
    scaler.update(bool(overflow))
  return out
