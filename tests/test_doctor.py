"""`parity doctor`, the environment block every run records, and the CPU-fallback refusal on CUDA machines."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata

import pytest

from conftest import ROOT, requires_all, requires_torch
from harness import backend, doctor
from parity import environment
from parity.pipeline.folder import ENVIRONMENT_FILE


@pytest.mark.process
@pytest.mark.slow
@requires_all
def test_doctor_json_runs_both_probes(tmp_path):
  """The real command, full mode (bandwidth included): ~18 s with a load of 7 on 2 cores, mostly the two imports."""
  out = tmp_path / "env.json"
  done = subprocess.run([sys.executable, "-m", "parity.cli", "doctor", "--json", str(out)], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr
  assert "parity doctor" in done.stdout and "DeepSpeed CPU Adam op" in done.stdout
  b = json.loads(out.read_text())
  assert b["schema"] == doctor.SCHEMA and b["quick"] is False
  assert b["packages"]["jax"] == metadata.version("jax") and b["packages"]["torch"] == metadata.version("torch")
  assert b["host"]["cpu_cores_logical"] >= 1 and b["host"]["python"] == ".".join(map(str, sys.version_info[:3]))
  assert re.fullmatch(r"[0-9a-f]{40}", b["git"]["commit"]) and isinstance(b["git"]["dirty"], bool)
  jx, tc = b["frameworks"]["jax"], b["frameworks"]["torch"]
  assert "error" not in jx and "error" not in tc, (jx, tc)
  assert jx["jax"] == metadata.version("jax") and jx["devices"] and jx["backend"] == jx["devices"][0]["platform"]
  # the offload plans need pinned_host; the CPU backend accepts it (README): the doctor must say so
  assert jx["memory_kinds"]["accepted"].get("pinned_host") is True
  bw = jx["bandwidth"]
  assert bw["bytes"] == 64 * 2**20 and all(bw[k] > 0 for k in ("numpy_to_device", "device_to_pinned_host",
                                                                "pinned_host_to_device"))
  assert tc["torch"] == metadata.version("torch") and tc["cuda_available"] is (tc["devices"] != [])
  assert tc["cpu_adam"]["state"] in ("loads", "not built"), tc["cpu_adam"]
  if not tc["cuda_available"]:
    assert tc["bandwidth"]["host_to_device_pinned"] == "n/a: no CUDA device"


@requires_torch
def test_cpu_adam_not_built_is_reported_never_built(tmp_path, monkeypatch):
  """An empty TORCH_EXTENSIONS_DIR: 'not built' with the build-ops hint, and nothing is started or created there."""
  monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
  from torch_impl.doctor import cpu_adam_state
  state = cpu_adam_state()
  assert state["state"] == "not built" and "parity build-ops" in state["detail"]
  assert list(tmp_path.iterdir()) == []


def test_environment_block_quick_starts_no_probe_without_cuda(monkeypatch):
  """What every run pays on a machine without a driver: no framework probe (its backend is recorded as inferred)."""
  monkeypatch.setattr(environment, "cuda_evidence", lambda files=(): None)
  monkeypatch.setattr(doctor, "probe_frameworks", lambda *a, **k: pytest.fail("probed in quick mode without CUDA"))
  b = doctor.environment_block(quick=True)
  assert b["frameworks"]["jax"]["backend"] == "cpu" and "inferred" in b["frameworks"]["jax"]["how"]
  assert b["packages"]["numpy"] == metadata.version("numpy") and b["cuda_driver"] is None
  assert b["host"]["load_average"] is None or len(b["host"]["load_average"]) == 3
  json.dumps(b)  # JSON-able as is


def test_cuda_evidence_reads_driver_files(tmp_path):
  assert environment.cuda_evidence((str(tmp_path / "nvidia0"),)) is None
  (tmp_path / "nvidia0").touch()
  assert environment.cuda_evidence((str(tmp_path / "nvidia0"),)) == f"{tmp_path / 'nvidia0'} exists"


def test_git_revision_reads_head_without_git():
  if not (ROOT / ".git").exists():
    pytest.skip("not a git checkout (an exported tree): nothing to read")
  rev = environment.git_revision(ROOT)
  head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
  assert rev["commit"] == head


def test_numa_nodes_from_sysfs(tmp_path):
  (tmp_path / "node1").mkdir()
  (tmp_path / "node1" / "cpulist").write_text("8-15\n")
  (tmp_path / "node1" / "meminfo").write_text("Node 1 MemTotal:       1024 kB\n")
  assert environment.numa_nodes(str(tmp_path)) == [{"node": 1, "cpus": "8-15", "mem_total_bytes": 1024 * 1024}]
  assert environment.numa_nodes(str(tmp_path / "absent")) is None


# --- the CPU-fallback refusal, with the detection and probes faked ---------------------------------------------

JAX_GPU = {"jax": "0.11.2", "backend": "gpu", "platforms": {"cuda": "1 device(s)"}}
JAX_CPU = {"jax": "0.10.2", "backend": "cpu",
           "platforms": {"cuda": "unavailable: Unknown backend cuda. Available backends are ['cpu']"}}
TORCH_GPU = {"torch": "2.11.0", "built_for_cuda": "13.0", "cuda_available": True}
TORCH_CPU_BUILD = {"torch": "2.13.0+cpu", "built_for_cuda": None, "cuda_available": False}


def _fake(monkeypatch, probes, evidence="/dev/nvidia0 exists"):
  asked = []
  monkeypatch.setattr(backend, "cuda_present", lambda: evidence)
  monkeypatch.setattr(backend, "probe_devices", lambda fws: asked.append(tuple(fws)) or {f: probes[f] for f in fws})
  monkeypatch.delenv(backend.ALLOW_CPU_ENV, raising=False)
  return asked


def test_no_cuda_probes_nothing(monkeypatch):
  asked = _fake(monkeypatch, {}, evidence=None)
  assert backend.check_backends(["jax", "deepspeed", "torch"]) is None and asked == []


def test_jax_without_plugin_is_refused_naming_the_extra(monkeypatch):
  asked = _fake(monkeypatch, {"jax": JAX_CPU, "torch": TORCH_GPU})
  with pytest.raises(backend.CpuFallbackError) as e:
    backend.check_backends(["jax", "deepspeed", "torch"])
  msg = str(e.value)
  assert asked == [("jax", "torch")]
  assert "/dev/nvidia0" in msg and "jax side would run on the CPU" in msg and "pip install -e '.[cuda]'" in msg
  assert "jax[cuda13]==0.10.2" in msg and "--allow-cpu" in msg
  assert "deepspeed/torch sides" not in msg  # torch sees its GPU: only jax is named


def test_cpu_only_torch_is_refused_naming_a_cuda_build(monkeypatch):
  _fake(monkeypatch, {"jax": JAX_GPU, "torch": TORCH_CPU_BUILD})
  with pytest.raises(backend.CpuFallbackError, match=r"torch 2\.13\.0\+cpu is a CPU-only build.*download\.pytorch"):
    backend.check_backends(["jax", "torch"])


def test_installed_plugin_that_fails_is_named(monkeypatch):
  _fake(monkeypatch, {"jax": {**JAX_CPU, "platforms": {"cuda": "unavailable: CUDA driver version is insufficient"}}})
  monkeypatch.setattr(backend.environment, "package_versions", lambda: {"jax-cuda13-plugin": "0.10.2"})
  with pytest.raises(backend.CpuFallbackError, match="has jax-cuda13-plugin 0.10.2 installed.*driver version"):
    backend.check_backends(["jax"])


def test_allow_cpu_runs_and_records_the_fallback(monkeypatch):
  _fake(monkeypatch, {"jax": JAX_CPU, "torch": TORCH_CPU_BUILD})
  got = backend.check_backends(["jax", "torch"], allow_cpu=True)
  assert got["allowed_cpu"] is True and len(got["cpu_fallback"]) == 2
  monkeypatch.setenv(backend.ALLOW_CPU_ENV, "1")
  assert backend.check_backends(["jax", "torch"])["allowed_cpu"] is True


def test_gpu_sides_pass_and_only_needed_frameworks_are_probed(monkeypatch):
  asked = _fake(monkeypatch, {"jax": JAX_GPU, "torch": TORCH_GPU})
  assert backend.check_backends(["deepspeed", "torch"])["cpu_fallback"] == [] and asked == [("torch",)]


def test_compare_refuses_with_exit_2_before_the_run_folder(monkeypatch, tmp_path, capsys):
  """The CLI path: exit 2, one line naming the package, no run folder; --allow-cpu gets past the check."""
  from parity.cli import main
  _fake(monkeypatch, {"jax": JAX_CPU, "torch": TORCH_GPU})
  out = tmp_path / "run"
  assert main(["compare", "--preset", "gpt2-tiny", "--steps", "2", "--sides", "jax,torch", "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert err.startswith("parity compare: error: CUDA is present") and "pip install -e '.[cuda]'" in err
  assert not out.exists()


def test_run_folder_gets_environment_json_before_any_side(monkeypatch, tmp_path):
  """run_comparison writes environment.json (quick block + run_id) before the sides start."""
  from parity.pipeline import compare as pipeline
  from parity.pipeline.resolve import resolve_run

  class Stop(Exception):
    pass

  seen = {}

  def no_sides(sides, start, on_interrupt):
    seen.update(json.loads((tmp_path / "run" / ENVIRONMENT_FILE).read_text()))
    raise Stop

  monkeypatch.setattr(pipeline.runner, "run_each_side", no_sides)
  _fake(monkeypatch, {"jax": JAX_CPU, "torch": TORCH_GPU}, evidence=None)
  with pytest.raises(Stop):
    pipeline.run_comparison(resolve_run("gpt2-tiny", steps=2), pipeline.RunOptions(out=tmp_path / "run"))
  lock_free = not (tmp_path / "run" / ".parity.lock").exists()
  assert seen["schema"] == doctor.SCHEMA and seen["run_id"] and seen["quick"] is True and lock_free
  assert seen["packages"]["numpy"] == metadata.version("numpy")


def test_run_environment_records_what_the_check_saw(monkeypatch):
  """With a driver, a run's block carries the check's probes (no second probe) and the fallback it allowed."""
  monkeypatch.setattr(doctor, "probe_frameworks", lambda *a, **k: pytest.fail("probed twice"))
  devices = {"cuda_driver": "/dev/nvidia0 exists", "frameworks": {"jax": JAX_CPU, "torch": TORCH_GPU},
             "cpu_fallback": ["the jax side would run on the CPU"], "allowed_cpu": True}
  b = doctor.run_environment(devices)
  assert b["frameworks"] == {"jax": JAX_CPU, "torch": TORCH_GPU} and b["allowed_cpu"] is True
  assert b["cpu_fallback"] == ["the jax side would run on the CPU"] and b["quick"] is True


def test_doctor_json_refuses_an_existing_file_without_force(tmp_path, capsys):
  """--json FILE never overwrites a file it did not just create: exit 2 naming the file and --force, before any
  probe starts (the file is left as it was)."""
  from parity.cli import main
  existing = tmp_path / "report.json"
  existing.write_text("the user's file")
  assert main(["doctor", "--quick", "--json", str(existing)]) == 2
  err = capsys.readouterr().err
  assert str(existing) in err and "--force" in err
  assert existing.read_text() == "the user's file"


# --- host limits: the pool, the cgroup limit and MemAvailable, with faked probes -------------

POOL = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"


def _limits_block(tmp_path, environ, jax_probe):
  """An environment block whose host limits come from fake files (cgroup v2: 8 GiB limit, 3 GiB used of which 1 GiB
  inactive file; MemAvailable 20 GiB) and `environ`, with `jax_probe` as the jax framework's probe result."""
  cg = tmp_path / "cg" / "job"
  cg.mkdir(parents=True)
  (tmp_path / "self").write_text("0::/job\n")
  (cg / "memory.max").write_text(str(8 * 2**30))
  (cg / "memory.current").write_text(str(3 * 2**30))
  (cg / "memory.stat").write_text(f"inactive_file {2**30}\n")
  (tmp_path / "meminfo").write_text("MemAvailable: 20971520 kB\n")
  hl = doctor.host_limits_block(environ, root=str(tmp_path / "cg"), self_cgroup=str(tmp_path / "self"),
                                meminfo=str(tmp_path / "meminfo"))
  return {"host_limits": hl, "frameworks": {"jax": jax_probe}, "numerics_flags": {"values": {"JAX_REMAT3": "1"}}}


