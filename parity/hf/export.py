"""ModelSpec -> HF config.json: `family_of_spec` picks the architecture from the spec's fields, `hf_config_from_spec`
writes its config. The inverse of `parity.hf.config.parse_hf_config` (spec -> config -> spec is the identity on
specs in that module's normal form)."""
from __future__ import annotations

from typing import Any

from parity.hf.config import HFFormatError
from parity.hf.families import FAMILIES, by_name
from parity.spec import ModelSpec

_ROTARY = {"norm": {"rmsnorm"}, "position": {"rope"}, "embed_scale": {"none"}, "norm_plus_one": {False},
           "post_norms": {False}, "qk_norm": {False}, "softcaps": {"none"}, "windows": {"none"},
           "local_rope": {False}, "attn_scale": {"1/sqrt(head_dim)"}, "mlp": {"swiglu"}, "mlp_bias": {False},
           "attn_bias": {"none", "qkv+out"}}
_GEMMA = {**_ROTARY, "mlp": {"geglu"}, "embed_scale": {"sqrt(d_model)"}, "norm_plus_one": {True}}
_GEMMA2 = {**_GEMMA, "post_norms": {True}, "softcaps": {"none", "attn", "final", "attn+final"},
           "windows": {"none", "all", "per-layer"}, "attn_scale": {"1/sqrt(head_dim)", "other"}}
_LAYOUTS: dict[str, dict[str, set]] = {
    "gpt2": {**_ROTARY, "norm": {"layernorm"}, "position": {"learned"}, "mlp": {"gelu"}, "mlp_bias": {True},
             "attn_bias": {"qkv+out"}, "attn_scale": {"1/sqrt(head_dim)", "1"}, "kv_heads": {"n_heads"},
             "d_head": {"d_model / n_heads"}, "rope_scaling": {False}},
    "llama": {**_ROTARY, "mlp_bias": {False, True}},
    "mistral": {**_ROTARY, "attn_bias": {"none"}, "windows": {"all", "per-layer"}},  # per-layer: as Ministral
    "qwen2": {**_ROTARY, "attn_bias": {"qkv"}, "windows": {"none", "all", "per-layer"}},
    "qwen3": {**_ROTARY, "qk_norm": {True}, "windows": {"none", "all", "per-layer"}},
    "gemma": {**_GEMMA, "gelu": {"tanh"}},
    "gemma2": _GEMMA2,
    "gemma3": {**_GEMMA2, "qk_norm": {True}, "local_rope": {False, True}},
}
"""family -> layout key -> the values its HF architecture can hold (keys it does not list: any value)."""


def _layout(spec: ModelSpec) -> dict[str, Any]:
  """The spec's fields as the layout keys of `_LAYOUTS`."""
  qkv, out = spec.linear_bias("qkv"), spec.linear_bias("out")
  kinds = set(spec.layer_kinds)
  windows = "none" if "sliding" not in kinds else "all" if kinds == {"sliding"} else "per-layer"
  caps = "+".join(k for k, v in (("attn", spec.attn_softcap), ("final", spec.final_softcap)) if v is not None)
  scale = {None: "1/sqrt(head_dim)", 1.0: "1"}.get(spec.attn_scale, "other")
  return {"norm": spec.norm, "position": spec.position, "mlp": spec.mlp, "norm_plus_one": spec.norm_plus_one,
          "embed_scale": "none" if spec.embed_scale == 1.0 else
          "sqrt(d_model)" if spec.embed_scale == spec.d_model ** 0.5 else spec.embed_scale,
          "post_norms": spec.post_norms, "qk_norm": spec.qk_norm, "softcaps": caps or "none", "windows": windows,
          "local_rope": spec.rope_local_theta is not None, "attn_scale": scale,
          "mlp_bias": spec.linear_bias("mlp"), "gelu": "tanh" if spec.gelu_approximate else "erf",
          "attn_bias": ("qkv+out" if qkv else "out") if out else ("qkv" if qkv else "none"),
          "kv_heads": "n_heads" if spec.kv_heads == spec.n_heads else spec.kv_heads,
          "d_head": "d_model / n_heads" if spec.d_head is None or spec.d_head * spec.n_heads == spec.d_model
          else spec.d_head, "rope_scaling": spec.rope_scaling is not None}


def _misfit(spec: ModelSpec, family: str, layout: dict[str, Any]) -> str | None:
  """Why `family`'s HF architecture cannot hold `spec` (the first layout key that differs), or None."""
  for key, allowed in _LAYOUTS[family].items():
    if layout[key] not in allowed:
      return f"{key}={layout[key]!r} (it has {' or '.join(repr(a) for a in sorted(allowed, key=str))})"
  if family in ("gemma2", "gemma3"):
    if spec.d_model % spec.n_heads:
      return f"hidden_size {spec.d_model} not divisible by num_attention_heads {spec.n_heads} (validated by HF)"
    if _query_pre_attn_scalar(spec) is None:
      return f"attn_scale={spec.attn_scale} is not query_pre_attn_scalar ** -0.5 for any query_pre_attn_scalar"
  return None


def family_of_spec(spec: ModelSpec) -> str:
  """The HF family whose layout equals the spec: 'gpt2', 'llama', 'mistral', 'qwen2', 'qwen3', 'gemma', 'gemma2' or
  'gemma3' (the first in that order whose architecture holds every field).

  Raises:
    HFFormatError: no supported HF architecture has this layout (each family's first mismatching field is named).
  """
  layout = _layout(spec)
  why = {}
  for family in (f.name for f in FAMILIES):
    why[family] = _misfit(spec, family, layout)
    if why[family] is None:
      return family
  raise HFFormatError("no HF architecture has this layout: " +
                      "; ".join(f"{by_name(f).hf_class} needs another {w}" for f, w in why.items()))


