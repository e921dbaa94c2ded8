"""Hugging Face checkpoints <-> ModelSpec and canonical weights (numpy + safetensors only).

Two families are read and written:

  gpt2   GPT2LMHeadModel: LayerNorm, GELU MLP, learned positions, biases, tied head.
         HF stores linear weights as Conv1D [in, out]; `c_attn` is q|k|v fused by columns.
  llama  LlamaForCausalLM (and MistralForCausalLM, same tensors): RMSNorm, SwiGLU, rotary
         positions (HF rotate-half layout, which both our models use, so no permutation),
         grouped-query attention, untied head, no biases. Linear weights are [out, in].

Anything the spec cannot express is refused with the reason (see `REFUSED` and the
`_parse_*` functions); it is never approximated. Every tensor goes through one table of
rules (`hf_rules`), which gives HF names, shapes and the transposes in one place:

  GPT-2 (HF)                          canonical                 op
  transformer.wte.weight [V, D]       wte.weight                copy
  transformer.wpe.weight [P, D]       wpe.weight                copy
  transformer.h.i.ln_1.{weight,bias}  h.i.ln_1.*                copy
  transformer.h.i.attn.c_attn.weight  h.i.attn.qkv.weight       transpose [D, 3D] -> [3D, D]
  transformer.h.i.attn.c_proj.weight  h.i.attn.proj.weight      transpose
  transformer.h.i.mlp.c_fc.weight     h.i.mlp.fc.weight         transpose [D, F] -> [F, D]
  transformer.h.i.mlp.c_proj.weight   h.i.mlp.proj.weight       transpose [F, D] -> [D, F]
  transformer.ln_f.*                  ln_f.*                    copy
  LLaMA (HF)                          canonical                 op
  model.embed_tokens.weight           wte.weight                copy
  model.layers.i.input_layernorm      h.i.ln_1.weight           copy
  model.layers.i.self_attn.{q,k,v}_proj.weight  h.i.attn.qkv.weight  rows concatenated q|k|v
  model.layers.i.self_attn.o_proj     h.i.attn.proj.weight      copy
  model.layers.i.post_attention_layernorm  h.i.ln_2.weight      copy
  model.layers.i.mlp.{gate,up,down}_proj  h.i.mlp.{gate,up,proj}.weight  copy
  model.norm.weight                   ln_f.weight               copy
  lm_head.weight                      lm_head.weight            copy (absent when tied)
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from parity import weights
from parity.spec import ModelSpec, RunSpec, SpecError, from_dict, to_dict

__all__ = [
    "HFFormatError", "Rule", "ARCHITECTURES", "REFUSED", "MODEL_PRESETS", "PUBLISHED_PARAM_COUNTS", "HFCheckpoint",
    "spec_from_hf_config", "parse_hf_config", "hf_config_from_spec", "family_of_spec", "hf_rules",
    "hf_to_canonical", "canonical_to_hf", "read_safetensors", "hf_weight_files", "load_hf_checkpoint",
    "save_hf_checkpoint", "canonical_metadata", "spec_from_metadata", "save_canonical", "load_canonical",
    "run_spec_from_hf", "SPEC_METADATA_KEY",
]


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

SPEC_METADATA_KEY = "parity_model_spec"
"""safetensors metadata key of a canonical file holding the ModelSpec as JSON (one key: header order is stable)."""

# Tensors in older HF checkpoints that are buffers, not parameters: dropped with the reason.
_IGNORED = {
    "gpt2": [(re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$"), "causal-mask buffer of old GPT-2 checkpoints")],
    "llama": [(re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$"),
               "rotary frequency buffer; recomputed from rope_theta")],
}
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


# ----------------------------------------------------------------------------- presets

MODEL_PRESETS: dict[str, ModelSpec] = {
    # OpenAI GPT-2 (Radford et al. 2019), HF gpt2 / gpt2-medium / gpt2-large / gpt2-xl.
    "gpt2-124m": ModelSpec(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, max_seq_len=1024),
    "gpt2-355m": ModelSpec(vocab_size=50257, d_model=1024, n_layers=24, n_heads=16, max_seq_len=1024),
    "gpt2-774m": ModelSpec(vocab_size=50257, d_model=1280, n_layers=36, n_heads=20, max_seq_len=1024),
    "gpt2-1.5b": ModelSpec(vocab_size=50257, d_model=1600, n_layers=48, n_heads=25, max_seq_len=1024),
    # meta-llama/Llama-3.2-1B: tied head, GQA 32/8, theta 5e5. Its config also has rope_scaling
    # (rope_type 'llama3'), which only changes positions beyond 8192; the dims here are exact.
    "llama-1b": ModelSpec(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192,
                          max_seq_len=8192, norm="rmsnorm", norm_eps=1e-5, mlp="swiglu", position="rope",
                          rope_theta=500000.0, bias=False, tie_embeddings=True),
    # meta-llama/Llama-2-{7b,13b,70b}-hf (Touvron et al. 2023, table 1); 70B uses GQA with 8 kv heads.
    "llama-7b": ModelSpec(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, d_ff=11008, max_seq_len=4096,
                          norm="rmsnorm", norm_eps=1e-5, mlp="swiglu", position="rope", bias=False,
                          tie_embeddings=False),
    "llama-13b": ModelSpec(vocab_size=32000, d_model=5120, n_layers=40, n_heads=40, d_ff=13824, max_seq_len=4096,
                           norm="rmsnorm", norm_eps=1e-5, mlp="swiglu", position="rope", bias=False,
                           tie_embeddings=False),
    "llama-70b": ModelSpec(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672,
                           max_seq_len=4096, norm="rmsnorm", norm_eps=1e-5, mlp="swiglu", position="rope",
                           bias=False, tie_embeddings=False),
}
"""Real model sizes as ModelSpecs, for `parity estimate` / `parity plan`."""

PUBLISHED_PARAM_COUNTS = {
    "gpt2-124m": 124_439_808, "gpt2-355m": 354_823_168, "gpt2-774m": 774_030_080, "gpt2-1.5b": 1_557_611_200,
    "llama-1b": 1_235_814_400, "llama-7b": 6_738_415_616, "llama-13b": 13_015_864_320,
    "llama-70b": 68_976_648_192,
}
"""Parameter counts as published (HF model cards / `num_parameters()`, tied head counted once)."""


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


# ----------------------------------------------------------------------------- tensor naming


@dataclasses.dataclass(frozen=True, slots=True)
class Rule:
  """One canonical tensor and the HF tensor(s) it comes from.

  Attributes:
    canonical: canonical name (parity.weights).
    hf: HF names; several are concatenated along axis 0 in this order (LLaMA q|k|v).
    rows: row count of each HF part when there are several, else ().
    transpose: the single HF tensor is the transpose of the canonical one (GPT-2 Conv1D [in, out]).
  """
  canonical: str
  hf: tuple[str, ...]
  rows: tuple[int, ...] = ()
  transpose: bool = False

  def hf_shapes(self, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Expected HF shapes given the canonical shape."""
    if self.rows:
      return [(r, *shape[1:]) for r in self.rows]
    return [tuple(reversed(shape)) if self.transpose else shape]


