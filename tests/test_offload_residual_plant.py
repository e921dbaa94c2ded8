"""The planted stale residual ('offload_residual_stale', parity.protocol.layout.OFFLOAD_PLANT_KEYS): a backward pass
that reads a wrong saved residual while the forward pass and the loss stay right, the bug class of an XLA host-offload
pass handing a scanned block's backward a stale offloaded buffer. The plant (jax_impl.residual_plant) gives each MLP
down projection the weight gradient stale_rows(h)^T dy; these tests hold that the loss is unchanged, that the gradient
is not, that the plant is refused where it cannot show, and that a compare FAILs on it (and PASSes without it)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import requires_jax, requires_torch
from parity.errors import SpecError
from parity.numerics.ds_json import OFFLOAD_REMAT
from parity.pipeline.plants import check_plants
from parity.presets import PRESETS
from parity.protocol.layout import DEBUG_KEYS, OFFLOAD_PLANT_KEYS, SIDE_PLANT_KEYS, parse_debug_value
from parity.spec import REMAT_POLICIES

ROOT = Path(__file__).resolve().parents[1]
KEY = "offload_residual_stale"
SPEC = PRESETS["llama3-tiny"]
OFFLOADED = dataclasses.replace(SPEC, jax=dataclasses.replace(SPEC.jax, remat="offload_names", scan_layers=True))


def test_the_plant_is_a_jax_debug_key_taking_true():
  assert OFFLOAD_PLANT_KEYS == (KEY,) and KEY in DEBUG_KEYS and KEY in SIDE_PLANT_KEYS
  assert parse_debug_value(KEY, True) is True
  with pytest.raises(ValueError, match=f"{KEY} is a planted bug: it takes true"):
    parse_debug_value(KEY, 1)


def test_the_plant_is_refused_where_no_residual_is_offloaded_or_on_another_side():
  for remat in OFFLOAD_REMAT:
    check_plants(dataclasses.replace(SPEC, jax=dataclasses.replace(SPEC.jax, remat=remat)), {"jax": {KEY: True}})
  for remat in (r for r in REMAT_POLICIES if r not in OFFLOAD_REMAT):
    spec = dataclasses.replace(SPEC, jax=dataclasses.replace(SPEC.jax, remat=remat))
    with pytest.raises(SpecError, match=rf"jax:{KEY}=true changes nothing .*jax.remat is '{remat}': no residual is "
                                        "offloaded .*--set jax.remat=offload_names"):
      check_plants(spec, {"jax": {KEY: True}})
  for side in ("torch", "deepspeed", "fsdp"):
    with pytest.raises(SpecError, match=rf"{side}:{KEY}=true changes nothing .*only the JAX side .*--perturb jax:"):
      check_plants(OFFLOADED, {side: {KEY: True}})
  one_token = dataclasses.replace(OFFLOADED, train=dataclasses.replace(SPEC.train, micro_batch_size=1, seq_len=1))
  with pytest.raises(SpecError, match="a micro batch holds one token"):
    check_plants(one_token, {"jax": {KEY: True}})


@pytest.mark.process
def test_compare_refuses_the_plant_on_a_plan_without_offloaded_residuals(tmp_path):
  """The CLI: exit 2 before any side starts, the reason named, no run folder left."""
  out = tmp_path / "run"
  cmd = [sys.executable, "-m", "parity", "compare", "--preset", "llama3-tiny", "--sides", "jax,torch", "--steps", "2",
         "--perturb", f"jax:{KEY}=true", "--out", str(out), "--no-progress"]
  proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert f"--perturb jax:{KEY}=true changes nothing" in proc.stderr and "jax.remat is 'none'" in proc.stderr
  assert "Traceback" not in proc.stderr and not out.exists()


# ----------------------------------------------------------------------------- the model level (jax on CPU)


@requires_jax
def test_the_offload_policies_agree_with_the_driver_side_list():
  from jax_impl import remat
  assert remat.OFFLOAD_POLICIES == OFFLOAD_REMAT


@requires_jax
def test_the_stale_weight_gradient_is_the_stale_rows_times_dy():
  """On one Dense layer (bias on): the output is bitwise proj(h), the kernel gradient stale_rows(h)^T dy, the input
  and bias gradients the clean ones (dy W^T, sum dy), for a linear loss sum(y * c) (dy = c)."""
  import jax
  import jax.numpy as jnp
  from jax_impl.layers import Dense
  from jax_impl.residual_plant import stale_rows, stale_weight_grad
  rng = np.random.default_rng(0)
  h, c = jnp.asarray(rng.normal(size=(2, 3, 5)), jnp.float32), jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32)
  dense = Dense(4)
  params = dense.init(jax.random.PRNGKey(0), h)

  def out(p, x, planted):
    proj = lambda v: dense.apply(p, v)
    return stale_weight_grad(proj, x, proj(x)) if planted else proj(x)

  assert np.array_equal(out(params, h, True), out(params, h, False))
  loss = lambda p, x, planted: jnp.sum(out(p, x, planted) * c)
  (gp, gx), (gp0, gx0) = (jax.grad(loss, argnums=(0, 1))(params, h, planted) for planted in (True, False))
  want_kernel = np.asarray(stale_rows(h)).reshape(6, 5).T @ np.asarray(c).reshape(6, 4)
  np.testing.assert_allclose(gp["params"]["kernel"], want_kernel, rtol=1e-6, atol=1e-6)
  assert not np.allclose(gp0["params"]["kernel"], want_kernel, atol=1e-3)  # the clean one is h^T dy
  np.testing.assert_array_equal(gp["params"]["bias"], gp0["params"]["bias"])
  np.testing.assert_array_equal(gx, gx0)
  assert np.array_equal(stale_rows(h).reshape(6, 5)[1:], np.asarray(h).reshape(6, 5)[:-1])


GRAD_REL_ERROR_MIN = 0.5
"""The planted gradient error, |g_planted - g| / |g| (Frobenius) of each h.N.mlp.proj.weight at step 0: measured 1.395
(h.0) and 1.408 (h.1) on llama3-tiny, 4 rows of 32 tokens, both offload policies, scan or not (max |error| 7.5e-3
against a largest gradient element of 5.4e-3). About sqrt(2): a neighbouring token's hidden is nearly uncorrelated
with the token's own, so the error (stale_rows(h) - h)^T dy has the norm of two independent gradients' difference.
0.5 is a floor well under it; a plant that moved the gradient by a rounding (1e-7) would fail it."""


@requires_jax
@pytest.mark.parametrize("remat", OFFLOAD_REMAT)
@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_the_planted_loss_is_the_clean_one_and_only_the_mlp_down_projection_gradient_differs(remat, scan):
  """Step 0's loss bitwise the clean one; every gradient but h.N.mlp.proj.weight's bitwise too; those off by
  GRAD_REL_ERROR_MIN or more (relative), printed as the recorded size of the error."""
  import jax
  from jax_impl import layout, model
  from parity.weights import init_params
  import jax_impl.step  # noqa: F401  (the step's matmul precision: fp32 matmuls at 'highest')
  spec = SPEC.model
  params = layout.to_flax(init_params(spec, 0), spec, scan_layers=scan)
  tok = np.random.default_rng(0).integers(0, spec.vocab_size, (4, SPEC.train.seq_len + 1)).astype(np.uint16)
  grads = {}
  for planted in (False, True):
    fn = lambda p: model.loss_fn(p, tok, spec, remat=remat, scan_layers=scan, stale_residual=planted)
    loss, g = jax.jit(jax.value_and_grad(fn))(params)
    grads[planted] = (float(loss), layout.from_flax(jax.device_get(g), spec, scan_layers=scan))
  (l0, g0), (l1, g1) = grads[False], grads[True]
  assert l1 == l0, (l1, l0)
  proj = {f"h.{i}.mlp.proj.weight" for i in range(spec.n_layers)}
  assert {k for k in g0 if not np.array_equal(g0[k], g1[k])} == proj
  rel = {k: float(np.linalg.norm(g1[k] - g0[k]) / np.linalg.norm(g0[k])) for k in sorted(proj)}
  print(f"{remat} scan={scan}: loss {l0!r} both; planted relative gradient error {rel}")
  assert min(rel.values()) >= GRAD_REL_ERROR_MIN, rel


@requires_jax
def test_the_model_refuses_the_plant_without_an_offload_policy():
  from jax_impl import layout, model
  from parity.weights import init_params
  spec = SPEC.model
  tok = np.zeros((1, 5), np.uint16)
  with pytest.raises(ValueError, match="planted stale residual .*needs an offload remat policy"):
    model.loss_fn(layout.to_flax(init_params(spec, 0), spec), tok, spec, remat="full", stale_residual=True)


@requires_jax
def test_the_trainer_threads_the_plant_to_its_step_and_not_its_eval():
  """Trainer.build(plants=...): step 0's loss equals the clean trainer's, its grad_norm does not; the eval loss of
  the same params is the clean one (the plant is in the backward pass only)."""
  from jax_impl.step import Trainer
  from parity.weights import init_params
  run = dataclasses.replace(OFFLOADED, train=dataclasses.replace(SPEC.train, steps=1))
  shape = (run.train.grad_accum_steps, run.train.micro_batch_size, run.train.seq_len + 1)
  batch = np.random.default_rng(1).integers(0, run.model.vocab_size, shape).astype(np.uint16)
  out = {}
  for plants in (frozenset(), frozenset({KEY})):
    t = Trainer.build(run, init_params(run.model, 0), plants=plants)
    t.compile(shape, (1, *shape[1:]))
    out[plants] = (t.eval_loss(batch[:1]), t.step(batch))
  (e0, m0), (e1, m1) = out.values()
  assert e1 == e0 and m1["loss"] == m0["loss"] and m1["lr"] == m0["lr"]
  # every other gradient is bitwise the clean one, so the norm moves by the proj weights' share alone: 1.4e-4
  # relative measured (llama3-tiny, step 0), far above a float32 norm's rounding (~1e-7 relative)
  assert abs(m1["grad_norm"] - m0["grad_norm"]) > 1e-5 * m0["grad_norm"], (m0, m1)


# ----------------------------------------------------------------------------- end to end


def _compare(out: Path, perturb: list[str]):
  import parity
  report = parity.compare("llama3-tiny", steps=STEPS, sides=["jax", "torch"], overrides=SETTINGS, out=out,
                          determinism_steps=0, noise_envelope=False, perturb=perturb)
  rep = json.loads((out / "report.json").read_text())
  return report, rep, {c["metric"]: c for c in rep["checks"]}


STEPS = 3
"""llama3-tiny warms up from lr 0: steps 0 and 1 apply lr 0, step 2 is the first update (the `updates` check needs
one); step 0's gradient (grad_norm) already differs, and the final params do after step 2's update."""
SETTINGS = {"jax.remat": "offload_names", "jax.scan_layers": True, "train.eval_every": 0}


@pytest.mark.process
@pytest.mark.slow
@requires_jax
@requires_torch
def test_compare_fails_on_the_stale_residual_naming_the_gradient_and_passes_without_it(tmp_path):
  """`parity compare --preset llama3-tiny --sides jax,torch --set jax.remat=offload_names --set
  jax.scan_layers=true --set train.eval_every=0 --steps 3 --perturb jax:offload_residual_stale=true`: exit 1, the
  loss check passing (the bug is silent there), grad_norm FAILing first at step 0 and params FAILing on an MLP down
  projection; the margins (measured / tolerance) printed. The same run without the plant PASSes."""
  report, rep, checks = _compare(tmp_path / "planted", [f"jax:{KEY}=true"])
  assert report.exit_code == 1 and not report.passed
  first = rep["verdict"]["first_failure"]
  assert (first["metric"], first["step"]) == ("grad_norm", 0), first
  assert checks["loss"]["passed"], checks["loss"]
  params = checks["params"]
  assert not params["passed"] and params["worst"].endswith(".mlp.proj.weight"), params
  margins = {m: checks[m]["value"] / checks[m]["tolerance"] for m in ("grad_norm", "params", "loss")}
  print(f"margins (measured / tolerance): {margins}")
  assert margins["params"] >= 3 and margins["grad_norm"] > 1, margins
  clean, rep_ok, checks_ok = _compare(tmp_path / "clean", [])
  assert clean.passed and clean.exit_code == 0, [c for c in rep_ok["checks"] if not c["passed"]]
