"""HF config.json -> ModelSpec: supported and refused architectures, and the HF config-class defaults.

Anything the spec cannot express is refused with the reason (see `REFUSED` and the `_parse_*` functions); it is
never approximated. The way back (spec -> config.json) is `parity.hf.export`.

Normal forms, so that config -> spec -> config -> spec is the identity:
  biases    bias = (q/k/v and o and MLP all have biases); qkv_bias / out_bias / mlp_bias are set only where they
            differ from `bias` (Qwen2: bias=False, qkv_bias=True).
  d_head    head_dim for the config classes that hold it as a field of its own (Qwen3, Gemma 1/2/3: default 128 or
            256); for LLaMA, Mistral, Qwen2 None when it equals hidden_size / num_attention_heads.
  layers    layer_types () when every layer is the default kind (all 'sliding' with a window, else all 'full').
  Gemma     attn_scale = query_pre_attn_scalar ** -0.5 (Gemma 2/3; Gemma 1 None: head_dim ** -0.5);
            embed_scale = hidden_size ** 0.5; Gemma 3's rope_local_theta is None when the sliding layers' rotary
            parameters equal the global ones.
"""
from __future__ import annotations

from typing import Any, Mapping

from parity.architecture import ROPE_TYPES
from parity.spec import ModelSpec, SpecError


class HFFormatError(SpecError):
  """A Hugging Face checkpoint or config cannot be read exactly into a ModelSpec + canonical weights."""


ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "GemmaForCausalLM": "gemma",
                 "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}
"""HF `architectures[0]` -> family. Every family but gpt2 uses the LLaMA tensor names (parity.hf.tensors)."""

MODEL_TYPES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM",
               "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
               "gemma3": "Gemma3ForConditionalGeneration"}
"""config.json `model_type` -> architecture, for configs without `architectures`."""

REFUSED = {
    "GPTNeoXForCausalLM": "parallel residual and partial rotary embeddings (rotary_pct)",
    "PhiForCausalLM": "parallel attention/MLP block and partial rotary embeddings",
    "Phi3ForCausalLM": "fused qkv_proj / gate_up_proj tensors and longrope rotary scaling",
    "MixtralForCausalLM": "a mixture-of-experts MLP (block_sparse_moe) has no ModelSpec field",
    "Qwen2MoeForCausalLM": "a mixture-of-experts MLP with a shared expert has no ModelSpec field",
    "Qwen3MoeForCausalLM": "a mixture-of-experts MLP has no ModelSpec field",
    "Gemma3ForConditionalGeneration": ("the multimodal Gemma 3 (vision tower + text model); save the text model "
                                       "as Gemma3ForCausalLM (its text_config) instead"),
    "GPT2Model": "a base model without the LM head; save the GPT2LMHeadModel instead",
    "LlamaModel": "a base model without the LM head; save the LlamaForCausalLM instead",
}
"""Known HF architectures that are refused, with the reason."""

_LLAMA = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
              num_attention_heads=32, num_key_value_heads=None, head_dim=None, hidden_act="silu",
              max_position_embeddings=2048, initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=False,
              attention_bias=False, mlp_bias=False, pretraining_tp=1, attention_dropout=0.0)
_QWEN = dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=32, head_dim=None, hidden_act="silu",
             max_position_embeddings=32768, initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=False,
             use_sliding_window=False, sliding_window=4096, max_window_layers=28, layer_types=None,
             attention_dropout=0.0)
