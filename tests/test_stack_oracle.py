"""The HF-Trainer oracle of the training-stack model (parity.migrate._stack): the real transformers Trainer, with
Accelerate and DeepSpeed on the CPU (one process, tests/stack_oracle.py), trains a tiny random LlamaForCausalLM under
every real ZeRO-Offload config of tests/data/realworld (whichever stack it comes from: the Trainer runs them all,
given the TrainingArguments each config's fixed values require), and

  * a config the port refuses under --stack hf-trainer stops the Trainer too, for the reason the refusal names;
  * for every other one, the stack model predicts the optimizer class, its mode, the param groups (which tensors,
    with which weight decay) and the hyperparameters the Trainer built, exactly;
  * parity's DeepSpeed side, run from the port of the config (`compare --deepspeed-config --stack hf-trainer`: the
    run spec plays the TrainingArguments), builds the same and reproduces the Trainer's losses within the loss bound
    of the config's precision;
  * a planted decay-mask difference FAILs: the same side run with parity's own mask ('matrices') leaves the bound,
    and a stack model that predicts another mask than the Trainer's is caught naming the tensors.

Versions: those of constraints.txt (transformers 5.24.0, accelerate 1.16.0, DeepSpeed 0.19.8, torch 2.13.0).
Runtime: one subprocess, about 43 s of CPU (60-80 s wall at load 4-6 on 2 cores, measured 2026-12-06; 13 cases).
"""
from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json

import pytest

from parity.migrate import Flags, port_config, read_deepspeed_config
from parity.migrate import _stack
from parity.numerics.schedule import lr_at
from parity.verdict.tolerances import tolerance
from parity.weights import decays
from tests.conftest import requires_deepspeed
from tests.test_migrate import REAL
from tests.test_port_stack import OFFLOAD_CONFIGS

TRAIN = dict(micro=2, grad_accum=2, steps=4, seq_len=16, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.5,
             max_grad_norm=1.0, warmup_steps=2)
"""The TrainingArguments (and the port's flags). lr x weight_decay = 5e-3 so that decay moves a decayed tensor by 0.5%
a step: a mask that decays other tensors then moves the step-3 loss by 7.9e-5 (one group vs parity's mask) to 1.5e-3
(the Trainer's two groups vs parity's mask), measured; at 1e-3 x 0.1 the same plants move it by ~1e-6, under the fp32
bound, and would prove nothing. warmup_steps fills the WarmupLR sections' "auto" (DeepSpeed 0.19.8 refuses 0); the
Trainer's own scheduler is 'constant', as the port assumes where a config has no scheduler section."""
LOSS_BOUND = tolerance("fp32", "loss").atol
"""The fp32 per-step loss bound of every comparison (parity.verdict.tolerances: independent fp32 stacks agree to
<= 4.3e-6); measured here: <= 7.2e-7, one or two fp32 ulps of the ~4.15 nats loss, every fp32 config and step. The two
fp16 configs take the fp16 bound (1e-2, parity.verdict.tolerances); measured 9.5e-7 (Determined's) and 4.3e-6
(DeepSpeedExamples' Megatron one)."""
TRAINS = ("lm-sys__FastChat__playground__deepspeed_config_s2.json",
          "hiyouga__LLaMA-Factory__examples__deepspeed__ds_z2_offload_config.json",
          "hiyouga__LLaMA-Factory__examples__deepspeed__ds_z3_offload_config.json",
          "huggingface__transformers__tests__deepspeed__ds_config_zero2.json",
          "huggingface__transformers__tests__deepspeed__ds_config_zero3.json",
          "huggingface__accelerate__tests__deepspeed__ds_config_zero3_model_only.json",
          "determined-ai__determined__examples__deepspeed__cifar10_cpu_offloading__ds_config_offload.json",
          "microsoft__DeepSpeedExamples__Megatron-LM__scripts__ds_zero2_cpu_offload_config.json")