def hf_rules(spec: ModelSpec, family: str) -> list[Rule]:
  """The mapping of every canonical tensor of `spec` to HF names, in canonical order.

  GPT-2 names carry the `transformer.` prefix that `save_pretrained` writes; unprefixed
  names (the original OpenAI upload) are accepted by `hf_to_canonical`.
  """
  rules = []
  hd = spec.head_dim
  for name in weights.param_shapes(spec):
    if family == "gpt2":
      rules.append(_gpt2_rule(name))
    else:
      rules.append(_llama_rule(name, (spec.n_heads * hd, spec.kv_heads * hd, spec.kv_heads * hd)))
  return rules


_GPT2_CONV1D = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
_GPT2_RENAME = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}


def _gpt2_rule(name: str) -> Rule:
  if name == "lm_head.weight":
    return Rule(name, (name,))
  hf = name
  for ours, theirs in _GPT2_RENAME.items():
    hf = hf.replace(f".{ours}.", f".{theirs}.")
  conv = name.endswith(".weight") and any(f".{m}." in name for m in _GPT2_CONV1D)
  return Rule(name, (f"transformer.{hf}",), transpose=conv)


_LLAMA_LAYER = {"ln_1.weight": "input_layernorm.weight", "ln_2.weight": "post_attention_layernorm.weight",
                "attn.proj.weight": "self_attn.o_proj.weight", "attn.proj.bias": "self_attn.o_proj.bias",
                "mlp.gate.weight": "mlp.gate_proj.weight", "mlp.gate.bias": "mlp.gate_proj.bias",
                "mlp.up.weight": "mlp.up_proj.weight", "mlp.up.bias": "mlp.up_proj.bias",
                "mlp.proj.weight": "mlp.down_proj.weight", "mlp.proj.bias": "mlp.down_proj.bias"}


