"""The run folder: no file of an earlier run is read as part of a new one, one run per
folder (a lock), nothing of the user's lost (--force moves aside; port/convert never write over their input), and
the report still written when the disk fails. Fast: no worker runs (run_side is replaced where a rerun is needed)."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from parity.cli import main
from parity.pipeline.claim import LOCK_NAME, read_lock
from parity.pipeline.claim import RunFolderError, RunIOError, claim_run_dir
from parity.pipeline.folder import prepare_run_dir
from parity.pipeline.resolve import resolve

TINY = ["compare", "--preset", "gpt2-tiny", "--sides", "jax,torch", "--steps", "4", "--no-progress"]


def _prepared(path: Path, **kw):
  spec = resolve("gpt2-tiny", steps=4, sides=["jax", "torch"], **kw)
  claim = claim_run_dir(path)
  prepare_run_dir(spec, path, run_id=claim.run_id)
  claim.release()
  return spec, claim.run_id


def _snapshot(folder: Path) -> dict[str, bytes]:
  return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _dead_pid() -> int:
  proc = subprocess.Popen([sys.executable, "-c", "pass"])
  proc.wait()
  return proc.pid


# ------------------------------------------------------------------ item 1: no file of an earlier run is read
def test_compare_refuses_a_folder_holding_an_earlier_run(tmp_path, capsys):
  out = tmp_path / "X"
  _prepared(out, overrides=["train.data_seed=1"])
  (out / "noise").mkdir()
  np.save(out / "noise" / "batches.npy", np.zeros((1, 1, 1, 2), np.uint16))  # the old rerun's input
  before = _snapshot(out)
  rc = main([*TINY, "--set", "train.data_seed=2", "--out", str(out)])
  err = capsys.readouterr().err
  assert rc == 2 and "holds an earlier run" in err and "--force" in err
  assert _snapshot(out) == before and not (out / LOCK_NAME).exists()


def test_prepare_never_writes_over_or_next_to_earlier_inputs(tmp_path):
  spec, _ = _prepared(tmp_path / "a")
  with pytest.raises(RunFolderError, match="earlier run"):
    prepare_run_dir(spec, tmp_path / "a")


def test_noise_rerun_reads_only_this_runs_batches(tmp_path, monkeypatch):
  """The cause of the false PASS: noise/batches.npy of an earlier run was reused. Now the noise folder of another
  run is refused, and the reversed batches are always derived from this run's batches."""
  from harness import self_runs
  from harness.runner import SideRun
  from parity.protocol import ControlError
  monkeypatch.setattr(self_runs, "run_side", lambda sub, side, **kw: SideRun(side, "ok", 0, 0.0, None, {}))
  out = tmp_path / "run"
  _prepared(out)
  (out / "noise").mkdir()
  stale = np.zeros_like(np.load(out / "batches.npy"))
  np.save(out / "noise" / "batches.npy", stale)
  (out / "noise" / "request.json").write_text(json.dumps({"schema": "parity.request/1", "run_id": "0" * 32}))
  with pytest.raises(ControlError, match="belongs to another run"):
    self_runs.run_noise(out, "jax", timeout_s=10)
  (out / "noise" / "request.json").unlink()
  self_runs.run_noise(out, "jax", timeout_s=10)  # same run: its batches are rewritten from this run's
  got = np.load(out / "noise" / "batches.npy")
  assert np.array_equal(got, self_runs.reversed_batches(np.load(out / "batches.npy")))


