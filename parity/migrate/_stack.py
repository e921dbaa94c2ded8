"""The training stack around `deepspeed.initialize`, and the optimizer a job really gets (`parity port --stack`).

A DeepSpeed JSON says what DeepSpeed does with the optimizer it is handed; the stack that runs it decides what it is
handed. Each StackModel states, for the stack versions in VERSIONS, the optimizer class, who builds it, its param
groups and decay mask (parity.spec.DECAY_MASKS), where its hyperparameters come from and the loss scaler; SOURCES
names the source lines each follows. The port, `compare --deepspeed-config` and the migration table use it.

  hf-trainer  transformers' Trainer with its DeepSpeed integration (through Accelerate). With an optimizer section,
              DeepSpeed builds it over every trainable parameter in one list (decay on every tensor). Without one,
              the Trainer's torch.optim.AdamW over its 2 groups (no decay on biases and norm weights), which
              Accelerate replaces by DeepSpeedCPUAdam over the same groups under offload_optimizer.
  accelerate  a script under Accelerate, modelled on accelerate's example deepspeed_with_config_support.py: the
              script's 2 groups (no decay on bias and LayerNorm weights), DeepSpeed's optimizer over them with a
              section (DummyOptim), else the script's torch AdamW, swapped for DeepSpeedCPUAdam as above.
  megatron    Megatron-DeepSpeed: always its own optimizer over 2 groups (no decay on biases and 1-D tensors),
              DeepSpeedCPUAdam under --cpu-optimizer (which offload needs); a client optimizer wins over the
              config's section, which DeepSpeed then ignores.
  deepspeed   a bare `deepspeed.initialize(model, model_parameters=model.parameters(), config)`: one group; no
              section: the script's client torch AdamW, which DeepSpeed refuses under offload_optimizer.

Imports neither jax nor torch.
"""
from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["STACKS", "VERSIONS", "SOURCES", "StackModel", "choose_stack", "stack_model", "apply_stack"]

STACKS = ("hf-trainer", "accelerate", "megatron", "deepspeed")

VERSIONS = {
    "hf-trainer": "transformers 5.24.0 Trainer, accelerate 1.16.0, DeepSpeed 0.19.8",
    "accelerate": "accelerate 1.16.0, DeepSpeed 0.19.8",
    "megatron": "Megatron-DeepSpeed f4157bea (2024-12-24), DeepSpeed 0.19.8",
    "deepspeed": "DeepSpeed 0.19.8",
}
"""The library versions each model was read from (transformers, accelerate and DeepSpeed are the ones installed with
the dev extra; tests/test_stack_oracle.py runs the first against them)."""

_SWAP = ("accelerate 1.16.0 accelerator.py Accelerator._prepare_deepspeed: a torch optimizer with zero_optimization."
         "offload_optimizer.device != 'none' and zero_force_ds_cpu_optimizer unset or true goes through utils/"
         "deepspeed.py map_pytorch_optim_to_deepspeed: DeepSpeedCPUAdam(optimizer.param_groups, lr=, weight_decay= "
         "(its defaults), adamw_mode=isinstance(optimizer, torch.optim.AdamW)); each group keeps its own betas, eps "
         "and weight_decay (torch's add_param_group fills only missing keys). The swap is in accelerate >= 0.18.0, "
         "adamw_mode from the class since 1.2.0 (before: always true), the zero_force_ds_cpu_optimizer test since "
         "0.20.0. It reads only offload_optimizer.device, not the legacy zero_optimization.cpu_offload")
_DUMMY = ("accelerate 1.16.0 accelerator.py Accelerator._prepare_deepspeed: a DummyOptim hands its params to "
          "deepspeed.initialize(model_parameters=optimizer.params); DeepSpeed builds the section's optimizer over "
          "them (DeepSpeed 0.19.8 engine._configure_basic_optimizer)")
