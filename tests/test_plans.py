"""parity.sizing.plans: the named plan pairs, apply_plan, and the planner."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from parity.sizing import memory

from parity.sizing import plans
from parity.hf import MODEL_PRESETS
from parity.presets import preset
from parity.spec import DeepSpeedPlan, JaxPlan, RunSpec, SpecError, TrainSpec

GiB = 2**30


def test_default_pair_is_the_default_run():
  assert plans.PLANS[plans.DEFAULT_PLAN].deepspeed == DeepSpeedPlan()
  assert plans.PLANS[plans.DEFAULT_PLAN].jax == JaxPlan()
  assert plans.plan_of(RunSpec()) == plans.DEFAULT_PLAN


@pytest.mark.parametrize("name", list(plans.PLANS))
def test_every_plan_applies_to_gpt2_tiny(name):
  run = plans.apply_plan(preset("gpt2-tiny"), name)
  assert (run.deepspeed, run.jax) == (plans.PLANS[name].deepspeed, plans.PLANS[name].jax)
  assert plans.plan_of(run) == name and plans.PLANS[name].description


def test_apply_plan_errors_name_the_problem():
  with pytest.raises(SpecError, match="known plans"):
    plans.apply_plan(preset("gpt2-tiny"), "zero9")
  odd = preset("gpt2-tiny")
  odd = odd.__class__(model=odd.model, train=TrainSpec(micro_batch_size=3, seq_len=32), jax=odd.jax)
  with pytest.raises(SpecError, match="zero3-fsdp4.*data_parallel"):
    plans.apply_plan(odd, "zero3-fsdp4")


def test_planner_7b_on_one_80gb_device_picks_a_plan_that_fits():
  train = TrainSpec(micro_batch_size=1, seq_len=2048, precision="bf16")
  hw = plans.HARDWARE["A100-80"]
  best, ranked = plans.choose_plan(MODEL_PRESETS["llama-7b"], train, hw, host_bytes=512 * GiB,
                                   sides=("deepspeed",))
  assert best is not None and best.fits
  assert best.peak_device_bytes["deepspeed"] <= 0.9 * hw.device_bytes
  assert best.host_bytes["deepspeed"] <= 512 * GiB
  assert ranked == sorted(ranked, key=lambda c: c.step_s)
  cheaper = [c for c in ranked if c.step_s < best.step_s]
  assert cheaper and all(not c.fits for c in cheaper)
  lines = plans.explain(best, ranked)
  assert len(lines) == len(cheaper) and all("does not fit" in ln and "GiB" in ln for ln in lines)
  assert {"zero0", "zero2"} <= {ln.split()[0] for ln in lines}  # unsharded, unoffloaded 7B: ~16 bytes/param


def test_planner_7b_on_one_80gb_device_fits_both_sides_by_streaming_the_jax_update():
  """llama-7b, one 80 GB device, 512 GB host, both sides. The plain JAX update brings all 50 GiB of
  fp32 Adam moments to the device at once, so every unstreamed pair fails on the JAX side. Streaming the
  moments alone (zero2-offload-scan) still fails: the params stay on the device, and the streamed update's
  new layer stack sits beside them, as does the bf16 compute copy in the forward pass. With the params on the
  host too (scan-offload) the device holds the gradient, the activations and every layer's bf16 weights (saved for
  the backward pass: nothing is recomputed), and room is left for a quarter of the moments (jax.offload_opt_ratio
  0.75). Recomputing each block (scan-offload-remat) frees the activations and the saved weights: three quarters of
  the moments stay (0.25), and that moves less than the backward pass's second fetch of every layer's params costs
  (cost._jax_layer_moves): the choice."""
  train = TrainSpec(micro_batch_size=1, seq_len=2048, precision="bf16")
  for hw in (plans.HARDWARE["A100-80"], plans.HARDWARE["H100"]):
    best, ranked = plans.choose_plan(MODEL_PRESETS["llama-7b"], train, hw, host_bytes=512 * GiB)
    assert best is not None and best.name == "scan-offload-remat" and best.jax_opt_ratio == 0.25, hw.name
    assert set(best.peak_device_bytes) == {"deepspeed", "jax"}
    assert max(best.peak_device_bytes.values()) <= 0.9 * hw.device_bytes
    by_name = {c.name: c for c in ranked}
    for name in ("zero2-offload", "zero3-offload-all", "zero2-offload-scan"):
      assert not by_name[name].fits and [p for p in by_name[name].problems if p.startswith("jax needs")], name
      assert by_name[name].peak_device_bytes["deepspeed"] <= 0.9 * hw.device_bytes  # DeepSpeed fits there
    full = plans.with_plan(RunSpec(model=MODEL_PRESETS["llama-7b"], train=train), plans.PLANS["scan-offload"])
    streamed = memory.peak_device_bytes(memory.estimate(full, sides=("jax",)), "jax")  # all moments on the host
    assert by_name["zero3-offload-all"].peak_device_bytes["jax"] - streamed > 40 * GiB
    assert by_name["scan-offload"].fits and by_name["scan-offload"].jax_opt_ratio == 0.75
    assert best.step_s < by_name["scan-offload"].step_s
    assert streamed < by_name["scan-offload"].peak_device_bytes["jax"] <= 0.9 * hw.device_bytes
    lines = plans.explain(best, ranked)
    assert lines and all("does not fit" in ln for ln in lines)
    assert {"zero0", "zero2"} <= {ln.split()[0] for ln in lines}  # the offload pairs above cost more than the choice


def test_planner_70b_on_8_devices_needs_fsdp_offload_scan_and_remat():
  """llama-70b on 8 x H100 (1 TiB host each): every pair without the streamed update needs > 72 GiB on the JAX
  side; ZeRO-3 + offload + scan without remat still holds every layer's activations; the choice recomputes."""
  train = TrainSpec(micro_batch_size=1, seq_len=2048, precision="bf16")
  best, ranked = plans.choose_plan(MODEL_PRESETS["llama-70b"], train, plans.HARDWARE["H100"], host_bytes=1024 * GiB,
                                   devices=8)
  assert best is not None and best.name == "scan-offload-remat"
  by_name = {c.name: c for c in ranked}
  assert not by_name["scan-offload"].fits and not by_name["zero3-offload-all-remat"].fits
  # Both sides process the same global batch (micro batch per device), so a pair without remat on either
  # side has the same compute on both; DeepSpeed's PCIe traffic is its partition, 1/8 of the model.
  n = memory.param_count(MODEL_PRESETS["llama-70b"])
  runs = {"deepspeed": RunSpec(model=MODEL_PRESETS["llama-70b"], train=train,
                               deepspeed=plans.PLANS["scan-offload"].deepspeed),
          "jax": RunSpec(model=MODEL_PRESETS["llama-70b"], train=dataclasses.replace(train, micro_batch_size=8),
                         jax=dataclasses.replace(plans.PLANS["scan-offload"].jax, data_parallel=8))}
  rows = [r for s, run in runs.items() for r in memory.estimate(run, ranks=8, sides=(s,))]
  hw = plans.HARDWARE["H100"]
  ds = plans.step_time(runs["deepspeed"], "deepspeed", hw, rows, ranks=8)
  jx = plans.step_time(runs["jax"], "jax", hw, rows, ranks=8)
  assert ds[1] == pytest.approx(jx[1], rel=1e-12)
  # (opt + param) x in/out x bf16
  assert ds[2] * hw.host_link_bytes_per_s == pytest.approx(2 * 2 * 2 * math.ceil(n / 8))


