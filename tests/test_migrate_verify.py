"""parity port --verify against the installed DeepSpeed: every scheduler type and the optimizer families.

Slow: each case starts a DeepSpeed subprocess (torch_impl.port_verify) and a JAX one (jax_impl.port_verify);
torch and jax never share a process.
"""
from __future__ import annotations

import importlib.util
import re

import pytest

from parity.migrate import Flags, port_config
from parity.migrate.verify import verify

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.requires_deepspeed, pytest.mark.requires_jax,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None
                                 or importlib.util.find_spec("jax") is None, reason="needs deepspeed and jax")]

STEPS = 30
BATCH = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0}
CASES = {
    "warmup_log_default_max": {"optimizer": {"type": "Adam", "params": {"lr": 2e-3, "weight_decay": 0.1}},
                               "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 7}}},
    "warmup_linear_one_step": {"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False,
                                                                        "weight_decay": 0.05}},
                               "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5,
                                                                            "warmup_max_lr": 1e-3,
                                                                            "warmup_num_steps": 1,
                                                                            "warmup_type": "linear"}}},
    "warmup_decay_total_eq_warmup": {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 12, "warmup_num_steps": 12,
                                                          "warmup_max_lr": 1e-3, "warmup_type": "linear"}}},
    "warmup_cosine_zero2_offload": {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.8, 0.99], "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 25, "warmup_num_steps": 5,
                                                           "warmup_min_ratio": 0.1}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    "one_cycle_momentum_stairs_fp16_zero1": {  # fp16 exercised: the scale halves after 2 overflows, grows every 4
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "fp16": {"enabled": True, "hysteresis": 2, "loss_scale_window": 4}, "zero_optimization": {"stage": 1},
        "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3,
                                                     "cycle_first_step_size": 6, "cycle_second_step_size": 4,
                                                     "cycle_first_stair_count": 3, "decay_step_size": 3,
                                                     "decay_lr_rate": 0.2, "decay_mom_rate": 0.1}}},
    "lr_range_test_sgd_momentum": {
        "optimizer": {"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9, "weight_decay": 1e-3}},
        "scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 4,
                                                        "lr_range_test_staircase": True}}},
    "lamb_constant_schedule_only": {"optimizer": {"type": "Lamb", "params": {"lr": 1e-2, "weight_decay": 0.01,
                                                                             "max_coeff": 0.5}}},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_verify_against_deepspeed(name):
  r = port_config({**BATCH, **CASES[name]}, Flags(), source=name)
  assert r.ported is not None, r.report.errors
  out = verify(r, steps=STEPS)
  assert out.ok, out.summary()
  assert out.lr_max_rel <= 1e-12
  if name.startswith("lamb"):
    assert out.mode == "schedule"  # FusedLamb is CUDA-only: optimizer checked against the numpy reference
  else:
    assert out.mode == "engine" and out.params_max_ulp_ratio <= 1
  if "fp16" in name:  # fp16 is run, not disabled; scale and skips equal at every step
    skipped = re.search(r"fp16 with (\d+) of \d+ steps skipped on overflow", out.notes[-1])
    assert out.scale_steps == STEPS and skipped and int(skipped.group(1)) > 0, out.notes
    head = out.summary().splitlines()[0]  # what the 30 steps never hit is named, nothing else
    assert "NOT exercised: fp16.consecutive_hysteresis False" in head and "fp16.min_loss_scale 1.0" in head, head
    assert "fp16.hysteresis" not in head and "loss_scale_window" not in head and "overflow skip" not in head, head


def test_fp16_at_stage0_runs_what_the_port_refusal_says():
  """The measurement behind parity.migrate._port.MSG_FP16_STAGE0: DeepSpeed 0.19.8's stage-0 FP16_Optimizer, run on
  the verify probe, equals (to the fp32 bound) an AdamW fed gradient / scale with the scale doubling every window,
  the clip on ||g|| / scale, and one zero-gradient step at construction; no step overflows at scale 2**16."""
  import tempfile
  from pathlib import Path
  import numpy as np
  from parity.migrate import reference
  from parity.migrate.verify import SHAPES, _run, _ulp_ratio, _update_rel_rounding
  from parity.numerics.loss_scale import LossScaler
  from parity.protocol.workers import worker_module
  opt = {"type": "adamw", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1,
                                     "bias_correction": True}}
  cfg = {**BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
         "fp16": {"enabled": True, "hysteresis": 2, "loss_scale_window": 4}, "steps_per_print": 10 ** 9}
  assert port_config(cfg, Flags()).ported is None  # refused
  with tempfile.TemporaryDirectory() as tmp:
    ds = _run(worker_module("deepspeed", "port_verify"), {"ds_config": cfg, "steps": STEPS, "seed": 0,
                                                          "shapes": SHAPES, "base_lr": 1e-3}, Path(tmp), "ds", 900)
  rng = np.random.default_rng(0)
  params = [rng.standard_normal(s).astype(np.float16).astype(np.float32) for s in SHAPES]
  grads = rng.standard_normal((STEPS, sum(int(np.prod(s)) for s in SHAPES))).astype(np.float32)
  sizes = np.cumsum([p.size for p in params])[:-1]
  state, scaler = {}, LossScaler(scale=2.0 ** 16, window=4, hysteresis=1, raise_at_min=False)
  ps = reference.numpy_update(opt, params, [np.zeros_like(p) for p in params], state, lr=1e-3, max_norm=1.0)
  out, scales = [], []
  for t in range(STEPS):
    scales.append(scaler.scale)
    scaler.update(False)  # the loss is never scaled, so nothing overflows
    g = [a.reshape(p.shape).astype(np.float16).astype(np.float32) / np.float32(scaler.scale)
         for a, p in zip(np.split(grads[t], sizes), params)]
    ps = reference.numpy_update(opt, ps, g, state, lr=1e-3, max_norm=1.0)
    out.append(np.concatenate([p.reshape(-1) for p in ps]))
  assert not ds["skipped"].any() and list(ds["scale"]) == scales and scales[-1] > scales[0]
  p0 = np.concatenate([p.reshape(-1) for p in params])
  assert _ulp_ratio(p0, ds["params"], np.stack(out), _update_rel_rounding(opt, STEPS)) <= 1
