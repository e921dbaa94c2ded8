"""Grouped-query self-attention of `jax_impl.model.GPT`: masks, sliding windows, rotary per layer kind, soft-cap.

Rounding points follow torch's (the `jax_impl.model` docstring): float32 scores and softmax statistics; in
bf16/fp16 the fused SDPA kernel's order (`Attention._fused_context`), or, with the soft-cap (which no fused
kernel takes: HF's eager attention, torch_impl's), the float32 softmax rounded to the compute dtype and multiplied
by v with float32 accumulation, rounded once. The model-family options live here too: biases
per projection (spec.linear_bias), per-head q/k RMSNorm before rotary (qk_norm), a head_dim of its own, scaled
rotary tables (`parity.architecture.rope_tables`), the attention soft-cap (float32, on the float32 scores, after
the scale and before the mask) and sliding windows per layer kind.

A layer's kind ('full' / 'sliding', `parity.architecture.layer_kinds`) reaches `Attention` as its `sliding`
argument: a Python bool (static: the mask and rotary tables of that kind), or a traced bool scalar, the
per-layer scanned input of `nn.scan` when a model mixes kinds (`jnp.where` then selects between both kinds'
masks and tables, which is exact, so scanned and unrolled layers compute the same values). None: the spec's one
kind when every layer has the same.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from parity.architecture import layer_rope
from parity.spec import ModelSpec

from jax_impl import kernels
from jax_impl.layers import (Dtype, Norm, _dense, _opmath, _reduced, _tap, apply_rope, planted, rope_tables,
                             softcap)

__all__ = ["Attention", "attention_mask", "kind_rope", "uniform_kind", "window_ok"]

Flag = Any
"""A layer's 'sliding' kind: a Python bool (static) or a traced bool scalar (a scanned per-layer input)."""


def attention_mask(segment_ids_bt: jax.Array, causal: bool = True) -> jax.Array:
  """bool (B, T, S), [query, key]: True where query t may attend key s, i.e. segment_ids[t] == segment_ids[s]
  and s <= t (parity.dataset.reference.attention_mask). Padding (segment 0) attends earlier padding only, so no
  row is empty. `causal=False` (the diagnose plant) keeps the segment test only.

  Args:
    segment_ids_bt: int (B, T): 0 = padding, 1, 2, ... = the example's order in its row.
  """
  t = segment_ids_bt.shape[-1]
  same_bts = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
  return same_bts & np.tril(np.ones((t, t), dtype=bool)) if causal else same_bts


def uniform_kind(spec: ModelSpec) -> bool | None:
  """True when every layer is 'sliding', False when every layer is 'full', None when the kinds are mixed."""
  kinds = set(spec.layer_kinds)
  return None if len(kinds) > 1 else kinds == {"sliding"}


def kind_rope(spec: ModelSpec, sliding: bool) -> tuple[float, dict | None]:
  """(theta, rope_scaling) of the layers of one kind (`parity.architecture.layer_rope` of such a layer; layer 0's
  when the model has none of that kind)."""
  kinds = spec.layer_kinds
  kind = "sliding" if sliding else "full"
  return layer_rope(spec, kinds.index(kind) if kind in kinds else 0)


def window_ok(t: int, window: int, sliding: Flag) -> Any:
  """bool (T, S): True where key s is inside the sliding window of query t (t - s < window, by index: within one
  segment of a packed row the index distance is the position distance), or everywhere when not `sliding`."""
  idx = np.arange(t)
  inside_ts = (idx[:, None] - idx[None, :]) < window
  if isinstance(sliding, bool):
    return inside_ts if sliding else np.ones((t, t), dtype=bool)
  return jnp.logical_or(inside_ts, jnp.logical_not(sliding))


def _pick(flag: Flag, if_true: Any, if_false: Any) -> Any:
  """if_true where the (static or traced) flag holds, else if_false; pytrees of arrays, exact."""
  if isinstance(flag, bool):
    return if_true if flag else if_false
  return jax.tree.map(lambda a, b: jnp.where(flag, a, b), if_true, if_false)