SOURCES: dict[str, tuple[str, ...]] = {
    "hf-trainer": (
        "transformers 5.24.0 integrations/deepspeed.py deepspeed_init: model_parameters = every trainable parameter "
        "in one list; deepspeed_optim_sched: an optimizer section -> DummyOptim(params=model_parameters), none -> "
        "trainer.create_optimizer() and zero_allow_untested_optimizer true",
        "transformers 5.24.0 trainer.py Trainer.create_optimizer / get_decay_parameter_names: 2 groups, weight_decay "
        "args.weight_decay on the rest, 0.0 on nn.LayerNorm parameters and names matching bias, layernorm, rmsnorm, "
        "norm (so the embeddings are decayed)",
        _DUMMY, _SWAP,
        "transformers 5.24.0 HfTrainerDeepSpeedConfig.trainer_config_process fills the \"auto\" values from the "
        "TrainingArguments; the loss scaler is DeepSpeed's (its fp16 section), the Trainer's own is not used",
    ),
    "accelerate": (
        "accelerate (16cb6eb8) examples/by_feature/deepspeed_with_config_support.py: 2 groups, no_decay = ['bias', "
        "'LayerNorm.weight']; torch.optim.AdamW without an optimizer section, DummyOptim(groups) with one. The groups "
        "are the script's: the model takes the HF Trainer's rule (no decay on biases and norm weights); the example's "
        "own names match BERT-style 'LayerNorm.weight' only, so on GPT-2 or Llama names it decays the norm weights "
        "too",
        _DUMMY, _SWAP,
    ),
    "megatron": (
        "Megatron-DeepSpeed f4157bea megatron/optimizer/__init__.py get_param_groups: no weight decay on names "
        "ending in .bias and on 1-D tensors (norm scales), wd_mult 1.0 on the rest (the embeddings too); "
        "get_megatron_optimizer: --cpu-optimizer -> DeepSpeedCPUAdam(param_groups, lr=--lr, weight_decay="
        "--weight-decay, betas=(--adam-beta1, --adam-beta2), eps=--adam-eps), else apex FusedAdam (or DeepSpeed's "
        "with --ds-fused-adam), both decoupled (AdamW); under --deepspeed it returns the optimizer unwrapped",
        "Megatron-DeepSpeed f4157bea megatron/training.py setup_model_and_optimizer: deepspeed.initialize(model, "
        "optimizer=<that optimizer>, lr_scheduler=<Megatron's>, config=...) whether or not the config has an "
        "optimizer section",
        "DeepSpeed 0.19.8 runtime/engine.py _configure_optimizer: a client optimizer is used as given (the section "
        "is not read); under offload_optimizer any client but DeepSpeedCPUAdam/DeepSpeedCPULion raises "
        "ZeRORuntimeException unless zero_force_ds_cpu_optimizer is false. DeepSpeed's own tests run the offload "
        "configs of tests/model/Megatron_GPT2 with --cpu-optimizer (run_func_test.py gen_cpu_optimizer_flag)",
    ),
    "deepspeed": (
        "DeepSpeed 0.19.8 runtime/engine.py _configure_basic_optimizer: the section's class over model_parameters "
        "(a bare script passes model.parameters(): one group); _configure_optimizer: a client optimizer as given, "
        "and under offload_optimizer ZeRORuntimeException for a client that is not DeepSpeedCPUAdam/DeepSpeedCPULion "
        "unless zero_force_ds_cpu_optimizer is false",
    ),
}

_GROUPS = {
    "all": "one group (every tensor decayed)",
    "no_bias_norm": "2 groups (no decay on biases and norm weights; the embeddings decayed)",
}
DECAY_MASKS_TEXT = {
    "matrices": "on the weight matrices only: no decay on biases, norm scales and the token/position embeddings",
    "no_bias_norm": "on every tensor but biases and norm scales (the embeddings too)",
    "all": "on every tensor, biases, norm scales and embeddings included",
}
"""The decay masks (parity.spec.DECAY_MASKS) in words, for the migration table."""
_DS_SCALER = ("DeepSpeed's: the fp16 section's DynamicLossScaler (or static scale) in the ZeRO optimizer; bf16 and "
              "fp32 scale nothing")


