"""What the installed DeepSpeed (0.19.8) refuses of a config: the checks the port does not meet elsewhere.

`port_config` refuses a config DeepSpeed itself would refuse, naming the key, DeepSpeed's own message and the fix,
and records it in `Report.deepspeed_refusals` (those that the key-by-key port finds are marked there with
`Ctx.refuse(..., deepspeed=True)`). The checks DeepSpeed makes that a config can trip, and where they live:

  config parse (runtime/config.py DeepSpeedConfig):
    removed top-level sections (_REMOVED_TOP_LEVEL_CONFIG_KEYS)        -> _port._misc
    pydantic extra='forbid' in zero_optimization, offload_*, fp16, bf16 -> Ctx.unknown_keys
    batch: one of train_batch_size / micro given, > 0, tb == mb*gas*world (_batch_assertion) -> _port._batch
    fp16 and bf16 both enabled                                         -> _port._precision
    ZeRO stage <= 3; deprecated cpu_offload with offload_optimizer      -> _port_zero
  deepspeed.initialize (runtime/engine.py):
    _do_sanity_check: optimizer.type neither a DeepSpeed optimizer nor in torch.optim (incl. the removed 1-bit
      optimizers); Lamb without dynamic loss scaling                   -> _port_optim
    _configure_basic_optimizer: optimizer.params.max_grad_norm; a param the optimizer class does not take
      (TypeError); scheduler type / params (lr_schedules)               -> _port_optim
    _configure_optimizer: a client torch optimizer (no optimizer section, and a stack that passes one) under
      offload_optimizer cpu/nvme unless zero_force_ds_cpu_optimizer is false (ZeRORuntimeException) -> here,
      MSG_CLIENT_OFFLOAD
    _do_optimizer_sanity_check: ZeRO (stage >= 1) with an optimizer outside ZERO_SUPPORTED_OPTIMIZERS unless
      zero_allow_untested_optimizer is true                             -> here, MSG_UNTESTED
    AutoTP: tensor_parallel.autotp_size > 1 needs a world size that is a multiple of it (device mesh) -> here
  Device-dependent refusals ("Type fp16 is not supported on your device", CUDA-only FusedLamb) are not config
  properties: `parity compare` lifts the CPU fp16 one (torch_impl.engine.allow_fp16_on_cpu).

A config without an optimizer section runs with the client optimizer its training stack hands DeepSpeed
(parity.migrate._stack: the script's torch.optim.AdamW under a bare deepspeed.initialize, DeepSpeedCPUAdam under offload
where Accelerate or Megatron passes one; torch_impl.engine.client_optimizer). tests/test_port_acceptance.py asks the
installed DeepSpeed, with that client, about every real-world config and a set of edge configs and checks this module
agrees.
"""
from __future__ import annotations


from parity.migrate._ctx import MISSING, Ctx
from parity.migrate._stack import StackModel

__all__ = ["check_deepspeed_accepts", "MSG_CLIENT_OFFLOAD", "MSG_UNTESTED"]

MSG_CLIENT_OFFLOAD = ("You are using ZeRO-Offload with a client provided optimizer (...) which in most cases will "
                      "yield poor performance. Please either use deepspeed.ops.adam.DeepSpeedCPUAdam or set an "
                      "optimizer in your ds-config ... you can also set <\"zero_force_ds_cpu_optimizer\": false>")
"""DeepSpeed 0.19.8 engine._configure_optimizer, ZeRORuntimeException (abridged)."""
MSG_UNTESTED = ("You are using an untested ZeRO Optimizer. Please add <\"zero_allow_untested_optimizer\": true> in the "
                "configuration file to use it.")
"""DeepSpeed 0.19.8 engine._do_optimizer_sanity_check, AssertionError."""
ZERO_SUPPORTED = {"adam", "adamw", "adagrad", "lion"}
"""optimizer.type values (lower case) whose class DeepSpeed builds is in zero/utils.py ZERO_SUPPORTED_OPTIMIZERS
(torch Adam/AdamW/Adagrad, FusedAdam, DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, FusedLion, DeepSpeedCPULion); the
client torch.optim.AdamW is too. Lamb (FusedLamb), the Mu* optimizers and other torch.optim classes are not."""


