"""HF config.json -> ModelSpec: supported (parity.hf.families: one row per family, its config-class defaults) and
refused architectures.

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

import math
import re
from typing import Any, Mapping

from parity.architecture import ROPE_TYPES
from parity.hf.families import FAMILIES, by_class, by_name
from parity.spec import ModelSpec, SpecError


class HFFormatError(SpecError):
  """A Hugging Face checkpoint or config cannot be read exactly into a ModelSpec + canonical weights."""


ARCHITECTURES = {f.hf_class: f.name for f in FAMILIES}
"""HF `architectures[0]` -> family (parity.hf.families). Every family but gpt2 uses the LLaMA tensor names
(parity.hf.tensors)."""

MODEL_TYPES = {**{f.model_type: f.hf_class for f in FAMILIES}, "gemma3": "Gemma3ForConditionalGeneration"}
"""config.json `model_type` -> architecture, for configs without `architectures`: each family's (parity.hf.families),
and the multimodal Gemma 3's, which `REFUSED` names."""

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

_SWIGLU = ("silu", "swish")
_TANH_GELU = ("gelu_pytorch_tanh", "gelu_new")


# ----------------------------------------------------------------------------- typed config.json values


class _Config(dict):
  """config.json over the HF class defaults, each value read with its type checked (transformers' strict config
  classes refuse the same values): a wrong type is an HFFormatError naming config.json, the key, the value and what
  it must be, never a coercion ("false" is not False, 8.5 is not 8) or an internal error."""

  def __init__(self, arch: str, defaults: Mapping[str, Any], given: Mapping[str, Any]):
    super().__init__({**defaults, **given})
    self.arch, self.given = arch, set(given)
    self.max_params, self.limit_why = None, ""

  def check_size(self, spec: ModelSpec, layers_key: str, width_key: str) -> None:
    """Refuses a model of more than max_params parameters, from the sizing code's per-layer count (cheap for any
    depth; `spec` need not hold its per-layer fields yet)."""
    if self.max_params is None:
      return
    from parity.sizing.resources import _param_count
    try:
      params = _param_count(spec)
    except Exception:
      return
    if params > self.max_params:
      raise HFFormatError(f"config.json ({self.arch}): describes a model of {params:,} parameters ({layers_key}="
                          f"{spec.n_layers:,}, {width_key}={spec.d_model:,}), more than {self.max_params:,}"
                          f"{self.limit_why}; check the config's sizes")

  def bad(self, key: str, value: Any, expected: str) -> HFFormatError:
    """The refusal of `key`'s value (`key` may be dotted into a nested block)."""
    default = "" if key.split(".")[0] in self.given else f" (config.json omits it: the {self.arch} default)"
    return HFFormatError(f"config.json ({self.arch}): {key}={value!r}{default} must be {expected}")

  def int(self, key: str, low: int = 1, *, none: bool = False) -> int | None:
    """An integer >= low (None allowed when `none`)."""
    v = self.get(key)
    if none and v is None:
      return None
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
      raise self.bad(key, v, f"an integer >= {low}" + (" or null" if none else ""))
    return v

  def num(self, key: str, *, low: float = 0.0, strict: bool = True, none: bool = False, value: Any = ...,
          ) -> float | None:
    """A finite number > low (>= low unless `strict`); `value` checks a value read from a nested block."""
    v = self.get(key) if value is ... else value
    if none and v is None:
      return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not (
        v > low if strict else v >= low):
      raise self.bad(key, v, f"a number {'>' if strict else '>='} {low:g}" + (" or null" if none else ""))
    return float(v)

  def bool(self, key: str) -> bool:
    v = self.get(key)
    if not isinstance(v, bool):
      raise self.bad(key, v, "true or false")
    return v

  def str(self, key: str) -> str:
    v = self.get(key)
    if not isinstance(v, str):
      raise self.bad(key, v, "a string")
    return v

  def dict(self, key: str) -> dict:
    """A JSON object ({} for null)."""
    v = self.get(key)
    if v is not None and not isinstance(v, Mapping):
      raise self.bad(key, v, "an object (or null)")
    return dict(v or {})


# ----------------------------------------------------------------------------- config.json -> ModelSpec


