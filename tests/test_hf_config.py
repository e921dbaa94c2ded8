"""parity.hf without any framework: config.json <-> ModelSpec, tensor naming, files, presets."""
from __future__ import annotations

import dataclasses
import json
import re
import struct

import numpy as np
import pytest

from parity import hf, weights
from parity.spec import ModelSpec, RunSpec, SpecError, TrainSpec

GPT2_TINY = {"architectures": ["GPT2LMHeadModel"], "vocab_size": 50, "n_positions": 16, "n_embd": 32,
             "n_layer": 2, "n_head": 4}
LLAMA_TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 50, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "rms_norm_eps": 1e-6}
# meta-llama/Llama-2-7b-hf config.json (transformers 4.x layout: top-level rope_theta/rope_scaling).
LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 4096,
             "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 4096,
             "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "pretraining_tp": 1,
             "rms_norm_eps": 1e-05, "rope_scaling": None, "tie_word_embeddings": False, "vocab_size": 32000}


# ----------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", list(hf.MODEL_PRESETS))
def test_presets_match_published_parameter_counts(name):
  spec = hf.MODEL_PRESETS[name].validate()
  print(f"\n{name}: {weights.n_params(spec):,} params (published {hf.PUBLISHED_PARAM_COUNTS[name]:,})")
  assert weights.n_params(spec) == hf.PUBLISHED_PARAM_COUNTS[name]


@pytest.mark.parametrize("name", sorted(hf.MODEL_PRESETS))
def test_presets_round_trip_through_hf_configs(name):
  spec = hf.MODEL_PRESETS[name]
  again = hf.spec_from_hf_config(json.loads(json.dumps(hf.hf_config_from_spec(spec))))
  assert again == spec, name


# ----------------------------------------------------------------------------- config.json -> spec


def test_gpt2_defaults_are_gpt2_124m():
  assert hf.spec_from_hf_config({"architectures": ["GPT2LMHeadModel"]}) == hf.MODEL_PRESETS["gpt2-124m"]


def test_llama2_7b_config_is_the_7b_preset():
  assert hf.spec_from_hf_config(LLAMA2_7B) == hf.MODEL_PRESETS["llama-7b"]


def test_a_model_type_that_contradicts_the_architecture_is_refused():
  """transformers' AutoModelForCausalLM builds the class model_type names, whatever architectures says: a config
  whose two keys disagree would otherwise be read as the architectures' family, not the model HF trains."""
  with pytest.raises(hf.HFFormatError, match=r"model_type 'llama' \(a LlamaForCausalLM\) contradicts "
                                             r"architectures\[0\] 'Qwen3ForCausalLM'"):
    hf.spec_from_hf_config({**LLAMA_TINY, "architectures": ["Qwen3ForCausalLM"], "model_type": "llama"})
  # agreeing keys, an unknown model_type, or one key alone: read as before
  assert hf.spec_from_hf_config({**LLAMA_TINY, "model_type": "llama"}) == hf.spec_from_hf_config(LLAMA_TINY)
  assert hf.spec_from_hf_config({**LLAMA_TINY, "model_type": "my_llama"}) == hf.spec_from_hf_config(LLAMA_TINY)
  assert hf.spec_from_hf_config({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                                 "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
                                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "head_dim": 8, "max_position_embeddings": 64}).n_layers == 2


def test_transformers5_rope_parameters_are_read():
  cfg = {**LLAMA_TINY, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
  spec = hf.spec_from_hf_config(cfg)
  assert spec.rope_theta == 500000.0 and spec.kv_heads == 2 and spec.ffn_dim == 48
  assert spec.norm == "rmsnorm" and spec.mlp == "swiglu" and spec.position == "rope" and not spec.bias


def test_gpt2_options_map_to_spec_fields():
  spec = hf.spec_from_hf_config({**GPT2_TINY, "activation_function": "gelu", "scale_attn_weights": False,
                                 "n_inner": 40, "tie_word_embeddings": False, "layer_norm_epsilon": 1e-6})
  assert (spec.gelu_approximate, spec.attn_scale, spec.d_ff, spec.tie_embeddings, spec.norm_eps) == \
      (False, 1.0, 40, False, 1e-6)


def test_mistral_sliding_window_is_applied_not_truncated():
  cfg = {**LLAMA_TINY, "architectures": ["MistralForCausalLM"], "sliding_window": 32}
  family, spec, notes = hf.parse_hf_config(cfg)
  assert family == "mistral" and spec.max_seq_len == 64 and spec.sliding_window == 32
  assert spec.layer_kinds == ("sliding", "sliding") and spec.layer_types == ()
  plain = hf.spec_from_hf_config({**cfg, "sliding_window": None})
  assert plain.sliding_window is None and hf.family_of_spec(plain) == "llama"
  assert hf.spec_from_hf_config({k: v for k, v in cfg.items() if k != "sliding_window"}).sliding_window == 4096


def test_llama_biases_in_normal_form():
  spec = hf.spec_from_hf_config({**LLAMA_TINY, "attention_bias": True, "mlp_bias": True})
  assert spec.bias and (spec.qkv_bias, spec.out_bias, spec.mlp_bias) == (None, None, None)
  assert "h.0.attn.qkv.bias" in weights.param_shapes(spec) and "h.0.ln_1.bias" not in weights.param_shapes(spec)
  spec = hf.spec_from_hf_config({**LLAMA_TINY, "attention_bias": True})
  assert (spec.bias, spec.qkv_bias, spec.out_bias, spec.mlp_bias) == (False, True, True, None)
  assert [spec.linear_bias(k) for k in ("qkv", "out", "mlp")] == [True, True, False]


LLAMA31_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}