def test_side_outputs_of_another_run_or_incomplete_are_not_ok(tmp_path):
  from harness.runner import SideRun
  from parity import weights
  from parity.pipeline.collect import side_outputs
  spec, rid = _prepared(tmp_path / "r")
  side = tmp_path / "r" / "jax"
  side.mkdir()
  recs = [{"step": i, "loss": 1.0, "grad_norm": 1.0, "lr": 0.0} for i in range(4)]
  (side / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
  weights.save(weights.load(tmp_path / "r" / "init.safetensors"), side / "final.safetensors")
  ok = lambda **s: SideRun("jax", "ok", 0, 1.0, None, {"status": "ok", **s})
  steps, final = side_outputs(side, ok(run_id=rid), rid, expected_steps=4)
  assert len(steps) == 4 and final is not None
  sr = ok(run_id="f" * 32)
  assert side_outputs(side, sr, rid, expected_steps=4)[1] is None and "another run" in sr.error
  assert sr.status == "crashed" and sr.summary["status"] == "crashed"
  data = (side / "final.safetensors").read_bytes()
  (side / "final.safetensors").write_bytes(data[: len(data) // 2])  # truncated mid-run
  sr = ok(run_id=rid)
  assert side_outputs(side, sr, rid, expected_steps=4)[1] is None and "final.safetensors cannot be read" in sr.error
  (side / "steps.jsonl").write_text(json.dumps(recs[0]) + "\n" + '{"step": 1, "lo')  # truncated
  sr = ok(run_id=rid)
  side_outputs(side, sr, rid, expected_steps=4)
  assert sr.status == "crashed" and "1 whole step records, 4 expected" in sr.error
  (side / "steps.jsonl").unlink()
  sr = ok(run_id=rid)
  side_outputs(side, sr, rid, expected_steps=4)
  assert "steps.jsonl is missing" in sr.error


# ------------------------------------------------------------------ item 3: one run per folder
def test_second_claim_is_refused_naming_the_first(tmp_path):
  first = claim_run_dir(tmp_path / "X", command="parity compare --out X")
  with pytest.raises(RunFolderError, match=rf"live run: pid {os.getpid()} .*command: parity compare --out X"):
    claim_run_dir(tmp_path / "X")
  with pytest.raises(RunFolderError, match="live run"):
    claim_run_dir(tmp_path / "X", force=True)  # --force never moves a live run aside
  first.release()
  assert not (tmp_path / "X" / LOCK_NAME).exists()


@pytest.mark.process
def test_concurrent_claims_exactly_one_wins(tmp_path):
  code = ("import sys, time; sys.path.insert(0, %r); from parity.pipeline.folder import claim_run_dir, RunFolderError\n"
          "time.sleep(max(0, %f - time.time()))\n"
          "try:\n  claim_run_dir(%r); print('won'); time.sleep(1.5)\n"
          "except RunFolderError as e:\n  print('refused', e)\n") % (
              str(Path(__file__).resolve().parents[1]), time.time() + 2.0, str(tmp_path / "X"))
  procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(4)]
  outs = [p.communicate(timeout=60)[0] for p in procs]
  assert sum(o.startswith("won") for o in outs) == 1, outs
  assert all("pid" in o for o in outs if o.startswith("refused")), outs


@pytest.mark.process
def test_a_lock_being_written_by_a_live_run_is_in_use_and_a_dead_one_s_is_cleared(tmp_path):
  """The moment between a racer writing `.parity.lock.<pid>.<id>` and linking it: the folder is in use by that pid
  (was: 'holds files that are not a parity run'); a dead racer's file is parity's leftover, removed."""
  x = tmp_path / "X"
  x.mkdir()
  (x / f"{LOCK_NAME}.{os.getpid()}.0123abcd").write_text("{}")
  with pytest.raises(RunFolderError, match=rf"in use by a run that started at the same moment \(pid {os.getpid()}"):
    claim_run_dir(x)
  (x / f"{LOCK_NAME}.{os.getpid()}.0123abcd").unlink()
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  (x / f"{LOCK_NAME}.{dead.pid}.0123abcd").write_text("{}")
  claim = claim_run_dir(x)
  assert sorted(p.name for p in x.iterdir()) == [LOCK_NAME]
  claim.release()


@pytest.mark.process
def test_stale_lock_is_reported_and_taken_over_safely(tmp_path):
  x = tmp_path / "X"
  x.mkdir()
  lock = {"pid": _dead_pid(), "host": os.uname().nodename, "started_utc": "2026-01-01T00:00:00Z",
          "command": "parity compare --out X", "run_id": "a" * 32}
  (x / LOCK_NAME).write_text(json.dumps(lock))
  assert read_lock(x)["alive"] is False
  claim = claim_run_dir(x)  # nothing but the dead lock: taken over
  assert claim.stale_lock["pid"] == lock["pid"] and read_lock(x)["run_id"] == claim.run_id
  claim.release()
  (x / LOCK_NAME).write_text(json.dumps(lock))
  (x / "batches.npy").write_bytes(b"old")  # the dead run left files: never reused, --force moves them aside
  with pytest.raises(RunFolderError, match="interrupted run .*no longer running.*--force"):
    claim_run_dir(x)
  claim = claim_run_dir(x, force=True)
  assert (claim.moved_to / "batches.npy").read_bytes() == b"old" and not (x / "batches.npy").exists()
  claim.release()


# ------------------------------------------------------------------ item 5: nothing lost
def test_force_moves_the_old_run_aside_whole(tmp_path):
  x = tmp_path / "X"
  _prepared(x)
  (x / "report.json").write_text("{}")
  before = _snapshot(x)
  with pytest.raises(RunFolderError, match="finished run"):
    claim_run_dir(x)
  claim = claim_run_dir(x, force=True)
  assert claim.moved_to.name.startswith("X.old-") and _snapshot(claim.moved_to) == before
  assert [p.name for p in x.iterdir()] == [LOCK_NAME]
  claim.release()


@pytest.mark.parametrize("force", [False, True])
def test_folder_that_is_not_a_run_is_refused_even_with_force(tmp_path, force):
  (tmp_path / "thesis.tex").write_text("mine")
  with pytest.raises(RunFolderError, match="not a parity run.*thesis.tex"):
    claim_run_dir(tmp_path, force=force)
  assert [p.name for p in tmp_path.iterdir()] == ["thesis.tex"]


def test_bad_out_and_refused_runs_leave_nothing(tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert main([*TINY, "--out", ""]) == 2 and "--out is given an empty value" in capsys.readouterr().err
  (tmp_path / "f").write_text("x")
  assert main([*TINY, "--out", "f"]) == 2 and "not a folder" in capsys.readouterr().err
  rc = main([*TINY, "--data", str(tmp_path / "missing.txt"), "--out", "new/deeper/run"])
  assert rc == 2 and "missing.txt" in capsys.readouterr().err
  assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # no empty run folder (nor its parents) left


def _port_args(cfg: Path, *extra: str) -> list[str]:
  return ["port", str(cfg), "--quiet", "--lr", "1e-4", "--micro-batch", "2", "--grad-accum", "1", "--bf16",
          "--warmup-steps", "10", "--total-steps", "100", "--max-grad-norm", "1", "--betas", "0.9,0.999",
          "--eps", "1e-8", "--weight-decay", "0", *extra]


def test_port_never_writes_over_its_input_or_a_foreign_file(tmp_path, capsys, monkeypatch):
  pytest.importorskip("pydantic")
  monkeypatch.chdir(tmp_path)
  cfg = tmp_path / "ds.json"
  text = json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 1}})
  cfg.write_text(text)
  (tmp_path / "link.json").symlink_to(cfg)
  (tmp_path / "sub").mkdir()
  notes = tmp_path / "notes.md"
  notes.write_text("my notes")
  for extra in (["-o", "ds.json"], ["-o", "link.json"], ["-o", "sub/../ds.json"], ["--report-md", str(cfg)],
                ["--report-md", "notes.md"], ["-o", "a.yaml", "--report-md", "a.yaml"], ["-o", ""]):
    assert main(_port_args(Path("ds.json"), *extra)) == 2, extra
    assert "error" in capsys.readouterr().err
  assert cfg.read_text() == text and notes.read_text() == "my notes" and not (tmp_path / "a.yaml").exists()
  assert main(_port_args(cfg, "-o", "a.yaml", "--report-md", "m.md")) == 0
  assert main(_port_args(cfg, "-o", "a.yaml", "--report-md", "m.md")) == 0  # its own outputs are replaced


