"""The placement and transfers section of report.md / report.html (parity/report/placement_view.py,
placement_strip.py): read from fixture files written to the schemas of SCHEMA.md (tests/golden/placement: a CPU
placement without transfers, a GPU-like one with 3 copies, a mismatch, a DeepSpeed transfers block, a corrupt file),
rendered, stored in report.json, re-rendered by `parity report` and re-verified."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from parity.report.run_record import RunRecord

from conftest import requires_jax, requires_torch
from parity.report.build import Report
from parity.report.markdown import placement_markdown
from parity.report.page import placement_html
from parity.report.placement_strip import COLOURS, bar_x
from parity.report.placement_view import PLACEMENT_FILE, placement_section

FIX = Path(__file__).parent / "golden" / "placement"
TORCH_SUMMARY = {"state_bytes_by_memory_kind": {"device": 1929216, "host": 0}}
BAR = re.compile(r'<rect class="copy (h2d|d2h)" data-start="(\d+)" data-done="(\d+)" x="([\d.]+)" y="[\d.]+" '
                 r'width="([\d.]+)" height="\d+" fill="(#\w+)">')


def _ds_transfers() -> dict:
  return json.loads((FIX / "deepspeed.transfers.json").read_text())


def _section(tmp_path: Path, jax_file: str | None, ds: dict | None = None, torch: dict | None = None) -> dict:
  """report.json 'placement' of a folder whose jax/placement.json is fixture `jax_file` (None: no file), with the
  DeepSpeed summary {'transfers': ds} and the torch summary `torch`, JSON round-tripped as report.json holds it."""
  (tmp_path / "jax").mkdir(exist_ok=True)
  if jax_file:
    shutil.copy(FIX / jax_file, tmp_path / "jax" / PLACEMENT_FILE)
  sides = {"jax": {"summary": {"status": "ok"}},
           "torch": {"summary": TORCH_SUMMARY if torch is None else torch},
           "deepspeed": {"summary": {"status": "ok", "transfers": _ds_transfers() if ds is None else ds}}}
  return json.loads(json.dumps(placement_section(tmp_path, sides)))


def _pages(sec: dict) -> tuple[str, str]:
  d = {"placement": sec}
  return "\n".join(placement_markdown(RunRecord.of(d))), placement_html(RunRecord.of(d))


def _md_row(md: str, *first: str) -> str:
  """The report.md table row starting with the cells `first`."""
  head = "| " + " | ".join(first) + " |"
  rows = [line for line in md.splitlines() if line.startswith(head)]
  assert len(rows) == 1, (head, rows)
  return rows[0]


def test_a_cpu_placement_without_transfers_gives_its_classes_bytes_and_why_no_schedule(tmp_path):
  sec = _section(tmp_path, "cpu.placement.json")
  assert sec["sides"]["jax"]["status"] == "ok"
  md, html = _pages(sec)
  assert "## Placement and transfers" in md and 'id="placement"' in html
  for cls, role, plan, nbytes in (("params", "argument", "device", "471.0 KiB"), ("batch", "argument",
                                  "no expectation", "4.0 KiB"), ("metrics", "result", "no expectation", "16 B")):
    row = _md_row(md, cls, role, plan, "device")
    assert f"| {nbytes} | 0 B |" in row and "MISMATCH" not in row
  for role in ("argument", "result"):  # the plan's pinned_host, S(5) in the entry layout
    assert _md_row(md, "opt_state",
                   role) == f"| opt_state | {role} | host | host | 33 / 33 | 942.0 KiB | 942.0 KiB | as planned |"
  assert _md_row(md, "params", "argument").endswith("| as planned |")
  assert _md_row(md, "argument_bytes") == "| argument_bytes | 475.0 KiB | 942.0 KiB |"
  assert _md_row(md, "generated_code_bytes") == "| generated_code_bytes | 0 B | n/a |"
  assert "split device/host (CPU backend: S(5) buffers of the entry layout counted as host)" in md
  assert "Copy schedule: not known: CPU backend: the compiled HLO carries no host\\<-\\>device copies." in md
  row = _md_row(md, "jax", "jax/placement.json", "942.0 KiB (964,612 B)", "942.0 KiB (964,612 B)")
  assert "entry buffers in host memory: opt_state argument 942.0 KiB, opt_state result 942.0 KiB; in-step " \
         "copies not known: CPU backend" in row
  assert "copy-strip" not in html and "<rect" not in html


def test_a_gpu_placement_draws_one_bar_per_copy_from_start_to_done(tmp_path):
  sec = _section(tmp_path, "gpu.placement.json")
  md, html = _pages(sec)
  bars = BAR.findall(html)
  assert len(bars) == 3 and html.count('class="copy ') == 3
  assert [(b[0], int(b[1]), int(b[2])) for b in bars] == [("h2d", 12, 40), ("h2d", 20, 55), ("d2h", 60, 90)]
  for direction, start, done, x, width, fill in bars:  # axis: 0 .. the last copy's done (90), no count recorded
    assert float(x) == bar_x(int(start), 90) and float(x) + float(width) == pytest.approx(bar_x(int(done), 90))
    assert fill == COLOURS[direction]
  assert float(bars[0][3]) < float(bars[1][3]) < float(bars[2][3]) and bar_x(90, 90) == 944.0
  assert html.count(">opt_state 1.0 MiB</text>") == 2 and html.count(">opt_state 512.0 KiB</text>") == 1
  assert "<title>opt_state/nu/h/0/attn/qkv/kernel: h2d, 512.0 KiB, positions 20 to 55" in html
  assert "the instruction count is not recorded" in html
  # report.md: the copies as a table instead, by start
  assert _md_row(md, "0", "opt_state/mu/h/0/attn/qkv/kernel", "opt_state", "h2d") == (
      "| 0 | opt_state/mu/h/0/attn/qkv/kernel | opt_state | h2d | 1.0 MiB (1,048,576 B) | 12 | 40 | 27 | 123456789 |")
  assert _md_row(md, "2", "opt_state/mu/h/0/attn/qkv/kernel", "opt_state", "d2h").endswith(
      "| 60 | 90 | 29 | not measured |")
  row = _md_row(md, "jax", "jax/placement.json", "2.4 MiB (2,537,472 B)", "1.9 MiB (2,013,184 B)")
  assert "3 copies in the compiled step (2 h2d, 1 d2h, 2.5 MiB)" in row and "opt_state argument 942.0 KiB" in row
  # a compiled space other than the plan that placement.json does not call a mismatch: said, not marked
  assert _md_row(md, "opt_state", "result", "host", "mixed").endswith(
      "| mixed: 32 of 33 buffers in host memory (placement.json lists no mismatch) |")
  assert "MISMATCH" not in md and 'class="fail"' not in html
  # with the entry computation's instruction count recorded, the axis spans it
  p = json.loads((FIX / "gpu.placement.json").read_text())
  p["transfers"]["entry_instructions"] = 120
  (tmp_path / "jax" / PLACEMENT_FILE).write_text(json.dumps(p))
  _, html = _pages(json.loads(json.dumps(placement_section(tmp_path, {"jax": {"summary": {}}}))))
  assert [float(b[3]) for b in BAR.findall(html)] == [bar_x(12, 120), bar_x(20, 120), bar_x(60, 120)]
  assert bar_x(12, 120) == round(250 + 12 / 120 * 694, 2) and "over the 120 instruction positions" in html


def test_a_mismatch_is_marked_with_its_detail(tmp_path):
  md, html = _pages(_section(tmp_path, "mismatch.placement.json"))
  row = _md_row(md, "opt_state", "argument", "host", "device", "0 / 37")
  assert row.endswith("| **MISMATCH: plan jax.offload_opt_state puts opt_state in pinned_host; the compiled "
                      "step takes 37 of 37 buffers in device memory** |")
  assert "**MISMATCH** " not in md and _md_row(md, "opt_state", "result").count("**MISMATCH: ") == 1
  assert _md_row(md, "params", "argument").endswith("| as planned |")
  assert "**MISMATCH activations in-step: remat offload_dots plans activations on the host" in md
  table = html.split("<h3>jax: placement of the compiled step</h3>")[1].split("</table>")[0]
  assert table.count('<tr class="fail">') == 2 and table.count('<span class="badge fail">MISMATCH</span>') == 2
  assert "the compiled step takes 37 of 37 buffers in device memory" in table
  assert "<b>MISMATCH activations in-step:" in html
  assert "Copy schedule: 0 host↔device copies" in md and len(BAR.findall(html)) == 0


def test_deepspeed_transfers_and_the_torch_baseline_sit_beside_the_jax_bytes(tmp_path):
  md, html = _pages(_section(tmp_path, "gpu.placement.json"))
  row = _md_row(md, "deepspeed", "deepspeed/summary.json transfers", "942.0 KiB (964,608 B)", "1.8 MiB (1,929,216 B)")
  assert "gradients (fp32 partition) d2h 1.8 MiB x 1/step (engine.optimizer.single_partition_of_fp32_groups)" in row
  assert row.endswith("| 0.0012 / 0.0015 / 0.0031 (n=8) |")
  assert _md_row(md, "torch", "torch/summary.json state_bytes_by_memory_kind", "0 B", "0 B")
  assert "DeepSpeed: gradients are copied per micro batch" in md and "0.0012 / 0.0015 / 0.0031 (n=8)" in html
  order = [line.split(" | ")[0] for line in md.splitlines()
           if line.startswith(("| jax |", "| torch |", "| deepspeed |"))]
  assert order == ["| jax", "| torch", "| deepspeed"]
  # a DeepSpeed side without offload: nothing moves, and no CPU Adam time is claimed
  none = {"bytes_per_step": {"h2d": 0, "d2h": 0}, "items": [], "source": "DeepSpeed config"}
  md, _ = _pages(_section(tmp_path, "gpu.placement.json", ds=none))
  assert _md_row(md, "deepspeed", "deepspeed/summary.json transfers", "0 B", "0 B").endswith(
      "| nothing (no offload) | not measured |")


@pytest.mark.parametrize("jax_file,ds,torch,said", [
    (None, None, None, "Not recorded: jax/placement.json is missing."),
    ("corrupt.placement.json", None, None, "Not recorded: jax/placement.json: Unterminated string"),
    ("cpu.placement.json", {"bytes_per_step": {"h2d": "lots"}, "items": []}, None,
     "| deepspeed | deepspeed/summary.json transfers | not recorded | not recorded | deepspeed/summary.json "
     "transfers.bytes_per_step.h2d is not a number or null ('lots'); transfers.bytes_per_step.d2h is missing | n/a |"),
    ("cpu.placement.json", None, {}, "| torch | torch/summary.json state_bytes_by_memory_kind | not recorded | "
     "not recorded | torch wrote no summary.json"),
], ids=["missing", "corrupt", "deepspeed-malformed", "torch-no-summary"])
def test_a_missing_or_malformed_record_says_not_recorded(tmp_path, jax_file, ds, torch, said):
  sec = _section(tmp_path, jax_file, ds=ds, torch=torch)
  md, html = _pages(sec)
  assert said in md, md
  assert "## Placement and transfers" in md and 'id="placement"' in html


def test_a_placement_of_another_schema_or_with_a_bad_copy_is_refused_by_name(tmp_path):
  p = json.loads((FIX / "gpu.placement.json").read_text())
  p["transfers"]["copies"][1]["start"] = "twelve"
  (tmp_path / "jax").mkdir()
  (tmp_path / "jax" / PLACEMENT_FILE).write_text(json.dumps(p))
  e = placement_section(tmp_path, {"jax": {"summary": {}}})["sides"]["jax"]
  assert e["status"] == "invalid" and e["placement"] is None
  assert e["error"] == "jax/placement.json: transfers.copies[1].start is not a whole number >= 0 ('twelve')"
  (tmp_path / "jax" / PLACEMENT_FILE).write_text(json.dumps({**p, "schema": "parity.placement/9"}))
  e = placement_section(tmp_path, {"jax": {"summary": {}}})["sides"]["jax"]
  assert e["status"] == "invalid" and "schema is 'parity.placement/9'" in e["error"]
  (tmp_path / "jax" / PLACEMENT_FILE).write_text("[1, 2]")
  assert "not a JSON object" in placement_section(tmp_path, {"jax": {"summary": {}}})["sides"]["jax"]["error"]


def _synthetic_run(tmp_path: Path) -> dict:
  """report.json data of a finished 3-side run (test_report_page._synthetic) whose folder holds the GPU fixture as
  jax/placement.json and whose DeepSpeed summary has the transfers fixture, with its placement section."""
  from test_report_page import _synthetic
  d = _synthetic(steps=4)
  d["sides"]["deepspeed"]["summary"]["transfers"] = _ds_transfers()
  (tmp_path / "jax").mkdir()
  shutil.copy(FIX / "gpu.placement.json", tmp_path / "jax" / PLACEMENT_FILE)
  d["placement"] = json.loads(json.dumps(placement_section(tmp_path, d["sides"])))
  return d


def test_a_re_render_shows_the_section_beside_the_plan_and_verify_holds_it_to_the_files(tmp_path):
  from parity.report.finished import rerender_run
  from parity.report.reverify import _placement_lines
  d = _synthetic_run(tmp_path)
  (tmp_path / "report.json").write_text(json.dumps(d))
  written, errors, kept = rerender_run(Report(data=d, run_dir=tmp_path))
  assert not errors and not kept and {"html", "md"} <= set(written)
  md, html = (tmp_path / "report.md").read_text(), (tmp_path / "report.html").read_text()
  assert md.index("## Plan and placements") < md.index("## Placement and transfers") < md.index("## Environment")
  assert "\n".join(placement_markdown(RunRecord.of(d))) in md and placement_html(RunRecord.of(d)) in html
  assert html.index('id="plan"') < html.index('id="placement"') < html.index('id="environment"')
  assert len(BAR.findall(html)) == 3
  assert _md_row(md, "2", "opt_state/mu/h/0/attn/qkv/kernel", "opt_state", "d2h")
  # what `parity report` re-verifies: the stored section against the files
  again = json.loads(json.dumps(placement_section(tmp_path, d["sides"])))
  assert _placement_lines(RunRecord.of(d), again) == []
  edited = {**d, "placement": json.loads(json.dumps(d["placement"]).replace("1048576", "1")) }
  assert _placement_lines(RunRecord.of(edited), again) == [
      "its placement section ('placement') is not the sides' placement.json / summary.json transfers"]
  older = RunRecord.of({k: v for k, v in d.items() if k != "placement"})  # written before the section existed
  assert _placement_lines(older, again) == ["it has no placement section, but jax, deepspeed recorded one"]
  (tmp_path / "jax" / PLACEMENT_FILE).unlink()
  del d["sides"]["deepspeed"]["summary"]["transfers"]
  assert _placement_lines(older, placement_section(tmp_path, d["sides"])) == []
  assert placement_markdown(older) == [] and placement_html(older) == ""


@pytest.mark.process
@pytest.mark.slow
@requires_jax
@requires_torch
def test_parity_report_re_renders_and_verifies_a_real_run_with_a_placement(tmp_path_factory, tmp_path, capsys):
  """The shared real run of test_report_page (gpt2-tiny, jax and torch), with the GPU fixture as its
  jax/placement.json recorded as `parity compare` records it (hash and section): `parity report` verifies it and
  draws the strip; an edited placement.json is named."""
  from test_report_page import shared_run
  from parity.cli import main
  from parity.report.build import artifact_hashes
  rd = Path(shutil.copytree(shared_run(tmp_path_factory), tmp_path / "run",
                            ignore=shutil.ignore_patterns(".parity.lock")))
  d = json.loads((rd / "report.json").read_text())
  assert d["placement"]["sides"]["torch"]["status"] == "ok"  # written by `parity compare` itself
  # the fixture stamped as this run's, and the one-side 'placement jax' check rebuilt from it as compare builds it
  run_id = d["run_folder"]["run_id"]
  fixture = {**json.loads((FIX / "gpu.placement.json").read_text()), "run_id": run_id}
  (rd / "jax" / PLACEMENT_FILE).write_text(json.dumps(fixture))
  from parity.verdict.placement import placement_check
  check = placement_check("jax", {"record": fixture, "problem": None}, d["sides"]["jax"]["status"]).to_json()
  names = [c["name"] for c in d["checks"]]
  assert "placement jax" in names
  d["checks"][names.index("placement jax")] = json.loads(json.dumps(check))
  d["placement"] = json.loads(json.dumps(placement_section(rd, d["sides"])))
  d["artifacts"] = artifact_hashes(rd, list(d["sides"]))
  (rd / "report.json").write_text(json.dumps(d))
  assert main(["report", str(rd), "--force"]) == 0, capsys.readouterr()
  html, md = (rd / "report.html").read_text(), (rd / "report.md").read_text()
  assert len(BAR.findall(html)) == 3 and "| jax | jax/placement.json | 2.4 MiB (2,537,472 B) |" in md
  (rd / "jax" / PLACEMENT_FILE).write_text((FIX / "cpu.placement.json").read_text())
  assert main(["report", str(rd)]) == 1
  assert "jax/placement.json" in capsys.readouterr().err


def test_an_older_report_is_not_refused_for_a_side_that_records_no_placement(tmp_path):
  """A report written before the placement section existed is named only when a side recorded a placement of its own
  (the JAX side's placement.json, DeepSpeed's transfers): a side read as a baseline from its state bytes (torch,
  fsdp, a side of its own with state in host memory) records none, whatever its name."""
  from parity.report.reverify import _placement_lines
  sides = {"torch": {"summary": {"state_bytes_by_memory_kind": {"device": 64, "host": 0}}},
           "fsdp": {"summary": {"state_bytes_by_memory_kind": {"device": 64, "host": 0}}},
           "numpy_side": {"summary": {"state_bytes_by_memory_kind": {"host": 64}}}}
  again = json.loads(json.dumps(placement_section(tmp_path, sides)))
  assert {s: e["status"] for s, e in again["sides"].items()} == {"torch": "ok", "fsdp": "ok", "numpy_side": "invalid"}
  assert _placement_lines(RunRecord.of({"sides": sides}), again) == []
