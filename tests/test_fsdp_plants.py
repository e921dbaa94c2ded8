"""The planted FSDP2 bugs (parity.protocol.layout.FSDP_PLANT_KEYS), each FAILing a torch-vs-fsdp
compare naming its check, the same settings without a plant PASSing, and both refused where they cannot show:
fsdp_reduce_dtype_low (gradients reduce-scattered in bfloat16 in an fp32 run: the semantics card's dtypes.grads at
step 0) and fsdp_shard_unsynced (rank 1's shard of h.0.attn.qkv.weight never updated: loss at step 2, the first step
after the first update with lr > 0). gpt2-tiny with one block, 3 steps, 2 ranks per side on CPU (gloo)."""
from __future__ import annotations

import json

import pytest

from conftest import requires_torch
from parity.errors import SpecError
from parity.pipeline.plants import check_plants
from parity.presets import PRESETS
from parity.protocol.layout import DEBUG_KEYS, FSDP_PLANT_KEYS, parse_debug_value

SETTINGS = {"model.n_layers": 1, "train.warmup_min_ratio": 0.5}
"""One block; lr 0, 5e-4, 7.5e-4 over the 3 steps (the preset's warmup from 0 would leave only the last step an
update, which no later step's loss sees)."""
STEPS = 3


def test_the_fsdp_plants_are_debug_keys_taking_true():
  assert FSDP_PLANT_KEYS == ("fsdp_reduce_dtype_low", "fsdp_shard_unsynced")
  assert all(k in DEBUG_KEYS for k in FSDP_PLANT_KEYS)
  assert parse_debug_value("fsdp_shard_unsynced", True) is True
  with pytest.raises(ValueError, match="fsdp_reduce_dtype_low is a planted bug: it takes true"):
    parse_debug_value("fsdp_reduce_dtype_low", 1)


def test_the_fsdp_plants_are_refused_on_the_other_sides():
  spec = PRESETS["gpt2-tiny"]
  for side in ("torch", "deepspeed", "jax"):
    for key in FSDP_PLANT_KEYS:
      with pytest.raises(SpecError, match=rf"--perturb {side}:{key}=true changes nothing .*only the fsdp side"):
        check_plants(spec, {side: {key: True}})
  check_plants(spec, {"fsdp": {k: True for k in FSDP_PLANT_KEYS}})


@pytest.mark.process
@requires_torch
def test_the_unsynced_shard_needs_a_second_rank(tmp_path):
  import parity
  with pytest.raises(SpecError, match=r"fsdp:fsdp_shard_unsynced=true changes nothing .*one rank \(--nproc 1\)"):
    parity.compare("gpt2-tiny", steps=STEPS, sides=["torch", "fsdp"], out=tmp_path / "r", determinism_steps=0,
                   perturb=["fsdp:fsdp_shard_unsynced=true"])
  assert not (tmp_path / "r").exists()  # refused before any side started


def _compare(out, perturb=()):
  import parity
  report = parity.compare("gpt2-tiny", steps=STEPS, sides=["torch", "fsdp"], overrides=SETTINGS, out=out,
                          determinism_steps=0, noise_envelope=False, nproc=2, perturb=list(perturb))
  rep = json.loads((out / "report.json").read_text())
  failed = {c["name"]: c for c in rep["checks"] if not c["passed"]}
  return report, rep, failed


@pytest.mark.process
@pytest.mark.slow
@requires_torch
def test_the_same_settings_without_a_plant_pass(tmp_path):
  report, rep, failed = _compare(tmp_path / "ok")
  assert report.passed and not failed, failed
  card = json.loads((tmp_path / "ok" / "fsdp" / "semantics.json").read_text())
  assert card["items"]["dtypes.grads"] == "float32" and card["info"]["fsdp.reduce_dtype"] == "float32"


@pytest.mark.process
@pytest.mark.slow
@requires_torch
def test_a_bfloat16_gradient_reduce_fails_the_semantics_card_at_step_0(tmp_path):
  report, rep, failed = _compare(tmp_path / "low", ["fsdp:fsdp_reduce_dtype_low=true"])
  assert report.exit_code == 1 and not report.passed
  first = rep["verdict"]["first_failure"]
  assert (first["check"], first["metric"], first["step"]) == ("semantics torch~fsdp", "semantics", 0), first
  assert rep["verdict"]["message"].endswith("semantics: dtypes.grads torch=float32 fsdp=bfloat16")
  card = json.loads((tmp_path / "low" / "fsdp" / "semantics.json").read_text())
  assert (card["info"]["fsdp.param_dtype"], card["info"]["fsdp.reduce_dtype"]) == ("float32", "bfloat16")


@pytest.mark.process
@pytest.mark.slow
@requires_torch
def test_a_shard_left_unsynced_fails_loss_at_step_2(tmp_path):
  report, rep, failed = _compare(tmp_path / "uns", ["fsdp:fsdp_shard_unsynced=true"])
  assert report.exit_code == 1 and not report.passed
  first = rep["verdict"]["first_failure"]
  assert (first["check"], first["metric"], first["step"]) == ("loss torch~fsdp", "loss", 2), first
  assert first["value"] > 100 * first["tolerance"]
  assert "semantics torch~fsdp" not in failed  # nothing the card reads changed
  assert failed["params torch~fsdp"]["worst"].startswith("h.0.attn.qkv.weight"), failed["params torch~fsdp"]
