"""parity.dataset.layouts: the padded and packed arrays, their masks and positions, and the
step assignment the equivalence reruns rely on (same examples per step for GA k x m and GA 1 x k*m, N ranks and 1,
packed and padded)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from parity.data import DataError
from parity.dataset.examples import Example
from parity.dataset.layouts import ARRAY_FILES, build_batches, cut_examples, split_holdout, step_order

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402


def _examples(lengths, seed=0, prompt_frac=0.5, max_prompt=None) -> list[Example]:
  """Random examples: ids in [1, 250), the first ~prompt_frac of tokens (at most max_prompt) without loss (a
  prompt), the rest with."""
  rng = np.random.default_rng(seed)
  out = []
  for i, n in enumerate(lengths):
    ids = rng.integers(1, 250, size=n).astype(np.uint32)
    loss = np.arange(n) >= min(max(1, int(n * prompt_frac)), max_prompt or n)
    loss[0] = False
    out.append(Example(ids=ids, loss=loss, record=i + 1))
  return out


def _expected(examples, pieces_of_step, pieces) -> Counter:
  """(example, token index) of every loss token the step's pieces must carry, with multiplicity."""
  c = Counter()
  for pi in pieces_of_step:
    p = pieces[int(pi)]
    c.update((p.example, p.start + i) for i in np.flatnonzero(p.loss))
  return c


def _found(b, s) -> Counter:
  """(example, token index) of each target with loss in step s, read back from the arrays' provenance."""
  ex, idx = b.source_example[s][..., 1:], b.source_index[s][..., 1:]
  m = b.loss_mask[s]
  return Counter(zip(ex[m].tolist(), idx[m].tolist()))


def _check_invariants(b, examples, seq_len):
  """Every property of the array contract, checked slot by slot through the provenance arrays."""
  ex_in, ex_tg = b.source_example[..., :-1], b.source_example[..., 1:]
  ix_in, ix_tg = b.source_index[..., :-1], b.source_index[..., 1:]
  m = b.loss_mask
  # a loss target is the next token of the same example as its input: no target crosses a segment, none is padding
  assert np.all(ex_in[m] == ex_tg[m]) and np.all(ex_in[m] >= 0) and np.all(ix_tg[m] == ix_in[m] + 1)
  assert np.all(b.segment_ids[m] > 0)
  # segment ids: 0 exactly on padding inputs; one segment id per piece within a row
  assert np.array_equal(b.segment_ids == 0, ex_in < 0)
  starts = np.zeros(b.positions.shape, dtype=bool)
  starts[..., 0] = b.segment_ids[..., 0] > 0
  starts[..., 1:] = (b.segment_ids[..., 1:] != b.segment_ids[..., :-1]) & (b.segment_ids[..., 1:] > 0)
  # positions restart at 0 at each piece and count up by one inside it; 0 on padding
  assert np.all(b.positions[starts] == 0) and np.all(b.positions[b.segment_ids == 0] == 0)
  inner = (b.segment_ids[..., 1:] == b.segment_ids[..., :-1]) & (b.segment_ids[..., 1:] > 0)
  assert np.all(b.positions[..., 1:][inner] == b.positions[..., :-1][inner] + 1)
  # the token ids are the examples' own
  real = b.source_example >= 0
  got = b.tokens[real]
  want = np.array([examples[e].ids[i] for e, i in zip(b.source_example[real], b.source_index[real])])
  assert np.array_equal(got, want)
  # every loss token of every piece of every step appears exactly once in that step; counts agree
  for s in range(b.tokens.shape[0]):
    assert _found(b, s) == _expected(examples, b.step_pieces[s], b.pieces)
  assert np.array_equal(b.loss_tokens_per_step, b.loss_mask.sum(axis=(1, 2, 3)))
  assert np.array_equal(b.loss_tokens_per_micro, b.loss_mask.sum(axis=(2, 3)))


SIZES = st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 4), st.sampled_from([4, 7, 16]))


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(2, 40), min_size=1, max_size=30), sizes=SIZES, seed=st.integers(0, 2**16),
       truncation=st.sampled_from(["truncate", "split"]))
