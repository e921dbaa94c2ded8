"""benchmarks/tpu_parts/offload.py, the offload benchmark: its arithmetic on the records a TPU v5e gave, and its
driver end to end on CPU (tiny mode: the figures are checks, not measurements)."""
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from benchmarks.tpu_parts import offload_report as rep

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "tpu_v5e" / "offload"


def _recorded():
  run2 = json.loads((DATA / "run2-micro2.json").read_text())
  run3 = json.loads((DATA / "run3-rates-home-after.json").read_text())
  return run2, run3


def test_the_recorded_chip_runs_derive_the_published_figures():
  run2, run3 = _recorded()
  rate = run3["children"]["rates"]["both"]["gb_per_s"]
  assert 18 < rate < 20  # donated buffers, both ways together
  rows = {(r["variant"], r["grad_accum"]): r for r in rep.derive(run2["children"]["timing"]["rows"], rate)
          if "median_s" in r}
  stream = rows[("opt-stream", 16)]
  base = rows[("no-offload", 16)]
  assert stream["vs_no_offload"] == pytest.approx(base["median_s"] / stream["median_s"])
  assert stream["vs_no_offload"] == pytest.approx(0.837, abs=0.005)
  assert stream["transfer_s"] == pytest.approx(stream["entry_moved_bytes"] / (rate * 1e9))
  assert stream["added_s"] == pytest.approx(stream["median_s"] - base["median_s"])
  assert stream["hidden"] == 0.0  # added more than the transfer: clamped, never negative
  assert stream["link_bound"] == 1.0 and stream["of_bound"] == pytest.approx(stream["vs_no_offload"])
  assert stream["saved_fraction"] == pytest.approx((base["device_bytes"] - stream["device_bytes"])
                                                   / stream["host_state_bytes"])
  # the device figure is XLA's peak less the step's host buffers, never the compiler's sum the row kept
  assert stream["device_bytes"] == stream["memory_analysis"]["peak_memory_in_bytes"] - 2_168_727_040
  assert stream["device_bytes"] < stream["device_peak_bytes"]
  assert stream["host_state_bytes"] == 2168725516  # the two Adam moments of 271M params in pinned_host
  small = rows[("opt-deferred", 2)]
  assert small["link_bound"] == pytest.approx(rows[("no-offload", 2)]["median_s"] / small["transfer_s"])
  # what the chip said: no layout hid more than a twentieth of its copy time
  assert all(r["hidden"] < 0.05 for r in rows.values() if "hidden" in r)


def test_the_tables_render_from_a_recorded_run():
  run2, run3 = _recorded()
  md = rep.markdown(run2)
  assert "| opt-stream | 32768 | 22,389 |" in md and "TPU v5 lite" in md
  assert "CompileTimeHostOffloadOutputLocationMismatch" in md  # unpinned_host refused by the compiler, recorded
  assert "| both | 18.81 |" in rep.markdown(run3)
  assert rep.peak_bf16("TPU v5 lite") == 197e12 and rep.peak_bf16("cpu") is None


@pytest.mark.process
@pytest.mark.slow
def test_the_driver_runs_rates_and_a_deferred_timing_on_cpu(tmp_path):
  proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tpu_parts" / "offload.py"), "--tiny", "--out",
                         str(tmp_path), "--only", "rates,timing", "--variants", "no-offload,opt-deferred",
                         "--budget-s", "240", "--steps", "1", "--warmup", "1"],
                        capture_output=True, text=True, timeout=400, cwd=ROOT)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  data = json.loads((tmp_path / "offload" / "offload.json").read_text())
  rates = data["children"]["rates"]
  assert all(rates[k]["gb_per_s"] > 0 for k in ("h2d", "d2h", "both"))
  rows = {(r["variant"], r["grad_accum"]): r for r in data["children"]["timing"]["rows"]}
  assert set(rows) == {("no-offload", 2), ("no-offload", 16), ("opt-deferred", 2), ("opt-deferred", 16)}
  assert all("error" not in r and r["tokens_per_s"] > 0 for r in rows.values())
  assert rows[("opt-deferred", 2)]["entry_moved_bytes"] > 0 == rows[("no-offload", 2)]["entry_moved_bytes"]
  with tarfile.open(tmp_path / "offload.tgz") as tar:
    assert {"offload/offload.json", "offload/offload.md"} <= set(tar.getnames())


def test_the_partial_offload_run_derives_its_published_figures():
  """benchmarks/results/2026-12-06-tpu-v5e-headroom.md, run 7: jax.offload_opt_ratio at 32k tokens per step, each
  share's speed against no offload and the time it adds against its transfer at the in-step rate."""
  run7 = json.loads((DATA / "run7-ratio.json").read_text())["children"]["timing"]
  assert run7["device"] == "TPU v5 lite"
  _, run3 = _recorded()
  rate = run3["children"]["rates"]["both"]["gb_per_s"]
  rows = {r["variant"]: r for r in rep.derive(run7["rows"], rate) if "median_s" in r}
  assert {r["tokens_per_step"] for r in rows.values()} == {32768}
  kept = {k: round(r["vs_no_offload"], 3) for k, r in rows.items() if k != "no-offload"}
  assert kept == {"opt-ratio-0.25": 0.951, "opt-ratio-0.5": 0.897, "opt-stream": 0.834}
  host = {k: round(r["host_state_bytes"] / 1e9, 2) for k, r in rows.items() if k != "no-offload"}
  assert host == {"opt-ratio-0.25": 0.63, "opt-ratio-0.5": 1.37, "opt-stream": 2.17}  # realised shares 29%, 63%
  # each share adds its transfer time at the in-step rate, give or take 10%: nothing of it hidden
  for k in kept:
    assert rows[k]["added_s"] == pytest.approx(rows[k]["transfer_s"], rel=0.1), k
    assert rows[k]["hidden"] < 0.06  # 0%, 4% and 5%: within the rate's own spread


@pytest.mark.parametrize("argv, words", [
    (["--grad-accum", "2,x"], "--grad-accum '2,x': whole numbers > 0"),
    (["--grad-accum", "0"], "--grad-accum '0': whole numbers > 0"),
    (["--variants", "opt-stream,opt-sometimes"], "--variants 'opt-stream,opt-sometimes': unknown opt-sometimes"),
])
def test_bad_options_exit_2_on_the_command_line(argv, words, capsys):
  """Checked before any child starts (a bad --grad-accum used to fail the timing child on the chip)."""
  from benchmarks.tpu_parts import offload
  with pytest.raises(SystemExit) as exc:
    offload.parse_args(["--out", "x", *argv])
  assert exc.value.code == 2 and words in capsys.readouterr().err
  assert offload.parse_args(["--out", "x", "--grad-accum", "2,16", "--variants", "opt-stream"]).grad_accum == "2,16"
