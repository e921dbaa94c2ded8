"""Finished run folders: what a folder lacks to be one (`load_finished` says so), and re-rendering one run's report
files from what it wrote (`rerender_run`, behind `parity report RUN_DIR`)."""
from __future__ import annotations

from pathlib import Path

from parity.inputs import InputError

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
  from parity.protocol.layout import read_steps, read_summary
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
  from parity.report.read import load_report
  why = _what_is_missing(Path(run_dir))
  if why:
    raise InputError(why)
  return load_report(run_dir)


def rerender_run(report) -> tuple[dict[str, Path], list[str], list[str]]:
  """Writes report.html, report.md with its PNG plots and card.json of a loaded run again, from report.json (and
  environment.json/migration.json beside it); report.json itself is left as it is (its verdict and artifact hashes
  are the record).

  Returns (name -> path written, ['file: error' for each file that could not be written (OSError)], ['file: why'
  for each file that could not be rendered: a report.json that lacks what the page shows, e.g. one written by an
  older parity])."""
  from parity.report.write import write_card, write_html, write_markdown, write_plot
  rd = Path(report.run_dir)
  written: dict[str, Path] = {}
  errors: list[str] = []
  unrendered: list[str] = []
  figures: dict = {}
  try:
    figures = write_plot(report, rd) or {}
    from parity.report.markdown import PLOT_FILES
    written.update({f"plot:{k}": rd / PLOT_FILES[k] for k in figures})
  except OSError as exc:
    errors.append(f"{rd}/*.png: {exc.strerror or exc}")
  except (KeyError, TypeError, ValueError, IndexError) as exc:
    unrendered.append(f"plots: report.json lacks {exc}")
  for key, name, write in (("html", "report.html", lambda p: write_html(report, p, figures)),
                           ("card", "card.json", lambda p: write_card(report, p)),
                           ("md", "report.md", lambda p: write_markdown(report, p))):
    try:
      _atomic_write(rd / name, write)
      written[key] = rd / name
    except OSError as exc:
      errors.append(f"{rd / name}: {exc.strerror or exc}")
    except (KeyError, TypeError, ValueError, IndexError) as exc:
      unrendered.append(f"{name}: report.json lacks {type(exc).__name__} {exc}")
  return written, errors, unrendered


def _atomic_write(path: Path, write) -> None:
  """Writes `path` through a temporary file and a rename (never a half-written file under the real name)."""
  import os
  tmp = path.with_name(f".{path.name}.tmp")
  try:
    write(tmp)
    os.replace(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)
