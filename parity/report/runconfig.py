"""What a run's configuration is, as dotted keys two runs can be compared on: the resolved spec, how it was launched
(nproc, perturbations) and a digest of its inputs; which sides proved bit-for-bit reproducible; a digest of each
side's final weights. A leaf of parity.report: the comparison page (parity.history.comparison), the card
(parity.report.card) and the regression gate (parity.history.gate, parity.history.snapshot) read it alike."""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from parity.report.build import EXAMPLE_ARTIFACTS
from parity.report.run_record import RunRecord
from parity.spec import with_later_defaults

__all__ = ["flatten", "config_diff", "run_as_compared", "launch_config", "gate_config", "proven_deterministic",
           "final_digests",
           "tensor_digest", "thread_settings", "VOLATILE_KEYS", "INPUT_FILES", "THREAD_KEYS"]

VOLATILE_KEYS = ("data.path", "timeout_s", "sides")
"""Spec keys the configuration gate leaves out: where the data file lay, how long a side may run, and which sides ran
(each baseline side is gated on its own: a side the new run lacks fails, one it adds is named). None of them changes
what a side computes."""
INPUT_FILES = ("init.safetensors", "batches.npy", "val_batches.npy", *EXAMPLE_ARTIFACTS)
"""The run's inputs, compared as part of the configuration (the same spec on other data or another initialisation is
another run; a padded/packed run's example arrays too, parity.report.build.EXAMPLE_ARTIFACTS): the .npy files by
their sha256 (report.json `artifacts`), init.safetensors by `tensor_digest` (its file bytes are not reproducible, see
there)."""
THREAD_KEYS = ("torch_num_threads", "torch_interop_threads", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "XLA_FLAGS")
"""The fields of a side's summary `threads` record (torch_impl.doctor.thread_settings; XLA_FLAGS where a side records
it) that can change its bits: the intra-op thread count sets how torch splits a float sum (harness.env.choose_threads),
inter-op threads how ops overlap, the variables what each pool starts with, XLA_FLAGS XLA's CPU thread pool. The
wait policy (OMP_WAIT_POLICY) and who set a variable change no bit and are left out."""


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
  """{'train': {'lr': 1e-3}} -> {'train.lr': 1e-3}; lists and scalars are leaves."""
  if not isinstance(d, dict):
    return {prefix: d}
  out: dict[str, Any] = {}
  for k, v in d.items():
    key = f"{prefix}.{k}" if prefix else str(k)
    out.update(flatten(v, key) if isinstance(v, dict) else {key: v})
  return out


def config_diff(base: dict[str, Any], new: dict[str, Any], missing: Any = None) -> dict[str, tuple[Any, Any]]:
  """Dotted key -> (base value, new value) for every key whose value differs (an absent key counts as None, so a key a
  newer spec adds with a null default is no difference; a key missing on one side shows `missing` there: None unless
  told, so pass a sentinel to tell an absent key from a null value). Both arguments are flat (see `flatten`)."""
  return {k: (base.get(k, missing), new.get(k, missing)) for k in sorted(set(base) | set(new))
          if base.get(k) != new.get(k)}


def launch_config(run_dir: str | Path) -> dict[str, Any]:
  """How a run was launched beyond its spec, as dotted keys to compare like the spec's: 'nproc' (ranks per side,
  launch.json; 1 when absent) and 'perturb.<side>.<key>' (request.json's per-side --perturb changes, which make
  the sides differ on purpose). A file that cannot be read adds nothing."""
  out: dict[str, Any] = {}
  try:
    launch = json.loads((Path(run_dir) / "launch.json").read_text(encoding="utf-8"))
    out["nproc"] = launch.get("nproc", 1) if isinstance(launch, dict) else 1
  except FileNotFoundError:
    out["nproc"] = 1
  except (OSError, ValueError):
    pass
  try:
    pert = json.loads((Path(run_dir) / "request.json").read_text(encoding="utf-8")).get("perturb")
  except (OSError, ValueError, AttributeError):
    pert = None
  if isinstance(pert, dict) and pert:
    out.update(flatten(pert, "perturb"))
  return out


