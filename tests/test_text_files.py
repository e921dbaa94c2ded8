"""One reader of a user's text files (parity.inputs.read_text / read_user_bytes): configs and JSON records
(parity.inputs), example files (parity.dataset.records), corpora (parity.data) and tokenizer files
(parity.dataset.tokenizer) accept a UTF-8 BOM and drop it, and refuse invalid UTF-8, a binary file, a missing file and
a folder with one message shape, '{what} {path} ...', naming the byte offset in the file and the fix."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Callable

import pytest

from parity.data import DataError, load_corpus
from parity.dataset.records import read_records
from parity.errors import ParityInputError
from parity.inputs import UTF8_BOM, InputError, load_json, read_text, read_user_bytes

BOM = UTF8_BOM


@dataclasses.dataclass(frozen=True)
class Caller:
  """One reader of user files: how to call it on a path, a valid body for it, what its messages call the file
  (`missing_what`: what a missing one is called), its error class, and whether a folder is a refusal."""
  name: str
  suffix: str
  body: bytes
  read: Callable[[Path], Any]
  what: str
  error: type[ParityInputError]
  missing_what: str = ""
  folder_refused: bool = True


def _tokenizer_config(path: Path) -> Any:
  """load_tokenizer on a folder holding a tiny tokenizer.json beside `path` (its tokenizer_config.json)."""
  tokenizers = pytest.importorskip("tokenizers")
  from parity.dataset.tokenizer import load_tokenizer
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
  tok.save(str(path.parent / "tokenizer.json"))
  return load_tokenizer(path.parent).special


def _corpus(path: Path) -> Any:
  c = load_corpus(str(path))
  return c.sha256, c.train.size, c.val.size


TEXT = "A corpus line of plain text, read as its bytes.\n" * 4
CALLERS = [
    Caller("config", ".json", b'{"train": {"lr": 0.001}, "note": "caf\xc3\xa9"}', lambda p: load_json(p, what="config"),
           "config", InputError),
    Caller("example-jsonl", ".jsonl", b'{"input_ids": [1, 2]}\n{"input_ids": [3]}\n',
           lambda p: [r.data for r in read_records(p)], "example file", DataError),
    Caller("example-json", ".json", b'[{"input_ids": [1, 2]}]', lambda p: [r.data for r in read_records(p)],
           "example file", DataError),
    Caller("corpus", ".dat", TEXT.encode(), _corpus, "data file", DataError, missing_what="data source",
           folder_refused=False),
    Caller("tokenizer-config", ".json", b'{"eos_token": "a"}', _tokenizer_config, "tokenizer config", DataError),
]
IDS = [c.name for c in CALLERS]


def _file(tmp_path: Path, caller: Caller, blob: bytes) -> Path:
  folder = tmp_path / caller.name
  folder.mkdir(parents=True, exist_ok=True)
  path = folder / ("tokenizer_config.json" if caller.name == "tokenizer-config" else f"input{caller.suffix}")
  path.write_bytes(blob)
  return path


def _refused(caller: Caller, path: Path, what: str = "") -> str:
  with pytest.raises(caller.error) as err:
    caller.read(path)
  message = str(err.value)
  assert message.startswith(f"{what or caller.what} {path} "), message
  return message


@pytest.mark.parametrize("caller", CALLERS, ids=IDS)
def test_a_bom_is_accepted_and_dropped(tmp_path, caller):
  plain = caller.read(_file(tmp_path / "plain", caller, caller.body))
  assert caller.read(_file(tmp_path / "bom", caller, BOM + caller.body)) == plain


@pytest.mark.parametrize("caller", CALLERS, ids=IDS)
def test_invalid_utf8_names_the_file_the_byte_its_offset_and_the_fix(tmp_path, caller):
  """The offset is the file's own (the BOM counted), so `cmp` / a hex editor finds the byte there."""
  bad = BOM + caller.body[:7] + b"\xff" + caller.body[7:]
  message = _refused(caller, _file(tmp_path, caller, bad))
  assert re.search(r"is not UTF-8 text \(byte 0xff at offset 10\); .*(iconv|UTF-8)", message), message


