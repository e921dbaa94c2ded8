"""PortedConfig: the JAX training config a DeepSpeed config becomes.

Pydantic with extra="forbid" because a ported YAML is read back (`parity port --to-deepspeed`).
Scheduler params keep DeepSpeed's names and raw values (e.g. warmup_num_steps before DeepSpeed's
clamp to >= 2); `jax_impl/schedules.py` and `parity.migrate.reference` apply DeepSpeed's rules.
"""
from __future__ import annotations

import json
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from parity.migrate.reference import SCHEDULER_DEFAULTS
from parity.spec import REMAT_POLICIES, JaxPlan

__all__ = ["PortedConfig", "OptimizerCfg", "SchedulerCfg", "BatchCfg", "PrecisionCfg", "LossScaleCfg",
           "ClippingCfg", "JaxCfg", "NotRunnable", "NOT_RUNNABLE_KEYS", "SCHEMA", "OPTIMIZER_PARAM_KEYS"]

SCHEMA = "parity.ported/2"
"""/2: the ZeRO and remat sections became `jax:` (JaxPlan's fields) and `not_runnable_by_compare:`."""
_STRICT = ConfigDict(extra="forbid", frozen=True)

OPTIMIZER_PARAM_KEYS: dict[str, tuple[str, ...]] = {
    "adamw": ("lr", "betas", "eps", "weight_decay", "bias_correction"),
    "adam": ("lr", "betas", "eps", "weight_decay", "bias_correction"),
    "lamb": ("lr", "betas", "eps", "weight_decay", "bias_correction", "max_coeff", "min_coeff", "eps_inside_sqrt"),
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
}


class OptimizerCfg(BaseModel):
  """The update rule. adamw: decoupled decay p -= lr*wd*p; adam: L2 decay added to the gradient."""
  model_config = _STRICT
  type: Literal["adamw", "adam", "lamb", "sgd"]
  impl: str
  """The DeepSpeed/torch class the job runs (FusedAdam, DeepSpeedCPUAdam, torch.optim.AdamW, ...); 'client CLASS
  (STACK)' when the training stack passes its own (parity.migrate._stack)."""
  params: dict[str, Any]
  decay_mask: Literal["matrices", "no_bias_norm", "all"] = "matrices"
  """The tensors the job decays (parity.spec.DECAY_MASKS), from its training stack's param groups: 'all' (one
  group), 'no_bias_norm' (the HF Trainer's / Megatron's two groups) or 'matrices' (parity's own; what a port written
  before the stack was modelled ran)."""

  @model_validator(mode="after")
  def _check_params(self):
    want = set(OPTIMIZER_PARAM_KEYS[self.type])
    got = set(self.params)
    if got != want:
      raise ValueError(f"optimizer.params for type {self.type!r} must have exactly {sorted(want)}; "
                       f"missing {sorted(want - got)}, unknown {sorted(got - want)}")
    for k in ("lr", "eps", "weight_decay", "max_coeff", "min_coeff", "momentum", "dampening"):
      v = self.params.get(k)
      if k in want and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
        raise ValueError(f"optimizer.params.{k} must be a number >= 0; got {v!r}")
    if "betas" in want:
      b = self.params["betas"]
      if not (isinstance(b, (list, tuple)) and len(b) == 2 and all(isinstance(x, (int, float)) and 0 <= x < 1
                                                                     for x in b)):
        raise ValueError(f"optimizer.params.betas must be two numbers in [0, 1); got {b!r}")
    return self


