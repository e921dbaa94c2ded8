"""report.html, report.md (+ PNGs) and card.json of a real small run (gpt2-tiny, 3 steps, jax and torch), and the
wording a reviewer reads (issue #14)."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from conftest import requires_jax, requires_torch

RUN_NAME = "report-page-run"


def shared_run(tmp_path_factory) -> Path:
  """The run folder of one real comparison (gpt2-tiny, 3 steps, jax and torch, no determinism rerun), made once per
  test session and shared by this module and test_report_browser.py."""
  out = tmp_path_factory.getbasetemp() / RUN_NAME
  if not (out / "report.json").exists():
    from parity.pipeline.compare import compare
    compare("gpt2-tiny", steps=3, sides=["jax", "torch"], out=out, determinism_steps=0, force=True,
            command="pytest tests/test_report_page.py")
  return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  return shared_run(tmp_path_factory)


def _gfm_cells(row: str) -> int:
  """Cells of a GFM table row: split at bars not escaped with a backslash (GFM splits even inside code spans)."""
  inner = row.strip()
  inner = inner[1:] if inner.startswith("|") else inner
  inner = inner[:-1] if inner.endswith("|") and not inner.endswith("\\|") else inner
  return len(re.split(r"(?<!\\)\|", inner))


def _tables(md: str) -> list[list[str]]:
  tables, cur = [], []
  for line in md.splitlines():
    if line.startswith("|"):
      cur.append(line)
    elif cur:
      tables.append(cur)
      cur = []
  return tables + ([cur] if cur else [])


@pytest.mark.slow
@requires_jax
@requires_torch
def test_html_is_one_self_contained_page_with_the_verdict_and_every_plot(run_dir):
  page = (run_dir / "report.html").read_text(encoding="utf-8")
  assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", page), "a resource outside the file"
  assert "<script" not in page and "<link" not in page and "<iframe" not in page
  assert not re.search(r"url\((?!#)", page), "a CSS url() to anything but an element of the page itself"
  banner = re.search(r'<div class="banner pass" id="verdict"><strong>(.*?)</strong>', page)
  assert banner and banner.group(1).startswith("PASS: jax and torch agree within tolerance on every check over all 3 "
                                               "steps; largest per-step loss difference"), banner
  assert "at step" in banner.group(1) and "jax vs torch" in banner.group(1)
  figures = re.findall(r'<figure data-plot="(\w+)"><svg(.*?)</svg>', page, flags=re.S)
  assert [k for k, _ in figures] == ["loss", "delta", "grad_norm", "lr", "memory", "throughput"]
  assert all(body.count("<path") >= 5 for _, body in figures)
  for needle in ("where the tolerance comes from", "CPU backend", "Plan and placements", "project git revision",
                 "max abs Δloss"):
    assert needle in page, needle


@pytest.mark.slow
@requires_jax
@requires_torch
def test_markdown_tables_keep_their_cells_and_the_plots_sit_beside_it(run_dir):
  md = (run_dir / "report.md").read_text()
  tables = _tables(md)
  assert len(tables) >= 5
  for rows in tables:
    n = _gfm_cells(rows[0])
    assert all(_gfm_cells(r) == n for r in rows), rows
  assert "max abs Δloss" in md and "|Δ" not in md.replace("\\|", "")
  images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
  assert {"loss.png", "loss_delta.png", "grad_norm.png", "lr.png", "memory.png", "throughput.png"} <= set(images)
  assert all((run_dir / name).stat().st_size > 5000 for name in images)
  assert md.splitlines()[2].startswith("**PASS: jax and torch agree")


@pytest.mark.slow
@requires_jax
@requires_torch
def test_card_says_what_was_compared_with_what_and_the_key_figures(run_dir):
  card = json.loads((run_dir / "card.json").read_text())
  assert card["schema"] == "parity.card/1" and card["verdict"]["passed"] is True
  assert card["compared"]["sides"] == ["jax", "torch"] and card["compared"]["preset"] == "gpt2-tiny"
  assert card["compared"]["steps"] == 3 and card["compared"]["precision"] == "fp32"
  assert card["command"] == "pytest tests/test_report_page.py"
  assert 0 <= card["key_figures"]["max_abs_dloss"]["jax vs torch"] < 1e-5
  assert set(card["key_figures"]["tokens_per_s"]) == {"jax", "torch"}
  assert card["backend"] == {"jax": "cpu", "torch": "cpu"}
  assert {"jax", "torch", "numpy"} <= set(card["versions"])


@pytest.mark.slow
@requires_jax
@requires_torch
def test_throughput_reports_repeats_load_and_backend(run_dir):
  from parity.report.content import throughput_rows
  d = json.loads((run_dir / "report.json").read_text())
  rows = {r["side"]: r for r in throughput_rows(d)}
  assert rows["jax"]["repeats"] == 2 and rows["torch"]["repeats"] == 2  # 3 steps, the first left out as warmup
  assert all(r["backend"] == "cpu" and "→" in r["load"] for r in rows.values())
  assert float(rows["torch"]["min_s"]) <= float(rows["torch"]["median_s"]) <= float(rows["torch"]["max_s"])
  assert all(len(d["sides"][s]["load"]["start"]) == 3 for s in ("jax", "torch"))
  env = d["environment"]
  assert env["cpu_model"] and len(env["load_avg_1_5_15"]) == 3 and "git" in env


@pytest.mark.slow
@requires_jax
@requires_torch
def test_a_stopped_side_reads_as_stopped_and_its_init_as_na(run_dir):
  from parity.report.content import side_rows, verdict_parts
  d = copy.deepcopy(json.loads((run_dir / "report.json").read_text()))
  torch = d["sides"]["torch"]
  torch.update(status="killed", error="worker killed by signal SIGKILL")
  torch["summary"] = {"steps_completed": 1, "status": "killed"}
  for k in ("step", "loss", "grad_norm", "lr"):
    torch["series"][k] = torch["series"][k][:1]
  d["verdict"] = {"passed": False, "message": "FAIL: ...", "first_failure": {
      "check": "completed jax~torch", "metric": "completed", "sides": ["jax", "torch"], "step": 1, "value": 1,
      "tolerance": 3}}
  kind, sentence, _ = verdict_parts(d)
  assert kind == "fail" and sentence == "FAIL: torch stopped after 1 of 3 steps (killed)."
  assert "breaks tolerance" not in sentence
  assert {r["side"]: r["init_s"] for r in side_rows(d)}["torch"] == "n/a"


def test_markdown_cells_escape_bars_and_wording_reads_plainly():
  from parity.report.content import plain_detail, tolerance_text
  from parity.report.markdown import cell, md_table
  assert cell("max |a - b|") == "max \\|a - b\\|" and cell("a\nb") == "a b" and cell(None) == "n/a"
  assert all(_gfm_cells(r) == 3 for r in md_table(["a", "b|c", "d"], [["x | y", "`|`", "z"]]))
  assert plain_detail("worst h.0; 0 of 52 tensors over; rule") == "worst h.0; all 52 tensors within tolerance; rule"
  assert plain_detail("2 of 52 tensors over;") == "2 of 52 tensors over tolerance;"
  lr = {"metric": "lr", "tolerance": 0.0}
  assert tolerance_text(lr, {"lr": {"atol": 0.0, "rtol": 1e-6}}) == \
      "relative: 1e-06 × value (the values compared are 0 here)"


def test_delta_plot_draws_exact_zeros_on_a_labelled_floor_not_as_spikes():
  from parity.report import plots
  fig = plots.delta_figure({"a vs b": ([0, 1, 2, 3], [0.0, 2e-7, 0.0, 3e-7])}, title="t", tolerance=1e-5)
  ax = fig.axes[0]
  floor = ax.get_ylim()[0] * 3
  curve, zeros = ax.lines[0], ax.lines[1]
  ys = list(curve.get_ydata())
  assert ys[1] == 2e-7 and ys[0] != ys[0] and ys[2] != ys[2]  # zeros leave the log curve (NaN), no 1e-12 spike
  assert list(zeros.get_xdata()) == [0, 2] and all(abs(y - floor) < 1e-18 for y in zeros.get_ydata())
  assert any(t.get_text() == "= 0" for t in ax.texts) and "exactly 0 (2 steps)" in zeros.get_label()
  svg = plots.to_svg(fig, salt="t")
  assert svg.startswith("<svg") and "</svg>" in svg


def test_identical_curves_are_said_to_coincide_and_titles_wrap_at_words():
  from parity.report import plots
  assert plots.coincide({"a": ([0, 1], [5.0, 4.0]), "b": ([0, 1], [5.0, 4.0])}) == 0.0
  assert plots.coincide({"a": ([0, 1], [5.0, 4.0]), "b": ([0, 1], [5.0, 3.0])}) is None
  title = "training loss · " + " ".join(["gpt2-small-cpu"] * 12)
  assert all(line.endswith("gpt2-small-cpu") or line.endswith("·") for line in plots.wrap_title(title).split("\n"))
  fig = plots.line_figure({"a": ([0, 1], [5.0, 4.0]), "b": ([0, 1], [5.0, 4.0])}, title=title, ylabel="loss")
  assert fig.axes[0].get_title(loc="left").startswith("curves coincide")
  assert fig.axes[0].lines[0].get_linestyle() != fig.axes[0].lines[1].get_linestyle()
  plots.to_png(fig)