def test_convert_force_never_deletes_the_source_or_a_foreign_folder(tmp_path, capsys):
  from parity import hf
  from parity.presets import preset
  spec = preset("gpt2-tiny").model
  from parity import weights
  src = tmp_path / "w.safetensors"
  hf.save_canonical(src, weights.init_params(spec, 0), spec)
  data = src.read_bytes()
  (tmp_path / "mine").mkdir()
  (tmp_path / "mine" / "thesis.tex").write_text("x")
  (tmp_path / "not.safetensors").write_text("not weights")
  cases = [[str(src), str(src)], [str(src), str(tmp_path / "." / "w.safetensors")],
           [str(src), str(tmp_path / "mine"), "--to", "hf"], [str(src), str(tmp_path / "not.safetensors")],
           [str(src), str(tmp_path), "--to", "hf"]]
  for args in cases:
    assert main(["convert-weights", *args, "--force"]) == 2, args
    assert "error" in capsys.readouterr().err
  assert src.read_bytes() == data and (tmp_path / "mine" / "thesis.tex").exists()
  assert (tmp_path / "not.safetensors").read_text() == "not weights"
  out = tmp_path / "copy.safetensors"
  assert main(["convert-weights", str(src), str(out)]) == 0
  assert main(["convert-weights", str(src), str(out)]) == 2  # exists, no --force
  assert main(["convert-weights", str(src), str(out), "--force"]) == 0  # a canonical file: replaced
  assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.safetensors", "mine", "not.safetensors", "w.safetensors"]


