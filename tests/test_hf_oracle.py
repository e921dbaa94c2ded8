"""Oracle tests: our JAX and PyTorch models against transformers on HF checkpoints.

Each case builds a randomly initialised GPT2LMHeadModel / LlamaForCausalLM / MistralForCausalLM /
Qwen2ForCausalLM / Qwen3ForCausalLM / Gemma2ForCausalLM / Gemma3ForCausalLM from a config (nothing is
downloaded), re-draws *every*
parameter (biases and norm scales too, so a mis-mapped bias cannot hide behind
HF's zero init) at a scale that gives O(1) activations and peaked attention,
saves it with `save_pretrained`, converts the folder with `parity.hf`, and checks:

  logits  of our torch model and of our JAX model == transformers' logits
  loss    (mean next-token cross-entropy) and its gradient w.r.t. every tensor

Max differences are printed; run with `pytest -s tests/test_hf_oracle.py` to see them.
"""
from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from parity import hf  # noqa: E402

# fp32 tolerances, one table (STYLE.md section 7). Measured maxima are in docs/hf.md.
TOL = {
    "logits": (1e-5, 0.0),
    # ^ abs, against transformers run in float64 (`model.double()`: the exact answer up to the
    #   fp32 cast inside HF's RMSNorm). Logits are O(1..10) here; each fp32 stack is <= ~8e-6 from
    #   it. Against transformers in float32 the bound is this plus transformers' own fp32 error
    #   (|hf32 - hf64|, measured up to ~1e-5 on the 3-layer GQA case): two fp32 stacks that each
    #   round differently can be ~2x one stack's error apart without either being wrong.
    "loss": (1e-5, 0.0),
    # ^ abs, nats; the same bound as parity.verdict.tolerances 'loss' (fp32).
    "grad": (1e-5, 1e-4),
    # ^ abs + rel (to the tensor's max |grad|): per-tensor max |a - b| <= atol + rtol * max|ref|.
    #   Gradients sum T*B terms in a different order on each side; measured <= ~1e-6 relative.
}

CASES = {
    # name: (architecture, config kwargs, sequence lengths checked for logits)
    "gpt2": ("GPT2LMHeadModel", dict(vocab_size=97, n_positions=48, n_embd=64, n_layer=2, n_head=4), (1, 7, 48)),
    "gpt2-erf-untied": ("GPT2LMHeadModel", dict(vocab_size=101, n_positions=40, n_embd=48, n_layer=2, n_head=3,
                                                n_inner=80, activation_function="gelu", tie_word_embeddings=False,
                                                layer_norm_epsilon=1e-6), (13, 40)),
    "llama-mha": ("LlamaForCausalLM", dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                           rms_norm_eps=1e-6), (5, 37, 64, 128)),
    "llama-gqa": ("LlamaForCausalLM", dict(vocab_size=89, hidden_size=64, intermediate_size=80, num_hidden_layers=3,
                                           num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32,
                                           rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True),
                  (9, 32, 77)),
    "llama-mqa-bias": ("LlamaForCausalLM", dict(vocab_size=64, hidden_size=48, intermediate_size=72,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                                max_position_embeddings=40, attention_bias=True, mlp_bias=True),
                       (11, 40)),
    "mistral-gqa": ("MistralForCausalLM", dict(vocab_size=97, hidden_size=64, intermediate_size=96,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=64, sliding_window=None), (17, 64)),
    # Llama 3.x: llama3 rotary scaling with original_max_position_embeddings 16, so it changes every wavelength above
    # 4 positions (16 / high_freq_factor) at these lengths.
    "llama3-rope": ("LlamaForCausalLM", dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                             rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                                                  low_freq_factor=1.0, high_freq_factor=4.0,
                                                                  original_max_position_embeddings=16)), (64,)),
    "qwen2-qkv-bias": ("Qwen2ForCausalLM", dict(vocab_size=89, hidden_size=64, intermediate_size=80,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=48), (48,)),
    "qwen3-head-dim": ("Qwen3ForCausalLM", dict(vocab_size=97, hidden_size=64, intermediate_size=96,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                head_dim=24, max_position_embeddings=48), (37,)),
    # Gemma 2: caps low enough to bind (scores and logits reach ~10), query_pre_attn_scalar != head_dim, and
    # a sliding and a full layer (the default alternation) with a window of 6. One logits length per new case (and
    # LOSS_SEQ for the gradients) keeps the JAX side's run time small.
    "gemma2-softcap": ("Gemma2ForCausalLM", dict(vocab_size=97, hidden_size=64, intermediate_size=96,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 head_dim=16, max_position_embeddings=48, query_pre_attn_scalar=24,
                                                 attn_logit_softcapping=5.0, final_logit_softcapping=4.0,
                                                 sliding_window=6), (48,)),
    # Gemma 3: 2 local : 1 global (sliding_window_pattern 3), local base 100, linear scaling x4 on the global layer.
    "gemma3-local-global": ("Gemma3ForCausalLM", dict(vocab_size=97, hidden_size=64, intermediate_size=96,
                                                      num_hidden_layers=3, num_attention_heads=4,
                                                      num_key_value_heads=2, head_dim=16, max_position_embeddings=48,
                                                      query_pre_attn_scalar=16, sliding_window=5,
                                                      sliding_window_pattern=3, rope_theta=10000.0,
                                                      rope_local_base_freq=100.0,
                                                      rope_scaling=dict(rope_type="linear", factor=4.0)), (48,)),
    "mistral-window": ("MistralForCausalLM", dict(vocab_size=97, hidden_size=64, intermediate_size=96,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=64, sliding_window=8), (41,)),
}
"""Sequence lengths above max_position_embeddings (LLaMA 128 > 64, 77 > 32) test a longer
context than the checkpoint was trained for: rotary models have no position table, so the
spec is widened (`max_seq_len`) with the same weights, as HF does implicitly."""

