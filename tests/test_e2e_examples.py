"""End to end: padded and packed example batches through `parity compare`, all three sides, fp32.

Two real compares: the built-in SFT demo padded (`--preset sft-tiny`), and a JSONL of short pre-tokenized examples
of varying lengths packed several to a row (attention, positions and targets must stop at each example)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import requires_all

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.process]


def _compare(out: Path, *args: str) -> dict:
  p = subprocess.run([sys.executable, "-m", "parity.cli", "compare", "--preset", "sft-tiny", "--steps", "4",
                      "--determinism-steps", "2", "--out", str(out), "--no-progress", *args],
                     cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  return json.loads((out / "report.json").read_text())


def _check_pass(rep: dict, layout: str) -> None:
  assert rep["verdict"]["passed"] is True and set(rep["sides"]) == {"jax", "deepspeed", "torch"}
  assert rep["data"]["layout"] == layout and rep["data"]["card"]["layout"] == layout
  loss_checks = [c for c in rep["checks"] if c["metric"] in ("loss", "val_loss")]
  assert len(loss_checks) == 6 and all(c["passed"] and c["tolerance"] <= 1e-5 for c in loss_checks)
  for name, s in rep["sides"].items():
    assert s["status"] == "ok" and len(s["series"]["loss"]) == 4, name


@requires_all
def test_the_sft_demo_padded_passes_on_all_three_sides(tmp_path):
  rep = _compare(tmp_path / "run")
  _check_pass(rep, "padded")
  card = rep["data"]["card"]
  assert card["source"].startswith("sft-demo") and 0 < card["padding_fraction"] < 1
  md = (tmp_path / "run" / "report.md").read_text()
  assert "## Data card" in md
  assert json.loads((tmp_path / "run" / "card.json").read_text())["compared"]["data_card"]["layout"] == "padded"


@requires_all
def test_short_examples_packed_several_to_a_row_pass_on_all_three_sides(tmp_path):
  rng = np.random.default_rng(3)
  path = tmp_path / "short.jsonl"
  lines = []
  for n in rng.integers(8, 60, 200):
    ids = rng.integers(0, 256, int(n)).tolist()
    prompt = int(rng.integers(1, n // 2))
    lines.append(json.dumps({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]}))
  path.write_text("\n".join(lines) + "\n")
  rep = _compare(tmp_path / "run", "--data", str(path), "--set", "train.layout=packed")
  _check_pass(rep, "packed")
  seg = np.load(tmp_path / "run" / "segment_ids.npy")
  assert seg.max() >= 3  # several examples in one row: the masks and positions matter
  _tampering_is_caught(tmp_path / "run")


def _verify(rd: Path) -> str:
  from parity.report.read import load_report, verify_report
  return "; ".join(verify_report(load_report(rd)))


def _tampering_is_caught(run: Path) -> None:
  """`parity report` re-verifies what it renders beside the checks, and the example arrays are hashed inputs: each
  edit of a copy is named (the untouched run verifies clean: the control)."""
  import shutil
  assert _verify(run) == ""
  edits = {
      "its data card ('data') is not request.json's": lambda d: d["data"]["card"].update(loss_tokens_total=1),
      "sides.jax.summary is not jax/summary.json": lambda d: d["sides"]["jax"]["summary"].update(compile_s=1e-3),
      "its memory table is not what the sides' summaries give":
          lambda d: d["memory"].update(predicted_vs_measured=[{"side": "jax", "bytes": 1}]),
      "its perturbations table is not what": lambda d: d.update(perturbations=[{"side": "jax", "key": "x"}]),
  }
  for i, (said, edit) in enumerate(edits.items()):
    rd = Path(shutil.copytree(run, run.parent / f"edit{i}", ignore=shutil.ignore_patterns(".parity.lock")))
    d = json.loads((rd / "report.json").read_text())
    edit(d)
    (rd / "report.json").write_text(json.dumps(d))
    assert said in _verify(rd), said
  for name in ("segment_ids.npy", "loss_mask.npy", "val_positions.npy"):
    rd = Path(shutil.copytree(run, run.parent / f"arr-{name}", ignore=shutil.ignore_patterns(".parity.lock")))
    a = np.load(rd / name)
    np.save(rd / name, (~a) if a.dtype == bool else a + 1)
    assert f"{name} (same size, different content)" in _verify(rd), name
