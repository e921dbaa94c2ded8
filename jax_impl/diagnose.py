"""JAX diagnose worker: `python -m jax_impl.diagnose run_dir/request.json --side jax`.

One step on the run's initial weights and `batches.npy[step]` (see `parity.diagnose`), written to
`run_dir/jax/diagnose.safetensors`:
  * forward taps of the first micro batch (`model.loss_and_taps`, the Flax `intermediates` collection);
  * `loss` and `grad/<param>`: `step.accumulate_grads` over all micro batches with `model.loss_fn`, the
    functions the training step uses (pre-clip, DeepSpeed's sum of grad(loss_i / A));
  * `update/<param>`: the params after one update of the real optax chain (`optim.make_optimizer`) from a
    fresh optimizer state whose schedule count is set to the request's `lr_step`, so the update applies
    `parity.schedule.train_lr(train, lr_step)` with the bias correction of a first Adam step (the torch
    worker does the same with a fresh torch AdamW).
Plants of this side (request `diagnose_plants`) are applied here: `no_causal_mask` (GPT.causal=False),
`transpose` (canonical weights transposed before `to_flax`), `decay_all` (every leaf in the decay mask).
"""
from __future__ import annotations

import os
import sys
from unittest import mock

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before jax is imported

from parity import diagnose as dg  # noqa: E402
from parity.protocol import SideIO, main_guard  # noqa: E402


def _with_schedule_count(opt_state, count: int):
  """The optimizer state with optax's schedule count (the lr position) set to `count`; Adam's own count stays."""
  import jax
  import jax.numpy as jnp
  import optax
  is_sched = lambda x: isinstance(x, optax.ScaleByScheduleState)
  return jax.tree.map(lambda s: s._replace(count=jnp.asarray(count, s.count.dtype)) if is_sched(s) else s,
                      opt_state, is_leaf=is_sched)


def _decay_all_mask(spec, scan_layers: bool = False):
  """Plant `decay_all`: a decay mask with every tensor decayed (norm scales, biases, embeddings)."""
  from parity.weights import param_shapes
  from jax_impl.model import tree_from_canonical
  return tree_from_canonical({n: True for n in param_shapes(spec)}, n_layers=spec.n_layers if scan_layers else None)


def _where_params(names, prefix: str, what: str) -> dict[str, str]:
  from jax_impl.model import flax_path
  out = {}
  for name in names:
    path, transposed = flax_path(name)
    out[f"{prefix}{name}"] = f"{what} params/{'/'.join(path)}" + (" ([in, out], transposed)" if transposed else "")
  return out


def run_side(io: SideIO) -> int:
  """Writes this side's diagnose tensors; returns the exit code (0)."""
  import jax
  import numpy as np
  import optax
  from jax_impl import model as model_lib
  from jax_impl import optim
  from jax_impl.step import accumulate_grads  # also sets jax_default_matmul_precision=highest

  req = dg.read_request(io.request, io.side)
  run = io.run
  dg.check_plan(run)
  spec, plants = run.model, req.plants
  canonical = dg.apply_weight_plants(io.init_params(), plants)
  batch = np.ascontiguousarray(io.batches()[req.step])  # (A, M, T + 1)
  dtype = model_lib.compute_dtype(run.train.precision)
  causal = not plants["no_causal_mask"]
  params = jax.device_put(model_lib.to_flax(canonical, spec))
  io.ready()

  _, taps = jax.jit(lambda p, x: model_lib.loss_and_taps(p, x, spec, dtype=dtype, causal=causal))(params, batch[0])
  loss = lambda p, x: model_lib.loss_fn(p, x, spec, dtype=dtype, causal=causal)
  loss_val, grads = jax.jit(lambda p, b: accumulate_grads(p, b, loss))(params, batch)
  if plants["decay_all"]:
    with mock.patch.object(optim, "decay_mask", _decay_all_mask):
      tx, schedule = optim.make_optimizer(spec, run.train)
  else:
    tx, schedule = optim.make_optimizer(spec, run.train)
  opt_state = _with_schedule_count(tx.init(params), req.lr_step)
  lr = float(schedule(optim.step_count_of(opt_state)))

  @jax.jit
  def update(p, g, s):
    updates, _ = tx.update(g, s, p)
    return optax.apply_updates(p, updates)

  new_params = update(params, grads, opt_state)

  taps = jax.device_get(taps)
  out = {model_lib.tap_name(loc): np.asarray(v) for loc, v in taps.items()}
  where = {model_lib.tap_name(loc): loc for loc in taps}
  out["loss"] = np.asarray(jax.device_get(loss_val), np.float32)
  where["loss"] = "step.accumulate_grads(model.loss_fn): mean over micro batches"
  names = dg.param_order(spec)
  g = model_lib.from_flax(grads, spec)
  p1 = model_lib.from_flax(new_params, spec)
  out.update({f"grad/{n}": g[n] for n in names})
  out.update({f"update/{n}": p1[n] for n in names})
  where.update(_where_params(names, "grad/", "gradient of"))
  where.update(_where_params(names, "update/", "optim.make_optimizer chain update of"))
  dg.write_outputs(io.out, out, where, dg.side_inputs(io.request, io.side))
  import flax
  io.finish("ok", versions={"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__},
            device=str(jax.devices()[0]),
            extra={"diagnose": {"step": req.step, "lr_step": req.lr_step, "lr": lr, "loss": float(out["loss"]),
                                "plants": plants, "tensors": len(out)}})
  return 0


def main(argv: list[str] | None = None) -> int:
  return main_guard(run_side, argv)


if __name__ == "__main__":
  sys.exit(main())
