"""Byte-level corpora and a seeded batch sampler shared by every side.

The harness materialises every batch a run will see (`make_batches`) into one
`.npy` file before any side starts, so the sides read identical token ids by
construction and need no data code of their own.
"""
from __future__ import annotations

import dataclasses
import hashlib
import sysconfig
from pathlib import Path

import numpy as np

__all__ = ["Corpus", "load_corpus", "make_batches", "DataError", "STDLIB_MAX_BYTES"]

STDLIB_MAX_BYTES = 24 * 2**20
"""The built-in corpus takes the first 24 MiB of the sorted stdlib sources."""
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".c", ".h", ".json", ".html", ".tex", ".csv")


class DataError(ValueError):
  """The corpus cannot be read or is too small for the requested batches."""


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Token ids split into train and held-out parts.

  Attributes:
    train: uint16 token ids, shape (n_train,).
    val: uint16 token ids, shape (n_val,); the last `val_fraction` of the corpus.
    source: human description (path or 'stdlib').
    sha256: hash of all token ids (train then val), to tie a report to its data.
    n_files: number of files read (0 for a .bin file).
    vocab_size: vocabulary the ids need: 256 for byte-level text, max id + 1 for a .bin file.
  """
  train: np.ndarray
  val: np.ndarray
  source: str
  sha256: str
  n_files: int
  vocab_size: int


def _stdlib_files() -> list[Path]:
  root = Path(sysconfig.get_paths()["stdlib"])
  return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def _read_files(files: list[Path], max_bytes: int | None) -> tuple[bytes, int]:
  chunks, total, used = [], 0, 0
  for f in files:
    try:
      b = f.read_bytes()
    except OSError:
      continue
    chunks.append(b)
    total += len(b)
    used += 1
    if max_bytes is not None and total >= max_bytes:
      break
  blob = b"".join(chunks)
  return (blob[:max_bytes] if max_bytes else blob), used


def load_corpus(source: str = "stdlib", *, val_fraction: float = 0.1, max_bytes: int | None = None) -> Corpus:
  """Loads a corpus as token ids.

  Args:
    source: 'stdlib' (this interpreter's standard-library .py files, sorted paths,
      first STDLIB_MAX_BYTES), a path to a text file, a folder (its text files,
      sorted, recursively), or a nanoGPT-style `.bin` file of uint16 token ids.
    val_fraction: fraction (0, 1) of the tokens, taken from the end, held out.
    max_bytes: cap on bytes read from text sources (None: all; stdlib: STDLIB_MAX_BYTES).
  Raises:
    DataError: the source does not exist, is empty, or holds too few tokens.
  """
  n_files = 0
  if not source or not str(source).strip():
    raise DataError("data source is empty; pass 'stdlib', a text file, a folder, or a .bin file")
  if source == "stdlib":
    blob, n_files = _read_files(_stdlib_files(), max_bytes or STDLIB_MAX_BYTES)
    ids = np.frombuffer(blob, dtype=np.uint8).astype(np.uint16)
  else:
    path = Path(source).expanduser()
    if not path.exists():
      raise DataError(f"data source {source!r} does not exist; pass 'stdlib', a text file, a folder, or a .bin file")
    if not (path.is_file() or path.is_dir()):  # a FIFO or device (/dev/zero) would block or never end
      raise DataError(f"data source {source!r} is not a regular file or folder (a pipe or device); save the corpus "
                      "to a file")
    if path.is_file() and path.suffix == ".bin":
      if path.stat().st_size % 2:
        raise DataError(f"{source}: {path.stat().st_size} bytes is not a whole number of uint16 token ids "
                        "(a nanoGPT .bin holds little-endian uint16)")
      ids = np.fromfile(path, dtype="<u2")
    elif path.is_file():
      blob, n_files = _read_files([path], max_bytes)
      ids = np.frombuffer(blob, dtype=np.uint8).astype(np.uint16)
    else:
      files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
      if not files:
        raise DataError(f"folder {source!r} holds no text files ({', '.join(TEXT_SUFFIXES)})")
      blob, n_files = _read_files(files, max_bytes)
      ids = np.frombuffer(blob, dtype=np.uint8).astype(np.uint16)
  if not 0 < val_fraction < 1:
    raise DataError(f"val_fraction must be in (0, 1); got {val_fraction}")
  if ids.size < 64:
    raise DataError(f"data source {source!r} holds only {ids.size} tokens; need at least 64")
  n_val = max(1, int(ids.size * val_fraction))
  is_bytes = source == "stdlib" or not str(source).endswith(".bin")
  return Corpus(train=ids[:-n_val], val=ids[-n_val:], source=source,
                sha256=hashlib.sha256(ids.tobytes()).hexdigest(), n_files=n_files,
                vocab_size=256 if is_bytes else int(ids.max()) + 1)


_CHUNK_TOKENS = 1 << 22
"""Tokens gathered per chunk by make_batches (32 MiB of int64 indices): peak memory is the uint16 batches plus
this, where one fancy-index over the whole run took 8 + 2 + 2 bytes per token."""


def _windows(ids: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
  idx = starts[..., None] + np.arange(length)
  return ids[idx]


def make_batches(corpus: Corpus, *, steps: int, grad_accum_steps: int, micro_batch_size: int,
                 seq_len: int, seed: int, eval_batches: int) -> tuple[np.ndarray, np.ndarray]:
  """Samples every training and validation window of a run.

  Training windows start at uniform random offsets (numpy PCG64 seeded by `seed`),
  drawn in step-major order; validation windows are fixed, evenly spaced over the
  held-out split.

  Returns:
    train: uint16, shape (steps, grad_accum_steps, micro_batch_size, seq_len + 1).
    val: uint16, shape (eval_batches, micro_batch_size, seq_len + 1).
    Inputs are [..., :-1], targets [..., 1:].
  Raises:
    DataError: a split is shorter than one window.
  """
  w = seq_len + 1
  for name, part in (("train", corpus.train), ("validation", corpus.val)):
    if part.size < w + 1:
      raise DataError(f"{corpus.source}: the {name} split has {part.size} tokens, fewer than one window of {w}; "
                      "use a larger corpus or a shorter train.seq_len")
  rng = np.random.default_rng(seed)
  starts = rng.integers(0, corpus.train.size - w, size=(steps, grad_accum_steps, micro_batch_size))
  train = np.empty(starts.shape + (w,), dtype=np.uint16)  # the only full-size array: 2 bytes per token
  flat_starts, flat = starts.reshape(-1), train.reshape(-1, w)
  rows = max(1, _CHUNK_TOKENS // w)  # windows gathered per chunk: int64 indices stay small, not 8 bytes per token
  for i in range(0, flat_starts.size, rows):
    flat[i:i + rows] = _windows(corpus.train, flat_starts[i:i + rows], w)
  n_val = max(eval_batches, 1) * micro_batch_size
  vstarts = np.linspace(0, corpus.val.size - w, num=n_val).astype(np.int64)
  val = _windows(corpus.val, vstarts, w).reshape(max(eval_batches, 1), micro_batch_size, w)
  return train, val.astype(np.uint16)
