"""A run's folder: per-side perturbations, claiming the folder, and writing the run's inputs (request, weights,
batches) into it once."""
from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import json
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from parity import weights
from parity.data import Corpus, load_corpus, make_batches
from parity.protocol.layout import DEBUG_KEYS, REQUEST_SCHEMA, parse_debug_value
from parity.pipeline.claim import (LOCK_NAME, RUN_INPUTS, RUN_MARKERS, RunFolder, RunFolderError, RunIOError,  # noqa: F401
                          claim_run_dir, read_lock)
from parity.spec import RunSpec, SpecError, apply_overrides, config_hash, to_dict

__all__ = ["prepare_run_dir", "default_run_dir", "parse_perturb", "check_perturb",
           "claim_run_dir",
           "RunFolder", "RunFolderError", "RunIOError", "read_lock", "write_new", "LOCK_NAME", "PreparedRun",
           "open_run_folder"]


PERTURBABLE = frozenset({
    "model.norm_eps", "model.gelu_approximate", "model.attn_scale", "model.rope_theta",
    "train.lr", "train.warmup_steps", "train.warmup_min_ratio", "train.cos_min_ratio", "train.lr_schedule",
    "train.lr_schedule_params", "train.beta1", "train.beta2", "train.eps", "train.weight_decay", "train.grad_clip",
    "train.precision", "train.loss_scale", "train.initial_scale_power", "train.loss_scale_window",
    "train.hysteresis", "train.consecutive_hysteresis", "train.min_loss_scale", "train.optimizer", "train.momentum",
    "train.dampening", "train.nesterov", "train.lamb_max_coeff", "train.lamb_min_coeff", "train.eps_inside_sqrt"})
"""Settings one side may change on its own: numerics only. Weights and batches are shared files, so keys that
shape them (seeds, sizes, steps, layer layout) cannot differ per side."""


def parse_perturb(items: Sequence[str], sides: Sequence[str], spec: RunSpec | None = None) -> dict[str, dict[str, Any]]:
  """Parses `--perturb side:key=value` (debug: make one side differ on purpose).

  Keys: `model.<field>` / `train.<field>` (applied to that side's spec only) or one of
  DEBUG_KEYS (nan_at_step, kill_at_step, hang_at_step, raise_at_step: a step; overflow_at_steps: a JSON
  list of steps, e.g. `jax:overflow_at_steps=[3,7]`).
  Each side's changes are validated on top of `spec` (the run's own; a default RunSpec when None), so a change
  that is valid for this run (e.g. OneCycle's lr_schedule_params on a OneCycle run) is accepted.
  Raises:
    SpecError: malformed item, unknown side, or unknown key, or a change the run's spec refuses.
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
    from parity.spec import parse_value
    value = parse_value(raw, f"--perturb {item[:60]!r}")  # deep nesting and inf/nan refused as in config files
    if key in DEBUG_KEYS:
      try:
        value = parse_debug_value(key, value)
      except ValueError as exc:
        raise SpecError(f"--perturb {item!r}: {exc}") from None
      value = list(value) if isinstance(value, tuple) else value
    out.setdefault(side, {})[key] = value
  check_perturb(out, spec)
  return out


def check_perturb(perturb: Mapping[str, Mapping[str, Any]], spec: RunSpec | None = None) -> None:
  """Validates each side's spec changes on top of `spec` now, not inside a worker. Raises SpecError naming the side."""
  for side, kv in perturb.items():
    fields = {k: v for k, v in kv.items() if k not in DEBUG_KEYS}
    if fields:
      try:
        apply_overrides(spec if spec is not None else RunSpec(), fields).validate()
      except SpecError as exc:
        raise SpecError(f"--perturb {side}: {exc}") from None


