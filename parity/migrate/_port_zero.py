"""zero_optimization and activation_checkpointing -> PortedConfig.jax (parity.spec.JaxPlan's fields) and the
parts of them compare cannot run yet (PortedConfig.not_runnable_by_compare)."""
from __future__ import annotations

from typing import Any

from parity.migrate._ctx import MISSING, Ctx

__all__ = ["port_zero", "port_remat"]

XLA_COMM = "communication tuning; XLA schedules the collectives of a sharded jit itself"
_NOT_NEEDED = {
    "allgather_partitions": XLA_COMM, "allgather_bucket_size": XLA_COMM, "reduce_scatter": XLA_COMM,
    "reduce_bucket_size": XLA_COMM, "overlap_comm": XLA_COMM, "contiguous_gradients": "gradient buffer layout; XLA "
    "allocates buffers", "round_robin_gradients": XLA_COMM, "use_multi_rank_bucket_allreduce": XLA_COMM,
    "stage3_prefetch_bucket_size": XLA_COMM, "stage3_max_live_parameters": "ZeRO-3 gather/release policy; XLA "
    "decides when gathered params are freed", "stage3_max_reuse_distance": "ZeRO-3 gather/release policy; XLA "
    "decides when gathered params are freed", "stage3_param_persistence_threshold": "ZeRO-3 keeps small params "
    "unpartitioned to save latency; the JAX plan shards every array, numerics unaffected",
    "stage3_model_persistence_threshold": "ZeRO-3 cap on unpartitioned params; the JAX plan shards every array",
    "sub_group_size": "optimizer-step tiling of ZeRO-3/offload; XLA fuses the update",
    "stage3_allgather_sequential": XLA_COMM, "stage3_use_all_reduce_for_fetch_params": XLA_COMM,
    "stage3_module_granularity_threshold": "ZeRO-3 hook granularity; JAX has no module hooks",
    "ignore_unused_parameters": "JAX gives unused params a zero gradient", "parameter_alignment": "flat-buffer "
    "alignment", "memory_efficient_linear": "ZeRO-3 linear autograd function; same math",
    "override_module_apply": "ZeRO-3 torch module hook", "log_trace_cache_warnings": "logging",
    "enable_sanity_checks": "debug checks", "elastic_checkpoint": "checkpoint layout", "load_from_fp32_weights":
    "checkpoint loading", "stage3_gather_16bit_weights_on_model_save": "checkpoint saving (JAX saves full arrays)",
    "stage3_gather_fp16_weights_on_model_save": "deprecated alias of stage3_gather_16bit_weights_on_model_save; "
    "checkpoint saving", "gather_16bit_weights_on_model_save": "checkpoint saving",
    "legacy_stage1": "old ZeRO-1 implementation; same math", "pipeline_loading_checkpoint": "checkpoint loading",
    "compute_grad_norm": "norm bookkeeping; clipping below decides", "save_muon_momentum_buffer_in_memory": "Muon+NVMe",
    "leaf_module": "ZeRO-3 leaf-module hint for torch hooks", "cpu_offload_use_pin_memory": "deprecated, no effect "
    "(DeepSpeed warns: use offload_param or offload_optimizer)",
}
_UNSUPPORTED_IF_TRUE = ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients")
_KNOWN = set(_NOT_NEEDED) | set(_UNSUPPORTED_IF_TRUE) | {"stage", "offload_optimizer", "offload_param", "cpu_offload",
                                                         "cpu_offload_param", "zero_hpz_partition_size", "zenflow"}
_REMOVED = {"mics_shard_size": "MiCS ZeRO-3 sharding has been removed", "mics_hierarchical_params_gather":
            "MiCS ZeRO-3 sharding has been removed", "zeropp_loco_param": "LoCo-Zero++ has been removed"}
_OFFLOAD_KEYS = {
    "offload_optimizer": ("device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write",
                          "fast_init", "ratio", "super_offload", "cpuadam_cores_perc"),
    "offload_param": ("device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"),
}
_INT_FIELDS = {"reduce_bucket_size": 1, "allgather_bucket_size": 0, "sub_group_size": 0,
               "stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 0,
               "stage3_model_persistence_threshold": 0, "stage3_max_live_parameters": 0,
               "stage3_max_reuse_distance": 0}


