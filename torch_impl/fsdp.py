"""The FSDP2 side ('fsdp'): the torch model under `torch.distributed.fsdp.fully_shard` (torch >= 2.6's FSDP2).

What `FsdpTrainer` runs (torch 2.13):
  * the model of `torch_impl.model.build_model`, `fully_shard` on each block (`model.h[i]`) and then on the root (the
    embeddings, the final norm and an untied head), over a 1-D device mesh of every rank (`device_mesh`: CPU + gloo,
    or CUDA + nccl; one rank is a mesh of one). Parameters become DTensor shards on dim 0; those fp32 shards are the
    master weights (no other copy exists);
  * precision (`policies`): fp32 runs with no policy; bf16 / fp16 with `MixedPrecisionPolicy(param_dtype=bf16 |
    fp16, reduce_dtype=float32)`: each block's params are all-gathered and cast to the compute dtype for its forward
    and backward, the gradients are upcast and reduce-scattered (averaged over the ranks) in float32 into float32
    sharded gradients. The masters start rounded to the compute dtype, as DeepSpeed's do
    (`parity.weights.master_weights`), so the first forward is the other sides'. Between the micro batches of one
    step FSDP2 accumulates the unsharded gradients in the reduce dtype (float32: `FSDPParam.to_accumulated_grad_if_
    needed`), where the plain-torch bf16 side accumulates in bfloat16: a rounding difference of bf16 runs with
    train.grad_accum_steps > 1 only. fp16 adds DeepSpeed's dynamic loss scaling as the plain-torch side does
    (`parity.numerics.loss_scale.LossScaler`: overflow skips the update and the schedule position);
  * `fsdp.offload` (`CPUOffloadPolicy`): sharded params, gradients and optimizer state in host memory, the optimizer
    step on the CPU; pinned only where CUDA exists (`RunSpec.fsdp.pin_memory`);
  * the optimizer of `torch_impl.baseline.build_optimizer` (`OPTIMIZER_IMPL` says which AdamW implementation and why),
    its lr written per step by `torch_impl.baseline.set_hparams` (DeepSpeed's schedule formula), DeepSpeed's
    clipping rule (`torch_impl.baseline.clip_like_deepspeed`) on the global norm of `sharded_grad_norm`;
  * `fsdp.activation_offload`: each micro batch's forward under `torch.autograd.graph.save_on_cpu`, the saved
    activations in host memory until the backward (`_saved_tensors`);
  * `fsdp.activation_checkpointing`: every block under non-reentrant `torch.utils.checkpoint` (`recompute_block`),
    recomputed in the backward;
  * gradient accumulation as the plain-torch side: each micro batch backpropagates loss / train.grad_accum_steps;
    the reduce-scatter runs only after the last micro batch (`set_requires_gradient_sync`, DDP's no_sync).
Checkpoints (DCP) are torch_impl/fsdp_side.py's. Imports torch and parity only.
"""
from __future__ import annotations

import os
import socket
from typing import Any

import numpy as np
import torch

from parity import weights
from parity.numerics.loss_scale import LossScaler
from parity.protocol.layout import FSDP_PLANT_KEYS
from parity.spec import RunSpec
from torch_impl import memory
from torch_impl.baseline import adam_grad_rms, build_optimizer, clip_like_deepspeed, set_hparams
from torch_impl.model import build_model, micro_loss
from torch_impl.semantics import decay_groups_of

__all__ = ["FsdpTrainer", "device_mesh", "policies", "sharded_grad_norm", "full_tensor", "fsdp_settings",
           "OPTIMIZER_IMPL", "REDUCE_PLANT", "UNSYNCED_PLANT", "UNSYNCED_PARAM", "UNSYNCED_RANK"]

