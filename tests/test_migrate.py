"""parity port: reading, fates, "auto", batch arithmetic, schedules (pure Python), round trip. No jax/torch."""
from __future__ import annotations

import json
import os
import math
from pathlib import Path

import numpy as np
import pytest

from parity.migrate import Flags, PortError, port_config, read_deepspeed_config
from parity.cli import port as cli
from parity.migrate import reference
from parity.migrate._report import leaf_paths
from parity.migrate._reverse import to_deepspeed, to_run_spec
from parity.presets import PRESETS

# The real DeepSpeed configs (tests/data/realworld/ds_configs, SOURCES.md there); PARITY_REALWORLD may name others.
REAL = Path(os.environ.get("PARITY_REALWORLD") or Path(__file__).parent / "data" / "realworld" / "ds_configs")
REAL_FILES = sorted(REAL.glob("*.json"))
GOLDEN = Path(__file__).parent / "golden" / "migrate"
GOLDEN_FILES = ["microsoft__DeepSpeedExamples__cifar__ds_config.json",
                "huggingface__transformers__tests__deepspeed__ds_config_zero3.json",
                "microsoft__DeepSpeedExamples__Megatron-LM-v1.1.5-ZeRO3__examples__ds_zero_stage_infinity_config.json"]
HF = dict(micro_batch=4, grad_accum=2, world_size=2, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
          warmup_steps=10, total_steps=100, max_grad_norm=1.0, precision="bf16", hidden_size=64)
_FLAG_OF = {"train_micro_batch_size_per_gpu": "micro_batch", "gradient_accumulation_steps": "grad_accum",
            "gradient_clipping": "max_grad_norm", "optimizer.params.lr": "lr", "optimizer.params.betas": "betas",
            "optimizer.params.eps": "eps", "optimizer.params.weight_decay": "weight_decay",
            "scheduler.params.warmup_max_lr": "lr", "scheduler.params.warmup_num_steps": "warmup_steps",
            "scheduler.params.total_num_steps": "total_steps", "fp16.enabled": "precision",
            "bf16.enabled": "precision", "zero_optimization.reduce_bucket_size": "hidden_size",
            "zero_optimization.stage3_prefetch_bucket_size": "hidden_size",
            "zero_optimization.stage3_param_persistence_threshold": "hidden_size"}
# Outcome of every real config with the flags its "auto" keys need (what a user would pass).
EXPECTED = {
    "axolotl-ai-cloud__axolotl__deepspeed_configs__zero1.json": "ported",
    "determined-ai__determined__examples__deepspeed__cifar10_cpu_offloading__ds_config_offload.json": "ported",
    "determined-ai__determined__examples__deepspeed__cifar10_moe__ds_config.json": "ported",
    "haotian-liu__LLaVA__scripts__zero2.json": "ported",
    "hiyouga__LLaMA-Factory__examples__deepspeed__ds_z0_config.json": "ported",
    "hiyouga__LLaMA-Factory__examples__deepspeed__ds_z2_autotp_config.json": "tensor_parallel",
    "hiyouga__LLaMA-Factory__examples__deepspeed__ds_z2_offload_config.json":
        "ported",  # hf-trainer: Accelerate swaps in DeepSpeedCPUAdam
    "hiyouga__LLaMA-Factory__examples__deepspeed__ds_z3_offload_config.json":
        "ported",  # hf-trainer: Accelerate swaps in DeepSpeedCPUAdam
    "huggingface__accelerate__examples__alst_ulysses_sequence_parallelism__sp-alst.ds-config.json": "ported",
    "huggingface__accelerate__examples__deepspeed_config_templates__zero_stage1_config.json": "ported",
    "huggingface__accelerate__tests__deepspeed__ds_config_zero3_model_only.json": "ported",
    "huggingface__transformers__tests__deepspeed__ds_config_zero2.json": "ported",
    "huggingface__transformers__tests__deepspeed__ds_config_zero3.json": "ported",
    "lm-sys__FastChat__playground__deepspeed_config_s2.json":
        "ported",  # hf-trainer: Accelerate swaps in DeepSpeedCPUAdam
    "microsoft__DeepSpeedExamples__Megatron-LM-v1.1.5-ZeRO3__examples__ds_zero_stage_infinity_config.json":
        "zero_optimization.stage3_param_persitence_threshold",
    "microsoft__DeepSpeedExamples__Megatron-LM__scripts__ds_zero2_cpu_offload_config.json": "ported",
    "microsoft__DeepSpeedExamples__cifar__ds_config.json": "zero_optimization.stage",  # fp16 at stage 0
    "microsoft__DeepSpeedExamples__training__MoQ__test.json": "quantize_training",
    "microsoft__DeepSpeedExamples__training__bing_bert__1-bit_adam__nccl__deepspeed_bsz4k_onebitadam_config_seq128_nccl.json":
        "optimizer.type",  # removed in 0.19.8
    "microsoft__DeepSpeedExamples__training__bing_bert__1-bit_lamb__nccl__deepspeed_bsz64k_onebitlamb_config_seq128_nccl.json":
        "optimizer.type",  # removed in 0.19.8
    "microsoft__DeepSpeedExamples__training__bing_bert__deepspeed_bsz4k_progressive_layer_drop_config_seq128.json":
        "progressive_layer_drop",
    "microsoft__DeepSpeedExamples__training__imagenet__config__ds_fp16_z1_config.json": "ported",
    "microsoft__DeepSpeedExamples__training__pipeline_parallelism__ds_config.json": "ported",
    "microsoft__DeepSpeed__tests__model__Megatron_GPT2__ds_config_func_bs8_zero2_offload.json":
        "zero_optimization.cpu_offload",  # default stack deepspeed: a client torch AdamW + offload, DeepSpeed raises
    "microsoft__DeepSpeed__tests__model__Megatron_GPT2__ds_config_func_scheduler.json":
        "optimizer.params.max_grad_norm",
    "microsoft__Megatron-DeepSpeed__examples_deepspeed__universal_checkpointing__ds_config.json": "ported",
}


