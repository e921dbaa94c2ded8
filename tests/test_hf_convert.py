"""`parity convert-weights` on checkpoints written by transformers: every format and direction.

The headline check: HF -> canonical -> orbax -> canonical reproduces the first canonical
file byte for byte (test_hf_canonical_orbax_round_trip_is_byte_identical).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from parity import hf, weights  # noqa: E402

from parity.hf import convert  # noqa: E402
from parity.cli import main as cli_main  # noqa: E402

GPT2 = dict(vocab_size=61, n_positions=24, n_embd=32, n_layer=2, n_head=4)
LLAMA = dict(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=24, bos_token_id=0, eos_token_id=0)


def _hf_model(kind: str, seed: int = 0, **over):
  torch.manual_seed(seed)
  if kind == "gpt2":
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**GPT2, **over}, bos_token_id=0, eos_token_id=0))
  else:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, **over}))
  with torch.no_grad():  # nonzero biases and norm scales, so a mis-mapped one shows
    for _, p in model.named_parameters():
      if p.ndim == 1:
        p.add_(0.1 * torch.randn(p.shape))
  return model.eval()


def _hf_state(model) -> dict[str, np.ndarray]:
  return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def _expected_canonical(model, kind: str) -> dict[str, np.ndarray]:
  spec = hf.spec_from_hf_config(model.config.to_dict())
  state = _hf_state(model)
  return hf.hf_to_canonical(state, spec, "gpt2" if kind == "gpt2" else "llama")


def _assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
  assert list(a) == list(b)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_bf16_checkpoint_widens_exactly(kind, tmp_path):
  model = _hf_model(kind).to(torch.bfloat16)
  model.save_pretrained(tmp_path)
  ck = hf.load_hf_checkpoint(tmp_path)
  assert any("widened to float32" in n for n in ck.notes)
  _assert_same(ck.params, _expected_canonical(model, kind))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_sharded_checkpoint_equals_single_file(kind, tmp_path):
  model = _hf_model(kind)
  model.save_pretrained(tmp_path / "one")
  model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
  assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
  _assert_same(hf.load_hf_checkpoint(tmp_path / "sharded").params, hf.load_hf_checkpoint(tmp_path / "one").params)


@pytest.mark.process
def test_pytorch_model_bin_is_read_in_a_torch_subprocess(tmp_path):
  model = _hf_model("gpt2")
  src = tmp_path / "hf"
  model.save_pretrained(src)
  (src / "model.safetensors").unlink()
  state = dict(model.state_dict())  # includes the tied lm_head.weight
  for i in range(GPT2["n_layer"]):  # causal-mask buffers of old GPT-2 pickles
    state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 24, 24, dtype=torch.bool))
  torch.save(state, src / "pytorch_model.bin")
  done = convert.convert(src, tmp_path / "w.safetensors")  # the output may not sit inside the source folder
  assert any("causal-mask" in n for n in done.notes)
  params, spec = hf.load_canonical(tmp_path / "w.safetensors")
  _assert_same(params, _expected_canonical(model, "gpt2"))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_export_to_hf_loads_in_transformers_with_equal_logits(kind, tmp_path):
  from torch_impl.model import build_model
  spec = hf.MODEL_PRESETS["gpt2-124m" if kind == "gpt2" else "llama-7b"]
  spec = hf.spec_from_hf_config({**hf.hf_config_from_spec(spec), **(
      {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 53, "n_positions": 16} if kind == "gpt2" else
      {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
       "head_dim": 8, "intermediate_size": 24, "vocab_size": 53, "max_position_embeddings": 16})})
  params = weights.init_params(spec, seed=5)
  params = {k: v + np.float32(0.05) * np.random.default_rng(1).standard_normal(v.shape).astype(np.float32)
            for k, v in params.items()}  # nonzero biases and norm offsets
  hf.save_canonical(tmp_path / "w.safetensors", params, spec)
  assert cli_main(["convert-weights", str(tmp_path / "w.safetensors"), str(tmp_path / "hf"), "--to", "hf"]) == 0
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
  tokens = torch.from_numpy(np.random.default_rng(0).integers(0, 53, size=(2, 16)))
  with torch.no_grad():
    ref = model(input_ids=tokens).logits.numpy()
    ours = build_model(spec, params)(tokens).numpy()
  diff = float(np.abs(ours - ref).max())
  print(f"\n[{kind}] exported checkpoint: our torch vs transformers logits max diff {diff:.3e}")
  assert diff <= 1e-5
  _assert_same(hf.load_hf_checkpoint(tmp_path / "hf").params, {k: params[k] for k in weights.param_shapes(spec)})


SMALL = dict(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=24, bos_token_id=0, eos_token_id=0, pad_token_id=0)
FAMILIES = {  # architecture, config class, config kwargs beyond SMALL
    "llama3": ("LlamaForCausalLM", "LlamaConfig", dict(rope_parameters=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8,
        rope_theta=5e5), attention_bias=True, head_dim=16)),
    "llama-yarn": ("LlamaForCausalLM", "LlamaConfig", dict(rope_parameters=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=8, rope_theta=1e4), mlp_bias=True)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=5)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=12, attention_bias=True, tie_word_embeddings=True)),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(head_dim=8)),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(head_dim=16, sliding_window=6, query_pre_attn_scalar=12,
                                                          attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        head_dim=8, sliding_window=6, sliding_window_pattern=3, rope_theta=1e5, rope_local_base_freq=100.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=False)),
}
INERT_CONFIG_KEYS = {"architectures", "transformers_version", "dtype", "use_cache", "_name_or_path",
                     "max_window_layers", "sliding_window_pattern", "_sliding_window_pattern", "bos_token_id",
                     "eos_token_id", "pad_token_id"}
"""Config keys that do not change the model's function once layer_types is explicit (Qwen max_window_layers, Gemma 3
sliding_window_pattern), or are not model fields (token ids, cache, dtype)."""


def _family_model(name: str):
  arch, cfg_cls, kw = FAMILIES[name]
  torch.manual_seed(1)
  model = getattr(transformers, arch)(getattr(transformers, cfg_cls)(**{**SMALL, **kw}))
  with torch.no_grad():  # nonzero biases and norm weights (Gemma's are 0 at init), so a mis-mapped one shows
    for _, p in model.named_parameters():
      if p.ndim == 1:
        p.add_(0.1 * torch.randn(p.shape))
  return model.eval()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_hf_to_canonical_to_hf_is_bit_identical(name, tmp_path):
  model = _family_model(name)
  model.save_pretrained(tmp_path / "src")
  ck = hf.load_hf_checkpoint(tmp_path / "src")
  assert ck.family == hf.ARCHITECTURES[FAMILIES[name][0]] and hf.family_of_spec(ck.spec) == ck.family
  hf.save_hf_checkpoint(tmp_path / "out", ck.spec, ck.params)
  stored, _ = hf.read_safetensors(tmp_path / "src" / "model.safetensors")
  again, _ = hf.read_safetensors(tmp_path / "out" / "model.safetensors")
  assert sorted(again) == sorted(stored)  # names; a tied head is stored by neither
  for k in stored:
    assert again[k].dtype == stored[k].dtype and np.array_equal(again[k], stored[k]), k
  table = hf.hf_tensor_table(ck.spec, ck.family)  # every parameter of the HF model, its shape and its tie
  assert {k: s for k, (s, _) in table.items()} == {k: tuple(v.shape) for k, v in model.state_dict().items()}
  if ck.spec.tie_embeddings:
    assert table["lm_head.weight"][1] == "model.embed_tokens.weight"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
  cfg_cls = type(model.config)
  want, got = model.config.to_dict(), cfg_cls.from_dict(json.loads((tmp_path / "out" / "config.json").read_text()))
  got = got.to_dict()
  assert {k: got.get(k) for k in set(want) | set(got) if k not in INERT_CONFIG_KEYS} == \
      {k: want.get(k) for k in set(want) | set(got) if k not in INERT_CONFIG_KEYS}
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  tokens = torch.from_numpy(np.random.default_rng(0).integers(0, 61, size=(2, 20)))
  with torch.no_grad():
    assert torch.equal(back(input_ids=tokens).logits, model(input_ids=tokens).logits)


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2", "gemma3"])
def test_hf_canonical_orbax_round_trip_is_byte_identical(kind, tmp_path, capsys):
  pytest.importorskip("orbax.checkpoint")
  model = _family_model(kind) if kind in FAMILIES else _hf_model(kind, tie_word_embeddings=(kind == "gpt2"))
  model.save_pretrained(tmp_path / "hf")
  first, ckpt, second = tmp_path / "first.safetensors", tmp_path / "orbax", tmp_path / "second.safetensors"
  assert cli_main(["convert-weights", str(tmp_path / "hf"), str(first)]) == 0
  assert cli_main(["convert-weights", str(first), str(ckpt), "--to", "orbax"]) == 0
  assert cli_main(["convert-weights", str(ckpt), str(second)]) == 0
  assert first.read_bytes() == second.read_bytes()
  assert cli_main(["convert-weights", str(ckpt), str(tmp_path / "hf2"), "--to", "hf"]) == 0  # orbax -> HF directly
  _assert_same(hf.load_hf_checkpoint(tmp_path / "hf2").params, hf.load_canonical(first)[0])
  print(capsys.readouterr().out)


def test_jax_checkpoint_in_process_round_trip(tmp_path):
  pytest.importorskip("orbax.checkpoint")
  from jax_impl import checkpoint
  from jax_impl.layout import from_flax, to_flax
  spec = hf.spec_from_hf_config({**LLAMA, "architectures": ["LlamaForCausalLM"]})
  params = weights.init_params(spec, seed=7)
  checkpoint.save(tmp_path / "ck", to_flax(params, spec), spec)
  tree, got_spec = checkpoint.load(tmp_path / "ck")
  assert got_spec == spec
  _assert_same(from_flax(tree, spec), params)
  with pytest.raises(FileExistsError, match="--force"):
    checkpoint.save(tmp_path / "ck", to_flax(params, spec), spec)


def test_cli_refusals_exit_2_with_the_reason(tmp_path, capsys):
  (tmp_path / "neox").mkdir()
  (tmp_path / "neox" / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"]}))
  assert cli_main(["convert-weights", str(tmp_path / "neox"), str(tmp_path / "w.safetensors")]) == 2
  assert "parallel residual" in capsys.readouterr().err
  _hf_model("llama").save_pretrained(tmp_path / "hf")
  assert cli_main(["convert-weights", str(tmp_path / "hf"), str(tmp_path / "w.safetensors")]) == 0
  assert cli_main(["convert-weights", str(tmp_path / "hf"), str(tmp_path / "w.safetensors")]) == 2
  assert "--force" in capsys.readouterr().err
  assert cli_main(["convert-weights", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
  assert "pass --to" in capsys.readouterr().err
  bad = tmp_path / "bad"
  _hf_model("llama").save_pretrained(bad)
  cfg = json.loads((bad / "config.json").read_text())
  (bad / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 4}))
  assert cli_main(["convert-weights", str(bad), str(tmp_path / "x.safetensors")]) == 2
  err = capsys.readouterr().err
  assert "k_proj.weight: (16, 32) (expected (32, 32))" in err, err


@pytest.mark.parametrize("name", ["llama3", "qwen2", "gemma3"])
def test_bf16_checkpoint_round_trips_to_the_same_bits(name, tmp_path):
  model = _family_model(name).to(torch.bfloat16)
  model.save_pretrained(tmp_path / "src")
  ck = hf.load_hf_checkpoint(tmp_path / "src")
  hf.save_hf_checkpoint(tmp_path / "out", ck.spec, ck.params, dtype="bfloat16")
  kinds_a, kinds_b = {}, {}
  stored, _ = hf.read_safetensors(tmp_path / "src" / "model.safetensors", stored_dtypes=kinds_a)
  again, _ = hf.read_safetensors(tmp_path / "out" / "model.safetensors", stored_dtypes=kinds_b)
  assert kinds_b == kinds_a and set(kinds_a.values()) == {"BF16"}
  assert all(np.array_equal(again[k].view(np.uint32), stored[k].view(np.uint32)) for k in stored)
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src").eval()  # not `model`: .to(bf16) also
  assert back.dtype == ref.dtype == torch.bfloat16                                # rounds its rotary buffers
  tokens = torch.from_numpy(np.random.default_rng(0).integers(0, 61, size=(2, 20)))
  with torch.no_grad():
    assert torch.equal(back(input_ids=tokens).logits, ref(input_ids=tokens).logits)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_spec_matches_the_transformers_modules(name):
  """The imported spec against the numbers transformers' modules hold: rotary inverse frequencies and cos/sin factor
  per layer (parity.architecture.layer_rope), the score scale, the window and soft-cap of each layer."""
  from parity import architecture
  model = _family_model(name)
  spec = hf.spec_from_hf_config(model.config.to_dict())
  rotary = model.model.rotary_emb
  for i, layer in enumerate(model.model.layers):
    attn = layer.self_attn
    kind = spec.layer_kinds[i]
    theta, scaling = architecture.layer_rope(spec, i)
    hf_kind = f"{kind}_attention"
    inv = getattr(rotary, f"{hf_kind}_inv_freq", None)
    inv = rotary.inv_freq if inv is None else inv
    factor = getattr(rotary, f"{hf_kind}_attention_scaling", getattr(rotary, "attention_scaling", 1.0))
    np.testing.assert_allclose(architecture.inv_freq(spec.head_dim, theta, scaling), inv.numpy(), rtol=2e-7,
                               err_msg=f"layer {i} inv_freq")
    assert architecture.attention_factor(scaling) == pytest.approx(factor, rel=1e-12)
    assert attn.scaling == pytest.approx(spec.scale, rel=1e-15) and attn.head_dim == spec.head_dim  # HF: hd ** -0.5
    window = getattr(attn, "sliding_window", model.config.sliding_window if name == "mistral" else None)
    assert window == (spec.sliding_window if kind == "sliding" else None), f"layer {i} window"
    assert getattr(attn, "attn_logit_softcapping", None) == spec.attn_softcap
  assert getattr(model.config, "final_logit_softcapping", None) == spec.final_softcap


@pytest.mark.parametrize("key, value", [("hidden_size", None), ("hidden_size", "abc"), ("rms_norm_eps", None),
                                        ("rope_parameters", [1, 2]), ("pretraining_tp", "two"),
                                        ("attention_bias", "false"), ("layer_types", "full_attention")])
def test_bad_config_values_exit_2_naming_config_json_and_the_key(key, value, tmp_path, capsys):
  """A mistyped config.json value is bad input (exit 2, named), never an internal error (exit 1)."""
  _hf_model("llama").save_pretrained(tmp_path / "hf")
  cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
  arch = ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"} if key == "layer_types"
          else {})  # LLaMA has no layer_types
  (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, **arch, key: value}))
  assert cli_main(["convert-weights", str(tmp_path / "hf"), str(tmp_path / "w.safetensors")]) == 2
  err = capsys.readouterr().err
  assert "config.json (" in err and f"{key}={value!r}" in err and "must be" in err, err


def test_f64_checkpoint_converts_with_a_note_when_exact(tmp_path, capsys):
  """save_pretrained of a float64 model writes F64; values that are float32 exactly (as here) are read with a
  note and written back as F32 with the same values."""
  model = _hf_model("llama").double()
  model.save_pretrained(tmp_path / "hf")
  ck = hf.load_hf_checkpoint(tmp_path / "hf")
  assert any("F64" in n and "exact" in n for n in ck.notes)
  _assert_same(ck.params, _expected_canonical(model.float(), "llama"))