def parse_hf_config(config: Mapping[str, Any], *, max_params: int | None = None,
                    limit_why: str = "") -> tuple[str, ModelSpec, list[str]]:
  """Reads an HF config.json dict exactly into a ModelSpec.

  Args:
    config: the parsed config.json of one of `ARCHITECTURES` (keys it omits take the HF config class's default).
    max_params: refuse a model of more parameters (counted per layer, parity.sizing.resources, before anything per
      layer is built: num_hidden_layers=10^9 took 258 s and 8.5 GB to refuse), saying `limit_why`; None: no limit.
  Returns:
    (family, spec, notes): family, a value of `ARCHITECTURES` ('gpt2' names tensors the GPT-2 way, every other
    family the LLaMA way), the validated spec, and human-readable notes on config keys that were accepted but
    have no spec field.
  Raises:
    HFFormatError: unknown or refused architecture, or a key whose value the spec cannot express (named).
  """
  archs = config.get("architectures") or []
  if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
    raise HFFormatError(f"config.json: architectures={archs!r} must be a list of class names, e.g. "
                        "[\"LlamaForCausalLM\"]")
  model_type = config.get("model_type", "")
  arch = archs[0] if archs else MODEL_TYPES.get(model_type, "") if isinstance(model_type, str) else ""
  typed = MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
  if archs and typed and typed != arch:  # transformers' Auto classes build the model from model_type
    raise HFFormatError(f"config.json: model_type {model_type!r} (a {typed}) contradicts architectures[0] {arch!r}; "
                        "transformers' AutoModelForCausalLM builds the model model_type names: correct whichever "
                        "of the two is wrong")
  if arch in REFUSED:
    raise HFFormatError(f"config.json: architecture {arch} is not supported: {REFUSED[arch]}")
  if arch not in ARCHITECTURES:
    raise HFFormatError(f"config.json: unknown architecture {arch or config.get('model_type')!r}; supported: "
                        f"{', '.join(ARCHITECTURES)} (refused with a reason: {', '.join(REFUSED)})")
  family = ARCHITECTURES[arch]
  notes: list[str] = []
  c = _Config(arch, by_class(arch).defaults, config)
  c.max_params, c.limit_why = max_params, limit_why
  spec = _parse_gpt2(c, notes) if family == "gpt2" else _parse_decoder(arch, family, c, notes)
  try:
    return family, spec.validate(), notes
  except SpecError as exc:
    raise HFFormatError(f"config.json ({arch}): {_hf_keys(str(exc), family)}") from None


_HF_KEYS = {"n_kv_heads": "num_key_value_heads", "n_heads": "num_attention_heads", "d_model": "hidden_size",
            "n_layers": "num_hidden_layers", "d_ff": "intermediate_size", "max_seq_len": "max_position_embeddings",
            "vocab_size": "vocab_size", "d_head": "head_dim", "sliding_window": "sliding_window",
            "layer_types": "layer_types", "rope_scaling": "rope_parameters", "rope_local_theta": "rope_local_base_freq"}
_GPT2_KEYS = {"n_heads": "n_head", "d_model": "n_embd", "n_layers": "n_layer", "d_ff": "n_inner",
              "max_seq_len": "n_positions", "vocab_size": "vocab_size"}


def _hf_keys(message: str, family: str) -> str:
  """A spec validation message with each model.<field> named by its config.json key first."""
  keys = _GPT2_KEYS if family == "gpt2" else _HF_KEYS
  return re.sub(r"model\.(\w+)", lambda m: f"{keys[m[1]]} (model.{m[1]})" if m[1] in keys else m[0], message)


def spec_from_hf_config(config: Mapping[str, Any]) -> ModelSpec:
  """The ModelSpec of an HF config.json dict; see `parse_hf_config`."""
  return parse_hf_config(config)[1]


def _refuse(arch: str, key: str, value: Any, why: str) -> HFFormatError:
  return HFFormatError(f"config.json ({arch}): {key}={value!r} is not supported: {why}")