def test_planner_both_sides_fit_on_h200_without_streaming():
  train = TrainSpec(micro_batch_size=1, seq_len=2048, precision="bf16")
  best, _ = plans.choose_plan(MODEL_PRESETS["llama-7b"], train, plans.HARDWARE["H200"], host_bytes=512 * GiB)
  assert best is not None and set(best.peak_device_bytes) == {"deepspeed", "jax"}
  assert not plans.PLANS[best.name].jax.scan_layers


def test_planner_explains_every_plan_when_none_fits():
  train = TrainSpec(micro_batch_size=1, seq_len=2048, precision="bf16")
  none, ranked = plans.choose_plan(MODEL_PRESETS["llama-7b"], train, plans.HARDWARE["A100-40"], host_bytes=64 * GiB)
  assert none is None and len(plans.explain(None, ranked)) == len(ranked)


def test_planner_prefers_no_offload_when_it_fits():
  train = TrainSpec(micro_batch_size=8, seq_len=1024, precision="bf16")
  best, _ = plans.choose_plan(MODEL_PRESETS["gpt2-124m"], train, plans.HARDWARE["H100"])
  assert best is not None and best.transfer_s == 0.0


def test_plan_cli(tmp_path, capsys):
  from parity.cli import main
  out = tmp_path / "p.json"
  rc = main(["plan", "--model", "llama-7b", "--hardware", "A100-80", "--host-memory", "512", "--sides", "deepspeed",
             "--json", str(out)])
  text = capsys.readouterr().out
  assert rc == 0 and "choice:" in text and "does not fit" in text
  data = json.loads(out.read_text())
  assert data["choice"] == next(c["name"] for c in data["ranked"] if c["fits"])
  assert main(["plan", "--model", "nope"]) == 2
  assert main(["plan", "--sides", "tpu"]) == 2


