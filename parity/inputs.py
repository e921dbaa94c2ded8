"""One safe way in for every file and number a user gives `parity` (numpy only; no jax, no torch).

Rules (each covers whole classes of input, not single cases):
  * text files (run configs, DeepSpeed configs, HF config.json/index files, report.json, spec sidecars, example
    files, tokenizer files; corpora through `read_user_bytes`) are read by `read_text`, the one reader of a user's
    text: must exist, be a file, be at most MAX_TEXT_BYTES (or the caller's limit), hold no NUL byte and decode as
    UTF-8 (a UTF-8 BOM is accepted and dropped), each refusal naming the file, the byte offset and the fix;
  * parsed trees go through `check_tree`: nesting at most MAX_DEPTH levels (a 5,000-deep file would otherwise
    raise RecursionError in the parser or later in our own recursive code), every float finite (JSON's
    1e400 parses to inf), and at most one value per character of the text parsed: every JSON/hjson/YAML value
    takes at least one character, so only references (YAML aliases `*x`, a "billion laughs" file) can expand a
    tree past that, and they are refused before the walk costs more than reading the file did;
  * an empty file (or YAML holding only comments) and a bare NaN/Infinity value are refused by name in
    `parse_text` (hjson would read `NaN` as the string 'NaN', or fail on `Infinity` with "Bad key name");
  * safetensors headers are checked by `safetensors_header` before any byte of tensor data is mapped: the
    8-byte length must fit the file and MAX_HEADER_BYTES, the header must be a JSON object whose entries each
    carry dtype, shape and data_offsets, and the offsets must lie inside the file;
  * numbers typed by a user (CLI values, environment variables, config strings) become numbers through
    `ascii_number`, which takes ASCII digits only: str.isdigit and int() also take '²', '１６' or '٣', which the
    runtimes that read the same text (XLA's strtoll, a shell, a launcher) do not;
  * sizes are checked by `check_resources` before a run allocates: the memory model (parity.sizing.memory) and the
    bytes of batches.npy against the machine's available memory and free disk.
Every refusal is an `InputError` (a SpecError, so a ValueError): the CLI prints it and exits 2.
"""
from __future__ import annotations

import codecs
import errno
import json
import os
import math
import re
import struct
from pathlib import Path
from typing import Any, Callable

from parity.errors import ParityInputError, SpecError

__all__ = ["InputError", "MAX_TEXT_BYTES", "MAX_DEPTH", "MAX_NODES", "MAX_HEADER_BYTES", "UTF8_BOM", "user_file",
           "read_text", "read_user_bytes", "check_tree",
           "parse_text", "load_json", "safetensors_header", "ascii_number"]

MAX_TEXT_BYTES = 16 * 2**20
"""Largest config/JSON file read (16 MiB). The largest real config in tests/data/realworld is under 10 KiB and an
HF model.safetensors.index.json of a 70B model is ~70 KiB; anything past 16 MiB is not a config."""
MAX_DEPTH = 100
"""Deepest nesting accepted in a parsed config. Real DeepSpeed configs nest 3-4 levels; 100 stays far below
Python's recursion limit (1000), which the parsers and our recursive helpers (to_dict, _merge) share."""
MAX_NODES = MAX_TEXT_BYTES
"""Most values `check_tree` walks when the caller does not know the text's length: one per byte of the largest
text file read (parse_text passes the exact bound, len(text) + 1)."""
MAX_HEADER_BYTES = 100 * 2**20
"""safetensors' own limit on the JSON header (100 MB, `safetensors` N_MAX_HEADER); larger is corrupt."""


class InputError(SpecError):
  """A file or value given by the user cannot be used. The message names the file/key, the value and the fix."""


_ASCII_INT = re.compile(r"[-+]?[0-9]+")
_ASCII_FLOAT = re.compile(r"[-+]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|inf|infinity|nan)", re.IGNORECASE)


