"""The FSDP2 plan pairs of tests/test_fsdp_plans.py in bf16: jax~deepspeed~fsdp by the noise envelope.

A file of its own so that pytest-xdist's loadfile puts these compares on another worker than the fp32 ones."""
from __future__ import annotations

import json

import pytest

from conftest import requires_all
from test_fsdp_plans import SIDES, SMALL, STEPS


@pytest.mark.process
@pytest.mark.slow
@requires_all
@pytest.mark.parametrize("plan", ["zero3", "scan-offload", "zero3-act-offload"])
def test_the_pair_passes_bf16_by_the_envelope(tmp_path, plan):
  """bf16 on every side (FSDP2: MixedPrecisionPolicy with bf16 params and fp32 reduce): the verdict comes from the
  noise envelope each side measures on itself (parity.verdict.envelope), which every side's run must fit."""
  import parity
  run = parity.compare("gpt2-tiny", sides=list(SIDES), out=tmp_path / "r", steps=STEPS, plan=plan, precision="bf16",
                       overrides=SMALL, determinism_steps=0)
  assert run.passed, [c for c in run.checks if not c["passed"]]
  rep = json.loads((tmp_path / "r" / "report.json").read_text())
  assert rep["plan"]["name"] == plan and rep["run"]["train"]["precision"] == "bf16"
  assert set(rep["noise_envelope"]["sides"]) == set(SIDES)  # the envelope decided, for every side
  card = json.loads((tmp_path / "r" / "fsdp" / "semantics.json").read_text())
  assert card["items"]["dtypes.params"] == "bfloat16"  # read from the FSDP2 side's own MixedPrecisionPolicy
