"""The layer-streamed optimizer update: AdamW applied one layer at a time inside a `jax.lax.scan`.

With `scan_layers`, every block tensor is stacked on a leading layer axis under `LAYERS`, and so are
its Adam moments. When the params or the optimizer state live in host memory (`offload_params`,
`offload_opt_state`), the plain update (`optax` on the whole tree) makes XLA bring all of them to
the device at once: for a 7B model the 50 GiB of fp32 moments alone. This update instead:

  1. computes the whole-gradient quantities once, on the device-resident gradient
     (`optim.global_stats`: the pre-clip norm, and under fp16 the overflow flag);
  2. applies the same optax chain, built with those stats (`optim.make_optimizer(stats=)`), to the
     non-layer params (embeddings, final norm) as one sub-tree;
  3. scans over the layer axis: each iteration moves one layer's param and moment slices to device
     memory (`jax.device_put(..., jax.memory.Space.Device)`), updates them, and moves the results back
     to the group's memory space; the scan stacks them into the new state. Until the scan ends the new
     stacks sit beside the old ones, in the group's memory kind (host for offloaded groups; the
     memory model counts them, `parity.sizing.memory`).

Every transform of the chain except the clip's norm and the fp16 overflow check is elementwise, so
each slice gets the arithmetic the whole-tree update gives it (XLA may fuse it differently: measured
bit-identical in fp32 and fp16, within 1 ulp of the params in bf16); the scalars of the state
(Adam's count, the schedule's count, the clip's recorded norm, the loss scale) come out of every
sub-update identical, and are taken from the non-layer one. The device then holds one layer's
moments and params at a time (two with XLA's prefetch of the next slice), plus the gradient.

The moves are the same in-jit `device_put`s the forward pass uses for per-layer params
(`model._params_to_device`), so the same caveat holds: the CPU backend drops them from the lowered
program, and the jaxpr is where CPU shows them (`remat.device_puts_in_jaxpr`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from parity.spec import RunSpec

from jax_impl import accelerator_plants, optim
from jax_impl.offload import DEVICE_KIND, LAYERS, Placement, TrainState, map_param_trees as _map_param_trees

__all__ = ["StreamOptions", "OPTIONS", "Pending", "streams_update", "updates_in_place", "defers_update",
           "scalars_to_device", "streamed_update", "apply_pending", "hand_on", "with_pending", "settled"]


@dataclasses.dataclass(frozen=True)
class StreamOptions:
  """How the layer-streamed update is laid out for the compiler (never what it computes: every option gives the
  same numbers, tests/test_jax_stream_options.py). The defaults are the layout measured best on a TPU v5e
  (benchmarks/tpu_parts/offload.py); the others stay so that the benchmark can measure them again.

  Attributes:
    enabled: stream the update when the plan allows it (`streams_update`); False updates the whole tree at once
      (every offloaded moment comes to the device together: the layout that saves no device memory).
    unroll: the layer scan's unroll factor (`jax.lax.scan(unroll=)`): with 2 or more, one loop iteration holds
      several layers, so XLA's scheduler can bring the next layer's slices in while the current one is updated and
      sent back; 0 unrolls every layer.
    in_place: carry the host stacks through the scan and write each updated layer back into them
      (`dynamic_update_index_in_dim`) instead of stacking new outputs beside the donated old ones: the host then
      holds one copy of the offloaded state instead of two at the end of the update. None (the default) decides
      by the plan (`updates_in_place`): in place when the params are offloaded too, the plan whose size the host
      bounds (params and both moments: 12 bytes per parameter held once instead of twice); beside when only the
      optimizer state is.
    deferred: apply each step's update at the start of the next step instead of at its end (fp32/bf16, optimizer
      state offloaded, params on the device). The step computes the gradient and hands it on as `Pending`; the next
      step applies it layer by layer before its forward pass, and the moments it sends back to the host then have
      the whole forward and backward pass to travel in: nothing of this step waits for them. The arithmetic is the
      same update on the same gradient, norm and learning rate; `jax_impl.step.Trainer.settle` applies a pending
      update before anything reads the state (params, moments, eval, checkpoint).
    home_after_loop: keep each updated layer in device memory until the layer loop ends and send the stacks home
      in one copy after it (instead of one copy per layer inside the loop, which the loop waits for): the copy can
      then run beside whatever the step does next, at the cost of holding the new stacks on the device meanwhile.
  """
  enabled: bool = True
  unroll: int = 1
  in_place: bool | None = None
  deferred: bool = False
  home_after_loop: bool = False


OPTIONS = StreamOptions()
"""The layout the Trainer builds with (a benchmark may replace it before building a Trainer)."""


def streams_update(run: RunSpec) -> bool:
  """Whether the step updates the state layer by layer: scan_layers with params or optimizer state offloaded."""
  return OPTIONS.enabled and run.jax.scan_layers and (run.jax.offload_params or run.jax.offload_opt_state)


def updates_in_place(run: RunSpec) -> bool:
  """Whether the streamed update writes each layer back into the carried host stacks (`StreamOptions.in_place`;
  None: when the params are offloaded). parity.sizing.memory counts the host's second copy by the same rule."""
  return bool(run.jax.offload_params) if OPTIONS.in_place is None else OPTIONS.in_place


