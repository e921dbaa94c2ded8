"""The one typed reader of a finished run (parity.report.run_record) and each plan describing itself once
(parity.side_plans): the recorded runs of tests/data read through it, nothing else reads report.json's keys, and the
three places that put a plan into words use the plan's own `describe`."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from parity.inputs import InputError
from parity.report.run_record import (REPORT_KEYS, REPORT_SCHEMA, CheckRecord, RunRecord, SideRecord, read_run)
from parity.side_plans import DeepSpeedPlan, FsdpPlan, JaxPlan, describe_plans, side_plans

ROOT = Path(__file__).resolve().parents[1]
RECORDED = sorted(p.parent for p in (ROOT / "tests" / "data").rglob("report.json"))


def test_recorded_runs_exist():
  assert len(RECORDED) >= 5, RECORDED  # tests/data/tpu_v5e: five cells and the two halves of a join


@pytest.mark.parametrize("folder", RECORDED, ids=lambda p: str(p.relative_to(ROOT / "tests" / "data")))
def test_every_recorded_run_reads_typed(folder):
  """Each recorded report.json (written by an earlier parity on a TPU VM) reads into typed records that say what the
  file says: the verdict, every check in order, each side's status, summary and series, the run's plans as plan
  objects, the environment, the run folder, the data and the rerun sections."""
  raw = json.loads((folder / "report.json").read_text())
  rec = read_run(folder)
  assert rec.schema == REPORT_SCHEMA and rec.json == raw and rec.present == set(raw)
  assert rec.verdict.passed is raw["verdict"]["passed"] and rec.verdict.message == raw["verdict"]["message"]
  ff = raw["verdict"]["first_failure"]
  assert (rec.verdict.first_failure is None) == (ff is None)
  if ff:
    assert (rec.verdict.first_failure.check, rec.verdict.first_failure.sides) == (ff["check"], tuple(ff["sides"]))
  assert [c.name for c in rec.checks] == [c["name"] for c in raw["checks"]]
  assert all(isinstance(c, CheckRecord) and c.json == r for c, r in zip(rec.checks, raw["checks"]))
  assert [c.gating for c in rec.checks] == [c.get("gating", True) for c in raw["checks"]]
  assert list(rec.sides) == list(raw["sides"]) and all(isinstance(s, SideRecord) for s in rec.sides.values())
  for name, s in rec.sides.items():
    stored = raw["sides"][name]
    assert (s.status, s.summary, s.series, s.error) == (stored["status"], stored["summary"], stored["series"],
                                                         stored["error"])
    assert s.device == str(stored["summary"].get("device") or "") and s.values("loss") == stored["series"]["loss"]
  assert rec.precision == raw["run"]["train"]["precision"] and rec.run.steps == raw["run"]["train"]["steps"]
  plans = rec.run.plans
  assert isinstance(plans["jax"], JaxPlan) and isinstance(plans["deepspeed"], DeepSpeedPlan)
  assert plans["jax"].offload_opt_state == raw["run"]["jax"]["offload_opt_state"]
  assert isinstance(plans["fsdp"], FsdpPlan) and rec.run.spec is not None
  assert (rec.plan.name if rec.plan else None) == (raw["plan"] or {}).get("name")
  assert rec.environment.versions == raw["environment"]["versions"] and rec.environment.cpu_count == \
      raw["environment"]["cpu_count"]
  assert rec.run_folder.run_id == raw["run_folder"]["run_id"] and rec.run_folder.command == raw["run_folder"]["command"]
  assert rec.data.sha256 == raw["data"]["sha256"] and rec.data.card == ((raw["data"].get("card") or None))
  assert {s: r.deterministic for s, r in rec.determinism.items()} == {
      s: r["deterministic"] for s, r in raw["determinism"].items()}
  assert rec.tolerance_table == raw["tolerances"][rec.precision]
  assert rec.stored("noise_envelope") == raw["noise_envelope"] and rec.artifact("request.json") == \
      raw["artifacts"]["request.json"]


def test_a_record_of_what_is_not_there_reads_empty():
  """A report section missing or of another type reads as empty (an edited or older report renders 'n/a'), and
  stored() names only report.json sections."""
  rec = RunRecord.of({"sides": {"jax": {"status": "ok"}}, "checks": [{"name": "loss a~b"}], "plan": "zero2"})
  assert rec.verdict.message == "" and rec.verdict.first_failure is None and rec.plan is None
  assert rec.sides["jax"].summary == {} and rec.sides["jax"].values("loss") == [] and rec.sides["jax"].load is None
  assert rec.checks[0].gating is True and rec.checks[0].sides == () and rec.run.plans == {} and rec.run.spec is None
  assert rec.migration is None and rec.environment.git is None and rec.determinism == {} and rec.write_errors == ()
  assert RunRecord.of(rec) is rec
  with pytest.raises(KeyError, match="not a report.json section"):
    rec.stored("verdicts")



def test_a_run_section_of_the_wrong_types_reads_as_not_recorded(tmp_path):
  """train.steps and train.precision of another type (an edited report) read as None, so the comparison page, which
  still shows a run whose files do not confirm it (flagged), renders 'n/a' where it read them, not a crash."""
  from parity.history.comparison import run_figures, run_row
  from parity.report.build import Report
  for run in ({}, {"train": None}, {"train": {"steps": "three", "precision": 3}}, {"train": {"steps": True}}):
    rec = RunRecord.of({"run": run, "sides": {"jax": {"status": "ok"}}})
    assert rec.run.steps is None and rec.run.precision is None and rec.precision is None
    fig = run_figures(Report(data={"run": run, "sides": {"jax": {"status": "ok"}}}, run_dir=tmp_path))
    assert fig.steps is None and run_row(fig, fig)["steps"] == "n/a"
  assert RunRecord.of({"run": {"train": {"steps": 3, "precision": "fp32"}}}).run.steps == 3

def test_read_run_refuses_what_is_no_finished_run(tmp_path):
  """read_run names the file and the section: no report.json, another schema, a section missing."""
  with pytest.raises(InputError, match="does not exist"):
    read_run(tmp_path)
  (tmp_path / "report.json").write_text(json.dumps({"schema": "parity.report/2"}))
  with pytest.raises(InputError, match="written by another parity version"):
    read_run(tmp_path)
  (tmp_path / "report.json").write_text(json.dumps({"schema": REPORT_SCHEMA, "verdict": {"passed": True}}))
  with pytest.raises(InputError, match="section 'verdict' must hold"):
    read_run(tmp_path)


# ----------------------------------------------------------------------------- no raw reads outside the reader
READERS = ("parity/report", "parity/history", "parity/cli", "parity/pipeline", "parity/diagnose")
"""The packages that read finished runs (the report and its pages, the comparison page and the gate, the terminal,
`parity join`, the pipeline's last line)."""
READER = ("run_record.py", "run_sections.py")
"""The reader: parity.report.run_record and its section records."""
REPORT_DICT_NAMES = frozenset({"d", "data", "report_data", "rep", "report_json"})
"""The names a loaded report.json dict went by before the reader (the count's receivers, with `<x>.data` and
`<x>.json`: Report.data, RunRecord.json)."""


def raw_report_reads(source: str) -> list[tuple[int, str]]:
  """(line, key) of every raw read of a report.json key (REPORT_KEYS) on a loaded report dict in `source`: a
  subscript `d["verdict"]` (read, not written) or a `.get("sides")` / `.pop` / `.setdefault` whose receiver is a
  report dict (REPORT_DICT_NAMES, or an attribute `.data` / `.json`)."""
  out = []
  for n in ast.walk(ast.parse(source)):
    if isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Load) and isinstance(n.slice, ast.Constant):
      key, recv = n.slice.value, n.value
    elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("get", "pop", "setdefault")
          and n.args and isinstance(n.args[0], ast.Constant)):
      key, recv = n.args[0].value, n.func.value
    else:
      continue
    named = (isinstance(recv, ast.Name) and recv.id in REPORT_DICT_NAMES) or (
        isinstance(recv, ast.Attribute) and recv.attr in ("data", "json"))
    if key in REPORT_KEYS and named:
      out.append((n.lineno, key))
  return out