def _parse_gpt2(c: _Config, notes: list[str]) -> ModelSpec:
  arch = by_name("gpt2").hf_class
  act = c.str("activation_function")
  approx = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}
  if act not in approx:
    raise _refuse(arch, "activation_function", act, "only gelu_new, gelu_pytorch_tanh (tanh GELU) and gelu (erf)")
  if c.bool("scale_attn_by_inverse_layer_idx"):
    raise _refuse(arch, "scale_attn_by_inverse_layer_idx", True,
                  "a per-layer 1/(layer+1) score scale has no spec field")
  if c.bool("add_cross_attention"):
    raise _refuse(arch, "add_cross_attention", True, "cross-attention layers are not part of a decoder-only GPT")
  if c.bool("reorder_and_upcast_attn"):
    notes.append("reorder_and_upcast_attn=true only changes fp16/bf16 rounding; fp32 attention is the same")
  spec = ModelSpec(
      vocab_size=c.int("vocab_size"), d_model=c.int("n_embd"), n_layers=c.int("n_layer"),
      n_heads=c.int("n_head"), n_kv_heads=None, d_ff=c.int("n_inner", none=True),
      max_seq_len=c.int("n_positions"), norm="layernorm", norm_eps=c.num("layer_norm_epsilon"), mlp="gelu",
      gelu_approximate=approx[act], position="learned", bias=True, tie_embeddings=c.bool("tie_word_embeddings"),
      attn_scale=None if c.bool("scale_attn_weights") else 1.0, init_std=c.num("initializer_range", strict=False))
  c.check_size(spec, "n_layer", "n_embd")
  return spec


def _parse_decoder(arch: str, family: str, c: _Config, notes: list[str]) -> ModelSpec:
  """Every rotary family: LLaMA, Mistral, Qwen2/3, Gemma 1/2/3 (family-specific parts in the helpers below)."""
  d, n = c.int("hidden_size"), c.int("num_attention_heads")
  kv = c.int("num_key_value_heads", none=True) or n
  if n % kv:
    raise c.bad("num_key_value_heads", kv, f"a divisor of num_attention_heads ({n})")
  hd = c.int("head_dim", none=True) or d // n
  gemma = family.startswith("gemma")
  own_head_dim = family == "qwen3" or gemma  # a head_dim field with a default of its own, not hidden / heads
  if gemma and c.get("use_bidirectional_attention") is not None and c.bool("use_bidirectional_attention"):
    raise _refuse(arch, "use_bidirectional_attention", True, "attention is causal in every ModelSpec")
  if "pretraining_tp" in c and c.int("pretraining_tp") != 1:
    notes.append(f"pretraining_tp={c['pretraining_tp']} only splits matmuls in old transformers; ignored")
  if "attention_dropout" in c and c.num("attention_dropout", strict=False) != 0.0:
    notes.append(f"attention_dropout={c['attention_dropout']} is not applied: ModelSpec has no dropout")
  kw: dict[str, Any] = dict(
      vocab_size=c.int("vocab_size"), d_model=d, n_layers=c.int("num_hidden_layers"), n_heads=n,
      n_kv_heads=None if kv == n else kv, d_head=None if d % n == 0 and hd == d // n and not own_head_dim else hd,
      d_ff=c.int("intermediate_size"), max_seq_len=c.int("max_position_embeddings"), norm="rmsnorm",
      norm_eps=c.num("rms_norm_eps"), position="rope", tie_embeddings=c.bool("tie_word_embeddings"),
      init_std=c.num("initializer_range", strict=False), qk_norm=family in ("qwen3", "gemma3"))
  kw.update(_mlp(arch, family, c))
  kw.update(_biases(family, c))
  if gemma:
    kw.update(_gemma(arch, family, c))
  c.check_size(ModelSpec(**kw), "num_hidden_layers", "hidden_size")  # before the per-layer lists of _windows
  kw.update(_windows(arch, family, c, kw["n_layers"], notes))
  kw.update(_rope(arch, c, kw["layer_types"] or (("sliding",) if kw["sliding_window"] is not None else ())))
  return ModelSpec(**kw)


def _mlp(arch: str, family: str, c: _Config) -> dict[str, Any]:
  """SwiGLU (silu) or, for Gemma, GeGLU with the GELU form of hidden_act / hidden_activation."""
  if not family.startswith("gemma"):
    if c.str("hidden_act") not in _SWIGLU:
      raise _refuse(arch, "hidden_act", c["hidden_act"], "the SwiGLU MLP uses silu")
    return {"mlp": "swiglu"}
  key = "hidden_act" if family == "gemma" else "hidden_activation"
  act = c.str(key)
  forms = {**{a: True for a in _TANH_GELU}, "gelu": family == "gemma"}  # GemmaConfig turns legacy 'gelu' into tanh
  if act not in forms:
    raise _refuse(arch, key, act, "GeGLU takes gelu_pytorch_tanh / gelu_new (tanh GELU) or gelu")
  return {"mlp": "geglu", "gelu_approximate": forms[act]}


