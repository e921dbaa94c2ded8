"""The semantics card's probes of family porting bugs the init weights hide (parity.semantics: norm.rounding,
forward.probe_loss) and the planted family bugs they catch at step 0 (parity.protocol.layout.FAMILY_PLANT_KEYS).

Before, q/k norms after rotary FAILed a qwen3-tiny fp32 compare only at step 15 of 16 by 1.1x its loss tolerance, a
skipped attention soft-cap only on params (1.8x), and in bf16 a skipped attention soft-cap and Gemma's (1 + w) norm
with Llama's rounding order PASSed (benchmarks/results/2026-12-06-family-plants.md)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import requires_all, requires_jax, requires_torch
from parity import semantics as card_lib
from parity.errors import SpecError
from parity.overrides import apply_overrides
from parity.pipeline.plants import check_plants
from parity.presets import preset

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ["gpt2-tiny", "llama3-tiny", "qwen2-tiny", "qwen3-tiny", "gemma2-tiny", "gemma3-tiny", "mistral-tiny"]
PLANTS = [("qk_norm_after_rope", "qwen3-tiny"), ("qk_norm_after_rope", "gemma3-tiny"),
          ("attn_softcap_skipped", "gemma2-tiny"), ("final_softcap_skipped", "gemma2-tiny"),
          ("norm_plus_one_rounded", "gemma2-tiny"), ("norm_plus_one_rounded", "gemma3-tiny")]


def test_bf16_round_is_round_to_nearest_even():
  ml_dtypes = pytest.importorskip("ml_dtypes")
  x = np.random.default_rng(0).standard_normal(100_000).astype(np.float32) * 10.0 ** np.arange(-3, 4).repeat(
      100_000 // 7 + 1)[:100_000].astype(np.float32)
  np.testing.assert_array_equal(card_lib.bf16_round(x), x.astype(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.parametrize("d", [8, 32, 64, 4096])
@pytest.mark.parametrize("form", ["rmsnorm", "rmsnorm(1+w)", "layernorm"])
def test_the_rounding_probe_tells_the_two_orders_apart_at_every_width(d, form):
  x, w = card_lib.rounding_probe(d, form == "rmsnorm(1+w)")
  x64 = x.astype(np.float64)
  c = x64 - x64.mean(-1, keepdims=True) if form == "layernorm" else x64
  n = (c / np.sqrt((c * c).mean(-1, keepdims=True) + 1e-6)).astype(np.float32)
  scale = (1.0 + w).astype(np.float32) if form == "rmsnorm(1+w)" else w
  one, two = card_lib.bf16_round(n * scale), card_lib.bf16_round(card_lib.bf16_round(n) * card_lib.bf16_round(scale))
  assert int((one != two).sum()) >= 20
  assert card_lib.classify_norm_rounding(x, w, one, form, 1e-6) == "one rounding"
  assert card_lib.classify_norm_rounding(x, w, two, form, 1e-6) == "rounded factors"
  assert card_lib.classify_norm_rounding(x, w, np.zeros_like(one), form, 1e-6) == "other"


def test_the_probe_loss_is_compared_within_its_tolerance():
  a = {"items": {"forward.probe_loss": 6.0}}
  tol = card_lib.probe_loss_tolerance(6.0, 6.0)
  assert card_lib.diff_cards(a, {"items": {"forward.probe_loss": 6.0 + 0.9 * tol}}) == []
  assert [d[0] for d in card_lib.diff_cards(a, {"items": {"forward.probe_loss": 6.0 + 1.1 * tol}})] == [
      "forward.probe_loss"]
  older = {"items": {"norm.form": "rmsnorm"}}  # a card written before the probe items existed: not compared on them
  assert card_lib.diff_cards(a, older) == [] and card_lib.diff_cards(older, a) == []
  assert card_lib.diff_cards({"items": {"forward.probe_loss": None}}, a)  # a card that has the item: compared
  big = apply_overrides(preset("gpt2-tiny"), {"model.n_layers": 12, "model.d_model": 4096, "model.n_heads": 32})
  assert card_lib.probe_spec(big.model) is None  # 3 x 4096^2 x 12 params: over PROBE_MAX_PARAMS, not run
  small = card_lib.probe_spec(preset("gemma3-tiny").model)
  assert small.layer_kinds == ("sliding", "sliding", "full") and small.vocab_size <= 512


def _items(side: str, spec, plants=frozenset()) -> dict:
  """norm.rounding and forward.probe_loss of one side's probes, with `plants` as this process's family plants."""
  form = "rmsnorm(1+w)" if spec.norm_plus_one else spec.norm
  if side == "jax":
    from jax_impl import layers, semantics
    layers.set_model_plants(plants)
    try:
      return {"norm.rounding": semantics.norm_rounding(spec, form), "forward.probe_loss": semantics.probe_loss(spec)}
    finally:
      layers.set_model_plants(())
  from torch_impl import layers, semantics
  layers.set_model_plants(plants)
  try:
    return {"norm.rounding": semantics.norm_rounding(layers.make_norm(spec), form),
            "forward.probe_loss": semantics.probe_loss(spec)}
  finally:
    layers.set_model_plants(())


def test_the_probe_tolerance_is_the_rounding_of_its_reductions_and_far_under_the_plants():
  """The tolerance grows with the loss (the token mean's rounding is relative to it): one ulp of the loss is far
  under it at every loss the probes reach (4-17 nats), and the smallest plant effect (8.1e-3) is >= 100x over it."""
  for loss in (4.0, 6.4, 8.0, 12.35, 16.16, 17.0):
    tol = card_lib.probe_loss_tolerance(loss, loss)
    assert card_lib.PROBE_LOSS_ATOL <= tol <= 8.1e-3 / 100
    assert tol >= 8 * float(np.spacing(np.float32(loss)))  # 8 ulps of the loss: what two CPUs' orders may differ by
  assert card_lib.probe_loss_tolerance(0.0, 0.0) == card_lib.PROBE_LOSS_ATOL


@requires_jax
@requires_torch
@pytest.mark.cpu_features
@pytest.mark.parametrize("name", FAMILIES)
def test_correct_sides_probe_alike(name):
  """Measured: the probe losses of jax and torch 0 to 3 ulps of the loss apart (2.38e-6 at gpt2-tiny's 8.0 on an
  AMD EPYC without AVX512-FP16, 0 to 9.5e-7 on the CPU before), within probe_loss_tolerance, the rounding of the
  probe's reductions on two sides; the rounding of the norms is HF's of each family on both."""
  spec = preset(name).model
  j, t = _items("jax", spec), _items("torch", spec)
  a, b = j["forward.probe_loss"], t["forward.probe_loss"]
  assert abs(a - b) <= card_lib.probe_loss_tolerance(a, b), (j, t)
  want = "one rounding" if spec.norm == "layernorm" or spec.norm_plus_one else "rounded factors"
  assert j["norm.rounding"] == t["norm.rounding"] == want


@requires_jax
@requires_torch
@pytest.mark.parametrize("plant, name", PLANTS)
@pytest.mark.parametrize("side", ["jax", "torch"])
def test_each_family_plant_moves_its_card_item_on_either_side(plant, name, side):
  """A forward plant moves the probe loss by >= 100x its tolerance (measured 810x to 7.7e5x of 1e-5); the (1 + w)
  rounding plant, which changes nothing in float32, changes norm.rounding."""
  spec = preset(name).model
  good, bad = _items(side, spec), _items(side, spec, {plant})
  if plant == "norm_plus_one_rounded":
    assert (good["norm.rounding"], bad["norm.rounding"]) == ("one rounding", "rounded factors")
  else:
    a, b = good["forward.probe_loss"], bad["forward.probe_loss"]
    assert abs(a - b) >= 100 * card_lib.probe_loss_tolerance(a, b)


def test_a_family_plant_the_model_cannot_show_is_refused():
  with pytest.raises(SpecError, match="qk_norm_after_rope=true changes nothing .* no q/k norms"):
    check_plants(preset("gemma2-tiny"), {"torch": {"qk_norm_after_rope": True}})
  with pytest.raises(SpecError, match="in fp32 rounding the normalised value"):
    check_plants(preset("gemma2-tiny"), {"torch": {"norm_plus_one_rounded": True}})
  with pytest.raises(SpecError, match="no attention soft-cap"):
    check_plants(preset("qwen3-tiny"), {"jax": {"attn_softcap_skipped": True}})
  check_plants(apply_overrides(preset("gemma2-tiny"), {"train.precision": "bf16"}),
               {"torch": {"norm_plus_one_rounded": True}})


@pytest.mark.process
@requires_all
@pytest.mark.parametrize("name, plant, item", [("qwen3-tiny", "qk_norm_after_rope", "forward.probe_loss"),
                                               ("gemma2-tiny", "norm_plus_one_rounded", "norm.rounding")])
def test_a_compare_fails_a_family_plant_at_step_0_naming_the_item(tmp_path, name, plant, item):
  check = semantics_failure_at_step_0(tmp_path / "run", name, "bf16", 3, ["--perturb", f"torch:{plant}=true"])
  assert item in check["detail"], check["detail"]


def semantics_failure_at_step_0(out: Path, name: str, precision: str, steps: int, perturb: list[str]) -> dict:
  """Runs `parity compare` of jax and torch on preset `name` with `perturb`'s plants into `out`, asserts it FAILs
  first on the semantics check at step 0, and returns that check ('semantics jax~torch', as report.json holds it)."""
  p = subprocess.run([sys.executable, "-m", "parity", "compare", "--preset", name, "--sides", "jax,torch", "--steps",
                      str(steps), "--set", f'train.precision="{precision}"', *perturb, "--determinism-steps", "0",
                      "--no-noise-envelope", "--out", str(out), "--no-progress"],
                     cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-2000:]
  rep = json.loads((out / "report.json").read_text())
  first = rep["verdict"]["first_failure"]
  assert first["metric"] == "semantics" and first["step"] == 0, first
  return next(c for c in rep["checks"] if c["name"] == "semantics jax~torch")


def test_an_overflowed_probe_loss_agrees_only_with_itself():
  """A port computing log(softmax) overflows to inf on wide models: inf is no number within a tolerance of 118."""
  inf = float("inf")
  for a, b in ((inf, 118.77), (-inf, 8.0), (8.0, inf), (float("nan"), 8.0)):
    assert card_lib.diff_cards({"items": {"forward.probe_loss": a}}, {"items": {"forward.probe_loss": b}})
  assert not card_lib.diff_cards({"items": {"forward.probe_loss": inf}}, {"items": {"forward.probe_loss": inf}})
