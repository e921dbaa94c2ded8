"""What the batches themselves cost: the token ids in their stored dtype, and on padded/packed runs the mask arrays
(segment ids, positions, loss weights) and the attention mask built from them, per side and memory kind; plus the
padding fraction's effect on the figures that count work (numpy only; no jax, no torch).

Per side, what a training step holds of its batch (docs/data-examples.md "The model level"):
  jax        the step's input is the whole step's batch, placed on the device before the jitted step and alive
             through it: token ids (A, M/D, T + 1) in batch_dtype(vocab) (uint16, uint32 above 65,536 ids) and, on
             padded/packed runs, segment ids int32, positions int32 and weights float32 (A, M/D, T); inside the
             forward, the attention mask bool (M/D, T, S) per micro batch (`jax_impl.model.attention_mask`),
             kept for the backward.
  torch,     one micro batch at a time (`torch_impl.model.micro_loss`): token ids as int64 (M, T + 1), segment ids
  deepspeed  and positions as int64 and weights float32 (M, T); the attention mask bool (M, 1, T, S) built once per
             forward for every block (`torch_impl.model.attention_mask`) and saved by SDPA for the backward.
  host       the run folder's arrays read by every side (parity.pipeline.examples_input): loss_mask bool,
             segment_ids int32, positions int32 per target of every step, and each side's float32 weights of the
             whole run, computed through float64 (parity.protocol.side.SideIO.example_arrays).
A stream run has no mask arrays: causality is SDPA's is_causal / a constant, positions 0..T-1.
"""
from __future__ import annotations

import math

import numpy as np

from parity.data import batch_dtype
from parity.sides import side_record
from parity.spec import RunSpec

__all__ = ["BATCH_NOTE", "is_batch_row", "MASK_DTYPES", "TORCH_INPUT_DTYPES", "has_masks", "token_bytes",
           "step_input_rows", "example_host_bytes",
           "example_file_bytes", "counted_tokens_per_s"]

MASK_DTYPES = {"segment_ids": np.dtype(np.int32), "positions": np.dtype(np.int32), "weights": np.dtype(np.float32)}
"""The arrays beside the tokens as the JAX step takes them (jax_impl.step._abstract_batch), per target."""
TORCH_INPUT_DTYPES = {"tokens": np.dtype(np.int64), "segment_ids": np.dtype(np.int64),
                      "positions": np.dtype(np.int64), "weights": np.dtype(np.float32)}
"""What torch_impl.model.micro_loss turns one micro batch into (embedding indices are int64)."""
BATCH_NOTE = "batch: "
"""What the note of every row `step_input_rows` makes holds (the attention mask's says 'attention mask')."""
_FILE_BYTES_PER_TARGET = 1 + 4 + 4
"""loss_mask.npy bool + segment_ids.npy int32 + positions.npy int32 (parity.pipeline.examples_input)."""
_WEIGHT_BYTES_PER_TARGET = 8 + 8 + 4
"""A side's weights of the whole run: token_weights' float64, factor * w (float64), then float32 (SideIO)."""


def is_batch_row(note: str) -> bool:
  """True for the note of a row of the batch (`step_input_rows`): not model state, so not in the scope that is set
  against DeepSpeed's model-state estimator."""
  return BATCH_NOTE in note or "attention mask" in note


def has_masks(run: RunSpec) -> bool:
  """True for a padded or packed run (segment ids, positions and weights beside the tokens)."""
  return run.train.layout != "stream"


def token_bytes(run: RunSpec) -> int:
  """Bytes of one stored token id: batch_dtype(model.vocab_size).itemsize (2 for uint16, 4 for uint32)."""
  return batch_dtype(run.model.vocab_size).itemsize


def _mask_bytes(run: RunSpec, rows: int, dtypes: dict) -> int:
  """Bytes of the segment ids, positions and weights of `rows` rows of T targets in `dtypes`."""
  return rows * run.train.seq_len * sum(dtypes[k].itemsize for k in ("segment_ids", "positions", "weights"))