def check_deepspeed_accepts(ctx: Ctx, model: StackModel) -> None:
  """Refuses (deepspeed=True) what deepspeed.initialize would refuse, under the training stack `model`, and the
  key-by-key port does not see.

  Args:
    ctx: the port in progress; reads ctx.cfg ("auto" resolved, deprecated offload forms rewritten).
    model: the stack's model (parity.migrate._stack): whether it hands DeepSpeed a client optimizer, and which.
  """
  zero = ctx.get("zero_optimization")
  zero = zero if isinstance(zero, dict) else ({"stage": int(zero)} if isinstance(zero, bool) else {})
  off = zero.get("offload_optimizer")
  off_dev = off.get("device") if isinstance(off, dict) else None
  stage = zero.get("stage", 0)
  stage = stage if isinstance(stage, int) and not isinstance(stage, bool) else 0
  if model.refusal and off_dev in ("cpu", "nvme"):
    written = [k for k in ("zero_force_ds_cpu_optimizer", "zero_optimization.offload_optimizer.device",
                           "zero_optimization.cpu_offload") if k in ctx.leaves]  # the key as the user wrote it
    key = written[0] if written else "zero_optimization.offload_optimizer"
    ctx.refuse(key, f"{key}: offload_optimizer.device {off_dev!r} with a client optimizer (the config has no "
               f"optimizer section) and zero_force_ds_cpu_optimizer not false: DeepSpeed 0.19.8 raises "
               f"ZeRORuntimeException at deepspeed.initialize: '{MSG_CLIENT_OFFLOAD}'. Fix: add an optimizer section "
               "(e.g. {\"type\": \"AdamW\", \"params\": {...}}: DeepSpeedCPUAdam runs it), or set "
               "\"zero_force_ds_cpu_optimizer\": false to keep the client torch.optim.AdamW. Why it is a client "
               f"torch.optim.AdamW: {model.refusal}.", deepspeed=True)
  name = ctx.get("optimizer.type")
  if stage >= 1 and isinstance(name, str) and name.lower() not in ZERO_SUPPORTED and not model.client and \
      ctx.get("zero_allow_untested_optimizer") is not True and not ctx.report.deepspeed_refusals:
    ctx.refuse("optimizer.type", f"optimizer.type {name!r} under ZeRO stage {stage}: its class is not one DeepSpeed "
               f"tested with ZeRO, and DeepSpeed 0.19.8 asserts at deepspeed.initialize: '{MSG_UNTESTED}'. Fix: set "
               "\"zero_allow_untested_optimizer\": true, or use Adam/AdamW.", deepspeed=True)
  tp = ctx.get("tensor_parallel.autotp_size")
  world = ctx.flags.world_size or 1
  if isinstance(tp, int) and not isinstance(tp, bool) and tp > 1 and world % tp:
    ctx.refuse("tensor_parallel.autotp_size", f"tensor_parallel.autotp_size {tp} with {world} rank(s) "
               f"(--world-size, default 1): deepspeed.initialize builds a (data, tensor) device mesh of the world and "
               f"fails (torch device_mesh AssertionError) unless the world size is a multiple of autotp_size. Fix: "
               f"run on a multiple of {tp} ranks (--world-size) or set autotp_size to 1.", deepspeed=True)
  if ctx.get("zero_force_ds_cpu_optimizer") not in (MISSING, True, False):
    ctx.refuse("zero_force_ds_cpu_optimizer", "zero_force_ds_cpu_optimizer: got "
                                              f"{ctx.get('zero_force_ds_cpu_optimizer')!r}; "
               "DeepSpeed's config reads a boolean (pydantic). Use true or false.", deepspeed=True)
