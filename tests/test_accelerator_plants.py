"""Accelerator-only plants (parity.protocol.layout.ACCELERATOR_PLANT_KEYS, jax_impl.accelerator_plants): errors the
JAX side makes only on an accelerator, so that its host-CPU rerun runs clean and only the cross-backend rule can catch
them. Here, on the CPU: the values each key takes, the sides that take them, that the CPU applies none (and the side
records it), and what each does to a step when in force (the platform given as an accelerator's)."""
from __future__ import annotations

import numpy as np
import pytest

from parity.errors import SpecError
from parity.pipeline.plants import check_plants
from parity.presets import preset
from parity.protocol.layout import parse_debug_value


@pytest.mark.parametrize("key, value, ok", [
    ("accelerator_update_scale", 1.001, True), ("accelerator_update_scale", 0.9997, True),
    ("accelerator_update_scale", 1, False), ("accelerator_update_scale", 0, False),
    ("accelerator_update_scale", float("inf"), False), ("accelerator_update_scale", True, False),
    ("accelerator_norm_eps", 1e-6, True), ("accelerator_norm_eps", -1e-6, False), ("accelerator_norm_eps", "x", False),
    ("accelerator_matmul_default", True, True), ("accelerator_matmul_default", 1.0, False)])
def test_each_key_takes_its_value(key, value, ok):
  if ok:
    assert parse_debug_value(key, value) == value
  else:
    with pytest.raises(ValueError, match=key):
      parse_debug_value(key, value)


def test_only_the_jax_side_takes_them():
  spec = preset("gpt2-tiny")
  check_plants(spec, {"jax": {"accelerator_update_scale": 1.001}})
  with pytest.raises(SpecError, match="applied by the JAX side only"):
    check_plants(spec, {"torch": {"accelerator_update_scale": 1.001}})


jax = pytest.importorskip("jax")


def test_the_cpu_applies_none_and_an_accelerator_all():
  from jax_impl import accelerator_plants as ap
  debug = {"accelerator_update_scale": 1.001, "accelerator_norm_eps": 1e-6, "nan_at_step": 3}
  try:
    assert ap.set_accelerator_plants(debug, "cpu") == {} and ap.planted_value("accelerator_norm_eps") is None
    assert ap.set_accelerator_plants(debug, "tpu") == {"accelerator_update_scale": 1.001,
                                                      "accelerator_norm_eps": 1e-6}
    tree = {"w": np.ones(3, np.float32)}
    np.testing.assert_allclose(ap.scaled_updates(tree)["w"], 1.001, rtol=1e-7)
  finally:
    ap.set_accelerator_plants({}, "cpu")


def _run(debug: dict, steps: int = 2):
  """gpt2-tiny's first `steps` steps on this CPU with `debug`'s plants in force as on an accelerator: (losses,
  final canonical params, init params)."""
  from jax_impl import accelerator_plants as ap
  from jax_impl.step import Trainer
  from parity.spec import RunSpec
  from parity.weights import init_params
  from parity.overrides import apply_overrides
  run = apply_overrides(preset("gpt2-tiny"), {"train.steps": steps, "train.grad_accum_steps": 1})
  init = init_params(run.model, 0)
  ap.set_accelerator_plants(debug, "tpu")
  try:
    t = Trainer.build(RunSpec(model=run.model, train=run.train, jax=run.jax), init)
    shape = (1, run.train.micro_batch_size, run.train.seq_len + 1)
    t.compile(shape, None)
    rng = np.random.default_rng(0)
    losses = [t.step(rng.integers(0, run.model.vocab_size, shape).astype(np.uint16))["loss"] for _ in range(steps)]
    return losses, t.canonical_params(), init
  finally:
    ap.set_accelerator_plants({}, "cpu")


def test_in_force_each_changes_the_step_as_documented():
  """The update scale: the first step's update is exactly 1.001x the clean one (the loss at step 0 unchanged); the
  final norm's eps moves the step-0 loss; neither touches what the CPU computes once cleared."""
  clean_losses, clean, init = _run({}, steps=1)
  scaled_losses, scaled, _ = _run({"accelerator_update_scale": 1.001}, steps=1)
  assert scaled_losses[0] == clean_losses[0]
  for name in ("h.0.attn.qkv.weight", "wte.weight"):
    du, ds = clean[name] - init[name], scaled[name] - init[name]
    big = np.abs(du) > 1e-6
    np.testing.assert_allclose(ds[big] / du[big], 1.001, rtol=2e-3)
  eps_losses, _, _ = _run({"accelerator_norm_eps": 1.0}, steps=1)
  assert abs(eps_losses[0] - clean_losses[0]) > 1e-4
  again, _, _ = _run({}, steps=1)
  assert again == clean_losses


def test_a_plant_that_changes_nothing_is_refused_naming_its_value():
  spec = preset("gpt2-tiny")  # norm eps 1e-5
  for kv, why in (({"accelerator_update_scale": 1.00000001}, "1.0 in float32"),
                  ({"accelerator_update_scale": 1e-320}, "0.0 in float32"),
                  ({"accelerator_norm_eps": 1e-5}, "norm eps is 1e-05 already")):
    with pytest.raises(SpecError, match=f"=.* changes nothing .*{why}"):
      check_plants(spec, {"jax": kv})
  with pytest.raises(ValueError, match="accelerator_update_scale takes"):
    parse_debug_value("accelerator_update_scale", 10 ** 400)
