"""A full disk named as such: "No space left on device (disk full while writing <path>)".

A side that fills its disk mid-run often cannot say so: its summary.json and its stderr.log are on the same full
disk, so the harness once saw only "worker exited with code 1 without a summary:" and an empty log, and the report
gave a blank reason. `disk_full_in` finds the OS error in whatever text did reach the harness (a summary's error
and traceback, the stderr tail) and names the file being written; `disk_full_at` tells a full disk from the
folder itself when no text did. The harness puts the reason first in the side's error (harness.runner), where
parity.report.headline.error_clause reads it.
"""
from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from parity.protocol.layout import CHECKPOINT_META, FINAL_MOMENTS

__all__ = ["DISK_FULL", "MIN_FREE_BYTES", "disk_full_reason", "disk_full_in", "disk_full_at", "written_file"]

DISK_FULL = os.strerror(errno.ENOSPC)
"""The OS's words for ENOSPC: 'No space left on device'."""
MIN_FREE_BYTES = 1 << 20
"""Free bytes (for an unprivileged writer) under which a folder's disk counts as full: less than one step's line
and a summary need, with room for the root-reserved blocks a user cannot write."""
_MARKS = (DISK_FULL.lower(), "errno 28]", "os error 28", "enospc")
"""How the error shows in text: Python's OSError ('[Errno 28] No space left on device'), Rust's I/O errors (the
safetensors writer: 'No space left on device (os error 28)'), C libraries' errno names."""
_FILE_CONSTANTS = {"FINAL_MOMENTS": FINAL_MOMENTS, "CHECKPOINT_META": CHECKPOINT_META}
"""The run-folder file names a worker's source line names by constant (parity.protocol.layout)."""


def disk_full_reason(path: str | Path) -> str:
  """'No space left on device (disk full while writing PATH)'."""
  return f"{DISK_FULL} (disk full while writing {path})"


def written_file(src: str) -> str | None:
  """The run-folder file one traceback source line writes: a quoted file name ('"final.safetensors"') or a layout
  constant (FINAL_MOMENTS); None when it names neither."""
  m = re.search(r'"([\w.-]+\.(?:safetensors|jsonl|json|npy|log))"', src)
  if m:
    return m.group(1)
  return next((v for k, v in _FILE_CONSTANTS.items() if re.search(rf"\b{k}\b", src)), None)


def disk_full_in(text: str | None, folder: str | Path) -> str | None:
  """`disk_full_reason` when `text` (a side's error, traceback or stderr) holds ENOSPC, else None. The path is the
  file the error names ("...: '/x/steps.jsonl'"), else the file the last parity frame of a traceback writes (in
  `folder`), else `folder` itself."""
  text = str(text or "")
  if not any(m in text.lower() for m in _MARKS):
    return None
  named = re.search(r"No space left on device: '([^']+)'", text)
  if named:
    return disk_full_reason(named.group(1))
  frames = re.findall(r'File "[^"]*parity[^"]*", line \d+, in \w+\n\s+(.*)', text)
  files = [f for f in map(written_file, frames) if f]
  return disk_full_reason(Path(folder) / files[-1] if files else folder)


def disk_full_at(folder: str | Path) -> bool:
  """Whether the disk of `folder` (or its nearest existing parent) has less than MIN_FREE_BYTES free for an
  unprivileged writer; False where it cannot be told."""
  p = Path(folder)
  while not p.exists() and p != p.parent:
    p = p.parent
  try:
    st = os.statvfs(p)
  except OSError:
    return False
  return st.f_bavail * st.f_frsize < MIN_FREE_BYTES
