"""The model families: one `Family` row each, the one table every other place reads.

A family is one Hugging Face causal-LM class and what parity knows of it: its transformers class and config class,
the config.json `model_type` of that config class, the tensor naming of its checkpoints, the config.json keys
`parity.hf.config.parse_hf_config` reads with the config class's default for each (a config.json may omit any of
them), and the names of its presets (the run presets of `parity.presets.PRESETS` and the model-size presets of
`parity.hf.presets.MODEL_PRESETS`). The reader of config.json (`parity.hf.config`), its writer (`parity.hf.export`),
the tensor tables (`parity.hf.tensors`) and the CLI's descriptions take every class name, model_type and default
from here. tests/test_families.py checks the rows against transformers' own classes, that every family name the
code compares with has a row, and that every preset has the row of its family.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Any, Mapping

__all__ = ["Family", "FAMILIES", "by_name", "by_class", "names"]


@dataclasses.dataclass(frozen=True)
class Family:
  """One model family.

  Attributes:
    name: parity's name of the family ('gpt2', 'llama', 'mistral', 'qwen2', 'qwen3', 'gemma', 'gemma2', 'gemma3').
    hf_class: the transformers causal-LM class (config.json `architectures[0]`), e.g. 'Gemma3ForCausalLM'.
    config_class: its transformers config class, e.g. 'Gemma3TextConfig'.
    model_type: that config class's `model_type` (config.json `model_type`), e.g. 'gemma3_text'.
    tensor_names: how its checkpoints name tensors: 'gpt2' (GPT-2's transformer.h.i.*) or 'llama' (model.layers.i.*).
    defaults: every config.json key the reader takes a default for, with the config class's default (transformers
      5.24); the rotary keys (rope_theta, rope_parameters, rope_scaling) are read for every rotary family alike.
    default_theta: (global, sliding-layer) rotary base when config.json gives none (None: the global one).
    run_presets: its run presets (parity.presets.PRESETS).
    model_presets: its model-size presets (parity.hf.presets.MODEL_PRESETS).
  """
  name: str
  hf_class: str
  config_class: str
  model_type: str
  tensor_names: str
  defaults: Mapping[str, Any]
  default_theta: tuple[float, float | None] = (10_000.0, None)
  run_presets: tuple[str, ...] = ()
  model_presets: tuple[str, ...] = ()


def _frozen(keys: Mapping[str, Any] | None = None, **more: Any) -> Mapping[str, Any]:
  """A read-only mapping of `keys` then `more` (a later key replaces an earlier one in its place)."""
  return types.MappingProxyType({**(keys or {}), **more})


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

FAMILIES: tuple[Family, ...] = (
    Family("gpt2", "GPT2LMHeadModel", "GPT2Config", "gpt2", "gpt2", _frozen(
        vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
        activation_function="gelu_new", layer_norm_epsilon=1e-5, initializer_range=0.02, scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False, tie_word_embeddings=True,
        add_cross_attention=False),
        run_presets=("gpt2-small-cpu", "gpt2-tiny", "gpt2-mini", "sft-tiny"),
        model_presets=("gpt2-124m", "gpt2-355m", "gpt2-774m", "gpt2-1.5b")),
    Family("llama", "LlamaForCausalLM", "LlamaConfig", "llama", "llama", _frozen(_LLAMA),
           run_presets=("llama3-tiny",),
           model_presets=("llama-1b", "llama-3.2-3b", "llama-3.1-8b", "llama-3.1-70b", "llama-7b", "llama-13b",
                          "llama-70b")),
    Family("mistral", "MistralForCausalLM", "MistralConfig", "mistral", "llama", _frozen(
        _LLAMA, intermediate_size=14336, num_key_value_heads=8, max_position_embeddings=4096 * 32,
        sliding_window=4096),
        run_presets=("mistral-tiny",), model_presets=("mistral-7b",)),
    Family("qwen2", "Qwen2ForCausalLM", "Qwen2Config", "qwen2", "llama", _frozen(_QWEN),
           run_presets=("qwen2-tiny",), model_presets=("qwen2.5-7b",)),
    Family("qwen3", "Qwen3ForCausalLM", "Qwen3Config", "qwen3", "llama",
           _frozen(_QWEN, head_dim=128, attention_bias=False),
           run_presets=("qwen3-tiny",), model_presets=("qwen3-8b", "qwen3-32b")),
    Family("gemma", "GemmaForCausalLM", "GemmaConfig", "gemma", "llama", _frozen(
        vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=16, head_dim=256, hidden_act="gelu_pytorch_tanh", max_position_embeddings=8192,
        initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
        attention_dropout=0.0, use_bidirectional_attention=None)),
    Family("gemma2", "Gemma2ForCausalLM", "Gemma2Config", "gemma2", "llama", _frozen(_GEMMA2),
           run_presets=("gemma2-tiny",), model_presets=("gemma-2-9b", "gemma-2-27b")),
    Family("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", "gemma3_text", "llama", _frozen(
        _GEMMA2, vocab_size=262208, max_position_embeddings=131072, final_logit_softcapping=None,
        attn_logit_softcapping=None, use_bidirectional_attention=False, sliding_window_pattern=6),
        default_theta=(1_000_000.0, 10_000.0), run_presets=("gemma3-tiny",), model_presets=("gemma-3-27b",)),
)
"""One row per family, in the order `parity.hf.export.family_of_spec` tries them (the first whose architecture holds
a spec's every field)."""

_BY_NAME = {f.name: f for f in FAMILIES}
_BY_CLASS = {f.hf_class: f for f in FAMILIES}


def names() -> tuple[str, ...]:
  """The families' names, in FAMILIES' order."""
  return tuple(_BY_NAME)


def by_name(name: str) -> Family:
  """The row of family `name` (KeyError for a name without a row: a bug, never user input)."""
  return _BY_NAME[name]


def by_class(hf_class: str) -> Family | None:
  """The row whose causal-LM class is `hf_class` (config.json `architectures[0]`), or None."""
  return _BY_CLASS.get(hf_class)

