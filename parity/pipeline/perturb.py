"""What a `--perturb side:key=value` makes each side run, decided before any side starts.

A perturbation is a planted difference: it must reach the side it names, or be refused (exit 2) naming the key and
why. Three things can keep one from reaching a side, and each is handled here:

  1. The key does not shape this run (`trains`: the numerics a side trains with, from the spec alone). train.momentum
     on an AdamW run, train.warmup_steps under a schedule given by lr_schedule_params, train.loss_scale in fp32,
     model.rope_theta with learned positions: refused, with the reason (`no_effect_reason`).
  2. The key is tied to another field: train.lr under WarmupLR/WarmupDecayLR whose warmup_max_lr equals train.lr
     (the usual case, and what a DeepSpeed config's "auto" fills in) sets the peak the schedule applies, so the
     perturbation moves warmup_max_lr with it (`side_fields`); the record says so.
  3. The DeepSpeed side runs a user's DeepSpeed config verbatim (`--deepspeed-config`), not the spec. There the
     perturbation is written into the config that side runs (the resolved copy in the run folder, never the user's
     file): every value deepspeed_json builds differently with it (`apply_to_config`); then the amended config is
     ported back (`parity.migrate`'s reading of what a DeepSpeed config trains) and must train exactly the
     perturbed numerics, or the perturbation is refused.

`plan_perturbations` does all three and returns the per-side field changes the sides apply (request.json
'perturb'), the DeepSpeed config that side runs, and one record per perturbation (request.json 'perturbations';
the report reads the values each side ran back from the side's own records).
"""
from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Mapping

from parity.architecture import attention_factor, inv_freq, layer_rope
from parity.numerics import schedule
from parity.numerics.ds_json import deepspeed_json, fp16_config
from parity.protocol.layout import DEBUG_KEYS
from parity.overrides import apply_overrides, get_dotted
from parity.sides import reads_plan
from parity.spec import RunSpec, SpecError, to_dict
from parity.migrate._reverse import port_for_compare
from parity.pipeline.plants import check_plants

__all__ = ["PerturbPlan", "plan_perturbations", "trains", "side_fields", "no_effect_reason", "apply_to_config"]

TIED_PEAK = ("WarmupLR", "WarmupDecayLR")
"""Schedules whose peak learning rate is lr_schedule_params.warmup_max_lr rather than train.lr."""

LR_FROM_PARAMS = {"WarmupLR": "warmup_max_lr", "WarmupDecayLR": "warmup_max_lr", "OneCycle": "cycle_min_lr and "
                  "cycle_max_lr", "LRRangeTest": "lr_range_test_min_lr"}
"""Schedules that take their learning rates from lr_schedule_params, not train.lr (the param that holds them)."""

LOSS_SCALE_KEYS = frozenset({"train.loss_scale", "train.initial_scale_power", "train.loss_scale_window",
                             "train.hysteresis", "train.consecutive_hysteresis", "train.min_loss_scale"})
COSINE_FIELDS = frozenset({"train.warmup_steps", "train.warmup_min_ratio", "train.cos_min_ratio"})
OPTIMIZER_ONLY = {"train.momentum": ("sgd",), "train.dampening": ("sgd",), "train.nesterov": ("sgd",),
                  "train.lamb_max_coeff": ("lamb",), "train.lamb_min_coeff": ("lamb",),
                  "train.eps_inside_sqrt": ("lamb",), "train.beta1": ("adamw", "adam", "lamb"),
                  "train.beta2": ("adamw", "adam", "lamb"), "train.eps": ("adamw", "adam", "lamb")}
"""Optimizer fields and the train.optimizer values that read them."""


@dataclasses.dataclass(frozen=True)
class PerturbPlan:
  """What each side runs.

  Attributes:
    perturb: side -> {dotted spec key: value, debug key: value}: what that side applies over the run's spec
      (request.json 'perturb'; the requested keys plus the tied fields they move).
    deepspeed_config: the DeepSpeed config the DeepSpeed side runs (the resolved one with that side's perturbations
      written in), or the given one unchanged, or None without --deepspeed-config.
    records: one per requested spec perturbation, JSON-ready: {side, key, value (requested), applies (the dotted
      fields that side changes for it), deepspeed_config ([{path, was, now}] written into the DeepSpeed config, or
      None when that side runs no user config), note (how it reaches the side)}.
  """
  perturb: dict[str, dict[str, Any]]
  deepspeed_config: dict[str, Any] | None
  records: list[dict[str, Any]]


