"""optimizer and scheduler sections -> PortedConfig.optimizer / .scheduler (DeepSpeed 0.19.8 semantics)."""
from __future__ import annotations

from typing import Any

from parity.migrate._ctx import MISSING, UNRESOLVED, Ctx
from parity.migrate.reference import SCHEDULER_DEFAULTS

__all__ = ["port_optimizer", "port_scheduler"]

MSG_MAX_GRAD_NORM = ("optimizer.params.max_grad_norm: DeepSpeed raises \"'max_grad_norm' is not supported as an "
                     "optimizer parameter, please switch to using the deepspeed parameter 'gradient_clipping'\" "
                     "(engine._configure_basic_optimizer). Move the value to top-level \"gradient_clipping\".")
_DS_OTHER = {"adagrad", "lion", "muadam", "muadamw", "musgd", "muon"}
_TORCH_OPTIMS = {"Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "ASGD", "LBFGS", "NAdam", "RAdam",
                 "RMSprop", "Rprop", "SGD", "SparseAdam", "Muon"}
_IMPL_DETAIL = "implementation detail of the torch kernel; no effect on the update"
_ADAM_DEFAULTS = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "bias_correction": True}
# 1-bit / 0-1 optimizers: DeepSpeed <= 0.16 signatures (removed from 0.19.8).
_ONEBIT = {
    "onebitadam": ("adamw", {"freeze_step", "cuda_aware", "comm_backend_name"}),
    "zerooneadam": ("adamw", {"var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper",
                              "cuda_aware", "comm_backend_name"}),
    "onebitlamb": ("lamb", {"freeze_step", "cuda_aware", "comm_backend_name", "coeff_beta", "factor_max",
                            "factor_min", "factor_threshold"}),
}
_TORCH_SCHEDULERS = {"LambdaLR", "MultiplicativeLR", "StepLR", "MultiStepLR", "ConstantLR", "LinearLR",
                     "ExponentialLR", "SequentialLR", "CosineAnnealingLR", "ChainedScheduler", "ReduceLROnPlateau",
                     "CyclicLR", "CosineAnnealingWarmRestarts", "OneCycleLR", "PolynomialLR", "LRScheduler"}


def _betas(ctx: Ctx, path: str, default: list[float]) -> Any:
  v = ctx.get(path)
  if v is UNRESOLVED:
    return None
  if v is MISSING:
    return list(default)
  if not (isinstance(v, (list, tuple)) and len(v) == 2 and all(
      isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < 1 for x in v)):
    ctx.refuse(path, f"{path}: got {v!r}; expected two numbers in [0, 1), e.g. [0.9, 0.999].")
    return None
  return [float(x) for x in v]


def _from_flags(ctx: Ctx, why: str) -> dict[str, Any] | None:
  f = ctx.flags
  missing = [flag for flag, v in (("--lr", f.lr), ("--betas", f.betas), ("--eps", f.eps),
                                  ("--weight-decay", f.weight_decay)) if v is None]
  if missing:
    ctx.refuse(None, f"optimizer: {why}, so DeepSpeed uses the optimizer the training script passes to "
               f"deepspeed.initialize. Pass {', '.join(missing)} to port it as AdamW (what the HF Trainer and "
               "Megatron build).")
    return None
  params = {"lr": f.lr, "betas": list(f.betas), "eps": f.eps, "weight_decay": f.weight_decay, "bias_correction": True}
  return {"type": "adamw", "impl": "client torch.optim.AdamW (from flags)", "params": params}


def _check_keys(ctx: Ctx, allowed: set[str], cls: str) -> bool:
  node = ctx.get("optimizer.params")
  ok = True
  for k in (node if isinstance(node, dict) else {}):
    if k == "max_grad_norm":
      ctx.refuse("optimizer.params.max_grad_norm", MSG_MAX_GRAD_NORM, deepspeed=True)
      ok = False
    elif k not in allowed:
      ctx.refuse(f"optimizer.params.{k}", f"optimizer.params.{k}: {cls} has no such argument; DeepSpeed passes every "
                 f"param to {cls}(...) and fails with TypeError. Known: {', '.join(sorted(allowed))}.", deepspeed=True)
      ok = False
  return ok


