"""The model-family presets: model-size presets (exact published sizes, accepted by `parity
estimate` / `parity plan --model`), CPU-size run presets per family, and what the memory and time models make of
head_dim, GQA, the family norms and soft-caps and 128k-262k vocabularies."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from parity import architecture
from parity.cli import main
from parity.hf import family_of_spec
from parity.hf.families import by_name
from parity.hf.presets import HF_REPOS, MODEL_PRESETS, PUBLISHED_PARAM_COUNTS, model_preset_name
from parity.pipeline.resolve import resolve_run
from parity.presets import PRESETS
from parity.sizing import cost, memory, plans
from parity.sizing.activations import activation_bytes, block_activation_bytes, logits_bytes
from parity.spec import SpecError
from parity.weights import n_params

FAMILY_SIZES = ["llama-1b", "llama-3.2-3b", "llama-3.1-8b", "llama-3.1-70b", "mistral-7b", "qwen2.5-7b", "qwen3-8b",
                "qwen3-32b", "gemma-2-9b", "gemma-2-27b", "gemma-3-27b"]
FAMILY_RUNS = ["llama3-tiny", "qwen2-tiny", "qwen3-tiny", "gemma2-tiny", "gemma3-tiny", "mistral-tiny"]
GiB = 2**30


# ----------------------------------------------------------------------------- model-size presets


@pytest.mark.parametrize("name", FAMILY_SIZES)
def test_family_size_presets_have_the_published_parameter_count(name):
  assert n_params(MODEL_PRESETS[name].validate()) == PUBLISHED_PARAM_COUNTS[name] and name in HF_REPOS


def _hf_model(name: str, spec):
  """(config class, model class, kwargs) of transformers for a preset, from its family's row (parity.hf.families)."""
  import transformers as T
  row = by_name(family_of_spec(spec))
  assert name in row.model_presets
  cfg, model = row.config_class, row.hf_class
  kw = dict(vocab_size=spec.vocab_size, hidden_size=spec.d_model, intermediate_size=spec.ffn_dim,
            num_hidden_layers=spec.n_layers, num_attention_heads=spec.n_heads, num_key_value_heads=spec.kv_heads,
            head_dim=spec.head_dim, tie_word_embeddings=spec.tie_embeddings)
  return getattr(T, cfg), getattr(T, model), kw


@pytest.mark.parametrize("name", ["llama-3.2-3b", "qwen2.5-7b", "qwen3-32b", "gemma-2-27b", "gemma-3-27b",
                                  "mistral-7b"])
def test_transformers_counts_the_same_parameters(name):
  """The HF model of the preset's family and sizes, built on the meta device (no memory, no download), has
  n_params() parameters: q/k/v biases (Qwen2), q/k norms (Qwen3, Gemma 3), post-norms (Gemma) included."""
  torch = pytest.importorskip("torch")
  pytest.importorskip("transformers")
  cfg, model, kw = _hf_model(name, MODEL_PRESETS[name])
  with torch.device("meta"):
    hf_model = model(cfg(**kw))
  assert hf_model.num_parameters() == n_params(MODEL_PRESETS[name]) == PUBLISHED_PARAM_COUNTS[name]


def test_family_size_presets_carry_their_features():
  m = MODEL_PRESETS
  assert m["llama-3.1-8b"].rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
  assert m["llama-1b"].rope_scaling["factor"] == 32.0 and m["llama-1b"].max_seq_len == 131072
  assert m["qwen2.5-7b"].linear_bias("qkv") and not m["qwen2.5-7b"].linear_bias("out")
  assert m["qwen3-32b"].n_heads * m["qwen3-32b"].head_dim == 8192 != m["qwen3-32b"].d_model
  assert m["gemma-2-27b"].scale == pytest.approx(144 ** -0.5)
  assert m["gemma-2-27b"].layer_kinds[:2] == ("sliding", "full")
  g3 = m["gemma-3-27b"]
  assert g3.layer_kinds.count("full") == 10 and g3.layer_kinds[5] == "full" and g3.layer_kinds[:5] == ("sliding",) * 5
  assert architecture.layer_rope(g3, 0) == (10000.0, None)
  assert architecture.layer_rope(g3, 5) == (1000000.0, {"rope_type": "linear", "factor": 8.0})
  assert set(m["mistral-7b"].layer_kinds) == {"sliding"} and m["mistral-7b"].sliding_window == 4096


