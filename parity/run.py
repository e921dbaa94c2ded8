"""Resolving a run (preset + config file + overrides) and laying out its run folder."""
from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from parity import weights
from parity.data import Corpus, load_corpus, make_batches
from parity.protocol.layout import DEBUG_KEYS, REQUEST_SCHEMA, parse_debug_value
from parity.spec import RunSpec, SpecError, apply_overrides, config_hash, to_dict

__all__ = ["resolve", "load_config_file", "prepare_run_dir", "default_run_dir", "parse_perturb", "claim_run_dir",
           "RunFolder", "RunFolderError", "RunIOError", "read_lock", "write_new", "LOCK_NAME", "PreparedRun",
           "open_run_folder"]


def load_config_file(path: str | Path) -> dict[str, Any]:
  """Reads a run config: YAML, or JSON as DeepSpeed reads it (comments, trailing commas).

  The readers are parity.migrate's, so run configs and DeepSpeed configs parse alike.
  Raises:
    SpecError: missing file, a syntax error (with file, line and column), or a top level that is not a mapping.
  """
  from parity.migrate._read import PortError, read_deepspeed_config, read_structured
  p = Path(path)
  if not p.exists():
    raise SpecError(f"config file not found: {p}")
  try:
    if p.suffix.lower() in (".json", ".hjson", ".json5"):
      return read_deepspeed_config(p)
    return read_structured(p)
  except PortError as exc:
    raise SpecError(str(exc)) from None


def _merge(base: dict, top: Mapping) -> dict:
  out = dict(base)
  for k, v in top.items():
    out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
  return out


def resolve(preset_name: str | None = None, *, config: str | Path | Mapping | None = None,
            overrides: Mapping[str, Any] | Sequence[str] = (), steps: int | None = None,
            sides: Sequence[str] | None = None, data: str | None = None) -> RunSpec:
  """The RunSpec of `parity.resolve.resolve_run` for a preset, config, flags and overrides (no checkpoint, plan or
  DeepSpeed config): a shorthand for tests and benchmarks.

  Raises:
    SpecError: unknown preset or key, a value of the wrong type or out of range.
  """
  from parity.resolve import resolve_run
  return resolve_run(preset_name, config=config, overrides=overrides, steps=steps, sides=sides, data=data).spec


def _is_path(data: Any) -> bool:
  return isinstance(data, str) and bool(data.strip()) and data != "stdlib"


def _data_relative_to(cfg: dict[str, Any], config: Path) -> dict[str, Any]:
  """A relative `data:` path in a config file names a path next to that file, as users expect (not the cwd).

  Raises:
    DataError: nothing at the resolved path; the message names the folder it was resolved against.
  """
  data = cfg.get("data")
  if not _is_path(data) or Path(data).expanduser().is_absolute():
    return cfg
  where = config.absolute().parent
  resolved = where / data
  if not resolved.exists():
    from parity.data import DataError
    raise DataError(f"{config}: data {data!r} is resolved relative to the config file's folder {where}, and "
                    f"{resolved} does not exist; fix the path (or make it absolute)")
  return {**cfg, "data": str(resolved)}


PERTURBABLE = frozenset({
    "model.norm_eps", "model.gelu_approximate", "model.attn_scale", "model.rope_theta",
    "train.lr", "train.warmup_steps", "train.warmup_min_ratio", "train.cos_min_ratio", "train.lr_schedule",
    "train.lr_schedule_params", "train.beta1", "train.beta2", "train.eps", "train.weight_decay", "train.grad_clip",
    "train.precision", "train.loss_scale", "train.initial_scale_power", "train.loss_scale_window",
    "train.hysteresis", "train.consecutive_hysteresis", "train.min_loss_scale", "train.optimizer", "train.momentum",
    "train.dampening", "train.nesterov", "train.lamb_max_coeff", "train.lamb_min_coeff", "train.eps_inside_sqrt"})
"""Settings one side may change on its own: numerics only. Weights and batches are shared files, so keys that
shape them (seeds, sizes, steps, layer layout) cannot differ per side."""


