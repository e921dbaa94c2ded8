"""The doctor's table and the throughput caveat for a TPU, rendered on CPU from what was recorded on a TPU v5e VM
(tests/data/tpu_v5e, SOURCE.md there): `parity doctor --json` of the VM and the run folders' JSON files."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from parity.report.run_record import RunRecord, SideRecord

from parity import sockets
from parity.cli.doctor import rows
from parity.cli.doctor_jax import STANDALONE, host_link_text
from parity.report import hardware, side_table

DATA = Path(__file__).parent / "data" / "tpu_v5e"
POOL = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"


def _doctor() -> dict:
  return json.loads((DATA / "doctor.json").read_text())


def test_the_recorded_tpu_block_shows_the_chip_the_link_and_the_settings():
  table = dict(rows(_doctor()))
  assert table["jax chip"] == "TPU v5 lite x 1, 15.75 GiB device memory each (memory_stats bytes_limit)"
  assert table["jax memory kinds"].startswith("device accepted, pinned_host accepted, unpinned_host accepted")
  link = table["jax host link"]
  assert link.startswith("step round trip 13.1 GB/s (128 MiB both ways: jit(donated pinned_host -> device")
  assert link.index("step round trip") < link.index(STANDALONE) < link.index("device to pinned host 0.88 GB/s")
  assert "the same RAM" not in link  # that is the CPU backend's sentence
  assert table["tpu host buffers"] == ("TPU_PREMAPPED_BUFFER_SIZE unset: runtime default; "
                                       "TPU_PREMAPPED_BUFFER_TRANSFER_THRESHOLD_BYTES unset: runtime default "
                                       "(a staging region pinned at start; pinned_host arrays are host memory "
                                       "beside it)")
  flags = table["tpu numerics flags"]
  assert flags.startswith("LIBTPU_INIT_ARGS=--xla_tpu_use_enhanced_launch_barrier=true; XLA_FLAGS unset: runtime "
                          "default; JAX_DEFAULT_MATMUL_PRECISION unset: runtime default")
  assert table["jax pinned-host pool"] == (
      f"{POOL}: the GPU pinned-pool rule does not apply on TPU (XLA's GPU client reads it); TPU pinned_host arrays "
      "are host memory beside the runtime's premapped region (TPU_PREMAPPED_BUFFER_SIZE unset: runtime default)")
  assert "per GPU" not in table["jax pinned-host pool"]
  assert table["numerics flags"].endswith("the TPU's own: the 'tpu numerics flags' row")
  assert table["sockets"] == "not recorded (a block written before the loopback check)"


def test_a_set_premapped_size_and_the_sockets_refusal_are_shown():
  block = _doctor()
  acc = block["frameworks"]["jax"]["accelerator"]
  acc["settings"]["TPU_PREMAPPED_BUFFER_SIZE"] = "4294967296"
  acc["settings"]["XLA_FLAGS"] = "--xla_tpu_enable_x=true"
  err = "[Errno 97] Address family not supported by protocol"
  block["sockets"] = {"allowed": False, "probe": "loopback TCP bind 127.0.0.1:0", "error": err,
                      "means": sockets.meaning(err)}
  table = dict(rows(block))
  assert table["tpu host buffers"].startswith("TPU_PREMAPPED_BUFFER_SIZE=4294967296; ")
  assert "XLA_FLAGS=--xla_tpu_enable_x=true" in table["tpu numerics flags"]
  assert table["jax pinned-host pool"].endswith("(TPU_PREMAPPED_BUFFER_SIZE=4294967296)")
  assert table["sockets"].startswith(f"REFUSED (loopback TCP bind: {err}): DeepSpeed's init")
  assert "`parity join`" in table["sockets"]
  block["sockets"] = {"allowed": True, "error": None}
  assert dict(rows(block))["sockets"].startswith("allowed (loopback TCP bind 127.0.0.1:0 works)")


def test_a_cpu_block_keeps_the_gpu_pool_rule_and_says_its_copies_are_ram():
  """The same block as if jax ran on the CPU: no TPU rows, the pool row as before, the link labelled as RAM."""
  block = _doctor()
  jx = block["frameworks"]["jax"]
  jx["backend"] = "cpu"
  jx["accelerator"] = {"kind": "cpu", "count": 1, "bytes_limit": None, "settings": {}}
  table = dict(rows(block))
  assert "tpu host buffers" not in table and "tpu numerics flags" not in table
  assert table["jax chip"] == "cpu x 1: the CPU backend, whose device memory is the host's RAM"
  assert table["jax pinned-host pool"].endswith("jax here runs on cpu: the pool applies to GPU backends only")
  assert table["jax host link"].endswith("memory-copy speeds, not a bus")


def test_older_probes_say_what_they_lack():
  jx = _doctor()["frameworks"]["jax"]
  old = copy.deepcopy(jx)
  del old["accelerator"], old["bandwidth"]["step_round_trip"]
  block = {**_doctor(), "frameworks": {**_doctor()["frameworks"], "jax": old}}
  table = dict(rows(block))
  assert table["jax chip"].startswith("not recorded")
  assert table["jax host link"].startswith(f"step round trip not recorded (a probe from before it); {STANDALONE}")
  assert table["tpu host buffers"].startswith("not recorded")
  assert host_link_text(None, "tpu") == "not measured (--quick)"
  assert host_link_text({"step_round_trip": {"error": "XlaRuntimeError: no"}}, "gpu").startswith(
      "step round trip not measured: XlaRuntimeError: no")


# --- the throughput caveat: each side's real device -----------------------------------------------------------


def _report(cell: str) -> dict:
  return json.loads((DATA / cell / "report.json").read_text())


def test_the_recorded_tpu_run_names_each_side_s_hardware():
  """JAX on the chip, torch on the host CPU: the caveat names both and says the figures are not comparable (it said
  'CPU backend (torch): ... not representative of GPU training', as gpt2-fp32.txt shows)."""
  assert "CPU backend (torch)" in (DATA / "gpt2-fp32.txt").read_text()
  note = side_table.throughput_note(RunRecord.of(_report("gpt2-fp32")))
  assert note.startswith("jax on TPU (TPU_0); torch on the host CPU (13 threads): tokens/s of sides on different "
                         "hardware are not comparable; sides ran one after another")
  assert "not representative of GPU training" not in note and "CPU backend" not in note


@pytest.mark.parametrize("cell", ["gpt2-fp32", "llama3-bf16-scan", "qwen3-fp32-act", "gemma3-fp32"])
def test_each_recorded_summary_reads_as_its_device(cell):
  summaries = {s: json.loads((DATA / cell / s / "summary.json").read_text()) for s in ("jax", "torch")}
  hw = {s: hardware.side_hardware(SideRecord.of("side", {"summary": summ})) for s, summ in summaries.items()}
  assert hw["jax"] == ("tpu", "TPU (TPU_0)")
  threads = summaries["torch"]["threads"]["torch_num_threads"]
  assert hw["torch"] == ("cpu", f"the host CPU ({threads} threads)")
  with_kind = {**summaries["jax"], "device_kind": "TPU v5 lite"}  # a side that records its chip's kind
  assert hardware.side_hardware(SideRecord.of("side", {"summary": with_kind})) == ("tpu", "TPU v5 lite")


def test_cpu_only_and_same_accelerator_runs_keep_their_wording():
  d = _report("gpt2-fp32")
  d["sides"]["jax"]["summary"]["device"] = "cpu:0"  # jax on the CPU as well: the CPU-only sentence, as before
  note = side_table.throughput_note(RunRecord.of(d))
  assert note.startswith("CPU backend (jax, torch): throughput is not representative of "
                                                  "GPU training; ")
  for name, dev in (("jax", "cuda:0"), ("torch", "cuda (NVIDIA H200)")):  # both on GPUs: no hardware caveat
    d["sides"][name]["summary"]["device"] = dev
  assert side_table.throughput_note(RunRecord.of(d)).startswith("sides ran one after another")
  d["sides"]["torch"]["summary"]["device"] = "cpu"  # a GPU jax beside a CPU torch (--allow-cpu)
  note = side_table.throughput_note(RunRecord.of(d))
  assert note.startswith("jax on GPU cuda:0; torch on the host CPU (13 threads): tokens/s "
                                                  "of sides on different hardware are not comparable")


def test_quick_environment_on_a_tpu_vm_does_not_name_jax_s_backend_cpu(monkeypatch):
  """Without an NVIDIA driver the quick block infers the backends; on a machine with a TPU runtime it must not say
  JAX ran on the CPU (the JAX side's summary names its device instead)."""
  from harness import doctor as hd
  monkeypatch.setattr(hd, "tpu_evidence", lambda: "/dev/accel0 present")
  fw = hd._inferred_frameworks()
  assert fw["jax"]["backend"] is None and "/dev/accel0 present" in fw["jax"]["how"]
  monkeypatch.setattr(hd, "tpu_evidence", lambda: None)
  assert hd._inferred_frameworks()["jax"]["backend"] == "cpu"
