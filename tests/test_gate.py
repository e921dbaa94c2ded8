"""The regression gate (parity/report/gate.py, `parity compare --baseline`, `parity check`) and the tracker
interface (parity/report/trackers.py), on three real gpt2-tiny runs built once per session (`real_runs`): a
baseline, a rerun of the same command gated against it, and a run with train.lr 1e-3 -> 1.1e-3 gated against it."""
from __future__ import annotations

import atexit
import copy
import functools
import json
import shutil
import tempfile
from pathlib import Path

import pytest

from conftest import requires_jax, requires_torch
from parity.inputs import InputError

STEPS = 4  # warmup 1: lr is 0 on steps 0-1, so the planted lr moves lr at step 2 and the loss at step 3
BASE_SET = {"train.warmup_steps": 1}


@functools.cache
def real_runs() -> dict[str, object]:
  """{'base', 'rerun', 'lr'} -> Report: three gpt2-tiny runs (jax, torch; 4 steps; no determinism rerun), the last
  two gated against the first through parity.compare(baseline=...). Built once per test session (~3 x 15-60 s)."""
  from parity.pipeline.compare import compare
  root = Path(tempfile.mkdtemp(prefix="parity-gate-runs-"))
  atexit.register(shutil.rmtree, root, True)  # removed when the test session's process ends
  kw = dict(steps=STEPS, sides=["jax", "torch"], determinism_steps=0)
  base = compare("gpt2-tiny", overrides=BASE_SET, out=root / "base", **kw)
  rerun = compare("gpt2-tiny", overrides=BASE_SET, out=root / "rerun", baseline=root / "base", **kw)
  lr = compare("gpt2-tiny", overrides={**BASE_SET, "train.lr": 1.1e-3}, out=root / "lr", baseline=root / "base", **kw)
  return {"base": base, "rerun": rerun, "lr": lr}


def needs_runs(test):
  """Marks a test that reads real_runs(): slow (starts workers), needs jax and torch."""
  return pytest.mark.slow(requires_jax(requires_torch(test)))


@needs_runs
def test_rerun_of_the_same_command_passes_and_is_bit_identical():
  runs = real_runs()
  rerun = runs["rerun"]
  gate = rerun.post.gate
  assert gate.passed and rerun.exit_code == 0, gate.to_markdown()
  rows = {(r.metric, r.side): r for r in gate.rows}
  for side in ("jax", "torch"):
    for metric in ("loss", "grad_norm", "lr", "val_loss"):
      assert rows[(metric, side)].status == "ok"
      assert rows[(metric, side)].change.startswith("|Δ| 0 at"), rows[(metric, side)]  # fp32 rerun: bit-identical
    assert rows[("step_time", side)].status in ("ok", "skipped")
  assert "same configuration" in gate.notes and "same package versions" in gate.notes
  gate_json = json.loads((Path(rerun.run_dir) / "gate.json").read_text())
  assert gate_json["passed"] is True and (Path(rerun.run_dir) / "gate.md").is_file()


@needs_runs
def test_planted_lr_change_fails_naming_lr_and_loss():
  lr = real_runs()["lr"]
  gate = lr.post.gate
  assert lr.passed, "the sides still agree with each other: only the gate sees the change"
  assert not gate.passed and lr.exit_code == 1
  moved = {(r.metric, r.side) for r in gate.moved}
  for side in ("jax", "torch"):
    assert ("lr", side) in moved and ("loss", side) in moved, moved
  loss_row = next(r for r in gate.moved if r.metric == "loss")
  assert "first outside at step 3" in loss_row.change  # the first step after the first non-zero lr
  assert "lr (jax)" in gate.message() and "loss (jax)" in gate.message()
  assert any("train.lr 0.001 -> 0.0011" in n for n in gate.notes)
  assert "**MOVED**" in (Path(lr.run_dir) / "gate.md").read_text()


@needs_runs
def test_parity_check_cli_exit_codes(capsys):
  from parity.cli import main
  runs = real_runs()
  base, rerun, lr = (str(runs[k].run_dir) for k in ("base", "rerun", "lr"))
  assert main(["check", rerun, base]) == 0
  assert main(["check", lr, base]) == 1
  out = capsys.readouterr().out
  assert "GATE FAIL" in out and "MOVED" in out and "lr (torch)" in out
  assert main(["check", str(Path(base) / "jax"), base]) == 2
  assert "not a parity run folder" in capsys.readouterr().err


def _copy_run(src, dst: Path) -> Path:
  shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".parity.lock"))
  return dst


def _edit_json(path: Path, edit) -> None:
  d = json.loads(path.read_text())
  edit(d)
  path.write_text(json.dumps(d))