REDUCE_PLANT, UNSYNCED_PLANT = FSDP_PLANT_KEYS
"""The planted FSDP2 bugs (parity.protocol.layout.FSDP_PLANT_KEYS): 'fsdp_reduce_dtype_low' lowers the gradient
reduce dtype (`policies`), 'fsdp_shard_unsynced' leaves one rank's shard of one param un-updated
(`FsdpTrainer.step`)."""
UNSYNCED_PARAM = "h.0.attn.qkv.weight"
"""The param whose shard the planted 'fsdp_shard_unsynced' leaves at its pre-step value on rank UNSYNCED_RANK (every
family's first attention projection: the rows of dim 0 that rank holds)."""
UNSYNCED_RANK = 1
"""The rank whose shard the planted 'fsdp_shard_unsynced' leaves un-updated (a 2-rank run or more: refused on 1)."""

OPTIMIZER_IMPL = "for-loop"
"""Which torch.optim.AdamW implementation runs: the for-loop one (`foreach=False, fused=False`: `_single_tensor_adamw`,
one tensor at a time), as on the plain-torch side (torch_impl.baseline.build_optimizer). Why: the implementations
compute the same formula with different kernels and so round differently, and the FSDP2 side is compared with the
plain-torch side at the fp32 tolerances. Measured on this machine's CPU (torch 2.13, 4 fp32 tensors of 256 x 256,
10 AdamW steps of random gradients): foreach gave the for-loop's params bit for bit, fused differed in 920 of
262,144 elements (by up to 2.4e-7, one float32 ulp near 1); on CUDA not measured. The for-loop runs on DTensors
element-wise on each rank's shard (no communication)."""


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def device_mesh():
  """The 1-D device mesh of every rank (torch.distributed initialised here once: gloo on CPU; on CUDA nccl for CUDA
  tensors and gloo for CPU ones, 'cpu:gloo,cuda:nccl', not run on CUDA here: no GPU on the machine this was built on).

  One process without torchrun gets the single-process rendezvous (MASTER_ADDR 127.0.0.1, a free MASTER_PORT,
  RANK 0, WORLD_SIZE 1, set only where absent), since fully_shard needs a process group even for one rank.
  Returns:
    (torch.distributed.device_mesh.DeviceMesh of shape (world,), torch.device this rank computes on).
  """
  import torch.distributed as dist  # torch.distributed: on first use
  from torch.distributed.device_mesh import init_device_mesh
  cuda = torch.cuda.is_available()
  os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
  if "MASTER_PORT" not in os.environ:
    os.environ["MASTER_PORT"] = str(_free_port())
  for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
    os.environ.setdefault(key, value)
  if cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
  if not dist.is_initialized():  # CUDA: nccl for the CUDA tensors, gloo for the CPU ones (offloaded shards, the
    dist.init_process_group(backend="cpu:gloo,cuda:nccl" if cuda else "gloo")  # loss mean: world_mean)
  device = torch.device(f"cuda:{torch.cuda.current_device()}") if cuda else torch.device("cpu")
  return init_device_mesh(device.type, (dist.get_world_size(),)), device


def policies(run: RunSpec, cuda: bool, plants: frozenset = frozenset()) -> dict[str, Any]:
  """fully_shard's keyword arguments for this run: mp_policy (bf16/fp16: MixedPrecisionPolicy(param_dtype=the
  compute dtype, reduce_dtype=float32); fp32: the default, no casting), offload_policy (fsdp.offload:
  CPUOffloadPolicy(pin_memory=fsdp.pin_memory and cuda)) and reshard_after_forward (fsdp.reshard_after_forward).

  The planted 'fsdp_reduce_dtype_low' (REDUCE_PLANT in `plants`) keeps the param dtype and lowers reduce_dtype to
  16 bits: bfloat16 in fp32 and bf16 runs (fp32: param_dtype=None, reduce_dtype=bfloat16, which FSDP2 accepts: the
  gradients are rounded to bfloat16 for the reduce-scatter, even on one rank, and cast back to the float32 shards;
  bf16: the policy without its fp32 reduce, the common mistake), float16 in fp16 runs."""
  from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
  precision = run.train.precision
  compute = None if precision == "fp32" else torch.bfloat16 if precision == "bf16" else torch.float16
  reduce = torch.float32
  if REDUCE_PLANT in plants:
    reduce = torch.float16 if precision == "fp16" else torch.bfloat16
  mp = (MixedPrecisionPolicy() if compute is None and reduce == torch.float32 else
        MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce))
  plan = run.fsdp
  offload = CPUOffloadPolicy(pin_memory=plan.pin_memory and cuda) if plan.offload else OffloadPolicy()
  return {"mp_policy": mp, "offload_policy": offload, "reshard_after_forward": plan.reshard_after_forward}


