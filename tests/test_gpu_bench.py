"""benchmarks/gpu.py, the GPU benchmark suite: its tiny mode end to end on CPU, its search and sizing rules."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import requires_all, requires_jax, requires_torch

ROOT = Path(__file__).resolve().parents[1]
PARTS = ROOT / "benchmarks" / "gpu_parts"
TPU_DOCTOR = ROOT / "tests" / "data" / "tpu_v5e" / "doctor.json"
DRIVER_SIDE = ("common", "sizing", "report", "report_grid", "device", "suite", "grid", "grid_flow", "fixed_flow",
               "by_compile")


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
  for name in ("jax_raw", "jax_train", "jax_largest", "jax_device"):
    assert "torch" not in _imported_roots(PARTS / f"{name}.py") and "deepspeed" not in _imported_roots(
        PARTS / f"{name}.py")
  for name in ("torch_raw", "ds_train", "fsdp_train"):
    assert "jax" not in _imported_roots(PARTS / f"{name}.py")
  driver = [ROOT / "benchmarks" / "gpu.py", ROOT / "benchmarks" / "tpu_parts" / "bench.py",
            *(PARTS / f"{n}.py" for n in DRIVER_SIDE)]
  for path in driver:
    assert not _imported_roots(path) & {"jax", "torch", "deepspeed", "flax", "optax", "jax_impl", "torch_impl"}, path


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


def test_search_probes_where_the_compilers_stated_need_points():
  """The TPU compiler says what it needed ("(24.14G) exceeds available HBM (15.75G)"): the next probe is n x
  available / needed inside the bracket (59 -> 38 on the chip's own refusal), not the midpoint (29)."""
  from benchmarks.gpu_parts.sizing import compiler_guess, search_largest
  per_layer, fixed, avail = 0.38, 1.7, 15.75  # GB: a need that grows with depth plus a part that does not
  calls = []

  def probe(n):
    calls.append(n)
    need = fixed + per_layer * n
    if need <= avail:
      return {"status": "ok"}
    return {"status": "oom", "detail": f"does not fit (compile: JaxRuntimeError: RESOURCE_EXHAUSTED: Ran out of "
                                       f"memory on HBM, the total memory required for HLO temporaries "
                                       f"({need:.2f}G) exceeds available HBM ({avail:.2f}G).)"}
  res = search_largest(probe, 59, max_probes=8, time_left=lambda: 100.0, min_probe_s=1.0)
  assert calls[:2] == [59, 38] and res["largest_ok"] == 36 and res["complete"], (calls, res)
  assert len(calls) < len(_search(36, 59)[1])  # fewer probes than bisection for the same answer
  assert compiler_guess({"n_layers": 59, "detail": "compile failed (INTERNAL)"}) is None
  assert compiler_guess({"n_layers": 10, "detail": "(20.00G) exceeds available HBM (15.00G)"}) == 7


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
  for script in ("gpu.sh", "tpu.sh", "tpu_parts/env.sh"):
    proc = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / script)], capture_output=True, text=True)
    assert proc.returncode == 0, (script, proc.stderr)


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
               "deepspeed_cost_none", "fsdp_fixed", "fsdp_cost_none"):
    r = rec[name]
    assert r["ok"] or (r["failure"] and r["detail"]), (name, r)
  assert rec["torch_raw"]["ok"] and rec["jax_raw"]["ok"]
  assert rec["torch_raw"]["result"]["bandwidth"]["host_to_host"]["median_gbs"] > 0
  assert rec["jax_raw"]["result"]["bandwidth"]["device_put_pinned_to_device"]["median_gbs"] > 0
  assert all(rec[p]["result"]["matmul"]["fp32"]["tflops"] > 0 for p in ("torch_raw", "jax_raw"))
  steps = [rec[n]["result"] for n in ("jax_fixed", "deepspeed_fixed", "fsdp_fixed") if rec[n]["ok"]]
  assert steps and all(s["tokens_per_s"] > 0 and s["peak_host_rss_bytes"] > 0 for s in steps)
  assert rec["jax_cost_offload"] == {"same_as": "jax_fixed"}  # tiny: one size, so the offload run is the fixed one
  assert rec["fsdp_fixed"]["ok"] and rec["fsdp_fixed"]["result"]["median_s"] > 0  # FSDP2 on one gloo rank
  for side in ("jax", "deepspeed", "fsdp"):
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


