"""`parity diagnose`: taps on both sides, the tolerance rule, and localisation of planted bugs.

The slow tests share one gpt2-tiny folder: the matched run computes both sides once, and each plant
reruns only the side it changes (`diagnose(run_dir=..., reuse=True)`).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from conftest import HAS_JAX, HAS_TORCH, requires_jax, requires_torch

from parity import diagnose as dg
from parity.presets import preset
from parity.spec import ModelSpec, SpecError

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
  assert plants == {"jax": {"no_causal_mask": True, "decay_all": False, "transpose": [], "offset": []},
                    "torch": {"no_causal_mask": False, "decay_all": True, "transpose": ["h.0.attn.proj.weight"],
                              "offset": []}}
  for bad, msg in (("jax", "SIDE:KIND"), ("deepspeed:decay_all", "not among"), ("jax:flip", "unknown plant"),
                   ("jax:transpose=h.0.mlp.fc.weight", "square"), ("jax:transpose=nope", "canonical")):
    with pytest.raises(SpecError, match=msg):
      dg.parse_plants([bad], ("jax", "torch"), GPT2)
  params = {"w": np.arange(4, dtype=np.float32).reshape(2, 2)}
  assert np.array_equal(dg.apply_weight_plants(params, {"transpose": ["w"]})["w"], params["w"].T)
  assert np.array_equal(dg.apply_weight_plants(params, {"offset": ["w"]})["w"], params["w"] + np.float32(0.05))
  assert dg.parse_plants(["torch:offset=h.0.ln_1.bias"], ("jax", "torch"), GPT2)["torch"]["offset"] == ["h.0.ln_1.bias"]
  with pytest.raises(SpecError, match="canonical"):
    dg.parse_plants(["torch:offset=h.9.ln_1.bias"], ("jax", "torch"), GPT2)


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
  from jax_impl import layers
  from jax_impl import layout
  params = layout.to_flax(init_params(spec, 0), spec)
  tok = _tokens(spec)
  loss, taps = jax.jit(lambda p, x: M.loss_and_taps(p, x, spec))(params, tok)
  names = {layers.tap_name(k) for k in taps}
  assert names == set(dg.forward_taps(spec))
  assert float(loss) == pytest.approx(float(M.loss_fn(params, tok, spec)), abs=1e-6)
  by = {layers.tap_name(k): v for k, v in taps.items()}
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


@pytest.mark.process
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


@pytest.mark.process
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


@pytest.mark.process
@pytest.mark.requires_deepspeed
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


@pytest.mark.parametrize("args,msg", [
    (["--sides", "jax,deepspeed"], "--sides"), (["--step", "99"], "--step 99"),
    (["--plant", "jax:transpose=h.0.mlp.fc.weight"], "square"), (["--set", "jax.scan_layers=true"], "scan_layers"),
    (["--perturb", "jax:model.n_layers=3"], "model.n_layers")])
def test_cli_bad_input_exits_2(tmp_path, capsys, args, msg):
  """In-process (cli.main; the refusal comes before any side starts: no process per case)."""
  from parity.cli import main
  try:
    code = main(["diagnose", "--preset", "gpt2-tiny", "--out", str(tmp_path / "dg"), *args])
  except SystemExit as exc:  # argparse's own refusals
    code = exc.code
  err = capsys.readouterr().err
  assert code == 2 and msg in err and "Traceback" not in err, (args, err)
  assert not (tmp_path / "dg" / "jax").exists()


@pytest.mark.process
@pytest.mark.slow
@requires_both
def test_matched_llama_family_breaks_nothing(tmp_path):
  r = dg.diagnose("gpt2-tiny", config=LLAMA_RUN, out=tmp_path / "llama")
  assert r.side_status == {"jax": "ok", "torch": "ok"}, r.message
  assert r.passed, r.message
  assert "h.1.mlp.gate" in [t.name for t in r.tensors] and "grad/lm_head.weight" in [t.name for t in r.tensors]


# ----------------------------------------------------------------------------- bf16 / fp16 vs each side's fp32


def _bf16(x):
  from parity.weights import round_to_bfloat16
  return round_to_bfloat16(np.asarray(x, np.float32))


def test_precision_rule_names_the_side_that_rounds_more_and_ignores_tiny_errors():
  rng = np.random.default_rng(1)
  spec = GPT2
  ref = {n: rng.standard_normal((4, 8, 16)).astype(np.float32) for n in dg.forward_taps(spec)}
  once = {n: _bf16(v) for n, v in ref.items()}  # one rounding: what a correct bf16 op does
  twice = dict(once)
  # h.0.attn.probs rounded with 2 fewer bits: ~4x the error of one bf16 rounding
  coarse = ref["h.0.attn.probs"] * np.float32(1 + 2.0 ** -6 * rng.uniform(-1, 1, ref["h.0.attn.probs"].shape))
  twice["h.0.attn.probs"] = coarse.astype(np.float32)
  tiny = dict(once)
  tiny["h.0.ln_1"] = ref["h.0.ln_1"] * np.float32(1 + 1e-6)  # exact to 1e-6 vs one rounding: both far below floor
  refs = {"jax": ref, "torch": ref}
  init, train = {}, preset("gpt2-tiny").train
  fwd = lambda r: [t for t in r if t.kind == "forward"]
  matched = fwd(dg.compare_precision(spec, train, "bf16", ("jax", "torch"), {"jax": once, "torch": dict(once)}, refs,
                                     init, 1e-3))
  assert matched and all(t.passed and t.ratio == 1.0 for t in matched)
  assert 1e-3 < matched[0].rms_err["jax"] < 2.0 ** -8  # one rounding: ~u / sqrt(3..6)
  r = fwd(dg.compare_precision(spec, train, "bf16", ("jax", "torch"), {"jax": once, "torch": twice}, refs, init, 1e-3))
  bad = [t for t in r if not t.passed]
  assert [t.name for t in bad] == ["h.0.attn.probs"] and bad[0].off == "torch" and bad[0].ratio > 2
  r = fwd(dg.compare_precision(spec, train, "bf16", ("jax", "torch"), {"jax": tiny, "torch": dict(tiny)}, refs, init,
                               1e-3))
  ln = next(t for t in r if t.name == "h.0.ln_1")
  assert ln.passed and ln.rms_err["jax"] < 1e-5  # equal tiny errors: no ratio to speak of
  assert dg.precision_errors(np.array([1.0, np.nan]), np.array([1.0, 2.0])) == (float("inf"), float("inf"))


def test_precision_update_is_judged_against_adam_on_the_sides_own_gradient():
  spec, train = GPT2, preset("gpt2-tiny").train
  lr = 1e-3
  name = "ln_f.weight"  # not decayed
  p0 = np.ones(32, np.float32)
  g_ref = np.linspace(-1, 1, 32).astype(np.float32) * 1e-2
  g_low = _bf16(g_ref)
  g_low[16] = -g_low[16]  # rounding flipped a small element's sign: the update moves 2 lr there, legitimately
  step = lambda g, decay=False: dg.compare.adamw_first_step(p0, g, lr, train, decay, 1.0).astype(np.float32)
  ref = {"grad/" + name: g_ref, "update/" + name: step(g_ref)}
  good = {"grad/" + name: g_low, "update/" + name: step(g_low)}
  decayed = {"grad/" + name: g_low, "update/" + name: step(g_low, decay=True)}  # decay where it must not be
  only = lambda r: next(t for t in r if t.name == "update/" + name)
  low = {"jax": good, "torch": good}
  with mock.patch.object(dg.compare, "tap_order", lambda s: ["update/" + name]):
    ok = only(dg.compare_precision(spec, train, "bf16", ("jax", "torch"), low, {"jax": ref, "torch": ref},
                                   {name: p0}, lr))
    assert ok.passed and ok.max_err["jax"] > 1.0  # 2 lr off the fp32 step at the flipped element, and still fine
    bad = only(dg.compare_precision(spec, train, "bf16", ("jax", "torch"), {"jax": good, "torch": decayed},
                                    {"jax": ref, "torch": ref}, {name: p0}, lr))
  assert bad.off == "torch" and bad.adam_residual["torch"] > 10 > 1 > bad.adam_residual["jax"]


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
  """One gpt2-tiny bf16 folder, both sides diagnosed once (bf16 and fp32 each) with nothing planted."""
  out = tmp_path_factory.mktemp("diagnose") / "tiny-bf16"
  return dg.diagnose("gpt2-tiny", overrides=['train.precision="bf16"'], out=out)


@pytest.mark.process
@pytest.mark.slow
@requires_both
def test_bf16_matched_reports_per_tap_errors_and_jax_rounds_like_torch(tiny_bf16):
  r = tiny_bf16
  assert r.side_status == {"jax": "ok", "torch": "ok"}, r.message
  spec = preset("gpt2-tiny").model
  assert r.precision == "bf16" and [t.name for t in r.precision_tensors] == dg.tap_order(spec)
  assert all(t.passed for t in r.tensors), "the two fp32 runs on the rounded weights must agree"
  u = dg.UNIT_ROUNDOFF["bf16"]
  by = {t.name: t for t in r.precision_tensors}
  for t in r.precision_tensors:
    if t.kind in ("forward", "grad"):  # real bf16 errors: between a fraction of one rounding and a few
      assert all(0 < e < 6 * u for e in t.rms_err.values()), t
  # forward: every op rounds where torch's kernel rounds (attention probs as SDPA's float32 internals)
  assert all(t.passed for t in r.precision_tensors if t.kind == "forward"), r.message
  assert by["h.0.attn.probs"].rms_err["jax"] < 0.1 * u
  # no JAX departure anywhere; the only flags are torch's CPU LayerNorm backward, which sums the weight and
  # bias gradients in bf16 (docs/diagnose.md)
  flagged = [t for t in r.precision_tensors if not t.passed]
  assert all(t.off == "torch" and t.kind == "grad" and t.name.split(".")[-2].split("/")[-1].startswith("ln_")
             for t in flagged), [(t.name, t.off) for t in flagged]
  assert r.first is None or r.first.name == flagged[0].name
  data = json.loads((r.run_dir / "diagnose.json").read_text())
  assert data["precision"] == "bf16" and len(data["precision_tensors"]) == len(r.precision_tensors)
  assert "rms_err" in data["precision_tensors"][0] and "adam_residual" in data["precision_tensors"][-1]
  md = (r.run_dir / "diagnose.md").read_text()
  assert "## bf16: each side's error against its own fp32 run" in md and "`h.1.mlp.act`" in md


@pytest.mark.process
@pytest.mark.slow
@requires_both
def test_bf16_planted_bug_is_localised_in_the_fp32_runs(tiny_bf16):
  r = dg.diagnose(run_dir=tiny_bf16.run_dir, reuse=True, plants=["torch:no_causal_mask"])
  assert r.side_status == {"jax": "ok", "torch": "ok"}, r.message
  assert r.first is not None and r.first.name == "h.0.attn.probs", r.message
  assert "fp32 runs" in r.message and r.exit_code == 1
  # a plant changes both of torch's runs alike, so its bf16 error against its own fp32 run stays a rounding
  # error; the comparison of the two sides' fp32 runs is what names it (future positions: |Δ| ~ 1)
  assert r.first.worst_abs_err > 0.5
  probs = next(t for t in r.precision_tensors if t.name == "h.0.attn.probs")
  assert probs.rms_err["torch"] < dg.UNIT_ROUNDOFF["bf16"]


@pytest.mark.process
@pytest.mark.slow
@requires_both
def test_bf16_llama_family_matched_passes(tmp_path):
  r = dg.diagnose("gpt2-tiny", config=LLAMA_RUN, overrides=['train.precision="bf16"'], out=tmp_path / "llama-bf16")
  assert r.side_status == {"jax": "ok", "torch": "ok"}, r.message
  assert r.passed, r.message  # RMSNorm, SwiGLU, RoPE, GQA: both sides round alike
  assert {t.name for t in r.precision_tensors} >= {"h.1.mlp.gate", "grad/lm_head.weight", "update/wte.weight"}


def test_ctrl_c_still_writes_the_report_then_reraises(tmp_path, monkeypatch):
  """Ctrl-C while a worker runs: the report says which side was interrupted and which never started, then
  the KeyboardInterrupt reaches the caller (the CLI exits 130)."""
  import harness.runner
  from parity.diagnose import diagnose

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(harness.runner, "run_side", interrupted)
  with pytest.raises(KeyboardInterrupt):
    diagnose("gpt2-tiny", out=str(tmp_path / "d"))
  report = json.loads((tmp_path / "d" / "diagnose.json").read_text())
  assert report["side_status"] == {"jax": "interrupted", "torch": "not_run"}
  assert "Ctrl-C" in report["side_errors"]["jax"] and "not started" in report["side_errors"]["torch"]
  assert (tmp_path / "d" / "diagnose.md").exists()


def test_a_refused_input_leaves_no_folder_behind(tmp_path):
  """A diagnose refused while preparing its folder (here: a data file that is not there) removes the folder it made
  (newcomer, 2026-12-02: an empty runs/<time>-diagnose-<hash>/ was left)."""
  from parity.data import DataError
  from parity.spec import SpecError
  out = tmp_path / "d"
  with pytest.raises((DataError, SpecError), match="does not exist"):
    dg.diagnose("sft-tiny", overrides={"data": str(tmp_path / "nowhere.jsonl")}, out=out)
  assert not out.exists()
