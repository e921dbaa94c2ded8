"""Where the train state lives: compiler-planned host offload through memory kinds.

The plan is expressed once, as shardings: every state leaf gets a `NamedSharding` on a
mesh with one axis, `data`, whose `memory_kind` is `device` or the plan's host kind
(`pinned_host` by default). The jitted step takes and returns the state with these
shardings (in/out shardings + donation); inside the step, `to_device` moves offloaded
groups into device memory before use, and the out shardings send the new values back
to the host. XLA plans the transfers; there is no hand-written copy loop.

The mesh has `plan.data_parallel` devices on its `data` axis; batches are split over
`data` along the micro-batch axis (`batch_sharding`). `plan.zero_stage` decides which
groups are sharded over `data` (`leaf_spec`, rule `parity.sizing.memory_jax.shard_axis`): 1 the
optimizer state, 2 also the gradients (a sharding constraint in the step, so XLA
reduce-scatters them), 3 also the params (FSDP; XLA all-gathers them where used). Host
offload combines with sharding: the memory kind sits on the same NamedSharding.

With `plan.offload_opt_ratio` r < 1 only part of the optimizer state is offloaded: the moments of the param leaves
`parity.sizing.memory_jax.opt_split` picks (DeepSpeed's ZeRO-Offload++ rule: the last leaves in parameter order, until
they hold r of the moment bytes) carry the host kind, the others `device`, leaf by leaf (`Placement.opt_host`,
`opt_host_mask`); the scalars stay in the host kind, as at r = 1. Every move below then moves the host leaves only.

With `plan.scan_layers` and `offload_params`, the layer-stacked params stay in host memory
through the forward and backward pass: `to_device` leaves the `LAYERS` subtree alone, and the
model moves each layer's slice to device inside the scan body (`model._params_to_device`).
Differentiated through that move, each layer's gradient slice would be born in host memory (JAX keeps a
cotangent in its primal's memory space, and a custom_vjp's cotangent must have its primal's type), to be
moved back for the update; the step instead differentiates with respect to a device anchor of the stack's
shape that nothing reads (`anchored_loss`, `model._anchor`), so the gradient is born on the device, with the
same values. With scan_layers the update is streamed
too (`jax_impl.stream`): one layer's params and moments come to the device at a time, so the
device never holds all offloaded state at once.

What CPU can and cannot show (docs/numerics.md): arrays really carry the memory kind, the
lowered StableHLO carries `mhlo.memory_kind = "pinned_host"` at the jit boundary, and the
compiled HLO marks those entry buffers with memory space 5 (`S(5)`); but in-jit
`device_put` lowers to nothing on CPU and `memory_analysis()` counts host buffers as
device bytes. GPU runs are the real test of placement.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from parity.sizing.memory_jax import opt_split, shard_axis
from parity.spec import JaxPlan, ModelSpec, RunSpec

from jax_impl.layout import flax_path

__all__ = ["TrainState", "Placement", "make_mesh", "make_placement", "materialize", "anchored_loss", "opt_host_paths",
           "map_param_trees", "state_memory_kinds", "bytes_by_memory_kind", "state_sharding_specs", "offload_evidence",
           "entry_buffers", "DATA_AXIS", "DEVICE_KIND", "LAYERS"]

DATA_AXIS = "data"
DEVICE_KIND = "device"
LAYERS = "h"
"""Params subtree stacked on a leading layer axis when scan_layers (= jax_impl.layout.LAYERS)."""

_SHARDED_FROM_STAGE = {"opt_state": 1, "grads": 2, "params": 3}


class TrainState(NamedTuple):
  """Everything a training step reads and replaces. Groups are placed independently."""
  params: Any  # Flax params pytree, float32 master weights
  opt_state: Any  # optax state of jax_impl.optim.make_optimizer (moments float32, counts int32)
  pending: Any = None  # jax_impl.stream.Pending of a deferred update (StreamOptions.deferred), else None


def make_mesh(devices: list[jax.Device] | None = None, data_parallel: int = 1) -> Mesh:
  """A 1-axis mesh (`data`) over `devices` (default: the first `data_parallel` local devices).

  Raises:
    ValueError: fewer than `data_parallel` local devices.
  """
  devs = list(devices) if devices else jax.local_devices()[:data_parallel]
  if len(devs) < data_parallel:
    raise ValueError(f"jax.data_parallel={data_parallel} needs {data_parallel} devices; this process has "
                     f"{len(devs)} ({jax.default_backend()}). On CPU, set XLA_FLAGS="
                     f"--xla_force_host_platform_device_count={data_parallel} before jax is imported "
                     "(the worker does this itself).")
  return Mesh(np.array(devs), (DATA_AXIS,))


def _is_stacked(path: tuple[Any, ...]) -> bool:
  return any(getattr(k, "key", None) == LAYERS for k in path)


def _path_name(path: tuple[Any, ...]) -> str:
  """'/'-joined keys of a params pytree path: 'h_0/attn/qkv/kernel', 'h/mlp/proj/kernel' (scan), 'wte/embedding'."""
  return "/".join(str(getattr(k, "key", k)) for k in path)


def map_param_trees(tree: Any, treedef: Any, fn: Callable[[Any], Any],
                    other: Callable[[Any], Any] = lambda x: x) -> Any:
  """Applies fn to every sub-tree of an optimizer-state-shaped `tree` (the state, or its shardings) whose structure is
  `treedef`, the params' (Adam's mu and nu), `other` to every other leaf (the scalars: counts, the clip's norm, the
  loss scale)."""
  is_params = lambda x: isinstance(x, dict) and jax.tree.structure(x) == treedef
  return jax.tree.map(lambda x: fn(x) if is_params(x) else other(x), tree, is_leaf=is_params)


@dataclasses.dataclass(frozen=True)
class Placement:
  """The memory plan of one run: mesh, memory kinds per state group, and the derived shardings.

  Attributes:
    mesh: the device mesh (axis `data`).
    plan: the JaxPlan (which groups are offloaded, to which host memory kind).
  """
  mesh: Mesh
  plan: JaxPlan
  opt_host: frozenset[str] | None = None
  """With part of the optimizer state offloaded (jax.offload_opt_ratio < 1, `opt_host_paths`): the params paths
  (`_path_name`) whose moments live in host memory, the others' on the device. None: every moment in
  `kind('opt_state')`."""

  def kind(self, group: str) -> str:
    """Memory kind between steps of a state group ('params' or 'opt_state'); gradients ('grads') stay on device. With
    part of the optimizer state offloaded, the kind of its offloaded part (and of its scalars): `opt_host_mask`."""
    offloaded = {"params": self.plan.offload_params, "opt_state": self.plan.offload_opt_state, "grads": False}[group]
    return self.plan.host_memory_kind if offloaded else DEVICE_KIND

  def opt_host_mask(self, params: Any) -> Any:
    """A tree like `params` of bools: whether that leaf's moments live in host memory between steps."""
    host = self.kind("opt_state") != DEVICE_KIND
    if self.opt_host is None:
      return jax.tree.map(lambda _: host, params)
    return jax.tree_util.tree_map_with_path(lambda p, _: host and _path_name(p) in self.opt_host, params)

  def sharded(self, group: str) -> bool:
    """Whether `group` ('params', 'opt_state' or 'grads') is sharded over `data` under the plan's stage."""
    return self.plan.zero_stage >= _SHARDED_FROM_STAGE[group] and self.mesh.shape[DATA_AXIS] > 1

  def leaf_spec(self, group: str, leaf: Any, stacked: bool = False) -> P:
    """PartitionSpec of one leaf: `data` on its `shard_axis` when the group is sharded, else replicated.

    Args:
      group: 'params', 'opt_state' or 'grads'.
      leaf: array or ShapeDtypeStruct.
      stacked: the leaf is scan-stacked (its layer axis 0 is never sharded).
    """
    if not self.sharded(group):
      return P()
    axis = shard_axis(tuple(leaf.shape), self.mesh.shape[DATA_AXIS], skip_leading=stacked)
    return P() if axis is None else P(*([None] * axis), DATA_AXIS)

  def group_shardings(self, group: str, tree: Any, kind: str | None = None) -> Any:
    """Pytree of NamedShardings (memory kind of `group`, or `kind`) matching `tree` (arrays or shapes)."""
    kind = kind or self.kind(group)
    spec = lambda path, x: self.leaf_spec(group, x, _is_stacked(path))
    return jax.tree_util.tree_map_with_path(lambda p, x: NamedSharding(self.mesh, spec(p, x), memory_kind=kind), tree)

  def state_shardings(self, state: TrainState) -> TrainState:
    """TrainState of shardings, each leaf in its group's memory kind (the moments each in theirs: `opt_host`)."""
    return TrainState(params=self.group_shardings("params", state.params),
                      opt_state=self.opt_shardings(state.opt_state, state.params))

  def opt_shardings(self, opt_state: Any, params: Any) -> Any:
    """Shardings of the optimizer state (arrays or shapes), its moments in the kind `opt_host_mask` gives each."""
    shardings = self.group_shardings("opt_state", opt_state)
    if self.opt_host is None:
      return shardings
    mask = self.opt_host_mask(params)
    on_device = lambda sub: jax.tree.map(lambda s, h: s if h else s.with_memory_kind(DEVICE_KIND), sub, mask)
    return map_param_trees(shardings, jax.tree.structure(params), on_device)

  def device_shardings(self, shardings: Any) -> Any:
    """The same shardings with memory kind `device` (the in-step working copies)."""
    return jax.tree.map(lambda s: s.with_memory_kind(DEVICE_KIND), shardings)

  def to_device(self, group: str, tree: Any, shardings: Any, keep_layers: bool = False) -> Any:
    """Inside jit: moves an offloaded group into device memory; identity for device groups.

    Args:
      keep_layers: leave the scan-stacked `LAYERS` subtree of the params where it is (the scan
        body moves one layer at a time); only with plan.scan_layers.
    """
    if self.kind(group) == DEVICE_KIND:
      return tree
    if keep_layers and self.plan.scan_layers and isinstance(tree, dict) and LAYERS in tree:
      rest = {k: v for k, v in tree.items() if k != LAYERS}
      moved = jax.device_put(rest, self.device_shardings({k: shardings[k] for k in rest}))
      return {**moved, LAYERS: tree[LAYERS]}
    return jax.device_put(tree, self.device_shardings(shardings))

  def batch_sharding(self) -> NamedSharding:
    """Sharding of a (accum, micro, seq + 1) batch: micro batches split over `data`, in device memory."""
    return NamedSharding(self.mesh, P(None, DATA_AXIS), memory_kind=DEVICE_KIND)

  def replicated(self) -> NamedSharding:
    """Device-memory replicated sharding (metrics, scalars)."""
    return NamedSharding(self.mesh, P(), memory_kind=DEVICE_KIND)


