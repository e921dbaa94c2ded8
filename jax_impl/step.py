"""The pure training step, the validation loss, and their ahead-of-time compilation.

    train_step(state, batch) -> (state, metrics)      jitted, donate_argnums=(0,)

`batch` is (grad_accum_steps, micro_batch_size, seq_len + 1) token ids. The step scans the
micro batches and sums the gradients of loss_i / grad_accum_steps, as DeepSpeed's engine
does (it divides each micro-batch loss by GAS before backward and accumulates .grad), then
applies the optimizer once. The reported loss is the mean of the micro-batch losses.

The JaxPlan shapes the step without changing its arithmetic: `remat` wraps each block in a
jax.checkpoint policy (`jax_impl.remat`), `scan_layers` runs the blocks as one scan over
layer-stacked params (and, with offloaded state, streams the optimizer update one layer at a time:
`jax_impl.stream`), `offload_*` place state groups in host memory (`jax_impl.offload`), and
`zero_stage` / `data_parallel` shard the state over the mesh's `data` axis (stage 2 adds a
sharding constraint on the accumulated gradients). Every plan gives the default plan's loss
to fp32 rounding (tests/test_jax_plans*.py).

`Trainer` is the thin stateful shell the worker drives: it owns the live state, feeds
batches, and reads metrics; the arithmetic is all in `train_step`.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from parity import weights

from parity.numerics import schedule as schedule_ref
from parity.spec import RunSpec

from jax_impl import model as model_lib
from jax_impl import layout
from jax_impl import optim
from jax_impl import loss_scaling
from jax_impl import offload as offload_lib
from jax_impl import remat as remat_lib
from jax_impl import accelerator_plants, residual_plant
from jax_impl import stream as stream_lib
from jax_impl.offload import Placement, TrainState, make_placement
from parity.numerics.loss_scale import MSG_AT_MINIMUM, LossScaleAtMinimum
from parity.protocol.layout import PLACEMENT_PLANT_KEYS

PLACEMENT_PLANT = PLACEMENT_PLANT_KEYS[0]
"""'placement_device': the planted mismatch of `Trainer.build`."""

__all__ = ["accumulate_grads", "make_train_step", "make_eval_loss", "init_state", "Trainer", "example_batch",
           "example_loss_kwargs"]

# fp32 parity on GPU: f32 matmuls must not silently use TF32 (docs/numerics.md).
jax.config.update("jax_default_matmul_precision", "highest")

Metrics = dict[str, jax.Array]


def accumulate_grads(params: Any, batch_amtp1: jax.Array, loss: Callable[[Any, jax.Array], jax.Array],
                     grad_shardings: Any = None, loss_multiplier: jax.Array | None = None) -> tuple[jax.Array, Any]:
  """Mean loss and averaged gradient over the micro batches, DeepSpeed style.

  Args:
    params: float32 params pytree (in device memory).
    batch_amtp1: token ids, shape (A, M, T + 1): A micro batches of M sequences; padded/packed: the dict
      `example_batch` makes (tokens (A, M, T + 1), segment_ids / positions int32 and weights float32 (A, M, T)).
    loss: (params, one micro batch of batch_amtp1) -> scalar float32 loss (the mean cross-entropy; padded/packed
      sum(weights * ce), weights = A * w so that the mean over micro batches is the step objective).
    grad_shardings: optional pytree of shardings for the accumulated gradient (ZeRO-2: sharded over
      `data`, so XLA reduce-scatters each micro batch's gradient instead of all-reducing it).
    loss_multiplier: fp16 only, float32 scalar m: differentiate (loss_i / A) * m, DeepSpeed's order
      (`engine.backward` divides by GAS, then the fp16 optimizer multiplies by the loss scale);
      m = loss scale, times inf to force an overflow. None: no multiply (fp32/bf16 unchanged).
  Returns:
    loss: float32 scalar, mean over the A micro-batch losses (nats, never scaled).
    grads: pytree like params, sum over micro batches of grad(m * loss_i / A), float32.
  """
  accum = jax.tree.leaves(batch_amtp1)[0].shape[0]

  def scaled(p: Any, tokens_mtp1: Any) -> tuple[jax.Array, jax.Array]:
    loss_i = loss(p, tokens_mtp1)
    out = loss_i / accum  # DeepSpeed: loss / gradient_accumulation_steps before backward
    return (out if loss_multiplier is None else out * loss_multiplier), loss_i

  grad_fn = jax.value_and_grad(scaled, has_aux=True)

  def body(carry: tuple[jax.Array, Any], tokens_mtp1: Any) -> tuple[tuple[jax.Array, Any], None]:
    loss_sum, grads_acc = carry
    (_, loss_i), grads_i = grad_fn(params, tokens_mtp1)
    return (loss_sum + loss_i, constrain(jax.tree.map(jnp.add, grads_acc, grads_i))), None

  constrain = (lambda g: g) if grad_shardings is None else (
      lambda g: jax.lax.with_sharding_constraint(g, grad_shardings))
  zeros = lambda x: jnp.zeros(x.shape, x.dtype)  # in device memory, whatever the params' memory kind
  init = (jnp.zeros((), jnp.float32), constrain(jax.tree.map(zeros, params)))
  (loss_sum, grads), _ = jax.lax.scan(body, init, batch_amtp1)
  return loss_sum / accum, grads


StepFn = Callable[..., tuple[TrainState, Metrics]]


def make_train_step(run: RunSpec, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    placement: Placement, shardings: TrainState, plants: frozenset = frozenset()) -> StepFn:
  """The pure step for this run (not yet jitted); `plants`: this side's planted data bugs (`_micro_loss`).

  Returns:
    fp32/bf16: train_step(state, batch (A, M, T + 1) ints) -> (new state, metrics), where metrics
    holds float32 scalars `loss` (mean over micro batches, nats), `grad_norm` (global L2 norm of
    the averaged gradient before clipping) and `lr` (learning rate applied by this update).

    fp16: train_step(state, batch, overflow_factor) with overflow_factor a float32 scalar (1 normally,
    inf to force this step's gradient to overflow: it multiplies the scaled loss, so one executable
    serves both). The loss is multiplied by the loss scale of the state (`optim.loss_scaled`); metrics
    add `loss_scale` (the scale this step used), `skipped` (bool: the gradient overflowed and the
    update was skipped) and `at_min_scale` (bool: an overflow at train.min_loss_scale, where DeepSpeed
    raises; `Trainer.step` raises). On a skipped step `grad_norm` is inf and `lr` the rate the update
    would have applied (the next step repeats it), as DeepSpeed reports them.
  """
  loss = _model_loss(run, placement, plants=plants)
  layers_on_host = run.jax.scan_layers and placement.kind("params") != "device"
  fp16 = run.train.precision == "fp16"
  ls_cfg = optim.LossScaleConfig.from_train(run.train) if fp16 else None
  streamed = stream_lib.streams_update(run)
  deferred = stream_lib.defers_update(run)

  def train_step(state: TrainState, batch_amtp1: jax.Array,
                 overflow_factor: jax.Array | None = None) -> tuple[TrainState, Metrics]:
    if deferred:  # the previous step's update first, layer by layer (jax_impl.stream.StreamOptions.deferred)
      state = stream_lib.apply_pending(run, placement, state, plants)
    grad_shd = placement.group_shardings("grads", state.params) if placement.sharded("grads") else None
    fwd_params = placement.to_device("params", state.params, shardings.params, keep_layers=True)
    if streamed:  # the moments stay where they are; the update streams them (jax_impl.stream)
      opt_state = stream_lib.scalars_to_device(placement, state.opt_state, state.params)
    else:
      opt_state = placement.to_device("opt_state", state.opt_state, shardings.opt_state)
    scale = loss_scaling.loss_scale_of(opt_state) if fp16 else None
    diff_params, diff_loss = offload_lib.anchored_loss(loss, fwd_params) if layers_on_host else (fwd_params, loss)
    loss_val, grads = accumulate_grads(diff_params, batch_amtp1, diff_loss, grad_shd,
                                       loss_multiplier=None if scale is None else scale * overflow_factor)
    lr = schedule(optim.step_count_of(opt_state))
    old_ls = optim.loss_scale_state_of(opt_state)
    if deferred:  # this step's update is the next step's first work; the state goes out as it came in
      return stream_lib.hand_on(run, state, grads, opt_state, {"loss": loss_val, "lr": lr})
    if streamed:  # one layer's params and moments on the device at a time (jax_impl.stream)
      params, opt_state = stream_lib.streamed_update(run, placement, grads, opt_state, state.params, plants)
    else:
      params = placement.to_device("params", state.params, shardings.params)  # the update's working copy
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, accelerator_plants.scaled_updates(updates))
    metrics = {"loss": loss_val, "grad_norm": optim.grad_norm_of(opt_state), "lr": lr}
    if fp16:
      new_ls = optim.loss_scale_state_of(opt_state)
      skipped = new_ls.last_overflow_iter == old_ls.cur_iter
      true_norm = metrics["grad_norm"] * (new_ls.scale / scale)  # the clip saw g / new scale (optim.loss_scaled)
      metrics.update(grad_norm=jnp.where(skipped, jnp.float32(jnp.inf), true_norm), loss_scale=scale,
                     skipped=skipped, at_min_scale=loss_scaling.overflow_at_minimum(old_ls, skipped, ls_cfg))
    return TrainState(params=params, opt_state=opt_state), metrics

  if fp16:
    return train_step
  return lambda state, batch_amtp1: train_step(state, batch_amtp1)


def _model_loss(run: RunSpec, placement: Placement, remat: bool = True,
                plants: frozenset = frozenset()) -> Callable[[Any, jax.Array], jax.Array]:
  """(params, tokens (M, T + 1)) -> mean cross-entropy, with the plan's layout, remat and per-layer moves (and this
  side's planted data bugs, `_micro_loss`).

  bf16/fp16 use DeepSpeed's layout: the whole fp32 param tree is cast to the compute dtype at the top of the
  loss (LayerNorm weights and embeddings included), so a weight used twice (the tied embedding) sums its
  two gradients in the compute dtype, and the cast's transpose hands the optimizer an fp32 gradient of
  the rounded value, as DeepSpeed copies its bf16/fp16 grads into the fp32 master partition. Measured on
  gpt2-tiny bf16 (30 steps) against the torch baseline (which casts its module the same way): Flax's
  per-layer casts instead (fp32 params, `dtype=bfloat16`) were 5x further off in rms |Δloss| (1.1e-3 vs
  2.2e-4) and 3x in grad norm.
  """
  plan = run.jax
  layer_to_device = plan.scan_layers and placement.kind("params") != "device"
  kw = dict(dtype=model_lib.compute_dtype(run.train.precision), remat=plan.remat if remat else "none",
            scan_layers=plan.scan_layers, layer_to_device=layer_to_device, host_memory_kind=plan.host_memory_kind,
            stale_residual=remat and residual_plant.STALE_RESIDUAL in plants)  # planted: jax_impl.residual_plant
  cast = lambda p: model_lib.cast_params(p, kw["dtype"])  # DeepSpeed's layout: the whole module in bf16/fp16
  if layer_to_device:  # the host-resident layer stack is cast per layer on the device, in the scan body (model)
    cast_rest = lambda p: {k: (v if k == layout.LAYERS else cast(v)) for k, v in p.items()}
    return lambda p, micro, host=None: _micro_loss(cast_rest(p), micro, run, {**kw, "host_layers": host}, plants)
  return lambda p, micro: _micro_loss(cast(p), micro, run, kw, plants)



EXAMPLE_KEYS = ("segment_ids", "positions", "weights")
"""The arrays a padded/packed micro batch carries beside its tokens (parity.protocol.side.ExampleArrays)."""


def _micro_loss(params: Any, micro: Any, run: RunSpec, kw: dict, plants: frozenset = frozenset()) -> jax.Array:
  """loss_fn of one micro batch: tokens (M, T + 1) as always (stream), or `example_batch`'s dict sliced to one
  micro batch: segment ids, positions and weights given to loss_fn (docs/data-examples.md "The model level"),
  with this side's planted data bugs (`example_loss_kwargs`)."""
  if not isinstance(micro, dict):
    return model_lib.loss_fn(params, micro, run.model, **kw)
  return model_lib.loss_fn(params, micro["tokens"], run.model, **example_loss_kwargs(micro, plants), **kw)


def example_loss_kwargs(micro: dict[str, Any], plants: frozenset = frozenset()) -> dict[str, Any]:
  """loss_fn's example arguments of one `example_batch` micro batch (segment_ids_bt, positions_bt, weights_bt,
  label_shift), with the planted data bugs `plants` (parity.protocol.layout.PLANT_KEYS) applied as the torch side
  applies them (torch_impl.model.micro_loss): attention_mask_dropped gives the model no segment ids (causal over
  the row), positions_not_restarted no positions (0..T-1), labels_shifted_twice label_shift=2."""
  return {"segment_ids_bt": None if "attention_mask_dropped" in plants else micro["segment_ids"],
          "positions_bt": None if "positions_not_restarted" in plants else micro["positions"],
          "weights_bt": micro["weights"], "label_shift": 2 if "labels_shifted_twice" in plants else 1}


def example_batch(tokens: Any, arrays: Any) -> dict[str, Any]:
  """The padded/packed batch pytree: {'tokens', 'segment_ids', 'positions', 'weights'} from the token batch and
  an ExampleArrays (numpy or global jax.Arrays; int32, int32, float32)."""
  return {"tokens": tokens, **{k: getattr(arrays, k) for k in EXAMPLE_KEYS}}


def _abstract_batch(shape: tuple[int, ...], dtype: Any, sharding: Any, examples: bool) -> Any:
  """The abstract step/eval input: token ids `shape`, with examples the `example_batch` dict."""
  tokens = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  if not examples:
    return tokens
  inner = tuple(shape[:-1]) + (shape[-1] - 1,)
  types = {"segment_ids": jnp.int32, "positions": jnp.int32, "weights": jnp.float32}
  return {"tokens": tokens, **{k: jax.ShapeDtypeStruct(inner, types[k], sharding=sharding) for k in EXAMPLE_KEYS}}


def make_eval_loss(run: RunSpec, placement: Placement, param_shardings: Any,
                   plants: frozenset = frozenset()) -> Callable[[Any, jax.Array], jax.Array]:
  """eval_loss(params, val (E, M, T + 1) ints) -> float32 mean of the E micro-batch losses (nats), with this side's
  model-level plants (`_micro_loss`)."""
  loss = _model_loss(run, placement, remat=False, plants=plants)

  def eval_loss(params: Any, val_emtp1: jax.Array) -> jax.Array:
    params = placement.to_device("params", params, param_shardings, keep_layers=True)
    losses_e = jax.lax.map(lambda tokens: loss(params, tokens), val_emtp1)
    return jnp.mean(losses_e)

  return eval_loss


def init_state(placement: Placement, params_np: Any, tx: optax.GradientTransformation) -> tuple[TrainState, TrainState]:
  """Places the params and a fresh optimizer state where the plan says.

  Args:
    placement: the memory plan.
    params_np: Flax params pytree of float32 numpy arrays (`model.to_flax`).
    tx: the optimizer.
  Returns:
    (state, shardings): the live TrainState and the TrainState of its shardings.
  """
  params_abs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params_np)
  opt_abs = jax.eval_shape(tx.init, params_abs)
  shardings = placement.state_shardings(TrainState(params=params_abs, opt_state=opt_abs))
  params = jax.device_put(params_np, shardings.params)
  zeros = lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), params_abs)  # adam's init reads shapes only
  opt_state = offload_lib.materialize(lambda: tx.init(zeros()), shardings.opt_state)
  return TrainState(params=params, opt_state=opt_state), shardings


