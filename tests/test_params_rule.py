"""The per-element Adam params rule (parity.verdict.params.param_checks, issue #11 item 2)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import requires_jax, requires_torch
from parity.verdict.params import AdamSensitivity, param_checks
from parity.presets import PRESETS
from parity.weights import init_params

SPEC = PRESETS["gpt2-tiny"].model
LR, STEPS, EPS = 1e-3, 4, 1e-8


def _pair(seed: int = 0):
  """init, a, b (b = a + fp32-size noise), and both sides' moments: every element's gradient RMS 1e-2 over 4
  updates at lr 1e-3, so S_i = 4e-3 / (1e-2 + eps) = 0.4."""
  init = init_params(SPEC, seed)
  rng = np.random.default_rng(seed)
  a = {k: v + LR * STEPS * np.sign(rng.standard_normal(v.shape)).astype(np.float32) for k, v in init.items()}
  b = {k: v + 1e-9 * rng.standard_normal(v.shape).astype(np.float32) for k, v in a.items()}
  sens = AdamSensitivity(EPS)
  rms = {k: np.full(v.shape, 1e-2, np.float32) for k, v in init.items()}
  for _ in range(STEPS):
    sens.add(rms, LR)
  mom = {"grad_rms": rms, "sensitivity": sens.result(rms)}
  return init, a, b, {"a": mom, "b": {k: {n: x.copy() for n, x in t.items()} for k, t in mom.items()}}


def _params_check(a, b, init, moments):
  checks, table = param_checks("a", a, "b", b, init, SPEC, "fp32", lr_sum=LR * STEPS, moments=moments)
  return {c.metric: c for c in checks}["params"], table


def test_near_zero_gradient_element_may_differ_by_a_full_adam_step():
  init, a, b, moms = _pair()
  name = "h.1.mlp.fc.weight"
  b[name][3, 5] = a[name][3, 5] - 2 * LR  # opposite-sign first step: 2·lr apart, as rounding noise does at step 1
  for m in moms.values():  # its gradient sat at rounding level: sqrt(v_hat) ~ 1e-11 at every update
    m["grad_rms"][name][3, 5] = 1e-11
    m["sensitivity"][name][3, 5] = STEPS * LR / (1e-11 + EPS)
  check, table = _params_check(a, b, init, moms)
  assert check.passed, check.detail
  assert "Adam per element" in check.detail
  old, _ = _params_check(a, b, init, None)  # the per-tensor rule flagged exactly this: 2e-3 / 4e-3 = 0.5 > 2e-3
  assert not old.passed and old.worst == name


def test_large_gradient_element_with_the_same_difference_fails():
  init, a, b, moms = _pair()
  name = "h.1.mlp.fc.weight"
  b[name][3, 5] = a[name][3, 5] - 2 * LR  # the same 2·lr, on an element whose gradient is 1e-2 (S_i = 0.4)
  check, table = _params_check(a, b, init, moms)
  assert not check.passed and check.worst == name
  assert check.value == pytest.approx(2 * LR, rel=1e-3) and check.tolerance < 1e-4
  assert [t["tensor"] for t in table if not t["passed"]] == [name]


def test_a_small_real_bug_on_every_element_still_fails():
  init, a, b, moms = _pair()
  b = {k: v * (1 - 1e-3 * LR) if k.endswith("fc.weight") else v for k, v in a.items()}  # weight decay 1e-3·lr
  b = {k: v + 3e-5 if k.endswith("fc.weight") else v for k, v in b.items()}  # a 0.75% drift of the movement
  check, _ = _params_check(a, b, init, moms)
  assert not check.passed


@pytest.mark.parametrize("missing", ["a", "b", "both"])
def test_missing_moments_fall_back_to_the_per_tensor_rule_and_say_so(missing):
  init, a, b, moms = _pair()
  if missing == "both":
    moms = {"a": None, "b": None}
  else:
    moms[missing] = None
  check, table = _params_check(a, b, init, moms)
  assert check.passed and "per-tensor fallback" in check.detail and "final_moments.safetensors" in check.detail
  assert ("a, b" if missing == "both" else missing) in check.detail
  assert all(t["rule"] == "per_tensor" for t in table)
  name = "h.0.mlp.fc.weight"
  b[name] = a[name] + 1e-2 * (a[name] - init[name])  # 1% of the movement: over 2e-3 under the fallback
  check, _ = _params_check(a, b, init, moms)
  assert not check.passed and check.worst == name


def test_bf16_keeps_the_per_tensor_rule():
  init, a, b, moms = _pair()
  checks, table = param_checks("a", a, "b", b, init, SPEC, "bf16", lr_sum=LR * STEPS, moments=moms)
  assert all(t["rule"] == "per_tensor" for t in table)
  assert "measured in fp32 only" in {c.metric: c for c in checks}["params"].detail


def test_sensitivity_accumulates_lr_over_rms_plus_eps():
  s = AdamSensitivity(1e-8)
  s.add({"w": np.array([1e-2, 0.0])}, 1e-3)
  s.add({"w": np.array([1e-2, 0.0])}, 0.0)  # an lr-0 step (WarmupCosineLR's step 0) adds nothing
  out = s.result({"w": np.zeros(2), "v": np.zeros(3)})
  np.testing.assert_allclose(out["w"], [1e-3 / (1e-2 + 1e-8), 1e-3 / 1e-8], rtol=1e-6)
  assert out["w"].dtype == np.float32 and out["v"].shape == (3,) and not out["v"].any()


@requires_jax
@requires_torch
def test_constant_lr_correct_pair_passes_and_a_planted_bug_fails(tmp_path):
  import parity
  sets = ['train.lr_schedule="Constant"', "train.lr=6e-4"]  # failed before: h.1.mlp.fc.weight ratio 2.8e-3 > 2e-3
  rep = parity.compare("gpt2-tiny", steps=4, sides=["jax", "torch"], out=tmp_path / "ok", overrides=sets,
                       noise_envelope=False, determinism_steps=0)
  params = next(c for c in rep.data["checks"] if c["metric"] == "params")
  assert rep.passed and params["passed"] and "Adam per element" in params["detail"], params
  bug = parity.compare("gpt2-tiny", steps=4, sides=["jax", "torch"], out=tmp_path / "bug", overrides=sets,
                       perturb=["torch:train.weight_decay=0.0"], noise_envelope=False, determinism_steps=0)
  params = next(c for c in bug.data["checks"] if c["metric"] == "params")
  assert not bug.passed and not params["passed"] and "Adam per element" in params["detail"]


def test_read_moments_round_trip_and_unreadable_files_fall_back(tmp_path):
  from parity import weights
  from parity.protocol import read_moments
  good = tmp_path / "m.safetensors"
  weights.save({"grad_rms/w": np.ones((2, 3)), "sensitivity/w": np.full((2, 3), 0.5)}, good)
  m = read_moments(good)
  assert set(m) == {"grad_rms", "sensitivity"} and m["sensitivity"]["w"].shape == (2, 3)
  bad = {"truncated": good.read_bytes()[:40], "empty": b""}
  for name, data in bad.items():
    (tmp_path / name).write_bytes(data)
    assert read_moments(tmp_path / name) is None, name
  weights.save({"grad_rms/w": -np.ones(2), "sensitivity/w": np.ones(2)}, tmp_path / "neg")
  weights.save({"grad_rms/w": np.ones(2)}, tmp_path / "half")
  weights.save({"w": np.ones(2)}, tmp_path / "foreign")
  assert all(read_moments(tmp_path / n) is None for n in ("neg", "half", "foreign", "missing"))


# The bf16/fp16 noise-envelope params rule (parity.verdict.envelope.envelope_params_check) with the same Adam term.

NOISE_RATIO = 1e-4  # each side's max|side - rerun| / moved, every tensor: bound_T = 10 * 1e-4 + 2e-3 = 3e-3 (bf16)


def _envelope_check(a, b, init, moments, precision="bf16"):
  from parity.verdict.envelope import envelope_params_check
  from parity.verdict.tolerances import envelope_rule
  noise = {s: {n: NOISE_RATIO for n in a} for s in ("a", "b")}
  return envelope_params_check("a", a, "b", b, init, SPEC, noise, envelope_rule(precision), moments=moments,
                               lr_sum=LR * STEPS, precision=precision)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_envelope_rounding_level_element_may_differ_by_a_full_adam_step(precision):
  init, a, b, moms = _pair()
  name = "h.0.attn.qkv.bias"
  b[name][7] = a[name][7] - 2 * LR  # the Constant-lr false alarm: opposite-sign steps on a rounding-level gradient
  for m in moms.values():
    m["grad_rms"][name][7] = 1e-11
    m["sensitivity"][name][7] = STEPS * LR / (1e-11 + EPS)
  check = _envelope_check(a, b, init, moms, precision)
  assert check.passed and "envelope + Adam per element" in check.detail, check.detail
  old = _envelope_check(a, b, init, None, precision)  # the per-tensor envelope: 2e-3 / 4e-3 = 0.5 > 3e-3
  assert not old.passed and old.worst == name and "per-tensor fallback" in old.detail


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_envelope_large_gradient_element_with_the_same_difference_fails(precision):
  init, a, b, moms = _pair()
  name = "h.0.attn.qkv.bias"
  b[name][7] = a[name][7] - 2 * LR  # gradient RMS 1e-2 (S_i = 0.4): kappa * g * S_i = 2.6e-4 (bf16), 3.2e-4 (fp16)
  check = _envelope_check(a, b, init, moms, precision)
  assert not check.passed and check.worst == name and check.value == pytest.approx(2 * LR, rel=1e-3)
  assert check.tolerance < 4e-4 and "1 of" in check.detail


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_envelope_lr_ten_percent_on_every_element_still_fails(precision):
  init, a, b, moms = _pair()
  b = {k: v + 0.1 * (v - init[k]) if k.endswith("mlp.fc.weight") else v for k, v in a.items()}  # 1.1x the movement
  check = _envelope_check(a, b, init, moms, precision)
  assert not check.passed and check.worst.endswith("mlp.fc.weight"), check.detail


@pytest.mark.parametrize("missing", ["b", "both"])
def test_envelope_missing_moments_fall_back_per_tensor_and_say_so(missing):
  init, a, b, moms = _pair()
  moms = {"a": None, "b": None} if missing == "both" else {**moms, "b": None}
  check = _envelope_check(a, b, init, moms)
  assert check.passed and "per-tensor fallback" in check.detail and "final_moments.safetensors" in check.detail
  assert ("a, b" if missing == "both" else "b wrote") in check.detail
  name = "h.0.mlp.fc.weight"
  b[name] = a[name] + 1e-2 * (a[name] - init[name])  # 1% of the movement: over bound_T = 3e-3
  check = _envelope_check(a, b, init, moms)
  assert not check.passed and check.worst == name and check.tolerance == pytest.approx(3e-3)


def test_envelope_kappa_is_at_least_fp32s_scaled_by_unit_roundoff():
  from parity.verdict.tolerances import tolerance
  k32 = tolerance("fp32", "params_grad_noise").rtol
  assert tolerance("bf16", "params_grad_noise").rtol == pytest.approx(k32 * 2.0 ** -8 / 2.0 ** -24)
  # fp16 measured above its scaling (range effects, see the entry's reason), never below it
  assert k32 * 2.0 ** -11 / 2.0 ** -24 < tolerance("fp16", "params_grad_noise").rtol < 0.1


@requires_jax
@requires_torch
def test_bf16_constant_lr_correct_pair_passes_the_params_envelope(tmp_path):
  import parity
  # failed before: params_envelope h.0.attn.qkv.bias max |Δ| / moved = 0.216 vs bound 0.1
  rep = parity.compare("gpt2-tiny", steps=8, sides=["jax", "torch"], out=tmp_path / "ok", determinism_steps=0,
                       overrides=['train.precision="bf16"', 'train.lr_schedule="Constant"'], noise_envelope=True)
  pe = next(c for c in rep.data["checks"] if c["metric"] == "params_envelope")
  assert rep.passed and pe["passed"] and "envelope + Adam per element" in pe["detail"], pe


def test_envelope_non_adam_optimizer_keeps_the_per_tensor_rule_and_says_so():
  from parity.verdict.envelope import envelope_params_check
  from parity.verdict.tolerances import envelope_rule
  init, a, b, moms = _pair()
  name = "h.0.attn.qkv.bias"
  b[name][7] = a[name][7] - 2 * LR  # would pass the Adam term (see above); SGD/Lamb updates have no such bound
  for m in moms.values():
    m["grad_rms"][name][7] = 1e-11
    m["sensitivity"][name][7] = STEPS * LR / (1e-11 + EPS)
  noise = {s: {n: NOISE_RATIO for n in a} for s in ("a", "b")}
  check = envelope_params_check("a", a, "b", b, init, SPEC, noise, envelope_rule("bf16"), moments=moms,
                                lr_sum=LR * STEPS, precision="bf16", adam_updates=False)
  assert not check.passed and "the optimizer is not Adam" in check.detail
