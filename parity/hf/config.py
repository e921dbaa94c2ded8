"""HF config.json <-> ModelSpec: supported and refused architectures, HF defaults, `family_of_spec`.

Anything the spec cannot express is refused with the reason (see `REFUSED` and the
`_parse_*` functions); it is never approximated.
"""
from __future__ import annotations

from typing import Any, Mapping

from parity.spec import ModelSpec, SpecError


class HFFormatError(SpecError):
  """A Hugging Face checkpoint or config cannot be read exactly into a ModelSpec + canonical weights."""


ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama"}
"""HF `architectures[0]` -> family of tensor names this module maps."""

REFUSED = {
    "Qwen2ForCausalLM": ("q/k/v projections have biases but o_proj and the MLP have none; ModelSpec.bias "
                         "is one switch for every linear layer, so this layout cannot be expressed"),
    "Qwen3ForCausalLM": "per-head RMSNorm on q and k (q_norm, k_norm) has no ModelSpec field",
    "GemmaForCausalLM": "RMSNorm scales by (1 + weight), GeGLU MLP and embeddings scaled by sqrt(d_model)",
    "Gemma2ForCausalLM": "extra post-norms, logit soft-capping and alternating sliding-window layers",
    "GPTNeoXForCausalLM": "parallel residual and partial rotary embeddings (rotary_pct)",
    "PhiForCausalLM": "parallel attention/MLP block and partial rotary embeddings",
    "GPT2Model": "a base model without the LM head; save the GPT2LMHeadModel instead",
    "LlamaModel": "a base model without the LM head; save the LlamaForCausalLM instead",
}
"""Known HF architectures that are refused, with the reason."""

_HF_DEFAULTS = {
    "gpt2": dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                 activation_function="gelu_new", layer_norm_epsilon=1e-5, initializer_range=0.02,
                 scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                 tie_word_embeddings=True, add_cross_attention=False),
    "LlamaForCausalLM": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=None, hidden_act="silu",
                             max_position_embeddings=2048, initializer_range=0.02, rms_norm_eps=1e-6,
                             tie_word_embeddings=False, rope_theta=10000.0, attention_bias=False, mlp_bias=False,
                             head_dim=None, pretraining_tp=1),
    "MistralForCausalLM": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
                               max_position_embeddings=4096 * 32, initializer_range=0.02, rms_norm_eps=1e-6,
                               tie_word_embeddings=False, rope_theta=10000.0, attention_bias=False,
                               mlp_bias=False, head_dim=None, sliding_window=4096, pretraining_tp=1),
}
"""HF config-class defaults (transformers GPT2Config / LlamaConfig / MistralConfig) for keys a config.json omits."""


# ----------------------------------------------------------------------------- config.json <-> ModelSpec


def parse_hf_config(config: Mapping[str, Any]) -> tuple[str, ModelSpec, list[str]]:
  """Reads an HF config.json dict exactly into a ModelSpec.

  Args:
    config: the parsed config.json of a GPT2LMHeadModel, LlamaForCausalLM or MistralForCausalLM.
  Returns:
    (family, spec, notes): family 'gpt2' or 'llama' (the tensor naming), the validated spec,
    and human-readable notes on config keys that were accepted but have no spec field.
  Raises:
    HFFormatError: unknown or refused architecture, or a key whose value the spec cannot express.
  """
  archs = config.get("architectures") or []
  arch = archs[0] if archs else {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                                 "mistral": "MistralForCausalLM"}.get(config.get("model_type", ""), "")
  if arch in REFUSED:
    raise HFFormatError(f"config.json: architecture {arch} is not supported: {REFUSED[arch]}")
  if arch not in ARCHITECTURES:
    raise HFFormatError(f"config.json: unknown architecture {arch or config.get('model_type')!r}; supported: "
                        f"{', '.join(ARCHITECTURES)} (refused with a reason: {', '.join(REFUSED)})")
  family = ARCHITECTURES[arch]
  notes: list[str] = []
  if family == "gpt2":
    spec = _parse_gpt2({**_HF_DEFAULTS["gpt2"], **config}, notes)
  else:
    spec = _parse_llama(arch, {**_HF_DEFAULTS[arch], **config}, notes)
  try:
    return family, spec.validate(), notes
  except SpecError as exc:
    raise HFFormatError(f"config.json ({arch}): {exc}") from None