def test_planner_ranks_a_pair_the_run_cannot_use_last_with_the_reason(monkeypatch):
  """A pair whose RunSpec does not validate for this run (here a DeepSpeed plan made invalid by hand) is not
  costed: it is ranked last, does not fit, and says why."""
  bad = plans.Plan(DeepSpeedPlan(zero_stage=1, offload_param="cpu"), JaxPlan(), "invalid on purpose")
  monkeypatch.setitem(plans.PLANS, "broken", bad)
  train = TrainSpec(micro_batch_size=1, seq_len=512, precision="bf16")
  best, ranked = plans.choose_plan(MODEL_PRESETS["gpt2-124m"], train, plans.HARDWARE["H100"])
  assert ranked[-1].name == "broken" and not ranked[-1].fits
  assert "not runnable here" in ranked[-1].problems[0] and "offload_param" in ranked[-1].problems[0]
  assert best is not None and best.name != "broken"


def test_compare_applies_jax_and_deepspeed_overrides_on_top_of_a_plan():
  """`--plan NAME --set jax.* --set deepspeed.*`: the pair first, then every override once, last (recorded)."""
  from parity.pipeline.resolve import resolve_run
  over = ["jax.remat=\"full\"", "deepspeed.activation_checkpointing=true", "train.lr=0.001"]
  run = resolve_run("gpt2-tiny", plan="zero2-offload-scan", overrides=over)
  spec, choice = run.spec, run.plan
  assert spec.jax.scan_layers and spec.jax.offload_opt_state and spec.jax.remat == "full"
  assert spec.deepspeed.activation_checkpointing and spec.deepspeed.zero_stage == 2
  assert spec.train.lr == 0.001
  assert choice == {"name": "zero2-offload-scan", "chosen_by": "user", "overrides": over[:2]}
  plain = resolve_run("gpt2-tiny", plan="zero2-offload-scan")
  assert plain.spec.jax.remat == "none" and "overrides" not in plain.plan
  with pytest.raises(SpecError, match="jax.zero_stage"):
    resolve_run("gpt2-tiny", plan="zero2", overrides={"jax.zero_stage": 7})


def test_plan_header_and_json_carry_the_inputs_assumed(tmp_path, capsys):
  """The header said the device and the link but not the host memory, and --json carried neither: both now give
  device memory (and what the reserve leaves), host memory per device, host link, peak and MFU as assumed."""
  from parity.cli import main
  out = tmp_path / "p.json"
  assert main(["plan", "--model", "llama-7b", "--hardware", "H100", "--host-memory", "384", "--bandwidth", "25",
               "--mfu", "0.3", "--json", str(out)]) == 0
  head = " ".join(capsys.readouterr().out.split("┏")[0].split())
  for text in ("80.0 GiB device memory (72.0 usable after a 10% reserve)", "384 GiB host memory per device",
               "25 GB/s host link per direction", "peak 989.0 TFLOP/s (bf16)", "MFU 0.3", "on 1 x H100"):
    assert text in head, (text, head)
  inputs = json.loads(out.read_text())["inputs"]
  assert inputs == {"hardware": "H100", "device_bytes": 80 * GiB, "reserve": 0.1,
                    "usable_device_bytes": int(80 * GiB * 0.9), "host_bytes_per_device": 384 * GiB,
                    "host_link_bytes_per_s": 25e9, "peak_flops": 989e12, "mfu": 0.3, "devices": 1,
                    "sides": ["deepspeed", "jax"], "opt_ratios": [0.25, 0.5, 0.75, 1.0], "precision": "bf16",
                    "micro_batch_size": 1, "seq_len": 2048,
                    "grad_accum_steps": 1, "padding_fraction": 0.0}


def test_plan_and_estimate_headers_name_the_plan_and_a_unit_that_shows_tiny_figures(capsys):
  from parity.cli import main
  assert main(["estimate", "--preset", "gpt2-tiny", "--plan", "zero3"]) == 0
  head = " ".join(capsys.readouterr().out.split("┏")[0].split())
  assert "plan zero3 (DeepSpeed ZeRO-3; JAX zero_stage 3)" in head, head
  assert main(["plan", "--preset", "gpt2-tiny"]) == 0
  text = capsys.readouterr().out
  assert "deepspeed MiB" in text and "µs" in text
  row = next(line for line in text.splitlines() if line.strip("│ ").startswith("zero0 "))
  cells = [c.strip() for c in row.strip().strip("│").split("│")]
  assert float(cells[1]) > 0 and cells[4] != "0.0 / 0.0", cells  # step time and device bytes read as non-zero