"""The real ZeRO-Offload configs (tests/test_port_stack.py OFFLOAD_CONFIGS) the HF Trainer trains: the first three
have no optimizer section and offload_optimizer (Accelerate swaps in DeepSpeedCPUAdam over the Trainer's 2 groups),
the next two an AdamW section (DeepSpeed builds it over one group), Accelerate's offload_param-only config none (the
Trainer's torch AdamW stays), Determined's an Adam section under ZeRO-3 with both offloads in fp16 (DeepSpeedCPUAdam,
AdamW mode: DeepSpeed's adam_w_mode defaults to true) and DeepSpeedExamples' Megatron one an Adam section with the
legacy cpu_offload key and only lr set (DeepSpeedCPUAdam with DeepSpeed's defaults, whatever the Trainer's betas)."""
REFUSED = {
    "microsoft__DeepSpeedExamples__Megatron-LM-v1.1.5-ZeRO3__examples__ds_zero_stage_infinity_config.json":
        "stage3_param_persitence_threshold",
    "microsoft__DeepSpeed__tests__model__Megatron_GPT2__ds_config_func_bs8_zero2_offload.json": "ZeRORuntimeException",
}
"""The real ZeRO-Offload configs the HF Trainer stops at, and what both its error and the port's refusal name: a
misspelt key DeepSpeed's config model forbids, and the legacy cpu_offload key with no optimizer section (Accelerate
does not swap for it, DeepSpeed refuses the Trainer's torch AdamW)."""
REAL_CASES = TRAINS + tuple(REFUSED)
PLANTED = {"lm-sys__FastChat__playground__deepspeed_config_s2.json": "matrices",
           "huggingface__transformers__tests__deepspeed__ds_config_zero2.json": "matrices"}
"""Replays with parity's own decay mask instead of the stack's: what the DeepSpeed side ran before the stack model."""
_FASTCHAT = read_deepspeed_config(REAL / TRAINS[0])
CRAFTED = {
    "legacy_cpu_offload": {**_FASTCHAT, "zero_optimization": {"stage": 2, "cpu_offload": True}},
    "zero_force_ds_cpu_optimizer_false": {**_FASTCHAT, "zero_force_ds_cpu_optimizer": False},
    "bf16_without_a_bf16_section": _FASTCHAT,
}
"""Three edges of the model: the legacy offload key (Accelerate does not see it, DeepSpeed refuses the Trainer's
AdamW), zero_force_ds_cpu_optimizer false (Accelerate keeps the Trainer's torch AdamW, DeepSpeed accepts it), and
FastChat's config (fp16 "auto", no bf16 section) run with bf16=True as FastChat's scripts run it (Accelerate adds
the bf16 section: the job trains in bf16)."""
FP16_CONFIG = "determined-ai__determined__examples__deepspeed__cifar10_cpu_offloading__ds_config_offload.json"
CRAFTED["fp16_on_a_cpu_without_it"] = read_deepspeed_config(REAL / FP16_CONFIG)
CRAFTED_ARGS = {"bf16_without_a_bf16_section": {"bf16": True}, "fp16_on_a_cpu_without_it": {"device_fp16": "absent"}}
"""bf16=True for FastChat's config; Determined's fp16 config run as on a CPU without fp16 (DeepSpeed's CPU accelerator
reports it unsupported and nothing lifts that: tests/stack_oracle.py), whatever this CPU has."""
_MISSING = [m for m in ("transformers", "accelerate") if importlib.util.find_spec(m) is None]
needs_stack = pytest.mark.skipif(bool(_MISSING), reason=f"{', '.join(_MISSING)} not installed (the dev extra)")
pytestmark = pytest.mark.cpu_features  # fp16 depends on the CPU: tests/cpu_masks/run reruns this module masked


