"""End to end: `parity compare` through the CLI and the Python API, real workers, tiny preset."""
from __future__ import annotations

import os
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import requires_all, requires_torch, requires_jax

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _cli(*args, timeout=900):
  return subprocess.run([sys.executable, "-m", "parity.cli", *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout)


@pytest.mark.process
@requires_all
def test_three_sides_reach_parity_on_real_text(tmp_path):
  out = tmp_path / "run"
  p = _cli("compare", "--preset", "gpt2-tiny", "--out", str(out), "--no-progress")
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  rep = json.loads((out / "report.json").read_text())
  assert rep["verdict"]["passed"] is True
  assert set(rep["sides"]) == {"jax", "deepspeed", "torch"}
  assert rep["data"]["source"] == "stdlib" and rep["data"]["files"] > 0
  for name, s in rep["sides"].items():
    assert s["status"] == "ok", name
    loss = s["series"]["loss"]
    assert len(loss) == rep["run"]["train"]["steps"]
    assert loss[-1] < loss[0] - 0.3, f"{name}: loss did not go down: {loss}"
    assert s["summary"]["tokens_per_s"] > 0 and s["summary"]["peak_host_rss_bytes"] > 0
  # every pair, every metric was checked and the loss check is tight
  names = {c["name"] for c in rep["checks"]}
  for pair in ("jax~deepspeed", "jax~torch", "deepspeed~torch"):
    for metric in ("loss", "grad_norm", "lr", "val_loss", "params", "completed"):
      assert f"{metric} {pair}" in names
  loss_checks = [c for c in rep["checks"] if c["metric"] == "loss"]
  assert all(c["value"] < 1e-5 and c["tolerance"] <= 1e-5 for c in loss_checks)
  # the JAX optimizer state lives in pinned_host, read from the arrays
  kinds = rep["sides"]["jax"]["summary"]["state_memory_kinds"]
  assert kinds["opt_state"] == "pinned_host" and kinds["params"] == "device"
  assert rep["sides"]["deepspeed"]["summary"]["zero_stage"] == 2
  for f in ("report.md", "report.json", "loss.png", "metrics.jsonl", "config.json"):
    assert (out / f).exists(), f
  assert "PASS" in (out / "report.md").read_text()
  # each side's first steps were rerun in a new process: the report states it was bit-identical
  for name in ("jax", "deepspeed", "torch"):
    det = rep["determinism"][name]
    assert det["deterministic"] is True and det["steps_checked"] == 8, (name, det)
  assert "## Determinism" in (out / "report.md").read_text()
  assert rep["noise_envelope"] is None  # fp32: the fixed table decides


@pytest.mark.process
@requires_all
def test_planted_mismatch_fails_at_step_zero(tmp_path):
  out = tmp_path / "run"
  p = _cli("compare", "--preset", "gpt2-tiny", "--steps", "3", "--sides", "jax,torch", "--determinism-steps", "0",
           "--out", str(out),
           "--no-progress", "--perturb", "jax:model.norm_eps=1e-3", "--train-anyway-on-card-diff")
  assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
  rep = json.loads((out / "report.json").read_text())
  first = rep["verdict"]["first_failure"]  # the semantics card names the eps first; trained anyway, the loss too
  assert first["metric"] == "semantics" and first["step"] == 0 and first["sides"] == ["jax", "torch"]
  assert "norm.eps jax=0.001 torch=1e-05" in rep["verdict"]["message"]
  loss = next(c for c in rep["checks"] if c["name"] == "loss jax~torch")
  assert not loss["passed"] and loss["first_failing_step"] == 0


@pytest.mark.process
@requires_all
def test_killed_and_nan_sides_are_reported_and_others_kept(tmp_path):
  import parity
  rep = parity.compare("gpt2-tiny", steps=5, out=tmp_path / "run", determinism_steps=0,
                       perturb=["deepspeed:kill_at_step=2", "torch:nan_at_step=3"])
  assert rep.exit_code == 1 and not rep.passed
  assert rep.side("deepspeed")["status"] == "killed" and "SIGKILL" in rep.side("deepspeed")["error"]
  assert "planted --perturb kill_at_step" in rep.side("deepspeed")["error"]  # not blamed on the OOM killer
  assert len(rep.side("deepspeed")["series"]["loss"]) == 2
  assert rep.side("torch")["status"] == "nan" and len(rep.side("torch")["series"]["loss"]) == 4
  assert rep.side("jax")["status"] == "ok" and (tmp_path / "run" / "jax" / "final.safetensors").exists()
  assert "deepspeed (killed)" in rep.message and "torch (nan)" in rep.message
  # checks that involve only finished steps still ran: jax vs deepspeed agree on steps 0-1
  loss = {c["name"]: c for c in rep.checks}["loss jax~deepspeed"]
  assert loss["passed"] and loss["detail"].endswith("over 2 steps")
  for side in ("jax", "deepspeed", "torch"):
    assert json.loads((tmp_path / "run" / side / "summary.json").read_text())["status"] == rep.side(side)["status"]


@pytest.mark.process
@requires_jax
@requires_torch
def test_hang_and_crash_are_reported(tmp_path):
  import parity
  rep = parity.compare("gpt2-tiny", steps=4, sides=["torch", "jax"], out=tmp_path / "run", timeout_s=45,
                       determinism_steps=0,
                       perturb=["jax:hang_at_step=1", "torch:raise_at_step=2"])
  assert rep.side("jax")["status"] == "timeout"
  assert rep.side("torch")["status"] == "crashed" and "injected failure at step 2" in rep.side("torch")["error"]
  assert rep.exit_code == 1 and (tmp_path / "run" / "report.md").exists()


@pytest.mark.parametrize("args, needle", [
    (["--preset", "nope"], "unknown preset"),
    (["--set", "train.lrr=1"], "unknown key 'lrr'"),
    (["--sides", "jax,mxnet"], "sides must be"),
    (["--data", "/does/not/exist"], "does not exist"),
    (["--perturb", "jax-norm"], "SIDE:KEY=VALUE"),
    (["--preset", "gpt2-tiny", "--resume-at", "15"], "--resume-at must be a step in [0, train.steps - 2 = 14]"),
    (["--preset", "gpt2-tiny", "--resume-at", "-1"], "--resume-at must be"),
    (["--preset", "gpt2-tiny", "--timeout", "0"], "--timeout must be > 0"),
    (["--preset", "gpt2-tiny", "--perturb", "jax:overflow_at_steps=[2]"], "needs loss scaling"),
    (["--preset", "gpt2-tiny", "--perturb", "jax:kill_at_step=999"], "is never reached"),
    (["--preset", "gpt2-tiny", "--perturb", "jax:overflow_at_steps=[]", "--set", 'train.precision="fp16"'],
     "empty list"),
])
def test_bad_input_exits_2_with_a_clear_message(tmp_path, capsys, args, needle):
  """In-process (cli.main: the same code as the `parity` process, without a process per case; the process's own
  exit 2 is test_negative_determinism_steps_exit_2_before_any_side_runs below)."""
  from parity.cli import main
  try:
    code = main(["compare", "--out", str(tmp_path / "r"), "--no-progress", *args])
  except SystemExit as exc:  # argparse's own refusals
    code = exc.code
  err = capsys.readouterr().err
  assert code == 2 and needle in err and "Traceback" not in err, err
  assert not (tmp_path / "r" / "jax").exists()


@pytest.mark.process
@requires_jax
@requires_torch
def test_compare_from_a_hugging_face_checkpoint(tmp_path):
  transformers = pytest.importorskip("transformers")
  import torch
  torch.manual_seed(0)
  cfg = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
  transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "hf")
  out = tmp_path / "run"
  p = _cli("compare", "--preset", "gpt2-tiny", "--steps", "4", "--sides", "jax,torch", "--determinism-steps", "0",
           "--hf-model",
           str(tmp_path / "hf"), "--out", str(out), "--no-progress")
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  rep = json.loads((out / "report.json").read_text())
  assert rep["run"]["model"]["n_layers"] == 2 and rep["run"]["model"]["norm_eps"] == 1e-5
  # every page names the checkpoint, not the preset that gave the training settings
  assert rep["checkpoint"] == {"path": str((tmp_path / "hf").absolute()), "architecture": "GPT2LMHeadModel"}
  title = "checkpoint hf (GPT2LMHeadModel, gpt2 family, "
  assert (out / "report.md").read_text().startswith(f"# parity report: {title}")
  assert json.loads((out / "card.json").read_text())["compared"]["title"].startswith(title)
  # the initial weights are the checkpoint's, not a fresh init
  from safetensors.numpy import load_file
  init = load_file(str(out / "init.safetensors"))
  hf_wte = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").transformer.wte.weight.detach().numpy()
  assert np.array_equal(init["wte.weight"], hf_wte)
  p = _cli("compare", "--hf-model", str(tmp_path / "nothing"), "--sides", "jax,torch", "--out", str(tmp_path / "r2"),
           "--no-progress")
  assert p.returncode == 2 and "nothing" in p.stderr


