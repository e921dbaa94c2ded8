"""The run inputs of a padded or packed run (train.layout): examples read through parity.dataset, laid out once,
written into the run folder next to batches.npy (docs/data-examples.md).

Files (each a new file, O_EXCL, as every run input):
  batches.npy        token ids (steps, A, M, T + 1), batch_dtype(model.vocab_size)   (the stream layout's file)
  loss_mask.npy      bool (steps, A, M, T): target t of row m carries the loss
  segment_ids.npy    int32 (steps, A, M, T): 0 on padding, 1.. per example in a row
  positions.npy      int32 (steps, A, M, T): position of each input within its example
  val_batches.npy    token ids (E, M, T + 1), E = train.eval_batches, from the held-out examples
  val_loss_mask.npy, val_segment_ids.npy, val_positions.npy: (E, M, T), as above
request.json 'examples' names them: {layout, loss_normalization, truncation, examples_per_step, arrays: {name:
file}, val_arrays: {name: file}}; the data card goes to request.json 'data'.card (and so to report.json / card.json).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from parity.data import DataError
from parity.dataset import build_batches, data_card, load_tokenizer, read_examples, sft_demo, split_holdout
from parity.dataset.demo import PAD_ID
from parity.spec import SFT_DEMO, RunSpec

__all__ = ["EXAMPLE_ARRAYS", "VAL_ARRAYS", "EXAMPLE_INPUTS", "VAL_FRACTION", "read_run_examples",
           "write_example_inputs"]

EXAMPLE_ARRAYS = {"loss_mask": "loss_mask.npy", "segment_ids": "segment_ids.npy", "positions": "positions.npy"}
"""The arrays beside batches.npy (training), name -> file."""
VAL_ARRAYS = {"loss_mask": "val_loss_mask.npy", "segment_ids": "val_segment_ids.npy",
              "positions": "val_positions.npy"}
"""The arrays beside val_batches.npy (validation), name -> file."""
EXAMPLE_INPUTS = tuple(EXAMPLE_ARRAYS.values()) + tuple(VAL_ARRAYS.values())
"""Files this module adds to a run folder (parity.pipeline.claim.RUN_INPUTS lists them)."""
VAL_FRACTION = 0.1
"""Examples held out for the validation loss: the last 10% in file order (as parity.data holds out a stream's end)."""


def read_run_examples(spec: RunSpec, tokenizer: str | None):
  """The run's ExampleSet: the built-in demo (data 'sft-demo') or the example file `spec.data`.

  Args:
    tokenizer: a folder with tokenizer.json for text records (the --hf-model checkpoint's by default), or None.
  Raises:
    DataError: the file cannot be read as examples, or a text record without a tokenizer (parity.dataset).
  """
  if spec.data == SFT_DEMO:
    return sft_demo()
  tok = load_tokenizer(tokenizer) if tokenizer is not None else None
  return read_examples(Path(spec.data).expanduser(), vocab_size=spec.model.vocab_size, tokenizer=tok)


def _pad_id(examples) -> int:
  """The id padding holds: the demo's PAD_ID, else 0 (never attended to, never a target: loss_mask and segment ids)."""
  return PAD_ID if examples.source.startswith("sft-demo") else 0


def _lay_out(examples, spec: RunSpec, world: int):
  """(training ExampleBatches, validation ExampleBatches or None) of the run's examples."""
  t = spec.train
  if examples.vocab_size > spec.model.vocab_size:
    raise DataError(f"data {examples.source!r}: its ids need a vocabulary of {examples.vocab_size}, not below "
                    f"model.vocab_size={spec.model.vocab_size}; pass --set model.vocab_size={examples.vocab_size}")
  try:
    train_ex, val_ex = (split_holdout(examples.examples, VAL_FRACTION) if t.eval_every > 0
                        else (list(examples.examples), []))
    common = dict(seq_len=t.seq_len, vocab_size=spec.model.vocab_size, world=world, layout=t.layout,
                  truncation=t.truncation, pad_id=_pad_id(examples))
    train = build_batches(train_ex, steps=t.steps, grad_accum_steps=t.grad_accum_steps,
                          micro_batch_size=t.micro_batch_size, seed=t.data_seed,
                          examples_per_step=t.examples_per_step, **common)
    val = (build_batches(val_ex, steps=t.eval_batches, grad_accum_steps=1, micro_batch_size=t.micro_batch_size,
                         seed=t.data_seed + 1, **common) if val_ex else None)
  except DataError as exc:  # the layout's refusals know no file: name it
    raise DataError(f"data {examples.source!r}: {exc}") from None
  return train, val


def write_example_inputs(run_dir: Path, spec: RunSpec, write_new: Callable[[Path, Any], None], *,
                         tokenizer: str | None = None, world: int = 1) -> tuple[dict[str, Any], dict[str, Any]]:
  """Reads, lays out and writes the example arrays (the module docstring's files).

  Args:
    run_dir: the run folder (claimed, holding no earlier input). write_new: parity.pipeline.folder.write_new.
    tokenizer: as read_run_examples. world: ranks of the widest side (micro_mean needs the micro batch to split).
  Returns:
    (data_info for request.json 'data' / report.json 'data': source, sha256, examples, card; the request's
    'examples' record).
  Raises:
    DataError: as read_run_examples and parity.dataset.layouts.build_batches (sizes, vocabulary, empty steps).
  """
  examples = read_run_examples(spec, tokenizer)
  train, val = _lay_out(examples, spec, world)
  write_new(run_dir / "batches.npy", lambda f: np.save(f, train.tokens))
  for name, file in EXAMPLE_ARRAYS.items():
    write_new(run_dir / file, lambda f, a=getattr(train, name): np.save(f, a))  # noqa: B008 - binds this array
  if val is not None:
    write_new(run_dir / "val_batches.npy", lambda f: np.save(f, val.tokens[:, 0]))
    for name, file in VAL_ARRAYS.items():
      write_new(run_dir / file, lambda f, a=getattr(val, name): np.save(f, a[:, 0]))  # noqa: B008 - binds this array
  card = data_card(examples, train)
  info = {"source": examples.source, "sha256": examples.sha256, "examples": len(examples.examples),
          "val_examples": 0 if val is None else int(len({p.example for p in val.pieces})),
          "layout": spec.train.layout, "loss_normalization": spec.train.loss_normalization, "card": card}
  record = {"layout": spec.train.layout, "loss_normalization": spec.train.loss_normalization,
            "truncation": spec.train.truncation, "examples_per_step": int(train.examples_per_step),
            "arrays": dict(EXAMPLE_ARRAYS), "val_arrays": dict(VAL_ARRAYS) if val is not None else None}
  return info, record
