"""`parity report RUN_DIR...` (parity/cli/report.py, parity/history/comparison.py): the comparison page over several
real runs, re-rendering one finished run, and folders that are not finished runs. The runs are test_gate.real_runs():
three gpt2-tiny runs (a baseline, a rerun, train.lr 1.1e-3), built once per session."""
from __future__ import annotations

import json
import re
import shutil
from types import SimpleNamespace
from pathlib import Path

import pytest

from parity.report.run_record import RunRecord, SideRecord

from test_gate import needs_runs, real_runs


def _dirs() -> list[str]:
  runs = real_runs()
  return [str(runs[k].run_dir) for k in ("base", "rerun", "lr")]


def _md_rows(text: str) -> list[list[str]]:
  """The cells of every GFM table row of `text`, split on unescaped bars, backslash escapes of punctuation removed
  (what a GFM renderer does)."""
  rows = []
  for line in text.splitlines():
    if line.startswith("|"):
      rows.append([re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", c.strip())
                   for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
  return rows


@needs_runs
def test_comparison_page_of_three_runs(tmp_path, capsys):
  from parity.cli import main
  from parity.history.comparison import COLUMNS
  out = tmp_path / "cmp"
  assert main(["report", *_dirs(), "-o", str(out)]) == 0
  assert "comparison:" in capsys.readouterr().out
  md = (out / "comparison.md").read_text()
  rows = _md_rows(md)
  assert len(rows) == 2 + 3 and all(len(r) == len(COLUMNS) for r in rows), rows  # no cell cut by a raw '|'
  by_run = {r[0]: dict(zip(COLUMNS, r)) for r in rows[2:]}
  assert by_run["base"]["differs from the first run"] == "(the first run)"
  assert by_run["rerun"]["differs from the first run"].startswith("nothing")
  assert by_run["lr"]["differs from the first run"] == "train.lr=0.0011"
  assert all(r["verdict"] == "PASS" and "jax~torch" in r["max |Δloss|"] for r in by_run.values())
  pngs = sorted(p.name for p in out.glob("comparison-*.png"))
  assert len(pngs) == 6 and all(f"]({name})" in md for name in pngs)
  html = (out / "comparison.html").read_text()
  assert html.count("<svg") == 6 and "3 of 3 runs hold parity" in html
  assert "<script" not in html and not re.search(r"(src|href)=\"https?:", html)  # no network, no script
  assert "regression gate: GATE FAIL" in md and "lr (jax)" in md  # the lr run was gated against the base run
  data = json.loads((out / "comparison.json").read_text())
  assert [r["label"] for r in data["runs"]] == ["base", "rerun", "lr"]


@needs_runs
def test_figures_of_a_run(tmp_path):
  from parity.history.comparison import load_runs, metric_values
  runs = load_runs(_dirs())
  base = runs[0]
  assert base.sides == ["jax", "torch"] and base.precision == "fp32" and base.steps == 4
  assert base.loss_tolerance == 1e-5 and 0 <= base.max_dloss["jax~torch"] <= 1e-5
  assert all(f["tokens_per_s"] > 0 and f["peak_rss_bytes"] > 0 for f in base.per_side.values())
  assert runs[2].differs == {"train.lr": 0.0011} and runs[1].differs == {}
  vals = metric_values(runs, "final_loss")
  assert set(vals) == {"jax", "torch"} and vals["jax"][0] == vals["jax"][1] != vals["jax"][2]


@needs_runs
def test_report_one_run_re_renders_from_its_files(tmp_path, capsys):
  from parity.cli import main
  run = Path(shutil.copytree(_dirs()[0], tmp_path / "run"))
  before = (run / "report.json").read_bytes()
  for name in ("report.html", "report.md", "card.json", "loss.png"):
    (run / name).unlink()
  assert main(["report", str(run)]) == 0
  assert "re-rendered from the run's files" in capsys.readouterr().out
  for name in ("report.html", "report.md", "card.json", "loss.png"):
    assert (run / name).stat().st_size > 0, name
  assert (run / "report.json").read_bytes() == before  # the record is not rewritten


@needs_runs
def test_a_run_whose_files_changed_is_flagged(tmp_path, capsys):
  from parity.cli import main
  d = _dirs()
  edited = Path(shutil.copytree(d[2], tmp_path / "edited"))
  with open(edited / "jax" / "steps.jsonl", "a") as f:
    f.write("\n")
  assert main(["report", d[0], str(edited), "-o", str(tmp_path / "cmp")]) == 1
  assert "files changed" in capsys.readouterr().out
  md = (tmp_path / "cmp" / "comparison.md").read_text()
  assert "files changed since its verdict" in md and "UNVERIFIED (files changed:" in md and "steps.jsonl" in md
  assert "**1 of 2 runs hold parity. Failed the regression gate" in md and "PASS (files changed)" not in md


def test_folders_that_are_not_finished_runs_exit_2(tmp_path, capsys):
  from parity.cli import main
  (tmp_path / "empty").mkdir()
  assert main(["report", str(tmp_path / "empty")]) == 2
  assert "neither report.json nor request.json" in capsys.readouterr().err
  unfinished = tmp_path / "unfinished"
  (unfinished / "jax").mkdir(parents=True)
  (unfinished / "request.json").write_text("{}")
  (unfinished / "jax" / "steps.jsonl").write_text('{"step": 0, "loss": 5.0}\n{"step": 1, "loss": 4.9}\n')
  assert main(["report", str(unfinished), str(tmp_path / "empty")]) == 2
  err = capsys.readouterr().err
  assert "unfinished run" in err and "report.json is missing" in err and "jax: 2 steps recorded" in err
  assert main(["report", str(tmp_path / "nowhere")]) == 2
  assert "not a folder" in capsys.readouterr().err
  assert main(["check", str(unfinished), str(tmp_path / "empty")]) == 2


@needs_runs
def test_same_folder_twice_and_a_run_folder_as_output_are_refused(tmp_path, capsys):
  from parity.cli import main
  d = _dirs()
  assert main(["report", d[0], d[0] + "/", "-o", str(tmp_path / "x")]) == 2
  assert "given twice" in capsys.readouterr().err
  assert main(["report", d[0], d[1], "-o", d[2]]) == 2
  assert "is a parity run folder" in capsys.readouterr().err
  inside = Path(d[2]) / "jax"  # a side's folder: the files would look like the run's own
  before = sorted(p.name for p in inside.iterdir())
  assert main(["report", d[0], d[1], "-o", str(inside)]) == 2
  assert f"is inside the parity run folder {Path(d[2]).absolute()}" in capsys.readouterr().err
  assert sorted(p.name for p in inside.iterdir()) == before


@needs_runs
def test_comparison_page_in_a_browser(tmp_path):
  """The comparison page as a person sees it, with the single-run page's headless Chromium helper: no console error,
  every plot parsed into a drawn SVG, the sentence on top, a screenshot that is not blank."""
  import test_report_browser as browser
  if browser.CHROMIUM is None:
    pytest.skip("headless Chromium not installed: `apt-get install -y chromium` (Debian) for the browser test")
  import numpy as np
  from matplotlib import image
  from parity.history.comparison import load_runs, write_comparison
  page = write_comparison(load_runs(_dirs()), tmp_path / "cmp")["html"]
  r = browser.chromium(page, tmp_path, "--dump-dom")
  assert r.returncode == 0 and browser.console_errors(r.stderr) == [], r.stderr[-2000:]
  banner = re.search(r'id="verdict"><strong>(.*?)</strong>', r.stdout)
  assert banner and banner.group(1) == "3 of 3 runs hold parity. Failed the regression gate against its baseline " \
                                       "(gate.md): lr."  # the lr run failed its gate against base
  figures = re.findall(r'<figure data-plot="(\w+)">(.*?)</figure>', r.stdout, flags=re.S)
  assert [k for k, _ in figures] == ["max_dloss", "final_loss", "tokens_per_s", "step_time_s_median",
                                     "peak_rss_bytes", "loss_curves"]
  for key, body in figures:
    size = re.search(r'<svg[^>]*\bwidth="([\d.]+)pt"[^>]*\bheight="([\d.]+)pt"', body)
    assert size and float(size.group(1)) > 100 and float(size.group(2)) > 100 and body.count("<path") >= 5, key
  shot = tmp_path / "comparison.png"
  r = browser.chromium(page, tmp_path, f"--screenshot={shot}", "--window-size=1400,3000", "--hide-scrollbars")
  assert r.returncode == 0 and shot.exists() and browser.console_errors(r.stderr) == [], r.stderr[-2000:]
  px = image.imread(str(shot))[..., :3]
  ink = (px.min(axis=2) < 0.5).mean(axis=1)
  assert (ink > 0.001).mean() > 0.5, "most of the page's height should carry text, tables or plots"
  amber = px[60:200, 100:1300].reshape(-1, 3)  # the warn banner (#fff6e0): the lr run failed its gate
  assert np.mean((amber[:, 0] > amber[:, 2] + 0.05) & (amber[:, 1] > amber[:, 2] + 0.03)) > 0.3, "an amber banner"


@needs_runs
def test_an_edited_report_is_unverified_and_refused(tmp_path, capsys):
  """A report.json whose check is marked passed beyond its tolerance (a FAIL flipped to PASS by hand) is refused
  by `parity report RUN` and `parity check`, and shown UNVERIFIED (not counted) on a comparison page."""
  from parity.cli import main
  d = _dirs()
  edited = Path(shutil.copytree(d[1], tmp_path / "edited"))
  data = json.loads((edited / "report.json").read_text())
  loss = next(c for c in data["checks"] if c["metric"] == "loss")
  loss["value"] = loss["tolerance"] * 4.32  # a failing figure left marked passed, like a flipped FAIL run
  (edited / "report.json").write_text(json.dumps(data))
  assert main(["report", str(edited)]) == 1
  err = capsys.readouterr().err
  assert "report.json does not match its checks" in err and "is marked passed" in err, err
  assert main(["check", str(edited), d[0]]) == 2
  assert main(["report", d[0], str(edited), "-o", str(tmp_path / "cmp")]) == 1
  assert "UNVERIFIED" in capsys.readouterr().out
  md = (tmp_path / "cmp" / "comparison.md").read_text()
  assert "**1 of 2 runs hold parity.**" in md and "UNVERIFIED (files changed:" in md
  assert "1 of 2 runs hold parity" in (tmp_path / "cmp" / "comparison.html").read_text()


@needs_runs
def test_comparison_output_folder_is_not_overwritten_or_left_half_written(tmp_path, capsys):
  """-o holding the user's comparison.md is refused (exit 2, the file named, --force replaces it); a folder we
  wrote is rewritten; an unwritable -o is exit 2 naming the file, with no traceback and no partial files."""
  from parity.cli import main
  d = _dirs()
  usr = tmp_path / "usr"
  usr.mkdir()
  (usr / "comparison.md").write_text("the user's notes")
  assert main(["report", d[0], d[1], "-o", str(usr)]) == 2
  err = capsys.readouterr().err
  assert "comparison.md" in err and "--force" in err and (usr / "comparison.md").read_text() == "the user's notes"
  assert main(["report", d[0], d[1], "-o", str(usr), "--force"]) == 0
  assert main(["report", d[0], d[1], "-o", str(usr)]) == 0  # comparison.json marks the folder as ours now
  bad = tmp_path / "bad"
  (bad / "comparison.md").mkdir(parents=True)  # a file that cannot be written (works as root, unlike chmod)
  assert main(["report", d[0], d[1], "-o", str(bad), "--force"]) == 2
  err = capsys.readouterr().err
  assert "cannot write" in err and "comparison.md" in err and "internal error" not in err and "Traceback" not in err
  assert sorted(p.name for p in bad.iterdir()) == ["comparison.md"]  # the PNGs written before it were removed


def test_fail_sentence_keeps_its_brackets_balanced():
  from parity.report.cells import first_clause
  text = "tensor wte: max ratio 4.32 (4.32x; bound 2e-3·moved + Adam noise); 3 tensors over"
  assert first_clause(text) == "tensor wte: max ratio 4.32 (4.32x; bound 2e-3·moved + Adam noise)"
  assert first_clause("no clause") == "no clause"


def test_perturb_and_nproc_are_part_of_what_differs(tmp_path):
  """launch.json's nproc and request.json's perturb are compared like spec keys (the comparison page's "differs"
  column and the gate's configuration note read the same keys)."""
  from parity.report.runconfig import config_diff, launch_config
  a, b = tmp_path / "a", tmp_path / "b"
  a.mkdir()
  b.mkdir()
  (a / "request.json").write_text(json.dumps({"perturb": {}}))
  (b / "request.json").write_text(json.dumps({"perturb": {"torch": {"lr_scale": 1.1}}}))
  (b / "launch.json").write_text(json.dumps({"schema": "parity.launch/1", "nproc": 2}))
  assert launch_config(a) == {"nproc": 1}
  assert config_diff(launch_config(a), launch_config(b)) == {"nproc": (1, 2), "perturb.torch.lr_scale": (None, 1.1)}


def test_gate_names_a_baseline_moved_aside_by_force(tmp_path):
  """`--out X --baseline X --force`: the old X was moved aside; the gate names where it is now, not X."""
  from parity.history.after import baseline_as_moved
  from parity.report.build import Report
  from test_gate import _snap
  x, old = tmp_path / "X", tmp_path / "X.old-1"
  x.mkdir()
  report = Report(data={"run_folder": {"moved_aside_to": str(old)}}, run_dir=x)
  assert baseline_as_moved(_snap(True, str(x)), report).source == old
  assert baseline_as_moved(_snap(True, str(x / "card.json")), report).source == old / "card.json"
  other = _snap(True, str(tmp_path / "elsewhere"))
  assert baseline_as_moved(other, report) is other


@needs_runs
def test_report_one_run_prints_only_what_it_wrote(tmp_path, capsys):
  """A re-render that cannot write report.html (here a folder in its place: works as root too) exits 1 and names
  it as not written, never as "report: .../report.html"; `check A nonexist` names the positional BASELINE."""
  from parity.cli import main
  run = Path(shutil.copytree(_dirs()[0], tmp_path / "run"))
  (run / "report.html").unlink()
  (run / "report.html").mkdir()
  assert main(["report", str(run)]) == 1
  out = capsys.readouterr().out
  assert "could not write" in out and "report.html" in out and "report: " not in out, out
  assert main(["check", _dirs()[1], str(tmp_path / "nonexist")]) == 2
  err = capsys.readouterr().err
  assert "BASELINE" in err and "--baseline" not in err


def test_rank_table_headers_do_not_promise_bytes():
  from parity.report.side_table import rank_table
  cols, rows = rank_table(SideRecord.of("side", {"summary": {"ranks": [{"rank": 0, "peak_rss_bytes": 3 * 2**20}]}}))
  assert cols == ["rank", "peak rss"] and "MiB" in rows[0][1]


def test_check_flags_are_recomputed_from_their_figures():
  """verify_report's rule per check kind: a check marked passed must have value <= tolerance (>= for completed and
  updates), a finite value, and only determinism may be stored as not gating."""
  from parity.report.read import check_contradictions
  ok = [{"name": "loss a~b", "metric": "loss", "value": 1e-6, "tolerance": 1e-5, "passed": True},
        {"name": "completed a~b", "metric": "completed", "value": 4.0, "tolerance": 4.0, "passed": True},
        {"name": "updates a~b", "metric": "updates", "value": 2.0, "tolerance": 1.0, "passed": True},
        {"name": "determinism a", "metric": "determinism", "value": 0.1, "tolerance": 0.0, "passed": False,
         "gating": False},
        {"name": "params a~b", "metric": "params", "value": 3.0, "tolerance": 2.0, "passed": False}]
  assert check_contradictions(ok) == []
  bad = [{"name": "grad_norm a~b", "metric": "grad_norm", "value": 4.32e-4, "tolerance": 1e-4, "passed": True},
         {"name": "completed a~b", "metric": "completed", "value": 2.0, "tolerance": 4.0, "passed": True},
         {"name": "loss a~b", "metric": "loss", "value": None, "tolerance": 1e-5, "passed": True},
         {"name": "params a~b", "metric": "params", "value": 3.0, "tolerance": 2.0, "passed": False, "gating": False}]
  found = check_contradictions(bad)
  assert [f.split(" ")[0] for f in found] == ["checks[0]", "checks[1]", "checks[2]", "checks[3]"], found


# ----------------------------------------------------------------------------- names that look like HTML or Markdown

HOSTILE = "<img src=x onerror=alert(1)> **bold** [link](javascript:x) _em_ ~~del~~ `code` &lt; | a"
"""A file or folder name a user may have (every character but '/' is allowed in one): raw HTML, emphasis, a link,
strikethrough, code, an entity and a table bar."""


def _render(md: str) -> str:
  """`md` rendered as GitHub renders it (CommonMark + tables + strikethrough; markdown-it-py comes with rich)."""
  markdown_it = pytest.importorskip("markdown_it")
  return markdown_it.MarkdownIt("commonmark").enable(["table", "strikethrough"]).render(md)


def _as_typed(html: str, text: str) -> None:
  """`text` appears in the rendered `html` as plain text: escaped, inside no tag the name made."""
  import html as _html
  assert _html.escape(text, quote=False) in html, (text, html)
  made = ("<img src=x", 'href="javascript:x"', "<em>em</em>", "<strong>bold</strong>", "<s>del</s>", "<del>del</del>",
          "<code>code</code>", "<script>", "<h1>heading", "<li>item", "<h1>[x]")
  assert not [m for m in made if m in html], html  # no element made from the name's characters


def test_md_text_renders_every_hostile_name_as_typed():
  from parity.report.markdown import cell, code_block, md_table, md_text
  for text in (HOSTILE, "# heading", "1. item", "- item", "+ item", "===", "a\n<script>x</script>", "\\*x\\*"):
    flat = " ".join(text.splitlines())
    _as_typed(_render(f"- {md_text(text)}"), flat)
    _as_typed(_render(f"{md_text(text)}\n"), flat)
    rows = md_table(["name", "x"], [[text, "1"]])
    assert len(re.split(r"(?<!\\)\|", rows[2])) == 4, rows  # no bar cut the row
    _as_typed(_render("\n".join(rows)), flat)
  assert cell("-0.5") == "-0.5" and md_text("-0.5") == "\\-0.5"  # a cell never starts a block: no escape there
  block = code_block(["```", "x ```` y"])
  assert block[0] == block[-1] == "`````" and "<code>```\nx ```` y\n</code>" in _render("\n".join(block))


@needs_runs
def test_report_md_keeps_no_html_or_markdown_from_file_and_folder_names(tmp_path):
  """report.md of a run whose command, output folder and DeepSpeed config are named like HTML and Markdown (the
  title, the plan rows, the command row and the migration line quote them): every one renders as typed."""
  from parity.report.markdown import report_markdown
  d = json.loads((Path(_dirs()[0]) / "report.json").read_text())
  d["run_folder"] = {**(d.get("run_folder") or {}), "command": f"parity compare --out '{HOSTILE}'"}
  d["migration"] = {"source": f"{HOSTILE}.json", "status": "ok", "file": "migration.md"}
  d["write_errors"] = [{"file": f"{HOSTILE}.png", "error": "disk full"}]
  html = _render(report_markdown(RunRecord.of(d), {}))
  _as_typed(html, f"parity compare --out '{HOSTILE}'")
  _as_typed(html, f"{HOSTILE}.json")
  assert html.count(f"{_esc(HOSTILE)}.json") >= 3  # title, plan row, migration line


def _esc(text: str) -> str:
  import html as _html
  return _html.escape(text, quote=False)


@needs_runs
def test_comparison_md_keeps_no_html_or_markdown_from_folder_names(tmp_path):
  from parity.cli import main
  from parity.history.comparison import COLUMNS
  d = _dirs()
  a = Path(shutil.copytree(d[0], tmp_path / HOSTILE))
  b = Path(shutil.copytree(d[1], tmp_path / "# [x](y)"))
  assert main(["report", str(a), str(b), "-o", str(tmp_path / "cmp")]) == 0
  md = (tmp_path / "cmp" / "comparison.md").read_text()
  rows = _md_rows(md)
  assert len(rows) == 2 + 2 and all(len(r) == len(COLUMNS) for r in rows), rows
  assert [r[0] for r in rows[2:]] == [HOSTILE, "# [x](y)"]
  html = _render(md)
  _as_typed(html, HOSTILE)
  _as_typed(html, str(a))  # the folder, in the list of runs
  assert html.count("<h1>") == 1  # the page's own title; '# [x](y)' starts no heading


# ----------------------------------------------------------------------------- the page in a browser

def _figures(label: str, differs: dict, problems: tuple = ()):
  from parity.history.comparison import RunFigures
  sides = ["jax", "deepspeed", "torch"]
  return RunFigures(
      label=label, run_dir=Path("/runs") / label, preset="gpt2-tiny", precision="bf16",
      plan="DeepSpeed config ds_zero3_offload_config_final.json (zero3-offload-all)", sides=sides, steps=200,
      passed=not problems, verdict="PASS", max_dloss={"jax~deepspeed": 1.234e-6, "jax~torch": 2.5e-7,
                                                     "deepspeed~torch": 3.1e-6},
      loss_tolerance=1e-5, per_side={s: {"status": "ok", "tokens_per_s": 123456.0, "step_time_s_median": 0.0123,
                                         "peak_rss_bytes": 2.5e9, "peak_device_bytes": None, "final_loss": 3.2}
                                     for s in sides},
      versions={"jax": "0.4.35", "torch": "2.5.1"}, config={}, differs=differs, problems=list(problems))


LAYOUT_PROBE = """<script>addEventListener('load', () => {
  const ths = [...document.querySelector('table').querySelectorAll('th')];  // the first table: key figures
  const right = ths.map(th => th.textContent + '=' + Math.ceil(th.getBoundingClientRect().right));
  document.body.insertAdjacentHTML('beforeend', '<pre id="probe">' + document.documentElement.clientWidth + ' ' +
    document.documentElement.scrollWidth + ' ' + right.join(';') + '</pre>'); });</script>"""
"""Added to a copy of the page: writes the viewport width, the page's scroll width and each header's right edge."""


@pytest.mark.process
@pytest.mark.slow
def test_key_figures_table_shows_every_column_in_a_1400px_window(tmp_path):
  """Three sides, a long folder name, an UNVERIFIED verdict and five differing keys (the failing case: the table ran
  to 2,511 px and hid "differs from the first run"): in a 1400 px window every column's right edge is on screen."""
  from test_report_browser import CHROMIUM, chromium
  if CHROMIUM is None:
    pytest.skip("headless Chromium not installed: `apt-get install -y chromium` (Debian)")
  from parity.history.comparison import COLUMNS, comparison_html
  runs = [_figures("baseline-run-2026-11-30", {}),
          _figures("lr-sweep-0.0011-with-a-long-folder-name", {"train.lr": 0.0011, "train.weight_decay": 0.11,
                                                               "model.n_layers": 4, "jax.remat": "full"}),
          _figures("gelu", {"model.mlp": "gelu_tanh"}, ("steps.jsonl changed since the verdict (sha256 differs)",))]
  page = tmp_path / "comparison.html"
  page.write_text(comparison_html(runs, {}).replace("</body>", LAYOUT_PROBE + "</body>"))
  r = chromium(page, tmp_path, "--dump-dom", "--window-size=1400,900")
  probe = re.search(r'<pre id="probe">(\d+) (\d+) (.*?)</pre>', r.stdout)
  assert r.returncode == 0 and probe, r.stderr[-2000:]
  width, scroll = int(probe.group(1)), int(probe.group(2))
  edges = dict(x.rsplit("=", 1) for x in probe.group(3).split(";"))
  assert list(edges) == list(COLUMNS) and scroll == width, probe.group(0)
  assert all(int(v) <= width for v in edges.values()), (width, edges)


def test_a_run_that_compared_no_pair_is_not_a_pass_on_the_comparison_page():
  """A ONE SIDE (or INTERRUPTED) run's stored flag may be true, but it compared nothing: its cell says what its own
  headline says and it does not count as holding parity (found on an fsdp run)."""
  from parity.history.comparison import holds, verdict_cell
  for message, word in (("ONE SIDE: fsdp ran ok; nothing to compare", "ONE SIDE"),
                        ("INTERRUPTED: stopped by Ctrl-C at step 3", "INTERRUPTED")):
    r = SimpleNamespace(passed=True, problems=[], verdict=message)
    assert verdict_cell(r) == word and not holds(r)
  ok = SimpleNamespace(passed=True, problems=[], verdict="PASS: jax and torch agree")
  assert verdict_cell(ok) == "PASS" and holds(ok)