def parse_perturb(items: Sequence[str], sides: Sequence[str]) -> dict[str, dict[str, Any]]:
  """Parses `--perturb side:key=value` (debug: make one side differ on purpose).

  Keys: `model.<field>` / `train.<field>` (applied to that side's spec only) or one of
  DEBUG_KEYS (nan_at_step, kill_at_step, hang_at_step, raise_at_step: a step; overflow_at_steps: a JSON
  list of steps, e.g. `jax:overflow_at_steps=[3,7]`).
  Raises:
    SpecError: malformed item, unknown side, or unknown key.
  """
  out: dict[str, dict[str, Any]] = {}
  for item in items:
    side, sep, kv = item.partition(":")
    if not sep or "=" not in kv:
      raise SpecError(f"--perturb {item!r} must look like SIDE:KEY=VALUE, e.g. jax:model.norm_eps=1e-3")
    if side not in sides:
      raise SpecError(f"--perturb {item!r}: side {side!r} is not among the sides run ({', '.join(sides)})")
    key, raw = kv.split("=", 1)
    if key not in DEBUG_KEYS and key not in PERTURBABLE:
      hint = (" (it shapes the shared weights or batches, so it cannot differ per side)"
              if key.startswith(("model.", "train.")) else "")
      raise SpecError(f"--perturb {item!r}: {key!r} cannot be perturbed{hint}; use one of "
                      f"{', '.join(sorted(PERTURBABLE))} or {', '.join(DEBUG_KEYS)}")
    from parity.spec import parse_value
    value = parse_value(raw, f"--perturb {item[:60]!r}")  # deep nesting and inf/nan refused as in config files
    if key in DEBUG_KEYS:
      try:
        value = parse_debug_value(key, value)
      except ValueError as exc:
        raise SpecError(f"--perturb {item!r}: {exc}") from None
      value = list(value) if isinstance(value, tuple) else value
    out.setdefault(side, {})[key] = value
  for side, kv in out.items():  # validate overrides now, not inside a worker
    fields = {k: v for k, v in kv.items() if k not in DEBUG_KEYS}
    if fields:
      apply_overrides(RunSpec(), fields).validate()
  return out


def write_new(path: str | Path, data: str | bytes | Callable[[Any], None]) -> None:
  """Writes a file that must not exist yet (O_EXCL): a run's files are never written over an earlier run's.

  Args:
    path: the file.
    data: its text (UTF-8), its bytes, or a function writing to the open binary file.
  Raises:
    RunFolderError: the file exists already.
    RunIOError: it could not be written (disk full, read-only folder, ...); the partial file is removed.
  """
  path = Path(path)
  try:
    f = open(path, "xb")
  except FileExistsError:
    raise RunFolderError(f"{path} exists already (an earlier run's file); a run never writes over or reads another "
                         "run's files: choose a new or empty folder") from None
  except OSError as exc:
    raise RunIOError(exc.errno, f"cannot create {path} ({exc.strerror}); the folder {path.parent} must be writable "
                                "with free space") from None
  try:
    with f:
      if callable(data):
        data(f)
      else:
        f.write(data.encode() if isinstance(data, str) else data)
  except OSError as exc:
    with contextlib.suppress(OSError):
      path.unlink()
    raise RunIOError(exc.errno, f"cannot write {path} ({exc.strerror}); the folder {path.parent} must be writable "
                                "with free space") from None


def default_run_dir(spec: RunSpec, name: str) -> Path:
  stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
  return Path("runs") / f"{stamp}-{name}-{config_hash(spec)[:8]}"


