"""One resolver for a run: every source of a run's settings, applied in one documented order.

`resolve_run` is what `parity compare`, `parity diagnose`, `parity estimate` and `parity plan` (and
`resolve`, its shorthand) build a run with. The sources, in the order they apply, each later one over the earlier ones:

  1. base        the preset a config file names (`preset:`), else the `preset` argument, else a model-size preset
                 (`model`, parity.hf.MODEL_PRESETS, with parity.sizing.memory.model_preset_train's training), else
                 DEFAULT_PRESET (any two of a config's `preset:`, `preset` and `model` are refused as a conflict)
  2. config      the config file's sections merged over the preset (a `parity port` output maps onto it)
  3. checkpoint  an HF checkpoint (`--hf-model`) replaces the model section; its weights become the initial weights
  4. plan        a plan pair (`--plan NAME|auto`) replaces the `jax` and `deepspeed` sections (and `fsdp`, for a
                 pair with an FSDP2 plan: parity.sizing.plans.with_plan)
  5. flags       `steps`, `sides`, `data`, `micro_batch`, `seq_len`, `grad_accum`, `precision`
  6. overrides   dotted `section.key: value` pairs, applied once, last, over everything above
  7. DeepSpeed   a DeepSpeed config (`--deepspeed-config`) is ported against the result: its "auto" values are
                 filled from the run so far, and what it sets explicitly decides the training, jax and
                 deepspeed sections. An override that the config contradicts is refused naming both values
                 (the DeepSpeed side runs the user's file verbatim, so a silent winner either way would make
                 the sides differ or misreport the run).

Nothing is applied twice and nothing applied earlier is replaced by a later step without that step's rule saying
so. The result is one frozen ResolvedRun. Per-side `--perturb` changes come after it, when the run folder is
prepared (parity.pipeline.perturb.plan_perturbations): each must change what its side trains, and on the DeepSpeed
side of a DeepSpeed config it is written into the copy of the config that side runs (never into the user's file).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from parity.presets import DEFAULT_PRESET, preset
from parity.overrides import apply_overrides, get_dotted, parse_overrides
from parity.sides import all_sides, reads_plan, side_record
from parity.spec import from_dict, RunSpec, SpecError, to_dict
from parity.migrate._read import PortError, read_deepspeed_config, read_structured
from parity.data import DataError
from parity.inputs import user_file
from parity.spec import SFT_DEMO
from parity.hf import MODEL_PRESETS, convert
from parity.hf.presets import model_preset_name
from parity.sizing.memory import model_preset_train
from parity.spec import check_numbers
from parity.migrate._reverse import load_ported, to_run_spec, port_for_compare
from parity import hf, weights
from parity.sizing import plans
from parity.sizing.plans import DEFAULT_PLAN, plan_of

__all__ = ["ResolvedRun", "resolve_run", "resolve", "overrides_mapping", "load_config_file",
           "check_fsdp_overrides_are_read"]


def load_config_file(path: str | Path) -> dict[str, Any]:
  """Reads a run config: YAML, or JSON as DeepSpeed reads it (comments, trailing commas).

  The readers are parity.migrate's, so run configs and DeepSpeed configs parse alike.
  Raises:
    SpecError: missing file, a syntax error (with file, line and column), or a top level that is not a mapping.
  """
  p = user_file(path, what="config", error=SpecError)  # the one reader's check and message (parity.inputs)
  try:
    if p.suffix.lower() in (".json", ".hjson", ".json5"):
      return read_deepspeed_config(p)
    return read_structured(p)
  except PortError as exc:
    raise SpecError(str(exc)) from None


def _merge(base: dict, top: Mapping) -> dict:
  out = dict(base)
  for k, v in top.items():
    out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
  return out


def resolve(preset_name: str | None = None, *, config: str | Path | Mapping | None = None,
            overrides: Mapping[str, Any] | Sequence[str] = (), steps: int | None = None,
            sides: Sequence[str] | None = None, data: str | None = None) -> RunSpec:
  """The RunSpec of `parity.pipeline.resolve.resolve_run` for a preset, config, flags and overrides (no checkpoint,
  plan or DeepSpeed config): a shorthand for tests and benchmarks.

  Raises:
    SpecError: unknown preset or key, a value of the wrong type or out of range.
  """
  return resolve_run(preset_name, config=config, overrides=overrides, steps=steps, sides=sides, data=data).spec


def _is_path(data: Any) -> bool:
  return isinstance(data, str) and bool(data.strip()) and data not in ("stdlib", SFT_DEMO)


def _data_relative_to(cfg: dict[str, Any], config: Path) -> dict[str, Any]:
  """A relative `data:` path in a config file names a path next to that file, as users expect (not the cwd).

  Raises:
    DataError: nothing at the resolved path; the message names the folder it was resolved against.
  """
  data = cfg.get("data")
  if not _is_path(data) or Path(data).expanduser().is_absolute():
    return cfg
  where = config.absolute().parent
  resolved = where / data
  if not resolved.exists():
    raise DataError(f"{config}: data {data!r} is resolved relative to the config file's folder {where}, and "
                    f"{resolved} does not exist; fix the path (or make it absolute)")
  return {**cfg, "data": str(resolved)}


@dataclasses.dataclass(frozen=True)
class ResolvedRun:
  """Everything a run is built from, resolved.

  Attributes:
    spec: the validated RunSpec every side runs (sides differ only by `--perturb`).
    preset: the preset the run is built on (the config file's own `preset:` when it names one).
    plan: {'name', 'chosen_by', 'why'?} of the plan pair the run's plans are, or None when they match no pair.
    init_source: absolute path of the HF checkpoint the initial weights come from; None: seeded init
      (parity.weights.init_params).
    init_params: canonical initial weights (name -> float32 array) from that checkpoint, or None.
    deepspeed_config: the resolved DeepSpeed config the DeepSpeed side runs verbatim ("auto" filled; a
      `--perturb deepspeed:...` is written into a copy of it, parity.pipeline.perturb), or None.
    deepspeed_source: the DeepSpeed config file it came from, or None.
    port: the migration PortResult (key-by-key report) of that config, or None.
    overrides: the dotted overrides applied last (key -> value), as given.
  """
  spec: RunSpec
  preset: str
  plan: dict | None = None
  init_source: str | None = None
  init_params: Mapping[str, Any] | None = dataclasses.field(default=None, repr=False)
  deepspeed_config: Mapping[str, Any] | None = dataclasses.field(default=None, repr=False)
  deepspeed_source: str | None = None
  port: Any = dataclasses.field(default=None, repr=False)
  overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  tokenizer: str | None = None
  """Padded/packed text records: the folder of their tokenizer.json (`--tokenizer`); None: init_source's."""
  sides_named: bool = False
  """The user named the sides (`sides`, an override of `sides`, or a config whose sides differ from the default):
  a named side that cannot run here fails the run; an unnamed one is left out (parity.sockets.plan_sides)."""
  inputs_from: str | None = None
  """A run from an earlier request (`parity compare --request`, parity.pipeline.request_source): the folder whose
  initial weights, batches and example arrays are copied byte for byte instead of being made again; None: made here."""


_DEFAULT_SIDES = next(f.default for f in dataclasses.fields(RunSpec) if f.name == "sides")
"""RunSpec's sides when nothing names them (jax, deepspeed, torch)."""


def overrides_mapping(overrides: Mapping[str, Any] | Sequence[str] | None) -> dict[str, Any]:
  """A mapping of dotted keys to values from a mapping (returned as a dict) or `key=value` strings (the
  convenient notebook form; parsed by parity.overrides.parse_overrides). Raises SpecError on a malformed string."""
  if overrides is None:
    return {}
  if isinstance(overrides, Mapping):
    return {str(k).strip(): v for k, v in overrides.items()}
  if isinstance(overrides, str):
    raise SpecError(f"overrides {overrides!r}: pass a list of key=value strings or a mapping, not one string")
  return parse_overrides(list(overrides))


def check_fsdp_overrides_are_read(spec: RunSpec, over: Mapping[str, Any], command: str = "compare") -> None:
  """SpecError when a comparison's `fsdp.*` override would be ignored: the FSDP2 plan is read by the fsdp side only
  (`--sides torch --set fsdp.offload=true` ran the plain-torch side and never said the key did nothing). `parity
  estimate` and `parity plan` read the fsdp section whatever the sides, so they do not call this."""
  keys = [k for k in over if k == "fsdp" or k.startswith("fsdp.")]
  if keys and command == "diagnose":
    raise SpecError(f"--set {keys[0]}: the fsdp section is the FSDP2 side's plan, and `parity diagnose` has no fsdp "
                    "side (its sides are jax, deepspeed, torch); leave the fsdp keys out")
  if keys and not spec.reads_plan("fsdp"):
    raise SpecError(f"--set {keys[0]}: the fsdp section is the FSDP2 side's plan, and this run's sides "
                    f"({','.join(spec.sides)}) do not include fsdp; add it (--sides {','.join(spec.sides)},fsdp) "
                    "or leave the fsdp keys out")


def _check_tokenizer_is_read(spec: RunSpec, tokenizer) -> None:
  """SpecError when `--tokenizer` would be ignored: a token stream, or the built-in byte-level SFT demo
  (`--tokenizer FILE` with --preset sft-tiny once ran a whole compare and never opened it)."""
  if spec.train.layout == "stream":
    raise SpecError(f"--tokenizer {tokenizer}: only padded/packed example files are tokenized, and this run's data "
                    f"({spec.data}) is a token stream (train.layout=stream); leave --tokenizer out, or give --data "
                    "a JSONL of text examples with --set train.layout=padded")
  if spec.data == SFT_DEMO:
    raise SpecError(f"--tokenizer {tokenizer}: the built-in sft-demo is byte-level (ids 0-257) and uses no "
                    "tokenizer; leave --tokenizer out, or give --data a JSONL of text examples")


def resolve_run(preset_name: str | None = None, *, model: str | None = None, config: str | Path | Mapping | None = None,
                hf_model: str | Path | None = None, plan: str | None = None, hardware: str = "H100",
                deepspeed_config: str | Path | None = None, steps: int | None = None,
                sides: Sequence[str] | None = None, data: str | None = None, micro_batch: int | None = None,
                seq_len: int | None = None, grad_accum: int | None = None, precision: str | None = None,
                overrides: Mapping[str, Any] | Sequence[str] | None = None,
                tokenizer: str | Path | None = None, stack: str | None = None) -> ResolvedRun:
  """Resolves one run from all its sources, in the order of this module's docstring.

  Args:
    preset_name: a parity.presets.PRESETS name, or None (the config's `preset:`, else `model`, else DEFAULT_PRESET).
    model: a model-size preset of parity.hf.MODEL_PRESETS (e.g. llama-7b, gpt2-124m), or its Hugging Face repository
      name in any case (parity.hf.presets.model_preset_name: 'Llama-3.1-8B'): its ModelSpec with
      parity.sizing.memory.model_preset_train's training (micro batch 1, seq_len min(2048, max_seq_len), bf16).
    config: a run config file (YAML/JSON/hjson) or mapping with sections model, train, jax, deepspeed (+ preset,
      data, sides, timeout_s), or a `parity port` output.
    hf_model: a local Hugging Face checkpoint folder.
    plan: a parity.sizing.plans.PLANS name, or 'auto' (the fastest pair that fits `hardware` by the memory model).
    hardware: a parity.sizing.plans.HARDWARE preset, for plan='auto'.
    deepspeed_config: a DeepSpeed JSON config file.
    steps, sides, data: train.steps, sides and data.
    micro_batch, seq_len, grad_accum, precision: train.micro_batch_size, seq_len, grad_accum_steps, precision.
    overrides: dotted overrides, a mapping {'train.lr': 3e-4} or strings ['train.lr=3e-4'].
    tokenizer: a folder with tokenizer.json for text example records (default: hf_model's folder).
    stack: the training stack that runs `deepspeed_config` (parity.migrate._stack.STACKS; default: chosen from the
      config, hf-trainer when it has "auto" values, else deepspeed); refused without a DeepSpeed config.
  Returns:
    The frozen ResolvedRun.
  Raises:
    SpecError (and its subclasses), DataError: unknown names or keys, wrong types, out-of-range values, a refused
      DeepSpeed config, a conflict between two sources (both named).
  """
  over = overrides_mapping(overrides)
  model = None if model is None else model_preset_name(model)  # 'Llama-3.1-8B' or its HF repo id: 'llama-3.1-8b'
  name, spec, init_source, init_params = _base_config_checkpoint(preset_name, model, config, hf_model)  # 1, 2, 3
  sides_named = sides is not None or "sides" in over or spec.sides != _DEFAULT_SIDES
  # 5 and 6 as one mapping of dotted keys, the overrides after the flags (a later key wins)
  user = {**_flag_values(steps=steps, sides=sides, data=data, micro_batch=micro_batch, seq_len=seq_len,
                         grad_accum=grad_accum, precision=precision), **over}
  plan_choice = None
  if plan is not None:                                                            # 4, then 5 and 6 over it
    pair, plan_choice = _plan_pair(spec, user, plan, hardware)
    spec = plans.with_plan(spec, pair)
  spec = apply_overrides(spec, user) if user else spec                           # 5, 6
  spec, ds_cfg, port = _deepspeed_config_step(deepspeed_config, spec, over, stack)  # 7
  spec = _validated(spec, plan, plan_choice)
  if init_params is not None:
    _check_init_shapes(spec, init_params, init_source)
  if tokenizer is not None:
    _check_tokenizer_is_read(spec, tokenizer)
  plan_record = _plan_record(spec, plan_choice, over)
  if deepspeed_config is not None and plan_record is not None:  # the config's port decided the plans, not a default
    plan_record = {**plan_record, "chosen_by": f"the DeepSpeed config {deepspeed_config}"}
  return ResolvedRun(spec=spec, preset=name, plan=plan_record, init_source=init_source,
                     tokenizer=None if tokenizer is None else str(Path(tokenizer).expanduser().absolute()),
                     init_params=init_params, deepspeed_config=ds_cfg, sides_named=sides_named,
                     deepspeed_source=str(deepspeed_config) if deepspeed_config else None, port=port, overrides=over)


def _validated(spec: RunSpec, plan: str | None, plan_choice: Mapping[str, Any] | None) -> RunSpec:
  """The settled, validated spec; a refusal under --plan names the plan (and that the planner chose it, for auto)."""
  try:
    return _settle(spec).validate()
  except SpecError as exc:
    if plan is None:
      raise SpecError(str(exc)) from None
    chosen = f"--plan auto chose {plan_choice['name']!r}" if plan == "auto" else f"plan {plan_choice['name']!r}"
    raise SpecError(f"{chosen}: {exc}") from None


def _base_config_checkpoint(preset_name: str | None, model: str | None, config: str | Path | Mapping | None,
                            hf_model: str | Path | None) -> tuple[str, RunSpec, str | None, Any]:
  """Steps 1-3 of resolve_run: the base preset (`_base_name`, `_base`), the config merged over it (a config file's
  relative data path taken from the file's folder), then a Hugging Face checkpoint's model section and weights.
  Returns (preset name, spec, init_source: the checkpoint folder, absolute, or None, init_params: its canonical
  weights or None). Raises SpecError / DataError as resolve_run does."""
  cfg, source = _config_mapping(config)
  name = _base_name(preset_name, model, cfg.pop("preset", None), source)
  if isinstance(config, (str, Path)):
    cfg = _data_relative_to(cfg, Path(config))
  spec = _base_with_config(_base(name, model), cfg, source)                       # 1, 2
  init_source, init_params = None, None
  if hf_model is not None:                                                        # 3
    spec, init_params = _from_checkpoint(hf_model, spec)
    init_source = str(Path(hf_model).expanduser().absolute())
  return name, spec, init_source, init_params


def _plan_record(spec: RunSpec, plan_choice: dict | None, over: Mapping[str, Any]) -> dict:
  """The run's plan record: the named plan chosen (with the jax./deepspeed./fsdp. overrides put on top of it, as
  key=value strings), or the plan the settled spec describes (`_plan_of`) when none was named; with an fsdp side and a
  pair that has no FSDP2 plan, `fsdp` says so (the pair describes the other sides only)."""
  record = _plan_of(spec) if plan_choice is None else plan_choice
  if plan_choice is not None and plan_choice.get("name") is not None:
    on_top = {k: v for k, v in over.items() if k.startswith(("jax.", "deepspeed.", "fsdp."))}
    if on_top:
      plan_choice["overrides"] = [f"{k}={json.dumps(v)}" for k, v in on_top.items()]
  pair = plans.PLANS.get((record or {}).get("name"))
  if pair is not None and pair.fsdp is None and spec.reads_plan("fsdp"):  # the pair says nothing of the fsdp side
    record = {**record, "fsdp": f"{plans.fsdp_missing_reason(pair)}: the fsdp side runs the run's own fsdp plan"}
  return record


def _config_mapping(config) -> tuple[dict[str, Any], str]:
  if config is None:
    return {}, "config"
  if isinstance(config, (str, Path)):
    return dict(load_config_file(config)), str(config)
  if isinstance(config, Mapping):
    return dict(config), "config"
  raise SpecError(f"config: expected a file path or a mapping, got {type(config).__name__}")


def _base(name: str, model: str | None) -> RunSpec:
  """The run preset `name`, or for a model-size preset its ModelSpec with model_preset_train's training."""
  if model is None:
    return preset(name)
  if model not in MODEL_PRESETS:
    raise SpecError(f"unknown model preset {model!r}; known model presets: {', '.join(MODEL_PRESETS)} "
                    "(see `parity presets`)")
  return RunSpec(model=MODEL_PRESETS[model], train=model_preset_train(MODEL_PRESETS[model]))


def _base_with_config(base: RunSpec, cfg: dict[str, Any], source: str) -> RunSpec:
  """The base run with the config's sections merged over it (or a `parity port` output mapped onto it)."""
  if str(cfg.get("schema", "")).startswith("parity.ported/"):  # `parity port`'s output: a DeepSpeed run's JAX config
    return to_run_spec(load_ported(cfg, source=source), base)
  try:
    spec = from_dict(RunSpec, _merge(to_dict(base), cfg))
    check_numbers(spec)  # out-of-range numbers are named with the file they came from
  except SpecError as exc:
    raise SpecError(f"{source}: {exc}") from None
  return spec


def _base_name(preset_name: str | None, model: str | None, named: str | None, source: str) -> str:
  """The preset the run is built on: the config's own `preset:`, the preset argument or the model preset (two that
  disagree are refused, naming both), else DEFAULT_PRESET."""
  if named is not None and preset_name is not None and named != preset_name:
    raise SpecError(f"{source} names preset {named!r} but the preset given is {preset_name!r}; drop one of them")
  if model is not None and (named or preset_name) is not None:
    raise SpecError(f"model preset {model!r} and preset {named or preset_name!r} (from "
                    f"{source if named else 'the preset argument'}) both name the base run; give one of them")
  return named or preset_name or model or DEFAULT_PRESET


def _flag_values(**flags: Any) -> dict[str, Any]:
  """The given (not None) flags as dotted keys of the RunSpec (steps -> train.steps, micro_batch ->
  train.micro_batch_size, ...)."""
  keys = {"steps": "train.steps", "sides": "sides", "data": "data", "micro_batch": "train.micro_batch_size",
          "seq_len": "train.seq_len", "grad_accum": "train.grad_accum_steps", "precision": "train.precision"}
  return {keys[k]: (list(v) if k == "sides" else v) for k, v in flags.items() if v is not None}


def _settle(spec: RunSpec) -> RunSpec:
  """What follows from the resolved values: eval_every at most the run's steps; a relative data path (from --data
  or --set) made absolute against the current directory, since workers run from the repository root."""
  if spec.train.eval_every > spec.train.steps:
    spec = dataclasses.replace(spec, train=dataclasses.replace(spec.train, eval_every=spec.train.steps))
  if _is_path(spec.data) and not Path(spec.data).expanduser().is_absolute():
    spec = dataclasses.replace(spec, data=str(Path(spec.data).expanduser().absolute()))
  return spec


def _from_checkpoint(hf_model, spec: RunSpec):
  try:
    # validated in resolve_run after the overrides: `--set train.seq_len=32` fits a preset to a short context
    return hf.run_spec_from_hf(hf_model, spec, bin_reader=convert.read_bin, validate=False)
  except (ValueError, FileNotFoundError) as exc:  # HFFormatError is a SpecError (a ValueError)
    raise SpecError(f"--hf-model {hf_model}: {exc}") from None


def _check_init_shapes(spec: RunSpec, init: Mapping[str, Any], source: str | None) -> None:
  """The checkpoint's weights must still fit the model after the overrides (e.g. `--set model.d_model=` would not)."""
  want = weights.param_shapes(spec.model)
  bad = [n for n, shp in want.items() if n not in init or tuple(init[n].shape) != tuple(shp)]
  if bad:
    n = bad[0]
    got = tuple(init[n].shape) if n in init else "missing"
    raise SpecError(f"--hf-model {source}: the overrides change the model so its weights no longer fit "
                    f"({n}: checkpoint {got}, model {tuple(want[n])}); override only settings that keep the shapes "
                    f"(e.g. model.norm_eps), or drop --hf-model")


def _plan_pair(spec: RunSpec, user: Mapping[str, Any], plan: str, hardware: str):
  """(the named or planner-chosen parity.sizing.plans.Plan (.jax, .deepspeed), {name, chosen_by, why?}). A named pair is
  validated with the rest of the run at the end; the planner ('auto') chooses for the run as the flags and
  overrides (`user`, dotted keys) will make it."""
  # the sides the run will have (a list from --sides or an override; anything else apply_overrides refuses later)
  sides = tuple(user["sides"]) if isinstance(user.get("sides"), (list, tuple)) else spec.sides
  if plan != "auto":
    if plan not in plans.PLANS:
      raise SpecError(f"unknown plan {plan!r}; known plans: {', '.join(plans.PLANS)} (or 'auto')")
    pair = plans.PLANS[plan]
    if pair.fsdp is None and reads_plan(sides, "fsdp"):  # the pair says nothing of it
      with_fsdp = ", ".join(n for n, p in plans.PLANS.items() if p.fsdp is not None)
      raise SpecError(f"--plan {plan}: {plans.fsdp_missing_reason(pair)}, and the sides include fsdp; name a pair "
                      f"that has one ({with_fsdp}), or leave --plan out (the fsdp side then runs its own fsdp "
                      "section, the report says which)")
    return pair, {"name": plan, "chosen_by": "user"}
  if hardware not in plans.HARDWARE:
    raise SpecError(f"--hardware {hardware!r} is not a preset; known: {', '.join(plans.HARDWARE)}")
  run = apply_overrides(spec, user) if user else spec
  best, ranked = plans.choose_plan(run.model, run.train, plans.HARDWARE[hardware], sides=tuple(
      s for s in run.sides if side_record(s).plan) or ("jax",))  # the sides with a plan: a pair has one for each
  if best is None:
    raise SpecError(f"--plan auto: no plan pair fits {hardware}: " + "; ".join(plans.explain(best, ranked)))
  pair = plans.PLANS[best.name]
  if best.jax_opt_ratio is not None:  # the share of the optimizer state the planner offloads (plans.OPT_RATIOS)
    pair = dataclasses.replace(pair, jax=dataclasses.replace(pair.jax, offload_opt_ratio=best.jax_opt_ratio))
  return pair, {"name": best.name, "chosen_by": f"planner ({hardware})",
                "why": [*best.notes, *plans.explain(best, ranked)]}


def _plan_of(spec: RunSpec) -> dict | None:
  """The pair the run's plans happen to be (the default pair unless the config or overrides changed them)."""
  matched = plan_of(spec)
  if matched is None:
    return None
  return {"name": matched, "chosen_by": "default" if matched == DEFAULT_PLAN else "the run's settings"}


def _deepspeed_config_step(deepspeed_config, spec: RunSpec, over: Mapping[str, Any], stack: str | None):
  """Step 7: (spec, DeepSpeed config, port) with the config ported over the spec (`_port`), or the spec unchanged
  and (None, None) without one; a --stack without a DeepSpeed config is refused."""
  if deepspeed_config is not None:
    return _port(deepspeed_config, spec, over, stack)
  if stack is not None:
    raise SpecError(f"--stack {stack}: it says which training stack runs a DeepSpeed config, and this run has none; "
                    "add --deepspeed-config FILE, or leave --stack out")
  return spec, None, None


def _plan_sections() -> set[str]:
  """The run sections that hold a side's plan (each record's `plan`)."""
  return {record.plan for record in all_sides() if record.plan}


def _port(deepspeed_config, spec: RunSpec, over: Mapping[str, Any], stack: str | None = None):
  """Ports the DeepSpeed config against `spec` under `stack`; refuses an override the config contradicts (both
  values named)."""
  ported, ds_cfg, port = port_for_compare(read_deepspeed_config(deepspeed_config), spec, source=str(deepspeed_config),
                                          stack=stack)
  want, got = to_dict(spec), to_dict(ported)
  for key in over:
    mine, theirs = get_dotted(want, key), get_dotted(got, key)
    if mine != theirs:
      # no "auto" of a DeepSpeed config fills a side's plan section (migrate._resolve.AUTO_RULES sets none of them)
      auto = "" if key.split(".")[0] in _plan_sections() else " (or set it to \"auto\" to take it from the run)"
      raise SpecError(f"--set {key}={mine!r} conflicts with --deepspeed-config {deepspeed_config}, which sets it to "
                      f"{theirs!r}; the DeepSpeed side runs that file as written, so change the value there{auto}, "
                      "or drop the --set")
  return ported, ds_cfg, port