# The real DeepSpeed configs (tests/data/realworld/ds_configs, SOURCES.md there); PARITY_REALWORLD may name others.
REALWORLD = Path(os.environ.get("PARITY_REALWORLD") or Path(__file__).parent / "data" / "realworld" / "ds_configs")
HF_ZERO2 = REALWORLD / "huggingface__transformers__tests__deepspeed__ds_config_zero2.json"


@pytest.mark.process
@requires_all
def test_real_zero2_offload_config_runs_head_to_head(tmp_path):
  """The HF Trainer's ZeRO-2 + CPU offload config: DeepSpeed runs the file, JAX its port."""
  out = tmp_path / "run"
  p = _cli("compare", "--preset", "gpt2-tiny", "--deepspeed-config", str(HF_ZERO2), "--determinism-steps", "0",
           "--out", str(out),
           "--no-progress")
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  rep = json.loads((out / "report.json").read_text())
  assert rep["verdict"]["passed"] and rep["run"]["train"]["lr_schedule"] == "WarmupLR"
  ds = rep["sides"]["deepspeed"]["summary"]
  assert ds["ds_config"]["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
  assert ds["optimizer"]["optimizer"] == "DeepSpeedCPUAdam" and ds["optimizer"]["scheduler"] == "WarmupLR"
  assert rep["sides"]["jax"]["summary"]["state_memory_kinds"]["opt_state"] == "pinned_host"
  mig = json.loads((out / "migration.json").read_text())
  assert mig["status"] == "ported" and all(e["fate"] in ("mapped", "not_needed", "unsupported") for e in mig["entries"])


@pytest.mark.process
@requires_jax
@requires_torch
def test_ctrl_c_kills_the_running_side_and_still_writes_a_report(tmp_path):
  import os
  import signal
  import time
  out = tmp_path / "run"
  proc = subprocess.Popen([sys.executable, "-m", "parity.cli", "compare", "--preset", "gpt2-tiny", "--steps", "4",
                           "--sides", "torch,jax", "--out", str(out), "--no-progress",
                           "--perturb", "torch:hang_at_step=1"], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  steps = out / "torch" / "steps.jsonl"
  deadline = time.time() + 120
  while time.time() < deadline and not (steps.exists() and steps.read_text().count("\n") >= 1):
    time.sleep(0.2)
  worker_pid = int((out / "torch" / "pid").read_text())
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 130, err
  time.sleep(0.5)
  with pytest.raises(ProcessLookupError):
    os.kill(worker_pid, 0)  # the hanging worker is gone
  rep = json.loads((out / "report.json").read_text())
  assert rep["verdict"]["message"].startswith("INTERRUPTED") and not rep["verdict"]["passed"]
  assert rep["sides"]["torch"]["status"] == "killed" and "interrupted" in rep["sides"]["torch"]["error"]
  assert rep["sides"]["jax"]["status"] == "not_run"


@pytest.mark.process
@requires_jax
@requires_torch
@pytest.mark.parametrize("perturb, metric", [
    ("torch:train.weight_decay=0.0", "params"),   # a wrong decay mask/default: params drift by ~wd*lr per step
    ("torch:train.grad_clip=0.5", None),          # a different clipping threshold
    ("jax:train.eps=1e-6", "loss"),               # a different Adam epsilon
])
def test_wrong_optimizer_settings_are_caught(tmp_path, perturb, metric):
  out = tmp_path / "run"
  p = _cli("compare", "--preset", "gpt2-tiny", "--steps", "4", "--sides", "jax,torch", "--determinism-steps", "0",
           "--out", str(out),  # trained anyway: the per-step and params checks must catch these too, not only the card
           "--no-progress", "--perturb", perturb, "--train-anyway-on-card-diff")
  assert p.returncode == 1, p.stdout[-2000:]
  rep = json.loads((out / "report.json").read_text())
  failed = {c["metric"] for c in rep["checks"] if not c["passed"]}
  assert failed and (metric is None or metric in failed), failed


@pytest.mark.process
@requires_all
def test_compare_reruns_each_side_for_determinism_resume_and_noise(tmp_path):
  """--determinism-steps / --resume-at / --noise-envelope: the reruns live in subfolders and their checks
  are in the report; determinism is reported only, resume gates the verdict."""
  out = tmp_path / "run"
  p = _cli("compare", "--preset", "gpt2-tiny", "--steps", "8", "--sides", "jax,torch", "--determinism-steps", "4",
           "--resume-at", "3", "--noise-envelope", "--out", str(out), "--no-progress")
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  rep = json.loads((out / "report.json").read_text())
  checks = {c["name"]: c for c in rep["checks"]}
  for side in ("jax", "torch"):
    assert checks[f"{side} determinism"]["passed"] and not checks[f"{side} determinism"]["gating"]
    assert checks[f"{side} resume"]["passed"] and checks[f"{side} resume"]["gating"]
    assert rep["resume"][side]["bit_identical"] and rep["resume"][side]["resumed_at_step"] == 4
    assert "final params" in rep["resume"][side]["detail"]
    assert (out / "repeat" / side / "checkpoint" / "meta.json").exists()
    resumed = [json.loads(x)["step"] for x in (out / "resume" / side / "steps.jsonl").read_text().splitlines()]
    assert resumed == [4, 5, 6, 7]
    assert len(rep["noise_envelope"]["sides"][side]["steps"]) == 8
  env = checks["loss_envelope jax~torch"]
  assert env["passed"] and env["value"] <= env["tolerance"]
  assert rep["timing"]["self_runs_s"] > 0
  md = (out / "report.md").read_text()
  assert "## Checkpoint / resume" in md and "## Noise envelope" in md


@pytest.mark.process
@requires_all
def test_bf16_verdict_uses_the_noise_envelope_and_catches_a_planted_bug(tmp_path):
  """bf16 on every side: each side is rerun with reversed batch order; jax~torch holds its envelope, while a
  DeepSpeed side with a wrong LayerNorm eps breaks it (the fixed bf16 table alone would not decide)."""
  out = tmp_path / "run"
  p = _cli("compare", "--preset", "gpt2-tiny", "--steps", "30", "--set", 'train.precision="bf16"',
           "--perturb", "deepspeed:model.norm_eps=1e-3", "--determinism-steps", "0", "--out", str(out),
           "--no-progress", "--train-anyway-on-card-diff")  # the envelope must catch it too, not only the card
  assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
  rep = json.loads((out / "report.json").read_text())
  checks = {c["name"]: c for c in rep["checks"]}
  for metric in ("loss", "grad_norm", "val_loss", "params"):
    assert checks[f"{metric}_envelope jax~torch"]["passed"], checks[f"{metric}_envelope jax~torch"]
    assert checks[f"{metric} jax~torch"]["gating"] is False  # the envelope decides in bf16
  assert not checks["loss_envelope jax~deepspeed"]["passed"] and not checks["loss_envelope deepspeed~torch"]["passed"]
  assert "deepspeed" in rep["verdict"]["first_failure"]["sides"]
  assert set(rep["noise_envelope"]["sides"]) == {"jax", "torch", "deepspeed"}
  assert "bf16" in rep["tolerances"] and "logits" in rep["tolerances"]["bf16"]
  assert "## Noise envelope" in (out / "report.md").read_text()


@pytest.mark.process
@pytest.mark.requires_deepspeed
@pytest.mark.parametrize("steps", ["-3"])
def test_negative_determinism_steps_exit_2_before_any_side_runs(tmp_path, steps):
  p = _cli("compare", "--preset", "gpt2-tiny", "--determinism-steps", steps, "--out", str(tmp_path / "r"),
           "--no-progress", timeout=120)
  assert p.returncode == 2 and "--determinism-steps must be >= 0" in p.stderr, p.stderr
  assert not (tmp_path / "r" / "jax").exists()
