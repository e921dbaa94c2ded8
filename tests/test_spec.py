import json

import numpy as np
import pytest

from parity import weights

from parity.numerics import schedule
from parity.presets import PRESETS
from parity.overrides import apply_overrides, parse_overrides
from parity.spec import DeepSpeedPlan, ModelSpec, RunSpec, SpecError, TrainSpec, config_hash, from_dict, to_dict
from parity.pipeline.folder import parse_perturb
from parity.pipeline.resolve import resolve


def test_presets_validate_and_round_trip():
  for name, spec in PRESETS.items():
    spec.validate()
    again = from_dict(RunSpec, json.loads(json.dumps(to_dict(spec))))
    assert again == spec, name
    assert config_hash(again) == config_hash(spec)


def test_overrides_apply_and_reject_unknown_keys():
  s = apply_overrides(RunSpec(), parse_overrides(["train.lr=3e-4", "model.norm_eps=1e-6", "jax.offload_params=true"]))
  assert s.train.lr == 3e-4 and s.model.norm_eps == 1e-6 and s.jax.offload_params is True
  with pytest.raises(SpecError, match="unknown key 'lrr'"):
    apply_overrides(RunSpec(), parse_overrides(["train.lrr=1"]))
  with pytest.raises(SpecError, match="expected an integer"):
    apply_overrides(RunSpec(), parse_overrides(["train.steps=abc"]))
  with pytest.raises(SpecError, match="section.key=value"):
    apply_overrides(RunSpec(), parse_overrides(["train.steps"]))


@pytest.mark.parametrize("bad, match", [
    (["model.d_model=100", "model.n_heads=3"], "divisible"),
    (["model.n_kv_heads=3"], "multiple"),
    (["train.warmup_steps=0"], "warmup_steps"),
    (["train.seq_len=4096"], "max_seq_len"),
    (["model.norm=batchnorm"], "model.norm"),
])
def test_invalid_specs_name_the_field(bad, match):
  with pytest.raises(SpecError, match=match):
    resolve("gpt2-tiny", overrides=bad)


def test_offload_param_needs_stage3():
  with pytest.raises(SpecError, match="requires zero_stage 3"):
    DeepSpeedPlan(zero_stage=2, offload_param="cpu").validate()


def test_config_file_errors_name_the_file(tmp_path):
  f = tmp_path / "run.yaml"
  f.write_text("train:\n  lr: [1, 2\n")
  with pytest.raises(SpecError, match="run.yaml"):
    resolve(config=f)
  f.write_text("train:\n  learning_rate: 1\n")
  with pytest.raises(SpecError, match="train.learning_rate"):
    resolve(config=f)
  f.write_text("preset: gpt2-tiny\ntrain:\n  steps: 3\n")
  s = resolve(config=f)
  assert s.train.steps == 3 and s.model.d_model == 64


def test_perturb_parsing():
  p = parse_perturb(["jax:model.norm_eps=1e-3", "deepspeed:kill_at_step=2"], ["jax", "deepspeed"])
  assert p == {"jax": {"model.norm_eps": 1e-3}, "deepspeed": {"kill_at_step": 2}}
  with pytest.raises(SpecError, match="not among the sides"):
    parse_perturb(["torch:kill_at_step=1"], ["jax"])
  with pytest.raises(SpecError, match="cannot be perturbed"):
    parse_perturb(["jax:model.nrm_eps=1"], ["jax"])
  with pytest.raises(SpecError, match="shapes the shared weights or batches"):
    parse_perturb(["jax:train.seed=5"], ["jax"])
  with pytest.raises(SpecError, match="integer >= 0"):
    parse_perturb(["jax:nan_at_step=abc"], ["jax"])
  with pytest.raises(SpecError, match="integer >= 0"):
    parse_perturb(["jax:kill_at_step=1.5"], ["jax"])


def test_init_follows_gpt2_scheme():
  spec = ModelSpec(d_model=256, n_layers=8, n_heads=4)
  p = weights.init_params(spec, seed=0)
  assert list(p) == list(weights.param_shapes(spec))
  assert all(v.dtype == np.float32 for v in p.values())
  assert abs(p["h.0.attn.qkv.weight"].std() - 0.02) < 1e-3
  assert abs(p["h.0.mlp.proj.weight"].std() - 0.02 / np.sqrt(16)) < 2e-4
  assert np.all(p["h.0.ln_1.weight"] == 1) and np.all(p["h.0.attn.qkv.bias"] == 0)
  q = weights.init_params(spec, seed=0)
  assert all(np.array_equal(p[k], q[k]) for k in p)
  assert not np.array_equal(p["wte.weight"], weights.init_params(spec, seed=1)["wte.weight"])


