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
from parity.data import Corpus, batch_dtype, load_corpus, make_batches
from parity.protocol.layout import DEBUG_KEYS, REQUEST_SCHEMA, parse_debug_value
from parity.protocol.semantics import TRAIN_ANYWAY_KEY
from parity.pipeline.claim import RUN_INPUTS, RunFolder, RunFolderError, RunIOError, claim_run_dir
from parity.pipeline.perturb import PerturbPlan, plan_perturbations
from parity.pipeline.examples_input import EXAMPLE_ARRAYS, write_example_inputs
from parity.pipeline.plants import check_plants_on_data
from parity.pipeline.request_source import copy_inputs
from parity.overrides import apply_overrides, parse_value
from parity.spec import RunSpec, SpecError, config_hash, to_dict
from parity.sizing.resources import check_resources

__all__ = ["prepare_run_dir", "default_run_dir", "parse_perturb", "check_perturb", "write_new", "PreparedRun",
           "open_run_folder", "DS_GIVEN", "DS_RESOLVED", "inputs_record", "check_vocab", "ENVIRONMENT_FILE",
           "write_environment"]

ENVIRONMENT_FILE = "environment.json"
"""<run_dir>/environment.json: the run's environment block (harness.doctor.run_environment) and its run_id."""
DS_GIVEN = "deepspeed_config.given.json"
"""The DeepSpeed config file exactly as the user gave it (`--deepspeed-config`), copied byte for byte."""
DS_RESOLVED = "deepspeed_config.resolved.json"
"""The DeepSpeed config the DeepSpeed side runs: DS_GIVEN with "auto" filled and its --perturb deepspeed:... written
in (request.json 'deepspeed_config' holds the same)."""


PERTURBABLE = frozenset({
    "model.norm_eps", "model.gelu_approximate", "model.attn_scale", "model.rope_theta", "model.rope_scaling",
    "model.rope_local_theta", "model.attn_softcap", "model.final_softcap", "model.sliding_window", "model.layer_types",
    "model.embed_scale", "model.norm_plus_one",
    "train.lr", "train.warmup_steps", "train.warmup_min_ratio", "train.cos_min_ratio", "train.lr_schedule",
    "train.lr_schedule_params", "train.beta1", "train.beta2", "train.eps", "train.weight_decay", "train.grad_clip",
    "train.precision", "train.loss_scale", "train.initial_scale_power", "train.loss_scale_window",
    "train.hysteresis", "train.consecutive_hysteresis", "train.min_loss_scale", "train.optimizer", "train.momentum",
    "train.dampening", "train.nesterov", "train.lamb_max_coeff", "train.lamb_min_coeff", "train.eps_inside_sqrt",
    "train.decay_mask",
    "train.loss_normalization"})
"""Settings one side may change on its own: numerics only. Weights and batches are shared files, so keys that
shape them (seeds, sizes, steps, layer layout, which tensors exist: biases, q/k and post norms, d_head) cannot differ
per side; model.norm_plus_one keeps the shared weights and changes what the side makes of its norm weights."""


