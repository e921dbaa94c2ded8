"""report.md: the verdict and tables of report.html in GitHub-flavoured Markdown, plots as PNG files beside it.

Every user-provided string (a file or folder name, a command line, an error, a stored message) goes through
`md_text`, which escapes what Markdown and HTML would interpret, so it renders as typed; every table cell goes through
`cell`, which applies `md_text` to all but the emphasis this module writes itself (`strong`), so each row has exactly
as many cells as its header (GFM splits rows at every unescaped bar, even in code spans)."""
from __future__ import annotations

import re
import statistics
from typing import Sequence

from parity.report.semantics_view import (PRECISION_INTRO, SEMANTICS_INTRO, precision_headers, precision_table,
                                          semantics_headers, semantics_rows)
from parity.report import cells, check_table, headline, setup_table, side_table
from parity.report.equivalence_view import EQUIVALENCE_HEADERS, equivalence_intro, equivalence_rows
from parity.report.join_view import JOIN_HEADERS, join_intro, join_rows
from parity.report.placement_view import COPY_HEADERS, copy_rows, placement_blocks
from parity.report.run_record import RunRecord

__all__ = ["md_text", "strong", "Markup", "cell", "code_block", "md_table", "report_markdown", "perturbation_markdown",
           "placement_markdown", "PLOT_FILES", "PLOT_ALT"]

PLOT_FILES = {"loss": "loss.png", "delta": "loss_delta.png", "grad_norm": "grad_norm.png", "lr": "lr.png",
              "loss_scale": "loss_scale.png", "memory": "memory.png", "throughput": "throughput.png"}
"""Figure key (parity.report.page.report_figures) -> PNG file name in the run folder."""
PLOT_ALT = {"loss": "training loss of every side", "delta": "per-step loss difference of each pair, log scale",
            "grad_norm": "gradient norm of every side", "lr": "learning rate of every side",
            "loss_scale": "fp16 loss scale and skipped steps", "memory": "memory per side, predicted and measured",
            "throughput": "tokens/s and step-time distribution per side"}
"""Alt text of each plot in report.md."""


_MD_INLINE = re.compile(r"[\\`*\[\]<>&|~]|(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])")
"""Characters with an inline meaning in GFM or HTML: escapes, code, emphasis, links and images, raw HTML and autolinks,
entities, table bars, strikethrough; '_' only where it can open or close emphasis (not between letters or digits)."""
_MD_BLOCK_START = re.compile(r"^(\s*)(?:([#=+-])|(\d+)([.)]))")
"""A start that makes a heading, a list item or a setext underline where the text begins a line or a list item."""


class Markup(str):
  """Markdown this module wrote itself (already escaped): `cell` keeps it as it is."""


def md_text(x, *, block: bool = True) -> str:
  """`x` as GFM text that renders as itself: every character of `_MD_INLINE` backslash-escaped, line breaks as spaces
  (so it cannot start a block), None as 'n/a'; with `block`, also a leading '#', '=', '+', '-' or list number
  ('1.' -> '1\\.'), which would start a heading or a list where the text begins a line or a list item (table cells
  hold inline text only: `cell` passes block=False). Use it for every user-provided string written to a .md file:
  file and folder names, commands, errors, stored messages."""
  text = " ".join(("n/a" if x is None else str(x)).splitlines())
  text = _MD_INLINE.sub(lambda m: "\\" + m.group(0), text)
  if not block:
    return text
  return _MD_BLOCK_START.sub(lambda m: m.group(1) + (f"\\{m.group(2)}" if m.group(2) else
                                                       f"{m.group(3)}\\{m.group(4)}"), text)


def strong(x) -> Markup:
  """Bold text for a table cell or a sentence: `md_text(x)` between '**'."""
  return Markup(f"**{md_text(x, block=False)}**")


def cell(x) -> str:
  """Text safe inside a GFM table cell: `md_text(x)` (bars, HTML and Markdown escaped, newlines as spaces, None as
  'n/a'), or `x` itself when it is `Markup` this module wrote."""
  return str(x) if isinstance(x, Markup) else md_text(x, block=False)


