"""The verdict grid measured with JAX on a TPU v5e and PyTorch on the VM's host CPU, judged again on CPU by today's
rules from the records it left (tests/data/tpu_v5e/grid, SOURCE.md there; the run: benchmarks/results/
2026-12-06-tpu-v5e-matrix.md). 5 families x fp32/bf16 x zero2-offload/scan-offload/act-offload must PASS, and each
plant of the plant table must FAIL, through the same functions the verdict calls: the placement check, the semantics
card diff, in fp32 the cross-backend rule (each metric within the table plus the JAX side's measured shift against
its own rerun on the host CPU, and the shift bounded itself), in bf16 the noise envelope. A rule tightened until a
correct chip run fails, or loosened until a plant passes, fails here."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from parity.protocol.layout import read_steps
from parity.semantics import diff_cards
from parity.verdict.backend import BACKEND_METRICS, backend_pair_check, backend_shift_check, shifts
from parity.verdict.envelope import ENVELOPE_METRICS, envelope_check, rerun_differences
from parity.verdict.placement import placement_check
from parity.verdict.steps import steps_by_index
from parity.verdict.tolerances import envelope_rule, tolerance

GRID = Path(__file__).parent / "data" / "tpu_v5e" / "grid"
FAMILIES = ("gpt2", "llama3", "qwen3", "gemma3", "mistral")
PLANS = ("zero2-offload", "scan-offload", "act-offload")
CELLS = [f"{f}-{p}-{plan}" for f in FAMILIES for p in ("fp32", "bf16") for plan in PLANS]
CARD_PLANTS = {  # plant -> the card item it changes
  "plant-norm-eps": "norm.eps", "plant-qk-norm-eps": "attention.qk_norm_eps", "plant-gelu": "mlp.gelu_form",
  "plant-rope-scaling": "rotary.per_layer", "plant-sliding-window": "attention.window",
  "plant-softcap": "attention.softcap", "plant-decay-biases": "optimizer.decay_set",
}
LOSS_PLANTS = ("plant-lr", "plant-adam-eps", "plant-labels-shifted", "plant-loss-on-prompt", "plant-positions",
               "plant-mask-dropped")


def _steps(cell: str, rel: str) -> list[dict]:
  return read_steps(GRID / cell / rel)


def _json(cell: str, rel: str) -> dict:
  return json.loads((GRID / cell / rel).read_text())


def _precision(cell: str) -> str:
  return _json(cell, "request.json")["run"]["train"]["precision"]


def _backend_checks(cell: str) -> list:
  """The fp32 cross-backend checks of a cell, as parity.pipeline.reruns.backend_result builds them."""
  jax, torch, on_cpu = _steps(cell, "jax/steps.jsonl"), _steps(cell, "torch/steps.jsonl"), \
      _steps(cell, "backend/jax/steps.jsonl")
  shift = shifts(jax, on_cpu)
  checks = []
  for m in BACKEND_METRICS:
    checks.append(backend_shift_check("jax", "TPU", shift[m], "fp32", m, steps_by_index(jax, m)))
    checks.append(backend_pair_check(m, "jax", jax, "torch", torch, {"jax": shift[m]}, "fp32"))
  return [c for c in checks if c is not None]


def _envelope_checks(cell: str) -> list:
  main = {s: _steps(cell, f"{s}/steps.jsonl") for s in ("jax", "torch")}
  noise: dict[str, dict] = {m: {} for m in ENVELOPE_METRICS}
  for s in main:
    for m, d in rerun_differences(main[s], _steps(cell, f"noise/{s}/steps.jsonl")).items():
      noise[m][s] = d
  rule = envelope_rule(_precision(cell))
  out = [envelope_check("jax", main["jax"], "torch", main["torch"], noise[m], rule, m) for m in ENVELOPE_METRICS]
  return [c for c in out if c is not None]


def test_the_grid_is_whole_and_ran_on_the_chip():
  assert sorted(p.name for p in GRID.iterdir() if not p.name.startswith("plant-")) == sorted(CELLS)
  for cell in CELLS:
    assert _json(cell, "jax/placement.json")["backend"] == "tpu", cell
    assert _precision(cell) == cell.split("-")[1]


@pytest.mark.parametrize("cell", CELLS)
def test_a_correct_cell_passes_every_recomputed_check(cell):
  jax = _steps(cell, "jax/steps.jsonl")
  assert len(jax) == 16 and len(_steps(cell, "torch/steps.jsonl")) == 16
  assert diff_cards(_json(cell, "jax/semantics.json"), _json(cell, "torch/semantics.json")) == []
  place = placement_check("jax", {"record": _json(cell, "jax/placement.json"), "problem": None}, "ok")
  assert place.passed, place.detail
  checks = _backend_checks(cell) if _precision(cell) == "fp32" else _envelope_checks(cell)
  assert len(checks) >= 3, [c.name for c in checks]  # loss, grad_norm, val_loss (and in fp32 their shifts)
  failed = [f"{c.name}: {c.detail}" for c in checks if not c.passed]
  assert not failed, failed


def test_the_fp32_table_alone_would_fail_correct_chip_runs():
  """Why the cross-backend rule exists: on the chip the pointwise fp32 loss bound (measured CPU against CPU) is
  exceeded by correct runs, which the table plus the measured shift passes."""
  tol = tolerance("fp32", "loss")
  over = []
  for cell in (c for c in CELLS if "-fp32-" in c):
    a = steps_by_index(_steps(cell, "jax/steps.jsonl"), "loss")
    b = steps_by_index(_steps(cell, "torch/steps.jsonl"), "loss")
    if any(abs(a[k] - b[k]) > tol.atol + tol.rtol * abs(a[k]) for k in a):
      over.append(cell)
  assert len(over) >= 3, over


@pytest.mark.parametrize("plant, item", sorted(CARD_PLANTS.items()))
def test_a_card_plant_on_the_chip_is_named_by_the_card(plant, item):
  diffs = diff_cards(_json(plant, "jax/semantics.json"), _json(plant, "torch/semantics.json"))
  assert item in [k for k, _, _ in diffs], diffs


@pytest.mark.parametrize("plant", LOSS_PLANTS)
def test_a_training_plant_on_the_chip_fails_the_cross_backend_rule(plant):
  assert _precision(plant) == "fp32"
  failed = [c.name for c in _backend_checks(plant) if not c.passed]
  assert any(n.startswith(("loss_backend", "grad_norm_backend")) for n in failed), failed


def test_a_planted_placement_on_the_chip_fails():
  check = placement_check("jax", {"record": _json("plant-placement", "jax/placement.json"), "problem": None}, "ok")
  assert not check.passed and check.value > 0, check.detail
