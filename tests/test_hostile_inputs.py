"""Hostile input, refused by name: numbers written in other scripts' digits ('²', '１６') in environment variables,
flags and --set values; a model too deep to plan; a full disk named as such in a crashed side's reason. In process
but one test (a worker that dies silently on a full disk)."""
from __future__ import annotations

import contextlib
import errno
import io
import os
import sys
import time
from pathlib import Path

import pytest

from parity.cli import main
from parity.errors import SpecError


def _cli(*argv) -> tuple[int, str]:
  """main(argv) in this process: (exit code, stderr); argparse's usage errors give SystemExit's code."""
  err = io.StringIO()
  with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    try:
      rc = main([str(a) for a in argv])
    except SystemExit as exc:
      rc = exc.code
  return rc, err.getvalue()


# ----------------------------------------------------------------------------- numbers in ASCII digits only
@pytest.mark.parametrize("text, kind, want", [
    ("12", int, 12), (" -3 ", int, -3), ("+4", int, 4), ("1e3", float, 1000.0), (".5", float, 0.5),
    ("inf", float, float("inf")), ("1.", float, 1.0)])
def test_ascii_numbers_read_as_numbers(text, kind, want):
  from parity.inputs import ascii_number
  assert ascii_number(text, kind) == want


@pytest.mark.parametrize("text, kind", [
    ("²", int), ("１６", int), ("٣", int), ("1_000", int), ("", int), ("1.5", int), ("١.٥", float), ("1e٣", float),
    ("１.５", float), ("0x10", int)])
def test_other_digits_are_refused_though_int_and_float_read_them(text, kind):
  from parity.inputs import ascii_number
  with pytest.raises(ValueError, match="in ASCII digits"):
    ascii_number(text, kind)
  assert ascii_number("5", sign=False) == 5
  with pytest.raises(ValueError):
    ascii_number("+5", sign=False)


def test_a_superscript_tpu_premapped_size_is_refused_naming_the_variable(monkeypatch):
  """`TPU_PREMAPPED_BUFFER_SIZE='²' parity plan` gave a traceback: str.isdigit takes '²', int() does not."""
  from parity.sizing.host_limits import tpu_premapped_setting
  with pytest.raises(SpecError, match="TPU_PREMAPPED_BUFFER_SIZE='²': must be a whole number of bytes > 0 in ASCII"):
    tpu_premapped_setting({"TPU_PREMAPPED_BUFFER_SIZE": "²"})
  with pytest.raises(SpecError, match="TPU_PREMAPPED_BUFFER_SIZE='１６'"):  # int() read it as 16
    tpu_premapped_setting({"TPU_PREMAPPED_BUFFER_SIZE": "１６"})
  assert tpu_premapped_setting({"TPU_PREMAPPED_BUFFER_SIZE": "268435456"}) == 268435456
  monkeypatch.setenv("TPU_PREMAPPED_BUFFER_SIZE", "²")
  rc, err = _cli("plan", "--hardware", "TPU-v5e")
  assert rc == 2 and "TPU_PREMAPPED_BUFFER_SIZE='²'" in err and "Traceback" not in err, err
  assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, named", [
    (["plan", "--micro-batch", "１"], "argument --micro-batch: expected an integer in ASCII digits, got '１'"),
    (["plan", "--mfu", "０.５"], "argument --mfu: expected a number in ASCII digits, got '０.５'"),
    (["estimate", "--ranks", "²"], "argument --ranks: expected an integer in ASCII digits, got '²'"),
    (["compare", "--steps", "４"], "argument --steps: expected an integer in ASCII digits, got '４'"),
    (["plan", "--set", "train.steps=１６"], "train.steps: expected an integer, got '１６'; write it in ASCII digits"),
    (["plan", "--set", "train.lr=１e-3"], "train.lr: expected a finite number, got '１e-3'; write it in ASCII digits"),
    (["plan", "--opt-ratios", "0.5,１"], "--opt-ratios '0.5,１'"),
])
def test_flags_and_set_values_in_other_digits_are_refused(argv, named):
  """argparse's int() and float() (and the config's coercion) read '１' as 1: every one is refused, exit 2."""
  rc, err = _cli(*argv)
  assert rc == 2 and named in err and "Traceback" not in err, err


def test_a_coordinator_port_in_other_digits_is_refused():
  from parity.protocol.ranks import check_coordinator, rank_env
  for port in ("²", "２９５００", " 80"):
    with pytest.raises(SpecError, match="--coordinator 'h:.*expected HOST:PORT"):
      check_coordinator(f"h:{port}", nnodes=2)
  check_coordinator("h:29500", nnodes=2)
  assert rank_env({"RANK": "１", "WORLD_SIZE": "２"}) == (0, 1) and rank_env({"RANK": "1", "WORLD_SIZE": "2"}) == (1, 2)


# ----------------------------------------------------------------------------- a model too deep to plan
@pytest.mark.parametrize("command", ["plan", "estimate"])
def test_an_absurd_depth_is_refused_at_once_naming_the_key_and_the_limit(command):
  """`parity plan --set model.n_layers=1000000000` was still running at 306 s (the memory model lists every
  layer's tensors)."""
  t0 = time.monotonic()
  rc, err = _cli(command, "--set", "model.n_layers=1000000000")
  assert rc == 2 and "model.n_layers=1,000,000,000: the planner and the memory model cost at most 1,024 layers" in err
  assert time.monotonic() - t0 < 10 and "Traceback" not in err


