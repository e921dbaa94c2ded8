"""report.md: the verdict and tables of report.html in GitHub-flavoured Markdown, plots as PNG files beside it.

Every table cell goes through `cell`: a '|' inside a cell is escaped (GFM splits rows at every unescaped bar, even in
code spans) and newlines become spaces, so each row has exactly as many cells as its header."""
from __future__ import annotations

from typing import Sequence

from parity.report import content as C

__all__ = ["cell", "md_table", "report_markdown", "PLOT_FILES", "PLOT_ALT"]

PLOT_FILES = {"loss": "loss.png", "delta": "loss_delta.png", "grad_norm": "grad_norm.png", "lr": "lr.png",
              "loss_scale": "loss_scale.png", "memory": "memory.png", "throughput": "throughput.png"}
"""Figure key (parity.report.page.report_figures) -> PNG file name in the run folder."""
PLOT_ALT = {"loss": "training loss of every side", "delta": "per-step loss difference of each pair, log scale",
            "grad_norm": "gradient norm of every side", "lr": "learning rate of every side",
            "loss_scale": "fp16 loss scale and skipped steps", "memory": "memory per side, predicted and measured",
            "throughput": "tokens/s and step-time distribution per side"}
"""Alt text of each plot in report.md."""


def cell(x) -> str:
  """Text safe inside a GFM table cell: '|' escaped, newlines as spaces, None as 'n/a'."""
  text = "n/a" if x is None else str(x)
  return " ".join(text.split("\n")).replace("\\|", "|").replace("|", "\\|")


def md_table(headers: Sequence[str], rows: Sequence[Sequence]) -> list[str]:
  """Lines of a GFM table (header, delimiter, rows), every cell through `cell`."""
  out = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
  out += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
  return out


def _self_sections(d: dict) -> list[str]:
  out = []
  env = d.get("noise_envelope")
  if env:
    r = env["rule"]
    out += ["", "## Noise envelope", "", f"{env['method'][0].upper()}{env['method'][1:]}. Each pair passes when, in "
            f"every window of {r['window']} steps, rms Δloss ≤ {r['factor']:g} × rms(envelope of the noisier side) "
            f"+ {r['floor']:g} nats. {r['reason']}", ""]
    rows = []
    for side, run in env["runs"].items():
      e = env["sides"].get(side, {})
      diffs = sorted(e.get("abs_loss_diff", []))
      gn = [x for x in e.get("grad_norm_rel_diff", []) if x is not None]
      rows.append([side, run["status"], C.fmt(diffs[-1] if diffs else None),
                   C.fmt(diffs[len(diffs) // 2] if diffs else None), C.fmt(max(gn) if gn else None),
                   C.fmt(e.get("params_ratio_max")), len(diffs)])
    out += md_table(["side", "rerun status", "max abs Δloss", "median abs Δloss", "max rel. Δgrad norm",
                     "params: max abs Δ / moved", "steps"], rows)
  det = d.get("determinism") or {}
  if det:
    out += ["", "## Determinism", ""] + md_table(["side", "deterministic", "detail"], [
        [s, "yes" if x["deterministic"] else "**no**", f"{x['detail']} (rerun of the first {x['steps_checked']} steps "
         "in a new process)"] for s, x in det.items()])
  res = d.get("resume") or {}
  if res:
    out += ["", "## Checkpoint / resume", ""] + md_table(
        ["side", "resumed at step", "bit-identical to the uninterrupted run", "detail"],
        [[s, x["resumed_at_step"], "yes" if x["bit_identical"] else "**no**", x["detail"]] for s, x in res.items()])
  return out


def report_markdown(d: dict, plots: dict[str, str], environment: dict | None = None) -> str:
  """report.md text. d: report.json data; plots: figure key -> (file name beside report.md, caption);
  environment: environment.json of the run folder, or None."""
  kind, sentence, sub = C.verdict_parts(d)
  out = [f"# parity report: {C.run_title(d)}", "", f"**{sentence}**", "", sub, ""]
  if d.get("write_errors"):
    out += ["**Some report files could not be written:** " + "; ".join(
        f"{e['file']}: {e['error']}" for e in d["write_errors"]), ""]
  out += ["Also: `report.html` (one page, plots inline), `report.json`, `card.json`, `metrics.jsonl`.", ""]
  out += ["## Checks", ""] + md_table(
      ["metric", "pair", "value is", "value", "tolerance", "result", "first failing step", "detail"],
      [[r["metric"], r["pair"], r["measure"], r["value"], r["tolerance"],
        r["result"] if r["passed"] or not r["gating"] else f"**{r['result']}**", r["first_failing_step"], r["detail"]]
       for r in C.check_rows(d)])
  out += ["", "Where each tolerance comes from:", ""]
  seen = set()
  for r in C.check_rows(d):
    if r["metric"] not in seen and r["source"]:
      seen.add(r["metric"])
      out.append(f"- **{r['metric']}**: {r['source']}")
  out += ["", "## Curves", ""]
  for key in ("loss", "delta", "grad_norm", "lr", "loss_scale"):
    if key in plots:
      out += [f"![{plots[key][1]}]({plots[key][0]})", ""]
  keys = ["side", "status", "steps", "loss", "val_loss", "tokens_per_s", "init_s", "compile_s", "op_build_s",
          "peak_rss", "peak_device", "memory_kinds", "backend"]
  out += ["## Sides", ""] + md_table(["side", "status", "steps", "loss first → last", "val loss", "tokens/s", "init s",
                                      "compile s", "op build s", "peak RSS", "peak device", "state by memory kind",
                                      "backend"], [[r[k] for k in keys] for r in C.side_rows(d)])
  for name, s in d["sides"].items():
    ranks = C.rank_table(s)
    if ranks:
      out += ["", f"{name}, per rank:", ""] + md_table(*ranks)
    if s.get("error"):
      out += ["", f"**{name} {s['status']}**:", "```", *s["error"].strip().splitlines()[-15:], "```"]
  mem = [r for r in ((d.get("memory") or {}).get("predicted_vs_measured") or []) if r["predicted"] or r["measured"]]
  if mem:
    out += ["", "## Memory: predicted vs measured", "", d["memory"]["note"] + ".", ""]
    out += [f"![{plots['memory'][1]}]({plots['memory'][0]})", ""] if "memory" in plots else []
    out += md_table(["side", "category", "memory kind", "predicted", "measured", "measured / predicted"],
                    [[r["side"], r["category"], r["memory_kind"], C.fmt_bytes(r["predicted"]),
                      C.fmt_bytes(r["measured"]), C.fmt(r["ratio"], ".3f")] for r in mem])
  tk = ["side", "backend", "repeats", "min_s", "median_s", "max_s", "tokens_per_s", "load", "op_build_s"]
  out += ["", "## Throughput", "", f"**{C.throughput_note(d)}**", ""]
  out += [f"![{plots['throughput'][1]}]({plots['throughput'][0]})", ""] if "throughput" in plots else []
  out += md_table(["side", "backend", "steps timed", "min s/step", "median s/step", "max s/step", "tokens/s",
                   "load (1 min) start → end", "op build s (not in init)"], [[r[k] for k in tk] for r in
                                                                             C.throughput_rows(d)])
  out += ["", "## Plan and placements", ""] + md_table(["item", "value"], C.plan_rows(d))
  if d.get("migration"):
    out += ["", f"DeepSpeed config **{d['migration']['source']}**: key-by-key migration table in "
            f"[migration.md](migration.md)."]
  out += _self_sections(d)
  out += ["", "## Environment", ""] + md_table(["item", "value"], C.environment_rows(d, environment))
  return "\n".join(out) + "\n"