def _query_pre_attn_scalar(spec: ModelSpec) -> int | float | None:
  """Gemma 2/3's query_pre_attn_scalar q with q ** -0.5 == the spec's score scale exactly, or None."""
  if spec.attn_scale is None:
    return spec.head_dim
  if spec.attn_scale < 1e-150:  # q = scale ** -2 would overflow a float
    return None
  q = spec.attn_scale ** -2.0
  for cand in (round(q), q):
    if cand > 0 and cand ** -0.5 == spec.attn_scale:
      return int(cand) if float(cand).is_integer() else float(cand)
  return None


def _rope_params(spec: ModelSpec, theta: float, scaling: dict | None) -> dict[str, Any]:
  return {"rope_type": "default", "rope_theta": theta} if scaling is None else {**scaling, "rope_theta": theta}


def hf_config_from_spec(spec: ModelSpec) -> dict[str, Any]:
  """The config.json dict of the HF model with this layout (the architecture of `family_of_spec`).

  Rotary configs carry `rope_parameters` (transformers >= 5) and the older top-level `rope_theta`, plus
  `rope_scaling` when there is a scaling (transformers 4.x reads only that; 5.x reads it to the same values).
  Raises:
    HFFormatError: see `family_of_spec`.
  """
  spec.validate()
  family = family_of_spec(spec)
  if family == "gpt2":
    gpt2 = by_name("gpt2")
    return {"architectures": [gpt2.hf_class], "model_type": gpt2.model_type, "vocab_size": spec.vocab_size,
            "n_positions": spec.max_seq_len, "n_embd": spec.d_model, "n_layer": spec.n_layers,
            "n_head": spec.n_heads, "n_inner": spec.d_ff,
            "activation_function": "gelu_new" if spec.gelu_approximate else "gelu",
            "layer_norm_epsilon": spec.norm_eps, "initializer_range": spec.init_std,
            "scale_attn_weights": spec.attn_scale is None, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "tie_word_embeddings": spec.tie_embeddings,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "dtype": "float32"}
  cfg: dict[str, Any] = {
      "architectures": [by_name(family).hf_class], "model_type": by_name(family).model_type,
      "vocab_size": spec.vocab_size, "hidden_size": spec.d_model, "intermediate_size": spec.ffn_dim,
      "num_hidden_layers": spec.n_layers, "num_attention_heads": spec.n_heads,
      "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_dim, "max_position_embeddings": spec.max_seq_len,
      "rms_norm_eps": spec.norm_eps, "initializer_range": spec.init_std, "rope_theta": spec.rope_theta,
      "tie_word_embeddings": spec.tie_embeddings, "attention_dropout": 0.0, "dtype": "float32"}
  if family == "qwen2" and spec.d_head is None:  # Qwen2Config has no head_dim (the attention reads it if present)
    del cfg["head_dim"]
  cfg.update(_family_keys(spec, family))
  cfg.update(_rope_keys(spec, family))
  return cfg


def _family_keys(spec: ModelSpec, family: str) -> dict[str, Any]:
  """The config keys of the MLP, biases, windows and Gemma fields, per family."""
  act = "gelu_pytorch_tanh" if spec.gelu_approximate else "gelu"
  out: dict[str, Any] = {}
  if family in ("llama", "qwen3", "gemma", "gemma2", "gemma3"):
    out["attention_bias"] = spec.linear_bias("qkv")
  if family == "llama":
    out["mlp_bias"] = spec.linear_bias("mlp")
  if family == "gemma":
    out["hidden_act"] = act
  elif family in ("gemma2", "gemma3"):
    out["hidden_activation"] = act
  else:
    out["hidden_act"] = "silu"
  kinds = spec.layer_kinds
  if family == "mistral":  # layer_types only when they differ per layer (AutoConfig then loads MinistralConfig)
    out["sliding_window"] = spec.sliding_window
    if spec.layer_types:
      out["layer_types"] = [f"{k}_attention" for k in kinds]
  elif family in ("qwen2", "qwen3", "gemma2", "gemma3"):
    out["layer_types"] = [f"{k}_attention" for k in kinds]
    out["sliding_window"] = spec.sliding_window
  if family in ("qwen2", "qwen3"):
    out["use_sliding_window"] = spec.sliding_window is not None
    out["max_window_layers"] = kinds.index("sliding") if "sliding" in kinds else spec.n_layers
  if family in ("gemma2", "gemma3"):
    out.update(query_pre_attn_scalar=_query_pre_attn_scalar(spec), attn_logit_softcapping=spec.attn_softcap,
               final_logit_softcapping=spec.final_softcap)
  return out


def _rope_keys(spec: ModelSpec, family: str) -> dict[str, Any]:
  """rope_parameters (+ rope_scaling; Gemma 3: nested per layer type, + rope_local_base_freq)."""
  glob = _rope_params(spec, spec.rope_theta, spec.rope_scaling)
  out: dict[str, Any] = {}
  if spec.rope_scaling is not None:
    out["rope_scaling"] = dict(spec.rope_scaling)
  if family != "gemma3":
    out["rope_parameters"] = glob
    return out
  local = glob if spec.rope_local_theta is None else _rope_params(spec, spec.rope_local_theta, None)
  out["rope_parameters"] = {"full_attention": glob, "sliding_attention": local}
  out["rope_local_base_freq"] = local["rope_theta"]
  return out