@dataclasses.dataclass(frozen=True)
class StackModel:
  """What the stack hands DeepSpeed, and so what the job trains with."""
  stack: str
  chosen_by: str
  """'--stack', or why the default was taken (the config's "auto" values, or none)."""
  optimizer_class: str
  """The class that updates the weights: DeepSpeedCPUAdam, FusedAdam, torch.optim.AdamW, ..."""
  built_by: str
  groups: str
  """Whose param groups and how many, in words."""
  decay_mask: str
  """parity.spec.DECAY_MASKS: the tensors the job decays (train.decay_mask of the port)."""
  hyperparameters: str
  """Where lr, betas, eps and weight_decay come from."""
  client: bool
  """The stack passes its own optimizer (the config's section, if any, is not what DeepSpeed builds)."""
  loss_scaler: str = _DS_SCALER
  notes: tuple[str, ...] = ()
  refusal: str | None = None
  """Why this stack itself stops at the config (it raises at start), or None."""

  @property
  def versions(self) -> str:
    return VERSIONS[self.stack]

  @property
  def sources(self) -> tuple[str, ...]:
    return SOURCES[self.stack]

  def summary(self) -> str:
    """One line for the migration table: class, groups, where the values come from, the versions."""
    return (f"{self.optimizer_class} over {self.groups}, built by {self.built_by}; {self.hyperparameters} "
            f"({self.versions})")

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d.update(versions=self.versions, sources=list(self.sources), notes=list(self.notes), summary=self.summary())
    return d


def choose_stack(raw: dict[str, Any], given: str | None) -> tuple[str, str]:
  """(stack, chosen_by): `given` (--stack) when set, else hf-trainer for a config with an "auto" value (only the HF
  integration fills them), else deepspeed (a bare deepspeed.initialize)."""
  if given is not None:
    return given, "--stack"
  if _has_auto(raw):
    return "hf-trainer", "default: the config has \"auto\" values, which the HF Trainer fills"
  return "deepspeed", "default: no \"auto\" value, so a bare deepspeed.initialize (give --stack for another)"


def _has_auto(node: Any) -> bool:
  if isinstance(node, dict):
    return any(_has_auto(v) for v in node.values())
  return node == "auto"


_SCHEDULE = {
    "hf-trainer": "the Trainer's own lr scheduler (TrainingArguments.lr_scheduler_type, default 'linear' with its "
                  "warmup)",
    "accelerate": "the script's lr scheduler",
    "megatron": "Megatron's OptimizerParamScheduler (--lr-decay-style, --lr-warmup-*)",
}


def _schedule_note(stack: str, scheduler: bool | str) -> tuple[str, ...]:
  if scheduler is True or stack not in _SCHEDULE:
    return ()
  why = (f"the config's scheduler section ({scheduler}) is not read" if isinstance(scheduler, str) else
         "no scheduler section")
  return (f"{why}: under {stack} {_SCHEDULE[stack]} sets the lr, which the config does not show; the port keeps the "
          "optimizer's lr constant (the job's, where that scheduler is a constant one); write the schedule as a "
          "scheduler section to port another",)


def stack_model(stack: str, chosen_by: str, *, section: str | None, offload: str | None, legacy_offload: bool,
                forced: bool, scheduler: bool | str = True) -> StackModel:
  """The StackModel of `stack` for a config (`scheduler`: True when DeepSpeed builds the config's scheduler section,
  False when there is none, its type when the stack passes its own scheduler instead (Megatron); without one read,
  the stack's own scheduler runs, a note says so)."""
  model = _stack_model(stack, chosen_by, section=section, offload=offload, legacy_offload=legacy_offload,
                       forced=forced)
  return dataclasses.replace(model, notes=model.notes + _schedule_note(stack, scheduler))


