"""PortedConfig -> DeepSpeed JSON (`parity port --to-deepspeed`), and PortedConfig -> RunSpec."""
from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import ValidationError

from parity.migrate._ctx import Flags
from parity.migrate._model import SCHEMA, PortedConfig
from parity.migrate._read import PortError
from parity.migrate._report import Report, leaf_paths
from parity.spec import RunSpec, SpecError

__all__ = ["to_deepspeed", "load_ported", "to_run_spec"]


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
    from parity.numerics.ds_json import fp16_section
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


def to_deepspeed(data: dict[str, Any], *, source: str = "") -> tuple[dict[str, Any], Report]:
  """Ported config dict -> (DeepSpeed config dict, report). Porting the result back gives the same meaning.

  Raises:
    PortError: `data` is not a valid ported config.
  """
  p = load_ported(data, source=source)
  report = Report(source=source, direction="jax->deepspeed")
  b = p.batch
  out: dict[str, Any] = {"train_batch_size": b.global_batch, "train_micro_batch_size_per_gpu": b.micro,
                         "gradient_accumulation_steps": b.grad_accum, "optimizer": _optimizer(p, report)}
  if p.scheduler.type != "Constant":
    out["scheduler"] = {"type": p.scheduler.type,
                        "params": {k: v for k, v in p.scheduler.params.items() if v is not None}}
  if p.clipping.epsilon != 1e-6:
    report.refuse(f"clipping.epsilon {p.clipping.epsilon}: DeepSpeed's clipping epsilon is fixed at 1e-6.")
  out["gradient_clipping"] = p.clipping.max_global_norm
  _precision(p, out, report)
  out.update(_zero_and_remat(p))
  _report_keys(p, report)
  return out, report


def _zero_and_remat(p: PortedConfig) -> dict[str, Any]:
  """The zero_optimization (and activation_checkpointing) sections of a ported config's jax: plan, with the
  not_runnable_by_compare settings written back (the params' own pinning, CPU checkpointing)."""
  from parity.numerics.ds_json import activation_checkpointing_section, zero_section
  j, nr = p.jax, p.not_runnable_by_compare
  params_kind = nr["params_host_memory_kind"].value if "params_host_memory_kind" in nr else j.host_memory_kind
  out: dict[str, Any] = {"zero_optimization": zero_section(
      j.zero_stage, j.host_memory_kind if j.offload_opt_state else None, params_kind if j.offload_params else None)}
  if j.remat != "none":
    from parity.numerics.ds_json import OFFLOAD_REMAT
    out["activation_checkpointing"] = activation_checkpointing_section(
        cpu=j.remat in OFFLOAD_REMAT or "cpu_checkpointing" in nr)
  return out


_TARGETS = {"batch.micro": "train_micro_batch_size_per_gpu", "batch.grad_accum": "gradient_accumulation_steps",
            "batch.global_batch": "train_batch_size", "clipping.max_global_norm": "gradient_clipping",
            "jax.zero_stage": "zero_optimization.stage", "jax.remat": "activation_checkpointing",
            "jax.offload_opt_state": "zero_optimization.offload_optimizer",
            "jax.offload_params": "zero_optimization.offload_param",
            "jax.host_memory_kind": "zero_optimization.offload_*.pin_memory",
            "not_runnable_by_compare.params_host_memory_kind.value": "zero_optimization.offload_param.pin_memory",
            "not_runnable_by_compare.cpu_checkpointing.value": "activation_checkpointing.cpu_checkpointing"}


def _report_keys(p: PortedConfig, report: Report) -> None:
  """Every key of the ported config in the reverse report: where it went in the DeepSpeed config, or why not."""
  for key, value in leaf_paths(p.to_dict()):
    top = key.split(".")[0]
    if key in ("batch.world", "jax.data_parallel"):
      report.set(key, "not_needed", None, f"launch DeepSpeed with {value} data-parallel ranks (the launcher sets "
                 "the world size, not the config)", value=value)
    elif key in ("schema", "source", "optimizer.impl", "jax.scan_layers") or key.endswith(".why"):
      report.set(key, "not_needed", None, "implied by the DeepSpeed sections written (informational here)",
                 value=value)
    elif key == "clipping.epsilon":
      report.set(key, "mapped", "gradient_clipping", "DeepSpeed's fixed 1e-6", value=value)
    else:
      tgt = _TARGETS.get(key, {"optimizer": "optimizer", "scheduler": "scheduler", "precision": "fp16/bf16",
                               "jax": "zero_optimization"}.get(top, top))
      report.set(key, "mapped", tgt, "written to the DeepSpeed config", value=value)


