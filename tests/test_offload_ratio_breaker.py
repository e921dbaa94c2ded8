"""jax.offload_opt_ratio as a user gives it (the CLI, a run config, a ported YAML read back, a DeepSpeed config):
each bad value is refused with exit 2, naming the key and the value as written, never read as another number."""
from __future__ import annotations

import json

import pytest
import yaml

from parity.cli import main


@pytest.mark.parametrize("value", ["true", "false"])
def test_a_boolean_ratio_on_the_cli_is_refused_not_read_as_one_or_zero(value, capsys):
  """float(True) is 1.0: `--set jax.offload_opt_ratio=true` ran as 'offload all of it' and `false` was refused as
  'got 0.0', a value the user never wrote."""
  assert main(["estimate", "--preset", "gpt2-tiny", "--set", f"jax.offload_opt_ratio={value}"]) == 2
  err = capsys.readouterr().err
  assert "jax.offload_opt_ratio" in err and value in err and "0.0" not in err and "Traceback" not in err


def test_a_boolean_in_any_float_field_of_a_run_config_is_refused(tmp_path, capsys):
  """The same rule for every float field of a YAML run config (train.lr here): true is not 1.0."""
  cfg = tmp_path / "run.yaml"
  cfg.write_text(yaml.safe_dump({"train": {"lr": True}}))
  assert main(["estimate", "--preset", "gpt2-tiny", "--config", str(cfg)]) == 2
  err = capsys.readouterr().err
  assert "train.lr" in err and "true" in err.lower() and "Traceback" not in err


def _ported(tmp_path, ratio) -> str:
  """A ZeRO-3 DeepSpeed config with the optimizer state offloaded at ratio 0.5, ported to YAML, its ratio then
  replaced by `ratio` (as a user edits the port)."""
  ds = tmp_path / "ds.json"
  ds.write_text(json.dumps({
      "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0}},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}))
  out = tmp_path / "ported.yaml"
  assert main(["port", "--quiet", str(ds), "-o", str(out)]) == 0
  doc = yaml.safe_load(out.read_text())
  assert doc["jax"]["offload_opt_ratio"] == 0.5
  doc["jax"]["offload_opt_ratio"] = ratio
  edited = tmp_path / "edited.yaml"
  edited.write_text(yaml.safe_dump(doc))
  return str(edited)


@pytest.mark.parametrize("ratio", [True, False])
def test_the_reverse_port_refuses_a_boolean_ratio(ratio, tmp_path, capsys):
  """pydantic's lax float took true as 1.0: the DeepSpeed config written back offloaded all of the optimizer state,
  silently."""
  edited = _ported(tmp_path, ratio)
  capsys.readouterr()
  assert main(["port", "--quiet", "--to-deepspeed", edited, "-o", str(tmp_path / "back.json")]) == 2
  err = capsys.readouterr().err
  assert "jax.offload_opt_ratio" in err and str(ratio).lower() in err.lower() and "Traceback" not in err
  assert not (tmp_path / "back.json").exists()


def test_a_ratio_override_the_deepspeed_config_contradicts_names_the_fix_that_exists(tmp_path):
  """The conflict message told the user to set the config's value to "auto", which the port refuses for
  offload_optimizer.ratio (nothing fills it): for a plan key the fix is the config's own value."""
  from parity.pipeline.resolve import resolve_run
  from parity.spec import SpecError
  ds = tmp_path / "ds.json"
  ds.write_text(json.dumps({
      "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0}},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}}))
  assert resolve_run("gpt2-tiny", deepspeed_config=ds).spec.jax.offload_opt_ratio == 0.3
  with pytest.raises(SpecError) as err:
    resolve_run("gpt2-tiny", deepspeed_config=ds, overrides=["jax.offload_opt_ratio=0.5"])
  msg = str(err.value)
  assert "jax.offload_opt_ratio=0.5" in msg and "0.3" in msg and "drop the --set" in msg and "auto" not in msg
  ratio_auto = json.loads(ds.read_text())
  ratio_auto["zero_optimization"]["offload_optimizer"]["ratio"] = "auto"
  ds.write_text(json.dumps(ratio_auto))
  with pytest.raises(SpecError, match="ratio is \"auto\", which nothing resolves"):  # the hint's fix did not work
    resolve_run("gpt2-tiny", deepspeed_config=ds, overrides=["jax.offload_opt_ratio=0.5"])


def test_plan_auto_with_a_ratio_its_pair_cannot_take_says_the_planner_chose_it():
  """gpt2-tiny fits an H100 without offload: --plan auto picks a pair that keeps the optimizer state on the device,
  so a --set ratio below 1 cannot apply. The error named "plan 'zero0'", a plan the user never gave (compare's
  resolve_run)."""
  from parity.pipeline.resolve import resolve_run
  from parity.spec import SpecError
  with pytest.raises(SpecError) as err:
    resolve_run("gpt2-tiny", plan="auto", overrides=["jax.offload_opt_ratio=0.3"])
  msg = str(err.value)
  assert msg.startswith("--plan auto chose 'zero0'") and "jax.offload_opt_ratio 0.3" in msg
  assert "jax.offload_opt_state=true" in msg


@pytest.mark.parametrize("sub_group_size", [None, 1000])
def test_the_port_says_deepspeed_offloads_whole_sub_groups(sub_group_size, tmp_path):
  """DeepSpeed splits each param group into sub-groups of zero_optimization.sub_group_size elements (default 1e9;
  stage3.py `_create_fp16_sub_groups`) and puts sub-group i on the CPU when i >= int((1 - ratio) · n): a model with
  one sub-group has all of its optimizer state on the CPU at ratio 0.3 (int(0.7) = 0). The port said the JAX plan's
  per-leaf 30% was DeepSpeed's placement; it now warns, naming the sub-group size that decides."""
  from parity.migrate import port_config
  zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}
  if sub_group_size is not None:
    zero["sub_group_size"] = sub_group_size
  raw = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0}},
         "zero_optimization": zero}
  res = port_config(raw)
  assert res.ported is not None and res.ported.jax.offload_opt_ratio == 0.3
  warned = [w for w in res.report.warnings if "offload_optimizer.ratio" in w]
  assert len(warned) == 1, res.report.warnings
  size = f"{sub_group_size or 10**9:,}"
  assert "whole sub-groups" in warned[0] and size in warned[0] and "all of its optimizer state on the CPU" in warned[0]
  assert "sub_group_size" in warned[0]
