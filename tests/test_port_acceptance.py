"""`parity port` accepts exactly what the installed DeepSpeed accepts.

For every real-world config (tests/data/realworld/ds_configs) and a set of crafted edge configs, the
port's decision "DeepSpeed would refuse this" (`Report.deepspeed_refusals`) is checked against the installed
DeepSpeed itself: one subprocess, started through harness.launch, runs `deepspeed.initialize` on every resolved config
the way `parity compare` runs it (torch_impl.port_verify.accepts: CPU, one gloo rank, a tiny model, the client
optimizer of the config's training stack when it has no optimizer section: the script's torch.optim.AdamW under a bare
deepspeed.initialize, DeepSpeedCPUAdam under offload where Accelerate or Megatron hands one over:
parity.migrate._stack). The pure-Python tests below run without DeepSpeed.
"""
from __future__ import annotations

import dataclasses
import json
import types
import os

import pytest

from parity.migrate import Flags, port_config
from parity.cli import port as cli
from tests.conftest import requires_deepspeed
from tests.test_migrate import REAL_FILES, flags_for
from parity.migrate import read_deepspeed_config

B = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0}
ADAMW = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}}
OFF = {"device": "cpu", "pin_memory": False}
CLIENT = Flags(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
# name -> config. Each probes one DeepSpeed check (parse or initialize); the oracle says what DeepSpeed does.
CRAFTED = {
    "offload_client_default": {**B, "zero_optimization": {"stage": 2, "offload_optimizer": OFF}},
    "offload_client_force_true": {**B, "zero_force_ds_cpu_optimizer": True,
                                  "zero_optimization": {"stage": 2, "offload_optimizer": OFF}},
    "offload_client_force_false": {**B, "zero_force_ds_cpu_optimizer": False,
                                   "zero_optimization": {"stage": 2, "offload_optimizer": OFF}},
    "offload_with_optimizer": {**B, "optimizer": ADAMW, "zero_optimization": {"stage": 2, "offload_optimizer": OFF}},
    "offload_stage1_client": {**B, "zero_optimization": {"stage": 1, "offload_optimizer": OFF}},
    "offload_stage3_client": {**B, "zero_optimization": {"stage": 3, "offload_optimizer": OFF, "offload_param": OFF}},
    "legacy_cpu_offload_client": {**B, "zero_optimization": {"stage": 2, "cpu_offload": True}},
    "optimizer_without_type_offload": {**B, "optimizer": {"params": {"lr": 1e-3}},
                                       "zero_optimization": {"stage": 2, "offload_optimizer": OFF}},
    "no_offload_client": {**B, "zero_optimization": {"stage": 2}},
    "fp16_and_bf16": {**B, "optimizer": ADAMW, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
    "offload_param_at_stage2": {**B, "optimizer": ADAMW, "zero_optimization": {"stage": 2, "offload_param": OFF}},
    "batch_inconsistent": {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 2,
                           "gradient_accumulation_steps": 2, "optimizer": ADAMW},
    "no_batch_at_all": {"optimizer": ADAMW},
    "unknown_optimizer_type": {**B, "optimizer": {"type": "AdamWW", "params": {"lr": 1e-3}}},
    "onebit_adam": {**B, "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 10}}},
    "sgd_under_zero": {**B, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 1}},
    "sgd_under_zero_allowed": {**B, "zero_allow_untested_optimizer": True,
                               "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 1}},
    "sgd_stage0": {**B, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
    "max_grad_norm_in_optimizer": {**B, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}},
    "unknown_zero_key": {**B, "optimizer": ADAMW, "zero_optimization": {"stage": 2, "overlap_com": True}},
    "removed_top_key": {**B, "optimizer": ADAMW, "sparse_attention": {"mode": "fixed"}},
    "unknown_scheduler": {**B, "optimizer": ADAMW, "scheduler": {"type": "WarmupCosine", "params": {}}},
    "bf16_with_fp16_loss_scale_keys": {**B, "optimizer": ADAMW, "bf16": {"enabled": True, "loss_scale": 0,
                                                                         "hysteresis": 2}},
    "fp16_stage0": {**B, "optimizer": ADAMW, "fp16": {"enabled": True}},  # DeepSpeed runs it; only the port refuses
    "bf16_stage2_offload_adamw": {**B, "optimizer": ADAMW, "bf16": {"enabled": True},
                                  "zero_optimization": {"stage": 2, "offload_optimizer": OFF}},
    # offload_optimizer.ratio (ZeRO-Offload++ partial offload): stage 3 only
    "partial_offload_stage2": {**B, "optimizer": ADAMW,
                               "zero_optimization": {"stage": 2, "offload_optimizer": {**OFF, "ratio": 0.5}}},
    "partial_offload_stage3": {**B, "optimizer": ADAMW,
                               "zero_optimization": {"stage": 3, "offload_optimizer": {**OFF, "ratio": 0.5}}},
}


STACKED = {
    "offload_client_hf_trainer": ("hf-trainer", CRAFTED["offload_client_default"]),
    "offload_stage3_client_hf_trainer": ("hf-trainer", CRAFTED["offload_stage3_client"]),
    "legacy_cpu_offload_client_hf_trainer": ("hf-trainer", CRAFTED["legacy_cpu_offload_client"]),
    "legacy_cpu_offload_client_megatron": ("megatron", CRAFTED["legacy_cpu_offload_client"]),
    "offload_with_optimizer_megatron": ("megatron", CRAFTED["offload_with_optimizer"]),
}
"""Crafted configs under another training stack than the default (parity.migrate._stack): the client optimizer the
stack hands DeepSpeed decides whether it accepts them."""


def _port(raw, flags):
  return port_config(json.loads(json.dumps(raw)), flags, source="crafted")


def _cases() -> dict[str, tuple[dict, Flags]]:
  cases = {f"crafted:{k}": (v, CLIENT) for k, v in CRAFTED.items()}
  cases.update({f"crafted:{k}": (v, dataclasses.replace(CLIENT, stack=st)) for k, (st, v) in STACKED.items()})
  for path in REAL_FILES:  # world size 1: the oracle is one rank
    cases[f"real:{path.name}"] = (read_deepspeed_config(path), dataclasses.replace(flags_for(
        read_deepspeed_config(path)), world_size=1))
  return cases


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
  """{case: {"accepted", "error"}} from the installed DeepSpeed, all cases in one subprocess."""
  from harness.launch import run_module
  tmp = tmp_path_factory.mktemp("oracle")
  ported = {name: _port(raw, flags) for name, (raw, flags) in _cases().items()}
  configs = {name: r.ds_config for name, r in ported.items()}
  clients = {name: r.stack.optimizer_class if r.stack.client else None for name, r in ported.items()}
  (tmp / "req.json").write_text(json.dumps({"configs": configs, "clients": clients, "train": {
      "lr": CLIENT.lr, "beta1": CLIENT.betas[0], "beta2": CLIENT.betas[1], "eps": CLIENT.eps,
      "weight_decay": CLIENT.weight_decay}}))
  proc = run_module("torch_impl.port_verify", ["--accepts", str(tmp / "req.json"), str(tmp / "out.json")],
                    timeout_s=1800, env={"DS_ACCELERATOR": "cpu"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads((tmp / "out.json").read_text())


@pytest.mark.process
@requires_deepspeed
def test_port_refuses_exactly_what_deepspeed_refuses(oracle):
  wrong = []
  for name, (raw, flags) in _cases().items():
    r = _port(raw, flags)
    ds_ok, port_ok = oracle[name]["accepted"], not r.report.deepspeed_refusals
    if ds_ok != port_ok:
      wrong.append(f"{name}: DeepSpeed {'accepts' if ds_ok else 'refuses (' + oracle[name]['error'][:160] + ')'}, "
                   f"port says {'accepts' if port_ok else 'refuses: ' + r.report.deepspeed_refusals[0][:160]}")
  assert not wrong, "\n".join(wrong)
  assert len(CRAFTED) >= 10 and sum(not v["accepted"] for v in oracle.values()) >= 8


def test_item4_offload_with_client_optimizer_is_refused_naming_key_and_fix(capsys):
  raw = {**B, "zero_optimization": {"stage": 2, "offload_optimizer": OFF}}
  r = _port(raw, CLIENT)
  assert r.exit_code == 2 and r.ported is None
  msg = r.report.deepspeed_refusals[0]
  assert "zero_optimization.offload_optimizer.device" in msg and "ZeRORuntimeException" in msg
  assert "add an optimizer section" in msg and '"zero_force_ds_cpu_optimizer": false' in msg
  assert _port({**raw, "zero_force_ds_cpu_optimizer": False}, CLIENT).exit_code == 0
  assert _port({**raw, "optimizer": ADAMW}, CLIENT).exit_code == 0


def test_item4_compare_refuses_it_and_does_not_add_an_optimizer(capsys):
  from parity.migrate._reverse import port_for_compare
  from parity.presets import PRESETS
  from parity.spec import SpecError
  base = PRESETS["gpt2-tiny"]
  with pytest.raises(SpecError, match="zero_force_ds_cpu_optimizer"):
    port_for_compare({**B, "zero_optimization": {"stage": 2, "offload_optimizer": OFF}}, base)
  _, ds, port = port_for_compare({**B, "zero_force_ds_cpu_optimizer": False,
                                  "zero_optimization": {"stage": 2, "offload_optimizer": OFF}}, base)
  assert "optimizer" not in ds  # DeepSpeed gets the client optimizer, not a DeepSpeedCPUAdam section
  from parity.report.progress import run_notes
  notes = " ".join(run_notes(types.SimpleNamespace(port=port)))  # shown before the run starts
  assert "filled in optimizer" in notes and "torch.optim.AdamW" in notes


def test_item4_cli_says_where_it_fills_in(tmp_path, capsys):
  p = tmp_path / "ds.json"
  p.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2},
                           "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}))
  assert cli.main([str(p), "--micro-batch", "4", "--lr", "3e-4", "-o", str(tmp_path / "o.yaml")]) == 0
  err = capsys.readouterr().err
  assert "implied" in err and "gradient_accumulation_steps" in err


def test_item9_verify_timeout_exits_3_with_message(tmp_path, capsys, monkeypatch):
  from parity.migrate import verify
  p = tmp_path / "ds.json"
  p.write_text(json.dumps({**B, "optimizer": ADAMW}))

  def slow(result, *, steps, timeout, seed=0):
    raise verify.VerifyTimeout("deepspeed", timeout)
  monkeypatch.setattr(cli, "verify", slow)  # parity.cli.port binds verify at import: patch it where it is called
  code = cli.main([str(p), "--verify", "--verify-timeout", "0.5", "-o", str(tmp_path / "o.yaml"), "--quiet"])
  err = capsys.readouterr().err
  assert code == cli.EXIT_VERIFY_TIMEOUT == 3
  assert "0.5 s" in err and "--verify-timeout" in err and "Traceback" not in err


@pytest.mark.process
def test_item9_launcher_kills_the_group_at_the_timeout(tmp_path):
  from harness.launch import LaunchTimeout, run_module
  with pytest.raises(LaunchTimeout) as e:
    run_module("http.server", ["0", "--bind", "127.0.0.1"], timeout_s=1.0)
  assert e.value.timeout_s == 1.0 and "http.server" in str(e.value)


def test_item8_verify_sides_get_the_workers_environment(tmp_path):
  """The DeepSpeed side of --verify prepares its environment with the workers' own function, and both sides are
  started by the one launcher (no subprocess of its own in parity.migrate.verify)."""
  import inspect
  from harness import launch
  from parity.migrate import verify
  src = inspect.getsource(verify)
  assert "import subprocess" not in src and "subprocess.run" not in src and "harness.launch" in src
  pv = (launch.ROOT / "torch_impl" / "port_verify.py").read_text()
  assert "setup_distributed()" in pv and "TORCH_EXTENSIONS_DIR" not in pv
  from parity.buildenv import env_bin, extensions_dir
  env = launch.worker_env({"X": "1"})
  assert env["PYTHONPATH"].split(":")[0] == str(launch.ROOT) and env["X"] == "1"
  assert env["TORCH_EXTENSIONS_DIR"] == os.environ.get("TORCH_EXTENSIONS_DIR", extensions_dir())
  if os.path.exists(os.path.join(env_bin(), "ninja")):  # this environment's ninja first, never a system one
    assert env["PATH"].split(os.pathsep)[0] == env_bin()
