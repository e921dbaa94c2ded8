"""The newer model-family fields on the PyTorch side (torch_impl.layers / torch_impl.model), in process.

Checked: a spec with the family fields spelled out at their defaults is the spec of before bit for bit, and the
stream layout of a full layer still calls SDPA with is_causal and no mask; the rotary tables are the shared numpy
ones (bitwise the float64 torch computation of before for plain rotary); a sliding layer really masks (a token
beyond the window changes nothing) and a packed row equals its examples alone with the window; the soft-capped
attention equals transformers' eager Gemma 2 attention; Gemma's (1 + w) RMSNorm, GeGLU and embedding scale follow
their formulas; every new diagnose tap is produced; canonical weights with every new tensor round-trip, in
canonical order, with q/k and post norms undecayed. The logits against transformers per family are the HF
oracle's (tests/test_hf_oracle.py).
"""
from __future__ import annotations

import dataclasses
import math
from unittest import mock

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parity.protocol import diagnose as dg  # noqa: E402
from parity.spec import ModelSpec  # noqa: E402
from parity.weights import decays, init_params, param_shapes  # noqa: E402
from torch_impl import layers  # noqa: E402
from torch_impl.model import (RMSNorm, TapRecorder, build_model, decay_groups, load_canonical,  # noqa: E402
                              rope_tables, softcap, to_canonical)

pytestmark = pytest.mark.requires_torch

V, T = 64, 16
GPT2 = ModelSpec(vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_seq_len=32)
LLAMA = ModelSpec(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, norm="rmsnorm",
                  mlp="swiglu", position="rope", rope_theta=500.0, bias=False, tie_embeddings=False, d_ff=48,
                  norm_eps=1e-6)
MISTRAL = dataclasses.replace(LLAMA, sliding_window=4)
GEMMA2 = dataclasses.replace(LLAMA, mlp="geglu", norm_plus_one=True, embed_scale=math.sqrt(32), post_norms=True,
                             d_head=12, attn_scale=24 ** -0.5, attn_softcap=2.0, final_softcap=3.0, sliding_window=4,
                             layer_types=("sliding", "full"), tie_embeddings=True)
EVERYTHING = dataclasses.replace(GEMMA2, qk_norm=True, qkv_bias=True, out_bias=True, mlp_bias=True,
                                 rope_local_theta=50.0,
                                 rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8})


def random_params(spec: ModelSpec, seed: int = 0) -> dict[str, np.ndarray]:
  """Canonical params with O(1) values everywhere (norm gains around their identity, biases too)."""
  rng = np.random.default_rng(seed)
  out = {}
  for name, shape in param_shapes(spec).items():
    if ".ln_" in name or name.startswith("ln_f"):
      arr = (0.0 if spec.norm_plus_one else 1.0) + 0.3 * rng.standard_normal(shape)
    else:
      fan_in = shape[-1] if len(shape) == 2 and not name.startswith("wte") else 1
      arr = rng.standard_normal(shape) / math.sqrt(fan_in)
    out[name] = arr.astype(np.float32)
  return out


def _tokens(seed: int = 1, b: int = 2, t: int = T) -> torch.Tensor:
  return torch.from_numpy(np.random.default_rng(seed).integers(0, V, (b, t)))


# ----------------------------------------------------------------------------- default specs unchanged


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_family_fields_at_their_defaults_change_nothing(spec, dtype):
  spelled = dataclasses.replace(spec, qkv_bias=spec.bias, out_bias=spec.bias, mlp_bias=spec.bias,
                                d_head=spec.d_model // spec.n_heads, layer_types=("full",) * spec.n_layers,
                                embed_scale=1.0)
  params = random_params(spec)
  tok = _tokens()
  seg = torch.tensor([[1] * 9 + [2] * 5 + [0] * 2, [1] * 16])
  for kw in ({}, {"segment_ids": seg}):
    a = build_model(spec, params).to(dtype)(tok, **kw)
    b = build_model(spelled, params).to(dtype)(tok, **kw)
    assert torch.equal(a, b)


def test_stream_full_layers_keep_sdpas_causal_path():
  model = build_model(MISTRAL, random_params(MISTRAL))
  calls = []
  real = torch.nn.functional.scaled_dot_product_attention

  def spy(*args, **kwargs):
    calls.append((kwargs.get("is_causal", False), kwargs.get("attn_mask") is None))
    return real(*args, **kwargs)

  with mock.patch.object(layers.F, "scaled_dot_product_attention", spy):
    build_model(LLAMA, random_params(LLAMA))(_tokens())
    assert calls == [(True, True)] * 2  # full layers, stream: is_causal, no mask
    calls.clear()
    model(_tokens())
    assert calls == [(False, False)] * 2  # sliding layers: the window mask


