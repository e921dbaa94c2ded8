"""Where `parity port` may write: outputs that destroy nothing (`check_outputs`), written whole or not at all
(`write_output`). The command itself is parity/cli/port.py."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Sequence

from parity.migrate._read import PortError

__all__ = ["OURS", "check_outputs", "write_output"]


OURS = ("schema: parity.ported/1", '"schema": "parity.ported/1"', "schema: parity.ported/2", '"schema": "parity.ported/2"',
        '"schema": "parity.migration/1"',
        "# Migration report:")
"""Text any file `parity port` writes starts with (or holds in its first 4 KiB): only such a file is replaced."""


def check_outputs(config: str | Path, outputs: Sequence[tuple[str, str | None]]) -> None:
  """Refuses, before anything is read or written, output paths that would destroy something: an output that is the
  input config (also through a symlink, `..` or a relative path), two outputs that are the same file, an output that
  is a folder, and an existing file that `parity port` did not write (OURS). An earlier port output is replaced.

  Raises:
    PortError: naming the flag, the path and the fix.
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
    if p.is_dir():
      raise PortError(f"{flag} {raw}: is a folder; give a file path")
    if p.exists() or p.is_symlink():
      try:
        with open(p, "rb") as f:
          head = f.read(4096).decode("utf-8", "replace")
      except OSError as exc:
        raise PortError(f"{flag} {raw}: exists and cannot be read ({exc.strerror}); give a new path") from None
      if not any(mark in head for mark in OURS):
        raise PortError(f"{flag} {raw}: exists and was not written by `parity port`; it is never overwritten. "
                        "Give a new path, or remove the file first")


def write_output(path: str | None, text: str) -> None:
  """Writes an output through a temporary file and a rename (a failed write never leaves half a file).

  Raises:
    OSError: the file cannot be written (the caller names it and exits 1).
  """
  if path is None:
    sys.stdout.write(text)
    return
  p = Path(path)
  tmp = p.with_name(f".{p.name}.tmp")
  try:
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, p)
  except OSError:
    tmp.unlink(missing_ok=True) if tmp.parent.is_dir() else None
    raise
