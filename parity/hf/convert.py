"""Weight conversion behind `parity convert-weights` (parity/cli/convert_weights.py): HF checkpoint folder <->
canonical safetensors <-> orbax checkpoint.

  parity convert-weights SRC DST [--from hf|canonical|orbax] [--to hf|canonical|orbax] [--force]

Every conversion goes through the canonical weights (float32, torch layout, the ModelSpec in
the file's metadata). Formats that need a framework run in a subprocess, so this module
imports neither jax nor torch:

  orbax             python -m jax_impl.convert_worker {to-orbax,from-orbax}
  pytorch_model.bin python -m torch_impl.convert_worker bin-to-safetensors  (torch.load weights_only=True)

Formats are inferred when not given: a folder with config.json is `hf`, a folder with
params/ and model_spec/ is `orbax`, a `*.safetensors` file is `canonical`.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

from parity import hf, weights
from parity.spec import ModelSpec, SpecError
from harness.launch import LaunchTimeout, run_module  # harness launches every process; it imports parity lazily

__all__ = ["FORMATS", "ConvertError", "Converted", "detect_format", "read_any", "convert", "read_bin"]

FORMATS = ("hf", "canonical", "orbax")
ROOT = Path(__file__).resolve().parents[2]
WORKER_TIMEOUT_S = 3600.0
"""Wall-clock limit of one framework subprocess, seconds (a 7B model converts in minutes)."""


class ConvertError(SpecError):
  """A conversion cannot be done: unknown format, existing output, or a failed worker."""


@dataclasses.dataclass(frozen=True)
class Converted:
  """What one conversion did."""
  src_format: str
  dst_format: str
  dst: Path
  spec: ModelSpec
  n_tensors: int
  n_params: int
  notes: tuple[str, ...]


def detect_format(path: str | Path, *, output: bool = False) -> str:
  """Infers the format of `path`; for an output that does not exist yet only `*.safetensors` is inferred.

  Raises:
    ConvertError: the format cannot be told; the message says which flag to pass.
  """
  p = Path(path)
  if p.suffix == ".safetensors" and (output or p.is_file()):
    return "canonical"
  if p.is_dir() and not output:
    if (p / "config.json").exists():
      return "hf"
    if (p / "params").is_dir() and (p / "model_spec").is_dir():
      return "orbax"
  if not output and not p.exists():
    raise ConvertError(f"{p} does not exist")
  raise ConvertError(f"cannot tell the format of {p}; pass --{'to' if output else 'from'} "
                     f"{'|'.join(FORMATS)} (canonical files end in .safetensors)")


def _worker(module: str, *args: str) -> None:
  """Runs one framework subprocess through the harness's launcher (the workers' environment, its own process
  group, bound to this process's life, killed at WORKER_TIMEOUT_S).

  Raises:
    ConvertError: it timed out or exited non-zero (its last lines of output are included).
  """
  try:
    proc = run_module(module, list(args), timeout_s=WORKER_TIMEOUT_S)
  except LaunchTimeout:
    raise ConvertError(f"{module} {args[0]} did not finish within {WORKER_TIMEOUT_S:.0f} s") from None
  if proc.returncode != 0:
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-8:]
    raise ConvertError(f"{module} {args[0]} failed (exit {proc.returncode}):\n  " + "\n  ".join(tail))


def read_bin(files: Sequence[Path]) -> dict[str, np.ndarray]:
  """pytorch_model.bin file(s) -> HF name -> numpy array, via the torch_impl worker.

  Raises:
    ConvertError: the worker failed (its message is included).
  """
  with tempfile.TemporaryDirectory(prefix="parity-bin-") as tmp:
    out = Path(tmp) / "bin.safetensors"
    # absolute: the worker runs from the repository root, not the user's current directory
    _worker("torch_impl.convert_worker", "bin-to-safetensors", str(out), *(str(Path(f).absolute()) for f in files))
    tensors, _ = hf.read_safetensors(out)
    return tensors


def read_any(src: str | Path, fmt: str, *, spec: ModelSpec | None = None
             ) -> tuple[ModelSpec, dict[str, np.ndarray], tuple[str, ...]]:
  """Reads any format into (spec, canonical float32 params, notes)."""
  if fmt == "hf":
    ck = hf.load_hf_checkpoint(src, bin_reader=read_bin)
    return ck.spec, ck.params, ck.notes
  if fmt == "canonical":
    params, spec = hf.load_canonical(src, spec)
    return spec, params, ()
  with tempfile.TemporaryDirectory(prefix="parity-orbax-") as tmp:
    out = Path(tmp) / "canonical.safetensors"
    _worker("jax_impl.convert_worker", "from-orbax", str(Path(src).absolute()), str(out))
    params, spec = hf.load_canonical(out)
    return spec, params, ()


def convert(src: str | Path, dst: str | Path, *, src_format: str | None = None, dst_format: str | None = None,
            spec: ModelSpec | None = None, force: bool = False) -> Converted:
  """Converts weights between the three formats (see the module docstring).

  Args:
    src: HF folder, canonical .safetensors file, or orbax folder.
    dst: output path of the same kinds.
    src_format, dst_format: one of FORMATS; inferred when None.
    spec: the spec of a canonical source that carries none in its metadata.
    force: replace an existing output.
  Returns:
    What was written.
  Raises:
    ConvertError: unknown format, existing output, or a failed worker.
    HFFormatError: an HF architecture, config key or tensor that cannot be mapped (named).
    InputError (a ValueError): tensors that do not match the spec (named; weights.check_names_and_shapes).
  """
  src, dst = Path(src), Path(dst)
  src_format = src_format or detect_format(src)
  dst_format = dst_format or detect_format(dst, output=True)
  for f in (src_format, dst_format):
    if f not in FORMATS:
      raise ConvertError(f"unknown format {f!r}; expected one of {', '.join(FORMATS)}")
  check_destination(src, dst, dst_format, force=force)
  model, params, notes = read_any(src, src_format, spec=spec)
  stage = dst.with_name(f".{dst.stem}.partial-{os.getpid()}{dst.suffix}")  # new: the output is built beside dst
  try:
    if dst_format == "canonical":
      dst.parent.mkdir(parents=True, exist_ok=True)
      hf.save_canonical(stage, params, model)
    elif dst_format == "hf":
      hf.save_hf_checkpoint(stage, model, params)
    else:
      with tempfile.TemporaryDirectory(prefix="parity-orbax-") as tmp:
        canon = src  # a canonical source that carries its spec goes to the worker as it is
        if src_format != "canonical" or spec is not None:
          canon = Path(tmp) / "canonical.safetensors"
          hf.save_canonical(canon, params, model)
        _worker("jax_impl.convert_worker", "to-orbax", str(Path(canon).absolute()), str(stage.absolute()))
    _swap_in(stage, dst)
  except BaseException:
    _remove(stage)  # only the staging output this call created
    raise
  n = weights.n_params(model)
  return Converted(src_format, dst_format, dst, model, len(weights.param_shapes(model)), n, tuple(notes))


def looks_like(path: Path, fmt: str) -> bool:
  """Whether `path` is a checkpoint of `fmt`, by its layout: canonical: a `.safetensors` file whose header parses;
  hf: a folder with config.json, a weights file (*.safetensors / pytorch_model*.bin) and no subfolders; orbax: a
  folder with params/ and model_spec/ and nothing else but orbax's own files. Only such a path is replaced."""
  import json
  import struct
  if path.is_symlink():
    return False
  if fmt == "canonical":
    if not (path.is_file() and path.suffix == ".safetensors"):
      return False
    try:
      with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return 2 <= n <= 100_000_000 and isinstance(json.loads(f.read(n)), dict)
    except (OSError, struct.error, ValueError):
      return False
  if not path.is_dir():
    return False
  entries = list(path.iterdir())
  if fmt == "hf":
    weights_file = any(e.is_file() and (e.suffix == ".safetensors" or (e.name.startswith("pytorch_model")
                                                                         and e.suffix == ".bin")) for e in entries)
    return (path / "config.json").is_file() and weights_file and not any(
        e.is_dir() and not e.name.startswith(".") for e in entries)
  return (path / "params").is_dir() and (path / "model_spec").is_dir() and all(
      e.name in ("params", "model_spec",
                 "commit_success.txt") or e.name.startswith(("_", ".")) or e.name.endswith(".json")
      for e in entries)


