"""parity.dataset.records and the pre-tokenized path of parity.dataset.examples: JSONL, JSON
arrays and Parquet of input_ids with labels (-100) or loss_mask; every refusal names the file, the record, the key
and the fix."""
from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from parity.data import DataError
from parity.dataset.examples import read_examples
from parity.dataset.records import read_records


def _jsonl(path, rows, blank_lines=False):
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + ("\n\n" if blank_lines else "\n")
                          for r in rows))  # a str row is written as is (raw JSON text)
  return path


def test_jsonl_labels_and_loss_mask_give_the_same_example(tmp_path):
  rows = [{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
          {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]},
          {"input_ids": [1, 2, 3]}]
  s = read_examples(_jsonl(tmp_path / "d.jsonl", rows, blank_lines=True), vocab_size=16)
  a, b, c = s.examples
  assert np.array_equal(a.ids, b.ids) and np.array_equal(a.loss, b.loss) and a.loss.tolist() == [0, 0, 1, 1]
  assert c.loss.tolist() == [False, True, True]  # no labels: every target; token 0 never (nothing precedes it)
  assert a.ids.dtype == np.uint32 and [e.record for e in s.examples] == [1, 2, 3]
  assert s.formats == {"input_ids": 3} and s.tokenizer is None and len(s.sha256) == 64


def test_boolean_masks_and_a_line_separator_inside_a_string_are_read(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_text('{"input_ids": [1, 2, 3], "loss_mask": [false, false, true], "note": "a\u2028b"}\n'
                  '{"input_ids": [4, 5], "attention_mask": [true, true]}\n')  # a raw U+2028, legal in JSON
  s = read_examples(path, vocab_size=8)
  assert [e.loss.tolist() for e in s.examples] == [[False, False, True], [False, True]]
  assert [e.record for e in s.examples] == [1, 2]


def test_a_json_array_reads_like_jsonl(tmp_path):
  rows = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [4, 5]}]
  (tmp_path / "d.json").write_text(json.dumps(rows, indent=1))
  s = read_examples(tmp_path / "d.json", vocab_size=8)
  assert [e.ids.tolist() for e in s.examples] == [[1, 2, 3], [4, 5]]
  assert s.examples[0].loss.tolist() == [False, True, True]


@pytest.mark.parametrize("row, match", [
    ({"input_ids": [1, 2, 30]}, r"d.jsonl line 2: token id 30 at position 2 is outside the vocabulary \[0, 16\); "
                                r"the file's largest id is 30: set model.vocab_size > 30"),
    ({"input_ids": [1, 2], "labels": [-100]}, "d.jsonl line 2: `labels` has 1 entries but `input_ids` has 2"),
    ({"input_ids": [1, 2, 3], "labels": [-100, 3, 4]}, r"line 2: labels\[1\] = 3 differs from input_ids\[1\] = 2.*"
                                                     "already shifted by one, unshift them"),
    ({"input_ids": [1, 2], "loss_mask": [0, 2]}, r"line 2: loss_mask\[1\] = 2; a loss_mask holds 0 or 1"),
    ({"input_ids": [1, 2], "labels": [1, 2], "loss_mask": [1, 1]}, "both `labels` and `loss_mask`; give one"),
    ({"input_ids": [1, 2, 0], "attention_mask": [1, 1, 0]}, "`attention_mask` has zeros .*parity pads"),
    ({"input_ids": "1 2 3"}, "line 2: `input_ids` must be a list of integers; got str"),
    ({"input_ids": [1, 2.5]}, "`input_ids` must be a list of integers; got list holding float 2.5"),
    ({"input_ids": [1, 2], "labels": [True, 2]}, "`labels` must be a list of integers; got list holding bool True"),
    ({"input_ids": [1, 2**70]}, "`input_ids` holds an integer beyond int64"),
    ({"input_ids": [7]}, "line 2: 1 token\\(s\\); an example needs at least 2"),
    ({"tokens": [1, 2]}, "line 2: no example key \\(keys: tokens\\); an example has one of input_ids, messages"),
    ({"text": "hello"}, "line 2: a `text` record needs a tokenizer .*tokenizer.json"),
    ('{"input_ids": [1, 2], "input_ids": [3, 4]}', "line 2: key 'input_ids' appears twice in one object"),
])
def test_a_bad_record_is_refused_naming_file_line_key_and_fix(tmp_path, row, match):
  path = _jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2]}, row])
  with pytest.raises(DataError, match=match):
    read_examples(path, vocab_size=16)


def test_an_id_beyond_the_vocabulary_names_the_files_largest_id(tmp_path):
  """The fix names the file's largest id, not the first bad record's: following it must work (once
  the advice from line 1 led to a new refusal at line 2)."""
  path = _jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 20]}, {"input_ids": [1, 2, 40]}, {"input_ids": [3, 30]}])
  with pytest.raises(DataError, match=r"line 1: token id 20 .* the file's largest id is 40: set model.vocab_size > 40"):
    read_examples(path, vocab_size=16)
  assert len(read_examples(path, vocab_size=41).examples) == 3


