"""The planted stale residual ('offload_residual_stale', parity.protocol.layout.OFFLOAD_PLANT_KEYS): a backward pass
that reads a wrong saved residual, the bug class of an XLA host-offload pass that hands the backward of a scanned
block a stale offloaded buffer. Such a bug is silent in the forward pass: the loss is right, only the gradients are
wrong.

What the plant does, in each block: the MLP down projection y = h @ W + b (h the `mlp_hidden` residual, which the
offload remat policies keep in host memory) keeps its forward value and its input gradient dh = dy W^T, but its
weight gradient is computed from `stale_rows(h)`, h with its token rows shifted by one over the flattened micro batch
(row r reads row r - 1's value, row 0 the last one's: the saved buffer read one row off):

    dW = stale_rows(h)^T dy        instead of        h^T dy

Written as y = proj(h) + (t - stop_gradient(t)) with t = proj(d) - proj(0) and d = stop_gradient(stale_rows(h) - h):
t - stop_gradient(t) is exactly 0 in the forward pass (the same value subtracted from itself), so y and the loss are
bitwise the clean ones; its derivative adds d^T dy to W's gradient (proj(0) = b takes the bias's share back out) and
nothing to h's or b's. The plant is applied only under an offload remat policy (`jax_impl.model.loss_fn` refuses it
otherwise), and the driver refuses it on a plan without one (parity.pipeline.plants.offload_reason).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from parity.protocol.layout import OFFLOAD_PLANT_KEYS

__all__ = ["STALE_RESIDUAL", "STALE_NAME", "stale_rows", "stale_weight_grad"]

STALE_RESIDUAL = OFFLOAD_PLANT_KEYS[0]
"""'offload_residual_stale'."""
STALE_NAME = "mlp_hidden"
"""The checkpoint_name of the residual the plant reads stale (jax_impl.remat.RESIDUAL_NAMES)."""


def stale_rows(h: jax.Array) -> jax.Array:
  """h (..., F) with its token rows shifted by one over the flattened leading axes: row r holds row r - 1's value,
  row 0 the last row's (a one-row micro batch comes back unchanged)."""
  flat = jnp.reshape(h, (-1, h.shape[-1]))
  return jnp.reshape(jnp.roll(flat, 1, axis=0), h.shape)


def stale_weight_grad(proj: Callable[[jax.Array], jax.Array], h: jax.Array, y: jax.Array) -> jax.Array:
  """y = proj(h) (a Dense layer, its output already computed) with the same forward value, bitwise, whose kernel
  gradient reads `stale_rows(h)` instead of h; the input and bias gradients unchanged (module docstring)."""
  d = jax.lax.stop_gradient(stale_rows(h) - h)
  t = proj(d) - proj(jnp.zeros_like(d))
  return y + (t - jax.lax.stop_gradient(t))
