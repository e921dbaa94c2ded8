"""Predicted per-device bytes of the JAX side's training state, from the RunSpec alone (numpy only).

The JAX side (`jax_impl.offload`) holds, between steps:

  params      fp32 master weights: one leaf per canonical tensor, or with `jax.scan_layers` one
              leaf per block tensor stacked on a leading layer axis (L, *shape);
  opt_state   what `jax_impl.optim.make_optimizer` builds: the clip state's pre-clip grad norm
              (float32 scalar), Adam's `count` (int32 scalar), `mu` and `nu` (float32, shaped like
              the params), the masked weight decay (no arrays) and the schedule's `count` (int32
              scalar).

Each group lives in `device` memory or in `jax.host_memory_kind` (offload_params /
offload_opt_state). With `jax.offload_opt_ratio` r < 1 only part of the optimizer state is offloaded (`opt_split`,
DeepSpeed's ZeRO-Offload++ rule): the param leaves are walked in `param_leaves`' order and the moments of the last
ones go to the host until they hold at least r of the moment elements; the rest stay on the device, and the scalars
stay with the host part, where r = 1 keeps them. Sharding over the mesh's `data` axis (size `jax.data_parallel`) follows
`shard_axis`: optimizer-state leaves are sharded from ZeRO stage 1, params from stage 3, each on
its largest axis divisible by the axis size (the layer axis of stacked leaves excluded); every
other leaf, and every scalar, is replicated. A sharded leaf holds nbytes / data_parallel per
device. Gradients are not state (they live inside the step), so stage 2 changes nothing here.

`jax_state_bytes(run)` must equal, exactly, `jax_impl.offload.bytes_by_memory_kind(state, device)`
of the live arrays on one device (tests/test_jax_plans.py::test_predicted_state_bytes_equal_the_live_arrays).
"""
from __future__ import annotations

import dataclasses
import math

from parity.spec import RunSpec
from parity.weights import param_shapes

__all__ = ["shard_axis", "param_leaves", "state_leaf_shapes", "OptSplit", "opt_split", "jax_group_bytes",
           "jax_state_bytes", "DEVICE_KIND", "OPT_SCALARS"]

DEVICE_KIND = "device"

OPT_SCALARS = (("clip.grad_norm", 4), ("adam.count", 4), ("schedule.count", 4))
"""Scalar leaves of the optimizer state (name, bytes): float32 norm, int32 counts."""

_F32 = 4


def shard_axis(shape: tuple[int, ...], n: int, *, skip_leading: bool = False) -> int | None:
  """Axis on which a leaf is sharded over a data axis of size `n`, or None (replicated).

  The largest axis whose size is divisible by n (ties: the first); with `skip_leading` the
  leading axis (the layer axis of scan-stacked leaves) is never chosen, so each scan iteration
  reads a whole layer slice. Shared by `jax_impl.offload` and `jax_state_bytes`.

  >>> shard_axis((64, 32), 4), shard_axis((3, 32), 4, skip_leading=False), shard_axis((6,), 4)
  (0, 1, None)
  """
  if n <= 1:
    return None
  best = None
  for axis, size in enumerate(shape):
    if (axis == 0 and skip_leading) or size % n:
      continue
    if best is None or size > shape[best]:
      best = axis
  return best


def param_leaves(run: RunSpec) -> list[tuple[str, tuple[int, ...], bool]]:
  """(name, shape, stacked?) of each param leaf as the JAX side holds it, in the offload order of `opt_split`.

  The order is the canonical one (parity.weights.param_shapes: torch's model.parameters(), the order DeepSpeed's
  ZeRO-3 sub-groups follow): embeddings, block 0 .. block L-1, final norm, head. With scan_layers a block tensor is
  one leaf stacked over the layers, named 'h.*.<tensor>' (shape (L, *shape)), at the place of its block-0 tensor.
  Linear weights are transposed on the JAX side; a transpose changes neither the size nor which sizes are
  divisible, so canonical shapes are used.
  """
  shapes = param_shapes(run.model)
  if not run.jax.scan_layers:
    return [(name, shape, False) for name, shape in shapes.items()]
  out, seen = [], set()
  for name, shape in shapes.items():
    if not name.startswith("h."):
      out.append((name, shape, False))
      continue
    tensor = name.split(".", 2)[2]
    if tensor not in seen:
      seen.add(tensor)
      out.append((f"h.*.{tensor}", (run.model.n_layers, *shape), True))
  return out