def test_the_packed_and_padded_arrays_keep_every_invariant_and_the_same_loss_tokens(lengths, sizes, seed, truncation):
  steps, ga, micro, seq_len = sizes
  examples = _examples(lengths, seed=seed, prompt_frac=0.3, max_prompt=3)  # a loss token in every first window
  packed = build_batches(examples, steps=steps, grad_accum_steps=ga, micro_batch_size=micro, seq_len=seq_len,
                         seed=seed, vocab_size=256, layout="packed", truncation=truncation, provenance=True)
  _check_invariants(packed, examples, seq_len)
  rows = ga * micro
  # the padded rerun of the packing equivalence: enough rows per step for one piece each, the same E
  padded = build_batches(examples, steps=steps, grad_accum_steps=1,
                         micro_batch_size=max(rows, packed.examples_per_step), seq_len=seq_len, seed=seed,
                         vocab_size=256, layout="padded", truncation=truncation,
                         examples_per_step=packed.examples_per_step, provenance=True)
  _check_invariants(padded, examples, seq_len)
  assert np.array_equal(padded.step_pieces, packed.step_pieces)
  assert np.array_equal(padded.loss_tokens_per_step, packed.loss_tokens_per_step)
  for s in range(steps):
    assert _found(padded, s) == _found(packed, s)


def test_a_packed_row_masks_the_last_target_of_each_example_and_restarts_positions():
  a = Example(np.array([10, 11, 12], np.uint32), np.array([0, 1, 1], bool), 1)
  b = Example(np.array([20, 21, 22, 23], np.uint32), np.array([0, 0, 1, 1], bool), 2)
  out = build_batches([a, b], steps=1, grad_accum_steps=1, micro_batch_size=1, seq_len=8, seed=0, vocab_size=64,
                      layout="packed", examples_per_step=2, pad_id=63)
  row = out.tokens[0, 0, 0].tolist()
  first = row.index(10) if row[0] == 10 else row.index(20)
  assert first == 0 and sorted(row[:7]) == [10, 11, 12, 20, 21, 22, 23] and row[7:] == [63, 63]
  seg, pos, m = out.segment_ids[0, 0, 0].tolist(), out.positions[0, 0, 0].tolist(), out.loss_mask[0, 0, 0].tolist()
  if row[0] == 20:  # first-fit decreasing puts the longer example first
    assert seg == [1, 1, 1, 1, 2, 2, 2, 0] and pos == [0, 1, 2, 3, 0, 1, 2, 0]
    # targets: 21 (no loss), 22, 23, then 10 (crosses: masked), 11, 12, pad, pad
    assert m == [False, True, True, False, True, True, False, False]
  assert out.loss_tokens_per_step.tolist() == [4]


def test_padded_rows_hold_one_example_each_right_padded():
  ex = _examples([3, 5, 2], seed=1, prompt_frac=0.0)
  out = build_batches(ex, steps=1, grad_accum_steps=1, micro_batch_size=3, seq_len=5, seed=0, vocab_size=256,
                      layout="padded", pad_id=0, provenance=True)
  for r in range(3):
    n = ex[out.source_example[0, 0, r, 0]].ids.size
    assert (out.segment_ids[0, 0, r] > 0).sum() == min(n, 5) and np.all(out.segment_ids[0, 0, r] <= 1)
    assert np.all(out.tokens[0, 0, r, n:] == 0) and out.loss_mask[0, 0, r].sum() == n - 1


def test_ga_k_by_m_is_ga_1_by_km_reshaped_and_ranks_do_not_change_the_arrays():
  ex = _examples(np.random.default_rng(3).integers(2, 30, size=50).tolist(), seed=3)
  for layout in ("padded", "packed"):
    kw = dict(steps=5, seq_len=16, seed=7, vocab_size=256, layout=layout)
    ga4 = build_batches(ex, grad_accum_steps=4, micro_batch_size=2, **kw)
    ga1 = build_batches(ex, grad_accum_steps=1, micro_batch_size=8, **kw)
    two_ranks = build_batches(ex, grad_accum_steps=4, micro_batch_size=2, world=2, **kw)
    assert ga4.examples_per_step == ga1.examples_per_step
    for name in ("tokens", "loss_mask", "segment_ids", "positions"):
      x4, x1 = getattr(ga4, name), getattr(ga1, name)
      assert np.array_equal(x4.reshape(x1.shape), x1), (layout, name)
      assert np.array_equal(getattr(two_ranks, name), x4)
    assert np.array_equal(ga4.loss_tokens_per_step, ga1.loss_tokens_per_step)


def test_packing_puts_more_examples_in_a_step_than_padding_and_less_padding():
  ex = _examples(np.random.default_rng(4).integers(4, 20, size=200).tolist(), seed=4)
  kw = dict(steps=4, grad_accum_steps=2, micro_batch_size=4, seq_len=64, seed=0, vocab_size=256)
  packed, padded = build_batches(ex, layout="packed", **kw), build_batches(ex, layout="padded", **kw)
  assert padded.examples_per_step == 8 and packed.examples_per_step > 3 * 8
  assert np.mean(packed.segment_ids == 0) < 0.5 * np.mean(padded.segment_ids == 0)