def test_the_planner_refuses_a_deep_model_and_counts_params_in_closed_form():
  import dataclasses
  from parity.presets import PRESETS
  from parity.sizing import memory, plans
  from parity.weights import n_params
  deep = dataclasses.replace(PRESETS["gpt2-tiny"].model, n_layers=plans.MAX_PLAN_LAYERS + 1)
  with pytest.raises(SpecError, match="model.n_layers=1,025"):
    plans.choose_plan(deep, PRESETS["gpt2-tiny"].train, plans.HARDWARE["H100"])
  for name, run in PRESETS.items():  # the closed form is the per-tensor count
    assert memory.param_count(run.model) == n_params(run.model), name
  t0 = time.monotonic()
  assert memory.param_count(dataclasses.replace(deep, n_layers=10**9)) > 10**9
  assert time.monotonic() - t0 < 1


# ----------------------------------------------------------------------------- a full disk, named
ENOSPC_TB = ('Traceback (most recent call last):\n'
             '  File "/r/parity/protocol/side.py", line 431, in finish\n'
             '    (self.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))\n'
             '  File "/usr/lib/python3.11/pathlib.py", line 1079, in write_text\n'
             '    return f.write(data)\n'
             'OSError: [Errno 28] No space left on device\n')


def _statvfs_full(monkeypatch, under: Path):
  """os.statvfs reporting no free block for paths under `under` (the disk filled by the run)."""
  real = os.statvfs

  def statvfs(path):
    st = real(path)
    if not str(Path(path)).startswith(str(under)):
      return st
    return os.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks, 0, 0, st.f_files, st.f_ffree, st.f_favail,
                              st.f_flag, st.f_namemax))
  monkeypatch.setattr(os, "statvfs", statvfs)


def test_a_side_that_died_silently_on_a_full_disk_is_named(tmp_path, monkeypatch):
  """After a disk-full mid-run the crash reasons were blank: the worker could write neither its summary nor its
  stderr.log, and the harness said 'worker exited with code 1 without a summary:' and nothing more."""
  from harness import runner
  from parity.report.headline import error_clause
  out = tmp_path / "torch"
  out.mkdir()
  blank = "worker exited with code 1 without a summary:\n"
  assert runner._disk_full_first("crashed", blank, None, "", out) == blank  # a disk with room: no such claim
  _statvfs_full(monkeypatch, tmp_path)
  error = runner._disk_full_first("crashed", blank, None, "", out)
  assert error.splitlines()[0] == f"No space left on device (disk full while writing {out})"
  assert error_clause({"error": error}) == f"No space left on device (disk full while writing {out})"
  assert runner._disk_full_first("killed", "worker killed by signal SIGKILL", None, "", out).startswith("worker")
  assert runner._disk_full_first("crashed", "ValueError: x", {"status": "crashed"}, "", out) == "ValueError: x"


def test_a_recorded_enospc_names_the_file_being_written(tmp_path):
  from harness import runner
  from parity.report.headline import error_clause
  out = tmp_path / "torch"
  summary = {"status": "crashed", "error": "OSError: [Errno 28] No space left on device", "traceback": ENOSPC_TB}
  error = runner._disk_full_first("crashed", summary["error"], summary, "", out)
  assert error.splitlines()[0] == f"No space left on device (disk full while writing {out / 'summary.json'})"
  assert error.splitlines()[1] == summary["error"]  # the worker's own words follow
  assert error_clause({"error": error}).endswith(f"(disk full while writing {out / 'summary.json'})")
  stderr = f"[torch] crashed: OSError(28, ...)\nOSError: [Errno 28] No space left on device: '{out}/steps.jsonl'\n"
  error = runner._disk_full_first("crashed", "worker exited with code 1 without a summary:\n" + stderr, None, stderr,
                                  out)
  assert error.startswith(f"No space left on device (disk full while writing {out}/steps.jsonl)\n")


def test_the_harness_names_a_full_disk_where_it_writes(tmp_path, monkeypatch):
  from harness import runner

  def full(self, *a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(Path, "write_text", full)
  summary = {"status": "crashed"}
  runner._write_summary(tmp_path, summary)
  assert summary["summary_not_written"] == f"No space left on device (disk full while writing {tmp_path}/summary.json)"
  monkeypatch.undo()

  def prepare_full(run_dir, out):
    raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(runner, "_prepare", prepare_full)
  (tmp_path / "request.json").write_text("{}")
  sr = runner.run_side(tmp_path, "torch", timeout_s=5)
  assert sr.status == "not_run" and f"(No space left on device (disk full while writing {tmp_path / 'torch'}))" in \
      sr.error


@pytest.mark.process
def test_a_worker_that_dies_without_a_word_on_a_full_disk_is_named(tmp_path, monkeypatch):
  """The whole path: a worker that exits 1 leaving no summary and an empty stderr.log, on a disk with no free block."""
  from harness.runner import run_side
  from parity.report.headline import error_clause
  (tmp_path / "request.json").write_text("{}")
  (tmp_path / "silent.py").write_text("import sys\nsys.exit(1)\n")
  _statvfs_full(monkeypatch, tmp_path)
  sr = run_side(tmp_path, "torch", timeout_s=30, module="silent", env={"PYTHONPATH": str(tmp_path)},
                python=sys.executable)
  assert sr.status == "crashed"
  assert error_clause(sr.summary) == f"No space left on device (disk full while writing {tmp_path / 'torch'})"