@pytest.mark.parametrize("caller", CALLERS, ids=IDS)
def test_a_binary_file_names_the_nul_bytes_offset(tmp_path, caller):
  message = _refused(caller, _file(tmp_path, caller, caller.body[:5] + b"\0" + caller.body[5:]))
  assert "is binary (a NUL byte at offset 5), not text" in message


@pytest.mark.parametrize("caller", [c for c in CALLERS if c.name != "tokenizer-config"], ids=lambda c: c.name)
def test_a_missing_file_names_the_path_and_where_it_resolved(tmp_path, monkeypatch, caller):
  """(A tokenizer_config.json is optional: its folder's own check names a missing tokenizer.)"""
  monkeypatch.chdir(tmp_path)
  path = Path(f"nope{caller.suffix}")
  message = _refused(caller, path, caller.missing_what)
  assert f"does not exist (resolved to {tmp_path / path}); check the path" in message


@pytest.mark.parametrize("caller", [c for c in CALLERS if c.folder_refused and c.name != "tokenizer-config"],
                         ids=lambda c: c.name)
def test_a_folder_is_refused(tmp_path, caller):
  (tmp_path / f"d{caller.suffix}").mkdir()
  assert "is a folder; pass a file" in _refused(caller, tmp_path / f"d{caller.suffix}")


def test_a_chat_template_with_a_bom_reads_as_without_and_invalid_utf8_is_refused(tmp_path):
  pytest.importorskip("tokenizers")
  from parity.dataset.tokenizer import _chat_template
  (tmp_path / "chat_template.jinja").write_bytes(BOM + b"{{ messages }}")
  assert _chat_template(tmp_path, {})[0] == "{{ messages }}"
  (tmp_path / "chat_template.jinja").write_bytes(b"{{ caf\xe9 }}")
  with pytest.raises(DataError, match=r"^chat template .*chat_template.jinja is not UTF-8 text \(byte 0xe9 at "
                                      r"offset 6\)"):
    _chat_template(tmp_path, {})


def test_offsets_are_exact_across_the_readers_steps(tmp_path):
  """read_user_bytes checks UTF-8 in 1 MiB steps: a character cut by a step is whole, and the offset of an invalid
  byte after a cut character, or of a cut character at the end, is the file's."""
  step = 1 << 20
  path = tmp_path / "big.dat"
  body = b"a" * (step - 1) + "é".encode() + b"b" * 10  # 'é' (2 bytes) across the first step's end
  path.write_bytes(body)
  assert read_user_bytes(path, max_bytes=None) == body
  path.write_bytes(BOM + body)
  assert read_user_bytes(path, max_bytes=None) == body
  path.write_bytes(body[:step + 5] + b"\xff" + body[step + 5:])
  with pytest.raises(InputError, match=rf"byte 0xff at offset {step + 5}\)"):
    read_user_bytes(path, max_bytes=None)
  path.write_bytes(b"a" * (2 * step - 1) + b"\xc3")  # a lead byte with nothing after it, the file's last
  with pytest.raises(InputError, match=rf"byte 0xc3 at offset {2 * step - 1}\)"):
    read_user_bytes(path, max_bytes=None)
  assert read_user_bytes(path, max_bytes=None, utf8=False)[-1] == 0xC3  # any encoding: its bytes


def test_the_text_readers_refuse_the_same_way(tmp_path):
  """read_text and read_user_bytes give the same messages (one reader), and a file over the limit is refused
  before it is read."""
  path = tmp_path / "f.txt"
  path.write_bytes(b"ok \xff")
  messages = set()
  for read in (read_text, read_user_bytes):
    with pytest.raises(InputError) as err:
      read(path, what="thing")
    messages.add(str(err.value))
  assert len(messages) == 1 and messages.pop().startswith(f"thing {path} is not UTF-8 text (byte 0xff at offset 3)")
  with pytest.raises(InputError, match=r"is 4 bytes, over the 3-byte limit"):
    read_text(path, max_bytes=3)
  assert json.loads(read_text(_write(tmp_path / "j.json", BOM + b"[1]"))) == [1]


def _write(path: Path, blob: bytes) -> Path:
  path.write_bytes(blob)
  return path