def _llama_rule(name: str, qkv_rows: tuple[int, int, int]) -> Rule:
  top = {"wte.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight",
         "lm_head.weight": "lm_head.weight"}
  if name in top:
    return Rule(name, (top[name],))
  _, i, rest = name.split(".", 2)
  p = f"model.layers.{i}"
  if rest.startswith("attn.qkv."):
    leaf = rest.rsplit(".", 1)[1]
    return Rule(name, tuple(f"{p}.self_attn.{x}_proj.{leaf}" for x in "qkv"), rows=qkv_rows)
  if rest not in _LLAMA_LAYER:
    raise HFFormatError(f"canonical tensor {name!r} has no LLaMA counterpart")
  return Rule(name, (f"{p}.{_LLAMA_LAYER[rest]}",))


def _normalise_names(tensors: Mapping[str, np.ndarray], family: str) -> dict[str, np.ndarray]:
  """Adds the `transformer.` prefix to unprefixed GPT-2 names; other names are kept."""
  if family != "gpt2":
    return dict(tensors)
  out = {}
  for k, v in tensors.items():
    out[k if k.startswith("transformer.") or k == "lm_head.weight" else f"transformer.{k}"] = v
  return out


def hf_to_canonical(tensors: Mapping[str, np.ndarray], spec: ModelSpec, family: str,
                    *, notes: list[str] | None = None) -> dict[str, np.ndarray]:
  """HF state dict (numpy, any float dtype) -> canonical float32 weights.

  Args:
    tensors: HF name -> array, e.g. from `read_safetensors`; weights [out, in] (LLaMA) or
      Conv1D [in, out] (GPT-2). A tied checkpoint may include or omit `lm_head.weight`.
    spec: the spec from the same checkpoint's config.json.
    family: 'gpt2' or 'llama'.
    notes: if given, receives one line per dropped buffer kind.
  Returns:
    Canonical name -> float32 C-contiguous array, in canonical order.
  Raises:
    HFFormatError: a tensor is missing, unexpected or misshapen (each named, with the
      expected shape), or a tied checkpoint's lm_head differs from its embedding.
  """
  src = _normalise_names(tensors, family)
  dropped: dict[str, int] = {}
  for k in list(src):
    bare = k.removeprefix("transformer.")
    for pattern, why in _IGNORED[family]:
      if pattern.match(bare):
        del src[k]
        dropped[why] = dropped.get(why, 0) + 1
  if notes is not None:
    notes.extend(f"dropped {n} tensor(s): {why}" for why, n in dropped.items())
  if spec.tie_embeddings and "lm_head.weight" in src:
    head = src.pop("lm_head.weight")
    wte = src.get("transformer.wte.weight" if family == "gpt2" else "model.embed_tokens.weight")
    if wte is not None and not (head.shape == wte.shape and np.array_equal(head, wte)):
      raise HFFormatError("lm_head.weight differs from the token embedding, but config.json has "
                          "tie_word_embeddings=true; set it to false if the head is untied")
  rules = hf_rules(spec, family)
  shapes = weights.param_shapes(spec)
  expected = {h: s for r in rules for h, s in zip(r.hf, r.hf_shapes(shapes[r.canonical]))}
  missing = [k for k in expected if k not in src]
  extra = sorted(k for k in src if k not in expected)
  wrong = [f"{k}: {tuple(src[k].shape)} (expected {expected[k]})" for k in expected
           if k in src and tuple(src[k].shape) != expected[k]]
  problems = []
  for label, items in (("missing", missing), ("unexpected", extra), ("wrong shape", wrong)):
    if items:
      problems.append(f"{label} {len(items)}: {', '.join(items[:8])}{' ...' if len(items) > 8 else ''}")
  if problems:
    raise HFFormatError(f"HF {family} tensors do not match config.json: " + "; ".join(problems))
  out = {}
  for r in rules:
    parts = [np.asarray(src[h], dtype=np.float32) for h in r.hf]
    arr = np.concatenate(parts, axis=0) if r.rows else (parts[0].T if r.transpose else parts[0])
    out[r.canonical] = np.ascontiguousarray(arr, dtype=np.float32)
  return out