# ----------------------------------------------------------------------------- TPU: device, peaks, sizing

def _tpu_device():
  """The device record from the jax probe recorded on a TPU v5e VM (`parity doctor --json`'s frameworks.jax: the
  format benchmarks/gpu_parts/jax_device.py writes, less its libtpu and open_s)."""
  from benchmarks.gpu_parts.device import device_from_jax_probe
  return device_from_jax_probe(json.loads(TPU_DOCTOR.read_text())["frameworks"]["jax"])


def test_tpu_device_is_read_from_a_recorded_probe():
  from benchmarks.gpu_parts import device, sizing
  dev = _tpu_device()
  assert (dev["kind"], dev["name"], dev["count"]) == ("tpu", "TPU v5 lite", 1)
  assert dev["memory_total_bytes"] == 16_909_336_064 and dev["memory_source"] == "memory_stats bytes_limit"
  assert dev["memory_kinds"] == ["device", "pinned_host", "unpinned_host"]
  assert dev["versions"]["jax"] == "0.10.2" and dev["runtime_settings"]["LIBTPU_INIT_ARGS"]
  hw = sizing.hardware(dev["memory_total_bytes"], 42 * 2**30, dev["name"], dev["kind"])
  assert (hw.name, hw.kind, hw.device_bytes) == ("TPU-v5e", "tpu", 16_909_336_064)  # the planner's preset, measured
  cpu = device.device_from_jax_probe({"backend": "cpu", "accelerator": {"kind": "cpu", "count": 1}})
  assert (cpu["kind"], cpu["name"], cpu["memory_total_bytes"]) == ("cpu", None, None)
  why = device.not_run_reasons(dev, tiny=False, socket_error="[Errno 97] Address family not supported by protocol")
  assert "torch has no device here" in why["torch"] and "refuses sockets" in why["deepspeed"]
  assert device.not_run_reasons({"kind": "gpu"}, tiny=False, socket_error=None) == {}
  assert device.not_run_reasons({"kind": "cpu"}, tiny=True, socket_error=None) == {}  # the CPU check runs them all


def test_tpu_evidence_and_the_recorded_environment():
  from benchmarks.gpu_parts import device
  env = {"TPU_ACCELERATOR_TYPE": "v5litepod-1", "XLA_FLAGS": "--x", "LIBTPU_INIT_ARGS": "--y", "HOME": "/h",
         "TPU_PREMAPPED_BUFFER_SIZE": "268435456", "JAX_PLATFORMS": ""}
  from harness.doctor import tpu_evidence
  assert device.tpu_evidence(env) == (tpu_evidence() or "TPU_ACCELERATOR_TYPE set")
  assert device.recorded_env(env) == {"LIBTPU_INIT_ARGS": "--y", "TPU_ACCELERATOR_TYPE": "v5litepod-1",
                                      "TPU_PREMAPPED_BUFFER_SIZE": "268435456", "XLA_FLAGS": "--x"}


def test_extensions_dir_falls_back_to_a_writable_folder(tmp_path):
  from benchmarks.gpu_parts import device
  blocker = tmp_path / "file"
  blocker.write_text("")
  path, note = device.extensions_dir({"TORCH_EXTENSIONS_DIR": str(blocker / "ext"), "TMPDIR": str(tmp_path)})
  assert path != str(blocker / "ext") and device.writable_dir(path) and "is not writable" in note
  assert device.extensions_dir({"TORCH_EXTENSIONS_DIR": str(tmp_path / "ok")}) == (str(tmp_path / "ok"), None)


