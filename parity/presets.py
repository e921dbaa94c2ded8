"""The run presets: named RunSpecs a run starts from (`parity compare --preset NAME`, a config's `preset:`).

Model-size presets for the memory model and planner (gpt2-124m, llama-7b, ...) are parity.hf.MODEL_PRESETS.
"""
from __future__ import annotations

from parity.errors import SpecError
from parity.spec import ModelSpec, RunSpec, TrainSpec

__all__ = ["PRESETS", "DEFAULT_PRESET", "preset"]

_TINY_TRAIN = TrainSpec(steps=16, micro_batch_size=4, seq_len=32, lr=1e-3, warmup_steps=3, eval_every=8,
                        eval_batches=2)
"""gpt2-tiny's training: 16 steps of 4 x 32 tokens."""
_ROPE_MODEL = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64,
                   norm="rmsnorm", norm_eps=1e-5, mlp="swiglu", position="rope", bias=False, tie_embeddings=False)
"""A LLaMA-layout model of gpt2-tiny's size (d_model 64, 2 layers) with GQA 4/2."""
_GEMMA_MODEL = dict(_ROPE_MODEL, norm_eps=1e-6, mlp="geglu", gelu_approximate=True, norm_plus_one=True,
                    embed_scale=64 ** 0.5, post_norms=True, tie_embeddings=True)
"""The Gemma layout at that size: (1 + w) RMSNorm, GeGLU with the tanh GELU, embeddings x sqrt(d_model), post-norms,
tied head."""


def _tiny(model: dict, **fields) -> RunSpec:
  """A run preset of gpt2-tiny's size and training (`_TINY_TRAIN`) with `model` and `fields` as its ModelSpec."""
  return RunSpec(model=ModelSpec(**{**model, **fields}), train=_TINY_TRAIN)


PRESETS: dict[str, RunSpec] = {
    # ~3.4 M params; all three sides finish in a few minutes on 2 CPU cores.
    "gpt2-small-cpu": RunSpec(),
    # ~0.1 M params, for tests: seconds per side. lr 1e-3: at 3e-3 a loss spike near step 35 makes two
    # correct fp32 stacks drift apart past 1e-5 by step ~40 (rounding amplified by unstable training).
    "gpt2-tiny": RunSpec(
        model=ModelSpec(d_model=64, n_layers=2, n_heads=2, max_seq_len=64),
        train=TrainSpec(steps=16, micro_batch_size=4, seq_len=32, lr=1e-3, warmup_steps=3,
                        eval_every=8, eval_batches=2)),
    # ~0.5 M params, 100 steps: the configuration docs/numerics.md measured.
    "gpt2-mini": RunSpec(
        model=ModelSpec(d_model=128, n_layers=2, n_heads=4, max_seq_len=64),
        train=TrainSpec(steps=100, micro_batch_size=8, seq_len=64, warmup_steps=10, eval_every=25)),
    # The padded SFT path end to end without a download: docstring -> body pairs of this Python's
    # stdlib, byte-level (parity.dataset.demo: vocab 258, PAD 256, EOS 257), gpt2-tiny's width, 128-token rows
    # (longer examples are truncated and counted in the data card), eval on the held-out last 10% of the examples.
    "sft-tiny": RunSpec(
        model=ModelSpec(d_model=64, n_layers=2, n_heads=2, max_seq_len=128, vocab_size=258),
        train=TrainSpec(steps=8, micro_batch_size=4, grad_accum_steps=2, seq_len=128, lr=1e-3, warmup_steps=3,
                        eval_every=4, eval_batches=2, layout="padded"),
        data="sft-demo"),
    # ---- one per model family, gpt2-tiny's size and training, each family's features on (their HF
    # model-size presets are parity.hf.MODEL_PRESETS). Llama 3.x: rope_scaling llama3 with original_max 16, so that
    # the 32-token rows reach past it (positions above original_max are where llama3 scaling differs from none).
    "llama3-tiny": _tiny(_ROPE_MODEL, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    # Qwen2/2.5: biases on q/k/v only (o_proj and the MLP without).
    "qwen2-tiny": _tiny(_ROPE_MODEL, rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True),
    # Qwen3: per-head q/k RMSNorm and a head_dim of its own (4 heads x 32 = 128 != d_model 64).
    "qwen3-tiny": _tiny(_ROPE_MODEL, rope_theta=1000000.0, norm_eps=1e-6, d_head=32, qk_norm=True),
    # Gemma 2: (1 + w) RMSNorm, GeGLU (tanh), embeddings x sqrt(64), post-norms, head_dim 32 with
    # query_pre_attn_scalar 16 (attn_scale 16 ** -0.5, not 1/sqrt(head_dim)), sliding window 8 < seq_len 32 on the
    # even layers. Soft-caps 2 (attention) and 3 (final) instead of 50 / 30: at this size and init the scaled scores
    # are ~0.04 and the logits ~0.2 (std, estimated), where cap * tanh(x / cap) differs from x by x^2 / (3 cap^2)
    # relative: under 1e-5 for 50 / 30, ~1e-4 / ~1e-3 for these, and more as training grows them.
    "gemma2-tiny": _tiny(_GEMMA_MODEL, d_head=32, attn_scale=16 ** -0.5, attn_softcap=2.0, final_softcap=3.0,
                         sliding_window=8, layer_types=("sliding", "full")),
    # Gemma 3: the Gemma norms and MLP, q/k norms, 3 layers with HF's pattern rule at period 3 (sliding, sliding,
    # full; the 27B's is 5:1), window 8, local rotary base 1e4 on the sliding layers and theta 1e6 with linear
    # scaling 8 on the full one.
    "gemma3-tiny": _tiny(_GEMMA_MODEL, n_layers=3, d_head=32, attn_scale=16 ** -0.5, qk_norm=True, sliding_window=8,
                         layer_types=("sliding", "sliding", "full"), rope_theta=1000000.0,
                         rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_local_theta=10000.0),
    # Mistral: every layer a sliding window of 8 < seq_len 32 (really applied, not cut down to max_seq_len).
    "mistral-tiny": _tiny(_ROPE_MODEL, sliding_window=8),
}
DEFAULT_PRESET = "gpt2-small-cpu"


def preset(name: str) -> RunSpec:
  """Returns the named preset. Raises SpecError listing the known names."""
  try:
    return PRESETS[name]
  except (KeyError, TypeError):  # TypeError: a config's `preset:` that is a list or mapping
    raise SpecError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}") from None