def _mark_params(ctx: Ctx, mapped: dict[str, str], notneeded: dict[str, str]) -> None:
  for k, why in mapped.items():
    ctx.mark(f"optimizer.params.{k}", "mapped", f"optimizer.params.{k}", why, overwrite=False)
  for k, why in notneeded.items():
    ctx.mark(f"optimizer.params.{k}", "not_needed", None, why, overwrite=False)


def _adam(ctx: Ctx, lname: str, offload: str | None, onebit: str | None) -> dict[str, Any] | None:
  w_mode = ctx.boolean("optimizer.params.adam_w_mode", True)
  torch_adam = ctx.boolean("optimizer.params.torch_adam", False)
  effective = lname == "adamw" or bool(w_mode) or onebit is not None
  if onebit:
    impl, allowed, wd_default = onebit, {"lr", "bias_correction", "betas", "eps", "eps_inside_sqrt", "weight_decay",
                                         "amsgrad"} | _ONEBIT[onebit.lower()][1], 0.0
  elif torch_adam:
    impl = "torch.optim.AdamW" if effective else "torch.optim.Adam"
    allowed, wd_default = {"lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "maximize", "capturable",
                           "differentiable", "fused"}, (0.01 if effective else 0.0)
  elif offload in ("cpu", "nvme"):
    impl, allowed, wd_default = "DeepSpeedCPUAdam", {"lr", "bias_correction", "betas", "eps", "weight_decay",
                                                     "amsgrad"}, 0.0
  else:
    impl, allowed, wd_default = "FusedAdam", {"lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad",
                                              "set_grad_none"}, 0.0
  allowed |= {"adam_w_mode", "torch_adam", "fp32_optimizer_states"}
  _check_keys(ctx, allowed, impl)
  lr = ctx.num("optimizer.params.lr", 1e-3, ge=0)
  betas = _betas(ctx, "optimizer.params.betas", [0.9, 0.999])
  eps = ctx.num("optimizer.params.eps", 1e-8, gt=0)
  wd = ctx.num("optimizer.params.weight_decay", wd_default, ge=0)
  bc = ctx.boolean("optimizer.params.bias_correction", True) if "bias_correction" in allowed else True
  for k, v in (("lr", 1e-3), ("betas", [0.9, 0.999]), ("eps", 1e-8), ("weight_decay", wd_default)):
    if not ctx.has(f"optimizer.params.{k}"):
      ctx.implied(f"optimizer.params.{k}", v, f"{impl} default")
  for k in ("amsgrad", "maximize", "eps_inside_sqrt"):
    if ctx.get(f"optimizer.params.{k}") is True:
      ctx.refuse(f"optimizer.params.{k}", f"optimizer.params.{k}: true is not supported by the port (Adam/AdamW "
                 "without it only). Remove it or set it to false.")
  if ctx.get("optimizer.params.fp32_optimizer_states") is False:
    ctx.refuse("optimizer.params.fp32_optimizer_states", "optimizer.params.fp32_optimizer_states: false keeps Adam "
               "moments in the param dtype; the JAX port keeps them fp32. Remove the key.")
  kind = "adamw" if effective else "adam"
  rule = ("decoupled weight decay p -= lr*wd*p (AdamW)" if effective else "L2 weight decay added to the gradient")
  if lname == "adamw" and w_mode is False:
    ctx.warn("optimizer.type AdamW ignores adam_w_mode=false: DeepSpeed's engine forces AdamW for type AdamW.")
  _mark_params(ctx, {
      "lr": "learning rate", "betas": "Adam (beta1, beta2)", "eps": "added to sqrt(v_hat)",
      "weight_decay": rule,
      "bias_correction": "bias-corrected moments (false: raw m / (sqrt(v) + eps))",
  }, {
      "adam_w_mode": f"selects the update rule -> optimizer.type {kind!r} ({rule})",
      "torch_adam": f"selects the class ({impl}); the JAX update is the same formula",
      "fp32_optimizer_states": "JAX keeps optimizer state in fp32",
      "amsgrad": "false: plain Adam", "maximize": "false: minimise", "eps_inside_sqrt": "false: eps outside sqrt",
      "foreach": _IMPL_DETAIL, "capturable": _IMPL_DETAIL, "differentiable": _IMPL_DETAIL, "fused": _IMPL_DETAIL,
      "set_grad_none": "JAX gradients are values, never stale buffers",
  })
  if None in (lr, betas, eps, wd, bc):
    return None
  return {"type": kind, "impl": impl, "params": {"lr": lr, "betas": betas, "eps": eps, "weight_decay": wd,
                                                 "bias_correction": bc}}