def test_tpu_peaks_come_from_the_data_sheets():
  from benchmarks.gpu_parts.common import peak_flops
  from parity.sizing.cost import HARDWARE
  for name, preset, bf16, int8 in (("TPU v5 lite", "TPU-v5e", 197e12, 394e12), ("TPU v5e", "TPU-v5e", 197e12, 394e12),
                                   ("TPU v5p", "TPU-v5p", 459e12, 918e12), ("TPU v5", "TPU-v5p", 459e12, 918e12),
                                   ("TPU v6 lite", "TPU-v6e", 918e12, 1836e12), ("TPU v6e", "TPU-v6e", 918e12,
                                                                                  1836e12)):
    assert (peak_flops(name, "bf16"), peak_flops(name, "int8")) == (bf16, int8), name
    assert peak_flops(name, "bf16") == HARDWARE[preset].peak_flops  # one figure with the planner's presets
    assert peak_flops(name, "fp32") == bf16 / 6 == HARDWARE[preset].peak_flops_fp32  # 6 bf16 passes at 'highest'
  # the v5e measured 31 TFLOP/s at 'highest' and 164 in bf16: under the peaks, within 5 % / 17 % of them
  assert 0.9 < 31e12 / peak_flops("TPU v5 lite", "fp32") < 1 and 164e12 / peak_flops("TPU v5 lite", "bf16") < 1
  assert peak_flops("NVIDIA H200", "int8") is None and peak_flops("NVIDIA H200", "bf16") == 989.4e12


def test_tpu_sizing_has_no_gpu_pinned_pool_and_counts_the_runtime_beside_the_state(monkeypatch):
  """On a GPU a JAX plan's pinned bytes go to XLA's pool, which the rule sizes where its 64 GiB default would
  exceed the host (parity.sizing.host_limits); a TPU has no such pool: its pinned_host arrays are host memory beside
  the runtime's premapped region, which (with the runtime and the compile) only adds to the host's need."""
  from benchmarks.gpu_parts import sizing
  from parity.sizing import host_limits
  monkeypatch.delenv("TPU_PREMAPPED_BUFFER_SIZE", raising=False)
  run = sizing.with_plan(sizing.fixed_run(), "scan-offload", micro_batch=1, n_layers=3)
  host = 40 * 2**30
  gpu_ok, gpu_why = sizing.predicted_fits(run, "jax", None, host, "gpu")
  tpu_ok, tpu_why = sizing.predicted_fits(run, "jax", None, host, "tpu")
  assert gpu_ok and tpu_ok and "pool" not in tpu_why
  # on a GPU the pool rule sets the pool where XLA's 64 GiB default would exceed the host; a TPU has no such pool
  env, decision = sizing.jax_pool(run, {}, kind="gpu")
  assert env == {"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": str(decision["gib"])} and decision["set_by"] == "parity"
  assert decision["fits"] and decision["gib"] < decision["default_gib"]
  assert sizing.jax_pool(run, {}, kind="tpu") == ({}, None)
  assert sizing.tpu_premapped({}) == (4_294_967_296, "TPU_PREMAPPED_BUFFER_SIZE unset: the runtime's default")
  # on a TPU the pinned state is host memory beside the premapped region (measured: 14 GiB of pinned_host arrays grew
  # the host's use by their size with a 1 GiB region), so the whole host peak counts, plus the runtime's overhead
  deep = sizing.with_plan(sizing.fixed_run(), "scan-offload", micro_batch=1, n_layers=12)
  memory, _ = sizing.sizing_modules()
  whole = memory.peak_host_bytes(memory.estimate(deep, sides=("jax",)), "jax")
  assert host_limits.jax_pinned_need_bytes(deep) > 0.5 * whole  # most of it is the pinned state
  monkeypatch.setenv("TPU_PREMAPPED_BUFFER_SIZE", str(256 << 20))
  overhead = sizing.tpu_host_overhead()
  assert overhead == (256 << 20) + sizing.TPU_RUNTIME_HOST_BYTES + sizing.TPU_COMPILE_HOST_BYTES
  assert sizing.predicted_fits(deep, "jax", None, whole + overhead, "tpu", 0)[0]
  ok, why = sizing.predicted_fits(deep, "jax", None, whole + overhead - 1, "tpu", 0)
  assert not ok and "the TPU runtime's host overhead" in why
  assert sizing.predicted_fits(deep, "jax", None, whole + overhead - 1, "gpu", 0)[0]  # no such overhead off a TPU
  monkeypatch.setenv("TPU_PREMAPPED_BUFFER_SIZE", str(16 << 30))  # a larger region costs host memory, never helps
  assert not sizing.predicted_fits(deep, "jax", None, whole + overhead, "tpu", 0)[0]


