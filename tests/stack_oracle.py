"""The HF-Trainer oracle of tests/test_stack_oracle.py: the real transformers Trainer (with Accelerate and DeepSpeed
on the CPU, one process) trains a tiny random LlamaForCausalLM under a DeepSpeed config, and parity's DeepSpeed side
replays the same job from the config's port.

    python -m tests.stack_oracle REQUEST.json OUT.json

REQUEST: {"cases": {name: {"config": <DeepSpeed JSON as published>, "replay": bool, "plant_mask": mask | null,
"train": {the keys below this case sets otherwise}}}, "train": {micro, grad_accum, steps, seq_len, lr, beta1, beta2,
eps, weight_decay, max_grad_norm, warmup_steps, fp16, bf16}} (fp16, bf16: the TrainingArguments', and the replay's
precision).
Per case OUT holds what the Trainer built and ran (`hf`: wrapper, optimizer class, adamw_mode, the engine's precision,
its param groups as canonical names with their hyperparameters, the loss of each step as the Trainer logged it) and,
with `replay`, what
parity's DeepSpeed side built and ran from `parity.migrate` port of the config under --stack hf-trainer (`parity`:
the same fields) and, with `plant_mask`, the losses of that side run with train.decay_mask set to it instead
(`planted`). Every case runs in this one process (imports once; the Trainer's DeepSpeed state is reset between).

fp16 and the CPU: DeepSpeed's CPU accelerator reports fp16 unsupported on a CPU without AVX512-FP16 / AMX-FP16, and
the Trainer's engine then refuses fp16 ("Type fp16 is not supported on your device"): a property of the machine, not
of the config. There the Trainer's fp16 cases run with that answer lifted as parity's own DeepSpeed side lifts it
(torch_impl.engine.allow_fp16_on_cpu: torch's CPU kernels compute float16 all the same), and the record says so
(`device`: {fp16_native, fp16_lifted}); a case with "device_fp16": "absent" runs the Trainer with fp16 reported
unsupported and nothing lifted, as on such a CPU, so the refusal itself is checked on every machine.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-6, tie_word_embeddings=False)
"""The model: tiny, no dropout (Llama has none), an untied head, GQA."""


def _env() -> None:
  """One CPU rank: DeepSpeed's CPU accelerator and the single-process rendezvous (torch_impl.distributed's)."""
  os.environ["DS_ACCELERATOR"] = "cpu"
  os.environ.setdefault("ACCELERATE_USE_CPU", "false")
  from torch_impl.distributed import setup_distributed  # the workers' own: op-build environment, gloo group
  setup_distributed()


def _names(model, hf_to_canon: dict[str, str]) -> dict[int, str]:
  return {id(p): hf_to_canon.get(n, n) for n, p in model.named_parameters()}


def _groups(opt, names: dict[int, str]) -> list[dict]:
  """The groups of a DeepSpeed engine's optimizer: canonical names (through the ZeRO wrapper's module params) and
  the hyperparameters the basic optimizer keeps per group."""
  basic = getattr(opt, "optimizer", opt)
  bit16 = getattr(opt, "bit16_groups", None) or getattr(opt, "fp16_groups", None)
  out = []
  for i, g in enumerate(basic.param_groups):
    params = bit16[i] if bit16 is not None else g["params"]
    out.append({"names": sorted({names[id(p)] for p in params if id(p) in names}),
                "lr": float(g["lr"]), "betas": [float(b) for b in g["betas"]], "eps": float(g["eps"]),
                "weight_decay": float(g["weight_decay"])})
  return out


def _precision(t: dict) -> str:
  return "fp16" if t.get("fp16") else ("bf16" if t.get("bf16") else "fp32")


def _built(engine, names: dict[int, str]) -> dict:
  opt = engine.optimizer
  basic = getattr(opt, "optimizer", opt)
  mode = getattr(basic, "adam_w_mode", None)  # DeepSpeed's Adams; torch's say it in their groups
  if mode is None and "decoupled_weight_decay" in basic.param_groups[0]:
    mode = bool(basic.param_groups[0]["decoupled_weight_decay"])
  precision = "bf16" if engine.bfloat16_enabled() else ("fp16" if engine.fp16_enabled() else "fp32")
  return {"wrapper": type(opt).__name__, "optimizer": type(basic).__name__, "adamw_mode": mode, "precision": precision,
          "groups": _groups(opt, names)}


def hf_case(config: dict, t: dict, tmp: Path) -> tuple[dict, np.ndarray, Path]:
  """Trains with the HF Trainer. Returns (record, the micro batches it drew (steps * grad_accum, micro, seq + 1),
  the folder of the initial checkpoint)."""
  import torch
  import transformers
  from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments
  from parity.hf import hf_rules, spec_from_hf_config
  torch.manual_seed(0)
  cfg = LlamaConfig(**LLAMA)
  model = LlamaForCausalLM(cfg)
  model.save_pretrained(tmp / "init", safe_serialization=True)
  spec = spec_from_hf_config(json.loads((tmp / "init" / "config.json").read_text()))
  hf_to_canon = {h: r.canonical for r in hf_rules(spec, "llama") for h in r.hf}
  rng = np.random.default_rng(1)
  n = max(64, t["steps"] * t["micro"] * t["grad_accum"])  # one row per sequence drawn: no epoch repeats a batch
  rows = rng.integers(0, LLAMA["vocab_size"], size=(n, t["seq_len"] + 1))
  drawn, losses = [], []

  def collate(items):
    ids = torch.stack([torch.as_tensor(x) for x in items])
    drawn.append(ids.numpy().copy())
    return {"input_ids": ids, "labels": ids.clone()}

  class Log(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
      if logs and "loss" in logs:
        losses.append(float(logs["loss"]))

  args = TrainingArguments(
      output_dir=str(tmp / "out"), per_device_train_batch_size=t["micro"], gradient_accumulation_steps=t["grad_accum"],
      max_steps=t["steps"], learning_rate=t["lr"], weight_decay=t["weight_decay"], adam_beta1=t["beta1"],
      adam_beta2=t["beta2"], adam_epsilon=t["eps"], max_grad_norm=t["max_grad_norm"], warmup_steps=t["warmup_steps"],
      lr_scheduler_type="constant", logging_steps=1, fp16=bool(t.get("fp16")), bf16=bool(t.get("bf16")),
      use_cpu=bool(t.get("bf16")),  # transformers refuses bf16 on a CPU unless told it is one
      save_strategy="no", report_to=[], seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
      deepspeed=copy.deepcopy(config))
  device = _device_fp16(bool(t.get("fp16")), absent=t.get("device_fp16") == "absent")
  trainer = Trainer(model=model, args=args, train_dataset=list(rows), data_collator=collate, callbacks=[Log()])
  trainer.train()
  record = {**_built(trainer.model_wrapped, _names(trainer.model, hf_to_canon)), "losses": losses, "device": device,
            "versions": {"transformers": transformers.__version__, "accelerate": _version("accelerate"),
                         "deepspeed": _version("deepspeed"), "torch": torch.__version__}}
  trainer.model_wrapped.destroy()
  _reset()
  batches = np.stack(drawn[:t["steps"] * t["grad_accum"]]).astype(np.uint32)
  return record, batches, tmp / "init"


def _device_fp16(fp16: bool, absent: bool) -> dict:
  """Sets what DeepSpeed's CPU accelerator answers to is_fp16_supported for the next engine: with `absent`, False and
  nothing lifted (a CPU without fp16); else its own answer (this CPU's, or the suite's fp16 mask), lifted for an fp16
  job where it is False, as parity's DeepSpeed side does. Returns {fp16_native, fp16_lifted}."""
  from torch_impl.engine import allow_fp16_on_cpu
  acc = _accelerator()
  vars(acc).pop("is_fp16_supported", None)  # the class's answer again, whatever an earlier case set
  if absent:
    acc.is_fp16_supported = lambda: False
    return {"fp16_native": False, "fp16_lifted": False}
  native = bool(acc.is_fp16_supported())
  lifted = fp16 and not native and allow_fp16_on_cpu({"fp16": {"enabled": True}})
  return {"fp16_native": native, "fp16_lifted": bool(lifted)}


