"""The reading of the example arrays every side must implement, in NumPy: the attention mask from segment ids, and
per-token loss weights for the two normalisations. The sides compute the same in their
framework; the tests use these as the reference.

Loss weights: for every optimizer step the objective is  L = sum over the step's slots of w * ce,  ce the per-token
cross-entropy of target tokens[..., t+1] at input t (float), w = token_weights(...) (0 where loss_mask is False):
  tokens      w = 1 / loss_tokens_per_step[s]: the sum of per-token losses over every micro batch and rank of the
              step, over the step's loss-token count (HF Trainer >= 4.46, torchtune).
  micro_mean  w = 1 / (A * W * n), n the loss tokens of the row's micro batch on its own rank: the mean over the
              A micro batches and W ranks of each rank-local micro batch's mean (many DeepSpeed scripts).
The count is global and in the arrays, so no rank needs a collective to know it. Under gradient accumulation with
data-parallel averaging, a rank backpropagates, for each micro batch, W * sum(w * ce) over its own rows (the
gradient mean over ranks divides by W again); DeepSpeed's engine.backward divides the loss by A, so the DeepSpeed
side backpropagates A * W * sum(w * ce). Either way the optimizer sees dL/dparams.
"""
from __future__ import annotations

import numpy as np

from parity.data import DataError

__all__ = ["attention_mask", "token_weights", "in_example_targets", "NORMALIZATIONS"]

NORMALIZATIONS = ("tokens", "micro_mean")


def attention_mask(segment_ids: np.ndarray) -> np.ndarray:
  """bool (..., T, T), [query, key]: True where query t may attend to key s, i.e. segment_ids[t] == segment_ids[s]
  and s <= t. Padding (segment 0) attends to earlier padding and itself only, so no row is empty (no NaN softmax).

  Args:
    segment_ids: int (..., T) (parity.dataset.layouts contract).

  >>> attention_mask(np.array([1, 1, 2, 0])).astype(int)
  array([[1, 0, 0, 0],
         [1, 1, 0, 0],
         [0, 0, 1, 0],
         [0, 0, 0, 1]])
  """
  t = segment_ids.shape[-1]
  same = segment_ids[..., :, None] == segment_ids[..., None, :]
  return same & np.tril(np.ones((t, t), dtype=bool))


def token_weights(loss_mask: np.ndarray, normalization: str, world: int = 1) -> np.ndarray:
  """float64 (steps, A, B, T): each target's weight in its step's objective (this module's docstring).

  Args:
    loss_mask: bool (steps, A, B, T), B the global micro batch (rank k holds rows [k*B/W, (k+1)*B/W)).
    normalization: 'tokens' or 'micro_mean'.
    world: W, the ranks (only micro_mean depends on it).
  Raises:
    DataError: an unknown normalization, B not a multiple of W, or (micro_mean) a rank-local micro batch without a
      loss token (its mean is undefined; the message names the step, micro batch and rank).
  """
  if normalization not in NORMALIZATIONS:
    raise DataError(f"train.loss_normalization must be one of {', '.join(NORMALIZATIONS)}; got {normalization!r}")
  steps, a, b, t = loss_mask.shape
  m = loss_mask.astype(np.float64)
  if normalization == "tokens":
    return m / m.sum(axis=(1, 2, 3), keepdims=True)
  if b % world:
    raise DataError(f"micro batch of {b} rows does not split over {world} ranks")
  local = m.reshape(steps, a, world, b // world, t)
  n = local.sum(axis=(3, 4), keepdims=True)
  if np.any(n == 0):
    s, k, r = (int(x[0]) for x in np.nonzero(n[..., 0, 0] == 0))
    raise DataError(f"optimizer step {s}, micro batch {k}, rank {r} holds no loss token, so micro_mean (a mean per "
                    "micro batch) is undefined; use loss_normalization 'tokens', or fewer rows per step")
  return (local / (a * world * n)).reshape(steps, a, b, t)


def in_example_targets(loss_mask: np.ndarray, segment_ids: np.ndarray) -> np.ndarray:
  """bool (..., T): the targets that lie inside their input's example, prompt tokens included: target t (token
  t + 1) of a real input (segment > 0) whose next input is of the same example, or that carries the loss already
  (the row's last target: its token is not among the inputs). `loss_mask` is never wider than this; the two differ
  exactly on the prompt targets. What the planted bug loss_on_prompt trains on (docs/data-examples.md).

  Args:
    loss_mask: bool (..., T); segment_ids: int (..., T), 0 on padding.
  """
  seg = np.asarray(segment_ids)
  out = np.asarray(loss_mask, dtype=bool).copy()
  out[..., :-1] |= (seg[..., :-1] > 0) & (seg[..., :-1] == seg[..., 1:])
  return out