def test_tpu_grid_depth_fits_device_and_host_with_the_runtime_overhead(monkeypatch):
  from benchmarks.gpu_parts import sizing
  monkeypatch.delenv("TPU_PREMAPPED_BUFFER_SIZE", raising=False)
  host = 42 * 2**30
  hw = sizing.hardware(16_909_336_064, host, "TPU v5 lite", "tpu")
  base = sizing.fixed_run()
  depth, why = sizing.grid_depth(base, sizing.GRID_PLANS, 4096, 8, hw, host)
  assert depth > 0 and "every plan fits" in why[0] and "premapped region 4.00 GiB" in why[-1]
  memory, _ = sizing.sizing_modules()
  usable = hw.device_bytes * (1 - sizing.RESERVE)

  def fits(n):
    runs = [sizing.grid_run(base, p, 4096, 8, n) for p in sizing.GRID_PLANS]
    dev = max(memory.peak_device_bytes(memory.estimate(r, sides=("jax",)), "jax") for r in runs)
    host_need = max(memory.peak_host_bytes(memory.estimate(r, sides=("jax",)), "jax") for r in runs)
    return dev <= usable and host_need + sizing.tpu_host_overhead() <= host
  assert fits(depth) and not fits(depth + 1)  # the deepest that fits
  small = sizing.grid_depth(base, sizing.GRID_PLANS, 4096, 8, hw, 12 * 2**30)[0]
  assert small < depth  # a small host bounds it: the state plus the runtime's overhead
  with pytest.raises(ValueError, match="multiple of the sequence length 1024"):
    sizing.grid_run(base, "zero0", 1000, 1)


# ----------------------------------------------------------------------------- largest by compiling

def _fake_compile(limit_layers: int, per_layer: int = 100, refuse: bool = True):
  """A compile function: n layers need n x per_layer bytes; past limit_layers XLA refuses (refuse) or compiles."""
  def compile_fn(n: int) -> dict:
    if refuse and n > limit_layers:
      raise RuntimeError("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
                         "hbm. Used 17.2G of 15.75G hbm.")
    return {"memory_analysis": {"argument_size_in_bytes": n * per_layer, "output_size_in_bytes": n * per_layer,
                                "temp_size_in_bytes": 10, "alias_size_in_bytes": n * per_layer,
                                "peak_memory_in_bytes": 7}, "n_params": n}
  return compile_fn


def test_compile_probe_classifies_refusals_and_peaks():
  from benchmarks.gpu_parts.by_compile import classify_compile_error, compile_probe
  ok = compile_probe(_fake_compile(10), 5, bytes_limit=10_000)
  assert (ok["status"], ok["fits"], ok["peak_bytes"], ok["xla_peak_bytes"], ok["n_params"]) == ("ok", True, 510, 7, 5)
  refused = compile_probe(_fake_compile(10), 11, bytes_limit=10_000)
  assert refused["status"] == "oom" and refused["fits"] is False and "Ran out of memory" in refused["detail"]
  over = compile_probe(_fake_compile(10, refuse=False), 50, bytes_limit=4_000)  # compiled, over the limit
  assert over["status"] == "oom" and "5010" not in over["detail"] and "> " in over["detail"]
  assert compile_probe(_fake_compile(10, refuse=False), 50, bytes_limit=6_000, usable_fraction=0.8)["status"] == "oom"
  no_limit = compile_probe(_fake_compile(10, refuse=False), 50, bytes_limit=None)
  assert no_limit["status"] == "ok" and "no device limit known" in no_limit["detail"]
  by_xla = compile_probe(_fake_compile(10, refuse=False), 50, bytes_limit=4_000, fit_by="xla")  # XLA's peak: 7
  assert by_xla["status"] == "ok" and by_xla["peak_bytes"] == 5010  # the sum is still recorded
  assert compile_probe(_fake_compile(10, refuse=False), 50, 4_000, fit_by="compile")["status"] == "ok"
  assert compile_probe(_fake_compile(10), 11, 10**9, fit_by="compile")["status"] == "oom"  # XLA's refusal decides

  def broken(n):
    raise ValueError("a tracing bug")
  err = compile_probe(broken, 3, 10_000)
  assert err["status"] == "error" and err["fits"] is None and "a tracing bug" in err["detail"]
  assert classify_compile_error("jaxlib.XlaRuntimeError: RESOURCE_EXHAUSTED: ...") == "oom"
  assert classify_compile_error("INTERNAL: something") == "error"


