"""fp16 dynamic loss scaling: parity.numerics.loss_scale against DeepSpeed's own classes, then every side end to end.

The state machine is checked against the installed DeepSpeed (`DynamicLossScaler` for ZeRO-1/2/3,
`FP16_Optimizer._update_scale` for stage 0) on random overflow sequences and settings. The slow
tests run gpt2-tiny in fp16 on every side with forced and with natural overflows and check that
the sides skip the same steps with the scales parity.numerics.loss_scale predicts.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import types
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from conftest import HAS_DEEPSPEED, requires_deepspeed, requires_jax, requires_torch
from parity.numerics.loss_scale import LossScaleAtMinimum, LossScaler, predict_scales

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

SETTINGS = st.fixed_dictionaries({
    "initial_scale_power": st.integers(0, 40),
    "loss_scale_window": st.integers(1, 6),
    "hysteresis": st.integers(1, 4),
    "consecutive_hysteresis": st.booleans(),
    "min_loss_scale": st.sampled_from([1, 2, 4, 64]),
})


def _train(**kw) -> types.SimpleNamespace:
  return types.SimpleNamespace(loss_scale=0.0, **kw)


@contextlib.contextmanager
def _quiet_deepspeed_scaler():
  """DeepSpeed's scaler asks deepspeed.comm for the rank to log; answer 0 without a process group."""
  from deepspeed.runtime.fp16 import loss_scaler
  with mock.patch.object(loss_scaler, "dist", types.SimpleNamespace(get_rank=lambda: 0)):
    yield loss_scaler


def _run(update, scale_of, overflows):
  """Scales before each step and the step index that raised (or None)."""
  scales = []
  for i, overflow in enumerate(overflows):
    scales.append(scale_of())
    try:
      update(overflow)
    except Exception:  # DeepSpeed raises a bare Exception at the minimum scale
      return scales, i
  return scales, None


@requires_deepspeed
@settings(max_examples=300, deadline=None)
@given(cfg=SETTINGS, overflows=st.lists(st.booleans(), min_size=1, max_size=60))
def test_dynamic_scale_matches_deepspeed_dynamic_loss_scaler(cfg, overflows):
  with _quiet_deepspeed_scaler() as ls:
    ds = ls.DynamicLossScaler(init_scale=2 ** cfg["initial_scale_power"], scale_window=cfg["loss_scale_window"],
                              min_scale=cfg["min_loss_scale"], delayed_shift=cfg["hysteresis"],
                              consecutive_hysteresis=cfg["consecutive_hysteresis"])
    want, want_raise = _run(ds.update_scale, lambda: float(ds.cur_scale), overflows)
  ours = LossScaler.from_train(_train(**cfg))
  got, got_raise = _run(ours.update, lambda: ours.scale, overflows)
  assert got == want
  assert got_raise == want_raise
  if want_raise is None:
    assert (ours.cur_hysteresis, ours.cur_iter, ours.last_overflow_iter) == (
        ds.cur_hysteresis, ds.cur_iter, ds.last_overflow_iter)


@requires_deepspeed
@settings(max_examples=150, deadline=None)
@given(cfg=SETTINGS, overflows=st.lists(st.booleans(), min_size=1, max_size=60))
def test_stage0_rule_matches_deepspeed_fp16_optimizer(cfg, overflows):
  """ZeRO stage 0 (FP16_Optimizer) has no hysteresis and no raise: our machine with hysteresis 1, raise_at_min off."""
  import torch
  from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
  from deepspeed.runtime.fp16.loss_scaler import LossScaleConfig, LossScaleProfile
  args = {"init_scale": 2 ** cfg["initial_scale_power"], "scale_window": cfg["loss_scale_window"],
          "min_scale": cfg["min_loss_scale"], "delayed_shift": cfg["hysteresis"],
          "consecutive_hysteresis": cfg["consecutive_hysteresis"]}
  fake = types.SimpleNamespace(verbose=False, loss_scale_config=LossScaleConfig(
      torch.float16, True, 1.0, args, profile=LossScaleProfile.FUSED))
  want, _ = _run(lambda o: FP16_Optimizer._update_scale(fake, o), lambda: float(fake.loss_scale_config.cur_scale),
                 overflows)
  ours = LossScaler.from_train(_train(**{**cfg, "hysteresis": 1}), raise_at_min=False)
  got, _ = _run(ours.update, lambda: ours.scale, overflows)
  assert got == want