def trains(spec: RunSpec) -> dict[str, Any]:
  """The numerics a side trains with, as the spec decides them: a perturbation that leaves this unchanged changes
  nothing the side runs.

  Returns:
    {model: {norm_eps, gelu (None for SwiGLU), rope ((theta, scaling) per layer; None for learned positions), scale
     (q.k multiplier), soft-caps, windows (per layer, None where full or not shorter than seq_len), embed_scale,
     norm_plus_one},
     lr: the lr of each optimizer step (parity.numerics.schedule.train_lr), betas: (beta1, beta2) per step (None for
     SGD), optimizer: (type, its other params), grad_clip, precision, fp16: DeepSpeed's fp16 block (loss scaling),
     loss_normalization (None on the stream layout, where 'tokens' and 'micro_mean' are the same loss),
     decay_mask (None without weight decay)}.
  """
  t = spec.train
  opt = schedule.optimizer_of(t)
  params = {k: v for k, v in opt["params"].items() if k not in ("lr", "betas")}
  betas = [schedule.train_betas(t, k) for k in range(t.steps)] if "betas" in opt["params"] else None
  return {"model": _model_numerics(spec),
          "lr": [schedule.train_lr(t, k) for k in range(t.steps)], "betas": betas,
          "optimizer": (opt["type"], params), "decay_mask": t.decay_mask if t.weight_decay > 0 else None,
          "grad_clip": t.grad_clip, "precision": t.precision, "fp16": fp16_config(t),
          "loss_normalization": t.loss_normalization if t.layout != "stream" else None}


def _model_numerics(spec: RunSpec) -> dict[str, Any]:
  """`trains`' model part: what the forward computes beyond the shared weights' shapes, per layer where it varies.

  A sliding window at or beyond train.seq_len hides no key of a row, so its effective value is None there; rotary
  positions are compared by the frequencies and the cos/sin factor each layer computes (a scaling of factor 1 is
  the plain rotary embedding)."""
  m = spec.model
  rope = [(tuple(inv_freq(m.head_dim, *layer_rope(m, i)).tolist()), attention_factor(layer_rope(m, i)[1]))
          for i in range(m.n_layers)] if m.position == "rope" else None
  return {"norm_eps": m.norm_eps, "gelu": m.gelu_approximate if m.mlp in ("gelu", "geglu") else None,
          "rope": rope, "scale": m.scale, "windows": _windows(spec),
          "attn_softcap": m.attn_softcap, "final_softcap": m.final_softcap,
          "embed_scale": m.embed_scale, "norm_plus_one": m.norm_plus_one}


def _windows(spec: RunSpec) -> tuple[int | None, ...]:
  """Per layer the sliding window that hides keys of a train.seq_len row, or None (a full layer, or a window of at
  least seq_len)."""
  m, t = spec.model, spec.train
  return tuple(m.sliding_window if k == "sliding" and m.sliding_window < t.seq_len else None for k in m.layer_kinds)


def _window_reason(spec: RunSpec, key: str, value: Any) -> str:
  """Why a sliding_window / layer_types perturbation leaves every layer's attention as it is (no_effect_reason)."""
  m, t = spec.model, spec.train
  new = apply_overrides(spec, {key: value}).model
  if new.layer_kinds == m.layer_kinds and key == "model.layer_types":
    return (f"it gives the layer kinds the run already has ({', '.join(m.layer_kinds)}; [] means every layer "
            "'sliding' when model.sliding_window is set, else 'full')")
  return (f"with it the {new.layer_kinds.count('sliding')} 'sliding' layer(s) of {m.n_layers} have a window of "
          f"{new.sliding_window}, at least train.seq_len ({t.seq_len}): every key of a row stays visible, as without "
          "it")


