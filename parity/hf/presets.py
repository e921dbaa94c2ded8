"""Real model sizes as ModelSpecs (`MODEL_PRESETS`), their published parameter counts, and the names
`parity estimate --model` / `parity plan --model` accept (`model_preset_name`).

Each spec takes the published config.json of the Hugging Face repository named in `HF_REPOS` key for key (the
ModelSpec field's docstring names its HF key). What the memory and time models do not need is still given exactly,
so a preset is the model, not an approximation of it.
"""
from __future__ import annotations

from parity.spec import ModelSpec, SpecError

__all__ = ["MODEL_PRESETS", "PUBLISHED_PARAM_COUNTS", "HF_REPOS", "MODEL_ALIASES", "model_preset_name"]

_LLAMA = dict(norm="rmsnorm", norm_eps=1e-5, mlp="swiglu", position="rope", bias=False)
_LLAMA3 = dict(_LLAMA, rope_theta=500000.0, max_seq_len=131072)
_QWEN = dict(norm="rmsnorm", norm_eps=1e-6, mlp="swiglu", position="rope", bias=False, rope_theta=1000000.0,
             tie_embeddings=False)
_GEMMA = dict(norm="rmsnorm", norm_eps=1e-6, mlp="geglu", gelu_approximate=True, position="rope", bias=False,
              norm_plus_one=True, post_norms=True, tie_embeddings=True)


def _llama3_rope(factor: float) -> dict:
  """HF rope_scaling of Llama 3.1 (factor 8) and 3.2 (factor 32): rope_type 'llama3', low 1, high 4, original 8192."""
  return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def _gemma2(d: int, layers: int, heads: int, kv: int, head_dim: int, ff: int, query_pre_attn_scalar: int
            ) -> ModelSpec:
  """A Gemma 2 config.json: vocab 256000, context 8192, theta 1e4, soft-caps 50 (attention) / 30 (final), window
  4096 on the even layers (HF Gemma2Config.layer_types: 'sliding_attention' where (i + 1) % 2)."""
  return ModelSpec(vocab_size=256000, d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=kv, d_head=head_dim,
                   d_ff=ff, max_seq_len=8192, rope_theta=10000.0, attn_scale=query_pre_attn_scalar ** -0.5,
                   embed_scale=d ** 0.5, attn_softcap=50.0, final_softcap=30.0, sliding_window=4096,
                   layer_types=tuple("sliding" if (i + 1) % 2 else "full" for i in range(layers)), **_GEMMA)


MODEL_PRESETS: dict[str, ModelSpec] = {
    # OpenAI GPT-2 (Radford et al. 2019), HF gpt2 / gpt2-medium / gpt2-large / gpt2-xl.
    "gpt2-124m": ModelSpec(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, max_seq_len=1024),
    "gpt2-355m": ModelSpec(vocab_size=50257, d_model=1024, n_layers=24, n_heads=16, max_seq_len=1024),
    "gpt2-774m": ModelSpec(vocab_size=50257, d_model=1280, n_layers=36, n_heads=20, max_seq_len=1024),
    "gpt2-1.5b": ModelSpec(vocab_size=50257, d_model=1600, n_layers=48, n_heads=25, max_seq_len=1024),
    # meta-llama/Llama-3.2-1B: tied head, GQA 32/8, theta 5e5, context 131072 with rope_scaling llama3 (factor 32).
    "llama-1b": ModelSpec(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192,
                          tie_embeddings=True, rope_scaling=_llama3_rope(32.0), **_LLAMA3),
    # meta-llama/Llama-3.2-3B: as 1B, 28 layers x 3072, 24 heads (GQA 8) of 128.
    "llama-3.2-3b": ModelSpec(vocab_size=128256, d_model=3072, n_layers=28, n_heads=24, n_kv_heads=8, d_ff=8192,
                              tie_embeddings=True, rope_scaling=_llama3_rope(32.0), **_LLAMA3),
    # meta-llama/Llama-3.1-8B and -70B: untied, GQA 8, theta 5e5, rope_scaling llama3 (factor 8), context 131072.
    "llama-3.1-8b": ModelSpec(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336,
                              tie_embeddings=False, rope_scaling=_llama3_rope(8.0), **_LLAMA3),
    "llama-3.1-70b": ModelSpec(vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672,
                               tie_embeddings=False, rope_scaling=_llama3_rope(8.0), **_LLAMA3),
    # meta-llama/Llama-2-{7b,13b,70b}-hf (Touvron et al. 2023, table 1); 70B uses GQA with 8 kv heads.
    "llama-7b": ModelSpec(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, d_ff=11008, max_seq_len=4096,
                          tie_embeddings=False, **_LLAMA),
    "llama-13b": ModelSpec(vocab_size=32000, d_model=5120, n_layers=40, n_heads=40, d_ff=13824, max_seq_len=4096,
                           tie_embeddings=False, **_LLAMA),
    "llama-70b": ModelSpec(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672,
                           max_seq_len=4096, tie_embeddings=False, **_LLAMA),
    # mistralai/Mistral-7B-v0.1: Llama layout, GQA 8, every layer a 4096-token sliding window, context 32768.
    "mistral-7b": ModelSpec(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336,
                            max_seq_len=32768, rope_theta=10000.0, tie_embeddings=False, sliding_window=4096,
                            **_LLAMA),
    # Qwen/Qwen2.5-7B: biases on q/k/v only (o_proj and the MLP have none), GQA 28/4, theta 1e6, context 131072
    # (its sliding_window 131072 is off: use_sliding_window false).
    "qwen2.5-7b": ModelSpec(vocab_size=152064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4, d_ff=18944,
                            max_seq_len=131072, qkv_bias=True, **_QWEN),
    # Qwen/Qwen3-8B and Qwen/Qwen3-32B: per-head q/k RMSNorm, head_dim 128 (32B: 64 x 128 = 8192 != 5120), GQA 8,
    # theta 1e6, context 40960, no biases.
    "qwen3-8b": ModelSpec(vocab_size=151936, d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8, d_head=128,
                          d_ff=12288, max_seq_len=40960, qk_norm=True, **_QWEN),
    "qwen3-32b": ModelSpec(vocab_size=151936, d_model=5120, n_layers=64, n_heads=64, n_kv_heads=8, d_head=128,
                           d_ff=25600, max_seq_len=40960, qk_norm=True, **_QWEN),
    # google/gemma-2-9b and google/gemma-2-27b (query_pre_attn_scalar 256 and 144 = d_model / heads).
    "gemma-2-9b": _gemma2(3584, 42, 16, 8, 256, 14336, 256),
    "gemma-2-27b": _gemma2(4608, 46, 32, 16, 128, 36864, 144),
    # google/gemma-3-27b-pt, its text_config (Gemma3ForCausalLM): vocab 262208, GQA 32/16 of 128,
    # query_pre_attn_scalar 168, q/k norms, no soft-caps; 5 local : 1 global (sliding_window_pattern 6: layer i
    # global where (i + 1) % 6 == 0), window 1024 with local base 1e4; global theta 1e6 with rope_scaling linear 8.
    "gemma-3-27b": ModelSpec(vocab_size=262208, d_model=5376, n_layers=62, n_heads=32, n_kv_heads=16, d_head=128,
                             d_ff=21504, max_seq_len=131072, rope_theta=1000000.0,
                             rope_scaling={"rope_type": "linear", "factor": 8.0}, attn_scale=168 ** -0.5,
                             embed_scale=5376 ** 0.5, qk_norm=True, sliding_window=1024,
                             layer_types=tuple("sliding" if (i + 1) % 6 else "full" for i in range(62)),
                             rope_local_theta=10000.0, **_GEMMA),
}
"""Real model sizes as ModelSpecs, for `parity estimate` / `parity plan` (`--model NAME`)."""

