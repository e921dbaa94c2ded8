"""parity.sizing.fsdp_memory: the FSDP2 side's memory model: the formulas, `estimate`'s and
`parity estimate`'s fsdp figures, predicted vs measured in the report's rows, and one worker run of 1 rank with and
without CPUOffloadPolicy measured against the model (exact on params, gradients and optimizer moments)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import requires_torch
from parity.presets import preset
from parity.sizing import fsdp_memory, measured, memory
from parity.spec import FsdpPlan, to_dict
from parity.weights import param_shapes

REPO = Path(__file__).resolve().parents[1]
EXACT = ("params", "gradients", "optimizer_moments")
"""Measured categories the model predicts exactly (the DeepSpeed model's bound: exact on params, master and moments,
gradients within 15%, tests/test_torch_stages.py; FSDP2's gradients are exact too: one flat reduce-scatter output)."""


def _tiny(**fsdp):
  run = preset("gpt2-tiny")
  return dataclasses.replace(run, fsdp=dataclasses.replace(run.fsdp, **fsdp))


def test_shards_are_dim0_padded_per_rank():
  assert fsdp_memory.shard_numel((257, 64), 2) == 129 * 64
  assert fsdp_memory.shard_numel((64,), 3) == 22
  assert fsdp_memory.shard_numel((1, 5), 4) == 5  # a rank past the last row still pads to chunk 0's size
  assert fsdp_memory.shard_numel((), 8) == 1


def test_units_are_the_root_and_each_block():
  run = preset("gpt2-tiny")
  units = fsdp_memory.unit_shapes(run.model)
  assert list(units) == ["root", "h.0", "h.1"]
  assert sum(math.prod(s) for shapes in units.values() for s in shapes) == memory.param_count(run.model)
  assert sorted(units["root"]) == sorted(tuple(param_shapes(run.model)[k]) for k in ("wte.weight", "wpe.weight",
                                                                                      "ln_f.weight", "ln_f.bias"))


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("offload", [False, True])
def test_resident_state_is_4_4_8_bytes_per_padded_shard_element(world, offload):
  run = _tiny(offload=offload)
  s = sum(fsdp_memory.shard_numel(tuple(v), world) for v in param_shapes(run.model).values())
  tot = memory.fsdp_state_bytes(run.model, run.train, run.fsdp, world)
  kind, other = ("host", "device") if offload else ("device", "host")
  assert {c: tot[c][kind] for c in EXACT} == {"params": 4 * s, "gradients": 4 * s, "optimizer_moments": 8 * s}
  assert all(tot[c][other] == 0 for c in EXACT)
  assert tot["master_params"] == tot["buffers"] == {"device": 0, "host": 0}
  if world == 1:
    assert s == memory.param_count(run.model)
  if world == 3:  # gpt2-tiny's dims are all even: 3 ranks pad (e.g. 64 rows -> 22 per rank)
    assert 3 * s > memory.param_count(run.model)


def test_optimizer_state_follows_the_optimizer():
  run = preset("gpt2-tiny")
  n = memory.param_count(run.model)
  moments = lambda **t: memory.fsdp_state_bytes(
      run.model, dataclasses.replace(run.train, **t), run.fsdp)["optimizer_moments"]["device"]
  assert moments(optimizer="adamw") == moments(optimizer="adam") == moments(optimizer="lamb") == 8 * n
  assert moments(optimizer="sgd", momentum=0.9) == 4 * n and moments(optimizer="sgd", momentum=0.0) == 0


def test_in_step_gathered_units_and_backward_buffers():
  """bf16: the root plus 2 blocks gathered in bf16 with reshard_after_forward, every block without; the largest unit's
  bf16 unsharded gradients and fp32 reduce-scatter input; accumulation keeps fp32 unsharded gradients of all units."""
  run = preset("gpt2-tiny")
  m = dataclasses.replace(run.model, n_layers=4)
  t = dataclasses.replace(run.train, precision="bf16")
  units = {u: sum(math.prod(s) for s in shapes) for u, shapes in fsdp_memory.unit_shapes(m).items()}
  root, block = units["root"], units["h.0"]

  def rows(plan, train=t):
    return [r for r in memory.fsdp_rows(dataclasses.replace(run, model=m, train=train, fsdp=plan), 1)
            if r.note.startswith("in-step") and r.category in ("params", "gradients")]
  on = rows(FsdpPlan())
  assert [r.bytes for r in on if r.category == "params"] == [2 * (root + 2 * block)]
  assert [r.bytes for r in on if r.category == "gradients"] == [(2 + 4) * max(root, block)]
  off = rows(FsdpPlan(reshard_after_forward=False))
  assert [r.bytes for r in off if r.category == "params"] == [2 * (root + 4 * block)]
  acc = rows(FsdpPlan(), dataclasses.replace(t, grad_accum_steps=2))
  assert 4 * memory.param_count(m) in [r.bytes for r in acc if r.category == "gradients"]
  peak = memory.fsdp_peak_bytes(m, t, FsdpPlan(offload=True), 1)
  assert peak["host"] == 16 * memory.param_count(m) and peak["device"] > 2 * (root + 2 * block)


def test_activations_and_batch_are_this_ranks_share_of_the_micro_batch():
  run = preset("gpt2-tiny")  # micro batch 4
  acts = lambda w: sum(r.bytes for r in memory.estimate(run, ranks=w, sides=("fsdp",))
                       if r.category == "activations" and not r.note.startswith("in-step"))
  torch_acts = sum(r.bytes for r in memory.estimate(run, sides=("torch",))
                   if r.category == "activations" and not r.note.startswith("in-step"))
  assert acts(1) == torch_acts and acts(2) * 2 == acts(1)
  with pytest.raises(ValueError, match="world"):
    memory.fsdp_rows(run, 0)


def test_predicted_vs_measured_has_fsdp_rows_for_its_ranks():
  run = preset("gpt2-tiny")
  n = memory.param_count(run.model)
  half = {"params": {"device": 2 * n, "host": 0}, "gradients": {"device": 2 * n, "host": 0},
          "optimizer_moments": {"device": 4 * n, "host": 0}}
  report = {"run": to_dict(run), "sides": {"fsdp": {"summary": {"state_bytes_by_category": half, "nproc": 2}}}}
  by = {(r["side"], r["category"], r["memory_kind"]): r for r in measured.predicted_vs_measured(report)}
  assert all(by[("fsdp", c, "device")]["ratio"] == 1.0 for c in EXACT)
  assert by[("fsdp", "activations", "device")]["predicted"] > 0 and by[("fsdp", "activations", "device")][
      "measured"] is None


def test_estimate_prints_and_writes_fsdp(tmp_path, capsys):
  from parity.cli import main
  out = tmp_path / "e.json"
  assert main(["estimate", "--preset", "gpt2-tiny", "--ranks", "2", "--set", "fsdp.offload=true",
               "--json", str(out)]) == 0
  text = " ".join(capsys.readouterr().out.split())  # the title wraps with the terminal's width
  assert "fsdp device" in text and "fsdp host" in text and "FSDP2 (CPU offload, reshard after forward)" in text
  data = json.loads(out.read_text())
  run = preset("gpt2-tiny")
  want = memory.fsdp_peak_bytes(run.model, run.train, FsdpPlan(offload=True), 2)
  assert {k: data[f"peak_{k}_bytes"]["fsdp"] for k in ("device", "host")} == want
  assert {r["side"] for r in data["rows"]} == {"deepspeed", "jax", "fsdp"}


def _run_fsdp_worker(tmp_path: Path, run) -> dict:
  from test_torch_engine import make_run_dir
  req = make_run_dir(tmp_path, run)
  env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    env.pop(key, None)
  proc = subprocess.run([sys.executable, "-m", "torch_impl.fsdp_worker", str(req), "--side", "fsdp"], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads((tmp_path / "fsdp" / "summary.json").read_text())


@pytest.mark.process
@pytest.mark.slow
@requires_torch
@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_one_rank_measured_equals_predicted(tmp_path, offload):
  """gpt2-tiny, 2 steps, 1 rank: torch_impl.memory's measured params, gradients and moments (by memory kind) equal
  the model's; measured on this machine: 482,304 / 482,304 / 964,608 bytes (device, or host under offload)."""
  run = dataclasses.replace(_tiny(offload=offload), sides=("fsdp",))
  run = dataclasses.replace(run, train=dataclasses.replace(run.train, steps=2))
  summary = _run_fsdp_worker(tmp_path, run)
  got = summary["state_bytes_by_category"]
  want = memory.fsdp_state_bytes(run.model, run.train, run.fsdp, 1)
  for cat in EXACT:
    assert got[cat] == want[cat], f"{cat}: measured {got[cat]} != predicted {want[cat]}"
  assert got["master_params"] == got["buffers"] == {"device": 0, "host": 0}


def test_estimate_says_when_the_micro_batch_does_not_split_over_the_fsdp_ranks(capsys):
  """`estimate --model llama-1b --ranks 2` said 'the micro batch split over them' of a micro batch of 1, which
  compare --nproc 2 refuses: it says what it counted and the micro batch that would split."""
  from parity.cli import main
  assert main(["estimate", "--model", "llama-1b", "--ranks", "2"]) == 0
  text = " ".join(capsys.readouterr().out.split())
  assert "micro batch 1 does not split over 2 ranks" in text and "--micro-batch 2 would" in text
  assert "train_micro_batch_size_per_gpu" in text  # DeepSpeed's rows: that micro batch on each rank
  assert main(["estimate", "--model", "llama-1b", "--ranks", "2", "--micro-batch", "2"]) == 0
  assert "the micro batch split over them" in " ".join(capsys.readouterr().out.split())
