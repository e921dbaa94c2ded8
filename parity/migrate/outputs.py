"""Where `parity port` may write: outputs that destroy nothing (`check_outputs`: only the file port wrote there,
unedited, is replaced without --force), written whole or not at all, with a record of what was written (`write_output`).
The command itself is parity/cli/port.py."""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Sequence

from parity.migrate._read import PortError

__all__ = ["OURS", "RECORD_SUFFIX", "check_outputs", "write_output", "record_path"]


OURS = ("schema: parity.ported/1", '"schema": "parity.ported/1"', "schema: parity.ported/2",
        '"schema": "parity.ported/2"',
        '"schema": "parity.migration/1"',
        "# Migration report:")
"""Text a ported config or report starts with (or holds in its first 4 KiB): named in the refusal of such a file that
has no matching record (an older port's output, or one edited since)."""
RECORD_SUFFIX = ".parity"
"""`OUT.parity`, the record beside every file `parity port` writes: {"written_by": "parity port", "sha256": ...} of
the bytes written. Only a file whose bytes still have that hash is replaced without --force (a DeepSpeed JSON has no
place for a marker of its own)."""
_WRITER = "parity port"


def record_path(path: str | Path) -> Path:
  """The record file beside the output `path` (OUT.parity)."""
  p = Path(path)
  return p.with_name(p.name + RECORD_SUFFIX)


def _sha256(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _recorded_hash(path: Path) -> str | None:
  """The sha256 the record beside `path` holds, or None (no record, or not one `parity port` wrote)."""
  try:
    rec = json.loads(record_path(path).read_text(encoding="utf-8"))
  except (OSError, ValueError):
    return None
  return rec.get("sha256") if isinstance(rec, dict) and rec.get("written_by") == _WRITER else None


def check_outputs(config: str | Path, outputs: Sequence[tuple[str, str | None]], *, force: bool = False) -> None:
  """Refuses, before anything is read or written, output paths that would destroy something: an output that is the
  input config (also through a symlink, `..` or a relative path), two outputs that are the same file, an output that
  is a folder (these also with --force), and, without `force`, an existing file that is not the file `parity port`
  wrote there: no record OUT.parity, or one whose sha256 its bytes no longer have (edited since, or foreign).

  Raises:
    PortError: naming the flag, the path, why and the fix.
  """
  outs = [(flag, raw) for flag, raw in outputs if raw is not None]
  src = Path(config)
  seen: dict[str, str] = {}
  for flag, raw in outs:
    if str(raw).strip() == "":
      raise PortError(f"{flag} '': an empty path names no file; give a file name or leave {flag} out")
    p = Path(raw)
    real = os.path.realpath(p)
    if real == os.path.realpath(src) or (p.exists() and src.exists() and os.path.samefile(p, src)):
      raise PortError(f"{flag} {raw}: that is the input config {config}; writing it would destroy the input. "
                      "Give another output path")
    if real in seen:
      raise PortError(f"{flag} {raw}: the same file as {seen[real]}; give each output its own path")
    seen[real] = f"{flag} {raw}"
    seen[os.path.realpath(record_path(p))] = f"the record {record_path(p)} of {flag} {raw}"
    if p.is_dir():
      raise PortError(f"{flag} {raw}: is a folder; give a file path")
    if not force and (p.exists() or p.is_symlink()):
      _check_ours(flag, raw, p)


def _check_ours(flag: str, raw: str, p: Path) -> None:
  """Refuses the existing output `p` unless its bytes have the sha256 of its record (the file port wrote there)."""
  try:
    data = p.read_bytes()
  except OSError as exc:
    raise PortError(f"{flag} {raw}: exists and cannot be read ({exc.strerror}); give a new path") from None
  recorded = _recorded_hash(p)
  if recorded == _sha256(data):
    return
  if recorded is not None:
    why = f"changed since `parity port` wrote it: its sha256 is not the one in {record_path(p)}"
  elif any(mark in data[:4096].decode("utf-8", "replace") for mark in OURS):
    why = f"it looks like a port output but has no record {record_path(p)} of what was written (an older port, or " \
          "copied), so an edit since cannot be ruled out"
  else:
    why = f"no record {record_path(p)}: written by something else"
  raise PortError(f"{flag} {raw}: exists and is not the file `parity port` wrote there (changed since, or foreign: "
                  f"{why}); it is not replaced without --force. Give a new path, or pass --force to replace it")


def write_output(path: str | None, text: str) -> None:
  """Writes an output through a temporary file and a rename (a failed write never leaves half a file), then its
  record OUT.parity (the sha256 of the bytes written, what `check_outputs` recognises).

  Raises:
    OSError: the file cannot be written (the caller names it and exits 1).
  """
  if path is None:
    sys.stdout.write(text)
    return
  data = text.encode("utf-8")
  try:  # as `compare --out` makes its folder; a file in the way is left to the write, which names it
    Path(path).parent.mkdir(parents=True, exist_ok=True)
  except (FileExistsError, NotADirectoryError):
    pass
  _replace(Path(path), data)
  _replace(record_path(path), (json.dumps({"written_by": _WRITER, "sha256": _sha256(data)}) + "\n").encode())


def _replace(p: Path, data: bytes) -> None:
  tmp = p.with_name(f".{p.name}.tmp")
  try:
    tmp.write_bytes(data)
    os.replace(tmp, p)
  except OSError:
    tmp.unlink(missing_ok=True) if tmp.parent.is_dir() else None
    raise