def to_run_spec(ported: PortedConfig, base: RunSpec) -> RunSpec:
  """Maps a ported config onto the RunSpec `parity compare` runs.

  The optimizer (AdamW, Adam with L2, Lamb, SGD; `_optimizer_fields`) and the scheduler (every one of
  parity.numerics.schedule.COMPARE_SCHEDULERS, OneCycle with or without momentum cycling) run as ported. The JAX side
  shards as the config does (`_jax_plan`): a ZeRO-3 config runs jax.zero_stage 3.
  Raises:
    SpecError: naming what compare cannot run yet (bias_correction false, more than one rank, fp16 under ZeRO
      stage 0, and each entry of the port's not_runnable_by_compare).
  The number of steps compare runs stays `base.train.steps`; the schedule keeps its own length.
  """
  o, s, b, pr = ported.optimizer, ported.scheduler, ported.batch, ported.precision
  from parity.numerics.schedule import COMPARE_SCHEDULERS
  if s.type not in COMPARE_SCHEDULERS:
    raise SpecError(f"parity compare runs the schedulers {', '.join(COMPARE_SCHEDULERS)}; the ported schedule is "
                    f"{s.type}.")
  if b.world != 1:
    raise SpecError(f"parity compare runs one data-parallel rank; the ported batch has world={b.world}.")
  fp16 = _fp16_fields(pr, ported.jax.zero_stage)
  if ported.not_runnable_by_compare:
    raise SpecError("parity compare cannot run yet: " + "; ".join(
        f"{k} {v.value!r}: {v.why}" for k, v in ported.not_runnable_by_compare.items()))
  j = ported.jax
  sched = {"lr_schedule": s.type, "lr_schedule_params": dict(s.params) if s.type != "Constant" else None}
  train = dataclasses.replace(
      base.train, micro_batch_size=b.micro, grad_accum_steps=b.grad_accum, **sched, **_optimizer_fields(o),
      grad_clip=ported.clipping.max_global_norm, precision=pr.compute_dtype, **fp16)
  ds = dataclasses.replace(base.deepspeed, zero_stage=j.zero_stage,
                           offload_optimizer="cpu" if j.offload_opt_state else "none",
                           offload_param="cpu" if j.offload_params else "none")
  return dataclasses.replace(base, train=train, jax=_jax_plan(ported, base, ds), deepspeed=ds).validate()


def _optimizer_fields(o: Any) -> dict[str, Any]:
  """TrainSpec fields of a ported optimizer (parity.numerics.schedule.optimizer_of is the inverse).

  Raises:
    SpecError: bias_correction false (compare's sides run bias-corrected Adam/Lamb only).
  """
  p = o.params
  if o.type != "sgd" and not p["bias_correction"]:
    raise SpecError(f"parity compare runs {o.type} with bias correction only; the ported optimizer has "
                    f"optimizer.params.bias_correction false. Set it to true to compare.")
  out: dict[str, Any] = {"optimizer": o.type, "lr": p["lr"], "weight_decay": p["weight_decay"]}
  if o.type == "sgd":
    return {**out, "momentum": p["momentum"], "dampening": p["dampening"], "nesterov": p["nesterov"]}
  out.update(beta1=p["betas"][0], beta2=p["betas"][1], eps=p["eps"])
  if o.type == "lamb":
    out.update(lamb_max_coeff=p["max_coeff"], lamb_min_coeff=p["min_coeff"], eps_inside_sqrt=p["eps_inside_sqrt"])
  return out