def defers_update(run: RunSpec) -> bool:
  """Whether the step hands its update on to the next step (`StreamOptions.deferred`): a streamed update of
  offloaded optimizer state with the params on the device, outside fp16 (whose loss scale the next forward pass
  needs already updated)."""
  return (OPTIONS.deferred and streams_update(run) and run.jax.offload_opt_state and not run.jax.offload_params
          and run.train.precision != "fp16")


class Pending(NamedTuple):
  """A step's update not yet applied (`StreamOptions.deferred`): its gradient, the stats the clip uses, and
  whether there is one (false before the first step and after `Trainer.settle`)."""
  grads: Any  # float32 pytree like the params, device memory
  grad_norm: jax.Array  # float32 scalar, pre-clip global norm of `grads`
  valid: jax.Array  # bool scalar


def _move(tree: Any, space: Any, host: Any = True) -> Any:
  """`tree` with its host-resident leaves moved to `space`: every leaf (host True), none (False), or those a tree of
  bools like `tree` marks (the moments of a partly offloaded optimizer state, `Placement.opt_host_mask`)."""
  if isinstance(host, bool):
    return jax.tree.map(lambda x: jax.device_put(x, space), tree) if host else tree
  return jax.tree.map(lambda x, h: jax.device_put(x, space) if h else x, tree, host)


def scalars_to_device(placement: Placement, opt_state: Any, params: Any) -> Any:
  """Inside jit: the optimizer state with its scalars (counts, clip norm, loss scale) in device memory and
  its params-shaped parts (the moments) left where they are; identity when the state is on the device."""
  if placement.kind("opt_state") == DEVICE_KIND:
    return opt_state
  return _map_param_trees(opt_state, jax.tree.structure(params), lambda t: t,
                          lambda x: jax.device_put(x, jax.memory.Space.Device))