def flags_for(raw: dict) -> Flags:
  """The flags a user passes for this config: one per "auto" key, the optimizer flags when it has none."""
  want = {_FLAG_OF[k] for k, v in leaf_paths(raw) if v == "auto" and k in _FLAG_OF}
  if any(k == "train_batch_size" and v == "auto" for k, v in leaf_paths(raw)):
    want |= {"micro_batch", "grad_accum"} - {k for k in ("micro_batch", "grad_accum")
                                             if not isinstance(raw.get(_key(k)), str) and _key(k) in raw}
  if "optimizer" not in raw:
    want |= {"lr", "betas", "eps", "weight_decay"}
  batch_auto = any(raw.get(k) == "auto" for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                  "gradient_accumulation_steps"))
  return Flags(**{k: HF[k] for k in want}, world_size=HF["world_size"] if batch_auto else None)


def _key(flag: str) -> str:
  return {"micro_batch": "train_micro_batch_size_per_gpu", "grad_accum": "gradient_accumulation_steps"}[flag]


def _write(tmp_path: Path, text: str) -> Path:
  p = tmp_path / "ds.json"
  p.write_text(text)
  return p


def _port(cfg: dict, **flags):
  return port_config(cfg, Flags(**flags), source="test")


BASE = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}


# --------------------------------------------------------------------------- real configs

@pytest.mark.parametrize("path", REAL_FILES, ids=lambda p: p.name[:60])
def test_real_config_without_flags_ports_or_refuses_naming_a_key(path):
  raw = read_deepspeed_config(path)
  r = port_config(raw, source=path.name)
  keys = {k for k, _ in leaf_paths(raw)}
  assert set(r.report.entries) == keys  # 100% of leaf keys have a fate
  assert all(e.fate in ("mapped", "not_needed", "unsupported") and e.reason for e in r.report.entries.values())
  assert not any("not recognised" in e.reason for e in r.report.entries.values())
  if r.ported is None:
    first = r.report.errors[0]
    names = keys | {k.split(".")[0] for k in keys} | {"optimizer", "batch"}
    assert any(n in first for n in names), first


@pytest.mark.parametrize("path", REAL_FILES, ids=lambda p: p.name[:60])
def test_real_config_with_its_flags(path):
  raw = read_deepspeed_config(path)
  r = port_config(raw, flags_for(raw), source=path.name)
  want = EXPECTED[path.name]
  if want == "ported":
    assert r.ported is not None, r.report.errors
    assert r.report.to_dict()["status"] == "ported"
  else:
    assert r.ported is None
    assert want in r.report.errors[0], r.report.errors
    assert r.report.entries[[k for k in r.report.entries if k.startswith(want)][0]].fate == "unsupported"


@pytest.mark.parametrize("name", GOLDEN_FILES)
def test_golden_reports(name):
  raw = read_deepspeed_config(REAL / name)
  r = port_config(raw, flags_for(raw), source=name)
  got = r.report.to_dict()
  golden = GOLDEN / (name.removesuffix(".json") + ".report.json")
  if not golden.exists() or os.environ.get("PARITY_UPDATE_GOLDEN") == "1":
    if os.environ.get("PARITY_UPDATE_GOLDEN") != "1":
      pytest.fail(f"golden {golden} is missing; run with PARITY_UPDATE_GOLDEN=1, review it, and commit it")
    golden.write_text(json.dumps(got, indent=2) + "\n")
  assert got == json.loads(golden.read_text())


# --------------------------------------------------------------------------- reading