def _offload(ctx: Ctx, section: str, stage: int) -> tuple[str, str, float]:
  """Returns (device, memory kind, the share of it offloaded: `_ratio`, 1.0 for offload_param) of
  zero_optimization.<section>."""
  path = f"zero_optimization.{section}"
  node = ctx.get(path)
  if node is MISSING or node is None:
    return "none", "device", 1.0
  if not isinstance(node, dict):
    ctx.refuse(path, f"{path}: expected an object such as {{\"device\": \"cpu\"}}; got {node!r}.")
    return "none", "device", 1.0
  ctx.unknown_keys(path, _OFFLOAD_KEYS[section], why="pydantic extra='forbid'")
  device = ctx.choice(f"{path}.device", ("none", "cpu", "nvme"), "none")
  pin = ctx.boolean(f"{path}.pin_memory", True)
  kind = "pinned_host" if pin else "unpinned_host"
  what = "optimizer state" if section == "offload_optimizer" else "fp32 params"
  tgt = "jax.offload_opt_state" if section == "offload_optimizer" else "jax.offload_params"
  if device == "nvme":
    ctx.refuse(f"{path}.device", f"{path}.device \"nvme\": JAX has no NVMe memory kind (only device, pinned_host, "
               f"unpinned_host). Nearest plan: set {path}.device to \"cpu\" -> {what} in pinned_host.",
               fate_reason="JAX has no NVMe memory kind; nearest: device \"cpu\" -> pinned_host")
  for k in ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pipeline_read", "pipeline_write",
            "fast_init"):
    ctx.mark(f"{path}.{k}", "not_needed", None, "NVMe swap tuning; used only with device \"nvme\"", overwrite=False)
  ratio = _ratio(ctx, path, stage, device) if section == "offload_optimizer" else 1.0
  if section == "offload_optimizer":
    if ctx.get(f"{path}.super_offload") is True:
      ctx.refuse(f"{path}.super_offload", f"{path}.super_offload: Superchip-specific CPU offload is not supported.")
    ctx.mark(f"{path}.super_offload", "not_needed", None, "false: standard offload", overwrite=False)
    ctx.mark(f"{path}.cpuadam_cores_perc", "not_needed", None, "CPU Adam threading; XLA runs the update",
             overwrite=False)
  if section == "offload_param" and stage != 3 and device in ("cpu", "nvme"):
    ctx.warn(f"{path}: DeepSpeed uses offload_param only with stage 3; stage is {stage}, so it is ignored.")
    ctx.mark(path, "not_needed", None, f"ignored by DeepSpeed at stage {stage} (offload_param is stage-3 only)")
    return "none", "device", 1.0
  if device == "cpu" and ratio > 0:
    ctx.mark(f"{path}.device", "mapped", tgt, f"{what} live in host memory between steps; XLA moves them in and out")
    ctx.mark(f"{path}.pin_memory", "mapped", "jax.host_memory_kind",
             f"{'true -> pinned_host' if pin else 'false -> unpinned_host'}")
    return "cpu", kind, ratio
  if device == "cpu":  # ratio 0: DeepSpeed keeps every sub-group on the accelerator
    ctx.mark(path, "mapped", tgt, "ratio 0: DeepSpeed puts no sub-group on the CPU, so the optimizer state stays in "
             "device memory (jax.offload_opt_state false)", overwrite=False)
    return "none", "device", 1.0
  if device == "nvme":
    ctx.mark(path, "not_needed", None, "part of the refused NVMe offload", overwrite=False)
    return "nvme", "device", 1.0
  ctx.mark(path, "not_needed", None, "device none: no offload", overwrite=False)
  return device or "none", "device", 1.0


def _ratio(ctx: Ctx, path: str, stage: int, device: str | None) -> float:
  """offload_optimizer.ratio (DeepSpeed's ZeRO-Offload++ partial offload, in [0, 1]) -> jax.offload_opt_ratio.

  DeepSpeed reads it at ZeRO stage 3 only (runtime/zero/config.py asserts 'Partial offloading only supported for ZeRO
  Stage 3.' whenever the section sets a ratio below 1) and puts the last `ratio` share of its sub-groups, in parameter
  order, on the CPU (stage3.py); the JAX plan offloads the moments of the last param leaves until they hold that share
  (parity.sizing.memory_jax.opt_split). Returns the ratio (1.0 when absent, refused, or not read by DeepSpeed)."""
  key = f"{path}.ratio"
  ratio = ctx.num(key, 1.0, ge=0, le=1)
  if ratio is None or ratio == 1:
    ctx.mark(key, "mapped", "jax.offload_opt_ratio", "1.0: all optimizer state offloaded", overwrite=False)
    return 1.0
  if stage != 3:
    ctx.refuse(key, f"{key} {ratio}: DeepSpeed offloads part of the optimizer state at ZeRO stage 3 only (its config "
               f"asserts 'Partial offloading only supported for ZeRO Stage 3.'); stage is {stage}. Set "
               "zero_optimization.stage to 3, or remove ratio (1.0: all of the optimizer state offloaded).",
               deepspeed=True)
    return 1.0
  if device != "cpu":
    ctx.mark(key, "not_needed", None, f"{ratio}: DeepSpeed reads ratio only with device cpu; device is {device}")
    return 1.0
  if ratio > 0:
    ctx.mark(key, "mapped", "jax.offload_opt_ratio", f"{ratio}: the moments of the last param leaves (parameter "
             f"order, as DeepSpeed's last sub-groups) in host memory until they hold {ratio:.0%} of the moment bytes, "
             "the rest on the device; the same numbers as offloading all of it")
    _warn_sub_groups(ctx, key, ratio)
  return float(ratio)