def test_no_raw_report_json_reads_outside_the_reader():
  """Every package that reads a finished run reads it through parity.report.run_record: 0 raw report.json key reads
  on a loaded report dict outside it (READER; there were 243 in parity/report, parity/history and parity/cli, 23 in
  parity/pipeline)."""
  found = [f"{p.relative_to(ROOT)}:{line} {key}" for pkg in READERS for p in sorted((ROOT / pkg).rglob("*.py"))
           if p.name not in READER for line, key in raw_report_reads(p.read_text())]
  assert found == [], "raw report.json reads outside parity.report.run_record:\n  " + "\n  ".join(found)


def test_the_raw_read_count_finds_planted_reads():
  """The counter counts a planted read of each kind, and leaves writes, other keys and other dicts alone."""
  planted = ('d = report.data\nv = d["verdict"]\ns = report.data.get("sides")\nc = rec.json["checks"]\n'
             'x = data.get("plan") or {}\nreport.data["write_errors"] = []\nsumm = s.get("device")\n'
             'q = d["status"]\nk = card.get("verdict")\n')
  assert raw_report_reads(planted) == [(2, "verdict"), (3, "sides"), (4, "checks"), (5, "plan")]


# ----------------------------------------------------------------------------- each plan describes itself once
def test_each_plan_describes_what_it_sets():
  assert JaxPlan().describe() == "offload_opt_state"
  assert JaxPlan(offload_opt_state=False).describe() == "no offload"
  assert JaxPlan(offload_params=True, scan_layers=True, zero_stage=3, remat="full", data_parallel=4,
                 host_memory_kind="unpinned_host").describe() == (
      "offload_opt_state, offload_params, unpinned_host, scan_layers, zero_stage 3, remat full, data_parallel 4")
  assert DeepSpeedPlan().describe() == "ZeRO-2, offload_optimizer cpu"
  assert DeepSpeedPlan(zero_stage=3, offload_optimizer="none", activation_checkpointing=True,
                       cpu_checkpointing=True).describe() == (
      "ZeRO-3, activation checkpointing with cpu_checkpointing (block inputs on the host)")
  assert FsdpPlan().describe() == "no offload, reshard after forward"
  assert FsdpPlan(offload=True, reshard_after_forward=False, activation_checkpointing=True).describe() == (
      "CPU offload, no reshard after forward, every block recomputed in the backward (activation checkpointing)")


