"""report.html, report.md (+ PNGs) and card.json of a real small run (gpt2-tiny, 3 steps, jax and torch), and the
wording a reviewer reads."""
from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path

import pytest

from parity.report.run_record import CheckRecord, RunRecord, SideRecord

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


@pytest.mark.process
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


@pytest.mark.process
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


@pytest.mark.process
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


@pytest.mark.process
@pytest.mark.slow
@requires_jax
@requires_torch
def test_throughput_reports_repeats_load_and_backend(run_dir):
  from parity.report.side_table import throughput_rows
  d = json.loads((run_dir / "report.json").read_text())
  rows = {r["side"]: r for r in throughput_rows(RunRecord.of(d))}
  assert rows["jax"]["repeats"] == 2 and rows["torch"]["repeats"] == 2  # 3 steps, the first left out as warmup
  assert all(r["backend"] == "cpu" and "→" in r["load"] for r in rows.values())
  assert float(rows["torch"]["min_s"]) <= float(rows["torch"]["median_s"]) <= float(rows["torch"]["max_s"])
  assert all(len(d["sides"][s]["load"]["start"]) == 3 for s in ("jax", "torch"))
  env = d["environment"]
  assert env["cpu_model"] and len(env["load_avg_1_5_15"]) == 3 and "git" in env


@pytest.mark.process
@pytest.mark.slow
@requires_jax
@requires_torch
def test_a_stopped_side_reads_as_stopped_and_its_init_as_na(run_dir):
  from parity.report.headline import verdict_parts
  from parity.report.side_table import side_rows
  d = copy.deepcopy(json.loads((run_dir / "report.json").read_text()))
  torch = d["sides"]["torch"]
  torch.update(status="killed", error="worker killed by signal SIGKILL")
  torch["summary"] = {"steps_completed": 1, "status": "killed"}
  for k in ("step", "loss", "grad_norm", "lr"):
    torch["series"][k] = torch["series"][k][:1]
  d["verdict"] = {"passed": False, "message": "FAIL: ...", "first_failure": {
      "check": "completed jax~torch", "metric": "completed", "sides": ["jax", "torch"], "step": 1, "value": 1,
      "tolerance": 3}}
  kind, sentence, _ = verdict_parts(RunRecord.of(d))
  assert kind == "fail" and sentence == "FAIL: torch stopped after 1 of 3 steps (killed)."
  assert "breaks tolerance" not in sentence
  assert {r["side"]: r["init_s"] for r in side_rows(RunRecord.of(d))}["torch"] == "n/a"


def test_markdown_cells_escape_bars_and_wording_reads_plainly():
  from parity.report.check_table import plain_detail, tolerance_text
  from parity.report.markdown import cell, md_table
  assert cell("max |a - b|") == "max \\|a - b\\|" and cell("a\nb") == "a b" and cell(None) == "n/a"
  assert all(_gfm_cells(r) == 3 for r in md_table(["a", "b|c", "d"], [["x | y", "`|`", "z"]]))
  assert plain_detail("worst h.0; 0 of 52 tensors over; rule") == "worst h.0; all 52 tensors within tolerance; rule"
  assert plain_detail("2 of 52 tensors over;") == "2 of 52 tensors over tolerance;"
  tols = {"lr": {"atol": 0.0, "rtol": 1e-6}}
  # the quoted step's values are 0 (a difference there would fail the check) ...
  assert tolerance_text(CheckRecord.of({"metric": "lr", "tolerance": 0.0, "value": 1e-9}), tols) == \
      "relative: 1e-06 × value (the values compared are 0 at the step quoted)"
  # ... but an all-zero Δ quotes an arbitrary step (an lr-0 warmup step too): it must not claim the lr is 0
  assert tolerance_text(CheckRecord.of({"metric": "lr", "tolerance": 0.0, "value": 0.0}), tols) == \
      "relative: 1e-06 × value (every difference is 0, so no one step's bound is quoted)"


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


# ------------------------------------------------------------------------------ like with like, true labels
# Synthetic report.json data, built with the real contract code (the RunSpec, the verdict's own checks, the memory
# model): each quoted case of the issue, without running a side.

