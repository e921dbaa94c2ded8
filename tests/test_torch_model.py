"""torch_impl.model against the canonical weight contract and a float64 NumPy reference GPT."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parity.presets import preset  # noqa: E402
from parity.spec import ModelSpec  # noqa: E402
from parity.weights import decays, init_params, param_shapes  # noqa: E402
from torch_impl.model import (GPT, build_model, decay_groups, lm_loss, load_canonical, rope_tables,  # noqa: E402
                              to_canonical)

pytestmark = pytest.mark.requires_torch

# Tolerance of fp32 torch logits against the float64 reference, relative to max |logit|.
# docs/numerics.md: PyTorch fp32 vs fp64 logits differ by ~1e-6 on these sizes; 1e-5 leaves
# 10x headroom and still catches every convention mismatch it lists (LayerNorm eps: 2e-3,
# GELU form: 4e-5).
LOGITS_RTOL_FP32 = 1e-5

GPT2 = preset("gpt2-tiny").model
LLAMA = ModelSpec(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=32,
                  norm="rmsnorm", norm_eps=1e-6, mlp="swiglu", position="rope", rope_theta=500.0, bias=False,
                  tie_embeddings=False)
SPECS = {
    "gpt2": GPT2,
    "llama": LLAMA,
    "gpt2-exact-gelu-mqa-scale": dataclasses.replace(GPT2, gelu_approximate=False, n_kv_heads=1, attn_scale=0.3,
                                                      norm_eps=1e-6, tie_embeddings=False),
    "layernorm-nobias-rope": dataclasses.replace(GPT2, bias=False, position="rope"),
}


def random_params(spec: ModelSpec, seed: int = 0) -> dict[str, np.ndarray]:
  """Canonical params with O(1) random values everywhere (biases and norm gains too),
  so that every term of the forward pass moves the logits measurably."""
  rng = np.random.default_rng(seed)
  out = {}
  for name, shape in param_shapes(spec).items():
    if ".ln_" in name or name.startswith("ln_f"):
      arr = (1.0 if name.endswith(".weight") else 0.0) + 0.3 * rng.standard_normal(shape)
    else:
      fan_in = shape[-1] if len(shape) == 2 and not name.startswith(("wte", "wpe")) else 1
      arr = rng.standard_normal(shape) / math.sqrt(fan_in)
    out[name] = arr.astype(np.float32)
  return out


# ----------------------------------------------------------------------------- numpy reference

def _ref_norm(spec: ModelSpec, x, p, prefix):
  if spec.norm == "rmsnorm":
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + spec.norm_eps) * p[f"{prefix}.weight"]
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  y = (x - mu) / np.sqrt(var + spec.norm_eps) * p[f"{prefix}.weight"]
  return y + p[f"{prefix}.bias"] if f"{prefix}.bias" in p else y


def _ref_linear(x, p, prefix):
  y = x @ p[f"{prefix}.weight"].T
  return y + p[f"{prefix}.bias"] if f"{prefix}.bias" in p else y


def _ref_rope(x, theta):
  """x: (B, H, T, D); HF LLaMA rotate-half, angles t * theta^(-2j/D)."""
  d, t = x.shape[-1], x.shape[-2]
  inv = theta ** (-np.arange(0, d, 2) / d)
  ang = np.arange(t)[:, None] * inv[None, :]
  cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
  rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
  return x * cos + rot * sin


def _ref_attention(spec: ModelSpec, x, p, prefix):
  b, t, _ = x.shape
  nh, nkv, hd = spec.n_heads, spec.kv_heads, spec.head_dim
  qkv = _ref_linear(x, p, f"{prefix}.qkv")
  q = qkv[..., :nh * hd].reshape(b, t, nh, hd).transpose(0, 2, 1, 3)
  k = qkv[..., nh * hd:(nh + nkv) * hd].reshape(b, t, nkv, hd).transpose(0, 2, 1, 3)
  v = qkv[..., (nh + nkv) * hd:].reshape(b, t, nkv, hd).transpose(0, 2, 1, 3)
  if spec.position == "rope":
    q, k = _ref_rope(q, spec.rope_theta), _ref_rope(k, spec.rope_theta)
  group = nh // nkv
  k, v = k[:, np.arange(nh) // group], v[:, np.arange(nh) // group]  # query head i uses kv head i // group
  scores = q @ k.transpose(0, 1, 3, 2) * spec.scale
  scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
  w = np.exp(scores - scores.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  y = (w @ v).transpose(0, 2, 1, 3).reshape(b, t, nh * hd)
  return _ref_linear(y, p, f"{prefix}.proj")


def _ref_gelu(x, approximate):
  if approximate:
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
  from math import erf
  return 0.5 * x * (1 + np.vectorize(erf)(x / math.sqrt(2)))


def _ref_mlp(spec: ModelSpec, x, p, prefix):
  if spec.mlp == "gelu":
    return _ref_linear(_ref_gelu(_ref_linear(x, p, f"{prefix}.fc"), spec.gelu_approximate), p, f"{prefix}.proj")
  g = _ref_linear(x, p, f"{prefix}.gate")
  return _ref_linear(g / (1 + np.exp(-g)) * _ref_linear(x, p, f"{prefix}.up"), p, f"{prefix}.proj")


def reference_logits(spec: ModelSpec, params: dict[str, np.ndarray], tokens: np.ndarray) -> np.ndarray:
  """Plain float64 NumPy GPT forward: tokens (B, T) int -> logits (B, T, V)."""
  p = {k: v.astype(np.float64) for k, v in params.items()}
  x = p["wte.weight"][tokens]
  if spec.position == "learned":
    x = x + p["wpe.weight"][: tokens.shape[1]]
  for i in range(spec.n_layers):
    x = x + _ref_attention(spec, _ref_norm(spec, x, p, f"h.{i}.ln_1"), p, f"h.{i}.attn")
    x = x + _ref_mlp(spec, _ref_norm(spec, x, p, f"h.{i}.ln_2"), p, f"h.{i}.mlp")
  x = _ref_norm(spec, x, p, "ln_f")
  head = p["wte.weight"] if spec.tie_embeddings else p["lm_head.weight"]
  return x @ head.T


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("name", SPECS)
def test_canonical_round_trip_is_exact(name):
  spec = SPECS[name]
  params = random_params(spec)
  out = to_canonical(build_model(spec, params))
  assert list(out) == list(param_shapes(spec)), "to_canonical must use canonical names and order"
  for k, v in params.items():
    assert out[k].dtype == np.float32 and np.array_equal(out[k], v), k


def test_state_dict_keys_are_canonical_names():
  for spec in SPECS.values():
    with torch.device("meta"):
      model = GPT(spec)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == param_shapes(spec)


def test_load_canonical_names_the_bad_tensor():
  spec = GPT2
  model = build_model(spec, init_params(spec, 0))
  params = init_params(spec, 0)
  bad = dict(params, **{"h.1.attn.qkv.weight": np.zeros((3, 3), np.float32)})
  with pytest.raises(ValueError, match=r"h\.1\.attn\.qkv\.weight"):
    load_canonical(model, bad)
  with pytest.raises(ValueError, match=r"missing.*ln_f\.bias"):
    load_canonical(model, {k: v for k, v in params.items() if k != "ln_f.bias"})
  with pytest.raises(ValueError, match=r"lm_head\.weight.*tie_embeddings"):
    load_canonical(model, dict(params, **{"lm_head.weight": params["wte.weight"]}))


def test_every_parameter_is_overwritten():
  """Whatever the construction init, the loaded model holds exactly the file's values."""
  spec = LLAMA
  params = random_params(spec, seed=3)
  model = GPT(spec)  # default torch init, then overwritten
  load_canonical(model, params)
  assert all(np.array_equal(v, params[k]) for k, v in to_canonical(model).items())