def test_largest_by_compile_brackets_the_limit_and_fit_down_finds_the_grid_depth():
  from benchmarks.gpu_parts.by_compile import compile_probe, fit_down
  from benchmarks.gpu_parts.sizing import search_largest
  calls = []

  def probe(n):
    calls.append(n)
    return compile_probe(_fake_compile(37), n, 10**9)
  res = search_largest(probe, 10, max_probes=20, time_left=lambda: 100.0, min_probe_s=0.0)
  assert calls == [10, 20, 40, 30, 35, 37] and (res["largest_ok"], res["smallest_failed"]) == (37, 40)
  calls.clear()
  down = fit_down(probe, 40, max_probes=10, time_left=lambda: 100.0)  # the prediction is too deep: bisect below
  assert calls[0] == 40 and down["depth"] == 37 and [p["n_layers"] for p in down["probes"]] == calls
  calls.clear()
  assert fit_down(probe, 12, max_probes=10, time_left=lambda: 100.0)["depth"] == 12 and calls == [12]
  assert fit_down(probe, 12, max_probes=10, time_left=lambda: 0.0) == {"depth": 0, "probes": [],
                                                                        "stopped": "probe cap or time reached"}
  stop = fit_down(lambda n: {"status": "error"}, 8, max_probes=5, time_left=lambda: 9.0)
  assert stop["depth"] == 0 and stop["stopped"] == "probe at 8 layers: error"


@pytest.mark.process
def test_confirm_run_names_a_hung_child_an_oom_and_a_success(tmp_path):
  """A child past its timeout is killed and named HUNG (a run past the device's memory has sat in XLA's failure
  handler until killed); an allocation failure at run time is OOM_AT_RUN; a child that wrote its JSON is ok. The
  children are `python -m timeit` running one statement."""
  import time
  from benchmarks.gpu_parts.by_compile import HUNG, OOM_AT_RUN, confirm_run
  out = tmp_path / "r.json"
  t0 = time.monotonic()
  hung = confirm_run("timeit", ["-n", "1", "-r", "1", "import time; time.sleep(60)"], out, timeout_s=1.0)
  assert hung["status"] == HUNG == "hung (timed out; XLA failure handler?)" and time.monotonic() - t0 < 30
  oom = confirm_run("timeit", ["-n", "1", "-r", "1", "raise MemoryError('RESOURCE_EXHAUSTED: Out of memory')"], out,
                    timeout_s=60.0)
  assert oom["status"] == OOM_AT_RUN and "RESOURCE_EXHAUSTED" in oom["stderr_tail"]
  ok = confirm_run("timeit", ["-n", "1", "-r", "1", f"open({str(out)!r}, 'w').write('{{\"median_s\": 1}}')"], out,
                   timeout_s=60.0)
  assert ok["status"] == "ok" and ok["result"] == {"median_s": 1}
  slow_exit = confirm_run("timeit", ["-n", "1", "-r", "1", f"open({str(out)!r}, 'w').write('{{\"complete\": true}}'"
                                     "); import time; time.sleep(60)"], out, timeout_s=3.0)
  assert slow_exit["status"] == "ok" and "after writing its result" in slow_exit["detail"]


@requires_jax
@pytest.mark.slow
def test_the_abstract_trainer_lowers_to_trainers_program():
  """jax_largest compiles without weights (abstract_trainer); it must be the program Trainer.build makes, or its
  sizes would be another step's. Also the grid's gradient accumulation changes only the batch's shape, so the
  compile part's executable is the train part's (the persistent cache serves it)."""
  import jax
  import numpy as np
  from benchmarks.gpu_parts import sizing
  from benchmarks.gpu_parts.common import fast_params
  from benchmarks.gpu_parts.jax_largest import abstract_trainer
  from jax_impl.step import Trainer

  def lowered(tr, shape):
    batch = jax.ShapeDtypeStruct(shape, np.uint16, sharding=tr.placement.batch_sharding())
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tr.state, tr.shardings)
    return tr.jit_step.lower(state, batch).as_text()
  for plan in ("zero0", "scan-offload"):
    r1, r8 = (sizing.grid_run(sizing.tiny_run(), plan, 64, ga) for ga in (1, 8))
    shape = (8, r1.train.micro_batch_size, r1.train.seq_len + 1)
    text = lowered(abstract_trainer(r1), shape)
    assert text == lowered(Trainer.build(r1, fast_params(r1.model)), shape), plan
    assert text == lowered(abstract_trainer(r8), shape), plan