def opt_host_paths(model: ModelSpec, plan: JaxPlan) -> frozenset[str] | None:
  """The params paths (`_path_name`) whose moments the plan offloads (parity.sizing.memory_jax.opt_split), or None
  when it offloads all of them or none (one memory kind for the whole group, as at jax.offload_opt_ratio 1)."""
  split = opt_split(RunSpec(model=model, jax=plan))
  if not split.partial:
    return None
  out = set()
  for name in split.host:  # a scan-stacked 'h.*.X' is the leaf X under LAYERS
    path, _ = flax_path(name.replace("h.*.", "h.0.", 1))
    out.add("/".join((LAYERS, *path[1:]) if name.startswith("h.*.") else path))
  return frozenset(out)


def make_placement(plan: JaxPlan, mesh: Mesh | None = None, model: ModelSpec | None = None) -> Placement:
  """Builds the placement, checking that the devices expose the plan's host memory kind.

  Args:
    model: the model (which leaves a plan with jax.offload_opt_ratio < 1 offloads: `opt_host_paths`); needed only
      for such a plan.
  Raises:
    ValueError: a device of the mesh has no memory of kind `plan.host_memory_kind`; a partial offload without `model`.
  """
  mesh = mesh or make_mesh(data_parallel=plan.data_parallel)
  if plan.offload_params or plan.offload_opt_state:
    for dev in mesh.devices.flat:
      kinds = {m.kind for m in dev.addressable_memories()}
      if plan.host_memory_kind not in kinds:
        raise ValueError(f"device {dev} has no {plan.host_memory_kind!r} memory (it has {sorted(kinds)}); "
                         "set jax.host_memory_kind to one of them or disable offload in the JaxPlan")
  if plan.offload_opt_state and plan.offload_opt_ratio < 1 and model is None:
    raise ValueError(f"jax.offload_opt_ratio {plan.offload_opt_ratio}: which moments go to the host depends on the "
                     "model; pass make_placement(model=)")
  opt_host = opt_host_paths(model, plan) if model is not None else None
  return Placement(mesh=mesh, plan=plan, opt_host=opt_host)


