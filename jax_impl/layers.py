"""The GPT's building blocks, rounding where torch's kernels round: Dense, Norm, rotary tables, the diagnose taps.

`jax_impl.model` assembles them into the decoder (and re-exports `Dense`, `TAPS`, `tap_name`, `rope_tables`).
float32: every op is the plain one. bf16/fp16 (`_reduced`): linear layers accumulate in float32 and add the
bias before one rounding (torch's addmm), GELU and SiLU compute in float32 and round once (`_opmath`),
residual and position adds round once (`_add`), norms compute in float32 and round their output once.

Speed (XLA CPU, measured by benchmarks/jax_step_vs_bare.py): `Dense` multiplies its input as one 2-D
(B * T, in) matrix, so the kernel gradient differentiates to one x^T @ dy dot over the natural layouts of
both operands; from the 3-D input XLA instead materialised a transposed copy of every output gradient
(the residual stream's gradient fused into it), ~20% of the step. The values are bitwise the same.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from parity import architecture
from parity.protocol.layout import FAMILY_PLANT_KEYS
from parity.spec import ModelSpec

from jax_impl.param_names import NORM_MODULES

__all__ = ["Dense", "Norm", "norm_eps", "TAPS", "tap_name", "rope_tables", "rope_at", "apply_rope", "mlp_activation",
           "softcap", "embed_scale", "set_model_plants", "planted", "FINAL_NORM"]

Dtype = Any

_MODEL_PLANTS: frozenset = frozenset()
"""This process's planted model-family porting bugs (parity.protocol.layout.FAMILY_PLANT_KEYS): one side per worker
process, set once before the step is traced (`set_model_plants`); read while tracing, so each is part of the
compiled step."""


def set_model_plants(plants) -> None:
  """Makes the family plants among `plants` (a side's SideIO.plants) this process's; the others are ignored here."""
  global _MODEL_PLANTS
  _MODEL_PLANTS = frozenset(p for p in plants if p in FAMILY_PLANT_KEYS)


def planted(key: str) -> bool:
  """Whether the family plant `key` is on in this process (`set_model_plants`)."""
  return key in _MODEL_PLANTS

TAPS = "intermediates"
"""Flax collection the diagnose taps are sown into (`parity diagnose`, docs/diagnose.md). Taps are recorded only
when a caller applies the model with this collection mutable (`loss_and_taps`); in training it is not, and
`_tap` adds nothing to the traced computation."""
_NORM_TAP = "out"
"""Sow name of a Norm's output; a Norm's tap is named after the module itself (`tap_name`)."""
_SUB_OUT = "_out"
"""Suffix of a tap sown under a submodule's name (`fc_out` is tap `fc`): Flax forbids a variable and a
submodule of the same name in one scope."""


def _tap(module: nn.Module, name: str, make: Any) -> None:
  """Sows `make()` as diagnose tap `name` of `module`, only while the TAPS collection is mutable.

  Args:
    module: the module whose scope holds the tap (its path is the tap's Flax location).
    name: the tap's last name part (canonical: see `tap_name`).
    make: a zero-argument function returning the value in the canonical layout; called only when
      tapping, so layout changes (transposes) cost nothing in training.
  """
  if module.is_mutable_collection(TAPS) and not module.is_initializing():
    module.sow(TAPS, name, make(), reduce_fn=lambda _, x: x, init_fn=lambda: None)


def tap_name(location: str) -> str:
  """Flax location of a sown tap -> canonical tap name (`parity.diagnose`).

  The location is the path in the variables, collection first. `h_{i}` becomes `h.{i}`; a
  norm's own output (`.../ln_1/out`) is named after the norm; a submodule's output sown in its
  parent as `<sub>_out` is named `<sub>`.

  >>> [tap_name(f"intermediates/{p}") for p in ("h_0/attn/q", "h_1/ln_2/out", "h_0/mlp/fc_out", "logits")]
  ['h.0.attn.q', 'h.1.ln_2', 'h.0.mlp.fc', 'logits']
  """
  parts = location.split("/")[1:]
  if len(parts) >= 2 and parts[-2] in NORM_MODULES and parts[-1] == _NORM_TAP:
    parts = parts[:-1]
  elif parts and parts[-1].endswith(_SUB_OUT):
    parts[-1] = parts[-1][:-len(_SUB_OUT)]
  return ".".join(f"h.{p[2:]}" if p.startswith("h_") and p[2:].isdigit() else p for p in parts)



def _reduced(dtype: Dtype) -> bool:
  """True for bf16/fp16 compute, where ops follow torch's rounding points (module docstring)."""
  return jnp.dtype(dtype) != jnp.dtype(jnp.float32)


def _add(a: jax.Array, b: jax.Array, dtype: Dtype) -> jax.Array:
  """a + b, broadcasting; bf16/fp16: in float32, rounded to `dtype` once (torch's add), spelled out.

  The value is the dtype's own add, but written as a plain `a + b` in bf16 XLA may keep the sum in float32
  for a float32 consumer (the next LayerNorm) and skip its rounding ("excess precision"): measured with
  `parity diagnose`, the residual stream then reached ln_2 unrounded (1.22x torch's error there; 1.00x
  spelled out). The broadcast operand's gradient (wpe over the batch) is then summed in float32, as torch's.
  """
  if not _reduced(dtype):
    return a + b
  return (a.astype(jnp.float32) + b.astype(jnp.float32)).astype(dtype)


def _opmath(fn: Any, x: jax.Array, dtype: Dtype) -> jax.Array:
  """fn(x) as torch's reduced-precision elementwise kernels compute it: in float32, rounded to `dtype` once.

  In float32 it is plain fn(x). x: any shape; the result has x's shape, in `dtype` when reduced.
  """
  if not _reduced(dtype):
    return fn(x)
  return fn(x.astype(jnp.float32)).astype(dtype)


FINAL_NORM = "ln_f"
"""The module name of the final norm (before the output projection), as parity.weights names its params."""


def norm_eps(norm: "Norm") -> float:
  """The eps a `Norm` module adds to its mean square / variance: spec.norm_eps; under the planted family bug
  'final_norm_eps_tenth' (parity.protocol.layout.FAMILY_PLANT_KEYS) a tenth of it in the final norm (FINAL_NORM), as
  a Llama-1 eps of 1e-6 left in a Llama-2 (1e-5) port. The semantics card reads each built norm through this
  (jax_impl.semantics.norm_eps_by_name)."""
  eps = norm.spec.norm_eps
  return eps / 10.0 if norm.name == FINAL_NORM and planted("final_norm_eps_tenth") else eps


class Norm(nn.Module):
  """LayerNorm (torch semantics: biased two-pass variance) or RMSNorm (LLaMA, or Gemma's (1 + w)), in float32.

  The output is rounded to `dtype` once (torch's layer_norm kernel); bf16/fp16 RMSNorm rounds the
  normalised value first and multiplies by the weight in `dtype`, as HF `LlamaRMSNorm` and
  `torch_impl.model.RMSNorm` do. With spec.norm_plus_one (Gemma) the scale is (1 + weight): the normalised value
  times (1 + weight) all in float32, rounded once (HF `Gemma2RMSNorm` / `Gemma3RMSNorm`), in every dtype.

  Params: `scale` (D,) (init 1, or 0 under norm_plus_one) and, for LayerNorm with spec.bias, `bias` (D,); float32.
  Call: x (..., D) -> (..., D) in `dtype`; the norm is over the last axis.

  Attributes:
    heads: the input is (B, T, heads, H) (the q/k norms); the diagnose tap is then in the canonical (B, heads, T, H)
      layout of the q/k taps.
  """
  spec: ModelSpec
  dtype: Dtype = jnp.float32
  heads: bool = False

  def _tap_out(self, y: jax.Array) -> None:
    _tap(self, _NORM_TAP, lambda: y.transpose(0, 2, 1, 3) if self.heads else y)

  @nn.compact
  def __call__(self, x_btd: jax.Array) -> jax.Array:
    s = self.spec
    d = x_btd.shape[-1]
    x = x_btd.astype(jnp.float32)
    eps = norm_eps(self)
    if s.norm == "layernorm":
      mean_bt1 = jnp.mean(x, axis=-1, keepdims=True)
      xc = x - mean_bt1
      var_bt1 = jnp.mean(xc * xc, axis=-1, keepdims=True)
      y = xc * jax.lax.rsqrt(var_bt1 + eps)
    else:
      ms_bt1 = jnp.mean(x * x, axis=-1, keepdims=True)
      y = x * jax.lax.rsqrt(ms_bt1 + eps)
    init = nn.initializers.zeros if s.norm_plus_one else nn.initializers.ones
    scale = self.param("scale", init, (d,), jnp.float32)
    if s.norm_plus_one and planted("norm_plus_one_rounded"):  # the planted porting bug: Llama's rounding order
      y = (y.astype(self.dtype).astype(jnp.float32)
           * (1.0 + scale.astype(jnp.float32)).astype(self.dtype).astype(jnp.float32)).astype(self.dtype)
      self._tap_out(y)
      return y
    if s.norm_plus_one:  # Gemma: (1 + w) in float32 (w may arrive rounded: cast_params), one rounding
      y = (y * (1.0 + scale.astype(jnp.float32))).astype(self.dtype)
      self._tap_out(y)
      return y
    if s.norm == "rmsnorm" and _reduced(self.dtype):
      # HF LlamaRMSNorm: round y, then weight * y rounded once (the product of two bf16/fp16 values is exact in
      # float32, so this is the dtype's multiply); in float32 so that the weight's gradient sums over (B, T) in
      # float32, as torch's reduction of it does, not in the dtype
      y = (y.astype(self.dtype).astype(jnp.float32) * scale.astype(self.dtype).astype(jnp.float32)).astype(self.dtype)
      self._tap_out(y)
      return y
    y = y * scale
    if s.norm == "layernorm" and s.bias:
      y = y + self.param("bias", nn.initializers.zeros, (d,), jnp.float32)
    y = y.astype(self.dtype)
    self._tap_out(y)
    return y


def rope_tables(seq_len: int, head_dim: int, theta: float, scaling: dict | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
  """Rotary cos/sin tables in the HF LLaMA rotate-half layout: `parity.architecture.rope_tables`, the one numpy
  implementation both sides take their tables from (float64 angles rounded once to float32; plain, linear,
  llama3 or yarn frequencies).

  Args:
    seq_len: number of positions T (0 .. T-1).
    head_dim: H, even.
    theta: rotary base (spec.rope_theta, or a layer's base: `parity.architecture.layer_rope`).
    scaling: spec.rope_scaling (HF rope_parameters) or None (plain rotary).
  Returns:
    cos, sin: float32, shape (T, H).
  References:
    Su et al. 2021 (RoFormer); HF transformers `LlamaRotaryEmbedding`, `rotate_half`.
  """
  return architecture.rope_tables(seq_len, head_dim, theta, scaling)


def apply_rope(x_btnh: jax.Array, cos: Any, sin: Any) -> jax.Array:
  """x * cos + rotate_half(x) * sin, rotate_half(x) = concat(-x2, x1) (HF LLaMA), in x's dtype.

  Args:
    x_btnh: (B, T, heads, H).
    cos, sin: float32 (T, H) tables (`rope_tables`; every row's position is its index), or (B, T, H) per-token
      tables (`rope_at`: positions restarting per example, packed rows).
  """
  h2 = x_btnh.shape[-1] // 2
  x1, x2 = x_btnh[..., :h2], x_btnh[..., h2:]
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  if jnp.ndim(cos) == 3:  # per-token angles (B, T, H)
    cos, sin = (jnp.asarray(c).astype(x_btnh.dtype)[:, :, None, :] for c in (cos, sin))  # (B, T, 1, H)
    return x_btnh * cos + rotated * sin
  cos = jnp.asarray(cos, x_btnh.dtype)[None, :, None, :]  # (1, T, 1, H)
  sin = jnp.asarray(sin, x_btnh.dtype)[None, :, None, :]
  return x_btnh * cos + rotated * sin


def rope_at(positions_bt: jax.Array, max_len: int, head_dim: int, theta: float, scaling: dict | None = None
            ) -> tuple[jax.Array, jax.Array]:
  """Rotary cos/sin of each token's own position: rows `positions_bt` of `rope_tables(max_len, ...)`.

  The rows are the tables' bitwise values, so positions 0..T-1 give exactly the stream path's angles.

  Args:
    positions_bt: int (B, T), each in [0, max_len) (jnp gathers clamp an index out of range; the layouts of
      parity.dataset never produce one: a position is < seq_len <= max_seq_len).
    max_len: rows of the table (spec.max_seq_len). head_dim, theta, scaling: as `rope_tables`.
  Returns:
    cos, sin: float32 (B, T, H).
  """
  cos_th, sin_th = rope_tables(max_len, head_dim, theta, scaling)
  return jnp.asarray(cos_th)[positions_bt], jnp.asarray(sin_th)[positions_bt]


class Dense(nn.Module):
  """`nn.Dense` (params `kernel` [in, out], `bias` [out]), rounding as torch's `nn.Linear` does.

  float32: nn.Dense's values (dot_general, then the bias added), with the input flattened to one (B * T, in)
  matrix for the product (a faster kernel gradient on XLA CPU, module docstring). bf16/fp16: the product
  accumulates in float32 and the bias is added in float32 before the output is rounded once, as torch's addmm (CPU
  gemm with beta = 1, CUDA cuBLASLt bias epilogue); so the bias gradient is also summed over (B, T)
  in float32 and rounded once, as torch's `grad_output.sum(0)`, instead of a bf16 reduction.

  Attributes:
    features: output width.
    use_bias: add `bias`.
    dtype: compute dtype; params are float32 (`param_dtype`) unless the caller cast the tree.
    kernel_init: initializer of `kernel`.
  """
  features: int
  use_bias: bool = True
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  kernel_init: Any = nn.initializers.lecun_normal()

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """x: (..., in) -> (..., features) in `dtype`."""
    kernel = self.param("kernel", self.kernel_init, (jnp.shape(x)[-1], self.features), self.param_dtype)
    bias = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype) if self.use_bias else None
    x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
    # one (B * T, in) @ (in, out) product: its kernel gradient is then x^T @ dy on both operands' own layouts
    # (XLA CPU copied every dy transposed for the 3-D form; module docstring); the same values bitwise
    x_2d = jnp.reshape(x, (-1, x.shape[-1]))
    dims = (((1,), (0,)), ((), ()))
    out_shape = (*x.shape[:-1], self.features)
    if not _reduced(self.dtype):
      y = jnp.reshape(jax.lax.dot_general(x_2d, kernel, dims, precision=None), out_shape)
      if bias is not None:
        y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
      return y
    y = jnp.reshape(jax.lax.dot_general(x_2d, kernel, dims, preferred_element_type=jnp.float32), out_shape)
    if bias is not None:
      y = y + bias.astype(jnp.float32)
    return y.astype(self.dtype)


def mlp_activation(spec: ModelSpec) -> Any:
  """The MLP nonlinearity `Mlp` applies: GELU of the `gelu_approximate` form (tanh or erf) for gelu and geglu, SiLU
  for swiglu. Returns a function of one array (any shape, float) to one of the same shape and dtype; the semantics
  card probes this function."""
  if spec.mlp == "swiglu":
    return jax.nn.silu
  approximate = bool(spec.gelu_approximate)
  return lambda x: jax.nn.gelu(x, approximate=approximate)


def softcap(x: jax.Array, cap: float) -> jax.Array:
  """cap * tanh(x / cap) (Gemma 2's attention-score and final-logit soft-caps), in x's dtype.

  float32: the plain ops. bf16/fp16 (HF's `x / cap; tanh; * cap` on the compute-dtype scores and logits): each of
  the three ops computes in float32 and rounds to x's dtype, as torch's, backward included (`_tanh_rounded`).
  x: any shape, float; cap > 0.
  """
  if not _reduced(x.dtype):
    return cap * jnp.tanh(x / cap)
  dtype = x.dtype
  y = _opmath(lambda v: v / cap, x, dtype)
  y = _tanh_rounded(y)
  return _opmath(lambda v: v * cap, y, dtype)


@jax.custom_vjp
def _tanh_rounded(x: jax.Array) -> jax.Array:
  """tanh of a bf16/fp16 array as torch computes it, forward and backward: y = tanh(x) in float32, rounded to x's
  dtype; the input gradient g * (1 - y^2) from the *rounded* y, in float32, rounded once (torch's CPU
  tanh_backward on reduced types; measured: bit-identical on 4,000 bf16 elements, where the derivative of the
  unrounded float32 tanh, what `_opmath(jnp.tanh, ...)` differentiates, differs from it in 53% of them)."""
  return jnp.tanh(x.astype(jnp.float32)).astype(x.dtype)


def _tanh_rounded_fwd(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  y = _tanh_rounded(x)
  return y, y


def _tanh_rounded_bwd(y: jax.Array, g: jax.Array) -> tuple[jax.Array]:
  yf = y.astype(jnp.float32)
  return ((g.astype(jnp.float32) * (1.0 - yf * yf)).astype(y.dtype),)


_tanh_rounded.defvjp(_tanh_rounded_fwd, _tanh_rounded_bwd)


def embed_scale(x_btd: jax.Array, scale: float) -> jax.Array:
  """x * scale with the scale first rounded to x's dtype (HF Gemma's `normalizer`), the product rounded once.

  x_btd: the token embeddings (B, T, D) in the compute dtype; the result has its shape and dtype.
  """
  dtype = x_btd.dtype
  factor = jnp.asarray(scale, dtype)
  if not _reduced(dtype):
    return x_btd * factor
  return (x_btd.astype(jnp.float32) * factor.astype(jnp.float32)).astype(dtype)


def _dense(features: int, spec: ModelSpec, dtype: Dtype, name: str, *, std: float | None = None,
           bias: bool | None = None) -> Dense:
  return Dense(features, use_bias=spec.bias if bias is None else bias, dtype=dtype,
               param_dtype=jnp.float32, name=name,
               kernel_init=nn.initializers.normal(spec.init_std if std is None else std))
