"""`parity plan` on TPUs: the TPU-v5e/v5p/v6e presets, no XLA GPU pinned-host pool rule there, the no-offload choice
when the model fits on the device. Memory and time models only: nothing is built, no accelerator is needed."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from parity.hf import MODEL_PRESETS
from parity.sizing import host_limits as hl
from parity.sizing import plans
from parity.spec import TrainSpec

GiB, GB = 2**30, 10**9
TRAIN = TrainSpec(micro_batch_size=1, seq_len=2048, precision="bf16")
DOCTOR = Path(__file__).parent / "data" / "tpu_v5e" / "doctor.json"
OFFLOAD = Path(__file__).parent / "data" / "tpu_v5e" / "offload" / "run3-rates-home-after.json"


@pytest.mark.parametrize("name,hbm,bf16,host", [("TPU-v5e", 16 * GiB, 197e12, 45 * GiB),
                                                ("TPU-v5p", 95 * GiB, 459e12, 112 * GB),
                                                ("TPU-v6e", 32 * GiB, 918e12, 192 * GiB)])
def test_the_tpu_presets_figures(name, hbm, bf16, host):
  hw = plans.HARDWARE[name]
  assert (hw.name, hw.kind, hw.device_bytes, hw.peak_flops, hw.host_bytes) == (name, "tpu", hbm, bf16, host)
  assert hw.host_link_bytes_per_s == 18.8 * GB  # the v5e's in-step rate both ways together; v5p/v6e assume it
  assert hw.hidden_transfer == 0.0  # measured on the v5e: the offload layouts hid 0-5% of their copies
  assert hw.peak("fp32") == pytest.approx(bf16 / 6) and hw.peak("bf16") == bf16  # fp32 as 6 bf16 passes (assumed)
  assert plans.HARDWARE["H100"].kind == "gpu"


def test_the_v5e_preset_is_the_measured_machine():
  """The host figure is doctor.json's and the link the offload benchmark's in-step rate (both ways, donated
  buffers); the measured usable HBM (bytes_limit) is within the 16 GiB."""
  doctor = json.loads(DOCTOR.read_text())
  hw = plans.HARDWARE["TPU-v5e"]
  assert hw.host_bytes == doctor["host"]["mem_total_bytes"]
  rates = json.loads(OFFLOAD.read_text())["children"]["rates"]
  assert hw.host_link_bytes_per_s == pytest.approx(rates["both"]["gb_per_s"] * GB, rel=0.01)
  limit = doctor["frameworks"]["jax"]["accelerator"]["bytes_limit"]
  assert hw.device_bytes * 0.9 < limit <= hw.device_bytes


def test_no_gpu_pool_rule_on_a_tpu():
  """scan-offload pins 75.3 GiB per device (> XLA's 64 GiB GPU default): on an H100 with 78 GiB host its 80 GiB
  pool does not fit, and a user's 70 GiB pool refuses it; on a TPU neither applies, the host memory alone bounds it
  (150 GiB there: the DeepSpeed side of the pair needs 113 GiB). The pairs as named: all of the optimizer state
  offloaded (opt_ratios (1,))."""
  model = MODEL_PRESETS["llama-7b"]
  full = (1.0,)
  for pool in (None, 70):
    _, ranked = plans.choose_plan(model, TRAIN, plans.HARDWARE["H100"], host_bytes=78 * GiB, xla_pool_gib=pool,
                                  opt_ratios=full)
    scan = {c.name: c for c in ranked}["scan-offload"]
    assert not scan.fits and scan.jax_pool is not None and any(hl.XLA_POOL_ENV in p for p in scan.problems)
    best, ranked = plans.choose_plan(model, TRAIN, plans.HARDWARE["TPU-v5p"], host_bytes=150 * GiB,
                                     xla_pool_gib=pool, opt_ratios=full)
    scan = {c.name: c for c in ranked}["scan-offload"]
    assert scan.host_bytes["jax"] > 64 * GiB and scan.fits and scan.jax_pool is None
    assert best is not None and all(c.jax_pool is None for c in ranked)
  _, ranked = plans.choose_plan(model, TRAIN, plans.HARDWARE["TPU-v5p"], host_bytes=70 * GiB, opt_ratios=full)
  scan = {c.name: c for c in ranked}["scan-offload"]  # too little host memory: the host bound, not a pool
  overhead = hl.tpu_process_overhead() / GiB  # the premapped region, the process's own, the compile: measured
  assert f"jax needs 75.3 GiB of host memory + {overhead:.1f} GiB the TPU runtime holds > 70.0 GiB" in scan.problems
  assert not any("pool" in p or hl.XLA_POOL_ENV in p for p in scan.problems)


def test_a_small_model_on_a_tpu_chooses_no_offload():
  train = TrainSpec(micro_batch_size=8, seq_len=1024, precision="bf16")
  best, ranked = plans.choose_plan(MODEL_PRESETS["gpt2-124m"], train, plans.HARDWARE["TPU-v5e"])
  assert best is not None and best.transfer_s == 0.0 and not any(best.host_bytes.values())
  assert best.step_s <= min(c.step_s for c in ranked if c.fits)


def test_equal_step_times_prefer_the_pair_without_offload():
  """With the transfers hidden under compute (a link this fast), offload pairs cost the same step as the no-offload
  ones: the ranking puts the pair moving fewer host bytes first, so on 4 devices with 9.2 GiB usable (zero0-2 do not
  fit, zero3 and zero3-offload-all do, at the same step) the choice is zero3."""
  train = TrainSpec(micro_batch_size=8, seq_len=1024, precision="bf16")
  hw = dataclasses.replace(plans.HARDWARE["TPU-v6e"], device_bytes=int(9.2 / 0.9 * GiB), host_link_bytes_per_s=1e18,
                           hidden_transfer=1.0)
  best, ranked = plans.choose_plan(MODEL_PRESETS["gpt2-124m"], train, hw, devices=4)
  assert [(c.step_s, c.transfer_s) for c in ranked] == sorted((c.step_s, c.transfer_s) for c in ranked)
  tied = {c.name: c for c in ranked if c.step_s == best.step_s}
  assert {"zero3", "zero3-offload-all", "zero2-offload"} <= set(tied) and tied["zero3-offload-all"].fits
  assert best.name == "zero3" and best.transfer_s == 0.0


def test_parity_plan_on_a_tpu(capsys, monkeypatch, tmp_path):
  from parity.cli import main
  monkeypatch.setenv(hl.XLA_POOL_ENV, "lots")  # a GPU-only variable: not read on a TPU (a GPU exits 2)
  out = tmp_path / "p.json"
  assert main(["plan", "--hardware", "TPU-v5e", "--model", "gpt2-124m", "--json", str(out)]) == 0
  text = " ".join(capsys.readouterr().out.split())
  assert "on 1 x TPU-v5e" in text and "16.0 GiB device memory" in text and "peak 197.0 TFLOP/s (bf16)" in text
  assert "choice: zero0" in text and "needs no offload on TPU-v5e" in text
  assert "a TPU has no pinned-host pool limit of its own" in text and hl.XLA_POOL_ENV not in text
  data = json.loads(out.read_text())
  assert data["choice"] == "zero0" and data["host_limits"]["hardware_kind"] == "tpu"
  assert data["host_limits"]["xla_pool_env"] is None
  monkeypatch.delenv(hl.XLA_POOL_ENV)
  assert main(["plan", "--hardware", "TPU-v5p", "--model", "llama-7b", "--host-memory", "512"]) == 0
  text = " ".join(capsys.readouterr().out.split())
  # the params stay on the device: with them on the host every micro batch fetches them again
  # (cost._jax_layer_moves), which costs more than streaming the moments at 0.75
  assert "choice: zero2-offload-scan" in text and hl.XLA_POOL_ENV not in text
  assert "jax offload_opt_ratio 0.75: the smallest of 0.25, 0.5, 0.75, 1 whose device bytes fit" in text
  assert main(["plan", "--hardware", "TPU-v5p", "--model", "llama-7b", "--host-memory", "512",
               "--opt-ratios", "1"]) == 0
  assert "choice: zero2-offload-scan" in " ".join(capsys.readouterr().out.split())  # all of it offloaded
  assert "the JAX side keeps" in text and "host memory is the only bound" in text


def test_copies_that_do_not_overlap_add_to_the_step():
  """hidden_transfer 0 (the v5e measured): an offload plan's step is compute + transfer, so where no offload fits
  the planner chooses it; with full overlap the same plan costs max(compute, transfer)."""
  model = MODEL_PRESETS["gpt2-355m"]
  train = TrainSpec(micro_batch_size=4, seq_len=1024, precision="bf16")
  hw = plans.HARDWARE["TPU-v5e"]
  _, ranked = plans.choose_plan(model, train, hw)
  off = {c.name: c for c in ranked}["zero2-offload"]
  assert off.transfer_s > 0 and off.step_s == pytest.approx(off.compute_s + off.transfer_s)
  _, ranked = plans.choose_plan(model, train, dataclasses.replace(hw, hidden_transfer=1.0))
  full = {c.name: c for c in ranked}["zero2-offload"]
  assert full.step_s == pytest.approx(max(full.compute_s, full.transfer_s))


def test_the_tpu_runtimes_host_memory_counts_against_the_host():
  """A TPU's JAX side needs its state plus what the runtime holds beside it (host_limits.tpu_process_overhead:
  the premapped region, 1.85 GB of the process's own and 3 GB for the compile, measured on a v5e): a host that holds
  the state alone but not that refuses the plan, naming both; the state's own figure (host_bytes) is the model's."""
  model = MODEL_PRESETS["llama-7b"]
  hw = plans.HARDWARE["TPU-v5p"]
  _, ranked = plans.choose_plan(model, TRAIN, hw, host_bytes=150 * GiB, opt_ratios=(1.0,))
  state = {c.name: c for c in ranked}["scan-offload"].host_bytes["jax"]
  overhead = hl.tpu_process_overhead()
  assert overhead == hl.TPU_PREMAPPED_DEFAULT_BYTES + hl.TPU_PROCESS_HOST_BYTES + hl.TPU_COMPILE_HOST_BYTES
  for host, fits in ((state + overhead, True), (state + overhead - 2**20, False)):
    _, ranked = plans.choose_plan(model, TRAIN, hw, host_bytes=host, opt_ratios=(1.0,))
    scan = {c.name: c for c in ranked}["scan-offload"]
    assert scan.host_bytes["jax"] == state
    assert any(p.startswith("jax needs") and "host memory" in p for p in scan.problems) is not fits
    assert any("the TPU runtime holds" in p for p in scan.problems) is not fits
  _, ranked = plans.choose_plan(model, TRAIN, plans.HARDWARE["H100"], host_bytes=state + 2**20, opt_ratios=(1.0,))
  assert not any("TPU runtime" in p for c in ranked for p in c.problems)  # a GPU's JAX side has no such overhead


def test_parity_plan_reads_the_tpus_premapped_region(capsys, monkeypatch):
  """`parity plan` on a TPU takes the region from TPU_PREMAPPED_BUFFER_SIZE. The measured largest offload model (103
  layers at d_model 1600, 3.25 B: benchmarks/results/2026-12-06-tpu-v5e-largest.md) needs 36.3 GiB of state: with
  the 256 MiB region those runs used and the compile held beside it (a run without a persistent compilation cache)
  that is 41.1 GiB, within a 42 GiB host; with the default 4 GiB region it is 44.8 GiB, over it. A value that is no
  byte count exits 2 naming it."""
  from parity.cli import main as cli
  argv = ["plan", "--hardware", "TPU-v5e", "--model", "gpt2-1.5b", "--set", "model.n_layers=103", "--sides", "jax",
          "--host-memory", "42", "--micro-batch", "1", "--seq-len", "1024"]
  monkeypatch.delenv(hl.TPU_PREMAPPED_ENV, raising=False)
  assert cli(argv) == 1 and "8.5 GiB the TPU runtime holds > 42.0 GiB" in capsys.readouterr().out
  monkeypatch.setenv(hl.TPU_PREMAPPED_ENV, str(256 << 20))
  assert cli(argv) == 0 and "scan-offload-remat" in capsys.readouterr().out
  monkeypatch.setenv(hl.TPU_PREMAPPED_ENV, "4G")
  assert cli(argv) == 2 and "TPU_PREMAPPED_BUFFER_SIZE='4G'" in capsys.readouterr().err


def test_the_torch_sides_get_no_tpu_figures(capsys, tmp_path):
  """DeepSpeed and FSDP2 run on a CUDA GPU or the host CPU, never on a TPU (the TPU VM measured refuses the sockets
  their process group needs: tests/data/tpu_v5e/join/B/environment.json): on a TPU the planner costs the JAX side
  alone, `parity plan` says why the others are not costed, and torch sides alone exit 2. A GPU costs them all."""
  from parity.cli import main
  from parity.spec import SpecError
  model, every = MODEL_PRESETS["gpt2-124m"], ("deepspeed", "jax", "fsdp")
  for name in ("TPU-v5e", "TPU-v5p", "TPU-v6e"):
    hw = plans.HARDWARE[name]
    assert plans.off_device_sides(hw, every) == ("deepspeed", "fsdp")
    _, ranked = plans.choose_plan(model, TRAIN, hw, sides=every)
    assert all(set(c.peak_device_bytes) == set(c.host_bytes) == {"jax"} for c in ranked)
    assert all(set(c.side_step_s) == {"jax"} for c in ranked if c.side_step_s is not None)
    with pytest.raises(SpecError, match="run on a CUDA GPU or the host CPU, not on a TPU"):
      plans.choose_plan(model, TRAIN, hw, sides=("deepspeed", "fsdp"))
  _, ranked = plans.choose_plan(model, TRAIN, plans.HARDWARE["H100"], sides=every)
  assert plans.off_device_sides(plans.HARDWARE["H100"], every) == ()
  assert any(set(c.peak_device_bytes) == set(every) for c in ranked)
  out = tmp_path / "p.json"
  assert main(["plan", "--hardware", "TPU-v5e", "--model", "gpt2-124m", "--json", str(out)]) == 0
  text = " ".join(capsys.readouterr().out.split())
  assert ("not costed on TPU-v5e: deepspeed (DeepSpeed) runs on a CUDA GPU or the host CPU, not on a TPU, so it gets "
          "no TPU device memory or step time") in text
  per_side = next(line for line in text.split("each side alone")[1:])
  assert "jax: zero0" in per_side and "deepspeed:" not in per_side
  data = json.loads(out.read_text())
  assert data["inputs"]["sides"] == ["jax"] and data["inputs"]["not_on_device"] == ["deepspeed"]
  assert all(set(r["peak_device_bytes"]) == {"jax"} for r in data["ranked"])
  assert main(["plan", "--hardware", "TPU-v5e", "--model", "gpt2-124m", "--sides", "deepspeed,fsdp"]) == 2
  err = " ".join(capsys.readouterr().err.split())
  assert "deepspeed, fsdp (DeepSpeed and FSDP2) run on a CUDA GPU or the host CPU, not on a TPU" in err
  from benchmarks.gpu_parts import sizing  # the benchmark suite's sizing on a chip: the JAX side alone
  fx = sizing.fixed_size(16_909_336_064, 40 * GiB, device_name="TPU v5 lite", kind="tpu")
  assert fx["why"] and not any("deepspeed" in line for line in fx["why"])


def test_v5p_and_v6e_mark_the_v5es_transfer_figures_unmeasured(capsys, tmp_path):
  """The host link and the copies' overlap were measured on a v5e only: the v5p and v6e presets carry them, and
  `parity plan` marks each "unmeasured (v5e's)" (its header and --json); a --bandwidth given is the user's own."""
  from parity.cli import main
  v5e = plans.HARDWARE["TPU-v5e"]
  assert v5e.unmeasured == () and v5e.unmeasured_label("host_link_bytes_per_s") == ""
  assert all(not plans.HARDWARE[n].unmeasured for n in plans.HARDWARE if n.startswith(("A100", "H1", "H2", "GH")))
  for name in ("TPU-v5p", "TPU-v6e"):
    hw = plans.HARDWARE[name]
    assert (hw.host_link_bytes_per_s, hw.hidden_transfer) == (v5e.host_link_bytes_per_s, v5e.hidden_transfer)
    assert set(hw.unmeasured) == {"host_link_bytes_per_s", "hidden_transfer"} and hw.borrowed_from == "v5e"
    assert hw.unmeasured_label("hidden_transfer") == "unmeasured (v5e's)"
  out = tmp_path / "p.json"
  assert main(["plan", "--hardware", "TPU-v6e", "--model", "gpt2-124m", "--json", str(out)]) == 0
  text = " ".join(capsys.readouterr().out.split())
  assert ("19 GB/s host link per direction (unmeasured (v5e's)), host copies in series with compute (unmeasured "
          "(v5e's))") in text
  assert json.loads(out.read_text())["inputs"]["unmeasured"] == {"host_link_bytes_per_s": "unmeasured (v5e's)",
                                                                 "hidden_transfer": "unmeasured (v5e's)"}
  assert main(["plan", "--hardware", "TPU-v5p", "--model", "gpt2-124m", "--bandwidth", "30"]) == 0
  text = " ".join(capsys.readouterr().out.split())
  assert "30 GB/s host link per direction, host copies in series with compute (unmeasured (v5e's))" in text
  assert main(["plan", "--hardware", "TPU-v5e", "--model", "gpt2-124m"]) == 0
  assert "unmeasured" not in capsys.readouterr().out  # the v5e's own figures
  docs = " ".join((Path(__file__).parents[1] / "docs" / "plans.md").read_text().split())
  assert "v6e presets carry both of the v5e's transfer figures, unmeasured (v5e's)" in docs
