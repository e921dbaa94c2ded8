"""Examples laid out as the arrays every side reads: `padded` (one example per row) and `packed` (several per row).

The array contract (T = seq_len, A = grad_accum_steps, B = micro_batch_size, the global micro batch: rank k of N
reads rows [k*B/N, (k+1)*B/N) of every micro batch, as parity.protocol.ranks.rank_rows does for `stream`):
  tokens        (steps, A, B, T+1), parity.data.batch_dtype(vocab_size): inputs tokens[..., :-1], targets
                tokens[..., 1:]; padding slots hold pad_id.
  loss_mask     (steps, A, B, T), bool: loss_mask[..., t] is True when target tokens[..., t+1] carries the loss. It
                is never True where slot t and slot t+1 belong to different examples (the last token of an example
                is never an input with a target), nor on padding.
  segment_ids   (steps, A, B, T), int32, over input positions: 0 = padding, 1, 2, ... = the example's order in its
                row. Attention of query t to key s is allowed iff segment_ids[t] == segment_ids[s] and s <= t
                (padding attends to padding only, so no attention row is empty).
  positions     (steps, A, B, T), int32: each input's position within its example, 0 at the example's first
                token; 0 on padding.

Which examples an optimizer step sees does not depend on A, B, the world size or the layout, so the equivalence
reruns (GA k x micro m against GA 1 x micro k*m, N ranks against 1, packed against padded) train on the same
examples at every step:
  1. Every example is cut to at most T+1 tokens first (`truncation`): 'truncate' keeps the first T+1 tokens and
     counts what it drops; 'split' cuts it into pieces of T+1 tokens that overlap by one token, piece j covering
     tokens [j*T, j*T + T+1), so every target of the example is a target of exactly one piece (a piece's first
     token is context only; positions restart in each piece). No example is dropped.
  2. The pieces are visited in a seeded order (numpy PCG64 seeded by `seed`; one fresh permutation per epoch), and
     step s takes the next `examples_per_step` of them (E). E is fixed for a run: by default A*B for `padded` (one
     piece per row), and for `packed` the largest E whose every step packs into R = A*B rows, searched from
     min(R*(T+1) / mean piece length, number of pieces) down (by PACK_SHRINK); a rerun passes the base run's E
     (ExampleBatches.examples_per_step) explicitly. When the set holds fewer pieces than E, or a step straddles
     two epochs, a piece can appear twice in one step (each time with all its loss tokens).
  3. Within a step, `padded` puts piece j in global row j (rows past E are all padding); `packed` places the pieces
     by first-fit decreasing length (ties: visiting order) into R rows of T+1 slots, each row's pieces in visiting
     order. Global row g is micro batch g // B, row g % B: a GA-k-by-m step reshaped to (1, k*m) is the GA-1 step.
With the `tokens` normalisation the loss of a step is the same sum over the same loss tokens in every such layout.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from parity.data import DataError, batch_dtype

__all__ = ["ExampleBatches", "Truncation", "Piece", "build_batches", "cut_examples", "step_order", "split_holdout",
           "LAYOUTS", "TRUNCATIONS", "ARRAY_FILES"]

ARRAY_FILES = {"tokens": "batches.npy", "loss_mask": "loss_mask.npy", "segment_ids": "segment_ids.npy",
               "positions": "positions.npy"}
"""Contract array -> the run-folder file it is meant to be written to (batches.npy keeps its name and role)."""
LAYOUTS = ("padded", "packed")
TRUNCATIONS = ("truncate", "split")
PACK_SHRINK = 0.95
"""When some step of the packed layout does not fit, E shrinks to floor(0.95 E) (at least by 1) and packing retries;
E = A*B always fits (one piece per row)."""


@dataclasses.dataclass(frozen=True)
class Truncation:
  """What cutting examples to T+1 tokens did (counts over the example set, each example once).

  Attributes:
    mode: 'truncate' or 'split'.
    examples_cut: examples longer than T+1 tokens.
    tokens_dropped: tokens beyond T+1 that 'truncate' dropped (0 for 'split').
    loss_tokens_dropped: of those, the loss-carrying ones.
    pieces_added: pieces 'split' added beyond one per example (0 for 'truncate').
  """
  mode: str
  examples_cut: int
  tokens_dropped: int
  loss_tokens_dropped: int
  pieces_added: int


@dataclasses.dataclass(frozen=True)
class Piece:
  """At most T+1 consecutive tokens of one example: ids/loss as Example's, `example` its index in the example
  list, `start` the index of its first token in that example."""
  ids: np.ndarray
  loss: np.ndarray
  example: int
  start: int


@dataclasses.dataclass(frozen=True)
class ExampleBatches:
  """Every training array of a run (shapes and meaning: this module's docstring).

  Attributes:
    tokens, loss_mask, segment_ids, positions: the array contract.
    loss_tokens_per_micro: int64 (steps, A): loss tokens of each micro batch, all ranks together.
    loss_tokens_per_step: int64 (steps,): loss tokens of each optimizer step, all micro batches and ranks: the
      divisor of the `tokens` normalisation.
    step_pieces: int64 (steps, E): the pieces (indices into `pieces`) of each step, in visiting order.
    pieces: the cut examples (cut_examples).
    layout: 'padded' or 'packed'.
    examples_per_step: E.
    truncation: the Truncation counts.
    source_example, source_index: int64 (steps, A, B, T+1) with provenance=True (else None): the example index and
      token index within it of each slot, -1 on padding.
  """
  tokens: np.ndarray
  loss_mask: np.ndarray
  segment_ids: np.ndarray
  positions: np.ndarray
  loss_tokens_per_micro: np.ndarray
  loss_tokens_per_step: np.ndarray
  step_pieces: np.ndarray
  pieces: tuple
  layout: str
  examples_per_step: int
  truncation: Truncation
  source_example: np.ndarray | None = None
  source_index: np.ndarray | None = None

  def arrays(self) -> dict[str, np.ndarray]:
    """The four contract arrays by their run-folder file names (ARRAY_FILES), for writing once per run."""
    return {ARRAY_FILES[k]: getattr(self, k) for k in ARRAY_FILES}


def split_holdout(examples, fraction: float) -> tuple[list, list]:
  """(train, held-out) examples: the last `fraction` of them in file order held out (at least one of each), as
  parity.data holds out the end of a token stream. Raises DataError: fraction not in (0, 1), or < 2 examples."""
  examples = list(examples)
  if not 0 < fraction < 1:
    raise DataError(f"val_fraction must be in (0, 1); got {fraction}")
  if len(examples) < 2:
    raise DataError(f"{len(examples)} example(s) cannot be split into training and held-out examples; give at "
                    "least 2, or set train.eval_every=0")
  n_val = min(len(examples) - 1, max(1, int(len(examples) * fraction)))
  return examples[:-n_val], examples[-n_val:]


def cut_examples(examples, seq_len: int, mode: str) -> tuple[list[Piece], Truncation]:
  """Pieces of at most seq_len + 1 tokens (this module's docstring, step 1) and the counts.

  Raises:
    DataError: `mode` is not one of TRUNCATIONS.
  """
  if mode not in TRUNCATIONS:
    raise DataError(f"train.truncation must be one of {', '.join(TRUNCATIONS)}; got {mode!r}")
  w, pieces, cut, dropped, loss_dropped, added = seq_len + 1, [], 0, 0, 0, 0
  for i, ex in enumerate(examples):
    n = ex.ids.size
    if n <= w:
      pieces.append(Piece(ex.ids, ex.loss, i, 0))
      continue
    cut += 1
    if mode == "truncate":
      pieces.append(Piece(ex.ids[:w], ex.loss[:w], i, 0))
      dropped += n - w
      loss_dropped += int(ex.loss[w:].sum())
      continue
    starts = range(0, n - 1, seq_len)  # piece j: tokens [j*T, j*T + T+1); the last starts before the final token
    for s in starts:
      loss = ex.loss[s:s + w].copy()
      loss[0] = False  # context only: the previous piece's last target
      pieces.append(Piece(ex.ids[s:s + w], loss, i, s))
    added += len(starts) - 1
  return pieces, Truncation(mode, cut, dropped, loss_dropped, added)


def step_order(n_pieces: int, steps: int, per_step: int, seed: int) -> np.ndarray:
  """int64 (steps, per_step): piece indices of each step, from one seeded permutation per epoch (PCG64(seed))."""
  rng = np.random.default_rng(seed)
  need, parts = steps * per_step, []
  while sum(p.size for p in parts) < need:
    parts.append(rng.permutation(n_pieces))
  return np.concatenate(parts)[:need].reshape(steps, per_step)


def _pack(lengths: np.ndarray, rows: int, width: int) -> list[list[int]] | None:
  """First-fit decreasing: per row, the positions (into `lengths`) of its pieces in visiting order; None: no fit."""
  free, out = np.full(rows, width, dtype=np.int64), [[] for _ in range(rows)]
  for j in np.argsort(-lengths, kind="stable"):
    fits = free >= lengths[j]
    if not fits.any():
      return None
    r = int(np.argmax(fits))
    free[r] -= lengths[j]
    out[r].append(int(j))
  return [sorted(r) for r in out]


def _layout_steps(pieces, order: np.ndarray, layout: str, rows: int, width: int) -> list[list[list[int]]] | None:
  """Per step, per global row, the piece indices it holds in order; None when a packed step does not fit."""
  lengths = np.array([p.ids.size for p in pieces], dtype=np.int64)
  out = []
  for step in order:
    if layout == "padded":
      out.append([[int(p)] for p in step] + [[] for _ in range(rows - step.size)])
      continue
    packed = _pack(lengths[step], rows, width)
    if packed is None:
      return None
    out.append([[int(step[j]) for j in row] for row in packed])
  return out


def _choose(pieces, steps: int, rows: int, seq_len: int, seed: int, layout: str, per_step: int | None):
  """(E, order, per-step rows) for the layout: E given, or the default (this module's docstring, step 2)."""
  width = seq_len + 1
  if per_step is not None:
    if per_step < 1 or (layout == "padded" and per_step > rows):
      raise DataError(f"examples_per_step={per_step} does not fit the padded layout's {rows} rows per step "
                      f"(grad_accum_steps x micro_batch_size); use at most {rows}, or more rows")
    order = step_order(len(pieces), steps, per_step, seed)
    placed = _layout_steps(pieces, order, layout, rows, width)
    if placed is None:
      raise DataError(f"examples_per_step={per_step}: some step's examples do not pack into {rows} rows of "
                      f"{width} tokens; use fewer examples per step (the default finds the largest that fits)")
    return per_step, order, placed
  if layout == "padded":
    e = rows
  else:
    mean = float(np.mean([p.ids.size for p in pieces]))
    e = max(rows, min(int(rows * width / mean), len(pieces)))  # more would repeat a piece within a step
  while True:
    order = step_order(len(pieces), steps, e, seed)
    placed = _layout_steps(pieces, order, layout, rows, width)
    if placed is not None:
      return e, order, placed
    e = max(rows, min(e - 1, int(e * PACK_SHRINK)))


def _fill(b: ExampleBatches, pieces, placed, micro: int, pad_id: int) -> None:
  """Writes each step's rows into the arrays of `b` (preallocated: padding everywhere)."""
  for s, rows in enumerate(placed):
    for g, row in enumerate(rows):
      a, r, off = g // micro, g % micro, 0
      for k, pi in enumerate(row, start=1):
        p, n = pieces[pi], pieces[pi].ids.size
        b.tokens[s, a, r, off:off + n] = p.ids
        end = min(off + n, b.segment_ids.shape[-1])  # a piece ending on slot T has no input there
        b.segment_ids[s, a, r, off:end] = k
        b.positions[s, a, r, off:end] = np.arange(end - off)
        b.loss_mask[s, a, r, off:off + n - 1] = p.loss[1:]  # target of slot t is slot t+1; the last slot's is not ours
        if b.source_example is not None:
          b.source_example[s, a, r, off:off + n] = p.example
          b.source_index[s, a, r, off:off + n] = p.start + np.arange(n)
        off += n


def _check_sizes(examples, steps: int, grad_accum_steps: int, micro_batch_size: int, seq_len: int, world: int,
                 layout: str, vocab_size: int, pad_id: int) -> None:
  if layout not in LAYOUTS:
    raise DataError(f"train.layout must be one of {', '.join(LAYOUTS)} for example data; got {layout!r}")
  for name, v in (("steps", steps), ("grad_accum_steps", grad_accum_steps), ("micro_batch_size", micro_batch_size),
                  ("seq_len", seq_len), ("world", world)):
    if v < 1:
      raise DataError(f"train.{name} must be >= 1 for example data; got {v}")
  if micro_batch_size % world:
    raise DataError(f"train.micro_batch_size={micro_batch_size} is the global micro batch and must split evenly "
                    f"over {world} ranks; use a multiple of {world}")
  if not examples:
    raise DataError("no examples to lay out")
  if not 0 <= pad_id < vocab_size:
    raise DataError(f"pad_id {pad_id} is outside the vocabulary [0, {vocab_size})")


def build_batches(examples, *, steps: int, grad_accum_steps: int, micro_batch_size: int, seq_len: int, seed: int,
                  vocab_size: int, world: int = 1, layout: str = "padded", truncation: str = "truncate",
                  examples_per_step: int | None = None, pad_id: int = 0, provenance: bool = False) -> ExampleBatches:
  """Every training array of a run from its examples (the contract and the assignment: this module's docstring).

  Args:
    examples: parity.dataset.examples.Example sequence (ids < vocab_size).
    steps, grad_accum_steps, micro_batch_size, seq_len, seed: as TrainSpec's (micro_batch_size is the global
      micro batch); world: ranks (only checked: micro_batch_size must split over them; the arrays are global).
    vocab_size: the model's; tokens are stored in batch_dtype(vocab_size).
    layout: 'padded' or 'packed'. truncation: 'truncate' or 'split'.
    examples_per_step: E (None: the layout's default); reruns pass the base run's.
    pad_id: the id padding slots hold (never an input that is attended to by, or a target of, a real token).
    provenance: also return source_example / source_index (for tests and diagnosis; 16 bytes per slot).
  Returns:
    ExampleBatches.
  Raises:
    DataError: a size < 1, micro_batch_size not a multiple of world, an unknown layout or truncation, E that does
      not fit, an id >= vocab_size, or a step whose examples carry no loss token (the `tokens` normalisation would
      divide by zero; the message names the step).
  """
  _check_sizes(examples, steps, grad_accum_steps, micro_batch_size, seq_len, world, layout, vocab_size, pad_id)
  top = max(int(ex.ids.max()) for ex in examples)
  if top >= vocab_size:
    raise DataError(f"token id {top} is outside the vocabulary [0, {vocab_size}); set model.vocab_size > {top}")
  pieces, trunc = cut_examples(examples, seq_len, truncation)
  rows = grad_accum_steps * micro_batch_size
  e, order, placed = _choose(pieces, steps, rows, seq_len, seed, layout, examples_per_step)
  shape = (steps, grad_accum_steps, micro_batch_size, seq_len)
  src = (lambda: np.full(shape[:-1] + (seq_len + 1,), -1, dtype=np.int64)) if provenance else (lambda: None)
  b = ExampleBatches(tokens=np.full(shape[:-1] + (seq_len + 1,), pad_id, dtype=batch_dtype(vocab_size)),
                     loss_mask=np.zeros(shape, dtype=bool), segment_ids=np.zeros(shape, dtype=np.int32),
                     positions=np.zeros(shape, dtype=np.int32), loss_tokens_per_micro=np.zeros(0),
                     loss_tokens_per_step=np.zeros(0), step_pieces=order, pieces=tuple(pieces), layout=layout,
                     examples_per_step=e, truncation=trunc, source_example=src(), source_index=src())
  _fill(b, pieces, placed, micro_batch_size, pad_id)
  per_micro = b.loss_mask.sum(axis=(2, 3), dtype=np.int64)
  empty = np.flatnonzero(per_micro.sum(axis=1) == 0)
  if empty.size:
    raise DataError(f"optimizer step {int(empty[0])} holds no loss token (its examples' loss falls only on tokens "
                    "cut off, or they have none, e.g. prompt-only); the `tokens` normalisation divides by zero: "
                    "use truncation='split', a longer seq_len, or drop examples without completion tokens")
  return dataclasses.replace(b, loss_tokens_per_micro=per_micro, loss_tokens_per_step=per_micro.sum(axis=1))