def test_trailing_comma_and_comment(tmp_path):
  p = _write(tmp_path, '{\n  // batch\n  "train_batch_size": 8, # hash comment\n  "train_micro_batch_size_per_gpu": '
                       '8,\n  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3,},},\n}\n')
  assert _port(read_deepspeed_config(p)).ported is not None


def test_syntax_error_names_line_and_column(tmp_path):
  p = _write(tmp_path, '{\n  "train_batch_size": 8,\n  "optimizer": ]\n}\n')
  with pytest.raises(PortError, match=r"ds\.json:3:\d+: not valid JSON"):
    read_deepspeed_config(p)


def test_duplicate_key_is_an_error(tmp_path):
  with pytest.raises(PortError, match="duplicate key 'train_batch_size'"):
    read_deepspeed_config(_write(tmp_path, '{"train_batch_size": 8, "train_batch_size": 16}'))


# --------------------------------------------------------------------------- auto and batch

def test_auto_without_its_flag_names_key_and_flag():
  r = _port({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})
  assert r.ported is None
  assert 'optimizer.params.lr is "auto"; pass --lr' in r.report.errors[0]


def test_auto_with_flag_resolves_and_reports():
  r = _port({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, lr=3e-4)
  assert r.ported.optimizer.params["lr"] == 3e-4
  e = r.report.entries["optimizer.params.lr"]
  assert (e.value, e.resolved, e.fate) == ("auto", 3e-4, "mapped") and "--lr" in e.reason


def test_auto_bucket_size_that_comes_out_fractional_is_truncated_like_hf():
  assert not (0.9 * 768 * 768).is_integer()  # 530841.6...: DeepSpeed's int field would reject it
  cfg = {**BASE, "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                       "stage3_prefetch_bucket_size": "auto",
                                       "stage3_param_persistence_threshold": "auto"}}
  r = _port(cfg, hidden_size=768)
  assert r.ported is not None
  ent = r.report.entries
  assert ent["zero_optimization.stage3_prefetch_bucket_size"].resolved == 530841
  assert ent["zero_optimization.reduce_bucket_size"].resolved == 768 * 768
  assert ent["zero_optimization.stage3_param_persistence_threshold"].resolved == 7680
  assert ent["zero_optimization.reduce_bucket_size"].fate == "not_needed"


def test_explicit_fractional_bucket_size_is_refused():
  r = _port({**BASE, "zero_optimization": {"stage": 2, "reduce_bucket_size": 90.5}})
  assert r.ported is None and "zero_optimization.reduce_bucket_size: got 90.5" in r.report.errors[0]


def test_flag_mismatching_an_explicit_value_is_refused_like_hf():
  r = _port(BASE, lr=5e-4)
  assert r.ported is None and "optimizer.params.lr is 0.001 in the config but --lr gives 0.0005" in r.report.errors[0]


def test_inconsistent_batch_arithmetic_shows_the_arithmetic():
  r = _port({**BASE, "gradient_accumulation_steps": 3}, world_size=1)
  assert r.ported is None
  assert "8 != 4 * 3 * 1 = 12" in r.report.errors[0]


@pytest.mark.parametrize("cfg,world,want", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (4, 4, 2, 32)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 2, (8, 2, 2, 32)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2, (4, 2, 2, 16)),
    ({"train_batch_size": 32}, 4, (8, 1, 4, 32)),
    ({"train_micro_batch_size_per_gpu": 4}, 3, (4, 1, 3, 12)),
])
def test_batch_any_two_imply_the_third(cfg, world, want):
  r = _port({**cfg, "optimizer": BASE["optimizer"]}, world_size=world)
  b = r.ported.batch
  assert (b.micro, b.grad_accum, b.world, b.global_batch) == want


def test_no_batch_key_is_refused():
  r = _port({"optimizer": BASE["optimizer"]})
  assert r.ported is None and "Either train_batch_size or train_micro_batch_size_per_gpu" in r.report.errors[0]


# --------------------------------------------------------------------------- optimizer semantics

