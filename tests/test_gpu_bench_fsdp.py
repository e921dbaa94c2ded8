"""The FSDP2 side of benchmarks/gpu.py's fixed flow: its tiny run end to end on the CPU (gloo, one rank), its plans,
its not-run reasons, and failures recorded instead of raised."""
from __future__ import annotations

import argparse
import time
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import requires_torch

ROOT = Path(__file__).resolve().parents[1]


def _suite(tmp_path: Path, tiny: bool, device: dict, **args):
  from benchmarks.gpu_parts.suite import Suite
  for sub in ("parts", "logs"):
    (tmp_path / sub).mkdir(parents=True, exist_ok=True)
  ns = argparse.Namespace(tiny=tiny, parts=["train", "largest"], sides=["fsdp"], steps=2, warmup=1, max_probes=1,
                          min_part_s=1, part_timeout_s=60, train_timeout_s=60, probe_timeout_s=60, **args)
  return Suite(ns, tmp_path, time.monotonic() + 120, device=device)


def test_fsdp_runs_the_zero3_pairs_fsdp2_plans():
  """The FSDP2 side's train pair and probe plan are parity's pairs with an FSDP2 plan: CPUOffloadPolicy where the
  fixed run needs offload, fully_shard alone without; the spec names the fsdp side alone."""
  from benchmarks.gpu_parts import sizing
  from parity.sizing import plans
  base = sizing.with_plan(sizing.tiny_run(), sizing.OFFLOAD_PLAN, micro_batch=4)
  off, none = sizing.train_run(base, "fsdp", offload=True), sizing.train_run(base, "fsdp", offload=False)
  assert off.fsdp == plans.PLANS["zero3-offload-all"].fsdp and off.fsdp.offload
  assert none.fsdp == plans.PLANS["zero3"].fsdp and not none.fsdp.offload
  assert off.sides == none.sides == ("fsdp",) and off.train.micro_batch_size == 4
  assert sizing.train_run(base, "deepspeed", offload=False) is base  # the other sides' configs carry their plan
  probe = sizing.probe_run(sizing.fixed_run(), "fsdp", 7)
  assert (probe.fsdp.offload, probe.model.n_layers, probe.train.micro_batch_size) == (True, 7, 1)
  assert sizing.PROBE_PLANS["fsdp"] == "zero3-offload-all" and probe.fsdp == plans.PLANS["zero3-offload-all"].fsdp


def test_fsdp_is_not_run_without_cuda_or_sockets():
  from benchmarks.gpu_parts import device
  why = device.not_run_reasons({"kind": "tpu", "name": "TPU v5 lite"}, tiny=False, socket_error=None)
  assert "FSDP2 would train on the host CPU" in why["fsdp"] and "TPU v5 lite" in why["fsdp"]
  refused = device.not_run_reasons({"kind": "cpu"}, tiny=True, socket_error="[Errno 97] Address family not supported")
  assert set(refused) == {"deepspeed", "fsdp"} and "refuses sockets" in refused["fsdp"]
  assert device.not_run_reasons({"kind": "gpu"}, tiny=False, socket_error=None) == {}


def test_a_side_that_cannot_run_is_recorded_as_not_run_without_a_process(tmp_path, monkeypatch):
  from benchmarks.gpu_parts import fixed_flow, report, sizing
  monkeypatch.setattr(fixed_flow, "run_part", lambda *a, **k: pytest.fail("a process was started"))
  suite = _suite(tmp_path, True, {"kind": "cpu", "host_available_bytes": 2**33})
  suite.not_run = {"fsdp": "fsdp: not run: this machine refuses sockets"}
  configs = {"fixed": sizing.with_plan(sizing.tiny_run(), sizing.OFFLOAD_PLAN)}
  fixed_flow.run_sides(suite, configs)
  assert suite.records["fsdp_fixed"] == {"ok": None, "not_run": "fsdp: not run: this machine refuses sockets"}
  assert suite.records["largest_fsdp"]["not_run"] and report.failed_parts({"records": suite.records}) == []


def test_a_depth_the_memory_model_refuses_is_recorded_not_started(tmp_path, monkeypatch):
  """Outside --tiny a probe whose predicted host bytes exceed the node's is 'host-limit': recorded, never started."""
  from benchmarks.gpu_parts import fixed_flow
  monkeypatch.setattr(fixed_flow, "run_part", lambda *a, **k: pytest.fail("a process was started"))
  suite = _suite(tmp_path, False, {"kind": "gpu", "memory_total_bytes": 80 * 2**30,
                                   "host_available_bytes": 2**20})  # 1 MiB: one layer of gpt2-1.5b cannot fit
  fixed_flow.run_side(suite, "fsdp", {}, suite.deadline)
  lg = suite.records["largest_fsdp"]
  assert "driver_fsdp" not in suite.records
  assert (lg["largest_ok"], lg["smallest_failed"], lg["plan"]) == (0, 1, "zero3-offload-all")
  assert lg["probes"][0]["status"] == "host-limit" and lg["probes"][0]["detail"].startswith("not started: ")