def canonical_to_hf(params: Mapping[str, np.ndarray], spec: ModelSpec, family: str | None = None
                    ) -> dict[str, np.ndarray]:
  """Canonical weights -> HF state dict (float32) of the family's *ForCausalLM.

  A tied head is omitted (HF re-ties `lm_head.weight` to the embedding on load).
  Raises:
    ValueError: the canonical weights do not match the spec (named).
    HFFormatError: the spec has no HF family.
  """
  family = family or family_of_spec(spec)
  weights.check_names_and_shapes(dict(params), spec, source="canonical_to_hf")
  out = {}
  for r in hf_rules(spec, family):
    arr = np.asarray(params[r.canonical], dtype=np.float32)
    if r.rows:
      for h, piece in zip(r.hf, np.split(arr, np.cumsum(r.rows)[:-1], axis=0)):
        out[h] = np.ascontiguousarray(piece)
    else:
      out[r.hf[0]] = np.ascontiguousarray(arr.T if r.transpose else arr)
  return out


# ----------------------------------------------------------------------------- files

_ST_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
              "U8": "u1", "BOOL": "?"}


def read_safetensors(path: str | Path, *, stored_dtypes: dict[str, str] | None = None
                     ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
  """Reads every tensor of a safetensors file, including bfloat16, with numpy only.

  BF16 is widened to float32 exactly (the 16 bits become the high half of a float32);
  other dtypes keep their numpy dtype. safetensors' own numpy loader cannot read BF16,
  which is how most HF checkpoints are stored.

  Args:
    path: the file.
    stored_dtypes: if given, receives name -> dtype as stored ('BF16', 'F32', ...).

  Returns:
    (name -> array, header metadata).
  Raises:
    HFFormatError: a truncated file, an unknown dtype, or a tensor whose byte range does not
      match its shape (named).
  """
  path = Path(path)
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) != 8:
      raise HFFormatError(f"{path}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", head)
    header = json.loads(f.read(n))
  meta = header.pop("__metadata__", None) or {}
  data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if header else np.zeros(0, np.uint8)
  out = {}
  for name, info in header.items():
    dt, shape, (start, stop) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
    if dt not in _ST_DTYPES and dt != "BF16":
      raise HFFormatError(f"{path}: tensor {name!r} has dtype {dt}, which is not supported")
    itemsize = 2 if dt == "BF16" else np.dtype(_ST_DTYPES[dt]).itemsize
    if stop - start != math.prod(shape) * itemsize or stop > data.size:
      raise HFFormatError(f"{path}: tensor {name!r} bytes [{start}, {stop}) do not hold shape {shape} of {dt}")
    raw = data[start:stop]
    if stored_dtypes is not None:
      stored_dtypes[name] = dt
    if dt == "BF16":
      arr = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    else:
      arr = np.array(raw.view(_ST_DTYPES[dt]))
    out[name] = arr.reshape(shape)
  return out, meta


