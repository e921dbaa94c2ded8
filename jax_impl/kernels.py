"""The attention kernel of the JAX side: `exact` (the default) or `flash` (Pallas' TPU flash attention).

`exact` is `jax_impl.attention.Attention`'s own computation: float32 scores materialised per layer and rounded where
torch's kernels round (docs/precision.md). It is what a parity verdict compares, on every backend.

`flash` runs the causal attention of a full-attention layer through the TPU flash-attention kernel of
`jax.experimental.pallas.ops.tpu.flash_attention`: the (T, S) scores are never written to HBM, which is what keeps
a TPU step at the matrix units' rate at long sequences. It is a speed layout for throughput runs on a TPU, not a
parity layout: its softmax statistics and the rounding of the product with v follow the kernel's blocking, not
torch's SDPA, so its bf16 values differ from `exact` by the kernel's own rounding. How much has not been measured
on trained weights yet (the timed runs start from constant weights, whose losses say nothing of it). Where a layer
needs what the kernel does not take, the layer keeps `exact`: a soft-cap, a sliding window, a segment mask (padded or
packed data), non-causal attention, or float32 compute.

The choice is this process's (`set_attention_kernel`), as the family plants are (`jax_impl.layers.planted`);
benchmarks set it before they build a step. A CPU or GPU process refuses `flash`.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

__all__ = ["KERNELS", "set_attention_kernel", "attention_kernel", "flash_context", "FLASH_BLOCK",
           "at_default_precision"]

KERNELS = ("exact", "flash")
FLASH_BLOCK = 512
"""Tile length (queries and keys, forward and backward) of the flash kernel, capped at the sequence length: the
kernel's own default is 128, which leaves the v5e's 128x128 matrix units waiting on the tiles' loads at head_dim
64-128 (Pallas' TPU guide: blocks of 512 or more for attention)."""

_KERNEL = "exact"


def set_attention_kernel(name: str) -> None:
  """Makes `name` (one of KERNELS) this process's attention kernel.

  Raises:
    ValueError: an unknown name, or `flash` in a process whose JAX backend is not a TPU.
  """
  global _KERNEL
  if name not in KERNELS:
    raise ValueError(f"attention kernel {name!r}: choose one of {', '.join(KERNELS)}")
  if name == "flash" and jax.default_backend() != "tpu":
    raise ValueError(f"attention kernel 'flash' is the TPU Pallas kernel; this process's JAX backend is "
                     f"{jax.default_backend()!r}: use 'exact'")
  _KERNEL = name


def attention_kernel() -> str:
  """This process's attention kernel (`set_attention_kernel`; 'exact' until it is called)."""
  return _KERNEL


def flash_context(q_btnh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array, scale: float,
                  dtype: jnp.dtype) -> jax.Array:
  """Causal softmax(q k^T * scale) v through the TPU flash kernel.

  Args:
    q_btnh: queries (B, T, N, H); k_btkh, v_btkh: keys and values (B, T, K, H), K dividing N (query head
      n reads kv head n // (N / K), as `Attention` groups them).
    scale: the score scale (spec.scale).
    dtype: the compute dtype the context is returned in.
  Returns:
    Context (B, T, N * H) in `dtype`, heads in query-head order.
  """
  from jax.experimental.pallas.ops.tpu import flash_attention as fa
  b, t, n, h = q_btnh.shape
  g = n // k_btkh.shape[2]
  # query head index = kv_head * G + g: each kv head repeated G times in place
  k_bnth = jnp.repeat(k_btkh, g, axis=2).transpose(0, 2, 1, 3).astype(dtype)
  v_bnth = jnp.repeat(v_btkh, g, axis=2).transpose(0, 2, 1, 3).astype(dtype)
  blk = min(FLASH_BLOCK, t)
  sizes = fa.BlockSizes(block_q=blk, block_k_major=blk, block_k=blk, block_b=1, block_q_major_dkv=blk,
                        block_k_major_dkv=blk, block_k_dkv=blk, block_q_dkv=blk, block_k_major_dq=blk,
                        block_k_dq=blk, block_q_dq=blk)
  kernel = at_default_precision(functools.partial(fa.flash_attention, causal=True, sm_scale=scale,
                                                  block_sizes=sizes))
  out_bnth = kernel(q_btnh.transpose(0, 2, 1, 3).astype(dtype), k_bnth, v_bnth)
  return out_bnth.transpose(0, 2, 1, 3).reshape(b, t, n * h).astype(dtype)


def at_default_precision(fn: Callable) -> Callable:
  """`fn` with its forward and its backward both traced at the default matmul precision.

  The step sets 'highest' for its float32 parity (jax_impl.step). Mosaic refuses a float32 contract precision on
  bf16 operands ("Bad lhs type", measured on a v5e), while a bf16 x bf16 product into a float32 accumulator is
  exact at the default. A `with jax.default_matmul_precision(...)` around the call alone would not reach the
  backward: a custom_vjp's backward rule is traced when the gradient is taken, after the call has returned; here
  the backward calls the forward's vjp inside the same context.
  """
  @jax.custom_vjp
  def wrapped(*args):
    with jax.default_matmul_precision("default"):
      return fn(*args)

  def fwd(*args):
    with jax.default_matmul_precision("default"):
      return jax.vjp(fn, *args)

  def bwd(vjp_fn, g):
    with jax.default_matmul_precision("default"):
      return vjp_fn(g)

  wrapped.defvjp(fwd, bwd)
  return wrapped