def side_fields(spec: RunSpec, kv: Mapping[str, Any]) -> dict[str, Any]:
  """The dotted spec fields one side changes for its requested spec perturbations `kv` (debug keys excluded).

  train.lr under WarmupLR/WarmupDecayLR whose lr_schedule_params.warmup_max_lr equals train.lr also moves
  warmup_max_lr (the peak those schedules apply), unless the same side perturbs train.lr_schedule_params itself.
  """
  out = {k: v for k, v in kv.items() if k not in DEBUG_KEYS}
  t = spec.train
  params = dict(t.lr_schedule_params or {})
  if ("train.lr" in out and "train.lr_schedule_params" not in out and t.lr_schedule in TIED_PEAK
      and isinstance(params.get("warmup_max_lr"), (int, float)) and math.isclose(params["warmup_max_lr"], t.lr,
                                                                                  rel_tol=1e-12, abs_tol=0.0)):
    out["train.lr_schedule_params"] = {**params, "warmup_max_lr": out["train.lr"]}
  return out


def no_effect_reason(spec: RunSpec, key: str, value: Any) -> str:
  """Why `key=value` changes nothing `spec` trains (called once `trains` showed it does not), for the refusal."""
  t, m = spec.train, spec.model
  current = get_dotted(to_dict(spec), key)
  if current == value:
    return f"the run already has {key}={value!r}"
  if key == "train.loss_normalization" and t.layout == "stream":
    return ("on the stream layout every micro batch has the same number of loss tokens, so 'tokens' and "
            "'micro_mean' are the same loss; it differs on train.layout=padded or packed")
  if key == "train.decay_mask" and t.weight_decay == 0:
    return "train.weight_decay is 0, so no tensor is decayed whatever the mask"
  if key in LOSS_SCALE_KEYS and t.precision != "fp16":
    return f"loss scaling runs only in fp16, and train.precision is {t.precision!r}"
  if key in OPTIMIZER_ONLY and t.optimizer not in OPTIMIZER_ONLY[key]:
    return f"train.optimizer {t.optimizer!r} does not read it (it is read by {', '.join(OPTIMIZER_ONLY[key])} only)"
  if key == "train.lr" and t.lr_schedule in LR_FROM_PARAMS:
    return (f"the lr schedule {t.lr_schedule} takes its learning rate from train.lr_schedule_params "
            f"({LR_FROM_PARAMS[t.lr_schedule]}), not from train.lr; perturb train.lr_schedule_params instead")
  if key in COSINE_FIELDS and (t.lr_schedule != "WarmupCosineLR" or t.lr_schedule_params is not None):
    return (f"it shapes only the default WarmupCosineLR (train.lr_schedule_params unset), and this run's schedule is "
            f"{t.lr_schedule} with lr_schedule_params {t.lr_schedule_params}; perturb train.lr_schedule_params instead")
  if key in ("train.beta1", "train.beta2") and schedule.cycles_momentum(t):
    return "OneCycle with cycle_momentum sets beta1 every step and fixes beta2 at 0.99"
  if key == "model.gelu_approximate" and m.mlp not in ("gelu", "geglu"):
    return f"model.mlp is {m.mlp!r}, which has no GELU"
  if key in ("model.rope_theta", "model.rope_scaling") and m.position != "rope":
    return f"model.position is {m.position!r}: {key} is used only with rotary positions"
  if key in ("model.rope_theta", "model.rope_scaling") and "full" not in m.layer_kinds and m.rope_local_theta:
    return f"every layer is 'sliding' and uses model.rope_local_theta, never {key}"
  if key == "model.rope_scaling":
    return f"{key}={value!r} gives every layer the rotary frequencies it already has (a factor of 1 scales nothing)"
  if key in ("model.sliding_window", "model.layer_types"):
    return _window_reason(spec, key, value)
  return (f"it leaves what the side trains unchanged over the run's {t.steps} steps (the lr of every step, the "
          "optimizer, clipping, precision, loss scaling and model are identical with and without it)")