def code_block(lines: Sequence[str]) -> list[str]:
  """A fenced code block holding `lines` verbatim: its fence is longer than any run of backticks in them, so no line
  can close it early."""
  runs = [len(r) for line in lines for r in re.findall(r"`+", line)]
  fence = "`" * max(3, max(runs, default=0) + 1)
  return [fence, *lines, fence]


def md_table(headers: Sequence[str], rows: Sequence[Sequence]) -> list[str]:
  """Lines of a GFM table (header, delimiter, rows), every cell through `cell`."""
  out = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
  out += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
  return out


def _self_sections(rec: RunRecord) -> list[str]:
  out = []
  env = rec.noise_envelope
  if env:
    r = env["rule"]
    n = rec.run.steps
    short = f" (this run's {n} steps make one shorter window)" if isinstance(r.get("window"), int) \
        and n is not None and n < r["window"] else ""
    out += ["", "## Noise envelope", "", f"{env['method'][0].upper()}{env['method'][1:]}. Each pair passes when, in "
            f"every window of {r['window']} steps{short}, rms Δloss ≤ {r['factor']:g} × rms(envelope of the noisier "
            f"side) + {r['floor']:g} nats. {r['reason']}", ""]
    rows = []
    for side, run in env["runs"].items():
      e = env["sides"].get(side, {})
      diffs = sorted(e.get("abs_loss_diff", []))
      gn = [x for x in e.get("grad_norm_rel_diff", []) if x is not None]
      rows.append([side, run["status"], cells.fmt(diffs[-1] if diffs else None),
                   cells.fmt(statistics.median(diffs) if diffs else None), cells.fmt(max(gn) if gn else None),
                   cells.fmt(e.get("params_ratio_max")), len(diffs)])
    out += md_table(["side", "rerun status", "max abs Δloss", "median abs Δloss", "max rel. Δgrad norm",
                     "params: max abs Δ / moved", "steps"], rows)
  det = rec.determinism
  if det:
    out += ["", "## Determinism", ""] + md_table(["side", "deterministic", "detail"], [
        [s, "yes" if x.deterministic else strong("no"),
         f"{x.detail} (rerun of the first {x.steps_checked} steps in a new process)"] for s, x in det.items()])
  res = rec.resume
  if res:
    out += ["", "## Checkpoint / resume", ""] + md_table(
        ["side", "resumed at step", "bit-identical to the uninterrupted run", "detail"],
        [[s, x.resumed_at_step, "yes" if x.bit_identical else strong("no"), x.detail] for s, x in res.items()])
  return out


def data_card_rows(rec: RunRecord) -> list[list]:
  """[item, value] rows of a padded/packed run's data card (report.json data.card, parity.dataset.card.data_card);
  [] for a stream run. report.md and report.html show the same rows."""
  card = rec.data.card
  if not card:
    return []
  per_step = card["loss_tokens_per_step"]
  rows = [[k, card[k]] for k in ("source", "sha256", "tokenizer", "tokenizer_sha256", "layout", "examples",
                                 "examples_seen", "examples_per_step", "length_min", "length_median", "length_max",
                                 "tokens_per_step")]
  if "chat_template" in card and ((card.get("formats") or {}).get("instruction") or card.get("chat_masking")):
    rows.append(["chat_template", card.get("chat_template") or "none: Alpaca records got the built-in Alpaca prompt"])
  pad = card["padding_fraction"]  # card.json keeps the exact fraction; the page shows it as a percentage
  rows.append(["padding_fraction", f"{pad:.4f} ({pad:.1%})" if isinstance(pad, (int, float)) else pad])
  return rows + [["loss_normalization", rec.data.loss_normalization],
                 ["loss tokens per step (min / max)", f"{min(per_step)} / {max(per_step)}"],
                 ["loss_tokens_total", card["loss_tokens_total"]],
                 ["truncation", ", ".join(f"{k} {v}" for k, v in card["truncation"].items())]]


def data_card_markdown(rec: RunRecord) -> list[str]:
  """'## Data card' (data_card_rows) of a padded/packed run; [] otherwise."""
  rows = data_card_rows(rec)
  return ["", "## Data card", ""] + md_table(["item", "value"], rows) if rows else []


