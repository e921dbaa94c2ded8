"""The FSDP2 side `fsdp` (torch_impl/fsdp.py, fsdp_side.py): the plan section and its hash, then end
to end on CPU (gloo): the four sides PASS on the default preset, 2 ranks agree with 1 rank and with the other sides at
the fp32 tolerances, a bf16 + CPUOffloadPolicy + accumulation run resumes bit for bit from its DCP checkpoint, and a
killed rank is reported by its rank."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import requires_all, requires_torch
from parity.errors import SpecError
from parity.overrides import apply_overrides
from parity.presets import DEFAULT_PRESET, PRESETS
from parity.spec import FsdpPlan, RunSpec, config_hash

SIDES = ("jax", "deepspeed", "torch", "fsdp")
STEPS = 3


def test_fsdp_plan_at_its_defaults_keeps_every_config_hash():
  # measured on main before RunSpec had an `fsdp` section (commit 4850e41)
  assert config_hash(PRESETS["gpt2-small-cpu"]) == "93d0bb43e4a32bcc"
  assert config_hash(PRESETS["gpt2-tiny"]) == "0e0bcdb5fc278b56"
  assert config_hash(RunSpec(fsdp=FsdpPlan())) == config_hash(RunSpec())
  offload = apply_overrides(RunSpec(), {"fsdp.offload": True})
  assert offload.fsdp.offload is True and config_hash(offload) != config_hash(RunSpec())
  assert config_hash(apply_overrides(RunSpec(), {"fsdp.reshard_after_forward": False})) != config_hash(RunSpec())
  on = apply_overrides(RunSpec(), {"deepspeed.activation_checkpointing": True, "deepspeed.cpu_checkpointing": True})
  assert config_hash(on) != config_hash(apply_overrides(RunSpec(), {"deepspeed.activation_checkpointing": True}))
  # measured on main before FsdpPlan.activation_checkpointing existed (commit 3970a09): an FSDP2 plan off its
  # defaults keeps its hash too, and the new field changes it only when on
  tiny_offload = apply_overrides(PRESETS["gpt2-tiny"], {"fsdp.offload": True})
  assert config_hash(tiny_offload) == "ae942901fa8bd240"
  assert config_hash(apply_overrides(tiny_offload, {"fsdp.activation_checkpointing": True})) != "ae942901fa8bd240"
  with pytest.raises(SpecError, match="fsdp.activation_checkpointing with fsdp.activation_offload"):
    apply_overrides(RunSpec(), {"fsdp.activation_checkpointing": True, "fsdp.activation_offload": True}).validate()


def test_fsdp_plan_and_side_are_validated():
  RunSpec(sides=SIDES).validate()
  with pytest.raises(SpecError, match="fsdp.offload must be true or false; got 'yes'"):
    RunSpec(fsdp=FsdpPlan(offload="yes")).validate()
  with pytest.raises(SpecError, match=r"sides must be a non-empty subset of \['deepspeed', 'fsdp', 'jax', 'torch'\]"):
    RunSpec(sides=("jax", "fsdp2")).validate()
  assert RunSpec().sides == ("jax", "deepspeed", "torch")  # the default sides are unchanged


def _side(run_dir: Path, side: str) -> dict:
  from parity import weights
  from parity.protocol import read_moments, read_steps
  out = run_dir / side
  return {"status": json.loads((out / "summary.json").read_text())["status"], "steps": read_steps(out / "steps.jsonl"),
          "final": weights.load(out / "final.safetensors"), "moments": read_moments(out)}


@pytest.fixture(scope="module")
def four_sides(tmp_path_factory):
  """The default preset, STEPS steps, every side on 1 rank (fp32), and the FSDP2 side alone on 2 ranks."""
  import parity
  base = tmp_path_factory.mktemp("fsdp")
  one = parity.compare(DEFAULT_PRESET, steps=STEPS, sides=list(SIDES), out=base / "n1", determinism_steps=0)
  two = parity.compare(DEFAULT_PRESET, steps=STEPS, sides=["fsdp"], out=base / "n2", determinism_steps=0, nproc=2)
  return base, one, two


@pytest.mark.process
@pytest.mark.slow
@requires_all
def test_four_sides_pass_on_the_default_preset(four_sides):
  base, one, _ = four_sides
  assert one.passed, [c for c in one.checks if not c.passed]
  rep = json.loads((base / "n1" / "report.json").read_text())
  names = {c["name"] for c in rep["checks"]}
  for pair in ("jax~fsdp", "deepspeed~fsdp", "torch~fsdp"):
    for metric in ("loss", "grad_norm", "lr", "val_loss", "params", "semantics", "completed"):
      assert f"{metric} {pair}" in names, (metric, pair)
  card = json.loads((base / "n1" / "fsdp" / "semantics.json").read_text())
  assert card["items"]["dtypes.params"] == "float32" and card["info"]["fsdp.reduce_dtype"] == "float32"
  assert card["info"]["fsdp.sharded_modules"] == PRESETS[DEFAULT_PRESET].model.n_layers + 1  # each block + the root
  summary = json.loads((base / "n1" / "fsdp" / "summary.json").read_text())
  assert summary["optimizer"]["implementation"] == "for-loop" and summary["fsdp"]["mesh"] == "cpu x 1"
  for c in rep["checks"]:
    if c["metric"] in ("loss", "grad_norm", "params") and "fsdp" in c["name"]:
      print(f"{c['name']}: {c['value']:.3g} (tolerance {c['tolerance']:.3g})")


@pytest.mark.process
@pytest.mark.slow
@requires_all
def test_two_ranks_agree_with_one_rank_and_the_other_sides(four_sides):
  from parity import weights
  from parity.pipeline.resolve import resolve
  from parity.verdict.sides import compare_sides
  base, _, two = four_sides
  assert two.passed, two.checks
  s = json.loads((base / "n2" / "fsdp" / "summary.json").read_text())
  assert s["nproc"] == 2 and [r["status"] for r in s["ranks"]] == ["ok", "ok"] and s["fsdp"]["mesh"] == "cpu x 2"
  spec = resolve(DEFAULT_PRESET, steps=STEPS, sides=list(SIDES))
  init = weights.load(base / "n1" / "init.safetensors")
  for other in ("fsdp", "torch", "jax"):
    pair = {f"{other}@1": _side(base / "n1", other), "fsdp@2": _side(base / "n2", "fsdp")}
    checks, _ = compare_sides(pair, spec=spec, init=init)  # the project's fp32 tolerances
    bad = [c for c in checks if not c.passed]
    assert not bad and len(pair["fsdp@2"]["steps"]) == STEPS, (other, bad)
    for c in checks:
      if c.metric in ("loss", "grad_norm", "params"):
        print(f"{c.name}: {c.value:.3g} (tolerance {c.tolerance:.3g})")


@pytest.mark.process
@pytest.mark.slow
@requires_torch
def test_bf16_offload_accumulation_resumes_bit_for_bit_from_dcp(tmp_path):
  import parity
  settings = {"train.precision": "bf16", "fsdp.offload": True, "train.grad_accum_steps": 2}
  report = parity.compare("gpt2-tiny", steps=4, sides=["fsdp"], overrides=settings, out=tmp_path / "r",
                          determinism_steps=2, resume_at=0, noise_envelope=False)
  rep = json.loads((tmp_path / "r" / "report.json").read_text())
  assert report.passed and rep["resume"]["fsdp"]["bit_identical"] is True, rep["resume"]
  assert rep["resume"]["fsdp"]["resumed_at_step"] == 1
  ckpt = tmp_path / "r" / "repeat" / "fsdp" / "checkpoint"
  meta = json.loads((ckpt / "meta.json").read_text())
  assert meta["format"] == "torch.distributed.checkpoint" and (ckpt / "dcp" / ".metadata").is_file()
  card = json.loads((tmp_path / "r" / "fsdp" / "semantics.json").read_text())
  assert (card["items"]["dtypes.params"], card["items"]["dtypes.master"]) == ("bfloat16", "float32")
  assert (card["info"]["fsdp.param_dtype"], card["info"]["fsdp.reduce_dtype"]) == ("bfloat16", "float32")
  assert card["info"]["fsdp.offload_to_cpu"] is True and card["info"]["fsdp.pin_memory"] is False  # no CUDA here
  kinds = json.loads((tmp_path / "r" / "fsdp" / "summary.json").read_text())["state_bytes_by_memory_kind"]
  assert kinds["device"] == 0 and kinds["host"] > 0  # CPUOffloadPolicy: the whole state on the host


@pytest.mark.process
@pytest.mark.slow
@requires_torch
def test_killed_fsdp_rank_is_named(tmp_path):
  import parity
  report = parity.compare("gpt2-tiny", steps=2, sides=["fsdp"], out=tmp_path / "run", determinism_steps=0, nproc=2,
                          perturb=["fsdp:kill_at_step=1", "fsdp:fault_rank=1"])
  assert report.exit_code == 1 and not report.passed
  s = json.loads((tmp_path / "run" / "fsdp" / "summary.json").read_text())
  assert s["status"] == "killed" and s["failed_rank"]["rank"] == 1 and s["failed_rank"]["exit_code"] == -9
  assert s["error"].startswith("rank 1 of 2 was killed by signal SIGKILL (the planted")
  assert {r["rank"]: r["status"] for r in s["ranks"]}[1] == "killed"
  assert "fsdp/rank1.stderr" in (tmp_path / "run" / "report.md").read_text()


@pytest.mark.process
@pytest.mark.slow
@requires_torch
@pytest.mark.parametrize("stop_rank", [False, True])
def test_a_killed_launcher_takes_its_ranks_with_it(tmp_path, stop_rank):
  """kill -9 of the torchrun agent: torchrun starts each rank in a session of its own, so the harness's kill of the
  agent's group missed them, and the two FSDP2 ranks trained on unsupervised and rewrote the reported run's
  summary.json. Each rank is bound to its launcher now (harness.lifetime.LAUNCHED_ENV, SIGKILL)
  and the harness kills any recorded rank still alive: the side is reported killed, naming the launcher, and no rank
  outlives the report, also when one rank was stopped (SIGSTOP) and the other blocked in a collective on it."""
  import signal
  from conftest import process_alive
  out = tmp_path / "run"
  cmd = [sys.executable, "-m", "parity.cli", "compare", "--preset", "gpt2-tiny", "--sides", "fsdp", "--nproc", "2",
         "--steps", "20000", "--set", "train.eval_every=0", "--determinism-steps", "0", "--no-progress",
         "--timeout", "300", "--out", str(out)]
  parity_proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  ranks = [out / "fsdp" / f"rank{k}.json" for k in (0, 1)]
  deadline = time.time() + 240
  while time.time() < deadline and not (all(r.exists() for r in ranks) and (out / "fsdp" / "steps.jsonl").exists()):
    time.sleep(0.5)
  pids = [json.loads(r.read_text())["pid"] for r in ranks]
  agent = int(Path(f"/proc/{pids[0]}/stat").read_text().rsplit(")", 1)[1].split()[1])  # the ranks' parent
  assert "torch.distributed.run" in Path(f"/proc/{agent}/cmdline").read_text().replace("\0", " ")
  if stop_rank:
    os.kill(pids[1], signal.SIGSTOP)
    time.sleep(2)
  os.kill(agent, signal.SIGKILL)
  text, _ = parity_proc.communicate(timeout=120)
  assert parity_proc.returncode == 1, text[-2000:]
  deadline = time.time() + 15
  while time.time() < deadline and any(process_alive(p) for p in pids):
    time.sleep(0.2)
  left = [p for p in pids if process_alive(p)]
  for p in left:  # leave no orphan behind when the test fails
    os.kill(p, signal.SIGKILL)
  assert not left, left
  summary = json.loads((out / "fsdp" / "summary.json").read_text())
  assert summary["status"] == "killed", summary.get("error")
  assert summary["error"].startswith("its launcher (torch.distributed.run) was killed by signal SIGKILL")
  time.sleep(2)
  assert json.loads((out / "fsdp" / "summary.json").read_text()) == summary  # nobody writes after the report