def _shard(model: torch.nn.Module, mesh, kwargs: dict[str, Any]) -> None:
  """fully_shard on every block, then on the root (its own params: embeddings, final norm, untied head)."""
  from torch.distributed.fsdp import fully_shard
  for block in model.h:
    fully_shard(block, mesh=mesh, **kwargs)
  fully_shard(model, mesh=mesh, **kwargs)


def recompute_block(block, x, rope, mask=None):
  """`GPT.checkpoint` under fsdp.activation_checkpointing: the block under non-reentrant
  `torch.utils.checkpoint.checkpoint` (the form torch recommends; FSDP2's pre-forward hook all-gathers the block's
  params again when the backward recomputes it). The rotary tables and the mask are inputs like x, saved whole."""
  from torch.utils.checkpoint import checkpoint
  args = (x, rope) if mask is None else (x, rope, mask)
  return checkpoint(block, *args, use_reentrant=False)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
  """The whole tensor of a DTensor shard (an all-gather: a collective, every rank calls it), on the mesh's device
  first where the shard is offloaded to the host; a plain tensor as it is."""
  from torch.distributed.tensor import DTensor
  if not isinstance(t, DTensor):
    return t
  if t.device.type != t.device_mesh.device_type:
    t = t.to(t.device_mesh.device_type)
  return t.full_tensor()


def _local(t: torch.Tensor) -> torch.Tensor:
  """This rank's shard of a DTensor (a view), or the tensor itself."""
  return t.to_local() if hasattr(t, "to_local") else t


def sharded_grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
  """Global L2 norm of sharded gradients, as `torch_impl.baseline.global_grad_norm` computes it on whole ones.

  Per tensor, the float64 sum of squares of this rank's shard (||shard||_2 in float64, squared), summed over the
  ranks (one float64 all-reduce of the per-tensor vector), then summed over the tensors in order. With one rank
  this is global_grad_norm's arithmetic operation for operation (sqrt(x^2) == x in IEEE arithmetic).
  Args:
    params: DTensor (or plain) params whose `.grad` is set (None grads are skipped).
  Returns:
    A float32 scalar tensor (CPU): sqrt(sum_i ||g_i||^2).
  """
  import torch.distributed as dist  # torch.distributed: on first use
  sq = [float(_local(p.grad).double().norm(2)) ** 2 for p in params if p.grad is not None]
  if dist.is_initialized() and dist.get_world_size() > 1:
    v = torch.tensor(sq, dtype=torch.float64)  # CPU: gloo (device_mesh's backend has it on CUDA too)
    dist.all_reduce(v)
    sq = v.cpu().tolist()
  return torch.tensor(sum(sq) ** 0.5, dtype=torch.float32)


def _dtypes(fp) -> tuple[torch.dtype, torch.dtype]:
  """(compute dtype, gradient reduce dtype) of one FSDPParam: its policy's, clamped as FSDP2 clamps them at its lazy
  init (`FSDPParam.init_dtype_attrs`: a param dtype equal to the param's own is no cast, a reduce dtype None or equal
  to the param dtype reduces in the param dtype); the attributes that init sets, once it ran."""
  orig = fp.sharded_param.dtype
  if hasattr(fp, "param_dtype"):
    param = fp.param_dtype or orig
    return param, fp.reduce_dtype or param
  mp = fp.mp_policy
  param = mp.param_dtype if mp.param_dtype is not None and orig.is_floating_point else orig
  return param, mp.reduce_dtype or param


