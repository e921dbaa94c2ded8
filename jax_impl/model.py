"""Flax linen GPT decoder (GPT-2 and LLaMA families) and the canonical weight mapping.

Every option of `parity.spec.ModelSpec` is implemented here: pre-norm blocks,
LayerNorm (with or without bias) or RMSNorm, GELU (tanh or erf) or SwiGLU MLP,
learned or rotary positions, grouped-query attention, tied or untied head.

Numerics follow PyTorch, not Flax defaults (shared/NUMERICS.md): the norm epsilon is
`spec.norm_eps` (Flax 1e-6, torch 1e-5), LayerNorm uses the two-pass biased
variance as `torch.nn.LayerNorm`, GELU uses `spec.gelu_approximate` explicitly,
and norms compute in float32 whatever the compute dtype.

In bf16/fp16 each op rounds where torch's bf16/fp16 kernels round, not once per jnp op (measured with
`parity diagnose` in bf16, docs/precision.md): linear layers accumulate in float32 and add the bias
before one rounding (torch's addmm), GELU and SiLU compute in float32 and round once ("opmath"),
residual and position adds round once even when a float32 op reads them next, RMSNorm rounds the
normalised value before the weight multiply (HF `LlamaRMSNorm`), and attention follows the fused SDPA
kernel: float32 scores and softmax statistics, unnormalised probabilities rounded for the product with
v (float32 accumulation), divided by the float32 row sum, rounded once. Reductions that produce a
gradient (bias, norm weight, position embedding) thereby sum in float32, as torch's do. In float32
every op is the plain one, unchanged (bitwise). The layers that round so (Dense, Norm, the adds) live in
`jax_impl.layers`; this module assembles attention, MLP, blocks and the decoder.

`to_flax` / `from_flax` (in `jax_impl.layout`, re-exported here) are the only place where the canonical
(torch) layout meets the Flax layout. Axis letters in names: B batch, T/S query/key positions,
D d_model, N query heads, K kv heads, G query heads per kv head, H head_dim,
F MLP width, V vocab.
"""
from __future__ import annotations

import functools

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from parity.spec import ModelSpec

from jax_impl import remat as remat_lib
# The layers (torch rounding points, diagnose taps: jax_impl.layers) and the canonical <-> Flax layout
# (jax_impl.layout) are imported from their own modules.
from jax_impl.layers import (_SUB_OUT, TAPS, Dtype, Norm, _add, _dense, _opmath, _reduced, _tap, apply_rope,
                             mlp_activation, rope_at, rope_tables)
from jax_impl.layout import LAYERS, Params

__all__ = ["GPT", "loss_fn", "loss_and_taps", "compute_dtype", "cast_params", "attention_mask"]


def compute_dtype(precision: str) -> Dtype:
  """TrainSpec.precision ('fp32' | 'bf16') -> the activation dtype; params stay float32."""
  return {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}[precision]


def cast_params(params: Params, dtype: Dtype) -> Params:
  """The fp32 param tree cast to the compute dtype, DeepSpeed's bf16/fp16 layout (the whole module in that
  dtype, embeddings and norm weights included); the tree itself when dtype is float32."""
  if jnp.dtype(dtype) == jnp.dtype(jnp.float32):
    return params
  return jax.tree.map(lambda x: x.astype(dtype), params)


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


# ----------------------------------------------------------------------------- decoder


