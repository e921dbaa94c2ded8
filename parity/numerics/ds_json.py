"""The one DeepSpeed-JSON builder: the config a RunSpec stands for (`deepspeed_json`, what the DeepSpeed side runs)
and the sections the reverse port (parity.migrate, `parity port --to-deepspeed`) writes from a ported config
(`zero_section`, `activation_checkpointing_section`, `fp16_section`). Pure: no torch, no deepspeed."""
from __future__ import annotations

from typing import Any

from parity.errors import SpecError
from parity.numerics import schedule

__all__ = ["STEPS_PER_PRINT", "ACTIVATION_CHECKPOINTING", "OFFLOAD_REMAT", "deepspeed_json", "zero_section",
           "activation_checkpointing_section", "fp16_section", "fp16_config", "TRAIN_KEY_PATHS", "config_value"]

STEPS_PER_PRINT = 10**9
"""DeepSpeed prints a progress line every this many steps; effectively never."""

ACTIVATION_CHECKPOINTING = {"partition_activations": False, "cpu_checkpointing": False,
                            "contiguous_memory_optimization": False, "synchronize_checkpoint_boundary": False,
                            "profile": False}
"""The activation_checkpointing section with its CPU copy off: recompute each block, keep its input on the device
(no model-parallel partitioning: a single data-parallel rank)."""

OFFLOAD_REMAT = ("offload_dots_no_batch", "offload_names")
"""JaxPlan.remat policies that keep residuals in host memory: DeepSpeed's cpu_checkpointing (jax_impl.remat)."""


def zero_section(stage: int, offload_optimizer: str | None, offload_param: str | None,
                 ratio: float = 1.0) -> dict[str, Any]:
  """DeepSpeed's zero_optimization section.

  Args:
    stage: ZeRO stage 0-3.
    offload_optimizer, offload_param: the host memory kind the optimizer state / fp32 params are offloaded to
      ('pinned_host' -> pin_memory true, 'unpinned_host' -> false), or None for none. DeepSpeed reads
      offload_param at stage 3 only, so it is written only there.
    ratio: the share of the optimizer state offloaded (offload_optimizer.ratio, jax.offload_opt_ratio), written when
      below 1 at stage 3 (DeepSpeed refuses it at other stages).
  Returns:
    {"stage": ..., and "offload_optimizer" / "offload_param": {"device": "cpu", "pin_memory": bool} when set}.
  """
  zero: dict[str, Any] = {"stage": stage}
  if offload_optimizer is not None:
    zero["offload_optimizer"] = {"device": "cpu", "pin_memory": offload_optimizer == "pinned_host"}
    if ratio < 1 and stage == 3:
      zero["offload_optimizer"]["ratio"] = ratio
  if offload_param is not None and stage == 3:
    zero["offload_param"] = {"device": "cpu", "pin_memory": offload_param == "pinned_host"}
  return zero


def activation_checkpointing_section(cpu: bool = False) -> dict[str, Any]:
  """DeepSpeed's activation_checkpointing section: every block recomputed; `cpu` keeps its checkpointed input in
  host memory (cpu_checkpointing)."""
  return {**ACTIVATION_CHECKPOINTING, "cpu_checkpointing": bool(cpu)}


def fp16_section(*, loss_scale: float, initial_scale_power: int, loss_scale_window: int, hysteresis: int,
                 consecutive_hysteresis: bool, min_loss_scale: int) -> dict[str, Any]:
  """DeepSpeed's enabled `fp16` block (runtime/precision_config.py DeepSpeedFP16Config): loss_scale 0 is dynamic,
  scale 2**initial_scale_power, halved after `hysteresis` overflows, doubled after `loss_scale_window` clean steps,
  never below min_loss_scale (an integer in DeepSpeed's schema)."""
  return {"enabled": True, "loss_scale": float(loss_scale), "initial_scale_power": initial_scale_power,
          "loss_scale_window": loss_scale_window, "hysteresis": hysteresis,
          "consecutive_hysteresis": consecutive_hysteresis, "min_loss_scale": int(min_loss_scale)}


def fp16_config(train) -> dict[str, Any]:
  """DeepSpeed's `fp16` block for a TrainSpec ({"enabled": False} unless precision is 'fp16').

  Args:
    train: a parity.spec.TrainSpec.
  Returns:
    `fp16_section` of the train.* loss-scale fields, or {"enabled": False}.
  Raises:
    SpecError: train.min_loss_scale is not a whole number (DeepSpeed's fp16.min_loss_scale is an int).
  """
  if train.precision != "fp16":
    return {"enabled": False}
  if float(train.min_loss_scale) != int(train.min_loss_scale):
    raise SpecError(f"train.min_loss_scale={train.min_loss_scale}: DeepSpeed's fp16.min_loss_scale is an integer; "
                     "use a whole number (default 1)")
  return fp16_section(loss_scale=train.loss_scale, initial_scale_power=train.initial_scale_power,
                      loss_scale_window=train.loss_scale_window, hysteresis=train.hysteresis,
                      consecutive_hysteresis=train.consecutive_hysteresis, min_loss_scale=train.min_loss_scale)