def parse_perturb(items: Sequence[str], sides: Sequence[str], spec: RunSpec | None = None) -> dict[str, dict[str, Any]]:
  """Parses `--perturb side:key=value` (debug: make one side differ on purpose).

  Keys: `model.<field>` / `train.<field>` (applied to that side's spec only) or one of
  DEBUG_KEYS (nan_at_step, kill_at_step, hang_at_step, raise_at_step: a step; overflow_at_steps: a JSON
  list of steps, e.g. `jax:overflow_at_steps=[3,7]`; the planted data bugs PLANT_KEYS: true, e.g.
  `torch:loss_on_prompt=true`, parity.pipeline.plants).
  Each side's changes are validated on top of `spec` (the run's own; a default RunSpec when None), so a change
  that is valid for this run (e.g. OneCycle's lr_schedule_params on a OneCycle run) is accepted.
  Raises:
    SpecError: malformed item, unknown side, or unknown key, the same side and key twice, or a change the run's spec
      refuses.
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
    value = parse_value(raw, f"--perturb {item[:60]!r}")  # deep nesting and inf/nan refused as in config files
    if key in DEBUG_KEYS:
      try:
        value = parse_debug_value(key, value)
      except ValueError as exc:
        raise SpecError(f"--perturb {item!r}: {exc}") from None
      value = list(value) if isinstance(value, tuple) else value
    if key in out.get(side, {}):  # the later one would silently replace the earlier: neither is what was asked
      raise SpecError(f"--perturb {item!r}: {side}:{key} is already given ({side}:{key}={out[side][key]!r}); a side "
                      "runs one value per key, so pass it once")
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
                    deepspeed_config: Mapping[str, Any] | None = None, run_id: str | None = None,
                    deepspeed_source: str | Path | None = None, init_source: str | None = None,
                    plan: PerturbPlan | None = None, tokenizer: str | None = None,
                    train_anyway_on_card_diff: bool = False, inputs_from: str | Path | None = None,
                    preset: str | None = None, world: int = 1) -> dict[str, Any]:
  """Writes config.json, init.safetensors, batches.npy, val_batches.npy and request.json, each as a new file
  (with a DeepSpeed config also DS_GIVEN and DS_RESOLVED).

  None of them may exist already (RUN_INPUTS): a run never reads inputs an earlier run left in its folder.
  `parity compare` first claims a fresh, locked folder (`claim_run_dir`); other callers pass a new or empty one.

  Args:
    init_params: canonical initial weights (e.g. from a Hugging Face checkpoint); default: the
      GPT-2 init of `parity.weights.init_params` with train.seed.
    deepspeed_config: a resolved DeepSpeed config the DeepSpeed side must run verbatim
      (`--deepspeed-config`); default: the one built from the spec.
    run_id: this run's id, recorded in request.json (derived requests and side summaries carry it on); default:
      a new one.
    deepspeed_source: the DeepSpeed config file as the user gave it: copied byte for byte to DS_GIVEN, its sha256
      recorded (request.json 'deepspeed_files').
    init_source: the Hugging Face checkpoint folder the initial weights came from (`--hf-model`), or None; recorded
      with the data and tokenizer that run (request.json 'inputs', `inputs_record`).
    plan: the perturbations as `parity.pipeline.perturb.plan_perturbations` decided them; default: decided here
      from `perturb` and `deepspeed_config`. request.json 'perturb' holds the fields each side applies, the
      'perturbations' records what each requested change does, and 'deepspeed_config' the config the DeepSpeed
      side runs (the resolved one with its perturbations written in; DS_RESOLVED is the same, as a file).
    tokenizer: padded/packed text records: the folder of their tokenizer.json; default: init_source's.
    train_anyway_on_card_diff: recorded as request.json 'train_anyway_on_card_diff': true (only when set): a side
      whose semantics card differs from an earlier side's trains anyway (parity.protocol.semantics.gate).
    inputs_from: `parity compare --request`: the folder whose inputs are copied byte for byte with their records
      (parity.pipeline.request_source.copy_inputs; request.json 'request_from'). preset: request.json 'preset'.
    world: ranks per side (--nproc x --nnodes), which the plants are checked for (a train.loss_normalization
      perturbation that changes nothing on these ranks is refused: parity.pipeline.plants.normalization_reason).
  With train.layout padded or packed, the examples of `spec.data` are laid out instead of a corpus's windows and
  their arrays written beside batches.npy (parity.pipeline.examples_input); request.json 'examples' names them.
  Returns:
    {'request': ..., 'corpus': {source, sha256, tokens}, 'prepare_s': seconds}.
  Raises:
    DataError: the corpus is missing or too small.
    SpecError: the corpus needs a larger vocabulary than the model has (`check_vocab`); a perturbation changes nothing
      its side trains or cannot reach the DeepSpeed side's config (plan_perturbations).
    RunFolderError: an input file of an earlier run is in the folder.
    RunIOError: a file could not be written (disk full, read-only folder); the message names it.
  """
  t0 = time.time()
  plan = plan or plan_perturbations(spec, perturb, deepspeed_config, source=str(deepspeed_source or ""))
  run_dir = _input_folder(Path(run_dir))
  if inputs_from is not None:  # `--request`: the earlier run's own files (parity.pipeline.request_source)
    data_info, inputs, examples, origin = copy_inputs(run_dir, Path(inputs_from), plan.perturb, write_new,
                                                      world=world)
  else:
    data_info, inputs, examples = _write_data(run_dir, spec, plan, corpus, tokenizer, init_source, world)
    _write_init(run_dir / "init.safetensors", spec, init_params)
    origin = None
  write_new(run_dir / "config.json", json.dumps(to_dict(spec), indent=2))
  ds_files = (_write_deepspeed_files(run_dir, deepspeed_source, plan.deepspeed_config)
              if deepspeed_config is not None else None)
  request = _request(spec, run_id, plan, data_info, inputs, ds_files, examples, train_anyway_on_card_diff,
                     {"preset": preset, "request_from": origin})
  write_new(run_dir / "request.json", json.dumps(request, indent=2))  # last: a folder with it is complete
  return {"request": request, "corpus": data_info, "prepare_s": time.time() - t0}


def _write_data(run_dir: Path, spec: RunSpec, plan: PerturbPlan, corpus: Corpus | None, tokenizer: str | None,
                init_source: str | None, world: int = 1) -> tuple[dict[str, Any], Any, Any]:
  """The run's batches (and, padded/packed, its example arrays) made here: (data_info, inputs, examples or None)."""
  if spec.train.layout == "stream":
    return (*_write_stream(run_dir, spec, corpus, init_source), None)
  # padded / packed: examples through parity.dataset (parity.pipeline.examples_input)
  return _write_examples(run_dir, spec, plan, tokenizer or init_source, init_source, world)


