"""The run folders of the equivalence reruns (`--equivalence ga,ranks,packing`, parity.pipeline.equivalence): one
derived request per kind in run_dir/equivalence/<kind>/, with the spec changed as the kind says and training arrays
that hold the same examples at every optimizer step as the main run's.

  ga       GA k x micro batch m  ->  GA 1 x micro batch k*m. Every array is the main run's reshaped from
           (steps, k, m, ...) to (steps, 1, k*m, ...): global row g is micro batch g // m, row g % m
           (parity.dataset.layouts), so each step holds the very same rows, bit for bit.
  ranks    N ranks -> 1 rank, or 1 rank -> 2 (launch.json of the rerun's own); the arrays are the main run's files
           (the global micro batch: rank k reads its rows of it).
  packing  packed -> padded, or padded -> packed: the examples read again and laid out by
           parity.dataset.layouts.build_batches with the main run's examples_per_step E, so step s visits the same
           pieces (step_order depends on the piece count, E, steps and the seed only). The main run's layout is
           rebuilt too and must equal its batches.npy and arrays bit for bit, and each step's pieces and loss tokens
           must be the same in both layouts; otherwise the rerun is not prepared (EquivalenceInputError).
           padded rows: R' = A * ceil(E / A) rounded up to a multiple of the ranks (micro batch ceil(E / A)), the
           main run's grad_accum_steps kept.
Every rerun trains without evaluation (train.eval_every 0): it is compared on its training records and final params.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from parity.data import DataError
from parity.dataset.layouts import build_batches
from parity.dataset.reference import token_weights
from parity.fields import from_dict
from parity.pipeline.examples_input import EXAMPLE_ARRAYS, VAL_FRACTION, _pad_id, read_run_examples
from parity.dataset import split_holdout
from parity.protocol import derive_request
from parity.protocol.layout import EQUIVALENCE_DIR
from parity.protocol.ranks import LAUNCH_FILE, read_launch, write_launch
from parity.spec import RunSpec, config_hash, to_dict

__all__ = ["EQUIVALENCE_DIR", "EquivalenceInputError", "prepare_equivalence", "rerun_train"]


class EquivalenceInputError(ValueError):
  """The rerun's arrays could not be made to hold the main run's examples (the message says which step and why)."""


def rerun_train(spec: RunSpec, kind: str, nproc: int, examples_per_step: int | None) -> tuple[dict[str, Any], int]:
  """(train fields the rerun changes, its ranks per side) for `kind` (this module's docstring).

  Args:
    nproc: the main run's ranks per side. examples_per_step: the main run's E (padded/packed; None on stream).
  """
  t, keys = spec.train, {"eval_every": 0}
  if kind == "ga":
    return {**keys, "grad_accum_steps": 1, "micro_batch_size": t.grad_accum_steps * t.micro_batch_size}, nproc
  if kind == "ranks":
    return keys, 1 if nproc > 1 else 2
  other = "padded" if t.layout == "packed" else "packed"
  keys.update(layout=other, examples_per_step=examples_per_step)
  if other == "padded":
    micro = math.ceil(examples_per_step / t.grad_accum_steps)
    keys["micro_batch_size"] = -(-micro // nproc) * nproc
  return keys, nproc


def prepare_equivalence(run_dir: Path, kind: str, spec: RunSpec, *, tokenizer: str | None = None) -> dict[str, Any]:
  """Writes run_dir/equivalence/<kind>/request.json (and its arrays, launch.json) for one equivalence rerun.

  Args:
    run_dir: the main run's folder (request.json, batches.npy and, padded/packed, the example arrays).
    kind: 'ga', 'ranks' or 'packing'. tokenizer: the main run's tokenizer folder (text example records).
  Returns:
    {'folder': Path, 'train': the changed train fields, 'nproc': its ranks, 'loss_tokens_per_step': [int] or None
    (the divisor of every step, the same in both runs)}.
  Raises:
    EquivalenceInputError: the rerun's arrays would not hold the main run's examples, or (micro_mean) a micro batch
      of the rerun holds no loss token. OSError: a file could not be written.
  """
  run_dir = Path(run_dir)
  request = json.loads((run_dir / "request.json").read_text())
  examples = request.get("examples") or {}
  nproc = int(read_launch(run_dir)["nproc"])
  train, ranks = rerun_train(spec, kind, nproc, examples.get("examples_per_step"))
  sub = derive_request(run_dir, f"{EQUIVALENCE_DIR}/{kind}").parent
  new = _rerun_spec(request, train)
  per_step = None
  if kind == "ga":
    per_step = _write_reshaped(run_dir, sub, request, new)
  elif kind == "packing":
    per_step = _write_relaid(run_dir, sub, spec, new, tokenizer, ranks)
  elif examples:  # ranks: the main run's arrays on another number of ranks
    mask = np.load(run_dir / EXAMPLE_ARRAYS["loss_mask"])
    _check_weights(mask, new, ranks)
    per_step = [int(x) for x in mask.sum(axis=(1, 2, 3))]
  _write_request(sub, new, {"changed": train, "nproc": ranks, "loss_tokens_per_step": per_step})
  (sub / LAUNCH_FILE).unlink(missing_ok=True)
  if ranks != nproc:
    launch = read_launch(run_dir)
    write_launch(sub, **{**launch, "nproc": ranks})
  else:
    if (run_dir / LAUNCH_FILE).exists():
      (sub / LAUNCH_FILE).write_text((run_dir / LAUNCH_FILE).read_text())
  return {"folder": sub, "train": train, "nproc": ranks, "loss_tokens_per_step": per_step}


def _rerun_spec(request: dict, train: dict[str, Any]) -> RunSpec:
  """The main run's spec with the rerun's train fields (validated by RunSpec)."""
  run = json.loads(json.dumps(request["run"]))
  run["train"].update(train)
  return from_dict(RunSpec, run)


def _write_request(sub: Path, spec: RunSpec, record: dict[str, Any]) -> None:
  """The derived request with the rerun's spec, config hash and (a user's DeepSpeed config) batch keys, no
  validation arrays (the rerun does not evaluate), and 'equivalence': record (what `prepare_equivalence` returns,
  less the folder: parity.report.reverify reads it back)."""
  path = sub / "request.json"
  request = json.loads(path.read_text())
  request["run"], request["config_hash"] = to_dict(spec), config_hash(spec)
  if request.get("examples"):
    request["examples"]["val_arrays"] = None
    request["examples"]["layout"] = spec.train.layout
    if spec.train.examples_per_step is not None:
      request["examples"]["examples_per_step"] = int(spec.train.examples_per_step)
  ds = request.get("deepspeed_config")
  if isinstance(ds, dict):  # the user's config runs verbatim: its batch keys follow the rerun's shape
    t = spec.train
    ds["train_micro_batch_size_per_gpu"] = t.micro_batch_size
    ds["gradient_accumulation_steps"] = t.grad_accum_steps
    if "train_batch_size" in ds:
      ds["train_batch_size"] = t.micro_batch_size * t.grad_accum_steps
  request["equivalence"] = record
  path.write_text(json.dumps(request, indent=2))


def _save(sub: Path, name: str, array: np.ndarray) -> str:
  tmp = sub / f"{name}.tmp.npy"
  np.save(tmp, np.ascontiguousarray(array))
  tmp.replace(sub / name)
  return name


def _point_at(sub: Path, files: dict[str, str]) -> None:
  """Points the derived request's batches and training arrays at the rerun's own files (name -> file in sub)."""
  path = sub / "request.json"
  request = json.loads(path.read_text())
  request["batches"] = files.pop("tokens")
  if files:
    request["examples"]["arrays"] = files
  path.write_text(json.dumps(request, indent=2))


def _write_reshaped(run_dir: Path, sub: Path, request: dict, spec: RunSpec) -> list[int] | None:
  """ga: batches.npy and the training arrays reshaped to (steps, 1, A*M, ...), written into `sub`."""
  files = {"tokens": _save(sub, "batches.npy", _one_micro(np.load(run_dir / request["batches"])))}
  mask = None
  for name, file in ((request.get("examples") or {}).get("arrays") or {}).items():
    arr = _one_micro(np.load(run_dir / Path(file).name))
    files[name] = _save(sub, f"{name}.npy", arr)
    mask = arr if name == "loss_mask" else mask
  _point_at(sub, files)
  if mask is None:
    return None
  _check_weights(mask, spec, int(read_launch(run_dir)["nproc"]))
  return [int(x) for x in mask.sum(axis=(1, 2, 3))]


def _one_micro(a: np.ndarray) -> np.ndarray:
  """(steps, A, M, ...) -> (steps, 1, A*M, ...): the same global rows in the same order."""
  return a.reshape(a.shape[0], 1, a.shape[1] * a.shape[2], *a.shape[3:])


def _write_relaid(run_dir: Path, sub: Path, spec: RunSpec, new: RunSpec, tokenizer: str | None,
                  ranks: int) -> list[int]:
  """packing: the main run's examples laid out again in the other layout (this module's docstring), checked."""
  ex = read_run_examples(spec, tokenizer)
  train_ex = (split_holdout(ex.examples, VAL_FRACTION)[0] if spec.train.eval_every > 0 else list(ex.examples))
  main = _lay(train_ex, spec, ranks, _pad_id(ex))
  _same_as_main(run_dir, main)
  other = _lay(train_ex, new, ranks, _pad_id(ex))
  for s in range(spec.train.steps):
    if sorted(main.step_pieces[s]) != sorted(other.step_pieces[s]):
      raise EquivalenceInputError(f"step {s}: the {new.train.layout} rerun would visit other examples than the "
                                  "main run")
  if not np.array_equal(main.loss_tokens_per_step, other.loss_tokens_per_step):
    s = int(np.flatnonzero(main.loss_tokens_per_step != other.loss_tokens_per_step)[0])
    raise EquivalenceInputError(f"step {s}: {main.loss_tokens_per_step[s]} loss tokens in the main run, "
                                f"{other.loss_tokens_per_step[s]} in the {new.train.layout} rerun")
  _check_weights(other.loss_mask, new, ranks)
  files = {"tokens": _save(sub, "batches.npy", other.tokens)}
  for name in EXAMPLE_ARRAYS:
    files[name] = _save(sub, f"{name}.npy", getattr(other, name))
  _point_at(sub, files)
  return [int(x) for x in other.loss_tokens_per_step]


def _lay(examples, spec: RunSpec, world: int, pad_id: int):
  t = spec.train
  try:
    return build_batches(examples, steps=t.steps, grad_accum_steps=t.grad_accum_steps,
                         micro_batch_size=t.micro_batch_size, seed=t.data_seed, seq_len=t.seq_len,
                         vocab_size=spec.model.vocab_size, world=world, layout=t.layout, truncation=t.truncation,
                         examples_per_step=t.examples_per_step, pad_id=pad_id)
  except DataError as exc:
    raise EquivalenceInputError(f"the {t.layout} layout of the main run's examples: {exc}") from None


def _same_as_main(run_dir: Path, main) -> None:
  """The rebuilt main layout must be the main run's files, bit for bit (else the examples were read otherwise)."""
  for name, file in {"tokens": "batches.npy", **EXAMPLE_ARRAYS}.items():
    if not np.array_equal(np.load(run_dir / file), getattr(main, name)):
      raise EquivalenceInputError(f"the main run's {file} could not be rebuilt from its examples (the data file "
                                  "changed since the run was prepared?); the packing rerun needs the same examples")


def _check_weights(loss_mask: np.ndarray, spec: RunSpec, world: int) -> None:
  """micro_mean: every rank-local micro batch of the rerun must hold a loss token (parity.dataset.reference)."""
  try:
    token_weights(np.asarray(loss_mask), spec.train.loss_normalization, world)
  except DataError as exc:
    raise EquivalenceInputError(f"the rerun's arrays ({spec.train.layout}, grad_accum_steps "
                                f"{spec.train.grad_accum_steps}, micro batch {spec.train.micro_batch_size}): "
                                f"{exc}") from None
