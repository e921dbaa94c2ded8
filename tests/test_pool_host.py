"""XLA's pinned-host pool against a host smaller than its 64 GiB default: the planner's rule and its row agree.

Before, `parity plan --model llama-1b --host-memory 32` refused every JAX offload pair (1.4-24.7 GiB of pinned host)
because the default 64 GiB pool could outgrow the 32 GiB host, while the same row's pool said `fits: true`. Now
parity sets the pool to the rule's size there (it holds the need with its headroom and fits the host), and the row's
`fits` is the very test that refuses. On a TPU there is no such pool (tests/test_plans_tpu.py)."""
from __future__ import annotations

import dataclasses

import pytest

from harness import env as henv
from parity.hf import MODEL_PRESETS
from parity.sizing import host_limits as hl
from parity.sizing import plans, resources
from parity.spec import RunSpec, TrainSpec

GiB = 2**30
VAR = hl.XLA_POOL_ENV
TRAIN = TrainSpec(micro_batch_size=1, seq_len=2048, precision="bf16")


def _ranked(model: str, host_gib: float, **kw) -> dict:
  _, ranked = plans.choose_plan(MODEL_PRESETS[model], TRAIN, plans.HARDWARE["H100"], host_bytes=int(host_gib * GiB),
                                **kw)
  return {c.name: c for c in ranked}


def test_a_small_host_takes_the_offload_pairs_whose_need_fits_it():
  rows = _ranked("llama-1b", 32)
  for name in ("zero3-act-offload", "zero2-offload", "act-offload", "zero3-offload-all", "scan-offload"):
    c = rows[name]
    need = c.jax_pool["need_bytes"]
    assert 1.4 * GiB <= need <= 24.7 * GiB, (name, need / GiB)
    assert c.fits and c.jax_pool["fits"], (name, c.problems)
    assert c.jax_pool["set_by"] == "parity" and need * hl.POOL_HEADROOM <= c.jax_pool["gib"] * GiB <= 32 * GiB
    assert "default pool > 32.0 GiB host memory per device" in c.jax_pool["statement"]


@pytest.mark.parametrize("model", ["llama-1b", "llama-3.2-3b", "llama-7b"])
@pytest.mark.parametrize("host_gib", [8, 16, 24, 32, 48, 63, 64, 100, 150, 512])
@pytest.mark.parametrize("user", [None, 16, 100])
def test_the_row_and_the_rule_agree_on_every_host(model, host_gib, user):
  """On every row: jax_pool.fits is False exactly when a pool problem refuses the pair, and a pair is refused for its
  pool only when no pool holds its need with the headroom within the host (or the user's pool is short)."""
  for c in _ranked(model, host_gib, xla_pool_gib=user).values():
    pool = c.jax_pool
    if pool is None:
      continue
    refused = [p for p in c.problems if "pool" in p]
    need = pool["need_bytes"]
    assert pool["fits"] == (hl.pool_problem(hl.pool_decision(need, user, host_gib * GiB), host_gib * GiB) is None)
    if pool["fits"]:
      assert not refused, (c.name, refused)
    elif need <= host_gib * GiB:  # a need the host holds is refused only when its pool cannot be placed
      assert refused, (c.name, pool)
    if user is None and need * hl.POOL_HEADROOM <= host_gib * GiB:
      assert pool["fits"], (c.name, pool)


def test_the_whole_gib_pool_where_the_16_gib_step_would_pass_the_host():
  d = hl.pool_decision(int(17 * GiB), None, 20 * GiB)
  assert d.parity_gib == 18 and d.fits  # ceil(17 x 1.05) = 18 GiB; the 16 GiB step's 32 would not fit
  assert hl.pool_decision(int(19.5 * GiB), None, 20 * GiB).fits is False  # 20.5 GiB with the headroom: no pool
  assert hl.pool_decision(int(9 * GiB), None, None).parity_gib is None  # host unknown: XLA's default, as before
  assert hl.pool_decision(int(9 * GiB), 48, 32 * GiB).fits is False  # a user's pool is kept, and said not to fit


def test_the_resource_check_and_the_worker_get_the_same_pool_on_a_small_gpu_host(monkeypatch):
  base = RunSpec(model=MODEL_PRESETS["llama-1b"], train=TRAIN, sides=("jax", "deepspeed"))
  plan = plans.PLANS["zero2-offload"]
  run = dataclasses.replace(base, deepspeed=plan.deepspeed, jax=plan.jax)
  checked = resources.check_host_pool(run, available=32 * GiB, gpu=True, environ={})
  assert checked.set_by == "parity" and checked.gib == 16 and checked.fits
  monkeypatch.setattr(hl, "host_bytes_per_device", lambda spec: 32 * GiB)
  env: dict[str, str] = {}
  choice = henv.host_pool_environ(env, run, gpu=True)
  assert env[VAR] == "16" and choice["gib"] == checked.gib
  cpu: dict[str, str] = {}
  assert henv.host_pool_environ(cpu, run, gpu=False)["set_by"] == "default" and VAR not in cpu  # not read on CPU