def _synthetic(precision: str = "fp32", sides=("jax", "torch", "deepspeed"), steps: int = 6, overrides=(),
               lrs=None) -> dict:
  """report.json data of a finished run that agreed everywhere: every side's series, summary (the byte counts the
  workers write for gpt2-tiny's default plans), and the checks parity.verdict makes of them."""
  from parity.pipeline.resolve import resolve
  from parity.sizing import measured, memory
  from parity.spec import to_dict
  from parity.verdict.steps import completion_check, series_check, updates_check
  from parity.verdict.tolerances import TOLERANCES
  spec = resolve("gpt2-tiny", steps=steps, overrides=[f"train.precision={precision}", *overrides])
  n = memory.param_count(spec.model)
  lrs = lrs if lrs is not None else [0.0, 0.0] + [1e-3] * (steps - 2)
  recs = [{"step": i, "loss": 5.0 - 0.1 * i, "grad_norm": 1.0, "lr": lrs[i]} for i in range(steps)]
  summaries = {
      "jax": {"device": "cpu:0", "tokens_per_s": 1000.0, "peak_host_rss_bytes": 4 << 20,
              "state_bytes_by_memory_kind": {"device": 4 * n, "pinned_host": 8 * n + 12},
              "state_memory_kinds": {"params": "device", "opt_state": "pinned_host"}},
      "torch": {"device": "cpu", "tokens_per_s": 900.0, "peak_host_rss_bytes": 3 << 20,
                "state_bytes_by_memory_kind": {"device": 16 * n, "host": 0},
                "state_bytes_by_category": {"params": {"device": 4 * n, "host": 0},
                                            "gradients": {"device": 4 * n, "host": 0},
                                            "optimizer_moments": {"device": 8 * n, "host": 0}}},
      "deepspeed": {"device": "cpu", "tokens_per_s": 800.0, "peak_host_rss_bytes": 5 << 20}}
  series = {k: [r[k] for r in recs] for k in ("step", "loss", "grad_norm", "lr")}
  series.update(loss_scale=[1.0] * steps, skipped=[False] * steps, step_time_s=[0.01] * steps,
                tokens=[128] * steps, val_step=[], val_loss=[])
  checks = []
  names = list(sides)
  for i, a in enumerate(names):
    for b in names[i + 1:]:
      checks += [completion_check(a, "ok", steps, b, "ok", steps, steps), updates_check(a, recs, b, recs)]
      checks += [series_check(m, a, recs, b, recs, precision) for m in ("loss", "grad_norm", "lr")]
  checks = [c.to_json() for c in checks]
  if precision != "fp32":  # the envelope decides: the per-step series checks are reported only
    for c in checks:
      c["gating"] = c["metric"] not in ("loss", "grad_norm")
  d = {"preset": "gpt2-tiny", "checkpoint": None, "run": to_dict(spec), "plan": {"name": "zero2-offload"},
       "migration": None, "checks": checks, "tolerances": {precision: {m: dataclasses.asdict(t) for m, t in
                                                                      TOLERANCES[precision].items()}},
       "verdict": {"passed": True, "message": "PASS", "first_failure": None},
       "sides": {s: {"status": "ok", "summary": summaries[s], "series": copy.deepcopy(series),
                     "load": {"start": [1.0, 1.0, 1.0], "end": [3.5, 2.0, 1.0]}} for s in sides},
       "environment": {"cpu_count": 2}}
  d["memory"] = {"predicted_vs_measured": measured.predicted_vs_measured(d), "note": "predicted vs measured"}
  return d


def _envelope(d: dict, a: str, b: str, value: float, bound: float) -> dict:
  return {"name": f"loss_envelope {a}~{b}", "metric": "loss_envelope", "sides": [a, b], "value": value,
          "tolerance": bound, "passed": value <= bound, "first_failing_step": None, "worst": "steps 0-5",
          "detail": "", "reason": "", "gating": True}


def test_memory_bars_carry_the_same_categories_on_every_side_and_say_what_is_not_measured():
  """A reported defect: JAX was one 'state' bar with no gradients or activations, the others had them."""
  from parity.report import side_table
  from parity.report import plots
  d = _synthetic()
  rows = [r for r in d["memory"]["predicted_vs_measured"] if r["category"] != "peak_rss"]
  cats = {s: {r["category"] for r in rows if r["side"] == s} for s in d["sides"]}
  assert cats["jax"] == cats["torch"] == cats["deepspeed"] and "state" not in cats["jax"]
  pred = {s: sum(r["predicted"] or 0 for r in rows if r["side"] == s) for s in d["sides"]}
  # fp32, no sharding: the same model's bytes, not 4x apart; JAX's opt_state adds its three scalar counters (12 B)
  assert pred["jax"] - pred["torch"] == 12
  by = {(r["side"], r["category"], r["memory_kind"]): r for r in rows}
  assert by[("jax", "params", "device")]["ratio"] == by[("jax", "optimizer_moments", "host")]["ratio"] == 1.0
  gaps = side_table.memory_gaps(RunRecord.of(d))
  assert "gradients on jax" in gaps and "activations on jax, torch, deepspeed" in gaps
  fig = plots.memory_figure(d["memory"]["predicted_vs_measured"], title="t")
  legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
  assert "activations" in legend and "gradients" in legend and any("predicted only" in t for t in legend)
  totals = [t.get_text() for t in fig.axes[0].texts]
  assert totals[0] == totals[2] == f"{pred['jax'] / 2**20:.3g}"  # the total on jax's predicted bar = torch's
  plots.to_png(fig)
  # params and opt_state in one memory kind: measured together, neither called "not measured"
  shared = _synthetic(overrides=["jax.offload_opt_state=false"])
  js = shared["sides"]["jax"]["summary"]
  js.update(state_bytes_by_memory_kind={"device": sum(js["state_bytes_by_memory_kind"].values())},
            state_memory_kinds={"params": "device", "opt_state": "device"})
  from parity.sizing.measured import predicted_vs_measured
  shared["memory"]["predicted_vs_measured"] = rows = predicted_vs_measured(shared)
  assert [r["ratio"] for r in rows if r["side"] == "jax" and r["category"] == "state"] == [1.0]
  gaps = side_table.memory_gaps(RunRecord.of(shared))
  assert "params on jax" not in gaps and "optimizer moments on jax" not in gaps and "measured together" in gaps


