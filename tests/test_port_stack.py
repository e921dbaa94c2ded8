"""`parity port --stack` / `compare --deepspeed-config --stack` (parity.migrate._stack): the optimizer class, param
groups and decay mask the config's training stack really builds, in the port, its table and the run spec; every real
ZeRO-Offload config ports and compares under the stack it comes from, or is refused for a reason that stops that stack
too. In-process (no framework): tests/test_stack_oracle.py runs the HF Trainer itself."""
from __future__ import annotations

import dataclasses
import json

import pytest

from parity.migrate import Flags, port_config, read_deepspeed_config
from parity.migrate._read import PortError
from parity.migrate._reverse import port_for_compare
from parity.migrate._stack import STACKS, SOURCES, VERSIONS
from parity.presets import preset
from parity.spec import SpecError
from parity.weights import decays, param_shapes
from tests.test_migrate import REAL, flags_for

OFF = {"device": "cpu", "pin_memory": True}
B = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0}
ADAMW = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}}
CLIENT = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)

OFFLOAD_CONFIGS = {
    "determined-ai__determined__examples__deepspeed__cifar10_cpu_offloading__ds_config_offload.json": "deepspeed",
    "hiyouga__LLaMA-Factory__examples__deepspeed__ds_z2_offload_config.json": "hf-trainer",
    "hiyouga__LLaMA-Factory__examples__deepspeed__ds_z3_offload_config.json": "hf-trainer",
    "huggingface__accelerate__tests__deepspeed__ds_config_zero3_model_only.json": "accelerate",
    "huggingface__transformers__tests__deepspeed__ds_config_zero2.json": "hf-trainer",
    "huggingface__transformers__tests__deepspeed__ds_config_zero3.json": "hf-trainer",
    "lm-sys__FastChat__playground__deepspeed_config_s2.json": "hf-trainer",
    "microsoft__DeepSpeedExamples__Megatron-LM-v1.1.5-ZeRO3__examples__ds_zero_stage_infinity_config.json": "megatron",
    "microsoft__DeepSpeedExamples__Megatron-LM__scripts__ds_zero2_cpu_offload_config.json": "megatron",
    "microsoft__DeepSpeed__tests__model__Megatron_GPT2__ds_config_func_bs8_zero2_offload.json": "megatron",
}
"""Every real config with ZeRO-Offload (offload_optimizer, offload_param or the legacy cpu_offload), and the stack its
repository runs it under: Determined's DeepSpeedTrial calls deepspeed.initialize itself; the Megatron configs are
DeepSpeed's Megatron examples and tests (tests/model/Megatron_GPT2 runs its offload configs with --cpu-optimizer)."""
REFUSED_BY_EVERY_STACK = {
    "microsoft__DeepSpeedExamples__Megatron-LM-v1.1.5-ZeRO3__examples__ds_zero_stage_infinity_config.json":
        "stage3_param_persitence_threshold: unknown key; DeepSpeed 0.19.8 rejects it"}
"""Offload configs refused for a reason DeepSpeed itself raises under any stack (deepspeed_refusals)."""


def _real(name: str) -> dict:
  return read_deepspeed_config(REAL / name)


def _port(raw, **flags):
  return port_config(json.loads(json.dumps(raw)), Flags(**flags), source="t")


def test_every_real_offload_config_is_listed():
  found = {p.name for p in REAL.glob("*.json") if any(k in p.read_text() for k in ("offload", "cpu_offload\""))}
  found = {n for n in found if '"cpu_offload": false' not in (REAL / n).read_text()}
  assert found == set(OFFLOAD_CONFIGS)


