"""Finished run folders: what a folder lacks to be one (`load_finished` says so), and re-rendering one run's report
files from what it wrote (`rerender_run`, behind `parity report RUN_DIR`)."""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from parity.inputs import InputError
from parity.protocol.layout import read_steps, read_summary
from parity.report.markdown import PLOT_FILES
from parity.report.read import load_report
from parity.report.write import atomic_write, write_card, write_html, write_markdown, write_plot

__all__ = ["load_finished", "changed_since_written", "rerender_run", "RENDER_RECORD", "WRITE_SLACK_S"]


def _what_is_missing(run_dir: Path) -> str | None:
  """Why `run_dir` is not a finished run, naming what it lacks; None when report.json is there (load_report then
  checks its contents) or the folder does not exist (load_report says so)."""
  if not run_dir.is_dir() or (run_dir / "report.json").exists():
    return None
  if any((run_dir / n).exists() for n in ("diagnose.md", "diagnose.json")):
    return None  # load_report names a diagnose folder
  if not (run_dir / "request.json").exists():
    return (f"{run_dir} is not a parity run folder: it has neither report.json nor request.json (pass a folder "
            "written by `parity compare`)")
  sides = []
  for d in sorted(p for p in run_dir.iterdir() if p.is_dir() and (p / "steps.jsonl").exists()):
    summ = read_summary(d / "summary.json")
    sides.append(f"{d.name}: {len(read_steps(d / 'steps.jsonl'))} steps recorded, "
                 + (f"status {summ.get('status')}" if summ else "no summary.json"))
  lock = " (.parity.lock is there: a run is writing it, or was killed)" if (run_dir / ".parity.lock").exists() else ""
  return (f"{run_dir} is an unfinished run{lock}: report.json is missing (the comparison never got to write it); "
          f"{'; '.join(sides) or 'no side wrote steps.jsonl'}. Rerun the comparison for a report")


def load_finished(run_dir: str | Path):
  """parity.report.read.load_report, with a folder that is not a finished run explained: what it lacks (no
  report.json: an unfinished run's sides and their steps, or not a run folder at all).
  Raises InputError (exit 2)."""
  why = _what_is_missing(Path(run_dir))
  if why:
    raise InputError(why)
  return load_report(run_dir)


RENDER_RECORD = ".parity-rendered.json"
"""Run-folder file: {'report_json_mtime_ns': int, 'files': {name: sha256 hex}} of the files the last `parity report`
re-render wrote, so the next one can tell a file a user edited from its own."""
WRITE_SLACK_S = 30.0
"""Seconds after report.json within which `parity compare` writes its other report files (report.md comes right
after report.json; a busy machine can take seconds): a file changed later than that, with no re-render record, was
changed by someone else."""


def _sha256(path: Path) -> str:
  return hashlib.sha256(path.read_bytes()).hexdigest()


def changed_since_written(rd: Path, names) -> list[str]:
  """The names (relative to run folder `rd`) of existing files that parity did not leave as they are: hash differs
  from RENDER_RECORD's (when that record belongs to this report.json), else modified more than WRITE_SLACK_S
  after report.json. A missing file is not changed."""
  rj = (rd / "report.json").stat()
  try:
    rec = json.loads((rd / RENDER_RECORD).read_text())
    files = rec["files"] if rec.get("report_json_mtime_ns") == rj.st_mtime_ns else {}
  except (OSError, ValueError, KeyError, TypeError):
    files = {}
  out = []
  for name in names:
    p = rd / name
    if p.is_file() and (_sha256(p) != files[name] if name in files else
                        p.stat().st_mtime > rj.st_mtime + WRITE_SLACK_S):
      out.append(name)
  return out


def rerender_run(report, force: bool = False) -> tuple[dict[str, Path], list[str], list[str]]:
  """Writes report.html, report.md with its PNG plots and card.json of a loaded run again, from report.json (and
  environment.json/migration.json beside it); report.json itself is left as it is (its verdict and artifact hashes
  are the record). A file changed since parity wrote it (changed_since_written) is kept unless `force`.

  Returns (name -> path written, ['file: error' for each file that could not be written (OSError)], ['file: why'
  for each file not re-rendered: kept as the user changed it, or one that could not be rendered: a report.json
  that lacks what the page shows, e.g. one written by an older parity])."""
  rd = Path(report.run_dir)
  kept = [] if force else changed_since_written(rd, ["report.html", "card.json", "report.md", *PLOT_FILES.values()])
  written: dict[str, Path] = {}
  errors: list[str] = []
  unrendered = [f"{n}: kept, changed since parity wrote it (--force replaces it)" for n in kept]
  figures: dict = {}
  try:
    with tempfile.TemporaryDirectory(dir=rd, prefix=".plots-") as tmp:  # plots drawn aside, moved in unless kept
      figures = write_plot(report, Path(tmp)) or {}
      for k in figures:
        if PLOT_FILES[k] not in kept:
          shutil.move(str(Path(tmp) / PLOT_FILES[k]), rd / PLOT_FILES[k])
          written[f"plot:{k}"] = rd / PLOT_FILES[k]
  except OSError as exc:
    errors.append(f"{rd}/*.png: {exc.strerror or exc}")
  except (KeyError, TypeError, ValueError, IndexError) as exc:
    unrendered.append(f"plots: report.json lacks {exc}")
  for key, name, write in (("html", "report.html", lambda p: write_html(report, p, figures)),
                           ("card", "card.json", lambda p: write_card(report, p)),
                           ("md", "report.md", lambda p: write_markdown(report, p))):
    if name in kept:
      continue
    try:
      atomic_write(rd / name, write)
      written[key] = rd / name
    except OSError as exc:
      errors.append(f"{rd / name}: {exc.strerror or exc}")
    except (KeyError, TypeError, ValueError, IndexError) as exc:
      unrendered.append(f"{name}: report.json lacks {type(exc).__name__} {exc}")
  try:  # what this re-render wrote, so the next one can tell a user's edit from it
    mine = {p.name: _sha256(p) for p in written.values()}
    atomic_write(rd / RENDER_RECORD, lambda p: p.write_text(json.dumps(
        {"report_json_mtime_ns": (rd / "report.json").stat().st_mtime_ns, "files": mine})))
  except OSError as exc:
    errors.append(f"{rd / RENDER_RECORD}: {exc.strerror or exc}")
  return written, errors, unrendered
