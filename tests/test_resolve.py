"""One resolver (parity.pipeline.resolve.resolve_run): the order the sources apply in, and the defects it removed
(a config's own preset misreported, --hf-model dropping --set model.*, overrides applied twice around
--plan, --deepspeed-config silently beating --set train.*)."""
from __future__ import annotations

import json

import pytest

from parity import hf, weights
from parity.cli import main as cli_main
from parity.pipeline.resolve import ResolvedRun, overrides_mapping, resolve_run
from parity.presets import preset
from parity.spec import SpecError


def _hf_folder(tmp_path, name="gpt2-tiny"):
  """A GPT-2 HF checkpoint folder of the preset's model, written from numpy (no torch)."""
  spec = preset(name).model
  canon = tmp_path / "w.safetensors"
  hf.save_canonical(canon, weights.init_params(spec, seed=3), spec)
  assert cli_main(["convert-weights", str(canon), str(tmp_path / "hf"), "--to", "hf"]) == 0
  return tmp_path / "hf"


def test_a_config_naming_its_own_preset_is_reported_as_that_preset(tmp_path):
  cfg = tmp_path / "run.yaml"
  cfg.write_text("preset: gpt2-tiny\ntrain:\n  lr: 0.0005\n")
  run = resolve_run(config=cfg)
  assert run.preset == "gpt2-tiny" and run.spec.model == preset("gpt2-tiny").model and run.spec.train.lr == 5e-4
  from parity.pipeline.folder import default_run_dir
  assert "gpt2-tiny" in default_run_dir(run.spec, run.preset).name
  with pytest.raises(SpecError, match="names preset 'gpt2-tiny' but the preset given is 'gpt2-mini'"):
    resolve_run("gpt2-mini", config=cfg)


def test_hf_checkpoint_keeps_model_overrides_and_refuses_ones_that_change_shapes(tmp_path):
  folder = _hf_folder(tmp_path)
  run = resolve_run("gpt2-tiny", hf_model=folder, overrides={"model.norm_eps": 1e-6, "train.steps": 3})
  assert run.spec.model.norm_eps == 1e-6 and run.spec.train.steps == 3
  assert run.init_source == str(folder.absolute()) and set(run.init_params) == set(weights.param_shapes(run.spec.model))
  with pytest.raises(SpecError, match="no longer fit"):
    resolve_run("gpt2-tiny", hf_model=folder, overrides={"model.d_model": 96})


def test_overrides_are_applied_once_after_the_plan(monkeypatch):
  import parity.pipeline.resolve as r
  calls = []
  real = r.apply_overrides
  monkeypatch.setattr(r, "apply_overrides", lambda spec, over: calls.append(dict(over)) or real(spec, over))
  run = resolve_run("gpt2-tiny", plan="zero2-offload-scan", overrides=["jax.remat=\"full\"", "train.lr=0.001"])
  assert calls == [{"jax.remat": "full", "train.lr": 0.001}]
  assert run.spec.jax.remat == "full" and run.spec.jax.scan_layers and run.spec.train.lr == 0.001
  assert run.plan["name"] == "zero2-offload-scan" and run.plan["overrides"] == ['jax.remat="full"']


def test_deepspeed_config_contradicting_a_set_is_refused_naming_both(tmp_path):
  ds = tmp_path / "ds.json"
  ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": "auto", "eps": "auto",
                                                                      "weight_decay": "auto"}},
                            "zero_optimization": {"stage": 1}, "gradient_clipping": "auto"}))
  with pytest.raises(SpecError, match=r"--set train.lr=0.003 conflicts with --deepspeed-config .*sets it to 0.0001"):
    resolve_run("gpt2-tiny", deepspeed_config=ds, overrides={"train.lr": 3e-3})
  run = resolve_run("gpt2-tiny", deepspeed_config=ds, overrides={"train.weight_decay": 0.05, "train.lr": 1e-4})
  assert run.spec.train.weight_decay == 0.05 and run.spec.train.lr == 1e-4  # "auto" takes the --set value
  assert run.deepspeed_config["optimizer"]["params"]["weight_decay"] == 0.05
  assert run.port is not None and run.deepspeed_source == str(ds)


def test_resolved_run_is_frozen_and_overrides_parse_once():
  run = resolve_run("gpt2-tiny", steps=4, sides=["jax", "torch"])
  assert isinstance(run, ResolvedRun) and run.spec.train.steps == 4 and run.plan["chosen_by"] == "default"
  with pytest.raises(AttributeError):
    run.preset = "x"  # type: ignore[misc]
  assert overrides_mapping(["train.lr=3e-4", "jax.remat=\"full\""]) == {"train.lr": 3e-4, "jax.remat": "full"}
  with pytest.raises(SpecError, match="must look like"):
    overrides_mapping(["train.lr"])
  with pytest.raises(SpecError, match="not one string"):
    overrides_mapping("train.lr=1")


