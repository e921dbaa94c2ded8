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