@needs_runs
def test_baseline_from_another_machine_skips_time_gates_and_names_versions(tmp_path):
  from parity.report.gate import check_against, load_baseline, snapshot_from_report
  runs = real_runs()
  base = _copy_run(runs["base"].run_dir, tmp_path / "elsewhere")

  def other_machine(d):
    d["environment"]["hostname"] = "build-box-7"
    d["environment"]["cpu_model"] = "Some Other CPU @ 9 GHz"
    d["environment"]["versions"]["jax"] = "0.0.1"
    for s in d["sides"].values():  # the baseline ran 100x faster on a quiet machine: a same-machine gate would fail
      s["summary"]["step_time_s_median"] /= 100
      s["load"] = {"start": [0.1, 0.1, 0.1], "end": [0.2, 0.1, 0.1]}
  _edit_json(base / "report.json", other_machine)
  env = base / "environment.json"
  if env.exists():
    def env_elsewhere(d):
      d["host"].update(hostname="build-box-7", cpu_model="Some Other CPU @ 9 GHz")
      d["packages"]["jax"] = "0.0.1"
    _edit_json(env, env_elsewhere)
  new = snapshot_from_report(runs["rerun"])
  gate = check_against(new, load_baseline(base))
  assert gate.passed and gate.cross_machine, gate.to_markdown()
  assert any("another machine" in n and "build-box-7" in n and "step_time" in n for n in gate.notes), gate.notes
  assert all(r.status == "skipped" and "another machine" in r.note for r in gate.rows if r.metric == "step_time")
  assert any("jax 0.0.1 ->" in n for n in gate.notes), gate.notes
  # the control: the same baseline numbers on this machine, both runs quiet, fail the step-time gate
  here = copy.deepcopy(load_baseline(base))
  here.machine = dict(new.machine)
  quiet = copy.deepcopy(new)
  for f in quiet.figures.values():
    f["load"] = 0.1
  for f in here.figures.values():
    f["load"] = 0.1
  moved = check_against(quiet, here).moved
  assert {r.metric for r in moved} == {"step_time"}, [(r.metric, r.side) for r in moved]


@needs_runs
def test_a_card_is_a_baseline(tmp_path):
  from parity.report.gate import check_against, load_baseline, snapshot_from_report
  runs = real_runs()
  card = Path(runs["base"].run_dir) / "card.json"
  assert card.is_file()
  snap = load_baseline(card)
  assert snap.kind == "card" and snap.series is None and set(snap.sides) == {"jax", "torch"}
  gate = check_against(snapshot_from_report(runs["rerun"]), snap)
  assert gate.passed, gate.to_markdown()
  assert {r.metric for r in gate.rows} >= {"verdict", "max_dloss", "peak_rss", "state_bytes"}
  assert any("is a card" in n for n in gate.notes)
  rows = {(r.metric, r.side): r for r in gate.rows}
  assert rows[("max_dloss", "jax~torch")].status == "ok", rows  # the card's 'jax vs torch' is the same pair
  for side in ("jax", "torch"):
    assert rows[("final_loss", side)].status == "ok" and rows[("loss (step 3)", side)].status == "ok"
    assert "did not record" not in rows[("step_time", side)].note, rows[("step_time", side)]  # card keeps load
  assert not any("absent" in n for n in gate.notes), gate.notes  # only versions both recorded are compared
  assert not any(n.rstrip().endswith("is") for n in gate.notes), gate.notes
  moved = check_against(snapshot_from_report(runs["lr"]), snap)  # a card baseline catches the planted lr change
  assert not moved.passed and {("loss (step 3)", "jax"), ("final_loss", "torch")} <= {(r.metric, r.side)
                                                                                      for r in moved.moved}
  bad = tmp_path / "card.json"
  bad.write_text('{"schema": "something else"}')
  with pytest.raises(InputError, match="not a parity card"):
    load_baseline(bad)


def test_bad_baseline_is_refused_before_anything_runs(tmp_path, capsys):
  from parity.cli import main
  rc = main(["compare", "--preset", "gpt2-tiny", "--steps", "2", "--out", str(tmp_path / "never"),
             "--baseline", str(tmp_path / "nothing-here")])
  assert rc == 2 and "no such file or folder" in capsys.readouterr().err
  assert not (tmp_path / "never").exists()
  (tmp_path / "empty").mkdir()
  rc = main(["compare", "--preset", "gpt2-tiny", "--steps", "2", "--out", str(tmp_path / "never"),
             "--baseline", str(tmp_path / "empty")])
  assert rc == 2 and "neither report.json nor request.json" in capsys.readouterr().err