def spec_from_hf_config(config: Mapping[str, Any]) -> ModelSpec:
  """The ModelSpec of an HF config.json dict; see `parse_hf_config`."""
  return parse_hf_config(config)[1]


def _refuse(arch: str, key: str, value: Any, why: str) -> HFFormatError:
  return HFFormatError(f"config.json ({arch}): {key}={value!r} is not supported: {why}")


def _parse_gpt2(c: Mapping[str, Any], notes: list[str]) -> ModelSpec:
  arch = "GPT2LMHeadModel"
  act = c["activation_function"]
  approx = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}
  if act not in approx:
    raise _refuse(arch, "activation_function", act, "only gelu_new, gelu_pytorch_tanh (tanh GELU) and gelu (erf)")
  if c["scale_attn_by_inverse_layer_idx"]:
    raise _refuse(arch, "scale_attn_by_inverse_layer_idx", True, "a per-layer 1/(layer+1) score scale has no spec field")
  if c["add_cross_attention"]:
    raise _refuse(arch, "add_cross_attention", True, "cross-attention layers are not part of a decoder-only GPT")
  if c["reorder_and_upcast_attn"]:
    notes.append("reorder_and_upcast_attn=true only changes fp16/bf16 rounding; fp32 attention is the same")
  return ModelSpec(
      vocab_size=int(c["vocab_size"]), d_model=int(c["n_embd"]), n_layers=int(c["n_layer"]),
      n_heads=int(c["n_head"]), n_kv_heads=None, d_ff=None if c["n_inner"] is None else int(c["n_inner"]),
      max_seq_len=int(c["n_positions"]), norm="layernorm", norm_eps=float(c["layer_norm_epsilon"]), mlp="gelu",
      gelu_approximate=approx[act], position="learned", bias=True, tie_embeddings=bool(c["tie_word_embeddings"]),
      attn_scale=None if c["scale_attn_weights"] else 1.0, init_std=float(c["initializer_range"]))


def _rope(arch: str, c: Mapping[str, Any]) -> float:
  """rope_theta from transformers>=5 `rope_parameters` or the older top-level `rope_theta`/`rope_scaling`."""
  params = c.get("rope_parameters") or {}
  scaling = c.get("rope_scaling") or {}
  for key, block in (("rope_parameters", params), ("rope_scaling", scaling)):
    kind = block.get("rope_type", block.get("type", "default"))
    if kind != "default":
      raise _refuse(arch, f"{key}.rope_type", kind, "only plain rotary embeddings (rope_type 'default'); "
                    "ModelSpec has rope_theta but no frequency scaling")
  return float(params.get("rope_theta", c["rope_theta"]))


def _parse_llama(arch: str, c: Mapping[str, Any], notes: list[str]) -> ModelSpec:
  if c["hidden_act"] not in ("silu", "swish"):
    raise _refuse(arch, "hidden_act", c["hidden_act"], "the SwiGLU MLP uses silu")
  d, n = int(c["hidden_size"]), int(c["num_attention_heads"])
  if c.get("head_dim") is not None and int(c["head_dim"]) * n != d:
    raise _refuse(arch, "head_dim", c["head_dim"], f"ModelSpec derives head_dim = hidden_size / num_attention_heads "
                  f"= {d}/{n}; a decoupled head_dim is not expressible")
  if bool(c["attention_bias"]) != bool(c["mlp_bias"]):
    raise HFFormatError(f"config.json ({arch}): attention_bias={c['attention_bias']} with mlp_bias={c['mlp_bias']} "
                        "is not supported: ModelSpec.bias is one switch for every linear layer")
  if int(c.get("pretraining_tp") or 1) != 1:
    notes.append(f"pretraining_tp={c['pretraining_tp']} only splits matmuls in old transformers; ignored")
  max_seq = int(c["max_position_embeddings"])
  window = c.get("sliding_window")
  if window is not None and int(window) < max_seq:
    notes.append(f"sliding_window={window} < max_position_embeddings={max_seq}: max_seq_len is set to {window}, "
                 "the longest context where sliding-window attention equals full causal attention")
    max_seq = int(window)
  kv = c["num_key_value_heads"]
  return ModelSpec(
      vocab_size=int(c["vocab_size"]), d_model=d, n_layers=int(c["num_hidden_layers"]), n_heads=n,
      n_kv_heads=None if kv is None or int(kv) == n else int(kv), d_ff=int(c["intermediate_size"]),
      max_seq_len=max_seq, norm="rmsnorm", norm_eps=float(c["rms_norm_eps"]), mlp="swiglu", position="rope",
      rope_theta=_rope(arch, c), bias=bool(c["attention_bias"]), tie_embeddings=bool(c["tie_word_embeddings"]),
      attn_scale=None, init_std=float(c["initializer_range"]))