def _biases(family: str, c: _Config) -> dict[str, Any]:
  """Per-projection biases in the module's normal form (bias = all three; the others only where they differ)."""
  if family == "qwen2":  # Qwen2Attention: q/k/v bias=True, o_proj bias=False; the MLP has none
    qkv, out, mlp = True, False, False
  elif family == "mistral":  # MistralAttention / MistralMLP: bias=False everywhere
    qkv = out = mlp = False
  else:
    qkv = out = c.bool("attention_bias")
    mlp = c.bool("mlp_bias") if family == "llama" else False
  bias = qkv and out and mlp
  return dict(bias=bias, qkv_bias=None if qkv == bias else qkv, out_bias=None if out == bias else out,
              mlp_bias=None if mlp == bias else mlp)


def _windows(arch: str, family: str, c: _Config, n_layers: int, notes: list[str]) -> dict[str, Any]:
  """sliding_window and layer_types ('full' / 'sliding' per layer, () for the default) from the HF keys."""
  if family in ("llama", "gemma"):
    return {"sliding_window": None, "layer_types": ()}
  w = c.int("sliding_window", none=True)
  if family == "mistral":  # every layer slides (MistralAttention passes config.sliding_window) ...
    default = ["sliding_attention" if w is not None else "full_attention"] * n_layers
    if "layer_types" in c.given:  # ... but AutoConfig loads a mistral config with layer_types as MinistralConfig
      notes.append("layer_types is read as transformers' AutoConfig / AutoModelForCausalLM read it (a mistral "
                   "config with layer_types loads as Ministral, whose layers follow layer_types; "
                   "MistralForCausalLM.from_pretrained itself would slide every layer)")
  elif family in ("qwen2", "qwen3"):
    if not c.bool("use_sliding_window"):  # Qwen2Config / Qwen3Config: sliding_window = None then
      w = None
    lo = c.int("max_window_layers", 0)
    default = ["sliding_attention" if w is not None and i >= lo else "full_attention" for i in range(n_layers)]
  else:
    every = 2 if family == "gemma2" else c.int("sliding_window_pattern", none=True) or 6
    default = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]
  hf_types = default if c.get("layer_types") is None else c.get("layer_types")
  if not isinstance(hf_types, list):
    raise c.bad("layer_types", hf_types, "a list of 'full_attention' / 'sliding_attention', one per layer")
  if len(hf_types) != n_layers:  # transformers' validate_layer_type refuses it (a short all-sliding list slid all)
    raise HFFormatError(f"config.json ({arch}): layer_types has {len(hf_types)} entries but num_hidden_layers is "
                        f"{n_layers}; give one layer type per layer (transformers refuses this config too)")
  kinds = []
  for t in hf_types:
    if t not in ("full_attention", "sliding_attention"):
      raise _refuse(arch, "layer_types", t, "only full_attention and sliding_attention layers")
    kinds.append(t.removesuffix("_attention"))
  if "sliding" in kinds and w is None:
    why = (f"use_sliding_window=false (sliding_window={c.get('sliding_window')!r} is then dropped by "
           f"transformers' config and its forward fails on the sliding layers); set use_sliding_window=true"
           if family in ("qwen2", "qwen3") else "sliding_window is null; give the window")
    raise HFFormatError(f"config.json ({arch}): layer_types has sliding_attention layers, but {why}, or make "
                        "them full_attention")
  plain = ("sliding" if w is not None else "full",) * len(kinds)
  return {"sliding_window": w, "layer_types": () if tuple(kinds) == plain else tuple(kinds)}


