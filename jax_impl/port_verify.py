"""JAX side of `parity port --verify` (the optimizer itself: jax_impl.optim.ported_optimizer).

    python -m jax_impl.port_verify REQUEST.json OUT.npz

REQUEST: {"ported": PortedConfig dict, "steps": N, "seed": S, "shapes": [...]}. Draws the same initial params
and per-step gradients as torch_impl.port_verify (numpy, seeded), applies `build_optimizer(ported)` N times
and writes lr (N,) float64 (the schedule at each step, x64), beta1 (N,), params (N, P) fp32 after each step.

fp16 (precision.compute_dtype 'fp16'): the params start fp16-rounded (DeepSpeed's fp32 masters are copies of the
fp16 module), the optimizer is wrapped in DeepSpeed's loss scaler (`jax_impl.loss_scaling.loss_scaled`, with the
port's precision.loss_scale), and it is fed what DeepSpeed's fp16 params receive: fp16(G[step] * scale). Also
writes scale (N,) the scale each step ran with and skipped (N,) bool; the schedule is read at the applied-step
count (a skipped step does not advance it).
"""
from __future__ import annotations

import json
import sys
from typing import Any, Mapping

import jax

jax.config.update("jax_enable_x64", True)  # schedules in float64 for the 1e-12 comparison; params stay fp32

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jax_impl.loss_scaling import LossScaleConfig, loss_scale_of, loss_scaled  # noqa: E402
from jax_impl.optim import ported_optimizer  # noqa: E402  the one optimizer factory
from jax_impl.schedules import lr_schedule, momentum_schedule  # noqa: E402

__all__ = ["build_optimizer"]


def _schedules(ported: Mapping[str, Any]):
  """(lr_fn, b1_fn) of a ported config: b1_fn None unless OneCycle cycles momentum (not for SGD: DeepSpeed disables
  the cycling for an optimizer without betas)."""
  sch, opt = ported["scheduler"], ported["optimizer"]
  lr_fn = lr_schedule(sch["type"], sch["params"], opt["params"]["lr"])
  mom = sch["type"] == "OneCycle" and sch["params"]["cycle_momentum"] and opt["type"] != "sgd"
  return lr_fn, momentum_schedule(sch["params"]) if mom else None


def build_optimizer(ported: Mapping[str, Any]) -> optax.GradientTransformation:
  """optax optimizer of a PortedConfig dict: `jax_impl.optim.ported_optimizer` with the config's schedules."""
  return ported_optimizer(ported, *_schedules(ported))


def _draws(shapes, steps, seed):
  rng = np.random.default_rng(seed)
  params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
  total = sum(int(np.prod(s)) for s in shapes)
  return params, rng.standard_normal((steps, total)).astype(np.float32)


def fp16_scaler(ported: Mapping[str, Any]) -> LossScaleConfig | None:
  """The loss scaler of a ported fp16 config (None otherwise), from its precision.loss_scale."""
  ls = ported["precision"]["loss_scale"] if ported["precision"]["compute_dtype"] == "fp16" else None
  if ls is None:
    return None
  return LossScaleConfig(initial_scale=float(2 ** ls["initial_scale_power"]) if ls["dynamic"] else
                         float(ls["static_scale"]), dynamic=ls["dynamic"], window=ls["window"],
                         hysteresis=ls["hysteresis"], consecutive_hysteresis=ls["consecutive_hysteresis"],
                         min_scale=float(ls["min_scale"]))


def main(argv: list[str]) -> int:
  """`python -m jax_impl.port_verify REQUEST OUT`: runs the ported optax optimizer and schedules of REQUEST's
  ported config (with its fp16 loss scaler) for its steps on its seeded parameters and gradients, and writes lr,
  beta1, the params, the loss scale and the skips per step to OUT (.npz) for parity.migrate.verify. Returns 0."""
  req_path, out_path = argv
  with open(req_path) as f:
    req = json.load(f)
  ported, steps = req["ported"], req["steps"]
  params_np, grads = _draws(req["shapes"], steps, req["seed"])
  scaler = fp16_scaler(ported)
  if scaler is not None:  # DeepSpeed's fp32 masters start as copies of the fp16 module
    params_np = [p.astype(np.float16).astype(np.float32) for p in params_np]
  params = [jnp.asarray(p) for p in params_np]
  sizes = [p.size for p in params_np]
  opt = ported["optimizer"]
  lr_fn, b1_fn = _schedules(ported)
  tx = ported_optimizer(ported, lr_fn, b1_fn)
  tx = tx if scaler is None else loss_scaled(tx, scaler)
  state = tx.init(params)
  step = jax.jit(lambda g, s, p: tx.update(g, s, p))
  lrs, b1s, out = np.zeros(steps), np.full(steps, np.nan), []
  scales, skipped, applied = np.ones(steps), np.zeros(steps, bool), 0
  for t in range(steps):
    lrs[t] = float(lr_fn(applied))
    b1s[t] = float(b1_fn(applied)) if b1_fn else (opt["params"]["betas"][0] if "betas" in opt["params"] else np.nan)
    g = [jnp.asarray(a.reshape(p.shape)) for a, p in zip(np.split(grads[t], np.cumsum(sizes)[:-1]), params_np)]
    if scaler is not None:  # the gradient DeepSpeed's fp16 params get: fp16(G * scale), inf past 65504
      scales[t] = float(loss_scale_of(state))
      g = [(x * jnp.float32(scales[t])).astype(jnp.float16).astype(jnp.float32) for x in g]
      skipped[t] = not all(bool(jnp.all(jnp.isfinite(x))) for x in g)
    upd, state = step(g, state, params)
    params = optax.apply_updates(params, upd)
    params = [x.astype(jnp.float32) for x in params]
    applied += 0 if skipped[t] else 1
    out.append(np.concatenate([np.asarray(x).reshape(-1) for x in params]))
  np.savez(out_path, lr=lrs, beta1=b1s, params=np.stack(out), scale=scales, skipped=skipped)
  return 0


if __name__ == "__main__":
  raise SystemExit(main(sys.argv[1:]))