def args_for(raw: dict) -> dict:
  """The TrainingArguments (TRAIN's keys, fp16 added) a Trainer user passes with `raw`: TRAIN, with every value the
  config fixes taken from it (transformers' trainer_config_process rejects a TrainingArguments value that differs
  from a number the config sets). A value the config leaves out stays TRAIN's: the Trainer fills only "auto", so the
  optimizer then gets DeepSpeed's default, which the port must predict."""
  t, num = {**TRAIN, "fp16": False}, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
  opt = (raw.get("optimizer") or {}).get("params") or {}
  sched = (raw.get("scheduler") or {}).get("params") or {}
  pairs = {"grad_accum": raw.get("gradient_accumulation_steps"), "micro": raw.get("train_micro_batch_size_per_gpu"),
           "lr": opt.get("lr"), "eps": opt.get("eps"), "weight_decay": opt.get("weight_decay"),
           "max_grad_norm": raw.get("gradient_clipping"), "warmup_steps": sched.get("warmup_num_steps")}
  t.update({k: v for k, v in pairs.items() if num(v)})
  if isinstance(opt.get("betas"), list):
    t["beta1"], t["beta2"] = opt["betas"]
  if num(raw.get("train_micro_batch_size_per_gpu")) or num(raw.get("train_batch_size")):
    t["grad_accum"] = raw.get("gradient_accumulation_steps") if num(raw.get("gradient_accumulation_steps")) else 1
  if num(raw.get("train_batch_size")):
    t["micro"] = raw["train_batch_size"] // t["grad_accum"]
  t["fp16"] = (raw.get("fp16") or {}).get("enabled") is True
  return t


def _args(name: str, raw: dict) -> dict:
  return {**args_for(raw), **CRAFTED_ARGS.get(name, {})}


def _flags(t: dict = TRAIN) -> Flags:
  return Flags(micro_batch=t["micro"], grad_accum=t["grad_accum"], world_size=1, lr=t["lr"],
               betas=(t["beta1"], t["beta2"]), eps=t["eps"], weight_decay=t["weight_decay"],
               max_grad_norm=t["max_grad_norm"], warmup_steps=t["warmup_steps"],
               precision="fp16" if t.get("fp16") else ("bf16" if t.get("bf16") else "fp32"), hidden_size=32,
               stack="hf-trainer")


