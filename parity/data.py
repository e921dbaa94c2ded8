"""Corpora (byte-level text or token-id files) and a seeded batch sampler shared by every side.

The harness materialises every batch a run will see (`make_batches`) into one
`.npy` file before any side starts, so the sides read identical token ids by
construction and need no data code of their own. Batches are stored in the
smallest unsigned dtype that holds the model's vocabulary (`batch_dtype`).

Sources (`load_corpus`):
  stdlib          this interpreter's standard-library .py files, read as bytes (ids 0-255).
  text file       read as bytes (ids 0-255) by parity.inputs.read_user_bytes: no NUL byte, a UTF-8 BOM dropped,
                  and valid UTF-8 unless its suffix is in TEXT_SUFFIXES.
  folder          its files with a suffix in TEXT_SUFFIXES (no NUL byte), sorted, read as bytes.
  NAME.bin        token ids: an llm.c file (a 256-int32 header: magic 20240520 version 1 = uint16, magic
                  20240801 version 7 = uint32; the header's dtype and token count are used), or a headerless
                  nanoGPT stream of little-endian uint16; NAME.uint32.bin (or NAME.uint16.bin) says the dtype.
  NAME.npy        a 1-D NumPy array of any integer dtype, ids >= 0.
A file that is neither is refused, never read as bytes.
"""
from __future__ import annotations

import dataclasses
import hashlib
import sysconfig
from pathlib import Path

import numpy as np

from parity.errors import ParityInputError
from parity.inputs import read_user_bytes, user_file
from parity.spec import MAX_VOCAB

__all__ = ["Corpus", "load_corpus", "make_batches", "batch_dtype", "DataError", "STDLIB_MAX_BYTES",
           "LLMC_HEADERS", "BIN_DTYPE_TAGS"]

STDLIB_MAX_BYTES = 24 * 2**20
"""The built-in corpus takes the first 24 MiB of the sorted stdlib sources."""
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".c", ".h", ".json", ".html", ".tex", ".csv")
LLMC_HEADER_INTS = 256
"""An llm.c token file starts with 256 little-endian int32: magic, version, token count, then zeros."""
LLMC_HEADERS = {(20240520, 1): "uint16", (20240801, 7): "uint32"}
"""(magic, version) of llm.c's dev/data/data_common.py HEADERS_INFO ('gpt-2', 'llama-3') -> token dtype."""
BIN_DTYPE_TAGS = ("uint16", "uint32")
"""A headerless .bin names its dtype in the file name, NAME.<tag>.bin; without a tag it is uint16 (nanoGPT)."""
ID_CAP = MAX_VOCAB
"""Largest token id + 1 a file may hold: model.vocab_size is capped there (parity.spec.MAX_VOCAB)."""


class DataError(ParityInputError):
  """The corpus cannot be read or is too small for the requested batches (bad input: exit 2)."""