def test_llama_shapes_fit_the_same_spec():
  spec = ModelSpec(norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False,
                   n_heads=8, n_kv_heads=2, d_model=256, d_ff=688).validate()
  s = weights.param_shapes(spec)
  assert "wpe.weight" not in s and "lm_head.weight" in s and "h.0.ln_1.bias" not in s
  assert s["h.0.attn.qkv.weight"] == ((8 + 2 * 2) * 32, 256)
  assert s["h.0.mlp.gate.weight"] == (688, 256) and s["h.0.mlp.proj.weight"] == (256, 688)
  assert weights.zero_grad_slices(spec) == {}


def test_decay_mask():
  assert weights.decays("h.0.attn.qkv.weight") and weights.decays("lm_head.weight")
  for name in ("wte.weight", "wpe.weight", "h.1.ln_1.weight", "h.1.attn.qkv.bias", "ln_f.bias"):
    assert not weights.decays(name)


def test_weights_round_trip_and_shape_errors(tmp_path):
  spec = PRESETS["gpt2-tiny"].model
  p = weights.init_params(spec, 3)
  weights.save(p, tmp_path / "w.safetensors")
  q = weights.load(tmp_path / "w.safetensors", spec)
  assert all(np.array_equal(p[k], q[k]) for k in p)
  with pytest.raises(ValueError, match="wrong shape"):
    weights.load(tmp_path / "w.safetensors", ModelSpec(d_model=128, n_layers=2, n_heads=2, max_seq_len=64))


def test_schedule_matches_deepspeed_semantics():
  t = TrainSpec(steps=100, lr=1.0, warmup_steps=10, warmup_min_ratio=0.0, cos_min_ratio=0.1)
  lrs = [schedule.train_lr(t, k) for k in range(100)]
  assert lrs[0] == 0.0            # iteration -1 before the first scheduler.step()
  assert lrs[1] == 0.0            # iteration 0: linear warmup starts at min ratio 0
  assert lrs[2] == pytest.approx(0.1)
  assert lrs[10] == pytest.approx(0.9)
  assert lrs[11] == pytest.approx(0.1 + 0.9 * (1 + np.cos(np.pi * 1 / 90)) / 2)
  assert lrs[-1] == pytest.approx(0.1 + 0.9 * (1 + np.cos(np.pi * 89 / 90)) / 2)
  # warmup of 1 is clamped to 2 as DeepSpeed does
  assert schedule.lr_at_step(2, lr=1.0, total_steps=10, warmup_steps=1, warmup_min_ratio=0, cos_min_ratio=0) == 0.5
  with pytest.raises(ValueError, match="positive"):
    schedule.lr_at_step(1, lr=1.0, total_steps=10, warmup_steps=0, warmup_min_ratio=0, cos_min_ratio=0)


@pytest.mark.parametrize("key", ["train.lr", "train.seed", "train.grad_accum_steps", "model.norm_eps", "model.n_heads"])
def test_null_for_a_field_that_takes_no_null_is_refused_naming_it(key):
  """`--set train.lr=null` (or `lr: ~` in a config) reached a comparison inside validate as None: TypeError, the CLI's
  'internal error'. A field whose annotation admits no None refuses null by key; one that does (e.g.
  model.n_kv_heads, train.examples_per_step) still takes it."""
  from parity.spec import RunSpec, from_dict, to_dict
  d = to_dict(RunSpec())
  section, name = key.split(".")
  d[section][name] = None
  with pytest.raises(SpecError, match=rf"{key}: expected .*, got null"):
    from_dict(RunSpec, d)
  d = to_dict(RunSpec())
  d["model"]["n_kv_heads"] = None
  d["train"]["examples_per_step"] = None
  assert from_dict(RunSpec, d) == RunSpec()


@pytest.mark.parametrize("key, value", [("eval_every", -1), ("eval_batches", 0), ("eval_batches", -1)])
def test_eval_cadence_and_batches_out_of_range_are_refused(key, value):
  """eval_every=-1 ran with no validation loss and eval_batches=0 evaluated one batch while config.json said 0:
  both are refused by key."""
  with pytest.raises(SpecError, match=r"train.eval_every must be >= 0 .* got"):
    TrainSpec(**{key: value}).validate()