def _configs() -> dict[str, dict]:
  return {**{n: read_deepspeed_config(REAL / n) for n in REAL_CASES}, **copy.deepcopy(CRAFTED)}


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
  """{case: {"hf": what the Trainer built and ran, "parity": parity's DeepSpeed side, "planted": with a plant}}."""
  from harness.launch import run_module
  tmp = tmp_path_factory.mktemp("stack_oracle")
  cases = {n: {"config": c, "replay": n in TRAINS, "plant_mask": PLANTED.get(n), "train": _args(n, c)}
           for n, c in _configs().items()}
  (tmp / "req.json").write_text(json.dumps({"cases": cases, "train": TRAIN}))
  proc = run_module("tests.stack_oracle", [str(tmp / "req.json"), str(tmp / "out.json")], timeout_s=900,
                    env={"DS_ACCELERATOR": "cpu"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads((tmp / "out.json").read_text())


def predicted(raw: dict, names: list[str], args: dict | None = None) -> dict:
  """What the port's stack model says the Trainer (given `args`, default `args_for(raw)`) builds for `raw` over the
  model's canonical tensors `names`: the optimizer class (its last name), adamw mode, the engine's precision, the
  groups [(decayed names, weight_decay), (the rest, 0.0)] (one group under 'all'), lr (the port's schedule after
  TRAIN's steps), betas, eps; or {'refused': the DeepSpeed refusal}."""
  r = port_config(copy.deepcopy(raw), _flags(args or args_for(raw)), source="oracle")
  if r.ported is None:
    return {"refused": r.report.deepspeed_refusals[0] if r.report.deepspeed_refusals else r.report.errors[0]}
  st, o, sched = r.stack, r.ported.optimizer, r.ported.scheduler
  wd = o.params["weight_decay"]
  decayed = sorted(n for n in names if decays(n, st.decay_mask))
  rest = sorted(n for n in names if not decays(n, st.decay_mask))
  groups = [(decayed, wd)] + ([(rest, 0.0)] if rest else [])
  return {"optimizer": st.optimizer_class.rsplit(".", 1)[-1], "adamw_mode": o.type == "adamw",
          "precision": r.ported.precision.compute_dtype, "groups": groups,
          "lr": lr_at(sched.type, sched.params, o.params["lr"], TRAIN["steps"]), "betas": o.params["betas"],
          "eps": o.params["eps"]}


def differences(built: dict, want: dict) -> list[str]:
  """Every way what a run built (the oracle's record: optimizer, adamw_mode, precision, groups) differs from
  `want`."""
  out = [f"{k}: built {built[k]!r}, predicted {want[k]!r}" for k in ("optimizer", "adamw_mode", "precision")
         if built[k] != want[k]]
  got = [(g["names"], g["weight_decay"]) for g in built["groups"]]
  if got != want["groups"]:
    for (gn, gw), (wn, ww) in zip(got + [([], None)] * len(want["groups"]), want["groups"] + [([], None)] * len(got)):
      extra, missing = sorted(set(gn) - set(wn)), sorted(set(wn) - set(gn))
      if extra or missing or gw != ww:
        out.append(f"group weight_decay {gw} (predicted {ww}): built also {extra}, predicted also {missing}")
  for g in built["groups"]:
    for k in ("lr", "betas", "eps"):
      if g[k] != pytest.approx(want[k], rel=1e-12):
        out.append(f"group {k} {g[k]}, predicted {want[k]}")
  return out


def _names(rec: dict) -> list[str]:
  return sorted(n for g in rec["groups"] for n in g["names"])


def test_the_oracle_covers_every_real_offload_config():
  assert set(REAL_CASES) == set(OFFLOAD_CONFIGS) and not set(TRAINS) & set(REFUSED)


@pytest.mark.process
@requires_deepspeed
@needs_stack
@pytest.mark.parametrize("name", TRAINS)
def test_the_stack_model_predicts_what_the_trainer_built(oracle, name):
  hf = oracle[name]["hf"]
  assert "error" not in hf, hf
  assert differences(hf, predicted(read_deepspeed_config(REAL / name), _names(hf))) == []
  assert hf["versions"]["accelerate"] == "1.16.0"


@pytest.mark.process
@requires_deepspeed
@needs_stack
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_config_the_port_refuses_stops_the_trainer_for_the_same_reason(oracle, name):
  hf = oracle[name]["hf"]
  want = predicted(read_deepspeed_config(REAL / name), [])
  assert "refused" in want and REFUSED[name] in want["refused"], want
  assert REFUSED[name] in hf.get("error", ""), hf


@pytest.mark.process
@requires_deepspeed
@needs_stack
@pytest.mark.parametrize("name", TRAINS)
def test_paritys_deepspeed_side_builds_the_same_and_reproduces_the_losses(oracle, name):
  hf, mine = oracle[name]["hf"], oracle[name]["parity"]
  assert differences(mine, {**{k: hf[k] for k in ("optimizer", "adamw_mode", "precision")},
                            "groups": [(g["names"], g["weight_decay"]) for g in hf["groups"]],
                            **{k: hf["groups"][0][k] for k in ("lr", "betas", "eps")}}) == []
  assert mine["wrapper"] == hf["wrapper"] and len(mine["losses"]) == len(hf["losses"]) == TRAIN["steps"]
  bound = tolerance("fp16" if args_for(read_deepspeed_config(REAL / name))["fp16"] else "fp32", "loss").atol
  worst = max(abs(a - b) for a, b in zip(hf["losses"], mine["losses"]))
  assert worst <= bound, (worst, hf["losses"], mine["losses"])


@pytest.mark.process
@requires_deepspeed
@needs_stack
@pytest.mark.parametrize("name", sorted(PLANTED))
def test_a_planted_decay_mask_difference_fails(oracle, name, monkeypatch):
  """Run with parity's own mask, the DeepSpeed side leaves the loss bound; a stack model that predicts that mask is
  caught by the comparison, which names the tensors."""
  hf, planted = oracle[name]["hf"], oracle[name]["planted"]
  assert planted["decay_mask"] == PLANTED[name] != oracle[name]["parity"]["decay_mask"]
  worst = max(abs(a - b) for a, b in zip(hf["losses"], planted["losses"]))
  assert worst > 5 * LOSS_BOUND, (worst, hf["losses"], planted["losses"])
  assert differences(planted, predicted(read_deepspeed_config(REAL / name), _names(hf)))  # the side differs too
  real = _stack._stack_model
  monkeypatch.setattr(_stack, "_stack_model", lambda *a, **k: dataclasses.replace(real(*a, **k), decay_mask="matrices"))
  found = differences(hf, predicted(read_deepspeed_config(REAL / name), _names(hf)))
  assert found and "wte.weight" in " ".join(found), found


@pytest.mark.process
@requires_deepspeed
@needs_stack
def test_the_legacy_offload_key_stops_the_trainer_as_the_port_says(oracle):
  hf = oracle["legacy_cpu_offload"]["hf"]
  assert hf.get("error", "").startswith("ZeRORuntimeException"), hf
  want = predicted(CRAFTED["legacy_cpu_offload"], [])
  assert "refused" in want and "not the legacy cpu_offload key" in want["refused"]


@pytest.mark.process
@requires_deepspeed
@needs_stack
def test_zero_force_false_keeps_the_trainers_torch_adamw(oracle):
  hf = oracle["zero_force_ds_cpu_optimizer_false"]["hf"]
  assert "error" not in hf, hf
  assert hf["optimizer"] == "AdamW"
  assert differences(hf, predicted(CRAFTED["zero_force_ds_cpu_optimizer_false"], _names(hf))) == []


MEGATRON_SKIP = ("Megatron-DeepSpeed cannot run here: it is no PyPI package, and its optimizer (apex FusedAdam, or "
                 "DeepSpeedCPUAdam under --cpu-optimizer) and fused kernels are built for CUDA; the megatron stack "
                 "model follows these source lines instead: " + " | ".join(_stack.SOURCES["megatron"]))


def test_megatron_has_no_oracle_here_and_its_model_cites_its_sources():
  """The megatron model's predictions for DeepSpeed's own Megatron offload config (tests/model/Megatron_GPT2), then a
  skip saying why no Megatron runs here and which source lines the model follows."""
  raw = read_deepspeed_config(REAL / "microsoft__DeepSpeed__tests__model__Megatron_GPT2__ds_config_func_bs8_zero2_"
                                     "offload.json")
  r = port_config(raw, dataclasses.replace(_flags(), stack="megatron", micro_batch=None, grad_accum=None,
                                           precision=None, max_grad_norm=None), source="megatron")
  assert r.ported is not None, r.report.errors
  assert (r.stack.optimizer_class, r.stack.decay_mask, r.stack.client) == ("DeepSpeedCPUAdam", "no_bias_norm", True)
  assert any("get_param_groups" in s for s in r.stack.sources) and any("--cpu-optimizer" in s for s in r.stack.sources)
  pytest.skip(MEGATRON_SKIP)


@pytest.mark.process
@requires_deepspeed
@needs_stack
def test_bf16_on_a_config_without_a_bf16_section_trains_in_bf16_as_the_port_says(oracle):
  hf, name = oracle["bf16_without_a_bf16_section"]["hf"], "bf16_without_a_bf16_section"
  assert "error" not in hf, hf
  assert hf["precision"] == "bf16"
  assert differences(hf, predicted(CRAFTED[name], _names(hf), _args(name, CRAFTED[name]))) == []


@pytest.mark.process
@requires_deepspeed
@needs_stack
def test_a_cpu_without_fp16_stops_the_trainer_at_the_device_not_at_the_config(oracle):
  """Where DeepSpeed's CPU accelerator reports fp16 unsupported (forced here on any CPU), the Trainer's engine refuses
  an fp16 job; the port accepts the config (a property of the device, not of the config: docs/migration.md), and the
  same job trains, and matches parity's side, where that answer is lifted as parity's DeepSpeed side lifts it."""
  hf = oracle["fp16_on_a_cpu_without_it"]["hf"]
  assert "Type fp16 is not supported on your device" in hf.get("error", ""), hf
  raw = read_deepspeed_config(REAL / FP16_CONFIG)
  assert args_for(raw)["fp16"] and "refused" not in predicted(raw, [])
  ran = oracle[FP16_CONFIG]["hf"]
  assert "error" not in ran and len(ran["losses"]) == TRAIN["steps"], ran
  assert ran["device"]["fp16_lifted"] is (not ran["device"]["fp16_native"]), ran["device"]
