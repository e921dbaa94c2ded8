import math

import numpy as np
import pytest

from parity import weights
from parity.verdict.params import param_checks
from parity.verdict.sides import compare_sides, verdict
from parity.verdict.steps import series_check
from parity.presets import PRESETS


def _recs(losses, **extra):
  return [{"step": i, "loss": loss, "grad_norm": 1.0, "lr": 1e-3, **extra} for i, loss in enumerate(losses)]


def test_series_within_and_beyond_tolerance():
  a = _recs([5.0, 4.0, 3.0, 2.0])
  b = _recs([5.0 + 2e-6, 4.0 - 3e-6, 3.0, 2.0])
  c = series_check("loss", "a", a, "b", b, "fp32")
  assert c.passed and c.value == pytest.approx(3e-6, rel=1e-3) and c.worst == 1
  b2 = _recs([5.0, 4.0, 3.0 + 5e-5, 2.0 + 1.0])
  c = series_check("loss", "a", a, "b", b2, "fp32")
  assert not c.passed and c.first_failing_step == 2 and c.worst == 3


def test_nan_on_one_side_fails_and_is_counted():
  c = series_check("loss", "a", _recs([5.0, 4.0]), "b", _recs([5.0, math.nan]), "fp32")
  assert not c.passed and c.first_failing_step == 1 and "finite on one side only" in c.detail


def test_lr_check_is_relative():
  a = [{"step": 0, "lr": 1e-3}, {"step": 1, "lr": 5e-4}]
  b = [{"step": 0, "lr": 1e-3 * (1 + 5e-8)}, {"step": 1, "lr": 5e-4 * (1 + 1e-5)}]
  c = series_check("lr", "a", a, "b", b, "fp32")
  assert not c.passed and c.first_failing_step == 1


def _params(spec, seed):
  return weights.init_params(spec, seed)


def test_param_check_relative_to_movement_and_zero_grad_rule():
  spec = PRESETS["gpt2-tiny"].model
  init = _params(spec, 0)
  rng = np.random.default_rng(0)
  a = {k: v + 1e-2 * rng.standard_normal(v.shape).astype(np.float32) for k, v in init.items()}
  b = {k: v + 1e-5 * rng.standard_normal(v.shape).astype(np.float32) for k, v in a.items()}
  # key-bias slice: wildly different noise, still within 2 * sum(lr)
  lo, hi = weights.zero_grad_slices(spec)["h.0.attn.qkv.bias"]
  b["h.0.attn.qkv.bias"] = a["h.0.attn.qkv.bias"].copy()
  b["h.0.attn.qkv.bias"][lo:hi] += 5e-3
  checks, table = param_checks("a", a, "b", b, init, spec, "fp32", lr_sum=0.01)
  by = {c.metric: c for c in checks}
  assert by["params"].passed and by["params_zero_grad"].passed
  assert len(table) == len(init)
  b["h.1.mlp.fc.weight"] = a["h.1.mlp.fc.weight"] + 5e-3  # half the movement: a real divergence
  checks, _ = param_checks("a", a, "b", b, init, spec, "fp32", lr_sum=0.01)
  by = {c.metric: c for c in checks}
  assert not by["params"].passed and by["params"].worst == "h.1.mlp.fc.weight"
  b["h.0.attn.qkv.bias"][lo:hi] += 1.0
  checks, _ = param_checks("a", a, "b", b, init, spec, "fp32", lr_sum=0.01)
  assert not {c.metric: c for c in checks}["params_zero_grad"].passed


def test_verdict_names_first_failing_step_and_metric():
  spec = PRESETS["gpt2-tiny"]
  spec = type(spec)(model=spec.model,
                    train=type(spec.train)(**{**{f: getattr(spec.train, f) for f in spec.train.__slots__}, "steps": 3}))
  init = _params(spec.model, 0)
  ok = {"status": "ok", "steps": _recs([5.0, 4.0, 3.0]), "final": None}
  bad = {"status": "ok", "steps": _recs([5.0, 4.5, 3.0]), "final": None}
  checks, _ = compare_sides({"x": ok, "y": dict(ok)}, spec=spec, init=init)
  v = verdict(checks, {"x": "ok", "y": "ok"})
  assert v.passed and v.message.startswith("PASS")
  checks, _ = compare_sides({"x": ok, "y": bad}, spec=spec, init=init)
  v = verdict(checks, {"x": "ok", "y": "ok"})
  assert not v.passed and v.first_failure.metric == "loss" and v.first_failure.first_failing_step == 1
  killed = {"status": "killed", "steps": _recs([5.0]), "final": None}
  checks, _ = compare_sides({"x": ok, "y": killed}, spec=spec, init=init)
  v = verdict(checks, {"x": "ok", "y": "killed"})
  assert not v.passed and "y (killed)" in v.message and v.first_failure.metric == "completed"
  assert v.first_failure.first_failing_step == 1