# ----------------------------------------------------------------------------- reporting


def _leaf_kind(x: Any) -> str:
  return getattr(x.sharding, "memory_kind", None) or DEVICE_KIND


def _groups(state: TrainState) -> list[tuple[str, Any]]:
  """The state's groups that hold arrays (a deferred update's `pending` only when there is one)."""
  return [(g, t) for g, t in state._asdict().items() if t is not None]


def state_memory_kinds(state: TrainState) -> dict[str, str]:
  """Memory kind of every state group, read from the live arrays.

  Returns:
    e.g. {"params": "device", "opt_state": "pinned_host"}; a group whose leaves disagree
    reads "mixed(device,pinned_host)".
  """
  out = {}
  for group, tree in _groups(state):
    kinds = sorted({_leaf_kind(x) for x in jax.tree.leaves(tree)})
    out[group] = kinds[0] if len(kinds) == 1 else f"mixed({','.join(kinds)})"
  return out


def state_sharding_specs(state: TrainState) -> dict[str, dict[str, int]]:
  """Per state group, how many live leaves are sharded over `data` and how many are replicated."""
  out = {}
  for group, tree in _groups(state):
    specs = [getattr(x.sharding, "spec", P()) for x in jax.tree.leaves(tree)]
    sharded = sum(DATA_AXIS in tuple(s) for s in specs)
    out[group] = {"sharded": sharded, "replicated": len(specs) - sharded}
  return out


