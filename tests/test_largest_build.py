"""The largest-model probes' build: state filled in place (no numpy copy of the weights on the host), the memory
model's host bound without build copies, and the NAME@POLICY plan variants (zero0@full: the no-offload plan that
fits the largest model)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import requires_jax
from test_gpu_bench import _driver


@requires_jax
def test_materialize_per_leaf_is_the_one_program_result_in_each_memory_kind(monkeypatch):
  """Above PER_LEAF_BYTES each leaf is its own program; the values and memory kinds are those of one program."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import SingleDeviceSharding
  from jax_impl import offload

  dev = jax.devices()[0]
  host, device = (SingleDeviceSharding(dev, memory_kind=k) for k in ("pinned_host", "device"))
  make = lambda: {"m": jnp.arange(12.0).reshape(3, 4), "n": (jnp.full((5,), 2.5), jnp.int32(7))}
  shardings = {"m": host, "n": (device, device)}
  whole = offload.materialize(make, shardings)
  monkeypatch.setattr(offload, "PER_LEAF_BYTES", 0)
  calls = []
  real_jit = jax.jit
  monkeypatch.setattr(jax, "jit", lambda *a, **k: calls.append(1) or real_jit(*a, **k))
  split = offload.materialize(make, shardings)
  assert len(calls) == 3  # one program per leaf
  for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(split)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.sharding.memory_kind == b.sharding.memory_kind
  assert split["m"].sharding.memory_kind == "pinned_host" and split["n"][0].sharding.memory_kind == "device"