def hf_weight_files(folder: str | Path) -> tuple[str, list[Path]]:
  """Finds the weight files of an HF checkpoint folder.

  Preference: model.safetensors, model.safetensors.index.json (shards), pytorch_model.bin,
  pytorch_model.bin.index.json.
  Returns:
    ('safetensors' | 'bin', files).
  Raises:
    FileNotFoundError: none of these exist, or the index names a shard that does not.
  """
  folder = Path(folder)
  for kind, single, index in (("safetensors", "model.safetensors", "model.safetensors.index.json"),
                              ("bin", "pytorch_model.bin", "pytorch_model.bin.index.json")):
    if (folder / single).exists():
      return kind, [folder / single]
    if (folder / index).exists():
      weight_map = json.loads((folder / index).read_text()).get("weight_map", {})
      files = [folder / f for f in sorted(set(weight_map.values()))]
      gone = [str(f) for f in files if not f.exists()]
      if gone or not files:
        raise FileNotFoundError(f"{folder / index} names missing shard(s): {gone or 'none listed'}")
      return kind, files
  raise FileNotFoundError(f"{folder}: no model.safetensors, model.safetensors.index.json, pytorch_model.bin "
                          "or pytorch_model.bin.index.json")


def _read_shards(folder: Path, files: list[Path], notes: list[str]) -> dict[str, np.ndarray]:
  out: dict[str, np.ndarray] = {}
  where: dict[str, Path] = {}
  stored: dict[str, str] = {}
  for f in files:
    tensors, _ = read_safetensors(f, stored_dtypes=stored)
    for k, v in tensors.items():
      if k in out:
        raise HFFormatError(f"tensor {k!r} appears in both {where[k].name} and {f.name}")
      out[k], where[k] = v, f
  index = folder / "model.safetensors.index.json"
  if index.exists() and len(files) > 1:
    for k, shard in json.loads(index.read_text())["weight_map"].items():
      if where.get(k) is None or where[k].name != shard:
        raise HFFormatError(f"{index.name}: tensor {k!r} is listed in {shard} but "
                            f"{'absent' if k not in where else 'stored in ' + where[k].name}")
  widened = sorted({d for d in stored.values() if d in ("BF16", "F16")})
  if widened:
    notes.append(f"stored dtype(s) {', '.join(widened)} widened to float32 (exact)")
  return out


@dataclasses.dataclass(frozen=True)
class HFCheckpoint:
  """An HF checkpoint read into our terms."""
  family: str
  """'gpt2' or 'llama' (tensor naming)."""
  spec: ModelSpec
  params: dict[str, np.ndarray]
  """Canonical float32 weights."""
  notes: tuple[str, ...]
  """Accepted config keys without a spec field, dropped buffers, conversions done."""


def load_hf_checkpoint(folder: str | Path, *, bin_reader=None) -> HFCheckpoint:
  """Reads an HF checkpoint folder (config.json + safetensors or pytorch_model.bin).

  Args:
    folder: the folder `save_pretrained` wrote.
    bin_reader: callable(list of .bin paths) -> dict name -> numpy array, used only for
      pytorch_model.bin (it needs torch; `parity.convert` passes one that runs a torch_impl
      subprocess with torch.load(weights_only=True)).
  Raises:
    FileNotFoundError: no config.json or no weights.
    HFFormatError: the architecture or a tensor cannot be mapped (named).
  """
  folder = Path(folder)
  cfg_path = folder / "config.json"
  if not cfg_path.exists():
    raise FileNotFoundError(f"{folder}: no config.json; pass the folder written by save_pretrained")
  family, spec, notes = parse_hf_config(json.loads(cfg_path.read_text()))
  kind, files = hf_weight_files(folder)
  if kind == "bin":
    if bin_reader is None:
      raise HFFormatError(f"{files[0]} is a pickle (pytorch_model.bin); reading it needs torch: use "
                          "`parity convert-weights` or pass bin_reader")
    tensors = bin_reader(files)
    notes.append(f"read {len(files)} pickle(s) with torch.load(weights_only=True); floats widened to float32")
  else:
    tensors = _read_shards(folder, files, notes)
  params = hf_to_canonical(tensors, spec, family, notes=notes)
  return HFCheckpoint(family, spec, params, tuple(notes))