def streamed_update(run: RunSpec, placement: Placement, grads: Any, opt_state: Any, params: Any,
                    plants: frozenset = frozenset(), stats: optim.GlobalStats | None = None,
                    apply: jax.Array | None = None) -> tuple[Any, Any]:
  """One optimizer update, the layer subtree streamed through device memory one layer at a time.

  Args:
    run: the resolved RunSpec (model and train specs for the optimizer; `streams_update(run)` true).
    placement: the memory plan (which groups live in host memory).
    grads: float32 gradient pytree (scan layout), in device memory; loss-scaled under fp16.
    opt_state: the `optim.make_optimizer` state: moments in their between-steps memory kind, scalars in
      device memory (`scalars_to_device`).
    params: the fp32 master params (scan layout), in their between-steps memory kind.
    plants: this side's planted bugs (`optim.make_optimizer`: 'decay_biases'), as the Trainer's own chain has them.
    stats: the whole gradient's stats when already computed (a deferred update carries the ones of its step);
      None computes them here.
    apply: bool scalar or None; false keeps every param and state value as it was (a deferred update with none
      pending), selected on the device before anything goes back to the host.
  Returns:
    (new params, new opt_state) in the same layout; the `LAYERS` subtree of each group is in that
    group's between-steps memory space (each moment in its own, `Placement.opt_host_mask`), the rest in device
    memory (the jit's out shardings place it).
  """
  full_def = jax.tree.structure(params)
  rest_of = lambda t: {k: v for k, v in t.items() if k != LAYERS}
  rest_def = jax.tree.structure(rest_of(params))
  params_host = placement.kind("params") != DEVICE_KIND
  opt_host = placement.opt_host_mask(params)  # per param leaf: its moments live in host memory
  to_device = lambda tree, host: _move(tree, jax.memory.Space.Device, host)
  to_home = lambda tree, host: _move(tree, jax.memory.Space.Host, host)

  stats = optim.global_stats(run.train, grads, opt_state) if stats is None else stats
  keep = (lambda new, old: new) if apply is None else (
      lambda new, old: jax.tree.map(lambda a, b: jnp.where(apply, a, b), new, old))
  tx, _ = optim.make_optimizer(run.model, run.train, scan_layers=True, stats=stats, plants=plants)

  # The non-layer params (embeddings, final norm) and their moments: one sub-tree update on the device.
  rest_params = to_device(rest_of(params), params_host)
  rest_state = _map_param_trees(opt_state, full_def, lambda t: to_device(rest_of(t), rest_of(opt_host)))
  updates, new_rest_state = tx.update(rest_of(grads), rest_state, rest_params)
  new_rest_params = keep(optax.apply_updates(rest_params, accelerator_plants.scaled_updates(updates)), rest_params)
  new_rest_state = keep(new_rest_state, rest_state)

  moments: list[Any] = []  # the layer subtree of each params-shaped part of the state, in tree order
  _map_param_trees(opt_state, full_def, lambda t: moments.append(t[LAYERS]))
  in_place = updates_in_place(run)
  home_after = OPTIONS.home_after_loop and not in_place  # the carried stacks are written layer by layer, at home
  update_layer = _layer_update(tx, opt_state, full_def, keep, (to_device, to_home), (params_host, opt_host[LAYERS]),
                               home_after)
  send_home = lambda new_p, new_m: (to_home(new_p, params_host), [to_home(m, opt_host[LAYERS]) for m in new_m])
  new_layers, new_moments = _layer_loop(update_layer, (grads[LAYERS], params[LAYERS], moments), in_place,
                                        send_home if home_after else None)
  stacked = iter(new_moments)
  new_state = _map_param_trees(new_rest_state, rest_def, lambda t: {**t, LAYERS: next(stacked)})
  return {**new_rest_params, LAYERS: new_layers}, new_state


def _layer_loop(update_layer: Callable, xs: tuple[Any, Any, list[Any]], in_place: bool,
                send_home: Callable | None) -> tuple[Any, list[Any]]:
  """The loop over the layer axis of (gradient, params, moment stacks): written back in place, or stacked as the
  scan's outputs (then `send_home`, when given, moves the new stacks home in one copy after the loop)."""
  grads_l, params_l, moments = xs
  n_layers = jax.tree.leaves(params_l)[0].shape[0]
  unroll = n_layers if OPTIONS.unroll == 0 else max(1, OPTIONS.unroll)
  if in_place:
    return _in_place_scan(update_layer, grads_l, params_l, moments, n_layers, unroll)
  # The new stacks are the scan's outputs, so they are new buffers beside the donated old ones until the scan
  # ends (parity.sizing.memory counts them); `in_place` writes each layer back into the carried stacks instead.
  body = lambda _, x: (None, update_layer(*x))
  _, (new_layers, new_moments) = jax.lax.scan(body, None, (grads_l, params_l, moments), unroll=unroll)
  return send_home(new_layers, new_moments) if send_home else (new_layers, new_moments)


def _layer_update(tx: Any, opt_state: Any, full_def: Any, keep: Callable, moves: tuple[Callable, Callable],
                  host: tuple[bool, Any], home_after: bool) -> Callable:
  """The update of one layer's slices: to the device, the chain's update (kept or not: `keep`), back home (or left
  on the device until the loop ends: `home_after`, from `StreamOptions.home_after_loop`). host: (the params live in
  host memory, a tree of bools like the layer params: which leaves' moments do)."""
  to_device, to_home = moves
  params_host, opt_host = host

  def update_layer(g_l: Any, p_l: Any, m_l: list[Any]) -> tuple[Any, list[Any]]:
    p_l = to_device(p_l, params_host)
    slices = iter([to_device(m, opt_host) for m in m_l])
    state_l = _map_param_trees(opt_state, full_def, lambda _t: {LAYERS: next(slices)})
    upd_l, new_state_l = tx.update({LAYERS: g_l}, state_l, {LAYERS: p_l})
    new_p_l = keep(optax.apply_updates({LAYERS: p_l}, accelerator_plants.scaled_updates(upd_l))[LAYERS], p_l)
    layer_def = jax.tree.structure({LAYERS: p_l})
    new_m_l: list[Any] = []
    _map_param_trees(new_state_l, layer_def, lambda t: new_m_l.append(t[LAYERS]))
    old_m_l: list[Any] = []
    _map_param_trees(state_l, layer_def, lambda t: old_m_l.append(t[LAYERS]))
    new_m_l = [keep(n, o) for n, o in zip(new_m_l, old_m_l)]
    if home_after:
      return new_p_l, new_m_l
    return to_home(new_p_l, params_host), [to_home(m, opt_host) for m in new_m_l]

  return update_layer