@pytest.mark.parametrize("cfg", [
    {**LLAMA_TINY, "rope_theta": 500000.0, "rope_scaling": LLAMA31_ROPE},  # meta-llama/Llama-3.1-8B (4.x layout)
    {**LLAMA_TINY, "rope_parameters": {**LLAMA31_ROPE, "rope_theta": 500000.0}},  # transformers 5 layout
])
def test_llama3_rope_scaling_is_read(cfg):
  spec = hf.spec_from_hf_config(cfg)
  assert spec.rope_theta == 500000.0 and spec.rope_scaling == LLAMA31_ROPE


def test_linear_and_yarn_rope_scaling_take_hf_defaults():
  spec = hf.spec_from_hf_config({**LLAMA_TINY, "rope_scaling": {"type": "linear", "factor": 2.0}})
  assert spec.rope_scaling == {"rope_type": "linear", "factor": 2.0}
  spec = hf.spec_from_hf_config({**LLAMA_TINY, "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                                   "beta_fast": None, "rope_theta": 1e6}})
  assert spec.rope_theta == 1e6  # original_max_position_embeddings defaults to max_position_embeddings, as in HF
  assert spec.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


QWEN2_TINY = {**LLAMA_TINY, "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 4}


def test_qwen2_biases_on_qkv_only_and_its_window_layers():
  spec = hf.spec_from_hf_config(QWEN2_TINY)
  assert [spec.linear_bias(k) for k in ("qkv", "out", "mlp")] == [True, False, False]
  assert (spec.bias, spec.qkv_bias, spec.out_bias, spec.mlp_bias) == (False, True, None, None)
  assert spec.sliding_window is None and spec.layer_kinds == ("full",) * 4  # use_sliding_window defaults to false
  names = weights.param_shapes(spec)
  assert "h.0.attn.qkv.bias" in names and "h.0.attn.proj.bias" not in names and "h.0.mlp.up.bias" not in names
  spec = hf.spec_from_hf_config({**QWEN2_TINY, "use_sliding_window": True, "sliding_window": 8,
                                 "max_window_layers": 2})
  assert spec.sliding_window == 8 and spec.layer_types == ("full", "full", "sliding", "sliding")
  spec = hf.spec_from_hf_config({**QWEN2_TINY, "use_sliding_window": True, "sliding_window": 8,
                                 "max_window_layers": 0})
  assert spec.layer_types == () and spec.layer_kinds == ("sliding",) * 4


def test_qwen3_qk_norm_and_its_default_head_dim():
  spec = hf.spec_from_hf_config({**LLAMA_TINY, "architectures": ["Qwen3ForCausalLM"]})
  assert spec.qk_norm and spec.d_head == 128 and spec.head_dim == 128  # Qwen3Config.head_dim defaults to 128
  assert weights.param_shapes(spec)["h.1.attn.ln_k.weight"] == (128,)
  spec = hf.spec_from_hf_config({**LLAMA_TINY, "architectures": ["Qwen3ForCausalLM"], "head_dim": 8,
                                 "attention_bias": True})
  assert spec.d_head == 8 and spec.linear_bias("out") and not spec.linear_bias("mlp")  # Qwen3 keeps its head_dim


GEMMA_TINY = {"vocab_size": 50, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64}


def test_gemma2_takes_the_config_class_defaults():
  spec = hf.spec_from_hf_config({**GEMMA_TINY, "architectures": ["Gemma2ForCausalLM"]})
  assert (spec.norm_plus_one, spec.post_norms, spec.qk_norm, spec.mlp, spec.gelu_approximate) == \
      (True, True, False, "geglu", True)
  assert spec.embed_scale == 32 ** 0.5 and spec.tie_embeddings and spec.d_head == 16
  assert spec.attn_scale == 256 ** -0.5 and (spec.attn_softcap, spec.final_softcap) == (50.0, 30.0)
  assert spec.sliding_window == 4096 and spec.layer_types == ("sliding", "full", "sliding", "full")
  spec = hf.spec_from_hf_config({**GEMMA_TINY, "architectures": ["Gemma2ForCausalLM"], "query_pre_attn_scalar": 16,
                                 "attn_logit_softcapping": None, "hidden_activation": "gelu"})
  assert spec.attn_scale == 0.25 and spec.attn_softcap is None and not spec.gelu_approximate


def test_gemma1_is_gemma2_without_post_norms_or_caps():
  spec = hf.spec_from_hf_config({**GEMMA_TINY, "architectures": ["GemmaForCausalLM"], "hidden_act": "gelu"})
  assert spec.norm_plus_one and spec.mlp == "geglu" and spec.gelu_approximate  # GemmaConfig: legacy gelu -> tanh
  assert not spec.post_norms and spec.attn_scale is None and spec.final_softcap is None and spec.layer_types == ()
  assert hf.family_of_spec(spec) == "gemma"


GEMMA3_TINY = {**GEMMA_TINY, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 6}


def test_gemma3_local_rope_and_pattern_in_both_layouts():
  old = {**GEMMA3_TINY, "sliding_window_pattern": 3, "sliding_window": 16, "rope_theta": 1e6,
         "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
  new = {**GEMMA3_TINY, "sliding_window": 16, "layer_types": ["sliding_attention"] * 2 + ["full_attention"]
         + ["sliding_attention"] * 2 + ["full_attention"],
         "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
  a, b = hf.spec_from_hf_config(old), hf.spec_from_hf_config(new)
  assert a == b and a.qk_norm and a.norm_plus_one and a.post_norms
  assert a.layer_types == ("sliding", "sliding", "full") * 2 and a.rope_local_theta == 1e4
  assert a.rope_theta == 1e6 and a.rope_scaling == {"rope_type": "linear", "factor": 8.0}
  default = hf.spec_from_hf_config(GEMMA3_TINY)  # pattern 6, global base 1e6, local 1e4, no caps
  assert default.layer_types == ("sliding",) * 5 + ("full",) and (default.rope_theta, default.rope_local_theta) == \
      (1e6, 1e4) and default.attn_softcap is None and default.final_softcap is None
  same = {**new, "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
  assert hf.spec_from_hf_config(same).rope_local_theta is None


@pytest.mark.parametrize("cfg", [
    LLAMA_TINY, {**LLAMA_TINY, "attention_bias": True}, {**LLAMA_TINY, "mlp_bias": True, "head_dim": 16},
    {**LLAMA_TINY, "rope_scaling": LLAMA31_ROPE, "rope_theta": 5e5},
    {**LLAMA_TINY, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.9, "truncate": False}},
    {**LLAMA_TINY, "architectures": ["MistralForCausalLM"], "sliding_window": 7},
    QWEN2_TINY, {**QWEN2_TINY, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    {**LLAMA_TINY, "architectures": ["Qwen3ForCausalLM"], "head_dim": 16, "tie_word_embeddings": True},
    {**GEMMA_TINY, "architectures": ["GemmaForCausalLM"]},
    {**GEMMA_TINY, "architectures": ["Gemma2ForCausalLM"], "query_pre_attn_scalar": 144, "sliding_window": 8},
    {**GEMMA_TINY, "architectures": ["Gemma2ForCausalLM"], "hidden_activation": "gelu", "layer_types": None},
    {**GEMMA3_TINY, "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "attn_logit_softcapping": 20.0},
    {**GEMMA3_TINY, "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5.0},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 5.0}}},
], ids=lambda c: c.get("architectures", ["?"])[0])
def test_config_to_spec_to_config_round_trips(cfg):
  family, spec, _ = hf.parse_hf_config(cfg)
  assert hf.family_of_spec(spec) == family
  exported = json.loads(json.dumps(hf.hf_config_from_spec(spec)))
  assert exported["architectures"] == cfg["architectures"]
  assert hf.parse_hf_config(exported)[:2] == (family, spec)
  assert hf.hf_config_from_spec(spec) == exported


@pytest.mark.parametrize("cfg, match", [
    ({"architectures": ["GPTNeoXForCausalLM"]}, "parallel residual"),
    ({"architectures": ["Gemma3ForConditionalGeneration"]}, "multimodal"),
    ({"model_type": "gemma3"}, "multimodal"),
    ({"architectures": ["BertForMaskedLM"]}, "unknown architecture 'BertForMaskedLM'"),
    ({**LLAMA_TINY, "rope_scaling": {"rope_type": "dynamic", "factor": 8.0}}, "rope_scaling.rope_type='dynamic'"),
    ({**LLAMA_TINY, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
     "rope_parameters.rope_type='longrope'.*default, linear, llama3, yarn"),
    ({**LLAMA_TINY, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({**LLAMA_TINY, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5"),
    ({**LLAMA_TINY, "hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({**GEMMA_TINY, "architectures": ["Gemma2ForCausalLM"], "hidden_activation": "relu"}, "hidden_activation='relu'"),
    ({**GEMMA_TINY, "architectures": ["Gemma2ForCausalLM"], "use_bidirectional_attention": True}, "causal"),
    ({**GEMMA_TINY, "architectures": ["Gemma2ForCausalLM"], "sliding_window": None}, "sliding_window is null"),
    ({**GEMMA_TINY, "architectures": ["Gemma2ForCausalLM"], "layer_types": ["chunked_attention"] * 4},
     "layer_types='chunked_attention'"),
    ({**GEMMA3_TINY, "rope_parameters": {"rope_type": "default", "rope_theta": 5.0}}, "nests them per layer type"),
    ({**GEMMA3_TINY, "rope_parameters": {"full_attention": {"rope_type": "default"},
                                         "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "sliding layers with a rotary scaling of their own"),
    ({**QWEN2_TINY, "rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per layer type"),
    ({**GPT2_TINY, "scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({**GPT2_TINY, "activation_function": "relu"}, "activation_function='relu'"),
    ({**GPT2_TINY, "n_embd": 30}, "divisible"),
])
def test_unsupported_configs_are_refused_with_the_reason(cfg, match):
  with pytest.raises(hf.HFFormatError, match=match):
    hf.parse_hf_config(cfg)


def test_spec_without_an_hf_family_is_refused():
  with pytest.raises(hf.HFFormatError, match="no HF architecture") as err:
    hf.hf_config_from_spec(ModelSpec(norm="rmsnorm", mlp="gelu"))
  assert "LlamaForCausalLM needs another position='learned'" in str(err.value)
  with pytest.raises(hf.HFFormatError, match="GPT2LMHeadModel needs another kv_heads=2"):
    hf.hf_config_from_spec(ModelSpec(n_kv_heads=2))
  llama = hf.spec_from_hf_config(LLAMA_TINY)
  with pytest.raises(hf.HFFormatError, match="Qwen2ForCausalLM needs another attn_bias='out'"):
    hf.hf_config_from_spec(dataclasses.replace(llama, out_bias=True))
  with pytest.raises(hf.HFFormatError, match="LlamaForCausalLM needs another softcaps='final'"):
    hf.hf_config_from_spec(dataclasses.replace(llama, final_softcap=30.0))
  gemma2 = hf.spec_from_hf_config({**GEMMA_TINY, "architectures": ["Gemma2ForCausalLM"]})
  assert hf.hf_config_from_spec(dataclasses.replace(gemma2, attn_scale=0.3))["query_pre_attn_scalar"] ** -0.5 == 0.3
  with pytest.raises(hf.HFFormatError, match="attn_scale=1e-200 is not query_pre_attn_scalar"):
    hf.hf_config_from_spec(dataclasses.replace(gemma2, attn_scale=1e-200))
  with pytest.raises(hf.HFFormatError, match="Gemma2ForCausalLM needs another local_rope=True"):
    hf.hf_config_from_spec(dataclasses.replace(gemma2, rope_local_theta=5.0))


# ----------------------------------------------------------------------------- tensors


def _spec(cfg):
  return hf.parse_hf_config(cfg)[:2]


FAMILY_CONFIGS = {
    "gpt2": GPT2_TINY, "llama": LLAMA_TINY, "llama-bias": {**LLAMA_TINY, "attention_bias": True, "mlp_bias": True},
    "llama-tied": {**LLAMA_TINY, "tie_word_embeddings": True},
    "mistral": {**LLAMA_TINY, "architectures": ["MistralForCausalLM"], "sliding_window": 8},
    "qwen2": QWEN2_TINY, "qwen3": {**LLAMA_TINY, "architectures": ["Qwen3ForCausalLM"], "head_dim": 12},
    "gemma": {**GEMMA_TINY, "architectures": ["GemmaForCausalLM"]},
    "gemma2": {**GEMMA_TINY, "architectures": ["Gemma2ForCausalLM"], "attention_bias": True},
    "gemma3": {**GEMMA3_TINY, "tie_word_embeddings": False},
}


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_canonical_to_hf_and_back_is_exact(name):
  family, spec = _spec(FAMILY_CONFIGS[name])
  params = weights.init_params(spec, seed=3)
  params = {k: v + np.float32(0.01) * np.arange(v.size, dtype=np.float32).reshape(v.shape) for k, v in params.items()}
  tensors = hf.canonical_to_hf(params, spec)
  table = hf.hf_tensor_table(spec, family)
  assert {k: v.shape for k, v in tensors.items()} == {k: s for k, (s, tied) in table.items() if tied is None}
  assert all(v.dtype == np.float32 for v in tensors.values())
  assert [k for k, (_, tied) in table.items() if tied] == (["lm_head.weight"] if spec.tie_embeddings else [])
  back = hf.hf_to_canonical(tensors, spec, family)
  assert list(back) == list(weights.param_shapes(spec))
  for k in params:
    np.testing.assert_array_equal(back[k], params[k], err_msg=k)
  again = hf.canonical_to_hf(back, spec)
  assert list(again) == list(tensors) and all(np.array_equal(again[k], tensors[k]) for k in tensors)


def test_gemma2_norm_names_and_qk_norms():
  family, spec = _spec(FAMILY_CONFIGS["gemma3"])
  rules = {r.canonical: r.hf for r in hf.hf_rules(spec, family)}
  assert rules["h.2.ln_1_post.weight"] == ("model.layers.2.post_attention_layernorm.weight",)  # after attention
  assert rules["h.2.ln_2.weight"] == ("model.layers.2.pre_feedforward_layernorm.weight",)
  assert rules["h.2.ln_2_post.weight"] == ("model.layers.2.post_feedforward_layernorm.weight",)
  assert rules["h.2.attn.ln_q.weight"] == ("model.layers.2.self_attn.q_norm.weight",)
  family, spec = _spec(LLAMA_TINY)
  assert {r.canonical: r.hf for r in hf.hf_rules(spec, family)}["h.1.ln_2.weight"] == \
      ("model.layers.1.post_attention_layernorm.weight",)


def test_unmapped_tensors_are_refused_by_name():
  family, spec = _spec(FAMILY_CONFIGS["gemma2"])
  good = hf.canonical_to_hf(weights.init_params(spec, 0), spec)
  with pytest.raises(hf.HFFormatError, match=r"unexpected 1: model\.layers\.0\.self_attn\.q_norm\.weight"):
    hf.hf_to_canonical({**good, "model.layers.0.self_attn.q_norm.weight": np.ones(16, np.float32)}, spec, family)
  bad = {k: v for k, v in good.items() if "post_feedforward" not in k}
  with pytest.raises(hf.HFFormatError, match=r"missing 4: model\.layers\.0\.post_feedforward_layernorm\.weight"):
    hf.hf_to_canonical(bad, spec, family)
  bad = {**good, "model.norm.weight": np.ones(32, np.int32)}
  with pytest.raises(hf.HFFormatError, match=r"not floating point 1: model\.norm\.weight: int32"):
    hf.hf_to_canonical(bad, spec, family)
  family, spec = _spec(FAMILY_CONFIGS["qwen2"])
  good = hf.canonical_to_hf(weights.init_params(spec, 0), spec)
  assert "model.layers.0.self_attn.k_proj.bias" in good and "model.layers.0.self_attn.o_proj.bias" not in good
  with pytest.raises(hf.HFFormatError, match=r"unexpected 1: model\.layers\.0\.self_attn\.o_proj\.bias"):
    hf.hf_to_canonical({**good, "model.layers.0.self_attn.o_proj.bias": np.zeros(32, np.float32)}, spec, family)


def test_gpt2_conv1d_transposes_and_qkv_column_order():
  family, spec = _spec(GPT2_TINY)
  d = spec.d_model
  c_attn = np.arange(d * 3 * d, dtype=np.float32).reshape(d, 3 * d)  # Conv1D [in, out]: columns q | k | v
  tensors = hf.canonical_to_hf(weights.init_params(spec, 0), spec)
  tensors["transformer.h.0.attn.c_attn.weight"] = c_attn
  qkv = hf.hf_to_canonical(tensors, spec, family)["h.0.attn.qkv.weight"]
  assert qkv.shape == (3 * d, d)
  np.testing.assert_array_equal(qkv[d:2 * d], c_attn[:, d:2 * d].T)  # k rows == k columns, transposed


def test_llama_qkv_rows_are_q_then_k_then_v():
  family, spec = _spec(LLAMA_TINY)
  tensors = hf.canonical_to_hf(weights.init_params(spec, 0), spec)
  for i, x in enumerate("qkv"):
    name = f"model.layers.1.self_attn.{x}_proj.weight"
    tensors[name] = np.full_like(tensors[name], i)
  qkv = hf.hf_to_canonical(tensors, spec, family)["h.1.attn.qkv.weight"]
  q, k = spec.n_heads * spec.head_dim, spec.kv_heads * spec.head_dim
  assert (qkv[:q] == 0).all() and (qkv[q:q + k] == 1).all() and (qkv[q + k:] == 2).all()


def test_unprefixed_gpt2_names_and_old_buffers_are_accepted():
  family, spec = _spec(GPT2_TINY)
  tensors = {k.removeprefix("transformer."): v for k,
             v in hf.canonical_to_hf(weights.init_params(spec, 0), spec).items()}
  tensors["h.0.attn.bias"] = np.tril(np.ones((1, 1, 16, 16), dtype=bool))
  tensors["h.0.attn.masked_bias"] = np.array(-1e4, dtype=np.float32)
  tensors["lm_head.weight"] = tensors["wte.weight"].copy()  # tied and stored: must equal the embedding
  notes: list[str] = []
  out = hf.hf_to_canonical(tensors, spec, family, notes=notes)
  assert set(out) == set(weights.param_shapes(spec))
  assert any("causal-mask buffer" in n for n in notes)


def test_bad_tensors_are_named():
  family, spec = _spec(LLAMA_TINY)
  good = hf.canonical_to_hf(weights.init_params(spec, 0), spec)
  bad = dict(good)
  del bad["model.layers.1.self_attn.k_proj.weight"]
  with pytest.raises(hf.HFFormatError, match=r"missing 1: model\.layers\.1\.self_attn\.k_proj\.weight"):
    hf.hf_to_canonical(bad, spec, family)
  bad = {**good, "model.layers.0.self_attn.q_norm.weight": np.ones(8, np.float32)}
  with pytest.raises(hf.HFFormatError, match=r"unexpected 1: model\.layers\.0\.self_attn\.q_norm\.weight"):
    hf.hf_to_canonical(bad, spec, family)
  bad = {**good, "model.layers.0.self_attn.v_proj.weight": np.zeros((32, 32), np.float32)}
  with pytest.raises(hf.HFFormatError, match=r"v_proj\.weight: \(32, 32\) \(expected \(16, 32\)\)"):
    hf.hf_to_canonical(bad, spec, family)
  family, spec = _spec({**LLAMA_TINY, "tie_word_embeddings": True})
  tied = hf.canonical_to_hf(weights.init_params(spec, 0), spec)
  tied["lm_head.weight"] = tied["model.embed_tokens.weight"] + 1
  with pytest.raises(hf.HFFormatError, match="lm_head.weight differs"):
    hf.hf_to_canonical(tied, spec, family)


# ----------------------------------------------------------------------------- files


def _write_raw_safetensors(path, tensors: dict[str, tuple[str, tuple, bytes]]) -> None:
  header, blob = {}, b""
  for name, (dt, shape, raw) in tensors.items():
    header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [len(blob), len(blob) + len(raw)]}
    blob += raw
  h = json.dumps(header).encode()
  path.write_bytes(struct.pack("<Q", len(h)) + h + blob)


def test_read_safetensors_widens_bf16_and_f16_exactly(tmp_path):
  x = np.array([[1.0, -2.5, 3.140625], [2.0**-10, 65280.0, -0.0]], dtype=np.float32)
  bf16 = (x.view(np.uint32) >> 16).astype("<u2")  # these values are exact in bfloat16
  f = tmp_path / "w.safetensors"
  _write_raw_safetensors(f, {"a": ("BF16", (2, 3), bf16.tobytes()), "b": ("F16", (3,), np.float16([1, 2, 3]).tobytes()),
                             "c": ("BOOL", (2,), np.array([True, False]).tobytes())})
  got, _ = hf.read_safetensors(f)
  np.testing.assert_array_equal(got["a"], x)
  assert got["a"].dtype == np.float32 and got["b"].dtype == np.float16 and got["c"].dtype == np.bool_
  _write_raw_safetensors(f, {"a": ("F32", (2, 3), x.tobytes()[:-4])})
  with pytest.raises(hf.HFFormatError, match="tensor 'a' bytes"):
    hf.read_safetensors(f)


def test_sharded_checkpoint_with_index(tmp_path):
  from safetensors.numpy import save_file
  family, spec = _spec(LLAMA_TINY)
  params = weights.init_params(spec, 1)
  tensors = hf.canonical_to_hf(params, spec)
  names = sorted(tensors)
  shards = {"model-00001-of-00002.safetensors": names[:7], "model-00002-of-00002.safetensors": names[7:]}
  for fname, keys in shards.items():
    save_file({k: tensors[k] for k in keys}, str(tmp_path / fname))
  index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
  (tmp_path / "config.json").write_text(json.dumps(LLAMA_TINY))
  ck = hf.load_hf_checkpoint(tmp_path)
  assert ck.spec == spec and all(np.array_equal(ck.params[k], params[k]) for k in params)
  index["weight_map"][names[0]] = "model-00002-of-00002.safetensors"
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(hf.HFFormatError, match=f"{names[0]}' is listed in model-00002"):
    hf.load_hf_checkpoint(tmp_path)


def test_missing_files_are_reported(tmp_path):
  with pytest.raises(FileNotFoundError, match="no config.json"):
    hf.load_hf_checkpoint(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(GPT2_TINY))
  with pytest.raises(FileNotFoundError, match="no model.safetensors"):
    hf.load_hf_checkpoint(tmp_path)
  (tmp_path / "pytorch_model.bin").write_bytes(b"")
  with pytest.raises(hf.HFFormatError, match="needs torch"):
    hf.load_hf_checkpoint(tmp_path)


def test_canonical_file_carries_its_spec(tmp_path):
  _, spec = _spec(LLAMA_TINY)
  params = weights.init_params(spec, 2)
  f = hf.save_canonical(tmp_path / "w.safetensors", params, spec)
  got, got_spec = hf.load_canonical(f)
  assert got_spec == spec and all(np.array_equal(got[k], params[k]) for k in params)
  with pytest.raises(hf.HFFormatError, match="differs from the given spec"):
    hf.load_canonical(f, ModelSpec())
  plain = tmp_path / "plain.safetensors"
  weights.save(params, plain)
  with pytest.raises(hf.HFFormatError, match="no parity_model_spec metadata"):
    hf.load_canonical(plain)
  (tmp_path / "spec.json").write_text(json.dumps(json.loads(hf.canonical_metadata(spec)[hf.SPEC_METADATA_KEY])))
  assert hf.load_canonical(plain)[1] == spec


def test_run_spec_from_hf_replaces_the_model_only(tmp_path):
  _, spec = _spec({**LLAMA_TINY, "vocab_size": 300})
  params = weights.init_params(spec, 4)
  hf.save_hf_checkpoint(tmp_path, spec, params)
  base = RunSpec(train=TrainSpec(steps=3, seq_len=32, micro_batch_size=2, warmup_steps=1))
  run, got = hf.run_spec_from_hf(tmp_path, base)
  assert run.model == spec and run.train == base.train and run.sides == base.sides
  assert all(np.array_equal(got[k], params[k]) for k in params)
  with pytest.raises(SpecError, match="exceeds model.max_seq_len"):
    hf.run_spec_from_hf(tmp_path, RunSpec(train=TrainSpec(seq_len=128)))


@pytest.mark.parametrize("name", ["mistral", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_run_spec_from_hf_takes_every_family(name, tmp_path):
  _, spec = _spec(FAMILY_CONFIGS[name])
  params = weights.init_params(spec, 5)
  hf.save_hf_checkpoint(tmp_path, spec, params)
  run, got = hf.run_spec_from_hf(tmp_path, RunSpec(train=TrainSpec(steps=2, seq_len=64, micro_batch_size=2,
                                                                    warmup_steps=1)))
  assert run.model == spec and list(got) == list(weights.param_shapes(spec))  # seq_len 64: Mistral's window 8 is
  assert all(np.array_equal(got[k], params[k]) for k in params)              # applied, not a context limit


# ----------------------------------------------------------------------------- config.json value types

QWEN3_TINY = {**LLAMA_TINY, "architectures": ["Qwen3ForCausalLM"], "head_dim": 8}
GEMMA2_TINY = {**GEMMA_TINY, "architectures": ["Gemma2ForCausalLM"]}


@pytest.mark.parametrize("cfg, match", [
    ({**LLAMA_TINY, "hidden_size": None}, r"hidden_size=None must be an integer >= 1"),
    ({**LLAMA_TINY, "hidden_size": "abc"}, r"hidden_size='abc' must be an integer >= 1"),
    ({**LLAMA_TINY, "rms_norm_eps": None}, r"rms_norm_eps=None must be a number > 0"),
    ({**LLAMA_TINY, "rope_parameters": [1, 2]}, r"rope_parameters=\[1, 2\] must be an object"),
    ({**LLAMA_TINY, "rope_parameters": {"rope_type": "default", "rope_theta": "abc"}},
     r"rope_parameters.rope_theta='abc' must be a number > 0"),
    ({**LLAMA_TINY, "pretraining_tp": "two"}, r"pretraining_tp='two' must be an integer"),
    ({**QWEN3_TINY, "head_dim": "16"}, r"head_dim='16' must be an integer"),
    ({**GEMMA2_TINY, "attn_logit_softcapping": "50"}, r"attn_logit_softcapping='50' must be a number > 0 or null"),
    ({**LLAMA_TINY, "architectures": ["MistralForCausalLM"], "sliding_window": 8.5},
     r"sliding_window=8.5 must be an integer >= 1 or null"),
    ({**LLAMA_TINY, "rope_theta": 0}, r"rope_theta=0 must be a number > 0"),
    ({**LLAMA_TINY, "attention_bias": "false"}, r"attention_bias='false' must be true or false"),
    ({**GEMMA2_TINY, "layer_types": "full_attention"}, r"layer_types='full_attention' must be a list"),
    ({**GEMMA2_TINY, "layer_types": {"a": 1}}, r"layer_types=\{'a': 1\} must be a list"),
    ({**LLAMA_TINY, "tie_word_embeddings": 1}, r"tie_word_embeddings=1 must be true or false"),
    ({**LLAMA_TINY, "architectures": "LlamaForCausalLM"}, r"architectures='LlamaForCausalLM' must be a list"),
    ({**GPT2_TINY, "n_embd": 32.0}, r"n_embd=32.0 must be an integer"),
    ({**LLAMA_TINY, "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "beta_fast": "x"}},
     r"rope_scaling.beta_fast='x' must be a number > 0"),
    ({**LLAMA_TINY, "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "truncate": "no"}},
     r"rope_scaling.truncate='no' must be true or false"),
    ({**LLAMA_TINY, "rope_scaling": {"rope_type": ["yarn"], "factor": 2.0}}, r"rope_scaling.rope_type=\['yarn'\]"),
    ({**GEMMA3_TINY, "rope_parameters": {"full_attention": 5, "sliding_attention": {}}},
     r"rope_parameters.full_attention=5 must be an object"),
])
def test_bad_config_values_are_refused_naming_the_key_and_the_type(cfg, match):
  with pytest.raises(hf.HFFormatError, match=r"config.json( \(\w+\))?: " + match):
    hf.parse_hf_config(cfg)


def test_a_default_that_does_not_fit_is_named_as_the_config_key_and_its_default():
  cfg = {k: v for k, v in QWEN2_TINY.items() if k != "num_key_value_heads"}  # Qwen2Config's default: 32
  with pytest.raises(hf.HFFormatError, match=r"num_key_value_heads=32 \(config.json omits it: the Qwen2ForCausalLM "
                                             r"default\) must be a divisor of num_attention_heads \(4\)"):
    hf.parse_hf_config(cfg)
  with pytest.raises(hf.HFFormatError, match=r"max_position_embeddings \(model.max_seq_len\) = 8589934592 is out"):
    hf.parse_hf_config({**LLAMA_TINY, "max_position_embeddings": 2**33})  # a spec check, named by the config key
  with pytest.raises(hf.HFFormatError, match=r"n_embd \(model.d_model\) \(30\) must be divisible by n_head"):
    hf.parse_hf_config({**GPT2_TINY, "n_embd": 30})


def test_qwen2_sliding_layers_with_use_sliding_window_false_name_use_sliding_window():
  """Qwen2Config drops sliding_window when use_sliding_window is false; its forward then fails on the sliding
  layers (TypeError in the mask). The refusal names the key that causes it."""
  cfg = {**QWEN2_TINY, "use_sliding_window": False, "sliding_window": 8,
         "layer_types": ["full_attention", "sliding_attention"] * 2}
  with pytest.raises(hf.HFFormatError, match=r"layer_types has sliding_attention layers, but use_sliding_window="
                                             r"false \(sliding_window=8 is then dropped"):
    hf.parse_hf_config(cfg)
  spec = hf.spec_from_hf_config({**cfg, "use_sliding_window": True})
  assert spec.layer_kinds == ("full", "sliding") * 2 and spec.sliding_window == 8


def test_mistral_layer_types_are_read_as_auto_config_reads_them():
  """AutoConfig loads a mistral config.json with layer_types as MinistralConfig, whose layers follow layer_types
  (tests/test_hf_oracle.py checks the logits against AutoModelForCausalLM)."""
  cfg = {**LLAMA_TINY, "architectures": ["MistralForCausalLM"], "num_hidden_layers": 4, "sliding_window": 8,
         "layer_types": ["full_attention", "sliding_attention"] * 2}
  family, spec, notes = hf.parse_hf_config(cfg)
  assert family == "mistral" and spec.layer_kinds == ("full", "sliding") * 2 and spec.sliding_window == 8
  assert any("Ministral" in n for n in notes) and not any("ignored" in n for n in notes)
  exported = hf.hf_config_from_spec(spec)
  assert exported["architectures"] == ["MistralForCausalLM"] and exported["layer_types"] == cfg["layer_types"]
  assert hf.parse_hf_config(exported)[:2] == (family, spec)
  every = hf.parse_hf_config({**cfg, "layer_types": ["sliding_attention"] * 4})
  assert every[1].layer_types == () and "layer_types" not in hf.hf_config_from_spec(every[1])


def test_f64_tensors_are_read_only_when_exact_in_float32(tmp_path):
  _, spec = _spec(LLAMA_TINY)
  params = weights.init_params(spec, 3)
  hf.save_hf_checkpoint(tmp_path, spec, params)
  tensors, _ = hf.read_safetensors(tmp_path / "model.safetensors")
  name = "model.norm.weight"
  f64 = {k: (("F64", v.shape, v.astype("<f8").tobytes()) if k == name else ("F32", v.shape, v.tobytes()))
         for k, v in tensors.items()}
  _write_raw_safetensors(tmp_path / "model.safetensors", f64)
  ck = hf.load_hf_checkpoint(tmp_path)
  assert np.array_equal(ck.params["ln_f.weight"], params["ln_f.weight"])
  assert any("F64" in n and "exact" in n for n in ck.notes)
  lossy = tensors[name].astype(np.float64) + 1e-12
  _write_raw_safetensors(tmp_path / "model.safetensors", {**f64, name: ("F64", lossy.shape, lossy.tobytes())})
  with pytest.raises(hf.HFFormatError, match="'model.norm.weight' is float64 \\(F64\\) and its values do not fit"):
    hf.load_hf_checkpoint(tmp_path)


def test_a_tensor_holding_nan_or_inf_is_refused_naming_it(tmp_path):
  """A checkpoint with a non-finite weight is bad input (exit 2 through HFFormatError), not a run that goes NaN."""
  _, spec = _spec(LLAMA_TINY)
  params = weights.init_params(spec, 3)
  hf.save_hf_checkpoint(tmp_path, spec, params)
  tensors, _ = hf.read_safetensors(tmp_path / "model.safetensors")
  name = "model.layers.0.self_attn.q_proj.weight"
  for bad in (np.nan, np.inf):
    broken = tensors[name].copy()
    broken[0, :3] = bad
    raw = {k: ("F32", v.shape, (broken if k == name else v).astype("<f4").tobytes()) for k, v in tensors.items()}
    _write_raw_safetensors(tmp_path / "model.safetensors", raw)
    with pytest.raises(hf.HFFormatError, match=f"tensor '{name}' holds 3 NaN/inf value"):
      hf.load_hf_checkpoint(tmp_path)


@pytest.mark.parametrize("n_types", [4, 8])
def test_layer_types_of_another_length_than_the_layers_is_refused_naming_both_and_the_file(tmp_path, n_types):
  """transformers refuses it (Gemma3TextConfig's validate_layer_type: num_hidden_layers must equal the number of
  layer_types); parity made every layer sliding when the short list was all sliding_attention."""
  from parity.hf.files import load_hf_checkpoint
  cfg = {**GEMMA3_TINY, "sliding_window": 16, "layer_types": ["sliding_attention"] * n_types}
  with pytest.raises(hf.HFFormatError, match=f"layer_types has {n_types} entries but num_hidden_layers is 6"):
    hf.parse_hf_config(cfg)
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(hf.HFFormatError, match=re.escape(str(tmp_path / "config.json")) + ".*layer_types has"):
    load_hf_checkpoint(tmp_path)
  transformers = pytest.importorskip("transformers")
  with pytest.raises(Exception, match="must be equal to the number of `layer_types`"):
    transformers.Gemma3TextConfig(**{k: v for k, v in cfg.items() if k != "architectures"})


def test_an_absurd_layer_count_is_refused_before_anything_is_built(tmp_path, monkeypatch):
  """num_hidden_layers=10^9 was refused only after 258 s and 8.5 GB (a per-layer list of 10^9 layer types). The
  limit is this host's memory against the float32 weights the checkpoint would load (the sizing code's parameter
  count, per layer: cheap for any depth)."""
  import time
  from parity.hf.files import load_hf_checkpoint
  from parity.sizing import host_limits
  from parity.sizing.resources import _param_count
  cfg = {**GEMMA3_TINY, "num_hidden_layers": 10**6}
  params = _param_count(dataclasses.replace(hf.spec_from_hf_config(GEMMA3_TINY), n_layers=10**6, layer_types=()))
  monkeypatch.setattr(host_limits, "host_memory", lambda: host_limits.HostMemory(4 * params - 1, None))
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(hf.HFFormatError, match=re.escape(str(tmp_path / "config.json")) +
                     f".*{params:,} parameters \\(num_hidden_layers=1,000,000, hidden_size=32\\).*this machine has"):
    load_hf_checkpoint(tmp_path)
  monkeypatch.undo()
  (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 10**9}))
  t0 = time.monotonic()
  with pytest.raises(hf.HFFormatError, match="num_hidden_layers=1,000,000,000"):
    load_hf_checkpoint(tmp_path)
  assert time.monotonic() - t0 < 5