@pytest.mark.parametrize("opt,kind,impl,wd", [
    ({"type": "Adam", "params": {}}, "adamw", "FusedAdam", 0.0),
    ({"type": "Adam", "params": {"adam_w_mode": False}}, "adam", "FusedAdam", 0.0),
    ({"type": "AdamW", "params": {"adam_w_mode": False}}, "adamw", "FusedAdam", 0.0),
    ({"type": "AdamW", "params": {"torch_adam": True}}, "adamw", "torch.optim.AdamW", 0.01),
    ({"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False}}, "adam", "torch.optim.Adam", 0.0),
])
def test_adam_family(opt, kind, impl, wd):
  r = _port({**BASE, "optimizer": opt})
  o = r.ported.optimizer
  assert (o.type, o.impl, o.params["weight_decay"]) == (kind, impl, wd)


def test_offload_selects_cpu_adam_and_pinned_host():
  r = _port({**BASE, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
  assert r.ported.optimizer.impl == "DeepSpeedCPUAdam"
  assert r.ported.jax.offload_opt_state and r.ported.jax.host_memory_kind == "pinned_host"
  assert r.ported.jax.zero_stage == 2 and not r.ported.jax.offload_params


def test_nvme_is_refused_with_the_nearest_plan():
  r = _port({**BASE, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}}})
  assert r.ported is None
  assert "nvme" in r.report.errors[0] and "pinned_host" in r.report.errors[0]


def test_legacy_forms_are_read_as_deepspeed_reads_them():
  r = _port({**BASE, "zero_optimization": True, "bfloat16": {"enabled": True}})
  assert r.ported.jax.zero_stage == 1 and r.ported.precision.compute_dtype == "bf16"
  assert any("deprecated" in w for w in r.report.warnings) and any("bfloat16" in w for w in r.report.warnings)
  r = _port({**BASE, "zero_optimization": {"stage": 2, "cpu_offload": True}})
  assert r.ported.jax.offload_opt_state and r.ported.jax.host_memory_kind == "pinned_host"


def test_default_gradient_clipping_is_one_and_reported():
  r = _port(BASE)
  assert r.ported.clipping.max_global_norm == 1.0
  assert any(i["key"] == "gradient_clipping" and i["value"] == 1.0 for i in r.report.implied)


def test_one_bit_adam_is_refused_as_deepspeed_refuses_it_naming_the_uncompressed_fix():
  r = _port({**BASE, "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 10,
                                                                      "bias_correction": False}}})
  assert r.ported is None and r.report.deepspeed_refusals
  assert "not a supported DeepSpeed Optimizer" in r.report.errors[0] and '"type": "AdamW"' in r.report.errors[0]
  assert r.report.entries["optimizer.params.freeze_step"].fate == "not_needed"


def test_onecycle_with_adam_reports_beta2_override():
  r = _port({**BASE, "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}})
  assert any(i["key"] == "optimizer.params.betas[1]" and i["value"] == 0.99 for i in r.report.implied)


# --------------------------------------------------------------------------- schedules (pure Python vs by hand)

def _sched(kind, **params):
  return {**BASE, "scheduler": {"type": kind, "params": params}}


def test_warmup_zero_steps_is_refused():
  r = _port(_sched("WarmupLR", warmup_num_steps=0))
  assert r.ported is None and "warmup_num_steps must be a positive integer" in r.report.errors[0]


def test_warmup_one_step_is_clamped_to_two():
  r = _port(_sched("WarmupLR", warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=1, warmup_type="linear"))
  p = r.ported.scheduler.params
  assert [reference.lr_at("WarmupLR", p, 1.0, c) for c in range(4)] == [0.0, 0.0, 0.5, 1.0]
  assert any("clamps" in i["reason"] for i in r.report.implied)


def test_warmup_lr_without_max_uses_optimizer_lr_and_log_default():
  r = _port(_sched("WarmupLR", warmup_num_steps=10))
  p = r.ported.scheduler.params
  assert p["warmup_max_lr"] == 1e-3 and p["warmup_type"] == "log"
  assert reference.lr_at("WarmupLR", p, 1e-3, 0) == 0.0  # iteration -1: min lr
  assert reference.lr_at("WarmupLR", p, 1e-3, 1) == 0.0  # log(1) = 0
  assert math.isclose(reference.lr_at("WarmupLR", p, 1e-3, 5), 1e-3 * math.log(5) / math.log(10))


def test_total_equals_warmup_decays_to_min_right_after_warmup():
  r = _port(_sched("WarmupDecayLR", total_num_steps=10, warmup_num_steps=10, warmup_min_lr=0.1,
                   warmup_max_lr=1.0, warmup_type="linear"))
  p = r.ported.scheduler.params
  lrs = [reference.lr_at("WarmupDecayLR", p, 1.0, c) for c in range(13)]
  assert lrs[0] == 0.1 and math.isclose(lrs[10], 0.1 + 0.9 * 0.9) and lrs[11] == 0.1 and lrs[12] == 0.1


def test_warmup_cosine_step_zero_is_zero_and_matches_parity_schedule():
  from parity.numerics import schedule
  r = _port(_sched("WarmupCosineLR", total_num_steps=50, warmup_num_steps=5, warmup_type="linear",
                   warmup_min_ratio=0.1, cos_min_ratio=0.2))
  p = r.ported.scheduler.params
  for c in range(60):
    assert reference.lr_at("WarmupCosineLR", p, 1e-3, c) == schedule.lr_at_step(
        c, lr=1e-3, total_steps=50, warmup_steps=5, warmup_min_ratio=0.1, cos_min_ratio=0.2)


def test_skipped_step_does_not_advance_the_schedule():
  # The schedule is a function of applied steps: a skipped fp16 step repeats the same lr.
  p = {"warmup_min_lr": 0.0, "warmup_max_lr": 1.0, "warmup_num_steps": 4, "warmup_type": "linear"}
  applied, lrs = 0, []
  for overflow in [False, True, True, False, False]:
    lrs.append(reference.lr_at("WarmupLR", p, 1.0, applied))
    applied += not overflow
  assert lrs == [0.0, 0.0, 0.0, 0.0, 0.25]


def test_loss_scaler_hysteresis_and_window():
  s = reference.LossScaleState(scale=2.0 ** 16, hysteresis=2)
  kw = dict(window=2, min_scale=1.0, delayed_shift=2, consecutive_hysteresis=False)
  s = reference.loss_scale_update(s, True, **kw)
  assert s.scale == 2.0 ** 16 and s.hysteresis == 1
  s = reference.loss_scale_update(s, True, **kw)
  assert s.scale == 2.0 ** 15
  for _ in range(3):
    s = reference.loss_scale_update(s, False, **kw)
  assert s.scale == 2.0 ** 16 and s.hysteresis == 2


# --------------------------------------------------------------------------- round trip, RunSpec, CLI

@pytest.mark.parametrize("cfg,flags", [
    (BASE, {}),
    ({**BASE, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False, "weight_decay": 0.1}},
      "fp16": {"enabled": True, "loss_scale_window": 100}, "zero_optimization": {"stage": 1}}, {}),
    ({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
      "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}},
      "bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu",
                                                                                     "pin_memory": False}},
      "activation_checkpointing": {"cpu_checkpointing": True}}, {"world_size": 2}),
    ({**BASE, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}},
      "scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_step_size": 5}}}, {}),
    ({**BASE, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3, "max_coeff": 0.3}},
      "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100}}}, {}),
])
def test_round_trip_to_deepspeed_and_back_keeps_meaning(cfg, flags):
  first = _port(cfg, **flags).ported
  ds, report = to_deepspeed(first.to_dict(), source="rt")
  assert report.ported, report.errors
  assert set(report.entries) == {k for k, _ in leaf_paths(first.to_dict())}
  back = _port(json.loads(json.dumps(ds)), world_size=first.batch.world).ported
  assert back is not None
  strip = lambda p: {k: v for k, v in p.to_dict().items() if k != "source"}
  assert strip(back) == strip(first)


