"""Loss tokens/s beside tokens/s: the one throughput rule of parity.protocol.layout extended to the
targets that carry the loss, in summary.json, the report's tables, the terminal table's columns and card.json.
In-process (no worker starts)."""
from __future__ import annotations

import json
import statistics

import pytest

from parity.report.run_record import RunRecord

from parity.pipeline.folder import prepare_run_dir
from parity.presets import preset
from parity.protocol.layout import loss_tokens_per_s, step_time_median, tokens_per_s, warm_step_times
from parity.protocol.side import SideIO
from parity.report import side_table
from parity.report.card import make_card
from parity.report.markdown import report_markdown
from parity.overrides import apply_overrides

from test_report_page import _synthetic


def test_loss_tokens_per_s_keeps_the_warm_steps_of_the_throughput_rule():
  times = [1.0, 0.5, 0.2, 0.4, 0.3, 0.25]
  counts = [10, 20, 30, 40, 50, 60]
  warm = warm_step_times(times)  # the first 2 left out
  assert loss_tokens_per_s(times, counts) == pytest.approx(statistics.fmean([30, 40, 50, 60]) / statistics.median(warm))
  # a step with no time is dropped with its count (the count of step 1 must not slide onto step 2's time)
  got = loss_tokens_per_s([1.0, "x", 0.2, 0.4, 0.3, 0.25], counts)
  assert got == pytest.approx(statistics.fmean([40, 50, 60]) / 0.3)
  # every target carries the loss (stream): the figure is tokens/s
  assert loss_tokens_per_s(times, [128] * 6) == pytest.approx(tokens_per_s(times, 128))
  assert loss_tokens_per_s(times, None) is None and loss_tokens_per_s(times, counts[:3]) is None
  assert loss_tokens_per_s([], []) is None and loss_tokens_per_s([0.0, 0.0], [1, 1]) is None
  assert loss_tokens_per_s(times, [10, 20, None, 40, 50, 60]) is None


def _padded_io(tmp_path, steps: int = 5):
  import numpy as np
  rng = np.random.default_rng(0)
  path = tmp_path / "ex.jsonl"  # a small file of pre-tokenized examples (the demo reads the stdlib: seconds)
  rows = [{"input_ids": rng.integers(0, 200, int(n)).tolist()} for n in rng.integers(5, 120, 60)]
  path.write_text("\n".join(json.dumps({**r, "labels": [-100] * 3 + r["input_ids"][3:]}) for r in rows) + "\n")
  spec = apply_overrides(preset("sft-tiny"), {"train.steps": steps, "train.eval_every": 0,
                                              "data": str(path)}).validate()
  run = tmp_path / "run"
  prepare_run_dir(spec, run)
  io = SideIO(run / "request.json", "torch")
  batches, _ = io.training_batches()
  io.example_arrays(1.0, batches.shape, None)
  return io, run


def test_a_padded_side_writes_loss_tokens_per_s_from_its_loss_mask(tmp_path):
  import numpy as np
  io, run = _padded_io(tmp_path)
  counts = np.load(run / "loss_mask.npy").sum(axis=(1, 2, 3)).tolist()
  times = [0.9, 0.3, 0.2, 0.25, 0.22]
  for k, t in enumerate(times):
    assert io.loss_tokens(k) == counts[k]
    io.record(k, loss=1.0, grad_norm=1.0, lr=1e-3, step_time_s=t)
  summ = io.finish("ok")
  assert summ["loss_tokens_per_s"] == pytest.approx(statistics.fmean(counts[2:]) / step_time_median(times))
  assert summ["loss_tokens_per_s"] < summ["tokens_per_s"]  # padding and prompts carry no loss
  assert json.loads((run / "torch" / "summary.json").read_text())["loss_tokens_per_s"] == summ["loss_tokens_per_s"]


def test_a_stream_side_writes_loss_tokens_per_s_equal_to_tokens_per_s(tmp_path):
  text = tmp_path / "corpus.txt"  # a small corpus (the default one reads the stdlib: seconds)
  text.write_text("the same GPT in two frameworks, side by side. " * 200)
  spec = apply_overrides(preset("gpt2-tiny"), {"train.steps": 4, "train.eval_every": 0,
                                               "data": str(text)}).validate()
  prepare_run_dir(spec, tmp_path / "run")
  io = SideIO(tmp_path / "run" / "request.json", "jax")
  for k, t in enumerate([0.5, 0.1, 0.2, 0.3]):
    io.record(k, loss=1.0, grad_norm=1.0, lr=1e-3, step_time_s=t)
  summ = io.finish("ok")
  assert summ["loss_tokens_per_s"] == pytest.approx(summ["tokens_per_s"]) and summ["tokens_per_s"] > 0


