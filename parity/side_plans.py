"""The sides' plans: where each keeps its training state (memory kinds, sharding) and how it rematerialises.

`JaxPlan` (memory kinds, mesh data axis, jax.checkpoint policy), `DeepSpeedPlan` (ZeRO stage, offload, activation
checkpointing) and `FsdpPlan` (fully_shard, CPUOffloadPolicy, save_on_cpu) are the plan sections of a RunSpec
(parity.spec, which re-exports them). parity.sizing.plans pairs them into named plans. Plain data: no jax, no torch.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

from parity.errors import SpecError
from parity.fields import check_section_numbers
from parity.sides import find_side, side_record

__all__ = ["REMAT_POLICIES", "JaxPlan", "DeepSpeedPlan", "FsdpPlan", "side_plans", "describe_plans"]


REMAT_POLICIES = ("none", "full", "save_dots", "save_dots_no_batch", "offload_dots_no_batch", "offload_names")
"""jax.checkpoint policies over each block (jax_impl/offload.py maps them to jax.checkpoint_policies)."""


@dataclasses.dataclass(frozen=True, slots=True)
class JaxPlan:
  """Where the JAX side keeps its training state (memory kinds), how it shards it, and how it rematerialises."""

  offload_opt_state: bool = True
  """Adam moments live in `pinned_host` between steps; XLA moves them in and out of the step."""
  offload_opt_ratio: float = 1.0
  """Share of the optimizer state offloaded, in (0, 1] (DeepSpeed offload_optimizer.ratio, ZeRO-Offload++): 1 offloads
  all of it; below 1 the moments of the last param leaves (embeddings, blocks, final norm, head:
  parity.sizing.memory_jax.opt_split) go to the host until they hold at least this share of the moment bytes, and the
  rest stay on the device. The numbers are the same at every ratio. Below 1 it needs offload_opt_state."""
  offload_params: bool = False
  """fp32 master params also live in `pinned_host` between steps (with scan_layers: moved to device per layer)."""
  host_memory_kind: Literal["pinned_host", "unpinned_host"] = "pinned_host"
  """Memory kind used for offloaded state."""
  remat: str = "none"
  """jax.checkpoint policy over each block, one of REMAT_POLICIES: none (save everything), full (recompute
  everything), save_dots / save_dots_no_batch (keep matmul outputs), offload_dots_no_batch / offload_names
  (keep them in host memory)."""
  scan_layers: bool = False
  """Run the blocks as one jax.lax.scan over layer-stacked params (layer axis 0)."""
  zero_stage: int = 0
  """Sharding over the mesh's data axis: 0 replicated, 1 optimizer state, 2 + gradients, 3 + params (FSDP)."""
  data_parallel: int = 1
  """Devices on the mesh's data axis (the micro batch is split over them); 1 = one device."""

  def validate(self) -> "JaxPlan":
    """Checks every field (numbers, remat policy, zero stage, host memory kind, booleans, data_parallel >= 1).
    Returns self. Raises SpecError naming the `jax.<field>` and the value."""
    check_section_numbers(self, "jax")
    if self.remat not in REMAT_POLICIES:
      raise SpecError(f"jax.remat must be one of {', '.join(REMAT_POLICIES)}; got {self.remat!r}")
    if self.zero_stage not in (0, 1, 2, 3):
      raise SpecError(f"jax.zero_stage must be 0, 1, 2 or 3; got {self.zero_stage}")
    if self.host_memory_kind not in ("pinned_host", "unpinned_host"):
      raise SpecError(f"jax.host_memory_kind must be 'pinned_host' or 'unpinned_host'; got {self.host_memory_kind!r}")
    for name in ("offload_opt_state", "offload_params", "scan_layers"):
      if not isinstance(getattr(self, name), bool):
        raise SpecError(f"jax.{name} must be true or false; got {getattr(self, name)!r}")
    if self.data_parallel < 1:
      raise SpecError(f"jax.data_parallel must be >= 1; got {self.data_parallel}")
    self._check_ratio()
    return self

  def _check_ratio(self) -> None:
    """offload_opt_ratio: a number in (0, 1], below 1 only with offload_opt_state."""
    r = self.offload_opt_ratio
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:
      raise SpecError(f"jax.offload_opt_ratio must be a number in (0, 1] (the share of the optimizer state offloaded; "
                      f"1: all of it); got {r!r}. Set it to e.g. 0.5, or to 1")
    if r < 1 and not self.offload_opt_state:
      raise SpecError(f"jax.offload_opt_ratio {r} offloads part of the optimizer state, but jax.offload_opt_state is "
                      "false (nothing is offloaded); set jax.offload_opt_state=true, or jax.offload_opt_ratio=1")

  def describe(self) -> str:
    """What the plan sets, in a few words: 'offload_opt_state, scan_layers, remat full' (the host memory kind only
    when it is not pinned_host); 'no offload' when it sets nothing."""
    host = [k for k in ("offload_opt_state", "offload_params") if getattr(self, k)]
    partial = self.offload_opt_state and self.offload_opt_ratio < 1
    host += [f"offload_opt_ratio {self.offload_opt_ratio:g}"] if partial else []
    return ", ".join([*host, *([self.host_memory_kind] if host and self.host_memory_kind != "pinned_host" else []),
                      *(["scan_layers"] if self.scan_layers else []),
                      *([f"zero_stage {self.zero_stage}"] if self.zero_stage else []),
                      *([f"remat {self.remat}"] if self.remat != "none" else []),
                      *([f"data_parallel {self.data_parallel}"] if self.data_parallel > 1 else [])]) or "no offload"