# ------------------------------------------------------------------ trackers


class FakeTracker:
  def __init__(self):
    self.records, self.closed = [], False

  def log_step(self, side, step, metrics):
    self.records.append((side, step, dict(metrics)))

  def close(self):
    self.closed = True


def test_mirror_sends_every_step_record_of_every_side(tmp_path):
  from parity.report.trackers import mirror_run
  for side, losses in (("jax", [5.0, 4.5, float("nan")]), ("torch", [5.0, 4.4])):
    (tmp_path / side).mkdir()
    lines = [json.dumps({"step": i, "loss": x, "lr": 1e-3, "grad_norm": float("inf") if i == 1 else 1.0,
                         "skipped": False}) for i, x in enumerate(losses)]
    (tmp_path / side / "steps.jsonl").write_text("\n".join(lines) + "\n{\"step\": 9, \"lo")  # a cut last line
  t = FakeTracker()
  n = mirror_run(tmp_path, [t], sides=["jax", "torch"])
  assert n == 5 and t.closed
  assert t.records[0] == ("jax", 0, {"loss": 5.0, "lr": 1e-3, "grad_norm": 1.0})
  assert t.records[1] == ("jax", 1, {"loss": 4.5, "lr": 1e-3})  # inf grad norm left out
  assert t.records[2] == ("jax", 2, {"lr": 1e-3, "grad_norm": 1.0})  # NaN loss left out
  assert [r[0] for r in t.records] == ["jax"] * 3 + ["torch"] * 2


def test_tracker_specs_and_not_installed(tmp_path, capsys):
  from parity.report.trackers import TRACKERS, _installed, check_trackers, parse_tracker
  assert parse_tracker("tensorboard:runs/tb") == ("tensorboard", "runs/tb")
  for bad in ("tensorboard", "tensorboard:", "neptune:x"):
    with pytest.raises(InputError, match="KIND:TARGET"):
      parse_tracker(bad)
  missing = [k for k, (mods, _) in TRACKERS.items() if _installed(*mods) is None]
  if not missing:
    pytest.skip("every tracker package is installed here: no not-installed path to test")
  kind = missing[0]
  with pytest.raises(InputError, match=f"{kind} is not installed.*pip install"):
    check_trackers([f"{kind}:somewhere"])
  from parity.cli import main
  rc = main(["compare", "--preset", "gpt2-tiny", "--steps", "2", "--out", str(tmp_path / "never"),
             "--tracker", f"{kind}:{tmp_path / 'tb'}"])
  assert rc == 2 and "pip install" in capsys.readouterr().err and not (tmp_path / "never").exists()


def test_tensorboard_event_files_when_installed(tmp_path):
  from parity.report.trackers import _installed, open_tracker
  if _installed("tensorboardX", "tensorboard") is None:
    pytest.skip("neither tensorboardX nor tensorboard is installed (optional; the not-installed path is tested)")
  t = open_tracker("tensorboard", str(tmp_path), "run1")
  t.log_step("jax", 0, {"loss": 5.0})
  t.close()
  assert list((tmp_path / "run1" / "jax").glob("events.out.tfevents.*"))


def _snap(passed: bool, source: str, **kw):
  """A minimal Snapshot (no series, one pair) for the gate's own rules, without starting a run."""
  from parity.report.gate import Snapshot
  fig = {"steps_completed": 4, "step_time_s_median": None, "peak_rss_bytes": None, "state_bytes": {},
         "final_loss": None}
  base = dict(source=Path(source), kind="card", precision="fp32", passed=passed,
              verdict="PASS" if passed else "FAIL: loss", sides=["jax", "torch"], series=None,
              figures={"jax": dict(fig), "torch": dict(fig)}, versions={}, machine={}, config={},
              max_dloss={"jax~torch": 1e-6})
  return Snapshot(**{**base, **kw})


def test_a_new_run_that_fails_its_verdict_never_passes_the_gate():
  from parity.report.gate import check_against
  for base_passed in (False, True):
    gate = check_against(_snap(False, "new"), _snap(base_passed, "base"))
    row = next(r for r in gate.rows if r.metric == "verdict")
    assert not gate.passed and gate.exit_code == 1, (base_passed, gate.to_markdown())
    assert row.status == ("MOVED" if base_passed else "FAIL") and "gating" in row.note
    assert "verdict" in gate.message() and ("**MOVED**" if base_passed else "**FAIL**") in gate.to_markdown()
  assert check_against(_snap(True, "new"), _snap(False, "base")).passed  # a fixed run passes a failing baseline
