"""What the README and docs/tpu.md say ran where on the TPU v5e, against the records (tests/data/tpu_v5e/): JAX on
the chip, the torch side on the VM's host CPU, DeepSpeed and FSDP2 not on the TPU VM at all (it refuses sockets), and
the cross-machine record a torch folder from a CPU machine joined with a JAX folder from the chip. And the MFU
counts the GPU benchmark reports print: the 6N convention beside the strict one."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TPU = ROOT / "tests" / "data" / "tpu_v5e"


def _json(path: Path) -> dict:
  return json.loads(path.read_text())


def _accelerator_rows() -> dict[str, str]:
  """The README's "Where parity has run" rows, by their first cell."""
  text = (ROOT / "README.md").read_text()
  table = text.split("## Where parity has run", 1)[1].split("\n## ", 1)[0]
  rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| where")]
  return {row.split("|")[1].strip(): row for row in rows}


def test_the_records_show_which_sides_ran_where_on_the_tpu_vm():
  """The facts the README's TPU row rests on: every grid cell ran jax and torch only; the TPU VM refused sockets
  (DeepSpeed's init and FSDP2's process group need them); the join pairs a torch folder made where sockets work with
  a JAX folder whose side ran on the chip."""
  cells = sorted((TPU / "grid").glob("*/request.json"))
  assert len(cells) == 44 and all(_json(c)["run"]["sides"] == ["jax", "torch"] for c in cells)
  chip_vm, cpu = _json(TPU / "join" / "B" / "environment.json"), _json(TPU / "join" / "A" / "environment.json")
  assert chip_vm["sockets"]["allowed"] is False and "DeepSpeed's init, FSDP2" in chip_vm["sockets"]["means"]
  assert cpu["sockets"]["allowed"] is True
  assert _json(TPU / "join" / "A" / "request.json")["run"]["sides"] == ["torch"]
  assert _json(TPU / "join" / "B" / "request.json")["run"]["sides"] == ["jax"]
  assert _json(TPU / "join" / "B" / "jax" / "summary.json")["device"].startswith("TPU_0")
  not_run = _json(TPU / "kernels" / "run3-largest.json")["not_run"]["deepspeed"]
  assert "this machine refuses sockets" in not_run


def test_the_readme_accelerator_rows_name_the_sides_and_where_each_ran():
  rows = _accelerator_rows()
  assert set(rows) == {"CPU", "TPU v5e", "GPU"}
  tpu = " ".join(rows["TPU v5e"].split())
  for said in ("On the chip: the JAX side only.", "On the VM's host CPU: the torch side",
               "DeepSpeed and FSDP2 did not run on the TPU VM: it refuses sockets",
               "a torch side from another machine comes in through `parity join`",
               "(JAX on the chip vs torch on the host CPU;", "a JAX folder from the chip joined with a torch folder "
               "made on a CPU machine PASSes", "Flash attention (JAX)"):
    assert said in tpu, said
  assert "GPU | not yet run" in " ".join(rows["GPU"].split())
  assert "every side (jax, deepspeed, torch, fsdp)" in rows["CPU"]


def test_docs_tpu_names_the_sides_that_did_not_run_on_the_chip():
  words = " ".join((ROOT / "docs" / "tpu.md").read_text().split())
  head = words.split("```", 1)[0]
  assert "JAX runs on the chip and the torch side (plain `torch.optim`) on the VM's host CPU" in head
  assert "DeepSpeed and FSDP2 do not run on a TPU VM that refuses sockets, as the one measured here does" in head
  assert "No DeepSpeed or FSDP2 figure in this page, or in `parity plan --hardware TPU-v5e`, is a TPU's." in head
  measured = words.split("## Measured", 1)[1]
  assert measured.startswith(" Where each side ran: JAX on the chip; torch on the VM's host CPU; DeepSpeed and FSDP2 "
                             "not on the TPU VM (it refuses sockets), so the cross-machine record joins a torch folder "
                             "made on a CPU machine with a JAX folder from the chip.")


def test_the_gpu_reports_give_both_mfu_counts():
  """fixed_flow.derived / grid_flow.mfu_rows records and the tables of report.py and report_grid.py: 6N and strict
  (matmul params only, attention dense: both sides' kernels compute every score); a CPU has no peak (n/a)."""
  from benchmarks.gpu_parts.common import MFU_NOTE, mfu_fields
  from benchmarks.gpu_parts.report import mfu_pair
  from parity.hf import MODEL_PRESETS
  from parity.sizing import cost, memory
  model = MODEL_PRESETS["llama-1b"]
  got = mfu_fields(model, 2048, 10_000.0, 197e12)
  assert got["flops_per_token"] == cost.flops_per_token(model, 2048)
  untied = memory.param_count(model) - cost.matmul_params(model)  # llama-1b ties its embedding: norms only leave
  assert 0 < untied < 1e6 if model.tie_embeddings else untied >= model.vocab_size * model.d_model
  assert got["strict_flops_per_token"] == cost.strict_flops_per_token(model, 2048) < got["flops_per_token"]
  assert got["mfu"] == pytest.approx(1e4 * got["flops_per_token"] / 197e12)
  assert got["mfu_strict"] == pytest.approx(1e4 * got["strict_flops_per_token"] / 197e12)
  assert got["attention_counted"] == "dense (the kernel computes every score, then masks)"
  causal = mfu_fields(model, 2048, 1e4, 197e12, causal_skip=True)
  assert causal["flops_per_token"] == got["flops_per_token"] and causal["mfu_strict"] < got["mfu_strict"]
  assert mfu_fields(model, 2048, 1e4, None)["mfu_strict"] is None
  assert mfu_pair({"mfu": 0.601, "mfu_strict": 0.503}) == "60.1% / 50.3%"
  assert mfu_pair({"mfu": {"8": 0.25}, "mfu_strict": {"8": 0.2}}, "8") == "25.0% / 20.0%"
  assert mfu_pair({"mfu": 0.25}) == "25.0%" and mfu_pair({"mfu": None, "mfu_strict": None}) == "n/a"
  assert "MFU (6N)" in MFU_NOTE and "MFU (strict) counts matmul params only" in MFU_NOTE