def _lamb(ctx: Ctx, onebit: str | None) -> dict[str, Any] | None:
  allowed = {"lr", "bias_correction", "betas", "eps", "eps_inside_sqrt", "weight_decay", "max_coeff", "min_coeff",
             "amsgrad"} | (_ONEBIT["onebitlamb"][1] if onebit else set())
  _check_keys(ctx, allowed, onebit or "FusedLamb")
  p = {"lr": ctx.num("optimizer.params.lr", 1e-3, ge=0), "betas": _betas(ctx, "optimizer.params.betas", [0.9, 0.999]),
       "eps": ctx.num("optimizer.params.eps", 1e-8, gt=0),
       "weight_decay": ctx.num("optimizer.params.weight_decay", 0.0, ge=0),
       "bias_correction": ctx.boolean("optimizer.params.bias_correction", True),
       "max_coeff": ctx.num("optimizer.params.max_coeff", 10.0, ge=0),
       "min_coeff": ctx.num("optimizer.params.min_coeff", 0.01, ge=0),
       "eps_inside_sqrt": ctx.boolean("optimizer.params.eps_inside_sqrt", False)}
  if ctx.get("optimizer.params.amsgrad") is True:
    ctx.refuse("optimizer.params.amsgrad", "optimizer.params.amsgrad: FusedLamb raises 'FusedLamb does not support "
               "the AMSGrad variant'. Remove it.")
  if ctx.num("fp16.loss_scale", 0) not in (0, None):
    ctx.refuse("optimizer.type", "optimizer.type Lamb: DeepSpeed asserts 'DeepSpeed lamb optimizer requires dynamic "
               "loss scaling'; fp16.loss_scale must be 0.", deepspeed=True)
  ctx.warn("Lamb: DeepSpeed's FusedLamb is a CUDA kernel; `--verify` on a CPU machine checks the port against "
           "parity's transcription of fused_lamb_cuda_kernel.cu, not against DeepSpeed.")
  _mark_params(ctx, {k: "FusedLamb argument" for k in p}, {"amsgrad": "false: plain Lamb"})
  if None in p.values():
    return None
  return {"type": "lamb", "impl": onebit or "FusedLamb", "params": p}


def _sgd(ctx: Ctx) -> dict[str, Any] | None:
  _check_keys(ctx, {"lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach",
                    "differentiable", "fused"}, "torch.optim.SGD")
  p = {"lr": ctx.num("optimizer.params.lr", 1e-3, ge=0), "momentum": ctx.num("optimizer.params.momentum", 0.0, ge=0),
       "dampening": ctx.num("optimizer.params.dampening", 0.0, ge=0),
       "weight_decay": ctx.num("optimizer.params.weight_decay", 0.0, ge=0),
       "nesterov": ctx.boolean("optimizer.params.nesterov", False)}
  if p["nesterov"] and (not p["momentum"] or p["dampening"]):
    ctx.refuse("optimizer.params.nesterov", "optimizer.params.nesterov: torch.optim.SGD raises 'Nesterov momentum "
               f"requires a momentum and zero dampening'; got momentum={p['momentum']}, dampening={p['dampening']}.",
               deepspeed=True)
  if ctx.get("optimizer.params.maximize") is True:
    ctx.refuse("optimizer.params.maximize", "optimizer.params.maximize: true is not supported by the port.")
  for k in ("lr", "weight_decay"):
    if not ctx.has(f"optimizer.params.{k}"):
      ctx.implied(f"optimizer.params.{k}", p[k], "torch.optim.SGD default")
  _mark_params(ctx, {**{k: "torch.optim.SGD argument" for k in p}, "weight_decay": "torch.optim.SGD argument: L2 "
                     "decay added to the gradient"},
               {"maximize": "false: minimise", "foreach": _IMPL_DETAIL, "differentiable": _IMPL_DETAIL,
                "fused": _IMPL_DETAIL})
  if None in p.values():
    return None
  return {"type": "sgd", "impl": "torch.optim.SGD", "params": p}