def _version(mod: str) -> str:
  import importlib
  return importlib.import_module(mod).__version__


def _reset() -> None:
  """Forgets the Trainer's DeepSpeed configuration (transformers' global one, Accelerate's shared state) so the next
  case starts clean; the process group stays."""
  from accelerate.state import AcceleratorState
  from transformers.integrations.deepspeed import unset_hf_deepspeed_config
  unset_hf_deepspeed_config()
  AcceleratorState._reset_state(reset_partial_state=False)


def replay(config: dict, t: dict, folder: Path, batches: np.ndarray, mask: str | None = None) -> dict:
  """parity's DeepSpeed side on the port of `config` (--stack hf-trainer; the run spec plays the TrainingArguments),
  from the checkpoint in `folder`, over `batches`; `mask` replaces the port's train.decay_mask (a plant)."""
  from parity.hf import run_spec_from_hf
  from parity.migrate._reverse import port_for_compare
  from parity.overrides import apply_overrides
  from parity.presets import preset
  from torch_impl.engine import DeepSpeedTrainer
  base = apply_overrides(preset("llama3-tiny"), {
      "train.micro_batch_size": t["micro"], "train.grad_accum_steps": t["grad_accum"], "train.steps": t["steps"],
      "train.seq_len": t["seq_len"], "train.lr": t["lr"], "train.beta1": t["beta1"], "train.beta2": t["beta2"],
      "train.eps": t["eps"], "train.weight_decay": t["weight_decay"], "train.grad_clip": t["max_grad_norm"],
      "train.warmup_steps": max(t["warmup_steps"], 1), "train.precision": _precision(t)})
  base, params = run_spec_from_hf(folder, base)
  spec, ds, result = port_for_compare(copy.deepcopy(config), base, source="oracle", stack="hf-trainer")
  if mask is not None:
    spec = dataclasses.replace(spec, train=dataclasses.replace(spec.train, decay_mask=mask))
  side = DeepSpeedTrainer(spec, params, config=ds)
  g = t["grad_accum"]
  losses = [side.step(batches[k * g:(k + 1) * g])["loss"] for k in range(t["steps"])]
  names = {id(p): n for n, p in side.engine.module.named_parameters()}
  record = {**_built(side.engine, names), "losses": losses, "decay_mask": spec.train.decay_mask,
            "stack": result.stack.to_dict()}
  side.engine.destroy()
  return record