def state_leaf_shapes(run: RunSpec) -> list[tuple[tuple[int, ...], bool]]:
  """(shape, stacked?) of each param leaf as the JAX side holds it (`param_leaves` without the names)."""
  return [(shape, stacked) for _, shape, stacked in param_leaves(run)]


@dataclasses.dataclass(frozen=True, slots=True)
class OptSplit:
  """Which param leaves' optimizer moments live in host memory between steps (`opt_split`)."""

  host: tuple[str, ...]
  """`param_leaves` names whose moments are offloaded, in that order (all of them at offload_opt_ratio 1, none
  without offload_opt_state)."""
  host_elements: int
  """Param elements of those leaves (each has one moment element per moment tree: Adam's mu and nu)."""
  total_elements: int
  """Param elements of every leaf."""
  layer_elements: int = 0
  """Of host_elements, those of block tensors (h.*): the part the streamed update moves one layer at a time."""

  @property
  def share(self) -> float:
    """The realised share of the moment bytes in host memory: host_elements / total_elements (>= the ratio asked,
    by less than the last leaf added)."""
    return self.host_elements / self.total_elements if self.total_elements else 0.0

  @property
  def partial(self) -> bool:
    """Some moments on the host and some on the device."""
    return 0 < self.host_elements < self.total_elements


def opt_split(run: RunSpec) -> OptSplit:
  """The optimizer-state leaves a plan offloads: DeepSpeed's ZeRO-Offload++ rule (offload_optimizer.ratio, stage3.py
  `_create_fp32_partitions`: sub-group i goes to the CPU when i >= int((1 - ratio) * n), the last share of the
  sub-groups in parameter order), per param leaf. The leaves are walked from the end of `param_leaves`' order and
  each is offloaded while the offloaded elements are below jax.offload_opt_ratio x all of them; so the realised share
  reaches the ratio, exceeds it by less than one leaf, and is everything at ratio 1."""
  leaves = param_leaves(run)
  total = sum(math.prod(shape) for _, shape, _ in leaves)
  if not run.jax.offload_opt_state:
    return OptSplit((), 0, total)
  target = run.jax.offload_opt_ratio * total
  host, moved, layers = [], 0, 0
  for name, shape, _ in reversed(leaves):
    if moved >= target:
      break
    host.append(name)
    moved += math.prod(shape)
    layers += math.prod(shape) if name.startswith("h.") else 0
  return OptSplit(tuple(reversed(host)), moved, total, layers)


def _leaf_bytes(shape: tuple[int, ...], n: int, sharded: bool, stacked: bool) -> int:
  size = _F32
  for d in shape:
    size *= d
  if sharded and shard_axis(shape, n, skip_leading=stacked) is not None:
    return size // n
  return size


def jax_group_bytes(run: RunSpec) -> dict[str, dict[str, int]]:
  """Bytes of each JAX state group held on ONE device, per memory kind: {'params': {kind: bytes}, 'opt_state':
  {kind: bytes}} (kinds holding no bytes left out). The optimizer state's moments are split by `opt_split`; its
  scalars are in the group's kind (the host kind when offload_opt_state)."""
  plan, n = run.jax, run.jax.data_parallel
  host = set(opt_split(run).host)
  leaves = param_leaves(run)
  params = sum(_leaf_bytes(s, n, plan.zero_stage >= 3, st) for _, s, st in leaves)
  moments = {name: 2 * _leaf_bytes(s, n, plan.zero_stage >= 1, st) for name, s, st in leaves}
  opt_kind = plan.host_memory_kind if plan.offload_opt_state else DEVICE_KIND
  opt = {opt_kind: sum(b for _, b in OPT_SCALARS)}
  for name, b in moments.items():
    kind = plan.host_memory_kind if name in host else DEVICE_KIND
    opt[kind] = opt.get(kind, 0) + b
  par_kind = plan.host_memory_kind if plan.offload_params else DEVICE_KIND
  return {"params": {par_kind: params} if params else {}, "opt_state": {k: v for k, v in opt.items() if v}}


def jax_state_bytes(run: RunSpec) -> dict[str, int]:
  """Bytes of the JAX train state held on ONE device, per memory kind.

  Args:
    run: the resolved run (model shapes; jax plan: offload flags and ratio, host kind, zero stage,
      data_parallel, scan_layers).
  Returns:
    memory kind -> bytes per device, e.g. {"device": 1_234, "pinned_host": 5_678}; only kinds
    that hold bytes appear (everything offloaded: no "device" key).
  """
  out: dict[str, int] = {}
  for by_kind in jax_group_bytes(run).values():
    for kind, b in by_kind.items():
      out[kind] = out.get(kind, 0) + b
  return {k: v for k, v in out.items() if v}