def ascii_number(text: str, kind: type = int, *, sign: bool = True) -> int | float:
  """The number `text` writes in ASCII: for `kind` int an optional sign (none where not `sign`) and the digits 0-9,
  for float also a point, an exponent, inf and nan (finiteness is the caller's rule); ASCII white space around it is
  dropped. The one way
  user text becomes a number: int() and float() also read other scripts' digits ('１６', '٣') and underscores,
  and str.isdigit takes '²', which int() then fails on with a traceback.

  Raises:
    ValueError: anything else, e.g. '１６' ('not a number in ASCII digits: ...'), for the caller to name its key.
  """
  s = str(text).strip(" \t\n\r")
  if not (_ASCII_INT if kind is int else _ASCII_FLOAT).fullmatch(s) or (not sign and s[:1] in "+-"):
    raise ValueError(f"not {'an integer' if kind is int else 'a number'} in ASCII digits: {str(text)[:40]!r}")
  return int(s) if kind is int else float(s)


UTF8_BOM = b"\xef\xbb\xbf"
"""A UTF-8 byte-order mark: accepted at the start of every text file a user gives, and dropped."""
_UTF8_FIX = "save it as UTF-8 (e.g. iconv -f ITS-ENCODING -t utf-8 FILE)"
_CHUNK = 1 << 20
"""Bytes checked per step when a file's UTF-8 is checked without decoding it whole (a corpus may be large)."""


def _more(hint: str) -> str:
  return f"; {hint}" if hint else ""


def user_file(path: str | Path, *, what: str = "file", error: type[ParityInputError] = InputError, hint: str = "",
              folder_ok: bool = False) -> Path:
  """The path of an input the user named, checked before a byte of it is read: it exists and is a regular file
  (or, `folder_ok`, a folder), never a pipe or device (reading one would block or never end).

  Raises:
    `error`: '{what} {path} does not exist (resolved to ...); check the path', '... is a folder; pass a file' or
      '... is not a regular file (a pipe or device)', each followed by `hint` when given.
  """
  p = Path(path).expanduser()
  if not p.exists() and p.is_symlink():
    raise error(f"{what} {p} is a symbolic link that leads to no file ({_dead_link(p)}); point it at the file, or "
                f"pass the file itself{_more(hint)}")
  if not p.exists():
    raise error(f"{what} {p} does not exist (resolved to {p.absolute()}); check the path{_more(hint)}")
  if p.is_dir() and not folder_ok:
    raise error(f"{what} {p} is a folder; pass a file{_more(hint)}")
  if not (p.is_file() or p.is_dir()):
    raise error(f"{what} {p} is not a regular file{' or folder' if folder_ok else ''} (a pipe or device); save it "
                "to a file and pass that")
  return p


def _dead_link(p: Path) -> str:
  """Why symbolic link `p` leads nowhere: 'a loop' or 'its target T does not exist'."""
  try:
    p.resolve(strict=True)
  except RuntimeError:  # Python < 3.13: a loop
    return "a loop"
  except OSError as exc:
    if exc.errno == errno.ELOOP:
      return "a loop"
  return f"its target {os.readlink(p)} does not exist"


def _read_raw(path: str | Path, what: str, error: type[ParityInputError], max_bytes: int | None, hint: str
              ) -> tuple[Path, bytes, int]:
  """(path, the file's bytes, where its text starts: 3 after a UTF-8 BOM, else 0), refusing what `read_text` does
  but invalid UTF-8."""
  p = user_file(path, what=what, error=error, hint=hint)
  try:
    size = p.stat().st_size
    if max_bytes is not None and size > max_bytes:
      raise error(f"{what} {p} is {size:,} bytes, over the {max_bytes:,}-byte limit for a text file; is it the "
                  "right file?")
    raw = p.read_bytes()
  except OSError as exc:
    raise error(f"{what} {p} cannot be read ({exc.strerror}); check the path and its permissions") from None
  nul = raw.find(b"\x00")
  if nul >= 0:
    wide = _wide_text(raw)
    if wide:  # its NUL bytes are refused whatever the caller reads: UTF-8 is the fix, not a suffix
      raise error(f"{what} {p} is {wide}, not UTF-8; {_UTF8_FIX}{_more(hint)}")
    raise error(f"{what} {p} is binary (a NUL byte at offset {nul}), not text{_more(hint)}")
  return p, raw, len(UTF8_BOM) if raw.startswith(UTF8_BOM) else 0