def prepare_run_dir(spec: RunSpec, run_dir: str | Path, *, perturb: Mapping[str, Mapping] | None = None,
                    corpus: Corpus | None = None, init_params: Mapping[str, np.ndarray] | None = None,
                    deepspeed_config: Mapping[str, Any] | None = None, run_id: str | None = None) -> dict[str, Any]:
  """Writes config.json, init.safetensors, batches.npy, val_batches.npy and request.json, each as a new file.

  None of them may exist already (RUN_INPUTS): a run never reads inputs an earlier run left in its folder.
  `parity compare` first claims a fresh, locked folder (`claim_run_dir`); other callers pass a new or empty one.

  Args:
    init_params: canonical initial weights (e.g. from a Hugging Face checkpoint); default: the
      GPT-2 init of `parity.weights.init_params` with train.seed.
    deepspeed_config: a resolved DeepSpeed config the DeepSpeed side must run verbatim
      (`--deepspeed-config`); default: the one built from the spec.
    run_id: this run's id, recorded in request.json (derived requests and side summaries carry it on); default:
      a new one.
  Returns:
    {'request': ..., 'corpus': {source, sha256, tokens}, 'prepare_s': seconds}.
  Raises:
    DataError: the corpus is missing or too small.
    SpecError: the corpus needs a larger vocabulary than the model has; RunFolderError: an input file of an
      earlier run is in the folder.
    RunIOError: a file could not be written (disk full, read-only folder); the message names it.
  """
  t0 = time.time()
  run_dir = Path(run_dir)
  if run_dir.exists() and not run_dir.is_dir():
    raise RunFolderError(f"--out {run_dir}: exists and is not a folder")
  try:
    run_dir.mkdir(parents=True, exist_ok=True)
  except OSError as exc:
    raise RunFolderError(f"--out {run_dir}: cannot create the run folder ({exc.strerror})") from None
  earlier = [n for n in RUN_INPUTS if (run_dir / n).exists() or (run_dir / n).is_symlink()]
  if earlier:
    raise RunFolderError(f"--out {run_dir}: holds {', '.join(earlier)} of an earlier run; a run never reads another "
                         "run's inputs: choose a new or empty folder")
  corpus = corpus or load_corpus(spec.data)
  if corpus.vocab_size > spec.model.vocab_size:
    raise SpecError(f"data {spec.data!r} has token ids up to {corpus.vocab_size - 1}, beyond "
                    f"model.vocab_size={spec.model.vocab_size}; set model.vocab_size >= {corpus.vocab_size}")
  t = spec.train
  train, val = make_batches(corpus, steps=t.steps, grad_accum_steps=t.grad_accum_steps,
                            micro_batch_size=t.micro_batch_size, seq_len=t.seq_len, seed=t.data_seed,
                            eval_batches=t.eval_batches)
  write_new(run_dir / "batches.npy", lambda f: np.save(f, train))
  write_new(run_dir / "val_batches.npy", lambda f: np.save(f, val))
  if init_params is None:
    params, meta = weights.init_params(spec.model, t.seed), {"seed": str(t.seed)}
  else:
    params, meta = dict(init_params), {"source": "given"}
    weights.check_names_and_shapes(params, spec.model, source="initial weights")
  from safetensors.numpy import save as safetensors_bytes
  write_new(run_dir / "init.safetensors", safetensors_bytes(
      {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in params.items()},  # as weights.save writes them
      metadata={**meta, **weights.spec_metadata(spec.model)}))
  data_info = {"source": corpus.source, "sha256": corpus.sha256, "train_tokens": int(corpus.train.size),
               "val_tokens": int(corpus.val.size), "files": corpus.n_files}
  write_new(run_dir / "config.json", json.dumps(to_dict(spec), indent=2))
  request = {"schema": REQUEST_SCHEMA, "run_id": run_id or uuid.uuid4().hex, "run": to_dict(spec),
             "config_hash": config_hash(spec),
             "init_weights": "init.safetensors", "batches": "batches.npy", "val_batches": "val_batches.npy",
             "perturb": {k: dict(v) for k, v in (perturb or {}).items()}, "data": data_info,
             "deepspeed_config": dict(deepspeed_config) if deepspeed_config is not None else None}
  write_new(run_dir / "request.json", json.dumps(request, indent=2))  # last: a folder with it is complete
  return {"request": request, "corpus": data_info, "prepare_s": time.time() - t0}


@dataclasses.dataclass(frozen=True)
class PreparedRun:
  """A claimed run folder with the run's inputs written (`open_run_folder`).

  Attributes: path (the folder), claim (its RunFolder lock: release it when the run ends), data_info (the corpus:
  source, sha256, token counts), prepare_s (seconds spent writing the inputs), init (the run's own initial weights,
  canonical name -> float32 array, read back once from init.safetensors).
  """
  path: Path
  claim: "RunFolder"
  data_info: dict[str, Any]
  prepare_s: float
  init: dict[str, np.ndarray]