def _request(spec: RunSpec, run_id: str | None, plan: PerturbPlan, data_info: dict[str, Any], inputs: Any,
             ds_files: Any, examples: Any, train_anyway: bool,
             extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """request.json's dict (prepare_run_dir): the run, its input files, the perturbation plan and data records;
  'examples' only for padded/packed, TRAIN_ANYWAY_KEY only when set, each of `extra` (preset, request_from) only
  when not None."""
  request = {"schema": REQUEST_SCHEMA, "run_id": run_id or uuid.uuid4().hex, "run": to_dict(spec),
             "config_hash": config_hash(spec),
             "init_weights": "init.safetensors", "batches": "batches.npy", "val_batches": "val_batches.npy",
             "perturb": plan.perturb, "perturbations": plan.records, "data": data_info, "inputs": inputs,
             "deepspeed_config": plan.deepspeed_config, "deepspeed_files": ds_files}
  if examples is not None:
    request["examples"] = examples
  if train_anyway:
    request[TRAIN_ANYWAY_KEY] = True
  request.update({k: v for k, v in (extra or {}).items() if v is not None})
  return request


def _write_examples(run_dir: Path, spec: RunSpec, plan: PerturbPlan, tokenizer: str | None, init_source: str | None,
                    world: int = 1) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
  """The padded/packed layouts' example arrays (parity.pipeline.examples_input.write_example_inputs, with
  `tokenizer` for text records), then the plants checked on them for `world` ranks per side
  (parity.pipeline.plants.check_plants_on_data: SpecError for a plant these batches hide); returns (data_info,
  inputs, examples)."""
  data_info, examples = write_example_inputs(run_dir, spec, write_new, tokenizer=tokenizer)
  check_plants_on_data(plan.perturb, np.load(run_dir / EXAMPLE_ARRAYS["loss_mask"]),
                       np.load(run_dir / EXAMPLE_ARRAYS["segment_ids"]), world=world)  # a hidden plant: exit 2
  inputs = {"data": data_info["source"], "tokens": "examples", "checkpoint": init_source,
            "tokenizer": data_info["card"]["tokenizer"] or "byte-level / pre-tokenized ids (no tokenizer)"}
  return data_info, inputs, examples


def _write_stream(run_dir: Path, spec: RunSpec, corpus: Corpus | None, init_source: str | None
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
  """The stream layout's batches.npy and val_batches.npy (windows of the corpus); returns (data_info, inputs)."""
  corpus = corpus or load_corpus(spec.data)
  check_vocab(corpus, spec.model.vocab_size)
  t = spec.train
  train, val = make_batches(corpus, steps=t.steps, grad_accum_steps=t.grad_accum_steps,
                            micro_batch_size=t.micro_batch_size, seq_len=t.seq_len, seed=t.data_seed,
                            eval_batches=t.eval_batches, dtype=batch_dtype(spec.model.vocab_size))
  write_new(run_dir / "batches.npy", lambda f: np.save(f, train))
  write_new(run_dir / "val_batches.npy", lambda f: np.save(f, val))
  data_info = {"source": corpus.source, "sha256": corpus.sha256, "train_tokens": int(corpus.train.size),
               "val_tokens": int(corpus.val.size), "files": corpus.n_files}
  return data_info, inputs_record(corpus, init_source, spec.model.vocab_size)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json")
"""Files of a Hugging Face checkpoint folder that hold its tokenizer (none of them is read by parity)."""


def check_vocab(corpus: Corpus, vocab_size: int) -> None:
  """Refuses a corpus whose largest id is not below `vocab_size` (model.vocab_size).

  Raises:
    SpecError: naming the data, the largest id and the fix (`--set model.vocab_size=N`).
  """
  if corpus.vocab_size > vocab_size:
    what = "byte-level text needs ids 0-255" if corpus.format == "bytes" else f"its largest id is {corpus.max_id}"
    raise SpecError(f"data {corpus.source!r}: {what}, not below model.vocab_size={vocab_size}; pass "
                    f"--set model.vocab_size={corpus.vocab_size} (or the tokenizer's vocabulary size, if larger)")


_FORMATS = {"nanogpt-bin": "a headerless .bin (nanoGPT)", "llmc-bin": "an llm.c .bin (its header names the dtype)",
            "npy": "a .npy array"}


def inputs_record(corpus: Corpus, init_source: str | None, vocab_size: int | None = None) -> dict[str, Any]:
  """What the run's tokens are and where its weights came from (request.json 'inputs'; report and card show it).

  Args:
    corpus: the corpus the batches were cut from. init_source: the --hf-model folder, or None.
    vocab_size: model.vocab_size (the batches' dtype follows it, `parity.data.batch_dtype`); None: not recorded.
  Returns:
    {data (the corpus source), tokens ('bytes': text read as UTF-8 bytes, ids 0-255, no tokenizer; 'ids': a .bin
     or .npy file's token ids as stored), format (parity.data.Corpus.format), file_dtype (the ids' dtype in the
     file), max_id (largest id of the corpus), vocab_size, batches_dtype (batches.npy's dtype; both None without
     vocab_size), checkpoint (the --hf-model folder, or None), checkpoint_tokenizer_used (False with a checkpoint:
     parity never tokenizes with it; None without), checkpoint_tokenizer_files (those of TOKENIZER_FILES the folder
     holds), tokenizer (one sentence saying which tokens ran)}.
  """
  ids = corpus.format != "bytes"
  found = [n for n in TOKENIZER_FILES if init_source and (Path(init_source) / n).is_file()]
  if ids:
    said = (f"the token ids stored in {_FORMATS.get(corpus.format, corpus.format)} ({corpus.file_dtype}, largest id "
            f"in the file {corpus.max_id}), as the tokenizer that wrote it made them")
    if vocab_size is not None:
      said += f"; model.vocab_size {vocab_size}, batches stored as {batch_dtype(vocab_size).name}"
  else:
    said = "UTF-8 bytes of the text (token ids 0-255); no tokenizer"
  if init_source:
    said += (f"; the checkpoint's tokenizer ({', '.join(found) or 'none in its folder'}) was not used, so the losses "
             "are not the checkpoint's losses on tokenized text")
  return {"data": corpus.source, "tokens": "ids" if ids else "bytes", "format": corpus.format,
          "file_dtype": corpus.file_dtype, "max_id": corpus.max_id, "vocab_size": vocab_size,
          "batches_dtype": None if vocab_size is None else batch_dtype(vocab_size).name,
          "checkpoint": init_source, "checkpoint_tokenizer_used": False if init_source else None,
          "checkpoint_tokenizer_files": found, "tokenizer": said}


def _write_deepspeed_files(run_dir: Path, source: str | Path | None, resolved: Mapping[str, Any]) -> dict[str, Any]:
  """Writes DS_GIVEN (the user's file, byte for byte, when `source` is one) and DS_RESOLVED (`resolved`, the config
  the DeepSpeed side runs) as new files. Returns {given: {file, source, sha256, bytes} | None, resolved: {file,
  sha256, bytes}}: the sha256 of DS_GIVEN is that of the user's file as it was read. Raises RunIOError (unreadable
  source) or what write_new raises."""
  import hashlib
  given = None
  if source is not None and Path(source).is_file():
    try:
      raw = Path(source).read_bytes()
    except OSError as exc:
      raise RunIOError(exc.errno, f"cannot read --deepspeed-config {source} ({exc.strerror})") from None
    write_new(run_dir / DS_GIVEN, raw)
    given = {"file": DS_GIVEN, "source": str(source), "sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}
  text = json.dumps(dict(resolved), indent=2).encode()
  write_new(run_dir / DS_RESOLVED, text)
  return {"given": given, "resolved": {"file": DS_RESOLVED, "sha256": hashlib.sha256(text).hexdigest(),
                                       "bytes": len(text)}}


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
                    command: str | None = None, train_anyway_on_card_diff: bool = False,
                    world: int = 1) -> PreparedRun:
  """Claims the run folder of a resolved run (parity.pipeline.resolve.ResolvedRun) and writes its inputs.

  Sizes that cannot fit are refused before any folder or array exists (parity.sizing.resources.check_resources); then
  the folder is claimed (`claim_run_dir`: `out`, default runs/<time>-<preset>-<hash>), the inputs written
  (`prepare_run_dir`; with a DeepSpeed config also migration.json/.md) and init.safetensors read back. The
  perturbations are decided first (`parity.pipeline.perturb.plan_perturbations`): one that cannot reach its side is
  refused before any folder exists. train_anyway_on_card_diff: recorded in request.json (`prepare_run_dir`); world:
  ranks per side, the plants are checked for (`prepare_run_dir`).
  Raises:
    SpecError, DataError, RunFolderError, RunIOError: as those functions; nothing of this run is left behind.
  """
  folder = Path(out) if out is not None else default_run_dir(run.spec, run.preset)
  ds_cfg = dict(run.deepspeed_config) if run.deepspeed_config is not None and run.port is not None else None
  stack = run.port.stack.stack if run.port is not None and run.port.stack is not None else None
  plan = plan_perturbations(run.spec, perturb, ds_cfg, source=str(run.deepspeed_source or ""),
                            stack=stack)  # before any file
  check_resources(run.spec, folder)
  claim = claim_run_dir(out if out is not None else folder, force=force, command=command)  # '' refused, not '.'
  try:
    prep = prepare_run_dir(run.spec, folder, perturb=perturb, init_params=run.init_params, deepspeed_config=ds_cfg,
                           run_id=claim.run_id, deepspeed_source=run.deepspeed_source if ds_cfg else None,
                           init_source=run.init_source, plan=plan, tokenizer=getattr(run, "tokenizer", None),
                           train_anyway_on_card_diff=train_anyway_on_card_diff,
                           inputs_from=getattr(run, "inputs_from", None), preset=getattr(run, "preset", None),
                           world=world)
    if run.port is not None:
      write_new(folder / "migration.json", run.port.report.to_json())
      write_new(folder / "migration.md", run.port.report.to_markdown())
    init = weights.load(folder / "init.safetensors")  # the run's own, read once, before any side can touch it
  except BaseException:  # refused or failed before any side started: leave nothing of this run behind
    claim.abandon()
    raise
  return PreparedRun(path=folder, claim=claim, data_info=prep["corpus"], prepare_s=prep["prepare_s"], init=init)


def write_environment(run_dir: str | Path, block: Mapping[str, object], run_id: str | None = None) -> Path:
  """Writes `block` (the environment block, harness.doctor.run_environment; plus the run's `run_id`) as
  <run_dir>/ENVIRONMENT_FILE, a new file (O_EXCL): a run-folder file, so written here, not by the launcher.

  Raises:
    RunFolderError: the file exists (an earlier run's); RunIOError: it could not be written.
  """
  path = Path(run_dir) / ENVIRONMENT_FILE
  write_new(path, json.dumps({**block, "run_id": run_id}, indent=1, default=str) + "\n")
  return path