# ----------------------------------------------------------------------------- grid arithmetic and report

def _grid_run(ga, median_s, moved, peak, status="ok"):
  return {"grad_accum": ga, "status": status, "median_s": median_s, "tokens_per_s": 4096 * ga / median_s,
          "tokens_per_step": 4096 * ga, "moved_bytes_per_step": moved, "compiled": {"device_bytes": peak}}


def test_offload_figures_are_derived_as_documented():
  from benchmarks.gpu_parts import grid
  none, off = _grid_run(1, 0.10, 0, 14e9), _grid_run(1, 0.50, 6.5e9, 10e9)
  row = grid.offload_row(none, off, host=5e9, rate_gbs=13.0)
  assert row["added_s"] == pytest.approx(0.40) and row["transfer_s"] == pytest.approx(0.5)  # 6.5 GB / 13 GB/s
  assert row["overlap"] == pytest.approx(1 - 0.40 / 0.5) and row["overlap_note"] == ""
  assert row["kept"] == pytest.approx(0.2) and row["link_bound"] == pytest.approx(0.10 / 0.5)
  assert row["achieved_of_link_bound"] == pytest.approx(0.2 / 0.2)
  assert row["mem_saved_of_host"] == pytest.approx((14e9 - 10e9) / 5e9)
  big = grid.offload_row(_grid_run(8, 0.8, 0, 14e9), _grid_run(8, 0.9, 6.5e9, 10e9), 5e9, 13.0)
  assert big["link_bound"] == 1.0 and big["overlap"] == pytest.approx(1 - 0.1 / 0.5)  # the moves fit under compute
  assert grid.overlap(-0.01, 0.5)[0] == 1.0 and "not slower" in grid.overlap(-0.01, 0.5)[1]
  assert grid.overlap(2.0, 0.5)[0] == 0.0 and "4.0x" in grid.overlap(2.0, 0.5)[1]
  assert grid.overlap(0.1, None) == (None, "no transfer time (no bytes moved or no measured rate)")
  assert grid.offload_row(none, off, 5e9, None)["transfer_s"] is None  # no rate measured: no made-up figure


def test_grid_summary_pairs_each_offload_plan_with_the_plan_without():
  from benchmarks.gpu_parts import grid
  raw = {"result": {"bandwidth": {"kind": "jax tpu (TPU v5 lite)", "jit_round_trip_donated": {"median_gbs": 13.1}}}}
  rate = grid.in_step_rate(raw)
  assert rate["gbs"] == 13.1 and "CPU" not in rate["source"] and grid.in_step_rate({"ok": False}) is None
  results = {"zero0": {"runs": [_grid_run(1, 0.1, 0, 9e9), _grid_run(8, 0.8, 0, 9.5e9)]},
             "zero2-offload-scan": {"state_bytes_by_memory_kind": {"device": 1, "pinned_host": 4e9},
                                    "runs": [_grid_run(1, 0.4, 6e9, 7e9), _grid_run(8, 1.0, 6e9, 7.5e9, "oom")]}}
  s = grid.summary(results, ["zero0", "zero2-offload-scan"], rate)
  assert s["none_plan"] == "zero0" and [(r["plan"], r["grad_accum"]) for r in s["rows"]] == [("zero2-offload-scan", 1)]
  assert s["rows"][0]["host_bytes"] == 4e9 and "zero2-offload-scan at grad accum 8: oom" in s["missing"][0]
  assert grid.offloads("scan-offload") and grid.offloads("act-offload") and not grid.offloads("zero2")
  assert grid.summary(results, ["zero2-offload-scan"], rate)["missing"] == [
      "no plan without offload in --jax-plans to compare against"]


def test_not_run_parts_are_no_failure_and_probe_errors_are():
  from benchmarks.gpu_parts import report
  data = {"records": {"torch_raw": {"ok": None, "not_run": "torch has no device"}, "jax_raw": {"ok": True},
                      "jax_largest": {"ok": True, "result": {"largest": {"zero0": {"probes": [{"status": "ok"}]}}}}}}
  assert report.failed_parts(data) == []
  data["records"]["jax_largest"]["result"]["largest"]["zero0"]["probes"].append({"status": "error"})
  data["records"]["confirm_zero0_9"] = {"ok": False, "status": "hung (timed out; XLA failure handler?)"}
  assert report.failed_parts(data) == ["confirm_zero0_9", "jax_largest probes"]


