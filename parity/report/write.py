"""Writing a run's report files: report.json, report.html, report.md with its PNG plots, card.json, metrics.jsonl."""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

from parity.report.build import Report
from parity.report.card import make_card
from parity.report.markdown import PLOT_ALT, PLOT_FILES, report_markdown
from parity.report.page import read_environment, report_figures, report_html

__all__ = ["write_all", "write_markdown", "write_plot", "write_html", "write_card", "atomic_write"]


def write_markdown(report: Report, path: Path, plots: dict[str, tuple[str, str]] | None = None) -> None:
  """report.md at `path`. plots: figure key -> (PNG file name beside it, caption); None: every PLOT_FILES file that
  exists beside `path`."""
  if plots is None:
    plots = {k: (f, PLOT_ALT[k]) for k, f in PLOT_FILES.items() if (Path(path).parent / f).exists()}
  Path(path).write_text(report_markdown(report.record, plots, read_environment(report.run_dir)))


def write_plot(report: Report, folder: Path) -> dict[str, tuple[str, str]]:
  """Renders every figure of the report (parity.report.page.report_figures) and writes each as a PNG into `folder`
  (names: parity.report.markdown.PLOT_FILES; each through a temporary file). Returns key -> (inline SVG text,
  caption) for report.html; {} without matplotlib. Raises OSError when a PNG cannot be written."""
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    return {}
  from parity.report.plots import to_png, to_svg  # imports matplotlib, which is optional: only when drawing
  out = {}
  for key, caption, fig in report_figures(report.record):
    svg = to_svg(fig, salt=key, close=False)
    png = to_png(fig)
    atomic_write(Path(folder) / PLOT_FILES[key], lambda p, b=png: p.write_bytes(b))
    out[key] = (svg, caption)
  return out


def write_html(report: Report, path: Path, figures: dict[str, tuple[str, str]]) -> None:
  """report.html at `path`: one self-contained page (parity.report.page.report_html)."""
  Path(path).write_text(report_html(report.record, figures, report.run_dir), encoding="utf-8")


def write_card(report: Report, path: Path) -> None:
  """card.json at `path` (parity.report.card.make_card)."""
  Path(path).write_text(json.dumps(make_card(report.record, report.run_dir), indent=2, default=str) + "\n")


def atomic_write(path: Path, write) -> None:
  """Writes `path` through a temporary file beside it (`.<name>.tmp`, given to `write(tmp_path)`) and a rename: a
  failed write (disk full) never leaves a partial file under the real name, and the temporary file is removed.
  Raises what `write` or the rename raises (OSError for the file system)."""
  tmp = path.with_name(f".{path.name}.tmp")
  try:
    write(tmp)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      tmp.unlink()
    raise


def _metrics(report: Report, path: Path) -> None:
  with open(path, "w") as f:
    for name, s in report.record.sides.items():
      ser = s.series
      for i, step in enumerate(ser["step"]):
        f.write(json.dumps({"side": name, "step": step, **{k: ser[k][i] for k in
                            ("loss", "grad_norm", "lr", "loss_scale", "skipped", "step_time_s", "tokens")}}) + "\n")


def _fallback_dir(report: Report) -> Path:
  rid = (report.record.run_folder.run_id or "")[:8] or time.strftime("%Y%m%d-%H%M%S")
  return Path(tempfile.gettempdir()) / f"parity-report-{Path(report.run_dir).name}-{rid}"


def write_all(report: Report) -> dict[str, Path]:
  """Writes metrics.jsonl (one object per step per side), the PNG plots (loss.png, loss_delta.png, ...; see
  parity.report.markdown.PLOT_FILES), report.html, card.json, report.json and report.md into the run folder.

  Never raises for the file system: each file is written on its own (through a temporary file, so none is left
  half-written); a file that cannot be written (disk full, read-only folder, folder removed) is named in
  `report.data['write_errors']` ([{file, error}]), which makes the exit code 1. When report.json or report.md
  cannot be written in the run folder they are written to a fallback folder under the system's temp dir,
  recorded in `report.data['report_written_to']`; if that fails too, the errors say so.
  Returns:
    name ('json', 'md', 'html', 'card', 'metrics', 'plot:<key>') -> path of each file written.
  """
  rd = Path(report.run_dir)
  errors: list[dict[str, str]] = []
  report.set_write_errors([])  # a re-render (parity report) writes every file anew: only its own errors count
  written: dict[str, Path] = {}

  def attempt(key: str, path: Path, write) -> bool:
    try:
      atomic_write(path, write)
    except OSError as exc:
      errors.append({"file": str(path), "error": exc.strerror or str(exc)})
      return False
    written[key] = path
    return True

  attempt("metrics", rd / "metrics.jsonl", lambda p: _metrics(report, p))
  figures: dict = {}
  try:
    figures = write_plot(report, rd) or {}
    written.update({f"plot:{k}": rd / f for k, f in _plot_files(figures)})
  except OSError as exc:
    errors.append({"file": str(rd / "*.png"), "error": exc.strerror or str(exc)})
  except Exception as exc:  # a figure that cannot be drawn must not lose the report
    errors.append({"file": str(rd / "*.png"), "error": f"could not draw: {type(exc).__name__}: {exc}"})
  for key, name, write in (("html", "report.html", lambda p: write_html(report, p, figures)),
                           ("card", "card.json", lambda p: write_card(report, p))):
    try:
      attempt(key, rd / name, write)
    except Exception as exc:  # (OSError is handled by attempt)
      errors.append({"file": str(rd / name), "error": f"could not render: {type(exc).__name__}: {exc}"})
  for _ in range(2):  # report.json records the errors of every file written before it, itself included on retry
    report.set_write_errors(errors)
    json_ok = attempt("json", rd / "report.json", lambda p: p.write_text(json.dumps(report.data, indent=2)))
    try:
      md_ok = attempt("md", rd / "report.md", lambda p: write_markdown(report, p))
    except Exception as exc:  # a rendering bug: report.json is written; say so, no fallback folder
      errors.append({"file": str(rd / "report.md"), "error": f"could not render: {type(exc).__name__}: {exc}"})
      md_ok = True
    if json_ok and md_ok:
      break
    rd = _fallback_dir(report)
    try:
      rd.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
      errors.append({"file": str(rd), "error": exc.strerror or str(exc)})
      break
    report.set_written_to(rd)
  report.set_write_errors(errors)
  return written


def _plot_files(figures: dict) -> list[tuple[str, str]]:
  return [(k, PLOT_FILES[k]) for k in figures]
