"""The DeepSpeed side: engine and one training step (environment: torch_impl.distributed; config from the spec:
torch_impl.ds_config; both re-exported here).

The engine is built from a `parity.spec.RunSpec` (or a user's resolved DeepSpeed config, checked against the spec):
`ds_config` maps the spec to a DeepSpeed config dict (AdamW, the LR scheduler of `parity.numerics.schedule`,
gradient clipping, ZeRO stage and offload, bf16), the param groups come from `parity.weights.decays` under
train.decay_mask (the training stack's; a config without an optimizer section gets the stack's client optimizer,
torch_impl.stack), and `build_engine` checks that DeepSpeed really built the optimizer the plan asks for
(DeepSpeedCPUAdam in AdamW mode under `offload_optimizer: cpu`) and decays exactly the tensors the mask names.

DeepSpeed semantics this module relies on (deepspeed 0.19.8):
  * `engine.backward(loss)` divides the loss by gradient_accumulation_steps
    before backpropagating (`scale_wrt_gas=True`), so gradients are the mean
    over micro batches; the caller passes the unscaled per-micro-batch loss.
  * `engine.step()` is called after every micro batch; it updates only at the
    accumulation boundary, then steps the LR scheduler. The scheduler starts at
    iteration -1, so optimizer step k applies `parity.numerics.schedule.train_lr(train, k)`.
  * ZeRO-1/2 clip with g / max(1, (||g|| + 1e-6) / clip) and expose the
    pre-clip norm through `engine.get_global_grad_norm()`.
  * fp16 (`fp16.enabled`, train.precision='fp16'): the module is cast to half, the ZeRO
    optimizer keeps fp32 masters and a `DynamicLossScaler` (parity.numerics.loss_scale is its reference).
    On overflow the ZeRO optimizer skips the update, sets its `_global_grad_norm` to inf, and the
    engine counts `skipped_steps` and does not step the LR scheduler (`_take_model_step`).
    ZeRO stage 0 is refused for fp16: DeepSpeed then uses `FP16_Optimizer`, whose scale rule
    ignores hysteresis (parity.numerics.loss_scale module docstring).
  * fp16 on a CPU without AVX512-FP16: DeepSpeed's CPU accelerator reports fp16 unsupported
    (`is_fp16_supported` asks `torch.ops.mkldnn._is_mkldnn_fp16_supported()`, False on this
    machine) and `DeepSpeedEngine._do_sanity_check` raises "Type fp16 is not supported on your
    device". torch's CPU kernels compute float16 correctly all the same (slowly, through float32
    arithmetic), so `build_engine` overrides that answer (`allow_fp16_on_cpu`); measured on
    gpt2-tiny, the engine's fp16 losses equal the plain-torch fp16 side's bit for bit.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from parity.numerics import schedule
from parity.spec import RunSpec
from parity.weights import param_shapes
from torch_impl import memory
from torch_impl.transfers import TransferProbe
from torch_impl.distributed import setup_distributed
from torch_impl.ds_config import MSG_FP16_STAGE0, ds_config, has_optimizer_section, per_rank_config
from torch_impl.model import build_model, micro_loss
from torch_impl.semantics import decay_groups_of
from torch_impl.stack import client_class, client_optimizer, decay_problems
from parity.protocol.ranks import rank_env

__all__ = ["allow_fp16_on_cpu", "build_engine", "torch_step", "eval_loss", "final_fp32_params", "optimizer_classes",
           "optimizer_hyperparams", "engine_state_bytes", "DeepSpeedTrainer"]


def allow_fp16_on_cpu(config: dict[str, Any]) -> bool:
  """Lets DeepSpeed's CPU accelerator accept fp16 when torch's CPU kernels can run it. Returns True when patched.

  DeepSpeed's `CPU_Accelerator.is_fp16_supported` answers with
  `torch.ops.mkldnn._is_mkldnn_fp16_supported()` (AVX512-FP16 / AMX-FP16 hardware); without it the
  engine refuses fp16 ("Type fp16 is not supported on your device", `DeepSpeedEngine._do_sanity_check`).
  The answer is overridden on the accelerator object only when the config enables fp16, the
  accelerator is the CPU one, and torch multiplies float16 matrices here (checked on a small
  product). The override stays for the process: DeepSpeed asks `supported_dtypes()` again when it
  all-reduces gradients (`engine.split_half_float_double_sparse`).
  """
  if not (config.get("fp16") or {}).get("enabled"):
    return False
  from deepspeed.accelerator import get_accelerator  # deepspeed: after setup_distributed set DS_ACCELERATOR
  acc = get_accelerator()
  if acc.device_name() != "cpu" or acc.is_fp16_supported():
    return False
  a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float16)
  if not torch.equal((a @ a).float(), torch.tensor([[7.0, 10.0], [15.0, 22.0]])):
    return False
  acc.is_fp16_supported = lambda: True
  return True


def _basic_optimizer(engine) -> torch.optim.Optimizer:
  """The optimizer that owns the moments (inside a ZeRO / BF16 wrapper when there is one)."""
  opt = engine.optimizer
  return getattr(opt, "optimizer", opt)


def _cpu_checkpointing(engine) -> bool:
  """Whether the blocks' checkpoints go to host memory: read from deepspeed.checkpointing's own configuration (the
  module globals `configure` set), not from the config; False without activation checkpointing."""
  if getattr(engine.module, "checkpoint", None) is None:
    return False
  from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt  # deepspeed: already imported
  return bool(ds_ckpt.CPU_CHECKPOINT and ds_ckpt.PARTITION_ACTIVATIONS)


def optimizer_classes(engine) -> dict[str, Any]:
  """Class names and ZeRO settings of what DeepSpeed built, for the summary and for checks."""
  basic = _basic_optimizer(engine)
  params = list(engine.module.parameters())
  return {
      "engine": type(engine).__name__,
      "wrapper": type(engine.optimizer).__name__,
      "optimizer": type(basic).__name__,
      "adamw_mode": getattr(basic, "adam_w_mode", None),
      "scheduler": type(engine.lr_scheduler).__name__ if engine.lr_scheduler is not None else None,
      "zero_stage": engine.zero_optimization_stage(),
      "cpu_offload": bool(engine.zero_cpu_offload()),
      "offload_param": engine.zero_offload_param() is not None,
      "partitioned_params": bool(params) and all(hasattr(p, "ds_tensor") for p in params),
      "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
      "activation_checkpointing": getattr(engine.module, "checkpoint", None) is not None,
      "cpu_checkpointing": _cpu_checkpointing(engine),
      "group_weight_decay": [g["weight_decay"] for g in basic.param_groups],
  }


HYPERPARAMS = ("betas", "eps", "weight_decay", "momentum", "dampening", "nesterov", "max_coeff", "min_coeff",
               "eps_inside_sqrt", "adam_w_mode")
"""Optimizer settings `optimizer_hyperparams` reads back from the param groups (the lr is per step: steps.jsonl)."""


def optimizer_hyperparams(engine) -> list[dict[str, Any]]:
  """The settings DeepSpeed's optimizer runs with, read from its param groups (one dict per group, the HYPERPARAMS it
  has; betas as a list): what a `--perturb deepspeed:train.beta2=...` must show up in (the report reads it back)."""
  basic = _basic_optimizer(engine)
  out = []
  for g in basic.param_groups:
    row = {k: (list(g[k]) if isinstance(g[k], tuple) else g[k]) for k in HYPERPARAMS if k in g}
    if "adam_w_mode" not in row and hasattr(basic, "adam_w_mode"):
      row["adam_w_mode"] = bool(basic.adam_w_mode)
    out.append({k: (float(v) if hasattr(v, "item") else v) for k, v in row.items()})
  return out


ZERO_WRAPPERS = {0: None, 1: "DeepSpeedZeroOptimizer", 2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}
"""Optimizer wrapper class DeepSpeed builds per ZeRO stage (fp32; stage 0 has none unless bf16 is on)."""


_OFFLOADED = {"adamw": "DeepSpeedCPUAdam", "adam": "DeepSpeedCPUAdam", "lamb": "FusedLamb", "sgd": "SGD"}
"""Optimizer class DeepSpeed runs under offload_optimizer: cpu, per train.optimizer."""


def _zero_problems(info: dict[str, Any], run: RunSpec, client: str | None = None) -> list[str]:
  """Differences between the ZeRO stage / offload / checkpointing DeepSpeed built and the plan. `client`: the class
  name of the client optimizer the config runs with (`client_class`), None when it has an optimizer section."""
  plan, problems = run.deepspeed, []
  if info["zero_stage"] != plan.zero_stage:
    problems.append(f"zero stage {info['zero_stage']} != planned {plan.zero_stage}")
  wrapper = ZERO_WRAPPERS[plan.zero_stage]
  if wrapper is not None and info["wrapper"] != wrapper:
    problems.append(f"stage {plan.zero_stage} should wrap the optimizer in {wrapper}; got {info['wrapper']}")
  if client and info["optimizer"] != client:
    problems.append(f"the config has no optimizer section, so the client {client} should run; got "
                    f"{info['optimizer']}")
  elif plan.offload_optimizer == "cpu" and not client and (info["optimizer"] != _OFFLOADED[run.train.optimizer]
                                                           or not info["cpu_offload"]):
    problems.append(f"offload_optimizer=cpu but the optimizer is {info['optimizer']} "
                    f"(cpu_offload={info['cpu_offload']})")
  if plan.offload_optimizer == "none" and (info["optimizer"] == "DeepSpeedCPUAdam" or info["cpu_offload"]):
    problems.append(f"offload_optimizer=none but the optimizer is {info['optimizer']} "
                    f"(cpu_offload={info['cpu_offload']})")
  if info["offload_param"] != (plan.offload_param == "cpu"):
    problems.append(f"offload_param built {info['offload_param']}, planned {plan.offload_param}")
  if info["partitioned_params"] != (plan.zero_stage == 3):
    problems.append(f"params partitioned (ds_tensor) = {info['partitioned_params']} under stage {plan.zero_stage}")
  if info["gradient_accumulation_steps"] != run.train.grad_accum_steps:
    problems.append(f"gradient_accumulation_steps {info['gradient_accumulation_steps']} != "
                    f"train.grad_accum_steps {run.train.grad_accum_steps}")
  if info["activation_checkpointing"] != plan.activation_checkpointing:
    problems.append(f"activation checkpointing is {info['activation_checkpointing']}, "
                    f"planned {plan.activation_checkpointing}")
  if info["cpu_checkpointing"] != plan.cpu_checkpointing:
    problems.append(f"CPU checkpointing (checkpoints in host memory) is {info['cpu_checkpointing']}, "
                    f"planned {plan.cpu_checkpointing}")
  return problems


def _check_engine(engine, run: RunSpec, client: str | None = None, plants: frozenset = frozenset()) -> None:
  """Raises RuntimeError when DeepSpeed did not build the optimizer, ZeRO stage, offload or decay set the plan asks
  for."""
  info = optimizer_classes(engine)
  problems = _zero_problems(info, run, client)
  if info["adamw_mode"] is not None and info["adamw_mode"] != (run.train.optimizer == "adamw"):
    problems.append(f"the Adam optimizer runs with adam_w_mode={info['adamw_mode']}; train.optimizer is "
                    f"{run.train.optimizer!r} ('adam' is L2, 'adamw' decoupled)")
  planned = schedule.deepspeed_scheduler(run.train)
  if info["scheduler"] != (planned["type"] if planned else None):
    problems.append(f"scheduler is {info['scheduler']}, expected {planned['type'] if planned else None}")
  problems += decay_problems(engine, run, plants)
  if problems:
    raise RuntimeError("DeepSpeed built a different training setup than planned: " + "; ".join(problems))


def _enable_checkpointing(model, config: dict[str, Any]) -> None:
  """Makes every block of `model` run under `deepspeed.checkpointing.checkpoint` (recomputed in backward).

  deepspeed.checkpointing is configured from the config's activation_checkpointing section. Its reentrant
  `checkpoint` is used: `non_reentrant_checkpoint` fails under ZeRO-3 (the recompute sees the released,
  size-0 params: "The size of tensor a (0) must match ...", deepspeed 0.19.8).
  Each block is called with tensors only (`_tensor_args`): DeepSpeed's partitioned path saves a (value, size) pair
  per argument and hands a non-tensor's size (None) back to the recompute as one more argument ("Block.forward()
  takes 4 positional arguments but 5 were given", deepspeed 0.19.8, any block called with its mask).
  partition_activations: as the config says, except that cpu_checkpointing turns it on. DeepSpeed's other CPU path
  `.to('cpu')`s each input and then empties the argument: on the CPU accelerator that copy is the argument itself,
  so the saved input is lost ("tensor has no dimensions" in the next block). The partitioned path clones, and with
  one model-parallel rank (mpu None) the partition is the whole tensor: the same numbers, the input in host memory.
  contiguous_memory_optimization without number_checkpoints: num_checkpoints = the blocks, as Megatron passes
  --num-layers (DeepSpeed asserts 'Must specify the number of layers with contiguous memory checkpointing').
  """
  import deepspeed  # deepspeed: after setup_distributed set DS_ACCELERATOR
  section = config.get("activation_checkpointing") or {}
  cpu = bool(section.get("cpu_checkpointing", False))
  layers = len(model.h) if section.get("contiguous_memory_optimization") and \
      section.get("number_checkpoints") is None else None
  deepspeed.checkpointing.configure(None, deepspeed_config=config, num_checkpoints=layers,
                                    partition_activations=bool(section.get("partition_activations", False)) or cpu)
  model.checkpoint = _tensor_args(deepspeed.checkpointing.checkpoint)


def _tensor_args(checkpoint):
  """`GPT.checkpoint(block, x, rope[, mask])` over a checkpoint function that takes tensors only: the rotary tables
  and the mask go in as tensors marked `no_checkpointing` (shared by every layer and not activations: DeepSpeed
  leaves them whole and in place) and the block is called with the same arguments as without checkpointing."""
  def run(block, x, rope, mask=None):
    shared = ([] if rope is None else list(rope)) + ([] if mask is None else [mask])
    for t in shared:
      t.no_checkpointing = True
    n_rope = 0 if rope is None else len(rope)

    def call(x, *rest):
      r = None if rope is None else tuple(rest[:n_rope])
      return block(x, r) if mask is None else block(x, r, rest[n_rope])
    return checkpoint(call, x, *shared)
  return run


def build_engine(run: RunSpec, params: dict[str, np.ndarray], config: dict[str, Any] | None = None,
                 plants: frozenset = frozenset()):
  """Builds the DeepSpeed engine for a run, starting from canonical weights.

  Args:
    run: the resolved run spec.
    params: canonical float32 initial weights.
    config: a user's DeepSpeed config to run verbatim (`parity compare --deepspeed-config`, "auto"
      already resolved); default `ds_config(run)`. Either way the engine is checked against `run`.
    plants: this side's planted bugs (torch_impl.semantics.decay_groups_of: 'decay_biases').
  Returns:
    The `deepspeed.DeepSpeedEngine` (the module is on the engine's device).
  Raises:
    RuntimeError: DeepSpeed built a different optimizer, scheduler, ZeRO stage, offload, accumulation or
      activation checkpointing than planned, or the config's fp16.enabled disagrees with train.precision.
    ValueError: fp16 under ZeRO stage 0 (MSG_FP16_STAGE0).
  """
  config = ds_config(run) if config is None else config
  if bool((config.get("fp16") or {}).get("enabled")) != (run.train.precision == "fp16"):
    raise RuntimeError(f"the DeepSpeed config has fp16.enabled={bool((config.get('fp16') or {}).get('enabled'))} but "
                       f"train.precision={run.train.precision!r}; port the config (`parity port`) so every side "
                       "runs the same precision")
  if run.train.precision == "fp16":
    if int((config.get("zero_optimization") or {}).get("stage", 0)) == 0:
      raise ValueError(MSG_FP16_STAGE0)
  setup_distributed()
  if run.train.precision == "fp16":
    allow_fp16_on_cpu(config)
  model = build_model(run.model, params)
  if run.deepspeed.activation_checkpointing:
    _enable_checkpointing(model, config)
  groups = decay_groups_of(model, run.train.weight_decay, plants, run.train.decay_mask)
  engine = initialize(model, groups, config, run.train)
  _check_engine(engine, run, client=client_class(config), plants=plants)
  return engine


def initialize(model: torch.nn.Module, groups: list[dict[str, Any]], config: dict[str, Any], train):
  """`deepspeed.initialize` as `parity compare` runs a config: the config's optimizer when it has a section, else the
  client optimizer (`client_optimizer`). Returns the engine; raises whatever DeepSpeed raises for the config."""
  import deepspeed  # deepspeed: after setup_distributed set DS_ACCELERATOR
  client = None if has_optimizer_section(config) else client_optimizer(groups, train, config)
  engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, optimizer=client, config=config)
  return engine


def _module_grad_norm(module: torch.nn.Module) -> float:
  """Global L2 norm of the module's .grad tensors, accumulated in float64."""
  sq = sum(float(p.grad.double().pow(2).sum()) for p in module.parameters() if p.grad is not None)
  return sq ** 0.5


def torch_step(engine, micro_batches: np.ndarray, *, before_update: Callable[[], None] | None = None,
               force_overflow: bool = False, arrays=None, plants: frozenset = frozenset()) -> dict[str, float | bool]:
  """One optimizer step of a DeepSpeed engine over the micro batches of that step.

  For each micro batch: forward, `engine.backward(loss)` (DeepSpeed divides the
  loss by gradient_accumulation_steps itself), `engine.step()` (an update only
  after the last micro batch). The engine is the only state that changes.

  Args:
    engine: a DeepSpeedEngine built with gradient_accumulation_steps == len(micro_batches).
    micro_batches: uint16 or uint32 token ids, (grad_accum_steps, micro_batch_size, seq_len + 1);
      inputs are [..., :-1], targets [..., 1:].
    before_update: called after the last backward, right before the update (state probes).
    force_overflow: fp16 only: backpropagate the last micro batch's loss times inf, so the engine's
      own overflow check (the ZeRO optimizer's, on the scaled fp16 gradients) fires and DeepSpeed
      skips the step and backs off the scale (debug `overflow_at_steps`).
    arrays: padded/packed: this rank's parity.protocol.side.ExampleArrays, weights A*W*w (`micro_loss`):
      engine.backward divides each sum(weights * ce) by A and ZeRO averages over W, so the gradient is that of the
      step objective sum(w * ce) (docs/data-examples.md "The model level"); the loss is then the mean of them.
    plants: the side's planted data bugs (PLANT_KEYS), applied by `micro_loss`.
  Returns:
    loss: mean over micro batches of the unscaled mean token cross-entropy, nats.
    grad_norm: global L2 norm of the accumulated gradient before clipping (inf on a skipped step).
    lr: learning rate the optimizer applied in this step (on a skipped step: would have applied;
      the scheduler does not advance, so the next step repeats it).
    fp16 adds loss_scale (the optimizer's `loss_scale` this step multiplied the loss by) and
    skipped (`engine.skipped_steps` grew).
  Raises:
    ValueError: the number of micro batches differs from the engine's accumulation steps, or
      force_overflow without fp16.
  """
  gas = engine.gradient_accumulation_steps()
  if len(micro_batches) != gas:
    raise ValueError(f"got {len(micro_batches)} micro batches; the engine accumulates {gas}")
  fp16 = engine.fp16_enabled()
  if force_overflow and not fp16:
    raise ValueError("force_overflow (debug overflow_at_steps) needs train.precision='fp16' (fp16.enabled)")
  lr = float(engine.optimizer.param_groups[0]["lr"])
  scale = float(engine.optimizer.loss_scale) if fp16 else 1.0  # the ZeRO optimizer's DynamicLossScaler.cur_scale
  skipped_before = engine.skipped_steps
  losses, grad_norm = [], None
  for i, mb in enumerate(micro_batches):
    loss = micro_loss(engine, mb, engine.device, arrays, i, plants)
    last = i == gas - 1
    engine.backward(loss * float("inf") if force_overflow and last else loss)
    losses.append(float(loss.detach()))
    if last:
      if engine.zero_optimization_stage() == 0 and not engine.bfloat16_enabled():
        grad_norm = _module_grad_norm(engine.module)  # the engine keeps no norm without ZeRO
      if before_update is not None:
        before_update()
    engine.step()
  if grad_norm is None:
    norm = engine.get_global_grad_norm()  # inf on a skipped fp16 step (DeepSpeedZeroOptimizer.step)
    grad_norm = float("nan") if norm is None else float(norm)
  out = {"loss": sum(losses) / len(losses), "grad_norm": grad_norm, "lr": lr}
  if fp16:
    out.update(loss_scale=scale, skipped=engine.skipped_steps > skipped_before)
  return out


@torch.no_grad()
def eval_loss(module: torch.nn.Module, val_batches: np.ndarray, device: torch.device, arrays=None,
              plants: frozenset = frozenset(), after=None) -> float:
  """Mean token cross-entropy over held-out micro batches, nats (no gradients, params unchanged).

  Args:
    module: the model (DeepSpeed: `engine.module`, whose ZeRO-3 hooks still gather params).
    val_batches: uint16 or uint32 (n, micro_batch_size, seq_len + 1).
    device: where the module computes.
    arrays: padded/packed: ExampleArrays (n, micro_batch_size, seq_len), weights summing to 1 per batch.
    plants: the side's planted data bugs (`micro_loss`).
    after: called after each micro batch's forward (DeepSpeed: deepspeed.checkpointing.reset), or None.
  """
  losses = []
  for i, mb in enumerate(val_batches):
    losses.append(float(micro_loss(module, mb, device, arrays, i, plants)))
    if after is not None:
      after()
  return sum(losses) / len(losses)



def final_fp32_params(engine) -> dict[str, np.ndarray]:
  """Canonical float32 master params (the fp32 copy DeepSpeed updates, not the compute copy).

  A collective under ZeRO: every rank must call it.
  """
  from deepspeed.utils import safe_get_full_fp32_param  # deepspeed: after setup_distributed set DS_ACCELERATOR
  out = {}
  for name, p in engine.module.named_parameters():
    full = safe_get_full_fp32_param(p)
    out[name] = (p if full is None else full).detach().float().cpu().numpy().copy()
  return {k: out[k] for k in param_shapes(engine.module.spec)}  # canonical order


def final_moments(engine, beta2: float) -> dict[str, np.ndarray]:
  """Canonical float32 sqrt(exp_avg_sq / (1 - beta2^step)) of every param, gathered from any ZeRO stage 0-3.

  `step` is the optimizer's own update count (per-param state, else the param group's). A collective under
  ZeRO: every rank must call it. Raises KeyError when the optimizer keeps no exp_avg_sq (not an Adam) or no step.
  """
  from deepspeed.utils import safe_get_full_optimizer_state  # deepspeed: after setup_distributed set DS_ACCELERATOR
  basic = _basic_optimizer(engine)
  steps = [int(st["step"]) for st in basic.state.values() if isinstance(st, dict) and "step" in st]
  steps += [int(g["step"]) for g in basic.param_groups if "step" in g]
  if not steps:
    raise KeyError(f"{type(basic).__name__} records no update count ('step'): cannot bias-correct exp_avg_sq")
  t = max(steps)
  corr = 1.0 - beta2 ** t if t > 0 else 1.0
  # ZeRO-1/2 link each param's fragment to the optimizer state lazily, and only on the path without CPU offload
  # (stage_1_and_2.py calls it after its own optimizer.step()); with offload_optimizer it never runs and
  # safe_get_full_optimizer_state raises 'exp_avg_sq not found'. Linking only makes per-param views (narrow) of the
  # flat partition's state tensors: nothing is copied or changed, as DeepSpeed itself does without offload.
  link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
  if callable(link) and basic.state:
    engine.optimizer._hp_optimizer_states_linked = False  # relink: an earlier link may predate the state
    link()
  out = {}
  for name, p in engine.module.named_parameters():
    v = safe_get_full_optimizer_state(p, "exp_avg_sq")
    if v is None:  # ZeRO-0 fp32: the torch-style optimizer keeps the state on the module's own params
      v = basic.state.get(p, {}).get("exp_avg_sq")
    if v is None:
      raise KeyError(f"{name}: DeepSpeed returned no exp_avg_sq (optimizer {type(basic).__name__})")
    v = v.detach().double().cpu().numpy().reshape(tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape))
    out[name] = np.sqrt(np.maximum(v, 0.0) / corr).astype(np.float32)
  return {k: out[k] for k in param_shapes(engine.module.spec)}


