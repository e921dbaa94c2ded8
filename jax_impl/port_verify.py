"""JAX side of `parity port --verify`, and the optax optimizer a ported config describes.

    python -m jax_impl.port_verify REQUEST.json OUT.npz

REQUEST: {"ported": PortedConfig dict, "steps": N, "seed": S, "shapes": [...]}. Draws the same initial params
and per-step gradients as torch_impl.port_verify (numpy, seeded), applies `build_optimizer(ported)` N times
and writes lr (N,) float64 (the schedule at each step, x64), beta1 (N,), params (N, P) fp32 after each step.
"""
from __future__ import annotations

import json
import sys
from typing import Any, Mapping, NamedTuple

import jax

jax.config.update("jax_enable_x64", True)  # schedules in float64 for the 1e-12 comparison; params stay fp32

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jax_impl.schedules import lr_schedule, momentum_schedule  # noqa: E402

__all__ = ["build_optimizer", "deepspeed_clip", "deepspeed_update"]


class ClipState(NamedTuple):
  """Stateless."""


def deepspeed_clip(max_norm: float, eps: float = 1e-6) -> optax.GradientTransformation:
  """DeepSpeed's clipping: g / max(1, (||g|| + eps) / max_norm) over the global L2 norm; identity if max_norm == 0."""
  def init_fn(params):
    del params
    return ClipState()

  def update_fn(updates, state, params=None):
    del params
    if max_norm <= 0:
      return updates, state
    norm = optax.global_norm(updates)
    factor = 1.0 / jnp.maximum(1.0, (norm + eps) / max_norm)
    return jax.tree.map(lambda g: (g * factor).astype(g.dtype), updates), state
  return optax.GradientTransformation(init_fn, update_fn)


class DeepSpeedOptState(NamedTuple):
  count: jax.Array  # shape=(), dtype=int32: applied updates so far (drives the schedules)
  mu: Any  # first moment (adam/lamb) or momentum buffer (sgd), same tree as params, fp32
  nu: Any  # second moment (adam/lamb), same tree as params, fp32; zeros for sgd