def step_input_rows(run: RunSpec, side: str, ranks: int = 1) -> list[tuple[str, str, int, str]]:
  """The device bytes of a side's batch during a step, as (category, phase note, bytes, what) per rank / device.

  Args:
    run: the run; its train.layout says whether masks exist. side: a registered side; its record's framework
      says how its batch lives (jax: the whole step's; torch: one micro batch's).
    ranks: the devices or ranks the micro batch's rows split over: the JAX data axis, the FSDP2 side's ranks; 1 for
      the torch and DeepSpeed sides, which take micro_batch_size per rank, as their activation rows do.
  Returns:
    Tuples for parity.sizing.memory.Row: ('buffers', 'in-step (batch...)', ...) for the step's inputs (JAX: the
    whole step's, alive through it; torch: one micro batch's, in the forward/backward) and ('activations',
    'in-step (forward/backward...)', ...) for the attention mask, 1 byte per (query, key) pair.
  Raises:
    SpecError: an unknown side.
  """
  t = run.train
  m = math.ceil(t.micro_batch_size / ranks)
  if side_record(side).framework == "jax":
    dt = batch_dtype(run.model.vocab_size)
    out = [("buffers", f"in-step (batch: token ids {dt.name} (A, M, T + 1), the whole step)",
            t.grad_accum_steps * m * (t.seq_len + 1) * dt.itemsize, "tokens")]
    if has_masks(run):
      out.append(("buffers", "in-step (batch: segment ids int32, positions int32, weights float32 (A, M, T))",
                  _mask_bytes(run, t.grad_accum_steps * m, MASK_DTYPES), "masks"))
  else:
    out = [("buffers", "in-step (forward/backward: batch: token ids int64 (M, T + 1), one micro batch)",
            m * (t.seq_len + 1) * TORCH_INPUT_DTYPES["tokens"].itemsize, "tokens")]
    if has_masks(run):
      out.append(("buffers", "in-step (forward/backward: batch: segment ids int64, positions int64, weights "
                             "float32 (M, T))", _mask_bytes(run, m, TORCH_INPUT_DTYPES), "masks"))
  if has_masks(run):
    out.append(("activations", "in-step (forward/backward: attention mask bool (M, T, S), kept for the backward)",
                m * t.seq_len * t.seq_len, "attention_mask"))
  return out


def example_file_bytes(run: RunSpec) -> int:
  """Bytes of a padded/packed run's example arrays in the run folder (loss mask, segment ids, positions; training
  and validation), 0 on stream."""
  if not has_masks(run):
    return 0
  t = run.train
  targets = (t.steps * t.grad_accum_steps + max(t.eval_batches, 1)) * t.micro_batch_size * t.seq_len
  return targets * _FILE_BYTES_PER_TARGET + 6 * 128  # + the .npy headers


def example_host_bytes(run: RunSpec) -> int:
  """Peak host bytes of the example arrays in one process, beyond batches.npy: the harness lays every array out at
  once (the files' bytes); a side holds the files' arrays and its whole-run weights, built through float64.
  The larger of the two; 0 on stream."""
  if not has_masks(run):
    return 0
  t = run.train
  targets = t.steps * t.grad_accum_steps * t.micro_batch_size * t.seq_len
  return example_file_bytes(run) + targets * _WEIGHT_BYTES_PER_TARGET


def counted_tokens_per_s(tokens_per_s: float, padding_fraction: float) -> float:
  """Tokens/s of real (non-padding) positions of a step that computes every position: a padded or packed step costs
  the same FLOPs per position whatever it holds (padding is computed and weighted 0), so the estimate scales by
  1 - padding_fraction (the data card's padding_fraction; 0 on stream).

  Raises:
    ValueError: padding_fraction outside [0, 1).
  """
  if not (isinstance(padding_fraction, (int, float)) and 0 <= padding_fraction < 1):
    raise ValueError(f"padding fraction {padding_fraction!r}: must be in [0, 1)")
  return tokens_per_s * (1.0 - padding_fraction)
