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
from jax_impl import optim
from jax_impl import offload as offload_lib
from jax_impl import remat as remat_lib
from jax_impl import stream as stream_lib
from jax_impl.offload import Placement, TrainState, make_placement

__all__ = ["accumulate_grads", "make_train_step", "make_eval_loss", "init_state", "Trainer"]

# fp32 parity on GPU: f32 matmuls must not silently use TF32 (shared/NUMERICS.md).
jax.config.update("jax_default_matmul_precision", "highest")

Metrics = dict[str, jax.Array]


def accumulate_grads(params: Any, batch_amtp1: jax.Array, loss: Callable[[Any, jax.Array], jax.Array],
                     grad_shardings: Any = None, grads_to_device: bool = False,
                     loss_multiplier: jax.Array | None = None) -> tuple[jax.Array, Any]:
  """Mean loss and averaged gradient over the micro batches, DeepSpeed style.

  Args:
    params: float32 params pytree (in device memory).
    batch_amtp1: token ids, shape (A, M, T + 1): A micro batches of M sequences.
    loss: (params, tokens (M, T + 1)) -> scalar float32 mean cross-entropy.
    grad_shardings: optional pytree of shardings for the accumulated gradient (ZeRO-2: sharded over
      `data`, so XLA reduce-scatters each micro batch's gradient instead of all-reducing it).
    grads_to_device: move each micro batch's gradient to device memory (params partly in host
      memory: the gradient of a host-resident input is born in host memory, the transpose of the
      in-scan move to device).
    loss_multiplier: fp16 only, float32 scalar m: differentiate (loss_i / A) * m, DeepSpeed's order
      (`engine.backward` divides by GAS, then the fp16 optimizer multiplies by the loss scale);
      m = loss scale, times inf to force an overflow. None: no multiply (fp32/bf16 unchanged).
  Returns:
    loss: float32 scalar, mean over the A micro-batch losses (nats, never scaled).
    grads: pytree like params, sum over micro batches of grad(m * loss_i / A), float32.
  """
  accum = batch_amtp1.shape[0]

  def scaled(p: Any, tokens_mtp1: jax.Array) -> tuple[jax.Array, jax.Array]:
    loss_i = loss(p, tokens_mtp1)
    out = loss_i / accum  # DeepSpeed: loss / gradient_accumulation_steps before backward
    return (out if loss_multiplier is None else out * loss_multiplier), loss_i

  grad_fn = jax.value_and_grad(scaled, has_aux=True)

  def body(carry: tuple[jax.Array, Any], tokens_mtp1: jax.Array) -> tuple[tuple[jax.Array, Any], None]:
    loss_sum, grads_acc = carry
    (_, loss_i), grads_i = grad_fn(params, tokens_mtp1)
    if grads_to_device:
      grads_i = jax.tree.map(lambda g: jax.device_put(g, jax.memory.Space.Device), grads_i)
    return (loss_sum + loss_i, constrain(jax.tree.map(jnp.add, grads_acc, grads_i))), None

  constrain = (lambda g: g) if grad_shardings is None else (
      lambda g: jax.lax.with_sharding_constraint(g, grad_shardings))
  zeros = lambda x: jnp.zeros(x.shape, x.dtype)  # in device memory, whatever the params' memory kind
  init = (jnp.zeros((), jnp.float32), constrain(jax.tree.map(zeros, params)))
  (loss_sum, grads), _ = jax.lax.scan(body, init, batch_amtp1)
  return loss_sum / accum, grads


StepFn = Callable[..., tuple[TrainState, Metrics]]


