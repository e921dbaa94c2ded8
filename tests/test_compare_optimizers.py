"""Compare runs every optimizer and scheduler `parity port` accepts.

Fast tests check the one JAX factory (jax_impl.optim.optimizer_update) and the one torch builder
(torch_impl.baseline.build_optimizer) against the float64 DeepSpeed reference (parity.migrate.reference), and the
port -> RunSpec mapping (OneCycle with and without momentum cycling, Adam L2, SGD, Lamb, ZeRO-3 sharding). The
compare tests run gpt2-tiny for a few steps on the JAX and torch sides: each reaches PASS, and a planted
difference in one optimizer hyper-parameter FAILs.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from conftest import requires_jax, requires_torch
from parity.numerics import schedule
from parity.migrate.reference import numpy_update
from parity.presets import preset
from parity.spec import SpecError, TrainSpec

ONECYCLE = {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 3, "cycle_min_mom": 0.8,
            "cycle_max_mom": 0.9}
CASES = [  # (train overrides, what it exercises)
    ({"optimizer": "adamw"}, "AdamW"),
    ({"optimizer": "adam"}, "Adam with L2 (adam_w_mode false)"),
    ({"optimizer": "lamb"}, "Lamb"),
    ({"optimizer": "sgd", "momentum": 0.9}, "SGD with momentum"),
    ({"optimizer": "sgd", "momentum": 0.9, "nesterov": True}, "SGD, Nesterov"),
    ({"optimizer": "sgd", "momentum": 0.5, "dampening": 0.3}, "SGD, dampening"),
    ({"optimizer": "sgd"}, "SGD without momentum"),
    ({"optimizer": "adamw", "lr_schedule": "OneCycle", "lr_schedule_params": ONECYCLE}, "AdamW, OneCycle cycling"),
    ({"optimizer": "lamb", "lr_schedule": "OneCycle", "lr_schedule_params": ONECYCLE}, "Lamb, OneCycle cycling"),
    ({"optimizer": "adam", "lr_schedule": "OneCycle", "lr_schedule_params": {**ONECYCLE, "cycle_momentum": False}},
     "Adam, OneCycle without cycling"),
]
# float32 arithmetic against the float64 reference over 6 steps of O(1) params and updates of size ~lr (1e-3):
# each step rounds at ~1 ulp of |p| (6e-8), so 6 steps stay below 1e-6; a wrong formula moves p by ~lr * 1e-1.
REF_ATOL = 1e-6


def _train(**kw) -> TrainSpec:
  return dataclasses.replace(TrainSpec(steps=6, lr=1e-3, weight_decay=0.1, grad_clip=0.0), **kw).validate()


def _draws(steps: int = 6):
  rng = np.random.default_rng(7)
  params = [rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal((6,)).astype(np.float32)]
  grads = [[rng.standard_normal(p.shape).astype(np.float32) for p in params] for _ in range(steps)]
  return params, grads


def _reference(t: TrainSpec, params, grads):
  opt, state, ref = schedule.optimizer_of(t), {}, [p.astype(np.float64) for p in params]
  out = []
  for k, g in enumerate(grads):
    b1, b2 = schedule.train_betas(t, k)
    o = opt if opt["type"] == "sgd" else {**opt, "params": {**opt["params"], "betas": [b1, b2]}}
    ref = numpy_update(o, ref, g, state, lr=schedule.train_lr(t, k))
    out.append(ref)
  return out


@requires_jax
@pytest.mark.parametrize("kw, what", CASES, ids=[c[1] for c in CASES])
def test_jax_factory_matches_deepspeed_reference(kw, what):
  import jax.numpy as jnp
  import optax
  from jax_impl import optim
  t = _train(**kw)
  params, grads = _draws()
  cyc = schedule.cycles_momentum(t)
  tx = optim.optimizer_update(schedule.optimizer_of(t), lambda c: jnp.asarray(schedule.train_lr(t, int(c)),
                                                                                jnp.float32),
                              b1_fn=(lambda c: jnp.float32(schedule.train_betas(t, int(c))[0])) if cyc else None,
                              b2=0.99 if cyc else None)
  p = [jnp.asarray(x) for x in params]
  st = tx.init(p)
  for k, (g, want) in enumerate(zip(grads, _reference(t, params, grads))):
    u, st = tx.update([jnp.asarray(x) for x in g], st, p)
    p = optax.apply_updates(p, u)
    err = max(float(np.max(np.abs(np.asarray(a, np.float64) - b))) for a, b in zip(p, want))
    assert err < REF_ATOL, f"{what}: step {k} differs from DeepSpeed's formula by {err}"
  assert int(optim.step_count_of(st)) == len(grads)


@requires_torch
@pytest.mark.parametrize("kw, what", CASES, ids=[c[1] for c in CASES])
def test_torch_builder_matches_deepspeed_reference(kw, what):
  import torch
  from torch_impl.baseline import build_optimizer
  t = _train(**kw)
  params, grads = _draws()
  ps = [torch.nn.Parameter(torch.from_numpy(x.copy())) for x in params]
  opt = build_optimizer([{"params": ps, "weight_decay": t.weight_decay}], t)
  for k, (g, want) in enumerate(zip(grads, _reference(t, params, grads))):
    for group in opt.param_groups:  # what TorchTrainer._set_hparams writes each step
      group["lr"] = schedule.train_lr(t, k)
      if schedule.cycles_momentum(t):
        group["betas"] = schedule.train_betas(t, k)
    for p, x in zip(ps, g):
      p.grad = torch.from_numpy(x.copy())
    opt.step()
    err = max(float(np.max(np.abs(p.detach().double().numpy() - b))) for p, b in zip(ps, want))
    assert err < REF_ATOL, f"{what}: step {k} differs from DeepSpeed's formula by {err}"


def test_sgd_ignores_onecycle_momentum_as_deepspeed_does():
  """DeepSpeed disables the cycling for an optimizer without betas (SGD): beta schedule untouched."""
  t = _train(optimizer="sgd", momentum=0.9, lr_schedule="OneCycle", lr_schedule_params=ONECYCLE)
  assert not schedule.cycles_momentum(t)
  c = _train(optimizer="adamw", lr_schedule="OneCycle", lr_schedule_params=ONECYCLE)
  params = schedule.scheduler_params(c)[1]
  assert schedule.train_betas(c, 0) == (0.8, 0.99)  # DeepSpeed writes cycle_min_mom at construction
  assert schedule.train_betas(c, 1) == (schedule.momentum_at(params, 1), 0.99) != (0.8, 0.99)
  assert schedule.adam_beta2(c) == 0.99 and schedule.adam_beta2(_train()) == 0.95


def test_default_deepspeed_optimizer_block_is_unchanged():
  t = TrainSpec()
  assert schedule.deepspeed_optimizer(t) == {"type": "AdamW", "params": {
      "lr": t.lr, "betas": [t.beta1, t.beta2], "eps": t.eps, "weight_decay": t.weight_decay}}
  assert schedule.deepspeed_optimizer(_train(optimizer="adam"))["params"]["adam_w_mode"] is False
  assert schedule.deepspeed_optimizer(_train(optimizer="sgd", momentum=0.9))["type"] == "SGD"


@pytest.mark.parametrize("kw, needle", [
    ({"optimizer": "rmsprop"}, "train.optimizer 'rmsprop'"),
    ({"optimizer": "sgd", "momentum": 1.0}, "train.momentum must be in [0, 1)"),
    ({"optimizer": "sgd", "nesterov": True}, "train.nesterov needs train.momentum > 0"),
    ({"optimizer": "lamb", "lamb_min_coeff": 20.0}, "train.lamb_min_coeff must be in [0, train.lamb_max_coeff]"),
])
def test_bad_optimizer_fields_are_named(kw, needle):
  with pytest.raises(SpecError, match=".*".join(map(__import__("re").escape, needle.split("*")))):
    _train(**kw)


def _ds(optimizer: dict, scheduler: dict | None = None, stage: int = 2, offload: bool = False) -> dict:
  zero: dict = {"stage": stage}
  if offload:
    zero["offload_optimizer"] = {"device": "cpu"}
  cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "optimizer": optimizer,
         "gradient_clipping": 1.0, "zero_optimization": zero}
  if optimizer["type"] in ("SGD", "Lamb"):  # DeepSpeed asserts on these under ZeRO without it (the port says so)
    cfg["zero_allow_untested_optimizer"] = True
  if scheduler:
    cfg["scheduler"] = scheduler
  return cfg


PORTED = [
    ({"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.01, "adam_w_mode": False}}, None,
     {"optimizer": "adam", "weight_decay": 0.01}),
    ({"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}, None, {"optimizer": "adamw"}),
    ({"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}, None, {"optimizer": "sgd", "momentum": 0.9}),
    ({"type": "Lamb", "params": {"lr": 1e-3, "max_coeff": 5.0}}, None, {"optimizer": "lamb", "lamb_max_coeff": 5.0}),
    ({"type": "AdamW", "params": {"lr": 1e-3}}, {"type": "OneCycle", "params": {**ONECYCLE, "cycle_momentum": False}},
     {"lr_schedule": "OneCycle"}),
    ({"type": "AdamW", "params": {"lr": 1e-3}}, {"type": "OneCycle", "params": ONECYCLE}, {"lr_schedule": "OneCycle"}),
    ({"type": "AdamW", "params": {"lr": 1e-3}},
     {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 2}},
     {"lr_schedule": "LRRangeTest"}),
]


@pytest.mark.parametrize("opt, sched, want", PORTED, ids=[f"{o['type']}-{(s or {}).get('type', 'none')}"
                                                          for o, s, _ in PORTED])
def test_port_for_compare_maps_every_optimizer_and_scheduler(opt, sched, want):
  from parity.migrate._reverse import port_for_compare
  spec, ds, _ = port_for_compare(_ds(opt, sched), preset("gpt2-tiny"), source="t.json")
  for k, v in want.items():
    assert getattr(spec.train, k) == v, k
  assert ds["optimizer"]["type"] == opt["type"]


def test_port_refuses_what_compare_cannot_run_by_name():
  from parity.migrate._reverse import port_for_compare
  with pytest.raises(SpecError, match="bias_correction false"):
    port_for_compare(_ds({"type": "Lamb", "params": {"lr": 1e-3, "bias_correction": False}}), preset("gpt2-tiny"))


def test_ported_zero3_config_runs_jax_zero3_and_names_the_pair(tmp_path):
  from parity.sizing import plans
  from parity.migrate._reverse import port_for_compare
  spec, _, _ = port_for_compare(_ds({"type": "AdamW", "params": {"lr": 1e-3}}, stage=3), preset("gpt2-tiny"))
  assert spec.jax.zero_stage == 3 and spec.deepspeed.zero_stage == 3
  assert plans.plan_of(spec) == "zero3"
  spec2, _, _ = port_for_compare(_ds({"type": "AdamW", "params": {"lr": 1e-3}}, stage=2, offload=True),
                                 preset("gpt2-tiny"))
  assert plans.plan_of(spec2) == "zero2-offload"  # the default pair: its JaxPlan, named
  cfg = tmp_path / "ds.json"
  cfg.write_text(json.dumps(_ds({"type": "AdamW", "params": {"lr": 1e-3}}, stage=3)))
  from parity.pipeline.resolve import resolve_run
  run = resolve_run("gpt2-tiny", deepspeed_config=cfg, steps=4, sides=["jax", "torch"])
  assert run.spec.jax.zero_stage == 3 and run.plan["name"] == "zero3"


# ----------------------------------------------------------------------------- short jax~torch compares

COMPARES = [
    ({"train.optimizer": "sgd", "train.momentum": 0.9, "train.lr": 0.05, "train.lr_schedule": "WarmupLR",
      "train.lr_schedule_params": {"warmup_num_steps": 2, "warmup_type": "linear"}}, "torch:train.momentum=0.8"),
    ({"train.optimizer": "adam", "train.lr_schedule": "OneCycle", "train.lr_schedule_params": ONECYCLE},
     "torch:train.optimizer=adamw"),  # decoupled decay instead of L2 on one side
    ({"train.optimizer": "lamb", "train.lr_schedule": "OneCycle",
      "train.lr_schedule_params": {**ONECYCLE, "cycle_momentum": False}}, "torch:train.lamb_max_coeff=0.5"),
    ({"train.optimizer": "adamw", "train.lr_schedule": "WarmupDecayLR",
      "train.lr_schedule_params": {"total_num_steps": 6, "warmup_num_steps": 2, "warmup_max_lr": 1e-3}}, None),
]


@pytest.mark.process
@requires_jax
@requires_torch
@pytest.mark.parametrize("over, planted", COMPARES, ids=["sgd-momentum-WarmupLR", "adam-l2-OneCycle-cycling",
                                                         "lamb-OneCycle-no-cycling", "adamw-WarmupDecayLR"])
def test_short_compare_passes_and_planted_change_fails(tmp_path, over, planted):
  import parity
  kw = dict(steps=5, sides=["jax", "torch"], noise_envelope=False, determinism_steps=0)
  rep = parity.compare("gpt2-tiny", overrides=over, out=tmp_path / "ok", **kw)
  assert rep.passed and rep.exit_code == 0, rep.message
  moments = json.loads((tmp_path / "ok" / "report.json").read_text())
  assert moments  # the report was written
  if planted is None:
    return
  bad = parity.compare("gpt2-tiny", overrides=over, out=tmp_path / "bad", perturb=[planted], **kw)
  assert not bad.passed and bad.exit_code == 1, f"planted {planted} was not caught: {bad.message}"


def test_params_rule_for_sgd_and_lamb_is_per_tensor_with_zero_grad_slices_inside():
  """No Adam step bound holds for SGD or Lamb: their zero-gradient slices join the per-tensor rule, where a
  difference the Adam bound 2·Σlr would let through FAILs (a check that can fail), and rounding noise passes."""
  from parity.verdict.params import param_checks
  from parity.weights import init_params, zero_grad_slices
  model = preset("gpt2-tiny").model
  init = init_params(model, 0)
  rng = np.random.default_rng(0)
  a = {k: v + 1e-3 * rng.standard_normal(v.shape).astype(np.float32) for k, v in init.items()}
  name, (lo, hi) = next(iter(zero_grad_slices(model).items()))
  b = {k: v.copy() for k, v in a.items()}
  b[name][lo:hi] += 5e-4  # within 2·Σlr = 2e-3 (the Adam zero-grad bound), half a tensor's whole move
  lr_sum = 1e-3
  adam, _ = param_checks("jax", a, "torch", b, init, model, "fp32", lr_sum)
  assert {c.metric: c.passed for c in adam} == {"params": True, "params_zero_grad": True}
  other, table = param_checks("jax", a, "torch", b, init, model, "fp32", lr_sum, adam_updates=False)
  assert [c.metric for c in other] == ["params"] and not other[0].passed and "per-tensor" in other[0].detail
  noise = {k: v + np.float32(1e-9) * np.sign(v) for k, v in a.items()}
  ok, _ = param_checks("jax", a, "torch", noise, init, model, "fp32", lr_sum, adam_updates=False)
  assert ok[0].passed


def test_lamb_with_scan_layers_is_refused_before_running():
  from parity.overrides import apply_overrides
  with pytest.raises(SpecError, match="jax.scan_layers=false"):
    apply_overrides(preset("gpt2-tiny"), {"train.optimizer": "lamb", "jax.scan_layers": True}).validate()
