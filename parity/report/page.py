"""report.html of one run: the verdict sentence, the checks, the plots (inline SVG), memory, throughput, plan,
migration and environment, in one self-contained file (no network, no server, no script)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from parity.report.semantics_view import (PRECISION_INTRO, SEMANTICS_INTRO, precision_headers, precision_table,
                                          semantics_headers, semantics_rows)
from parity.report import cells, check_table, headline, setup_table, side_table
from parity.report import html as H
from parity.report.equivalence_view import EQUIVALENCE_HEADERS, equivalence_intro, equivalence_rows
from parity.report.join_view import JOIN_HEADERS, join_intro, join_rows
from parity.report.markdown import data_card_rows
from parity.report.placement_strip import strip_svg
from parity.report.placement_view import placement_blocks
from parity.report.run_record import RunRecord

__all__ = ["report_figures", "report_html", "read_environment", "placement_html"]


def _series_of(rec: RunRecord, key: str) -> dict[str, tuple[list, list]]:
  return {(n if s.status == "ok" else f"{n} ({s.status})"): (s.series["step"], s.series[key])
          for n, s in rec.sides.items()}


def _pairs(rec: RunRecord, key: str) -> dict[str, tuple[list, list]]:
  """'a vs b' -> (common steps, |a - b|) for every pair of sides (non-numeric values skipped)."""
  names, out = list(rec.sides), {}
  num = (int, float)
  for i, a in enumerate(names):
    for b in names[i + 1:]:
      la = dict(zip(rec.sides[a].series["step"], rec.sides[a].series[key]))
      lb = dict(zip(rec.sides[b].series["step"], rec.sides[b].series[key]))
      st = [k for k in la if k in lb and isinstance(la[k], num) and isinstance(lb[k], num)]
      out[f"{a} vs {b}"] = (st, [abs(la[k] - lb[k]) for k in st])
  return out


def report_figures(rec: RunRecord) -> Iterator[tuple[str, str, Any]]:
  """(key, caption, matplotlib Figure) of every plot the run's data supports, in page order."""
  from parity.report import plots as P  # imports matplotlib, which is optional: only when drawing
  t = headline.run_title(rec)
  prec = rec.precision
  sides = {n: {**s.series, "status": s.status} for n, s in rec.sides.items()}
  yield "loss", "Training loss of every side (markers without a line: held-out loss at its steps).", \
      P.loss_figure(sides, title=f"training loss · {t}")
  if len(rec.sides) > 1:
    loss_checks = [c for c in rec.checks if c.metric == "loss"]
    tol = max((c.tolerance for c in loss_checks if isinstance(c.tolerance, (int, float)) and c.tolerance),
              default=None)
    gating = any(c.gating for c in loss_checks)  # bf16/fp16: the noise envelope decides instead
    env = {f"noise envelope of {s} (batch rows reversed)": (e["steps"], e["abs_loss_diff"])
           for s, e in ((rec.noise_envelope or {}).get("sides") or {}).items()}
    yield "delta", ("Per-step loss difference of each pair, log scale; exact zeros sit on the '= 0' line"
                    + ("; dotted: each side's own rounding noise (noise envelope)." if env else ".")), \
        P.delta_figure(_pairs(rec, "loss"), title=f"per-step abs Δloss per pair · {t}", tolerance=tol,
                       tolerance_label="loss tolerance (atol)" if gating else
                       "per-step loss bound (reported only: the noise envelope decides)", envelopes=env)
  gaps = sorted({st for s in rec.sides.values() for st, g in zip(s.series["step"], s.series["grad_norm"])
                 if not isinstance(g, (int, float))})
  gap_note = f"gaps: non-finite norm (inf/NaN, e.g. an fp16 overflow) at step(s) {', '.join(map(str, gaps))}" \
      if gaps else None
  yield "grad_norm", "Global L2 norm of the gradient before clipping.", \
      P.line_figure(_series_of(rec, "grad_norm"), title=f"gradient norm · {t}", ylabel="grad norm", note=gap_note)
  yield "lr", "Learning rate of each step.", P.line_figure(_series_of(rec, "lr"), title=f"learning rate · {t}",
                                                          ylabel="learning rate")
  scales = [v for s in rec.sides.values() for v in s.series["loss_scale"] if isinstance(v, (int, float))]
  if prec == "fp16" or any(v != 1 for v in scales):
    skipped = {f"{n}: skipped step": ([st for st, k in zip(s.series["step"], s.series["skipped"]) if k],
                                      [sc for sc, k in zip(s.series["loss_scale"], s.series["skipped"]) if k])
               for n, s in rec.sides.items() if any(s.series["skipped"])}
    per_side = ", ".join(f"{n} {sum(bool(k) for k in s.series['skipped'])}" for n, s in rec.sides.items())
    yield "loss_scale", ("Dynamic loss scale (fp16); shaded bands and markers: steps skipped for overflow, per side: "
                         f"{per_side}."), \
        P.line_figure(_series_of(rec, "loss_scale"), title=f"loss scale · {t}", ylabel="loss scale", log=True,
                      points=skipped, note=f"skipped steps per side: {per_side}",
                      vlines={"step skipped for overflow": sorted({x for pts in skipped.values() for x in pts[0]})})
  rows = side_table.memory_rows(rec)
  if any(r["category"] != "peak_rss" and (r["predicted"] or r["measured"]) for r in rows):
    gaps = side_table.memory_gaps(rec)
    yield "memory", ("Memory per side in the same categories, predicted (parity.sizing.memory) beside measured (live "
                     "arrays / engine tensors); right panel, hatched: host memory." + (f" {gaps}." if gaps else "")), \
        P.memory_figure(rows, title=f"memory · {t}")
  times = {n: side_table.step_times(s) for n, s in rec.sides.items()}
  tps = {n: side_table.side_tokens_per_s(rec, s) for n, s in rec.sides.items()}
  yield "throughput", (f"Tokens/s per side, and the time of every step after the warmup "
                       f"({side_table.warmup_phrase(rec)}; the caveat above holds)."), \
      P.throughput_figure(times, tps, title=f"throughput · {t}")