# --------------------------------------------------------------------------- noise envelope, repeats
from parity.verdict.envelope import envelope_check, windowed_rms  # noqa: E402
from parity.verdict.steps import repeat_check  # noqa: E402
from parity.verdict.tolerances import EnvelopeRule  # noqa: E402

_RULE = EnvelopeRule(factor=3.0, floor=1e-6, window=10, reason="test")


def test_windowed_rms_merges_a_short_tail():
  w = windowed_rms(list(range(23)), np.ones(23), 10)
  assert [(lo, hi) for lo, hi, _ in w] == [(0, 9), (10, 22)] and all(r == 1.0 for *_, r in w)
  w = windowed_rms(list(range(26)), np.arange(26.0), 10)
  assert [(lo, hi) for lo, hi, _ in w] == [(0, 9), (10, 19), (20, 25)]
  assert w[0][2] == pytest.approx(np.sqrt(np.mean(np.arange(10.0) ** 2)))


def _noisy(n, scale, seed):
  return np.random.default_rng(seed).normal(0.0, scale, n)


def test_envelope_passes_rounding_noise_and_fails_a_drift():
  n = 60
  base = np.linspace(5.0, 2.0, n)
  noise = {"a": {i: abs(x) for i, x in enumerate(_noisy(n, 1e-3, 0))}}
  b_ok = base + _noisy(n, 1e-3, 1)
  c = envelope_check("a", _recs(base), "b", _recs(b_ok), noise, _RULE)
  assert c.passed and c.metric == "loss_envelope" and c.value < c.tolerance
  k = np.arange(n)
  drift = b_ok + np.where(k >= 20, (k - 20) * 2e-3, 0.0)  # from step 20 on, a difference growing past the noise
  c = envelope_check("a", _recs(base), "b", _recs(drift), noise, _RULE)
  assert not c.passed and c.first_failing_step == 20
  assert "windows" in c.detail


def test_envelope_uses_the_noisier_side_and_skips_without_an_envelope():
  n = 30
  base = np.full(n, 3.0)
  other = base + 5e-3
  quiet = {i: 1e-4 for i in range(n)}
  loud = {i: 4e-3 for i in range(n)}
  assert not envelope_check("a", _recs(base), "b", _recs(other), {"a": quiet}, _RULE).passed
  assert envelope_check("a", _recs(base), "b", _recs(other), {"a": quiet, "b": loud}, _RULE).passed
  assert envelope_check("a", _recs(base), "b", _recs(other), {"c": loud}, _RULE) is None
  nan = envelope_check("a", _recs(base), "b", _recs([*other[:-1], math.nan]), {"a": loud}, _RULE)
  assert not nan.passed and nan.first_failing_step == n - 1


def test_repeat_check_is_bitwise():
  a = _recs([5.0, 4.0, 3.0])
  assert repeat_check("determinism", "jax", a, _recs([5.0, 4.0]), gating=False).passed
  c = repeat_check("determinism", "jax", a, _recs([5.0, 4.0 + 2 ** -40]), gating=False)
  assert not c.passed and c.first_failing_step == 1 and not c.gating and c.value > 0
  p = {"w": np.ones((2, 2), np.float32)}
  q = {"w": np.ones((2, 2), np.float32)}
  q["w"][1, 1] = np.nextafter(np.float32(1), np.float32(2))
  c = repeat_check("resume", "torch", a, a[2:], from_step=2, final_a=p, final_b=q, gating=True)
  assert not c.passed and "final params differ" in c.detail and c.gating
  assert repeat_check("resume", "torch", a, a[2:], from_step=2, final_a=p, final_b=dict(p), gating=True).passed
  assert not repeat_check("resume", "torch", a, [], from_step=2, gating=True).passed


def test_non_gating_failures_do_not_fail_the_verdict():
  a = _recs([5.0, 4.0])
  det = repeat_check("determinism", "a", a, _recs([5.0, 4.1]), gating=False)
  ok = series_check("loss", "a", a, "b", a, "fp32")
  v = verdict([ok, det], {"a": "ok", "b": "ok"})
  assert v.passed and "1 checks" in v.message
  res = repeat_check("resume", "a", a, _recs([5.0, 4.1])[1:], from_step=1, gating=True)
  assert not verdict([ok, res], {"a": "ok", "b": "ok"}).passed


