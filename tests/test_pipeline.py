"""The short pipeline (resolve -> folder -> sides -> collect -> compare -> reruns -> report)
and the worker contract split by its two ends (layout / control / worker side, one worker registry).

The pipeline tests run the real pipeline with a fake `run_side` (no framework: each "side" writes the files a worker
writes), so they take seconds; the end-to-end runs are in test_e2e_compare.py.
"""
from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from parity.inputs import InputError

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- a fake side: the files a worker writes
def _fake_run_side(calls: list, interrupt_on: str | None = None):
  """A stand-in for harness.runner.run_side: writes steps.jsonl, final.safetensors and summary.json as a worker
  would (identical numbers for every side, so the sides agree), honouring stop_after_step."""
  from harness.runner import SideRun
  from parity import weights

  def run_side(run_dir, side, *, timeout_s, on_progress=None, **kw):
    calls.append((Path(run_dir).name, side))
    if side == interrupt_on:
      raise KeyboardInterrupt
    run_dir = Path(run_dir)
    req = json.loads((run_dir / "request.json").read_text())
    steps = req["run"]["train"]["steps"]
    last = req.get("stop_after_step", steps - 1)
    out = run_dir / side
    out.mkdir(parents=True, exist_ok=True)
    recs = [{"step": i, "loss": 5.0 - 0.1 * i, "grad_norm": 1.0, "lr": 1e-3, "loss_scale": 1.0, "skipped": False,
             "step_time_s": 0.1, "tokens": 64} for i in range(last + 1)]
    (out / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    init = weights.load(run_dir / req["init_weights"])
    weights.save({k: v + np.float32(1e-3) for k, v in init.items()}, out / "final.safetensors")
    summary = {"run_id": req["run_id"], "side": side, "status": "ok", "init_s": 1.0, "compile_s": 0.5,
               "train_s": 2.0, "steps_completed": last + 1}
    (out / "summary.json").write_text(json.dumps(summary))
    return SideRun(side, "ok", 0, 4.0, None, summary)
  return run_side


@pytest.fixture
def fake_sides(monkeypatch):
  import harness.runner
  import harness.self_runs
  calls: list = []

  def install(interrupt_on: str | None = None):
    fake = _fake_run_side(calls, interrupt_on)
    monkeypatch.setattr(harness.runner, "run_side", fake)
    monkeypatch.setattr(harness.self_runs, "run_side", fake)
    return calls
  return install


def test_run_comparison_takes_the_resolved_run_and_frozen_options(tmp_path, fake_sides):
  from parity.pipeline.compare import RunOptions, run_comparison
  from parity.pipeline.resolve import resolve_run
  calls = fake_sides()
  run = resolve_run("gpt2-tiny", steps=4, sides=("jax", "torch"))
  options = RunOptions(out=tmp_path / "r", determinism_steps=2, noise_envelope=False)
  with pytest.raises(dataclasses.FrozenInstanceError):
    options.out = tmp_path / "elsewhere"  # type: ignore[misc]
  report = run_comparison(run, options)
  assert report.passed, report.message
  assert calls == [("r", "jax"), ("r", "torch"), ("repeat", "jax"), ("repeat", "torch")]
  data = json.loads((tmp_path / "r" / "report.json").read_text())
  assert data["preset"] == "gpt2-tiny" and data["determinism"]["jax"]["deterministic"] is True
  # busy seconds and the overhead ratio computed once, in build_report: each fake side is busy 3.5 s, the two
  # determinism reruns too; nothing is patched in afterwards
  t = data["timing"]
  assert t["sides_s"] == {"jax": 3.5, "torch": 3.5} and t["self_runs_s"] == pytest.approx(7.0)
  assert t["overhead_ratio"] == pytest.approx(t["wall_s"] / 14.0)
  assert data["run_folder"]["run_id"] == json.loads((tmp_path / "r" / "request.json").read_text())["run_id"]
  assert {"plan", "memory", "noise_envelope", "resume"} <= set(data)


def test_compare_keyword_form_is_resolve_plus_run_comparison(tmp_path, fake_sides):
  import parity
  from parity.pipeline import compare as api
  assert parity.RunOptions is api.RunOptions
  fake_sides()
  report = parity.compare("gpt2-tiny", steps=4, sides=["jax", "torch"], out=tmp_path / "k", determinism_steps=0)
  assert report.passed and report.data["determinism"] == {} and report.data["timing"]["self_runs_s"] == 0.0


def test_the_pipeline_takes_the_after_report_step_from_its_caller(tmp_path, fake_sides):
  """The pipeline never imports the history: its caller hands it the after-report step (parity.compare and
  parity.run_comparison give parity.history.after.PostRun.for_options). The step is prepared before any side starts
  and applied to the written report, whose Report.post it becomes; a baseline or tracker asked for without a step
  is a TypeError before anything runs, never a gate silently skipped."""
  import parity
  from parity.pipeline import compare as api
  from parity.pipeline.resolve import resolve_run
  calls = fake_sides()
  seen = []

  class Step:
    empty = False

    def apply(self, report):
      seen.append(json.loads((report.run_dir / "report.json").read_text())["verdict"]["passed"])
      return "applied"

  def prepare(options):
    assert calls == [] and options.trackers == ("tensorboard:x",)  # before any side
    return Step()

  run = resolve_run("gpt2-tiny", steps=4, sides=("jax", "torch"))
  options = api.RunOptions(out=tmp_path / "s", determinism_steps=0, trackers=["tensorboard:x"])
  report = api.run_comparison(run, options, after=prepare)
  assert seen == [True] and report.post == "applied"
  with pytest.raises(TypeError, match="after-report step"):
    api.run_comparison(run, api.RunOptions(out=tmp_path / "t", baseline=tmp_path / "s"))
  assert not (tmp_path / "t").exists() and len(calls) == 2
  with pytest.raises(InputError, match="baseline"):  # parity.run_comparison prepares the history's step: refused early
    parity.run_comparison(run, api.RunOptions(out=tmp_path / "u", baseline=tmp_path / "missing"))
  assert not (tmp_path / "u").exists() and len(calls) == 2


def test_compare_states_no_option_of_its_own(tmp_path, fake_sides):
  """compare(preset, **keywords) maps its keywords onto resolve_run's parameters (what is run) and
  RunOptions' fields (how), by their names; it restates none, and an unknown keyword is a TypeError naming it, the
  closest valid name and both lists, before anything runs."""
  import inspect
  import parity
  from parity.pipeline import compare as api
  from parity.pipeline.resolve import resolve_run
  assert list(inspect.signature(api.compare).parameters) == ["preset", "after", "keywords"]  # after: the caller's step
  assert list(inspect.signature(parity.compare).parameters) == ["preset", "keywords"]
  assert set(api.SOURCE_KEYWORDS) == set(inspect.signature(resolve_run).parameters) - {"preset_name"}
  assert api.OPTION_FIELDS == tuple(f.name for f in dataclasses.fields(api.RunOptions))
  assert not set(api.SOURCE_KEYWORDS) & set(api.OPTION_FIELDS)  # no keyword could mean two things
  source, how = api.split_keywords({"steps": 4, "out": "o", "hf_model": None, "timeout_s": 3.0})
  assert source == {"steps": 4, "hf_model": None} and how == {"out": "o", "timeout_s": 3.0}
  calls = fake_sides()
  with pytest.raises(TypeError, match=r"unknown keyword\(s\) 'step' \(did you mean 'steps'\?\), 'bogus'; what is "
                                      r"run: .*config, .*hf_model.*; how it runs: out, .*trackers"):
    parity.compare("gpt2-tiny", step=4, bogus=1, out=tmp_path / "u")
  assert calls == [] and not (tmp_path / "u").exists()
  with pytest.raises(TypeError, match="new_option"):
    api.RunOptions(new_option=1)  # type: ignore[call-arg]


def test_run_options_takes_one_string_as_one_item():
  """perturb and trackers: a lone string is one change / one tracker (it was iterated character by character)."""
  from parity.pipeline.compare import RunOptions
  o = RunOptions(perturb="jax:model.norm_eps=1e-3", trackers=["tensorboard:x"])
  assert o.perturb == ("jax:model.norm_eps=1e-3",) and o.trackers == ("tensorboard:x",)
  assert RunOptions(perturb={"jax": {"model.norm_eps": 1e-3}}).perturb == {"jax": {"model.norm_eps": 1e-3}}
  assert RunOptions().progress is True  # one default for compare, run_comparison and the CLI (--no-progress)


def test_ctrl_c_in_a_side_reports_then_reraises(tmp_path, fake_sides):
  """The one run-each-side helper: the side running at Ctrl-C is 'killed', the rest 'not_run', no reruns start,
  the report says INTERRUPTED, then the KeyboardInterrupt reaches the caller."""
  from parity.pipeline.compare import RunOptions, run_comparison
  from parity.pipeline.resolve import resolve_run
  calls = fake_sides(interrupt_on="jax")
  with pytest.raises(KeyboardInterrupt):
    run_comparison(resolve_run("gpt2-tiny", steps=4, sides=("jax", "torch")), RunOptions(out=tmp_path / "c"))
  data = json.loads((tmp_path / "c" / "report.json").read_text())
  assert calls == [("c", "jax")]
  assert data["sides"]["jax"]["status"] == "killed" and data["sides"]["torch"]["status"] == "not_run"
  assert "interrupted" in data["sides"]["torch"]["error"]
  assert data["verdict"]["passed"] is False and data["verdict"]["message"].startswith("INTERRUPTED")
  assert not (tmp_path / "c" / ".parity.lock").exists()  # the folder's claim is released


def test_run_each_side_is_the_one_interrupt_loop():
  from harness.runner import SideRun, run_each_side
  seen = []

  def start(side):
    seen.append(side)
    if side == "b":
      raise KeyboardInterrupt
    return SideRun(side, "ok", 0, 1.0, None, {})
  runs, exc = run_each_side(["a", "b", "c"], start, on_interrupt=lambda s: SideRun(s, "killed", None, 0, None, {}),
                            what="diagnose")
  assert seen == ["a", "b"] and isinstance(exc, KeyboardInterrupt)
  assert [r.status for r in runs.values()] == ["ok", "killed", "not_run"]
  assert runs["c"].error == "not started: the diagnose was interrupted (Ctrl-C)"
  # both drivers use it; neither has its own loop
  for path in ("parity/pipeline/compare.py", "parity/diagnose/driver.py"):
    src = (ROOT / path).read_text()
    assert "run_each_side(" in src and "except KeyboardInterrupt" not in src, path


def test_build_report_assembles_everything_once():
  from harness.runner import SideRun
  from parity.verdict.sides import Verdict
  from parity.report import build_report
  from parity.presets import preset
  spec = preset("gpt2-tiny")
  sr = SideRun("jax", "ok", 0, 9.0, None, {"init_s": 1.0, "compile_s": 1.0, "train_s": 2.0})
  rep = build_report(spec=spec, preset_name="gpt2-tiny", run_dir=Path("/x"), data_info={}, side_runs={"jax": sr},
                     side_steps={"jax": []}, checks=[], params_table=[], verdict=Verdict(True, None, "PASS: ok"),
                     wall_s=12.0, prepare_s=1.0, plan={"name": "p"}, reruns_s=2.0,
                     reruns={"noise_envelope": None, "determinism": {"jax": {"deterministic": True}}, "resume": {}},
                     run_folder={"run_id": "r"}, interrupted=True)
  d = rep.data
  assert d["timing"]["overhead_ratio"] == pytest.approx(12.0 / 6.0) and d["timing"]["self_runs_s"] == 2.0
  assert d["plan"] == {"name": "p"} and d["determinism"]["jax"]["deterministic"] and d["run_folder"] == {"run_id": "r"}
  assert d["verdict"]["passed"] is False and d["verdict"]["message"] == "INTERRUPTED: stopped before every run and " \
      "check finished; so far: ok"
  assert isinstance(d["memory"]["predicted_vs_measured"], list)
  src = (ROOT / "parity" / "pipeline" / "compare.py").read_text()
  import re
  assert not re.search(r"report\.data\[[^\]]*\]\s*=|\.data\.update\(", src)  # nothing patched after build_report


def _functions(path: Path):
  """(name, lines) of every function: from `def` to its end, its docstring not counted (documentation is not size)."""
  tree = ast.parse(path.read_text())
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      doc = node.body[0] if node.body and isinstance(node.body[0], ast.Expr) and \
          isinstance(getattr(node.body[0], "value", None), ast.Constant) and isinstance(node.body[0].value.value, str) \
          else None
      yield node.name, node.end_lineno - node.lineno + 1 - (doc.end_lineno - doc.lineno + 1 if doc else 0)


PIPELINE_FILES = ["parity/pipeline/compare.py", "parity/pipeline/reruns.py", "parity/pipeline/collect.py",
                  "parity/report/build.py", "parity/pipeline/folder.py",
                  "parity/diagnose/__init__.py", "parity/diagnose/driver.py", "parity/protocol/__init__.py",
                  "parity/protocol/layout.py", "parity/protocol/control.py", "parity/protocol/side.py",
                  "parity/protocol/workers.py", "parity/protocol/loop.py", "parity/protocol/diagnose.py",
                  "harness/runner.py", "harness/self_runs.py", "jax_impl/worker.py", "torch_impl/worker.py"]


@pytest.mark.parametrize("path", PIPELINE_FILES)
def test_pipeline_files_and_functions_are_short(path):
  """The size targets: no function over ~60 lines, no file over ~500, compare() <= ~50 (docstrings not counted)."""
  p = ROOT / path
  assert len(p.read_text().splitlines()) <= 500, path
  long = {name: n for name, n in _functions(p) if n > (50 if name in ("compare", "run_comparison") else 60)}
  assert not long, f"{path}: {long}"


def test_diagnose_package_init_is_a_face():
  from parity.diagnose import DiagnoseResult, diagnose
  assert diagnose.__module__ == "parity.diagnose.driver" and DiagnoseResult.__module__ == "parity.diagnose.driver"
  tree = ast.parse((ROOT / "parity" / "diagnose" / "__init__.py").read_text())
  assert all(isinstance(n, (ast.Expr, ast.ImportFrom, ast.Import, ast.Assign)) for n in tree.body)


# ----------------------------------------------------------------------------- item 4: the worker contract
def test_one_worker_registry_by_side_and_job():
  from parity.protocol import workers
  assert workers.SIDE_WORKERS == workers.workers_for("train") == {
      "jax": "jax_impl.worker", "deepspeed": "torch_impl.worker", "torch": "torch_impl.worker",
      "fsdp": "torch_impl.fsdp_worker"}
  assert workers.DIAGNOSE_WORKERS == {"jax": "jax_impl.diagnose", "torch": "torch_impl.diagnose"}
  assert workers.worker_module("deepspeed", "port_verify") == "torch_impl.port_verify"
  for (side, job), module in workers.WORKERS.items():  # every registered module exists
    assert job in workers.JOBS and (ROOT / (module.replace(".", "/") + ".py")).is_file(), (side, job, module)
  with pytest.raises(ValueError, match="no 'diagnose' worker for side 'deepspeed'; the sides with one are jax, torch"):
    workers.worker_module("deepspeed", "diagnose")
  with pytest.raises(ValueError, match="unknown worker job 'train2'"):
    workers.worker_module("jax", "train2")
  from parity.diagnose import DIAGNOSE_WORKERS
  assert DIAGNOSE_WORKERS is workers.DIAGNOSE_WORKERS  # no second table


def test_run_side_takes_its_module_from_the_registry(tmp_path, monkeypatch):
  """run_side(job=...) launches the registry's module; a side without a worker for the job is refused by name."""
  from harness import lifetime, runner
  seen = []

  def spawn(cmd, **kw):
    seen.append(cmd)
    raise RuntimeError("stop here")
  monkeypatch.setattr(lifetime, "spawn", spawn)
  (tmp_path / "request.json").write_text("{}")
  with pytest.raises(RuntimeError, match="stop here"):
    runner.run_side(tmp_path, "torch", timeout_s=1, job="diagnose")
  assert seen[0][3] == "torch_impl.diagnose"
  with pytest.raises(ValueError, match="no 'diagnose' worker for side 'deepspeed'"):
    runner.run_side(tmp_path, "deepspeed", timeout_s=1, job="diagnose")


def test_protocol_split_by_its_two_ends():
  """layout (files, readers) <- control (run control) <- side (the worker end); old import paths still work."""
  from parity import protocol
  from parity.protocol import control, layout, side
  assert protocol.read_steps is layout.read_steps and protocol.SideIO is side.SideIO
  assert protocol.derive_request is control.derive_request and protocol.ControlError is control.ControlError
  imports = {m: {n.module for n in ast.walk(ast.parse((ROOT / "parity" / "protocol" / f"{m}.py").read_text()))
                 if isinstance(n, ast.ImportFrom)} for m in ("layout", "control", "side")}
  assert not {"parity.protocol.control", "parity.protocol.side"} & imports["layout"]
  assert "parity.protocol.side" not in imports["control"]


def test_one_batch_shape_check_for_both_workers(tmp_path):
  from parity.protocol.side import check_batch_shapes
  from parity.presets import preset
  t = preset("gpt2-tiny").train
  want = (t.steps, t.grad_accum_steps, t.micro_batch_size, t.seq_len + 1)
  check_batch_shapes(want, (2, *want[2:]), t)
  with pytest.raises(ValueError, match=r"batches.npy has shape .*regenerate the run folder"):
    check_batch_shapes((t.steps - 1, *want[1:]), None, t)
  with pytest.raises(ValueError, match=r"val_batches.npy has shape \(2, 3\)"):
    check_batch_shapes(want, (2, 3), t)
  for worker in ("jax_impl/worker.py", "torch_impl/worker.py"):  # neither keeps a copy of its own: the loop checks
    src = (ROOT / worker).read_text()
    assert "_check_batches" not in src and "training_batches" not in src and "run_train(io" in src, worker
  assert "io.training_batches()" in (ROOT / "parity" / "protocol" / "loop.py").read_text()


def test_side_io_checks_val_batches_for_every_side(tmp_path):
  """SideIO.training_batches refuses a val_batches.npy of the wrong shape (the torch worker did not check it)."""
  from parity.protocol import REQUEST_SCHEMA, SideIO
  from parity.pipeline.folder import prepare_run_dir
  from parity.presets import preset
  from parity.spec import to_dict
  spec = preset("gpt2-tiny")
  prepare_run_dir(spec, tmp_path)
  io = SideIO(tmp_path / "request.json", "torch")
  batches, val = io.training_batches()
  assert batches.shape[0] >= spec.train.steps and val is not None
  np.save(tmp_path / "val_batches.npy", np.zeros((2, 3), np.uint16))
  with pytest.raises(ValueError, match="val_batches.npy has shape"):
    io.training_batches()
  assert json.loads((tmp_path / "request.json").read_text())["schema"] == REQUEST_SCHEMA and to_dict(spec)


def test_compare_reads_one_sides_string_as_a_comma_list_and_refuses_a_timeout_that_is_no_number():
  """parity.compare(sides='jax') was refused as ['j', 'a', 'x'] and timeout_s='x' raised a bare TypeError from a
  comparison. One string is a comma list, as --sides; a timeout that is no number is a SpecError naming
  --timeout. Both refused before any folder or process exists."""
  import parity
  from parity.spec import SpecError
  with pytest.raises(SpecError, match=r"got \['jax', 'bogus'\]"):
    parity.compare("gpt2-tiny", steps=2, sides="jax,bogus")
  with pytest.raises(SpecError, match="--timeout must be > 0 seconds; got x"):
    parity.compare("gpt2-tiny", steps=2, sides="jax", timeout_s="x", out="/nonexistent-parity-test/run")
