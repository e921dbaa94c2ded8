"""parity port --verify against the installed DeepSpeed: every scheduler type and the optimizer families.

Slow: each case starts a DeepSpeed subprocess (torch_impl.port_verify) and a JAX one (jax_impl.port_verify);
torch and jax never share a process.
"""
from __future__ import annotations

import importlib.util

import pytest

from parity.migrate import Flags, port_config
from parity.migrate.verify import verify

pytestmark = [pytest.mark.slow, pytest.mark.requires_deepspeed, pytest.mark.requires_jax,
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
    "one_cycle_momentum_stairs": {
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
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