def test_the_terminal_gives_jax_bytes_and_the_throughput_caveat():
  """A reported defect: the terminal showed 'params on device' for JAX and tokens/s with no caveat."""
  from rich.console import Console
  from parity.cli.compare import print_summary
  from parity.report.build import Report
  con = Console(record=True, width=200)
  print_summary(Report(data=_synthetic(), run_dir=Path("/tmp/x")), con)
  out = con.export_text()
  jax_line = next(line for line in out.splitlines() if line.startswith("│ jax"))
  assert "device: 471.0 KiB (params)" in jax_line
  assert "CPU backend" in out and "one after another" in out and "1-minute load 1.00 to 3.50" in out


def test_a_checkpoint_run_is_titled_by_the_checkpoint_on_every_page(tmp_path):
  """A reported defect: an --hf-model LLaMA run was titled 'gpt2-tiny' in report.html, report.md and card.json."""
  from parity.report import cells, headline
  from parity.report.build import checkpoint_record
  from parity.report.card import make_card
  from parity.report.markdown import report_markdown
  from parity.report.page import report_html
  (tmp_path / "tiny-llama").mkdir()
  (tmp_path / "tiny-llama" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
  d = _synthetic(overrides=["model.norm=rmsnorm", "model.mlp=swiglu", "model.position=rope", "model.bias=false",
                            "model.n_kv_heads=1", "model.tie_embeddings=false"])
  d["checkpoint"] = checkpoint_record(str(tmp_path / "tiny-llama"))
  from parity.spec import ModelSpec, from_dict
  from parity.weights import n_params
  n = n_params(from_dict(ModelSpec, d["run"]["model"]))
  want = f"checkpoint tiny-llama (LlamaForCausalLM, llama family, {cells.fmt_count(n)} params"
  rec = RunRecord.of(d)
  assert headline.run_title(rec).startswith(want) and "training settings of gpt2-tiny" in headline.run_title(rec)
  assert report_markdown(rec, {}).splitlines()[0] == f"# parity report: {headline.run_title(rec)}"
  assert f"<h1>parity report · {headline.run_title(RunRecord.of(d))}</h1>" in report_html(RunRecord.of(d), {}, tmp_path)
  card = make_card(RunRecord.of(d))
  assert card["compared"]["title"] == headline.run_title(rec) and card["compared"]["model"]["name"].startswith(want)
  assert card["compared"]["checkpoint"]["architecture"] == "LlamaForCausalLM"
  assert checkpoint_record(None) is None and checkpoint_record(str(tmp_path / "gone"))["architecture"] is None
  assert headline.model_label(RunRecord.of(_synthetic())) == "gpt2-tiny (gpt2 family, 120.6 K params)"


def test_a_bf16_pass_quotes_the_envelope_bound_that_decided():
  """A reported defect: the bf16 PASS sentence quoted the per-step loss bound 0.02, which does not gate."""
  from parity.report import headline
  d = _synthetic("bf16")
  d["checks"] += [_envelope(d, "jax", "torch", 1.1e-4, 1.88e-3), _envelope(d, "jax", "deepspeed", 7.5e-5, 1.6e-3)]
  sentence = headline.verdict_parts(RunRecord.of(d))[1]
  assert "noise envelope decides: worst loss window rms Δloss 0.00011 (jax vs torch, steps 0-5) within its envelope "\
      "bound 0.00188" in sentence
  assert "tolerance 0.02" not in sentence and "bound of 0.02 that is reported only" in sentence
  d["checks"][2] = {**d["checks"][2], "passed": False}  # a reported-only check over its bound: not "every check"
  assert "on every gating check (1 reported-only check over its bound: loss jax~torch)" in \
      headline.verdict_parts(RunRecord.of(d))[1]


def test_the_params_label_says_what_its_value_is_under_each_rule():
  """A reported defect: under the per-tensor rule the params value is a ratio, labelled 'element abs Δ'."""
  from parity.report import check_table
  d = _synthetic("bf16")
  tols = d["tolerances"]["bf16"]
  fallback = {"name": "params jax~torch", "metric": "params", "sides": ["jax", "torch"], "value": 0.171,
              "tolerance": 0.5, "passed": True, "first_failing_step": None, "worst": "wte.weight", "gating": False,
              "detail": "worst tensor wte.weight: max |Δ| = 0.000374, moved 0.00219 from init (ratio 0.171); 0 of 28 "
                        "tensors over; rule: per-tensor fallback (bf16: the per-element rule is measured in fp32 only)",
              "reason": ""}
  adam = {**fallback, "value": 5.96e-08, "tolerance": 4.01e-06,
          "detail": "worst tensor h.1.ln_1.weight: element |Δ| = 5.96e-08 vs allowed 4.01e-06; rule: Adam per element"}
  d["checks"] += [fallback]
  row = next(r for r in check_table.check_rows(RunRecord.of(d)) if r["metric"] == "params")
  assert "ratio" in row["measure"] and "element" not in row["measure"] and row["measure"] == check_table.RATIO_LABEL
  assert check_table.tolerance_text(CheckRecord.of(fallback), tols).startswith("0.5 (ratio bound")
  assert "Adam" not in check_table.tolerance_text(CheckRecord.of(fallback), tols)
  assert check_table.measure_label(CheckRecord.of(adam)) == "worst tensor: element abs Δ"
  assert "Adam noise term" in check_table.tolerance_text(CheckRecord.of(adam), _synthetic()["tolerances"]["fp32"])


def test_the_lr_source_names_the_schedule_that_ran_and_updates_say_why_steps_were_not_counted():
  """A reported defect: a WarmupLR run's lr source named WarmupCosineLR; 'updates 198 of 200' gave no reason."""
  from parity.report import check_table
  d = _synthetic(overrides=["train.lr_schedule=WarmupLR", 'train.lr_schedule_params={"warmup_min_lr": 0.0, '
                            '"warmup_max_lr": 1e-3, "warmup_num_steps": 3}'])
  rows = check_table.check_rows(RunRecord.of(d))
  lr = next(r for r in rows if r["metric"] == "lr")
  assert "DeepSpeed WarmupLR, the schedule this run used" in lr["source"] and "WarmupCosineLR" not in lr["source"]
  up = next(r for r in rows if r["metric"] == "updates")
  assert up["detail"].startswith("4 of 6 steps updated the weights")
  assert "steps 0, 1 not counted: lr 0 on at least one side (the start of WarmupLR's warmup)" in up["detail"]
  assert up["measure"] == "steps with lr > 0 on both sides (of 6; not counted: steps 0, 1, lr 0)"
  mid = _synthetic(lrs=[1e-3, 0.0, 1e-3, 1e-3, 1e-3, 1e-3])
  assert "step 1 not counted: lr 0 on at least one side (the schedule gives lr 0 there)" in \
      next(r for r in check_table.check_rows(RunRecord.of(mid)) if r["metric"] == "updates")["detail"]
  md = __import__("parity.report.markdown", fromlist=["x"]).report_markdown(RunRecord.of(d), {})
  assert "WarmupCosineLR" not in md


def test_details_say_what_their_figures_are_and_a_mended_write_error_is_not_repeated(tmp_path):
  """Read as a reviewer: a grad_norm/lr figure is the step nearest its relative bound, not the max; all-zero
  differences say so; 'over 1 steps'; a re-render that wrote the page does not say the page could not be written."""
  from parity.report import check_table, headline, setup_table
  from parity.report.page import report_figures
  assert check_table.plain_detail("max |Δgrad_norm| = 4.77e-07 at step 3 (tolerance 0.00118) over 6 steps") == \
      "|Δgrad_norm| = 4.77e-07 at step 3, the step nearest its tolerance (0.00118 there), over 6 steps"
  assert check_table.plain_detail("max |Δlr| = 0 at step 0 (tolerance 0) over 6 steps") == \
      "|Δlr| = 0 on every step compared (6 steps)"
  assert check_table.plain_detail("max |Δval_loss| = 0 at step 3 (tolerance 1e-05) over 1 steps") == \
      "|Δval_loss| = 0 on every step compared (1 step)"
  assert check_table.plain_detail("max |Δloss| = 1e-06 at step 2 (tolerance 1e-05) over 1 steps").endswith(
      "over 1 step")
  d = _synthetic()
  d["write_errors"] = [{"file": str(tmp_path / "report.html"), "error": "No space left on device"},
                       {"file": str(tmp_path / "*.png"), "error": "No space left on device"},
                       {"file": str(tmp_path / "metrics.jsonl"), "error": "No space left on device"}]
  assert len(headline.open_write_errors(RunRecord.of(d), tmp_path)) == 3
  (tmp_path / "report.html").write_text("re-rendered")
  (tmp_path / "loss.png").write_bytes(b"png")
  (tmp_path / "metrics.jsonl").write_text("an older file: a re-render does not write it")
  assert [e["file"] for e in headline.open_write_errors(RunRecord.of(d), tmp_path)] == [str(tmp_path / "metrics.jsonl")]
  assert check_table.plain_detail(
      "worst window steps 0-5: rms |Δgrad_norm| 0.000243 vs envelope rms 0.000966").startswith(
      "worst window steps 0-5: rms rel. |Δgrad_norm| 0.000243")  # the grad_norm envelope is relative
  d["environment"]["git"] = {"rev": "b" * 40, "dirty": False}  # committed while the sides ran: both revisions named
  rev = dict(setup_table.environment_rows(RunRecord.of(d), {"git": {"commit": "a" * 40}}))["project git revision"]
  assert rev.startswith("bbbbbbbbbbbb (clean) when the report was written; the sides started at aaaaaaaaaaaa")
  rows = dict(setup_table.environment_rows(RunRecord.of(d), {"git": {"commit": "b" * 40}}))
  assert rows["project git revision"] == "bbbbbbbbbbbb (clean)"
  bf16 = _synthetic("bf16")  # the per-step loss bound drawn on the delta plot is named as not gating
  fig = dict((k, f) for k, _, f in report_figures(RunRecord.of(bf16)))["delta"]
  assert any("reported only" in t.get_text() for t in fig.axes[0].get_legend().get_texts())


def test_throughput_uses_one_warmup_rule_and_tokens_per_s_is_tokens_over_that_median(tmp_path):
  """A reported defect: report.md said median 0.005065 s/step beside 28,831 tokens/s (= 128 / 0.00444, the
  summary's median, which left out two steps while the report left out one); the card paired them the same way."""
  from parity.protocol.layout import step_time_median, warm_step_times, warmup_steps_left_out
  from parity.report import side_table
  from parity.report.build import Report
  from parity.report.card import make_card
  from parity.report.markdown import report_markdown
  from parity.history.comparison import side_figures
  from parity.history.snapshot import snapshot_from_report
  assert [warmup_steps_left_out(n) for n in range(6)] == [0, 0, 1, 1, 2, 2]
  assert warm_step_times([0.3, 0.2, "x", 0.1]) == [0.2, 0.1]  # non-numbers dropped before the rule
  d = _synthetic(steps=4, sides=("jax", "torch"))
  jax_times = [0.26913529400007974, 0.005277326999930665, 0.005064670000137994, 0.00381461599999966]  # a measured run
  d["sides"]["jax"]["series"]["step_time_s"] = jax_times
  d["sides"]["jax"]["summary"].update(step_time_s_median=0.004439643000068827, tokens_per_s=28831.14700844542)
  tps = side_table.tokens_per_step(RunRecord.of(d))
  med = step_time_median(jax_times)
  assert med == pytest.approx(0.00443964) and tps == 128
  row = next(r for r in side_table.throughput_rows(RunRecord.of(d)) if r["side"] == "jax")
  assert row["repeats"] == 2 and row["median_s"] == "0.00444" and row["tokens_per_s"] == f"{tps / med:,.0f}" == "28,831"
  assert next(r for r in side_table.side_rows(RunRecord.of(d)) if r["side"] == "jax")["tokens_per_s"] == "28,831"
  note = side_table.throughput_note(RunRecord.of(d))
  assert "the first 2 steps left out as warmup" in note and "128 tokens per step / the median" in note
  md = report_markdown(RunRecord.of(d), {})
  assert "(the first step left out" not in md and "0.00444" in md
  kf = make_card(RunRecord.of(d), tmp_path)["key_figures"]
  assert kf["step_time_s_median"]["jax"] == pytest.approx(med)
  assert kf["tokens_per_s"]["jax"] == pytest.approx(tps / kf["step_time_s_median"]["jax"])
  # the gate's snapshot and the comparison page read summary.json's median, which the side wrote by the same rule
  # (SideIO.finish: step_time_median of its step times): the same figure as the report's and the card's
  snap = snapshot_from_report(Report(data=d, run_dir=tmp_path))
  assert snap.figures["jax"]["step_time_s_median"] == pytest.approx(med)
  assert side_figures(SideRecord.of("side", d["sides"]["jax"]))["step_time_s_median"] == pytest.approx(med)
  d3 = _synthetic(steps=3, sides=("jax", "torch"))  # three steps: only the first is warmup, and the note says so
  assert "the first step left out as warmup" in side_table.throughput_note(RunRecord.of(d3))


def _stopped(d: dict, side: str, n: int, status: str, error: str, traceback: str = "") -> dict:
  """`d` with `side` stopped after `n` steps: its series cut, its summary's status and error, and the checks
  recomputed as parity.verdict.sides would (completion first)."""
  from parity.verdict.steps import completion_check, updates_check
  s = d["sides"][side]
  s["status"] = status
  s["series"] = {k: v[:n] if isinstance(v, list) else v for k, v in s["series"].items()}
  s["summary"].update(steps_completed=n, error=error, traceback=traceback)
  other = next(x for x in d["sides"] if x != side)
  recs = lambda x: [{"step": i, "lr": lr} for i, lr in enumerate(d["sides"][x]["series"]["lr"])]
  total = d["run"]["train"]["steps"]
  comp = completion_check(other, "ok", total, side, status, n, total).to_json()
  upd = updates_check(other, recs(other), side, recs(side), total).to_json()
  d["checks"] = [comp, upd]
  ff = upd if not upd["passed"] else comp
  d["verdict"] = {"passed": False, "message": "FAIL: side(s) did not finish", "first_failure": {
      "check": ff["name"], "metric": ff["metric"], "sides": ff["sides"], "step": ff["first_failing_step"],
      "value": ff["value"], "tolerance": ff["tolerance"]}}
  return d


def test_a_killed_side_is_blamed_for_no_update_not_the_configured_steps():
  """A reported defect: kill -9 of JAX after step 1 of 4 read 'lr was 0 on all 1 steps ... run more steps
  than the warmup (train.steps > 2 ...)', advice for a run configured too short, not for a side that stopped."""
  from parity.report import headline
  from parity.verdict.steps import updates_check
  d = _stopped(_synthetic(steps=4, sides=("jax", "torch")), "jax", 1, "killed",
               "worker killed by signal SIGKILL (SIGKILL: killed from outside, or by the kernel's OOM killer)")
  sentence = headline.verdict_sentence(RunRecord.of(d))
  assert sentence.startswith("FAIL: jax stopped after 1 of 4 steps (killed: worker killed by signal SIGKILL)")
  assert "train.steps > 2" not in sentence and "run more steps" not in sentence
  assert "no optimizer update was compared before jax stopped" in sentence
  upd = next(c for c in d["checks"] if c["metric"] == "updates")
  assert "run more steps" not in upd["detail"] and "stopped after 1 of 4 steps" in upd["detail"]
  short = [{"step": i, "lr": 0.0} for i in range(2)]  # a run configured with only the warmup's steps: advice stays
  assert "train.steps > 2" in updates_check("jax", short, "torch", short, 2).detail


def test_a_crashed_side_names_its_error_in_the_verdict():
  """A reported defect: a full disk read 'FAIL: torch stopped after 4 of 4 steps (crashed)'; the cause was in
  the side's summary only."""
  from parity.report import headline
  tb = ('Traceback (most recent call last):\n  File "/r/parity/protocol/side.py", line 273, in finish\n'
        '    weights.save(final_params, self.out / "final.safetensors",\n'
        '  File "/r/parity/weights.py", line 192, in save\n    save_file({k: v for k, v in params.items()}, '
        'str(path),\n  File "/v/safetensors/numpy.py", line 93, in save_file\n    serialize_file(\n')
  err = "SafetensorError: Error while serializing: I/O error: No space left on device (os error 28)"
  d = _stopped(_synthetic(steps=4, sides=("jax", "torch")), "torch", 4, "crashed", err, tb)
  sentence = headline.verdict_sentence(RunRecord.of(d))
  assert sentence == ("FAIL: torch stopped after 4 of 4 steps (crashed writing final.safetensors: "
                                   "No space left on device).")
  moments_tb = tb.replace('final_params, self.out / "final.safetensors",', "flat, self.out / FINAL_MOMENTS, m)")
  assert headline.error_clause({"error": err, "traceback": moments_tb}) == (
      "writing final_moments.safetensors: No space left on device")
  assert headline.error_clause({"error": "ValueError: shapes (3,) and (4,) differ"}) == \
      "ValueError: shapes (3,) and (4,) differ"
  assert headline.error_clause({"error": None}) == ""


def test_an_interrupted_run_plots_without_a_warning_and_none_reaches_the_user(monkeypatch):
  """A reported defect: every interrupted run printed 'parity/report/plots.py:178: UserWarning: Attempting to
  set identical low and high ylims' (a delta plot with no step both sides ran)."""
  import warnings
  from parity.report import plots as P
  from parity.report.page import report_figures
  d = _stopped(_synthetic(steps=4, sides=("jax", "torch")), "jax", 0, "interrupted", "interrupted by SIGINT")
  for name in ("line_figure", "loss_figure", "delta_figure", "memory_figure", "throughput_figure", "to_png"):
    monkeypatch.setattr(P, name, getattr(P, name).__wrapped__)  # the cause, with the guard off
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    keys = [k for k, _, fig in report_figures(RunRecord.of(d)) if P.to_png(fig)]
    lo, hi = P.delta_figure({"jax vs torch": ([], [])}, title="t", tolerance=None).axes[0].get_ylim()
  assert "delta" in keys and lo < hi
  monkeypatch.undo()

  def noisy():
    warnings.warn("an internal plotting remark", UserWarning)
    return 1
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    assert P.quiet(noisy)() == 1
  assert not seen


def test_the_terminal_says_each_perturbation_and_whether_it_was_applied():
  """A reported defect: a --perturb run's terminal said nothing about its perturbations."""
  from rich.console import Console
  from parity.cli.compare import print_summary
  from parity.report.build import Report
  d = _synthetic(sides=("jax", "deepspeed"))
  ran = lambda v, where: {"value": v, "from": where}
  d["perturbations"] = [
      {"side": "deepspeed", "key": "train.lr", "value": 0.002, "applies": {"optimizer.params.lr": 0.002},
       "deepspeed_config": [], "ran": {"jax": ran(0.001, "its steps"), "deepspeed": ran(0.001, "its steps")},
       "applied": False},
      {"side": "jax", "key": "train.beta2", "value": 0.999, "applies": {"train.beta2": 0.999},
       "deepspeed_config": None, "ran": {"jax": ran(0.999, "its spec")}, "applied": True},
      {"side": "jax", "key": "kill_at_step", "value": 1, "applies": None, "deepspeed_config": None,
       "ran": {"jax": ran(None, "summary.json perturbed")}, "applied": None}]
  con = Console(record=True, width=200)
  print_summary(Report(data=d, run_dir=Path("/tmp/x")), con)
  text = con.export_text()
  lines = [ln for ln in text.splitlines() if ln.startswith("perturbation ")]
  assert lines == ["perturbation deepspeed: train.lr = 0.002: NOT APPLIED: deepspeed ran 0.001 (jax: 0.001, read from "
                   "its steps; deepspeed: 0.001, read from its steps)",
                   "perturbation jax: train.beta2 = 0.999: applied (jax: 0.999, read from its spec)"]
  assert "planted fault jax: kill_at_step = 1 (debug: no spec value to apply)" in text
  del d["perturbations"]
  con = Console(record=True, width=200)
  print_summary(Report(data=d, run_dir=Path("/tmp/x")), con)
  assert "perturbation " not in con.export_text()


def test_a_re_render_keeps_files_the_user_changed_unless_forced(tmp_path):
  """A reported defect: `parity report RUN` rewrote a user-edited report.md, report.html and loss.png with no
  warning."""
  import os
  from parity.report.build import Report
  from parity.report.finished import RENDER_RECORD, WRITE_SLACK_S, changed_since_written, rerender_run
  d = _synthetic(steps=4, sides=("jax", "torch"))
  (tmp_path / "report.json").write_text(json.dumps(d))
  report = Report(data=d, run_dir=tmp_path)
  written, errors, kept = rerender_run(report)  # nothing there yet: everything written, and recorded
  assert not errors and not kept and {"html", "md", "card", "plot:loss"} <= set(written)
  assert changed_since_written(tmp_path, ["report.md", "loss.png", "card.json"]) == []
  (tmp_path / "report.md").write_text("my notes\n")
  (tmp_path / "loss.png").write_bytes(b"my plot")
  written, _, kept = rerender_run(report)
  assert (tmp_path / "report.md").read_text() == "my notes\n" and (tmp_path / "loss.png").read_bytes() == b"my plot"
  assert sorted(k.split(":")[0] for k in kept) == ["loss.png", "report.md"] and "--force" in kept[0]
  assert "md" not in written and "plot:loss" not in written and "html" in written  # its own: replaced
  written, _, kept = rerender_run(report, force=True)
  assert not kept and (tmp_path / "report.md").read_text() != "my notes\n" and "plot:loss" in written
  # a folder as `parity compare` left it (no re-render record): a file modified well after report.json was edited
  (tmp_path / RENDER_RECORD).unlink()
  rj = (tmp_path / "report.json").stat().st_mtime
  os.utime(tmp_path / "card.json", (rj + WRITE_SLACK_S + 60, rj + WRITE_SLACK_S + 60))
  os.utime(tmp_path / "report.md", (rj + 1, rj + 1))
  assert changed_since_written(tmp_path, ["card.json", "report.md"]) == ["card.json"]


def test_a_failed_check_with_nothing_measured_says_why_not_exceeds():
  """A check that failed without a value (an equivalence rerun killed before it finished) reads as 'could not be
  measured: <why>', not 'first exceeds its tolerance (... n/a)'."""
  from parity.report.headline import verdict_parts
  d = _synthetic(sides=("jax", "torch"))
  check = {"name": "equivalence ga jax", "metric": "equivalence_ga", "sides": ["jax"], "value": None,
           "tolerance": 1e-5, "passed": False, "first_failing_step": None, "worst": None, "gating": True,
           "detail": "the rerun did not finish: worker killed by signal SIGKILL; nothing to compare", "reason": "r"}
  d["checks"].append(check)
  d["verdict"] = {"passed": False, "message": "FAIL: ...", "first_failure": {
      "check": check["name"], "metric": "equivalence_ga", "sides": ["jax"], "step": None, "value": None,
      "tolerance": 1e-5}}
  kind, sentence, _ = verdict_parts(RunRecord.of(d))
  assert kind == "fail" and "exceeds" not in sentence and "n/a" not in sentence, sentence
  assert "equivalence_ga of jax could not be measured: the rerun did not finish: worker killed by signal SIGKILL" \
      in sentence, sentence


def test_the_data_card_rows_show_the_padding_fraction_rounded_and_as_a_percentage():
  """card.json keeps the exact fraction; report.md/html show 4 decimals and the percentage (newcomer, 2026-12-02:
  0.057861328125 printed as is)."""
  from parity.report.markdown import data_card_rows
  card = {k: 1 for k in ("source", "sha256", "tokenizer", "tokenizer_sha256", "layout", "examples", "examples_seen",
                         "examples_per_step", "length_min", "length_median", "length_max", "tokens_per_step",
                         "loss_tokens_total")}
  card.update(padding_fraction=0.057861328125, loss_tokens_per_step=[3, 5], truncation={"cut": 0})
  rows = dict((k, v) for k, v in data_card_rows(RunRecord.of({"data": {"card": card, "loss_normalization": "tokens"}})))
  assert rows["padding_fraction"] == "0.0579 (5.8%)" and rows["loss tokens per step (min / max)"] == "3 / 5"
  assert data_card_rows(RunRecord.of({"data": {}})) == []


def test_data_notes_tell_the_terminal_what_truncation_cut_and_stay_quiet_otherwise():
  """Examples cut to a row are said before the sides start, not only in the data card (newcomer, 2026-12-02)."""
  from parity.report.progress import data_notes
  card = {"examples": 512, "truncation": {"mode": "truncate", "examples_cut": 329, "tokens_dropped": 48972,
                                          "loss_tokens_dropped": 35086, "pieces_added": 0}}
  (line,) = data_notes({"card": card})
  assert "329 of 512 examples" in line and "48,972 tokens dropped, 35,086 of them with loss" in line
  assert "train.truncation=split" in line
  assert data_notes({"card": {**card, "truncation": {**card["truncation"], "examples_cut": 0}}}) == []
  assert data_notes({"card": {**card, "truncation": {**card["truncation"], "mode": "split"}}}) == []
  assert data_notes({"source": "stream"}) == [] and data_notes(None) == []


def test_environment_section_shows_one_readable_row_per_setting_not_json(tmp_path):
  """report.html's Environment table: worker threads, host limits and numerics flags one row per setting ('KEY =
  value (set by X: reason)'), no JSON blob; the raw block stays in environment.json (a re-render of a finished
  run folder, tests/data/tpu_v5e/join/A)."""
  import contextlib
  import html
  import io
  import shutil

  from parity.cli import main
  run = tmp_path / "A"
  shutil.copytree(Path(__file__).parent / "data" / "tpu_v5e" / "join" / "A", run)
  with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    assert main(["report", str(run)]) == 0
  page = (run / "report.html").read_text()
  start = page.index(">Environment<")
  section = html.unescape(page[start:page.index("</table>", start)])
  assert '{"' not in section and "[{" not in section
  cells = re.findall(r"<tr><th>(.*?)</th><td>(.*?)</td>", section)
  assert next(v for k, v in cells if k == "worker threads").startswith("OMP_NUM_THREADS = 2 (set by parity: 2 thread")
  assert "JAX_REMAT3 = unset (the framework's default)" in [v for k, v in cells if k == "numerics flag"]
  assert any(v.startswith("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB = 64 GiB (set by default") for k, v in cells
             if k == "host limit")
  assert json.loads((run / "environment.json").read_text())["worker_threads"]["values"] == {"OMP_NUM_THREADS": "2"}
