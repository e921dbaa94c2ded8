"""Offload must not change the arithmetic: every JAX plan that offloads (Adam moments, params, saved residuals) against
the same plan with everything in device memory, after a few fp32 steps, params and Adam moments compared element by
element.

    offload_equality(plans, steps) -> [{plan, reference, max_abs_param_diff, max_abs_moment_diff, bitwise, ...}]

The reference of a plan is the plan with offload_opt_state (at ratio 1) and offload_params off and an offload remat
policy replaced by its twin that saves the same residuals in device memory (`reference_plan`,
jax_impl.remat.DEVICE_COUNTERPART: the same recompute, so the same program but for the moves); scan_layers,
zero_stage, data_parallel and the rest stay, so the two steps differ only in where the state and the residuals live.
On CPU an in-jit move to host memory lowers to nothing, so there the comparison checks that the offload's program
structure (the layer-streamed update, the per-layer param moves) leaves the values alone; on a TPU or GPU the moves
are real and the same call checks the transfers too (a wrong or stale buffer shows as a difference). Measured on CPU
(tests/test_jax_plans.py): every offload plan of parity.sizing.plans.PLANS, with and without scan_layers, bitwise.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import numpy as np
import optax

from parity.spec import JaxPlan, ModelSpec, RunSpec, TrainSpec
from parity.weights import init_params

from jax_impl import layout, optim, remat
from jax_impl.step import Trainer

__all__ = ["MODEL", "TRAIN", "offloads", "reference_plan", "offload_plans", "offload_equality"]

MODEL = ModelSpec(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, norm="rmsnorm",
                  mlp="swiglu", position="rope", bias=False, tie_embeddings=False, d_ff=48)
"""A two-layer LLaMA-style model (a scan of two iterations; the small sizes keep each compile to seconds on CPU)."""
TRAIN = TrainSpec(steps=3, micro_batch_size=2, grad_accum_steps=2, seq_len=8, warmup_steps=1, lr=1e-2, eval_every=0,
                  precision="fp32")
"""fp32, two micro batches of two rows per step, lr 1e-2 after one warmup step: every step but the first updates."""


def offloads(plan: JaxPlan) -> bool:
  """Whether the plan keeps anything in host memory: Adam moments, params or saved residuals."""
  return plan.offload_opt_state or plan.offload_params or plan.remat in remat.OFFLOAD_POLICIES


def reference_plan(plan: JaxPlan) -> JaxPlan:
  """The plan with every group and residual in device memory (module docstring)."""
  return dataclasses.replace(plan, offload_opt_state=False, offload_opt_ratio=1.0, offload_params=False,
                             remat=remat.DEVICE_COUNTERPART.get(plan.remat, plan.remat))


def offload_plans(named: Mapping[str, JaxPlan], devices: int = 1) -> dict[str, JaxPlan]:
  """Every plan of `named` (e.g. {name: pair.jax for each pair of parity.sizing.plans.PLANS}) that offloads and fits
  on `devices` devices, with and without scan_layers ('NAME' as named, 'NAME+scan' / 'NAME-scan' with scan_layers
  toggled), duplicates dropped."""
  out: dict[str, JaxPlan] = {}
  for name, plan in named.items():
    if not offloads(plan) or plan.data_parallel > devices:
      continue
    toggled = dataclasses.replace(plan, scan_layers=not plan.scan_layers)
    for key, p in ((name, plan), (name + ("-scan" if plan.scan_layers else "+scan"), toggled)):
      if p not in out.values():
        out[key] = p
  return out


def _adam_moments(opt_state: Any) -> tuple[Any, Any]:
  """(mu, nu) of the optimizer state's Adam (DeepSpeed's form or optax's)."""
  classes = (optim.DeepSpeedOptState, optax.ScaleByAdamState)
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, classes)) if isinstance(x, classes)]
  if len(found) != 1:
    raise ValueError(f"expected one Adam state in the optimizer state, found {len(found)}")
  return found[0].mu, found[0].nu


