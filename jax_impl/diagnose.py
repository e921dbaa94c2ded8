"""JAX diagnose worker: `python -m jax_impl.diagnose run_dir/request.json --side jax`.

One step on the run's initial weights and `batches.npy[step]` (see `parity.diagnose`), written to
`run_dir/jax/diagnose.safetensors`:
  * forward taps of the first micro batch (`model.loss_and_taps`, the Flax `intermediates` collection);
  * `loss` and `grad/<param>`: `step.accumulate_grads` over all micro batches with `model.loss_fn`, the
    functions the training step uses (pre-clip, DeepSpeed's sum of grad(loss_i / A));
  * `update/<param>`: the params after one update of the real optax chain (`optim.make_optimizer`) from a
    fresh optimizer state whose schedule count is set to the request's `lr_step`, so the update applies
    `parity.numerics.schedule.train_lr(train, lr_step)` with the bias correction of a first Adam step (the torch
    worker does the same with a fresh torch AdamW).
bf16/fp16: the step starts from the master weights rounded to the compute dtype and computes as
`jax_impl.step` does (the whole param tree cast at the top of the loss; fp16 with the loss scale, the
recorded gradient unscaled); the same step in fp32 on those weights goes to `diagnose.fp32.safetensors`.
Plants of this side (request `diagnose_plants`) are applied here: `no_causal_mask` (GPT.causal=False),
`transpose` (canonical weights transposed before `to_flax`), `decay_all` (every leaf in the decay mask).
"""
from __future__ import annotations

import dataclasses
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before jax is imported

import flax  # (after the environment above)
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_impl import model as model_lib
from jax_impl import layers, layout, loss_scaling
from jax_impl import optim
from jax_impl.step import accumulate_grads, example_batch, example_loss_kwargs  # (sets fp32 matmuls)
from parity.protocol import diagnose as dg
from parity.protocol.side import SideIO, main_guard
from parity.weights import master_weights


def _with_schedule_count(opt_state, count: int):
  """The optimizer state with optax's schedule count (the lr position) set to `count`; Adam's own count stays."""
  is_sched = lambda x: isinstance(x, optax.ScaleByScheduleState)
  return jax.tree.map(lambda s: s._replace(count=jnp.asarray(count, s.count.dtype)) if is_sched(s) else s,
                      opt_state, is_leaf=is_sched)


def _where_params(names, prefix: str, what: str) -> dict[str, str]:
  out = {}
  for name in names:
    path, transposed = layout.flax_path(name)
    out[f"{prefix}{name}"] = f"{what} params/{'/'.join(path)}" + (" ([in, out], transposed)" if transposed else "")
  return out