def batch_dtype(vocab_size: int) -> np.dtype:
  """The dtype batches.npy stores ids of a `vocab_size` vocabulary in: uint16 up to 65,536 ids, else uint32."""
  return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Token ids split into train and held-out parts.

  Attributes:
    train: token ids, shape (n_train,): uint16 when every id is below 65,536, else uint32.
    val: token ids, shape (n_val,), same dtype; the last `val_fraction` of the corpus.
    source: human description (path or 'stdlib').
    sha256: hash of all token ids (train then val) as stored here (little-endian, that dtype).
    n_files: number of files read (0 for a token-id file).
    vocab_size: vocabulary the ids need: 256 for byte-level text, max id + 1 for a token-id file.
    format: 'bytes' (text), 'nanogpt-bin' (headerless .bin), 'llmc-bin' (llm.c header), 'npy'.
    file_dtype: the ids' dtype in the file ('uint8' for text bytes, e.g. 'uint32', 'int64').
    max_id: the largest id in the corpus.
  """
  train: np.ndarray
  val: np.ndarray
  source: str
  sha256: str
  n_files: int
  vocab_size: int
  format: str = "bytes"
  file_dtype: str = "uint8"
  max_id: int = 255


def _stdlib_files() -> list[Path]:
  root = Path(sysconfig.get_paths()["stdlib"])
  return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)


_TOKEN_FIX = ("token ids belong in NAME.bin (llm.c header, or headerless uint16; NAME.uint32.bin for uint32) or a "
              "1-D integer NAME.npy")


def _read_text_file(path: Path) -> bytes:
  """A text file's bytes through the one reader of user text (parity.inputs.read_user_bytes): a NUL byte refused and
  a UTF-8 BOM dropped for every file; invalid UTF-8 refused unless its suffix is one of TEXT_SUFFIXES (text in any
  encoding, read as its bytes). Each refusal is a DataError naming the file and the byte offset."""
  return read_user_bytes(path, what="data file", error=DataError, max_bytes=None,
                         utf8=path.suffix.lower() not in TEXT_SUFFIXES, hint=f"if it holds token ids: {_TOKEN_FIX}",
                         utf8_fix=f"if it is text, convert it to UTF-8 (e.g. iconv -t utf-8) or name it with a text "
                                  f"suffix ({', '.join(TEXT_SUFFIXES)}) to read it as its bytes")


def _read_files(files: list[Path], max_bytes: int | None, *, user: bool = True) -> tuple[bytes, int]:
  """The files' bytes joined, up to `max_bytes` (None: all), and how many were read. A user's files are read by
  `_read_text_file` (refusals named); the built-in stdlib corpus as it is, a file that cannot be read skipped."""
  chunks, total, used = [], 0, 0
  for f in files:
    if user:
      b = _read_text_file(f)
    else:
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


def _bin_tag(path: Path) -> str | None:
  """The dtype a NAME.<tag>.bin file name says (BIN_DTYPE_TAGS), or None."""
  tag = Path(path.stem).suffix.lstrip(".").lower()
  return tag if tag in BIN_DTYPE_TAGS else None


def _read_bin(path: Path) -> tuple[np.ndarray, str, str]:
  """(ids, format, dtype name) of a .bin token file: llm.c header first, else the name's tag, else uint16.

  Raises DataError: a size that is not whole ids, an llm.c header of an unknown version or a wrong token count, a
  tag that contradicts the header, or a headerless uint16 file that holds uint32 ids (every second uint16 small).
  """
  size, tag = path.stat().st_size, _bin_tag(path)
  head = np.fromfile(path, dtype="<i4", count=LLMC_HEADER_INTS) if size >= 4 * LLMC_HEADER_INTS else None
  if head is not None and int(head[0]) in {m for m, _ in LLMC_HEADERS}:
    dt = LLMC_HEADERS.get((int(head[0]), int(head[1])))
    if dt is None:
      raise DataError(f"{path}: llm.c header magic {int(head[0])} with version {int(head[1])}, which parity does "
                      f"not know (known: {', '.join(f'{m} v{v} = {d}' for (m, v), d in LLMC_HEADERS.items())})")
    if tag is not None and tag != dt:
      raise DataError(f"{path}: the name says {tag} but its llm.c header says {dt}; rename the file")
    n, body = int(head[2]), size - 4 * LLMC_HEADER_INTS
    if body != n * np.dtype(dt).itemsize:
      raise DataError(f"{path}: its llm.c header says {n} {dt} tokens ({n * np.dtype(dt).itemsize} bytes) but "
                      f"{body} bytes follow the header; the file is truncated or not an llm.c file")
    return np.fromfile(path, dtype="<" + np.dtype(dt).str[1:], offset=4 * LLMC_HEADER_INTS), "llmc-bin", dt
  dt = np.dtype(tag or "uint16")
  if size % dt.itemsize:
    raise DataError(f"{path}: {size} bytes is not a whole number of {dt.name} token ids (a headerless .bin holds "
                    f"little-endian {dt.name}{'' if tag else ', as nanoGPT writes; NAME.uint32.bin for uint32'})")
  ids = np.fromfile(path, dtype=dt.newbyteorder("<"))
  if tag is None and ids.size >= 64 and ids.size % 2 == 0 and int(ids[1::2].max()) < 64 <= int(ids[0::2].max()):
    raise DataError(f"{path}: read as headerless uint16 (nanoGPT), every second id is below 64, as little-endian "
                    f"uint32 ids look; if the file holds uint32 ids rename it {path.stem}.uint32.bin, if it really "
                    f"is uint16 rename it {path.stem}.uint16.bin")
  return ids, "nanogpt-bin", dt.name


def _read_npy(path: Path) -> tuple[np.ndarray, str, str]:
  """(ids, 'npy', dtype name) of a 1-D integer .npy. Raises DataError: not an array file, a pickled object array, a
  non-integer dtype, more than one dimension, or a negative id."""
  try:
    arr = np.load(path, mmap_mode="r", allow_pickle=False)
  except (ValueError, OSError, EOFError) as exc:
    raise DataError(f"{path}: not a NumPy array file parity can read ({exc}); save the ids with "
                    "numpy.save(path, ids) as a 1-D integer array") from None
  if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "iu":
    kind = getattr(arr, "dtype", type(arr).__name__)
    raise DataError(f"{path}: holds {kind} values, not integer token ids; save the ids as an integer array "
                    "(e.g. ids.astype(numpy.uint32))")
  if arr.ndim != 1:
    raise DataError(f"{path}: a {arr.ndim}-D array of shape {arr.shape}; token ids must be one 1-D stream "
                    "(documents concatenated, e.g. ids.reshape(-1))")
  if arr.size and arr.dtype.kind == "i" and int(arr.min()) < 0:
    at = int(np.argmax(arr < 0))
    raise DataError(f"{path}: token id {int(arr[at])} at index {at} is negative (padding or an ignore label like "
                    "-100?); a token stream holds ids >= 0 only: remove those entries")
  return arr, "npy", arr.dtype.name


def _token_corpus(path: Path) -> tuple[np.ndarray, str, str, int]:
  """(ids in the smallest of uint16/uint32 holding them, format, file dtype, max id) of a .bin or .npy file."""
  ids, fmt, dt = _read_bin(path) if path.suffix.lower() == ".bin" else _read_npy(path)
  max_id = int(ids.max()) if ids.size else 0
  if max_id >= ID_CAP:
    raise DataError(f"{path}: token id {max_id} is beyond the largest vocabulary parity accepts "
                    f"(model.vocab_size <= {ID_CAP}); is the file's dtype right?")
  return np.ascontiguousarray(ids, dtype=batch_dtype(max_id + 1)), fmt, dt, max_id


def load_corpus(source: str = "stdlib", *, val_fraction: float = 0.1, max_bytes: int | None = None) -> Corpus:
  """Loads a corpus as token ids (the sources: this module's docstring).

  Args:
    source: 'stdlib' (this interpreter's standard-library .py files, sorted paths, first STDLIB_MAX_BYTES), a
      path to a text file, a folder (its text files, sorted, recursively), a `.bin` token file (llm.c
      header, or headerless uint16 / NAME.uint32.bin) or a 1-D integer `.npy`.
    val_fraction: fraction (0, 1) of the tokens, taken from the end, held out.
    max_bytes: cap on bytes read from text sources (None: all; stdlib: STDLIB_MAX_BYTES).
  Raises:
    DataError: the source does not exist, is empty, holds too few tokens, is a binary file that is not a token
      file, or is a token file parity refuses (the message names the file and the fix).
  """
  n_files, fmt, file_dtype = 0, "bytes", "uint8"
  if not source or not str(source).strip():
    raise DataError("data source is empty; pass 'stdlib', a text file, a folder, or a .bin / .npy token file")
  if source == "stdlib":
    blob, n_files = _read_files(_stdlib_files(), max_bytes or STDLIB_MAX_BYTES, user=False)
    ids = np.frombuffer(blob, dtype=np.uint8).astype(np.uint16)
  else:
    path = user_file(source, what="data source", error=DataError, folder_ok=True,
                     hint="pass 'stdlib', a text file, a folder, or a .bin / .npy token file")
    if path.is_file() and path.suffix.lower() in (".bin", ".npy"):
      ids, fmt, file_dtype, _ = _token_corpus(path)
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
  max_id = int(ids.max())
  return Corpus(train=ids[:-n_val], val=ids[-n_val:], source=source,
                sha256=hashlib.sha256(ids.tobytes()).hexdigest(), n_files=n_files,
                vocab_size=256 if fmt == "bytes" else max_id + 1, format=fmt, file_dtype=file_dtype,
                max_id=max_id)


_CHUNK_TOKENS = 1 << 22
"""Tokens gathered per chunk by make_batches (32 MiB of int64 indices): peak memory is the uint16 batches plus
this, where one fancy-index over the whole run took 8 + 2 + 2 bytes per token (uint16 ids; 4 + 4 for uint32)."""


def _windows(ids: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
  idx = starts[..., None] + np.arange(length)
  return ids[idx]


def make_batches(corpus: Corpus, *, steps: int, grad_accum_steps: int, micro_batch_size: int,
                 seq_len: int, seed: int, eval_batches: int,
                 dtype: np.dtype | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Samples every training and validation window of a run.

  Training windows start at uniform random offsets (numpy PCG64 seeded by `seed`),
  drawn in step-major order; validation windows are fixed, evenly spaced over the
  held-out split.

  Args:
    dtype: the batches' dtype: `batch_dtype(model.vocab_size)` (what the sides check); None: that of the
      corpus's own vocabulary (uint16 for text).
  Returns:
    train: `dtype`, shape (steps, grad_accum_steps, micro_batch_size, seq_len + 1).
    val: `dtype`, shape (eval_batches, micro_batch_size, seq_len + 1).
    Inputs are [..., :-1], targets [..., 1:].
  Raises:
    DataError: a split is shorter than one window, or `dtype` cannot hold the corpus's largest id.
  """
  dtype = batch_dtype(corpus.vocab_size) if dtype is None else np.dtype(dtype)
  if corpus.max_id > np.iinfo(dtype).max:
    raise DataError(f"{corpus.source}: token id {corpus.max_id} does not fit batches of {dtype.name}; set "
                    f"model.vocab_size > {corpus.max_id}")
  w = seq_len + 1
  for name, part in (("train", corpus.train), ("validation", corpus.val)):
    if part.size < w + 1:
      raise DataError(f"{corpus.source}: the {name} split has {part.size} tokens, fewer than one window of {w}; "
                      "use a larger corpus or a shorter train.seq_len")
  rng = np.random.default_rng(seed)
  starts = rng.integers(0, corpus.train.size - w, size=(steps, grad_accum_steps, micro_batch_size))
  train = np.empty(starts.shape + (w,), dtype=dtype)  # the only full-size array: 2 or 4 bytes per token
  flat_starts, flat = starts.reshape(-1), train.reshape(-1, w)
  rows = max(1, _CHUNK_TOKENS // w)  # windows gathered per chunk: int64 indices stay small, not 8 bytes per token
  for i in range(0, flat_starts.size, rows):
    flat[i:i + rows] = _windows(corpus.train, flat_starts[i:i + rows], w)
  n_val = max(eval_batches, 1) * micro_batch_size
  vstarts = np.linspace(0, corpus.val.size - w, num=n_val).astype(np.int64)
  val = _windows(corpus.val, vstarts, w).reshape(max(eval_batches, 1), micro_batch_size, w)
  return train, val.astype(dtype)