def _with_card(d: dict, per_step: list[int]) -> dict:
  """`d` as a padded run's report data: a data card (parity.dataset.card.CARD_FIELDS) with these loss tokens."""
  from parity.dataset.card import CARD_FIELDS
  card = {k: None for k in CARD_FIELDS} | {"layout": "padded", "loss_tokens_per_step": per_step,
                                          "loss_tokens_total": sum(per_step), "truncation": {"mode": "truncate"}}
  d["data"] = {"card": card, "loss_normalization": "tokens"}
  return d


def test_report_tables_and_card_show_loss_tokens_per_s_on_examples_only():
  d = _synthetic(steps=6, sides=("jax", "torch"))
  for s in d["sides"].values():
    s["series"]["step_time_s"] = [0.5, 0.2, 0.01, 0.02, 0.01, 0.03]
  stream_md = report_markdown(RunRecord.of(d), {})
  assert side_table.throughput_columns(RunRecord.of(d)) == [("tokens_per_s", "tokens/s")]
  assert "loss tokens/s" not in stream_md.split("## Throughput")[1].split("\n\n")[2]  # no redundant column
  assert "every target carries the loss (stream), so loss tokens/s equals tokens/s" in \
      side_table.throughput_note(RunRecord.of(d))
  kf = make_card(RunRecord.of(d))["key_figures"]
  assert kf["loss_tokens_per_s"] == kf["tokens_per_s"]
  per_step = [40, 50, 60, 70, 80, 90]
  _with_card(d, per_step)
  want = statistics.fmean(per_step[2:]) / 0.015
  rec = RunRecord.of(d)
  assert side_table.side_loss_tokens_per_s(rec, rec.sides["jax"]) == pytest.approx(want)
  assert [h for _, h in side_table.throughput_columns(RunRecord.of(d))] == ["tokens/s", "loss tokens/s"]
  row = next(r for r in side_table.throughput_rows(RunRecord.of(d)) if r["side"] == "jax")
  assert row["loss_tokens_per_s"] == f"{want:,.0f}"
  torch_row = next(r for r in side_table.side_rows(RunRecord.of(d)) if r["side"] == "torch")
  assert torch_row["loss_tokens_per_s"] == f"{want:,.0f}"
  md = report_markdown(RunRecord.of(d), {})
  tables = [line for line in md.splitlines() if line.startswith("| side |")]
  assert sum("| tokens/s | loss tokens/s |" in line for line in tables) == 2  # the sides and throughput tables
  assert "40 to 90 a step" in side_table.throughput_note(RunRecord.of(d))
  assert make_card(RunRecord.of(d))["key_figures"]["loss_tokens_per_s"]["jax"] == pytest.approx(want)


def test_the_html_page_and_the_terminal_table_carry_the_column(tmp_path):
  from rich.console import Console
  from parity.cli.compare import print_summary
  from parity.report.build import Report
  from parity.report.page import report_html
  d = _with_card(_synthetic(steps=6, sides=("jax", "torch")), [40, 50, 60, 70, 80, 90])
  page = report_html(RunRecord.of(d), {}, tmp_path)
  assert page.count("loss tokens/s</th>") == 2
  con = Console(record=True, width=200)
  print_summary(Report(data=d, run_dir=tmp_path), con)
  assert "loss tokens/s" in con.export_text()


def test_throughput_note_names_a_side_whose_device_was_not_recorded():
  """A killed side's summary is the harness's, without a device: its row still shows the tokens/s of the steps it
  recorded, and the note says so instead of leaving it out of the backend caveat (newcomer, 2026-12-02)."""
  d = _synthetic(steps=6, sides=("jax", "deepspeed"))
  for s in d["sides"].values():
    s["series"]["step_time_s"] = [0.5, 0.2, 0.01, 0.02, 0.01, 0.03]
  d["sides"]["jax"]["summary"]["device"] = "cpu"
  d["sides"]["deepspeed"]["summary"].pop("device", None)
  note = side_table.throughput_note(RunRecord.of(d))
  assert "CPU backend (jax)" in note and "deepspeed: device not recorded (the side did not finish" in note
  d["sides"]["deepspeed"]["summary"]["device"] = "cpu"
  assert "device not recorded" not in side_table.throughput_note(RunRecord.of(d))


def test_the_warmup_phrase_says_no_step_timed_for_a_side_killed_before_its_first_step():
  """A side killed while compiling timed no step: the note must not say 'one step ran'."""
  from parity.report.side_table import warmup_phrase
  sides = lambda **n: {k: {"series": {"step_time_s": [0.1] * v}} for k, v in n.items()}
  assert warmup_phrase(RunRecord.of({"sides": sides(jax=0, torch=2)})) == (
      "jax: no step timed, torch: the first step left out as warmup")
  assert warmup_phrase(RunRecord.of({"sides": sides(jax=1, torch=1)})) == "no step left out (one step ran)"
  assert warmup_phrase(RunRecord.of({"sides": sides(jax=5, torch=5)})) == "the first 2 steps left out as warmup"