def _other_keys(ctx: Ctx) -> None:
  """Marks the optimizer section's keys besides type and params, which DeepSpeed does not read."""
  for k in ctx.get("optimizer"):
    if k not in ("type", "params"):
      why = ("legacy fused fp16 optimizer switch; no effect on the math" if k == "legacy_fusion"
             else "DeepSpeed reads only optimizer.type and optimizer.params")
      ctx.mark(f"optimizer.{k}", "not_needed", None, why)


def port_optimizer(ctx: Ctx, offload: str | None, *, ignored: str | None = None) -> dict[str, Any] | None:
  """Returns the ported optimizer dict, or None after refusing. `ignored`: why the stack never lets DeepSpeed read
  the optimizer section (Megatron passes its own optimizer): its keys are marked not_needed and the client optimizer
  is ported from the flags."""
  if not ctx.has("optimizer") or ignored is not None:
    ctx.mark("optimizer", "not_needed", None, ignored or "")  # no leaf without a section: marks nothing then
    return _from_flags(ctx, "the stack passes its own optimizer" if ctx.has("optimizer") else
                       "the config has no optimizer section")
  name = ctx.get("optimizer.type")
  if not isinstance(ctx.get("optimizer"), dict):
    ctx.refuse("optimizer", f"optimizer: got {ctx.get('optimizer')!r}; expected an object with type and params.")
    return None
  if name is MISSING:
    ctx.mark("optimizer", "not_needed", None, "ignored by DeepSpeed: the optimizer section has no type")
    return _from_flags(ctx, "the optimizer section has no type")
  _other_keys(ctx)
  if not isinstance(name, str):
    ctx.refuse("optimizer.type", f"optimizer.type: got {name!r}; expected a name such as \"AdamW\".")
    return None
  if ctx.has("optimizer.params") and not isinstance(ctx.get("optimizer.params"), dict):
    ctx.refuse("optimizer.params", "optimizer.params: expected an object of keyword arguments.")
    return None
  if ctx.get("optimizer.params") == {}:
    ctx.mark("optimizer.params", "not_needed", None, "empty: every argument takes its default (see implied)")
  lname = name.lower()
  if lname in _ONEBIT:
    kind = _ONEBIT[lname][0]
    why = (f"{name} -> uncompressed {'AdamW' if kind == 'adamw' else 'Lamb'}: DeepSpeed 0.19.8 no longer ships the "
           "1-bit/0-1 optimizers (its engine rejects the type). They run the uncompressed update until freeze_step "
           "and afterwards compress gradient communication (1-bit Adam also freezes the variance); the JAX port "
           "models the uncompressed update only.")
    ctx.warn(why)
    out = _adam(ctx, "adamw", offload, name) if kind == "adamw" else _lamb(ctx, name)
    for k in _ONEBIT[lname][1]:
      ctx.mark(f"optimizer.params.{k}", "not_needed", None,
               "compression-stage / communication setting of the 1-bit optimizer; JAX all-reduces uncompressed")
    ctx.refuse("optimizer.type", f"optimizer.type {name!r}: DeepSpeed 0.19.8 asserts at deepspeed.initialize "
               f"'{name} is not a supported DeepSpeed Optimizer' (the 1-bit/0-1 optimizers were removed). Fix: "
               f"use \"type\": \"{'AdamW' if kind == 'adamw' else 'Lamb'}\", the uncompressed update it ports to.",
               deepspeed=True)
    return out
  if lname in ("adam", "adamw"):
    ctx.mark("optimizer.type", "mapped", "optimizer.type", "type Adam runs AdamW (decoupled decay) unless "
             "adam_w_mode is false; type AdamW always does (engine._configure_basic_optimizer)")
    return _adam(ctx, lname, offload, None)
  if lname == "lamb":
    ctx.mark("optimizer.type", "mapped", "optimizer.type", "DeepSpeed FusedLamb: per-tensor trust ratio "
             "||w|| / ||m/(sqrt(v)+eps) + wd*w|| clamped to [min_coeff, max_coeff]")
    return _lamb(ctx, None)
  if name == "SGD":
    ctx.mark("optimizer.type", "mapped", "optimizer.type", "torch.optim.SGD (DeepSpeed falls back to torch.optim)")
    return _sgd(ctx)
  if lname in _DS_OTHER or name in _TORCH_OPTIMS:
    ctx.refuse("optimizer.type", f"optimizer.type {name!r} is a valid DeepSpeed optimizer but the port maps only "
               "Adam, AdamW, Lamb, SGD and the 1-bit/0-1 variants. Use one of those or port by hand.")
    return None
  ctx.refuse("optimizer.type", f"optimizer.type {name!r}: DeepSpeed asserts '{name} is not a supported DeepSpeed "
             "Optimizer' (neither a DeepSpeed optimizer nor in torch.optim; names are case-sensitive there).",
             deepspeed=True)
  return None