def _jax_plan(ported: PortedConfig, base: RunSpec, ds: Any) -> Any:
  """The JaxPlan of a ported config: its memory kinds and remat, sharded at the config's ZeRO stage.

  Where a parity.sizing.plans.PLANS pair has exactly this DeepSpeed plan and these memory kinds, its JaxPlan runs (so the
  report names the pair: a ZeRO-3 config runs the `zero3` pair, jax.zero_stage 3 on one device); otherwise
  jax.zero_stage is the config's stage.
  """
  from parity.sizing.plans import PLANS
  j = ported.jax
  host = j.offload_opt_state or j.offload_params
  jax = dataclasses.replace(base.jax, offload_opt_state=j.offload_opt_state, offload_params=j.offload_params,
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

  Raises:
    SpecError: fp16 under ZeRO stage 0 (DeepSpeed's FP16_Optimizer ignores hysteresis; the other sides
      follow the DynamicLossScaler of stages 1-3), or fp16 without loss-scale settings.
  """
  if pr.compute_dtype != "fp16":
    return {}
  ls = pr.loss_scale
  if ls is None:
    raise SpecError("the ported precision is fp16 without loss-scale settings (precision.loss_scale).")
  if zero_stage == 0:
    raise SpecError("parity compare runs fp16 under ZeRO stages 1-3: at stage 0 DeepSpeed's FP16_Optimizer halves "
                    "the loss scale on every overflow (fp16.hysteresis ignored). Set zero_optimization.stage >= 1.")
  return {"loss_scale": 0.0 if ls.dynamic else float(ls.static_scale), "initial_scale_power": ls.initial_scale_power,
          "loss_scale_window": ls.window, "hysteresis": ls.hysteresis,
          "consecutive_hysteresis": ls.consecutive_hysteresis, "min_loss_scale": float(ls.min_scale)}


def compare_flags(raw: dict[str, Any], base: RunSpec) -> Flags:
  """Values for the "auto" (and missing) keys of a DeepSpeed config, taken from the run spec.

  Only keys that are "auto" or absent get a value, so an explicit setting in the user's config
  always wins (and the HF Trainer's mismatch rule never fires): the run spec plays the part of
  the HF TrainingArguments. World size is 1: compare runs one data-parallel rank.
  """
  from parity.migrate._report import leaf_paths
  from parity.migrate._resolve import AUTO_RULES
  autos = {p for p, v in leaf_paths(raw) if v == "auto"}
  t, opt = base.train, raw.get("optimizer")
  values = {"micro_batch": t.micro_batch_size, "grad_accum": t.grad_accum_steps, "lr": t.lr,
            "betas": (t.beta1, t.beta2), "eps": t.eps, "weight_decay": t.weight_decay, "warmup_steps": t.warmup_steps,
            "total_steps": t.steps, "max_grad_norm": t.grad_clip, "precision": t.precision,
            "hidden_size": base.model.d_model}
  wanted = {AUTO_RULES[p][0] for p in autos if p in AUTO_RULES and AUTO_RULES[p][0]}
  if not isinstance(opt, dict) or "type" not in opt:
    wanted |= {"lr", "betas", "eps", "weight_decay"}
  if "train_micro_batch_size_per_gpu" not in raw and "train_batch_size" not in raw:
    wanted |= {"micro_batch"}
  if "gradient_accumulation_steps" not in raw and "train_batch_size" not in raw:
    wanted |= {"grad_accum"}
  if raw.get("train_batch_size") == "auto":
    wanted |= {"micro_batch", "grad_accum"}
  return Flags(world_size=1, **{k: values[k] for k in sorted(wanted)})


def port_for_compare(raw: dict[str, Any], base: RunSpec, *, source: str = ""):
  """Ports a DeepSpeed config for `parity compare --deepspeed-config`.

  Returns:
    (RunSpec for the JAX and torch sides, the resolved DeepSpeed config the DeepSpeed side runs
    verbatim, the PortResult with its key-by-key report).
  Raises:
    SpecError: the config is refused (the report's errors, naming the keys), or compare cannot run it.
  """
  from parity.migrate._port import port_config
  result = port_config(raw, compare_flags(raw, base), source=source)
  if result.ported is None:
    raise SpecError(f"{source or 'DeepSpeed config'}: refused: " + "; ".join(result.report.errors))
  spec = to_run_spec(result.ported, base)
  ds = {k: v for k, v in result.ds_config.items() if v is not None}
  # A config without an optimizer section runs as the HF Trainer runs it: the DeepSpeed side passes a client
  # torch.optim.AdamW (torch_impl.engine.client_optimizer) to deepspeed.initialize; the config is not amended, so
  # DeepSpeed accepts or refuses exactly what it would (the port has already refused what it would refuse).
  # The values the port filled in are shown before the run starts (parity.report.progress.run_notes).
  return spec, ds, result
