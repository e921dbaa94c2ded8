"""parity.architecture: the rotary frequencies against transformers' own (`ROPE_INIT_FUNCTIONS`), per-layer kinds and
bases, and the refusals of the model-family fields."""
from __future__ import annotations

import numpy as np
import pytest

from parity import architecture as arch
from parity.spec import ModelSpec, SpecError, config_hash, RunSpec, without_later_defaults

ROPE = dict(norm="rmsnorm", mlp="swiglu", position="rope", bias=False)
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 8.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "llama3-short": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    "yarn-mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
                    "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
}


@pytest.mark.parametrize("name", sorted(SCALINGS))
@pytest.mark.parametrize("head_dim,theta", [(128, 500000.0), (64, 10000.0), (16, 1e6)])
def test_inv_freq_and_attention_factor_match_transformers(name, head_dim, theta):
  transformers = pytest.importorskip("transformers")
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  sc = SCALINGS[name]
  config = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                                    max_position_embeddings=131072, rope_parameters={**sc, "rope_theta": theta})
  theirs, their_factor = ROPE_INIT_FUNCTIONS[sc["rope_type"]](config, "cpu")
  ours = arch.inv_freq(head_dim, theta, sc)
  # transformers computes in float32: its own rounding (~1 ulp of each frequency, and of theta ** x) is the bound
  np.testing.assert_allclose(ours, theirs.double().numpy(), rtol=2e-6, atol=0)
  assert arch.attention_factor(sc) == pytest.approx(their_factor, rel=1e-12)


def test_plain_tables_are_the_float64_recipe_rounded_once():
  cos, sin = arch.rope_tables(40, 16, 10000.0)
  inv = 1.0 / (10000.0 ** (np.arange(0, 16, 2, dtype=np.float64) / 16))
  ang = np.outer(np.arange(40, dtype=np.float64), inv)
  ang = np.concatenate([ang, ang], -1)
  assert cos.dtype == np.float32 and np.array_equal(cos, np.cos(ang).astype(np.float32))
  assert np.array_equal(sin, np.sin(ang).astype(np.float32))
  ycos, _ = arch.rope_tables(4, 16, 10000.0, SCALINGS["yarn"])
  assert ycos[0, 0] == np.float32(arch.attention_factor(SCALINGS["yarn"])) > 1


def test_layer_kinds_and_local_rope():
  gemma3 = ModelSpec(n_layers=3, sliding_window=8, layer_types=("sliding", "sliding", "full"), rope_theta=1e6,
                     rope_local_theta=1e4, rope_scaling=SCALINGS["linear"], **ROPE).validate()
  assert gemma3.layer_kinds == ("sliding", "sliding", "full")
  assert [arch.layer_rope(gemma3, i) for i in range(3)] == [(1e4, None), (1e4, None), (1e6, SCALINGS["linear"])]
  mistral = ModelSpec(n_layers=2, sliding_window=8, **ROPE).validate()
  assert mistral.layer_kinds == ("sliding", "sliding") and arch.layer_rope(mistral, 1) == (10000.0, None)
  assert ModelSpec(n_layers=2).layer_kinds == ("full", "full")


@pytest.mark.parametrize("fields,match", [
    (dict(layer_types=("full",)), "one per layer"),
    (dict(layer_types=("full", "local", "full", "full")), "'local' is not a layer kind"),
    (dict(layer_types=("full", "sliding", "full", "full")), "sliding_window is null"),
    (dict(sliding_window=0), "sliding_window must be null"),
    (dict(rope_local_theta=1e4), "has none"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "'dynamic' is not supported"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope_scaling.low_freq_factor"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0, "typo": 1}), "unknown key"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                        "original_max_position_embeddings": 8192}), "high_freq_factor must exceed"),
    (dict(attn_softcap=0.0), "attn_softcap must be null"),
    (dict(embed_scale=-1.0), "embed_scale must be"),
    (dict(qkv_bias="yes"), "qkv_bias must be null"),
    (dict(d_head=0), "d_head must be null"),
    (dict(norm_plus_one=True, norm="layernorm"), "needs model.norm 'rmsnorm'"),
])
def test_family_fields_are_refused_naming_the_field(fields, match):
  with pytest.raises(SpecError, match=match):
    ModelSpec(**fields).validate()


def test_d_head_decouples_heads_from_width_and_defaults_keep_the_hash():
  s = ModelSpec(d_model=64, n_heads=3, d_head=24, **ROPE).validate()
  assert s.head_dim == 24
  with pytest.raises(SpecError, match="divisible"):
    ModelSpec(d_model=64, n_heads=3, **ROPE).validate()
  assert without_later_defaults({"model": {"qkv_bias": None, "qk_norm": True, "d_model": 8}})["model"] == {
      "qk_norm": True, "d_model": 8}  # FAMILY_DEFAULTS at their defaults leave the hashed spec
                                      # (parity.spec.LATER_FIELDS)
  assert config_hash(RunSpec()) == "93d0bb43e4a32bcc"  # the default run's hash from before the fields existed
  assert ModelSpec(bias=True, qkv_bias=True, out_bias=False).linear_bias("out") is False
  assert ModelSpec(bias=True).linear_bias("mlp") is True


@pytest.mark.parametrize("key, value, match", [
    ("beta_fast", "x", r"beta_fast \(yarn\) must be a number > 0; got 'x'"),
    ("beta_slow", 0, r"beta_slow \(yarn\) must be a number > 0"),
    ("attention_factor", True, r"attention_factor \(yarn\) must be a number > 0"),
    ("mscale", 0.0, r"mscale \(yarn\) must be a number > 0"),
    ("mscale_all_dim", -1.0, r"mscale_all_dim \(yarn\) must be a number > 0"),
    ("truncate", "true", r"truncate \(yarn\) must be true or false; got 'true'"),
])
def test_yarn_optional_keys_are_checked_up_front(key, value, match):
  sc = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16, key: value}
  with pytest.raises(SpecError, match=r"model.rope_scaling." + match):
    ModelSpec(**ROPE, rope_scaling=sc).validate()
  ok = {**sc, key: False if key == "truncate" else 2.0}
  ModelSpec(**ROPE, rope_scaling=ok).validate()


@pytest.mark.parametrize("value", ["full", {"a": 1}, "full,sliding"])
def test_layer_types_given_as_other_than_a_list_are_refused_not_split(value):
  """from_dict would make tuple('full') its characters; a --set / config value that is not a list is refused."""
  from parity.overrides import apply_overrides
  with pytest.raises(SpecError, match=r"model.layer_types must be a list; got"):
    apply_overrides(RunSpec(), {"model.layer_types": value})
  with pytest.raises(SpecError, match=r"model.layer_types must be a list of 'full' / 'sliding'"):
    ModelSpec(**ROPE, layer_types="full").validate()  # built directly: the field's own check


def test_family_bool_fields_take_true_false_strings_as_model_bias_does():
  from parity.overrides import apply_overrides
  run = apply_overrides(RunSpec(), {"model.bias": "false", "model.post_norms": "true", "model.qkv_bias": "True",
                                    "model.mlp_bias": "false"})
  assert (run.model.bias, run.model.post_norms, run.model.qkv_bias, run.model.mlp_bias) == (False, True, True, False)
  for key, value in (("model.bias", 1), ("model.norm_plus_one", 1), ("model.qkv_bias", 1), ("model.qkv_bias", "yes")):
    with pytest.raises(SpecError, match=key.split(".")[1]):
      apply_overrides(RunSpec(), {key: value}).validate()
