"""Resolving a run (preset + config file + overrides) and laying out its run folder."""
from __future__ import annotations

import datetime as _dt
import json
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from parity import weights
from parity.data import Corpus, load_corpus, make_batches
from parity.protocol import DEBUG_KEYS, REQUEST_SCHEMA, parse_debug_value
from parity.spec import DEFAULT_PRESET, RunSpec, SpecError, apply_overrides, config_hash, from_dict, preset, to_dict

__all__ = ["resolve", "load_config_file", "prepare_run_dir", "default_run_dir", "parse_perturb"]


def load_config_file(path: str | Path) -> dict[str, Any]:
  """Reads a run config: YAML, or JSON as DeepSpeed reads it (comments, trailing commas).

  The readers are parity.migrate's, so run configs and DeepSpeed configs parse alike.
  Raises:
    SpecError: missing file, a syntax error (with file, line and column), or a top level that is not a mapping.
  """
  from parity.migrate._read import PortError, read_deepspeed_config, read_structured
  p = Path(path)
  if not p.exists():
    raise SpecError(f"config file not found: {p}")
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
            overrides: Sequence[str] = (), steps: int | None = None, sides: Sequence[str] | None = None,
            data: str | None = None) -> RunSpec:
  """Builds the RunSpec of a comparison: preset, then config file, then flags, then `key=value` overrides.

  A config file may name its own base with a top-level `preset:` key. A config written by `parity port`
  (schema 'parity.ported/1') sets the training and plan sections; the model and data come from the preset.
  Raises:
    SpecError: unknown preset or key, a value of the wrong type or out of range.
  """
  cfg: dict[str, Any] = {}
  source = "config"
  if isinstance(config, (str, Path)):
    source = str(config)
    cfg = load_config_file(config)
    cfg = _data_relative_to(cfg, Path(config))
  elif config is not None:
    cfg = dict(config)
  name = cfg.pop("preset", None) or preset_name or DEFAULT_PRESET
  if cfg.get("schema") == "parity.ported/1":  # the output of `parity port`: the JAX config of a DeepSpeed run
    from parity.migrate._reverse import load_ported, to_run_spec
    spec = to_run_spec(load_ported(cfg, source=source), preset(name))
    cfg = {}
  else:
    spec = None
  base = to_dict(spec if spec is not None else preset(name))
  try:
    spec = from_dict(RunSpec, _merge(base, cfg))
    from parity.spec import check_numbers
    check_numbers(spec)  # out-of-range numbers are named with the file they came from
  except SpecError as exc:
    raise SpecError(f"{source}: {exc}") from None
  flags = {}
  if steps is not None:
    flags["train"] = {"steps": steps}
  if sides is not None:
    flags["sides"] = list(sides)
  if data is not None:
    flags["data"] = data
  if flags:
    spec = from_dict(RunSpec, _merge(to_dict(spec), flags))
  if overrides:
    spec = apply_overrides(spec, list(overrides))
  if spec.train.eval_every > spec.train.steps:
    spec = apply_overrides(spec, [f"train.eval_every={spec.train.steps}"])
  if _is_path(spec.data) and not Path(spec.data).expanduser().is_absolute():  # --data / --set: relative to the cwd
    import dataclasses
    spec = dataclasses.replace(spec, data=str(Path(spec.data).expanduser().absolute()))
  return spec.validate()


def _is_path(data: Any) -> bool:
  return isinstance(data, str) and bool(data.strip()) and data != "stdlib"


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
    from parity.data import DataError
    raise DataError(f"{config}: data {data!r} is resolved relative to the config file's folder {where}, and "
                    f"{resolved} does not exist; fix the path (or make it absolute)")
  return {**cfg, "data": str(resolved)}


PERTURBABLE = frozenset({
    "model.norm_eps", "model.gelu_approximate", "model.attn_scale", "model.rope_theta",
    "train.lr", "train.warmup_steps", "train.warmup_min_ratio", "train.cos_min_ratio", "train.lr_schedule",
    "train.lr_schedule_params", "train.beta1", "train.beta2", "train.eps", "train.weight_decay", "train.grad_clip",
    "train.precision", "train.loss_scale", "train.initial_scale_power", "train.loss_scale_window",
    "train.hysteresis", "train.consecutive_hysteresis", "train.min_loss_scale"})
"""Settings one side may change on its own: numerics only. Weights and batches are shared files, so keys that
shape them (seeds, sizes, steps, layer layout) cannot differ per side."""