_WIDE_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF16_LE, "UTF-16"),
              (codecs.BOM_UTF16_BE, "UTF-16"))
"""Byte-order marks of the wide encodings (UTF-32 first: its little-endian mark begins with UTF-16's)."""


def _wide_text(raw: bytes) -> str | None:
  """'UTF-16 text (its byte-order mark)' / 'UTF-32 ...' for a file starting with that mark, 'text in UTF-16 or
  UTF-32 (every second byte of its start is NUL)' for ASCII text in a wide encoding without one, else None."""
  for bom, name in _WIDE_BOMS:
    if raw.startswith(bom):
      return f"{name} text (its byte-order mark)"
  head = raw[:64]
  head = head[:len(head) - len(head) % 4]
  text = lambda bs: all(b in (9, 10, 13) or 32 <= b < 127 for b in bs)  # ASCII a text file would start with
  for width in (2, 4):  # one ASCII character per 2 or 4 bytes, its byte first (LE) or last (BE), the rest NUL
    for pos in (0, width - 1):
      rest = bytes(b for i, b in enumerate(head) if i % width != pos)
      if len(head) >= 4 and text(head[pos::width]) and not rest.strip(b"\0"):
        return "text in UTF-16 or UTF-32 (every second byte of its start is NUL)"
  return None


def _not_utf8(p: Path, raw: bytes, offset: int, what: str, error: type[ParityInputError], fix: str,
              hint: str) -> ParityInputError:
  return error(f"{what} {p} is not UTF-8 text (byte 0x{raw[offset]:02x} at offset {offset}); {fix}{_more(hint)}")


def read_text(path: str | Path, *, what: str = "file", error: type[ParityInputError] = InputError,
              max_bytes: int | None = MAX_TEXT_BYTES, hint: str = "", utf8_fix: str = _UTF8_FIX) -> str:
  """The text of a file the user gave: the one reader of user text files (configs, JSON records, example files,
  tokenizer files, corpora through `read_user_bytes`), so that each refuses the same things the same way.

  A UTF-8 byte-order mark at the start is accepted and dropped (JSON forbids one, editors on Windows write one).
  Args:
    what: what the file is meant to be ('config', 'example file', ...): every message starts '{what} {path} '.
    error: the ParityInputError subclass raised (InputError, DataError, ...).
    max_bytes: the largest file read (None: any size).
    hint: appended to the refusals of a missing file, a folder, a binary file and invalid UTF-8 (what the file
      should be instead); utf8_fix: how to mend invalid UTF-8.
  Raises:
    `error`: missing, a folder, a pipe or device, unreadable, larger than `max_bytes`, binary (a NUL byte, its
      offset named) or not UTF-8 (the offending byte and its offset in the file named, with the fix).
  """
  p, raw, start = _read_raw(path, what, error, max_bytes, hint)
  try:
    return str(memoryview(raw)[start:], "utf-8")
  except UnicodeDecodeError as exc:
    raise _not_utf8(p, raw, start + exc.start, what, error, utf8_fix, hint) from None


