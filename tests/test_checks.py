import math

import numpy as np
import pytest

from parity import weights
from parity.checks import compare_sides, param_checks, series_check, verdict
from parity.spec import PRESETS


def _recs(losses, **extra):
  return [{"step": i, "loss": l, "grad_norm": 1.0, "lr": 1e-3, **extra} for i, l in enumerate(losses)]


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
  spec = type(spec)(model=spec.model, train=type(spec.train)(**{**{f: getattr(spec.train, f) for f in spec.train.__slots__}, "steps": 3}))
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
