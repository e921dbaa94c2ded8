"""Flax linen GPT decoder (GPT-2, LLaMA 3, Mistral, Qwen2/3 and Gemma 2/3 families) and the canonical weight mapping.

Every option of `parity.spec.ModelSpec` is implemented here: pre-norm blocks,
LayerNorm (with or without bias) or RMSNorm, GELU (tanh or erf) or SwiGLU MLP,
learned or rotary positions, grouped-query attention, tied or untied head; and the
model-family fields: biases per projection, a head_dim of its own, per-head q/k
RMSNorm, scaled rotary tables (`parity.architecture.rope_tables`), Gemma's (1 + w) RMSNorm,
GeGLU, embedding scale, post-attention/post-MLP norms and soft-caps (`jax_impl.layers.softcap`),
and sliding-window attention per layer kind with its own rotary base (`jax_impl.attention`;
with scan_layers, a model that mixes kinds scans each layer's kind as an input). At their
defaults a spec computes exactly what it computed before these fields (bitwise).

Numerics follow PyTorch, not Flax defaults (docs/numerics.md): the norm epsilon is
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
every op is the plain one, unchanged (bitwise). Gemma's norm computes in float32 and rounds once; the
attention soft-cap works on the float32 scores; the final soft-cap on the compute-dtype logits, each op
rounded (HF). The layers that round so (Dense, Norm, the adds) live in `jax_impl.layers`, attention in
`jax_impl.attention`; this module assembles MLP, blocks and the decoder.

`to_flax` / `from_flax` (in `jax_impl.layout`, re-exported here) are the only place where the canonical
(torch) layout meets the Flax layout. Axis letters in names: B batch, T/S query/key positions,
D d_model, N query heads, K kv heads, G query heads per kv head, H head_dim,
F MLP width, V vocab.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from parity.spec import ModelSpec

from jax_impl import accelerator_plants
from jax_impl import remat as remat_lib
from jax_impl import residual_plant
# The layers (torch rounding points, diagnose taps: jax_impl.layers), attention (jax_impl.attention) and the
# canonical <-> Flax layout (jax_impl.layout) are imported from their own modules.
from jax_impl.attention import Attention, attention_mask, kind_rope, uniform_kind
from jax_impl.layers import (_SUB_OUT, TAPS, Dtype, Norm, _add, _dense, _opmath, _tap, embed_scale, mlp_activation,
                             planted, rope_at, softcap)
from jax_impl.param_names import LAYERS, Params

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


# ----------------------------------------------------------------------------- decoder


class Mlp(nn.Module):
  """fc -> GELU -> proj (GPT-2), proj(silu(gate(x)) * up(x)) (SwiGLU, LLaMA) or proj(gelu(gate(x)) * up(x)) (GeGLU,
  Gemma); biases where spec.linear_bias("mlp")."""
  spec: ModelSpec
  dtype: Dtype = jnp.float32
  stale_residual: bool = False
  """The planted stale residual: proj's weight gradient reads mlp_hidden one row off (`jax_impl.residual_plant`)."""

  @nn.compact
  def __call__(self, x_btd: jax.Array) -> jax.Array:
    s = self.spec
    f = s.ffn_dim
    bias = s.linear_bias("mlp")
    x_btd = checkpoint_name(x_btd, "mlp_in")
    if s.mlp == "gelu":
      fc_btf = _dense(f, s, self.dtype, "fc", bias=bias)(x_btd)
      _tap(self, "fc" + _SUB_OUT, lambda: fc_btf)
      hid_btf = _opmath(mlp_activation(s), fc_btf, self.dtype)
    else:
      gate_btf = _dense(f, s, self.dtype, "gate", bias=bias)(x_btd)
      up_btf = _dense(f, s, self.dtype, "up", bias=bias)(x_btd)
      _tap(self, "gate" + _SUB_OUT, lambda: gate_btf)
      _tap(self, "up" + _SUB_OUT, lambda: up_btf)
      hid_btf = _opmath(mlp_activation(s), gate_btf, self.dtype) * up_btf  # torch: the activation rounds, then *
    _tap(self, "act", lambda: hid_btf)
    hid_btf = checkpoint_name(hid_btf, "mlp_hidden")
    proj_std = s.init_std / np.sqrt(2 * s.n_layers)
    proj = _dense(s.d_model, s, self.dtype, "proj", std=proj_std, bias=bias)
    y_btd = proj(hid_btf)
    if self.stale_residual:
      y_btd = residual_plant.stale_weight_grad(proj, hid_btf, y_btd)
    _tap(self, "out", lambda: y_btd)
    return y_btd