def test_to_run_spec():
  base = PRESETS["gpt2-tiny"]
  ok = _port({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95],
                                                                "weight_decay": 0.1}},
              "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 30, "warmup_num_steps": 3,
                                                                 "warmup_type": "linear", "cos_min_ratio": 0.1}},
              "bf16": {"enabled": True}}).ported
  spec = to_run_spec(ok, base)
  # compare runs base.train.steps; the schedule keeps its own length (total_num_steps 30)
  assert (spec.train.steps, spec.train.lr, spec.train.beta2, spec.train.precision) \
      == (base.train.steps, 3e-4, 0.95, "bf16")
  assert spec.train.lr_schedule == "WarmupCosineLR" and spec.train.lr_schedule_params["total_num_steps"] == 30
  assert spec.train.grad_accum_steps == 2 and spec.train.micro_batch_size == 4
  warm = to_run_spec(_port(_sched("WarmupLR", warmup_num_steps=5)).ported, base)
  assert warm.train.lr_schedule == "WarmupLR" and warm.train.lr_schedule_params["warmup_num_steps"] == 5
  # OneCycle runs in compare, with and without momentum cycling (it was once refused for the cycling)
  for cyc in (True, False):
    one = to_run_spec(_port(_sched("OneCycle", cycle_min_lr=1e-4, cycle_max_lr=1e-3, cycle_momentum=cyc)).ported, base)
    assert one.train.lr_schedule == "OneCycle" and one.train.lr_schedule_params["cycle_momentum"] is cyc


def test_cli_exit_codes_and_reports(tmp_path, capsys):
  src = _write(tmp_path, json.dumps({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}))
  assert cli.main([str(src), "--quiet"]) == 2
  assert "pass --lr" in capsys.readouterr().err
  out, rj, md = tmp_path / "o.yaml", tmp_path / "r.json", tmp_path / "r.md"
  assert cli.main([str(src), "--quiet", "--lr", "1e-3", "-o", str(out), "--report-json", str(rj),
                   "--report-md", str(md)]) == 0
  rep = json.loads(rj.read_text())
  assert rep["status"] == "ported" and {e["key"] for e in rep["entries"]} == {k for k, _ in leaf_paths(
      json.loads(src.read_text()))}
  assert all(set(e) >= {"key", "value", "fate", "target", "reason"} for e in rep["entries"])
  assert "| `optimizer.params.lr` |" in md.read_text()
  back = tmp_path / "back.json"
  assert cli.main([str(out), "--to-deepspeed", "--quiet", "-o", str(back)]) == 0
  assert json.loads(back.read_text())["optimizer"]["type"] == "AdamW"
  bad = _write(tmp_path, "{ nope: ]")
  assert cli.main([str(bad), "--quiet"]) == 2