def family_of_spec(spec: ModelSpec) -> str:
  """'gpt2' or 'llama': the HF family whose layout equals the spec.

  Raises:
    HFFormatError: no supported HF architecture has this layout (the field is named).
  """
  gpt2 = {"norm": "layernorm", "mlp": "gelu", "position": "learned", "bias": True}
  llama = {"norm": "rmsnorm", "mlp": "swiglu", "position": "rope"}
  for family, want in (("gpt2", gpt2), ("llama", llama)):
    if all(getattr(spec, k) == v for k, v in want.items()):
      if family == "gpt2" and spec.kv_heads != spec.n_heads:
        raise HFFormatError(f"GPT2LMHeadModel has no grouped-query attention; got n_kv_heads={spec.n_kv_heads}")
      if family == "gpt2" and spec.attn_scale not in (None, 1.0):
        raise HFFormatError(f"GPT2LMHeadModel scales scores by 1/sqrt(head_dim) or 1; got attn_scale={spec.attn_scale}")
      if family == "llama" and spec.attn_scale is not None:
        raise HFFormatError(f"LlamaForCausalLM scales scores by 1/sqrt(head_dim); got attn_scale={spec.attn_scale}")
      return family
  fields = {k: getattr(spec, k) for k in ("norm", "mlp", "position", "bias")}
  raise HFFormatError(f"no HF architecture has the layout {fields}: GPT-2 is {gpt2}, LLaMA is {llama}")


def hf_config_from_spec(spec: ModelSpec) -> dict[str, Any]:
  """The config.json dict of the HF model with this layout (GPT2LMHeadModel or LlamaForCausalLM).

  LLaMA configs carry both `rope_parameters` (transformers >= 5) and `rope_theta` (older).
  Raises:
    HFFormatError: see `family_of_spec`.
  """
  spec.validate()
  if family_of_spec(spec) == "gpt2":
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": spec.vocab_size,
            "n_positions": spec.max_seq_len, "n_embd": spec.d_model, "n_layer": spec.n_layers,
            "n_head": spec.n_heads, "n_inner": spec.d_ff,
            "activation_function": "gelu_new" if spec.gelu_approximate else "gelu",
            "layer_norm_epsilon": spec.norm_eps, "initializer_range": spec.init_std,
            "scale_attn_weights": spec.attn_scale is None, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "tie_word_embeddings": spec.tie_embeddings,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "dtype": "float32"}
  return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": spec.vocab_size,
          "hidden_size": spec.d_model, "intermediate_size": spec.ffn_dim, "num_hidden_layers": spec.n_layers,
          "num_attention_heads": spec.n_heads, "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_dim,
          "hidden_act": "silu", "max_position_embeddings": spec.max_seq_len, "rms_norm_eps": spec.norm_eps,
          "initializer_range": spec.init_std, "rope_theta": spec.rope_theta,
          "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
          "attention_bias": spec.bias, "mlp_bias": spec.bias, "tie_word_embeddings": spec.tie_embeddings,
          "attention_dropout": 0.0, "dtype": "float32"}