def plan_perturbations(spec: RunSpec, perturb: Mapping[str, Mapping[str, Any]] | None,
                       deepspeed_config: Mapping[str, Any] | None = None, *, source: str = "",
                       stack: str | None = None) -> PerturbPlan:
  """Decides what each side runs for `perturb` (parity.pipeline.folder.parse_perturb's form), or refuses.

  Args:
    spec: the run's resolved RunSpec (with --deepspeed-config: the ported one every side starts from).
    perturb: side -> {key: value}, spec keys and DEBUG_KEYS; None or {} for none.
    deepspeed_config: the resolved DeepSpeed config the DeepSpeed side runs verbatim, or None.
    source: the DeepSpeed config file, for messages.
    stack: the training stack the config was ported under (parity.migrate._stack), for the re-port that checks a
      DeepSpeed-side change; None: chosen from the config.
  Returns:
    The PerturbPlan.
  Raises:
    SpecError: '--perturb SIDE:KEY=VALUE: ...' when a perturbation changes nothing that side trains
      (`no_effect_reason`), or when the DeepSpeed side's config cannot carry it (`apply_to_config`); a planted data
      bug (PLANT_KEYS) that cannot have an effect on this spec (parity.pipeline.plants.spec_reason).
  """
  check_plants(spec, perturb)
  return _plan(spec, perturb, deepspeed_config, source, stack)


def _plan(spec: RunSpec, perturb: Mapping[str, Mapping[str, Any]] | None, deepspeed_config: Mapping[str, Any] | None,
          source: str, stack: str | None = None) -> PerturbPlan:
  out: dict[str, dict[str, Any]] = {}
  records: list[dict[str, Any]] = []
  ds_cfg = copy.deepcopy(dict(deepspeed_config)) if deepspeed_config is not None else None
  for side, kv in (perturb or {}).items():
    fields = side_fields(spec, kv)
    for key, value in kv.items():
      if key not in DEBUG_KEYS:
        own = _check_effect(spec, side, kv, key)
        records.append({"side": side, "key": key, "value": value, "applies": own, "deepspeed_config": None,
                        "note": _note(own, key)})
    out[side] = {**fields, **{k: v for k, v in kv.items() if k in DEBUG_KEYS}}
    if reads_plan((side,), "deepspeed") and ds_cfg is not None and fields:  # the side the DeepSpeed config is for
      ds_cfg, changes = apply_to_config(spec, fields, ds_cfg, source=source, stack=stack)
      for r in records:
        if r["side"] == side:
          r["deepspeed_config"] = [c for c in changes if set(c["for"]) & set(r["applies"])]
  return PerturbPlan(perturb=out, deepspeed_config=ds_cfg, records=records)


def _check_effect(spec: RunSpec, side: str, kv: Mapping[str, Any], key: str) -> dict[str, Any]:
  """The fields `key` moves on `side` (`side_fields`), once shown to change what the side trains: the side's
  perturbations with it must train differently from the same without it (so keys that only work together, e.g.
  lr_schedule=Constant with lr_schedule_params=null, are each judged with the others). Raises SpecError."""
  item = f"--perturb {side}:{key}={_show(kv[key])}"
  try:
    with_it = trains(apply_overrides(spec, side_fields(spec, kv)))
  except ValueError as exc:
    raise SpecError(f"{item}: {exc}") from None
  try:
    without = trains(apply_overrides(spec, side_fields(spec, {k: v for k, v in kv.items() if k != key})))
  except ValueError:  # the others alone are not a valid run: this key is what makes them one
    without = None
  if with_it == without:
    raise SpecError(f"{item} changes nothing the {side} side trains: {no_effect_reason(spec, key, kv[key])}")
  return side_fields(spec, {key: kv[key]})


def _show(value: Any) -> str:
  import json
  return json.dumps(value) if not isinstance(value, str) else value


def _note(fields: Mapping[str, Any], key: str) -> str | None:
  moved = [k for k in fields if k != key]
  if not moved:
    return None
  return (f"{key} also moves {', '.join(moved)}: the schedule's peak (warmup_max_lr) equalled train.lr, so the "
          "perturbation sets the peak the schedule applies")


SECTION_TYPES = ("optimizer.type", "scheduler.type")
"""Leaves that name a whole section's kind: a perturbation that changes one would replace the user's section."""


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
  """dotted path -> leaf of a JSON tree (lists are leaves; a missing section is absent)."""
  if isinstance(node, Mapping) and node:
    out: dict[str, Any] = {}
    for k, v in node.items():
      out.update(_leaves(v, f"{prefix}.{k}" if prefix else str(k)))
    return out
  return {prefix: node}


