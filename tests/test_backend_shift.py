"""Pairs on two backends (parity.verdict.backend): the table plus each accelerator side's measured shift against its
rerun on the host CPU decides the pair, the shift itself is bounded, and the rerun machinery runs for real."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from parity.verdict.backend import backend_pair_check, backend_shift_check, on_accelerator, shifts
from parity.verdict.gating import mark_backend_decided, reported_only_allowed
from parity.verdict.steps import series_check

DATA = Path(__file__).parent / "data" / "tpu_v5e"


def _steps(losses, grad=1.0):
  return [{"step": i, "loss": x, "grad_norm": grad, "lr": 1e-3} for i, x in enumerate(losses)]


def test_devices():
  assert on_accelerator("TPU_0(process=0,(0,0,0,0))") and on_accelerator("cuda:0")
  assert not on_accelerator("cpu") and not on_accelerator("TFRT_CPU_0") and not on_accelerator(None)


def test_a_pair_over_the_table_passes_within_the_measured_shift_and_fails_beyond_it():
  torch = _steps([5.0, 4.5, 4.0])
  tpu = _steps([5.0 + 1.4e-5, 4.5 + 2e-5, 4.0 - 1e-5])  # over the 1e-5 table, as measured on the chip
  cpu_rerun = _steps([5.0 + 2e-6, 4.5 + 3e-6, 4.0 - 1e-6])
  table = series_check("loss", "jax", tpu, "torch", torch, "fp32")
  assert not table.passed
  sh = shifts(tpu, cpu_rerun)
  c = backend_pair_check("loss", "jax", tpu, "torch", torch, {"jax": sh["loss"]}, "fp32")
  assert c.passed and c.name == "loss_backend jax~torch" and "jax's shift" in c.detail
  bug = _steps([5.0 + 3e-4, 4.5 + 4e-4, 4.0])  # a framework difference both backends carry
  c = backend_pair_check("loss", "jax", bug, "torch", torch, {"jax": shifts(bug, _steps([5.0 + 3e-4, 4.5 + 4e-4,
                                                                                         4.0]))["loss"]}, "fp32")
  assert not c.passed and c.first_failing_step == 0


def test_the_shift_itself_is_bounded():
  ok = backend_shift_check("jax", "TPU v5 lite", {0: 2.2e-5, 1: 1e-5}, "fp32")
  assert ok.passed and ok.tolerance == 2e-4
  bad = backend_shift_check("jax", "TPU v5 lite", {0: 1e-5, 1: 3e-3}, "fp32")
  assert not bad.passed and bad.first_failing_step == 1 and bad.value == 3e-3


def test_an_accelerator_only_error_in_grad_norm_or_val_loss_cannot_grant_itself_its_tolerance():
  """The pair bound takes the side's own shift, so every metric's shift is bounded too: grad norm 1.5 on the chip
  where the CPU rerun (and torch) read 1.0 passes the pair bound but FAILs its shift bound."""
  tpu, cpu = _steps([5.0, 4.0], grad=1.5), _steps([5.0, 4.0], grad=1.0)
  sh = shifts(tpu, cpu)
  pair = backend_pair_check("grad_norm", "jax", tpu, "torch", cpu, {"jax": sh["grad_norm"]}, "fp32")
  assert pair.passed  # by construction: the shift is granted
  c = backend_shift_check("jax", "TPU v5 lite", sh["grad_norm"], "fp32", "grad_norm", {0: 1.5, 1: 1.5})
  assert not c.passed and c.name == "grad_norm_backend_shift jax" and c.first_failing_step == 0
  val = backend_shift_check("jax", "TPU v5 lite", {0: 0.5}, "fp32", "val_loss", {0: 4.0})
  assert not val.passed and val.tolerance == 2e-4
  ok = backend_shift_check("jax", "TPU v5 lite", {0: 3.2e-5}, "fp32", "grad_norm", {0: 5.65})
  assert ok.passed


def test_the_table_check_is_reported_only_where_the_backend_check_decides():
  torch, tpu = _steps([5.0, 4.0]), _steps([5.0 + 2e-5, 4.0])
  table = series_check("loss", "jax", tpu, "torch", torch, "fp32")
  mark_backend_decided([table], {("loss", "jax", "torch")})
  assert table.gating is False and "different backends" in table.detail
  stored = [table.to_json(), {"metric": "loss_backend", "sides": ["jax", "torch"]}]
  assert reported_only_allowed(stored[0], stored, "fp32")
  assert not reported_only_allowed(stored[0], stored[:1], "fp32")


def test_recorded_chip_steps_over_the_cpu_table():
  """The recorded run the rule is for: gemma3-tiny's JAX side on the chip differs from torch on the CPU by 1.9e-5 at
  step 0 (its tanh-GELU), over the 1e-5 table."""
  read = lambda side: [json.loads(x) for x in (DATA / "gemma3-fp32" / side / "steps.jsonl").read_text().splitlines()
                       if x.strip()]
  c = series_check("loss", "jax", read("jax"), "torch", read("torch"), "fp32")
  assert not c.passed and 1e-5 < c.value < 3e-5 and c.first_failing_step == 0


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.requires_jax
@pytest.mark.requires_torch
def test_the_cpu_rerun_runs_and_decides_the_pair(tmp_path):
  """A real jax,torch compare on this CPU, then the backend rerun as if the JAX side had run on a chip: the rerun
  runs in backend/jax on the host CPU, its shift is 0 here (the same backend), and its checks decide the pair."""
  import subprocess
  import sys
  from parity.pipeline.reruns import RerunContext, backend_reruns, backend_sides
  from parity.report.reverify import _collect, _spec
  from parity.report.run_record import RunRecord
  from parity import weights
  out = tmp_path / "run"
  p = subprocess.run([sys.executable, "-m", "parity.cli", "compare", "--preset", "gpt2-tiny", "--steps", "3",
                      "--sides", "jax,torch", "--determinism-steps", "0", "--no-progress", "--out", str(out)],
                     cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stdout + p.stderr
  d = json.loads((out / "report.json").read_text())
  assert d["backend"] is None  # both sides on this CPU: no rerun
  spec, _ = _spec(out, RunRecord.of(d))
  data, _ = _collect(out, RunRecord.of(d), spec, d["run_folder"]["run_id"])
  ctx = RerunContext(out, spec, d["run_folder"]["run_id"], 300.0, weights.load(out / "init.safetensors"), data)
  assert backend_sides(ctx) == []
  data["jax"]["device"] = "TPU_0(process=0,(0,0,0,0))"
  assert backend_sides(ctx) == ["jax"]
  res = backend_reruns(ctx)
  checks = {c.name: c for c in res.checks}
  assert (out / "backend" / "jax" / "steps.jsonl").exists()
  assert checks["backend_shift jax"].passed and checks["backend_shift jax"].value == 0.0
  assert checks["loss_backend jax~torch"].passed and ("loss", "jax", "torch") in res.decides
  assert checks["grad_norm_backend_shift jax"].passed and checks["val_loss_backend_shift jax"].passed
  assert res.section["runs"]["jax"]["status"] == "ok"


def test_device_classes_group_one_kind_of_hardware():
  from parity.verdict.backend import device_class
  assert {device_class(d) for d in ("cuda:0", "cuda (NVIDIA H200)", "rocm:0")} == {"gpu"}
  assert {device_class(d) for d in ("TFRT_CPU_0", "cpu", None)} == {"cpu"}
  assert device_class("TPU_0(process=0,(0,0,0,0))") == "tpu"


def test_a_zero_step_0_shift_or_loss_gives_a_bound_not_a_crash():
  """Step-0 shift 0 and loss 0 (or no values): the floor is 4 ulps of 1 nat; a later shift is judged, not divided
  by zero."""
  for values in ({0: 0.0, 1: -0.1}, None, {0: float("inf"), 1: 1.0}):
    c = backend_shift_check("jax", "TPU_0", {0: 0.0, 1: 1e-7}, "fp32", "loss", values)
    assert c.passed and c.tolerance > 0 and ">= 0%" not in c.detail, c.detail
    bad = backend_shift_check("jax", "TPU_0", {0: 0.0, 1: 1e-3}, "fp32", "loss", values)
    assert not bad.passed and bad.first_failing_step == 1