class SchedulerCfg(BaseModel):
  """Learning-rate schedule; type and params as in DeepSpeed, every default filled in."""
  model_config = _STRICT
  type: Literal["Constant", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"]
  params: dict[str, Any]

  @model_validator(mode="after")
  def _check_params(self):
    want = set(SCHEDULER_DEFAULTS[self.type])
    if set(self.params) != want:
      raise ValueError(f"scheduler.params for {self.type} must have exactly {sorted(want)}; got {sorted(self.params)}")
    return self


class BatchCfg(BaseModel):
  model_config = _STRICT
  micro: int = Field(ge=1)
  """Sequences per data-parallel rank per micro step."""
  grad_accum: int = Field(ge=1)
  """Micro steps per optimizer step."""
  world: int = Field(ge=1)
  """Data-parallel ranks (size of the mesh's data axis)."""
  global_batch: int = Field(ge=1)
  """Sequences per optimizer step = micro * grad_accum * world (DeepSpeed train_batch_size)."""

  @model_validator(mode="after")
  def _product(self):
    if self.global_batch != self.micro * self.grad_accum * self.world:
      raise ValueError(f"batch.global_batch ({self.global_batch}) != micro * grad_accum * world "
                       f"({self.micro} * {self.grad_accum} * {self.world} = "
                       f"{self.micro * self.grad_accum * self.world})")
    return self


class LossScaleCfg(BaseModel):
  """fp16 loss scaling: DeepSpeed's DynamicLossScaler of ZeRO stages 1-3 when dynamic (an overflow at min_scale ends
  the run). A port is never fp16 at ZeRO stage 0 (refused: parity.migrate._port.MSG_FP16_STAGE0)."""
  model_config = _STRICT
  dynamic: bool
  static_scale: float = Field(ge=0)
  """Used when dynamic is false."""
  initial_scale_power: int
  """Dynamic: the first scale is 2**initial_scale_power."""
  window: int = Field(ge=1)
  """Dynamic: overflow-free steps before the scale doubles (loss_scale_window)."""
  hysteresis: int = Field(ge=1)
  """Dynamic: overflows tolerated before the scale halves (delayed shift)."""
  consecutive_hysteresis: bool
  min_scale: float = Field(gt=0)


class PrecisionCfg(BaseModel):
  model_config = _STRICT
  compute_dtype: Literal["fp32", "fp16", "bf16"]
  """Dtype of the forward/backward; master weights and optimizer state stay fp32."""
  grad_accum_dtype: Literal["fp32", "fp16", "bf16"]
  loss_scale: LossScaleCfg | None
  """fp16 only."""
  skip_nonfinite_updates: bool
  """Skip the update (and do not advance the LR schedule) when a gradient is inf/nan."""


class ClippingCfg(BaseModel):
  model_config = _STRICT
  max_global_norm: float = Field(ge=0)
  """0 disables clipping. g <- g / max(1, (||g|| + epsilon) / max_global_norm)."""
  epsilon: float = 1e-6


class JaxCfg(BaseModel):
  """The JAX side's plan, in parity.spec.JaxPlan's fields exactly (a port's `jax:` section is a JaxPlan): ZeRO is
  `zero_stage` over the mesh's data axis (1 optimizer state, 2 + gradients, 3 + params sharded), DeepSpeed's
  offload_optimizer / offload_param are `offload_opt_state` / `offload_params` in `host_memory_kind` (and
  offload_optimizer's ratio, ZeRO-3 only, `offload_opt_ratio`), activation checkpointing is `remat` (full, or
  offload_names for cpu_checkpointing)."""
  model_config = _STRICT
  offload_opt_state: bool
  offload_opt_ratio: float = Field(1.0, gt=0, le=1)
  """DeepSpeed offload_optimizer.ratio (ZeRO-3 only): the share of the optimizer state in host memory."""
  offload_params: bool
  host_memory_kind: Literal["pinned_host", "unpinned_host"]
  remat: Literal[REMAT_POLICIES]  # type: ignore[valid-type]
  scan_layers: bool = False
  zero_stage: int = Field(ge=0, le=3)
  data_parallel: int = Field(1, ge=1)

  @field_validator("offload_opt_ratio", mode="before")
  @classmethod
  def _ratio_not_bool(cls, v):  # pydantic's lax float reads true as 1.0
    if isinstance(v, bool):
      raise ValueError("jax.offload_opt_ratio must be a number in (0, 1] (true/false is not a share)")
    return v

  @model_validator(mode="after")
  def _stage3_params(self):
    if self.offload_params and self.zero_stage != 3:
      raise ValueError("jax.offload_params needs zero_stage 3 (DeepSpeed's offload_param is stage-3 only); got "
                       f"zero_stage={self.zero_stage}")
    if self.offload_opt_ratio < 1 and not self.offload_opt_state:
      raise ValueError(f"jax.offload_opt_ratio {self.offload_opt_ratio} offloads part of the optimizer state, but "
                       "jax.offload_opt_state is false; set it true, or offload_opt_ratio to 1.0")
    return self

  def plan(self) -> JaxPlan:
    """This section as the parity.spec.JaxPlan compare runs (validated)."""
    return JaxPlan(**self.model_dump()).validate()


class NotRunnable(BaseModel):
  """A part of the source config that the ported config holds but `parity compare` cannot run yet."""
  model_config = _STRICT
  value: Any
  """The setting, in the source config's terms (kept so the reverse port writes it back)."""
  why: str
  run: str = ""
  """How to run it all the same (another command, or the nearest config compare runs), or what checks it instead."""


NOT_RUNNABLE_KEYS = ("params_host_memory_kind", "cpu_checkpointing", "fp16_zero_stage0", "bias_correction",
                     "scheduler")
"""What `not_runnable_by_compare` may hold: params_host_memory_kind (offload_param pinned differently from
offload_optimizer: a JaxPlan has one host memory kind), cpu_checkpointing (only in ports written before compare's
DeepSpeed side ran CPU checkpointing, deepspeed.cpu_checkpointing: compare_blockers drops it), and the
checks `to_run_spec` makes (parity.migrate._blockers.compare_blockers): fp16 under ZeRO stage 0, Adam/Lamb without
bias correction, a scheduler compare does not run."""


class PortedConfig(BaseModel):
  model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
  schema_: Literal["parity.ported/2"] = Field(SCHEMA, alias="schema")
  source: str = ""
  optimizer: OptimizerCfg
  scheduler: SchedulerCfg
  batch: BatchCfg
  precision: PrecisionCfg
  clipping: ClippingCfg
  jax: JaxCfg
  not_runnable_by_compare: dict[str, NotRunnable] = {}
  """What compare cannot run yet (NOT_RUNNABLE_KEYS), each with its value, why and how to run it; empty exactly when
  `to_run_spec` maps it (the port fills it from the same checks, parity.migrate._blockers.compare_blockers)."""
  deepspeed_only: dict[str, Any] = {}
  """DeepSpeed settings of the source the JAX plan does not model (activation-checkpointing layout, ZeRO
  communication tuning, logging and I/O sections), by dotted key path with their values: `--to-deepspeed` writes
  them back as they were."""

  @field_validator("not_runnable_by_compare")
  @classmethod
  def _known_parts(cls, v):
    unknown = sorted(set(v) - set(NOT_RUNNABLE_KEYS))
    if unknown:
      raise ValueError(f"unknown key(s) {unknown}; expected some of {list(NOT_RUNNABLE_KEYS)}")
    return v

  @field_validator("source")
  @classmethod
  def _src(cls, v):
    return str(v)

  def to_dict(self) -> dict[str, Any]:
    return json.loads(self.model_dump_json(by_alias=True))

  def dumps(self, fmt: Literal["yaml", "json"] = "yaml") -> str:
    d = self.to_dict()
    if fmt == "json":
      return json.dumps(d, indent=2) + "\n"
    return yaml.safe_dump(d, sort_keys=False)