def _stack_model(stack: str, chosen_by: str, *, section: str | None, offload: str | None, legacy_offload: bool,
                 forced: bool) -> StackModel:
  """The StackModel of `stack` for a config.

  Args:
    stack, chosen_by: `choose_stack`'s answer.
    section: the class DeepSpeed builds from the config's optimizer section (parity.migrate._port_optim's impl), or
      None when the config has none.
    offload: zero_optimization.offload_optimizer.device as DeepSpeed reads it ('cpu', 'nvme') or None.
    legacy_offload: that offload comes from the legacy `zero_optimization.cpu_offload: true`.
    forced: zero_force_ds_cpu_optimizer is not false (DeepSpeed's default true).
  """
  common = {"stack": stack, "chosen_by": chosen_by}
  if stack == "megatron":
    return _megatron(common, section, offload)
  if stack == "deepspeed":
    if section:
      return StackModel(**common, optimizer_class=section, built_by="DeepSpeed from the optimizer section",
                        groups="one group: model.parameters(), as a bare deepspeed.initialize passes them",
                        decay_mask="all", hyperparameters="optimizer.params (DeepSpeed's defaults where absent)",
                        client=False)
    refusal = _client_refusal(stack, offload, forced)
    return StackModel(**common, optimizer_class="torch.optim.AdamW", built_by="the training script (client "
                      "optimizer; the config has no optimizer section)", groups="one group: model.parameters()",
                      decay_mask="all", hyperparameters="lr, betas, eps, weight_decay from --lr/--betas/--eps/"
                      "--weight-decay (the script's values)", client=True, refusal=refusal)
  return _hf(common, stack, section, offload, legacy_offload, forced)


def _client_refusal(stack: str, offload: str | None, forced: bool, why: str = "") -> str | None:
  if offload is None or not forced:
    return None
  other = (". If the HF Trainer or Accelerate runs it (they swap in DeepSpeedCPUAdam), or Megatron (--cpu-optimizer "
           "passes one), it trains: pass --stack hf-trainer, accelerate or megatron" if stack == "deepspeed" else "")
  return f"the {stack} stack hands DeepSpeed a client torch.optim.AdamW{why}{other}"


def _hf(common: dict[str, Any], stack: str, section: str | None, offload: str | None, legacy: bool,
        forced: bool) -> StackModel:
  trainer = stack == "hf-trainer"
  who = "the Trainer" if trainer else "the script"
  mask = "all" if trainer and section else "no_bias_norm"
  groups = (f"{who}'s " + _GROUPS["no_bias_norm"] + ("" if trainer else ", the HF Trainer's rule")) \
      if mask == "no_bias_norm" else (
      "one group: every trainable parameter (transformers' model_parameters)")
  fill = "the Trainer's arguments" if trainer else "the script (DummyOptim: lr, weight_decay)"
  if section:
    return StackModel(**common, optimizer_class=section, built_by=f"DeepSpeed from the optimizer section over {who}'s "
                      "parameters (DummyOptim)", groups=groups, decay_mask=mask,
                      hyperparameters=f"optimizer.params, \"auto\" values filled from {fill}", client=False)
  swap = offload is not None and forced and not legacy
  refusal = _client_refusal(stack, offload, forced and legacy, ": Accelerate swaps in DeepSpeedCPUAdam only for "
                            "zero_optimization.offload_optimizer.device, not the legacy cpu_offload key, which "
                            "DeepSpeed still reads as offload. Fix: write \"offload_optimizer\": {\"device\": \"cpu\"} "
                            "instead of \"cpu_offload\": true")
  base = "the Trainer's create_optimizer" if trainer else "the script"
  if swap:
    return StackModel(**common, optimizer_class="DeepSpeedCPUAdam", built_by=f"{base} (torch.optim.AdamW), which "
                      "Accelerate replaces with DeepSpeedCPUAdam over the same groups (offload_optimizer)",
                      groups=groups, decay_mask=mask, hyperparameters=f"lr and weight_decay from {who} (Accelerate "
                      ">= 0.18.0), betas and eps kept per group from its AdamW (--lr/--betas/--eps/--weight-decay)",
                      client=True)
  return StackModel(**common, optimizer_class="torch.optim.AdamW", built_by=f"{base} (client optimizer; the config has "
                    "no optimizer section)", groups=groups, decay_mask=mask, hyperparameters=f"lr, betas, eps, "
                    f"weight_decay from {who} (--lr/--betas/--eps/--weight-decay)", client=True, refusal=refusal)