def read_user_bytes(path: str | Path, *, what: str = "file", error: type[ParityInputError] = InputError,
                    max_bytes: int | None = MAX_TEXT_BYTES, hint: str = "", utf8: bool = True,
                    utf8_fix: str = _UTF8_FIX) -> bytes:
  """`read_text`'s bytes, not decoded (a byte-level corpus): the same refusals, a UTF-8 BOM dropped the same way,
  and the UTF-8 check only when `utf8` (False: text in any encoding, read as its bytes; a NUL byte still refused).
  The check walks the file in 1 MiB steps, so a large corpus is never decoded whole."""
  p, raw, start = _read_raw(path, what, error, max_bytes, hint)
  if utf8:
    dec = codecs.getincrementaldecoder("utf-8")()
    for i in range(start, len(raw), _CHUNK):
      pending = len(dec.getstate()[0])  # bytes of a character cut at the last step, decoded with this one
      try:
        dec.decode(raw[i:i + _CHUNK], final=i + _CHUNK >= len(raw))
      except UnicodeDecodeError as exc:
        raise _not_utf8(p, raw, i - pending + exc.start, what, error, utf8_fix, hint) from None
  return raw[start:]


def check_tree(data: Any, source: str, *, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES) -> Any:
  """Walks a parsed config without recursion; returns `data` unchanged. Stops after `max_nodes` values.

  Raises:
    InputError: nesting deeper than `max_depth`, more than `max_nodes` values (a tree whose shared references,
      e.g. YAML aliases, expand it past its text), or a float that is inf/nan (named by its key path).
  """
  stack, walked = [(data, "", 0)], 0
  while stack:
    node, key, depth = stack.pop()
    walked += 1
    if walked > max_nodes:
      raise InputError(f"{source}: expands to more than {max_nodes:,} values (at {key or 'the top level'}), more "
                       "than its text can hold: YAML aliases (*name) repeat anchored parts (an alias bomb?); "
                       "write the values out or remove the aliases")
    if depth > max_depth:
      raise InputError(f"{source}: nesting deeper than {max_depth} levels at {key or 'the top level'}; "
                       "configs and run records are a few levels deep: check the file")
    if isinstance(node, float) and not math.isfinite(node):
      raise InputError(f"{source}: {key or 'value'} is {node} (a number too large for a float, or not a number); "
                       "every number must be finite, check it")
    if isinstance(node, dict):
      stack.extend((v, f"{key}.{k}" if key else str(k), depth + 1) for k, v in node.items())
    elif isinstance(node, (list, tuple)):
      stack.extend((v, f"{key}[{i}]", depth + 1) for i, v in enumerate(node))
  return data


def parse_text(text: str, source: str, fmt: str, *, object_pairs_hook: Callable | None = None) -> Any:
  """Parses JSON ('json'), hjson ('hjson', DeepSpeed's reader) or YAML ('yaml', safe loader) and `check_tree`s it.

  Syntax errors are left to the caller's parser-specific handling (json.JSONDecodeError, hjson.HjsonDecodeError,
  yaml.YAMLError pass through); what no parser reports well is turned into InputError here.
  Raises:
    InputError: an empty file (nothing but whitespace, or YAML with only comments), a bare NaN/Infinity value
      (JSON/hjson; named by key and line), nesting too deep (RecursionError inside the parser), an integer with
      too many digits, inf/nan, or more values than characters (alias expansion; see check_tree).
  """
  if not text.strip():
    raise InputError(f"{source}: the file is empty; write the config into it (a mapping of keys), or pass another")
  if fmt == "hjson":  # json reads NaN/Infinity as floats, which check_tree refuses by key
    _refuse_bare_nonfinite(text, source)
  try:
    if fmt == "json":
      data = json.loads(text, object_pairs_hook=object_pairs_hook)
    elif fmt == "hjson":
      import hjson
      data = hjson.loads(text, object_pairs_hook=object_pairs_hook)
    elif fmt == "yaml":
      data = _yaml_load_unique(text, source)
    else:
      raise ValueError(f"unknown format {fmt!r}")
  except RecursionError:
    raise InputError(f"{source}: nested too deeply to parse (over Python's recursion limit); a config is a few "
                     "levels deep, check the file") from None
  except OverflowError:  # hjson reads integral floats as int: 1e400 -> int(inf)
    where = _overflow_key(text, object_pairs_hook)
    raise InputError(f"{source}: {where or 'a number'} is too large for a float (e.g. 1e400); every number must be "
                     "finite, check it") from None
  except ValueError as exc:
    if "digits" not in str(exc):  # syntax errors: the caller's own handler names line and column
      raise
    raise InputError(f"{source}: an integer has too many digits ({exc}); check the number") from None
  if data is None and fmt == "yaml":
    raise InputError(f"{source}: the file holds no config (only comments or an empty document); write the config "
                     "into it (a mapping of keys), or pass another")
  # every value of the tree takes >= 1 character of `text`; more values means references expanded it
  return check_tree(data, source, max_nodes=len(text) + 1)