def make_train_step(run: RunSpec, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    placement: Placement, shardings: TrainState) -> StepFn:
  """The pure step for this run (not yet jitted).

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
  loss = _model_loss(run, placement)
  layers_on_host = run.jax.scan_layers and placement.kind("params") != "device"
  fp16 = run.train.precision == "fp16"
  ls_cfg = optim.LossScaleConfig.from_train(run.train) if fp16 else None
  streamed = stream_lib.streams_update(run)

  def train_step(state: TrainState, batch_amtp1: jax.Array,
                 overflow_factor: jax.Array | None = None) -> tuple[TrainState, Metrics]:
    grad_shd = placement.group_shardings("grads", state.params) if placement.sharded("grads") else None
    fwd_params = placement.to_device("params", state.params, shardings.params, keep_layers=True)
    if streamed:  # the moments stay where they are; the update streams them (jax_impl.stream)
      opt_state = stream_lib.scalars_to_device(placement, state.opt_state, state.params)
    else:
      opt_state = placement.to_device("opt_state", state.opt_state, shardings.opt_state)
    scale = optim.loss_scale_of(opt_state) if fp16 else None
    loss_val, grads = accumulate_grads(fwd_params, batch_amtp1, loss, grad_shd, grads_to_device=layers_on_host,
                                       loss_multiplier=None if scale is None else scale * overflow_factor)
    lr = schedule(optim.step_count_of(opt_state))
    old_ls = optim.loss_scale_state_of(opt_state)
    if streamed:  # one layer's params and moments on the device at a time (jax_impl.stream)
      params, opt_state = stream_lib.streamed_update(run, placement, grads, opt_state, state.params)
    else:
      params = placement.to_device("params", state.params, shardings.params)  # the update's working copy
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
    metrics = {"loss": loss_val, "grad_norm": optim.grad_norm_of(opt_state), "lr": lr}
    if fp16:
      new_ls = optim.loss_scale_state_of(opt_state)
      skipped = new_ls.last_overflow_iter == old_ls.cur_iter
      true_norm = metrics["grad_norm"] * (new_ls.scale / scale)  # the clip saw g / new scale (optim.loss_scaled)
      metrics.update(grad_norm=jnp.where(skipped, jnp.float32(jnp.inf), true_norm), loss_scale=scale,
                     skipped=skipped, at_min_scale=optim.overflow_at_minimum(old_ls, skipped, ls_cfg))
    return TrainState(params=params, opt_state=opt_state), metrics

  if fp16:
    return train_step
  return lambda state, batch_amtp1: train_step(state, batch_amtp1)


def _model_loss(run: RunSpec, placement: Placement, remat: bool = True) -> Callable[[Any, jax.Array], jax.Array]:
  """(params, tokens (M, T + 1)) -> mean cross-entropy, with the plan's layout, remat and per-layer moves.

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
            scan_layers=plan.scan_layers, layer_to_device=layer_to_device, host_memory_kind=plan.host_memory_kind)
  cast = lambda p: model_lib.cast_params(p, kw["dtype"])  # DeepSpeed's layout: the whole module in bf16/fp16
  if layer_to_device:  # the host-resident layer stack is cast per layer on the device, in the scan body (model)
    cast_rest = lambda p: {k: (v if k == model_lib.LAYERS else cast(v)) for k, v in p.items()}
    return lambda p, tokens_mtp1: model_lib.loss_fn(cast_rest(p), tokens_mtp1, run.model, **kw)
  return lambda p, tokens_mtp1: model_lib.loss_fn(cast(p), tokens_mtp1, run.model, **kw)