def _warn_sub_groups(ctx: Ctx, key: str, ratio: float) -> None:
  """DeepSpeed's share is of sub-groups, not of bytes (stage3.py `_create_fp16_sub_groups`: each param group cut
  into runs of sub_group_size elements; sub-group i on the CPU when i >= int((1 - ratio) * n)): said, with the size."""
  size = ctx.get("zero_optimization.sub_group_size")
  given = isinstance(size, int) and not isinstance(size, bool) and size > 0
  size = size if given else 10**9
  ctx.warn(f"{key} {ratio}: DeepSpeed offloads whole sub-groups, each param group cut into runs of "
           f"zero_optimization.sub_group_size = {size:,} elements{'' if given else ' (its default)'}, the last "
           f"n - int({1 - ratio:g} * n) of the n sub-groups on the CPU: a param group under {size:,} parameters is "
           "one sub-group, so with one param group DeepSpeed keeps all of its optimizer state on the CPU at any "
           f"ratio above 0. The JAX plan offloads per param leaf (at least {ratio:.0%} of the moment bytes): the "
           "numbers are the same, the two sides' host shares may not be. Lower sub_group_size to split DeepSpeed's "
           "finer.")


def port_zero(ctx: Ctx) -> tuple[dict[str, Any], dict[str, Any]] | None:
  """zero_optimization -> (the ZeRO fields of PortedConfig.jax: zero_stage, offload_opt_state, offload_params,
  host_memory_kind; the not_runnable_by_compare entries they need), marking every key in ctx.report; refusals
  (removed, quantized or unmappable features) are recorded on ctx. Returns None when the section is neither an
  object nor a boolean."""
  z = ctx.get("zero_optimization")
  if z is MISSING:
    ctx.implied("zero_optimization.stage", 0, "no zero_optimization section: stage 0 (plain data parallel)")
    z = {}
  if isinstance(z, bool):
    return _boolean_form(ctx, z)
  if not isinstance(z, dict):
    ctx.refuse("zero_optimization", f"zero_optimization: got {z!r}; expected an object or a boolean.")
    return None
  for k, msg in _REMOVED.items():
    if k in z:
      ctx.refuse(f"zero_optimization.{k}", f"zero_optimization.{k}: DeepSpeed 0.19.8 raises '{msg}'. Remove it.",
                 deepspeed=True)
  ctx.unknown_keys("zero_optimization", sorted(_KNOWN | set(_REMOVED)), why="DeepSpeedZeroConfig has extra='forbid'")
  stage = ctx.num("zero_optimization.stage", 0, integer=True, ge=0, le=3)
  stage = 0 if stage is None else stage
  ctx.mark("zero_optimization.stage", "mapped", "jax.zero_stage",
           ["stage 0: params, grads, opt state replicated over the data axis",
            "stage 1: optimizer state sharded over the data axis",
            "stage 2: optimizer state + gradients sharded over the data axis (reduce-scatter)",
            "stage 3: optimizer state, gradients and params sharded over the data axis (FSDP)"][stage])
  for k, lo in _INT_FIELDS.items():
    ctx.num(f"zero_optimization.{k}", 0, integer=True, ge=lo)
  _deprecated_offload_flags(ctx)
  opt_dev, opt_kind, ratio = _offload(ctx, "offload_optimizer", stage)
  _, par_kind, _ = _offload(ctx, "offload_param", stage)
  if opt_dev == "cpu" and stage == 0:
    ctx.refuse("zero_optimization.offload_optimizer.device", "zero_optimization.offload_optimizer needs stage >= 1 "
               "(ZeRO-Offload partitions the optimizer state it moves to the host); got stage 0. Set stage to 1 or 2.")
  _communication_features(ctx)
  return _plan(stage, opt_kind, par_kind, ratio)