def deepspeed_json(run) -> dict[str, Any]:
  """The DeepSpeed config dict equivalent to a RunSpec (what `deepspeed.initialize(config=...)` gets).

  The optimizer block is `parity.numerics.schedule.deepspeed_optimizer(run.train)`; the scheduler block
  `schedule.deepspeed_scheduler(run.train)` (none for 'Constant'). The global batch is left for DeepSpeed to derive
  (micro x accumulation x world size). Offloads are unpinned (pin_memory false).
  Args:
    run: a parity.spec.RunSpec (train and deepspeed plan read).
  Raises:
    SpecError: train.min_loss_scale not a whole number in fp16 (`fp16_config`).
  """
  t, plan = run.train, run.deepspeed
  cfg: dict[str, Any] = {
      "train_micro_batch_size_per_gpu": t.micro_batch_size,
      "gradient_accumulation_steps": t.grad_accum_steps,
      "optimizer": schedule.deepspeed_optimizer(t),
  }
  scheduler = schedule.deepspeed_scheduler(t)
  if scheduler is not None:  # 'Constant': no scheduler block, the optimizer lr throughout
    cfg["scheduler"] = scheduler
  if plan.activation_checkpointing:
    cfg["activation_checkpointing"] = activation_checkpointing_section(cpu=plan.cpu_checkpointing)
    if plan.cpu_checkpointing:  # the path that copies the input to the host (torch_impl.engine._enable_checkpointing)
      cfg["activation_checkpointing"]["partition_activations"] = True
  if t.optimizer == "sgd" and plan.offload_optimizer == "cpu":  # DeepSpeed offloads only its own CPU optimizers
    cfg["zero_force_ds_cpu_optimizer"] = False
  if t.optimizer in ("sgd", "lamb") and plan.zero_stage >= 1:  # DeepSpeed asserts on optimizers it did not test
    cfg["zero_allow_untested_optimizer"] = True
  return {
      **cfg,
      "gradient_clipping": t.grad_clip,
      "zero_optimization": zero_section(plan.zero_stage, "unpinned_host" if plan.offload_optimizer == "cpu" else None,
                                        "unpinned_host" if plan.offload_param == "cpu" else None),
      "bf16": {"enabled": t.precision == "bf16"},
      "fp16": fp16_config(t),
      "steps_per_print": STEPS_PER_PRINT,
      "wall_clock_breakdown": False,
  }


TRAIN_KEY_PATHS = {
    "train.lr": "optimizer.params.lr", "train.beta1": "optimizer.params.betas.0",
    "train.beta2": "optimizer.params.betas.1", "train.eps": "optimizer.params.eps",
    "train.weight_decay": "optimizer.params.weight_decay", "train.momentum": "optimizer.params.momentum",
    "train.dampening": "optimizer.params.dampening", "train.nesterov": "optimizer.params.nesterov",
    "train.lamb_max_coeff": "optimizer.params.max_coeff", "train.lamb_min_coeff": "optimizer.params.min_coeff",
    "train.eps_inside_sqrt": "optimizer.params.eps_inside_sqrt", "train.optimizer": "optimizer.type",
    "train.grad_clip": "gradient_clipping", "train.lr_schedule": "scheduler.type",
    "train.lr_schedule_params": "scheduler.params", "train.warmup_steps": "scheduler.params.warmup_num_steps",
    "train.warmup_min_ratio": "scheduler.params.warmup_min_ratio",
    "train.cos_min_ratio": "scheduler.params.cos_min_ratio", "train.loss_scale": "fp16.loss_scale",
    "train.initial_scale_power": "fp16.initial_scale_power", "train.loss_scale_window": "fp16.loss_scale_window",
    "train.hysteresis": "fp16.hysteresis", "train.consecutive_hysteresis": "fp16.consecutive_hysteresis",
    "train.min_loss_scale": "fp16.min_loss_scale"}
"""Where a DeepSpeed config holds each train field (as `deepspeed_json` writes it; a number is a list index).
train.precision is read from the bf16/fp16 `enabled` flags (`config_value`); model fields are in no config."""


def config_value(config: Any, key: str) -> tuple[bool, Any]:
  """(found, value) of a spec key in a DeepSpeed config (TRAIN_KEY_PATHS; train.precision from bf16/fp16.enabled).

  Args:
    config: a DeepSpeed config dict (e.g. the one a side's summary.json records), or None.
    key: a dotted spec key, e.g. 'train.beta2'.
  Returns:
    (True, the value) when the config holds it; (False, None) when the key has no place in a config, or the
    config lacks the section (e.g. no optimizer section: DeepSpeed ran the client optimizer).

  >>> config_value({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.999]}}}, "train.beta2")
  (True, 0.999)
  >>> config_value({"bf16": {"enabled": True}}, "train.precision")
  (True, 'bf16')
  """
  if not isinstance(config, dict):
    return False, None
  if key == "train.precision":
    on = lambda sec: isinstance(config.get(sec), dict) and config[sec].get("enabled") is True
    return True, "fp16" if on("fp16") else "bf16" if on("bf16") else "fp32"
  if key not in TRAIN_KEY_PATHS:
    return False, None
  node: Any = config
  for part in TRAIN_KEY_PATHS[key].split("."):
    if isinstance(node, dict) and part in node:
      node = node[part]
    elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
      node = node[int(part)]
    else:
      return False, None
  return True, node
