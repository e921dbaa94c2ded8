"""Where the train state lives: compiler-planned host offload through memory kinds.

The plan is expressed once, as shardings: every state leaf gets a `NamedSharding` on a
mesh with one axis, `data`, whose `memory_kind` is `device` or the plan's host kind
(`pinned_host` by default). The jitted step takes and returns the state with these
shardings (in/out shardings + donation); inside the step, `to_device` moves offloaded
groups into device memory before use, and the out shardings send the new values back
to the host. XLA plans the transfers; there is no hand-written copy loop.

Today the mesh has one device and everything is replicated over `data`. Data
parallelism extends it by building the mesh over more devices: batches are already
split over `data` along the micro-batch axis (`batch_sharding`), and FSDP only changes
`leaf_spec`.

What CPU can and cannot show (NUMERICS.md): arrays really carry the memory kind, the
lowered StableHLO carries `mhlo.memory_kind = "pinned_host"` at the jit boundary, and the
compiled HLO marks those entry buffers with memory space 5 (`S(5)`); but in-jit
`device_put` lowers to nothing on CPU and `memory_analysis()` counts host buffers as
device bytes. GPU runs are the real test of placement.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from parity.spec import JaxPlan

__all__ = ["TrainState", "Placement", "make_mesh", "make_placement", "state_memory_kinds",
           "bytes_by_memory_kind", "offload_evidence", "DATA_AXIS", "DEVICE_KIND"]

DATA_AXIS = "data"
DEVICE_KIND = "device"


class TrainState(NamedTuple):
  """Everything a training step reads and replaces. Groups are placed independently."""
  params: Any  # Flax params pytree, float32 master weights
  opt_state: Any  # optax state of jax_impl.optim.make_optimizer (moments float32, counts int32)


def make_mesh(devices: list[jax.Device] | None = None) -> Mesh:
  """A 1-axis mesh (`data`) over `devices` (default: the first local device)."""
  devs = list(devices) if devices else jax.local_devices()[:1]
  return Mesh(np.array(devs), (DATA_AXIS,))


@dataclasses.dataclass(frozen=True)
class Placement:
  """The memory plan of one run: mesh, memory kinds per state group, and the derived shardings.

  Attributes:
    mesh: the device mesh (axis `data`).
    plan: the JaxPlan (which groups are offloaded, to which host memory kind).
  """
  mesh: Mesh
  plan: JaxPlan

  def kind(self, group: str) -> str:
    """Memory kind between steps of a state group ('params' or 'opt_state')."""
    offloaded = {"params": self.plan.offload_params, "opt_state": self.plan.offload_opt_state}[group]
    return self.plan.host_memory_kind if offloaded else DEVICE_KIND

  def leaf_spec(self, group: str, leaf: Any) -> P:
    """PartitionSpec of one state leaf; replicated over `data` (the hook for FSDP)."""
    del group, leaf
    return P()

  def group_shardings(self, group: str, tree: Any) -> Any:
    """Pytree of NamedShardings (memory kind of `group`) matching `tree` (arrays or shapes)."""
    kind = self.kind(group)
    return jax.tree.map(lambda x: NamedSharding(self.mesh, self.leaf_spec(group, x), memory_kind=kind), tree)

  def state_shardings(self, state: TrainState) -> TrainState:
    """TrainState of shardings, each leaf in its group's memory kind."""
    return TrainState(params=self.group_shardings("params", state.params),
                      opt_state=self.group_shardings("opt_state", state.opt_state))

  def device_shardings(self, shardings: Any) -> Any:
    """The same shardings with memory kind `device` (the in-step working copies)."""
    return jax.tree.map(lambda s: s.with_memory_kind(DEVICE_KIND), shardings)

  def to_device(self, group: str, tree: Any, shardings: Any) -> Any:
    """Inside jit: moves an offloaded group into device memory; identity for device groups."""
    if self.kind(group) == DEVICE_KIND:
      return tree
    return jax.device_put(tree, self.device_shardings(shardings))

  def batch_sharding(self) -> NamedSharding:
    """Sharding of a (accum, micro, seq + 1) batch: micro batches split over `data`, in device memory."""
    return NamedSharding(self.mesh, P(None, DATA_AXIS), memory_kind=DEVICE_KIND)

  def replicated(self) -> NamedSharding:
    """Device-memory replicated sharding (metrics, scalars)."""
    return NamedSharding(self.mesh, P(), memory_kind=DEVICE_KIND)