# ------------------------------------------------------------------ item 6: disk full, read-only, files missing
def test_prepare_on_a_full_disk_names_the_file_and_exits_1(tmp_path, capsys, monkeypatch):
  import builtins
  real_open = builtins.open

  def full(path, mode="r", *a, **k):
    if "x" in mode and str(path).endswith("init.safetensors"):
      raise OSError(errno.ENOSPC, "No space left on device")
    return real_open(path, mode, *a, **k)
  monkeypatch.setattr(builtins, "open", full)
  out = tmp_path / "run"
  rc = main([*TINY, "--out", str(out)])
  err = capsys.readouterr().err
  assert rc == 1 and "init.safetensors" in err and "No space left" in err and "Traceback" not in err
  assert not out.exists()  # refused before any side: nothing of this run left


def test_report_written_wherever_it_can_be(tmp_path, monkeypatch):
  from parity.report import Report
  from parity.report import write as rw
  report = Report(data={"verdict": {"passed": True, "message": "PASS: test"}, "sides": {},
                        "run_folder": {"run_id": "b" * 32}}, run_dir=tmp_path / "run")
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "metrics.jsonl").write_text("kept\n")
  monkeypatch.setattr(rw, "write_markdown", lambda r, p: Path(p).write_text("# md"))
  monkeypatch.setattr(rw, "write_plot", lambda r, p: False)
  monkeypatch.setattr(rw.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
  real = rw.atomic_write

  def enospc_in_run(path, write):
    if path.parent == tmp_path / "run":
      raise OSError(errno.ENOSPC, "No space left on device")
    return real(path, write)
  monkeypatch.setattr(rw, "atomic_write", enospc_in_run)
  written = rw.write_all(report)
  assert report.exit_code == 1 and {e["file"] for e in report.data["write_errors"]} >= {
      str(tmp_path / "run" / "report.json"), str(tmp_path / "run" / "metrics.jsonl")}
  fallback = Path(report.data["report_written_to"])
  assert written["json"] == fallback / "report.json" and fallback.parent == tmp_path / "tmp"
  assert json.loads((fallback / "report.json").read_text())["write_errors"]
  assert (tmp_path / "run" / "metrics.jsonl").read_text() == "kept\n"  # what was written stays


@pytest.mark.process
def test_runner_survives_an_unwritable_side_folder(tmp_path):
  from harness.runner import run_side
  (tmp_path / "request.json").write_text("{}")
  (tmp_path / "jax").write_text("a file where the side folder should be")
  sr = run_side(tmp_path, "jax", timeout_s=5)
  assert sr.status == "not_run" and "cannot prepare" in sr.error


def test_run_io_error_reads_as_its_message():
  assert str(RunIOError(errno.ENOSPC, "cannot write X (No space left on device)")).startswith("cannot write X")


def test_read_only_or_full_folder_at_claim_exits_1_and_leaves_nothing(tmp_path, capsys, monkeypatch):
  def erofs(*a, **k):
    raise OSError(errno.EROFS, "Read-only file system")
  monkeypatch.setattr(os, "link", erofs)
  rc = main([*TINY, "--out", str(tmp_path / "a" / "run")])
  err = capsys.readouterr().err
  assert rc == 1 and "Read-only file system" in err and ".parity.lock" in err and "Traceback" not in err
  assert list(tmp_path.iterdir()) == []


def test_force_replaces_only_a_checkpoint_of_the_output_format(tmp_path):
  from parity.hf.convert import looks_like
  ob = tmp_path / "ob"
  for d in ("params", "model_spec"):
    (ob / d).mkdir(parents=True)
  (ob / "_CHECKPOINT_METADATA").write_text("{}")
  (ob / "commit_success.txt").write_text("ok")
  assert looks_like(ob, "orbax") and not looks_like(ob, "hf") and not looks_like(ob, "canonical")
  (ob / "thesis.tex").write_text("mine")
  assert not looks_like(ob, "orbax")
  hf_dir = tmp_path / "hf"
  hf_dir.mkdir()
  (hf_dir / "config.json").write_text("{}")
  assert not looks_like(hf_dir, "hf")  # no weights file: not a checkpoint
  (hf_dir / "model.safetensors").write_bytes(b"x")
  assert looks_like(hf_dir, "hf")
  (hf_dir / "src").mkdir()
  assert not looks_like(hf_dir, "hf")  # a project folder with a config.json is not replaced


# ----------------------------------------------------------------------------- what a lock or a folder says it is


@pytest.mark.parametrize("content", ["garbage{", "", "[1, 2]", '{"pid": 5}'])
def test_unreadable_lock_is_named_not_taken_for_another_host(tmp_path, content):
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / LOCK_NAME).write_text(content)
  with pytest.raises(RunFolderError, match=r"lock file .*\.parity\.lock cannot be read .* remove that file") as e:
    claim_run_dir(tmp_path / "run")
  assert "another host" not in str(e.value) and "pid ?" not in str(e.value)


