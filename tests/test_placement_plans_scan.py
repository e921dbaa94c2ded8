"""The compiled placement of the JAX plans with scan_layers or an activation-offload policy (the other half of
test_placement_plans.py; tests/placement_cases.py), and the placement check of a correct run passing."""
from __future__ import annotations

import pytest

pytest.importorskip("jax")

from parity.verdict.placement import placement_check

from placement_cases import GROUPS, assert_placement, assert_residual_moves, compile_records

NAMES = sorted(GROUPS[1])


@pytest.fixture(scope="module")
def records() -> dict[str, dict]:
  return compile_records(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_placement_of_every_plan_from_the_compiled_program(records, name):
  assert_placement(records[name], name)
  assert_residual_moves(records[name], name)


@pytest.mark.parametrize("name", ["scan-offload", "act-offload"])
def test_a_correct_run_passes_the_placement_check(records, name):
  c = placement_check("jax", {"record": records[name], "problem": None}, "ok")
  assert c.passed and c.sides == ("jax",) and c.first_failing_step is None and c.value == 0
  assert "every tensor class where the plan puts it" in c.detail and "opt_state pinned_host" in c.detail
  assert ("activations pinned_host" in c.detail) == (name == "act-offload")