def make_placement(plan: JaxPlan, mesh: Mesh | None = None) -> Placement:
  """Builds the placement, checking that the devices expose the plan's host memory kind.

  Raises:
    ValueError: a device of the mesh has no memory of kind `plan.host_memory_kind`.
  """
  mesh = mesh or make_mesh()
  if plan.offload_params or plan.offload_opt_state:
    for dev in mesh.devices.flat:
      kinds = {m.kind for m in dev.addressable_memories()}
      if plan.host_memory_kind not in kinds:
        raise ValueError(f"device {dev} has no {plan.host_memory_kind!r} memory (it has {sorted(kinds)}); "
                         "set jax.host_memory_kind to one of them or disable offload in the JaxPlan")
  return Placement(mesh=mesh, plan=plan)


# ----------------------------------------------------------------------------- reporting


def _leaf_kind(x: Any) -> str:
  return getattr(x.sharding, "memory_kind", None) or DEVICE_KIND


def state_memory_kinds(state: TrainState) -> dict[str, str]:
  """Memory kind of every state group, read from the live arrays.

  Returns:
    e.g. {"params": "device", "opt_state": "pinned_host"}; a group whose leaves disagree
    reads "mixed(device,pinned_host)".
  """
  out = {}
  for group, tree in state._asdict().items():
    kinds = sorted({_leaf_kind(x) for x in jax.tree.leaves(tree)})
    out[group] = kinds[0] if len(kinds) == 1 else f"mixed({','.join(kinds)})"
  return out


def bytes_by_memory_kind(tree: Any) -> dict[str, int]:
  """Bytes held by the live arrays of `tree` in this process, per memory kind (all addressable shards)."""
  out: dict[str, int] = {}
  for x in jax.tree.leaves(tree):
    kind = _leaf_kind(x)
    out[kind] = out.get(kind, 0) + sum(int(s.data.nbytes) for s in x.addressable_shards)
  return out


def _entry_layout(hlo_text: str) -> str:
  """The `entry_computation_layout={...}` attribute of an HLO module header (balanced braces)."""
  key = "entry_computation_layout={"
  start = hlo_text.find(key)
  if start < 0:
    return ""
  depth, i = 1, start + len(key)
  while i < len(hlo_text) and depth:
    depth += {"{": 1, "}": -1}.get(hlo_text[i], 0)
    i += 1
  return hlo_text[start + len(key):i - 1]


def offload_evidence(lowered_text: str, compiled_text: str, host_kind: str = "pinned_host") -> dict[str, int]:
  """Counts the host-placement annotations a compiled step carries.

  Args:
    lowered_text: `jit(...).lower(...).as_text()` (StableHLO).
    compiled_text: `lowered.compile().as_text()` (optimised HLO).
    host_kind: the host memory kind of the plan.
  Returns:
    lowered_host_args_results: entry arguments/results with `mhlo.memory_kind = "<host_kind>"`;
    lowered_host_placements: `annotate_device_placement` ops placing a value in host memory;
    compiled_host_entry_buffers: entry parameters/results in host memory space `S(5)`;
    compiled_host_buffers: every `S(5)` layout in the compiled module (GPU adds in-step copies).
    `unpinned_host` gets no S(5) on CPU (NUMERICS.md).
  """
  entry = _entry_layout(compiled_text)
  return {
      "lowered_host_args_results": lowered_text.count(f'mhlo.memory_kind = "{host_kind}"'),
      "lowered_host_placements": lowered_text.count(f'_xla_buffer_placement = "{host_kind}"'),
      "compiled_host_entry_buffers": entry.count("S(5)"),
      "compiled_host_buffers": compiled_text.count("S(5)"),
  }
