"""`parity compare --deepspeed-config` on a real ZeRO-Offload config the HF Trainer runs (FastChat's, no optimizer
section): the DeepSpeed side gets DeepSpeedCPUAdam over the Trainer's two groups (parity.migrate._stack) and agrees
with JAX, and the DeepSpeed side run with parity's own decay mask instead (the behaviour before the stack model)
FAILs at step 0 naming the tensors (process tests; each compare runs once, about 40 s at load 9 on 2 cores)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import requires_all
from tests.test_migrate import REAL

ROOT = Path(__file__).resolve().parents[1]
FASTCHAT = REAL / "lm-sys__FastChat__playground__deepspeed_config_s2.json"
MEGATRON_GPT2 = REAL / "microsoft__DeepSpeed__tests__model__Megatron_GPT2__ds_config_func_bs8_zero2_offload.json"
RUNS = {"clean": [], "planted": ["--perturb", "deepspeed:train.decay_mask=matrices"],
        "megatron": ["--deepspeed-config", str(MEGATRON_GPT2), "--stack", "megatron", "--steps", "4"]}
"""The runs (flags after the common ones; a later --deepspeed-config / --steps wins)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """name -> (exit code, report.json, output, run folder), each compare run once, when a test first asks."""
  base, cache = tmp_path_factory.mktemp("stack_compare"), {}

  def get(name: str):
    if name not in cache:
      out = base / name
      p = subprocess.run([sys.executable, "-m", "parity.cli", "compare", "--preset", "gpt2-tiny", "--deepspeed-config",
                          str(FASTCHAT), "--steps", "2", "--sides", "jax,deepspeed", "--determinism-steps", "0",
                          "--no-progress", "--out", str(out), *RUNS[name]], cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
      rep = out / "report.json"
      cache[name] = (p.returncode, json.loads(rep.read_text()) if rep.exists() else None, p.stdout + p.stderr, out)
    return cache[name]
  return get


@pytest.mark.process
@pytest.mark.slow
@requires_all
def test_an_hf_trainer_offload_config_compares_with_the_stacks_optimizer(runs):
  rc, rep, out, folder = runs("clean")
  assert rc == 0 and rep is not None, out[-3000:]
  summary = json.loads((folder / "deepspeed" / "summary.json").read_text())
  assert summary["optimizer"]["optimizer"] == "DeepSpeedCPUAdam" and summary["optimizer"]["cpu_offload"]
  assert sorted(summary["optimizer"]["group_weight_decay"]) == [0.0, 0.1]
  card = json.loads((folder / "deepspeed" / "semantics.json").read_text())["items"]
  assert "wte.weight" in card["optimizer.decay_set"] and "ln_f.weight" not in card["optimizer.decay_set"]
  assert "DeepSpeedCPUAdam over the Trainer's 2 groups" in out  # the run notes say what the stack builds
  assert "## Training stack" in (folder / "migration.md").read_text()


@pytest.mark.process
@pytest.mark.slow
@requires_all
def test_parity_own_mask_on_the_deepspeed_side_fails_at_step_0(runs):
  rc, rep, out, _ = runs("planted")
  assert rc == 1 and rep is not None, out[-3000:]
  first = rep["verdict"]["first_failure"]
  assert first["metric"] == "semantics" and first["step"] == 0
  detail = next(c["detail"] for c in rep["checks"] if c["name"] == "semantics jax~deepspeed")
  assert "optimizer.decay_set" in detail and "wpe.weight, wte.weight" in detail


@pytest.mark.process
@pytest.mark.slow
@requires_all
def test_deepspeeds_own_megatron_offload_config_compares_under_megatron(runs):
  """DeepSpeed's tests/model/Megatron_GPT2 offload config (legacy cpu_offload, fp16, no optimizer section,
  activation_checkpointing with partition_activations and contiguous_memory_optimization) under --stack megatron:
  DeepSpeedCPUAdam over Megatron's groups, and it PASSes. The DeepSpeed side stopped with 'Must specify the number of
  layers with contiguous memory checkpointing' (Megatron passes num_checkpoints=--num-layers), then, once past it,
  with an IndexError at the first validation forward (only backward frees the contiguous buffers; Megatron's evaluate
  calls deepspeed.checkpointing.reset())."""
  rc, rep, out, folder = runs("megatron")
  assert rc == 0 and rep is not None and rep["verdict"]["passed"], out[-3000:]
  summary = json.loads((folder / "deepspeed" / "summary.json").read_text())
  assert summary["optimizer"]["optimizer"] == "DeepSpeedCPUAdam" and summary["optimizer"]["activation_checkpointing"]
  assert rep["sides"]["deepspeed"]["series"]["val_loss"]  # its held-out micro batches: a forward each, reset between