@pytest.mark.parametrize("name", sorted(OFFLOAD_CONFIGS))
def test_each_real_offload_config_ports_and_compares_under_its_stack_or_every_stack_refuses_it(name):
  """Ported and mapped by compare (to_run_spec) under the stack it comes from, the table naming the optimizer class
  and the stack's groups; or refused with a reason DeepSpeed raises whatever the stack."""
  raw, stack = _real(name), OFFLOAD_CONFIGS[name]
  own = "optimizer" not in raw or stack == "megatron"  # the stack passes its own optimizer: its values are flags
  flags = dataclasses.replace(flags_for(raw), stack=stack, world_size=1, **(CLIENT if own else {}))
  r = port_config(raw, flags, source=name)
  if name in REFUSED_BY_EVERY_STACK:
    assert r.ported is None and any(REFUSED_BY_EVERY_STACK[name] in e for e in r.report.deepspeed_refusals)
    for other in STACKS:
      again = port_config(raw, dataclasses.replace(flags, stack=other), source=name)
      assert any(REFUSED_BY_EVERY_STACK[name] in e for e in again.report.deepspeed_refusals), other
    return
  assert r.ported is not None, r.report.errors
  st = r.report.stack
  assert st["stack"] == stack and st["refusal"] is None
  assert st["optimizer_class"] in st["summary"] and st["groups"] in st["summary"]
  table = json.dumps(r.report.to_dict()["entries"]) + json.dumps(r.report.implied)
  assert f"{stack} stack: {st['optimizer_class']} over {st['groups']}" in table
  assert r.ported.optimizer.decay_mask == st["decay_mask"]
  spec, ds, _ = port_for_compare(json.loads(json.dumps(raw)), preset("gpt2-tiny"), source=name, stack=stack)
  assert spec.train.decay_mask == st["decay_mask"]
  assert "cpu" in (spec.deepspeed.offload_optimizer, spec.deepspeed.offload_param)
  assert ("optimizer" in ds) == (not st["client"])  # a client optimizer: the DeepSpeed side passes it


def test_the_offload_configs_the_brief_names_port_under_the_hf_trainer():
  """FastChat's and LLaMA-Factory's ZeRO-Offload configs have no optimizer section and train daily: under the HF
  Trainer Accelerate swaps in DeepSpeedCPUAdam over the Trainer's two groups, so they are not refused."""
  for name in ("lm-sys__FastChat__playground__deepspeed_config_s2.json",
               "hiyouga__LLaMA-Factory__examples__deepspeed__ds_z2_offload_config.json"):
    r = port_config(_real(name), Flags(micro_batch=4, grad_accum=2, precision="bf16", max_grad_norm=1.0, **CLIENT),
                    source=name)
    assert r.ported is not None, r.report.errors
    assert r.report.stack["stack"] == "hf-trainer" and "auto" in r.report.stack["chosen_by"]
    assert r.ported.optimizer.impl == "client DeepSpeedCPUAdam (hf-trainer)"
    assert r.ported.optimizer.decay_mask == "no_bias_norm"
    implied = next(i for i in r.report.implied if i["key"] == "optimizer")
    assert "DeepSpeedCPUAdam over the Trainer's 2 groups" in implied["reason"]
    assert "lr and weight_decay from the Trainer (Accelerate >= 0.18.0)" in implied["reason"]


@pytest.mark.parametrize("stack, section, mask, cls", [
    ("deepspeed", True, "all", "DeepSpeedCPUAdam"),
    ("hf-trainer", True, "all", "DeepSpeedCPUAdam"),
    ("accelerate", True, "no_bias_norm", "DeepSpeedCPUAdam"),
    ("megatron", True, "no_bias_norm", "DeepSpeedCPUAdam"),
    ("hf-trainer", False, "no_bias_norm", "DeepSpeedCPUAdam"),
    ("accelerate", False, "no_bias_norm", "DeepSpeedCPUAdam"),
    ("megatron", False, "no_bias_norm", "DeepSpeedCPUAdam"),
])
def test_each_stack_under_offload(stack, section, mask, cls):
  raw = {**B, "zero_optimization": {"stage": 2, "offload_optimizer": OFF}, **({"optimizer": ADAMW} if section else {})}
  r = _port(raw, stack=stack, **CLIENT)
  assert r.ported is not None, r.report.errors
  st = r.report.stack
  assert (st["optimizer_class"], st["decay_mask"], r.ported.optimizer.decay_mask) == (cls, mask, mask)
  assert st["versions"] == VERSIONS[stack] and st["sources"] == list(SOURCES[stack])
  if stack == "megatron" and section:  # Megatron passes its own optimizer: DeepSpeed never reads the section
    assert "optimizer" not in r.ds_config and r.report.entries["optimizer.type"].fate == "not_needed"
    assert any("section (DeepSpeedCPUAdam) is ignored" in w or "is ignored" in w for w in r.report.warnings)


def test_a_bare_deepspeed_initialize_refuses_a_client_under_offload_and_names_the_stacks_that_run_it():
  raw = {**B, "zero_optimization": {"stage": 2, "offload_optimizer": OFF}}
  r = _port(raw, **CLIENT)
  assert r.report.stack["stack"] == "deepspeed" and r.ported is None
  msg = r.report.deepspeed_refusals[0]
  assert "ZeRORuntimeException" in msg and "pass --stack hf-trainer, accelerate or megatron" in msg
  assert _port(raw, stack="hf-trainer", **CLIENT).ported is not None