def test_doctor_shows_the_pool_per_gpu_with_a_faked_gpu_probe(tmp_path):
  from parity.cli.doctor import host_rows
  rows = dict(host_rows(_limits_block(tmp_path, {POOL: "160"}, JAX_GPU)))
  assert rows["jax pinned-host pool"] == (f"160 GiB per GPU ({POOL}=160); applies to this jax's GPU devices, one "
                                          "pool each")
  assert rows["host memory"] == (f"MemAvailable 20.0 GiB; cgroup v2 {tmp_path / 'cg' / 'job'}: limit 8.0 GiB, "
                                 "working set 3.0 GiB less inactive file 1.0 GiB, headroom 6.0 GiB; a run may use "
                                 "6.0 GiB")
  assert rows["numerics flags"] == "JAX_REMAT3=1"
  rows = dict(host_rows(_limits_block(tmp_path / "b", {}, JAX_GPU)))
  assert rows["jax pinned-host pool"].startswith(f"64 GiB per GPU (XLA's default; {POOL} not set)")


def test_doctor_says_the_pool_applies_to_gpu_backends_on_a_cpu_jax(tmp_path):
  from parity.cli.doctor import host_rows, rows
  block = _limits_block(tmp_path, {}, JAX_CPU)
  text = dict(host_rows(block))["jax pinned-host pool"]
  assert text.endswith("jax here runs on cpu: the pool applies to GPU backends only")
  bad = dict(host_rows(_limits_block(tmp_path / "b", {POOL: "64GB"}, JAX_CPU)))["jax pinned-host pool"]
  assert bad.startswith(f"INVALID: {POOL}='64GB'") and "whole number of GiB" in bad
  full = doctor.environment_block(quick=True, frameworks={"jax": JAX_GPU, "torch": TORCH_GPU})
  assert {"jax pinned-host pool", "host memory", "numerics flags"} <= {k for k, _ in rows(full)}
  assert full["host_limits"]["xla_pool"]["variable"] == POOL and "numerics_flags" in full
  json.dumps(full)