class Block(nn.Module):
  """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)); with spec.post_norms (Gemma 2/3)
  x + ln_1_post(attn(ln_1(x))), then x + ln_2_post(mlp(ln_2(x))).

  With `scanned`, the call signature is the `nn.scan` body's: (x, None) -> (x, None); `mask_bts`, `rope` and
  `local` (see `Attention`) follow, broadcast over the layers, then `sliding` (the layer's kind, a scanned input
  when the model mixes kinds).
  """
  spec: ModelSpec
  dtype: Dtype = jnp.float32
  scanned: bool = False
  causal: bool = True
  """See `Attention.causal` (diagnose plant only)."""
  stale_residual: bool = False
  """See `Mlp.stale_residual` (the planted stale residual only)."""

  @nn.compact
  def __call__(self, x_btd: jax.Array, _: Any = None, mask_bts: jax.Array | None = None,
               rope: tuple[jax.Array, jax.Array] | None = None, local: tuple[jax.Array, jax.Array] | None = None,
               sliding: Any = None) -> Any:
    s = self.spec
    attn = Attention(s, self.dtype, self.causal, name="attn")
    h_btd = Norm(s, self.dtype, name="ln_1")(x_btd)
    if mask_bts is None and rope is None and local is None and sliding is None:
      a_btd = attn(h_btd)  # the stream call of a default spec, unchanged
    else:
      a_btd = attn(h_btd, mask_bts, rope, local, sliding)
    if s.post_norms:
      a_btd = Norm(s, self.dtype, name="ln_1_post")(a_btd)
    x_btd = _add(x_btd, a_btd, self.dtype)
    _tap(self, "resid_mid", lambda: x_btd)
    m_btd = Mlp(s, self.dtype, self.stale_residual, name="mlp")(Norm(s, self.dtype, name="ln_2")(x_btd))
    if s.post_norms:
      m_btd = Norm(s, self.dtype, name="ln_2_post")(m_btd)
    x_btd = _add(x_btd, m_btd, self.dtype)
    _tap(self, "out", lambda: x_btd)
    return (x_btd, None) if self.scanned else x_btd


def _params_to_device(variables: Any, dtype: Dtype) -> Any:
  """One layer's params (a slice of the host-resident fp32 stack) moved into device memory in the scan body,
  then cast to the compute dtype there (bf16/fp16: the per-layer form of the step's whole-tree cast, which
  would otherwise run on the whole stack in host memory; the cast's transpose still hands the optimizer an
  fp32 gradient of the rounded value)."""
  return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device).astype(dtype), variables)


HOST_LAYERS = "host_layers"
"""The variable collection that carries the host-resident layer stack when the gradient is anchored on the device
(`GPT.anchored`); the "params" collection then holds the anchor."""


@jax.custom_vjp
def _anchor(moved: jax.Array, anchor: jax.Array) -> jax.Array:
  """`moved`, whose gradient is handed to `anchor` (a device array of its shape that nothing reads, so XLA keeps
  no buffer of it, not even for a recomputing backward pass)."""
  return moved


_anchor.defvjp(lambda moved, anchor: (moved, None), lambda _, ct: (jnp.zeros_like(ct), ct))


def _anchored_to_device(variables: Any, dtype: Dtype) -> Any:
  """One layer's params as the step computes with them when its gradient must be born on the device: the host slice
  moved to the device, its gradient handed to the layer's slice of the device-resident anchor (`_anchor`) instead
  of flowing back through the move (whose transpose would put it in host memory), then cast to the compute dtype.
  The values are `_params_to_device`'s."""
  anchor, host = variables["params"], variables[HOST_LAYERS]
  move = lambda a, h: _anchor(jax.device_put(jax.lax.stop_gradient(h), jax.memory.Space.Device), a).astype(dtype)
  return {"params": jax.tree.map(move, anchor, host)}


