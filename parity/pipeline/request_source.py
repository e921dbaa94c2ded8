"""`parity compare --request A/request.json`: the run an earlier folder made, again, with other sides.

One request, two machines (docs/join.md): the reference sides run in folder A on one machine, the other sides from
A's request on another, and `parity join A B` gives the verdict. Run B must be exactly run A (the same resolved spec
but its side list, the same batches and initial weights), so its inputs are never made again from sources that could
differ on another machine (the `stdlib` corpus is this Python's, a data path may not exist there):

  spec        resolve_run over A's request.json 'run' (a full spec), with the sides asked for; its config_hash with
              A's sides must be A's, or the request is refused (written by another version, edited).
  inputs      A's init.safetensors, batches.npy, val_batches.npy and, for padded/packed data, the example arrays are
              copied byte for byte from the folder beside A's request.json (`copy_inputs`); its data and inputs records
              are A's. When A is finished (report.json), each file must still have the sha256 A's report recorded.
  DeepSpeed   a run made with --deepspeed-config ports A's byte copy of that file (deepspeed_config.given.json) again.
  provenance  B's request.json records 'request_from' {request, run_id, config_hash, sha256} and each copied file's
              sha256; `parity join` checks the files themselves.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np

from parity.inputs import InputError, load_json
from parity.pipeline.examples_input import EXAMPLE_ARRAYS, EXAMPLE_INPUTS
from parity.pipeline.plants import check_plants_on_data
from parity.pipeline.resolve import ResolvedRun, resolve_run
from parity.presets import PRESETS
from parity.protocol.layout import REQUEST_SCHEMA
from parity.spec import SpecError, config_hash

__all__ = ["REQUEST_INPUTS", "CONFLICTING_FLAGS", "DS_GIVEN", "read_request", "resolve_request", "copy_inputs",
           "sha256_of"]

REQUEST_INPUTS = ("init.safetensors", "batches.npy", "val_batches.npy", *EXAMPLE_INPUTS)
"""The input files a run from a request takes from the request's folder (those that folder holds; the first two
always)."""
CONFLICTING_FLAGS = {"preset": "--preset", "config": "--config", "overrides": "--set", "steps": "--steps",
                     "data": "--data", "hf_model": "--hf-model", "deepspeed_config": "--deepspeed-config",
                     "plan": "--plan", "tokenizer": "--tokenizer", "stack": "--stack"}
"""`parity compare` flags (dest -> flag) that say what is run: with --request the request says it, so each is
refused."""
DS_GIVEN = "deepspeed_config.given.json"
"""The byte copy of a --deepspeed-config file in a run folder (parity.pipeline.folder.DS_GIVEN, which imports this
module)."""


def sha256_of(path: Path) -> str:
  """The sha256 (hex) of a file, read in 8 MiB blocks. Raises OSError."""
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(8 * 2**20):
      h.update(block)
  return h.hexdigest()


def read_request(path: str | Path) -> tuple[Path, dict[str, Any]]:
  """(the folder of the request, request.json as read) of `--request PATH` (request.json, or its run folder).

  Raises:
    InputError: not a parity request; a rerun's (derived) or a joined folder's request; the folder lacks
      init.safetensors or batches.npy; a file the request's report.json recorded has changed since (each named).
  """
  p = Path(path)
  file = p / "request.json" if p.is_dir() else p
  if not file.is_file():
    raise InputError(f"--request {path}: no such file; pass the request.json of a `parity compare` run folder")
  req = load_json(file, what="request")
  if not isinstance(req, dict) or req.get("schema") != REQUEST_SCHEMA or not isinstance(req.get("run"), dict):
    raise InputError(f"--request {file}: not a parity run request (schema {REQUEST_SCHEMA!r} with a 'run' section)")
  if req.get("derived_from") is not None:
    raise InputError(f"--request {file}: the request of a rerun (derived from {req['derived_from']}); pass the run "
                     "folder's own request.json")
  if req.get("join") is not None:
    raise InputError(f"--request {file}: the request of a joined folder (`parity join`); pass the request.json of "
                     "one of the folders it joined")
  folder = file.parent
  for name in ("init.safetensors", "batches.npy"):
    if not (folder / name).is_file():
      raise InputError(f"--request {file}: {folder / name} is missing; a run from a request trains on that folder's "
                       "own weights and batches (copy the whole run folder, not request.json alone)")
  _check_recorded(folder)
  return folder, req


def _check_recorded(folder: Path) -> None:
  """Refuses an input file of a finished folder whose sha256 is not what its report.json recorded (InputError)."""
  try:
    arts = json.loads((folder / "report.json").read_text()).get("artifacts") or {}
  except (OSError, ValueError, AttributeError):
    return  # not finished yet (or no report): the inputs are copied as they are; `parity join` checks them
  for name in REQUEST_INPUTS:
    rec, p = arts.get(name), folder / name
    if isinstance(rec, dict) and "sha256" in rec and p.is_file() and sha256_of(p) != rec["sha256"]:
      raise InputError(f"--request: {p} changed after its run (its report.json records sha256 {rec['sha256'][:12]}.., "
                       f"the file has {sha256_of(p)[:12]}..); a run from a request must train on what that run did: "
                       "restore the file or rerun that folder")


def _preset_of(folder: Path, req: dict[str, Any]) -> str | None:
  """The preset the request's run was built on: its own 'preset', else its report.json's; None when neither is a
  preset (resolve_run then takes its default: the request's 'run' holds the whole spec either way)."""
  name = req.get("preset")
  if name is None:
    try:
      name = json.loads((folder / "report.json").read_text()).get("preset")
    except (OSError, ValueError, AttributeError):
      name = None
  return name if name in PRESETS else None


def resolve_request(path: str | Path, *, sides: list[str] | None = None) -> ResolvedRun:
  """The ResolvedRun of `--request PATH`: the request's run, with `sides` (default: the request's own), that takes
  its inputs from the request's folder (ResolvedRun.inputs_from; the module docstring says what is taken from where).

  Raises:
    InputError: as read_request. SpecError: the run cannot be rebuilt as the request recorded it (its config_hash
      differs), the sides are not valid, or its DeepSpeed config is not in the folder.
  """
  folder, req = read_request(path)
  file = folder / "request.json"
  ds = None
  if req.get("deepspeed_files"):
    ds = folder / DS_GIVEN
    if not ds.is_file():
      raise InputError(f"--request {file}: the run ran a DeepSpeed config, and {ds} (its byte copy) is missing")
  run_map = {k: v for k, v in req["run"].items() if k != "preset"}
  try:
    run = resolve_run(_preset_of(folder, req), config=run_map, sides=sides,
                      deepspeed_config=str(ds) if ds is not None else None)
  except SpecError as exc:
    raise SpecError(f"--request {file}: {exc}") from None
  same = dataclasses.replace(run.spec, sides=tuple(req["run"].get("sides") or ()))
  if config_hash(same) != req.get("config_hash"):
    raise SpecError(f"--request {file}: its run does not rebuild as it was recorded (config_hash "
                    f"{req.get('config_hash')!r}, rebuilt {config_hash(same)!r}): written by another parity version, "
                    "or edited; run both sides from one version's request")
  checkpoint = (req.get("inputs") or {}).get("checkpoint")
  return dataclasses.replace(run, inputs_from=str(folder.absolute()), init_source=checkpoint, sides_named=True)


def copy_inputs(run_dir: Path, source: Path, perturb: dict, write_new: Callable[[Path, Any], None], *,
                world: int = 1) -> tuple[dict, Any, Any, dict]:
  """Copies the input files of the request folder `source` (REQUEST_INPUTS it holds) into `run_dir` as new files,
  byte for byte (parity.pipeline.folder.write_new), and checks this run's planted data bugs on the copied example
  arrays for `world` ranks per side (parity.pipeline.plants.check_plants_on_data: a plant these batches hide is
  refused).

  Returns:
    (data_info, inputs, examples: the source request's records, which describe the copied files; request_from:
     {request, run_id, config_hash, sha256 of its request.json, files {name: sha256}}).
  Raises:
    InputError: the source's request.json cannot be read; RunFolderError/RunIOError: as write_new.
  """
  req = load_json(source / "request.json", what="request")
  files = {}
  for name in REQUEST_INPUTS:
    src = source / name
    if not src.is_file():
      continue
    write_new(run_dir / name, lambda f, s=src: _copy_into(s, f))
    files[name] = sha256_of(run_dir / name)
  if req.get("examples"):
    check_plants_on_data(perturb, np.load(run_dir / EXAMPLE_ARRAYS["loss_mask"]),
                         np.load(run_dir / EXAMPLE_ARRAYS["segment_ids"]), world=world)
  origin = {"request": str((source / "request.json").absolute()), "run_id": req.get("run_id"),
            "config_hash": req.get("config_hash"), "sha256": sha256_of(source / "request.json"), "files": files}
  return req.get("data"), req.get("inputs"), req.get("examples"), origin


def _copy_into(src: Path, f) -> None:
  with open(src, "rb") as s:
    while block := s.read(8 * 2**20):
      f.write(block)