def test_rope_tables_are_the_shared_numpy_tables_and_the_float64_torch_ones():
  for t, hd, theta in ((40, 16, 10000.0), (128, 64, 500000.0), (1024, 128, 1e6)):
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.outer(torch.arange(t, dtype=torch.float64), inv)
    ang = torch.cat([ang, ang], -1)
    cos, sin = rope_tables(t, hd, theta)
    assert cos.dtype == torch.float32 and cos.shape == (t, hd)
    assert torch.equal(cos, ang.cos().float()) and torch.equal(sin, ang.sin().float())
  scaled = {"rope_type": "linear", "factor": 4.0}
  cos, _ = rope_tables(8, 16, 100.0, scaling=scaled)
  from parity.architecture import rope_tables as shared
  np.testing.assert_array_equal(cos.numpy(), shared(8, 16, 100.0, scaled)[0])


# ----------------------------------------------------------------------------- sliding windows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_token_beyond_the_window_changes_nothing(dtype):
  spec = dataclasses.replace(MISTRAL, n_layers=1)
  model = build_model(spec, random_params(spec)).to(dtype)
  tok = _tokens()
  moved = tok.clone()
  moved[:, 2] = (moved[:, 2] + 1) % V
  a, b = model(tok), model(moved)
  w = spec.sliding_window
  assert torch.equal(a[:, :2], b[:, :2])  # before the token
  assert (a[:, 2:2 + w] != b[:, 2:2 + w]).any(-1).all()  # inside its window: every position moves
  assert torch.equal(a[:, 2 + w:], b[:, 2 + w:])  # t - 2 >= window: out of sight
  # two layers see twice as far, minus one
  model2 = build_model(MISTRAL, random_params(MISTRAL))
  a, b = model2(tok), model2(moved)
  reach = 2 + 2 * (w - 1)
  assert (a[:, reach] != b[:, reach]).any() and torch.equal(a[:, reach + 1:], b[:, reach + 1:])


def test_window_mask_is_the_reference_formula():
  seg = torch.tensor([[1, 1, 1, 1, 1, 2, 2, 2, 0, 0]])
  got = layers.window_mask(10, 3, torch.device("cpu"), seg)[0, 0].numpy()
  t, s = np.arange(10)[:, None], np.arange(10)[None, :]
  ids = seg[0].numpy()
  want = (s <= t) & (t - s < 3) & (ids[:, None] == ids[None, :])
  np.testing.assert_array_equal(got, want)
  assert got.any(-1).all()


@pytest.mark.parametrize("spec", [MISTRAL, GEMMA2], ids=["mistral", "gemma2"])
def test_packed_rows_equal_their_examples_alone_with_the_window(spec):
  model = build_model(spec, random_params(spec))
  a, b = _tokens(3, 1, 9)[0], _tokens(4, 1, 7)[0]
  packed = torch.cat([a, b])[None]
  seg = torch.tensor([[1] * 9 + [2] * 7])
  pos = torch.tensor([list(range(9)) + list(range(7))])
  got = model(packed, segment_ids=seg, positions=pos)
  alone_a, alone_b = model(a[None])[0], model(b[None])[0]
  # Same ops on the same values; only the matmuls' row counts differ, so the BLAS may block (and so order) the
  # reductions differently: a few ulps of the logits' scale per layer. Measured worst over 30 seeds x {1, 2} threads
  # on AVX2: 9.2 ulps of max|logit| (gemma2), 4.0 (mistral); an AVX-512 CI box gave 6.5. 64 ulps leaves 7x; a packed
  # row without its segment ids (the bug this guards) is off by ~8e6 ulps.
  atol = 64 * torch.finfo(torch.float32).eps * max(alone_a.abs().max().item(), alone_b.abs().max().item())
  torch.testing.assert_close(got[0, :9], alone_a, rtol=0, atol=atol)
  torch.testing.assert_close(got[0, 9:], alone_b, rtol=0, atol=atol)


# ----------------------------------------------------------------------------- Gemma's pieces


def test_softcap_attention_is_hf_eager_gemma2_attention():
  gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
  spec = dataclasses.replace(GEMMA2, n_layers=1, layer_types=("full",), sliding_window=None)
  attn = build_model(spec, random_params(spec)).h[0].attn
  x = torch.randn(2, T, spec.d_model, generator=torch.Generator().manual_seed(0))
  cos, sin = rope_tables(T, spec.head_dim, spec.rope_theta)
  got = attn(x, (cos, sin))
  q, k, v = attn._heads(x, (cos, sin))
  module = mock.Mock(num_key_value_groups=spec.n_heads // spec.kv_heads, training=False)
  mask = torch.zeros(T, T).masked_fill_(~torch.ones(T, T, dtype=torch.bool).tril(), torch.finfo(torch.float32).min)
  ctx, _ = gemma2.eager_attention_forward(module, q, k, v, mask[None, None], scaling=spec.scale,
                                          softcap=spec.attn_softcap)
  want = attn.proj(ctx.reshape(2, T, -1))
  torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
  assert not torch.equal(got, build_model(dataclasses.replace(spec, attn_softcap=None),
                                          random_params(spec)).h[0].attn(x, (cos, sin)))


def test_softcap_formula():
  x = torch.linspace(-100, 100, 41)
  torch.testing.assert_close(softcap(x, 30.0), 30.0 * torch.tanh(x / 30.0), rtol=0, atol=0)
  assert float(softcap(x, 30.0).abs().max()) < 30.0


def test_gemma_norm_geglu_and_embedding_scale():
  norm = RMSNorm(8, 1e-6, plus_one=True)
  assert torch.equal(norm.weight.detach(), torch.zeros(8))
  with torch.no_grad():
    norm.weight.copy_(torch.linspace(-0.5, 0.5, 8))
  x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)).bfloat16()
  x32 = x.float()
  want = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + norm.weight.float())).bfloat16()
  assert torch.equal(norm(x), want)  # float32 throughout, one rounding
  spec = dataclasses.replace(GEMMA2, n_layers=1, layer_types=("sliding",))
  model = build_model(spec, random_params(spec))
  mlp, h = model.h[0].mlp, torch.randn(2, 3, spec.d_model)
  gelu = torch.nn.functional.gelu(mlp.gate(h), approximate="tanh")
  assert torch.equal(mlp(h), mlp.proj(gelu * mlp.up(h)))
  rec = TapRecorder()
  model.record_taps(rec)
  tok = _tokens()
  model(tok)
  scale = torch.tensor(math.sqrt(32), dtype=torch.float32)
  assert torch.equal(rec.values["embed"], model.wte(tok) * scale)