def test_truncate_counts_what_it_drops_and_split_keeps_every_target():
  ex = _examples([30, 5, 12], seed=5, prompt_frac=0.0)  # loss on every token but the first
  pieces, t = cut_examples(ex, seq_len=9, mode="truncate")
  assert [p.ids.size for p in pieces] == [10, 5, 10]
  assert (t.examples_cut, t.tokens_dropped, t.loss_tokens_dropped, t.pieces_added) == (2, 20 + 2, 22, 0)
  pieces, t = cut_examples(ex, seq_len=9, mode="split")
  assert (t.examples_cut, t.tokens_dropped, t.pieces_added) == (2, 0, 3 + 1)
  assert sum(int(p.loss.sum()) for p in pieces) == sum(e.loss_tokens for e in ex)
  assert [p.start for p in pieces if p.example == 0] == [0, 9, 18, 27]
  with pytest.raises(DataError, match="train.truncation must be one of truncate, split; got 'drop'"):
    cut_examples(ex, seq_len=9, mode="drop")


def test_the_step_order_visits_every_example_once_per_epoch():
  order = step_order(10, steps=5, per_step=4, seed=1)
  assert sorted(order.reshape(-1)[:10].tolist()) == list(range(10))
  assert sorted(order.reshape(-1)[10:20].tolist()) == list(range(10))
  assert np.array_equal(order, step_order(10, steps=5, per_step=4, seed=1))
  assert not np.array_equal(order, step_order(10, steps=5, per_step=4, seed=2))


def test_tokens_use_the_vocabularys_dtype_and_large_ids_survive():
  ex = [Example(np.array([5, 151_935, 7], np.uint32), np.array([0, 1, 1], bool), 1)]
  out = build_batches(ex, steps=1, grad_accum_steps=1, micro_batch_size=1, seq_len=4, seed=0, vocab_size=151_936)
  assert out.tokens.dtype == np.uint32 and out.tokens[0, 0, 0, 1] == 151_935
  assert out.loss_mask.dtype == bool and out.segment_ids.dtype == np.int32 and out.positions.dtype == np.int32
  with pytest.raises(DataError, match="token id 151935 is outside the vocabulary \\[0, 32000\\); set model.vocab_size"):
    build_batches(ex, steps=1, grad_accum_steps=1, micro_batch_size=1, seq_len=4, seed=0, vocab_size=32_000)


@pytest.mark.parametrize("kw, match", [
    (dict(micro_batch_size=3, world=2), "micro_batch_size=3 is the global micro batch and must split evenly over 2"),
    (dict(layout="stream"), "train.layout must be one of padded, packed for example data; got 'stream'"),
    (dict(examples_per_step=5), "examples_per_step=5 does not fit the padded layout's 4 rows per step"),
    (dict(seq_len=0), "train.seq_len must be >= 1"),
])
def test_bad_sizes_are_refused_naming_the_key_and_the_fix(kw, match):
  args = dict(steps=2, grad_accum_steps=1, micro_batch_size=4, seq_len=8, seed=0, vocab_size=256) | kw
  with pytest.raises(DataError, match=match):
    build_batches(_examples([5, 6, 7]), **args)


def test_a_packed_examples_per_step_that_cannot_fit_is_refused():
  with pytest.raises(DataError, match="examples_per_step=40: some step's examples do not pack into 2 rows of 9"):
    build_batches(_examples([8] * 40), steps=1, grad_accum_steps=1, micro_batch_size=2, seq_len=8, seed=0,
                  vocab_size=256, layout="packed", examples_per_step=40)


def test_a_step_without_loss_tokens_is_refused_naming_it():
  prompt_only = [Example(np.array([1, 2, 3], np.uint32), np.zeros(3, bool), 1)]
  with pytest.raises(DataError, match="optimizer step 0 holds no loss token"):
    build_batches(prompt_only, steps=1, grad_accum_steps=1, micro_batch_size=1, seq_len=4, seed=0, vocab_size=8)


def test_held_out_examples_are_the_last_ones_and_eval_batches_build_from_them():
  ex = _examples(list(range(2, 22)), seed=6, max_prompt=1)
  train, val = split_holdout(ex, 0.1)
  assert [e.record for e in val] == [19, 20] and len(train) == 18
  out = build_batches(val, steps=3, grad_accum_steps=1, micro_batch_size=2, seq_len=8, seed=0, vocab_size=256)
  arrays = out.arrays()
  assert set(arrays) == set(ARRAY_FILES.values()) and arrays["batches.npy"].shape == (3, 1, 2, 9)
  with pytest.raises(DataError, match="1 example\\(s\\) cannot be split into training and held-out examples"):
    split_holdout(ex[:1], 0.1)
  with pytest.raises(DataError, match="val_fraction must be in \\(0, 1\\); got 1.5"):
    split_holdout(ex, 1.5)