LOSS_SEQ = 23
"""Tokens per sequence of the loss/gradient check (odd, shorter than every context, longer than every window)."""

CONFIG_CLASSES = {"Gemma3ForCausalLM": "Gemma3TextConfig"}
"""Architectures whose config class is not the architecture's name with ForCausalLM -> Config."""


def _randomise(model: torch.nn.Module, seed: int, *, plus_one: bool = False) -> None:
  """Redraws every parameter: matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 0.3^2), 1-D ~ 1 or 0 + N(0, 0.1^2)
  (norm weights ~ 0 + N(0, 0.1^2) when the norm scales by 1 + weight: `plus_one`, Gemma).

  Embedding std 0.3 gives logits of std ~0.3 * sqrt(d_model) ~ 2-3 (max ~10), the range of a
  trained model's centred logits, where fp32 rounding is ~1e-6; attention is peaked enough
  that a wrong rotary angle or head grouping changes the logits by >> 1e-3.
  """
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if p.ndim == 1:
        base = 1.0 if ("norm" in name or ".ln_" in name) and not plus_one else 0.0
        p.copy_(base + 0.1 * noise)
      elif "wte" in name or "wpe" in name or "embed_tokens" in name:
        p.copy_(0.3 * noise)
      else:
        fan_in = p.shape[0] if "transformer.h." in name else p.shape[1]  # GPT-2 Conv1D is [in, out]
        p.copy_(noise / math.sqrt(fan_in))


@dataclasses.dataclass
class Case:
  name: str
  hf_model: torch.nn.Module
  hf64: torch.nn.Module
  """The same transformers model in float64: the reference for logits."""
  spec: "hf.ModelSpec"
  params: dict[str, np.ndarray]
  seqs: tuple[int, ...]


_CACHE: dict[str, Case] = {}


def _case(name: str, tmp_path_factory) -> Case:
  if name in _CACHE:
    return _CACHE[name]
  arch, kwargs, seqs = CASES[name]
  cfg_cls = getattr(transformers, CONFIG_CLASSES.get(arch) or
                    arch.replace("LMHeadModel", "Config").replace("ForCausalLM", "Config"))
  torch.manual_seed(0)
  # pad_token_id None: Gemma's default 0 makes embed_tokens an nn.Embedding(padding_idx=0), whose row 0 gets no
  # gradient in transformers; ModelSpec has no padding row (the forward is the same).
  model = getattr(transformers, arch)(cfg_cls(**kwargs, bos_token_id=0, eos_token_id=0, pad_token_id=None))
  _randomise(model, seed=list(CASES).index(name) + 1, plus_one=arch.startswith("Gemma"))
  model.eval()
  folder = tmp_path_factory.mktemp(name)
  model.save_pretrained(folder)
  ck = hf.load_hf_checkpoint(folder)
  _CACHE[name] = Case(name, model, copy.deepcopy(model).double(), ck.spec, ck.params, seqs)
  return _CACHE[name]