@pytest.mark.process
def test_a_part_process_that_dies_is_recorded_not_raised(tmp_path, monkeypatch):
  """A spec the part cannot read (planted: cut short) kills each fsdp_train process at its start: the train runs
  and the probe are recorded as errors with the part's output, the search stops with a lower bound, and the report
  names them as failed."""
  from benchmarks.gpu_parts import fixed_flow, report

  def cut(run, path):
    path.write_text('{"model": {')
    return path
  monkeypatch.setattr(fixed_flow, "write_spec", cut)
  suite = _suite(tmp_path, True, {"kind": "cpu", "host_available_bytes": 2**33})
  _, configs = fixed_flow.train_configs(suite)
  fixed_flow.run_side(suite, "fsdp", configs, suite.deadline)
  rec = suite.records
  assert "driver_fsdp" not in rec
  for name in ("fsdp_fixed", "fsdp_cost_none"):
    assert rec[name]["ok"] is False and rec[name]["failure"] == "error" and "JSONDecodeError" in rec[name][
        "stderr_tail"], rec[name]
  lg = rec["largest_fsdp"]
  assert lg["largest_ok"] == 0 and lg["probes"][0]["status"] == "error" and lg["stopped"] == "probe at 2 layers: error"
  failed = report.failed_parts({"records": rec})
  assert {"fsdp_fixed", "fsdp_cost_none", "largest_fsdp"} <= set(failed)
  assert "largest n_layers trained" in report.markdown({"records": rec, **_data_shell(suite)})


def _data_shell(suite) -> dict:
  return {"header": {"date": "d", "mode": "tiny", "machine": "m", "python": "3", "versions": {}, "env": {}},
          "device": {**suite.device, "cpu_usable": 2}, "offload": {}, "suite_wall_s": 1.0}


@pytest.mark.process
@pytest.mark.slow
@requires_torch
def test_tiny_fsdp_side_trains_and_finds_a_largest_model_on_cpu(tmp_path):
  """`gpu.py --tiny --sides fsdp`: the project's FSDP2 trainer on one gloo rank: torch_raw, the fixed run (offload),
  the run without offload, one largest-model probe; real figures, n_params the memory model's count."""
  from benchmarks.gpu_parts import sizing
  from parity.sizing import memory
  proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--tiny", "--sides", "fsdp", "--out",
                         str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  data = json.loads((tmp_path / "gpu.json").read_text())
  rec, tiny = data["records"], sizing.tiny_run()
  assert rec["torch_raw"]["ok"] and not any(k.startswith(("jax", "deepspeed", "largest_jax")) for k in rec)
  assert rec["fsdp_cost_offload"] == {"same_as": "fsdp_fixed"}
  for name, offload in (("fsdp_fixed", True), ("fsdp_cost_none", False)):
    r = rec[name]["result"]
    assert rec[name]["ok"] and r["side"] == "fsdp" and r["world"] == 1 and r["backend"] == "cpu"
    assert all(s > 0 for s in r["step_s"]) and r["median_s"] > 0 and r["tokens_per_s"] > 0
    assert r["n_params"] == memory.param_count(tiny.model) and r["loss"] > 0
    assert r["fsdp"]["offload_to_cpu"] is offload and r["fsdp"]["param_dtype"] == "bfloat16"
    kind = "host" if offload else "device"  # CPUOffloadPolicy's state is host memory (torch_impl.memory's kinds)
    assert r["state_bytes_by_memory_kind"][kind] > 0
    assert rec[name]["config"]["plan"] == ("zero3-offload-all" if offload else "zero3")
  o = data["offload"]["fsdp"]
  assert o["kept"] > 0 and o["moved_bytes_per_step"] > 0 and o["link"]["source"].startswith("host memcpy")
  lg = rec["largest_fsdp"]
  assert lg["largest_ok"] >= 1 and lg["probes"][0]["status"] == "ok" and lg["probes"][0]["step_s"] > 0
  assert lg["largest_params"] == memory.param_count(sizing.probe_run(tiny, "fsdp", lg["largest_ok"]).model)
  md = (tmp_path / "gpu.md").read_text()
  assert "| fsdp_fixed | zero3-offload-all" in md and "| fsdp | zero3-offload-all |" in md


@pytest.mark.process
def test_the_fixed_flows_default_budget_is_per_side(tmp_path):
  """Without --budget-s the fixed flow gets 240 s a side (720 for all three, 240 for one); a given budget stands."""
  import importlib.util
  import time
  spec = importlib.util.spec_from_file_location("gpu_driver_fsdp", ROOT / "benchmarks" / "gpu.py")
  drv = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(drv)
  for argv, budget in (([], 720.0), (["--sides", "fsdp"], 240.0), (["--budget-s", "100"], 100.0)):
    suite, status = drv.prepare(drv.parse_args(["--device-gib", "80", "--flow", "fixed", "--out", str(tmp_path),
                                                *argv]))
    assert status is None and suite.args.budget_s == budget
    assert budget - 30 < suite.deadline - time.monotonic() <= budget
