"""Predicted per-device bytes of the JAX side's training state, from the RunSpec alone (numpy only).

The JAX side (`jax_impl.offload`) holds, between steps:

  params      fp32 master weights: one leaf per canonical tensor, or with `jax.scan_layers` one
              leaf per block tensor stacked on a leading layer axis (L, *shape);
  opt_state   what `jax_impl.optim.make_optimizer` builds: the clip state's pre-clip grad norm
              (float32 scalar), Adam's `count` (int32 scalar), `mu` and `nu` (float32, shaped like
              the params), the masked weight decay (no arrays) and the schedule's `count` (int32
              scalar).

Each group lives in `device` memory or in `jax.host_memory_kind` (offload_params /
offload_opt_state). Sharding over the mesh's `data` axis (size `jax.data_parallel`) follows
`shard_axis`: optimizer-state leaves are sharded from ZeRO stage 1, params from stage 3, each on
its largest axis divisible by the axis size (the layer axis of stacked leaves excluded); every
other leaf, and every scalar, is replicated. A sharded leaf holds nbytes / data_parallel per
device. Gradients are not state (they live inside the step), so stage 2 changes nothing here.

`jax_state_bytes(run)` must equal, exactly, `jax_impl.offload.bytes_by_memory_kind(state, device)`
of the live arrays on one device (tests/test_jax_plans.py::test_predicted_state_bytes_equal_the_live_arrays).
"""
from __future__ import annotations

from parity.spec import RunSpec
from parity.weights import param_shapes

__all__ = ["shard_axis", "state_leaf_shapes", "jax_state_bytes", "DEVICE_KIND", "OPT_SCALARS"]

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


def state_leaf_shapes(run: RunSpec) -> list[tuple[tuple[int, ...], bool]]:
  """(shape, stacked?) of each param leaf as the JAX side holds it (stacked per block when scan_layers).

  Linear weights are transposed on the JAX side; a transpose changes neither the size nor which
  sizes are divisible, so canonical shapes are used.
  """
  shapes = param_shapes(run.model)
  if not run.jax.scan_layers:
    return [(shape, False) for shape in shapes.values()]
  out, stacked = [], {}
  for name, shape in shapes.items():
    if name.startswith("h."):
      stacked.setdefault(name.split(".", 2)[2], shape)
    else:
      out.append((shape, False))
  return out + [((run.model.n_layers, *shape), True) for shape in stacked.values()]


def _leaf_bytes(shape: tuple[int, ...], n: int, sharded: bool, stacked: bool) -> int:
  size = _F32
  for d in shape:
    size *= d
  if sharded and shard_axis(shape, n, skip_leading=stacked) is not None:
    return size // n
  return size


def jax_state_bytes(run: RunSpec) -> dict[str, int]:
  """Bytes of the JAX train state held on ONE device, per memory kind.

  Args:
    run: the resolved run (model shapes; jax plan: offload flags, host kind, zero stage,
      data_parallel, scan_layers).
  Returns:
    memory kind -> bytes per device, e.g. {"device": 1_234, "pinned_host": 5_678}; only kinds
    that hold bytes appear (everything offloaded: no "device" key).
  """
  plan, n = run.jax, run.jax.data_parallel
  leaves = state_leaf_shapes(run)
  params = sum(_leaf_bytes(s, n, plan.zero_stage >= 3, st) for s, st in leaves)
  moments = sum(_leaf_bytes(s, n, plan.zero_stage >= 1, st) for s, st in leaves)
  opt = 2 * moments + sum(b for _, b in OPT_SCALARS)
  out: dict[str, int] = {}
  for group_bytes, offloaded in ((params, plan.offload_params), (opt, plan.offload_opt_state)):
    kind = plan.host_memory_kind if offloaded else DEVICE_KIND
    out[kind] = out.get(kind, 0) + group_bytes
  return {k: v for k, v in out.items() if v}