def test_known_sequence_and_minimum():
  t = _train(initial_scale_power=3, loss_scale_window=2, hysteresis=2, consecutive_hysteresis=False,
             min_loss_scale=2)
  # overflow (hysteresis 2 -> 1), overflow (8 -> 4), clean x3 (double on the 3rd: stable interval 2), ...
  assert predict_scales(t, [True, True, False, False, False, False]) == [8.0, 8.0, 4.0, 4.0, 4.0, 8.0]
  with pytest.raises(LossScaleAtMinimum, match="min_loss_scale=2"):
    predict_scales(t, [True] * 5)  # 8, 8, 4, 2, then an overflow at the minimum
  static = types.SimpleNamespace(loss_scale=128.0)
  assert predict_scales(static, [True, False, True]) == [128.0] * 3


def test_state_dict_round_trip_and_setting_check():
  t = _train(initial_scale_power=10, loss_scale_window=3, hysteresis=2, consecutive_hysteresis=True,
             min_loss_scale=1)
  a = LossScaler.from_train(t)
  for o in (True, False, True, True):
    a.update(o)
  b = LossScaler.from_train(t)
  b.load_state_dict(a.state_dict())
  assert b == a
  c = LossScaler.from_train(types.SimpleNamespace(**{**vars(t), "hysteresis": 3}))
  with pytest.raises(ValueError, match="hysteresis: saved 2, now 3"):
    c.load_state_dict(a.state_dict())




# --------------------------------------------------------------------------- the trainers, in process

OVERFLOWS = [False, True, False, True, True, False, False, False, True, False, False, False, False, True]


@requires_jax
@pytest.mark.parametrize("cfg", [dict(initial_scale_power=5, loss_scale_window=2, hysteresis=2,
                                      consecutive_hysteresis=False, min_loss_scale=4),
                                 dict(initial_scale_power=30, loss_scale_window=1, hysteresis=3,
                                      consecutive_hysteresis=True, min_loss_scale=1),
                                 dict(initial_scale_power=1, loss_scale_window=5, hysteresis=1,
                                      consecutive_hysteresis=False, min_loss_scale=1)])
def test_jax_traced_rule_matches_the_reference(cfg):
  import jax
  import jax.numpy as jnp
  from jax_impl import optim
  from jax_impl import loss_scaling
  train = _train(**cfg)
  lcfg = optim.LossScaleConfig.from_train(train)
  init = optim.loss_scaled(optim.optax.identity(), lcfg).init({}).loss_scale

  def body(state, overflow):
    at_min = loss_scaling.overflow_at_minimum(state, overflow, lcfg)
    return optim.next_loss_scale(state, overflow, lcfg), (state.scale, at_min)

  _, (scales, at_min) = jax.jit(lambda s, o: jax.lax.scan(body, s, o))(init, jnp.asarray(OVERFLOWS))
  ref = LossScaler.from_train(train)
  want, raised_at = _run(ref.update, lambda: ref.scale, OVERFLOWS)
  n = len(want)
  assert [float(x) for x in scales[:n]] == want
  flagged = [i for i, x in enumerate(at_min) if bool(x)]
  assert (flagged[0] if flagged else None) == raised_at  # the step where DeepSpeed raises


