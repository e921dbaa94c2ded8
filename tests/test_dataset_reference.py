"""The example arrays read as the sides must read them (parity.dataset.reference), on a one-layer NumPy attention
model in float64: with the `tokens` normalisation, packed equals padded, GA k x m equals GA 1 x k*m and N ranks equal
1 (the --equivalence checks, here exact up to float64 rounding); a dropped mask or positions not restarted
change the packed objective (the data plants are visible in these arrays); micro_mean differs where counts vary."""
from __future__ import annotations

import numpy as np
import pytest

from parity.data import DataError
from parity.dataset.examples import Example
from parity.dataset.layouts import build_batches
from parity.dataset.reference import attention_mask, token_weights

V, D, T = 64, 8, 16


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {k: rng.normal(0, 0.5, size=s) for k, s in (("wte", (V, D)), ("wpe", (T, D)), ("wq", (D, D)),
                                                       ("wk", (D, D)), ("wv", (D, D)))}


def _ce(p, tokens, mask, positions):
  """Per-target cross-entropy (R, T) of a one-layer attention model with learned positions and tied embeddings."""
  x = p["wte"][tokens[:, :-1]] + p["wpe"][positions]  # (R, T, D)
  q, k, v = x @ p["wq"], x @ p["wk"], x @ p["wv"]
  s = np.einsum("rtd,rsd->rts", q, k) / np.sqrt(D)
  s = np.where(mask, s, -np.inf)
  att = np.exp(s - s.max(axis=-1, keepdims=True))
  att /= att.sum(axis=-1, keepdims=True)
  logits = (x + att @ v) @ p["wte"].T  # (R, T, V)
  lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  return lse - np.take_along_axis(logits, tokens[:, 1:, None].astype(np.int64), -1)[..., 0]


def _objective(b, normalization="tokens", world=1, mask=None, positions=None):
  """Per-step objective sum(w * ce) (steps,), optionally with a planted mask or positions."""
  w = token_weights(b.loss_mask, normalization, world)
  steps, a, rows, t = b.loss_mask.shape
  flat = lambda x: x.reshape(steps * a * rows, *x.shape[3:])
  m = attention_mask(flat(b.segment_ids)) if mask is None else mask(flat(b.segment_ids))
  ce = _ce(_params(), flat(b.tokens), m, flat(b.positions) if positions is None else positions(flat(b.positions)))
  return (w * ce.reshape(b.loss_mask.shape)).sum(axis=(1, 2, 3))


def _examples(n=60, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for i, L in enumerate(rng.integers(3, 14, size=n)):
    loss = np.arange(L) >= rng.integers(1, L - 1)  # a prompt of 1..L-2 tokens without loss
    out.append(Example(rng.integers(0, V, size=L).astype(np.uint32), loss, i + 1))
  return out


@pytest.fixture(scope="module")
def runs():
  ex = _examples()
  kw = dict(steps=3, seq_len=T, seed=5, vocab_size=V)
  packed = build_batches(ex, grad_accum_steps=2, micro_batch_size=2, layout="packed", **kw)
  e = packed.examples_per_step
  return {"packed": packed,
          "padded": build_batches(ex, grad_accum_steps=1, micro_batch_size=e, layout="padded", examples_per_step=e,
                                  **kw),
          "ga4": build_batches(ex, grad_accum_steps=4, micro_batch_size=2, layout="padded", **kw),
          "ga1": build_batches(ex, grad_accum_steps=1, micro_batch_size=8, layout="padded", **kw)}


def test_packed_equals_padded_with_token_normalisation(runs):
  assert runs["packed"].examples_per_step > 4  # several examples share a row
  np.testing.assert_allclose(_objective(runs["packed"]), _objective(runs["padded"]), rtol=1e-12)


def test_ga_and_ranks_are_equivalent_with_tokens_but_not_with_micro_mean(runs):
  ga4, ga1 = runs["ga4"], runs["ga1"]
  np.testing.assert_allclose(_objective(ga4), _objective(ga1), rtol=1e-12)
  np.testing.assert_allclose(_objective(ga4, world=2), _objective(ga4), rtol=1e-12)  # tokens: world plays no part
  mm4, mm1 = _objective(ga4, "micro_mean"), _objective(ga1, "micro_mean")
  assert np.max(np.abs(mm4 - mm1) / mm1) > 1e-3  # the mean of micro means depends on how the step is cut
  assert np.max(np.abs(_objective(ga4, "micro_mean", world=2) - mm4) / mm4) > 1e-3


def test_the_per_rank_micro_batch_losses_accumulate_to_the_step_objective(runs):
  b, world = runs["ga4"], 2
  for norm in ("tokens", "micro_mean"):
    w = token_weights(b.loss_mask, norm, world)
    steps, a, rows, t = b.loss_mask.shape
    ce = _ce(_params(), b.tokens.reshape(-1, t + 1), attention_mask(b.segment_ids.reshape(-1, t)),
             b.positions.reshape(-1, t)).reshape(b.loss_mask.shape)
    per_rank_micro = world * (w * ce).reshape(steps, a, world, rows // world, t).sum(axis=(3, 4))  # what each backprops
    np.testing.assert_allclose(per_rank_micro.sum(axis=1).mean(axis=1), (w * ce).sum(axis=(1, 2, 3)), rtol=1e-12)


@pytest.mark.parametrize("plant", ["causal mask only (attends across documents)", "positions not restarted"])
def test_planted_mask_and_position_bugs_change_the_packed_objective(runs, plant):
  packed = runs["packed"]
  if plant.startswith("causal"):
    got = _objective(packed, mask=lambda seg: np.broadcast_to(np.tril(np.ones((T, T), bool)), seg.shape + (T,)))
  else:
    got = _objective(packed, positions=lambda pos: np.broadcast_to(np.arange(T, dtype=np.int32), pos.shape))
  assert np.max(np.abs(got - _objective(runs["padded"]))) > 1e-3


def test_micro_mean_refuses_a_rank_micro_batch_without_loss_tokens():
  mask = np.zeros((1, 1, 2, 4), bool)
  mask[0, 0, 0, 1] = True
  with pytest.raises(DataError, match="optimizer step 0, micro batch 0, rank 1 holds no loss token"):
    token_weights(mask, "micro_mean", world=2)
  with pytest.raises(DataError, match="train.loss_normalization must be one of tokens, micro_mean; got 'sum'"):
    token_weights(mask, "sum")