def config_diff(spec: RunSpec, fields: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
  """path -> (value, perturbed value) of every leaf `parity.numerics.ds_json.deepspeed_json` builds differently for
  the spec with `fields` applied: where a DeepSpeed config carries those fields."""
  before, after = _leaves(deepspeed_json(spec)), _leaves(deepspeed_json(apply_overrides(spec, fields)))
  return {p: (before.get(p), after.get(p)) for p in sorted(set(before) | set(after)) if before.get(p) != after.get(p)}


def _set(cfg: dict[str, Any], path: str, value: Any) -> tuple[bool, Any]:
  """Sets `path` in cfg when every section above it exists; (set, the value it had)."""
  *parents, leaf = path.split(".")
  node = cfg
  for p in parents:
    if not isinstance(node.get(p), dict):
      return False, None
    node = node[p]
  was = node.get(leaf)
  node[leaf] = copy.deepcopy(value)
  return True, was


def _caused_by(spec: RunSpec, fields: Mapping[str, Any], path: str) -> list[str]:
  """The fields whose change alone moves config `path` (all of them when none does alone)."""
  keys = []
  for k in fields:
    try:
      if path in config_diff(spec, {k: fields[k]}):
        keys.append(k)
    except ValueError:  # not a valid run alone (e.g. lr_schedule without its params)
      continue
  return keys or list(fields)


def apply_to_config(spec: RunSpec, fields: Mapping[str, Any], config: Mapping[str, Any], *,
                    source: str = "", stack: str | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
  """Writes one side's perturbed spec fields into the DeepSpeed config that side runs, and proves it took.

  Each leaf deepspeed_json builds differently with `fields` (`config_diff`) is set where the config has its section;
  a section the config lacks (no optimizer section: DeepSpeed gets the client optimizer built from the side's spec)
  is left to the spec. Then the amended config is ported back (parity.migrate._reverse.port_for_compare, against
  the perturbed spec) and must train exactly what the perturbed spec trains (`trains`).

  Args:
    spec: the run's ported RunSpec; fields: dotted spec field -> value (`side_fields`); config: the resolved
      DeepSpeed config; source: its file, for messages.
  Returns:
    (the amended config, a new dict; [{path, was, now, for: [requested keys]}] of the values written).
  Raises:
    SpecError: '--perturb deepspeed:KEY=VALUE: ...' when the change would replace the config's optimizer or
      scheduler type, or the amended config would not train the perturbed values (both named).
  """
  out, changes = copy.deepcopy(dict(config)), []
  where = source or "the DeepSpeed config"
  items = ", ".join(f"{k}={_show(v)}" for k, v in fields.items())
  try:
    diff = config_diff(spec, fields)
  except ValueError as exc:
    raise SpecError(f"--perturb deepspeed:{items}: {exc}") from None
  for path, (was, now) in diff.items():
    if path in SECTION_TYPES and get_dotted(out, path) is not None:
      raise SpecError(f"--perturb deepspeed:{items}: it changes {path} of {where} ({was} -> {now}), and the "
                      "DeepSpeed side runs that file's sections as written; edit a copy of the file, or perturb "
                      "another side")
  for path, (_, now) in diff.items():
    done, had = _set(out, path, now)
    if done:
      changes.append({"path": path, "was": had, "now": now, "for": _caused_by(spec, fields, path)})
  want = apply_overrides(spec, fields)
  try:
    ported = port_for_compare(copy.deepcopy(out), want, source=where, stack=stack)[0]
  except SpecError as exc:
    raise SpecError(f"--perturb deepspeed:{items}: {where} with the change written in is refused: "
                    f"{exc}") from None
  got, expect = trains(ported), trains(want)
  # the decay mask is no key of a config: it is the param groups the training stack passes, which the DeepSpeed side
  # builds from its own spec (torch_impl.engine.build_engine), so the spec carries it, as it carries the loss weights
  bad = [k for k in expect if got[k] != expect[k] and k != "decay_mask"]
  if bad:
    held = (f"with {', '.join(c['path'] for c in changes)} written in, the config still trains" if changes else
            "it has no section that holds it, so it still trains")
    raise SpecError(f"--perturb deepspeed:{items}: {where} cannot "
                    f"carry it: {held} a different {', '.join(bad)} ({_show(got[bad[0]])}, wanted "
                    f"{_show(expect[bad[0]])}); edit a copy of the file, or perturb another side")
  return out, changes