# ----------------------------------------------------------------------------- taps and canonical weights


def test_every_new_tap_is_produced_and_leaves_the_output_alone():
  spec = EVERYTHING
  model = build_model(spec, random_params(spec))
  tok = _tokens()
  plain = model(tok)
  rec = TapRecorder()
  model.record_taps(rec)
  tapped = model(tok)
  model.record_taps(None)
  assert torch.equal(plain, tapped)
  assert set(rec.values) == set(dg.forward_taps(spec))
  new = ("h.1.attn.ln_q", "h.1.attn.ln_k", "h.1.attn.scores_capped", "h.1.ln_1_post", "h.1.ln_2_post", "logits_capped")
  assert set(new) <= set(rec.values)
  assert rec.values["h.0.attn.ln_q"].shape == (2, spec.n_heads, T, spec.head_dim)
  assert rec.values["h.0.attn.ln_k"].shape == (2, spec.kv_heads, T, spec.head_dim)
  assert rec.values["h.0.ln_1_post"].shape == (2, T, spec.d_model)
  assert torch.equal(rec.values["logits_capped"], plain.detach())
  assert torch.equal(rec.values["h.0.attn.scores_capped"], softcap(rec.values["h.0.attn.scores"], 2.0))
  assert float(rec.values["h.0.attn.scores_capped"].abs().max()) < 2.0
  probs = rec.values["h.0.attn.probs"]
  torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]))
  assert float(probs[..., 0, 1:].abs().max()) == 0 and float(probs[..., -1, :T - 4].abs().max()) == 0  # window 4


def test_canonical_round_trip_with_every_new_tensor():
  spec = EVERYTHING
  params = random_params(spec)
  for name in ("h.0.attn.ln_q.weight", "h.0.attn.ln_k.weight", "h.0.ln_1_post.weight", "h.0.ln_2_post.weight",
               "h.0.attn.qkv.bias", "h.0.attn.proj.bias", "h.0.mlp.gate.bias", "h.0.mlp.up.bias", "h.0.mlp.proj.bias"):
    assert name in params
  assert params["h.0.attn.ln_q.weight"].shape == (spec.head_dim,)
  model = build_model(spec, params)
  assert [n for n, _ in model.named_parameters()] == list(param_shapes(spec))  # canonical order
  back = to_canonical(model)
  assert list(back) == list(params) and all(np.array_equal(back[k], params[k]) for k in params)
  fresh = build_model(spec, init_params(spec, 0))
  assert not fresh.h[0].attn.ln_q.weight.detach().any()  # (1 + w) norms start at w = 0
  load_canonical(fresh, back)
  assert torch.equal(fresh(_tokens()), model(_tokens()))
  missing = {k: v for k, v in params.items() if k != "h.1.attn.ln_k.weight"}
  with pytest.raises(ValueError, match="ln_k"):
    load_canonical(fresh, missing)
  groups = decay_groups(model, 0.1)
  names = {id(p): n for n, p in model.named_parameters()}
  decayed = {names[id(p)] for p in groups[0]["params"]}
  assert decayed == {n for n in params if decays(n)}
  assert not any(("ln_q" in n or "ln_k" in n or "_post" in n) for n in decayed)


def test_bf16_family_model_trains_a_step():
  spec = EVERYTHING
  model = build_model(spec, random_params(spec)).bfloat16()
  tok = _tokens(t=T + 1)
  seg = torch.tensor([[1] * 10 + [2] * 6, [1] * 14 + [0] * 2])
  pos = torch.tensor([list(range(10)) + list(range(6)), list(range(14)) + [0, 1]])
  for kw in ({}, {"segment_ids": seg, "positions": pos}):
    logits = model(tok[:, :-1], **kw)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, V), tok[:, 1:].reshape(-1))
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