def test_an_id_beyond_the_vocabulary_names_the_json_record(tmp_path):
  (tmp_path / "d.json").write_text(json.dumps([{"input_ids": [1, 2]}, {"input_ids": [3, 151_936]}]))
  with pytest.raises(DataError, match=r"d.json record 2 \(array index 1\): token id 151936 at position 1"):
    read_examples(tmp_path / "d.json", vocab_size=151_936)


@pytest.mark.parametrize("name, blob, match", [
    ("ids.jsonl", np.arange(1, 65, dtype=np.uint32).tobytes(),
     "is binary \\(a NUL byte at offset 1\\), not text; example files are JSONL"),
    ("latin.jsonl", '{"text": "caf\xe9"}\n'.encode("latin-1"), "is not UTF-8 text \\(byte 0xe9 at offset 13\\)"),
    ("d.jsonl", b'{"input_ids": [1, 2]}\n{"input_ids": [1,\n', "d.jsonl line 2: not a JSON object"),
    ("d.jsonl", b'[{"input_ids": [1, 2]}]\n', "line 1: a list, not a JSON object|a JSON array\\? name the file .json"),
    ("d.json", b'{"input_ids": [1, 2]}\n{"input_ids": [3, 4]}\n', "not JSON \\(Extra data.*name it .jsonl"),
    ("d.json", b'{"input_ids": [1, 2]}', "the top level is a dict; .*an array of example objects"),
    ("d.txt", b'{"input_ids": [1, 2]}\n', "suffix '.txt' is not an example format; example files are JSONL"),
    ("empty.jsonl", b"\n\n", "empty.jsonl: holds no example record"),
])
def test_a_file_that_is_not_example_json_is_refused(tmp_path, name, blob, match):
  (tmp_path / name).write_bytes(blob)
  with pytest.raises(DataError, match=match):
    read_examples(tmp_path / name, vocab_size=16)


def test_a_missing_file_is_refused(tmp_path):
  with pytest.raises(DataError, match="example file .*nope.jsonl does not exist"):
    list(read_records(tmp_path / "nope.jsonl"))


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is not None,
                    reason="pyarrow is installed: test_parquet_input_ids_are_read covers Parquet")
def test_parquet_without_pyarrow_says_what_to_install(tmp_path):
  (tmp_path / "d.parquet").write_bytes(b"PAR1")
  with pytest.raises(DataError, match="reading Parquet needs pyarrow, which is not installed: pip install pyarrow"):
    read_examples(tmp_path / "d.parquet")


def test_parquet_input_ids_are_read(tmp_path):
  pa = pytest.importorskip("pyarrow")
  pq = pytest.importorskip("pyarrow.parquet")
  pq.write_table(pa.table({"input_ids": [[1, 2, 3], [4, 5]], "labels": [[-100, 2, 3], [4, 5]]}), tmp_path / "d.parquet")
  s = read_examples(tmp_path / "d.parquet", vocab_size=8)
  assert [e.loss.tolist() for e in s.examples] == [[False, True, True], [False, True]]
  pq.write_table(pa.table({"ids": [[1, 2]]}), tmp_path / "bad.parquet")
  with pytest.raises(DataError, match="bad.parquet: no input_ids column \\(columns: ids\\)"):
    read_examples(tmp_path / "bad.parquet", vocab_size=8)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
@pytest.mark.parametrize("body, said", [("[" * 100_000 + "]" * 100_000, "nested too deeply"),
                                        ('{"input_ids": [' + "9" * 5001 + "]}", "too many digits")])
def test_hostile_json_is_bad_data_not_an_internal_error(tmp_path, suffix, body, said):
  """Nesting past the recursion limit and a 5,001-digit integer raised RecursionError / ValueError from json (the
  CLI's 'internal error', exit 1); they are DataError naming the file (exit 2)."""
  from parity.dataset.records import read_records
  from parity.data import DataError
  p = tmp_path / f"hostile{suffix}"
  p.write_text(body if suffix == ".jsonl" else f"[{body}]")
  with pytest.raises(DataError, match=said) as err:
    list(read_records(p))
  assert str(p) in str(err.value)


def test_a_byte_order_mark_is_dropped(tmp_path):
  """json refuses a BOM (with Python's advice, 'decode using utf-8-sig'); the one reader of user text drops it, as it
  does for every text file (tests/test_text_files.py)."""
  path = tmp_path / "bom.jsonl"
  path.write_bytes(b'\xef\xbb\xbf{"input_ids": [1, 2]}\n')
  assert [e.ids.tolist() for e in read_examples(path, vocab_size=16).examples] == [[1, 2]]