def fsdp_settings(model: torch.nn.Module) -> dict[str, Any]:
  """What the built FSDP2 modules run with, read from their FSDPParams (every module fully_shard wrapped): the
  compute (param) dtype, the gradient reduce dtype, host offload and pinning, each as the sorted set of values over
  the params (one value when uniform), and the number of sharded modules."""
  from torch.distributed.fsdp import FSDPModule, fully_shard
  dt = lambda d: str(d).replace("torch.", "")
  seen: dict[str, set] = {"param_dtype": set(), "reduce_dtype": set(), "offload_to_cpu": set(), "pin_memory": set()}
  modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
  for m in modules:
    for group in fully_shard.state(m)._fsdp_param_groups:
      for fp in group.fsdp_params:
        param, reduce = _dtypes(fp)
        seen["param_dtype"].add(dt(param))
        seen["reduce_dtype"].add(dt(reduce))
        seen["offload_to_cpu"].add(bool(fp.offload_to_cpu))
        seen["pin_memory"].add(bool(fp.pin_memory))
  one = lambda s: next(iter(s)) if len(s) == 1 else sorted(s)
  return {**{k: one(v) for k, v in seen.items()}, "sharded_modules": len(modules)}


class FsdpTrainer:
  """FSDP2 training of the same model, behind the interface the side drives (torch_impl.fsdp_side.FsdpSide).

  Args:
    run: the resolved run spec (run.fsdp: the plan).
    params: canonical float32 initial weights.
    plants: planted bugs (parity.protocol.layout.PLANT_KEYS) its steps, evals and param groups apply, and the
      FSDP2 ones (FSDP_PLANT_KEYS: `policies`, `step`).
  Raises:
    RuntimeError: the optimizer built is not the for-loop implementation (OPTIMIZER_IMPL).
  """

  side = "fsdp"

  def __init__(self, run: RunSpec, params: dict[str, np.ndarray], plants: frozenset = frozenset()):
    import torch.distributed as dist  # torch.distributed: on first use
    t = run.train
    self.run, self.plants = run, plants
    self.mesh, self.device = device_mesh()
    self.world = dist.get_world_size()
    self.model = build_model(run.model, weights.master_weights(params, t.precision), device=self.device)
    self.fsdp_kwargs = policies(run, self.device.type == "cuda", plants)
    _shard(self.model, self.mesh, self.fsdp_kwargs)
    if run.fsdp.activation_checkpointing:
      self.model.checkpoint = recompute_block
    self.optimizer = build_optimizer(decay_groups_of(self.model, t.weight_decay, plants, t.decay_mask), t)
    g0 = self.optimizer.param_groups[0]
    if g0.get("foreach") or g0.get("fused"):
      raise RuntimeError(f"the FSDP2 side runs the {OPTIMIZER_IMPL} optimizer; got foreach={g0.get('foreach')} "
                         f"fused={g0.get('fused')}")
    self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
    self.grad_clip = float(t.grad_clip)
    """The clip threshold every step clips with (`clip_like_deepspeed`; 0: none); the semantics card reads it."""
    self.step_index = 0
    """Optimizer updates applied = the LR schedule position (skipped fp16 steps do not count)."""
    self.loss_scaler = LossScaler.from_train(t, raise_at_min=True) if t.precision == "fp16" else None
    """fp16 only: DeepSpeed's loss scaler, as the plain-torch side's."""
    self.compute_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[t.precision]
    self._snapshots: list[memory.StateBytes] = []

  def step(self, micro_batches: np.ndarray, *, probe: bool = False, force_overflow: bool = False,
           arrays=None) -> dict[str, float | bool]:
    """One optimizer step over this rank's (grad_accum_steps, micro_batch_size / world, seq_len + 1) tokens.

    Args and returns as `torch_impl.baseline.TorchTrainer.step` (loss: this rank's mean over its micro batches;
    grad_norm: the global pre-clip norm, inf on a skipped fp16 step; lr; fp16 adds loss_scale and skipped).
    Raises:
      ValueError: the number of micro batches differs from train.grad_accum_steps, or force_overflow without fp16.
      parity.numerics.loss_scale.LossScaleAtMinimum: an overflow at train.min_loss_scale.
    """
    t, scaler = self.run.train, self.loss_scaler
    if len(micro_batches) != t.grad_accum_steps:
      raise ValueError(f"got {len(micro_batches)} micro batches; train.grad_accum_steps={t.grad_accum_steps}")
    if force_overflow and scaler is None:
      raise ValueError(f"force_overflow (debug overflow_at_steps) needs train.precision='fp16' (loss scaling); "
                       f"this run has train.precision={t.precision!r}")
    lr = set_hparams(self.optimizer, t, self.step_index)
    scale = scaler.scale if scaler is not None else 1.0
    losses = self._backward(micro_batches, arrays, scale * (float("inf") if force_overflow else 1.0))
    out: dict[str, float | bool] = {"loss": sum(losses) / len(losses), "lr": lr}
    divisor = 1.0
    if scaler is not None:
      out.update(loss_scale=scale, skipped=False)
      overflow = self._overflow()
      scaler.update(overflow)  # raises LossScaleAtMinimum where DeepSpeed raises
      if overflow:
        self.optimizer.zero_grad(set_to_none=True)
        return {**out, "skipped": True, "grad_norm": float("inf")}
      divisor = scaler.scale  # DeepSpeed unscales with the updated scale (the plain-torch side's rule)
      for p in self.params:
        if p.grad is not None:
          _local(p.grad).div_(divisor)
    norm = sharded_grad_norm(self.params)
    clip_like_deepspeed(self.params, self.grad_clip, norm)
    if probe:
      self._snapshots.append(self.measure())
    stale = self._unsynced_shard()
    self.optimizer.step()
    if stale is not None:  # the planted 'fsdp_shard_unsynced': this rank's updated shard never written back
      stale[0].copy_(stale[1])
    if probe:
      self._snapshots.append(self.measure())
    self.step_index += 1
    return {**out, "grad_norm": float(norm) * divisor / scale}

  def _unsynced_shard(self) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The planted 'fsdp_shard_unsynced' (UNSYNCED_PLANT in plants), on rank UNSYNCED_RANK only: (UNSYNCED_PARAM's
    local shard, a copy of it before the update), which `step` copies back after optimizer.step, so that rank's rows
    of the param stay at their pre-step values while its Adam moments and every other shard (the other ranks' rows
    of it too) advance; None otherwise. Local only: no collective differs between the ranks."""
    if UNSYNCED_PLANT not in self.plants or self.mesh.get_rank() != UNSYNCED_RANK:
      return None
    shard = _local(dict(self.model.named_parameters())[UNSYNCED_PARAM].detach())
    return shard, shard.clone()

  def _backward(self, micro_batches: np.ndarray, arrays, multiplier: float) -> list[float]:
    """Backward of every micro batch (loss / A, times the fp16 scale); the gradients are reduce-scattered after the
    last one only. Returns the micro-batch losses (unscaled, nats)."""
    a = self.run.train.grad_accum_steps
    self.optimizer.zero_grad(set_to_none=True)
    losses = []
    for i, mb in enumerate(micro_batches):
      self.model.set_requires_gradient_sync(i == len(micro_batches) - 1)
      with self._saved_tensors():
        loss = micro_loss(self.model, mb, self.device, arrays, i, self.plants)  # float32 (logits cast up)
      scaled = loss / a
      (scaled * multiplier if multiplier != 1.0 else scaled).backward()
      losses.append(float(loss.detach()))
    return losses

  def _saved_tensors(self):
    """The context the forward runs in: `torch.autograd.graph.save_on_cpu` under fsdp.activation_offload (every
    tensor autograd saves for the backward goes to host memory, pinned where CUDA exists; on the CPU a tensor
    already in host memory is kept as it is), else a context that changes nothing."""
    import contextlib
    if not self.run.fsdp.activation_offload:
      return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda")

  def _overflow(self) -> bool:
    """Whether any rank's gradient shard holds a non-finite value (a max all-reduce of the ranks' flags)."""
    import torch.distributed as dist  # torch.distributed: on first use
    bad = any(p.grad is not None and not bool(torch.isfinite(_local(p.grad)).all()) for p in self.params)
    flag = torch.tensor([1.0 if bad else 0.0], device=self.device)
    if self.world > 1:
      dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)

  @torch.no_grad()
  def eval_loss(self, val_batches: np.ndarray, arrays=None) -> float:
    """Mean token cross-entropy over held-out micro batches, nats (every rank evaluates all of them: the forward
    all-gathers each block's params); padded/packed as TorchTrainer.eval_loss."""
    losses = [float(micro_loss(self.model, mb, self.device, arrays, i, self.plants))
              for i, mb in enumerate(val_batches)]
    return sum(losses) / len(losses)

  def poison(self) -> None:
    """Fills this rank's shard of the token embedding with NaN (every rank does: the whole table); the next loss is
    NaN."""
    with torch.no_grad():
      _local(self.model.wte.weight).fill_(float("nan"))

  def canonical_params(self) -> dict[str, np.ndarray]:
    """Canonical name -> float32 numpy copy of each whole master param (an all-gather per param: a collective)."""
    own = dict(self.model.named_parameters())
    return {k: full_tensor(own[k].detach()).float().cpu().numpy().copy() for k in weights.param_shapes(self.run.model)}

  def canonical_moments(self) -> dict[str, np.ndarray]:
    """Adam's bias-corrected per-element gradient RMS, canonical, float32, whole (torch_impl.baseline.adam_grad_rms
    over the all-gathered moments: a collective); zeros before the first update. Raises KeyError when the optimizer
    is not an Adam."""
    return adam_grad_rms(self.run, self.model, self.optimizer, whole=full_tensor)

  def measure(self) -> memory.StateBytes:
    """Bytes of this rank's training state now (`torch_impl.memory` categories): its param shards (the fp32
    masters: master_params 0), their gradient shards, the Adam moments; kind 'host' for what fsdp.offload keeps
    there (on CUDA: where each tensor lives). Gathered compute copies live inside forward/backward only."""
    ledger = memory._Ledger(cuda=self.device.type == "cuda")  # counts each storage once, by its memory kind
    host = self.run.fsdp.offload
    for p in self.params:
      ledger.add(_local(p.detach()), "params", host)
    for p in self.params:
      ledger.add(None if p.grad is None else _local(p.grad), "gradients", host)
    for st in self.optimizer.state.values():
      for v in st.values():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
          ledger.add(_local(v), "optimizer_moments", host)
    return ledger.result()

  def state_bytes(self) -> memory.StateBytes:
    """Per-(category, kind) maximum over the probed moments (now, when nothing was probed)."""
    return memory.merge_max(*(self._snapshots or [self.measure()]))

  def describe(self) -> dict[str, Any]:
    """Summary extras: the optimizer and its implementation, the FSDP2 settings as built (`fsdp_settings`), the mesh."""
    return {"optimizer": {"optimizer": type(self.optimizer).__name__, "implementation": OPTIMIZER_IMPL,
                          "foreach": False, "fused": False,
                          "group_weight_decay": [g["weight_decay"] for g in self.optimizer.param_groups],
                          "clipping": "deepspeed: g / max(1, (||g|| + 1e-6) / clip)"},
            "fsdp": {**fsdp_settings(self.model), "mesh": f"{self.mesh.device_type} x {self.world}",
                     "reshard_after_forward": self.run.fsdp.reshard_after_forward,
                     "activation_offload": ("save_on_cpu" + (" (pinned)" if self.device.type == "cuda" else "")
                                            if self.run.fsdp.activation_offload else None),
                     "activation_checkpointing": ("torch.utils.checkpoint (non-reentrant), every block"
                                                  if getattr(self.model, "checkpoint", None) is recompute_block
                                                  else None)},
            "versions": {"torch": torch.__version__}}