def open_run_folder(run: Any, out: str | Path | None, perturb: Mapping[str, Mapping], *, force: bool = False,
                    command: str | None = None) -> PreparedRun:
  """Claims the run folder of a resolved run (parity.resolve.ResolvedRun) and writes its inputs.

  Sizes that cannot fit are refused before any folder or array exists (parity.inputs.check_resources); then the
  folder is claimed (`claim_run_dir`: `out`, default runs/<time>-<preset>-<hash>), the inputs written
  (`prepare_run_dir`; with a DeepSpeed config also migration.json/.md) and init.safetensors read back.
  Raises:
    SpecError, DataError, RunFolderError, RunIOError: as those functions; nothing of this run is left behind.
  """
  from parity.inputs import check_resources
  folder = Path(out) if out is not None else default_run_dir(run.spec, run.preset)
  check_resources(run.spec, folder)
  claim = claim_run_dir(out if out is not None else folder, force=force, command=command)  # '' refused, not '.'
  try:
    ds_cfg = dict(run.deepspeed_config) if run.deepspeed_config is not None and run.port is not None else None
    prep = prepare_run_dir(run.spec, folder, perturb=perturb, init_params=run.init_params, deepspeed_config=ds_cfg,
                           run_id=claim.run_id)
    if run.port is not None:
      write_new(folder / "migration.json", run.port.report.to_json())
      write_new(folder / "migration.md", run.port.report.to_markdown())
    init = weights.load(folder / "init.safetensors")  # the run's own, read once, before any side can touch it
  except BaseException:  # refused or failed before any side started: leave nothing of this run behind
    claim.abandon()
    raise
  return PreparedRun(path=folder, claim=claim, data_info=prep["corpus"], prepare_s=prep["prepare_s"], init=init)


# ------------------------------------------------------------------ the run folder: fresh, locked, never reused
LOCK_NAME = ".parity.lock"
"""The lock file of a run folder being written (JSON: pid, host, proc_start, started_utc, command, run_id)."""
RUN_MARKERS = ("request.json", "report.json", "config.json", LOCK_NAME)
"""Files whose presence makes a folder a parity run folder (an earlier or a running run)."""
RUN_INPUTS = ("request.json", "config.json", "init.safetensors", "batches.npy", "val_batches.npy")
"""The files `prepare_run_dir` writes; it never overwrites one (a run never reads an earlier run's inputs)."""


class RunFolderError(SpecError):
  """The run folder cannot be used as asked (exists with a run in it, locked by a live run, not a folder, empty
  name); the message names the folder and the fix. A SpecError: the CLI exits 2, before anything is written."""


class RunIOError(OSError):
  """A file of the run could not be written or read (disk full, read-only folder, a file removed while running);
  the message names the file. The CLI exits 1: the run was attempted and did not produce a trustworthy result."""

  def __str__(self) -> str:
    return str(self.strerror if self.strerror is not None else super().__str__())


def _proc_start(pid: int) -> str | None:
  """The kernel's start time of `pid` (clock ticks since boot, /proc/<pid>/stat field 22); None if unknown."""
  try:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def read_lock(run_dir: str | Path) -> dict[str, Any] | None:
  """The lock of a run folder: its JSON plus 'alive' (True: the locking process still runs on this host; False:
  it is dead, a stale lock; None: another host, cannot tell). None when there is no lock."""
  path = Path(run_dir) / LOCK_NAME
  try:
    info = json.loads(path.read_text())
  except FileNotFoundError:
    return None
  except (OSError, ValueError):
    info = {}
  if not isinstance(info, dict):
    info = {}
  pid = info.get("pid")
  if info.get("host") != socket.gethostname():
    alive = None
  elif not isinstance(pid, int) or pid <= 0:
    alive = False
  else:
    start = _proc_start(pid)  # a live pid with another start time is a reused pid: the locker is dead
    alive = start is not None and (info.get("proc_start") in (None, start))
  return {**info, "alive": alive}