def make_eval_loss(run: RunSpec, placement: Placement, param_shardings: Any) -> Callable[[Any, jax.Array], jax.Array]:
  """eval_loss(params, val (E, M, T + 1) ints) -> float32 mean of the E micro-batch losses (nats)."""
  loss = _model_loss(run, placement, remat=False)

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
  opt_state = jax.jit(lambda: tx.init(zeros()), out_shardings=shardings.opt_state)()
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
  _factors: dict[bool, jax.Array] = dataclasses.field(default_factory=dict, repr=False)

  @classmethod
  def build(cls, run: RunSpec, canonical: dict[str, np.ndarray], mesh: jax.sharding.Mesh | None = None) -> "Trainer":
    """Maps the canonical weights, places the state and jits the functions (no compilation yet).

    bf16/fp16: the master weights start as the canonical weights rounded to the compute dtype, as
    DeepSpeed's do (`parity.weights.master_weights`).
    """
    placement = make_placement(run.jax, mesh)
    scan = run.jax.scan_layers
    canonical = weights.master_weights(canonical, run.train.precision)  # bf16/fp16: rounded, as DeepSpeed's
    tx, schedule = optim.make_optimizer(run.model, run.train, scan_layers=scan)
    state, shardings = init_state(placement, model_lib.to_flax(canonical, run.model, scan_layers=scan), tx)
    step = make_train_step(run, tx, schedule, placement, shardings)
    metrics_shd = placement.replicated()
    extra = (metrics_shd,) if run.train.precision == "fp16" else ()  # the overflow factor
    jit_step = jax.jit(step, in_shardings=(shardings, placement.batch_sharding(), *extra),
                       out_shardings=(shardings, metrics_shd), donate_argnums=(0,))
    jit_eval = jax.jit(make_eval_loss(run, placement, shardings.params),
                       in_shardings=(shardings.params, placement.batch_sharding()), out_shardings=metrics_shd)
    return cls(run=run, placement=placement, state=state, shardings=shardings, jit_step=jit_step, jit_eval=jit_eval)

  @property
  def compile_s(self) -> float:
    return float(sum(self.compile_times_s.values()))

  def compile(self, batch_shape: tuple[int, ...], val_shape: tuple[int, ...] | None, dtype: Any = np.uint16) -> None:
    """Lowers and compiles the step (and eval, when `val_shape`) for these batch shapes, timed."""
    batch_shd = self.placement.batch_sharding()
    t0 = time.perf_counter()
    extra = (jax.ShapeDtypeStruct((), jnp.float32, sharding=self.placement.replicated()),) if self.fp16 else ()
    traced = self.jit_step.trace(_abstract(self.state, self.shardings),
                                 jax.ShapeDtypeStruct(batch_shape, dtype, sharding=batch_shd), *extra)
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
                                         jax.ShapeDtypeStruct(val_shape, dtype, sharding=batch_shd)).compile()
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

  def step(self, batch_amtp1: np.ndarray, *, force_overflow: bool = False) -> dict[str, float | bool]:
    """Runs one optimizer step on a host batch (A, M, T + 1); returns host-synchronised metrics.

    Args:
      batch_amtp1: uint16 token ids (A, M, T + 1).
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
    batch = batch_amtp1 if isinstance(batch_amtp1, jax.Array) else jax.device_put(  # a multi-process batch is global
        np.ascontiguousarray(batch_amtp1), self.placement.batch_sharding())
    extra = (self._overflow_factor(force_overflow),) if self.fp16 else ()
    self.state, metrics = self.step_fn(self.state, batch, *extra)
    jax.block_until_ready((self.state, metrics))
    out = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if self.fp16:
      out["skipped"] = bool(out["skipped"])
      if out.pop("at_min_scale"):
        from parity.numerics.loss_scale import MSG_AT_MINIMUM, LossScaleAtMinimum
        ls = optim.loss_scale_state_of(self.state.opt_state)
        raise LossScaleAtMinimum(MSG_AT_MINIMUM.format(step=int(jax.device_get(ls.cur_iter)) - 1,
                                                       min_scale=self.run.train.min_loss_scale))
    return out

  def evaluate(self, val_emtp1: np.ndarray) -> float:
    """Validation loss (nats) of the current params on host micro batches (E, M, T + 1)."""
    val = val_emtp1 if isinstance(val_emtp1, jax.Array) else jax.device_put(
        np.ascontiguousarray(val_emtp1), self.placement.batch_sharding())
    return float(jax.device_get(self.eval_fn(self.state.params, val)))

  def poison(self) -> None:
    """Replaces every param with NaN, keeping each array's sharding and memory kind (fault injection)."""
    nan = lambda x: jax.device_put(np.full(x.shape, np.nan, x.dtype), x.sharding)
    self.state = self.state._replace(params=jax.tree.map(nan, self.state.params))

  def canonical_params(self) -> dict[str, np.ndarray]:
    """Current fp32 master params in the canonical (torch) layout."""
    return model_lib.from_flax(self.state.params, self.run.model, scan_layers=self.run.jax.scan_layers)

  def canonical_moments(self) -> dict[str, np.ndarray]:
    """Adam's bias-corrected per-element gradient RMS sqrt(nu / (1 - beta2^count)), canonical layout, float32.

    count is the number of Adam updates applied (fp16 overflow-skipped steps do not count); all zeros before
    the first update. Read by the params rule (parity.verdict.params.param_checks).
    """
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
    return model_lib.from_flax(nu, self.run.model, scan_layers=self.run.jax.scan_layers)
