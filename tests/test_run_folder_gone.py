"""A run folder deleted while the run runs: the side that was running is 'crashed' saying so, no later side is
started (its folder is never recreated), and the verdict names the folder (exit 1). Before, every side was reported
'crashed, 0 steps' and each later side was started on the recreated, empty folder."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

VANISH = textwrap.dedent("""
  import shutil, sys
  from pathlib import Path
  with open(sys.argv[0].replace("vanish.py", "starts.txt"), "a") as f:
    f.write(sys.argv[sys.argv.index("--side") + 1] + "\\n")
  shutil.rmtree(Path(sys.argv[1]).parent, ignore_errors=True)  # the run folder, under the running worker
  sys.exit(1)
""")
"""A worker that deletes its own run folder (argv: request.json --side S) and fails, counting its starts beside it."""


@pytest.fixture
def vanish(tmp_path):
  mod = tmp_path / "mods"
  mod.mkdir()
  (mod / "vanish.py").write_text(VANISH)
  return mod


@pytest.mark.process
def test_no_side_starts_after_the_run_folder_vanished(tmp_path, vanish):
  from harness.runner import not_run, run_each_side, run_side
  run = tmp_path / "run"
  run.mkdir()
  (run / "request.json").write_text("{}")
  runs, interrupted = run_each_side(
      ["jax", "torch", "fsdp"],
      lambda s: run_side(run, s, timeout_s=30, module="vanish", env={"PYTHONPATH": str(vanish)}),
      on_interrupt=lambda s: not_run(s, "interrupted"))
  assert interrupted is None
  assert (vanish / "starts.txt").read_text().split() == ["jax"]  # one worker started, not three
  assert not run.exists()  # never recreated by a later side
  jax = runs["jax"]
  assert jax.status == "crashed" and f"the run folder {run} was deleted or moved" in jax.error, jax.error
  assert "while jax ran" in jax.error
  for side in ("torch", "fsdp"):
    assert runs[side].status == "not_run" and runs[side].error.startswith(f"not started: the run folder {run}")


@pytest.mark.process
def test_compare_names_the_vanished_folder_and_fails(tmp_path, vanish, monkeypatch):
  """Through parity.compare: the verdict sentence names the folder, the side it stopped and the sides not started;
  the report goes to the fallback folder (the run folder is not recreated), so the exit code is 1."""
  import parity
  from harness import runner
  from parity.report.headline import verdict_sentence
  monkeypatch.setattr(runner, "worker_module", lambda side, job: "vanish")
  monkeypatch.setenv("PYTHONPATH", str(vanish))
  out = tmp_path / "run"
  report = parity.compare("gpt2-tiny", sides=["jax", "torch"], out=out, steps=2, determinism_steps=0,
                          progress=False)
  assert not report.passed
  sentence = verdict_sentence(report.record)
  assert sentence.startswith(f"FAIL: the run folder {out} was deleted or moved while the run was running"), sentence
  assert "jax stopped after 0 of 2 steps" in sentence and "torch was not started" in sentence, sentence
  assert (vanish / "starts.txt").read_text().split() == ["jax"]
  assert report.data["write_errors"] and not Path(out).exists()
  assert report.exit_code == 1