def read_environment(run_dir: Path) -> dict | None:
  """environment.json of the run folder (the doctor block: versions, devices, CPU, git, load), None when absent or
  unreadable."""
  try:
    data = json.loads((Path(run_dir) / "environment.json").read_text())
  except (OSError, ValueError):
    return None
  return data if isinstance(data, dict) else None


def _source(text: str, n: int = 70) -> str:
  """Where a tolerance comes from: short texts as they are, long ones folded (<details>) under their opening."""
  if len(text) <= n:
    return text
  head = text[:n].rsplit(" ", 1)[0] + " …"
  return H.details(head, H.esc(text))


def _result(r: dict) -> str:
  kind = "pass" if r["passed"] else ("fail" if r["gating"] else "info")
  return H.badge(kind, r["result"])


def _metrics_html(rec: RunRecord) -> str:
  """One row per metric, its worst pair: what a reviewer reads first."""
  rows = check_table.metric_rows(rec)
  return H.table(["metric", "value is", "worst pair (or side)", "value", "tolerance", "where the tolerance comes from",
                  "result",
                  "first failing step"],
                 [[r["metric"], r["measure"], r["worst"], r["value"], r["tolerance"], _source(r["source"]),
                   _result(r), r["first_failing_step"]] for r in rows],
                 row_classes=["fail" if not r["passed"] and r["gating"] else None for r in rows], numeric=(3,))


def _checks_html(rec: RunRecord) -> str:
  """Every check of every pair, with its detail."""
  rows = check_table.check_rows(rec)
  return H.table(["check", "value is", "value", "tolerance", "result", "first failing step", "detail"],
                 [[r["name"], r["measure"], r["value"], r["tolerance"], _result(r), r["first_failing_step"],
                   r["detail"]] for r in rows],
                 row_classes=["fail" if not r["passed"] and r["gating"] else ("info" if not r["gating"] else None)
                              for r in rows], numeric=(2,))


def _sides_html(rec: RunRecord) -> str:
  keys = [("side", "side"), ("status", "status"), ("steps", "steps"), ("loss", "loss first → last"),
          ("val_loss", "val loss"), *side_table.throughput_columns(rec), ("init_s", "init s"),
          ("compile_s", "compile s"), ("op_build_s", "op build/load s"), ("peak_rss", "peak RSS"),
          ("peak_device", "peak device"), ("memory_kinds", "state by memory kind"), ("backend", "backend")]
  rows = side_table.side_rows(rec)
  numeric = tuple(i for i, (k, _) in enumerate(keys) if k not in ("side", "status", "loss", "val_loss",
                                                                   "memory_kinds", "backend"))
  out = H.table([h for _, h in keys], [[r[k] for k, _ in keys] for r in rows],
                row_classes=[None if r["status"] == "ok" else "fail" for r in rows], numeric=numeric)
  out += "".join(f"<p>{H.esc(note)}.</p>" for note in side_table.memory_notes(rec))
  out += "".join(f"<p><strong>{H.esc(name)} not run</strong>: {H.esc(why.reason)}</p>"  # parity.sockets
                 for name, why in rec.sides_not_run.items() if name not in rec.sides)
  for name, s in rec.sides.items():
    if s.error:
      out += H.details(f"{name} {s.status}: error output", H.code("\n".join(s.error.strip().splitlines()[-20:]),
                                                                  block=True))
    ranks = side_table.rank_table(s)
    if ranks:
      out += H.section(f"{name}: per rank", H.table(*ranks), level=3)
  return out