def _boolean_form(ctx: Ctx, z: bool) -> tuple[dict[str, Any], dict[str, Any]]:
  """`zero_optimization: true|false`, DeepSpeed's deprecated form of stage 1|0: mapped with a warning."""
  ctx.warn("zero_optimization: a boolean is the deprecated format; DeepSpeed warns 'this format of ZeRO "
           f"optimization setup is deprecated' and reads it as stage {int(z)}.")
  ctx.mark("zero_optimization", "mapped", "jax.zero_stage", f"deprecated boolean form -> stage {int(z)}")
  ctx.report.entries["zero_optimization"].resolved = {"stage": int(z)}
  if ctx.has("allgather_size"):
    ctx.mark("allgather_size", "not_needed", None, f"legacy allgather_bucket_size of the boolean form; {XLA_COMM}")
  return _plan(int(z), "device", "device")


def _deprecated_offload_flags(ctx: Ctx) -> None:
  """zero_optimization.cpu_offload / cpu_offload_param (deprecated booleans): rewritten in ctx.cfg to the
  offload_optimizer / offload_param sections DeepSpeed reads them as, or marked not needed when false."""
  if ctx.get("zero_optimization.cpu_offload") is True:
    if ctx.has("zero_optimization.offload_optimizer"):
      ctx.refuse("zero_optimization.cpu_offload", "zero_optimization.cpu_offload with offload_optimizer: DeepSpeed "
                 "asserts 'Cannot provide deprecated parameter and replacing parameter together'. Keep one.",
                 deepspeed=True)
    ctx.warn("zero_optimization.cpu_offload is deprecated; DeepSpeed warns 'use offload_optimizer instead' and reads "
             "it as offload_optimizer.device=cpu (pinned).")
    ctx.cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    ctx.mark("zero_optimization.cpu_offload", "mapped", "jax.offload_opt_state",
             "deprecated form of offload_optimizer {device: cpu} -> pinned_host")
    ctx.report.entries["zero_optimization.cpu_offload"].resolved = {"offload_optimizer": {"device": "cpu"}}
  elif ctx.has("zero_optimization.cpu_offload"):
    ctx.boolean("zero_optimization.cpu_offload")
    ctx.mark("zero_optimization.cpu_offload", "not_needed", None, "deprecated; false means no optimizer offload")
  if ctx.get("zero_optimization.cpu_offload_param") is True:
    ctx.warn("zero_optimization.cpu_offload_param is deprecated; DeepSpeed reads it as offload_param.device=cpu.")
    ctx.cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    ctx.mark("zero_optimization.cpu_offload_param", "mapped", "jax.offload_params",
             "deprecated form of offload_param {device: cpu} -> pinned_host")
  elif ctx.has("zero_optimization.cpu_offload_param"):
    ctx.mark("zero_optimization.cpu_offload_param", "not_needed", None, "deprecated; false means no param offload")
  if ctx.has("zero_optimization.stage3_gather_fp16_weights_on_model_save"):
    ctx.warn("zero_optimization.stage3_gather_fp16_weights_on_model_save is deprecated; DeepSpeed warns 'use "
             "gather_16bit_weights_on_model_save instead'.")


def _communication_features(ctx: Ctx) -> None:
  """Refuses the ZeRO++ quantized communication, hpZ partitioning and ZenFlow (the JAX plan has one data axis and
  full-precision collectives); marks the remaining tuning keys not needed."""
  for k in _UNSUPPORTED_IF_TRUE:
    if ctx.get(f"zero_optimization.{k}") is True:
      ctx.refuse(f"zero_optimization.{k}", f"zero_optimization.{k}: quantized ZeRO++ communication changes the "
                 "numerics; the JAX plan all-reduces in full precision. Set it to false.")
    ctx.mark(f"zero_optimization.{k}", "not_needed", None, "false: full-precision communication", overwrite=False)
  hpz = ctx.num("zero_optimization.zero_hpz_partition_size", 1, integer=True, ge=0)
  if hpz not in (0, 1, None):
    ctx.refuse("zero_optimization.zero_hpz_partition_size", f"zero_optimization.zero_hpz_partition_size {hpz}: "
               "hierarchical (ZeRO++ hpZ) partitioning needs a 2-D mesh; the JAX plan has one data axis. Set it to 1.")
  ctx.mark("zero_optimization.zero_hpz_partition_size", "not_needed", None, "1: flat partitioning", overwrite=False)
  if ctx.has("zero_optimization.zenflow"):
    ctx.refuse("zero_optimization.zenflow", "zero_optimization.zenflow: ZenFlow's stale-gradient updates are not "
               "supported by the port. Remove the section.")
  for k, why in _NOT_NEEDED.items():
    ctx.mark(f"zero_optimization.{k}", "not_needed", None, why, overwrite=False)