def perturbation_markdown(rec: RunRecord) -> list[str]:
  """The 'Inputs' lines (data, tokens, DeepSpeed config files) and the 'Perturbations' table of report.md."""
  out = []
  lines = setup_table.inputs_lines(rec)
  if lines:
    out += ["", "## Inputs", ""] + [f"- {md_text(x)}" for x in lines]
  rows = setup_table.perturbation_rows(rec)
  if rows:
    out += ["", "## Perturbations (planted on purpose with --perturb)", ""] + md_table(
        setup_table.PERTURB_HEADERS, [[*r[:-1], r[-1] if r[-1] == "applied" else strong(r[-1])] for r in rows])
  return out


def placement_markdown(rec: RunRecord) -> list[str]:
  """'## Placement and transfers' of report.md (parity.report.placement_view.placement_blocks: the transfer table,
  each JAX side's placement table, mismatches in bold; the copy schedule as a table of the copies, where report.html
  draws its strip); [] for a report without the section."""
  blocks = placement_blocks(rec)
  out = ["", "## Placement and transfers"] if blocks else []
  for b in blocks:
    if b[0] == "h3":
      out += ["", f"### {md_text(b[1])}"]
    elif b[0] in ("p", "warn"):
      out += ["", strong(b[1]) if b[0] == "warn" else md_text(b[1])]
    elif b[0] == "table":
      out += [""] + md_table(b[1], [[*r[:-1], strong(r[-1])] if bad else r for r, bad in zip(b[2], b[3])])
    else:
      out += [""] + md_table(COPY_HEADERS, copy_rows(b[2]))
  return out


def _checks_markdown(rec: RunRecord) -> list[str]:
  """report.md's "## Checks" lines: the check table (a failing gating result in bold), then where each metric's
  tolerance comes from."""
  out = ["## Checks", ""] + md_table(
      ["metric", "pair (or side)", "value is", "value", "tolerance", "result", "first failing step", "detail"],
      [[r["metric"], r["pair"], r["measure"], r["value"], r["tolerance"],
        r["result"] if r["passed"] or not r["gating"] else strong(r["result"]), r["first_failing_step"], r["detail"]]
       for r in check_table.check_rows(rec)])
  out += ["", "Where each tolerance comes from:", ""]
  seen = set()
  for r in check_table.check_rows(rec):
    if r["metric"] not in seen and r["source"]:
      seen.add(r["metric"])
      out.append(f"- {strong(r['metric'])}: {md_text(r['source'])}")
  return out


def _memory_markdown(rec: RunRecord, plots: dict[str, str]) -> list[str]:
  """report.md's "## Memory: predicted vs measured" lines (the gaps, the figure when `plots` has 'memory', the
  table), or [] when no side has a predicted or measured figure. plots: as report_markdown."""
  mem = [r for r in side_table.memory_rows(rec) if r["predicted"] or r["measured"]]
  if not mem:
    return []
  gaps = side_table.memory_gaps(rec)
  out = ["", "## Memory: predicted vs measured", "", md_text(rec.memory_note + "."), ""]
  out += [strong(gaps + "."), ""] if gaps else []
  out += [f"![{md_text(plots['memory'][1])}]({plots['memory'][0]})", ""] if "memory" in plots else []
  out += md_table(["side", "category", "memory kind", "predicted", "measured", "measured / predicted"],
                  [[r["side"], r["category"], r["memory_kind"], cells.fmt_bytes(r["predicted"]),
                    cells.fmt_bytes(r["measured"]), cells.fmt(r["ratio"], ".3f")] for r in mem])
  return out


def _semantics_markdown(rec: RunRecord) -> list[str]:
  """The semantics card's table and, under it, each side's precision settings; [] without cards."""
  out: list[str] = []
  if semantics_rows(rec):
    out += ["", "## Semantics card", "", md_text(SEMANTICS_INTRO), ""] + md_table(semantics_headers(rec),
                                                                                semantics_rows(rec))
  if precision_table(rec):
    out += ["", "### Precision settings", "", md_text(PRECISION_INTRO), ""] + md_table(precision_headers(rec),
                                                                                      precision_table(rec))
  return out


