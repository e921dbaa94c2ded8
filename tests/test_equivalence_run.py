"""--equivalence end to end: real compares of short examples packed several to a row, with the
equivalence reruns (one module-scoped run per normalisation, every assertion reads those folders).

  tokens      jax and torch, --equivalence ga,packing: each side's GA-1 and padded reruns hold to fp32 rounding
              (gating checks, PASS), and report.json / report.md / report.html / the terminal show them.
  micro_mean  torch only, --equivalence ga: the GA-1 rerun is measurably apart; reported, not failing (exit 0).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import requires_jax, requires_torch
from test_equivalence import _short_examples

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.process, requires_torch]


def _compare(out: Path, data: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
  p = subprocess.run([sys.executable, "-m", "parity.cli", "compare", "--preset", "sft-tiny", "--data", str(data),
                      "--set", "train.layout=packed", "--set", "train.seq_len=64", "--set", "train.eval_every=0",
                      "--set", "train.warmup_steps=1", "--set", "model.n_layers=1", "--steps", "3",
                      "--determinism-steps", "0", "--out", str(out), "--no-progress", *args],
                     cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert (out / "report.json").exists(), p.stdout[-3000:] + p.stderr[-3000:]
  return p, json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  return _short_examples(tmp_path_factory.mktemp("equivalence-data") / "short.jsonl", n=200)


@pytest.fixture(scope="module")
def tokens_run(tmp_path_factory, data):
  out = tmp_path_factory.mktemp("equivalence") / "tokens"
  return (out, *_compare(out, data, "--sides", "jax,torch", "--equivalence", "ga,packing"))


@pytest.fixture(scope="module")
def micro_run(tmp_path_factory, data):
  out = tmp_path_factory.mktemp("equivalence") / "micro"
  return (out, *_compare(out, data, "--sides", "torch", "--equivalence", "ga",
                         "--set", "train.loss_normalization=micro_mean"))


@requires_jax
def test_tokens_holds_every_equivalence_to_fp32_rounding_on_both_sides(tokens_run):
  out, p, rep = tokens_run
  assert p.returncode == 0 and rep["verdict"]["passed"], rep["verdict"]["message"]
  eq = [c for c in rep["checks"] if c["metric"].startswith("equivalence")]
  assert sorted(c["name"] for c in eq) == ["equivalence ga jax", "equivalence ga torch", "equivalence packing jax",
                                           "equivalence packing torch"]
  assert all(c["gating"] and c["passed"] and c["value"] <= 1e-5 for c in eq)
  sec = rep["equivalence"]
  assert sec["ga"]["rerun"]["changed"]["grad_accum_steps"] == 1
  assert sec["packing"]["rerun"]["changed"]["layout"] == "padded"
  assert sec["ga"]["loss_tokens_per_step"] == sec["packing"]["loss_tokens_per_step"]  # the same loss tokens
  assert "## Equivalence" in (out / "report.md").read_text()
  assert 'id="equivalence"' in (out / "report.html").read_text()
  assert "equivalence packing torch (tokens): max |Δloss|" in p.stdout


@requires_jax
def test_the_packed_and_padded_reruns_really_differ_in_layout(tokens_run):
  out = tokens_run[0]
  assert np.load(out / "segment_ids.npy").max() >= 2  # several examples to a row in the main run
  assert np.load(out / "equivalence" / "packing" / "segment_ids.npy").max() == 1  # one per row in the rerun


def test_micro_mean_reports_how_far_apart_without_failing(micro_run):
  _, p, rep = micro_run
  assert p.returncode == 0, rep["verdict"]["message"]
  (c,) = [c for c in rep["checks"] if c["metric"].startswith("equivalence")]
  assert c["metric"] == "equivalence_ga_distance" and c["gating"] is False
  assert c["value"] > 100 * 1e-5 and not c["passed"]  # measured 5.1e-3: far past fp32 rounding
  row = rep["equivalence"]["ga"]["sides"]["torch"]
  assert row["max_abs_loss_diff"] == c["value"] and row["params_ratio_max"] > 0
  assert "reported only (distance)" in p.stdout


@requires_jax
def test_parity_report_verify_recomputes_the_equivalence_checks_and_catches_an_edit(tokens_run, tmp_path):
  import shutil
  from parity.report.read import load_report, verify_report
  out = tokens_run[0]
  assert verify_report(load_report(out)) == []
  copy = tmp_path / "copy"
  shutil.copytree(out, copy)
  rep = json.loads((copy / "report.json").read_text())
  rep["equivalence"]["ga"]["sides"]["jax"]["max_abs_loss_diff"] = 0.5  # an edited figure
  (copy / "report.json").write_text(json.dumps(rep))
  assert any("equivalence section" in line for line in verify_report(load_report(copy)))


def test_equivalence_asked_for_a_side_that_died_is_a_named_failure(tmp_path, data):
  """A side killed in its main run gets no equivalence rerun: the report says it was asked for and not run (a failing
  'reruns' check naming the kind and the side), instead of an equivalence section without that side."""
  from parity.report.read import load_report, verify_report
  out = tmp_path / "killed"
  p, rep = _compare(out, data, "--sides", "torch", "--equivalence", "ga", "--perturb", "torch:kill_at_step=1")
  assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
  rows = [c for c in rep["checks"] if c["metric"] == "reruns"]
  assert len(rows) == 1 and not rows[0]["passed"] and rows[0]["gating"]
  assert "--equivalence ga was not run for torch (killed)" in rows[0]["detail"], rows[0]["detail"]
  assert verify_report(load_report(out)) == []