# ----------------------------------------------------------------------------- the TPU command and house rules

def test_bench_refuses_a_budget_the_install_spent_and_passes_options_on(tmp_path, monkeypatch, capsys):
  monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "tpu_parts"))
  import bench
  monkeypatch.setenv("TPU_SH_T0", "0")  # the install "started" in 1970: nothing is left
  assert bench.main(["--out", str(tmp_path), "--budget-s", "420"]) == 2
  assert "too little to measure" in capsys.readouterr().err
  a, rest = bench.parse(["--out", str(tmp_path), "--premapped-mib", "256", "--largest-budget-s", "120"])
  cmd = bench.command(a, rest, 300.0)
  assert cmd[-2:] == ["--largest-budget-s", "120"] and cmd[cmd.index("--budget-s") + 1] == "300"
  assert cmd[cmd.index("--raw-mib") + 1] == "32"  # the pinned copies must fit a 256 MiB region
  env = bench.environment(a, str(tmp_path / "cache"))
  assert env["TPU_PREMAPPED_BUFFER_SIZE"] == str(256 << 20) and env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]


def test_benchmark_files_keep_the_house_sizes():
  """No file over 500 lines, no function over 60 (docstrings not counted), in the suite's driver and parts."""
  files = [ROOT / "benchmarks" / "gpu.py", ROOT / "benchmarks" / "tpu_parts" / "bench.py", *PARTS.glob("*.py")]
  for path in files:
    tree = ast.parse(path.read_text())
    assert len(path.read_text().splitlines()) <= 500, path
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        body = node.body[1:] if ast.get_docstring(node) else node.body
        lines = node.end_lineno - (body[0].lineno if body else node.lineno) + 1
        assert lines <= 60, f"{path.name}:{node.name} is {lines} lines"


@pytest.mark.process
@pytest.mark.slow
@requires_jax
@requires_torch
def test_tiny_grid_flow_runs_every_part_on_cpu(tmp_path):
  """The TPU flow on the CPU: jax_raw's in-step rate, the largest model by compiling and its confirming run, the
  plan x accumulation grid and its offload figures, DeepSpeed recorded as not run; JSON and Markdown written."""
  proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--tiny", "--flow", "grid",
                         "--largest-plans", "zero2-offload-scan", "--budget-s", "600", "--out", str(tmp_path)],
                        capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  data = json.loads((tmp_path / "gpu.json").read_text())
  rec = data["records"]
  assert rec["deepspeed"]["ok"] is None and rec["deepspeed"]["not_run"]
  assert rec["jax_raw"]["result"]["bandwidth"]["jit_round_trip_donated"]["median_gbs"] > 0
  for plan in ("zero0", "zero2-offload-scan"):
    runs = rec[f"grid_{plan}"]["result"]["runs"]
    assert [r["grad_accum"] for r in runs] == [1, 2] and all(r["status"] == "ok" for r in runs)
    assert all(r["tokens_per_s"] > 0 and r["compiled"]["peak_bytes"] > 0 for r in runs)
  rows = rec["grid_summary"]["rows"]
  assert [r["grad_accum"] for r in rows] == [1, 2] and all(r["moved_bytes_per_step"] > 0 for r in rows)
  assert all(r["transfer_s"] > 0 and 0 <= r["overlap"] <= 1 for r in rows)
  probes = rec["jax_largest"]["result"]["largest"]["zero2-offload-scan"]["probes"]
  assert probes[0]["status"] == "ok" and probes[0]["compile_s"] > 0 and probes[0]["peak_bytes"] > 0
  confirm = rec["confirm_zero2-offload-scan_2"]
  assert confirm["status"] == "ok" and confirm["result"]["n"] == 2
  md = (tmp_path / "gpu.md").read_text()
  for heading in ("Train grid", "Offload cost and overlap (grid)", "Largest model by compiling", "Parts not run"):
    assert heading in md