def _sched_value(ctx: Ctx, kind: str, key: str) -> Any:
  path = f"scheduler.params.{key}"
  v = ctx.get(path)
  if v is UNRESOLVED:
    return None
  if isinstance(v, (list, tuple)):
    ctx.refuse(path, f"{path}: per-param-group lists are not supported by the port (one param group); got {v!r}. "
               "Give one number.")
    return None
  if key in ("warmup_num_steps", "lr_range_test_step_size"):
    if v is MISSING:
      return SCHEDULER_DEFAULTS[kind][key]
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
      ctx.refuse(path, f"{path}: got {v!r}; DeepSpeed {kind} raises '{key} must be a positive integer'. "
                 "Use an integer >= 1.", deepspeed=True)
      return None
    return v
  if key in ("warmup_type",):
    if v is MISSING:
      return "log"
    if v not in ("log", "linear"):
      ctx.warn(f"{path}: {v!r} is unknown; DeepSpeed warns 'Using unknown warmup_type' and uses 'log'.")
      return "log"
    return v
  if key in ("lr_range_test_staircase", "cycle_momentum"):
    return ctx.boolean(path, SCHEDULER_DEFAULTS[kind][key])
  if key in ("total_num_steps", "cycle_first_step_size", "cycle_second_step_size", "cycle_first_stair_count",
             "cycle_second_stair_count", "decay_step_size"):
    return ctx.num(path, SCHEDULER_DEFAULTS[kind][key], ge=0)
  return ctx.num(path, SCHEDULER_DEFAULTS[kind][key])


def port_scheduler(ctx: Ctx, optimizer: dict[str, Any] | None, *, ignored: str | None = None
                   ) -> dict[str, Any] | None:
  """Returns the ported scheduler dict, or None after refusing. `ignored`: why the stack never lets DeepSpeed read
  the section (its own lr scheduler wins): the section is marked not_needed and the lr kept constant."""
  if ignored is not None and ctx.has("scheduler"):
    ctx.mark("scheduler", "not_needed", None, ignored)
    return {"type": "Constant", "params": {}}
  if not ctx.has("scheduler"):
    ctx.implied("scheduler", {"type": "Constant"}, "no scheduler section: DeepSpeed keeps optimizer.params.lr "
                "(a client scheduler passed to deepspeed.initialize is not part of the config)")
    return {"type": "Constant", "params": {}}
  name = ctx.get("scheduler.type")
  if name is MISSING:
    ctx.mark("scheduler", "not_needed", None, "ignored by DeepSpeed: the scheduler section has no type")
    return {"type": "Constant", "params": {}}
  for k in ctx.get("scheduler"):
    if k not in ("type", "params"):
      ctx.mark(f"scheduler.{k}", "not_needed", None, "DeepSpeed reads only scheduler.type and scheduler.params")
  if name not in SCHEDULER_DEFAULTS or name == "Constant":
    if name in _TORCH_SCHEDULERS:
      ctx.refuse("scheduler.type", f"scheduler.type {name!r}: a torch.optim.lr_scheduler class; the port maps only "
                 "DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle and LRRangeTest.")
    else:
      ctx.refuse("scheduler.type", f"scheduler.type {name!r}: DeepSpeed asserts 'DeepSpeed does not recognize LR "
                 f"scheduler {name}'. Known: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest.",
                 deepspeed=True)
    return None
  ctx.mark("scheduler.type", "mapped", "scheduler.type", f"{name}: value at every step equals DeepSpeed's, incl. "
           "step 0 (scheduler iteration -1) and no advance on a skipped step")
  params = ctx.get("scheduler.params")
  if not isinstance(params, dict):
    ctx.refuse("scheduler", f"scheduler.params is missing or not an object; DeepSpeed calls {name}(optimizer, "
               "**params) and fails. Add \"params\": {...}.")
    return None
  defaults = SCHEDULER_DEFAULTS[name]
  if params == {}:
    ctx.mark("scheduler.params", "not_needed", None, f"empty: every {name} argument takes its default")
  for k in params:
    if k not in defaults:
      ctx.refuse(f"scheduler.params.{k}", f"scheduler.params.{k}: {name} has no such argument (TypeError in "
                 f"DeepSpeed). Known: {', '.join(defaults)}.", deepspeed=True)
  out = {k: _sched_value(ctx, name, k) for k in defaults}
  _implied_and_required(ctx, name, out, defaults, optimizer)
  for k in params:
    if k in defaults:
      ctx.mark(f"scheduler.params.{k}", "mapped", f"scheduler.params.{k}", f"{name} argument", overwrite=False)
  if None in [v for k, v in out.items() if defaults[k] is not None or k in params] or ctx.report.errors:
    return None
  return {"type": name, "params": out}