def write_new(path: str | Path, data: str | bytes | Callable[[Any], None]) -> None:
  """Writes a file that must not exist yet (O_EXCL): a run's files are never written over an earlier run's.

  Args:
    path: the file.
    data: its text (UTF-8), its bytes, or a function writing to the open binary file.
  Raises:
    RunFolderError: the file exists already.
    RunIOError: it could not be written (disk full, read-only folder, ...); the partial file is removed.
  """
  path = Path(path)
  try:
    f = open(path, "xb")
  except FileExistsError:
    raise RunFolderError(f"{path} exists already (an earlier run's file); a run never writes over or reads another "
                         "run's files: choose a new or empty folder") from None
  except OSError as exc:
    raise RunIOError(exc.errno, f"cannot create {path} ({exc.strerror}); the folder {path.parent} must be writable "
                                "with free space") from None
  try:
    with f:
      if callable(data):
        data(f)
      else:
        f.write(data.encode() if isinstance(data, str) else data)
  except OSError as exc:
    with contextlib.suppress(OSError):
      path.unlink()
    raise RunIOError(exc.errno, f"cannot write {path} ({exc.strerror}); the folder {path.parent} must be writable "
                                "with free space") from None


def default_run_dir(spec: RunSpec, name: str) -> Path:
  stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
  return Path("runs") / f"{stamp}-{name}-{config_hash(spec)[:8]}"


def prepare_run_dir(spec: RunSpec, run_dir: str | Path, *, perturb: Mapping[str, Mapping] | None = None,
                    corpus: Corpus | None = None, init_params: Mapping[str, np.ndarray] | None = None,
                    deepspeed_config: Mapping[str, Any] | None = None, run_id: str | None = None) -> dict[str, Any]:
  """Writes config.json, init.safetensors, batches.npy, val_batches.npy and request.json, each as a new file.

  None of them may exist already (RUN_INPUTS): a run never reads inputs an earlier run left in its folder.
  `parity compare` first claims a fresh, locked folder (`claim_run_dir`); other callers pass a new or empty one.

  Args:
    init_params: canonical initial weights (e.g. from a Hugging Face checkpoint); default: the
      GPT-2 init of `parity.weights.init_params` with train.seed.
    deepspeed_config: a resolved DeepSpeed config the DeepSpeed side must run verbatim
      (`--deepspeed-config`); default: the one built from the spec.
    run_id: this run's id, recorded in request.json (derived requests and side summaries carry it on); default:
      a new one.
  Returns:
    {'request': ..., 'corpus': {source, sha256, tokens}, 'prepare_s': seconds}.
  Raises:
    DataError: the corpus is missing or too small.
    SpecError: the corpus needs a larger vocabulary than the model has; RunFolderError: an input file of an
      earlier run is in the folder.
    RunIOError: a file could not be written (disk full, read-only folder); the message names it.
  """
  t0 = time.time()
  run_dir = _input_folder(Path(run_dir))
  corpus = corpus or load_corpus(spec.data)
  if corpus.vocab_size > spec.model.vocab_size:
    raise SpecError(f"data {spec.data!r} has token ids up to {corpus.vocab_size - 1}, beyond "
                    f"model.vocab_size={spec.model.vocab_size}; set model.vocab_size >= {corpus.vocab_size}")
  t = spec.train
  train, val = make_batches(corpus, steps=t.steps, grad_accum_steps=t.grad_accum_steps,
                            micro_batch_size=t.micro_batch_size, seq_len=t.seq_len, seed=t.data_seed,
                            eval_batches=t.eval_batches)
  write_new(run_dir / "batches.npy", lambda f: np.save(f, train))
  write_new(run_dir / "val_batches.npy", lambda f: np.save(f, val))
  _write_init(run_dir / "init.safetensors", spec, init_params)
  data_info = {"source": corpus.source, "sha256": corpus.sha256, "train_tokens": int(corpus.train.size),
               "val_tokens": int(corpus.val.size), "files": corpus.n_files}
  write_new(run_dir / "config.json", json.dumps(to_dict(spec), indent=2))
  request = {"schema": REQUEST_SCHEMA, "run_id": run_id or uuid.uuid4().hex, "run": to_dict(spec),
             "config_hash": config_hash(spec),
             "init_weights": "init.safetensors", "batches": "batches.npy", "val_batches": "val_batches.npy",
             "perturb": {k: dict(v) for k, v in (perturb or {}).items()}, "data": data_info,
             "deepspeed_config": dict(deepspeed_config) if deepspeed_config is not None else None}
  write_new(run_dir / "request.json", json.dumps(request, indent=2))  # last: a folder with it is complete
  return {"request": request, "corpus": data_info, "prepare_s": time.time() - t0}