def _rope_block(c: _Config, key: str, block: Any, theta: float, max_pos: int) -> tuple[float, dict | None]:
  """(rope_theta, rope_scaling) of one HF rope_parameters / rope_scaling dict, as transformers standardises it."""
  arch = c.arch
  if not isinstance(block, Mapping):
    raise c.bad(key, block, "an object (or null)")
  block = dict(block)
  kind = block.pop("rope_type", None) or block.pop("type", None) or "default"
  block.pop("type", None)
  if block.get("rope_theta") is not None:
    theta = c.num(f"{key}.rope_theta", value=block["rope_theta"])
  block.pop("rope_theta", None)
  partial = block.pop("partial_rotary_factor", None)
  if partial not in (None, 1, 1.0):
    raise _refuse(arch, f"{key}.partial_rotary_factor", partial, "partial rotary embeddings have no spec field")
  nested = [k for k, v in block.items() if isinstance(v, Mapping)]
  if nested:
    raise _refuse(arch, f"{key}.{nested[0]}", block[nested[0]], "rotary parameters per layer type are read for "
                  "Gemma3ForCausalLM only")
  if kind == "default":
    return theta, None
  if not isinstance(kind, str) or kind not in ROPE_TYPES:
    raise _refuse(arch, f"{key}.rope_type", kind, f"rotary scaling types: default, {', '.join(ROPE_TYPES)}")
  scaling = {"rope_type": kind, **{k: v for k, v in block.items() if v is not None or k == "truncate"}}
  if kind in ("llama3", "yarn"):
    scaling.setdefault("original_max_position_embeddings", max_pos)
  if "truncate" in scaling and scaling["truncate"] is None:  # transformers: `if truncate:`
    scaling["truncate"] = False
  for k, v in scaling.items():
    if k == "truncate" and not isinstance(v, bool):
      raise c.bad(f"{key}.truncate", v, "true or false")
    if k not in ("rope_type", "truncate"):
      c.num(f"{key}.{k}", value=v)
  return theta, scaling


def _rope(arch: str, c: _Config, kinds: tuple[str, ...]) -> dict[str, Any]:
  """rope_theta / rope_scaling / rope_local_theta from transformers>=5 `rope_parameters` (Gemma 3: per layer type)
  or the older top-level `rope_theta`, `rope_scaling` (and Gemma 3's `rope_local_base_freq`)."""
  max_pos = c.int("max_position_embeddings")
  glob, local = by_class(arch).default_theta
  theta = glob if c.get("rope_theta") is None else c.num("rope_theta")
  if arch != by_name("gemma3").hf_class:  # transformers: rope_scaling, if given, replaces rope_parameters
    key = "rope_scaling" if c.get("rope_scaling") else "rope_parameters"
    theta, scaling = _rope_block(c, key, c.dict(key), theta, max_pos)
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": None}
  params = c.dict("rope_parameters")
  if params and not {"full_attention", "sliding_attention"} & set(params):
    raise _refuse(arch, "rope_parameters", params, "Gemma 3 nests them per layer type ({'full_attention': {...}, "
                  "'sliding_attention': {...}}); transformers ignores a flat dict here")
  full_params = params.get("full_attention") or {}
  if not isinstance(full_params, Mapping):
    raise c.bad("rope_parameters.full_attention", full_params, "an object (or null)")
  full = {**full_params, **c.dict("rope_scaling")}
  theta, scaling = _rope_block(c, "rope_parameters.full_attention", full, theta, max_pos)
  local_theta = local if c.get("rope_local_base_freq") is None else c.num("rope_local_base_freq")
  local_theta, local_scaling = _rope_block(c, "rope_parameters.sliding_attention",
                                           params.get("sliding_attention") or {}, local_theta, max_pos)
  if "sliding" not in kinds or (local_theta, local_scaling) == (theta, scaling):
    local_theta = None
  elif local_scaling is not None:
    raise _refuse(arch, "rope_parameters.sliding_attention.rope_type", local_scaling["rope_type"],
                  "sliding layers with a rotary scaling of their own have no spec field (rope_local_theta is plain)")
  return {"rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": local_theta}


def _gemma(arch: str, family: str, c: _Config) -> dict[str, Any]:
  """Gemma's (1 + w) RMSNorm, sqrt(hidden_size) embedding scale, and Gemma 2/3's post-norms, score scale and caps."""
  kw: dict[str, Any] = dict(norm_plus_one=True, embed_scale=c.int("hidden_size") ** 0.5)
  if family == "gemma":
    return kw
  q = c["query_pre_attn_scalar"]
  if isinstance(q, bool) or not isinstance(q, (int, float)) or not q > 0:
    raise _refuse(arch, "query_pre_attn_scalar", q, "the attention scale is query_pre_attn_scalar ** -0.5 > 0")
  caps = {}
  for ours, theirs in (("attn_softcap", "attn_logit_softcapping"), ("final_softcap", "final_logit_softcapping")):
    caps[ours] = c.num(theirs, none=True)
  return {**kw, **caps, "post_norms": True, "attn_scale": q ** -0.5}