def test_the_legacy_cpu_offload_key_is_refused_under_the_hf_trainer():
  """Accelerate swaps only for zero_optimization.offload_optimizer.device; the legacy cpu_offload reaches DeepSpeed as
  offload with the Trainer's torch AdamW, which DeepSpeed refuses (tests/test_stack_oracle.py runs it)."""
  r = _port({**B, "zero_optimization": {"stage": 2, "cpu_offload": True}}, stack="hf-trainer", **CLIENT)
  assert r.ported is None and "not the legacy cpu_offload key" in r.report.deepspeed_refusals[0]
  assert _port({**B, "zero_optimization": {"stage": 2, "cpu_offload": True}}, stack="megatron", **CLIENT).ported


def test_without_offload_the_hf_trainer_keeps_its_torch_adamw_and_megatron_its_fused_adam():
  r = _port({**B, "zero_optimization": {"stage": 1}}, stack="hf-trainer", **CLIENT)
  assert r.report.stack["optimizer_class"] == "torch.optim.AdamW" and r.ported.optimizer.decay_mask == "no_bias_norm"
  m = _port({**B, "zero_optimization": {"stage": 1}}, stack="megatron", **CLIENT)
  assert m.report.stack["optimizer_class"] == "FusedAdam"
  f = _port({**B, "zero_force_ds_cpu_optimizer": False, "zero_optimization": {"stage": 2, "offload_optimizer": OFF}},
            stack="hf-trainer", **CLIENT)
  assert f.report.stack["optimizer_class"] == "torch.optim.AdamW"  # Accelerate keeps it: DeepSpeed accepts


def test_the_default_stack_is_the_hf_trainer_for_auto_values_else_deepspeed():
  auto = _port({**B, "train_micro_batch_size_per_gpu": "auto", "optimizer": ADAMW}, micro_batch=2)
  assert auto.report.stack["stack"] == "hf-trainer"
  assert _port({**B, "optimizer": ADAMW}).report.stack["stack"] == "deepspeed"


def test_auto_under_a_stack_that_fills_nothing_is_refused_naming_the_stack():
  r = _port({**B, "train_micro_batch_size_per_gpu": "auto", "optimizer": ADAMW}, micro_batch=2, stack="deepspeed")
  assert r.ported is None and "under --stack deepspeed nothing fills it" in r.report.errors[0]
  with pytest.raises(PortError, match="--stack 'trainer'"):
    _port({**B, "optimizer": ADAMW}, stack="trainer")


def test_megatron_ignores_the_optimizer_section_and_takes_the_flags():
  raw = {**B, "optimizer": {"type": "Adam", "params": {"lr": 0.5}}, "zero_optimization": {"stage": 1}}
  r = _port(raw, stack="megatron", **CLIENT)
  assert r.ported.optimizer.params["lr"] == CLIENT["lr"]  # Megatron's --lr, not the section's 0.5
  assert all(r.report.entries[k].fate == "not_needed" for k in r.report.entries if k.startswith("optimizer."))


def test_the_stack_is_in_the_markdown_report_and_the_cli(tmp_path, capsys):
  from parity.cli import port as cli
  r = _port({**B, "zero_optimization": {"stage": 2, "offload_optimizer": OFF}}, stack="hf-trainer", **CLIENT)
  md = r.report.to_markdown()
  assert "## Training stack" in md and "`hf-trainer` (--stack;" in md and "Decay mask `no_bias_norm`" in md
  p = tmp_path / "ds.json"
  p.write_text(json.dumps({**B, "zero_optimization": {"stage": 2, "offload_optimizer": OFF}}))
  assert cli.main([str(p), "--stack", "megatron", "--lr", "1e-3", "--betas", "0.9,0.999", "--eps", "1e-8",
                   "--weight-decay", "0.1", "-o", str(tmp_path / "o.yaml")]) == 0
  err = capsys.readouterr().err
  assert "stack megatron (--stack): DeepSpeedCPUAdam over Megatron's 2 groups" in err and "--stack megatron" in err


def test_the_run_spec_decays_what_the_stack_decays():
  """to_run_spec carries the mask to every side (train.decay_mask); parity.weights.decays reads it."""
  spec, _, _ = port_for_compare({**B, "train_micro_batch_size_per_gpu": "auto", "optimizer": ADAMW,
                                 "zero_optimization": {"stage": 2, "offload_optimizer": OFF}}, preset("gpt2-tiny"))
  assert spec.train.decay_mask == "all"
  names = param_shapes(spec.model)
  assert all(decays(n, "all") for n in names)
  assert {n for n in names if not decays(n, "no_bias_norm")} == {n for n in names if n.endswith(".bias") or
                                                                  ".ln_" in n or n.startswith("ln_f")}
  assert decays("wte.weight", "no_bias_norm") and not decays("wte.weight", "matrices")


