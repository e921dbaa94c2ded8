"""placement.json: the GPU HLO transfer parser on a hand-written XLA:GPU module, the
mismatch rules, the one-side 'placement' check and how collect and the report carry it, the planted mismatch's
refusals, and one end-to-end `parity compare` with the plant FAILing naming the class. The placement of every JAX
plan from its compiled program: tests/test_placement_plans*.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parity.report.run_record import RunRecord

from parity.pipeline.collect import placement_entry
from parity.pipeline.plants import check_plants
from parity.protocol.placement import PLACEMENT_FILE, read_placement, write_placement, writes_placement
from parity.report.check_table import check_rows, metric_rows
from parity.sizing.plans import apply_plan
from parity.spec import RunSpec, SpecError
from parity.verdict.placement import placement_check
from parity.verdict.sides import METRIC_ORDER, verdict
from parity.verdict.steps import completion_check

from conftest import requires_jax

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "hlo" / "gpu_offload_step.hlo"
LABELS = dict(arg_names=["params/w", "opt_state/mu/w", "params/h", "batch"],
              arg_classes=["params", "opt_state", "params", "batch"],
              result_names=["params/w", "opt_state/mu/w", "params/h", "metrics/loss"],
              result_classes=["params", "opt_state", "params", "metrics"])
PINNED = {"host_memory_kind": "pinned_host", "offload_opt_state": True, "offload_params": False, "remat": "none"}


def _row(cls, role, n, host, expected):
  space = "host" if host == n else "device" if host == 0 else "mixed"
  return {"class": cls, "role": role, "buffers": n, "host_buffers": host, "bytes": 4 * n, "host_bytes": 4 * host,
          "memory_space": space, "expected": expected, "pruned": 0}


def _acts(expected="device", by_policy=0, copies=None):
  return {"policy": "none", "expected": expected, "jaxpr_to_host": by_policy, "jaxpr_to_device": 0,
          "jaxpr_to_host_by_policy": by_policy, "compiled_to_host_copies": copies}


# ----------------------------------------------------------------------------- the HLO parser (jax_impl, no jax)


@requires_jax
def test_gpu_hlo_transfers_bytes_direction_tensor_and_window():
  from jax_impl import hlo_transfers as hlo
  text = FIXTURE.read_text()
  args, results = hlo.layout_buffers(text)
  assert args == [(1024, 0), (1024, 5), (2048, 5), (256, 0)] and results[1] == (1024, 5)
  got = hlo.transfers(text, **LABELS)
  assert got["scheduled"] is True
  rows = [(c["op"], c["direction"], c["bytes"], c["tensor"], c["class"], c["computation"], c["window_ops"],
           c["window_compute_ops"], c["times_per_step"]) for c in got["copies"]]
  assert rows == [
      # the scan streams the host-resident layer stack in, one [16,16] slice per iteration (2 iterations)
      ("dynamic-slice", "h2d", 1024, "params/h", "params", "region_body.8", 1, 1, 2),
      # a residual written to the host stack XLA allocated (AllocateBuffer): no state buffer, its op_name names it
      ("dynamic-update-slice", "d2h", 256, "jit(train_step)/while/body/mlp_hidden", None, "region_body.8", 1, 1, 2),
      # the Adam moment in: its window holds the whole loop (the while and two fusions count as compute)
      ("copy", "h2d", 1024, "opt_state/mu/w", "opt_state", "main.42", 10, 2, 1),
      # the residual read back, printed without the sugar (async-start, calls=%async_wrapped_ds)
      ("dynamic-slice", "h2d", 256, "jit(train_step)/transpose(jvp(while))/body/mlp_hidden", None, "main.42", 2, 1, 1),
      # the new moment out: traced forward into the ROOT tuple, entry result 1
      ("copy", "d2h", 1024, "opt_state/mu/w", "opt_state", "main.42", 1, 1, 1),
  ]
  assert [(c["start"], c["done"]) for c in got["copies"]][2] == (4, 15)
  assert hlo.host_compute(text, LABELS["arg_names"], LABELS["arg_classes"]) == []  # AllocateBuffer computes nothing


@requires_jax
def test_gpu_hlo_host_compute_and_unnamed_parameters():
  from jax_impl import hlo_transfers as hlo
  text = FIXTURE.read_text().replace(
      "  %copy-start = (f32[16,16]{1,0}",
      "  %add.99 = f32[16,16]{1,0:S(5)} add(%p1, %p1), metadata={op_name=\"jit(train_step)/add\"}\n"
      "  %copy-start = (f32[16,16]{1,0}")
  ops = hlo.host_compute(text, LABELS["arg_names"], LABELS["arg_classes"])
  assert ops == [{"name": "add.99", "opcode": "add", "computation": "main.42", "bytes": 1024,
                  "tensor": "opt_state/mu/w", "class": "opt_state", "host_marked": False}]
  unnamed = hlo.transfers(text)["copies"]  # no labels: the parameter's op_name metadata names it
  assert unnamed[0]["tensor"] == "state.params['h']" and unnamed[0]["class"] is None


@requires_jax
def test_bytes_per_step_from_the_copies_and_an_unknown_trip_count():
  from jax_impl import hlo_transfers as hlo
  from jax_impl.placement import _bytes_per_step
  text = FIXTURE.read_text()
  args, results = hlo.layout_buffers(text)
  copies = hlo.transfers(text, **LABELS)["copies"]
  got = _bytes_per_step(copies, True, args, results)
  assert got == {"h2d": 2 * 1024 + 1024 + 256, "d2h": 2 * 256 + 1024, "source": "compiled HLO copies",
                 "entry_h2d": 1024 + 2048, "entry_d2h": 1024 + 2048}
  no_count = hlo.transfers(text.replace(', backend_config={"known_trip_count":{"n":"2"}}', ""), **LABELS)["copies"]
  assert _bytes_per_step(no_count, True, args, results)["h2d"] is None  # never a guess
  assert _bytes_per_step([], False, args, results)["source"] == "entry layout host buffers"


# ----------------------------------------------------------------------------- mismatches and the check


@requires_jax
def test_mismatches_name_the_class_both_ways_and_the_residuals():
  from parity.spec import JaxPlan
  from jax_impl.placement import plan_mismatches
  plan = JaxPlan(offload_opt_state=True, remat="offload_names")
  rows = [_row("params", "argument", 4, 2, "device"), _row("opt_state", "argument", 37, 0, "host"),
          _row("batch", "argument", 1, 0, "device")]
  out = plan_mismatches(rows, _acts("host", 0), [], plan, "cpu")
  assert [(m["class"], m["role"], m["expected"], m["compiled"]) for m in out] == [
      ("params", "argument", "device", "mixed"), ("opt_state", "argument", "host", "device"),
      ("activations", "residuals", "host", "device")]
  assert out[1]["detail"] == ("plan jax.offload_opt_state puts opt_state in pinned_host; the compiled step takes 37 of "
                              "37 buffers in device memory")
  assert out[0]["buffers"] == {"mismatched": 2, "of": 4} and "takes 2 of 4 buffers in host memory" in out[0]["detail"]
  assert plan_mismatches(rows[2:], _acts("host", 5), [], plan, "cpu") == []
  gpu = plan_mismatches(rows[2:], _acts("host", 5, copies=0), [], plan, "gpu")  # the jaxpr moves, the HLO does not
  assert [m["class"] for m in gpu] == ["activations"] and "0 host-bound copies in the HLO" in gpu[0]["detail"]
  ops = [{"name": "add.9", "opcode": "add", "bytes": 4096, "tensor": "t", "class": "opt_state"},
         {"name": "add.10", "opcode": "add", "bytes": 8, "tensor": "count", "class": "opt_state"}]  # a scalar: listed
  stray = plan_mismatches([], _acts("device", 3), ops, JaxPlan(), "gpu")
  assert [(m["class"], m["compiled"]) for m in stray] == [("activations", "host"), ("opt_state", "host")]


def test_the_placement_check_fails_at_step_0_naming_the_class_and_both_spaces():
  mm = [{"class": "opt_state", "role": r, "expected": "host", "compiled": "device",
         "buffers": {"mismatched": n, "of": n}, "detail": "..."} for r, n in (("argument", 58), ("result", 59))]
  rec = {"plan": PINNED, "classes": [], "mismatches": mm}
  c = placement_check("jax", {"record": rec, "problem": None}, "ok")
  assert not c.passed and c.gating and c.first_failing_step == 0 and c.worst == "opt_state" and c.value == 2
  assert c.detail == ("placement: opt_state planned pinned_host, compiled in device memory "
                      "(58/58 buffers in, 59/59 buffers out)")
  assert c.name == "placement jax" and c.sides == ("jax",) and c.metric == "placement"
  assert METRIC_ORDER["semantics"] < METRIC_ORDER["placement"] < METRIC_ORDER["completed"]


def test_a_missing_record_is_not_run_and_a_crashed_side_gets_no_check():
  missing = {"record": None, "problem": "run/jax/placement.json is missing"}
  c = placement_check("jax", missing, "ok")
  assert not c.passed and not c.gating and c.detail == "placement: not run: run/jax/placement.json is missing"
  assert placement_check("jax", missing, "crashed") is None
  assert placement_check("deepspeed", None, "ok") is None


def test_collect_reads_this_runs_placement_only(tmp_path):
  assert writes_placement("jax") and not writes_placement("deepspeed") and not writes_placement("torch")
  assert placement_entry(tmp_path, "torch", {}, "r1") is None
  entry = placement_entry(tmp_path, "jax", {"placement_error": "ValueError: boom"}, "r1")
  assert entry["record"] is None and "is missing" in entry["problem"] and "ValueError: boom" in entry["problem"]
  write_placement(tmp_path / PLACEMENT_FILE, {"schema": "parity.placement/1", "run_id": "r0", "mismatches": []})
  assert "belongs to another run" in placement_entry(tmp_path, "jax", {}, "r1")["problem"]
  assert read_placement(tmp_path / PLACEMENT_FILE, "r0")[0]["run_id"] == "r0"
  with pytest.raises(FileExistsError, match="never written over"):
    write_placement(tmp_path / PLACEMENT_FILE, {})


def test_a_one_side_check_renders_in_the_check_tables_and_the_verdict():
  mm = [{"class": "opt_state", "role": "argument", "expected": "host", "compiled": "device",
         "buffers": {"mismatched": 3, "of": 3}}]
  place = placement_check("jax", {"record": {"plan": PINNED, "mismatches": mm}, "problem": None}, "ok")
  done = completion_check("jax", "ok", 2, "torch", "ok", 2, 2)
  v = verdict([done, place], {"jax": "ok", "torch": "ok"})
  assert v.first_failure is place and v.message == (
      "FAIL: placement of jax fails at step 0: placement: opt_state planned pinned_host, compiled in device memory "
      "(3/3 buffers in)")
  d = {"run": {"train": {"precision": "fp32"}}, "tolerances": {}, "sides": {},
       "checks": [done.to_json(), place.to_json()]}
  rows = check_rows(RunRecord.of(d))
  assert [(r["pair"], r["result"], r["tolerance"]) for r in rows] == [
      ("jax vs torch", "pass", "all 2 steps"), ("jax", "FAIL", "0 (must be equal)")]
  assert metric_rows(RunRecord.of(d))[1]["worst"] == "jax" and rows[1]["measure"] != "placement"


def test_the_planted_mismatch_is_refused_where_it_cannot_show():
  spec = apply_plan(RunSpec(), "zero2-offload")
  check_plants(spec, {"jax": {"placement_device": True}})
  with pytest.raises(SpecError, match="torch:placement_device=true changes nothing .*only the JAX side"):
    check_plants(spec, {"torch": {"placement_device": True}})
  with pytest.raises(SpecError, match="offloads nothing"):
    check_plants(apply_plan(RunSpec(), "zero2"), {"jax": {"placement_device": True}})


# ----------------------------------------------------------------------------- end to end


@requires_jax
@pytest.mark.process
@pytest.mark.slow
def test_compare_with_the_planted_mismatch_fails_naming_opt_state(tmp_path):
  """`parity compare --plan zero2-offload --sides jax --perturb jax:placement_device=true` (2 steps): exit 1, the
  placement check FAILs at step 0 naming opt_state, placement.json is this run's, and the report re-verifies."""
  out = tmp_path / "run"
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  cmd = [sys.executable, "-m", "parity", "compare", "--preset", "gpt2-tiny", "--plan", "zero2-offload", "--sides",
         "jax", "--steps", "2", "--set", "model.n_layers=1", "--set", "train.eval_every=0", "--perturb",
         "jax:placement_device=true", "--out", str(out), "--no-progress", "--no-noise-envelope",
         "--determinism-steps", "0"]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads((out / "report.json").read_text())
  ff = report["verdict"]["first_failure"]
  assert (ff["metric"], ff["sides"], ff["step"]) == ("placement", ["jax"], 0)
  check = next(c for c in report["checks"] if c["metric"] == "placement")
  assert check["worst"] == "opt_state" and "opt_state planned pinned_host, compiled in device memory" in check["detail"]
  rec = json.loads((out / "jax" / PLACEMENT_FILE).read_text())
  assert rec["run_id"] == report["run_folder"]["run_id"] and rec["plan"]["offload_opt_state"] is True
  assert {m["class"] for m in rec["mismatches"]} == {"opt_state"}
  assert "| placement | jax |" in (out / "report.md").read_text()
  report_cmd = [sys.executable, "-m", "parity", "report", str(out)]
  again = subprocess.run(report_cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert again.returncode == 1 and "re-rendered" in again.stdout and "UNVERIFIED" not in again.stdout, again.stdout
  (out / "jax" / PLACEMENT_FILE).write_text(json.dumps({**rec, "mismatches": []}))  # the check must recompute from it
  edited = subprocess.run(report_cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert "UNVERIFIED" in edited.stderr and "jax/placement.json" in edited.stderr, edited.stderr  # its hash
  from parity.report.build import artifact_hashes  # the hashes forged too: the recomputed check itself disagrees
  (out / "report.json").write_text(json.dumps({**report, "artifacts": artifact_hashes(out, list(report["sides"]))}))
  forged = subprocess.run(report_cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert "UNVERIFIED" in forged.stderr and "placement jax" in forged.stderr, forged.stderr
