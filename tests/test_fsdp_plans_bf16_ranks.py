"""The FSDP2 plan pairs in bf16 on two ranks: jax~deepspeed~fsdp by the noise envelope, every side and its
perturbed rerun under torchrun / jax.distributed with 2 processes (each pair by the envelope in
bf16, with 1 and 2 ranks). One rank is tests/test_fsdp_plans_bf16.py. A file of its own so that pytest-xdist's
loadfile puts these compares on another worker than the one-rank ones."""
from __future__ import annotations

import json

import pytest

from conftest import requires_all
from test_fsdp_plans import SIDES, SMALL, STEPS, _why


@pytest.mark.process
@pytest.mark.slow
@requires_all
@pytest.mark.parametrize("plan", ["zero3", "scan-offload", "zero3-act-offload"])
def test_the_pair_passes_bf16_on_two_ranks_by_the_envelope(tmp_path, plan):
  """bf16 on 2 ranks (FSDP2: bf16 params, fp32 reduce over gloo; DeepSpeed ZeRO-3 bf16; JAX over a 2-process mesh):
  the verdict comes from the envelope each side measures on itself, and that envelope is itself measured on 2
  ranks (the perturbed reruns are 2-rank runs too)."""
  import parity
  out = tmp_path / "r"
  run = parity.compare("gpt2-tiny", sides=list(SIDES), out=out, nproc=2, steps=STEPS, plan=plan, precision="bf16",
                       overrides=SMALL, determinism_steps=0)
  assert run.passed, [_why(out, s, run.checks) for s in SIDES]
  rep = json.loads((out / "report.json").read_text())
  assert rep["plan"]["name"] == plan and rep["run"]["train"]["precision"] == "bf16"
  assert set(rep["noise_envelope"]["sides"]) == set(SIDES)
  for side in SIDES:
    for folder in (out / side, out / "noise" / side):
      summary = json.loads((folder / "summary.json").read_text())
      assert summary["nproc"] == 2 and [r["status"] for r in summary["ranks"]] == ["ok", "ok"], (folder, summary)
  gating = [c for c in rep["checks"] if c.get("gating", True)]
  assert {c["name"] for c in gating} >= {f"loss_envelope {a}~{b}" for a, b in
                                         (("jax", "deepspeed"), ("jax", "fsdp"), ("deepspeed", "fsdp"))}