def _megatron(common: dict[str, Any], section: str | None, offload: str | None) -> StackModel:
  notes = ()
  if section:
    notes = (f"the config's optimizer section ({section}) is ignored: Megatron-DeepSpeed passes its own optimizer "
             "to deepspeed.initialize, and DeepSpeed runs a client optimizer as given",)
  cls = "DeepSpeedCPUAdam" if offload else "FusedAdam"
  how = ("--cpu-optimizer (what DeepSpeed accepts under offload_optimizer)" if offload else
         "apex FusedAdam, or DeepSpeed's with --ds-fused-adam; decoupled decay (AdamW). parity's DeepSpeed side "
         "runs torch.optim.AdamW for it on a CPU (FusedAdam needs CUDA): the same update")
  return StackModel(**common, optimizer_class=cls, built_by=f"Megatron's get_megatron_optimizer: {how}",
                    groups="Megatron's 2 groups (no decay on biases and 1-D tensors, i.e. norm weights; the "
                    "embeddings decayed)", decay_mask="no_bias_norm", hyperparameters="lr, betas, eps, weight_decay "
                    "from Megatron's --lr, --adam-beta1/2, --adam-eps, --weight-decay (the port's --lr/--betas/--eps/"
                    "--weight-decay)", client=True, notes=notes)


def apply_stack(ctx: Any, stack: str, chosen_by: str, optimizer: dict[str, Any] | None,
                offload: str | None) -> tuple[dict[str, Any] | None, StackModel]:
  """The stack's model for the config in `ctx` (parity.migrate._ctx.Ctx, "auto" resolved), written into the port:
  the ported optimizer's impl and decay_mask, the migration table's optimizer rows (where each value comes from),
  report.stack, and the stack's notes as warnings.

  Args:
    optimizer: port_optimizer's result (None when refused); offload: offload_optimizer.device as DeepSpeed reads it.
  Returns:
    (the optimizer with impl and decay_mask set, or None; the StackModel).
  """
  opt = ctx.get("optimizer")
  has_section = isinstance(opt, dict) and "type" in opt
  if not has_section:
    section = None
  elif stack == "megatron":
    section = str(opt["type"])
  else:
    section = optimizer["impl"] if optimizer else str(opt["type"])
  sched = ctx.get("scheduler")
  sched = isinstance(sched, dict) and "type" in sched and (str(sched["type"]) if stack == "megatron" else True)
  model = stack_model(stack, chosen_by, section=section, offload=offload,
                      legacy_offload=ctx.get("zero_optimization.cpu_offload") is True,
                      forced=ctx.get("zero_force_ds_cpu_optimizer") is not False,
                      scheduler=sched)  # Megatron's own scheduler wins over the section
  ctx.report.stack = model.to_dict()
  for note in model.notes:
    ctx.warn(note)
  where = f"{stack} stack: {model.summary()}"
  if model.client:
    ctx.implied("optimizer", {"class": model.optimizer_class, "decay_mask": model.decay_mask,
                              **({"params": optimizer["params"]} if optimizer else {})},
                f"{'the config has no optimizer section' if not has_section else 'the section is not read'}; "
                f"{where}. Weight decay {_mask_text(model.decay_mask)}")
  else:
    for key in ("optimizer.type", "optimizer.params.weight_decay"):
      e = ctx.report.entries.get(key)
      if e is not None and e.fate == "mapped":
        extra = f"; decay {_mask_text(model.decay_mask)}" if key.endswith("weight_decay") else ""
        e.reason = f"{e.reason}{extra}; {where}"
  if optimizer is None:
    return None, model
  impl = f"client {model.optimizer_class} ({stack})" if model.client else optimizer["impl"]
  return {**optimizer, "impl": impl, "decay_mask": model.decay_mask}, model


def _mask_text(mask: str) -> str:
  return f"{DECAY_MASKS_TEXT[mask]} (train.decay_mask {mask})"