def _one_step(spec, train, canonical, batch, req, causal: bool, arrays=None):
  """Taps, loss, gradients and first update of one step in `train.precision`, as the training step computes them.

  bf16/fp16 follow `jax_impl.step._model_loss`: the whole fp32 param tree is cast to the compute dtype at the
  top of the loss (DeepSpeed's layout), so the gradient is the fp32 gradient of the rounded params. fp16
  multiplies the loss by the fresh optimizer state's loss scale and divides the recorded gradient by the scale
  the update used (`optim.loss_scaled`'s order).

  Args:
    spec: the model spec.
    train: the training spec; its precision picks the compute dtype.
    canonical: canonical float32 weights the step starts from (plants and master-weight rounding applied).
    batch: token ids (A, M, T + 1).
    req: the diagnose WorkerRequest (lr position, plants).
    causal: False only under the `no_causal_mask` plant.
    arrays: padded/packed only, the step's ExampleArrays (A, M, T): segment ids, positions and weights given to
      the model and loss as jax_impl.step gives them (`example_loss_kwargs`, with `req.data_plants`); the taps are
      those of the first micro batch.
  Returns:
    (tensors, where, lr): canonical tap name -> float32 numpy array, tap name -> Flax location, the update's lr.
  Raises:
    RuntimeError: fp16 only, the gradient overflowed at the initial loss scale (the update would be skipped).
  """
  dtype = model_lib.compute_dtype(train.precision)
  cast = lambda p: model_lib.cast_params(p, dtype)  # as jax_impl.step's loss does
  params = jax.device_put(layout.to_flax(canonical, spec))
  if arrays is not None:  # padded/packed: the training step's example arguments, its data plants applied
    batch = example_batch(batch, arrays)
    first = example_loss_kwargs(jax.tree.map(lambda a: a[0], batch), req.data_plants)
    taps_kw = {k: first[k] for k in ("segment_ids_bt", "positions_bt")}
    loss = lambda p, x: model_lib.loss_fn(cast(p), x["tokens"], spec, dtype=dtype, causal=causal,
                                          **example_loss_kwargs(x, req.data_plants))
  else:
    taps_kw = {}
    loss = lambda p, x: model_lib.loss_fn(cast(p), x, spec, dtype=dtype, causal=causal)
  tokens0 = batch["tokens"][0] if arrays is not None else batch[0]
  _, taps = jax.jit(lambda p, x, kw: model_lib.loss_and_taps(cast(p), x, spec, dtype=dtype, causal=causal, **kw))(
      params, tokens0, taps_kw)
  tx, schedule = _optimizer(spec, train, req.plants["decay_all"])
  opt_state = _with_schedule_count(tx.init(params), req.lr_step)
  lr = float(schedule(optim.step_count_of(opt_state)))
  fp16 = train.precision == "fp16"

  scale = loss_scaling.loss_scale_of(opt_state) if fp16 else None
  loss_val, grads = jax.jit(lambda p, b, m: accumulate_grads(p, b, loss, loss_multiplier=m))(params, batch, scale)

  @jax.jit
  def update(p, g, s):
    updates, new_s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), new_s

  new_params, new_state = update(params, grads, opt_state)
  if fp16:
    old_ls, new_ls = optim.loss_scale_state_of(opt_state), optim.loss_scale_state_of(new_state)
    if int(new_ls.last_overflow_iter) == int(old_ls.cur_iter):
      raise RuntimeError(f"fp16: the gradient overflowed at the initial loss scale {float(old_ls.scale):g}, so the "
                         "update would be skipped; diagnose another --step or lower train.initial_scale_power")
    grads = jax.tree.map(lambda x: x / new_ls.scale, grads)  # DeepSpeed unscales by the scale after its update
  out, where = _outputs(spec, taps, loss_val, grads, new_params)
  return out, where, lr


def _optimizer(spec, train, decay_all: bool):
  """optim.make_optimizer's (tx, schedule); under the `decay_all` plant with every tensor decayed."""
  return optim.make_optimizer(spec, dataclasses.replace(train, decay_mask="all") if decay_all else train)


def _outputs(spec, taps, loss_val, grads, new_params) -> tuple[dict, dict[str, str]]:
  """(tensors, where) of one diagnosed step: canonical tap name -> float32 numpy array (forward taps, 'loss',
  'grad/<param>', 'update/<param>') and tap name -> its Flax location."""
  taps = jax.device_get(taps)
  out = {layers.tap_name(loc): np.asarray(v, np.float32) for loc, v in taps.items()}
  where = {layers.tap_name(loc): loc for loc in taps}
  out["loss"] = np.asarray(jax.device_get(loss_val), np.float32)
  where["loss"] = "step.accumulate_grads(model.loss_fn): mean over micro batches"
  names = dg.param_order(spec)
  g = layout.from_flax(grads, spec)
  p1 = layout.from_flax(new_params, spec)
  out.update({f"grad/{n}": g[n] for n in names})
  out.update({f"update/{n}": p1[n] for n in names})
  where.update(_where_params(names, "grad/", "gradient of"))
  where.update(_where_params(names, "update/", "optim.make_optimizer chain update of"))
  return out, where


class JaxDiagnose:
  """`parity.protocol.diagnose.DiagnoseSide` of the JAX side."""

  def check(self, io: SideIO) -> None:
    dg.check_plan(io.run)  # unrolled layers, no remat

  def one_step(self, run, params, req, batch, arrays=None) -> dg.DiagnoseStep:
    """`_one_step` from the master weights rounded to the compute dtype, as `Trainer.build` does."""
    canonical = master_weights(params, run.train.precision)
    out, where, lr = _one_step(run.model, run.train, canonical, batch, req, not req.plants["no_causal_mask"],
                               arrays)
    return dg.DiagnoseStep(tensors=out, where=where, lr=lr, loss=float(out["loss"]))

  def versions(self) -> dict[str, str]:
    return {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__}

  def device(self) -> str:
    return str(jax.devices()[0])


def main(argv: list[str] | None = None) -> int:
  return main_guard(lambda io: dg.run_diagnose(io, JaxDiagnose()), argv)


if __name__ == "__main__":
  sys.exit(main())