def _memory_table(rec: RunRecord) -> str:
  rows = [r for r in side_table.memory_rows(rec) if r["predicted"] or r["measured"]]
  return H.table(["side", "category", "memory kind", "predicted", "measured", "measured / predicted"],
                 [[r["side"], r["category"], r["memory_kind"], cells.fmt_bytes(r["predicted"]),
                   cells.fmt_bytes(r["measured"]), cells.fmt(r["ratio"], ".3f")] for r in rows],
                 numeric=(3, 4, 5)) if rows else ""


def _migration_html(run_dir: Path, rec: RunRecord) -> str:
  mig = rec.migration
  if not mig:
    return ""
  try:
    m = json.loads((Path(run_dir) / "migration.json").read_text())
  except (OSError, ValueError):
    return H.section("DeepSpeed config migration", f"<p>{H.esc(mig.source)}: migration.json is missing.</p>",
                     anchor="migration")
  rows = [[H.code(e["key"]), json.dumps(e.get("value"), default=str)
           + (f" → {json.dumps(e['resolved'], default=str)}" if e.get("resolved") is not None else ""),
           e.get("fate"), e.get("target") or "", e.get("reason") or ""] for e in m.get("entries") or []]
  body = (f"<p>The DeepSpeed side ran {H.code(str(m.get('source')))} as given; the JAX and torch sides ran its port "
          f"(status <b>{H.esc(m.get('status'))}</b>; also in migration.md).</p>"
          + H.table(["key", "value", "fate", "target", "reason"], rows))
  if isinstance(m.get("loss_normalization"), dict):
    body += f"<p>Loss normalisation the config implies: {H.esc(m['loss_normalization'].get('why'))}.</p>"
  if m.get("implied"):
    body += H.section("implied by DeepSpeed defaults", H.table(["key", "value", "reason"], [
        [H.code(i["key"]), json.dumps(i["value"], default=str), i["reason"]] for i in m["implied"]]), level=3)
  return H.section(f"DeepSpeed config migration: {mig.source}", body, anchor="migration")


def _perturb_kind(result: str) -> str:
  return "pass" if result == "applied" else "info" if result.startswith("unknown") else "fail"


def perturbations_html(rec: RunRecord) -> str:
  """The 'Inputs' and 'Perturbations' sections (parity.report.setup_table.inputs_lines / perturbation_rows); '' when
  the report has neither."""
  out = ""
  lines = setup_table.inputs_lines(rec)
  if lines:
    out += H.section("Inputs", "".join(f"<p class=\"note\">{H.esc(x)}</p>" for x in lines), anchor="inputs")
  rows = setup_table.perturbation_rows(rec)
  if rows:
    out += H.section("Perturbations (planted on purpose with --perturb)", H.table(
        setup_table.PERTURB_HEADERS, [[*r[:-1], H.badge(_perturb_kind(r[-1]), r[-1])] for r in rows],
        row_classes=[{"pass": None}.get(_perturb_kind(r[-1]), _perturb_kind(r[-1])) for r in rows]),
        anchor="perturbations")
  return out


def _placement_cells(row: list[str], bad: bool) -> list:
  return [*row[:-1], H.Raw(H.badge("fail", "MISMATCH") + " " + H.esc(row[-1].removeprefix("MISMATCH: ")))] \
      if bad else row


def placement_html(rec: RunRecord) -> str:
  """The 'Placement and transfers' section (parity.report.placement_view.placement_blocks: the transfer table, each
  JAX side's placement table with its mismatch rows marked, and, where the copies are known, the schedule strip,
  parity.report.placement_strip.strip_svg); '' for a report without the section."""
  parts = []
  for b in placement_blocks(rec):
    if b[0] == "h3":
      parts.append(f"<h3>{H.esc(b[1])}</h3>")
    elif b[0] in ("p", "warn"):
      parts.append(f"<p><b>{H.esc(b[1])}</b></p>" if b[0] == "warn" else f"<p class=\"note\">{H.esc(b[1])}</p>")
    elif b[0] == "table":
      parts.append(H.table(b[1], [_placement_cells(r, bad) for r, bad in zip(b[2], b[3])],
                           row_classes=["fail" if bad else None for bad in b[3]]))
    else:
      parts.append(H.figure(strip_svg(b[2]["transfers"]), f"{b[1]}: host↔device copies of the compiled step, "
                            "each bar from its start to its done position (hover a bar for its tensor)."))
  return H.section("Placement and transfers", "".join(parts), anchor="placement") if parts else ""