def engine_state_bytes(engine, run: RunSpec) -> memory.StateBytes:
  """Bytes of params, gradients, master copy, moments and buffers held by the engine now."""
  wrapper = engine.optimizer
  basic = _basic_optimizer(engine)
  return memory.state_bytes(engine.module, basic, wrapper=wrapper if wrapper is not basic else None,
                            offload_optimizer=run.deepspeed.offload_optimizer == "cpu",
                            offload_param=run.deepspeed.offload_param == "cpu")


class DeepSpeedTrainer:
  """The DeepSpeed side behind the interface the worker drives (torch_impl.side.TorchSide).

  Args:
    run: the resolved run spec.
    params: canonical float32 initial weights.
  """

  side = "deepspeed"

  def __init__(self, run: RunSpec, params: dict[str, np.ndarray], config: dict[str, Any] | None = None,
               plants: frozenset = frozenset()):
    self.run = run
    self.plants = plants
    """Planted data bugs (parity.protocol.layout.PLANT_KEYS) its steps and evals apply (`micro_loss`)."""
    self.config = per_rank_config(ds_config(run) if config is None else config, rank_env()[1])
    self.engine = build_engine(run, params, self.config, plants)
    self._snapshots: list[memory.StateBytes] = []
    self.probe = TransferProbe(self.engine)
    """Host<->device bytes and CPU Adam time of each step (torch_impl.transfers; `transfers()`)."""

  @property
  def device(self) -> torch.device:
    return self.engine.device

  def step(self, micro_batches: np.ndarray, *, probe: bool = False,
           force_overflow: bool = False, arrays=None) -> dict[str, float | bool]:
    """One optimizer step (`torch_step`); with probe, state bytes are measured before and after the update."""
    hook = (lambda: self._snapshots.append(engine_state_bytes(self.engine, self.run))) if probe else None
    with self.probe.step():
      metrics = torch_step(self.engine, micro_batches, before_update=hook, force_overflow=force_overflow,
                           arrays=arrays, plants=self.plants)
    if probe:
      self._snapshots.append(engine_state_bytes(self.engine, self.run))
    return metrics

  def transfers(self) -> dict[str, Any]:
    """summary.json's `transfers` block (torch_impl.transfers.TransferProbe.summary)."""
    return self.probe.summary()

  def eval_loss(self, val_batches: np.ndarray, arrays=None) -> float:
    """Under activation checkpointing, deepspeed.checkpointing.reset() after each forward, as DeepSpeed asks and
    Megatron's evaluate does: only backward frees the contiguous buffers (the next forward overran them: IndexError)."""
    import deepspeed  # deepspeed: already imported by the engine
    after = deepspeed.checkpointing.reset if getattr(self.engine.module, "checkpoint", None) is not None else None
    return eval_loss(self.engine.module, val_batches, self.device, arrays, self.plants, after=after)

  def poison(self) -> None:
    """Fills the token embedding (compute copy) with NaN; the next loss is NaN."""
    with torch.no_grad():
      self.engine.module.wte.weight.fill_(float("nan"))

  def canonical_params(self) -> dict[str, np.ndarray]:
    return final_fp32_params(self.engine)

  def canonical_moments(self) -> dict[str, np.ndarray]:
    """Adam's bias-corrected per-element gradient RMS, canonical, float32 (`final_moments`). A ZeRO collective."""
    if self.run.train.optimizer not in ("adam", "adamw"):
      raise KeyError(f"train.optimizer {self.run.train.optimizer!r} keeps no Adam second moment the params rule "
                     "can use")
    return final_moments(self.engine, float(schedule.adam_beta2(self.run.train)))

  def state_bytes(self) -> memory.StateBytes:
    """Per-(category, kind) maximum over the probed moments (now, when nothing was probed)."""
    return memory.merge_max(*(self._snapshots or [engine_state_bytes(self.engine, self.run)]))

  def describe(self) -> dict[str, Any]:
    """Summary extras: optimizer class names, the DeepSpeed config it was given, the optimizer's settings as its
    param groups hold them (`optimizer_hyperparams`), the ZeRO stage."""
    import deepspeed  # deepspeed: after setup_distributed set DS_ACCELERATOR
    return {"optimizer": optimizer_classes(self.engine), "ds_config": self.config,
            "optimizer_hyperparams": optimizer_hyperparams(self.engine),
            "zero_stage": self.engine.zero_optimization_stage(),
            "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__}}