def _block_class(remat: str, host_kind: str, scanned: bool, layer_to_device: bool, dtype: Dtype,
                 anchored: bool = False) -> Any:
  """Block wrapped in the plan's jax.checkpoint policy and, for scanned host params, a per-layer move (and cast);
  `anchored`: the move of `_anchored_to_device`, the host stack in the HOST_LAYERS collection."""
  cls: Any = Block
  if layer_to_device and anchored:
    cls = nn.map_variables(cls, ("params", HOST_LAYERS),
                           trans_in_fn=functools.partial(_anchored_to_device, dtype=dtype), init=False)
  elif layer_to_device:
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
    stale_residual: the planted stale residual (`jax_impl.residual_plant`): each block's MLP down projection takes
      its weight gradient from a wrong saved residual; the forward values unchanged.
    anchored: with layer_to_device, the layer stack comes in the HOST_LAYERS collection and params[LAYERS] is a
      device-resident anchor added to each moved layer (`_anchored_to_device`): the gradient is then taken on the
      device instead of being born in host memory.
  """
  spec: ModelSpec
  dtype: Dtype = jnp.float32
  remat: str | bool = False
  scan_layers: bool = False
  layer_to_device: bool = False
  host_memory_kind: str = "pinned_host"
  causal: bool = True
  stale_residual: bool = False
  anchored: bool = False

  def _remat_name(self) -> str:
    if isinstance(self.remat, bool):
      return "full" if self.remat else "none"
    return self.remat

  def _blocks(self, x_btd: jax.Array, mask_bts: jax.Array | None = None,
              rope: tuple[jax.Array, jax.Array] | None = None,
              local: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """The blocks over x (B, T, D). A model that mixes layer kinds passes each layer's kind (`sliding`): a Python
    bool per unrolled block, a scanned (L,) bool input of the nn.scan; the rest is broadcast over the layers."""
    s = self.spec
    to_device = self.layer_to_device and self.scan_layers and not self.is_initializing()
    anchored = to_device and self.anchored
    block = _block_class(self._remat_name(), self.host_memory_kind, self.scan_layers, to_device, self.dtype,
                         anchored)
    mixed = uniform_kind(s) is None
    extra: tuple = (mask_bts, rope) + ((local,) if local is not None or mixed else ())
    if all(e is None for e in extra) and not mixed:
      extra = ()  # stream: the call of before, unchanged
    kinds = [k == "sliding" for k in s.layer_kinds]
    if not self.scan_layers:
      for i in range(s.n_layers):
        args = ((None,) + extra if extra else ()) + ((kinds[i],) if mixed else ())
        x_btd = block(s, self.dtype, False, self.causal, self.stale_residual, name=f"h_{i}")(x_btd, *args)
      return x_btd
    # (None, mask, rope[, local]): the same for every layer; the kinds, one per layer
    kw = {"in_axes": (nn.broadcast,) * (1 + len(extra)) + ((0,) if mixed else ())} if extra else {}
    axes = {"params": 0, **({HOST_LAYERS: 0} if anchored else {})}
    scanned = nn.scan(block, variable_axes=axes, split_rngs={"params": True}, length=s.n_layers, **kw)
    x_btd, _ = scanned(s, self.dtype, True, self.causal, self.stale_residual, name=LAYERS)(
        x_btd, None, *extra, *((jnp.asarray(kinds),) if mixed else ()))
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
    if s.embed_scale != 1.0:  # Gemma: x sqrt(d_model), the scale rounded to the compute dtype first
      x_btd = embed_scale(x_btd, s.embed_scale)
    if s.position == "learned":
      wpe = nn.Embed(s.max_seq_len, s.d_model, dtype=self.dtype, param_dtype=jnp.float32, name="wpe",
                     embedding_init=nn.initializers.normal(s.init_std))
      if positions_bt is None:
        x_btd = _add(x_btd, wpe(jnp.arange(t, dtype=jnp.int32))[None], self.dtype)  # + (1, T, D)
      else:
        x_btd = _add(x_btd, wpe(positions_bt.astype(jnp.int32)), self.dtype)  # + (B, T, D)
    _tap(self, "embed", lambda: x_btd)
    rope = local = None
    if s.position == "rope" and positions_bt is not None:  # the 'full' layers' tables, and the 'sliding' ones'
      rope = rope_at(positions_bt.astype(jnp.int32), s.max_seq_len, s.head_dim, *kind_rope(s, False))
      if s.rope_local_theta is not None:
        local = rope_at(positions_bt.astype(jnp.int32), s.max_seq_len, s.head_dim, *kind_rope(s, True))
    mask_bts = None if segment_ids_bt is None else attention_mask(segment_ids_bt, self.causal)
    x_btd = self._blocks(x_btd, mask_bts, rope, local)
    eps = accelerator_plants.planted_value("accelerator_norm_eps")  # a planted accelerator-only error, if any
    x_btd = Norm(s if eps is None else dataclasses.replace(s, norm_eps=eps), self.dtype, name="ln_f")(x_btd)
    with (jax.default_matmul_precision("default") if accelerator_plants.planted_value("accelerator_matmul_default")
          else contextlib.nullcontext()):
      if s.tie_embeddings:
        logits_btv = wte.attend(x_btd)  # x @ wte.T
      else:
        logits_btv = _dense(s.vocab_size, s, self.dtype, "lm_head", bias=False)(x_btd)
    _tap(self, "logits", lambda: logits_btv)
    if s.final_softcap is not None and not planted("final_softcap_skipped"):  # Gemma 2: before the loss (HF)
      logits_btv = softcap(logits_btv, s.final_softcap)
      _tap(self, "logits_capped", lambda: logits_btv)
    return logits_btv


def loss_fn(params: Params, tokens_btp1: jax.Array, spec: ModelSpec, *, dtype: Dtype = jnp.float32,
            remat: str | bool = False, scan_layers: bool = False, layer_to_device: bool = False,
            host_memory_kind: str = "pinned_host", causal: bool = True, segment_ids_bt: jax.Array | None = None,
            positions_bt: jax.Array | None = None, weights_bt: jax.Array | None = None,
            label_shift: int = 1, stale_residual: bool = False, host_layers: Params | None = None) -> jax.Array:
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
    label_shift: 1 (always, in training). 2 only as the planted bug "labels shifted twice":
      input t is scored against token t + 2; the last input has no target then (its weight is dropped).
    stale_residual: True only as the planted bug 'offload_residual_stale' (`jax_impl.residual_plant`), under an
      offload remat policy (jax_impl.remat.OFFLOAD_POLICIES): the loss is the same, the MLP weight gradients wrong.
    host_layers: with layer_to_device, {LAYERS: the host-resident layer stack} when `params[LAYERS]` is its device
      anchor (`GPT.anchored`): the loss is the same, and its gradient with respect to params[LAYERS] is born on
      the device.
  Returns:
    Scalar float32: without weights, the mean over all B * T targets of -log p(target); with weights,
    sum over (B, T) of weights * -log p(target).
  Raises:
    ValueError: weights_bt is not (B, T), label_shift is not in [1, T], stale_residual without an offload remat
      policy, or host_layers without layer_to_device and scan_layers (trace time); see `GPT.__call__`.
  """
  if stale_residual and remat not in remat_lib.OFFLOAD_POLICIES:
    raise ValueError(f"the planted stale residual reads an offloaded residual: it needs an offload remat policy "
                     f"({', '.join(remat_lib.OFFLOAD_POLICIES)}); got remat={remat!r}")
  if host_layers is not None and not (layer_to_device and scan_layers):
    raise ValueError("host_layers (the host stack of an anchored gradient) needs layer_to_device and scan_layers: "
                     "without them params[LAYERS], the anchor, would be computed with as the weights")
  if not 1 <= label_shift < tokens_btp1.shape[1]:
    raise ValueError(f"label_shift={label_shift} must be in [1, {tokens_btp1.shape[1] - 1}] (1 in training)")
  tokens = tokens_btp1.astype(jnp.int32)
  inputs_bt, targets_bt = tokens[:, :-1], tokens[:, 1:]
  model = GPT(spec, dtype, remat, scan_layers, layer_to_device, host_memory_kind, causal, stale_residual,
              anchored=host_layers is not None)
  variables = {"params": params, **({HOST_LAYERS: host_layers} if host_layers is not None else {})}
  logits_btv = model.apply(variables, inputs_bt, *_example_args(segment_ids_bt, positions_bt)).astype(jnp.float32)
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