_GEMMA2 = dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
               num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
               max_position_embeddings=8192, initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=True,
               attention_bias=False, attention_dropout=0.0, query_pre_attn_scalar=256, sliding_window=4096,
               layer_types=None, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
               use_bidirectional_attention=None)
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "GPT2LMHeadModel": dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                            activation_function="gelu_new", layer_norm_epsilon=1e-5, initializer_range=0.02,
                            scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                            reorder_and_upcast_attn=False, tie_word_embeddings=True, add_cross_attention=False),
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": {**_LLAMA, "intermediate_size": 14336, "num_key_value_heads": 8,
                           "max_position_embeddings": 4096 * 32, "sliding_window": 4096,
                           "attention_bias": False, "mlp_bias": False},
    "Qwen2ForCausalLM": _QWEN,
    "Qwen3ForCausalLM": {**_QWEN, "head_dim": 128, "attention_bias": False},
    "GemmaForCausalLM": dict(vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                             num_attention_heads=16, num_key_value_heads=16, head_dim=256,
                             hidden_act="gelu_pytorch_tanh", max_position_embeddings=8192, initializer_range=0.02,
                             rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
                             attention_dropout=0.0, use_bidirectional_attention=None),
    "Gemma2ForCausalLM": _GEMMA2,
    "Gemma3ForCausalLM": {**_GEMMA2, "vocab_size": 262208, "max_position_embeddings": 131072,
                          "final_logit_softcapping": None, "attn_logit_softcapping": None,
                          "use_bidirectional_attention": False, "sliding_window_pattern": 6},
}
"""HF config-class defaults (transformers 5.24 GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config,
GemmaConfig, Gemma2Config, Gemma3TextConfig) for keys a config.json omits. Rotary bases: `_DEFAULT_THETA`."""

_DEFAULT_THETA = {"Gemma3ForCausalLM": (1_000_000.0, 10_000.0)}
"""(global, local) rotary base when config.json gives none (Gemma3TextConfig.default_theta); others 10000."""

_SWIGLU = ("silu", "swish")
_TANH_GELU = ("gelu_pytorch_tanh", "gelu_new")


# ----------------------------------------------------------------------------- config.json -> ModelSpec


def parse_hf_config(config: Mapping[str, Any]) -> tuple[str, ModelSpec, list[str]]:
  """Reads an HF config.json dict exactly into a ModelSpec.

  Args:
    config: the parsed config.json of one of `ARCHITECTURES` (keys it omits take the HF config class's default).
  Returns:
    (family, spec, notes): family, a value of `ARCHITECTURES` ('gpt2' names tensors the GPT-2 way, every other
    family the LLaMA way), the validated spec, and human-readable notes on config keys that were accepted but
    have no spec field.
  Raises:
    HFFormatError: unknown or refused architecture, or a key whose value the spec cannot express (named).
  """
  archs = config.get("architectures") or []
  arch = archs[0] if archs else MODEL_TYPES.get(config.get("model_type", ""), "")
  if arch in REFUSED:
    raise HFFormatError(f"config.json: architecture {arch} is not supported: {REFUSED[arch]}")
  if arch not in ARCHITECTURES:
    raise HFFormatError(f"config.json: unknown architecture {arch or config.get('model_type')!r}; supported: "
                        f"{', '.join(ARCHITECTURES)} (refused with a reason: {', '.join(REFUSED)})")
  family = ARCHITECTURES[arch]
  notes: list[str] = []
  c = {**_HF_DEFAULTS[arch], **config}
  spec = _parse_gpt2(c, notes) if family == "gpt2" else _parse_decoder(arch, family, c, notes)
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


def _parse_decoder(arch: str, family: str, c: Mapping[str, Any], notes: list[str]) -> ModelSpec:
  """Every rotary family: LLaMA, Mistral, Qwen2/3, Gemma 1/2/3 (family-specific parts in the helpers below)."""
  d, n = int(c["hidden_size"]), int(c["num_attention_heads"])
  kv = n if c["num_key_value_heads"] is None else int(c["num_key_value_heads"])
  hd = d // n if c.get("head_dim") is None else int(c["head_dim"])
  gemma = family.startswith("gemma")
  own_head_dim = family == "qwen3" or gemma  # a head_dim field with a default of its own, not hidden / heads
  if gemma and c.get("use_bidirectional_attention"):
    raise _refuse(arch, "use_bidirectional_attention", True, "attention is causal in every ModelSpec")
  if int(c.get("pretraining_tp") or 1) != 1:
    notes.append(f"pretraining_tp={c['pretraining_tp']} only splits matmuls in old transformers; ignored")
  if float(c.get("attention_dropout") or 0.0) != 0.0:
    notes.append(f"attention_dropout={c['attention_dropout']} is not applied: ModelSpec has no dropout")
  kw: dict[str, Any] = dict(
      vocab_size=int(c["vocab_size"]), d_model=d, n_layers=int(c["num_hidden_layers"]), n_heads=n,
      n_kv_heads=None if kv == n else kv, d_head=None if d % n == 0 and hd == d // n and not own_head_dim else hd,
      d_ff=int(c["intermediate_size"]), max_seq_len=int(c["max_position_embeddings"]), norm="rmsnorm",
      norm_eps=float(c["rms_norm_eps"]), position="rope", tie_embeddings=bool(c["tie_word_embeddings"]),
      init_std=float(c["initializer_range"]), qk_norm=family in ("qwen3", "gemma3"))
  kw.update(_mlp(arch, family, c))
  kw.update(_biases(family, c))
  kw.update(_windows(arch, family, c, kw["n_layers"], notes))
  kw.update(_rope(arch, c, kw["layer_types"] or (("sliding",) if kw["sliding_window"] is not None else ())))
  if gemma:
    kw.update(_gemma(arch, family, c))
  return ModelSpec(**kw)