def test_a_diagnose_folder_is_named_as_one(tmp_path):
  from parity.inputs import InputError
  from parity.report.read import load_report
  d = tmp_path / "dg"
  d.mkdir()
  (d / "request.json").write_text('{"schema": "parity.request/1"}')
  (d / "diagnose.json").write_text('{"schema": "parity.diagnose/1"}')
  (d / "diagnose.md").write_text("# diagnose\n")
  with pytest.raises(RunFolderError, match="holds a diagnose run"):
    claim_run_dir(d)
  with pytest.raises(InputError, match=r"holds a `parity diagnose` run.*diagnose\.md"):
    load_report(d)


@pytest.mark.parametrize("marker,inner", [
    ("report.json", "jax/nested"), ("request.json", "a/b/c"), (".parity.lock", "x"), ("diagnose.json", "torch")])
def test_out_inside_a_run_folder_is_refused(tmp_path, marker, inner):
  run = tmp_path / "base"
  run.mkdir()
  (run / marker).write_text('{"schema": "parity.x/1", "pid": 1, "host": "h"}')
  with pytest.raises(RunFolderError, match=f"inside the parity run folder {run}"):
    claim_run_dir(run / inner)
  assert not (run / inner).exists()


def test_out_next_to_a_run_or_under_a_users_config_is_accepted(tmp_path):
  """Only parity's own files mark a run: a project folder with its own config.json/report.json is not one."""
  (tmp_path / "config.json").write_text("{}")
  (tmp_path / "report.json").write_text('{"schema": "mine"}')
  claim = claim_run_dir(tmp_path / "runs" / "one")
  claim.release()
