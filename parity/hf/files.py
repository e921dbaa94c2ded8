"""Files: safetensors reading (BF16 too), single and sharded HF checkpoint folders, canonical files
with the spec as metadata, and `run_spec_from_hf`."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Mapping

import numpy as np

from parity import weights
from parity.hf.config import HFFormatError, parse_hf_config
from parity.hf.export import hf_config_from_spec
from parity.hf.tensors import canonical_to_hf, hf_to_canonical
from parity.inputs import InputError, load_json, parse_text, safetensors_header
from parity.sizing.resources import tensor_count
from parity.spec import ModelSpec, RunSpec, SpecError, from_dict, to_dict

SPEC_METADATA_KEY = weights.SPEC_METADATA_KEY
"""safetensors metadata key of a canonical file holding the ModelSpec as JSON (one key: header order is stable)."""


_ST_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
              "U8": "u1", "BOOL": "?"}


def read_safetensors(path: str | Path, *, stored_dtypes: dict[str, str] | None = None
                     ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
  """Reads every tensor of a safetensors file, including bfloat16, with numpy only.

  BF16 is widened to float32 exactly (the 16 bits become the high half of a float32);
  other dtypes keep their numpy dtype. safetensors' own numpy loader cannot read BF16,
  which is how most HF checkpoints are stored.

  Args:
    path: the file.
    stored_dtypes: if given, receives name -> dtype as stored ('BF16', 'F32', ...).

  Returns:
    (name -> array, header metadata).
  Raises:
    HFFormatError: a truncated file, an unknown dtype, or a tensor whose byte range does not
      match its shape (named).
  """
  path = Path(path)
  try:  # one header check for every safetensors reader (parity.inputs): lengths, entries, offsets, dtypes
    header, meta, data_start = safetensors_header(path)
  except InputError as exc:
    raise HFFormatError(str(exc)) from None
  data = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start) if header and data_start < path.stat().st_size \
      else np.zeros(0, np.uint8)
  out = {}
  for name, info in header.items():
    dt, shape, (start, stop) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
    if dt not in _ST_DTYPES and dt != "BF16":
      raise HFFormatError(f"{path}: tensor {name!r} has dtype {dt}, which is not supported")
    raw = data[start:stop]
    if stored_dtypes is not None:
      stored_dtypes[name] = dt
    if dt == "BF16":
      arr = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    else:
      arr = np.array(raw.view(_ST_DTYPES[dt]))
    out[name] = arr.reshape(shape)
  return out, meta


def hf_weight_files(folder: str | Path) -> tuple[str, list[Path]]:
  """Finds the weight files of an HF checkpoint folder.

  Preference: model.safetensors, model.safetensors.index.json (shards), pytorch_model.bin,
  pytorch_model.bin.index.json.
  Returns:
    ('safetensors' | 'bin', files).
  Raises:
    FileNotFoundError: none of these exist, or the index names a shard that does not.
  """
  folder = Path(folder)
  for kind, single, index in (("safetensors", "model.safetensors", "model.safetensors.index.json"),
                              ("bin", "pytorch_model.bin", "pytorch_model.bin.index.json")):
    if (folder / single).exists():
      return kind, [folder / single]
    if (folder / index).exists():
      files = [folder / f for f in sorted(set(_weight_map(folder / index).values()))]
      gone = [str(f) for f in files if not f.exists()]
      if gone or not files:
        raise FileNotFoundError(f"{folder / index} names missing shard(s): {gone or 'none listed'}")
      return kind, files
  raise FileNotFoundError(f"{folder}: no model.safetensors, model.safetensors.index.json, pytorch_model.bin "
                          "or pytorch_model.bin.index.json")


def _weight_map(index: Path) -> dict[str, str]:
  """The `weight_map` of an HF index file: tensor name -> shard file name in the same folder.

  Raises:
    HFFormatError: the file is not UTF-8 JSON, has no `weight_map` mapping, or a shard is not a plain file name
      (a path such as ../x would read outside the checkpoint folder).
  """
  try:
    data = load_json(index, what="HF index")
  except InputError as exc:
    raise HFFormatError(str(exc)) from None
  wm = data.get("weight_map") if isinstance(data, dict) else None
  if not isinstance(wm, dict) or not wm:
    raise HFFormatError(f"{index}: 'weight_map' must be a non-empty mapping of tensor name -> shard file; got "
                        f"{type(wm).__name__ if wm is not None else 'none'}; the index is corrupt")
  for k, v in wm.items():
    if not isinstance(v, str) or not v or Path(v).name != v or v in (".", ".."):
      raise HFFormatError(f"{index}: weight_map[{k!r}] = {v!r} is not a shard file name in the checkpoint folder")
  return wm


def _read_shards(folder: Path, files: list[Path], notes: list[str]) -> dict[str, np.ndarray]:
  out: dict[str, np.ndarray] = {}
  where: dict[str, Path] = {}
  stored: dict[str, str] = {}
  for f in files:
    tensors, _ = read_safetensors(f, stored_dtypes=stored)
    for k, v in tensors.items():
      if k in out:
        raise HFFormatError(f"tensor {k!r} appears in both {where[k].name} and {f.name}")
      out[k], where[k] = v, f
  index = folder / "model.safetensors.index.json"
  if index.exists() and len(files) > 1:
    for k, shard in _weight_map(index).items():
      if where.get(k) is None or where[k].name != shard:
        raise HFFormatError(f"{index.name}: tensor {k!r} is listed in {shard} but "
                            f"{'absent' if k not in where else 'stored in ' + where[k].name}")
  widened = sorted({d for d in stored.values() if d in ("BF16", "F16")})
  if widened:
    notes.append(f"stored dtype(s) {', '.join(widened)} widened to float32 (exact)")
  return out


@dataclasses.dataclass(frozen=True)
class HFCheckpoint:
  """An HF checkpoint read into our terms."""
  family: str
  """A family's name (its row of parity.hf.families.FAMILIES): 'gpt2', 'llama', 'mistral', 'qwen2', 'qwen3', 'gemma',
  'gemma2', 'gemma3'."""
  spec: ModelSpec
  params: dict[str, np.ndarray]
  """Canonical float32 weights."""
  notes: tuple[str, ...]
  """Accepted config keys without a spec field, dropped buffers, conversions done."""


def _host_param_limit() -> tuple[int | None, str]:
  """(the most parameters whose float32 weights, what HFCheckpoint.params holds, fit in the memory this process may
  use now (parity.sizing.host_limits.host_memory: MemAvailable, the cgroup's headroom), why); (None, "") when
  neither is known."""
  from parity.sizing import host_limits
  avail = host_limits.host_memory().available_bytes
  if avail is None:
    return None, ""
  return avail // 4, (f": its float32 weights would not fit in the {avail / 1e9:,.1f} GB of memory this machine has "
                      "available (MemAvailable / the cgroup's headroom)")


def load_hf_checkpoint(folder: str | Path, *, bin_reader=None) -> HFCheckpoint:
  """Reads an HF checkpoint folder (config.json + safetensors or pytorch_model.bin).

  Args:
    folder: the folder `save_pretrained` wrote.
    bin_reader: callable(list of .bin paths) -> dict name -> numpy array, used only for
      pytorch_model.bin (it needs torch; `parity.hf.convert` passes one that runs a torch_impl
      subprocess with torch.load(weights_only=True)).
  Raises:
    FileNotFoundError: no config.json or no weights.
    HFFormatError: the architecture or a tensor cannot be mapped (named).
  """
  folder = Path(folder)
  cfg_path = folder / "config.json"
  if not cfg_path.exists() and not cfg_path.is_symlink():  # a link leading nowhere: load_json names it
    raise FileNotFoundError(f"{folder}: no config.json; pass the folder written by save_pretrained")
  try:
    cfg = load_json(cfg_path, what="HF config")
  except InputError as exc:
    raise HFFormatError(str(exc)) from None
  if not isinstance(cfg, dict):
    raise HFFormatError(f"{cfg_path}: the top level must be an object; got {type(cfg).__name__}")
  limit, why = _host_param_limit()
  try:
    family, spec, notes = parse_hf_config(cfg, max_params=limit, limit_why=why)
  except HFFormatError as exc:  # its messages say "config.json": name the file read
    msg = str(exc)
    raise HFFormatError(str(cfg_path) + msg.removeprefix("config.json") if msg.startswith("config.json")
                        else f"{cfg_path}: {msg}") from None
  kind, files = hf_weight_files(folder)
  if kind == "bin":
    if bin_reader is None:
      raise HFFormatError(f"{files[0]} is a pickle (pytorch_model.bin); reading it needs torch: use "
                          "`parity convert-weights` or pass bin_reader")
    tensors = bin_reader(files)
    notes.append(f"read {len(files)} pickle(s) with torch.load(weights_only=True); floats widened to float32")
  else:
    tensors = _read_shards(folder, files, notes)
  expected = tensor_count(spec)  # before hf_to_canonical lists every tensor: config.json may claim 10^7 layers
  if expected > 2 * len(tensors) + 8:  # LLaMA's q|k|v are 3 HF tensors per canonical one; buffers, a tied head
    raise HFFormatError(f"{cfg_path}: describes a model of {expected:,} tensors (n_layers={spec.n_layers}), but the "
                        f"weight files hold {len(tensors):,}; config.json does not belong to these weights")
  params = hf_to_canonical(tensors, spec, family, notes=notes)
  return HFCheckpoint(family, spec, params, tuple(notes))


def save_hf_checkpoint(folder: str | Path, spec: ModelSpec, params: Mapping[str, np.ndarray], *,
                       dtype: str = "float32") -> Path:
  """Writes config.json + model.safetensors that `AutoModelForCausalLM.from_pretrained` loads.

  Args:
    dtype: 'float32' (exact) or 'bfloat16' (rounded to nearest even; exact for weights read from a bfloat16
      checkpoint, so HF bf16 -> canonical -> HF bf16 gives the same bits).
  Raises:
    HFFormatError: the spec has no HF family; InputError (a ValueError): params do not match the spec, or an
      unknown dtype.
  """
  from safetensors.numpy import save_file
  if dtype not in ("float32", "bfloat16"):
    raise InputError(f"save_hf_checkpoint: dtype must be 'float32' or 'bfloat16'; got {dtype!r}")
  folder = Path(folder)
  config = {**hf_config_from_spec(spec), "dtype": dtype}
  tensors = canonical_to_hf(params, spec)
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
  if dtype == "float32":
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
  else:
    _write_bf16_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
  return folder


def bfloat16_bits(x: np.ndarray) -> np.ndarray:
  """float32 -> bfloat16 bit patterns (little-endian uint16, same shape), rounded to nearest even.

  The inverse of `read_safetensors`' widening: a float32 that came from a bfloat16 maps back to its 16 bits.
  """
  u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
  return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")


def _write_bf16_safetensors(path: Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> None:
  """A safetensors file of BF16 tensors (in the given order), with string metadata; the header is padded to 8 bytes."""
  header: dict = {"__metadata__": dict(metadata)}
  blobs, offset = [], 0
  for name, arr in tensors.items():
    raw = bfloat16_bits(arr).tobytes()
    header[name] = {"dtype": "BF16", "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
    blobs.append(raw)
    offset += len(raw)
  head = json.dumps(header, separators=(",", ":")).encode()
  head += b" " * (-len(head) % 8)
  with open(path, "wb") as f:
    f.write(len(head).to_bytes(8, "little"))
    f.write(head)
    for raw in blobs:
      f.write(raw)


def canonical_metadata(spec: ModelSpec) -> dict[str, str]:
  """safetensors metadata of a canonical file: {SPEC_METADATA_KEY: compact sorted JSON of the spec}."""
  return weights.spec_metadata(spec)


def spec_from_metadata(meta: Mapping[str, str], *, source: str = "metadata") -> ModelSpec | None:
  """The ModelSpec stored by `canonical_metadata`, or None when absent."""
  if SPEC_METADATA_KEY not in meta:
    return None
  try:
    return from_dict(ModelSpec, parse_text(meta[SPEC_METADATA_KEY], source, "json")).validate()
  except (json.JSONDecodeError, SpecError) as exc:
    raise HFFormatError(f"{source}: bad {SPEC_METADATA_KEY} metadata: {exc}") from None


def save_canonical(path: str | Path, params: Mapping[str, np.ndarray], spec: ModelSpec) -> Path:
  """Writes canonical float32 weights with the spec as metadata; the bytes depend only on (params, spec)."""
  weights.check_names_and_shapes(dict(params), spec, source=str(path))
  ordered = {k: params[k] for k in weights.param_shapes(spec)}
  weights.save(ordered, path, metadata=canonical_metadata(spec))
  return Path(path)


def load_canonical(path: str | Path, spec: ModelSpec | None = None) -> tuple[dict[str, np.ndarray], ModelSpec]:
  """Reads a canonical file and its spec: from metadata, else a sidecar `spec.json`, else `spec`.

  The sidecar is `<file>.spec.json` or `spec.json` in the same folder, holding a ModelSpec dict.
  Raises:
    FileNotFoundError: no such file.
    HFFormatError: no spec found anywhere, or metadata and `spec` disagree.
    InputError (a ValueError): tensors do not match the spec (named; weights.check_names_and_shapes).
  """
  path = Path(path)
  if not path.exists():
    raise FileNotFoundError(f"canonical weights not found: {path}")
  try:
    _, meta, _ = safetensors_header(path)
  except InputError as exc:
    raise HFFormatError(str(exc)) from None
  stored = spec_from_metadata(meta, source=str(path))
  if stored is None:
    for side in (path.with_name(path.name + ".spec.json"), path.with_name("spec.json")):
      if side.exists():
        try:
          stored = from_dict(ModelSpec, load_json(side, what="spec file"), path="model").validate()
        except SpecError as exc:  # InputError is one
          raise HFFormatError(f"{side}: {exc}") from None
        break
  if stored is not None and spec is not None and stored != spec:
    raise HFFormatError(f"{path}: stored spec {to_dict(stored)} differs from the given spec {to_dict(spec)}")
  spec = stored or spec
  if spec is None:
    raise HFFormatError(f"{path}: no {SPEC_METADATA_KEY} metadata and no spec.json beside it; pass a spec")
  params = weights.load(path, spec)
  return {k: params[k] for k in weights.param_shapes(spec)}, spec


def run_spec_from_hf(folder: str | Path, base: RunSpec, *, bin_reader=None, validate: bool = True
                     ) -> tuple[RunSpec, dict[str, np.ndarray]]:
  """The RunSpec of a comparison that starts from an HF checkpoint, and its canonical weights.

  The model section is replaced by the checkpoint's spec; training, plans, data and sides
  come from `base`. The caller must use the returned weights as the initial weights
  (instead of `weights.init_params`). `validate=False` leaves the RunSpec unvalidated, for a caller that applies
  overrides first and validates after (parity.pipeline.resolve: `--set train.seq_len=` within the context).

  Raises:
    FileNotFoundError, HFFormatError: see `load_hf_checkpoint`.
    SpecError: `base.train.seq_len` exceeds the checkpoint's context (named; only with `validate`).
  """
  ckpt = load_hf_checkpoint(folder, bin_reader=bin_reader)
  run = dataclasses.replace(base, model=ckpt.spec)
  if not validate:
    return run, ckpt.params
  try:
    return run.validate(), ckpt.params
  except SpecError as exc:
    raise SpecError(f"{folder}: {exc}") from None