@pytest.mark.parametrize("given, name", [("llama-3.1-8b", "llama-3.1-8b"), ("Llama-3.1-8B", "llama-3.1-8b"),
                                         ("meta-llama/Llama-3.2-1B", "llama-1b"), ("Qwen/Qwen3-8B", "qwen3-8b"),
                                         ("Mistral-7B-v0.1", "mistral-7b"), ("GEMMA-3-27B-PT", "gemma-3-27b"),
                                         ("gpt2-xl", "gpt2-1.5b"), (" llama-7b ", "llama-7b")])
def test_model_preset_names_accept_the_hf_names(given, name):
  assert model_preset_name(given) == name
  assert resolve_run(model=given).preset == name


def test_an_unknown_model_preset_lists_the_known_ones():
  with pytest.raises(SpecError, match="known model presets: .*gemma-3-27b"):
    model_preset_name("llama-4-8b")


# ----------------------------------------------------------------------------- estimate and plan, in process


@pytest.mark.parametrize("name", FAMILY_SIZES)
def test_estimate_and_plan_work_for_every_family_size_preset(name, tmp_path, capsys):
  est, pln = tmp_path / "e.json", tmp_path / "p.json"
  assert main(["estimate", "--model", name, "--json", str(est)]) == 0
  assert json.loads(est.read_text())["total_params"] == PUBLISHED_PARAM_COUNTS[name]
  assert main(["plan", "--model", name, "--devices", "8", "--host-memory", "1024", "--json", str(pln)]) == 0
  assert json.loads(pln.read_text())["choice"] in plans.PLANS
  out = capsys.readouterr().out
  assert "peak device" in out and "choice:" in out


def test_plan_llama_3_1_8b_by_its_hf_name_on_one_h100(tmp_path):
  pln = tmp_path / "p.json"
  assert main(["plan", "--model", "Llama-3.1-8B", "--json", str(pln)]) == 0
  data = json.loads(pln.read_text())
  assert data["choice"] == "scan-offload-remat"  # half of its optimizer state offloaded: what fits the device
  assert next(c for c in data["ranked"] if c["name"] == data["choice"])["jax_opt_ratio"] == 0.5


@pytest.mark.parametrize("name", FAMILY_RUNS)
def test_estimate_and_plan_work_for_every_family_run_preset(name, capsys):
  assert main(["estimate", "--preset", name]) == 0
  assert main(["plan", "--preset", name]) == 0
  assert f"{n_params(PRESETS[name].model):,} params" in capsys.readouterr().out


# ----------------------------------------------------------------------------- run presets at CPU size


def test_family_run_presets_exercise_their_features_at_tiny_size():
  for name in FAMILY_RUNS:
    run = PRESETS[name].validate()
    m, t = run.model, run.train
    assert (m.d_model, t.seq_len, t.steps, t.micro_batch_size) == (64, 32, 16, 4), name
    if m.sliding_window is not None:
      assert m.sliding_window < t.seq_len, f"{name}: a window >= seq_len is full attention"
  sc = PRESETS["llama3-tiny"].model.rope_scaling
  assert sc["rope_type"] == "llama3" and sc["original_max_position_embeddings"] < PRESETS["llama3-tiny"].train.seq_len
  m = PRESETS["llama3-tiny"].model
  assert not np.array_equal(architecture.inv_freq(m.head_dim, m.rope_theta),
                            architecture.inv_freq(m.head_dim, m.rope_theta, sc))
  q2, q3 = PRESETS["qwen2-tiny"].model, PRESETS["qwen3-tiny"].model
  assert q2.linear_bias("qkv") and not q2.linear_bias("out") and not q2.linear_bias("mlp")
  assert q3.qk_norm and q3.n_heads * q3.head_dim != q3.d_model
  g2, g3 = PRESETS["gemma2-tiny"].model, PRESETS["gemma3-tiny"].model
  assert g2.attn_softcap and g2.final_softcap and set(g2.layer_kinds) == {"sliding", "full"} and g2.post_norms
  assert g2.norm_plus_one and g2.mlp == "geglu" and g2.embed_scale == 8.0 and g2.scale != 1 / np.sqrt(g2.head_dim)
  assert set(g3.layer_kinds) == {"sliding", "full"} and g3.qk_norm and g3.rope_local_theta is not None
  assert architecture.layer_rope(g3, 0) != architecture.layer_rope(g3, g3.layer_kinds.index("full"))
  assert set(PRESETS["mistral-tiny"].model.layer_kinds) == {"sliding"}


