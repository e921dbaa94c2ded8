"""`parity diagnose`: taps on both sides, the tolerance rule, and localisation of planted bugs.

The slow tests share one gpt2-tiny folder: the matched run computes both sides once, and each plant
reruns only the side it changes (`diagnose(run_dir=..., reuse=True)`).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import HAS_JAX, HAS_TORCH, requires_jax, requires_torch

from parity import diagnose as dg
from parity.spec import ModelSpec, SpecError, preset

ROOT = Path(__file__).resolve().parents[1]
requires_both = pytest.mark.skipif(not (HAS_JAX and HAS_TORCH), reason="needs jax and torch")

GPT2 = ModelSpec(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
LLAMA = ModelSpec(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, norm="rmsnorm",
                  mlp="swiglu", position="rope", bias=False, tie_embeddings=False, d_ff=48, norm_eps=1e-6)
LLAMA_RUN = {"model": {"norm": "rmsnorm", "mlp": "swiglu", "position": "rope", "bias": False, "n_heads": 4,
                       "n_kv_heads": 2, "tie_embeddings": False, "d_ff": 96, "norm_eps": 1e-6}}


# ----------------------------------------------------------------------------- rule and names (no workers)


def test_tap_order_is_forward_then_loss_then_backward_grads_then_updates():
  order = dg.tap_order(GPT2)
  assert order[:3] == ["embed", "h.0.ln_1", "h.0.attn.q"]
  assert order.index("h.0.attn.scores") < order.index("h.0.attn.probs") < order.index("h.0.attn.context")
  assert order.index("h.1.out") < order.index("ln_f") < order.index("logits") < order.index("loss")
  grads = [n for n in order if n.startswith("grad/")]
  assert grads[0] == "grad/ln_f.bias" and grads[-1] == "grad/wte.weight"
  assert grads.index("grad/h.1.mlp.proj.weight") < grads.index("grad/h.0.attn.qkv.weight")
  assert [n for n in order if n.startswith("update/")] == [g.replace("grad/", "update/") for g in grads]
  llama = dg.forward_taps(LLAMA)
  assert "h.0.mlp.gate" in llama and "h.0.mlp.up" in llama and "h.0.mlp.fc" not in llama


def test_forward_rule_passes_rounding_and_names_the_worst_element():
  rng = np.random.default_rng(0)
  ref = rng.standard_normal((2, 3, 4)).astype(np.float32)
  ok = dg.compare_tensor("h.0.ln_1", ref, ref * (1 + np.float32(1e-7)))
  assert ok.passed and ok.max_rel_err < 1e-6
  bad = ref.copy()
  bad[1, 2, 3] += 1e-3
  d = dg.compare_tensor("h.0.ln_1", ref, bad)
  assert not d.passed and d.worst_index == (1, 2, 3) and d.max_abs_err == pytest.approx(1e-3, rel=1e-3)
  nan = ref.copy()
  nan[0, 0, 0] = np.nan
  assert not dg.compare_tensor("logits", ref, nan).passed
  assert dg.compare_tensor("logits", nan, nan).passed  # the same NaN on both sides is not a difference
  assert not dg.compare_tensor("logits", ref, ref[:1]).passed


def test_update_rule_allows_adam_noise_only_where_the_gradient_is_noise():
  lr, eps = 1e-3, 1e-8
  p0 = np.ones(4, np.float32)
  g = np.array([1e-2, -1e-2, 1e-11, 5e-3])  # element 2: a noise-level gradient (like the key bias)
  step = lr * g / (np.abs(g) + eps)
  a = (p0 - step).astype(np.float32)
  b = a.copy()
  b[2] = p0[2] - lr * 0.9  # Adam turned noise into ~lr: allowed there (<= 2 lr)
  assert dg.compare_tensor("update/h.0.ln_1.weight", a, b, init=p0, grad=g, lr=lr, adam_eps=eps).passed
  c = (a - lr * 0.1 * p0).astype(np.float32)  # weight decay applied where it must not be
  d = dg.compare_tensor("update/h.0.ln_1.weight", a, c, init=p0, grad=g, lr=lr, adam_eps=eps)
  assert not d.passed and d.worst_index != (2,)


def test_plants_parse_and_reject_bad_input():
  plants = dg.parse_plants(["jax:no_causal_mask", "torch:transpose=h.0.attn.proj.weight", "torch:decay_all"],
                           ("jax", "torch"), GPT2)
  assert plants == {"jax": {"no_causal_mask": True, "decay_all": False, "transpose": []},
                    "torch": {"no_causal_mask": False, "decay_all": True, "transpose": ["h.0.attn.proj.weight"]}}
  for bad, msg in (("jax", "SIDE:KIND"), ("deepspeed:decay_all", "not among"), ("jax:flip", "unknown plant"),
                   ("jax:transpose=h.0.mlp.fc.weight", "square"), ("jax:transpose=nope", "canonical")):
    with pytest.raises(SpecError, match=msg):
      dg.parse_plants([bad], ("jax", "torch"), GPT2)
  params = {"w": np.arange(4, dtype=np.float32).reshape(2, 2)}
  assert np.array_equal(dg.apply_weight_plants(params, {"transpose": ["w"]})["w"], params["w"].T)


def test_lr_position_skips_warmup_zeros():
  train = preset("gpt2-tiny").train
  k, lr = dg.lr_position(train, 0)
  assert k == 2 and lr > 0
  assert dg.lr_position(train, 5)[0] == 5
  with pytest.raises(SpecError, match="train.steps"):
    dg.lr_position(train, train.steps)


# ----------------------------------------------------------------------------- taps in each model


def _tokens(spec, b=2, t=9, seed=0):
  return np.random.default_rng(seed).integers(0, spec.vocab_size, (b, t))


@requires_jax
def test_jax_taps_cover_the_forward_and_leave_training_alone():
  import jax
  spec = GPT2  # LLaMA taps: test_matched_llama_family_breaks_nothing (a missing tap fails there)
  from parity.weights import init_params
  from jax_impl import model as M
  params = M.to_flax(init_params(spec, 0), spec)
  tok = _tokens(spec)
  loss, taps = jax.jit(lambda p, x: M.loss_and_taps(p, x, spec))(params, tok)
  names = {M.tap_name(k) for k in taps}
  assert names == set(dg.forward_taps(spec))
  assert float(loss) == pytest.approx(float(M.loss_fn(params, tok, spec)), abs=1e-6)
  by = {M.tap_name(k): v for k, v in taps.items()}
  assert by["h.0.attn.q"].shape == (2, spec.n_heads, 8, spec.head_dim)
  assert by["h.0.attn.k"].shape == (2, spec.kv_heads, 8, spec.head_dim)
  assert np.allclose(np.asarray(by["h.0.attn.probs"]).sum(-1), 1, atol=1e-5)
  variables = M.GPT(spec).init(jax.random.key(0), tok[:, :-1])
  assert set(variables) == {"params"}  # nothing sown when not tapping


@requires_torch
@pytest.mark.parametrize("spec", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_torch_taps_cover_the_forward_and_leave_the_output_alone(spec):
  import torch
  from parity.weights import init_params
  from torch_impl.model import TapRecorder, build_model
  model = build_model(spec, init_params(spec, 0))
  x = torch.from_numpy(_tokens(spec)[:, :-1])
  plain = model(x)
  rec = TapRecorder()
  model.record_taps(rec)
  tapped = model(x)
  model.record_taps(None)
  assert torch.equal(plain, tapped)
  assert set(rec.values) == set(dg.forward_taps(spec))
  assert rec.values["h.0.attn.k"].shape == (2, spec.kv_heads, 8, spec.head_dim)
  assert torch.equal(rec.values["logits"], plain.detach())
  # SDPA made the context; the tapped probs reproduce it
  probs, v = rec.values["h.0.attn.probs"], rec.values["h.0.attn.v"].repeat_interleave(
      spec.n_heads // spec.kv_heads, dim=1)
  ctx = (probs @ v).transpose(1, 2).reshape(2, 8, -1)
  assert torch.allclose(ctx, rec.values["h.0.attn.context"], atol=1e-6)


# ----------------------------------------------------------------------------- end to end (worker processes)


@pytest.fixture(scope="module")
def tiny_matched(tmp_path_factory):
  """One gpt2-tiny folder, both sides diagnosed once with nothing planted."""
  out = tmp_path_factory.mktemp("diagnose") / "tiny"
  return dg.diagnose("gpt2-tiny", out=out)


@pytest.mark.slow
@requires_both
def test_matched_gpt2_tiny_breaks_nothing(tiny_matched):
  r = tiny_matched
  assert r.side_status == {"jax": "ok", "torch": "ok"}, r.message
  assert r.passed and r.exit_code == 0 and r.first is None, r.message
  assert [t.name for t in r.tensors] == dg.tap_order(preset("gpt2-tiny").model)
  assert (r.lr_step, r.step) == (2, 0) and r.lr > 0
  data = json.loads((r.run_dir / "diagnose.json").read_text())
  assert data["passed"] and data["first"] is None and len(data["tensors"]) == len(r.tensors)
  assert "PASS" in (r.run_dir / "diagnose.md").read_text()
  where = {t.name: t.where for t in r.tensors}["h.0.attn.q"]
  assert where == {"jax": "intermediates/h_0/attn/q", "torch": "h.0.attn (Attention) q"}


PLANTS = [
    ({"perturb": ["torch:model.gelu_approximate=false"]}, "h.0.mlp.act"),
    ({"plants": ["torch:no_causal_mask"]}, "h.0.attn.probs"),
    ({"plants": ["torch:transpose=h.0.attn.proj.weight"]}, "h.0.attn.out"),
    ({"plants": ["torch:decay_all"]}, "update/ln_f.weight"),
    ({"perturb": ["jax:model.attn_scale=0.2"]}, "h.0.attn.scores"),
]


@pytest.mark.slow
@requires_both
@pytest.mark.parametrize("change,expected", PLANTS, ids=[e for _, e in PLANTS])
def test_planted_mismatch_is_localised(tiny_matched, change, expected):
  r = dg.diagnose(run_dir=tiny_matched.run_dir, reuse=True, **change)
  assert r.side_status == {"jax": "ok", "torch": "ok"}, r.message
  assert r.first is not None and r.first.name == expected, r.message
  assert r.exit_code == 1 and not r.first.passed
  assert r.first.worst_abs_err > r.first.tolerance
  assert all(t.passed for t in r.tensors[:[t.name for t in r.tensors].index(expected)])
  if expected.startswith("update/"):  # forward and gradients all agree; only the decay differs
    assert all(t.passed for t in r.tensors if not t.name.startswith("update/"))


@pytest.mark.slow
@requires_both
def test_cli_localises_layernorm_eps_and_exits_1(tmp_path):
  out = tmp_path / "eps"
  p = subprocess.run([sys.executable, "-m", "parity.cli", "diagnose", "--preset", "gpt2-tiny", "--out", str(out),
                      "--perturb", "jax:model.norm_eps=1e-6"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
  assert "FIRST DIFFERENCE: h.0.ln_1" in p.stdout and "intermediates/h_0/ln_1/out" in p.stdout
  data = json.loads((out / "diagnose.json").read_text())
  assert data["first"]["name"] == "h.0.ln_1" and data["first"]["max_rel_err"] > 1e-3
  assert data["perturb"] == {"jax": {"model.norm_eps": 1e-06}}


def test_cli_bad_input_exits_2():
  for args, msg in ((["--sides", "jax,deepspeed"], "--sides"), (["--step", "99"], "--step 99"),
                    (["--plant", "jax:transpose=h.0.mlp.fc.weight"], "square"),
                    (["--set", "jax.scan_layers=true"], "scan_layers"),
                    (["--perturb", "jax:model.n_layers=3"], "model.n_layers")):
    p = subprocess.run([sys.executable, "-m", "parity.cli", "diagnose", "--preset", "gpt2-tiny", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and msg in p.stderr, (args, p.stderr)


@pytest.mark.slow
@requires_both
def test_matched_llama_family_breaks_nothing(tmp_path):
  r = dg.diagnose("gpt2-tiny", config=LLAMA_RUN, out=tmp_path / "llama")
  assert r.side_status == {"jax": "ok", "torch": "ok"}, r.message
  assert r.passed, r.message
  assert "h.1.mlp.gate" in [t.name for t in r.tensors] and "grad/lm_head.weight" in [t.name for t in r.tensors]