def _abstract(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _memory_analysis(compiled: Any) -> dict[str, int]:
  stats = compiled.memory_analysis()
  if stats is None:
    return {}
  return {k: int(getattr(stats, k)) for k in dir(stats)
          if not k.startswith("_") and isinstance(getattr(stats, k), (int, np.integer))}


@dataclasses.dataclass
class Trainer:
  """Live state plus the compiled step and eval of one run.

  Attributes:
    run: the resolved RunSpec.
    placement: mesh and memory kinds.
    state: the live TrainState (replaced by every step; the old one is donated).
    shardings: TrainState of shardings of `state`.
    jit_step, jit_eval: the jitted (not yet compiled) functions.
    step_fn, eval_fn: the AOT-compiled executables (after `compile`).
    compile_times_s: lower/compile wall seconds of each function.
    jaxpr_text, lowered_text, compiled_text: the train step's jaxpr (where CPU keeps in-jit memory
      moves and activation offload), StableHLO and optimised HLO.
    memory_analysis: numeric fields of the train step's `compiled.memory_analysis()`, bytes.
  """
  run: RunSpec
  placement: Placement
  state: TrainState
  shardings: TrainState
  jit_step: Any
  jit_eval: Any
  step_fn: Any = None
  eval_fn: Any = None
  compile_times_s: dict[str, float] = dataclasses.field(default_factory=dict)
  jaxpr_text: str = ""
  lowered_text: str = ""
  compiled_text: str = ""
  memory_analysis: dict[str, int] = dataclasses.field(default_factory=dict)
  tx: Any = None
  """The optax chain the step applies (the semantics card probes it: jax_impl.semantics)."""
  schedule: Any = None
  """Its learning-rate schedule: update count -> lr."""
  _factors: dict[bool, jax.Array] = dataclasses.field(default_factory=dict, repr=False)
  jit_settle: Any = None
  """Deferred update only: state -> the state with its pending update applied (`settle`)."""

  @classmethod
  def build(cls, run: RunSpec, canonical: dict[str, np.ndarray], mesh: jax.sharding.Mesh | None = None,
            plants: frozenset = frozenset()) -> "Trainer":
    """Maps the canonical weights, places the state and jits the functions (no compilation yet); `plants`: the
    side's planted data bugs (parity.protocol.layout.PLANT_KEYS; `_micro_loss`).

    bf16/fp16: the master weights start as the canonical weights rounded to the compute dtype, as
    DeepSpeed's do (`parity.weights.master_weights`). The planted mismatch 'placement_device'
    (parity.protocol.layout.PLACEMENT_PLANT_KEYS) builds the step with every offloaded group in device memory:
    the Trainer's run says so, the request's plan does not (jax_impl.placement checks the step against that one).
    """
    if PLACEMENT_PLANT in plants:
      run = dataclasses.replace(run, jax=dataclasses.replace(run.jax, offload_params=False, offload_opt_state=False,
                                                             offload_opt_ratio=1.0))
    placement = make_placement(run.jax, mesh, run.model)
    scan = run.jax.scan_layers
    canonical = weights.master_weights(canonical, run.train.precision)  # bf16/fp16: rounded, as DeepSpeed's
    tx, schedule = optim.make_optimizer(run.model, run.train, scan_layers=scan, plants=plants)
    state, shardings = init_state(placement, layout.to_flax(canonical, run.model, scan_layers=scan), tx)
    if stream_lib.defers_update(run):
      state, shardings = stream_lib.with_pending(placement, state, shardings)
    step = make_train_step(run, tx, schedule, placement, shardings, plants)
    metrics_shd = placement.replicated()
    extra = (metrics_shd,) if run.train.precision == "fp16" else ()  # the overflow factor
    jit_step = jax.jit(step, in_shardings=(shardings, placement.batch_sharding(), *extra),
                       out_shardings=(shardings, metrics_shd), donate_argnums=(0,))
    jit_eval = jax.jit(make_eval_loss(run, placement, shardings.params, plants),
                       in_shardings=(shardings.params, placement.batch_sharding()), out_shardings=metrics_shd)
    jit_settle = None
    if state.pending is not None:
      jit_settle = jax.jit(lambda st: stream_lib.settled(run, placement, st, plants), in_shardings=(shardings,),
                           out_shardings=shardings, donate_argnums=(0,))
    return cls(run=run, placement=placement, state=state, shardings=shardings, jit_step=jit_step, jit_eval=jit_eval,
               tx=tx, schedule=schedule, jit_settle=jit_settle)

  def settle(self) -> None:
    """Applies a deferred update still pending (`jax_impl.stream.StreamOptions.deferred`), so that the state holds
    the params and moments of every step taken; nothing to do otherwise. Everything that reads the state calls it."""
    if self.jit_settle is not None:
      self.state = self.jit_settle(self.state)

  @property
  def compile_s(self) -> float:
    return float(sum(self.compile_times_s.values()))

  def compile(self, batch_shape: tuple[int, ...], val_shape: tuple[int, ...] | None, dtype: Any = np.uint16,
              examples: bool = False) -> None:
    """Lowers and compiles the step (and eval, when `val_shape`) for these batch shapes, timed; examples: the
    inputs are `example_batch` dicts (padded/packed)."""
    batch_shd = self.placement.batch_sharding()
    t0 = time.perf_counter()
    extra = (jax.ShapeDtypeStruct((), jnp.float32, sharding=self.placement.replicated()),) if self.fp16 else ()
    traced = self.jit_step.trace(_abstract(self.state, self.shardings),
                                 _abstract_batch(batch_shape, dtype, batch_shd, examples), *extra)
    self.jaxpr_text = str(traced.jaxpr)
    lowered = traced.lower()
    t1 = time.perf_counter()
    self.step_fn = lowered.compile()
    t2 = time.perf_counter()
    self.compile_times_s.update(train_step_lower=t1 - t0, train_step_compile=t2 - t1)
    self.lowered_text, self.compiled_text = lowered.as_text(), self.step_fn.as_text()
    self.memory_analysis = _memory_analysis(self.step_fn)
    if val_shape is not None:
      t0 = time.perf_counter()
      self.eval_fn = self.jit_eval.lower(_abstract(self.state.params, self.shardings.params),
                                         _abstract_batch(val_shape, dtype, batch_shd, examples)).compile()
      self.compile_times_s["eval_compile"] = time.perf_counter() - t0

  def kept_args(self) -> list[int] | None:
    """Flat argument indices the compiled step kept (jit prunes unused inputs from the entry).

    Read from the executable's private `_kept_var_idx` (jax 0.10.2); None when it is unavailable.
    """
    kept = getattr(getattr(self.step_fn, "_executable", None), "_kept_var_idx", None)
    return None if kept is None else sorted(kept)

  def offload_evidence(self) -> dict[str, Any]:
    """Compiler evidence of the plan's offload (after `compile`), per offload option.

    Returns:
      `offload.offload_evidence` of the step with its per-option entries `offload_params` and
      `offload_opt_state` (host<->device bytes per step per device, from the S(5) entry buffers),
      plus `jaxpr_device_puts` (`remat.device_puts_in_jaxpr`): the in-jit moves that the CPU
      backend drops from the lowered text (activation offload, per-layer param moves).
    """
    groups = {"offload_params": len(jax.tree.leaves(self.state.params)),
              "offload_opt_state": len(jax.tree.leaves(self.state.opt_state))}
    ev = offload_lib.offload_evidence(self.lowered_text, self.compiled_text, self.run.jax.host_memory_kind,
                                      groups, self.kept_args())
    ev["jaxpr_device_puts"] = remat_lib.device_puts_in_jaxpr(self.jaxpr_text)
    return ev

  @property
  def fp16(self) -> bool:
    return self.run.train.precision == "fp16"

  def _overflow_factor(self, force: bool) -> jax.Array:
    """The fp16 step's overflow_factor input, placed once per value: 1, or inf to force an overflow."""
    if force not in self._factors:
      self._factors[force] = jax.device_put(np.float32(np.inf if force else 1.0), self.placement.replicated())
    return self._factors[force]

  def step(self, batch_amtp1: Any, *, force_overflow: bool = False) -> dict[str, float | bool]:
    """Runs one optimizer step on a host batch (A, M, T + 1); returns host-synchronised metrics.

    Args:
      batch_amtp1: uint16 or uint32 token ids (the dtype compile() was given) (A, M, T + 1); padded/packed: the
        `example_batch` dict (compiled with examples=True).
      force_overflow: fp16 only: make this step's scaled gradient non-finite inside the compiled
        step (debug `overflow_at_steps`); the update is skipped and the loss scale backs off.
    Returns:
      loss, grad_norm, lr (floats); fp16 adds loss_scale (float) and skipped (bool).
    Raises:
      ValueError: force_overflow on a run that is not fp16.
      parity.numerics.loss_scale.LossScaleAtMinimum: an overflow with the scale at train.min_loss_scale
        (DeepSpeed's DynamicLossScaler raises there); the state is already updated.
    """
    if force_overflow and not self.fp16:
      raise ValueError(f"force_overflow (debug overflow_at_steps) needs train.precision='fp16' (loss scaling); "
                       f"this run has train.precision={self.run.train.precision!r}")
    batch = self._place(batch_amtp1)
    extra = (self._overflow_factor(force_overflow),) if self.fp16 else ()
    self.state, metrics = self.step_fn(self.state, batch, *extra)
    jax.block_until_ready((self.state, metrics))
    out = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if self.fp16:
      out["skipped"] = bool(out["skipped"])
      if out.pop("at_min_scale"):
        ls = optim.loss_scale_state_of(self.state.opt_state)
        raise LossScaleAtMinimum(MSG_AT_MINIMUM.format(step=int(jax.device_get(ls.cur_iter)) - 1,
                                                       min_scale=self.run.train.min_loss_scale))
    return out

  def eval_loss(self, val_emtp1: Any) -> float:
    """Validation loss (nats) of the current params on host micro batches (E, M, T + 1) (padded/packed: an
    `example_batch` dict, weights summing to 1 per batch: the mean over batches of sum(w * ce))."""
    self.settle()
    return float(jax.device_get(self.eval_fn(self.state.params, self._place(val_emtp1))))

  def _place(self, batch: Any) -> Any:
    """A host batch (array or `example_batch` dict) on the batch sharding; global jax.Arrays as they are.

    A batch of host arrays only goes in one device_put call (one batched transfer): for a padded/packed dict of
    four arrays that costs about half the host CPU time of four calls (0.55 against 1.0 ms per step on gpt2-tiny,
    benchmarks/results/train_step_layouts.md), which at small shapes is several % of the step."""
    shd = self.placement.batch_sharding()
    if not any(isinstance(x, jax.Array) for x in jax.tree.leaves(batch)):
      return jax.device_put(jax.tree.map(np.ascontiguousarray, batch), shd)
    return jax.tree.map(lambda x: x if isinstance(x, jax.Array) else jax.device_put(np.ascontiguousarray(x), shd),
                        batch)

  def poison(self) -> None:
    """Replaces every param with NaN, keeping each array's sharding and memory kind (fault injection)."""
    self.settle()
    nan = lambda x: jax.device_put(np.full(x.shape, np.nan, x.dtype), x.sharding)
    self.state = self.state._replace(params=jax.tree.map(nan, self.state.params))

  def canonical_params(self) -> dict[str, np.ndarray]:
    """Current fp32 master params in the canonical (torch) layout."""
    self.settle()
    return layout.from_flax(self.state.params, self.run.model, scan_layers=self.run.jax.scan_layers)

  def canonical_moments(self) -> dict[str, np.ndarray]:
    """Adam's bias-corrected per-element gradient RMS sqrt(nu / (1 - beta2^count)), canonical layout, float32.

    count is the number of Adam updates applied (fp16 overflow-skipped steps do not count); all zeros before
    the first update. Read by the params rule (parity.verdict.params.param_checks).
    """
    self.settle()
    nu, count = optim.adam_second_moment(self.state.opt_state, self.run.train)  # KeyError: not an Adam
    count = int(jax.device_get(count))
    corr = 1.0 - float(schedule_ref.adam_beta2(self.run.train)) ** count if count > 0 else 1.0

    def rms(v: np.ndarray) -> np.ndarray:  # sqrt(max(v, 0) / corr) in float64, rounded once; in place, one buffer
      v64 = np.asarray(v).astype(np.float64)
      np.maximum(v64, 0.0, out=v64)
      np.divide(v64, corr, out=v64)
      return np.sqrt(v64, out=v64).astype(np.float32)

    # elementwise, so computed in the Flax layout and mapped after (the worker calls this every step; half the time
    # of mapping first and allocating per op, measured on gpt2-small-cpu; the values are bitwise the same)
    nu = jax.tree.map(rms, jax.device_get(nu))
    return layout.from_flax(nu, self.run.model, scan_layers=self.run.jax.scan_layers)