def _tokens(vocab: int, b: int, t: int, seed: int) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, vocab, size=(b, t), dtype=np.int64)


def _check_logits(label: str, case: Case, runs: dict[int, tuple[np.ndarray, np.ndarray]]) -> None:
  """runs: T -> (tokens, our logits). Prints and checks the max diffs against HF fp64 and fp32."""
  atol = TOL["logits"][0]
  vs64, vs32, lines = {}, {}, []
  for t, (tokens, ours) in runs.items():
    with torch.no_grad():
      ids = torch.from_numpy(tokens)
      ref32 = case.hf_model(input_ids=ids).logits.numpy()
      ref64 = case.hf64(input_ids=ids).logits.numpy()
    assert ours.shape == ref32.shape, f"T={t}: logits shape {ours.shape} != transformers {ref32.shape}"
    vs64[t] = float(np.max(np.abs(ours - ref64)))
    vs32[t] = float(np.max(np.abs(ours - ref32)))
    hf_err = float(np.max(np.abs(ref32 - ref64)))
    lines.append(f"T={t}: vs hf64 {vs64[t]:.2e}, vs hf32 {vs32[t]:.2e} (hf32 vs hf64 {hf_err:.2e}, "
                 f"max|logit| {np.abs(ref64).max():.1f})")
    assert vs32[t] <= atol + hf_err, \
        f"{label} T={t}: max diff vs transformers fp32 {vs32[t]:.3e} >= tol {atol + hf_err:.3e}"
  print(f"\n{label}: max vs hf64 {max(vs64.values()):.3e}, vs hf32 {max(vs32.values()):.3e}\n  " + "\n  ".join(lines))
  worst = max(vs64.values())
  assert worst <= atol, f"{label}: logits max diff vs transformers fp64 {worst:.3e} >= tol {atol}"


def _spec_for(case: Case, t: int):
  """The checkpoint's spec, widened for rotary models evaluated beyond max_position_embeddings."""
  if t > case.spec.max_seq_len and case.spec.position == "rope":
    return dataclasses.replace(case.spec, max_seq_len=t)
  return case.spec


def _report(label: str, diffs: dict[str, float]) -> float:
  worst = max(diffs.values())
  top = sorted(diffs.items(), key=lambda kv: -kv[1])[:3]
  print(f"\n{label}: max {worst:.3e}  (worst: {', '.join(f'{k}={v:.2e}' for k, v in top)})")
  return worst


def _hf_loss_and_grads(case: Case, tokens: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
  """transformers' own loss (labels=input_ids, shifted inside) and its canonical-named gradients."""
  model = case.hf_model
  model.zero_grad(set_to_none=True)
  out = model(input_ids=torch.from_numpy(tokens), labels=torch.from_numpy(tokens))
  out.loss.backward()
  grads = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}
  return float(out.loss.detach()), hf.hf_to_canonical(grads, case.spec, hf.family_of_spec(case.spec))


