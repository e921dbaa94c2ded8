"""The parts that make the JAX worker's step fast (issue #13 item 6) give the same values bitwise.

benchmarks/jax_step_vs_bare.py measures the speed; these tests pin what the speed-ups must not change:
`jax_impl.layers.Dense` (the product over a flattened (B * T, in) input) and `Trainer.canonical_moments`
(computed in place, in the Flax layout).
"""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from parity.presets import preset  # noqa: E402
from parity.numerics import schedule as schedule_ref  # noqa: E402
from parity.weights import init_params  # noqa: E402

from jax_impl import layers, optim  # noqa: E402
from jax_impl import model as M  # noqa: E402
from jax_impl.step import Trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _dense_case(seed: int = 0):
  """A Dense of the default preset's qkv shape: x (8, 128, 256) -> (8, 128, 768), and an output gradient."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((8, 128, 256)), jnp.float32)
  params = {"kernel": jnp.asarray(0.02 * rng.standard_normal((256, 768)), jnp.float32),
            "bias": jnp.asarray(0.1 * rng.standard_normal(768), jnp.float32)}
  dy = jnp.asarray(rng.standard_normal((8, 128, 768)), jnp.float32)
  return x, params, dy


def test_dense_fp32_values_and_gradients_are_flax_dense_bitwise():
  import flax.linen as nn
  x, params, dy = _dense_case()

  def vjp(module):
    y, pull = jax.jit(lambda p, x: jax.vjp(lambda p, x: module.apply({"params": p}, x), p, x))(params, x)
    return y, jax.jit(pull)(dy)

  (y_ours, (dp_ours, dx_ours)), (y_flax, (dp_flax, dx_flax)) = vjp(layers.Dense(768)), vjp(nn.Dense(768))
  assert np.array_equal(y_ours, y_flax)
  assert np.array_equal(dx_ours, dx_flax)
  for name in ("kernel", "bias"):
    assert np.array_equal(dp_ours[name], dp_flax[name]), name


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="pins XLA CPU's compiled form of the kernel gradient")
def test_dense_kernel_gradient_is_one_dot_over_untransposed_operands():
  """dW = x^T @ dy contracts dim 0 of both (B * T, .) operands: no transposed copy of dy (module docstring)."""
  x, params, dy = _dense_case()
  dense = layers.Dense(768)
  grad_k = jax.jit(lambda k, x, dy: jax.vjp(lambda k: dense.apply({"params": {**params, "kernel": k}}, x), k)[1](dy)[0])
  hlo = grad_k.lower(params["kernel"], x, dy).compile().as_text()
  dots = [line for line in hlo.splitlines() if " dot(" in line and "= f32[256,768]" in line]
  assert dots, "no kernel-gradient dot found in the compiled HLO"
  assert all("lhs_contracting_dims={0}, rhs_contracting_dims={0}" in d for d in dots), dots


def test_canonical_moments_are_the_float64_formula_bitwise():
  run = preset("gpt2-tiny")
  trainer = Trainer.build(run, init_params(run.model, 0))
  t = run.train
  batch = np.random.default_rng(0).integers(0, run.model.vocab_size, (t.grad_accum_steps, t.micro_batch_size,
                                                                      t.seq_len + 1), dtype=np.uint16)
  trainer.compile(batch.shape, None, batch.dtype)
  for _ in range(3):
    trainer.step(batch)
  nu, count = optim.adam_second_moment(trainer.state.opt_state, t)
  corr = 1.0 - float(schedule_ref.adam_beta2(t)) ** int(count)
  want = {k: np.sqrt(np.maximum(v.astype(np.float64), 0.0) / corr).astype(np.float32)
          for k, v in M.from_flax(nu, run.model).items()}  # the formula as first written: map, then compute
  got = trainer.canonical_moments()
  assert got.keys() == want.keys()
  assert all(got[k].dtype == np.float32 and np.array_equal(got[k], want[k]) for k in want)
  assert all(np.any(v > 0) for k, v in got.items() if k.endswith(".weight")), "3 steps: every weight has moments"


@pytest.mark.slow
def test_benchmark_runs_and_writes_results(tmp_path):
  """benchmarks/jax_step_vs_bare.py end to end on gpt2-tiny: every pair measured, JSON and Markdown written."""
  import json
  proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "jax_step_vs_bare.py"), "--preset", "gpt2-tiny",
                         "--rounds", "2", "--warmup", "1", "--steps-per-round", "1", "--tag", "t",
                         "--results", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads((tmp_path / "jax_step_vs_bare-t.json").read_text())
  for key in ("worker_vs_bare", "worker_vs_stock_flax", "offload_on_vs_off"):
    assert len(out[key]["ratios"]) == 2 and out[key]["ratio_min"] > 0, key
  assert out["hlo"]["worker"]["counts"]["dot"] > 0
  assert "| worker/bare |" in (tmp_path / "jax_step_vs_bare-t.md").read_text()