@pytest.mark.parametrize("name", SPECS)
def test_forward_matches_numpy_reference(name):
  spec = SPECS[name]
  params = random_params(spec, seed=1)
  tokens = np.random.default_rng(2).integers(0, spec.vocab_size, size=(2, spec.max_seq_len // 2 + 3))
  ref = reference_logits(spec, params, tokens)
  with torch.no_grad():
    got = build_model(spec, params)(torch.from_numpy(tokens)).double().numpy()
  err = np.abs(got - ref).max()
  scale = max(1.0, np.abs(ref).max())
  assert err <= LOGITS_RTOL_FP32 * scale, f"{name}: max |logits - ref| = {err:.3g} (>= {LOGITS_RTOL_FP32 * scale:.3g})"


def test_reference_catches_a_convention_mismatch():
  """The forward test has power: the wrong GELU form moves logits beyond its tolerance."""
  spec = GPT2
  params = random_params(spec, seed=1)
  tokens = np.random.default_rng(2).integers(0, spec.vocab_size, size=(2, 16))
  ref = reference_logits(dataclasses.replace(spec, gelu_approximate=False), params, tokens)
  with torch.no_grad():
    got = build_model(spec, params)(torch.from_numpy(tokens)).double().numpy()
  assert np.abs(got - ref).max() > 2 * LOGITS_RTOL_FP32 * max(1.0, np.abs(ref).max())


def test_loss_is_mean_token_cross_entropy():
  rng = np.random.default_rng(0)
  logits = rng.standard_normal((2, 5, 7))
  targets = rng.integers(0, 7, size=(2, 5))
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  ref = -np.take_along_axis(logp, targets[..., None], -1).mean()
  got = lm_loss(torch.from_numpy(logits.astype(np.float32)), torch.from_numpy(targets))
  assert got.dtype == torch.float32
  assert abs(float(got) - ref) < 1e-6
  got_bf16 = lm_loss(torch.from_numpy(logits).bfloat16(), torch.from_numpy(targets))
  assert got_bf16.dtype == torch.float32


def test_rope_tables_are_exactly_rounded_float64():
  cos, sin = rope_tables(40, 16, 10000.0)
  inv = 10000.0 ** (-np.arange(0, 16, 2) / 16)
  ang = np.arange(40)[:, None] * inv
  ang = np.concatenate([ang, ang], -1)
  assert cos.dtype == torch.float32 and cos.shape == (40, 16)
  np.testing.assert_array_equal(cos.numpy(), np.cos(ang).astype(np.float32))
  np.testing.assert_array_equal(sin.numpy(), np.sin(ang).astype(np.float32))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_decay_groups_follow_the_canonical_mask(name):
  spec = SPECS[name]
  model = build_model(spec, random_params(spec))
  groups = decay_groups(model, 0.1)
  names = {id(p): n for n, p in model.named_parameters()}
  decayed = {names[id(p)] for p in groups[0]["params"]}
  plain = {names[id(p)] for p in groups[1]["params"]}
  assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
  assert decayed == {n for n in param_shapes(spec) if decays(n)}
  assert plain == {n for n in param_shapes(spec) if not decays(n)}


def test_sequence_longer_than_the_table_is_rejected():
  model = build_model(GPT2, init_params(GPT2, 0))
  with pytest.raises(ValueError, match="max_seq_len"):
    model(torch.zeros(1, GPT2.max_seq_len + 1, dtype=torch.long))