def _accelerator():
  from deepspeed.accelerator import get_accelerator
  return get_accelerator()


def main(argv: list[str]) -> int:
  req = json.loads(Path(argv[0]).read_text())
  _env()
  out = {}
  for name, case in req["cases"].items():
    t = {**req["train"], **case.get("train", {})}
    with tempfile.TemporaryDirectory() as d:
      try:
        hf, batches, folder = hf_case(case["config"], t, Path(d))
      except Exception as e:  # the Trainer itself refuses the config: the answer for this case
        msg = " | ".join(line.strip() for line in str(e).strip().splitlines()[:4])  # pydantic: the key is line 2
        out[name] = {"hf": {"error": f"{type(e).__name__}: {msg}"}}
        vars(_accelerator()).pop("is_fp16_supported", None)
        _reset()
        continue
      out[name] = {"hf": hf}
      vars(_accelerator()).pop("is_fp16_supported", None)  # parity's side decides for itself (build_engine)
      if case.get("replay"):
        out[name]["parity"] = replay(case["config"], t, folder, batches)
        if case.get("plant_mask"):
          out[name]["planted"] = replay(case["config"], t, folder, batches, case["plant_mask"])
  Path(argv[1]).write_text(json.dumps(out, indent=1))
  return 0


if __name__ == "__main__":
  raise SystemExit(main(sys.argv[1:]))