def _train(plan: JaxPlan, model: ModelSpec, train: TrainSpec, batches: np.ndarray,
           plants: frozenset = frozenset()) -> dict[str, np.ndarray]:
  """The canonical params, mu and nu (keys 'params/NAME', 'mu/NAME', 'nu/NAME') after training `batches`."""
  run = RunSpec(model=model, train=train, jax=plan)
  t = Trainer.build(run, init_params(model, train.seed), plants=plants)
  t.compile(batches.shape[1:], None)
  for batch in batches:
    t.step(batch)
  out = {f"params/{k}": v for k, v in t.canonical_params().items()}  # first: it settles a deferred update
  mu, nu = _adam_moments(t.state.opt_state)
  for kind, tree in (("mu", mu), ("nu", nu)):
    canonical = layout.from_flax(jax.device_get(tree), model, scan_layers=plan.scan_layers)
    out.update({f"{kind}/{k}": np.asarray(v) for k, v in canonical.items()})
  return out


def _max_diff(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray], prefixes: tuple[str, ...]) -> tuple[float, str]:
  """The largest |a - b| over the entries whose key starts with one of `prefixes`, and that entry's key."""
  worst = (0.0, "")
  for k in (k for k in a if k.startswith(prefixes)):
    d = float(np.max(np.abs(np.asarray(a[k], np.float64) - np.asarray(b[k], np.float64)), initial=0.0))
    worst = max(worst, (d, k))
  return worst


def offload_equality(plans: Mapping[str, JaxPlan], steps: int = 3, *, model: ModelSpec = MODEL,
                     train: TrainSpec = TRAIN, seed: int = 0, plants: frozenset = frozenset()) -> list[dict[str, Any]]:
  """Trains each offload plan and its `reference_plan` for `steps` fp32 steps on the same batches and compares.

  Args:
    plans: name -> JaxPlan, each one that offloads (`offload_plans` picks them out of the named plans).
    steps: optimizer steps (train.steps is set to it).
    model, train: the run (train.precision must be fp32: the comparison is of one arithmetic, not of roundings).
    seed: the token batches' seed.
    plants: planted bugs (parity.protocol.layout.SIDE_PLANT_KEYS) for the offloaded runs only, never the references:
      a positive control (e.g. 'offload_residual_stale' on an offload remat plan must come back not bitwise).
  Returns:
    One dict per plan: plan (name), reference (the reference plan's fields that differ, 'field=value' joined by
    ', '), max_abs_param_diff and max_abs_moment_diff (float: the largest |offloaded - reference| over every param /
    every element of Adam's mu and nu, canonical layout), worst_param / worst_moment (the entry, 'params/NAME',
    'mu/NAME' or 'nu/NAME'; '' when equal), bitwise (both maxima are 0).
  Raises:
    ValueError: a plan that offloads nothing, or train.precision not fp32.
  """
  if train.precision != "fp32":
    raise ValueError(f"offload_equality compares fp32 arithmetic; got train.precision={train.precision!r}")
  train = dataclasses.replace(train, steps=steps)
  rng = np.random.default_rng(seed)
  batches = rng.integers(0, model.vocab_size, (steps, train.grad_accum_steps, train.micro_batch_size,
                                               train.seq_len + 1)).astype(np.uint16)
  refs: dict[JaxPlan, dict[str, np.ndarray]] = {}
  rows = []
  for name, plan in plans.items():
    if not offloads(plan):
      raise ValueError(f"plan {name!r} offloads nothing (offload_opt_state, offload_params false, remat "
                       f"{plan.remat!r}): there is no offload to compare")
    ref = reference_plan(plan)
    if ref not in refs:
      refs[ref] = _train(ref, model, train, batches)
    got = _train(plan, model, train, batches, plants)
    dp, wp = _max_diff(got, refs[ref], ("params/",))
    dm, wm = _max_diff(got, refs[ref], ("mu/", "nu/"))
    differs = [f"{f.name}={getattr(ref, f.name)}" for f in dataclasses.fields(JaxPlan)
               if getattr(ref, f.name) != getattr(plan, f.name)]
    rows.append({"plan": name, "reference": ", ".join(differs), "max_abs_param_diff": dp, "max_abs_moment_diff": dm,
                 "worst_param": wp if dp else "", "worst_moment": wm if dm else "", "bitwise": dp == 0 and dm == 0})
  return rows
