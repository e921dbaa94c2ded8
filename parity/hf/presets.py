"""Real model sizes as ModelSpecs (`MODEL_PRESETS`) and their published parameter counts."""
from __future__ import annotations

from parity.spec import ModelSpec

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
