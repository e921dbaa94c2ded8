"""jax_impl.step and jax_impl.worker: accumulation, step metrics, eval, and an end-to-end worker run."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from parity import data, protocol, weights  # noqa: E402

from parity.numerics import schedule  # noqa: E402
from parity.presets import preset  # noqa: E402
from parity.spec import JaxPlan, ModelSpec, RunSpec, to_dict, TrainSpec  # noqa: E402

from jax_impl import model as M  # noqa: E402
from jax_impl import layout  # noqa: E402
from jax_impl import optim as jax_optim  # noqa: E402
from jax_impl.step import Trainer, accumulate_grads  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL = ModelSpec(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, norm="rmsnorm",
                  mlp="swiglu", position="rope", bias=False, tie_embeddings=False)
TRAIN = TrainSpec(steps=3, micro_batch_size=2, grad_accum_steps=2, seq_len=8, warmup_steps=1, lr=1e-2,
                  eval_every=0, grad_clip=0.5)


def tokens(shape, seed=0):
  return np.random.default_rng(seed).integers(0, MODEL.vocab_size, shape).astype(np.uint16)


def test_accumulation_equals_one_big_batch():
  params = layout.to_flax(weights.init_params(MODEL, 0), MODEL)
  batch = tokens((2, 3, 9))  # 2 micro batches of 3 sequences
  loss = lambda p, t: M.loss_fn(p, t, MODEL)
  acc_loss, acc_grads = jax.jit(lambda p, b: accumulate_grads(p, b, loss))(params, batch)
  big_loss, big_grads = jax.jit(jax.value_and_grad(loss))(params, batch.reshape(1 * 6, 9))
  # equal-size micro batches: mean of means == mean over all tokens; only fp32 rounding differs
  np.testing.assert_allclose(float(acc_loss), float(big_loss), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(acc_grads), jax.tree.leaves(big_grads)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-7)


@pytest.fixture(scope="module")
def trained():
  t = Trainer.build(RunSpec(model=MODEL, train=TRAIN, jax=JaxPlan()), weights.init_params(MODEL, 0))
  b = tokens((TRAIN.steps, 2, 2, 9))
  val = tokens((3, 2, 9), seed=9)
  t.compile(b.shape[1:], val.shape)
  params0 = t.canonical_params()
  metrics = [t.step(x) for x in b]
  return t, b, val, params0, metrics


def test_step_metrics_report_loss_norm_and_lr(trained):
  t, b, _, params0, metrics = trained
  params = layout.to_flax(params0, MODEL)
  loss = lambda p, x: M.loss_fn(p, x, MODEL)
  want_loss, grads = jax.jit(lambda p, x: accumulate_grads(p, x, loss))(params, b[0])
  norm = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads)))
  assert metrics[0]["loss"] == pytest.approx(float(want_loss), rel=1e-6)
  assert metrics[0]["grad_norm"] == pytest.approx(norm, rel=1e-6)
  assert [m["lr"] for m in metrics] == [float(np.float32(schedule.train_lr(TRAIN, k))) for k in range(TRAIN.steps)]
  assert set(t.compile_times_s) == {"train_step_lower", "train_step_compile", "eval_compile"}
  assert t.memory_analysis["argument_size_in_bytes"] > 0


def test_eval_loss_is_the_mean_over_val_micro_batches(trained):
  t, _, val, _, _ = trained
  params = layout.to_flax(t.canonical_params(), MODEL)
  want = np.mean([float(M.loss_fn(params, v, MODEL)) for v in val])
  assert t.eval_loss(val) == pytest.approx(want, rel=1e-6)


def test_first_step_runs_with_lr_zero_and_keeps_params():
  t = Trainer.build(RunSpec(model=MODEL, train=TRAIN), weights.init_params(MODEL, 0))
  b = tokens((1, 2, 2, 9))
  t.compile(b.shape[1:], None)
  before = t.canonical_params()
  assert t.step(b[0])["lr"] == 0.0
  after = t.canonical_params()
  for k in before:
    np.testing.assert_array_equal(after[k], before[k], err_msg=k)


def test_remat_and_bf16_plans_train():
  b = tokens((2, 2, 2, 9))
  runs = {"base": RunSpec(model=MODEL, train=dataclasses.replace(TRAIN, steps=2)),
          "remat": RunSpec(model=MODEL, train=dataclasses.replace(TRAIN, steps=2), jax=JaxPlan(remat="full")),
          "bf16": RunSpec(model=MODEL, train=dataclasses.replace(TRAIN, steps=2, precision="bf16"))}
  losses = {}
  for name, run in runs.items():
    t = Trainer.build(run, weights.init_params(MODEL, 0))
    t.compile(b.shape[1:], None)
    losses[name] = [t.step(x)["loss"] for x in b]
    assert {str(x.dtype) for x in jax.tree.leaves(t.state.params)} == {"float32"}
  np.testing.assert_allclose(losses["remat"], losses["base"], rtol=1e-6)
  np.testing.assert_allclose(losses["bf16"], losses["base"], rtol=2e-2)  # bf16: 8 mantissa bits


def test_poison_keeps_placement_and_yields_nan(trained):
  t = Trainer.build(RunSpec(model=MODEL, train=TRAIN, jax=JaxPlan(offload_params=True)), weights.init_params(MODEL, 0))
  b = tokens((1, 2, 2, 9))
  t.compile(b.shape[1:], None)
  t.poison()
  assert all(x.sharding.memory_kind == "pinned_host" for x in jax.tree.leaves(t.state.params))
  assert np.isnan(t.step(b[0])["loss"])


# ----------------------------------------------------------------------------- worker end to end


def make_run_dir(root: Path, perturb: dict | None = None) -> tuple[Path, RunSpec]:
  run = preset("gpt2-tiny")
  run = dataclasses.replace(run, train=dataclasses.replace(run.train, steps=6, eval_every=3), sides=("jax",))
  weights.save(weights.init_params(run.model, run.train.seed), root / "init.safetensors")
  corpus = data.load_corpus(run.data, max_bytes=200_000)
  t = run.train
  train_b, val_b = data.make_batches(corpus, steps=t.steps, grad_accum_steps=t.grad_accum_steps,
                                     micro_batch_size=t.micro_batch_size, seq_len=t.seq_len, seed=t.data_seed,
                                     eval_batches=t.eval_batches)
  np.save(root / "batches.npy", train_b)
  np.save(root / "val_batches.npy", val_b)
  request = {"schema": protocol.REQUEST_SCHEMA, "run": to_dict(run), "init_weights": "init.safetensors",
             "batches": "batches.npy", "val_batches": "val_batches.npy", "perturb": perturb or {}}
  (root / "request.json").write_text(json.dumps(request))
  return root / "request.json", run


def run_worker(request: Path) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=str(REPO))
  return subprocess.run([sys.executable, "-m", "jax_impl.worker", str(request), "--side", "jax"], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.process
@pytest.mark.slow
def test_worker_end_to_end(tmp_path):
  request, run = make_run_dir(tmp_path)
  proc = run_worker(request)
  assert proc.returncode == 0, proc.stderr[-3000:]
  steps = protocol.read_steps(tmp_path / "jax" / "steps.jsonl")
  assert [s["step"] for s in steps] == list(range(run.train.steps))
  assert all(np.isfinite(s["loss"]) and s["step_time_s"] > 0 for s in steps)
  assert [s["lr"] for s in steps] == pytest.approx([schedule.train_lr(run.train, k) for k in range(6)], rel=1e-7)
  assert [s["step"] for s in steps if "val_loss" in s] == [2, 5]
  assert steps[-1]["loss"] < steps[0]["loss"]
  summary = protocol.read_summary(tmp_path / "jax" / "summary.json")
  assert summary["status"] == "ok" and summary["steps_completed"] == 6
  assert summary["state_memory_kinds"] == {"params": "device", "opt_state": "pinned_host"}
  assert summary["offload_evidence"]["compiled_host_entry_buffers"] > 0
  assert summary["compile_s"] > 0 and summary["versions"]["jax"] == jax.__version__
  assert summary["plan"] == to_dict(run.jax) and summary["peak_device_bytes"] is None
  assert set(summary["state_bytes_by_memory_kind"]) == {"device", "pinned_host"}
  final = weights.load(tmp_path / "jax" / "final.safetensors", run.model)
  init = weights.load(tmp_path / "init.safetensors", run.model)
  assert not np.array_equal(final["h.0.attn.qkv.weight"], init["h.0.attn.qkv.weight"])


# The NaN stop is the loop's (parity.protocol.loop.run_train): tests/test_loop.py (FakeSide); the poison itself:
# test_poison_keeps_placement_and_yields_nan.


@pytest.mark.process
def test_jax_side_never_imports_torch():
  code = ("import sys; import jax_impl.worker, jax_impl.step, jax_impl.model, jax_impl.optim, jax_impl.offload; "
          "bad = sorted(m for m in ('torch', 'deepspeed') if m in sys.modules); assert not bad, bad")
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]


# ----------------------------------------------------------------------------- Trainer.canonical_moments, the benchmark
# Computed in place in the Flax layout (a speed-up; benchmarks/jax_step_vs_bare.py measures it), bitwise the formula.


def test_canonical_moments_are_the_float64_formula_bitwise():
  run = preset("gpt2-tiny")
  trainer = Trainer.build(run, weights.init_params(run.model, 0))
  t = run.train
  batch = np.random.default_rng(0).integers(0, run.model.vocab_size, (t.grad_accum_steps, t.micro_batch_size,
                                                                      t.seq_len + 1), dtype=np.uint16)
  trainer.compile(batch.shape, None, batch.dtype)
  for _ in range(3):
    trainer.step(batch)
  nu, count = jax_optim.adam_second_moment(trainer.state.opt_state, t)
  corr = 1.0 - float(schedule.adam_beta2(t)) ** int(count)
  want = {k: np.sqrt(np.maximum(v.astype(np.float64), 0.0) / corr).astype(np.float32)
          for k, v in layout.from_flax(nu, run.model).items()}  # the formula as first written: map, then compute
  got = trainer.canonical_moments()
  assert got.keys() == want.keys()
  assert all(got[k].dtype == np.float32 and np.array_equal(got[k], want[k]) for k in want)
  assert all(np.any(v > 0) for k, v in got.items() if k.endswith(".weight")), "3 steps: every weight has moments"


@pytest.mark.slow
@pytest.mark.process
def test_benchmark_runs_and_writes_results(tmp_path):
  """benchmarks/jax_step_vs_bare.py end to end on gpt2-tiny: every pair measured, JSON and Markdown written."""
  import json
  proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "jax_step_vs_bare.py"), "--preset", "gpt2-tiny",
                         "--rounds", "2", "--warmup", "1", "--steps-per-round", "1", "--tag", "t",
                         "--results", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads((tmp_path / "jax_step_vs_bare-t.json").read_text())
  for key in ("worker_vs_bare", "worker_vs_stock_flax", "offload_on_vs_off"):
    assert len(out[key]["ratios"]) == 2 and out[key]["ratio_min"] > 0, key
  assert out["hlo"]["worker"]["counts"]["dot"] > 0
  assert "| worker/bare |" in (tmp_path / "jax_step_vs_bare-t.md").read_text()