def test_ported_yaml_runs_as_a_compare_config(tmp_path):
  """`parity port -o run.yaml` writes what `parity compare --config run.yaml` runs."""
  from parity.pipeline.resolve import resolve
  src = _write(tmp_path,
               json.dumps({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.05}},
                                     "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}}))
  out = tmp_path / "run.yaml"
  assert cli.main([str(src), "--quiet", "-o", str(out)]) == 0
  spec = resolve("gpt2-tiny", config=out)
  assert spec.train.lr == 3e-4 and spec.train.weight_decay == 0.05 and spec.train.lr_schedule == "WarmupLR"
  assert spec.model == PRESETS["gpt2-tiny"].model


# -------------------------------------------------------------------------------- the port says what DeepSpeed does

FP16 = {"enabled": True, "hysteresis": 2, "loss_scale_window": 4}


@pytest.mark.parametrize("zero, key", [({"zero_optimization": {"stage": 0}}, "zero_optimization.stage"),
                                       ({}, "fp16.enabled")])
def test_fp16_at_stage0_is_refused_naming_what_deepspeed_runs(zero, key):
  """Item 5: stage-0 fp16 was ported with hysteresis 2 for the JAX scaler; DeepSpeed's FP16_Optimizer never scales
  the loss there (tests/test_migrate_verify.py measures it)."""
  r = _port({**BASE, "fp16": FP16, **zero})
  assert r.ported is None
  err = r.report.errors[0]
  assert "FP16_Optimizer" in err and "fp16.hysteresis is never read" in err and "divides the gradient" in err
  assert "Fix: set zero_optimization.stage to 1" in err
  assert r.report.entries[key].fate == "unsupported"
  assert r.report.to_dict()["deepspeed_accepts"]  # DeepSpeed runs it; the port refuses to misstate it


def test_fp16_at_stage1_keeps_the_hysteresis_deepspeed_runs():
  p = _port({**BASE, "fp16": FP16, "zero_optimization": {"stage": 1}}).ported
  assert (p.precision.loss_scale.hysteresis, p.precision.loss_scale.window) == (2, 4)
  assert p.not_runnable_by_compare == {}


def test_reverse_refuses_fp16_at_stage0():
  p = _port({**BASE, "fp16": FP16, "zero_optimization": {"stage": 1}}).ported.to_dict()
  p["jax"]["zero_stage"] = 0
  _, report = to_deepspeed(p)
  assert not report.ported
  assert "jax.zero_stage 0" in report.errors[0] and "never multiplies the loss" in report.errors[0]


def test_not_runnable_lists_every_reason_compare_refuses_with_how_to_run_it():
  """Item 5: not_runnable_by_compare was {} on ports compare then refused; it is compare's own checks now."""
  from parity.migrate._reverse import compare_blockers
  from parity.spec import SpecError
  cfg = {**BASE, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "bias_correction": False}},
         "activation_checkpointing": {"cpu_checkpointing": True}}  # runnable: not listed
  p = _port(cfg).ported
  assert set(p.not_runnable_by_compare) == {"bias_correction"}
  assert all(v.why and v.run for v in p.not_runnable_by_compare.values())
  assert p.not_runnable_by_compare == compare_blockers(p)
  with pytest.raises(SpecError) as e:
    to_run_spec(p, PRESETS["gpt2-tiny"])
  assert "bias_correction" in str(e.value) and "cpu_checkpointing" not in str(e.value)


def test_not_runnable_is_empty_exactly_when_compare_runs_the_port():
  from parity.spec import SpecError
  seen = 0
  for path in REAL_FILES:
    raw = read_deepspeed_config(path)
    p = port_config(raw, flags_for(raw), source=path.name).ported
    if p is None:
      continue
    try:
      to_run_spec(p, PRESETS["gpt2-tiny"])
      runs = True
    except SpecError:
      runs = False
    assert runs == (not p.not_runnable_by_compare), (path.name, p.not_runnable_by_compare)
    seen += 1
  assert seen >= 10