def _grad_diffs(ours: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> dict[str, float]:
  atol, rtol = TOL["grad"]
  diffs = {}
  for k, r in ref.items():
    d = float(np.max(np.abs(ours[k] - r)))
    bound = atol + rtol * float(np.max(np.abs(r)))
    assert not np.isnan(ours[k]).any(), f"{k}: NaN in our gradient"
    assert d <= bound, f"grad {k}: max diff {d:.3e} >= tol {bound:.3e}"
    diffs[k] = d
  return diffs


# ----------------------------------------------------------------------------- torch side


@pytest.mark.parametrize("name", list(CASES))
def test_torch_logits_match_transformers(name, tmp_path_factory):
  from torch_impl.model import build_model
  case = _case(name, tmp_path_factory)
  runs = {}
  for t in case.seqs:
    tokens = _tokens(case.spec.vocab_size, 2, t, seed=t)
    model = build_model(_spec_for(case, t), case.params)
    with torch.no_grad():
      runs[t] = (tokens, model(torch.from_numpy(tokens)).numpy())
  _check_logits(f"[{name}] torch vs transformers logits", case, runs)


@pytest.mark.parametrize("name", list(CASES))
def test_torch_loss_and_grads_match_transformers(name, tmp_path_factory):
  from torch_impl.model import build_model, lm_loss
  case = _case(name, tmp_path_factory)
  tokens = _tokens(case.spec.vocab_size, 3, LOSS_SEQ + 1, seed=99)
  ref_loss, ref_grads = _hf_loss_and_grads(case, tokens)
  model = build_model(case.spec, case.params)
  t = torch.from_numpy(tokens)
  loss = lm_loss(model(t[:, :-1]), t[:, 1:])
  loss.backward()
  grads = {k: p.grad.detach().numpy() for k, p in model.named_parameters()}
  print(f"\n[{name}] torch vs transformers loss: {ref_loss:.6f} diff {abs(loss.item() - ref_loss):.3e}")
  _report(f"[{name}] torch vs transformers grads", _grad_diffs(grads, ref_grads))
  assert abs(loss.item() - ref_loss) <= TOL["loss"][0]


# ----------------------------------------------------------------------------- JAX side


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_jax_logits_match_transformers(name, tmp_path_factory):
  pytest.importorskip("jax")
  import jax.numpy as jnp
  from jax_impl.model import GPT
  from jax_impl.layout import to_flax
  case = _case(name, tmp_path_factory)
  tree = to_flax(case.params, case.spec)
  runs = {}
  for t in case.seqs:
    tokens = _tokens(case.spec.vocab_size, 2, t, seed=t)
    logits = GPT(_spec_for(case, t)).apply({"params": tree}, jnp.asarray(tokens, jnp.int32))
    runs[t] = (tokens, np.asarray(logits))
  _check_logits(f"[{name}] jax vs transformers logits", case, runs)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_jax_loss_and_grads_match_transformers(name, tmp_path_factory):
  jax = pytest.importorskip("jax")
  import jax.numpy as jnp
  from jax_impl.layout import from_flax, to_flax
  from jax_impl.model import loss_fn
  case = _case(name, tmp_path_factory)
  tokens = _tokens(case.spec.vocab_size, 3, LOSS_SEQ + 1, seed=99)
  ref_loss, ref_grads = _hf_loss_and_grads(case, tokens)
  loss, g_tree = jax.value_and_grad(loss_fn)(to_flax(case.params, case.spec), jnp.asarray(tokens, jnp.int32),
                                             case.spec)
  grads = from_flax(g_tree, case.spec)
  print(f"\n[{name}] jax vs transformers loss: {ref_loss:.6f} diff {abs(loss.item() - ref_loss):.3e}")
  _report(f"[{name}] jax vs transformers grads", _grad_diffs(grads, ref_grads))
  assert abs(loss.item() - ref_loss) <= TOL["loss"][0]


def test_mistral_config_with_layer_types_is_read_as_auto_model_for_causal_lm_reads_it(tmp_path):
  """transformers' AutoConfig loads a model_type 'mistral' config.json with layer_types as MinistralConfig, whose
  layers follow layer_types; the import reads it the same way (a note says so), and exports the layer_types back."""
  import json
  from torch_impl.model import build_model
  kwargs = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=6,
                layer_types=["full_attention", "sliding_attention"], bos_token_id=0, eos_token_id=0)
  torch.manual_seed(0)
  model = transformers.MinistralForCausalLM(transformers.MinistralConfig(**kwargs))
  _randomise(model, seed=41)
  model.save_pretrained(tmp_path)
  cfg = json.loads((tmp_path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["MistralForCausalLM"],
                                                    "model_type": "mistral"}))
  auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  assert type(auto).__name__ == "MinistralForCausalLM"
  ck = hf.load_hf_checkpoint(tmp_path)
  assert ck.spec.layer_types == ("full", "sliding") and ck.spec.sliding_window == 6
  assert any("Ministral" in n for n in ck.notes)
  tokens = _tokens(97, 2, 29, seed=5)
  with torch.no_grad():
    ref = auto(input_ids=torch.from_numpy(tokens)).logits.numpy()
    ours = build_model(ck.spec, ck.params)(torch.from_numpy(tokens)).numpy()
  assert float(np.max(np.abs(ours - ref))) <= 2 * TOL["logits"][0]
  out = hf.hf_config_from_spec(ck.spec)
  assert out["architectures"] == ["MistralForCausalLM"] and out["layer_types"] == kwargs["layer_types"]