def _describe_lock(info: Mapping[str, Any]) -> str:
  return (f"pid {info.get('pid', '?')} on {info.get('host', '?')}, started {info.get('started_utc', '?')}, "
          f"command: {info.get('command', '?')}")


@dataclasses.dataclass
class RunFolder:
  """A run folder claimed by this process (`claim_run_dir`).

  Attributes:
    path: the folder.
    run_id: this run's id (32 hex chars): request.json, every derived request and every side's summary.json carry
      it, and a file that carries another id is not read as this run's.
    moved_to: where --force moved the earlier run, or None.
    stale_lock: the dead run's lock that was taken over, or None.
    created: folders this claim created (deepest last); removed again by `abandon` when they are left empty.
  """
  path: Path
  run_id: str
  moved_to: Path | None = None
  stale_lock: dict[str, Any] | None = None
  created: list[Path] = dataclasses.field(default_factory=list)

  def release(self) -> None:
    """Removes the lock if it is still this run's (never another run's)."""
    info = read_lock(self.path)
    if info is not None and info.get("run_id") == self.run_id:
      with contextlib.suppress(OSError):
        (self.path / LOCK_NAME).unlink()

  def abandon(self) -> None:
    """Undoes the claim of a run refused before it started: removes the files `prepare_run_dir` wrote for this run
    (only its named inputs, and only while this run holds the lock of the folder, which was fresh when locked), the
    lock, and the folders the claim created if they are left empty. Nothing else is touched."""
    lock = read_lock(self.path)  # the folder was fresh when locked: while the lock is ours, so are these files
    if lock is not None and lock.get("run_id") == self.run_id:
      for name in (*RUN_INPUTS, "migration.json", "migration.md"):
        with contextlib.suppress(OSError):
          (self.path / name).unlink()
    self.release()
    for folder in reversed(self.created):
      with contextlib.suppress(OSError):
        folder.rmdir()  # only succeeds when empty


def _is_run_folder(path: Path) -> bool:
  return any((path / m).exists() for m in RUN_MARKERS)


def _aside_name(path: Path) -> Path:
  stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
  cand = path.with_name(f"{path.name}.old-{stamp}")
  n = 2
  while cand.exists() or cand.is_symlink():
    cand = path.with_name(f"{path.name}.old-{stamp}-{n}")
    n += 1
  return cand