def test_a_runs_environment_records_the_jax_workers_pool(monkeypatch):
  """environment.json (run_environment with the run's spec) records the pool the runner gives the JAX worker, and
  the same value under numerics_flags."""
  import dataclasses
  from parity.hf import MODEL_PRESETS
  from parity.sizing.plans import PLANS
  from parity.spec import RunSpec, TrainSpec
  monkeypatch.delenv(POOL, raising=False)
  monkeypatch.setattr(doctor, "probe_frameworks", lambda *a, **k: pytest.fail("probed"))
  run = RunSpec(model=MODEL_PRESETS["llama-7b"], train=TrainSpec(micro_batch_size=1, seq_len=2048, precision="bf16"),
                jax=PLANS["scan-offload"].jax, deepspeed=PLANS["scan-offload"].deepspeed)
  devices = {"frameworks": {"jax": JAX_GPU, "torch": TORCH_GPU}, "cpu_fallback": [], "allowed_cpu": False}
  b = doctor.run_environment(devices, run, {"jax": {"kill_at_step": 1}})
  assert b["host_pool"]["jax"]["value"] == "80" and b["host_pool"]["jax"]["set_by"] == "parity"
  assert b["numerics_flags"]["values"][POOL] == "80" and b["numerics_flags"]["set_by"][POOL] == "parity"
  tiny = doctor.run_environment(devices, dataclasses.replace(run, sides=("torch",)))
  assert "host_pool" not in tiny and tiny["numerics_flags"]["values"][POOL] is None