def test_perturb_is_validated_against_the_runs_own_spec():
  """A per-side change that is valid for this run (OneCycle params on a OneCycle run) is accepted; one that the run
  refuses is refused naming the side (parse_perturb validated against a default RunSpec before)."""
  from parity.pipeline.folder import parse_perturb
  one_cycle = {"train.lr_schedule": "OneCycle",
               "train.lr_schedule_params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 2}}
  spec = resolve_run("gpt2-tiny", overrides=one_cycle).spec
  item = 'torch:train.lr_schedule_params={"cycle_min_lr": 2e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 2}'
  assert parse_perturb([item], spec.sides, spec)["torch"]["train.lr_schedule_params"]["cycle_min_lr"] == 2e-4
  with pytest.raises(SpecError, match="--perturb torch"):
    parse_perturb(['torch:train.lr_schedule_params={"cycle_min_lr": 2e-4}'], spec.sides, spec)


def test_a_deepspeed_config_run_says_its_plans_come_from_that_config(tmp_path):
  """A report of a --deepspeed-config run said 'memory plan: zero2-offload (default)': the plan
  record names the config the port took the plans from."""
  import json as _json
  from parity.pipeline.resolve import resolve_run
  cfg = tmp_path / "ds.json"
  cfg.write_text(_json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2},
                              "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}))
  run = resolve_run("gpt2-tiny", deepspeed_config=cfg)
  assert run.plan is None or run.plan["chosen_by"] == f"the DeepSpeed config {cfg}"
  assert run.plan is not None  # ZeRO-2 without offload matches a pair


def test_set_train_seq_len_fits_a_preset_to_a_shorter_checkpoint_context(tmp_path):
  """The checkpoint replaces the model before the overrides apply, and the context check runs after them: a preset
  whose seq_len exceeds the checkpoint's max_position_embeddings is fixed by --set train.seq_len."""
  import dataclasses
  spec = dataclasses.replace(preset("qwen2-tiny").model, max_seq_len=16)
  hf.save_hf_checkpoint(tmp_path, spec, weights.init_params(spec, seed=2))
  with pytest.raises(SpecError, match=r"train.seq_len \(32\) exceeds model.max_seq_len \(16\); lower it "
                                      r"\(--set train.seq_len=16\)"):
    resolve_run("qwen2-tiny", hf_model=tmp_path)
  run = resolve_run("qwen2-tiny", hf_model=tmp_path, overrides=["train.seq_len=16"])
  assert run.spec.train.seq_len == 16 and run.spec.model == spec and run.init_params is not None
  assert resolve_run("qwen2-tiny", hf_model=tmp_path, seq_len=8).spec.train.seq_len == 8


def test_an_empty_set_value_is_refused_naming_the_key(capsys):
  """`--set train.lr=` used to reach the config-file reader and say 'the file is empty'; it names the key now."""
  from parity.overrides import parse_overrides
  with pytest.raises(SpecError, match=r"'train.lr=' has no value after '='"):
    parse_overrides(["train.lr="])
  with pytest.raises(SpecError, match="no value"):
    parse_overrides(["train.lr=   "])
  assert parse_overrides(['data=""']) == {"data": ""}  # an explicitly empty JSON string is a value
  assert cli_main(["compare", "--set", "train.lr=", "--steps", "1"]) == 2
  assert "train.lr=' has no value" in capsys.readouterr().err


def test_fsdp_overrides_without_the_fsdp_side_are_refused_by_compare_not_by_estimate(tmp_path, capsys):
  """The fsdp section is read by the fsdp side only: a comparison without it refuses `--set fsdp.*` (exit 2, before
  any folder), while `parity estimate`, which estimates the FSDP2 side whatever the sides, takes it."""
  out = tmp_path / "r"
  assert cli_main(["compare", "--sides", "torch", "--set", "fsdp.offload=true", "--steps", "1", "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert "--set fsdp.offload" in err and "--sides torch,fsdp" in err and not out.exists()
  import parity
  with pytest.raises(SpecError, match="fsdp section is the FSDP2 side's plan"):
    parity.compare("gpt2-tiny", sides=["jax", "torch"], overrides={"fsdp.activation_offload": True},
                   out=tmp_path / "api")
  assert cli_main(["estimate", "--preset", "gpt2-tiny", "--set", "fsdp.offload=true"]) == 0
  assert cli_main(["diagnose", "--preset", "gpt2-tiny", "--set", "fsdp.offload=true", "--out",
                   str(tmp_path / "d")]) == 2
  assert "`parity diagnose` has no fsdp side" in capsys.readouterr().err and not (tmp_path / "d").exists()
