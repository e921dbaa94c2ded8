"""JAX plans on a 4-device mesh (ZeRO stages 1-3, FSDP, with host offload): parity with one device.

The forced CPU device count must be set before jax is imported, so the plans run in a spawned
process (`python tests/test_jax_plans_mesh.py`, this file's __main__) with
XLA_FLAGS=--xla_force_host_platform_device_count=4; it prints one JSON report that the tests read.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("jax")

REPO = Path(__file__).resolve().parents[1]
N_DEV = 4
PLANS = {
    "ref": dict(offload_opt_state=False),
    "z1": dict(zero_stage=1, data_parallel=N_DEV, offload_opt_state=False),
    "z2_off": dict(zero_stage=2, data_parallel=N_DEV),
    "z3": dict(zero_stage=3, data_parallel=N_DEV, offload_opt_state=False),
    "z3_off_all_scan": dict(zero_stage=3, data_parallel=N_DEV, offload_params=True, scan_layers=True,
                            remat="offload_names"),
    "dp_only": dict(zero_stage=0, data_parallel=N_DEV),
}
"""Plan name -> JaxPlan fields; `ref` runs on one device."""
STEPS = 3


def _leaf_report(trainer) -> list[dict]:
  """Every state leaf: group, shape, partition spec, memory kind, expected spec and kind."""
  import jax
  from jax.sharding import PartitionSpec as P
  from parity.sizing.memory_jax import shard_axis
  pl = trainer.placement
  rows = []
  for group, tree in trainer.state._asdict().items():
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
      stacked = any(getattr(k, "key", None) == "h" for k in path)
      axis = shard_axis(x.shape, pl.mesh.size, skip_leading=stacked) if pl.sharded(group) else None
      want = P() if axis is None else P(*([None] * axis), "data")
      rows.append({"group": group, "path": jax.tree_util.keystr(path), "shape": list(x.shape),
                   "spec": str(x.sharding.spec), "want_spec": str(want),
                   "kind": x.sharding.memory_kind, "want_kind": pl.kind(group)})
  return rows


def probe() -> dict:
  """Trains every plan for STEPS steps on the same weights and batches; returns the JSON report."""
  import jax
  from parity.sizing.memory_jax import jax_state_bytes
  from parity.spec import JaxPlan, ModelSpec, RunSpec, TrainSpec
  from parity.weights import init_params
  from jax_impl import offload
  from jax_impl.placement import placement_record
  from jax_impl.step import Trainer
  model = ModelSpec(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)
  train = TrainSpec(steps=STEPS, micro_batch_size=4, grad_accum_steps=2, seq_len=8, warmup_steps=1, lr=1e-2,
                    eval_every=0)
  batches = np.random.default_rng(0).integers(0, 64, (STEPS, 2, 4, 9)).astype(np.uint16)
  out = {"devices": len(jax.devices()), "plans": {}}
  for name, fields in PLANS.items():
    run = RunSpec(model=model, train=train, jax=JaxPlan(**fields)).validate()
    t = Trainer.build(run, init_params(model, 0))
    t.compile(batches.shape[1:], None)
    losses = [t.step(b)["loss"] for b in batches]
    dev0 = t.placement.mesh.devices.flat[0]
    out["plans"][name] = {"losses": losses, "leaves": _leaf_report(t), "mesh": int(t.placement.mesh.size),
                          "measured": offload.bytes_by_memory_kind(t.state, dev0),
                          "predicted": jax_state_bytes(run), "evidence": t.offload_evidence(),
                          "params": {k: v.tolist() for k, v in t.canonical_params().items()},
                          "placement": placement_record(t)}
  return out


@pytest.fixture(scope="module")
def report() -> dict:
  env = dict(os.environ, PYTHONPATH=str(REPO), XLA_FLAGS=f"--xla_force_host_platform_device_count={N_DEV}")
  proc = subprocess.run([sys.executable, str(Path(__file__))], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.process
def test_mesh_has_the_plan_devices(report):
  assert report["devices"] == N_DEV
  assert {n: p["mesh"] for n, p in report["plans"].items()} == {n: f.get("data_parallel", 1) for n, f in PLANS.items()}


@pytest.mark.process
@pytest.mark.parametrize("name", [n for n in PLANS if n != "ref"])
def test_loss_equals_one_device(report, name):
  ref, got = report["plans"]["ref"], report["plans"][name]
  np.testing.assert_allclose(got["losses"], ref["losses"], rtol=0, atol=2e-6, err_msg=name)
  for k, v in ref["params"].items():
    np.testing.assert_allclose(got["params"][k], v, rtol=0, atol=2e-5, err_msg=f"{name}: {k}")


@pytest.mark.process
@pytest.mark.parametrize("name", list(PLANS))
def test_every_leaf_has_the_planned_sharding_and_memory_kind(report, name):
  leaves = report["plans"][name]["leaves"]
  bad = [r for r in leaves if r["spec"] != r["want_spec"] or r["kind"] != r["want_kind"]]
  assert not bad, bad[:5]
  stage = PLANS[name].get("zero_stage", 0)
  sharded = {g for g in ("params", "opt_state") if any("data" in r["spec"] for r in leaves if r["group"] == g)}
  assert sharded == ({"opt_state"} if stage in (1, 2) else {"params", "opt_state"} if stage == 3 else set())


@pytest.mark.process
@pytest.mark.parametrize("name", list(PLANS))
def test_predicted_state_bytes_per_device_are_exact(report, name):
  p = report["plans"][name]
  assert p["predicted"] == p["measured"], name


@pytest.mark.process
def test_sharded_offload_moves_one_shard_per_device(report):
  """Compiled entry buffers in S(5) are per-device shards: ZeRO-3 moves 1/4 of the sharded params."""
  ev = report["plans"]["z3_off_all_scan"]["evidence"]
  params_bytes = report["plans"]["z3_off_all_scan"]["predicted"]
  assert ev["offload_params"]["host_to_device_bytes"] > 0
  moved_in = ev["offload_params"]["host_to_device_bytes"] + ev["offload_opt_state"]["host_to_device_bytes"]
  moved_out = ev["offload_params"]["device_to_host_bytes"] + ev["offload_opt_state"]["device_to_host_bytes"]
  assert moved_out == params_bytes["pinned_host"]
  assert moved_in == params_bytes["pinned_host"] - 4  # jit prunes the clip's previous norm: never read
  assert ev["jaxpr_device_puts"]["to_host"] > 0  # activation offload, visible only in the jaxpr on CPU


@pytest.mark.process
def test_zero3_fsdp4_placement_from_the_compiled_program(report):
  """PLANS['zero3-fsdp4'] is the `z3` plan here: everything in device memory, per-device (1/4) bytes in the entry
  layout (tests/test_placement_plans.py asserts the one-device plans)."""
  from parity.sizing.plans import PLANS as PAIRS
  from parity.spec import JaxPlan
  assert JaxPlan(**PLANS["z3"]) == PAIRS["zero3-fsdp4"].jax
  rec = report["plans"]["z3"]["placement"]
  assert {(r["class"], r["role"]): r["memory_space"] for r in rec["classes"]} == {
      ("params", "argument"): "device", ("opt_state", "argument"): "device", ("batch", "argument"): "device",
      ("params", "result"): "device", ("opt_state", "result"): "device", ("metrics", "result"): "device"}
  assert rec["mismatches"] == [] and rec["plan"]["data_parallel"] == N_DEV
  state_out = sum(r["bytes"] for r in rec["classes"] if r["role"] == "result" and r["class"] != "metrics")
  assert state_out == report["plans"]["z3"]["predicted"]["device"]  # per device: the shards, not the whole state


@pytest.mark.process
@pytest.mark.slow
def test_cli_runs_a_sharded_plan_and_the_worker_forces_the_devices(tmp_path):
  """`parity compare --set jax.data_parallel=4 --set jax.zero_stage=3`: the worker reads the request
  and sets the forced CPU device count itself (no XLA_FLAGS from the caller)."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, "-m", "parity.cli", "compare", "--preset", "gpt2-tiny", "--sides", "jax",
                         "--steps", "3", "--set", f"jax.data_parallel={N_DEV}", "--set", "jax.zero_stage=3",
                         "--determinism-steps", "0",
                         "--out", str(tmp_path / "run")], cwd=REPO, env=dict(env, PYTHONPATH=str(REPO)),
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  from parity.sizing.memory_jax import jax_state_bytes
  from parity.spec import RunSpec, from_dict
  summary = json.loads((tmp_path / "run" / "jax" / "summary.json").read_text())
  run = from_dict(RunSpec, json.loads((tmp_path / "run" / "request.json").read_text())["run"])
  assert summary["mesh_devices"] == N_DEV and summary["status"] == "ok"
  assert summary["state_shardings"]["params"]["replicated"] == 0
  assert summary["state_bytes_by_memory_kind"] == jax_state_bytes(run)


if __name__ == "__main__":
  print(json.dumps(probe()))