def _yaml_load_unique(text: str, source: str) -> Any:
  """yaml.safe_load that refuses a key given twice in one mapping (PyYAML keeps the last silently; the JSON and hjson
  readers refuse duplicates, as DeepSpeed does) and a key that is not a string (`1:`, `null:`; JSON keys are strings
  and the spec readers expect names), naming the key and its line. Raises InputError."""
  import yaml

  class UniqueKeys(yaml.SafeLoader):
    pass

  def mapping(loader, node, deep=False):
    seen = {}
    for key_node, _ in node.value:  # the keys written in this mapping; a '<<' merge's keys may be overridden
      if key_node.tag == "tag:yaml.org,2002:merge":
        continue
      key = loader.construct_object(key_node, deep=deep)
      if not isinstance(key, str):  # JSON and hjson keys are strings; a config's keys are names
        raise InputError(f"{source}: key {key!r} (line {key_node.start_mark.line + 1}) is not a string "
                         f"({type(key).__name__}); config keys are names: quote it or fix the key")
      try:
        if key in seen:
          raise InputError(f"{source}: duplicate key {key!r} in one mapping (lines {seen[key] + 1} and "
                           f"{key_node.start_mark.line + 1}); keep one of them")
        seen[key] = key_node.start_mark.line
      except TypeError:  # an unhashable key: construct_mapping names it
        break
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)

  UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
  return yaml.load(text, Loader=UniqueKeys)  # a SafeLoader subclass


_BIG_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+(?![\w.])")


def _overflow_key(text: str, hook: Callable | None) -> str | None:
  """'key optimizer.params.lr = 1e400': the key path of the first number literal of an hjson text that overflows a
  float, found by parsing the text again with that literal replaced by a marker string; None when not found."""
  import hjson
  marker = "\x00parity-overflow\x00"
  for m in _BIG_NUMBER.finditer(text):
    if math.isfinite(float(m.group())):
      continue
    try:
      data = hjson.loads(text[:m.start()] + json.dumps(marker) + text[m.end():], object_pairs_hook=hook)
    except (ValueError, OverflowError, RecursionError):
      continue
    stack = [(data, "")]
    while stack:
      node, key = stack.pop()
      if node == marker:
        return f"key {key or '(top level)'} = {m.group()}"
      if isinstance(node, dict):
        stack.extend((v, f"{key}.{k}" if key else str(k)) for k, v in node.items())
      elif isinstance(node, list):
        stack.extend((v, f"{key}[{i}]") for i, v in enumerate(node))
  return None


_BARE_NONFINITE = re.compile(r"""(?:["']?([^\s"'{},:\[\]]+)["']?\s*:\s*|^\s*|[\[,]\s*)"""
                             r"""([+-]?(?:NaN|Infinity|inf|nan))(?=\s*(?:[,}\]]|$))""")


def _refuse_bare_nonfinite(text: str, source: str) -> None:
  """Refuses an hjson text with an unquoted NaN/Infinity value (hjson reads NaN as the string 'NaN' or fails on
  Infinity with 'Bad key name'): a config number must be finite. Names the key and line."""
  for line_no, line in enumerate(text.splitlines(), 1):
    stripped = line.split("//", 1)[0].split("#", 1)[0]
    m = _BARE_NONFINITE.search(stripped)
    if m:
      key = f"key {m.group(1)!r}" if m.group(1) else "a value"
      raise InputError(f"{source}:{line_no}: {key} is {m.group(2)}: NaN and Infinity are not allowed (not JSON "
                       "numbers, and a config number must be finite); write a finite number")