HF_REPOS = {
    "gpt2-124m": "openai-community/gpt2", "gpt2-355m": "openai-community/gpt2-medium",
    "gpt2-774m": "openai-community/gpt2-large", "gpt2-1.5b": "openai-community/gpt2-xl",
    "llama-1b": "meta-llama/Llama-3.2-1B", "llama-3.2-3b": "meta-llama/Llama-3.2-3B",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B", "llama-3.1-70b": "meta-llama/Llama-3.1-70B",
    "llama-7b": "meta-llama/Llama-2-7b-hf", "llama-13b": "meta-llama/Llama-2-13b-hf",
    "llama-70b": "meta-llama/Llama-2-70b-hf", "mistral-7b": "mistralai/Mistral-7B-v0.1",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B", "qwen3-8b": "Qwen/Qwen3-8B", "qwen3-32b": "Qwen/Qwen3-32B",
    "gemma-2-9b": "google/gemma-2-9b", "gemma-2-27b": "google/gemma-2-27b", "gemma-3-27b": "google/gemma-3-27b-pt",
}
"""The Hugging Face repository whose config.json each preset is (and whose name `--model` also accepts)."""

PUBLISHED_PARAM_COUNTS = {
    "gpt2-124m": 124_439_808, "gpt2-355m": 354_823_168, "gpt2-774m": 774_030_080, "gpt2-1.5b": 1_557_611_200,
    "llama-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824, "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496, "llama-7b": 6_738_415_616, "llama-13b": 13_015_864_320,
    "llama-70b": 68_976_648_192, "mistral-7b": 7_241_732_096, "qwen2.5-7b": 7_615_616_512,
    "qwen3-8b": 8_190_735_360, "qwen3-32b": 32_762_123_264, "gemma-2-9b": 9_241_705_984,
    "gemma-2-27b": 27_227_128_320,
    # the text model only (Gemma3ForCausalLM on text_config); the hub's 27.4 B adds the SigLIP vision tower
    "gemma-3-27b": 27_009_346_304,
}
"""Parameter counts as published (HF model cards / safetensors index / `num_parameters()`, tied head counted once);
tests/test_hf_config.py also builds each config with transformers on the meta device and counts."""


def _alias(repo: str) -> str:
  return repo.rsplit("/", 1)[-1].lower()


MODEL_ALIASES = {_alias(repo): name for name, repo in HF_REPOS.items() if _alias(repo) != name}
"""Other names of a preset: its HF repository's name, lower-cased (`llama-3.2-1b`, `mistral-7b-v0.1`, `gpt2-xl`)."""


def model_preset_name(name: str) -> str:
  """The MODEL_PRESETS key `name` means: the key itself, or its HF repository id or name in any case
  ('Llama-3.1-8B', 'meta-llama/Llama-3.1-8B', 'mistral-7b-v0.1').

  Raises:
    SpecError: no preset has that name (the known names are listed).
  """
  key = str(name).strip().lower()
  key = key if key in MODEL_PRESETS else MODEL_ALIASES.get(_alias(key), _alias(key))
  if key not in MODEL_PRESETS:
    raise SpecError(f"unknown model preset {name!r}; known model presets: {', '.join(MODEL_PRESETS)} "
                    "(or their Hugging Face repository names; see `parity presets`)")
  return key
