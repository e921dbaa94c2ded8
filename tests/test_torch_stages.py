"""Every DeepSpeed plan of parity.sizing.plans through the worker, with loss parity vs the plain-torch baseline.

gpt2-tiny, 3 steps, one rank. Each plan is also checked for what it built (`optimizer` in summary.json,
written by `torch_impl.engine.optimizer_classes`; `_check_engine` already refused a mismatch) and for its
measured state bytes against parity.sizing.memory's prediction.
"""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from parity.sizing import memory

from parity.sizing import plans
from parity.protocol import read_steps, read_summary
from parity.spec import RunSpec
from parity.verdict.tolerances import tolerance
from test_torch_engine import make_run_dir, run_worker, tiny_run

pytestmark = [pytest.mark.requires_deepspeed, pytest.mark.slow]
LOSS_ATOL_FP32 = tolerance("fp32", "loss").atol
DS_PLANS = {}
for _name, _plan in plans.PLANS.items():  # one run per distinct DeepSpeed plan
  DS_PLANS.setdefault(_plan.deepspeed, _name)
# Measured state bytes vs parity.sizing.memory, ratio bounds. params, master copy and moments are predicted exactly;
# gradients within 15% (DeepSpeed's reduction buckets and in-flight module gradients).
EXACT = ("params", "master_params", "optimizer_moments")
GRAD_RATIO = (0.85, 1.15)


def _losses(request: Path, side: str) -> list[float]:
  return [s["loss"] for s in read_steps(request.parent / side / "steps.jsonl")]


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
  """Plain-torch losses per grad_accum_steps (1 and 2)."""
  out = {}
  for gas in (1, 2):
    run = tiny_run(steps=3, grad_accum_steps=gas)
    req = make_run_dir(tmp_path_factory.mktemp(f"torch{gas}"), run)
    proc = run_worker(req, "torch")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out[gas] = _losses(req, "torch")
  return out


def _run_plan(tmp_path: Path, name: str, gas: int) -> tuple[RunSpec, Path, dict]:
  run = plans.apply_plan(tiny_run(steps=3, grad_accum_steps=gas), name)
  req = make_run_dir(tmp_path, run)
  proc = run_worker(req, "deepspeed")
  assert proc.returncode == 0, proc.stderr[-3000:]
  return run, req, read_summary(req.parent / "deepspeed" / "summary.json")


@pytest.mark.process
@pytest.mark.parametrize("name, gas", [(n, 1) for n in DS_PLANS.values()] + [("zero2-offload", 2), ("zero3", 2)])
def test_plan_loss_parity_and_build(tmp_path, baselines, name, gas):
  run, req, summary = _run_plan(tmp_path, name, gas)
  plan = run.deepspeed
  got, want = _losses(req, "deepspeed"), baselines[gas]
  assert len(got) == len(want) == 3
  diffs = [abs(a - b) for a, b in zip(got, want)]
  assert max(diffs) < LOSS_ATOL_FP32, f"{name} GAS {gas}: |dloss| {diffs} (>= {LOSS_ATOL_FP32})"
  built = summary["optimizer"]
  assert built["zero_stage"] == plan.zero_stage and built["cpu_offload"] == (plan.offload_optimizer == "cpu")
  assert built["offload_param"] == (plan.offload_param == "cpu")
  assert built["activation_checkpointing"] == plan.activation_checkpointing
  assert built["gradient_accumulation_steps"] == gas
  assert built["optimizer"] == ("DeepSpeedCPUAdam" if plan.offload_optimizer == "cpu" else "FusedAdam")
  _check_memory(run, summary)


def _check_memory(run: RunSpec, summary: dict) -> None:
  measured = summary["state_bytes_by_category"]
  predicted = memory.totals(memory.estimate(run, sides=("deepspeed",)), "deepspeed")
  for cat in EXACT:
    assert measured[cat] == predicted[cat], f"{cat}: measured {measured[cat]} != predicted {predicted[cat]}"
  for kind in memory.KINDS:
    m, p = measured["gradients"][kind], predicted["gradients"][kind]
    assert (m == p == 0) or (p and GRAD_RATIO[0] <= m / p <= GRAD_RATIO[1]), f"gradients {kind}: {m} vs {p}"
  assert summary["peak_host_rss_bytes"] > 0 and sum(summary["state_bytes_by_memory_kind"].values()) > 0