def _input_folder(run_dir: Path) -> Path:
  """The run folder, created if missing; refused (RunFolderError) when not a folder or holding an input file
  (RUN_INPUTS) of an earlier run."""
  if run_dir.exists() and not run_dir.is_dir():
    raise RunFolderError(f"--out {run_dir}: exists and is not a folder")
  try:
    run_dir.mkdir(parents=True, exist_ok=True)
  except OSError as exc:
    raise RunFolderError(f"--out {run_dir}: cannot create the run folder ({exc.strerror})") from None
  earlier = [n for n in RUN_INPUTS if (run_dir / n).exists() or (run_dir / n).is_symlink()]
  if earlier:
    raise RunFolderError(f"--out {run_dir}: holds {', '.join(earlier)} of an earlier run; a run never reads another "
                         "run's inputs: choose a new or empty folder")
  return run_dir


def _write_init(path: Path, spec: RunSpec, init_params: Mapping[str, np.ndarray] | None) -> None:
  """init.safetensors (new file): the given canonical weights (names and shapes checked) or the seeded GPT-2 init,
  float32, with the model spec in its metadata."""
  t = spec.train
  if init_params is None:
    params, meta = weights.init_params(spec.model, t.seed), {"seed": str(t.seed)}
  else:
    params, meta = dict(init_params), {"source": "given"}
    weights.check_names_and_shapes(params, spec.model, source="initial weights")
  from safetensors.numpy import save as safetensors_bytes
  write_new(path, safetensors_bytes(
      {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in params.items()},  # as weights.save writes them
      metadata={**meta, **weights.spec_metadata(spec.model)}))


@dataclasses.dataclass(frozen=True)
class PreparedRun:
  """A claimed run folder with the run's inputs written (`open_run_folder`).

  Attributes: path (the folder), claim (its RunFolder lock: release it when the run ends), data_info (the corpus:
  source, sha256, token counts), prepare_s (seconds spent writing the inputs), init (the run's own initial weights,
  canonical name -> float32 array, read back once from init.safetensors).
  """
  path: Path
  claim: "RunFolder"
  data_info: dict[str, Any]
  prepare_s: float
  init: dict[str, np.ndarray]


def open_run_folder(run: Any, out: str | Path | None, perturb: Mapping[str, Mapping], *, force: bool = False,
                    command: str | None = None) -> PreparedRun:
  """Claims the run folder of a resolved run (parity.pipeline.resolve.ResolvedRun) and writes its inputs.

  Sizes that cannot fit are refused before any folder or array exists (parity.sizing.resources.check_resources); then the
  folder is claimed (`claim_run_dir`: `out`, default runs/<time>-<preset>-<hash>), the inputs written
  (`prepare_run_dir`; with a DeepSpeed config also migration.json/.md) and init.safetensors read back.
  Raises:
    SpecError, DataError, RunFolderError, RunIOError: as those functions; nothing of this run is left behind.
  """
  from parity.sizing.resources import check_resources
  folder = Path(out) if out is not None else default_run_dir(run.spec, run.preset)
  check_resources(run.spec, folder)
  claim = claim_run_dir(out if out is not None else folder, force=force, command=command)  # '' refused, not '.'
  try:
    ds_cfg = dict(run.deepspeed_config) if run.deepspeed_config is not None and run.port is not None else None
    prep = prepare_run_dir(run.spec, folder, perturb=perturb, init_params=run.init_params, deepspeed_config=ds_cfg,
                           run_id=claim.run_id)
    if run.port is not None:
      write_new(folder / "migration.json", run.port.report.to_json())
      write_new(folder / "migration.md", run.port.report.to_markdown())
    init = weights.load(folder / "init.safetensors")  # the run's own, read once, before any side can touch it
  except BaseException:  # refused or failed before any side started: leave nothing of this run behind
    claim.abandon()
    raise
  return PreparedRun(path=folder, claim=claim, data_info=prep["corpus"], prepare_s=prep["prepare_s"], init=init)