def _tiny_fp16(**over):
  from parity.pipeline.resolve import resolve
  from parity.weights import init_params
  spec = resolve("gpt2-tiny", steps=4, overrides=['train.precision="fp16"', "train.hysteresis=1",
                                                  *[f"train.{k}={v}" for k, v in over.items()]])
  rng = np.random.default_rng(0)
  t = spec.train
  batches = rng.integers(0, spec.model.vocab_size, (4, t.grad_accum_steps, t.micro_batch_size, t.seq_len + 1))
  return spec, init_params(spec.model, t.seed), batches.astype(np.uint16)


@requires_jax
def test_jax_forced_overflow_skips_the_whole_update_in_one_executable():
  import jax
  from jax_impl import optim
  from jax_impl.step import Trainer
  spec, params, batches = _tiny_fp16(initial_scale_power=10)
  tr = Trainer.build(spec, params)
  tr.compile(batches.shape[1:], None, batches.dtype)
  assert optim.loss_scale_state_of(tr.state.opt_state) is not None  # inside the placed, donated state
  m0 = tr.step(batches[0])
  before = jax.device_get(tr.state)
  m1 = tr.step(batches[1], force_overflow=True)
  after = jax.device_get(tr.state)
  assert m1["skipped"] and math.isinf(m1["grad_norm"]) and not m0["skipped"]
  assert (m0["loss_scale"], m1["loss_scale"]) == (1024.0, 1024.0)
  same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), (before.params, before.opt_state.inner),
                      (after.params, after.opt_state.inner))
  assert all(jax.tree.leaves(same))  # params, Adam moments and count (so the LR schedule) unchanged
  m2 = tr.step(batches[2])
  assert m2["loss_scale"] == 512.0 and m2["lr"] == m1["lr"] and not m2["skipped"]
  with pytest.raises(ValueError, match="train.precision='fp16'"):
    Trainer.build(spec.__class__(model=spec.model, train=dataclasses.replace(spec.train, precision="fp32")),
                  params).step(batches[0], force_overflow=True)


@requires_torch
def test_torch_forced_overflow_skips_and_the_scaler_checkpoints():
  import torch
  from torch_impl.baseline import TorchTrainer
  spec, params, batches = _tiny_fp16(initial_scale_power=10)
  tr = TorchTrainer(spec, params)
  m0 = tr.step(batches[0])
  masters = [p.detach().clone() for p in tr.params]
  moments = {k: v.clone() for k, v in tr.optimizer.state[tr.params[0]].items()}
  m1 = tr.step(batches[1], force_overflow=True)
  assert m1["skipped"] and math.isinf(m1["grad_norm"]) and tr.step_index == 1
  assert all(torch.equal(a, b) for a, b in zip(masters, tr.params))
  assert all(torch.equal(moments[k], v) for k, v in tr.optimizer.state[tr.params[0]].items())
  saved = tr.loss_scaler.state_dict()
  other = TorchTrainer(spec, params)
  other.loss_scaler.load_state_dict(saved)
  assert other.loss_scaler.scale == 512.0 == tr.step(batches[2])["loss_scale"] and not m0["skipped"]

# --------------------------------------------------------------------------- DeepSpeed configs <-> fp16 runs

# The real DeepSpeed configs (tests/data/realworld/ds_configs, SOURCES.md there); PARITY_REALWORLD may name others.
REAL = Path(os.environ.get("PARITY_REALWORLD") or Path(__file__).parent / "data" / "realworld" / "ds_configs")
FP16_CONFIGS = [  # (real config, the run's precision that an "auto" fp16.enabled takes)
    ("huggingface__accelerate__examples__deepspeed_config_templates__zero_stage1_config.json", "fp32"),
    ("huggingface__transformers__tests__deepspeed__ds_config_zero2.json", "fp16"),
]