def bytes_by_memory_kind(tree: Any, device: jax.Device | None = None) -> dict[str, int]:
  """Bytes held by the live arrays of `tree`, per memory kind.

  Args:
    tree: pytree of jax Arrays.
    device: count only the shards on this device (per-device bytes, what
      `parity.sizing.memory_jax.jax_state_bytes` predicts); None: all addressable shards of this process.
  """
  out: dict[str, int] = {}
  for x in jax.tree.leaves(tree):
    kind = _leaf_kind(x)
    shards = [s for s in x.addressable_shards if device is None or s.device == device]
    out[kind] = out.get(kind, 0) + sum(int(s.data.nbytes) for s in shards)
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


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_BUFFER = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\](\{[^}]*\})?")


def entry_buffers(compiled_text: str) -> tuple[list[tuple[int, bool]], list[tuple[int, bool]]]:
  """Entry parameters and results of a compiled module: (bytes per device, in host memory S(5)?) each.

  Parsed from `entry_computation_layout`, e.g. `(f32[64,32]{1,0:S(5)}, s32[]{:S(5)})->(...)`;
  sizes are per device (the SPMD-partitioned shapes).
  """
  layout = _entry_layout(compiled_text)
  if "->" not in layout:
    return [], []

  def parse(text: str) -> list[tuple[int, bool]]:
    out = []
    for dtype, dims, lay in _BUFFER.findall(text):
      n = _DTYPE_BYTES.get(dtype, 0)
      for d in filter(None, dims.split(",")):
        n *= int(d)
      out.append((n, "S(5)" in (lay or "")))
    return out

  args, results = layout.split("->", 1)
  return parse(args), parse(results)