class Attention(nn.Module):
  """Causal grouped-query self-attention; kv head k serves query heads k*G .. k*G+G-1 (HF repeat_kv).

  Attributes:
    causal: apply the causal mask. Always True in training; False only as a planted bug of
      `parity diagnose` (`--plant SIDE:no_causal_mask`).

  Call: x (B, T, D) -> (B, T, D). With `mask_bts` (bool (B, T, S), `attention_mask`: segment and causality
  already in it) the scores outside it are set to finfo(float32).min before the softmax, instead of the causal
  mask; with `rope` ((B, T, H) cos and sin, `rope_at`) rotary angles are each token's own position. None of them:
  today's stream computation, unchanged.
  """
  spec: ModelSpec
  dtype: Dtype = jnp.float32
  causal: bool = True

  @nn.compact
  def __call__(self, x_btd: jax.Array, mask_bts: jax.Array | None = None,
               rope: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    s = self.spec
    b, t, _ = x_btd.shape
    n, k, h = s.n_heads, s.kv_heads, s.head_dim
    g = n // k
    x_btd = checkpoint_name(x_btd, "attn_in")
    qkv_btf = _dense((n + 2 * k) * h, s, self.dtype, "qkv")(x_btd)  # rows: q heads, k heads, v heads
    qkv_btf = checkpoint_name(qkv_btf, "qkv")
    q_btnh = qkv_btf[..., :n * h].reshape(b, t, n, h)
    k_btkh = qkv_btf[..., n * h:(n + k) * h].reshape(b, t, k, h)
    v_btkh = qkv_btf[..., (n + k) * h:].reshape(b, t, k, h)
    if s.position == "rope":
      cos_th, sin_th = rope_tables(t, h, s.rope_theta) if rope is None else rope  # (T, H), or per token (B, T, H)
      q_btnh = apply_rope(q_btnh, cos_th, sin_th)
      k_btkh = apply_rope(k_btkh, cos_th, sin_th)
    _tap(self, "q", lambda: q_btnh.transpose(0, 2, 1, 3))  # (B, N, T, H)
    _tap(self, "k", lambda: k_btkh.transpose(0, 2, 1, 3))  # (B, K, T, H)
    _tap(self, "v", lambda: v_btkh.transpose(0, 2, 1, 3))  # (B, K, T, H)
    q_btkgh = q_btnh.reshape(b, t, k, g, h)  # query head index = kv_head * G + g
    scores_bkgts = jnp.einsum("BTKGH,BSKH->BKGTS", q_btkgh, k_btkh,
                              preferred_element_type=jnp.float32) * s.scale
    _tap(self, "scores", lambda: scores_bkgts.reshape(b, n, t, t))  # (B, N, T, S)
    if mask_bts is not None:  # segment & causal (attention_mask), per row
      scores_bkgts = jnp.where(mask_bts[:, None, None], scores_bkgts, jnp.finfo(jnp.float32).min)
    elif self.causal:
      causal_ts = np.tril(np.ones((t, t), dtype=bool))
      scores_bkgts = jnp.where(causal_ts, scores_bkgts, jnp.finfo(jnp.float32).min)
    if _reduced(self.dtype):
      out_btkgh = self._fused_context(scores_bkgts, v_btkh)
    else:
      probs_bkgts = jax.nn.softmax(scores_bkgts, axis=-1).astype(self.dtype)
      _tap(self, "probs", lambda: probs_bkgts.reshape(b, n, t, t))  # (B, N, T, S)
      out_btkgh = jnp.einsum("BKGTS,BSKH->BTKGH", probs_bkgts, v_btkh.astype(self.dtype))
    out_btd = checkpoint_name(out_btkgh.reshape(b, t, n * h), "attn_out")  # heads in query-head order
    _tap(self, "context", lambda: out_btd)  # (B, T, N * H)
    proj_std = s.init_std / np.sqrt(2 * s.n_layers)
    y_btd = _dense(s.d_model, s, self.dtype, "proj", std=proj_std)(out_btd)
    _tap(self, "out", lambda: y_btd)
    return y_btd

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


class Mlp(nn.Module):
  """fc -> GELU -> proj (GPT-2), or proj(silu(gate(x)) * up(x)) (SwiGLU, LLaMA)."""
  spec: ModelSpec
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x_btd: jax.Array) -> jax.Array:
    s = self.spec
    f = s.ffn_dim
    x_btd = checkpoint_name(x_btd, "mlp_in")
    if s.mlp == "gelu":
      fc_btf = _dense(f, s, self.dtype, "fc")(x_btd)
      _tap(self, "fc" + _SUB_OUT, lambda: fc_btf)
      hid_btf = _opmath(mlp_activation(s), fc_btf, self.dtype)
    else:
      gate_btf = _dense(f, s, self.dtype, "gate")(x_btd)
      up_btf = _dense(f, s, self.dtype, "up")(x_btd)
      _tap(self, "gate" + _SUB_OUT, lambda: gate_btf)
      _tap(self, "up" + _SUB_OUT, lambda: up_btf)
      hid_btf = _opmath(mlp_activation(s), gate_btf, self.dtype) * up_btf  # torch: F.silu rounds, then the product
    _tap(self, "act", lambda: hid_btf)
    hid_btf = checkpoint_name(hid_btf, "mlp_hidden")
    proj_std = s.init_std / np.sqrt(2 * s.n_layers)
    y_btd = _dense(s.d_model, s, self.dtype, "proj", std=proj_std)(hid_btf)
    _tap(self, "out", lambda: y_btd)
    return y_btd