def parse_perturb(items: Sequence[str], sides: Sequence[str]) -> dict[str, dict[str, Any]]:
  """Parses `--perturb side:key=value` (debug: make one side differ on purpose).

  Keys: `model.<field>` / `train.<field>` (applied to that side's spec only) or one of
  DEBUG_KEYS (nan_at_step, kill_at_step, hang_at_step, raise_at_step: a step; overflow_at_steps: a JSON
  list of steps, e.g. `jax:overflow_at_steps=[3,7]`).
  Raises:
    SpecError: malformed item, unknown side, or unknown key.
  """
  out: dict[str, dict[str, Any]] = {}
  for item in items:
    side, sep, kv = item.partition(":")
    if not sep or "=" not in kv:
      raise SpecError(f"--perturb {item!r} must look like SIDE:KEY=VALUE, e.g. jax:model.norm_eps=1e-3")
    if side not in sides:
      raise SpecError(f"--perturb {item!r}: side {side!r} is not among the sides run ({', '.join(sides)})")
    key, raw = kv.split("=", 1)
    if key not in DEBUG_KEYS and key not in PERTURBABLE:
      hint = (" (it shapes the shared weights or batches, so it cannot differ per side)"
              if key.startswith(("model.", "train.")) else "")
      raise SpecError(f"--perturb {item!r}: {key!r} cannot be perturbed{hint}; use one of "
                      f"{', '.join(sorted(PERTURBABLE))} or {', '.join(DEBUG_KEYS)}")
    try:
      value = json.loads(raw)
    except json.JSONDecodeError:
      value = raw
    if key in DEBUG_KEYS:
      try:
        value = parse_debug_value(key, value)
      except ValueError as exc:
        raise SpecError(f"--perturb {item!r}: {exc}") from None
      value = list(value) if isinstance(value, tuple) else value
    out.setdefault(side, {})[key] = value
  for side, kv in out.items():  # validate overrides now, not inside a worker
    fields = [f"{k}={json.dumps(v)}" for k, v in kv.items() if k not in DEBUG_KEYS]
    if fields:
      apply_overrides(RunSpec(), fields).validate()
  return out


def default_run_dir(spec: RunSpec, name: str) -> Path:
  stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
  return Path("runs") / f"{stamp}-{name}-{config_hash(spec)[:8]}"


def prepare_run_dir(spec: RunSpec, run_dir: str | Path, *, perturb: Mapping[str, Mapping] | None = None,
                    corpus: Corpus | None = None, init_params: Mapping[str, np.ndarray] | None = None,
                    deepspeed_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """Writes config.json, init.safetensors, batches.npy, val_batches.npy and request.json.

  Args:
    init_params: canonical initial weights (e.g. from a Hugging Face checkpoint); default: the
      GPT-2 init of `parity.weights.init_params` with train.seed.
    deepspeed_config: a resolved DeepSpeed config the DeepSpeed side must run verbatim
      (`--deepspeed-config`); default: the one built from the spec.
  Returns:
    {'request': ..., 'corpus': {source, sha256, tokens}, 'prepare_s': seconds}.
  Raises:
    DataError: the corpus is missing or too small.
    SpecError: the corpus needs a larger vocabulary than the model has.
  """
  t0 = time.time()
  run_dir = Path(run_dir)
  if run_dir.exists() and not run_dir.is_dir():
    raise SpecError(f"--out {run_dir}: exists and is not a folder")
  try:
    run_dir.mkdir(parents=True, exist_ok=True)
  except OSError as exc:
    raise SpecError(f"--out {run_dir}: cannot create the run folder ({exc.strerror})") from None
  corpus = corpus or load_corpus(spec.data)
  if corpus.vocab_size > spec.model.vocab_size:
    raise SpecError(f"data {spec.data!r} has token ids up to {corpus.vocab_size - 1}, beyond "
                    f"model.vocab_size={spec.model.vocab_size}; set model.vocab_size >= {corpus.vocab_size}")
  t = spec.train
  train, val = make_batches(corpus, steps=t.steps, grad_accum_steps=t.grad_accum_steps,
                            micro_batch_size=t.micro_batch_size, seq_len=t.seq_len, seed=t.data_seed,
                            eval_batches=t.eval_batches)
  np.save(run_dir / "batches.npy", train)
  np.save(run_dir / "val_batches.npy", val)
  if init_params is None:
    params, meta = weights.init_params(spec.model, t.seed), {"seed": str(t.seed)}
  else:
    params, meta = dict(init_params), {"source": "given"}
    weights.check_names_and_shapes(params, spec.model, source="initial weights")
  weights.save(params, run_dir / "init.safetensors", metadata={**meta, **weights.spec_metadata(spec.model)})
  data_info = {"source": corpus.source, "sha256": corpus.sha256, "train_tokens": int(corpus.train.size),
               "val_tokens": int(corpus.val.size), "files": corpus.n_files}
  (run_dir / "config.json").write_text(json.dumps(to_dict(spec), indent=2))
  request = {"schema": REQUEST_SCHEMA, "run": to_dict(spec), "config_hash": config_hash(spec),
             "init_weights": "init.safetensors", "batches": "batches.npy", "val_batches": "val_batches.npy",
             "perturb": {k: dict(v) for k, v in (perturb or {}).items()}, "data": data_info,
             "deepspeed_config": dict(deepspeed_config) if deepspeed_config is not None else None}
  (run_dir / "request.json").write_text(json.dumps(request, indent=2))
  return {"request": request, "corpus": data_info, "prepare_s": time.time() - t0}