def check_destination(src: Path, dst: Path, dst_format: str, *, force: bool) -> None:
  """Refuses a destination whose writing could destroy something, before anything is read or written.

  Refused: '' ; dst that is src or lies inside it, or holds it (also through symlinks, `..`, relative paths); an
  existing dst without `force`; with `force`, a dst that is a symlink or not a checkpoint of `dst_format`
  (`looks_like`): --force replaces only a checkpoint of that format, and only once the new one is complete.
  Raises:
    ConvertError: naming the path and the fix.
  """
  if str(dst).strip() in ("", "."):
    raise ConvertError(f"DST {str(dst)!r} names no new file or folder; give an output path")
  s, d = Path(os.path.realpath(src)), Path(os.path.realpath(dst))
  if s == d or s.is_relative_to(d) or d.is_relative_to(s):
    raise ConvertError(f"DST {dst}: {'is' if s == d else 'overlaps'} the source {src}; writing it would destroy the "
                       "source. Give an output path outside it")
  if not (dst.exists() or dst.is_symlink()):
    return
  if not force:
    raise ConvertError(f"{dst} exists; pass --force to replace it (only a {dst_format} checkpoint is replaced)")
  if dst.is_symlink():
    raise ConvertError(f"{dst} is a symbolic link; --force does not replace links. Remove it or give another path")
  if not looks_like(dst, dst_format):
    raise ConvertError(f"{dst} exists and is not a {dst_format} checkpoint; --force replaces only a checkpoint of the "
                       "output format, never other files or folders. Give another output path")


def _remove(path: Path) -> None:
  import shutil
  try:
    if path.is_dir() and not path.is_symlink():
      shutil.rmtree(path)
    else:
      path.unlink(missing_ok=True)
  except OSError:
    pass


def _swap_in(stage: Path, dst: Path) -> None:
  """Puts the complete output `stage` at `dst`; an existing dst (checked by check_destination) is removed only after
  the new output took its name."""
  if not (dst.exists() or dst.is_symlink()):
    os.rename(stage, dst)
    return
  old = dst.with_name(f".{dst.stem}.replaced-{os.getpid()}{dst.suffix}")
  os.rename(dst, old)
  try:
    os.rename(stage, dst)
  except OSError:
    os.rename(old, dst)
    raise
  _remove(old)