def run_as_compared(run: Any) -> Any:
  """report.json's `run` (a RunSpec as a dict) with the fields added later that it lacks filled with their defaults
  (parity.spec.LATER_FIELDS: the train layout keys, the model family keys, deepspeed.cpu_checkpointing, the fsdp
  section): a run written before those keys existed and one written after that leaves them alone are the same
  configuration, and against a run that changes one of them only that key differs (a baseline without an fsdp
  section against a run with fsdp.activation_checkpointing=true: one difference, not the whole section)."""
  return with_later_defaults(run) if isinstance(run, dict) else run


def gate_config(rec: RunRecord, run_dir: str | Path | None) -> dict[str, Any]:
  """What the configuration gate compares of a run (its report.json, `rec`): the resolved run spec as dotted keys (less
  VOLATILE_KEYS), how it was launched (`launch_config`: nproc, perturb.<side>.<key>) and a digest (hex) of each
  input file as `input.<file>` (INPUT_FILES), and of a --deepspeed-config run's DeepSpeed JSON (given and
  resolved copies, report.json deepspeed_files) as `input.deepspeed_config.<given|resolved>`. What is read from
  `run_dir` (launch.json, request.json, init.safetensors) is skipped when it is None; a file that cannot be read adds
  no key."""
  out = {k: v for k, v in flatten(run_as_compared(dict(rec.run.json))).items() if k not in VOLATILE_KEYS}
  for f in INPUT_FILES:
    if f.endswith(".safetensors"):
      digest = tensor_digest(Path(run_dir) / f) if run_dir is not None else None
    else:
      art = rec.artifact(f)
      digest = art.get("sha256") if isinstance(art, dict) else None
    if digest:
      out[f"input.{f}"] = digest
  for role, file in sorted(rec.deepspeed_files.items()):
    if isinstance(file, dict) and file.get("sha256"):  # the DeepSpeed JSON itself: keys the spec does not model
      out[f"input.deepspeed_config.{role}"] = file["sha256"]  # (bucket sizes, ZeRO tuning) can change that side
  if run_dir is not None:
    out.update(launch_config(run_dir))
  return out


def proven_deterministic(rec: RunRecord) -> dict[str, int]:
  """side -> steps checked, for each side whose determinism rerun (report.json `determinism`: the side's first steps
  again in a new process) was bit-identical; a side whose rerun differed or did not run is absent."""
  return {s: int(v.steps_checked) for s, v in rec.determinism.items()
          if v.deterministic is True and isinstance(v.steps_checked, int) and v.steps_checked > 0}


def final_digests(rec: RunRecord, run_dir: str | Path | None) -> dict[str, str]:
  """side -> tensor_digest of <run_dir>/<side>/final.safetensors (sides without a readable one are absent)."""
  if run_dir is None:
    return {}
  out = {}
  for s in rec.sides:
    digest = tensor_digest(Path(run_dir) / str(s) / "final.safetensors")
    if digest:
      out[str(s)] = digest
  return out


def thread_settings(rec: RunRecord) -> dict[str, dict[str, str | None]]:
  """side -> its thread settings (THREAD_KEYS it recorded, values as text, None: unset) of a run: each side's summary
  `threads` record (the torch-stack sides write one, torch_impl.doctor.thread_settings; a run written before they did
  has none). A side that recorded no `threads` mapping is absent."""
  out = {}
  for s, side in rec.sides.items():
    t = side.summary.get("threads")
    if isinstance(t, dict):
      out[str(s)] = {k: None if t[k] is None else str(t[k]) for k in THREAD_KEYS if k in t}
  return out


def tensor_digest(path: str | Path) -> str | None:
  """sha256 (hex) of the tensors a safetensors file holds: its header's tensor entries (name, dtype, shape, offsets;
  keys sorted), then its data bytes. The `__metadata__` map is left out: it repeats the model spec (compared by the
  configuration gate) and safetensors writes it in no fixed order, so two bit-identical runs' files can differ in
  sha256 (measured: {'seed', 'parity_model_spec'} in either order). None when the file is missing or is not a
  safetensors file. Reads the whole file (in 8 MiB blocks)."""
  h = hashlib.sha256()
  try:
    with open(path, "rb") as f:
      n = struct.unpack("<Q", f.read(8))[0]
      header = json.loads(f.read(n))
      header = {k: v for k, v in header.items() if k != "__metadata__"} if isinstance(header, dict) else header
      h.update(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())
      for block in iter(lambda: f.read(1 << 23), b""):
        h.update(block)
  except (OSError, ValueError, struct.error):
    return None
  return h.hexdigest()