def _mlp(arch: str, family: str, c: Mapping[str, Any]) -> dict[str, Any]:
  """SwiGLU (silu) or, for Gemma, GeGLU with the GELU form of hidden_act / hidden_activation."""
  if not family.startswith("gemma"):
    if c["hidden_act"] not in _SWIGLU:
      raise _refuse(arch, "hidden_act", c["hidden_act"], "the SwiGLU MLP uses silu")
    return {"mlp": "swiglu"}
  key = "hidden_act" if family == "gemma" else "hidden_activation"
  act = c[key]
  forms = {**{a: True for a in _TANH_GELU}, "gelu": family == "gemma"}  # GemmaConfig turns legacy 'gelu' into tanh
  if act not in forms:
    raise _refuse(arch, key, act, "GeGLU takes gelu_pytorch_tanh / gelu_new (tanh GELU) or gelu")
  return {"mlp": "geglu", "gelu_approximate": forms[act]}


def _biases(family: str, c: Mapping[str, Any]) -> dict[str, Any]:
  """Per-projection biases in the module's normal form (bias = all three; the others only where they differ)."""
  if family == "qwen2":  # Qwen2Attention: q/k/v bias=True, o_proj bias=False; the MLP has none
    qkv, out, mlp = True, False, False
  elif family == "mistral":  # MistralAttention / MistralMLP: bias=False everywhere
    qkv = out = mlp = False
  else:
    qkv = out = bool(c["attention_bias"])
    mlp = bool(c["mlp_bias"]) if family == "llama" else False
  bias = qkv and out and mlp
  return dict(bias=bias, qkv_bias=None if qkv == bias else qkv, out_bias=None if out == bias else out,
              mlp_bias=None if mlp == bias else mlp)


def _windows(arch: str, family: str, c: Mapping[str, Any], n_layers: int, notes: list[str]) -> dict[str, Any]:
  """sliding_window and layer_types ('full' / 'sliding' per layer, () for the default) from the HF keys."""
  if family in ("llama", "gemma"):
    return {"sliding_window": None, "layer_types": ()}
  if family == "mistral":  # every layer slides (MistralAttention passes config.sliding_window)
    if c.get("layer_types") is not None:
      notes.append("layer_types is ignored by MistralForCausalLM (every layer uses sliding_window); ignored")
    w = c["sliding_window"]
    return {"sliding_window": None if w is None else int(w), "layer_types": ()}
  if family in ("qwen2", "qwen3"):
    w = c["sliding_window"] if c["use_sliding_window"] else None
    default = ["sliding_attention" if w is not None and i >= int(c["max_window_layers"]) else "full_attention"
               for i in range(n_layers)]
  else:
    w = c["sliding_window"]
    every = 2 if family == "gemma2" else int(c.get("sliding_window_pattern") or 6)
    default = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]
  hf_types = c.get("layer_types")
  hf_types = default if hf_types is None else hf_types
  kinds = []
  for t in hf_types:
    if t not in ("full_attention", "sliding_attention"):
      raise _refuse(arch, "layer_types", t, "only full_attention and sliding_attention layers")
    kinds.append(t.removesuffix("_attention"))
  window = None if w is None else int(w)
  plain = ("sliding" if window is not None else "full",) * len(kinds)
  return {"sliding_window": window, "layer_types": () if tuple(kinds) == plain else tuple(kinds)}