def _implied_and_required(ctx: Ctx, name: str, out: dict[str, Any], defaults: dict[str, Any],
                          optimizer: dict[str, Any] | None) -> None:
  """The scheduler values DeepSpeed fills in or clamps (recorded as implied, `out` updated), its required arguments
  (refused when absent), and the OneCycle rules (`_one_cycle`)."""
  base_lr = optimizer["params"]["lr"] if optimizer else None
  if name == "WarmupLR" and not ctx.has("scheduler.params.warmup_max_lr"):
    out["warmup_max_lr"] = base_lr
    ctx.implied("scheduler.params.warmup_max_lr", base_lr, "WarmupLR without warmup_max_lr uses the optimizer's lr")
  if name == "WarmupDecayLR" and not ctx.has("scheduler.params.warmup_max_lr"):
    ctx.implied("scheduler.params.warmup_max_lr", 0.001, "WarmupDecayLR default (not the optimizer lr)")
  for req in [k for k, v in defaults.items() if v is None and k not in ("warmup_max_lr", "cycle_second_step_size",
                                                                        "cycle_second_stair_count")]:
    if not ctx.has(f"scheduler.params.{req}"):
      ctx.refuse("scheduler.type", f"scheduler.params.{req} is required by {name} (no default; DeepSpeed fails "
                 f"with TypeError). Add it, e.g. --total-steps N with \"{req}\": \"auto\".", deepspeed=True)
  if "warmup_num_steps" in out and isinstance(out["warmup_num_steps"], int) and out["warmup_num_steps"] < 2:
    ctx.implied("scheduler.params.warmup_num_steps", 2, f"DeepSpeed clamps warmup_num_steps "
                f"{out['warmup_num_steps']} to max(2, warmup_num_steps)")
  tot, wu = out.get("total_num_steps"), out.get("warmup_num_steps")
  if isinstance(tot, int) and isinstance(wu, int) and tot < max(2, wu):
    ctx.warn(f"scheduler: total_num_steps {tot} is less than warmup_num_steps {wu} (DeepSpeed warns the same).")
  if name == "OneCycle":
    _one_cycle(ctx, out, optimizer)


def _one_cycle(ctx: Ctx, out: dict[str, Any], optimizer: dict[str, Any] | None) -> None:
  """OneCycle: a positive first step size; momentum cycling off for SGD (as DeepSpeed does), else beta2 -> 0.99."""
  if out["cycle_first_step_size"] is not None and out["cycle_first_step_size"] <= 0:
    ctx.refuse("scheduler.params.cycle_first_step_size", "scheduler.params.cycle_first_step_size must be "
               f"positive (DeepSpeed raises); got {out['cycle_first_step_size']}.")
  if out["cycle_momentum"] and optimizer and optimizer["type"] == "sgd":
    out["cycle_momentum"] = False
    ctx.warn("OneCycle: cycle_momentum is disabled because torch.optim.SGD has no betas (DeepSpeed warns and "
             "disables it the same way).")
  elif out["cycle_momentum"]:
    ctx.implied("optimizer.params.betas[1]", 0.99, "OneCycle with cycle_momentum sets every group's betas to "
                "(momentum, 0.99): beta2 becomes 0.99 whatever optimizer.params.betas says")