def save_hf_checkpoint(folder: str | Path, spec: ModelSpec, params: Mapping[str, np.ndarray]) -> Path:
  """Writes config.json + model.safetensors (float32) that `AutoModelForCausalLM.from_pretrained` loads.

  Raises:
    HFFormatError: the spec has no HF family; ValueError: params do not match the spec.
  """
  from safetensors.numpy import save_file
  folder = Path(folder)
  config = hf_config_from_spec(spec)
  tensors = canonical_to_hf(params, spec)
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
  save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
  return folder


def canonical_metadata(spec: ModelSpec) -> dict[str, str]:
  """safetensors metadata of a canonical file: {SPEC_METADATA_KEY: compact sorted JSON of the spec}."""
  return {SPEC_METADATA_KEY: json.dumps(to_dict(spec), sort_keys=True, separators=(",", ":"))}


def spec_from_metadata(meta: Mapping[str, str], *, source: str = "metadata") -> ModelSpec | None:
  """The ModelSpec stored by `canonical_metadata`, or None when absent."""
  if SPEC_METADATA_KEY not in meta:
    return None
  try:
    return from_dict(ModelSpec, json.loads(meta[SPEC_METADATA_KEY])).validate()
  except (json.JSONDecodeError, SpecError) as exc:
    raise HFFormatError(f"{source}: bad {SPEC_METADATA_KEY} metadata: {exc}") from None


def save_canonical(path: str | Path, params: Mapping[str, np.ndarray], spec: ModelSpec) -> Path:
  """Writes canonical float32 weights with the spec as metadata; the bytes depend only on (params, spec)."""
  weights.check_names_and_shapes(dict(params), spec, source=str(path))
  ordered = {k: params[k] for k in weights.param_shapes(spec)}
  weights.save(ordered, path, metadata=canonical_metadata(spec))
  return Path(path)


def load_canonical(path: str | Path, spec: ModelSpec | None = None) -> tuple[dict[str, np.ndarray], ModelSpec]:
  """Reads a canonical file and its spec: from metadata, else a sidecar `spec.json`, else `spec`.

  The sidecar is `<file>.spec.json` or `spec.json` in the same folder, holding a ModelSpec dict.
  Raises:
    FileNotFoundError: no such file.
    HFFormatError: no spec found anywhere, or metadata and `spec` disagree.
    ValueError: tensors do not match the spec (named).
  """
  from safetensors import safe_open
  path = Path(path)
  if not path.exists():
    raise FileNotFoundError(f"canonical weights not found: {path}")
  with safe_open(str(path), framework="numpy") as f:
    stored = spec_from_metadata(f.metadata() or {}, source=str(path))
  if stored is None:
    for side in (path.with_name(path.name + ".spec.json"), path.with_name("spec.json")):
      if side.exists():
        stored = from_dict(ModelSpec, json.loads(side.read_text()), path="model").validate()
        break
  if stored is not None and spec is not None and stored != spec:
    raise HFFormatError(f"{path}: stored spec {to_dict(stored)} differs from the given spec {to_dict(spec)}")
  spec = stored or spec
  if spec is None:
    raise HFFormatError(f"{path}: no {SPEC_METADATA_KEY} metadata and no spec.json beside it; pass a spec")
  params = weights.load(path, spec)
  return {k: params[k] for k in weights.param_shapes(spec)}, spec


def run_spec_from_hf(folder: str | Path, base: RunSpec, *, bin_reader=None
                     ) -> tuple[RunSpec, dict[str, np.ndarray]]:
  """The RunSpec of a comparison that starts from an HF checkpoint, and its canonical weights.

  The model section is replaced by the checkpoint's spec; training, plans, data and sides
  come from `base`. The caller must use the returned weights as the initial weights
  (instead of `weights.init_params`).

  Raises:
    FileNotFoundError, HFFormatError: see `load_hf_checkpoint`.
    SpecError: `base.train.seq_len` exceeds the checkpoint's context (named).
  """
  ckpt = load_hf_checkpoint(folder, bin_reader=bin_reader)
  run = dataclasses.replace(base, model=ckpt.spec)
  try:
    return run.validate(), ckpt.params
  except SpecError as exc:
    raise SpecError(f"{folder}: {exc}") from None
