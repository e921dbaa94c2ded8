"""The one reader of user text files (parity.inputs.read_text, read_user_bytes, user_file) names what a file is when
it is text in another encoding (UTF-16 or UTF-32, as Windows editors save it) or a link that leads nowhere (broken, or
a loop), with the fix, rather than calling it binary or absent."""
from __future__ import annotations

import json
import os

import pytest

from parity import data, inputs
from parity.hf.config import HFFormatError
from parity.hf.files import load_hf_checkpoint
from parity.inputs import InputError

TEXT = json.dumps({"train": {"steps": 3}})


@pytest.mark.parametrize("encoding, name", [("utf-16", "UTF-16"), ("utf-16-le", None), ("utf-32", "UTF-32")])
def test_text_in_utf16_or_utf32_is_named_with_the_fix(tmp_path, encoding, name):
  """With a byte-order mark the encoding is named; without one (utf-16-le) the NUL bytes of ASCII text in a
  two-byte encoding still get the fix; each refusal says to save the file as UTF-8."""
  p = tmp_path / "run.json"
  p.write_bytes(TEXT.encode(encoding))  # Python's utf-16 and utf-32 write a byte-order mark, utf-16-le none
  for read in (inputs.read_text, inputs.read_user_bytes, inputs.load_json):
    with pytest.raises(InputError) as err:
      read(p)
    msg = str(err.value)
    assert str(p) in msg and "save it as UTF-8" in msg, msg
    assert name is None or f"is {name} text" in msg, msg
  corpus = tmp_path / "corpus.txt"  # a .txt corpus is read as its bytes in any encoding, but not with NUL bytes
  corpus.write_bytes(TEXT.encode(encoding))
  with pytest.raises(data.DataError) as err:
    data._read_text_file(corpus)
  assert "save it as UTF-8" in str(err.value) and "text suffix" not in str(err.value), str(err.value)
  p.write_bytes(b"ab\x00cd")  # a NUL byte in what is no two-byte text: binary, as before
  with pytest.raises(InputError, match=r"is binary \(a NUL byte at offset 2\), not text"):
    inputs.read_text(p)


def test_a_link_that_leads_nowhere_is_named_as_a_link(tmp_path):
  loop, broken = tmp_path / "loop.json", tmp_path / "broken.json"
  os.symlink(loop.name, loop)
  os.symlink("missing.json", broken)
  with pytest.raises(InputError, match=r"loop.json is a symbolic link that leads to no file \(a loop\); "):
    inputs.read_text(loop)
  with pytest.raises(InputError, match=r"broken.json is a symbolic link that leads to no file \(its target "
                                       r"missing.json does not exist\); "):
    inputs.user_file(broken, what="config")
  with pytest.raises(InputError, match=r"does not exist \(resolved to "):  # no link: as before
    inputs.read_text(tmp_path / "absent.json")
  (tmp_path / "ckpt").mkdir()  # an HF folder whose config.json is such a link: named, not "no config.json"
  os.symlink("config.json", tmp_path / "ckpt" / "config.json")
  with pytest.raises(HFFormatError, match=r"HF config .*ckpt/config.json is a symbolic link that leads to no file "
                                          r"\(a loop\)"):
    load_hf_checkpoint(tmp_path / "ckpt")


def test_a_binary_id_file_is_not_called_wide_text():
  """A little-endian uint32 id array starts 01 00 00 00 02 00 00 00: every second byte NUL, like UTF-16 text, but its
  other bytes are not text; it is binary (the wide-text guess needs ASCII between the NULs)."""
  import numpy as np
  from parity.inputs import _wide_text
  assert _wide_text(np.arange(1, 65, dtype=np.uint32).tobytes()) is None
  for enc in ("utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"):
    assert _wide_text('{"text": "hi"}\n'.encode(enc)) is not None, enc