@requires_torch
@pytest.mark.parametrize("name,base_precision", FP16_CONFIGS)
def test_fp16_deepspeed_config_ports_to_an_fp16_run_and_back(name, base_precision):
  import json
  from parity.migrate._reverse import port_for_compare, to_deepspeed
  from parity.pipeline.resolve import resolve
  from torch_impl.engine import ds_config
  from parity.numerics.ds_json import fp16_config
  raw = json.loads((REAL / name).read_text())
  base = resolve("gpt2-tiny", overrides=[f'train.precision="{base_precision}"'])
  spec, ds, result = port_for_compare(raw, base, source=name)
  t = spec.train
  assert t.precision == "fp16"
  assert (t.loss_scale, t.initial_scale_power, t.loss_scale_window, t.hysteresis, t.consecutive_hysteresis,
          t.min_loss_scale) == (0.0, 16, 1000, 2, False, 1.0)
  assert ds["fp16"]["enabled"] is True  # the DeepSpeed side runs the resolved config verbatim
  want = {"enabled": True, "loss_scale": 0.0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
          "consecutive_hysteresis": False, "min_loss_scale": 1}
  assert fp16_config(t) == want == ds_config(spec)["fp16"]  # a run spec's own DeepSpeed config
  back, report = to_deepspeed(result.ported.to_dict(), source=name)  # the ported YAML -> DeepSpeed
  assert back["fp16"] == want and not report.errors
  assert result.ported.precision.skip_nonfinite_updates  # DeepSpeed skips overflowing fp16 steps


def test_fp16_under_zero_stage0_is_refused_for_compare():
  from parity.migrate._reverse import port_for_compare
  from parity.pipeline.resolve import resolve
  from parity.spec import SpecError
  raw = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 0},
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "fp16": {"enabled": True}}
  with pytest.raises(SpecError, match=r"at ZeRO stage 0.*Fix: set zero_optimization.stage to 1"):
    port_for_compare(raw, resolve("gpt2-tiny"))

# --------------------------------------------------------------------------- every side, end to end

FP16_NOISE = 1e-3
"""Max |Δloss| (nats) between two fp16 sides over these 10-12-step gpt2-tiny runs. Measured: <= 1.1e-4
(DeepSpeed and the plain-torch side agree bit for bit on 6-7 of the steps, <= 4e-5 apart; JAX, which keeps
LayerNorm in float32, <= 1.1e-4 from either). The bound leaves ~10x room and stays far below one skipped or
extra update, which moves the loss of the next step by > 1e-2 here (two updates at lr <= 6.7e-4: 5.5e-2)."""


def _sides() -> list[str]:
  sides = ["jax", "torch"]
  if HAS_DEEPSPEED:
    sides.append("deepspeed")
  return sides


def test_a_skipped_step_with_an_infinite_grad_norm_is_not_a_failure(tmp_path):
  """DeepSpeed reports grad_norm inf on a step skipped for overflow; SideIO.record accepts it only then."""
  from parity.protocol import SideIO
  with open(tmp_path / "probe.jsonl", "w") as f:
    fake = types.SimpleNamespace(run=types.SimpleNamespace(train=types.SimpleNamespace(tokens_per_step=1)),
                                 _steps=f, _step_times=[], _step_loss_tokens=[], steps_done=0,
                                 loss_tokens=lambda step: 1)
    kw = dict(loss=1.0, grad_norm=float("inf"), lr=0.0, step_time_s=0.0, loss_scale=2.0)
    assert SideIO.record(fake, 0, skipped=True, **kw)
    assert not SideIO.record(fake, 1, skipped=False, **kw)
    assert not SideIO.record(fake, 2, skipped=True, **{**kw, "loss": float("nan")})


def _run_fp16(tmp_path, *, steps: int, overrides: list[str], forced: list[int]) -> tuple[object, dict[str, list]]:
  """gpt2-tiny in fp16 on every side with overflows forced at `forced`; returns (spec, records per side)."""
  from harness.runner import run_side
  from parity.protocol import read_steps
  from parity.pipeline.folder import prepare_run_dir
  from parity.pipeline.resolve import resolve
  sides = _sides()
  spec = resolve("gpt2-tiny", steps=steps, sides=sides,
                 overrides=['train.precision="fp16"', "train.eval_every=0", *overrides])
  perturb = {side: {"overflow_at_steps": forced} for side in sides} if forced else {}
  prepare_run_dir(spec, tmp_path, perturb=perturb)
  records = {}
  for side in sides:
    res = run_side(tmp_path, side, timeout_s=600)
    assert res.status == "ok", f"{side}: {res.status}: {res.error or res.summary.get('error')}"
    records[side] = read_steps(tmp_path / side / "steps.jsonl")
    assert len(records[side]) == steps, side
  return spec, records