def report_markdown(rec: RunRecord, plots: dict[str, str], environment: dict | None = None) -> str:
  """report.md text. rec: the run (its report.json, parity.report.run_record); plots: figure key -> (file name
  beside report.md, caption); environment: environment.json of the run folder, or None."""
  kind, sentence, sub = headline.verdict_parts(rec)
  out = [f"# parity report: {md_text(headline.run_title(rec))}", "", strong(sentence), "", md_text(sub), ""]
  errors = headline.open_write_errors(rec)
  if errors:
    out += ["**Some report files could not be written:** " + "; ".join(
        md_text(f"{e['file']}: {e['error']}") for e in errors), ""]
  out += ["Also: `report.html` (one page, plots inline), `report.json`, `card.json`, `metrics.jsonl`.", ""]
  if join_rows(rec):  # `parity join`: the folders joined and each side's machine
    out += ["## Joined runs", "", md_text(join_intro(rec)), ""] + md_table(list(JOIN_HEADERS), join_rows(rec)) + [""]
  out += _checks_markdown(rec)
  out += _semantics_markdown(rec)
  out += ["", "## Curves", ""]
  for key in ("loss", "delta", "grad_norm", "lr", "loss_scale"):
    if key in plots:
      out += [f"![{md_text(plots[key][1])}]({plots[key][0]})", ""]
  cols = side_table.throughput_columns(rec)  # tokens/s, and loss tokens/s on padded/packed runs
  keys = ["side", "status", "steps", "loss", "val_loss", *(k for k, _ in cols), "init_s", "compile_s", "op_build_s",
          "peak_rss", "peak_device", "memory_kinds", "backend"]
  out += ["## Sides", ""] + md_table(["side", "status", "steps", "loss first → last", "val loss",
                                      *(h for _, h in cols), "init s", "compile s", "op build/load s", "peak RSS",
                                      "peak device", "state by memory kind", "backend"],
                                     [[r[k] for k in keys] for r in side_table.side_rows(rec)])
  out += [line for note in side_table.memory_notes(rec) for line in ("", md_text(note) + ".")]
  for name, why in rec.sides_not_run.items():  # this machine could not start it (parity.sockets)
    if name not in rec.sides:  # a named one is in the table above, its reason below as its error
      out += ["", strong(f"{name} not run") + ": " + md_text(why.reason)]
  for name, s in rec.sides.items():
    ranks = side_table.rank_table(s)
    if ranks:
      out += ["", f"{name}, per rank:", ""] + md_table(*ranks)
    if s.error:
      out += ["", strong(f"{name} {s.status}") + ":", *code_block(s.error.strip().splitlines()[-15:])]
  out += _memory_markdown(rec, plots)
  tk = ["side", "backend", "repeats", "min_s", "median_s", "max_s", *(k for k, _ in cols), "load", "op_build_s"]
  out += ["", "## Throughput", "", strong(side_table.throughput_note(rec)), ""]
  out += [f"![{md_text(plots['throughput'][1])}]({plots['throughput'][0]})", ""] if "throughput" in plots else []
  out += md_table(["side", "backend", "steps timed", "min s/step", "median s/step", "max s/step",
                   *(h for _, h in cols), "load (1 min) start → end", "op build/load s (not in init)"],
                  [[r[k] for k in tk] for r in side_table.throughput_rows(rec)])
  out += data_card_markdown(rec)
  out += ["", "## Plan and placements", ""] + md_table(["item", "value"], setup_table.plan_rows(rec))
  out += placement_markdown(rec)
  if rec.migration:
    out += ["", f"DeepSpeed config {strong(rec.migration.source)}: key-by-key migration table in "
            f"[migration.md](migration.md)."]
    if rec.migration.loss_normalization:
      out += ["", f"Loss normalisation the config implies: {md_text(rec.migration.loss_normalization)}."]
  out += _self_sections(rec)
  if equivalence_rows(rec):
    out += ["", "## Equivalence", "", md_text(equivalence_intro(rec)), ""] + md_table(EQUIVALENCE_HEADERS,
                                                                                 equivalence_rows(rec))
  out += perturbation_markdown(rec)
  out += ["", "## Environment", ""] + md_table(["item", "value"], setup_table.environment_rows(rec, environment))
  return "\n".join(out) + "\n"
