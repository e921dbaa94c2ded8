"""When a planted data bug (parity.protocol.layout.PLANT_KEYS, `--perturb SIDE:KEY=true`) can change what a side
trains, decided before the sides start: a plant that cannot have an effect is refused (exit 2) with the reason,
rather than left to PASS silently (docs/data-examples.md "Planted bugs").

The physics, per plant (right padding, one causal attention per row):
  attention_mask_dropped   the model gets no segment ids, so attention is causal over the whole row. A real token
                           never reads padding (padding sits after it), so it changes only a row holding two or more
                           examples: the packed layout, and data where some row packs a later example.
  positions_not_restarted  the model gets positions 0..T-1 along the row. Only an example that does not start at
                           slot 0 sees other positions (packed rows again); and rotary positions enter q.k as
                           differences only, so within a per-example mask it changes nothing: learned positions
                           (model.position='learned') only, unless the same side drops the mask too.
  labels_shifted_twice     input t scored against token t + 2: always a different objective.
  loss_on_prompt           every target inside its example carries the loss: changes the objective only when the
                           data has prompt targets without loss.
  decay_biases             (an optimizer plant, any layout) every '*.bias' joins the decayed set: changes the update
                           only when the model has biases and train.weight_decay > 0.
  placement_device         (a placement fault, JAX side only: PLACEMENT_PLANT_KEYS) the step compiled with the offloaded
                           groups in device memory: shows only when the JaxPlan offloads a group (`placement_reason`).
  fsdp_reduce_dtype_low    (an FSDP2 plant, fsdp side only: FSDP_PLANT_KEYS) the gradients reduced in 16 bits: any
                           run (`fsdp_reason`).
  fsdp_shard_unsynced      (an FSDP2 plant, fsdp side only) rank 1's shard of one param not updated: needs a rank 1
                           (--nproc 2 or more: parity.pipeline.compare, which knows the ranks).
  offload_residual_stale   (an activation-offload plant, JAX side only: OFFLOAD_PLANT_KEYS) the MLP down projection's
                           weight gradient read from a wrong saved residual: shows only when the plan offloads residuals
                           (jax.remat offload_names / offload_dots_no_batch) and a micro batch holds two token rows
                           or more (`offload_reason`).
  family plants            (FAMILY_PLANT_KEYS, any side: `family_reason`) a convention of the model family run wrong:
                           qk_norm_after_rope needs q/k norms and rotary, attn_softcap_skipped / final_softcap_skipped
                           the soft-cap, norm_plus_one_rounded Gemma's (1 + w) norm in bf16/fp16 (in fp32 both orders
                           are the same float32 operations).
A planted data bug on every compared side is refused too (`every_side_reason`): comparing the sides
cannot see a difference none of them has. And a `train.loss_normalization` perturbation is refused on batches where
both normalisations give every target the same weight for this run's ranks (every rank's micro batch of a step
holds the same number of loss tokens: `normalization_reason`; always so on one rank without gradient accumulation,
whose one micro batch is the whole step).
Numpy only; `spec_reason` reads the spec, `data_reason` the arrays the run folder holds.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from parity.dataset.reference import in_example_targets, token_weights
from parity.numerics.ds_json import OFFLOAD_REMAT
from parity.protocol.layout import (ACCELERATOR_PLANT_KEYS, FAMILY_PLANT_KEYS, FSDP_PLANT_KEYS, OFFLOAD_PLANT_KEYS,
                                    PLACEMENT_PLANT_KEYS, PLANT_KEYS)
from parity.protocol.placement import writes_placement
from parity.weights import param_shapes
from parity.spec import RunSpec, SpecError

__all__ = ["spec_reason", "data_reason", "every_side_reason", "normalization_reason", "placement_reason",
           "fsdp_reason", "offload_reason", "family_reason", "check_plants", "check_plants_on_data"]


def spec_reason(spec: RunSpec, key: str, plants: Mapping[str, Any]) -> str | None:
  """Why plant `key` cannot change what a side of `spec` trains (its other `plants` considered), or None."""
  t, m = spec.train, spec.model
  if key == "decay_biases":
    return _decay_biases_reason(spec)
  if t.layout == "stream":
    return ("the planted data bugs act on the example arrays (segment ids, positions, loss mask) of "
            "train.layout=padded or packed; the stream layout has none")
  if key == "attention_mask_dropped" and t.layout == "padded":
    return ("on the padded layout a row holds one example from slot 0, right-padded: under the causal mask a real "
            "token never reads padding, so without the segment mask every real logit is the same; it shows on "
            "train.layout=packed (attention across documents)")
  if key == "positions_not_restarted" and t.layout == "padded":
    return ("on the padded layout every example starts at slot 0, so its positions are 0..T-1 already; it shows on "
            "train.layout=packed (examples after slot 0)")
  if (key == "positions_not_restarted" and m.position == "rope"
          and not plants.get("attention_mask_dropped")):
    return ("model.position is 'rope': rotary positions enter q.k as differences, which a shift of a whole example "
            "leaves unchanged within its own (per-example) attention; it shows with learned positions (GPT-2)")
  return None


def _decay_biases_reason(spec: RunSpec) -> str | None:
  """Why 'decay_biases' changes nothing: no parameter named '*.bias', or no weight decay."""
  if not any(n.endswith(".bias") for n in param_shapes(spec.model)):
    return "the model has no bias parameters (model.bias and the per-projection biases are off, no LayerNorm bias)"
  if not spec.train.weight_decay > 0:
    return f"train.weight_decay is {spec.train.weight_decay}: nothing is decayed"
  return None


def data_reason(key: str, loss_mask: np.ndarray, segment_ids: np.ndarray) -> str | None:
  """Why plant `key` changes nothing on these training arrays (bool / int (steps, A, M, T)), or None."""
  if key in ("attention_mask_dropped", "positions_not_restarted") and int(np.max(segment_ids, initial=0)) < 2:
    return "no row of the run's batches holds a second example, so no example starts after slot 0"
  if key == "loss_on_prompt" and np.array_equal(in_example_targets(loss_mask, segment_ids), loss_mask):
    return "every target inside an example carries the loss already (the data has no prompt tokens without loss)"
  return None


def every_side_reason(sides, perturb: Mapping[str, Mapping[str, Any]] | None) -> str | None:
  """Why the perturbations cannot be seen by comparing `sides` (the run's sides, in order): a key given the same
  value on every one of them (two or more sides) is a change of the run itself, not a difference; else None. Only the
  planted data bugs (PLANT_KEYS) are checked: fault injections (kill, NaN, hang, raise, overflow) test the run's
  failure paths, and a spec key on every side tests its routing, on every side if the user wants."""
  perturb = perturb or {}
  sides = list(sides)
  if len(sides) < 2 or any(s not in perturb for s in sides):
    return None
  for key, value in perturb[sides[0]].items():
    if key not in PLANT_KEYS + FAMILY_PLANT_KEYS:  # fault injections test the run itself; a spec key: routing
      continue
    if all(key in perturb[s] and perturb[s][key] == value for s in sides[1:]):
      fix = ("plant it on one side only" if key in PLANT_KEYS else
             f"plant it on one side only, or give it to every side with --set {key}=...")
      return (f"--perturb {key}={value!r} on every compared side ({', '.join(sides)}): a difference none of the sides "
              f"has cannot be seen by comparing them, so the run would PASS with the bug on every side; {fix}")
  return None


def normalization_reason(loss_mask: np.ndarray, world: int = 1) -> str | None:
  """Why a train.loss_normalization perturbation changes nothing on these training arrays (bool (steps, A, B, T), B
  the global micro batch) run on `world` ranks per side (--nproc x --nnodes; rank k holds rows [k*B/W, (k+1)*B/W)):
  every target's weight is the same under 'tokens' and 'micro_mean' (parity.dataset.reference.token_weights), i.e.
  every rank's micro batch of a step holds the same number of loss tokens; else None. One rank without gradient
  accumulation always is: its one micro batch is the whole step, and both divide by the step's loss tokens."""
  steps, accum, rows, _ = loss_mask.shape
  try:
    same = np.allclose(token_weights(loss_mask, "tokens"), token_weights(loss_mask, "micro_mean", world),
                       rtol=1e-12, atol=0.0)
  except ValueError:  # DataError (micro_mean undefined on these batches) is the sides' own refusal
    return None
  if not same:
    return None
  if accum * world == 1:
    return ("the run has one rank and one micro batch a step (train.grad_accum_steps=1, --nproc 1), so the micro "
            "batch's mean is the step's token mean: 'tokens' and 'micro_mean' are one loss; it shows with "
            "train.grad_accum_steps > 1 or --nproc 2 or more, on data whose micro batches hold different numbers "
            "of loss tokens")
  return (f"on these batches every rank's micro batch of a step ({world} rank(s) x {accum} micro batch(es) of "
          f"{rows // max(world, 1)} row(s)) holds the same number of loss tokens, so 'tokens' and 'micro_mean' "
          "give every target the same weight; it shows on data whose micro batches hold different numbers of loss "
          "tokens (examples of varying length, padded or packed)")


def _refuse(side: str, key: str, reason: str, value: object = True) -> None:
  text = "true" if value is True else value
  raise SpecError(f"--perturb {side}:{key}={text} changes nothing the {side} side trains: {reason}")


def placement_reason(spec: RunSpec, side: str) -> str | None:
  """Why the planted placement fault ('placement_device', PLACEMENT_PLANT_KEYS) on `side` cannot show, or None: only
  the JAX worker compiles its step from a placement plan (parity.protocol.placement.writes_placement), and a plan that
  offloads nothing already keeps every group in device memory."""
  if not writes_placement(side):
    return (f"only the JAX side compiles its step from a memory plan and writes placement.json; {side} has no "
            "compiled placement to plant a mismatch in")
  if not (spec.jax.offload_params or spec.jax.offload_opt_state):
    return ("the run's JaxPlan offloads nothing (jax.offload_params and jax.offload_opt_state are false): every group "
            "is in device memory already; plant it on a plan that offloads, e.g. --plan zero2-offload")
  return None


def fsdp_reason(side: str, key: str) -> str | None:
  """Why the planted FSDP2 bug `key` (FSDP_PLANT_KEYS) on `side` cannot show, or None: only the fsdp side shards its
  model with fully_shard (a reduce dtype to lower, a rank's shard to leave behind)."""
  if side != "fsdp":
    return (f"{key} is a planted FSDP2 bug: only the fsdp side (torch.distributed.fsdp.fully_shard) has a gradient "
            f"reduce dtype and sharded params to plant it in; plant it as --perturb fsdp:{key}=true")
  return None


def family_reason(spec: RunSpec, key: str) -> str | None:
  """Why the planted family porting bug `key` (FAMILY_PLANT_KEYS) changes nothing a side of `spec` trains, or None."""
  m, t = spec.model, spec.train
  if key == "qk_norm_after_rope" and not (m.qk_norm and m.position == "rope"):
    return "it moves the q/k norms past rotary, and the model has no q/k norms (model.qk_norm) or no rotary"
  if key == "attn_softcap_skipped" and m.attn_softcap is None:
    return "the model has no attention soft-cap (model.attn_softcap) to skip"
  if key == "final_softcap_skipped" and m.final_softcap is None:
    return "the model has no final-logit soft-cap (model.final_softcap) to skip"
  if key == "norm_plus_one_rounded" and not m.norm_plus_one:
    return "the model's norms are not Gemma's (1 + w) form (model.norm_plus_one)"
  if key == "norm_plus_one_rounded" and t.precision == "fp32":
    return ("in fp32 rounding the normalised value and (1 + w) to the compute dtype changes nothing (both are "
            "float32 already); it shows with train.precision bf16 or fp16")
  return None


def offload_reason(spec: RunSpec, side: str, key: str) -> str | None:
  """Why the planted activation-offload bug `key` (OFFLOAD_PLANT_KEYS) on `side` cannot show, or None: only the JAX
  side saves its residuals through a jax.checkpoint policy, the bug class lives in offloaded residuals (a plan that
  keeps them in device memory has none to read stale), and a one-token micro batch has no other row to read."""
  if side != "jax":
    return (f"{key} is a planted activation-offload bug: only the JAX side keeps backward residuals through a "
            f"jax.checkpoint offload policy; plant it as --perturb jax:{key}=true")
  if spec.jax.remat not in OFFLOAD_REMAT:
    return (f"the run's jax.remat is {spec.jax.remat!r}: no residual is offloaded to host memory, so there is no "
            "offloaded residual to read stale; plant it on a plan that offloads residuals, e.g. --set "
            "jax.remat=offload_names (or --plan act-offload / zero3-act-offload)")
  if spec.train.micro_batch_size * spec.train.seq_len < 2:
    return "a micro batch holds one token: there is no other row of the saved residual to read in its place"
  return None


def _reason(spec: RunSpec, side: str, key: str, kv: Mapping[str, Any]) -> str | None:
  """The reason of the check that owns plant `key` (`spec_reason`, `fsdp_reason`, `offload_reason`, `family_reason`,
  `placement_reason`)."""
  if key in PLANT_KEYS:
    return spec_reason(spec, key, kv)
  if key in FSDP_PLANT_KEYS:
    return fsdp_reason(side, key)
  if key in OFFLOAD_PLANT_KEYS:
    return offload_reason(spec, side, key)
  if key in FAMILY_PLANT_KEYS:
    return family_reason(spec, key)
  if key in ACCELERATOR_PLANT_KEYS:
    return accelerator_reason(side, key, kv.get(key), spec)
  return placement_reason(spec, side)


def accelerator_reason(side: str, key: str = "", value: Any = None, spec: RunSpec | None = None) -> str | None:
  """Why an accelerator-only plant (ACCELERATOR_PLANT_KEYS) on `side` cannot show, or None: only the JAX side
  applies them (jax_impl.accelerator_plants; where it runs on the CPU it applies none and the report says so); an
  update scale that float32 rounds to 1 or 0, and a norm eps equal to the model's, change nothing."""
  if not writes_placement(side):  # the JAX worker, the one that compiles a step for a device
    return f"accelerator-only plants are applied by the JAX side only (jax_impl.accelerator_plants); {side} has none"
  if key == "accelerator_update_scale" and isinstance(value, (int, float)) and float(np.float32(value)) in (0.0, 1.0):
    return (f"the factor is {float(np.float32(value))!r} in float32, where the updates are scaled: use one float32 "
            "tells from 1, such as 1.0001")
  if key == "accelerator_norm_eps" and spec is not None and value == spec.model.norm_eps:
    return f"the model's norm eps is {spec.model.norm_eps} already: plant another value, such as a tenth of it"
  return None


def check_plants(spec: RunSpec, perturb: Mapping[str, Mapping[str, Any]] | None) -> None:
  """Refuses a plant `spec_reason`, `placement_reason`, `fsdp_reason` or `offload_reason` names (SpecError
  '--perturb SIDE:KEY=true changes nothing ...: reason'), and a perturbation given alike to every side of spec.sides
  (`every_side_reason`)."""
  alike = every_side_reason(spec.sides, perturb)
  if alike is not None:
    raise SpecError(alike)
  for side, kv in (perturb or {}).items():
    for key in (k for k in kv if k in PLANT_KEYS + PLACEMENT_PLANT_KEYS + FSDP_PLANT_KEYS + OFFLOAD_PLANT_KEYS
                                    + FAMILY_PLANT_KEYS + ACCELERATOR_PLANT_KEYS):
      reason = _reason(spec, side, key, kv)
      if reason is not None:
        _refuse(side, key, reason, kv.get(key))


def check_plants_on_data(perturb: Mapping[str, Mapping[str, Any]] | None, loss_mask: np.ndarray,
                         segment_ids: np.ndarray, *, world: int = 1) -> None:
  """Refuses a plant `data_reason` names for the run's training arrays, and a train.loss_normalization perturbation
  `normalization_reason` names for the run's `world` ranks per side (SpecError, as `check_plants`)."""
  for side, kv in (perturb or {}).items():
    if "train.loss_normalization" in kv:
      reason = normalization_reason(np.asarray(loss_mask, dtype=bool), world)
      if reason is not None:
        raise SpecError(f"--perturb {side}:train.loss_normalization={kv['train.loss_normalization']} changes nothing "
                        f"the {side} side trains: {reason}")
    for key in (k for k in kv if k in PLANT_KEYS):
      reason = data_reason(key, loss_mask, segment_ids)
      if reason is not None:
        _refuse(side, key, reason)