@requires_jax
@pytest.mark.parametrize("plan", ["scan-offload", "zero0"])
def test_the_filled_trainer_is_the_fast_weights_trainer_in_place(plan, monkeypatch):
  """jax_train --fast-init fills the state in place: the same params as Trainer.build of common.fast_params (fp32),
  the same optimizer state and memory kinds, and it trains (the loss of the same step)."""
  import jax
  from benchmarks.gpu_parts import sizing
  from benchmarks.gpu_parts.common import fast_params
  from benchmarks.gpu_parts.jax_train import filled_trainer
  from jax_impl import offload
  from jax_impl.step import Trainer

  run = sizing.grid_run(sizing.tiny_run(), plan, 64, 1)
  run = dataclasses.replace(run, train=dataclasses.replace(run.train, precision="fp32"))
  monkeypatch.setattr(offload, "PER_LEAF_BYTES", 0)  # the per-leaf path, as a large model takes it
  filled, built = filled_trainer(run), Trainer.build(run, fast_params(run.model))
  kinds = lambda st: [x.sharding.memory_kind for x in jax.tree.leaves(st)]
  assert kinds(filled.state) == kinds(built.state)
  for a, b in zip(jax.tree.leaves(filled.state), jax.tree.leaves(built.state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  shape = (1, run.train.micro_batch_size, run.train.seq_len + 1)
  batch = np.random.default_rng(0).integers(0, run.model.vocab_size, shape).astype(np.uint16)
  for tr in (filled, built):
    tr.compile(shape, None)
  assert filled.step(batch)["loss"] == built.step(batch)["loss"]


def test_plan_variants_set_the_remat_policy_and_name_what_is_unknown():
  from benchmarks.gpu_parts import sizing
  assert sizing.plan_variant("zero0") == ("zero0", None)
  assert sizing.plan_variant("zero0@full") == ("zero0", "full")
  base = sizing.tiny_run()
  run = sizing.with_plan(base, "zero0@full", micro_batch=1, n_layers=3)
  assert run.jax.remat == "full" and run.jax.scan_layers and not run.jax.offload_opt_state and run.model.n_layers == 3
  assert sizing.with_plan(base, "zero0").jax.remat == "none"
  with pytest.raises(ValueError, match="unknown plan 'zero9'"):
    sizing.plan_variant("zero9@full")
  with pytest.raises(ValueError, match="unknown remat policy ''"):
    sizing.plan_variant("zero0@")
  from benchmarks.gpu_parts.grid import offloads
  assert offloads("zero0@offload_names") and not offloads("zero0@full") and offloads("scan-offload@full")


def test_a_probe_that_fills_in_place_is_bounded_by_the_state_alone(monkeypatch):
  """With 3 build copies a scan-offload probe of 1.3 B params needs host room for 15.6 GB of numpy weights; filled
  in place it needs none: on a TPU the host then holds its state once, beside the runtime's overhead (the premapped
  region among it: a larger region only costs host memory)."""
  from benchmarks.gpu_parts import sizing
  from parity.sizing import memory
  run = sizing.with_plan(sizing.fixed_run("gpt2-1.5b"), "scan-offload-remat", micro_batch=1, n_layers=40)
  monkeypatch.setenv(sizing.TPU_PREMAPPED_ENV, str(256 << 20))
  state = memory.peak_host_bytes(memory.estimate(run, sides=("jax",)), "jax")
  host = state + sizing.tpu_host_overhead() + 2**20
  assert not sizing.predicted_fits(run, "jax", None, host, "tpu")[0]
  ok, why = sizing.predicted_fits(run, "jax", None, host, "tpu", sizing.FAST_BUILD_COPIES)
  assert ok and "0 fp32 build copies" in why
  monkeypatch.setenv(sizing.TPU_PREMAPPED_ENV, str(8 << 30))  # the region is host memory too: it refuses it now
  ok, why = sizing.predicted_fits(run, "jax", None, host, "tpu", sizing.FAST_BUILD_COPIES)
  assert not ok and "the TPU runtime's host overhead" in why


def test_the_driver_takes_plan_variants_and_a_confirming_runs_limit():
  longer = _driver().parse_args(["--confirm-timeout-s", "280", "--largest-plans", "zero0@full,scan-offload-remat"])
  assert longer.probe_timeout_s == 280 and longer.largest_plans == ["zero0@full", "scan-offload-remat"]
  assert (_driver().parse_args([]).probe_timeout_s, _driver().parse_args(["--tiny"]).probe_timeout_s) == (150, 90)


@pytest.mark.parametrize("argv, words", [
    (["--largest-plans", "zero0@sometimes"], "unknown remat policy 'sometimes'; choose from none, full"),
    (["--confirm-timeout-s", "0"], "--confirm-timeout-s must be a finite number > 0; got 0.0"),
    (["--largest-resolution", "nan"], "--largest-resolution must be a number in [0, 1); got nan"),
    (["--largest-resolution", "inf"], "--largest-resolution must be a number in [0, 1); got inf"),
    (["--largest-resolution", "-0.1"], "--largest-resolution must be a number in [0, 1); got -0.1"),
    (["--largest-resolution", "1"], "--largest-resolution must be a number in [0, 1); got 1.0"),
])
def test_bad_plan_variants_and_limits_exit_2_naming_the_option(argv, words, capsys):
  with pytest.raises(SystemExit) as exc:
    _driver().parse_args(argv)
  assert exc.value.code == 2 and words in capsys.readouterr().err


def test_the_largest_resolution_reaches_the_search():
  from benchmarks.gpu_parts import jax_largest
  assert _driver().parse_args(["--largest-resolution", "0"]).largest_resolution == 0
  assert _driver().parse_args([]).largest_resolution == 0.125
  argv = ["--json", "x.json", "--base", "b.json", "--host-bytes", "1"]
  assert jax_largest.parse_args(argv + ["--resolution", "0"]).resolution == 0


@requires_jax
def test_the_confirming_run_writes_what_it_compiled_before_it_steps(tmp_path, monkeypatch):
  """jax_train's first write is the incomplete record of the compiled step (its memory and moves), so a process killed
  during its steps (a host out of memory) still says what it planned; the second is the complete one."""
  from benchmarks.gpu_parts import jax_train, sizing
  from benchmarks.gpu_parts.common import write_spec
  run = sizing.grid_run(sizing.tiny_run(), "scan-offload", 64, 1)
  spec = write_spec(run, tmp_path / "run.spec.json")
  writes = []
  monkeypatch.setattr(jax_train, "write_json", lambda path, data: writes.append(dict(data)))
  assert jax_train.main(["--spec", str(spec), "--json", str(tmp_path / "out.json"), "--steps", "1", "--warmup", "0",
                         "--fast-init"]) == 0
  first, last = writes
  assert (first["complete"], first["phase"]) == (False, "compiled") and "step_s" not in first
  assert first["memory_analysis"] and first["compile_s"] > 0 and first["moved_bytes_per_step"] > 0
  assert last["complete"] and len(last["step_s"]) == 1 and last["memory_analysis"] == first["memory_analysis"]