@dataclasses.dataclass(frozen=True, slots=True)
class DeepSpeedPlan:
  """ZeRO configuration of the DeepSpeed side."""

  zero_stage: int = 2
  """ZeRO stage 0-3 (optimizer state, + gradients, + params partitioned)."""
  offload_optimizer: Literal["none", "cpu"] = "cpu"
  """zero_optimization.offload_optimizer.device; 'cpu' uses DeepSpeedCPUAdam."""
  offload_param: Literal["none", "cpu"] = "none"
  """zero_optimization.offload_param.device; stage 3 only."""
  activation_checkpointing: bool = False
  """Recompute each block in the backward pass (deepspeed.checkpointing / torch.utils.checkpoint)."""
  cpu_checkpointing: bool = False
  """With activation_checkpointing: keep each block's checkpointed input in host memory until its backward
  (activation_checkpointing.cpu_checkpointing, with partition_activations so DeepSpeed copies it: torch_impl.engine
  `_enable_checkpointing`). The same recompute, so the same numbers; DeepSpeed's counterpart of the JAX offload remat
  policies (`offload_names`)."""

  def validate(self) -> "DeepSpeedPlan":
    """Checks every field (numbers, zero stage 0-3, offload targets 'none'/'cpu', offload_param only at stage 3).
    Returns self. Raises SpecError naming the `deepspeed.<field>` and the value."""
    check_section_numbers(self, "deepspeed")
    if self.zero_stage not in (0, 1, 2, 3):
      raise SpecError(f"deepspeed.zero_stage must be 0, 1, 2 or 3; got {self.zero_stage}")
    for name in ("offload_optimizer", "offload_param"):
      if getattr(self, name) not in ("none", "cpu"):
        raise SpecError(f"deepspeed.{name} must be 'none' or 'cpu'; got {getattr(self, name)!r} "
                        "(NVMe offload has no JAX counterpart; `parity port` explains the nearest host-memory plan)")
    for name in ("activation_checkpointing", "cpu_checkpointing"):
      if not isinstance(getattr(self, name), bool):
        raise SpecError(f"deepspeed.{name} must be true or false; got {getattr(self, name)!r}")
    if self.cpu_checkpointing and not self.activation_checkpointing:
      raise SpecError("deepspeed.cpu_checkpointing keeps the checkpoints of activation checkpointing in host memory; "
                      "set deepspeed.activation_checkpointing=true with it")
    if self.offload_param != "none" and self.zero_stage != 3:
      raise SpecError(f"deepspeed.offload_param requires zero_stage 3; got zero_stage={self.zero_stage}. "
                      "Use offload_optimizer for stages 1-2.")
    if self.offload_optimizer != "none" and self.zero_stage == 0:
      raise SpecError("deepspeed.offload_optimizer requires zero_stage >= 1; got 0")
    return self

  def describe(self) -> str:
    """What the plan sets, in a few words: 'ZeRO-2, offload_optimizer cpu, activation checkpointing'."""
    return ", ".join([f"ZeRO-{self.zero_stage}",
                      *(f"{k} cpu" for k in ("offload_optimizer", "offload_param") if getattr(self, k) == "cpu"),
                      *(["activation checkpointing" + (" with cpu_checkpointing (block inputs on the host)"
                                                       if self.cpu_checkpointing else "")]
                        if self.activation_checkpointing else [])])