def test_multi_rank_batch_runs_its_global_batch_with_nproc(tmp_path, capsys):
  """Item 5: world=4 was written as runnable and compare refused it ('runs one data-parallel rank')."""
  from parity.protocol.ranks import check_nproc
  p = _port({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, world_size=4).ported
  assert p.batch.world == 4 and p.not_runnable_by_compare == {}
  spec = to_run_spec(p, PRESETS["gpt2-tiny"])
  assert (spec.train.micro_batch_size, spec.train.grad_accum_steps) == (16, 2)  # the global micro batch
  check_nproc(spec.train, 4)  # --nproc 4 splits it back into the config's 4 ranks of 4
  src = _write(tmp_path, json.dumps({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                                     "gradient_accumulation_steps": 2}))
  out = tmp_path / "p.yaml"
  assert cli.main([str(src), "--quiet", "--world-size", "4", "--lr", "1e-3", "--betas", "0.9,0.95", "--eps", "1e-8",
                   "--weight-decay", "0", "-o", str(out)]) == 0
  err = capsys.readouterr().err
  assert f"wrote the ported JAX config to {out}" in err
  assert f"next: parity compare --config {out} --nproc 4" in err
  assert "--world-size 4" in err and "--betas 0.9,0.95 --verify" in err


def test_cli_names_every_reason_compare_cannot_run(tmp_path, capsys):
  src = _write(tmp_path, json.dumps({**BASE, "optimizer": {"type": "Adam", "params": {"bias_correction": False}}}))
  assert cli.main([str(src), "--quiet", "-o", str(tmp_path / "p.yaml")]) == 0
  err = capsys.readouterr().err
  assert "parity compare cannot run this port (1 reason):" in err and "bias_correction" in err
  assert "next: parity compare" not in err and f"next: parity port {src} --verify" in err


def test_to_deepspeed_keeps_what_the_jax_plan_does_not_model():
  """Item 5: --to-deepspeed turned partition_activations and contiguous_memory_optimization from true to false."""
  cfg = {**BASE, "activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": True,
                                              "number_checkpoints": 4},
         "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e8},
         "steps_per_print": 7, "wall_clock_breakdown": False}
  first = _port(cfg).ported
  ds, report = to_deepspeed(first.to_dict())
  assert report.ported, report.errors
  for key, value in leaf_paths(cfg):
    if key.split(".")[0] in ("optimizer", "train_batch_size", "train_micro_batch_size_per_gpu"):
      continue  # ported in their own right (Adam -> AdamW, the batch made explicit)
    node = ds
    for part in key.split("."):
      node = node[part]
    assert node == value, key
  assert report.entries["deepspeed_only.activation_checkpointing.partition_activations"].target == \
      "activation_checkpointing.partition_activations"
  back = _port(json.loads(json.dumps(ds))).ported
  assert back.deepspeed_only == first.deepspeed_only


def test_weight_decay_mask_is_the_training_stacks_in_the_report():
  """The mask a port records is its stack's (parity.migrate._stack): a bare deepspeed.initialize decays every tensor
  (one group), the HF Trainer's client optimizer all but biases and norm weights (transformers 5.24.0)."""
  r = _port({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}})
  why = r.report.entries["optimizer.params.weight_decay"].reason
  assert "on every tensor, biases, norm scales and embeddings included (train.decay_mask all)" in why
  assert "one group: model.parameters()" in why and r.ported.optimizer.decay_mask == "all"
  assert r.report.stack["stack"] == "deepspeed" and r.report.stack["chosen_by"].startswith("default: no")
  client = _port({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4}, lr=1e-3, betas=(0.9, 0.999),
                 eps=1e-8, weight_decay=0.1, stack="hf-trainer")
  implied = [i for i in client.report.implied if i["key"] == "optimizer"][0]["reason"]
  assert "the Trainer's 2 groups (no decay on biases and norm weights; the embeddings decayed)" in implied
  assert client.ported.optimizer.decay_mask == "no_bias_norm"
  assert client.ported.optimizer.impl == "client torch.optim.AdamW (hf-trainer)"