class Block(nn.Module):
  """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)).

  With `scanned`, the call signature is the `nn.scan` body's: (x, None) -> (x, None); `mask_bts` and `rope` (see
  `Attention`) follow, broadcast over the layers.
  """
  spec: ModelSpec
  dtype: Dtype = jnp.float32
  scanned: bool = False
  causal: bool = True
  """See `Attention.causal` (diagnose plant only)."""

  @nn.compact
  def __call__(self, x_btd: jax.Array, _: Any = None, mask_bts: jax.Array | None = None,
               rope: tuple[jax.Array, jax.Array] | None = None) -> Any:
    attn = Attention(self.spec, self.dtype, self.causal, name="attn")
    h_btd = Norm(self.spec, self.dtype, name="ln_1")(x_btd)
    x_btd = _add(x_btd, attn(h_btd) if mask_bts is None and rope is None else attn(h_btd, mask_bts, rope), self.dtype)
    _tap(self, "resid_mid", lambda: x_btd)
    x_btd = _add(x_btd, Mlp(self.spec, self.dtype, name="mlp")(Norm(self.spec, self.dtype, name="ln_2")(x_btd)),
                 self.dtype)
    _tap(self, "out", lambda: x_btd)
    return (x_btd, None) if self.scanned else x_btd


def _params_to_device(variables: Any, dtype: Dtype) -> Any:
  """One layer's params (a slice of the host-resident fp32 stack) moved into device memory in the scan body,
  then cast to the compute dtype there (bf16/fp16: the per-layer form of the step's whole-tree cast, which
  would otherwise run on the whole stack in host memory; the cast's transpose still hands the optimizer an
  fp32 gradient of the rounded value)."""
  return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device).astype(dtype), variables)


def _block_class(remat: str, host_kind: str, scanned: bool, layer_to_device: bool, dtype: Dtype) -> Any:
  """Block wrapped in the plan's jax.checkpoint policy and, for scanned host params, a per-layer move (and cast)."""
  cls: Any = Block
  if layer_to_device:
    cls = nn.map_variables(cls, "params", trans_in_fn=functools.partial(_params_to_device, dtype=dtype), init=False)
  pol = remat_lib.policy(remat, host_kind)
  if pol is not None:
    cls = nn.remat(cls, policy=pol, prevent_cse=not scanned)
  return cls