def _plan(stage: int, opt_kind: str, par_kind: str, ratio: float = 1.0) -> tuple[dict[str, Any], dict[str, Any]]:
  """(JaxPlan's ZeRO fields, not_runnable_by_compare entries) of a stage, the two offloads' memory kinds
  ('device', 'pinned_host' or 'unpinned_host'; params offload is stage-3 only) and the share of the optimizer state
  offloaded. One JaxPlan host memory kind holds both offloads: the optimizer's when both are offloaded, the params'
  kind then kept as not runnable when it differs."""
  par_kind = par_kind if stage == 3 else "device"
  host = [k for k in (opt_kind, par_kind) if k != "device"]
  jax = {"zero_stage": stage, "offload_opt_state": opt_kind != "device", "offload_params": par_kind != "device",
         "host_memory_kind": host[0] if host else "pinned_host",
         "offload_opt_ratio": ratio if opt_kind != "device" else 1.0}
  not_runnable = {}
  if len(set(host)) == 2:
    not_runnable["params_host_memory_kind"] = {
        "value": par_kind, "why": f"offload_param is {par_kind} but offload_optimizer {opt_kind}: a JaxPlan keeps "
                                  "all offloaded state in one host memory kind (jax.host_memory_kind)"}
  return jax, not_runnable


def port_remat(ctx: Ctx) -> tuple[str, dict[str, Any]]:
  """activation_checkpointing -> (PortedConfig.jax.remat: 'none', 'full' or 'offload_names' for cpu_checkpointing,
  no not_runnable_by_compare entry: compare's DeepSpeed side runs cpu_checkpointing too, deepspeed.cpu_checkpointing).
  """
  if not ctx.has("activation_checkpointing"):
    return "none", {}
  sec = "activation_checkpointing"
  node = ctx.get(sec)
  if not isinstance(node, dict):
    ctx.refuse(sec, f"{sec}: expected an object; got {node!r}.")
    return "none", {}
  cpu = ctx.boolean(f"{sec}.cpu_checkpointing", False)
  policy = "offload_names" if cpu else "full"
  reason = ("the section configures deepspeed.checkpointing, which the model calls once per block -> "
            f"jax.checkpoint per block, policy {policy!r}")
  ctx.mark(f"{sec}.cpu_checkpointing", "mapped", "jax.remat", "true: checkpointed residuals in pinned_host "
           "(save_and_offload_only_these_names)" if cpu else "false: residuals stay on device")
  ctx.mark(f"{sec}.partition_activations", "not_needed", None, "splits checkpoints across model-parallel ranks; the "
           "JAX plan has no model-parallel axis, and with one model-parallel rank DeepSpeed keeps each whole "
           "(parity compare's DeepSpeed side configures it off, or on under cpu_checkpointing, the path that copies "
           "the checkpoints to the host: torch_impl.engine._enable_checkpointing)")
  ctx.mark(f"{sec}.contiguous_memory_optimization", "not_needed", None, "checkpoint buffer layout; XLA allocates")
  ctx.mark(f"{sec}.number_checkpoints", "not_needed", None, "buffer count for contiguous_memory_optimization")
  ctx.mark(f"{sec}.synchronize_checkpoint_boundary", "not_needed", None, "CUDA synchronisation for profiling")
  ctx.mark(f"{sec}.profile", "not_needed", None, "timing of checkpointed forwards")
  for k in node:
    if k not in ("cpu_checkpointing", "partition_activations", "contiguous_memory_optimization", "number_checkpoints",
                 "synchronize_checkpoint_boundary", "profile"):
      ctx.mark(f"{sec}.{k}", "not_needed", None, "not read by DeepSpeed's activation-checkpointing config")
      ctx.warn(f"{sec}.{k}: unknown key; DeepSpeed does not read it.")
  ctx.implied("jax.remat", policy, reason)
  return policy, {}