def test_one_side_with_a_failing_gating_check_fails():
  a = _recs([5.0, 4.0])
  res = repeat_check("resume", "torch", a, [], from_step=1, gating=True)
  v = verdict([res], {"torch": "ok"})
  assert not v.passed and v.message.startswith("FAIL: torch: torch resume")
  det = repeat_check("determinism", "torch", a, _recs([5.0, 4.5]), gating=False)
  assert verdict([det], {"torch": "ok"}).passed


def test_fp16_pairs_compare_loss_scale_and_skipped_exactly():
  spec = PRESETS["gpt2-tiny"]
  import dataclasses as dc
  spec = dc.replace(spec, train=dc.replace(spec.train, precision="fp16", steps=3))
  a = [{"step": i, "loss": 5.0, "grad_norm": 1.0, "lr": 1e-3, "loss_scale": 65536.0,
        "skipped": False} for i in range(3)]
  b = [dict(r) for r in a]
  b[2]["loss_scale"] = 32768.0
  checks, _ = compare_sides({"jax": {"status": "ok", "steps": a, "final": None},
                             "torch": {"status": "ok", "steps": b, "final": None}}, spec=spec, init={})
  by = {c.metric: c for c in checks}
  assert not by["loss_scale"].passed and by["loss_scale"].first_failing_step == 2 and by["skipped"].passed


def test_series_check_treats_equal_infinities_as_a_match_without_warnings():
  """fp16 skipped steps record grad_norm = inf on both sides: a match (diff 0), not nan and no RuntimeWarning."""
  import warnings
  a = [{"step": 0, "grad_norm": 1.0}, {"step": 1, "grad_norm": float("inf")}, {"step": 2, "grad_norm": 2.0}]
  b = [{"step": 0, "grad_norm": 1.0}, {"step": 1, "grad_norm": float("inf")}, {"step": 2, "grad_norm": 2.0}]
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    c = series_check("grad_norm", "jax", a, "torch", b, "fp16")
  assert c.passed and c.value == 0.0
  b[1]["grad_norm"] = 3.0
  c = series_check("grad_norm", "jax", a, "torch", b, "fp16")
  assert not c.passed and c.first_failing_step == 1


def test_a_run_with_lr_zero_on_every_step_fails_the_updates_check():
  """A 2-step run (DeepSpeed's warmup gives lr 0 at steps 0 and 1) moved no weight, so a
  weight-decay difference between the sides passed every check. The 'updates' check fails it, naming the fix."""
  from parity.verdict.steps import updates_check
  zero = [{"step": 0, "lr": 0.0}, {"step": 1, "lr": 0.0}]
  c = updates_check("jax", zero, "torch", zero)
  assert not c.passed and c.gating and c.value == 0 and "more steps than the warmup" in c.detail
  moving = zero + [{"step": 2, "lr": 1e-4}]
  c = updates_check("jax", moving, "torch", moving)
  assert c.passed and c.value == 1 and c.first_failing_step is None
  one_side = zero + [{"step": 2, "lr": 0.0}]
  assert not updates_check("jax", moving, "torch", one_side).passed  # both sides must update on the same step


def test_a_relative_bound_names_the_step_nearest_it_and_the_largest_difference():
  """grad_norm's bound is relative: the step nearest it need not hold the largest |Δ|; the detail names both
  (design review, 2026-12-02: 'max |Δgrad_norm| = 2.38e-07 at step 0' where the largest was 4.77e-07 at step 3)."""
  from parity.verdict.steps import series_check
  a = [{"step": 0, "grad_norm": 1e-3}, {"step": 1, "grad_norm": 10.0}]
  b = [{"step": 0, "grad_norm": 1e-3 + 2e-7}, {"step": 1, "grad_norm": 10.0 + 5e-7}]
  c = series_check("grad_norm", "jax", a, "torch", b, "fp32")
  assert c.worst == 0 and "the step nearest its tolerance" in c.detail
  assert "largest |Δgrad_norm| = 5e-07 at step 1" in c.detail
  same = series_check("loss", "jax", [{"step": 0, "loss": 1.0}], "torch", [{"step": 0, "loss": 1.0 + 1e-6}], "fp32")
  assert same.detail.startswith("max |Δloss| = ") and "largest" not in same.detail  # an absolute bound: one step
