"""`parity report A B C`: one comparison page over several finished runs.

A sweep over plans or model sizes, or the same comparison before and after an upgrade: each run folder is read back
(parity.report.read.load_report, checked by verify_report) and reduced to its key figures (`RunFigures`): verdict,
max |Δloss| per pair, tokens/s, median step time and peak memory per side, plan, precision, preset, versions and
what of its configuration differs from the first run. `write_comparison` writes comparison.md (GFM tables, PNG
plots beside it) and comparison.html (one self-contained file) with one plot per metric across the runs.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

from parity.history.gate import read_gate
from parity.inputs import InputError
from parity.protocol.layout import enclosing_run
from parity.report import html as H
from parity.report.finished import load_finished
from parity.report.headline import model_label
from parity.report.markdown import md_table, md_text
from parity.report.read import finite_number, peak_load, verify_report
from parity.report.run_record import RunRecord, SideRecord
from parity.report.runconfig import config_diff, flatten, launch_config
from parity.side_plans import describe_plans
from parity.report.write import atomic_write
from parity.report.plots import across_runs_figure, line_figure, to_png, to_svg  # imports matplotlib: only when drawing

__all__ = ["RunFigures", "load_runs", "run_figures", "side_figures", "METRICS", "metric_values", "gate_failures",
           "comparison_figures", "comparison_markdown", "comparison_html", "write_comparison", "COLUMNS"]


@dataclasses.dataclass
class RunFigures:
  """The key figures of one finished run (units in the names; None: not measured, e.g. a side that crashed).

  Attributes:
    label: a short unique name for the run (its folder name; the parent folder is added when two names clash).
    run_dir: the run folder. preset, precision, plan: as the run was resolved (plan: the pair's name, else a short
      description of each side's settings). sides: side names, reference first. steps: train.steps.
    passed, verdict: the stored verdict (passed flag and its one-line message).
    max_dloss: 'a~b' -> max |loss_a - loss_b| over the steps both ran (the `loss` check's value; nats).
    loss_tolerance: the loss check's tolerance (nats) of the run's precision.
    per_side: side -> {status, tokens_per_s, step_time_s_median, peak_rss_bytes, peak_device_bytes, final_loss}.
    versions: package -> version of the harness environment. config: the resolved run spec, dotted keys.
    differs: dotted key -> value where this run's config differs from the first run's ({} for the first).
    loss_series: side -> (steps, loss) for the overlaid loss plot. problems: what verify_report found (the files
      the verdict rests on changed since the run, or an edited report); [] when intact.
    gate: the one-line outcome of the run's regression gate (gate.json, `--baseline`), '' when it had none;
      gate_passed: whether that gate passed (None: no gate; parity.history.gate.read_gate).
    backend: the sides' devices' platforms ('cpu', 'cuda'). max_load: the highest 1-minute load average recorded
      around any side (None: not recorded). cores: the machine's CPU count.
  """
  label: str
  run_dir: Path
  preset: str
  precision: str | None
  plan: str
  sides: list[str]
  steps: int | None
  passed: bool
  verdict: str
  max_dloss: dict[str, float | None]
  loss_tolerance: float | None
  per_side: dict[str, dict[str, Any]]
  versions: dict[str, str]
  config: dict[str, Any]
  differs: dict[str, Any] = dataclasses.field(default_factory=dict)
  loss_series: dict[str, tuple[list[int], list[float | None]]] = dataclasses.field(default_factory=dict)
  problems: list[str] = dataclasses.field(default_factory=list)
  backend: str = ""
  max_load: float | None = None
  cores: int | None = None
  gate: str = ""
  gate_passed: bool | None = None


METRICS: tuple[tuple[str, str, str, bool], ...] = (
    ("max_dloss", "max |Δloss| per pair", "nats", True),
    ("final_loss", "final training loss per side", "nats", False),
    ("tokens_per_s", "throughput per side", "tokens/s", False),
    ("step_time_s_median", "median step time per side", "s", False),
    ("peak_rss_bytes", "peak host RSS per side", "MiB", False),
)
"""(key, title, unit, log scale) of each plot across runs; max_dloss is per pair, the others per side."""


def _plan_text(rec: RunRecord) -> str:
  """The plan pair's name when one was chosen, else the run's own plans as each describes itself
  (parity.side_plans.describe_plans over the plans of the sides that ran)."""
  plan, mig = rec.plan, rec.migration
  name = plan.name if plan else None
  if mig and mig.source:  # the DeepSpeed config's port decided the plans
    return f"DeepSpeed config {Path(str(mig.source)).name}" + (f" ({name})" if name else "")
  if name:
    return str(name)
  return describe_plans(rec.side_plans()) or "none: no side of it runs a plan"


def side_figures(s: SideRecord) -> dict[str, Any]:
  """A side's key figures (RunFigures.per_side) from its record."""
  summ, losses = s.summary, [x for x in s.values("loss") if finite_number(x) is not None]
  return {"status": s.status, "tokens_per_s": finite_number(summ.get("tokens_per_s")),
          "step_time_s_median": finite_number(summ.get("step_time_s_median")),
          "peak_rss_bytes": finite_number(s.peak_rss_bytes),
          "peak_device_bytes": finite_number(summ.get("peak_device_bytes")),
          "final_loss": float(losses[-1]) if losses else None}


def run_figures(report, label: str | None = None) -> RunFigures:
  """The key figures of one loaded Report (parity.report.build.Report; read with load_report).

  Returns RunFigures with `problems` empty and `differs` empty (load_runs fills both)."""
  rec = report.record
  max_dloss: dict[str, float | None] = {}
  tol = None
  for c in rec.checks:
    if c.metric == "loss" and len(c.sides) == 2:
      max_dloss["~".join(c.sides)] = finite_number(c.value)
      tol = finite_number(c.tolerance) if tol is None else tol
  if tol is None:
    tol = finite_number((rec.tolerance_table.get("loss") or {}).get("atol"))
  sides = list(rec.sides)
  return RunFigures(
      label=label or Path(report.run_dir).name, run_dir=Path(report.run_dir), preset=model_label(rec),
      precision=rec.precision, plan=_plan_text(rec), sides=sides,
      steps=rec.run.steps, passed=bool(rec.verdict.passed), verdict=rec.verdict.message,
      max_dloss=max_dloss, loss_tolerance=tol, per_side={s: side_figures(rec.sides[s]) for s in sides},
      versions=dict(rec.environment.versions),
      config={**flatten(dict(rec.run.json)), **launch_config(report.run_dir)},
      loss_series={s: (rec.sides[s].values("step"), [finite_number(x) for x in rec.sides[s].values("loss")])
                   for s in sides},
      backend=",".join(sorted({(rec.sides[s].device or "?").split(":")[0] for s in sides})),
      max_load=_max_load(rec), cores=rec.environment.cpu_count)


def gate_failures(runs: Sequence[RunFigures]) -> str:
  """' Failed the regression gate against its baseline (gate.md): a, b.' naming the runs whose gate.json failed ('' when
  none did): a run that holds parity but moved against its baseline must not leave the banner green."""
  bad = [r.label for r in runs if r.gate_passed is False]
  return f" Failed the regression gate against its baseline (gate.md): {', '.join(bad)}." if bad else ""


def _max_load(rec: RunRecord) -> float | None:
  """The highest 1-minute load average recorded around any side (sides.<side>.load {start, end}), None if none."""
  loads = [x for x in (peak_load(s.load) for s in rec.sides.values()) if x is not None]
  return max(loads) if loads else None


def _labels(dirs: Sequence[Path]) -> list[str]:
  """Folder names, with the parent folder prefixed where two runs share a name (and an index if still equal)."""
  names = [p.name for p in dirs]
  out = [f"{p.parent.name}/{p.name}" if names.count(p.name) > 1 else p.name for p in dirs]
  return [f"{x} #{i + 1}" if out.count(x) > 1 else x for i, x in enumerate(out)]


def load_runs(run_dirs: Sequence[str | Path]) -> list[RunFigures]:
  """Reads every run folder and returns their key figures, in the order given.

  Args:
    run_dirs: folders of finished `parity compare` runs (at least one; each once).
  Returns:
    One RunFigures per folder; `differs` relative to the first run; `problems` from verify_report (a run whose
    files changed since its verdict is still shown, flagged).
  Raises:
    InputError: an empty list, a folder given twice, or a folder that is not a finished run (load_report's message
      names the folder and what is missing).
  """
  if not run_dirs:
    raise InputError("no run folder given: pass one or more folders written by `parity compare`")
  dirs = [Path(p) for p in run_dirs]
  seen: dict[Path, Path] = {}
  for p in dirs:
    key = p.resolve()
    if key in seen:
      raise InputError(f"{p} is given twice (also as {seen[key]}); pass each run folder once")
    seen[key] = p
  runs = []
  for p, label in zip(dirs, _labels([p.resolve() for p in dirs])):
    report = load_finished(p)
    fig = run_figures(report, label)
    fig.problems = verify_report(report)
    fig.gate, fig.gate_passed = read_gate(p)
    runs.append(fig)
  for r in runs[1:]:
    r.differs = {k: new for k, (_, new) in config_diff(runs[0].config, r.config).items()}
  return runs


def metric_values(runs: Sequence[RunFigures], key: str) -> dict[str, list[float | None]]:
  """Series name -> one value per run for the metric `key` of METRICS: per pair ('a~b') for max_dloss, per side
  otherwise (peak_rss_bytes in MiB). A run without that pair or side gives None there."""
  names: list[str] = []
  for r in runs:
    for n in (r.max_dloss if key == "max_dloss" else r.sides):
      if n not in names:
        names.append(n)
  scale = 1 / 2**20 if key == "peak_rss_bytes" else 1.0
  out: dict[str, list[float | None]] = {}
  for n in names:
    vals = []
    for r in runs:
      v = r.max_dloss.get(n) if key == "max_dloss" else (r.per_side.get(n) or {}).get(key)
      vals.append(None if v is None else v * scale)
    out[n] = vals
  return out


def _g(v, spec: str = ".3g") -> str:
  return "n/a" if v is None else format(v, spec)


def _mib(v) -> str:
  return "n/a" if v is None else f"{v / 2**20:,.0f} MiB"


def holds(r: RunFigures) -> bool:
  """True when the run's stored verdict passed AND its files still verify (verify_report found nothing): a run
  whose report or artifacts changed since its verdict never counts as holding parity, nor one that compared no
  pair (ONE SIDE, INTERRUPTED)."""
  return r.passed and not r.problems and not str(r.verdict).startswith(("ONE SIDE", "INTERRUPTED"))


def verdict_cell(r: RunFigures) -> str:
  """'PASS' / 'FAIL', 'ONE SIDE' / 'INTERRUPTED' for a run that compared no pair (as its own headline says), or
  'UNVERIFIED (files changed: ...)' when verify_report found a problem: the stored verdict no longer describes the
  files, so it is not shown as a verdict."""
  if r.problems:
    return f"UNVERIFIED (files changed: {'; '.join(r.problems)})"
  for word in ("ONE SIDE", "INTERRUPTED"):  # no pair was compared: not a PASS, whatever the stored flag
    if str(r.verdict).startswith(word):
      return word
  return "PASS" if r.passed else "FAIL"


def run_row(r: RunFigures, first: RunFigures) -> dict[str, str]:
  """The comparison table's cells of one run (text; several sides or pairs joined by '; '); `first`: the run the
  configuration and versions are compared with."""
  ver = [f"{k} {v}" for k, v in r.versions.items() if first.versions.get(k) != v]
  differs = [f"{k}={v!r}" for k, v in r.differs.items()] + ver
  return {
      "run": r.label, "verdict": verdict_cell(r),
      "preset": r.preset, "precision": r.precision or "n/a", "plan": r.plan, "steps": _g(r.steps, "d"),
      "max |Δloss|": "; ".join(f"{p} {_g(v)}" for p, v in r.max_dloss.items()) or "n/a",
      "tokens/s": "; ".join(f"{s} {_g(f['tokens_per_s'], ',.0f')}" for s, f in r.per_side.items()),
      "median step s": "; ".join(f"{s} {_g(f['step_time_s_median'], '.3g')}" for s, f in r.per_side.items()),
      "peak RSS": "; ".join(f"{s} {_mib(f['peak_rss_bytes'])}" for s, f in r.per_side.items()),
      "differs from the first run": "(the first run)" if r is first else
      ", ".join(differs) or "nothing: same configuration and versions",
  }


COLUMNS = ("run", "verdict", "preset", "precision", "plan", "steps", "max |Δloss|", "tokens/s", "median step s",
           "peak RSS", "differs from the first run")


def comparison_figures(runs: Sequence[RunFigures]):
  """(key, caption, Figure) per plot: one per METRICS entry across the runs, then every run's loss curves."""
  labels = [r.label for r in runs]
  out = []
  for key, title, unit, log in METRICS:
    vals = metric_values(runs, key)
    zeros = [n for n, vs in vals.items() if log and any(v == 0 for v in vs)]
    cap = f"{title} across {len(runs)} runs ({unit})" + (
        f"; an exact 0 ({', '.join(zeros)}) has no place on the log scale and is not drawn" if zeros else "")
    fig = across_runs_figure(labels, vals, title=f"{title}, across runs", ylabel=unit, log=log)
    if key == "max_dloss":
      tols = {r.loss_tolerance for r in runs if r.loss_tolerance}
      for t in sorted(tols):
        ax = fig.axes[0]
        ax.axhline(t, color="k", ls="--", lw=1)
        ax.annotate(f"loss tolerance {t:g}", (1.0, t), xycoords=("axes fraction", "data"), ha="right", va="bottom",
                    fontsize=8)
    out.append((key, cap, fig))
  curves = {f"{r.label} · {s}": r.loss_series[s] for r in runs for s in r.sides}
  out.append(("loss_curves", "training loss per step of every run and side",
              line_figure(curves, title="training loss, every run and side", ylabel="loss (nats/token)")))
  return out


def timing_note(runs: Sequence[RunFigures]) -> str:
  """One sentence on how far the time figures can be compared: the backend, and the runs whose machine was busier
  than its core count (1-minute load) while a side ran; '' when nothing needs saying."""
  out = []
  cpu = [r.label for r in runs if "cpu" in r.backend.split(",")]
  if cpu:
    out.append(f"Throughput and step times of {', '.join(cpu)} come from a CPU backend.")
  busy = [f"{r.label} (load {r.max_load:.1f} on {r.cores} cores)" for r in runs
          if r.max_load is not None and r.cores and r.max_load > r.cores]
  if busy:
    out.append(f"The machine was shared with other work while these ran, so their times are not comparable: "
               f"{', '.join(busy)}.")
  return " ".join(out)


def comparison_markdown(runs: Sequence[RunFigures], plots: dict[str, tuple[str, str]]) -> str:
  """comparison.md: the key-figure table (GFM), each run's problems, and the PNG plots (plots: key -> (file name
  beside it, caption)). Every name, path and stored message goes through parity.report.markdown's `md_text` / `cell`,
  so a folder named like HTML or Markdown reads as typed."""
  n_pass = sum(holds(r) for r in runs)
  out = [f"# parity: {len(runs)} runs compared", "",
         f"**{n_pass} of {len(runs)} runs hold parity.{md_text(gate_failures(runs))}** Runs in the order given; the "
         "first is the reference for \"differs\". " + md_text(timing_note(runs)), ""]
  out += md_table(COLUMNS, [[run_row(r, runs[0])[c] for c in COLUMNS] for r in runs])
  out += ["", "## Runs", ""]
  for r in runs:
    out.append(f"- {md_text(r.label)}: {md_text(r.run_dir)} — " + md_text(f"UNVERIFIED (stored verdict: {r.verdict})"
                                                                          if r.problems else r.verdict))
    out += [f"  - regression gate: {md_text(r.gate)} (gate.md)"] if r.gate else []
    out += [f"  - **files changed since its verdict**: {md_text(p)}" for p in r.problems]
  for key, (name, caption) in plots.items():
    out += ["", f"![{md_text(caption)}]({name})", "", f"*{md_text(caption, block=False)}*"]
  return "\n".join(out) + "\n"


def comparison_html(runs: Sequence[RunFigures], figures: dict[str, tuple[str, str]]) -> str:
  """comparison.html: one self-contained page (parity.report.html building blocks, inline SVG figures:
  figures: key -> (svg, caption))."""
  n_pass = sum(holds(r) for r in runs)
  changed = [r.label for r in runs if r.problems]
  gated = gate_failures(runs)
  kind = "pass" if n_pass == len(runs) and not changed and not gated else "fail" if n_pass == 0 else "warn"
  sub = (f"Files changed since the verdict in: {', '.join(changed)}. " if changed else "") + \
      "Runs in the order given; the first is the reference for \"differs\". " + timing_note(runs)
  rows, classes = [], []
  for r in runs:
    row = run_row(r, runs[0])
    link = H.Raw(f"<a href=\"{H.esc((r.run_dir / 'report.html').resolve().as_uri())}\">{H.esc(r.label)}</a>")
    cells = [link, H.badge("pass" if holds(r) else "fail", row["verdict"])]
    cells += [H.Raw("<br>".join(_figure_html(x) if c in PER_SIDE else H.esc(x) for x in row[c].split("; ")))
              for c in COLUMNS[2:]]
    rows.append(cells)
    classes.append("fail" if not r.passed or r.problems else None)
  body = [f"<h1>parity: {len(runs)} runs compared</h1>",
          H.banner(kind, f"{n_pass} of {len(runs)} runs hold parity.{gated}", sub),
          H.section("Key figures", f"<div class=\"keyfig\">{H.table(list(COLUMNS), rows, row_classes=classes)}</div>"),
          H.section("Plots", "".join(H.figure(svg, cap, key=k) for k, (svg, cap) in figures.items()))]
  details = [H.kv_table([("folder", str(r.run_dir)),
                         ("verdict", f"UNVERIFIED (stored verdict: {r.verdict})" if r.problems else r.verdict),
                         ("versions", ", ".join(f"{k} {v}" for k, v in r.versions.items()) or "n/a"),
                         *([("regression gate", r.gate)] if r.gate else []),
                         *[("files changed", p) for p in r.problems]]) for r in runs]
  body.append(H.section("Runs", "".join(H.section(r.label, d, level=3) for r, d in zip(runs, details))))
  css = H.CSS + KEY_FIGURES_CSS
  return H.page(f"parity: {len(runs)} runs compared", "\n".join(body), css=css)


PER_SIDE = ("max |Δloss|", "tokens/s", "median step s", "peak RSS")
"""Key-figure columns of one 'name value' figure per side or pair, joined by '; '."""


def _figure_html(item: str) -> str:
  """'jax 2,384 MiB' as HTML that breaks, if the width needs it, only between the name and its value."""
  name, _, value = item.partition(" ")
  return f"{H.esc(name)} <span class=\"nw\">{H.esc(value)}</span>" if value else H.esc(item)


KEY_FIGURES_CSS = ("main{max-width:1600px} .keyfig{overflow-x:auto} .keyfig table{width:100%}\n"
                   ".keyfig td:first-child,.keyfig td:nth-child(5){overflow-wrap:anywhere;min-width:7em}\n"
                   ".keyfig td:nth-child(2){min-width:7em} .keyfig td:last-child{min-width:11em}\n"
                   ".keyfig .nw{white-space:nowrap}\n")
"""The key-figures table fits a 1400 px window (the page may use up to 1600 px): every cell may wrap (a folder name
and the plan anywhere, a figure only between its side and its value), the verdict and "differs" columns keep room;
should the table still be wider (a narrow window, many sides), it scrolls inside its own box, not off the page."""

COMPARISON_SCHEMA = "parity.comparison/1"


def _foreign_files(out: Path) -> list[str]:
  """The files in `out` this command would replace but did not write: comparison.md/.html/.json and
  comparison-*.png, unless comparison.json there carries COMPARISON_SCHEMA (a folder an earlier `parity report`
  wrote); [] for a missing or empty folder."""
  if not out.is_dir():
    return []
  ours = sorted(p.name for p in out.iterdir() if p.name in ("comparison.md", "comparison.html", "comparison.json")
                or (p.name.startswith("comparison-") and p.name.endswith(".png")))
  try:
    mark = json.loads((out / "comparison.json").read_text(encoding="utf-8")).get("schema")
  except (OSError, ValueError, AttributeError):
    mark = None
  return [] if mark == COMPARISON_SCHEMA else ours


def write_comparison(runs: Sequence[RunFigures], out_dir: str | Path, force: bool = False) -> dict[str, Path]:
  """Writes comparison.html, comparison.md with its PNG plots (comparison-<metric>.png) and comparison.json
  (the key figures) into `out_dir` (created if missing; files of an earlier comparison there are replaced).

  Returns: name -> path. Raises InputError (exit 2) when `out_dir` is a run folder or inside one (its files are not
  mixed with a comparison's), when it holds comparison files this command did not write (no comparison.json with
  COMPARISON_SCHEMA; `force` replaces them), or when a file cannot be written there (the files this call wrote
  are removed again, the message names the file)."""
  out = Path(out_dir)
  if (out / "report.json").exists() or (out / ".parity.lock").exists():
    raise InputError(f"-o {out} is a parity run folder; write the comparison to a folder of its own")
  outer = enclosing_run(out)
  if outer is not None:  # e.g. a side's folder: files there would look like the run's own
    raise InputError(f"-o {out} is inside the parity run folder {outer}; write the comparison to a folder of its own")
  foreign = [] if force else _foreign_files(out)
  if foreign:
    raise InputError(f"-o {out} holds files `parity report` did not write ({', '.join(foreign)}); they would be "
                     "replaced: pick another folder, or pass --force to replace them")
  created: list[Path] = []
  try:
    return _write_comparison_files(runs, out, created)
  except OSError as exc:
    for p in created:
      p.unlink(missing_ok=True)
    where = exc.filename or out
    raise InputError(f"-o {out}: cannot write {where} ({exc.strerror or exc}); pick a writable folder with free "
                     "space") from None


def _write_comparison_files(runs: Sequence[RunFigures], out: Path, created: list[Path]) -> dict[str, Path]:
  """write_comparison's writing: every file it creates anew is appended to `created` (removed on a failure)."""
  out.mkdir(parents=True, exist_ok=True)

  def _atomic(path: Path, write) -> None:
    if not path.exists():
      created.append(path)
    atomic_write(path, write)
  written: dict[str, Path] = {}
  figures, plots = {}, {}
  for key, caption, fig in comparison_figures(runs):
    figures[key] = (to_svg(fig, salt=key, close=False), caption)
    name = f"comparison-{key}.png"
    _atomic(out / name, lambda p, b=to_png(fig): p.write_bytes(b))  # noqa: B008 - the PNG is drawn once, here
    plots[key] = (name, caption)
    written[f"plot:{key}"] = out / name
  _atomic(out / "comparison.md", lambda p: p.write_text(comparison_markdown(runs, plots), encoding="utf-8"))
  _atomic(out / "comparison.html", lambda p: p.write_text(comparison_html(runs, figures), encoding="utf-8"))
  data = [{**dataclasses.asdict(r), "run_dir": str(r.run_dir), "config": None, "loss_series": None} for r in runs]
  _atomic(out / "comparison.json", lambda p: p.write_text(json.dumps({"schema": COMPARISON_SCHEMA,
                                                                      "runs": data}, indent=2, default=str)))
  written.update(md=out / "comparison.md", html=out / "comparison.html", json=out / "comparison.json")
  return written