def load_json(path: str | Path, *, what: str = "JSON file") -> Any:
  """read_text + JSON parse + check_tree. Raises InputError naming the file (and line/column on a syntax error)."""
  try:
    return parse_text(read_text(path, what=what), str(path), "json")
  except json.JSONDecodeError as exc:
    raise InputError(f"{what} {path}:{exc.lineno}:{exc.colno}: not valid JSON: {exc.msg}; fix the syntax there"
                     ) from None


_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}


def safetensors_header(path: str | Path) -> tuple[dict[str, dict], dict[str, str], int]:
  """Reads and checks a safetensors header without touching the tensor data.

  Returns:
    (name -> {dtype, shape, data_offsets}, string metadata, byte offset where the data starts).
  Raises:
    InputError: missing file, shorter than 8 bytes, header length past the file or MAX_HEADER_BYTES, header not
      UTF-8 JSON object, an entry without dtype/shape/data_offsets, a negative dimension, an unknown dtype, or a
      byte range that does not match its shape or lies past the end of the file (each named).
  """
  p = Path(path)
  if not p.is_file():
    raise InputError(f"safetensors file not found: {p}")
  size = p.stat().st_size
  with open(p, "rb") as f:
    head = f.read(8)
    if len(head) != 8:
      raise InputError(f"{p}: not a safetensors file ({size} bytes, shorter than its 8-byte header length)")
    (n,) = struct.unpack("<Q", head)
    if n > min(size - 8, MAX_HEADER_BYTES):
      raise InputError(f"{p}: safetensors header length {n:,} bytes exceeds the file ({size:,} bytes) or the "
                       f"{MAX_HEADER_BYTES:,}-byte limit: the file is truncated or not safetensors")
    raw = f.read(n)
  try:
    header = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as exc:
    raise InputError(f"{p}: safetensors header is not valid JSON ({type(exc).__name__}); the file is corrupt"
                     ) from None
  if not isinstance(header, dict):
    raise InputError(f"{p}: safetensors header must be a JSON object; got {type(header).__name__}")
  meta = header.pop("__metadata__", None) or {}
  if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
    raise InputError(f"{p}: safetensors __metadata__ must map strings to strings")
  data_size = size - 8 - n
  for name, info in header.items():
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
      missing = sorted({"dtype", "shape", "data_offsets"} - set(info)) if isinstance(info, dict) else "all"
      raise InputError(f"{p}: tensor {name!r} has no {missing} in the safetensors header; the file is corrupt")
    dt, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
    if dt not in _ST_ITEMSIZE:
      raise InputError(f"{p}: tensor {name!r} has dtype {dt!r}, not a safetensors dtype this tool reads "
                       f"({', '.join(_ST_ITEMSIZE)})")
    if (not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                               for d in shape)):
      raise InputError(f"{p}: tensor {name!r} has shape {shape!r}; expected a list of integers >= 0")
    if (not isinstance(offs, list) or len(offs) != 2 or not all(isinstance(o, int) and not isinstance(o, bool)
                                                                for o in offs)):
      raise InputError(f"{p}: tensor {name!r} has data_offsets {offs!r}; expected [start, stop]")
    start, stop = offs
    if not 0 <= start <= stop <= data_size or stop - start != math.prod(shape) * _ST_ITEMSIZE[dt]:
      raise InputError(f"{p}: tensor {name!r} bytes [{start}, {stop}) do not hold shape {tuple(shape)} of {dt} "
                       f"within the {data_size:,} data bytes; the file is truncated or corrupt")
  return header, meta, 8 + n