def test_compare_refuses_stack_without_a_deepspeed_config():
  from parity.pipeline.resolve import resolve_run
  with pytest.raises(SpecError, match="--stack megatron: it says which training stack runs a DeepSpeed config"):
    resolve_run("gpt2-tiny", stack="megatron")


def test_a_ported_file_runs_its_stacks_mask_with_compare_config(tmp_path):
  """`parity compare --config ported.yaml` runs the mask the port recorded (optimizer.decay_mask)."""
  from parity.pipeline.resolve import resolve_run
  r = _port({**B, "zero_optimization": {"stage": 2, "offload_optimizer": OFF}}, stack="hf-trainer", **CLIENT)
  path = tmp_path / "ported.yaml"
  path.write_text(r.ported.dumps("yaml"))
  assert "decay_mask: no_bias_norm" in path.read_text()
  assert resolve_run("gpt2-tiny", config=path).spec.train.decay_mask == "no_bias_norm"


FASTCHAT = "lm-sys__FastChat__playground__deepspeed_config_s2.json"


@pytest.mark.parametrize("stack", ["hf-trainer", "accelerate"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_precision_flag_adds_the_section_the_config_lacks_as_accelerate_does(stack, precision):
  """Accelerate 1.16.0 DeepSpeedPlugin.set_mixed_precision (utils/dataclasses.py) adds {"bf16": {"enabled": true}}
  (fp16: {"enabled": true, "auto_cast": true}) to a config without that section when the Trainer's bf16 (fp16) or
  `accelerate launch --mixed_precision` asks for it: FastChat's config (fp16 "auto", no bf16 section) run with
  `--bf16 True`, as FastChat's scripts run it, trains in bf16 (tests/test_stack_oracle.py runs the Trainer so)."""
  raw = _real(FASTCHAT)
  if precision == "fp16":
    raw = {**raw, "fp16": None}
    del raw["fp16"]
  r = _port(raw, micro_batch=2, grad_accum=1, precision=precision, stack=stack, **CLIENT)
  assert r.ported is not None, r.report.errors
  assert r.ported.precision.compute_dtype == precision
  assert r.ds_config[precision]["enabled"] is True and r.ds_config.get("fp16" if precision == "bf16" else "bf16",
                                                                        {}).get("enabled") is not True
  added = next(i for i in r.report.implied if i["key"] == f"{precision}.enabled")
  assert added["value"] is True and "set_mixed_precision" in added["reason"]
  spec, ds, _ = port_for_compare(raw, dataclasses.replace(
      preset("gpt2-tiny"), train=dataclasses.replace(preset("gpt2-tiny").train, precision=precision)), stack=stack)
  assert spec.train.precision == precision and ds[precision]["enabled"] is True


@pytest.mark.parametrize("stack", ["megatron", "deepspeed"])
def test_a_precision_flag_without_its_section_is_not_read_by_the_other_stacks(stack):
  raw = {**B, "zero_optimization": {"stage": 1}}
  r = _port(raw, precision="bf16", stack=stack, **CLIENT)
  assert r.ported is not None and r.ported.precision.compute_dtype == "fp32" and "bf16" not in r.ds_config
  assert any("--bf16" in w and "nothing reads it" in w for w in r.report.warnings), r.report.warnings


def test_megatron_ignores_the_scheduler_section_too():
  """Megatron-DeepSpeed's setup_model_and_optimizer passes lr_scheduler=<its OptimizerParamScheduler> to
  deepspeed.initialize whenever it trains, and DeepSpeed 0.19.8 engine._configure_lr_scheduler builds the config's
  scheduler only without a client one: the section is never read. It was ported as the job's schedule, and a --lr
  that differs from its warmup_max_lr was refused as a mismatch nothing would see."""
  sched = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.5, "warmup_num_steps": 100}}
  raw = {**B, "scheduler": sched, "zero_optimization": {"stage": 1}}
  r = _port(raw, stack="megatron", **CLIENT)
  assert r.ported is not None, r.report.errors
  assert r.ported.scheduler.type == "Constant" and "scheduler" not in r.ds_config
  assert all(r.report.entries[k].fate == "not_needed" and "OptimizerParamScheduler" in r.report.entries[k].reason
             for k in r.report.entries if k.startswith("scheduler."))
  assert any("the config's scheduler section (WarmupLR) is not read: under megatron Megatron's "
             "OptimizerParamScheduler" in w for w in r.report.warnings), r.report.warnings
  assert _port(raw, stack="hf-trainer", **CLIENT).report.errors  # read there: --lr 1e-3 vs warmup_max_lr 0.5
  spec, ds, _ = port_for_compare(raw, preset("gpt2-tiny"), stack="megatron")
  assert spec.train.lr_schedule == "Constant" and "scheduler" not in ds