@dataclasses.dataclass(frozen=True, slots=True)
class FsdpPlan:
  """How the FSDP2 side (`torch.distributed.fsdp.fully_shard`, torch_impl/fsdp.py) keeps its training state. Every
  block and then the root is sharded over the ranks (ZeRO-3-like: params, gradients and optimizer state split)."""

  offload: bool = False
  """`CPUOffloadPolicy`: the sharded params, their gradients and the optimizer state live in host memory; each
  block's params are copied to the device for its forward and backward, and the optimizer step runs on the CPU."""
  pin_memory: bool = True
  """With offload, pin the host copies (CPUOffloadPolicy(pin_memory=True)) where CUDA exists; a machine without an
  accelerator cannot pin (torch 2.13 raises 'Cannot access accelerator device when none is available'), so there
  the side runs unpinned and its summary says so."""
  reshard_after_forward: bool = True
  """fully_shard's reshard_after_forward: free each block's gathered params after its forward and gather them again
  for its backward (True, ZeRO-3's schedule), or keep them to the backward (False, ZeRO-2's memory)."""

  activation_offload: bool = False
  """Activations saved for the backward pass kept in host memory (`torch.autograd.graph.save_on_cpu` around each
  micro batch's forward, pinned where CUDA exists) and brought back when the backward needs them: PyTorch's
  counterpart of the JAX offload remat policies. Nothing is recomputed, so the numbers are the run without it."""
  activation_checkpointing: bool = False
  """Recompute each block in the backward pass (`torch.utils.checkpoint.checkpoint`, non-reentrant, around each block
  of the sharded model, as torchtitan's full activation checkpointing): only each block's input is saved. FSDP2's
  hooks all-gather the block's params again for the recompute. The counterpart of DeepSpeed's activation
  checkpointing and JAX's remat='full'; the same ops on the same values, so the same numbers."""

  def validate(self) -> "FsdpPlan":
    """Checks every field is a boolean, and that activation_checkpointing and activation_offload are not both on.
    Returns self. Raises SpecError naming the `fsdp.<field>` and the value."""
    for name in ("offload", "pin_memory", "reshard_after_forward", "activation_offload", "activation_checkpointing"):
      if not isinstance(getattr(self, name), bool):
        raise SpecError(f"fsdp.{name} must be true or false; got {getattr(self, name)!r}")
    if self.activation_checkpointing and self.activation_offload:
      raise SpecError("fsdp.activation_checkpointing with fsdp.activation_offload: checkpointing saves each block's "
                      "input only and recomputes the rest, save_on_cpu moves what is saved to the host; the side "
                      "runs one of them (the plans pair each with its own counterpart); set one to false")
    return self

  def describe(self) -> str:
    """What the plan sets, in a few words: 'CPU offload, reshard after forward, every block recomputed in the backward
    (activation checkpointing)' (every block and the root are always sharded; pin_memory is how the offload is made,
    not what is placed)."""
    return ", ".join(["CPU offload" if self.offload else "no offload",
                      "reshard after forward" if self.reshard_after_forward else "no reshard after forward",
                      *(["activations saved on the CPU"] if self.activation_offload else []),
                      *(["every block recomputed in the backward (activation checkpointing)"]
                        if self.activation_checkpointing else [])])


def side_plans(run, sides=None) -> dict[str, JaxPlan | DeepSpeedPlan | FsdpPlan]:
  """side -> its plan, for each side of `sides` (default: the run's) whose record names a plan section
  (parity.sides: `SideRecord.plan`), in that order; run: a RunSpec."""
  records = [find_side(s) for s in (run.sides if sides is None else sides)]
  return {r.name: getattr(run, r.plan) for r in records if r is not None and r.plan}


def describe_plans(plans) -> str:
  """Each plan described once (its `describe`), named by its side's label (parity.sides): 'DeepSpeed ZeRO-2,
  offload_optimizer cpu; JAX offload_opt_state'. plans: side -> plan (`side_plans`). The one wording the CLI's sizing
  tables, the report's plan rows and the comparison page share."""
  return "; ".join(f"{side_record(s).label} {p.describe()}" for s, p in plans.items())
