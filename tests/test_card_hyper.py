"""The semantics card's optimizer hyper-parameters and every norm's eps (parity.semantics: optimizer.betas,
optimizer.eps, optimizer.weight_decay_groups, clip.max_norm read from the built optimizer, norm.eps_all), and the
plants they catch at step 0.

Before, the card held only the first block's first norm eps and none of the betas and eps each side built: a planted
beta2 of 0.949 FAILed a compare only on the loss (2.4x its tolerance), an Adam eps of 1e-7 at 1.9x, and a final norm
eps ten times too small (1e-6 for 1e-5, the Llama-1 / Llama-2 porting mistake) PASSed in bf16."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import requires_all, requires_jax, requires_torch
from test_card_probes import semantics_failure_at_step_0
from parity import semantics as card_lib
from parity.overrides import apply_overrides
from parity.presets import preset

NAMES = ("h.0.ln_1", "h.0.ln_2", "h.1.ln_1", "h.1.ln_2", "h.2.ln_1", "h.2.ln_2", "ln_f")
PLANTS = {"train.beta2=0.949": "optimizer.betas", "train.eps=1e-7": "optimizer.eps",
          "train.grad_clip=2.0": "clip.max_norm", "final_norm_eps_tenth=true": "norm.eps_all"}
"""Each plant on one side and the card item that names it."""


def _items(**items) -> dict:
  return {"items": items}


# ------------------------------------------------------------------ the framework-free items and their diff
def test_norm_eps_item_is_one_number_when_all_agree_else_each_role_and_layers():
  assert card_lib.norm_eps_item({n: 1e-5 for n in NAMES}) == 1e-5
  assert card_lib.norm_eps_item({}) is None
  final = {**{n: 1e-5 for n in NAMES}, "ln_f": 1e-6}
  assert card_lib.norm_eps_item(final) == ["h.*.ln_1 1e-05", "h.*.ln_2 1e-05", "ln_f 1e-06"]
  middle = {**{n: 1e-5 for n in NAMES}, "h.1.ln_1": 1e-6}
  assert card_lib.norm_eps_item(middle) == ["h.{0,2}.ln_1 1e-05", "h.1.ln_1 1e-06", "h.*.ln_2 1e-05", "ln_f 1e-05"]
  assert card_lib.norm_eps_item(dict(reversed(list(middle.items())))) == card_lib.norm_eps_item(middle)  # any order
  many = {f"h.{i}.ln_1": (1e-6 if i in (3, 4, 9) else 1e-5) for i in range(12)}
  assert card_lib.norm_eps_item(many) == ["h.{0-2,5-8,10-11}.ln_1 1e-05", "h.{3-4,9}.ln_1 1e-06"]
  assert card_lib.norm_eps_item({"h.0.ln_1": 1e-5, "ln_f": None}) == ["h.*.ln_1 1e-05", "ln_f default"]


def test_one_or_each_keeps_a_group_that_differs():
  assert card_lib.one_or_each([[0.9, 0.95], [0.9, 0.95]]) == [0.9, 0.95]
  assert card_lib.one_or_each([1e-8, 1e-7]) == [1e-8, 1e-7]
  assert card_lib.one_or_each([]) is None


def test_diff_cards_names_each_new_item_and_skips_a_card_without_it():
  good = _items(**{"norm.eps_all": 1e-5, "optimizer.betas": [0.9, 0.95], "optimizer.eps": 1e-8,
                   "optimizer.weight_decay_groups": [0.0, 0.1], "clip.max_norm": 1.0})
  for item, bad in (("norm.eps_all", ["h.*.ln_1 1e-05", "h.*.ln_2 1e-05", "ln_f 1e-06"]),
                    ("optimizer.betas", [0.9, 0.949]), ("optimizer.betas", [[0.9, 0.95], [0.9, 0.949]]),
                    ("optimizer.eps", 1e-7), ("optimizer.weight_decay_groups", [0.1]), ("clip.max_norm", 2.0)):
    other = _items(**{**good["items"], item: bad})
    assert [d[0] for d in card_lib.diff_cards(good, other)] == [item], (item, bad)
  other = _items(**{**good["items"], "norm.eps_all": ["h.*.ln_1 1e-05", "h.*.ln_2 1e-05", "ln_f 1e-06"]})
  assert card_lib.diff_text("jax", "torch", card_lib.diff_cards(good, other)) == (
      "semantics: norm.eps_all jax=1e-05 torch=(h.*.ln_1 1e-05, h.*.ln_2 1e-05, ln_f 1e-06)")
  older = _items(**{"norm.eps": 1e-5})  # a card written before these items existed: not compared on them
  assert card_lib.diff_cards(good, older) == [] and card_lib.diff_cards(older, good) == []


def test_betas_agree_within_a_float32_rounding_and_no_further():
  """BETA_ATOL: a beta1 from a float32 table (JAX under OneCycle) equals the float64 one of a torch param group; a
  beta2 of 0.99999 is not 0.999999 (1 - beta2 ten times larger), which the generic relative 1e-5 would call equal."""
  f32 = [float(np.float32(0.85)), 0.99]
  assert f32[0] != 0.85
  assert card_lib.diff_cards(_items(**{"optimizer.betas": [0.85, 0.99]}), _items(**{"optimizer.betas": f32})) == []
  for b in (0.8, 0.85, 0.9, 0.95, 0.99, 0.999, 0.9999999):
    assert abs(float(np.float32(b)) - b) <= card_lib.BETA_ATOL / 3
  assert card_lib.diff_cards(_items(**{"optimizer.betas": [0.9, 0.99999]}),
                             _items(**{"optimizer.betas": [0.9, 0.999999]}))
  assert card_lib.diff_cards(_items(**{"optimizer.betas": [0.9, 0.95]}), _items(**{"optimizer.betas": None}))


def test_the_report_says_betas_agree_within_their_tolerance():
  from parity.report.semantics_view import agree_text
  row = {"item": "optimizer.betas", "agree": True, "values": {"jax": [float(np.float32(0.85)), 0.99],
                                                               "torch": [0.85, 0.99]}}
  assert agree_text(row) == "yes, within 1e-07"
  assert agree_text({**row, "values": {"jax": [0.85, 0.99], "torch": [0.85, 0.99]}}) == "yes"


# ------------------------------------------------------------------ each side reads what it built
@requires_jax
def test_jax_reads_the_chain_it_built_not_the_spec():
  """The card's betas, eps, decays and clip are the values the optax chain was built with: a Trainer whose chain
  was built from other values than its run's shows the chain's (the fp16 loss-scaled wrapper keeps them)."""
  from jax_impl import optim
  from jax_impl.semantics import optimizer_items, semantics_card
  from jax_impl.step import Trainer
  from parity import weights
  run = preset("gpt2-tiny")
  trainer = Trainer.build(run, weights.init_params(run.model, run.train.seed))
  items = semantics_card(trainer, frozenset())["items"]
  assert (items["optimizer.betas"], items["optimizer.eps"], items["clip.max_norm"]) == ([0.9, 0.95], 1e-8, 1.0)
  assert items["optimizer.weight_decay_groups"] == [0.0, 0.1] and items["norm.eps_all"] == 1e-5
  other = apply_overrides(run, {"train.beta2": 0.949, "train.eps": 1e-7, "train.grad_clip": 2.0,
                                "train.weight_decay": 0.01, "train.precision": "fp16"})
  trainer.tx = optim.make_optimizer(run.model, other.train)[0]  # the run still says 0.95, 1e-8, 1.0, 0.1
  items = semantics_card(trainer, frozenset())["items"]
  assert (items["optimizer.betas"], items["optimizer.eps"], items["clip.max_norm"]) == ([0.9, 0.949], 1e-7, 2.0)
  assert items["optimizer.weight_decay_groups"] == [0.0, 0.01] and items["clip.rule"] == "global-l2"
  sgd = optim.make_optimizer(run.model, apply_overrides(run, {"train.optimizer": "sgd"}).train)[0]
  got = optimizer_items(sgd, 0, [], 3)
  assert got["optimizer.betas"] is None and got["optimizer.eps"] is None
  assert got["optimizer.weight_decay_groups"] == [0.0]


@requires_torch
def test_torch_reads_its_param_groups_and_the_clip_its_step_uses():
  import torch
  from torch_impl import semantics as ts
  from torch_impl.baseline import TorchTrainer
  from parity import weights
  run = preset("gpt2-tiny")
  trainer = TorchTrainer(run, weights.init_params(run.model, run.train.seed))
  items = ts.semantics_card(trainer, "torch", frozenset())["items"]
  assert (items["optimizer.betas"], items["optimizer.eps"], items["clip.max_norm"]) == ([0.9, 0.95], 1e-8, 1.0)
  assert items["optimizer.weight_decay_groups"] == [0.0, 0.1] and items["norm.eps_all"] == 1e-5
  trainer.optimizer.param_groups[1]["eps"] = 1e-7  # one group built otherwise: shown per group, not hidden
  trainer.grad_clip = 2.0
  items = ts.semantics_card(trainer, "torch", frozenset())["items"]
  assert items["optimizer.eps"] == [1e-8, 1e-7] and items["clip.max_norm"] == 2.0
  p = torch.nn.Parameter(torch.zeros(1))
  assert ts.optimizer_items(torch.optim.SGD([p], lr=0.1).param_groups) == {
      "optimizer.betas": None, "optimizer.eps": None, "optimizer.weight_decay_groups": [0.0]}


@requires_jax
@requires_torch
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama3-tiny", "qwen3-tiny", "gemma2-tiny"])
def test_both_sides_read_every_norm_and_the_final_norm_plant(name):
  """Every norm module (pre-norms, q/k norms, Gemma's post norms, the final norm) on both sides, unrolled and
  scanned alike; the planted final-norm eps moves ln_f alone, to a tenth, on either side."""
  from jax_impl import layers as jl
  from jax_impl.semantics import norm_eps_by_name as jax_eps
  from torch_impl import layers as tl
  from torch_impl.model import build_model
  from torch_impl.semantics import norm_eps_by_name as torch_eps
  from parity import weights
  spec = preset(name).model
  init = weights.init_params(spec, 0)
  want = {n[:-len(".weight")]: spec.norm_eps for n in weights.param_shapes(spec)
          if n.endswith(".weight") and n.rsplit(".", 2)[-2].startswith("ln_")}
  for plants in (frozenset(), frozenset({"final_norm_eps_tenth"})):
    jl.set_model_plants(plants)
    tl.set_model_plants(plants)
    try:
      j, js, t = jax_eps(spec, False), jax_eps(spec, True), torch_eps(build_model(spec, init))
    finally:
      jl.set_model_plants(())
      tl.set_model_plants(())
    expect = {**want, "ln_f": spec.norm_eps / 10.0} if plants else want
    assert j == js == expect and t == pytest.approx(expect, rel=1e-12), (j, t)
    assert card_lib.norm_eps_item(j) == card_lib.norm_eps_item(t)


@requires_jax
def test_an_accelerator_only_plant_is_no_built_object_of_the_card():
  """jax_impl.accelerator_plants stands for an accelerator's own compiler error: the card keeps the run's eps under
  its final-norm eps, so that only the cross-backend rule can catch it, as planted."""
  from jax_impl import accelerator_plants
  from jax_impl.semantics import norm_eps_by_name
  spec = preset("llama3-tiny").model
  accelerator_plants.set_accelerator_plants({"accelerator_norm_eps": 1e-6}, "tpu")
  try:
    assert set(norm_eps_by_name(spec, False).values()) == {spec.norm_eps}
    assert accelerator_plants.planted_value("accelerator_norm_eps") == 1e-6  # still in force after the probe
  finally:
    accelerator_plants.set_accelerator_plants({}, "cpu")


@requires_jax
@requires_torch
def test_one_cycle_betas_agree_across_sides():
  """Under OneCycle momentum cycling the JAX chain's beta1 at step 0 comes from a float32 table and torch's group
  holds the float64 value: equal within BETA_ATOL, and beta2 is OneCycle's 0.99 on both."""
  from jax_impl.semantics import semantics_card as jcard
  from jax_impl.step import Trainer
  from torch_impl.baseline import TorchTrainer
  from torch_impl.semantics import semantics_card as tcard
  from parity import weights
  run = apply_overrides(preset("gpt2-tiny"), {"train.lr_schedule": "OneCycle", "train.lr_schedule_params": {
      "cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}})  # beta1 at step 0: cycle_min_mom 0.8, not a float32 value
  init = weights.init_params(run.model, run.train.seed)
  j = jcard(Trainer.build(run, init), frozenset())
  t = tcard(TorchTrainer(run, init), "torch", frozenset())
  assert j["items"]["optimizer.betas"][1] == t["items"]["optimizer.betas"][1] == 0.99
  assert t["items"]["optimizer.betas"][0] == 0.8 and j["items"]["optimizer.betas"][0] == float(np.float32(0.8))
  assert [d for d in card_lib.diff_cards(j, t) if d[0].startswith(("optimizer.", "clip.", "norm."))] == []


# ------------------------------------------------------------------ a compare stops each plant at step 0
@pytest.mark.process
@requires_all
@pytest.mark.parametrize("name, precision", [("gpt2-tiny", "fp32"), ("llama3-tiny", "bf16"), ("gpt2-tiny", "fp16")])
def test_a_compare_fails_each_hyper_and_final_norm_plant_at_step_0_naming_the_item(tmp_path, name, precision):
  """The four plants on one side of one compare per precision: the torch side stops before step 1 and the
  'semantics' check, the first failure, names each plant's item."""
  out = tmp_path / "run"
  perturb = [a for plant in PLANTS for a in ("--perturb", f"torch:{plant}")]
  check = semantics_failure_at_step_0(out, name, precision, 2, perturb)
  for item in PLANTS.values():
    assert item in check["detail"], (item, check["detail"])
  assert not (out / "torch" / "steps.jsonl").exists() or not (out / "torch" / "steps.jsonl").read_text().strip()
