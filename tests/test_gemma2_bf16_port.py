"""Gemma 2's soft-caps in bf16, ported op for op from transformers (modeling_gemma2.eager_attention_forward and the
final-logit cap): the scores a matmul in the compute dtype, scaled and capped there (each op rounded), the softmax in
float32, the probs rounded; k and v repeated per query head. torch_impl matches transformers bit for bit and jax_impl
matches torch_impl bit for bit, forward and backward, so a bf16 compare of Gemma 2 is held to rounding noise and
not to a port gap (before: torch's scores were float32, and JAX differentiated its tanh from the unrounded value and
summed a kv group's gradients before rounding)."""
from __future__ import annotations

import dataclasses
from unittest import mock

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from test_torch_families import GEMMA2, random_params  # noqa: E402
from torch_impl import layers as tl  # noqa: E402
from torch_impl.model import build_model, rope_tables  # noqa: E402

pytestmark = [pytest.mark.requires_torch, pytest.mark.requires_jax]
SPEC = dataclasses.replace(GEMMA2, n_layers=1, layer_types=("full",), sliding_window=None)
T = 16


def _bf16(seed: int, shape) -> np.ndarray:
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_torch_softcapped_attention_is_transformers_eager_bit_for_bit_in_bf16():
  gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
  attn = build_model(SPEC, random_params(SPEC)).h[0].attn.to(torch.bfloat16)
  x = torch.from_numpy(_bf16(0, (2, T, SPEC.d_model))).bfloat16()
  cos, sin = rope_tables(T, SPEC.head_dim, SPEC.rope_theta)
  q, k, v = (a.detach().requires_grad_() for a in attn._heads(x, (cos, sin)))
  rep = SPEC.n_heads // SPEC.kv_heads
  ours = tl._explicit_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), SPEC.scale,
                                SPEC.attn_softcap, None, True, lambda *a: None)
  g = torch.from_numpy(_bf16(1, tuple(ours.shape))).bfloat16()
  ours.backward(g)
  mine = [t.grad.clone() for t in (q, k, v)]
  for t in (q, k, v):
    t.grad = None
  module = mock.Mock(num_key_value_groups=rep, training=False)
  keep = torch.ones(T, T, dtype=torch.bool).tril()
  mask = torch.zeros(T, T, dtype=torch.bfloat16).masked_fill_(~keep, torch.finfo(torch.bfloat16).min)
  ctx, _ = gemma2.eager_attention_forward(module, q, k, v, mask[None, None], scaling=SPEC.scale,
                                          softcap=SPEC.attn_softcap)
  ctx = ctx.transpose(1, 2)  # HF returns (B, T, heads, hd)
  ctx.backward(g)
  assert torch.equal(ours, ctx)  # before: 35% of the elements differed (float32 scores)
  for name, a, t in zip("qkv", mine, (q, k, v)):
    assert torch.equal(a, t.grad), name  # before: 38-53%


@pytest.mark.parametrize("cap", [2.0, 3.0, 30.0])
def test_jax_softcap_rounds_and_differentiates_as_torch(cap):
  """The three rounded ops forward, and tanh's gradient from its rounded output (torch's tanh_backward): before, JAX
  differentiated the unrounded float32 tanh and 53% of a bf16 gradient's elements differed."""
  from jax_impl.layers import softcap as jsoft
  x, g = _bf16(2, (8, 512)) * 3, _bf16(3, (8, 512))
  xt = torch.from_numpy(x).bfloat16().requires_grad_()
  yt = tl.softcap(xt, cap)
  yt.backward(torch.from_numpy(g).bfloat16())
  yj, vjp = jax.vjp(lambda v: jsoft(v, cap), jnp.asarray(x).astype(jnp.bfloat16))
  (gj,) = vjp(jnp.asarray(g).astype(jnp.bfloat16))
  np.testing.assert_array_equal(np.asarray(yj.astype(jnp.float32)), yt.detach().float().numpy())
  np.testing.assert_array_equal(np.asarray(gj.astype(jnp.float32)), xt.grad.float().numpy())


def test_jax_softcapped_attention_is_torchs_bit_for_bit_in_bf16():
  """The whole Attention module (projections, rotary, capped scores, GQA 4/2, output projection) in bf16: the output
  and the gradients of the input and of both weights equal torch's. Before, 52% of the input gradient and 51-59% of
  the k and v rows of the qkv gradient differed (one rounding of a kv group's summed gradient against two)."""
  from jax_impl.attention import Attention
  from jax_impl.layout import to_flax
  params = random_params(SPEC)
  tattn = build_model(SPEC, params).h[0].attn.to(torch.bfloat16)
  xn, gn = _bf16(4, (2, T, SPEC.d_model)), _bf16(5, (2, T, SPEC.d_model))
  x = torch.from_numpy(xn).bfloat16().requires_grad_()
  with torch.backends.mkldnn.flags(enabled=False):  # torch's own GEMM, as tests/test_jax_model.py (AVX-512 CPUs
    yt = tattn(x, rope_tables(T, SPEC.head_dim, SPEC.rope_theta))  # send bf16 matmuls to oneDNN otherwise; the
    yt.backward(torch.from_numpy(gn).bfloat16())  # machine this was measured on matched both ways)
  flax = jax.tree.map(lambda a: jnp.asarray(a).astype(jnp.bfloat16), to_flax(params, SPEC)["h_0"]["attn"])
  mod = Attention(SPEC, dtype=jnp.bfloat16)
  yj, vjp = jax.vjp(lambda p, xx: mod.apply({"params": p}, xx, sliding=False), flax,
                    jnp.asarray(xn).astype(jnp.bfloat16))
  gp, gx = vjp(jnp.asarray(gn).astype(jnp.bfloat16))
  f32 = lambda a: np.asarray(a.astype(jnp.float32))
  np.testing.assert_array_equal(f32(yj), yt.detach().float().numpy())
  np.testing.assert_array_equal(f32(gx), x.grad.float().numpy())
  np.testing.assert_array_equal(f32(gp["qkv"]["kernel"]).T, tattn.qkv.weight.grad.float().numpy())
  np.testing.assert_array_equal(f32(gp["proj"]["kernel"]).T, tattn.proj.weight.grad.float().numpy())
