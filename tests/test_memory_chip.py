"""The memory model's JAX host rows against what the compiled step on a TPU v5e holds in host memory
(tests/data/tpu_v5e/offload/run5-scan-offload-29-memory.json: scan-offload, gpt2-1.5b's width, 29 layers)."""
from __future__ import annotations

import json
from pathlib import Path

from parity.sizing import memory

DATA = Path(__file__).parent / "data" / "tpu_v5e" / "offload" / "run5-scan-offload-29-memory.json"


def _run():
  from benchmarks.gpu_parts import sizing
  rec = json.loads(DATA.read_text())
  return rec, sizing.with_plan(sizing.fixed_run(rec["model"]), rec["plan"], micro_batch=rec["micro_batch"],
                               n_layers=rec["n_layers"])


def test_the_host_rows_are_the_chips_host_arguments_and_temporaries():
  """Resident host rows (fp32 params and both moments, in place) against the step's host arguments; the in-step
  gradient row (each layer's gradient, born in host memory by the transpose of its move to the device) against the
  step's host temporaries. Both within 1% (the chip's buffers are padded to its tiles; the model counts elements)."""
  rec, run = _run()
  ma = rec["memory_analysis"]
  rows = [r for r in memory.estimate(run, sides=("jax",)) if r.kind == "host"]
  assert memory.param_count(run.model) == rec["n_params"]
  resident = sum(r.bytes for r in rows if not r.note.startswith("in-step"))
  grads = [r for r in rows if r.category == "gradients"]
  assert len(grads) == 1 and grads[0].note.startswith("in-step (forward/backward")
  assert abs(resident / ma["host_argument_size_in_bytes"] - 1) < 0.01
  assert abs(resident / rec["state_bytes_by_memory_kind"]["pinned_host"] - 1) < 0.01
  assert abs(grads[0].bytes / ma["host_temp_size_in_bytes"] - 1) < 0.01
  # the peak the premapped region must hold: what the chip's step held in host memory at once
  peak = memory.peak_host_bytes(rows, "jax")
  assert abs(peak / (ma["host_argument_size_in_bytes"] + ma["host_temp_size_in_bytes"]) - 1) < 0.01


def test_without_the_gradient_row_the_model_would_miss_a_quarter_of_the_host_peak():
  """The check above can fail: the resident rows alone are 24% short of what the chip held."""
  rec, run = _run()
  ma = rec["memory_analysis"]
  rows = [r for r in memory.estimate(run, sides=("jax",)) if r.kind == "host" and r.category != "gradients"]
  held = ma["host_argument_size_in_bytes"] + ma["host_temp_size_in_bytes"]
  assert memory.peak_host_bytes(rows, "jax") / held < 0.8


def test_the_step_time_model_counts_the_layer_stacks_moves_as_the_chip_took_them():
  """The same step took 2.15 s on the chip (its second step; the first compiled). At the TPU-v5e preset's in-step
  rate the cost model gives 1.89 s with each micro batch's layer moves (the params' fetch, the gradient's round trip
  through host memory) and 1.32 s without them: within 15% with, 39% short without."""
  from parity.sizing import cost
  rec, run = _run()
  measured = 2.1515843849999783  # the record's step_s[1] (benchmarks/results/2026-12-06-tpu-v5e-headroom run 5)
  hw = cost.HARDWARE["TPU-v5e"]
  rows = memory.estimate(run, sides=("jax",))
  step, compute, transfer = cost.step_time(run, "jax", hw, rows)
  assert abs(step / measured - 1) < 0.15
  without = transfer - cost._jax_layer_moves(run, rows) / hw.host_link_bytes_per_s
  assert (compute + without) / measured < 0.65


def test_the_device_model_refuses_the_depth_the_chip_refused_and_keeps_the_one_it_ran():
  """The search compiled 59 layers and XLA refused them (24.14 GB of HBM temporaries > 15.75 GiB); 29 compiled and
  trained. Under remat 'none' the backward pass reads every layer's compute-dtype weights, saved in the forward pass
  (the per-layer move and cast are not recomputed): without that row the model put 59 layers within the chip."""
  from benchmarks.gpu_parts import sizing
  rec, _ = _run()
  base = sizing.fixed_run(rec["model"])
  limit = rec["bytes_limit"]
  probes = {p["n_layers"]: p["status"] for p in rec["search_probes"]}
  assert probes == {59: "oom", 29: "ok"}
  for n, status in probes.items():
    rows = memory.estimate(sizing.with_plan(base, rec["plan"], micro_batch=1, n_layers=n), sides=("jax",))
    peak = memory.peak_device_bytes(rows, "jax")
    assert (peak <= limit) == (status == "ok"), (n, peak)
    saved = [r for r in rows if r.kind == "device" and "saved for the backward pass" in r.note]
    assert len(saved) == 1
    if status == "oom":
      assert peak - saved[0].bytes <= limit  # the row is what tells the two depths apart
