"""Hugging Face checkpoints <-> ModelSpec and canonical weights (numpy + safetensors only).

Eight architectures are read and written (config.json <-> ModelSpec, `parity.hf.config` / `parity.hf.export`):

  family   architecture        spec fields beyond GPT-2's (HF key)
  gpt2     GPT2LMHeadModel     LayerNorm, GELU MLP, learned positions, biases, tied head; Conv1D [in, out] weights,
                               `c_attn` = q|k|v fused by columns.
  llama    LlamaForCausalLM    RMSNorm, SwiGLU, rotary (rope_parameters / rope_scaling: default, linear, llama3,
                               yarn), GQA, head_dim, attention_bias (q/k/v/o) and mlp_bias.
  mistral  MistralForCausalLM  LLaMA without biases; sliding_window applied in every layer.
  qwen2    Qwen2ForCausalLM    biases on q/k/v only (qkv_bias); use_sliding_window / max_window_layers /
                               layer_types -> sliding_window, layer_types.
  qwen3    Qwen3ForCausalLM    per-head q/k RMSNorm (q_norm, k_norm -> qk_norm), head_dim, attention_bias.
  gemma    GemmaForCausalLM    RMSNorm x (1 + w) (norm_plus_one), GeGLU (hidden_act, tanh), embeddings x
                               sqrt(hidden_size) (embed_scale), tied head.
  gemma2   Gemma2ForCausalLM   Gemma + post-norms (post_norms), attn_scale = query_pre_attn_scalar ** -0.5,
                               attn/final logit soft-caps, layer_types alternating with sliding_window.
  gemma3   Gemma3ForCausalLM   Gemma 2 + q/k norms, rope_local_base_freq / rope_parameters.sliding_attention ->
                               rope_local_theta, rope scaling of the global layers, sliding_window_pattern.

Rotary models use HF's rotate-half layout, as both our models do, so no q/k permutation is applied.
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
  LLaMA-style (every rotary family)   canonical                 op
  model.embed_tokens.weight           wte.weight                copy
  model.layers.i.input_layernorm      h.i.ln_1.weight           copy
  model.layers.i.self_attn.{q,k,v}_proj.weight  h.i.attn.qkv.weight  rows concatenated q|k|v
  model.layers.i.self_attn.o_proj     h.i.attn.proj.weight      copy
  model.layers.i.post_attention_layernorm  h.i.ln_2.weight      copy (without post-norms)
  model.layers.i.self_attn.{q,k}_norm.weight  h.i.attn.ln_{q,k}.weight  copy (Qwen3, Gemma 3) [head_dim]
  model.layers.i.post_attention_layernorm  h.i.ln_1_post.weight copy (Gemma 2/3: after attention!)
  model.layers.i.pre_feedforward_layernorm h.i.ln_2.weight      copy (Gemma 2/3)
  model.layers.i.post_feedforward_layernorm h.i.ln_2_post.weight copy (Gemma 2/3)
  model.layers.i.mlp.{gate,up,down}_proj  h.i.mlp.{gate,up,proj}.weight  copy (SwiGLU and GeGLU)
  model.norm.weight                   ln_f.weight               copy
  lm_head.weight                      lm_head.weight            copy (absent when tied)

The package is split by responsibility; every name below is importable from `parity.hf`:

  families one row per model family (FAMILIES): its HF class, config class, model_type, the config keys read with
           their defaults, its presets; every other module takes these from it
  config   config.json -> ModelSpec, supported/refused architectures, HFFormatError
  export   ModelSpec -> config.json: family_of_spec, hf_config_from_spec
  tensors  the rules table: HF names, shapes and transposes <-> canonical weights
  files    safetensors (BF16 too), single/sharded HF folders, canonical files, run_spec_from_hf
  presets  MODEL_PRESETS and PUBLISHED_PARAM_COUNTS
"""
from __future__ import annotations

from parity.hf.config import ARCHITECTURES, REFUSED, HFFormatError, parse_hf_config, spec_from_hf_config
from parity.hf.export import family_of_spec, hf_config_from_spec
from parity.hf.families import FAMILIES, Family
from parity.hf.files import (SPEC_METADATA_KEY, HFCheckpoint, bfloat16_bits, canonical_metadata, hf_weight_files,
                             load_canonical, load_hf_checkpoint, read_safetensors, run_spec_from_hf, save_canonical,
                             save_hf_checkpoint, spec_from_metadata)
from parity.hf.presets import MODEL_PRESETS, PUBLISHED_PARAM_COUNTS
from parity.hf.tensors import Rule, canonical_to_hf, hf_rules, hf_tensor_table, hf_to_canonical

__all__ = [
    "HFFormatError", "Rule", "FAMILIES", "Family", "ARCHITECTURES", "REFUSED", "MODEL_PRESETS",
    "PUBLISHED_PARAM_COUNTS", "HFCheckpoint",
    "spec_from_hf_config", "parse_hf_config", "hf_config_from_spec", "family_of_spec", "hf_rules",
    "hf_tensor_table", "hf_to_canonical", "canonical_to_hf", "read_safetensors", "hf_weight_files",
    "load_hf_checkpoint",
    "save_hf_checkpoint", "canonical_metadata", "spec_from_metadata", "save_canonical", "load_canonical",
    "run_spec_from_hf", "SPEC_METADATA_KEY", "bfloat16_bits",
]