def test_bf16_section_with_loss_scale_keys_names_the_fix():
  """Item 9: refused (DeepSpeed 0.19.8 rejects it too) but with no fix."""
  r = _port({**BASE, "bf16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}})
  err = r.report.errors[0]
  assert "bf16.loss_scale, bf16.initial_scale_power" in err
  assert "remove these keys: bf16 has no loss scaling" in err
  assert r.report.deepspeed_refusals and len(r.report.errors) == 1
  assert r.report.entries["bf16.loss_scale"].fate == "unsupported"


def test_terminal_keeps_bracketed_text():
  """Item 9: rich read '[adam_beta1, adam_beta2]' as markup and dropped it."""
  import io
  from rich.console import Console
  r = _port({**BASE, "optimizer": {"type": "AdamW", "params": {"betas": "auto"}}}, betas=(0.9, 0.95))
  buf = io.StringIO()
  cli.print_port_table(r.report, Console(file=buf, width=600, highlight=False))
  assert "HF fills [adam_beta1, adam_beta2], from --betas" in buf.getvalue()


def test_markdown_report_keeps_pipes():
  """Item 9: migration.md wrote ||g|| as //g//."""
  md = _port({**BASE, "gradient_clipping": 1.0}).report.to_markdown()
  assert "(\\|\\|g\\|\\| + 1e-6)" in md and "//g//" not in md


def test_overflowing_number_names_its_key_path(tmp_path):
  """Item 9: 1e400 named the file but not the key."""
  p = _write(tmp_path, '{"train_batch_size": 8, // hjson\n "optimizer": {"params": {"lr": 1e400,}}}')
  with pytest.raises(PortError) as e:
    read_deepspeed_config(p)
  assert "optimizer.params.lr" in str(e.value) and str(p) in str(e.value)


def test_verify_request_runs_fp16_and_says_bf16_is_not_exercised():
  """Item 5: --verify dropped the fp16 section and said OK; it runs it now, and names what it cannot run (bf16)."""
  from parity.migrate.verify import BF16_NOT_EXERCISED, VerifyOutcome, verify_request
  fp16 = _port({**BASE, "fp16": FP16, "zero_optimization": {"stage": 1}})
  ds, jx, notes = verify_request(fp16, 5)
  assert ds["ds_config"]["fp16"]["enabled"] and ds["ds_config"]["fp16"]["hysteresis"] == 2
  assert jx["ported"]["precision"]["loss_scale"]["hysteresis"] == 2 and "fp16 runs as configured" in notes[0]
  ds, _, notes = verify_request(_port({**BASE, "bf16": {"enabled": True}}), 5)
  assert "bf16" not in ds["ds_config"] and BF16_NOT_EXERCISED in notes[0]
  out = VerifyOutcome(True, 5, 0.0, 0.0, 0.1, 0.1, "engine", notes, not_exercised=[BF16_NOT_EXERCISED])
  assert out.summary().startswith(f"verify: OK for what ran; NOT exercised: {BF16_NOT_EXERCISED}")


def test_verify_fails_on_a_loss_scale_the_port_got_wrong():
  """The fp16 comparison catches a hysteresis that differs from DeepSpeed's (the stage-0 bug of item 5)."""
  from parity.migrate.verify import _reference_params, _scale_failures
  good = _port({**BASE, "fp16": FP16, "zero_optimization": {"stage": 1}}).ported.to_dict()
  wrong = json.loads(json.dumps(good))
  wrong["precision"]["loss_scale"]["hysteresis"] = 1
  steps = 20
  _, _, ds_scale = _reference_params(good, steps, 0)  # stands for DeepSpeed's DynamicLossScaler, hysteresis 2
  _, _, jx_scale = _reference_params(wrong, steps, 0)
  assert (ds_scale != jx_scale).any()
  fails = _scale_failures({"scale": ds_scale, "skipped": np.zeros(steps, bool)},
                          {"scale": jx_scale, "skipped": np.zeros(steps, bool)}, ds_scale, engine=True)
  k = int(np.flatnonzero(ds_scale != jx_scale)[0])
  assert fails and fails[0].startswith(f"fp16 loss scale at step {k}: DeepSpeed")


def test_to_deepspeed_says_which_activation_keys_it_wrote_as_defaults():
  p = _port({**BASE, "activation_checkpointing": {"partition_activations": True}}).ported.to_dict()
  _, report = to_deepspeed(p)
  assert not any("partition_activations" in w for w in report.warnings)
  assert any("contiguous_memory_optimization" in w and "default (false)" in w for w in report.warnings)


def test_a_port_prints_its_outcome_before_the_key_table_and_a_refusal_prints_the_table(tmp_path, capsys):
  """A ported config: 'parity port: ported <src>: N keys (...)' is the first line, the key table after it; a refused
  one still prints the whole table and every reason."""
  src = _write(tmp_path, json.dumps({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}))
  assert cli.main([str(src), "-o", str(tmp_path / "o.yaml")]) == 0
  err = capsys.readouterr().err
  first = err.strip().splitlines()[0]
  assert first.startswith(f"parity port: ported {src}: ") and "mapped" in first and "key table follows" in first
  assert err.index("mapped") < err.index("parity port: wrote")
  assert "optimizer.params.lr" in err.split(first, 1)[1]  # the table still comes, after the outcome
  bad = _write(tmp_path, json.dumps({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}))
  assert cli.main([str(bad)]) == 2
  err = capsys.readouterr().err
  assert "parity port: ported" not in err and "optimizer.params.lr" in err and "pass --lr" in err


def test_port_makes_the_folders_of_its_outputs(tmp_path, capsys):
  """-o / --report-md into a folder that does not exist yet: made, as `compare --out` makes its folder (was: exit 1,
  'cannot write ... (No such file or directory)' after the whole table)."""
  cfg = tmp_path / "ds.json"
  cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}))
  out = tmp_path / "new" / "deeper"
  from parity.cli import main
  rc = main(["port", str(cfg), "-o", str(out / "jax_run.yaml"), "--report-md", str(out / "migration.md"), "--quiet"])
  assert rc == 0, capsys.readouterr()
  assert (out / "jax_run.yaml").is_file() and (out / "migration.md").is_file()