class GPT(nn.Module):
  """GPT decoder; returns logits in the compute dtype.

  Attributes:
    spec: the model spec.
    dtype: compute dtype (float32 or bfloat16); params are always float32.
    remat: JaxPlan.remat policy over each block (`jax_impl.remat`); True/False mean "full"/"none".
    scan_layers: run the blocks as one `nn.scan` over params stacked on a leading layer axis,
      under the module name `LAYERS` ("h") instead of h_0 .. h_{L-1}.
    layer_to_device: with scan_layers, move each layer's param slice to device memory inside the
      scan body and cast it to `dtype` there (the stacked params live in host memory, fp32;
      JaxPlan.offload_params).
    host_memory_kind: host memory kind for the offload remat policies.
    causal: see `Attention.causal`; False only as a `parity diagnose` plant.
  """
  spec: ModelSpec
  dtype: Dtype = jnp.float32
  remat: str | bool = False
  scan_layers: bool = False
  layer_to_device: bool = False
  host_memory_kind: str = "pinned_host"
  causal: bool = True

  def _remat_name(self) -> str:
    if isinstance(self.remat, bool):
      return "full" if self.remat else "none"
    return self.remat

  def _blocks(self, x_btd: jax.Array, mask_bts: jax.Array | None = None,
              rope: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    s = self.spec
    block = _block_class(self._remat_name(), self.host_memory_kind, self.scan_layers,
                         self.layer_to_device and self.scan_layers and not self.is_initializing(), self.dtype)
    extra = () if mask_bts is None and rope is None else (mask_bts, rope)  # stream: the call of before, unchanged
    if not self.scan_layers:
      for i in range(s.n_layers):
        x_btd = block(s, self.dtype, False, self.causal, name=f"h_{i}")(x_btd, *((None,) + extra if extra else ()))
      return x_btd
    kw = {"in_axes": (nn.broadcast,) * 3} if extra else {}  # (None, mask, rope): the same for every layer
    scanned = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=s.n_layers, **kw)
    x_btd, _ = scanned(s, self.dtype, True, self.causal, name=LAYERS)(x_btd, None, *extra)
    return x_btd

  @nn.compact
  def __call__(self, tokens_bt: jax.Array, segment_ids_bt: jax.Array | None = None,
               positions_bt: jax.Array | None = None) -> jax.Array:
    """Next-token logits.

    Args:
      tokens_bt: int32 token ids, shape (B, T), T <= spec.max_seq_len.
      segment_ids_bt: optional int (B, T) (the `padded` / `packed` layouts, docs/data-examples.md): query t
        attends key s iff segment_ids[t] == segment_ids[s] and s <= t (`attention_mask`). None: causal only.
      positions_bt: optional int (B, T), each token's position within its example, in [0, max_seq_len): learned
        positions gather wpe[positions], rotary angles use them. None: 0 .. T-1 in every row.
      With neither (the `stream` layout) the computation is exactly the one without these arguments.
    Returns:
      Logits, shape (B, T, vocab_size), in `dtype`.
    Raises:
      ValueError: T exceeds spec.max_seq_len, or segment_ids_bt / positions_bt is not (B, T) (trace time).
    """
    s = self.spec
    t = tokens_bt.shape[1]
    if t > s.max_seq_len:
      raise ValueError(f"sequence of {t} tokens exceeds model.max_seq_len={s.max_seq_len}; "
                       "use shorter sequences or a larger max_seq_len")
    for name, arr in (("segment_ids_bt", segment_ids_bt), ("positions_bt", positions_bt)):
      if arr is not None and tuple(arr.shape) != tuple(tokens_bt.shape):
        raise ValueError(f"{name} has shape {tuple(arr.shape)}; it must be the inputs' shape {tuple(tokens_bt.shape)}")
    wte = nn.Embed(s.vocab_size, s.d_model, dtype=self.dtype, param_dtype=jnp.float32, name="wte",
                   embedding_init=nn.initializers.normal(s.init_std))
    x_btd = wte(tokens_bt)
    if s.position == "learned":
      wpe = nn.Embed(s.max_seq_len, s.d_model, dtype=self.dtype, param_dtype=jnp.float32, name="wpe",
                     embedding_init=nn.initializers.normal(s.init_std))
      if positions_bt is None:
        x_btd = _add(x_btd, wpe(jnp.arange(t, dtype=jnp.int32))[None], self.dtype)  # + (1, T, D)
      else:
        x_btd = _add(x_btd, wpe(positions_bt.astype(jnp.int32)), self.dtype)  # + (B, T, D)
    _tap(self, "embed", lambda: x_btd)
    rope = None
    if s.position == "rope" and positions_bt is not None:
      rope = rope_at(positions_bt.astype(jnp.int32), s.max_seq_len, s.head_dim, s.rope_theta)
    mask_bts = None if segment_ids_bt is None else attention_mask(segment_ids_bt, self.causal)
    x_btd = self._blocks(x_btd, mask_bts, rope)
    x_btd = Norm(s, self.dtype, name="ln_f")(x_btd)
    if s.tie_embeddings:
      logits_btv = wte.attend(x_btd)  # x @ wte.T
    else:
      logits_btv = _dense(s.vocab_size, s, self.dtype, "lm_head", bias=False)(x_btd)
    _tap(self, "logits", lambda: logits_btv)
    return logits_btv


def loss_fn(params: Params, tokens_btp1: jax.Array, spec: ModelSpec, *, dtype: Dtype = jnp.float32,
            remat: str | bool = False, scan_layers: bool = False, layer_to_device: bool = False,
            host_memory_kind: str = "pinned_host", causal: bool = True, segment_ids_bt: jax.Array | None = None,
            positions_bt: jax.Array | None = None, weights_bt: jax.Array | None = None,
            label_shift: int = 1) -> jax.Array:
  """Next-token cross-entropy, nats, float32: the mean over all targets, or the weighted sum.

  Args:
    params: the Flax params pytree (`to_flax` layout, stacked when scan_layers), float32.
    tokens_btp1: token ids, shape (B, T + 1), any integer dtype (uint16 or uint32 from the run files).
      Inputs are tokens[:, :-1], targets tokens[:, 1:].
    spec: the model spec.
    dtype: compute dtype of the forward pass; log_softmax is always float32.
    remat, scan_layers, layer_to_device, host_memory_kind, causal: see `GPT`.
    segment_ids_bt, positions_bt: optional int (B, T) over the inputs (see `GPT.__call__`; the run folder's
      segment_ids.npy / positions.npy micro batch).
    weights_bt: optional float32 (B, T), the weight of target t (0 where it carries no loss; the micro batch's
      rows of parity.dataset.reference.token_weights, times what the trainer's gradient convention needs).
    With none of the three (the `stream` layout) the traced computation is exactly the one without them.
    label_shift: 1 (always, in training). 2 only as the planted bug "labels shifted twice" (issue #20 item 6):
      input t is scored against token t + 2; the last input has no target then (its weight is dropped).
  Returns:
    Scalar float32: without weights, the mean over all B * T targets of -log p(target); with weights,
    sum over (B, T) of weights * -log p(target).
  Raises:
    ValueError: weights_bt is not (B, T), or label_shift is not in [1, T] (trace time); see `GPT.__call__`.
  """
  if not 1 <= label_shift < tokens_btp1.shape[1]:
    raise ValueError(f"label_shift={label_shift} must be in [1, {tokens_btp1.shape[1] - 1}] (1 in training)")
  tokens = tokens_btp1.astype(jnp.int32)
  inputs_bt, targets_bt = tokens[:, :-1], tokens[:, 1:]
  model = GPT(spec, dtype, remat, scan_layers, layer_to_device, host_memory_kind, causal)
  logits_btv = model.apply({"params": params}, inputs_bt, *_example_args(segment_ids_bt, positions_bt)
                           ).astype(jnp.float32)
  if label_shift != 1:  # the plant: targets one further ahead, the inputs that still have one
    keep = tokens.shape[1] - label_shift
    logits_btv, targets_bt = logits_btv[:, :keep], tokens[:, label_shift:]
    weights_bt = None if weights_bt is None else weights_bt[:, :keep]
  return _mean_nll(logits_btv, targets_bt) if weights_bt is None else _weighted_nll(logits_btv, targets_bt, weights_bt)


