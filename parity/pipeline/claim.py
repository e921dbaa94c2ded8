"""The run folder's claim: fresh, locked while a run writes it, never reused (`claim_run_dir`); parity.pipeline.folder
re-exports these names."""
from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import json
import os
import re
import socket
import sys
import uuid
from pathlib import Path
from typing import Any, Mapping

from parity.protocol.layout import LOCK_NAME, enclosing_run
from parity.spec import SpecError

__all__ = ["claim_run_dir", "RunFolder", "RunFolderError", "RunIOError", "read_lock", "enclosing_run", "LOCK_NAME",
           "RUN_MARKERS", "RUN_INPUTS"]


# ------------------------------------------------------------------ the run folder: fresh, locked, never reused
RUN_MARKERS = ("request.json", "report.json", "config.json", LOCK_NAME)
"""Files whose presence makes a folder a parity run folder (an earlier or a running run)."""
RUN_INPUTS = ("request.json", "config.json", "init.safetensors", "batches.npy", "val_batches.npy",
              "deepspeed_config.given.json", "deepspeed_config.resolved.json",
              "loss_mask.npy", "segment_ids.npy", "positions.npy", "val_loss_mask.npy", "val_segment_ids.npy",
              "val_positions.npy")  # the last six: padded/packed runs (parity.pipeline.examples_input)
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
  it is dead, a stale lock; None: another host, cannot tell). None when there is no lock. A lock that is not a
  parity lock (not JSON, no pid/host: garbage, a truncated write) is {'alive': None, 'unreadable': why}."""
  path = Path(run_dir) / LOCK_NAME
  try:
    info = json.loads(path.read_text())
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as exc:
    return {"alive": None, "unreadable": f"not JSON: {type(exc).__name__}"}
  if not isinstance(info, dict) or not isinstance(info.get("host"), str) or "pid" not in info:
    return {"alive": None, "unreadable": "no pid and host recorded"}
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


def _is_diagnose_folder(path: Path) -> bool:
  """A finished `parity diagnose` folder: its diagnose.json/.md (written at its end)."""
  return (path / "diagnose.json").exists() or (path / "diagnose.md").exists()


def _aside_name(path: Path) -> Path:
  stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
  cand = path.with_name(f"{path.name}.old-{stamp}")
  n = 2
  while cand.exists() or cand.is_symlink():
    cand = path.with_name(f"{path.name}.old-{stamp}-{n}")
    n += 1
  return cand


def _vacate(path: Path, force: bool) -> tuple[Path | None, dict[str, Any] | None]:
  """The checks of `claim_run_dir` on a non-empty folder; returns (where --force moved an earlier run, the dead
  run's lock taken over), each None when not. Raises RunFolderError as claim_run_dir says."""
  moved_to, stale = None, None
  if not (path.is_dir() and any(path.iterdir())):
    return moved_to, stale
  lock = read_lock(path)
  if lock is not None and lock.get("unreadable"):
    raise RunFolderError(f"--out {path}: its lock file {path / LOCK_NAME} cannot be read ({lock['unreadable']}), so "
                         "whether a run is writing this folder is unknown; if none is, remove that file and rerun, "
                         "or choose another --out")
  if lock is not None and lock["alive"] is not False:
    who = "a live run" if lock["alive"] else "a run on another host (its liveness cannot be checked from here)"
    raise RunFolderError(f"--out {path}: in use by {who}: {_describe_lock(lock)}; wait for it to finish or choose "
                         f"another --out" + ("" if lock["alive"] else f" (remove {path / LOCK_NAME} if that run "
                                                                      "is gone)"))
  racers = _claiming(path)
  if racers["alive"]:  # another run is between writing its lock and linking it: it started at the same moment
    raise RunFolderError(f"--out {path}: in use by a run that started at the same moment (pid {racers['alive'][0]}, "
                         "claiming the folder); choose another --out")
  for name in racers["dead"]:  # parity's own leftover, never the user's
    with contextlib.suppress(OSError):
      (path / name).unlink()
  others = [p.name for p in path.iterdir() if p.name != LOCK_NAME]
  if lock is None and not others:
    return moved_to, stale
  if lock is not None and not others:
    stale = lock  # a run that died before writing anything: nothing to keep, take the folder over
  elif not _is_run_folder(path):
    listed = ", ".join(sorted(others)[:3]) + (", ..." if len(others) > 3 else "")
    raise RunFolderError(f"--out {path}: the folder holds files that are not a parity run ({listed}); choose a new "
                         "or empty folder (--force only moves an earlier parity run aside)")
  elif not force:
    what = (f"an interrupted run (stale lock: {_describe_lock(lock)}, no longer running)" if lock is not None else
            "a diagnose run (see its diagnose.md)" if _is_diagnose_folder(path) else
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
  return moved_to, stale


def _make_folders(path: Path) -> list[Path]:
  """Creates `path` and its missing parents; returns those created (removed again on failure: RunIOError)."""
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
  return created


def _claiming(path: Path) -> dict[str, list]:
  """The lock files other runs are writing in `path` (`.parity.lock.<pid>.<id>`, before their atomic link): 'alive'
  the pids still running, 'dead' the file names a run left when it died mid-claim (not the user's files)."""
  out: dict[str, list] = {"alive": [], "dead": []}
  for p in path.iterdir():
    m = re.fullmatch(re.escape(LOCK_NAME) + r"\.(\d+)\.[0-9a-f]{8}", p.name)
    if m is None:
      continue
    pid = int(m.group(1))
    if _proc_start(pid) is not None:  # alive, as read_lock tells a lock's process
      out["alive"].append(pid)
    else:
      out["dead"].append(p.name)
  return out


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
    - '' and paths that exist and are not folders are refused;
    - a folder inside another parity run folder (`enclosing_run`) is refused;
    - a lock that cannot be read (not a parity lock) is refused by name: remove it if no run writes the folder.
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
  path = _check_out_path(run_dir)
  moved_to, stale = _vacate(path, force)
  created = _make_folders(path)
  run_id = uuid.uuid4().hex
  info = _lock_info(command, run_id)
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

def _lock_info(command: str | None, run_id: str) -> dict[str, Any]:
  """What .parity.lock records about this run: pid, host, process start (to tell a reused pid), start time (UTC),
  command line (default sys.argv) and run_id."""
  return {"pid": os.getpid(), "host": socket.gethostname(), "proc_start": _proc_start(os.getpid()),
          "started_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
          "command": command if command is not None else " ".join(sys.argv), "run_id": run_id}


def _check_out_path(run_dir: str | Path) -> Path:
  """`--out` as a Path, refused (RunFolderError) when empty, a dangling link, not a folder, or inside another run."""
  if str(run_dir).strip() == "":
    raise RunFolderError("--out '': an empty path names no folder; give a new folder, e.g. --out runs/try")
  path = Path(run_dir)
  if path.is_symlink() and not path.exists():
    raise RunFolderError(f"--out {path}: a dangling symbolic link; remove it or choose another folder")
  if path.exists() and not path.is_dir():
    raise RunFolderError(f"--out {path}: exists and is not a folder; choose a new folder")
  outer = enclosing_run(path)
  if outer is not None:
    raise RunFolderError(f"--out {path}: inside the parity run folder {outer}, whose files a new run would mix with; "
                         "choose a folder outside it (e.g. next to it)")
  return path