def report_html(rec: RunRecord, figures: dict[str, tuple[str, str]], run_dir: Path) -> str:
  """The page. rec: the run (its report.json, parity.report.run_record); figures: key -> (svg text, caption) from
  report_figures; run_dir: for migration.json and environment.json beside report.json."""
  kind, sentence, sub = headline.verdict_parts(rec)
  fig = lambda k: H.figure(figures[k][0], figures[k][1], key=k) if k in figures else ""
  body = [f"<h1>parity report · {H.esc(headline.run_title(rec))}</h1>", H.banner(kind, sentence, sub)]
  errors = headline.open_write_errors(rec, run_dir)
  if errors:
    body.append(H.banner("warn", "Some report files could not be written: " + "; ".join(
        f"{e['file']}: {e['error']}" for e in errors)))
  if join_rows(rec):  # `parity join`: the folders joined and each side's machine
    body.append(H.section("Joined runs", f"<p class=\"note\">{H.esc(join_intro(rec))}</p>"
                          + H.table(JOIN_HEADERS, join_rows(rec)), anchor="join"))
  body.append(H.section("Checks: one row per metric, its worst pair", _metrics_html(rec)
                        + "<p class=\"note\">Every check of every pair: <a href=\"#all-checks\">all checks</a>.</p>",
                        anchor="checks"))
  if semantics_rows(rec):
    rows = semantics_rows(rec)
    body.append(H.section("Semantics card", f"<p class=\"note\">{H.esc(SEMANTICS_INTRO)}</p>"
                          + H.table(semantics_headers(rec), rows,
                                    row_classes=[None if r[-1].startswith("yes") else "fail" for r in rows])
                          + (f"<h3>Precision settings</h3><p class=\"note\">{H.esc(PRECISION_INTRO)}</p>"
                             + H.table(precision_headers(rec), precision_table(rec)) if precision_table(rec) else ""),
                          anchor="semantics"))
  body.append(H.section("Curves", "".join(fig(k) for k in ("loss", "delta", "grad_norm", "lr", "loss_scale")),
                        anchor="curves"))
  body.append(H.section("Sides", _sides_html(rec), anchor="sides"))
  mem_note = H.esc(rec.memory_note or "")
  gaps = H.esc(side_table.memory_gaps(rec))
  body.append(H.section("Memory", fig("memory") + (f"<p class=\"note\">{mem_note}.</p>" if mem_note else "")
                        + (f"<p class=\"note\"><b>{gaps}.</b></p>" if gaps and "memory" not in figures else "")
                        + _memory_table(rec), anchor="memory"))
  tp = side_table.throughput_rows(rec)
  cols = side_table.throughput_columns(rec)
  tkeys = ["side", "backend", "repeats", "min_s", "median_s", "max_s", *(k for k, _ in cols), "load", "op_build_s"]
  note = H.esc(side_table.throughput_note(rec))
  body.append(H.section("Throughput", f"<p class=\"note\"><b>{note}</b></p>" + fig("throughput")
                        + H.table(["side", "backend", "steps timed", "min s/step", "median s/step", "max s/step",
                                   *(h for _, h in cols), "load (1 min) start → end", "op build/load s (not in init)"],
                                  [[r[k] for k in tkeys] for r in tp], numeric=tuple(range(2, 6 + len(cols)))),
                        anchor="throughput"))
  card_rows = data_card_rows(rec)
  if card_rows:
    body.append(H.section("Data card", H.kv_table([tuple(r) for r in card_rows]), anchor="data-card"))
  if equivalence_rows(rec):
    body.append(H.section("Equivalence", f"<p class=\"note\">{H.esc(equivalence_intro(rec))}</p>"
                          + H.table(EQUIVALENCE_HEADERS, equivalence_rows(rec)), anchor="equivalence"))
  body.append(H.section("Plan and placements", H.kv_table(setup_table.plan_rows(rec)), anchor="plan"))
  body.append(placement_html(rec))
  body.append(_migration_html(run_dir, rec))
  body.append(perturbations_html(rec))
  body.append(H.section(f"All checks ({len(rec.checks)})", _checks_html(rec), anchor="all-checks"))
  body.append(H.section("Environment", H.kv_table(setup_table.environment_rows(rec, read_environment(run_dir))),
                        anchor="environment"))
  body.append("<p class=\"note\">Written by parity from report.json in this folder; report.md has the same tables "
              "with the plots as PNG files.</p>")
  return H.page(f"parity: {sentence[:120]}", "\n".join(body))
