"""PortedConfig -> DeepSpeed JSON (`parity port --to-deepspeed`), and PortedConfig -> RunSpec."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from pydantic import ValidationError

from parity.migrate._ctx import Flags
from parity.migrate._blockers import compare_blockers
from parity.migrate._model import SCHEMA, PortedConfig
from parity.migrate._read import PortError
from parity.migrate._report import Report, leaf_paths
from parity.overrides import has_dotted
from parity.spec import RunSpec, SpecError
from parity.numerics.ds_json import fp16_section, activation_checkpointing_section, zero_section, OFFLOAD_REMAT
from parity.sizing.plans import PLANS
from parity.migrate._resolve import AUTO_RULES, FILLS
from parity.migrate._stack import choose_stack
from parity.migrate._port import port_config

__all__ = ["to_deepspeed", "load_ported", "to_run_spec", "compare_blockers", "optimizer_section"]


def load_ported(data: dict[str, Any], *, source: str = "") -> PortedConfig:
  """Validates a ported config dict. Raises PortError naming the first bad key (or the older schema and the fix)."""
  if isinstance(data, dict) and data.get("schema") == "parity.ported/1":
    raise PortError(f"{source}: written by an older `parity port` (schema parity.ported/1, with sharding: and remat: "
                    f"sections); port the DeepSpeed config again for schema {SCHEMA} (a jax: section in "
                    "parity.spec.JaxPlan's fields).", key="schema")
  try:
    return PortedConfig.model_validate(data)
  except ValidationError as e:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
    raise PortError(f"{source}: not a ported config (schema {SCHEMA}): {loc}: {err['msg']}; "
                    f"got {err.get('input')!r}.", key=loc) from None


_OPT_NAMES = {"adamw": "AdamW", "adam": "Adam", "lamb": "Lamb", "sgd": "SGD"}


def _optimizer(p: PortedConfig, report: Report) -> dict[str, Any]:
  o = p.optimizer
  params = dict(o.params)
  if o.type in ("adamw", "adam"):
    if o.impl.startswith("torch.optim."):
      if not params.pop("bias_correction"):
        report.refuse("optimizer.params.bias_correction: false cannot be expressed with torch.optim Adam(W) "
                      "(impl torch.optim.*); change impl to FusedAdam.")
      params["torch_adam"] = True
    if o.type == "adam":
      params["adam_w_mode"] = False
    return {"type": _OPT_NAMES[o.type], "params": params}
  return {"type": _OPT_NAMES[o.type], "params": params}


def optimizer_section(p: PortedConfig) -> dict[str, Any]:
  """The DeepSpeed optimizer section of a ported optimizer ({"type", "params"}), also for a client optimizer (which
  `to_deepspeed` does not write): what `--verify` runs when the source config had none. What `to_deepspeed` would
  refuse (bias_correction false with torch.optim) is written as torch.optim runs it (bias corrected)."""
  return _optimizer(p, Report(source="", direction="jax->deepspeed"))


def _precision(p: PortedConfig, out: dict[str, Any], report: Report) -> None:
  pr = p.precision
  if pr.compute_dtype == "fp16":
    ls = pr.loss_scale
    if ls is None:
      report.refuse("precision.loss_scale: fp16 needs loss-scale settings (DeepSpeed always scales fp16 losses).")
      return
    if not float(ls.min_scale).is_integer():
      report.refuse(f"precision.loss_scale.min_scale {ls.min_scale}: DeepSpeed's min_loss_scale is an integer.")
    if not pr.skip_nonfinite_updates:
      report.refuse("precision.skip_nonfinite_updates: false with fp16 has no DeepSpeed equivalent: DeepSpeed "
                    "skips every overflowing fp16 step, with a static or a dynamic loss scale.")
    _scaler_of_stage(ls, p.jax.zero_stage, report)
    out["fp16"] = fp16_section(loss_scale=0 if ls.dynamic else ls.static_scale,
                               initial_scale_power=ls.initial_scale_power, loss_scale_window=ls.window,
                               hysteresis=ls.hysteresis, consecutive_hysteresis=ls.consecutive_hysteresis,
                               min_loss_scale=int(ls.min_scale))
  elif pr.compute_dtype == "bf16":
    out["bf16"] = {"enabled": True, "check_grad_overflow": pr.skip_nonfinite_updates}
  elif pr.skip_nonfinite_updates:
    report.refuse("precision.skip_nonfinite_updates: true with fp32 compute has no DeepSpeed equivalent "
                  "(DeepSpeed checks overflow only for fp16/bf16).")
  if pr.grad_accum_dtype != pr.compute_dtype:
    out["data_types"] = {"grad_accum_dtype": pr.grad_accum_dtype}


def _scaler_of_stage(ls: Any, stage: int, report: Report) -> None:
  """Refuses fp16 at jax.zero_stage 0: DeepSpeed's stage-0 FP16_Optimizer does not run a loss-scaled step
  (parity.migrate._port.MSG_FP16_STAGE0)."""
  if stage == 0:
    report.refuse("precision.compute_dtype fp16 with jax.zero_stage 0 cannot be written for DeepSpeed: at ZeRO stage "
                  "0 DeepSpeed 0.19.8 never multiplies the loss by the loss scale but divides the gradient by it "
                  "(FP16_Optimizer), so the config would not run this loss scaling. Set jax.zero_stage >= 1.")


def _put(out: dict[str, Any], key: str, value: Any, report: Report) -> None:
  """Writes `value` at the dotted `key` of `out` (PortedConfig.deepspeed_only), creating sections."""
  *parents, leaf = key.split(".")
  node = out
  for part in parents:
    node = node.setdefault(part, {})
    if not isinstance(node, dict):
      report.refuse(f"deepspeed_only.{key}: {part} is not a section in the DeepSpeed config written; remove the key.")
      return
  node[leaf] = value


def to_deepspeed(data: dict[str, Any], *, source: str = "") -> tuple[dict[str, Any], Report]:
  """Ported config dict -> (DeepSpeed config dict, report). Porting the result back gives the same meaning.

  Raises:
    PortError: `data` is not a valid ported config.
  """
  p = load_ported(data, source=source)
  report = Report(source=source, direction="jax->deepspeed")
  b = p.batch
  out: dict[str, Any] = {"train_batch_size": b.global_batch, "train_micro_batch_size_per_gpu": b.micro,
                         "gradient_accumulation_steps": b.grad_accum}
  if p.optimizer.impl.startswith(CLIENT):  # the source's form: the script passes the optimizer (HF Trainer's mask)
    report.warnings.append(f"optimizer: no optimizer section is written (the source had none; {p.optimizer.impl}): "
                           "pass the optimizer to deepspeed.initialize as the source's script did")
  else:
    out["optimizer"] = _optimizer(p, report)
  if p.scheduler.type != "Constant":
    out["scheduler"] = {"type": p.scheduler.type,
                        "params": {k: v for k, v in p.scheduler.params.items() if v is not None}}
  if p.clipping.epsilon != 1e-6:
    report.refuse(f"clipping.epsilon {p.clipping.epsilon}: DeepSpeed's clipping epsilon is fixed at 1e-6.")
  out["gradient_clipping"] = p.clipping.max_global_norm
  _precision(p, out, report)
  out.update(_zero_and_remat(p, report))
  for key, value in p.deepspeed_only.items():  # what the JAX plan does not model, as the source had it
    _put(out, key, value, report)
  defaulted = [k for k in ("partition_activations", "contiguous_memory_optimization", "synchronize_checkpoint_boundary",
                           "profile") if "activation_checkpointing" in out and
               f"activation_checkpointing.{k}" not in p.deepspeed_only]
  if defaulted:
    report.warnings.append(f"activation_checkpointing: {', '.join(defaulted)} written as DeepSpeed's default (false); "
                           "the ported config does not hold them (deepspeed_only), the JAX plan does not model them")
  _report_keys(p, out, report)
  return out, report


def _zero_and_remat(p: PortedConfig, report: Report) -> dict[str, Any]:
  """The zero_optimization (and activation_checkpointing) sections of a ported config's jax: plan, with the
  not_runnable_by_compare settings written back (the params' own pinning, CPU checkpointing). A partial optimizer
  offload (jax.offload_opt_ratio < 1) is offload_optimizer.ratio at ZeRO stage 3, refused at another stage."""
  j, nr = p.jax, p.not_runnable_by_compare
  params_kind = nr["params_host_memory_kind"].value if "params_host_memory_kind" in nr else j.host_memory_kind
  if j.offload_opt_state and j.offload_opt_ratio < 1 and j.zero_stage != 3:
    report.refuse(f"jax.offload_opt_ratio {j.offload_opt_ratio} at jax.zero_stage {j.zero_stage}: DeepSpeed offloads "
                  "part of the optimizer state at ZeRO stage 3 only ('Partial offloading only supported for ZeRO "
                  "Stage 3.'); set jax.zero_stage to 3, or jax.offload_opt_ratio to 1.0.")
  out: dict[str, Any] = {"zero_optimization": zero_section(
      j.zero_stage, j.host_memory_kind if j.offload_opt_state else None, params_kind if j.offload_params else None,
      j.offload_opt_ratio)}
  if j.remat != "none":
    out["activation_checkpointing"] = activation_checkpointing_section(
        cpu=j.remat in OFFLOAD_REMAT or "cpu_checkpointing" in nr)
  return out


_LOSS_SCALE = {"dynamic": "fp16.loss_scale", "static_scale": "fp16.loss_scale",
               "initial_scale_power": "fp16.initial_scale_power", "window": "fp16.loss_scale_window",
               "hysteresis": "fp16.hysteresis", "consecutive_hysteresis": "fp16.consecutive_hysteresis",
               "min_scale": "fp16.min_loss_scale"}
_FIXED = {"batch.micro": "train_micro_batch_size_per_gpu", "batch.grad_accum": "gradient_accumulation_steps",
          "batch.global_batch": "train_batch_size", "clipping.max_global_norm": "gradient_clipping",
          "clipping.epsilon": "gradient_clipping", "jax.zero_stage": "zero_optimization.stage",
          "not_runnable_by_compare.params_host_memory_kind.value": "zero_optimization.offload_param.pin_memory",
          "not_runnable_by_compare.cpu_checkpointing.value": "activation_checkpointing.cpu_checkpointing"}
CLIENT = "client "
"""How a ported optimizer.impl starts when the source config had no optimizer section (_port_optim._from_flags)."""


def _target(key: str, p: PortedConfig, out: dict[str, Any]) -> tuple[str | None, str]:
  """(the dotted key of `out` a ported key is written to, the reason), or (None, why nothing is written for it)."""
  top, _, rest = key.partition(".")
  if key in _FIXED:
    return _FIXED[key], "DeepSpeed's fixed 1e-6" if key == "clipping.epsilon" else "written to the DeepSpeed config"
  if top == "optimizer":
    return _optimizer_target(rest, p, out)
  if top == "scheduler":
    if p.scheduler.type == "Constant":
      return None, ("Constant: no scheduler section is written (the source had none): DeepSpeed keeps "
                    "optimizer.params.lr, or runs the client scheduler the script passes to deepspeed.initialize")
    if rest.startswith("params.") and not has_dotted(out, key):
      return None, "null: left out, DeepSpeed's default applies"
    return key, "written to the DeepSpeed config"
  if top == "precision":
    return _precision_target(rest, p)
  if top == "jax":
    return _jax_target(rest, p, out)
  return None, "nothing to write"


def _optimizer_target(rest: str, p: PortedConfig, out: dict[str, Any]) -> tuple[str | None, str]:
  o = p.optimizer
  if o.impl.startswith(CLIENT):
    return None, (f"client optimizer ({o.impl}): the source's training stack passes it to deepspeed.initialize "
                  f"(decay mask {o.decay_mask}), so no optimizer section is written; under the HF Trainer an "
                  "optimizer section would decay every tensor")
  if rest == "impl":
    return None, "implied by optimizer.type and optimizer.params written (informational here)"
  if rest == "decay_mask":
    return None, (f"{o.decay_mask}: the param groups the training stack passes, not a config key (parity port "
                  "--stack says which stack; parity.migrate._stack)")
  if rest == "type":
    return "optimizer.type", "written to the DeepSpeed config"
  if rest == "params.bias_correction" and not has_dotted(out, "optimizer.params.bias_correction"):
    return "optimizer.params.torch_adam", "torch.optim Adam(W) (torch_adam true) always corrects the bias"
  return f"optimizer.{rest}", "written to the DeepSpeed config"


def _precision_target(rest: str, p: PortedConfig) -> tuple[str | None, str]:
  pr = p.precision
  if rest == "compute_dtype":
    if pr.compute_dtype == "fp32":
      return None, "fp32: no fp16/bf16 section is written (DeepSpeed computes in fp32 by default)"
    return f"{pr.compute_dtype}.enabled", "written to the DeepSpeed config"
  if rest == "grad_accum_dtype":
    if pr.grad_accum_dtype == pr.compute_dtype:
      return None, "the compute dtype: DeepSpeed's default, no data_types section is written"
    return "data_types.grad_accum_dtype", "written to the DeepSpeed config"
  if rest == "loss_scale":
    return None, "null: no fp16 loss scaling to write"
  if rest.startswith("loss_scale."):
    return _LOSS_SCALE[rest.removeprefix("loss_scale.")], "written to the DeepSpeed config"
  if pr.compute_dtype == "bf16":
    return "bf16.check_grad_overflow", "written to the DeepSpeed config"
  if pr.compute_dtype == "fp16":
    return "fp16.enabled", "DeepSpeed skips every overflowing fp16 step (no key of its own)"
  return None, "false: DeepSpeed checks no overflow in fp32, nothing to write"


def _jax_target(rest: str, p: PortedConfig, out: dict[str, Any]) -> tuple[str | None, str]:
  j = p.jax
  if rest in ("offload_opt_state", "offload_params"):
    sect = "offload_optimizer" if rest == "offload_opt_state" else "offload_param"
    if has_dotted(out, f"zero_optimization.{sect}"):
      return f"zero_optimization.{sect}.device", "written to the DeepSpeed config"
    if getattr(j, rest):
      return None, f"not written: DeepSpeed reads zero_optimization.{sect} at ZeRO stage 3 only"
    return None, f"false: no zero_optimization.{sect} section is written (DeepSpeed's default: no offload)"
  if rest == "offload_opt_ratio":
    if has_dotted(out, "zero_optimization.offload_optimizer.ratio"):
      return "zero_optimization.offload_optimizer.ratio", "written to the DeepSpeed config"
    if j.offload_opt_ratio == 1:
      return None, "1.0: all of the optimizer state offloaded, DeepSpeed's default (no ratio written)"
    return None, "not written: DeepSpeed offloads part of the optimizer state at ZeRO stage 3 only"
  if rest == "host_memory_kind":
    for sect in ("offload_optimizer", "offload_param"):
      if has_dotted(out, f"zero_optimization.{sect}.pin_memory"):
        return f"zero_optimization.{sect}.pin_memory", "written to the DeepSpeed config"
    return None, "no offload section written: the host memory kind is not used, nothing to write"
  if rest == "remat":
    if j.remat == "none":
      return None, "none: no activation_checkpointing section is written"
    return "activation_checkpointing", "written to the DeepSpeed config"
  return None, "nothing to write"


def _report_keys(p: PortedConfig, out: dict[str, Any], report: Report) -> None:
  """Every key of the ported config in the reverse report: the key of `out` it was written to (which `out` holds:
  tests/test_port_acceptance.py checks every real config), or why nothing was written for it."""
  for key, value in leaf_paths(p.to_dict()):
    top = key.split(".")[0]
    if key in ("batch.world", "jax.data_parallel"):
      report.set(key, "not_needed", None, f"launch DeepSpeed with {value} data-parallel ranks (the launcher sets "
                 "the world size, not the config)", value=value)
    elif key in ("schema", "source", "jax.scan_layers") or key.endswith((".why", ".run")):
      report.set(key, "not_needed", None, "informational here: nothing to write", value=value)
    elif key in ("not_runnable_by_compare", "deepspeed_only"):  # empty
      report.set(key, "not_needed", None, "empty: nothing to write", value=value)
    elif top == "not_runnable_by_compare" and (key not in _FIXED or not has_dotted(out, _FIXED[key])):
      report.set(key, "not_needed", None, "what compare cannot run, derived from the other sections "
                 "(compare_blockers); nothing to write", value=value)
    elif top == "deepspeed_only":
      report.set(key, "mapped", key.removeprefix("deepspeed_only."), "kept from the source config: DeepSpeed "
                 "reads it, the JAX plan does not model it", value=value)
    else:
      tgt, why = _target(key, p, out)
      report.set(key, "mapped" if tgt else "not_needed", tgt, why, value=value)


def to_run_spec(ported: PortedConfig, base: RunSpec) -> RunSpec:
  """Maps a ported config onto the RunSpec `parity compare` runs.

  The optimizer (AdamW, Adam with L2, Lamb, SGD; `_optimizer_fields`) and the scheduler (every one of
  parity.numerics.schedule.COMPARE_SCHEDULERS, OneCycle with or without momentum cycling) run as ported. The JAX side
  shards as the config does (`_jax_plan`): a ZeRO-3 config runs jax.zero_stage 3. An activation_checkpointing section
  (jax.remat not none) checkpoints on both sides: deepspeed.activation_checkpointing true (torch_impl.engine wraps
  every block in deepspeed.checkpointing.checkpoint), as JAX rematerialises each block.
  A port for N data-parallel ranks (batch.world) runs its global micro batch, micro x N: train.micro_batch_size
  is the global micro batch (docs/multirank.md), so `parity compare --nproc N` runs the config's N ranks of
  `micro` sequences each, and --nproc 1 the same global batch on one rank.
  Raises:
    SpecError: naming every reason compare cannot run it and how to run it (`compare_blockers`).
  The number of steps compare runs stays `base.train.steps`; the schedule keeps its own length.
  """
  blockers = compare_blockers(ported)
  if blockers:
    raise SpecError("parity compare cannot run this ported config: " + "; ".join(
        f"{k} {json.dumps(v.value)}: {v.why}. {v.run}" for k, v in blockers.items()))
  o, s, b, pr = ported.optimizer, ported.scheduler, ported.batch, ported.precision
  fp16 = _fp16_fields(pr, ported.jax.zero_stage)
  j = ported.jax
  sched = {"lr_schedule": s.type, "lr_schedule_params": dict(s.params) if s.type != "Constant" else None}
  train = dataclasses.replace(
      base.train, micro_batch_size=b.micro * b.world, grad_accum_steps=b.grad_accum, **sched, **_optimizer_fields(o),
      grad_clip=ported.clipping.max_global_norm, precision=pr.compute_dtype, **fp16)
  ds = dataclasses.replace(base.deepspeed, zero_stage=j.zero_stage,
                           offload_optimizer="cpu" if j.offload_opt_state else "none",
                           offload_param="cpu" if j.offload_params else "none",
                           activation_checkpointing=j.remat != "none",  # the config's section: each block recomputed
                           cpu_checkpointing=j.remat in OFFLOAD_REMAT)  # as --to-deepspeed writes it back
  return dataclasses.replace(base, train=train, jax=_jax_plan(ported, base, ds), deepspeed=ds).validate()


def _optimizer_fields(o: Any) -> dict[str, Any]:
  """TrainSpec fields of a ported optimizer (parity.numerics.schedule.optimizer_of is the inverse); bias_correction
  false is refused before (compare_blockers)."""
  p = o.params
  out: dict[str, Any] = {"optimizer": o.type, "lr": p["lr"], "weight_decay": p["weight_decay"],
                         "decay_mask": o.decay_mask}
  if o.type == "sgd":
    return {**out, "momentum": p["momentum"], "dampening": p["dampening"], "nesterov": p["nesterov"]}
  out.update(beta1=p["betas"][0], beta2=p["betas"][1], eps=p["eps"])
  if o.type == "lamb":
    out.update(lamb_max_coeff=p["max_coeff"], lamb_min_coeff=p["min_coeff"], eps_inside_sqrt=p["eps_inside_sqrt"])
  return out


def _jax_plan(ported: PortedConfig, base: RunSpec, ds: Any) -> Any:
  """The JaxPlan of a ported config: its memory kinds and remat, sharded at the config's ZeRO stage.

  Where a parity.sizing.plans.PLANS pair has exactly this DeepSpeed plan and these memory kinds, its JaxPlan runs (so
  the report names the pair: a ZeRO-3 config runs the `zero3` pair, jax.zero_stage 3 on one device); otherwise
  jax.zero_stage is the config's stage.
  """
  j = ported.jax
  host = j.offload_opt_state or j.offload_params
  jax = dataclasses.replace(base.jax, offload_opt_state=j.offload_opt_state, offload_params=j.offload_params,
                            offload_opt_ratio=j.offload_opt_ratio if j.offload_opt_state else 1.0,
                            host_memory_kind=j.host_memory_kind if host else base.jax.host_memory_kind,
                            remat=j.remat, zero_stage=j.zero_stage)
  for plan in PLANS.values():
    pj = plan.jax
    if plan.deepspeed == ds and (pj.offload_opt_state, pj.offload_params, pj.remat) == \
        (jax.offload_opt_state, jax.offload_params, jax.remat) and pj.data_parallel == jax.data_parallel \
        and pj.scan_layers == jax.scan_layers and (not host or pj.host_memory_kind == jax.host_memory_kind):
      return dataclasses.replace(jax, zero_stage=pj.zero_stage)
  return jax


def _fp16_fields(pr: Any, zero_stage: int) -> dict[str, Any]:
  """TrainSpec loss-scale fields of a ported fp16 precision ({} for fp32/bf16).

  fp16 under ZeRO stage 0 is refused before (compare_blockers).
  Raises:
    SpecError: fp16 without loss-scale settings.
  """
  if pr.compute_dtype != "fp16":
    return {}
  ls = pr.loss_scale
  if ls is None:
    raise SpecError("the ported precision is fp16 without loss-scale settings (precision.loss_scale).")
  return {"loss_scale": 0.0 if ls.dynamic else float(ls.static_scale), "initial_scale_power": ls.initial_scale_power,
          "loss_scale_window": ls.window, "hysteresis": ls.hysteresis,
          "consecutive_hysteresis": ls.consecutive_hysteresis, "min_loss_scale": float(ls.min_scale)}


def compare_flags(raw: dict[str, Any], base: RunSpec, stack: str | None = None) -> Flags:
  """Values for the "auto" (and missing) keys of a DeepSpeed config, taken from the run spec.

  Only keys that are "auto" or absent get a value, so an explicit setting in the user's config
  always wins (and the HF Trainer's mismatch rule never fires): the run spec plays the part of
  the HF TrainingArguments. World size is 1: the config's batch is the 1-rank run's (with --nproc N compare
  splits it over the ranks, torch_impl.ds_config.per_rank_config).
  """
  autos = {p for p, v in leaf_paths(raw) if v == "auto"}
  t, opt = base.train, raw.get("optimizer")
  values = {"micro_batch": t.micro_batch_size, "grad_accum": t.grad_accum_steps, "lr": t.lr,
            "betas": (t.beta1, t.beta2), "eps": t.eps, "weight_decay": t.weight_decay, "warmup_steps": t.warmup_steps,
            "total_steps": t.steps, "max_grad_norm": t.grad_clip, "precision": t.precision,
            "hidden_size": base.model.d_model}
  wanted = {AUTO_RULES[p][0] for p in autos if p in AUTO_RULES and AUTO_RULES[p][0]}
  if not isinstance(opt, dict) or "type" not in opt or stack == "megatron":  # the stack's own optimizer
    wanted |= {"lr", "betas", "eps", "weight_decay"}
  if "train_micro_batch_size_per_gpu" not in raw and "train_batch_size" not in raw:
    wanted |= {"micro_batch"}
  if "gradient_accumulation_steps" not in raw and "train_batch_size" not in raw:
    wanted |= {"grad_accum"}
  if raw.get("train_batch_size") == "auto":
    wanted |= {"micro_batch", "grad_accum"}
  if t.precision in ("bf16", "fp16") and t.precision not in raw and choose_stack(raw, stack)[0] in FILLS:
    wanted |= {"precision"}  # the Trainer's bf16/fp16: Accelerate adds the section (parity.migrate._resolve)
  return Flags(world_size=1, stack=stack, **{k: values[k] for k in sorted(wanted)})


def port_for_compare(raw: dict[str, Any], base: RunSpec, *, source: str = "", stack: str | None = None):
  """Ports a DeepSpeed config for `parity compare --deepspeed-config`, under the training stack `stack`
  (parity.migrate._stack; None: chosen from the config).

  Returns:
    (RunSpec for the JAX and torch sides, the resolved DeepSpeed config the DeepSpeed side runs
    verbatim, the PortResult with its key-by-key report).
  Raises:
    SpecError: the config is refused (the report's errors, naming the keys), or compare cannot run it.
  """
  result = port_config(raw, compare_flags(raw, base, stack), source=source)
  if result.ported is None:
    raise SpecError(f"{source or 'DeepSpeed config'}: refused: " + "; ".join(result.report.errors))
  spec = to_run_spec(result.ported, base)
  ds = {k: v for k, v in result.ds_config.items() if v is not None}
  # A config without an optimizer section (or, under Megatron, whose section DeepSpeed never reads: the port drops
  # it) runs as its stack runs it: the DeepSpeed side passes the client optimizer (torch_impl.engine.client_optimizer:
  # DeepSpeedCPUAdam under offload, as Accelerate and Megatron pass it, else torch.optim.AdamW) over the param groups
  # of train.decay_mask; the config is not otherwise amended, so DeepSpeed accepts or refuses exactly what it would.
  # The values the port filled in are shown before the run starts (parity.report.progress.run_notes).
  return spec, ds, result