# ----------------------------------------------------------------------------- memory and time models


def test_block_activations_use_head_dim_and_the_family_norms():
  """Qwen3-32B: q = 64 x 128 = 8192 wide (not d_model 5120), k = 8 x 128, q/k norm inputs (q + k); the formula of
  block_activation_bytes term by term, bf16, micro batch 1 x 2048."""
  m, s, b, e = MODEL_PRESETS["qwen3-32b"], 2048, 1, 2
  h, f, a, q, k = 5120, 25600, 64, 8192, 1024
  norms, qkv, attn_out, mlp, qk_norms = 2 * h + h, q + 2 * k, q, h + 4 * f, q + k
  expected = e * (s * b * (norms + qkv + attn_out + mlp + qk_norms) + a * s * s * b)
  assert block_activation_bytes(m, b, s, e) == (expected, 0)
  repeated = block_activation_bytes(m, b, s, e, kv_repeated=True)[0]
  assert repeated - block_activation_bytes(m, b, s, e)[0] == e * s * b * 2 * (q - k)
  g = MODEL_PRESETS["gemma-2-27b"]  # post-norm inputs 2·h, the scores' tanh (attention soft-cap): one a·s²·b more
  plain = dataclasses.replace(g, post_norms=False, attn_softcap=None)
  assert block_activation_bytes(g, b, s, e)[0] - block_activation_bytes(plain, b, s, e)[0] == \
      e * (s * b * 2 * g.d_model + g.n_heads * s * s * b)


def test_logits_bytes_grow_with_the_vocabulary():
  """(B, T, V) logits in bf16 + their float32 upcast saved (6 bytes per element), 2 more with a final soft-cap, and a
  float32 gradient (4) in the step: at 262,208 ids they outweigh several blocks."""
  s, b = 2048, 1
  g3 = MODEL_PRESETS["gemma-3-27b"]
  small = dataclasses.replace(g3, vocab_size=32000)
  grow = activation_bytes(g3, b, s, 2)[0] - activation_bytes(small, b, s, 2)[0]
  assert grow == 6 * s * b * (262208 - 32000)
  assert logits_bytes(g3, b, s, 2) == (6 * s * b * 262208, 4 * s * b * 262208)
  assert logits_bytes(g3, b, s, 4) == (4 * s * b * 262208, 4 * s * b * 262208)  # fp32: no separate upcast
  assert logits_bytes(MODEL_PRESETS["gemma-2-9b"], b, s, 2)[0] == 8 * s * b * 256000  # + the final soft-cap's tanh
  total = sum(logits_bytes(g3, b, s, 2))
  assert total > 3 * block_activation_bytes(g3, b, s, 2)[0] and total > 4 * GiB
  run = resolve_run(model="gemma-3-27b").spec
  grads = [r for r in memory.estimate(run) if r.note.startswith("in-step (forward/backward: float32 gradient")]
  assert [r.bytes for r in grads] == [4 * s * b * 262208] * 2  # one per side, counted in the forward/backward peak


def test_deepspeed_side_saves_k_and_v_repeated_to_every_head():
  """torch_impl repeats K/V to n_heads before SDPA; the JAX side contracts grouped heads: the two sides' saved
  activations differ by L·e·sb·2(q - k) on a GQA model, and not at all without GQA."""
  run = resolve_run(model="llama-3.1-8b").spec
  rows = memory.estimate(run)
  act = {r.side: r.bytes for r in rows if r.category == "activations" and r.note == "remat none"}
  m, sb, e = run.model, run.train.seq_len * run.train.micro_batch_size, 2
  assert act["deepspeed"] - act["jax"] == m.n_layers * e * sb * 2 * (4096 - 1024)
  mha = memory.estimate(resolve_run(model="llama-7b").spec)
  assert len({r.bytes for r in mha if r.category == "activations" and r.note == "remat none"}) == 1


def test_attention_flops_use_heads_times_head_dim():
  """PaLM's 12·L·H·Q·s: Qwen3-32B's attention is 64 x 128 = 8192 wide, not d_model 5120."""
  m, s = MODEL_PRESETS["qwen3-32b"], 2048
  assert cost.flops_per_token(m, s) == 6 * n_params(m) + 12 * 64 * 8192 * s
  assert cost.recompute_flops_per_token(m, s, "save_dots_no_batch") == 4 * 64 * 8192 * s