def deepspeed_update(opt: Mapping[str, Any], lr_fn, b1_fn=None, b2: float | None = None
                     ) -> optax.GradientTransformation:
  """The update rule of a ported optimizer, returning the full parameter delta (lr applied).

  Args:
    opt: ported optimizer {'type': 'adamw'|'adam'|'lamb'|'sgd', 'params': {...}}.
    lr_fn: count -> lr (a jax_impl.schedules schedule).
    b1_fn: count -> beta1 (OneCycle momentum) or None for params.betas[0].
    b2: beta2 override (OneCycle forces 0.99) or None.
  """
  kind, p = opt["type"], opt["params"]

  def init_fn(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return DeepSpeedOptState(jnp.zeros((), jnp.int32), zeros, jax.tree.map(jnp.zeros_like, params))

  def update_fn(grads, state, params):
    dt = jax.tree.leaves(params)[0].dtype
    lr = jnp.asarray(lr_fn(state.count), dt)
    t = state.count + 1
    if kind == "sgd":
      mom, damp, wd = p["momentum"], p["dampening"], p["weight_decay"]
      g = jax.tree.map(lambda g, x: g + wd * x if wd else g, grads, params)
      if mom:
        first = state.count == 0
        buf = jax.tree.map(lambda b, g: jnp.where(first, g, mom * b + (1 - damp) * g), state.mu, g)
        g = jax.tree.map(lambda g, b: g + mom * b, g, buf) if p["nesterov"] else buf
      else:
        buf = state.mu
      return jax.tree.map(lambda g: -lr * g, g), DeepSpeedOptState(t, buf, state.nu)
    beta1 = jnp.asarray(b1_fn(state.count) if b1_fn else p["betas"][0], dt)
    beta2 = jnp.asarray(b2 if b2 is not None else p["betas"][1], dt)
    eps, wd = p["eps"], p["weight_decay"]
    if kind == "adam" and wd:
      grads = jax.tree.map(lambda g, x: g + wd * x, grads, params)
    mu = jax.tree.map(lambda m, g: beta1 * m + (1 - beta1) * g, state.mu, grads)
    nu = jax.tree.map(lambda v, g: beta2 * v + (1 - beta2) * g * g, state.nu, grads)
    tf = t.astype(dt)
    bc1, bc2 = 1 - beta1 ** tf, 1 - beta2 ** tf
    if kind in ("adam", "adamw"):
      if p["bias_correction"]:
        upd = jax.tree.map(lambda m, v: (m / bc1) / (jnp.sqrt(v / bc2) + eps), mu, nu)
      else:
        upd = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
      if kind == "adamw" and wd:
        return (jax.tree.map(lambda u, x: -lr * wd * x - lr * u, upd, params), DeepSpeedOptState(t, mu, nu))
      return jax.tree.map(lambda u: -lr * u, upd), DeepSpeedOptState(t, mu, nu)
    step = lr * jnp.sqrt(bc2) / bc1 if p["bias_correction"] else lr  # lamb: fused_lamb_cuda_kernel.cu

    def lamb_leaf(m, v, x):
      denom = jnp.sqrt(v + eps) if p["eps_inside_sqrt"] else jnp.sqrt(v) + eps
      u = m / denom + wd * x
      wn, un = jnp.linalg.norm(x.reshape(-1)), jnp.linalg.norm(u.reshape(-1))
      coeff = jnp.where((wn != 0) & (un != 0), jnp.clip(wn / jnp.where(un == 0, 1, un), p["min_coeff"],
                                                        p["max_coeff"]), 1.0).astype(dt)
      return -step * coeff * u
    return jax.tree.map(lamb_leaf, mu, nu, params), DeepSpeedOptState(t, mu, nu)
  return optax.GradientTransformation(init_fn, update_fn)


def build_optimizer(ported: Mapping[str, Any]) -> optax.GradientTransformation:
  """optax optimizer of a PortedConfig dict: DeepSpeed clipping, then the update with its schedules.

  With precision.skip_nonfinite_updates the chain is wrapped in optax.apply_if_finite, which leaves the
  inner state (and so the schedule's count) untouched on a non-finite step, as DeepSpeed does.
  """
  opt, sch = ported["optimizer"], ported["scheduler"]
  lr_fn = lr_schedule(sch["type"], sch["params"], opt["params"]["lr"])
  b1_fn = b2 = None
  if sch["type"] == "OneCycle" and sch["params"]["cycle_momentum"] and opt["type"] != "sgd":
    b1_fn, b2 = momentum_schedule(sch["params"]), 0.99
  tx = optax.chain(deepspeed_clip(ported["clipping"]["max_global_norm"], ported["clipping"]["epsilon"]),
                   deepspeed_update(opt, lr_fn, b1_fn, b2))
  if ported["precision"]["skip_nonfinite_updates"]:
    tx = optax.apply_if_finite(tx, max_consecutive_errors=2**31 - 1)
  return tx


def _draws(shapes, steps, seed):
  rng = np.random.default_rng(seed)
  params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
  total = sum(int(np.prod(s)) for s in shapes)
  return params, rng.standard_normal((steps, total)).astype(np.float32)


def main(argv: list[str]) -> int:
  req_path, out_path = argv
  with open(req_path) as f:
    req = json.load(f)
  ported, steps = req["ported"], req["steps"]
  params_np, grads = _draws(req["shapes"], steps, req["seed"])
  params = [jnp.asarray(p) for p in params_np]
  sizes = [p.size for p in params_np]
  sch, opt = ported["scheduler"], ported["optimizer"]
  lr_fn = lr_schedule(sch["type"], sch["params"], opt["params"]["lr"])
  mom = sch["type"] == "OneCycle" and sch["params"]["cycle_momentum"] and opt["type"] != "sgd"
  b1_fn = momentum_schedule(sch["params"]) if mom else None
  tx = build_optimizer(ported)
  state = tx.init(params)
  step = jax.jit(lambda g, s, p: tx.update(g, s, p))
  lrs, b1s, out = np.zeros(steps), np.full(steps, np.nan), []
  for t in range(steps):
    lrs[t] = float(lr_fn(t))
    b1s[t] = float(b1_fn(t)) if b1_fn else (opt["params"]["betas"][0] if "betas" in opt["params"] else np.nan)
    g = [jnp.asarray(a.reshape(p.shape)) for a, p in zip(np.split(grads[t], np.cumsum(sizes)[:-1]), params_np)]
    upd, state = step(g, state, params)
    params = optax.apply_updates(params, upd)
    params = [x.astype(jnp.float32) for x in params]
    out.append(np.concatenate([np.asarray(x).reshape(-1) for x in params]))
  np.savez(out_path, lr=lrs, beta1=b1s, params=np.stack(out))
  return 0


if __name__ == "__main__":
  raise SystemExit(main(sys.argv[1:]))