def _repeat_kv(x_bskh: jax.Array, g: int) -> jax.Array:
  """(B, S, K, H) -> (B, S, K, G, H): each kv head repeated for its G query heads (HF `repeat_kv`). The soft-capped
  bf16/fp16 path (HF eager) multiplies per query head, so each head's k and v gradient is rounded to the compute
  dtype on its own and the repeat's gradient then sums the group's, as torch's `repeat_interleave` backward does;
  contracting the group inside one einsum (the float32 path) rounds the sum once. Measured (gemma2 attention, bf16,
  G = 2): k and v gradients then bit-identical to torch's, where 51-59% of their elements differed."""
  b, s, k, h = x_bskh.shape
  return jnp.broadcast_to(x_bskh[:, :, :, None, :], (b, s, k, g, h))


class Attention(nn.Module):
  """Causal grouped-query self-attention; kv head k serves query heads k*G .. k*G+G-1 (HF repeat_kv).

  Attributes:
    causal: apply the causal mask. Always True in training; False only as a planted bug of
      `parity diagnose` (`--plant SIDE:no_causal_mask`).

  Call: x (B, T, D) -> (B, T, D). With `mask_bts` (bool (B, T, S), `attention_mask`: segment and causality
  already in it) the scores outside it are set to finfo(float32).min before the softmax, instead of the causal
  mask; with `rope` ((B, T, H) cos and sin, `rope_at`) rotary angles are each token's own position (`local`: the
  same for the 'sliding' layers' base, spec.rope_local_theta). `sliding`: this layer's kind (module docstring);
  a sliding layer also masks keys at or beyond spec.sliding_window positions back. None of them on a default
  spec: today's stream computation, unchanged.
  """
  spec: ModelSpec
  dtype: Dtype = jnp.float32
  causal: bool = True

  @nn.compact
  def __call__(self, x_btd: jax.Array, mask_bts: jax.Array | None = None,
               rope: tuple[jax.Array, jax.Array] | None = None, local: tuple[jax.Array, jax.Array] | None = None,
               sliding: Flag | None = None) -> jax.Array:
    s = self.spec
    b, t, _ = x_btd.shape
    n, k, h = s.n_heads, s.kv_heads, s.head_dim
    flag = self._flag(sliding)
    x_btd = checkpoint_name(x_btd, "attn_in")
    qkv_btf = _dense((n + 2 * k) * h, s, self.dtype, "qkv", bias=s.linear_bias("qkv"))(x_btd)  # q, k, v heads
    qkv_btf = checkpoint_name(qkv_btf, "qkv")
    q_btnh = qkv_btf[..., :n * h].reshape(b, t, n, h)
    k_btkh = qkv_btf[..., n * h:(n + k) * h].reshape(b, t, k, h)
    v_btkh = qkv_btf[..., (n + k) * h:].reshape(b, t, k, h)
    after = planted("qk_norm_after_rope")  # the planted porting bug: the q/k norms after rotary
    if s.qk_norm and not after:  # per head, over head_dim, before rotary (HF q_norm / k_norm)
      q_btnh = Norm(s, self.dtype, heads=True, name="ln_q")(q_btnh)
      k_btkh = Norm(s, self.dtype, heads=True, name="ln_k")(k_btkh)
    if s.position == "rope":
      cos_th, sin_th = self._rope(t, rope, local, flag)  # (T, H), or per token (B, T, H)
      q_btnh = apply_rope(q_btnh, cos_th, sin_th)
      k_btkh = apply_rope(k_btkh, cos_th, sin_th)
    if s.qk_norm and after:
      q_btnh = Norm(s, self.dtype, heads=True, name="ln_q")(q_btnh)
      k_btkh = Norm(s, self.dtype, heads=True, name="ln_k")(k_btkh)
    _tap(self, "q", lambda: q_btnh.transpose(0, 2, 1, 3))  # (B, N, T, H)
    _tap(self, "k", lambda: k_btkh.transpose(0, 2, 1, 3))  # (B, K, T, H)
    _tap(self, "v", lambda: v_btkh.transpose(0, 2, 1, 3))  # (B, K, T, H)
    capped = s.attn_softcap is not None
    if self._flash(mask_bts, flag, capped):  # the TPU speed layout (jax_impl.kernels)
      out_btd = kernels.flash_context(q_btnh, k_btkh, v_btkh, s.scale, self.dtype)
    else:
      out_btd = self._exact_context(q_btnh, k_btkh, v_btkh, mask_bts, flag)
    out_btd = checkpoint_name(out_btd, "attn_out")  # heads in query-head order
    _tap(self, "context", lambda: out_btd)  # (B, T, N * H)
    proj_std = s.init_std / np.sqrt(2 * s.n_layers)
    y_btd = _dense(s.d_model, s, self.dtype, "proj", std=proj_std, bias=s.linear_bias("out"))(out_btd)
    _tap(self, "out", lambda: y_btd)
    return y_btd

  def _exact_context(self, q_btnh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array, mask_bts: jax.Array | None,
                     flag: Flag) -> jax.Array:
    """The parity layout's softmax(q k^T * scale) v in torch's rounding order (module docstring): (B, T, N * H)."""
    s = self.spec
    b, t, n, h = q_btnh.shape
    k, g = s.kv_heads, s.n_heads // s.kv_heads
    capped = s.attn_softcap is not None
    q_btkgh = q_btnh.reshape(b, t, k, g, h)  # query head index = kv_head * G + g
    eager = capped and _reduced(self.dtype)  # HF Gemma 2 eager_attention_forward in the compute dtype (`_eager`)
    if eager:
      k_btkh, v_btkh = _repeat_kv(k_btkh, g), _repeat_kv(v_btkh, g)
      scores_bkgts = jnp.einsum("BTKGH,BSKGH->BKGTS", q_btkgh, k_btkh, preferred_element_type=jnp.float32)
      scores_bkgts = _opmath(lambda x: x * s.scale, scores_bkgts.astype(self.dtype), self.dtype)
    else:
      scores_bkgts = jnp.einsum("BTKGH,BSKH->BKGTS", q_btkgh, k_btkh, preferred_element_type=jnp.float32) * s.scale
    _tap(self, "scores", lambda: scores_bkgts.reshape(b, n, t, t))  # (B, N, T, S)
    if capped and not planted("attn_softcap_skipped"):  # before the mask (HF Gemma 2)
      scores_bkgts = softcap(scores_bkgts, s.attn_softcap)
      _tap(self, "scores_capped", lambda: scores_bkgts.reshape(b, n, t, t))  # (B, N, T, S)
    scores_bkgts = self._masked(scores_bkgts.astype(jnp.float32), mask_bts, flag)  # softmax input: float32
    if _reduced(self.dtype) and s.attn_softcap is None:
      out_btkgh = self._fused_context(scores_bkgts, v_btkh)
    elif eager:  # soft-capped (no fused kernel; HF eager, torch_impl): float32 softmax, rounded
      probs_bkgts = jax.nn.softmax(scores_bkgts, axis=-1)
      _tap(self, "probs", lambda: probs_bkgts.reshape(b, n, t, t))  # (B, N, T, S) float32, as torch's
      out_btkgh = jnp.einsum("BKGTS,BSKGH->BTKGH", probs_bkgts.astype(self.dtype), v_btkh.astype(self.dtype),
                             preferred_element_type=jnp.float32).astype(self.dtype)
    else:
      probs_bkgts = jax.nn.softmax(scores_bkgts, axis=-1).astype(self.dtype)
      _tap(self, "probs", lambda: probs_bkgts.reshape(b, n, t, t))  # (B, N, T, S)
      out_btkgh = jnp.einsum("BKGTS,BSKH->BTKGH", probs_bkgts, v_btkh.astype(self.dtype))
    return out_btkgh.reshape(b, t, n * h)

  def _flash(self, mask_bts: jax.Array | None, flag: Flag, capped: bool) -> bool:
    """Whether this layer runs the flash kernel: chosen for the process (`jax_impl.kernels`), and a layer the kernel
    takes (causal, full attention, no segment mask, no soft-cap, bf16/fp16 compute)."""
    return (kernels.attention_kernel() == "flash" and mask_bts is None and flag is False and self.causal
            and not capped and _reduced(self.dtype))

  def _flag(self, sliding: Flag | None) -> Flag:
    if sliding is not None:
      return sliding
    kind = uniform_kind(self.spec)
    if kind is None:
      raise ValueError("this model mixes 'full' and 'sliding' layers (model.layer_types): pass each layer's "
                       "`sliding` kind to Attention")
    return kind

  def _rope(self, t: int, rope: Any, local: Any, flag: Flag) -> tuple[Any, Any]:
    """cos, sin of this layer's kind: the stream tables of positions 0 .. T-1 (T, H), or the per-token ones."""
    s = self.spec
    if rope is not None:
      return rope if local is None else _pick(flag, local, rope)
    if isinstance(flag, bool) or s.rope_local_theta is None:
      return rope_tables(t, s.head_dim, *kind_rope(s, flag if isinstance(flag, bool) else False))
    return _pick(flag, rope_tables(t, s.head_dim, *kind_rope(s, True)),
                 rope_tables(t, s.head_dim, *kind_rope(s, False)))

  def _masked(self, scores_bkgts: jax.Array, mask_bts: jax.Array | None, flag: Flag) -> jax.Array:
    """The scores with finfo(float32).min outside the mask: segments (mask_bts) or causality, and the window."""
    t = scores_bkgts.shape[-1]
    windowed = flag is not False
    if mask_bts is not None:  # segment & causal (attention_mask), per row
      if windowed:
        mask_bts = mask_bts & window_ok(t, self.spec.sliding_window, flag)
      return jnp.where(mask_bts[:, None, None], scores_bkgts, jnp.finfo(jnp.float32).min)
    if not (self.causal or windowed):
      return scores_bkgts
    mask_ts = np.tril(np.ones((t, t), dtype=bool)) if self.causal else np.ones((t, t), dtype=bool)
    if windowed:
      mask_ts = mask_ts & window_ok(t, self.spec.sliding_window, flag)
    return jnp.where(mask_ts, scores_bkgts, jnp.finfo(jnp.float32).min)

  def _fused_context(self, scores_bkgts: jax.Array, v_bskh: jax.Array) -> jax.Array:
    """bf16/fp16 softmax(scores) @ v in the order of torch's fused SDPA kernel (flash attention on CPU).

    Softmax statistics in float32 (row max m, e = exp(s - m), row sum l = sum e); e rounded to the
    compute dtype for the product with v, accumulated in float32; divided by l; rounded once. The
    kernel's per-block rescaling of e is exact up to float32 rounding for rows within one key block.

    Args:
      scores_bkgts: float32 masked, scaled scores (B, K, G, T, S).
      v_bskh: values (B, S, K, H) in the compute dtype.
    Returns:
      Context (B, T, K, G, H) in the compute dtype.
    """
    b, k, g, t, _ = scores_bkgts.shape
    m_bkgt1 = jax.lax.stop_gradient(jnp.max(scores_bkgts, axis=-1, keepdims=True))
    e_bkgts = jnp.exp(scores_bkgts - m_bkgt1)
    l_bkgt1 = jnp.sum(e_bkgts, axis=-1, keepdims=True)
    _tap(self, "probs", lambda: (e_bkgts / l_bkgt1).reshape(b, k * g, t, t))  # float32, as the kernel's
    acc_btkgh = jnp.einsum("BKGTS,BSKH->BTKGH", e_bkgts.astype(self.dtype), v_bskh.astype(self.dtype),
                           preferred_element_type=jnp.float32)
    l_btkg1 = l_bkgt1[..., 0].transpose(0, 3, 1, 2)[..., None]  # (B, T, K, G, 1)
    return (acc_btkgh / l_btkg1).astype(self.dtype)