def test_a_flag_against_an_explicit_value_under_accelerate_names_accelerates_rule():
  """Accelerate's _prepare_deepspeed fills the config with deepspeed_config_process(must_match=False): only "auto"
  takes the script's value, an explicit one wins silently; the refusal said the HF Trainer rejects it."""
  raw = {**B, "optimizer": ADAMW, "zero_optimization": {"stage": 2, "offload_optimizer": OFF}}
  msg = _port(raw, stack="accelerate", lr=5e-4).report.errors[0]
  assert "optimizer.params.lr is 0.001 in the config but --lr gives 0.0005" in msg
  assert "HF Trainer" not in msg and "Accelerate fills only \"auto\" values" in msg and "would be ignored" in msg
  assert "the HF Trainer rejects this mismatch" in _port(raw, stack="hf-trainer", lr=5e-4).report.errors[0]


def test_the_ports_warnings_are_among_the_notes_shown_before_a_compare(tmp_path):
  """What the port warns about changes what compare compares (Megatron's unread optimizer section, the stack's own lr
  scheduler the config does not show): it is printed with the "filled in" lines (parity.report.progress.run_notes),
  with or without --no-progress, and recorded in the run folder's migration.json / migration.md."""
  from parity.pipeline.resolve import resolve_run
  from parity.report.progress import run_notes
  path = tmp_path / "ds.json"
  path.write_text(json.dumps({**B, "optimizer": {"type": "Adam", "params": {"lr": 0.5}},
                              "zero_optimization": {"stage": 1}}))
  notes = run_notes(resolve_run("gpt2-tiny", deepspeed_config=path, stack="megatron"))
  assert any(n.startswith("port warning: the config's optimizer section (Adam) is ignored") for n in notes), notes
  assert any(n.startswith("port warning: no scheduler section: under megatron") for n in notes), notes


@pytest.mark.parametrize("flag", ["--world-size", "--micro-batch", "--grad-accum", "--hidden-size"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_a_count_flag_below_one_is_refused_naming_the_flag(tmp_path, capsys, flag, value):
  """`--world-size 0` was refused as 'train_batch_size must equal micro * GAS * world; 0 != 2 * 1 * 0 = 0'."""
  from parity.cli import port as cli
  p = tmp_path / "ds.json"
  p.write_text(json.dumps({**B, "optimizer": ADAMW}))
  with pytest.raises(SystemExit) as stop:  # argparse's own exit, as for every bad flag value
    cli.main([str(p), flag, value, "-o", str(tmp_path / "o.yaml")])
  err = capsys.readouterr().err
  assert stop.value.code == 2 and f"argument {flag}: must be a whole number >= 1; got {value!r}" in err, err
  assert not (tmp_path / "o.yaml").exists()


def test_schedule_flags_that_no_auto_reads_are_reported_not_read():
  """--warmup-steps / --total-steps fill only a scheduler "auto": on a config without a scheduler section they change
  nothing, and the port says so instead of looking as if it carried the warmup."""
  name = "hiyouga__LLaMA-Factory__examples__deepspeed__ds_z2_offload_config.json"
  r = port_config(_real(name), Flags(micro_batch=4, grad_accum=2, precision="bf16", max_grad_norm=1.0,
                                     warmup_steps=100, total_steps=1000, **CLIENT), source=name)
  assert r.ported is not None, r.report.errors
  unread = [w for w in r.report.warnings if "is not read" in w]
  assert len(unread) == 2 and "--warmup-steps 100 is not read: the config has no scheduler section" in unread[0]
  assert "--total-steps 1000" in unread[1]
  # transformers' WarmupLR config reads --warmup-steps through its "auto"; it has no total_num_steps to fill
  zero2 = _real("huggingface__transformers__tests__deepspeed__ds_config_zero2.json")
  r2 = port_config(json.loads(json.dumps(zero2)), dataclasses.replace(flags_for(zero2), warmup_steps=10,
                                                                      total_steps=100), source="t")
  assert r2.ported is not None, r2.report.errors
  assert [w for w in r2.report.warnings if "is not read" in w] == [
      "--total-steps 100 is not read: the config has no scheduler.params.total_num_steps, and the flag only fills "
      "an \"auto\" there; the ported schedule is the config's (write the scheduler section to port a warmup)."]
