"""The built-in SFT demo (docstring -> body pairs from this Python's stdlib, byte-level) and the
data card of a run on examples."""
from __future__ import annotations

import ast
import hashlib
import json
import textwrap

import numpy as np
import pytest

from parity.data import DataError
from parity.dataset.card import CARD_FIELDS, data_card
from parity.dataset.demo import DEMO_VOCAB, EOS_ID, PAD_ID, demo_pairs, sft_demo
from parity.dataset.examples import read_examples
from parity.dataset.layouts import build_batches


@pytest.fixture(scope="module")
def demo():
  return sft_demo(max_examples=128, max_tokens=256)


def test_the_demo_is_docstring_to_body_byte_level_with_eos(demo):
  assert len(demo.examples) == 128 and demo.vocab_size == DEMO_VOCAB == 258 and demo.formats == {"prompt": 128}
  for ex in demo.examples:
    assert ex.ids.size <= 256 and ex.ids[-1] == EOS_ID and int(ex.ids[:-1].max()) < 256
    k = int(np.argmax(ex.loss))  # first loss token: the body starts there, the prompt is all before it
    assert not ex.loss[:k].any() and ex.loss[k:].all()
    prompt, body = bytes(ex.ids[:k].astype(np.uint8)).decode(), bytes(ex.ids[k:-1].astype(np.uint8)).decode()
    fn = ast.parse(textwrap.dedent(prompt + body)).body[0]  # prompt + completion: the whole function
    assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(fn)
    assert fn.body[0].end_lineno == prompt.count("\n")  # the prompt ends with the docstring
  assert PAD_ID not in np.concatenate([ex.ids for ex in demo.examples])


def test_the_demo_is_deterministic_and_its_hash_names_its_content(demo):
  again = sft_demo(max_examples=128, max_tokens=256)
  assert again.sha256 == demo.sha256
  assert all(np.array_equal(a.ids, b.ids) for a, b in zip(again.examples, demo.examples))
  assert sft_demo(max_examples=64, max_tokens=256).sha256 != demo.sha256
  where, prompt, completion = demo_pairs(1, 256)[0]
  assert where.startswith("operator.py:") and prompt.lstrip().startswith("def ") and completion.strip()


def test_a_too_short_demo_is_refused():
  with pytest.raises(DataError, match="max_tokens=8 is too short for a function; use >= 16"):
    sft_demo(max_tokens=8)


def test_the_card_of_the_demo_padded(demo):
  b = build_batches(demo.examples, steps=3, grad_accum_steps=2, micro_batch_size=2, seq_len=128, seed=0,
                    vocab_size=DEMO_VOCAB, layout="padded", pad_id=PAD_ID)
  card = data_card(demo, b)
  assert tuple(card) == CARD_FIELDS and json.loads(json.dumps(card)) == card
  lengths = [ex.ids.size for ex in demo.examples]
  assert (card["length_min"], card["length_max"], card["length_median"]) == (min(lengths), max(lengths),
                                                                                float(np.median(lengths)))
  assert card["examples"] == 128 and card["examples_per_step"] == 4 and card["examples_seen"] == 12
  assert card["tokens_per_step"] == 2 * 2 * 128
  # input positions of a piece of L tokens: L (its last token is an input without a target), or T when cut to T + 1
  real = sum(min(lengths[b.pieces[int(p)].example], 128) for p in b.step_pieces.reshape(-1))
  assert card["padding_fraction"] == pytest.approx(1 - real / (3 * 2 * 2 * 128))
  assert card["loss_tokens_per_step"] == b.loss_tokens_per_step.tolist() and card["loss_tokens_total"] == sum(
      card["loss_tokens_per_step"])
  cut = [n for n in lengths if n > 129]
  assert card["truncation"] == {"mode": "truncate", "examples_cut": len(cut),
                                "tokens_dropped": sum(n - 129 for n in cut),
                                "loss_tokens_dropped": sum(int(ex.loss[129:].sum()) for ex in demo.examples),
                                "pieces_added": 0}
  assert card["tokenizer"] is None and card["source"].startswith("sft-demo (stdlib of Python 3.")


def test_the_card_names_the_file_and_its_hash(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_text('{"input_ids": [1, 2, 3, 4]}\n{"input_ids": [5, 6], "labels": [-100, 6]}\n')
  s = read_examples(path, vocab_size=8)
  b = build_batches(s.examples, steps=2, grad_accum_steps=1, micro_batch_size=2, seq_len=3, seed=0, vocab_size=8,
                    layout="packed")
  card = data_card(s, b)
  assert card["source"] == str(path) and card["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
  assert card["layout"] == "packed" and card["formats"] == {"input_ids": 2} and card["loss_tokens_per_step"] == [4, 4]