def _in_place_scan(update_layer: Callable, grads_l: Any, params_l: Any, moments: list[Any], n_layers: int,
                   unroll: int) -> tuple[Any, list[Any]]:
  """The layer loop with the param and moment stacks carried and each updated layer written back at its index."""
  index = lambda tree, i: jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), tree)
  put = lambda tree, new, i: jax.tree.map(lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y, i, 0), tree, new)

  def body(carry: tuple[Any, list[Any]], i: jax.Array) -> tuple[tuple[Any, list[Any]], None]:
    p_stack, m_stacks = carry
    new_p, new_m = update_layer(index(grads_l, i), index(p_stack, i), [index(m, i) for m in m_stacks])
    return (put(p_stack, new_p, i), [put(m, n, i) for m, n in zip(m_stacks, new_m)]), None

  (new_layers, new_moments), _ = jax.lax.scan(body, (params_l, moments), jax.numpy.arange(n_layers), unroll=unroll)
  return new_layers, new_moments


def apply_pending(run: RunSpec, placement: Placement, state: TrainState, plants: frozenset = frozenset()
                  ) -> TrainState:
  """Inside jit: the state with its pending update applied (where there is one) and none left pending.

  The same layer-streamed update as the step's own (`streamed_update`), on the carried gradient with the carried
  norm; `Pending.valid` false leaves every value as it was."""
  p = state.pending
  opt_state = scalars_to_device(placement, state.opt_state, state.params)
  stats = optim.GlobalStats(p.grad_norm, None)
  params, opt_state = streamed_update(run, placement, p.grads, opt_state, state.params, plants, stats=stats,
                                      apply=p.valid)
  return TrainState(params=params, opt_state=opt_state, pending=None)


def hand_on(run: RunSpec, state: TrainState, grads: Any, opt_state: Any, metrics: dict) -> tuple[TrainState, dict]:
  """Inside jit, a deferred step's end: the state as it came in, this step's gradient and norm pending, and the
  metrics with the norm (the one the clip will use when the next step applies the update)."""
  stats = optim.global_stats(run.train, grads, opt_state)
  pending = Pending(grads=grads, grad_norm=stats.grad_norm, valid=jnp.bool_(True))
  return (TrainState(params=state.params, opt_state=state.opt_state, pending=pending),
          {**metrics, "grad_norm": stats.grad_norm})


def with_pending(placement: Placement, state: TrainState, shardings: TrainState) -> tuple[TrainState, TrainState]:
  """The state and shardings with an empty `Pending` (zero gradient in device memory, not valid)."""
  grad_shd = placement.group_shardings("grads", state.params, kind=DEVICE_KIND)
  rep = placement.replicated()
  pending_shd = Pending(grads=grad_shd, grad_norm=rep, valid=rep)
  zeros = jax.jit(lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), state.params),
                  out_shardings=grad_shd)()
  pending = Pending(grads=zeros, grad_norm=jax.device_put(np.float32(0), rep),
                    valid=jax.device_put(np.bool_(False), rep))
  return state._replace(pending=pending), shardings._replace(pending=pending_shd)


def settled(run: RunSpec, placement: Placement, state: TrainState, plants: frozenset) -> TrainState:
  """Inside jit: `apply_pending`, with an empty Pending kept (same structure, not valid) for the next step."""
  p = state.pending
  out = apply_pending(run, placement, state, plants)
  return out._replace(pending=Pending(grads=p.grads, grad_norm=p.grad_norm, valid=jnp.bool_(False)))
