"""Records of an example file: JSONL, a JSON array, or Parquet, each record a dict with its place in the file.

A record's place (`Record.where`) is what every error about it names: 'FILE line 12' for JSONL (1-based line
numbers, blank lines skipped), 'FILE record 4 (array index 3)' for a JSON array, 'FILE row 7' for Parquet (1-based).
JSON and JSONL are read by the one reader of user text (parity.inputs.read_text): a UTF-8 BOM is dropped, a file
that is not UTF-8 text (a NUL byte, an invalid byte) is refused naming the byte offset: it is never read as bytes.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, Iterator

from parity.data import DataError
from parity.inputs import read_text, user_file

__all__ = ["Record", "read_records", "JSONL_SUFFIXES", "JSON_SUFFIXES", "PARQUET_SUFFIXES", "file_sha256"]

JSONL_SUFFIXES = (".jsonl", ".ndjson")
JSON_SUFFIXES = (".json",)
PARQUET_SUFFIXES = (".parquet", ".pq")
PARQUET_COLUMNS = ("input_ids", "labels", "loss_mask")
"""The columns read from a Parquet file: pre-tokenized examples only (text columns are not read from Parquet)."""
_FORMATS_FIX = (f"example files are JSONL ({', '.join(JSONL_SUFFIXES)}), a JSON array ({', '.join(JSON_SUFFIXES)}) "
                f"or Parquet with an input_ids column ({', '.join(PARQUET_SUFFIXES)})")


@dataclasses.dataclass(frozen=True)
class Record:
  """One example record as read.

  Attributes:
    data: the record's JSON object (Parquet: the row's PARQUET_COLUMNS present, as Python lists).
    number: 1-based record number in the file (blank JSONL lines are not counted).
    where: the place errors name, e.g. 'data.jsonl line 12' (this module's docstring).
  """
  data: dict
  number: int
  where: str


def file_sha256(path: Path) -> str:
  """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def _text(path: Path) -> str:
  """The file as text, through the one reader of user text (parity.inputs.read_text): a UTF-8 BOM dropped (json
  refuses one), a NUL byte or invalid UTF-8 refused as a DataError naming the byte offset."""
  return read_text(path, what="example file", error=DataError, max_bytes=None, hint=_FORMATS_FIX)


def _object(path: Path, value, where: str, number: int) -> Record:
  if not isinstance(value, dict):
    raise DataError(f"{where}: a {type(value).__name__}, not a JSON object; each example is an object such as "
                    '{"prompt": ..., "completion": ...} or {"input_ids": [...]}')
  return Record(value, number, where)


def _unique(pairs: list[tuple[str, Any]], where: str) -> dict[str, Any]:
  """A JSON object from its pairs, refusing a key given twice (json keeps the last silently)."""
  out: dict[str, Any] = {}
  for k, v in pairs:
    if k in out:
      raise DataError(f"{where}: key {k!r} appears twice in one object; JSON readers disagree on which one counts: "
                      "keep one")
    out[k] = v
  return out


def _loads(text: str, where: str) -> Any:
  """json.loads, with what its JSONDecodeError does not cover refused as bad data naming `where`: nesting over
  Python's recursion limit (RecursionError inside the parser) and an integer over Python's 4,300-digit conversion
  limit (ValueError). Raises DataError for those; json.JSONDecodeError passes through to the caller's message."""
  try:
    return json.loads(text, object_pairs_hook=lambda pairs: _unique(pairs, where))
  except RecursionError:
    raise DataError(f"{where}: nested too deeply to parse (over Python's recursion limit); an example is an object "
                    "of a few levels (input_ids, messages, ...): check the file") from None
  except (json.JSONDecodeError, DataError):
    raise
  except ValueError as exc:  # int('9' * 5000): "Exceeds the limit (4300 digits) for integer string conversion"
    raise DataError(f"{where}: an integer has too many digits ({exc}); token ids and labels are small integers, "
                    "check the file") from None


def _jsonl(path: Path) -> Iterator[Record]:
  number = 0
  for line_no, line in enumerate(_text(path).split("\n"), start=1):  # not splitlines: U+2028 may sit in a string
    if not line.strip():
      continue
    number += 1
    where = f"{path} line {line_no}"
    try:
      value = _loads(line, where)
    except json.JSONDecodeError as exc:
      hint = " (a JSON array? name the file .json)" if line_no == 1 and line.lstrip().startswith("[") else ""
      raise DataError(f"{where}: not a JSON object ({exc.msg} at column {exc.colno}){hint}; JSONL holds one JSON "
                      "object per line") from None
    yield _object(path, value, where, number)


def _json(path: Path) -> Iterator[Record]:
  try:
    value = _loads(_text(path), str(path))
  except json.JSONDecodeError as exc:
    hint = "; if it holds one object per line, name it .jsonl" if exc.msg == "Extra data" else ""
    raise DataError(f"{path}: not JSON ({exc.msg} at line {exc.lineno} column {exc.colno}){hint}") from None
  if not isinstance(value, list):
    raise DataError(f"{path}: the top level is a {type(value).__name__}; an example file in JSON is an array of "
                    "example objects ([{...}, {...}])")
  for i, item in enumerate(value):
    yield _object(path, item, f"{path} record {i + 1} (array index {i})", i + 1)


def _parquet(path: Path) -> Iterator[Record]:
  try:  # optional: only Parquet needs it, and it is a large install
    import pyarrow.parquet as pq
  except ImportError:
    raise DataError(f"{path}: reading Parquet needs pyarrow, which is not installed: pip install pyarrow, or "
                    "convert the file to JSONL ({\"input_ids\": [...]} per line)") from None
  try:
    schema = pq.read_schema(path)
  except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a file that is not Parquet
    raise DataError(f"{path}: not a Parquet file pyarrow can read ({exc})") from None
  cols = [c for c in PARQUET_COLUMNS if c in schema.names]
  if "input_ids" not in cols:
    raise DataError(f"{path}: no input_ids column (columns: {', '.join(schema.names)}); parity reads pre-tokenized "
                    "Parquet only: an input_ids column of token-id lists, optionally labels or loss_mask")
  table = pq.read_table(path, columns=cols).to_pydict()
  for i in range(len(table["input_ids"])):
    yield Record({c: table[c][i] for c in cols}, i + 1, f"{path} row {i + 1}")


def read_records(path: str | Path) -> Iterator[Record]:
  """The records of an example file, in file order (formats: this module's docstring).

  Raises:
    DataError: the file does not exist, has a suffix none of the readers takes, is not UTF-8 JSON / JSONL, holds
      a record that is not an object, or is Parquet without pyarrow installed or without an input_ids column.
  """
  path = user_file(path, what="example file", error=DataError, hint=_FORMATS_FIX)
  suffix = path.suffix.lower()
  if suffix in JSONL_SUFFIXES:
    return _jsonl(path)
  if suffix in JSON_SUFFIXES:
    return _json(path)
  if suffix in PARQUET_SUFFIXES:
    return _parquet(path)
  raise DataError(f"{path}: suffix {suffix or '(none)'!r} is not an example format; {_FORMATS_FIX}")