def test_the_three_places_a_plan_is_put_into_words_use_its_describe(tmp_path):
  """The sizing tables (parity.cli.sizing.plan_label), the report's plan rows (parity.report.setup_table.plan_rows)
  and the comparison page (parity.history.comparison) say a plan in the plan's own words, and none of them spells out
  a plan's fields itself."""
  from parity.cli.sizing import plan_label
  from parity.history.comparison import _plan_text
  from parity.presets import preset
  from parity.report.setup_table import plan_rows
  from parity.spec import to_dict
  spec = preset("gpt2-tiny")
  plans = side_plans(spec, ("deepspeed", "jax"))
  both = describe_plans(plans)
  assert both == f"DeepSpeed {spec.deepspeed.describe()}; JAX {spec.jax.describe()}"
  assert plan_label(spec, plans).endswith(f"({both})")
  rec = RunRecord.of({"run": json.loads(json.dumps(to_dict(spec))), "sides": {s: {"status": "ok"} for s in spec.sides}})
  rows = dict(plan_rows(rec))
  assert rows["DeepSpeed plan"] == spec.deepspeed.describe() and rows["JAX plan"] == spec.jax.describe()
  assert "FSDP2 plan" not in rows  # no fsdp side ran
  assert _plan_text(rec) == describe_plans(side_plans(spec))
  for rel in ("parity/cli/sizing.py", "parity/report/setup_table.py", "parity/history/comparison.py"):
    text = (ROOT / rel).read_text()
    assert "describe" in text, rel
    spelled = [f for f in ("offload_opt_state", "offload_optimizer", "zero_stage", "scan_layers", "reshard_after")
               if f in text]
    assert spelled == [], f"{rel} spells out a plan's fields: {spelled}"