def claim_run_dir(run_dir: str | Path, *, force: bool = False, command: str | None = None) -> RunFolder:
  """Claims a fresh run folder for one run, under a lock no other run can take while this one lives.

  Rules (every run reads only files it wrote itself):
    - a new or empty folder is used; the lock `.parity.lock` is created atomically (link(2) of a complete file,
      which fails if the lock exists), so of two runs started at once exactly one gets the folder;
    - a folder locked by a live run is refused, naming that run (pid, host, start time, command), --force or not;
    - a folder holding an earlier parity run (finished, or interrupted: its lock's pid is dead) is refused; with
      `force` it is moved aside whole to `<name>.old-<time>` (never mixed, never deleted) and a fresh one made;
    - a folder that only holds a dead run's lock is taken over (`stale_lock` says whose);
    - a non-empty folder that is not a parity run is refused, --force or not (nothing of the user's is moved);
    - '' and paths that exist and are not folders are refused.
  Args:
    run_dir: the folder (`--out`).
    force: move an earlier run found there aside.
    command: the command line recorded in the lock (default: sys.argv).
  Returns:
    The RunFolder; call `release()` when the run ends (or `abandon()` if it was refused before starting).
  Raises:
    RunFolderError: any refusal above (exit 2).
    RunIOError: the folder or its lock cannot be written (read-only, disk full; exit 1); nothing is left behind.
  """
  if str(run_dir).strip() == "":
    raise RunFolderError("--out '': an empty path names no folder; give a new folder, e.g. --out runs/try")
  path = Path(run_dir)
  if path.is_symlink() and not path.exists():
    raise RunFolderError(f"--out {path}: a dangling symbolic link; remove it or choose another folder")
  if path.exists() and not path.is_dir():
    raise RunFolderError(f"--out {path}: exists and is not a folder; choose a new folder")
  moved_to, stale = None, None
  if path.is_dir() and any(path.iterdir()):
    lock = read_lock(path)
    if lock is not None and lock["alive"] is not False:
      who = "a live run" if lock["alive"] else "a run on another host (its liveness cannot be checked from here)"
      raise RunFolderError(f"--out {path}: in use by {who}: {_describe_lock(lock)}; wait for it to finish or choose "
                           f"another --out" + ("" if lock["alive"] else f" (remove {path / LOCK_NAME} if that run "
                                                                        "is gone)"))
    others = [p.name for p in path.iterdir() if p.name != LOCK_NAME]
    if lock is not None and not others:
      stale = lock  # a run that died before writing anything: nothing to keep, take the folder over
    elif not _is_run_folder(path):
      listed = ", ".join(sorted(others)[:3]) + (", ..." if len(others) > 3 else "")
      raise RunFolderError(f"--out {path}: the folder holds files that are not a parity run ({listed}); choose a new "
                           "or empty folder (--force only moves an earlier parity run aside)")
    elif not force:
      what = (f"an interrupted run (stale lock: {_describe_lock(lock)}, no longer running)" if lock is not None else
              "a finished run" if (path / "report.json").exists() else "an earlier run (no report: it did not finish)")
      raise RunFolderError(f"--out {path}: the folder holds {what}; a new run never reuses its files. Choose a new "
                           f"--out, or pass --force to move the old run aside to {path.name}.old-<time>")
    else:
      if Path.cwd().resolve().is_relative_to(path.resolve()):
        raise RunFolderError(f"--out {path}: --force cannot move the current directory aside; run from elsewhere")
      moved_to = _aside_name(path)
      try:
        os.rename(path, moved_to)
      except OSError as exc:
        raise RunFolderError(f"--out {path}: --force could not move the earlier run aside to {moved_to} "
                             f"({exc.strerror}); move it yourself or choose another --out") from None
  created = []
  for folder in reversed([path, *path.parents]):
    if folder.exists() or str(folder) in ("", "."):
      continue
    try:
      folder.mkdir()
      created.append(folder)
    except FileExistsError:
      pass
    except OSError as exc:
      for f in reversed(created):
        with contextlib.suppress(OSError):
          f.rmdir()
      raise RunIOError(exc.errno, f"--out {path}: cannot create {folder} ({exc.strerror}); nothing was written: "
                                  "choose a writable place with free space") from None
  run_id = uuid.uuid4().hex
  info = {"pid": os.getpid(), "host": socket.gethostname(), "proc_start": _proc_start(os.getpid()),
          "started_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
          "command": command if command is not None else " ".join(sys.argv), "run_id": run_id}
  claim = RunFolder(path=path, run_id=run_id, moved_to=moved_to, stale_lock=stale, created=created)
  tmp = path / f"{LOCK_NAME}.{os.getpid()}.{run_id[:8]}"
  try:
    tmp.write_text(json.dumps(info, indent=2))
    if stale is not None:
      os.replace(tmp, path / LOCK_NAME)  # nobody else holds it: the dead run's lock becomes ours
    else:
      os.link(tmp, path / LOCK_NAME)  # atomic: fails when another run holds the lock
  except FileExistsError:
    lock = read_lock(path) or {}
    with contextlib.suppress(OSError):
      tmp.unlink()
    claim.abandon()
    raise RunFolderError(f"--out {path}: in use by a run that started at the same moment: {_describe_lock(lock)}; "
                         "choose another --out") from None
  except OSError as exc:
    with contextlib.suppress(OSError):
      tmp.unlink()
    claim.abandon()
    raise RunIOError(exc.errno, f"--out {path}: cannot write the lock {path / LOCK_NAME} ({exc.strerror}); nothing "
                                "was written: choose a writable folder with free space") from None
  finally:
    with contextlib.suppress(OSError):
      tmp.unlink()
  leftover = [m for m in RUN_MARKERS if m != LOCK_NAME and (path / m).exists()]
  if leftover:  # a run that finished (and released its lock) between our check and our lock
    claim.release()
    raise RunFolderError(f"--out {path}: another run wrote {', '.join(sorted(leftover)[:3])} while this one was "
                         "claiming the folder; choose another --out")
  return claim
