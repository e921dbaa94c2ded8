"""`parity port` records the loss normalisation a DeepSpeed job implies, as far as the config tells:
one micro batch per step on one rank makes 'tokens' and 'micro_mean' one loss; "auto" values name the HF
Trainer (its version decides); otherwise the script decides. In-process, no jax/torch."""
from __future__ import annotations

import dataclasses
import json
import types

import pytest

from parity.cli import port as cli
from parity.migrate import Flags, port_config, read_deepspeed_config
from parity.migrate._loss_norm import DECIDED_BY
from parity.migrate._report import leaf_paths
from parity.presets import PRESETS
from parity.report.progress import run_notes
from tests.test_migrate import REAL_FILES, flags_for

ADAM = {"type": "AdamW", "params": {"lr": 1e-3}}


def _record(cfg: dict, **flags) -> dict:
  return port_config(cfg, Flags(**flags), source="t").report.to_dict()["loss_normalization"]


@pytest.mark.parametrize("path", REAL_FILES, ids=lambda p: p.name[:60])
def test_every_real_config_gets_a_record_ported_or_refused(path):
  raw = read_deepspeed_config(path)
  ln = port_config(raw, flags_for(raw), source=path.name).report.to_dict()["loss_normalization"]
  assert ln["value"] == "tokens" and ln["decided_by"] in DECIDED_BY and ln["why"]
  autos = any(v == "auto" for _, v in leaf_paths(raw))
  if ln["same_loss"]:
    assert ln["decided_by"] == ("config" if flags_for(raw).world_size is not None else "assumption")
  else:
    assert ln["decided_by"] == ("hf_trainer" if autos else "script")
    assert ln["why"].startswith("not stated by the config") and "micro_mean" in ln["why"]


def test_one_micro_batch_on_one_rank_is_one_loss():
  ln = _record({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "optimizer": ADAM},
               world_size=1)
  assert (ln["decided_by"], ln["same_loss"]) == ("config", True) and "same loss" in ln["why"]
  assumed = _record({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "optimizer": ADAM})
  # one rank assumed (no --world-size) is not the config deciding (it once said "the config decides")
  assert assumed["decided_by"] == "assumption" and assumed["why"].startswith("not stated by the config")
  assert "if the job ran on one rank" in assumed["why"] and "--world-size" in assumed["why"]
  two_ranks = _record({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "optimizer": ADAM},
                      world_size=2)  # per-rank means averaged over ranks: not the step's token mean
  assert (two_ranks["decided_by"], two_ranks["same_loss"]) == ("script", False)


def test_accumulation_without_auto_is_the_scripts_choice():
  ln = _record({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4, "optimizer": ADAM})
  assert ln["decided_by"] == "script" and "training script decides" in ln["why"]
  assert "inside backward" in ln["why"] and "--set train.loss_normalization=micro_mean" in ln["why"]
  assert any("4 x world 1" in s for s in ln["signals"])


def test_auto_values_name_the_hf_trainer_and_its_version():
  ln = _record({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "optimizer": ADAM},
               micro_batch=2, grad_accum=8)
  assert ln["decided_by"] == "hf_trainer" and "4.46" in ln["why"] and "average_tokens_across_devices" in ln["why"]
  assert any("gradient_accumulation_steps, train_micro_batch_size_per_gpu" in s for s in ln["signals"])
  assert _record({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                  "optimizer": ADAM}, micro_batch=2, grad_accum=1, world_size=1)["decided_by"] == "config"


def test_the_cli_and_the_markdown_report_say_it(tmp_path, capsys):
  p = tmp_path / "ds.json"
  p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                           "optimizer": ADAM}))
  md = tmp_path / "r.md"
  assert cli.main([str(p), "-o", str(tmp_path / "o.yaml"), "--report-md", str(md), "--quiet"]) == 0
  err = capsys.readouterr().err
  assert "loss normalisation: train.loss_normalization tokens recorded; not stated by the config" in err
  text = md.read_text()
  assert "## Loss normalisation" in text and "(decided by script)" in text


def test_a_compare_on_examples_notes_what_it_trains_beside_what_the_config_implies():
  from parity.migrate._reverse import port_for_compare
  base = PRESETS["sft-tiny"]
  raw = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "optimizer": ADAM}
  spec, _, port = port_for_compare(raw, base)
  notes = run_notes(types.SimpleNamespace(port=port, spec=spec))
  assert any(n.startswith("loss normalisation: this run trains train.loss_normalization=tokens; the DeepSpeed "
                          "config: not stated by the config") for n in notes), notes
  stream = dataclasses.replace(spec, train=dataclasses.replace(spec.train, layout="stream"))
  assert not any("loss normalisation" in n for n in run_notes(types.SimpleNamespace(port=port, spec=stream)))
