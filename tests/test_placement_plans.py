"""Every JAX plan of parity.sizing.plans.PLANS, compiled: where its step keeps params, optimizer state and the remat
policy's residuals (jax_impl.placement.placement_record), asserted from the compiled program, so a JAX upgrade that
changes a plan's placement or an offload policy's meaning fails. The plans without
scan_layers or an offload policy are here, the others in test_placement_plans_scan.py (tests/placement_cases.py)."""
from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

from parity.sizing.plans import PLANS  # noqa: E402

from jax_impl.offload import make_placement  # noqa: E402

from placement_cases import (EXPECT, EXTRA, GROUPS, JAX_PLANS, ON_MESH, assert_placement,  # noqa: E402
                             assert_residual_moves, compile_records)

NAMES = sorted(GROUPS[0])


@pytest.fixture(scope="module")
def records() -> dict[str, dict]:
  return compile_records(NAMES)


def test_every_plan_is_covered():
  assert set(JAX_PLANS) | ON_MESH == set(PLANS) | set(EXTRA) == set(EXPECT) | ON_MESH
  assert GROUPS[0] | GROUPS[1] == set(JAX_PLANS) and not GROUPS[0] & GROUPS[1]


def test_one_device_shards_nothing_so_the_stage_does_not_change_the_program():
  for plan in JAX_PLANS.values():
    placement = make_placement(plan)
    assert not any(placement.sharded(g) for g in ("params", "opt_state", "grads")), plan


@pytest.mark.parametrize("name", NAMES)
def test_placement_of_every_plan_from_the_compiled_program(records, name):
  assert_placement(records[name], name)
  assert_residual_moves(records[name], name)


def test_the_record_names_its_jax_and_remat3_and_cpu_shows_no_copies(records):
  rec = records["zero2-offload"]
  assert rec["versions"] == {"jax": jax.__version__, "jaxlib": __import__("jaxlib").__version__}
  assert rec["jax_remat3"] is getattr(jax.config, "jax_remat3", None)
  assert rec["schema"] == "parity.placement/1" and rec["run_id"] == "r1" and rec["backend"] == "cpu"
  t = rec["transfers"]
  assert t["known"] is False and t["copies"] == [] and t["host_compute"] == []
  assert t["why_not"].startswith("CPU backend:") and "0 instruction results" in t["why_not"]
  opt = next(r for r in rec["classes"] if r["class"] == "opt_state" and r["role"] == "argument")
  assert rec["bytes_per_step"]["h2d"] == opt["host_bytes"] > 0
  assert rec["bytes_per_step"]["source"] == "entry layout host buffers"
  ma = rec["memory_analysis"]
  assert set(ma) == {"device", "host", "note"} and ma["device"]["argument_bytes"] > 0
  assert all(v == 0 for v in ma["host"].values()) and "equal to the" in ma["note"]
