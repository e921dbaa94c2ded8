"""A JAX folder made on a TPU v5e joined with a torch folder made on a CPU machine from the same request
(tests/data/tpu_v5e/join: A = `parity compare --preset gpt2-tiny --sides torch --steps 16` on a 2-core CPU machine;
B = `parity compare --request A/request.json --sides jax` on the TPU VM). `parity join` gives one verdict, held to the
fp32 table plus the chip side's measured shift; a tampered request, batch file or init in either folder is refused,
naming the file. No framework is started: the join reads files."""
from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from parity.cli import main

DATA = Path(__file__).parent / "data" / "tpu_v5e" / "join"


def _cli(*argv) -> tuple[int, str]:
  out = io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
    rc = main([str(a) for a in argv])
  return rc, out.getvalue()


@pytest.fixture
def folders(tmp_path):
  for name in ("A", "B"):
    shutil.copytree(DATA / name, tmp_path / name)
  return tmp_path


def test_the_chip_s_jax_folder_joins_the_cpu_torch_folder_into_one_verdict(folders):
  rc, out = _cli("join", folders / "A", folders / "B", "--out", folders / "AB")
  assert rc == 0, out[-3000:]
  rep = json.loads((folders / "AB" / "report.json").read_text())
  assert rep["verdict"]["passed"]
  checks = {c["name"]: c for c in rep["checks"]}
  assert checks["loss_backend torch~jax"]["passed"] and checks["backend_shift jax"]["passed"]
  assert 0 < checks["backend_shift jax"]["value"] < checks["loss_backend torch~jax"]["tolerance"]
  assert checks["semantics torch~jax"]["value"] == 0 and checks["placement jax"]["value"] == 0
  machines = json.dumps(rep["run_folder"]["join"])
  assert "TPU" in machines and "cpu" in machines.lower()
  assert "jax on TPU v5 lite" in out and "not comparable" in out


@pytest.mark.parametrize("folder, name", [("B", "batches.npy"), ("A", "init.safetensors"), ("B", "request.json"),
                                          ("A", "val_batches.npy")])
def test_a_tampered_file_in_either_folder_is_refused_by_name(folders, folder, name):
  path = folders / folder / name
  if name == "request.json":
    req = json.loads(path.read_text())
    req["run"]["train"]["lr"] = 2e-3
    path.write_text(json.dumps(req, indent=2))
  else:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
  rc, out = _cli("join", folders / "A", folders / "B", "--out", folders / "AB")
  assert rc == 2, out[-2000:]
  assert f"{path} changed after its run" in out and "Traceback" not in out
  assert not (folders / "AB").exists()




def test_a_torch_error_the_chip_s_shift_would_hide_fails_on_one_backend():
  """The loophole of the pair bound (table + the chip's shift): a torch whose loss sits 1e-5 + 0.9x the chip's shift
  from the chip's loss at every step, on the side away from the JAX side's host-CPU rerun (up to 1.6e-5 from it here:
  table + 2x shift is what the bound alone admits). The pair bound PASSes it; the JAX side's host-CPU rerun against
  torch, at the table, FAILs it, and passes the recorded correct torch. (What `parity join` and a one-machine run on a
  TPU VM compute: parity.verdict.reruns.backend_result.)"""
  from parity.verdict.backend import backend_pair_check, one_backend_check, shifts
  read = lambda *p: [json.loads(x) for x in (DATA.joinpath(*p)).read_text().splitlines() if x.strip()]
  jax, jax_cpu, torch = read("B", "jax", "steps.jsonl"), read("B", "backend", "jax", "steps.jsonl"), read(
      "A", "torch", "steps.jsonl")
  shift = {"jax": shifts(jax, jax_cpu)["loss"]}
  bad = [{**t, "loss": j["loss"] + (1.0 if j["loss"] >= c["loss"] else -1.0) * (1e-5 + 0.9 * shift["jax"][j["step"]])}
         for t, j, c in zip(torch, jax, jax_cpu)]
  assert max(shift["jax"].values()) > 0
  for steps, ok in ((torch, True), (bad, False)):
    assert backend_pair_check("loss", "torch", steps, "jax", jax, shift, "fp32").passed  # the shift granted
    one = one_backend_check("loss", "torch", steps, "jax", jax_cpu, ["jax"], "fp32")
    assert one.passed is ok and one.name == "loss_one_backend torch~jax" and "host-CPU rerun" in one.detail