def _example_args(segment_ids_bt: jax.Array | None, positions_bt: jax.Array | None) -> tuple:
  """GPT.__call__'s extra arguments: none at all for the stream layout (its call stays the old one)."""
  return () if segment_ids_bt is None and positions_bt is None else (segment_ids_bt, positions_bt)


def _nll(logits_btv: jax.Array, targets_bt: jax.Array) -> jax.Array:
  logp_btv = jax.nn.log_softmax(logits_btv.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp_btv, targets_bt[..., None], axis=-1)[..., 0]


def _mean_nll(logits_btv: jax.Array, targets_bt: jax.Array) -> jax.Array:
  return jnp.mean(_nll(logits_btv, targets_bt))


def _weighted_nll(logits_btv: jax.Array, targets_bt: jax.Array, weights_bt: jax.Array) -> jax.Array:
  """sum(weights * nll), float32; weights (B, T) (any float dtype, used as float32)."""
  if tuple(weights_bt.shape) != tuple(targets_bt.shape):
    raise ValueError(f"weights_bt has shape {tuple(weights_bt.shape)}; it must be the targets' shape "
                     f"{tuple(targets_bt.shape)}")
  return jnp.sum(weights_bt.astype(jnp.float32) * _nll(logits_btv, targets_bt))


def loss_and_taps(params: Params, tokens_btp1: jax.Array, spec: ModelSpec, *, dtype: Dtype = jnp.float32,
                  causal: bool = True, segment_ids_bt: jax.Array | None = None, positions_bt: jax.Array | None = None,
                  weights_bt: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """`loss_fn` of one micro batch, plus every diagnose tap of the forward pass (`parity diagnose`).

  Unrolled layers and no remat only (the taps are sown per block module). Jittable.

  Args:
    params: Flax params (unrolled `to_flax` layout), float32.
    tokens_btp1: token ids, shape (B, T + 1); inputs tokens[:, :-1], targets tokens[:, 1:].
    spec: the model spec.
    dtype: compute dtype.
    causal: see `GPT.causal`.
    segment_ids_bt, positions_bt, weights_bt: see `loss_fn`.
  Returns:
    loss: float32 scalar, nats (what `loss_fn` returns).
    taps: Flax location (e.g. 'intermediates/h_0/attn/q'; `tap_name` gives the canonical name) ->
      array in the canonical layout: q/k/v (B, heads, T, H), scores/probs (B, N, T, S), the rest
      (B, T, features).
  """
  tokens = tokens_btp1.astype(jnp.int32)
  inputs_bt, targets_bt = tokens[:, :-1], tokens[:, 1:]
  model = GPT(spec, dtype, causal=causal)
  logits_btv, state = model.apply({"params": params}, inputs_bt, *_example_args(segment_ids_bt, positions_bt),
                                  mutable=[TAPS])
  taps = {}
  for path, value in jax.tree_util.tree_flatten_with_path(state[TAPS])[0]:
    taps["/".join((TAPS, *(str(getattr(k, "key", k)) for k in path)))] = value
  loss = _mean_nll(logits_btv, targets_bt) if weights_bt is None else _weighted_nll(logits_btv, targets_bt, weights_bt)
  return loss, taps