def _check_scaling(spec, records: dict[str, list], overflows: list[bool]) -> None:
  """Every side: skipped == overflows, scales == parity.numerics.loss_scale's prediction, lr frozen on skips, losses
  close."""
  from parity.numerics import schedule
  want_scales = predict_scales(spec.train, overflows)
  applied = [sum(not o for o in overflows[:k]) for k in range(len(overflows))]
  want_lr = [schedule.train_lr(spec.train, a) for a in applied]
  for side, recs in records.items():
    assert [r["skipped"] for r in recs] == overflows, side
    assert [r["loss_scale"] for r in recs] == want_scales, side
    assert all(math.isinf(r["grad_norm"]) == r["skipped"] for r in recs), side
    assert [r["lr"] for r in recs] == pytest.approx(want_lr, rel=1e-6, abs=1e-12), side
  ref = records["jax"]
  for side, recs in records.items():
    worst = max(abs(a["loss"] - b["loss"]) for a, b in zip(ref, recs))
    assert worst <= FP16_NOISE, f"jax vs {side}: max |dloss| {worst:.2e} > {FP16_NOISE}"


@pytest.mark.process
@pytest.mark.requires_deepspeed
@pytest.mark.slow
@requires_jax
@requires_torch
def test_forced_overflows_skip_the_same_steps_on_every_side(tmp_path):
  # hysteresis 2: the overflow at step 2 only uses up the hysteresis, 3 and 4 halve; window 3 doubles after
  # 3 clean steps following the last overflow (step 8), and step 10's overflow halves again.
  forced = [2, 3, 4, 10]
  spec, records = _run_fp16(tmp_path, steps=12, forced=forced,
                            overrides=["train.initial_scale_power=12", "train.loss_scale_window=3"])
  overflows = [k in forced for k in range(12)]
  _check_scaling(spec, records, overflows)
  assert len(set(predict_scales(spec.train, overflows))) >= 3  # halvings and a doubling were exercised


@pytest.mark.process
@pytest.mark.requires_deepspeed
@pytest.mark.slow
@requires_jax
@requires_torch
def test_natural_overflows_at_a_too_large_initial_scale(tmp_path):
  # 2**18 times the loss overflows fp16 activation gradients (max 65504) on this text; the sides must find that
  # out at the same steps, back off by the same rule, and then train.
  spec, records = _run_fp16(tmp_path, steps=10, forced=[], overrides=["train.initial_scale_power=18"])
  overflows = [r["skipped"] for r in records["jax"]]
  assert overflows[0] and not all(overflows), overflows
  _check_scaling(spec, records, overflows)


@requires_deepspeed
def test_engine_refuses_fp16_at_stage0_and_a_precision_mismatch():
  from parity.pipeline.resolve import resolve
  from parity.weights import init_params
  from torch_impl.engine import MSG_FP16_STAGE0, build_engine, ds_config
  spec = resolve("gpt2-tiny", overrides=['train.precision="fp16"', "deepspeed.zero_stage=0",
                                         'deepspeed.offload_optimizer="none"'])
  params = init_params(spec.model, 0)
  with pytest.raises(ValueError, match="deepspeed.zero_stage >= 1") as err:
    build_engine(spec, params)
  assert str(err.value) == MSG_FP16_STAGE0
  fp32 = resolve("gpt2-tiny")
  with pytest.raises(RuntimeError, match="fp16.enabled=True but train.precision='fp32'"):
    build_engine(fp32, params, {**ds_config(fp32), "fp16": {"enabled": True}})
