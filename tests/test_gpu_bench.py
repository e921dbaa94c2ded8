"""benchmarks/gpu.py, the GPU benchmark suite: its tiny mode end to end on CPU, its search and sizing rules."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import requires_all

ROOT = Path(__file__).resolve().parents[1]
PARTS = ROOT / "benchmarks" / "gpu_parts"


def _imported_roots(path: Path) -> set[str]:
  """Top-level package names a module imports anywhere (top level or inside functions)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out |= {a.name.split(".")[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      out.add(node.module.split(".")[0])
  return out


def test_each_part_imports_one_framework_and_the_driver_none():
  """torch and jax never share a process: JAX parts never import torch, torch parts never jax; the driver and its
  helpers import neither (they only launch the parts)."""
  for name in ("jax_raw", "jax_train"):
    assert "torch" not in _imported_roots(PARTS / f"{name}.py") and "deepspeed" not in _imported_roots(
        PARTS / f"{name}.py")
  for name in ("torch_raw", "ds_train"):
    assert "jax" not in _imported_roots(PARTS / f"{name}.py")
  for path in (ROOT / "benchmarks" / "gpu.py", PARTS / "common.py", PARTS / "sizing.py", PARTS / "report.py"):
    assert not _imported_roots(path) & {"jax", "torch", "deepspeed", "flax", "optax"}, path


def _search(threshold: int, start: int, **kw):
  from benchmarks.gpu_parts.sizing import search_largest
  calls = []

  def probe(n):
    calls.append(n)
    return {"status": "ok" if n <= threshold else "oom"}
  kw.setdefault("max_probes", 50)
  res = search_largest(probe, start, time_left=lambda: 100.0, min_probe_s=1.0, **kw)
  return res, calls


def test_search_doubles_then_bisects_to_an_eighth():
  res, calls = _search(37, 10)
  assert calls == [10, 20, 40, 30, 35, 37]  # doubling until the first OOM, then bisection
  assert (res["largest_ok"], res["smallest_failed"], res["complete"]) == (37, 40, True)
  res, calls = _search(3, 10)  # the start itself does not fit: bisection below it
  assert calls[0] == 10 and res["largest_ok"] == 3 and res["complete"]


def test_search_stops_on_error_budget_and_cap_with_a_lower_bound():
  from benchmarks.gpu_parts.sizing import search_largest
  res = search_largest(lambda n: {"status": "ok" if n < 8 else "error"}, 4, max_probes=10, time_left=lambda: 100.0,
                       min_probe_s=1.0)
  assert res["largest_ok"] == 4 and not res["complete"] and "8 layers: error" in res["stopped"]
  res, calls = _search(1000, 4, max_probes=2)
  assert calls == [4, 8] and not res["complete"] and "cap (2)" in res["stopped"]
  res = search_largest(lambda n: {"status": "ok"}, 4, max_probes=9, time_left=lambda: 0.5, min_probe_s=1.0)
  assert res["probes"] == [] and "time budget" in res["stopped"]
  res = search_largest(lambda n: {"status": "host-limit"}, 4, max_probes=9, time_left=lambda: 9.0, min_probe_s=1.0)
  assert res["smallest_failed"] == 1 and res["largest_ok"] == 0  # nothing may start: no depth trained


def test_fixed_size_needs_offload_by_the_memory_model():
  """On an H200 (140.4 GiB as nvidia-smi reports it) with 120 GiB of host memory: at the fixed micro batch no
  plan without offload fits either side, the offload pair fits both; at the cost batch zero2 fits both."""
  from benchmarks.gpu_parts import sizing
  from benchmarks.gpu_parts.common import sizing_modules
  memory, plans = sizing_modules()
  dev, host = 143771 * 2**20, 120 * 2**30
  fx = sizing.fixed_size(dev, host)
  assert fx["micro_cost"] < fx["micro_fixed"], fx["why"]
  usable = dev * (1 - sizing.RESERVE)
  for side in ("jax", "deepspeed"):
    for plan, micro, fits in ((sizing.NO_OFFLOAD_PLAN, fx["micro_fixed"], False),
                              (sizing.OFFLOAD_PLAN, fx["micro_fixed"], True),
                              (sizing.NO_OFFLOAD_PLAN, fx["micro_cost"], True)):
      run = sizing.with_plan(fx["run"], plan, micro_batch=micro)
      peak = memory.peak_device_bytes(memory.estimate(run, sides=(side,)), side)
      assert (peak <= usable) == fits, (side, plan, micro, peak / 2**30)
  assert "no plan without offload fits" in fx["why"][0]


def test_failures_are_classified_and_peaks_known():
  from benchmarks.gpu_parts.common import classify_failure, peak_flops
  assert classify_failure(1, "jaxlib.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory allocating", False) == "oom"
  assert classify_failure(1, "torch.OutOfMemoryError: CUDA out of memory.", False) == "oom"
  assert classify_failure(-9, "", False) == "oom"  # the kernel's OOM killer
  assert classify_failure(None, "", True) == "timeout"
  assert classify_failure(1, "ValueError: bad", False) == "error"
  assert peak_flops("NVIDIA H200", "bf16") == 989.4e12 and peak_flops("NVIDIA H100 PCIe", "tf32") == 378e12
  assert peak_flops("cpu", "bf16") is None


@pytest.mark.process
def test_wrapper_is_valid_bash():
  proc = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu.sh")], capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr


@pytest.mark.process
@pytest.mark.slow
@requires_all
def test_tiny_mode_runs_every_part_on_cpu(tmp_path):
  """The whole suite in --tiny mode: every part has numbers or a recorded failure reason; bandwidth, matmul and at
  least one side's training step succeed on CPU; JSON and Markdown written."""
  proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--tiny", "--out", str(tmp_path)],
                        capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
  data = json.loads((tmp_path / "gpu.json").read_text())
  rec = data["records"]
  for name in ("torch_raw", "jax_raw", "jax_fixed", "jax_cost_none", "deepspeed_fixed",
               "deepspeed_cost_none"):
    r = rec[name]
    assert r["ok"] or (r["failure"] and r["detail"]), (name, r)
  assert rec["torch_raw"]["ok"] and rec["jax_raw"]["ok"]
  assert rec["torch_raw"]["result"]["bandwidth"]["host_to_host"]["median_gbs"] > 0
  assert rec["jax_raw"]["result"]["bandwidth"]["device_put_pinned_to_device"]["median_gbs"] > 0
  assert all(rec[p]["result"]["matmul"]["fp32"]["tflops"] > 0 for p in ("torch_raw", "jax_raw"))
  steps = [rec[n]["result"] for n in ("jax_fixed", "deepspeed_fixed") if rec[n]["ok"]]
  assert steps and all(s["tokens_per_s"] > 0 and s["peak_host_rss_bytes"] > 0 for s in steps)
  assert rec["jax_cost_offload"] == {"same_as": "jax_fixed"}  # tiny: one size, so the offload run is the fixed one
  for side in ("jax", "deepspeed"):
    o, lg = data["offload"][side], rec[f"largest_{side}"]
    assert "error" in o or (o["kept"] > 0 and o["moved_bytes_per_step"] > 0), o
    assert len(lg["probes"]) == 1 and (lg["largest_ok"] == 2 or lg["probes"][0]["status"] != "ok"), lg
  if rec["jax_fixed"]["ok"]:
    assert rec["jax_fixed"]["result"]["state_bytes_by_memory_kind"].get("pinned_host", 0) > 0  # offload ran
    assert rec["jax_fixed"]["derived"]["mfu"] is None  # no peak on CPU: n/a, not a made-up figure
  md = (tmp_path / "gpu.md").read_text()
  for heading in ("Host <-> device bandwidth", "Matmul throughput", "fixed GPT size", "Offload cost", "Largest"):
    assert heading in md
  assert "CPU/tiny figure" in md and data["header"]["mode"].startswith("tiny")