def _driver():
  import importlib.util
  spec = importlib.util.spec_from_file_location("gpu_driver", ROOT / "benchmarks" / "gpu.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.mark.parametrize("argv, words", [
    (["--grad-accum", "1,x"], "--grad-accum '1,x': whole numbers > 0"),
    (["--jax-plans", "zero0,zero9"], "--jax-plans 'zero0,zero9': unknown plan 'zero9'"),
    (["--largest-plans", ""], "--largest-plans '': give at least one value"),
    (["--model", "gpt5"], "--model: model 'gpt5': not in parity.hf.MODEL_PRESETS"),
    (["--micro-tokens", "1000"], "--micro-tokens 1000: must be a multiple of --model gpt2-1.5b's sequence length 1024"),
    (["--raw-mib", "-1"], "--mib must be > 0"),
    (["--sides", "jax,torch"], "--sides 'jax,torch': unknown torch; choose from jax, deepspeed, fsdp"),
])
def test_bad_options_exit_2_naming_the_option(argv, words, capsys):
  with pytest.raises(SystemExit) as exc:
    _driver().parse_args(argv)
  assert exc.value.code == 2 and words in capsys.readouterr().err


def test_options_take_the_grid_defaults():
  args = _driver().parse_args([])
  assert (args.jax_plans, args.grad_accum, args.micro_tokens) == (["zero0", "zero2-offload-scan"], [1, 8], 4096)
  assert args.largest_plans == ["zero0", "zero2-offload-scan", "scan-offload"] and args.largest_budget_s == 240
  assert (args.flow, args.largest_fit_by, args.model) == ("auto", "sum", "gpt2-1.5b")
  assert args.sides == ["jax", "deepspeed", "fsdp"] and not args.budget_given  # the fixed flow: 240 s a side
  tiny = _driver().parse_args(["--tiny", "--model", "gpt2-124m", "--raw-mib", "4"])
  assert (tiny.grad_accum, tiny.micro_tokens, tiny.mib) == ([1, 2], 64, 4)


def test_the_grid_depth_is_the_compiled_checks_or_an_honest_fallback():
  from benchmarks.gpu_parts.grid_flow import grid_depth_choice
  checked = {"grid": {"depth": 9, "stopped": "the prediction fits", "probes": []}}
  assert grid_depth_choice(checked, 11, ["model"]) == (9, "compiled: every grid plan fits at 9 layers (the "
                                                           "prediction fits)")
  refused = {"grid": {"depth": 0, "stopped": "probe cap or time reached",
                      "probes": [{"n_layers": 11, "status": "oom"}]}}
  depth, how = grid_depth_choice(refused, 11, ["model"])
  assert depth == 5 and how.startswith("unchecked: half of 11 layers")
  assert grid_depth_choice({}, 11, ["model"]) == (11, "the memory model's (11 layers): not checked by compiling")
  assert grid_depth_choice({}, 2, [])[1].startswith("the preset's")
  from benchmarks.gpu_parts import grid
  partial = {"ok": False, "partial": {"bandwidth": {"kind": "x", "jit_round_trip_donated": {"median_gbs": 9.0}}}}
  assert grid.in_step_rate(partial)["gbs"] == 9.0  # the part overran in its matmuls: its bandwidth is kept


def test_the_suites_host_memory_is_the_smaller_of_memavailable_and_the_cgroup_headroom(monkeypatch):
  """A sandbox's cgroup can allow less than the VM's MemAvailable (40 GiB under 45 on a TPU VM): probes are sized
  by what this process may use."""
  from benchmarks.gpu_parts import device
  from parity.sizing import host_limits
  GiB = 2**30
  cg = {"limit_bytes": 40 * GiB, "usage_bytes": 30 * GiB, "inactive_file_bytes": 0}
  monkeypatch.setattr(host_limits, "host_memory", lambda: host_limits.HostMemory(29 * GiB, cg))
  facts = device.host_facts()
  assert facts["host_available_bytes"] == 10 * GiB and facts["host_memory"]["mem_available_bytes"] == 29 * GiB
  monkeypatch.setattr(host_limits, "host_memory", lambda: host_limits.HostMemory(29 * GiB, None))
  assert device.host_facts()["host_available_bytes"] == 29 * GiB
  assert device.host_facts(host_gib=3)["host_available_bytes"] == 3 * GiB