def _rope_block(arch: str, key: str, block: Mapping[str, Any], theta: float, max_pos: int
                ) -> tuple[float, dict | None]:
  """(rope_theta, rope_scaling) of one HF rope_parameters / rope_scaling dict, as transformers standardises it."""
  block = dict(block)
  kind = block.pop("rope_type", None) or block.pop("type", None) or "default"
  block.pop("type", None)
  theta = float(block.pop("rope_theta", None) or theta)
  partial = block.pop("partial_rotary_factor", None)
  if partial not in (None, 1, 1.0):
    raise _refuse(arch, f"{key}.partial_rotary_factor", partial, "partial rotary embeddings have no spec field")
  nested = [k for k, v in block.items() if isinstance(v, Mapping)]
  if nested:
    raise _refuse(arch, f"{key}.{nested[0]}", block[nested[0]], "rotary parameters per layer type are read for "
                  "Gemma3ForCausalLM only")
  if kind == "default":
    return theta, None
  if kind not in ROPE_TYPES:
    raise _refuse(arch, f"{key}.rope_type", kind, f"rotary scaling types: default, {', '.join(ROPE_TYPES)}")
  scaling = {"rope_type": kind, **{k: v for k, v in block.items() if v is not None or k == "truncate"}}
  if kind in ("llama3", "yarn"):
    scaling.setdefault("original_max_position_embeddings", max_pos)
  if "truncate" in scaling and scaling["truncate"] is None:  # transformers: `if truncate:`
    scaling["truncate"] = False
  return theta, scaling


def _rope(arch: str, c: Mapping[str, Any], kinds: tuple[str, ...]) -> dict[str, Any]:
  """rope_theta / rope_scaling / rope_local_theta from transformers>=5 `rope_parameters` (Gemma 3: per layer type)
  or the older top-level `rope_theta`, `rope_scaling` (and Gemma 3's `rope_local_base_freq`)."""
  max_pos = int(c["max_position_embeddings"])
  glob, local = _DEFAULT_THETA.get(arch, (10_000.0, None))
  theta = c.get("rope_theta") or glob
  if arch != "Gemma3ForCausalLM":  # transformers: rope_scaling, if given, replaces rope_parameters
    key = "rope_scaling" if c.get("rope_scaling") else "rope_parameters"
    theta, scaling = _rope_block(arch, key, c.get(key) or {}, theta, max_pos)
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": None}
  params = c.get("rope_parameters") or {}
  if params and not {"full_attention", "sliding_attention"} & set(params):
    raise _refuse(arch, "rope_parameters", params, "Gemma 3 nests them per layer type ({'full_attention': {...}, "
                  "'sliding_attention': {...}}); transformers ignores a flat dict here")
  full = {**(params.get("full_attention") or {}), **(c.get("rope_scaling") or {})}
  theta, scaling = _rope_block(arch, "rope_parameters.full_attention", full, theta, max_pos)
  local_theta, local_scaling = _rope_block(arch, "rope_parameters.sliding_attention",
                                           params.get("sliding_attention") or {},
                                           c.get("rope_local_base_freq") or local, max_pos)
  if "sliding" not in kinds or (local_theta, local_scaling) == (theta, scaling):
    local_theta = None
  elif local_scaling is not None:
    raise _refuse(arch, "rope_parameters.sliding_attention.rope_type", local_scaling["rope_type"],
                  "sliding layers with a rotary scaling of their own have no spec field (rope_local_theta is plain)")
  return {"rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": local_theta}


def _gemma(arch: str, family: str, c: Mapping[str, Any]) -> dict[str, Any]:
  """Gemma's (1 + w) RMSNorm, sqrt(hidden_size) embedding scale, and Gemma 2/3's post-norms, score scale and caps."""
  kw: dict[str, Any] = dict(norm_plus_one=True, embed_scale=int(c["hidden_size"]) ** 0.5)
  if family == "gemma":
    return kw
  q = c["query_pre_attn_scalar"]
  if isinstance(q, bool) or not isinstance(q, (int, float)) or not q > 0:
    raise _refuse(arch, "query_pre_attn_scalar", q, "the attention scale is query_pre_attn_scalar ** -0.5 > 0")
  caps = {}
  for ours, theirs in (("attn_softcap", "attn_logit_softcapping"), ("final_softcap", "final_logit_softcapping")):
    caps[ours] = None if c[theirs] is None else float(c[theirs])
  return {**kw, **caps, "post_norms": True, "attn_scale": q ** -0.5}