def _group_moves(compiled_text: str, groups: dict[str, int], kept: list[int] | None
                 ) -> dict[str, dict[str, int]]:
  """Host bytes in/out per step of each state group, from the entry buffers (groups in argument order)."""
  args, results = entry_buffers(compiled_text)
  if kept is not None:  # jit drops unused arguments (e.g. the clip state's last norm) from the entry
    full: list[tuple[int, bool]] = [(0, False)] * (max(kept, default=-1) + 1)
    for i, buf in zip(sorted(kept), args):
      full[i] = buf
    args = full
  out, start = {}, 0
  for name, n in groups.items():
    host_in = sum(b for b, host in args[start:start + n] if host)
    host_out = sum(b for b, host in results[start:start + n] if host)
    out[name] = {"host_to_device_bytes": host_in, "device_to_host_bytes": host_out,
                 "moved_bytes_per_step": host_in + host_out}
    start += n
  return out


def offload_evidence(lowered_text: str, compiled_text: str, host_kind: str = "pinned_host",
                     groups: dict[str, int] | None = None, kept: list[int] | None = None) -> dict[str, Any]:
  """Counts the host-placement annotations a compiled step carries, and the bytes they move.

  Args:
    lowered_text: `jit(...).lower(...).as_text()` (StableHLO).
    compiled_text: `lowered.compile().as_text()` (optimised HLO).
    host_kind: the host memory kind of the plan.
    groups: state group -> number of leaves, in the step's argument (and result) order, e.g.
      {"params": 16, "opt_state": 37}; adds one entry per group with its host bytes per step.
    kept: indices of the flat arguments the executable kept (jit prunes unused ones); None: all.
  Returns:
    lowered_host_args_results: entry arguments/results with `mhlo.memory_kind = "<host_kind>"`;
    lowered_host_placements: `annotate_device_placement` ops placing a value in host memory;
    compiled_host_entry_buffers: entry parameters/results in host memory space `S(5)`;
    compiled_host_buffers: every `S(5)` layout in the compiled module (GPU adds in-step copies);
    per group (when `groups`): host_to_device_bytes (entry parameters in S(5)),
    device_to_host_bytes (entry results in S(5)) and their sum moved_bytes_per_step, per device.
    `unpinned_host` gets no S(5) on CPU (docs/numerics.md).
  """
  entry = _entry_layout(compiled_text)
  out: dict[str, Any] = {
      "lowered_host_args_results": lowered_text.count(f'mhlo.memory_kind = "{host_kind}"'),
      "lowered_host_placements": lowered_text.count(f'_xla_buffer_placement = "{host_kind}"'),
      "compiled_host_entry_buffers": entry.count("S(5)"),
      "compiled_host_buffers": compiled_text.count("S(5)"),
  }
  if groups:
    out.update(_group_moves(compiled_text, groups, kept))
  return out


PER_LEAF_BYTES = 1 << 30
"""Above this many bytes of output, `materialize` computes one leaf per program."""


def materialize(make: Callable[[], Any], shardings: Any) -> Any:
  """The pytree `make()` returns, placed by `shardings` (a pytree of shardings like it). Up to PER_LEAF_BYTES, one
  jitted program; above, one program per leaf (XLA drops the other leaves), so that the device never holds more than
  one leaf of a state bound for host memory: all of a 2 B-param model's fp32 moments (16 GB) would not fit a 16 GiB
  chip on their way to the host."""
  shapes = jax.eval_shape(make)
  if sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(shapes)) <= PER_LEAF_BYTES:
    return jax.jit(make, out_shardings=shardings)()
  flat, treedef = jax.tree.flatten(shardings)
  leaf = lambda i: jax.jit(lambda: jax.tree.leaves(make())[i], out_shardings=flat[i])()
  return jax.tree.unflatten(treedef, [leaf(i) for i in range(len(flat))])


def anchored_loss(loss: Callable, params: Any) -> tuple[Any, Callable]:
  """(params with the layer stack replaced by a device anchor of its shape, loss of those): differentiated, the
  gradient of the layer stack is born on the device (`jax_impl.model.GPT.anchored`), equal to the gradient with
  respect to the host stack itself, which the transpose of each layer's move would put in host memory."""
  host = {LAYERS: params[LAYERS]}
  anchor = jax.tree.map(lambda x: jax.numpy.zeros(x.shape, x.dtype), host[LAYERS])  # never read
  return {**params, LAYERS: anchor}, lambda p, micro: loss(p, micro, host)
