"""Each newer model family trained head to head from a random Hugging Face checkpoint built in the test.

For Llama 3.x (llama3 rotary scaling), Qwen2 (q/k/v biases), Qwen3 (q/k norms, a decoupled head_dim), Gemma 2
(soft-caps, alternating sliding-window layers), Gemma 3 (5:1 local:global shortened to 2:1, local rotary base,
linear scaling on the global layers) and Mistral (a window shorter than the sequence): transformers builds the
tiny model with its own random init (nothing is downloaded) and `save_pretrained`s it; `parity compare
--hf-model DIR` then runs jax, deepspeed and torch on it, 3 steps, in fp32 at the fp32 tolerances and in bf16 by
the noise envelope (parity.verdict.envelope; tests/test_families_compare_bf16.py, a file of its own so that
`--dist loadfile` runs the two halves on two workers), and must PASS. Each checkpoint's window (8) is shorter than the
32-token rows and each rotary scaling changes angles inside them, so a side that ignored a field would differ.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import requires_all

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
_SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
FAMILIES = {
    # name: (config class, model class, the family's own config keys)
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_parameters={"rope_type": "default",
                                                                       "rope_theta": 1000000.0})),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, attention_bias=False)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=8, attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0, layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
}


def _checkpoint(family: str, folder: Path) -> Path:
  config_cls, model_cls, own = FAMILIES[family]
  torch.manual_seed(0)
  config = getattr(transformers, config_cls)(**{**_SMALL, **own})
  getattr(transformers, model_cls)(config).save_pretrained(folder)
  return folder


def _compare(hf: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "parity", "compare", "--preset", "gpt2-tiny", "--steps", "3",
                         "--sides", "jax,deepspeed,torch", "--determinism-steps", "0", "--hf-model", str(hf),
                         "--out", str(out), "--no-progress", *extra],
                        cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.mark.process
@pytest.mark.slow
@requires_all
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_passes_three_sides_fp32(family, tmp_path):
  check_family(family, "fp32", tmp_path)


def check_family(family: str, precision: str, tmp_path: Path) -> None:
  """The compare of `family`'s checkpoint in `precision` PASSes, on the checkpoint's architecture and fields."""
  hf = _checkpoint(family, tmp_path / "hf")
  extra = () if precision == "fp32" else ("--set", 'train.precision="bf16"')
  p = _compare(hf, tmp_path / "run", *extra)
  assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
  rep = json.loads((tmp_path / "run" / "report.json").read_text())
  assert rep["verdict"]["passed"]
  assert rep["checkpoint"]["architecture"] == FAMILIES[family][1]
  assert set(rep["sides"]) == {"jax", "deepspeed", "torch"}
  model = rep["run"]["model"]
  want = {"llama3": {"rope_scaling"}, "qwen2": {"qkv_bias"}, "qwen3": {"qk_norm", "d_head"},
          "gemma2": {"attn_softcap", "final_softcap", "post_norms", "layer_types"},
          "gemma3": {"qk_norm", "rope_local_theta", "rope_scaling", "layer_types"},
          "mistral": {"sliding_window"}}[family]
  assert all(model.get(k) not in (None, False, []) for k in want), {k: model.get(k) for k in want}
