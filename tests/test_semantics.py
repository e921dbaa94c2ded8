"""The semantics card: the framework-free diff and gate, the report's check, and each side's probes
detecting a deliberately wrong object (in process). The process tests (plants FAIL at step 0, no false alarm on a
3-side run) are in tests/test_semantics_runs.py."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from parity import semantics as card_lib
from parity.numerics.adam import classify_adam
from parity.overrides import apply_overrides
from parity.pipeline.plants import spec_reason
from parity.presets import preset
from parity.protocol.semantics import SEMANTICS_FILE, TRAIN_ANYWAY_KEY, read_card
from parity.verdict.sides import compare_sides, semantics_check, verdict
from test_loop import FakeSide, make_run, train

GOOD = {"mlp.gelu_form": "tanh", "norm.form": "layernorm", "norm.eps": 1e-5, "optimizer.decay_set": ["a", "b"]}


def _card(side, **items):
  return card_lib.make_card(side, "r", {**GOOD, **items}, {"optimizer": side})


def test_diff_names_each_item_and_both_values_and_ignores_info():
  a, b = _card("jax"), _card("deepspeed", **{"mlp.gelu_form": "erf"})
  assert card_lib.diff_cards(a, _card("torch")) == []  # info differs (optimizer names): never diffed
  diffs = card_lib.diff_cards(a, b)
  assert diffs == [("mlp.gelu_form", "tanh", "erf")]
  assert card_lib.diff_text("jax", "deepspeed", diffs) == "semantics: mlp.gelu_form jax=tanh deepspeed=erf"
  c = _card("torch", **{"optimizer.decay_set": ["a", "b", "x.bias"]})
  assert ("optimizer.decay_set jax=2 names (none the other lacks) torch=3 names (1 the other lacks: x.bias)"
          in card_lib.diff_text("jax", "torch", card_lib.diff_cards(a, c)))
  with pytest.raises(ValueError, match="not in parity.semantics.DIFFED"):
    card_lib.make_card("jax", "r", {"mlp.gelu": "tanh"}, {})


def test_semantics_check_fails_at_step_0_and_is_named_first_by_the_verdict():
  check = semantics_check("jax", _card("jax"), "deepspeed", _card("deepspeed", **{"mlp.gelu_form": "erf"}))
  assert not check.passed and check.first_failing_step == 0 and check.metric == "semantics"
  assert check.detail == "semantics: mlp.gelu_form jax=tanh deepspeed=erf"
  assert semantics_check("jax", _card("jax"), "torch", _card("torch")).passed
  spec = preset("gpt2-tiny")
  sides = {s: {"status": "ok", "steps": [], "final": None, "semantics": _card(s, **(
      {"mlp.gelu_form": "erf"} if s == "deepspeed" else {}))} for s in ("jax", "deepspeed")}
  checks, _ = compare_sides(sides, spec=spec, init={})
  assert checks[-1].name == "semantics jax~deepspeed"
  v = verdict(checks, {"jax": "ok", "deepspeed": "crashed"})
  assert v.first_failure.metric == "semantics" and "mlp.gelu_form jax=tanh deepspeed=erf" in v.message


def _two_sides(tmp_path, second: dict, **request):
  run = make_run(tmp_path / "r")
  if request:
    req = json.loads((run / "request.json").read_text())
    (run / "request.json").write_text(json.dumps({**req, **request}))
  first = train(run, FakeSide(card=GOOD), side="jax")
  return first, train(run, FakeSide(card={**GOOD, **second}), side="torch")


def test_a_later_side_whose_card_differs_stops_before_step_1_naming_both_values(tmp_path):
  first, later = _two_sides(tmp_path, {"mlp.gelu_form": "erf"})
  assert first.code == 0 and first.summary["status"] == "ok"
  assert later.code == 1 and later.summary["status"] == "crashed" and later.steps == []
  assert "semantics: mlp.gelu_form jax=tanh torch=erf" in later.summary["error"]
  assert "--train-anyway-on-card-diff" in later.summary["error"]
  assert read_card(later.out / SEMANTICS_FILE, "loop-test")["items"]["mlp.gelu_form"] == "erf"


def test_train_anyway_and_reruns_do_not_stop(tmp_path):
  _, later = _two_sides(tmp_path / "a", {"mlp.gelu_form": "erf"}, **{TRAIN_ANYWAY_KEY: True})
  assert later.summary["status"] == "ok" and len(later.steps) > 0
  _, rerun = _two_sides(tmp_path / "b", {"mlp.gelu_form": "erf"}, derived_from="../request.json")
  assert rerun.summary["status"] == "ok"
  _, same = _two_sides(tmp_path / "c", {})
  assert same.summary["status"] == "ok"


def test_a_card_of_another_run_is_not_read(tmp_path):
  p = tmp_path / SEMANTICS_FILE
  p.write_text(json.dumps(_card("jax")))
  assert read_card(p, "r") is not None and read_card(p, "other") is None and read_card(tmp_path / "no", None) is None


def test_classify_adam_tells_eps_placement_and_bias_correction():
  g = eps = 1e-8
  for (placement, bc), u in card_lib_forms(g, eps).items():
    assert classify_adam(u, g, eps, 0.9, 0.999, 3) == (placement, bc)
  assert classify_adam(1.0, g, eps, 0.9, 0.999, 3) == (None, None)  # SGD-like: no Adam form


def card_lib_forms(g, eps):
  from parity.numerics.adam import adam_forms
  return adam_forms(g, eps, 0.9, 0.999, 3)


def test_decay_biases_is_refused_where_it_cannot_act():
  tiny = preset("gpt2-tiny")
  assert spec_reason(tiny, "decay_biases", {}) is None  # stream layout: an optimizer plant acts on any layout
  no_bias = apply_overrides(tiny, {"model.bias": False})
  assert "no bias parameters" in spec_reason(no_bias, "decay_biases", {})
  assert "nothing is decayed" in spec_reason(apply_overrides(tiny, {"train.weight_decay": 0.0}), "decay_biases", {})


def test_norm_probe_infers_form_eps_and_statistics_dtype():
  def norm(kind, eps, reduced=False, gain=1.0):
    def apply(x):
      x = x.astype(np.float16 if reduced else np.float64) if x.dtype == np.float16 else x.astype(np.float64)
      c = x - x.mean() if kind == "ln" else x
      ms = (c * c).mean()
      return (gain * c / np.sqrt(ms + eps)).astype(np.float64)
    return apply
  assert card_lib.norm_probe(norm("ln", 1e-5), 8) == {"form": "layernorm", "eps": 1e-5, "stats_dtype": "float32"}
  assert card_lib.norm_probe(norm("rms", 1e-6), 8)["form"] == "rmsnorm"
  assert card_lib.norm_probe(norm("rms", 1e-6, gain=2.0), 8)["form"] == "rmsnorm(1+w)"
  assert card_lib.norm_probe(norm("ln", 1e-3), 8)["eps"] == 1e-3
  with np.errstate(over="ignore", invalid="ignore"):
    assert card_lib.norm_probe(norm("ln", 1e-5, reduced=True), 8)["stats_dtype"] == "reduced"


# ------------------------------------------------------------------ the JAX side's probes on wrong objects
@pytest.mark.requires_jax
def test_jax_probes_detect_wrong_objects():
  import jax
  import jax.numpy as jnp
  from jax_impl import layers, semantics as js
  from jax_impl import model as model_lib
  tiny = preset("gpt2-tiny").model
  assert js.gelu_form(layers.mlp_activation(tiny)) == "tanh"
  assert js.gelu_form(lambda x: jax.nn.gelu(x, approximate=False)) == "erf"
  assert js.gelu_form(jax.nn.silu) == "silu"
  assert js.rotary_layout(layers.apply_rope, 8) == "half-split"

  def interleaved(x, cos, sin):  # pairs (0, 1), (2, 3), ...: the GPT-J / Meta layout
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = jnp.asarray(cos)[..., 0::2], jnp.asarray(sin)[..., 0::2]
    return jnp.stack([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).reshape(x.shape)
  assert js.rotary_layout(interleaved, 8) == "interleaved"
  assert js.loss_reduction(model_lib._mean_nll) == "mean"
  assert js.loss_reduction(lambda lg, t: jnp.sum(model_lib._nll(lg, t))) == "sum"
  eps_wrong = apply_overrides(preset("gpt2-tiny"), {"model.norm_eps": 1e-3}).model
  assert card_lib.norm_probe(lambda x: js._norm_apply(eps_wrong, x), tiny.d_model)["eps"] == 1e-3


@pytest.mark.requires_jax
@pytest.mark.parametrize("overrides, plants, item, value", [
    ({}, frozenset(), "optimizer.eps_placement", "outside"),
    ({}, frozenset({"decay_biases"}), "optimizer.decay_set", "h.0.attn.qkv.bias"),
    ({"jax.scan_layers": True}, frozenset({"decay_biases"}), "optimizer.decay_set", "h.1.mlp.fc.bias"),
    ({"model.gelu_approximate": False}, frozenset(), "mlp.gelu_form", "erf"),
    ({"train.grad_clip": 0.0}, frozenset(), "clip.rule", "none"),
    ({"train.precision": "bf16"}, frozenset(), "dtypes.params", "bfloat16"),
])
def test_jax_card_of_a_built_trainer(overrides, plants, item, value):
  from jax_impl.semantics import semantics_card
  from jax_impl.step import Trainer
  from parity import weights
  run = apply_overrides(preset("gpt2-tiny"), overrides)
  card = semantics_card(Trainer.build(run, weights.init_params(run.model, run.train.seed), plants=plants), plants)
  got = card["items"][item]
  assert (value in got) if isinstance(got, list) else got == value, got
  if item == "optimizer.decay_set" and "decay_biases" not in plants:
    assert not any(n.endswith(".bias") for n in got)


@pytest.mark.requires_jax
def test_jax_optimizer_probe_reads_eps_inside_and_no_bias_correction():
  import optax
  from jax_impl import semantics as js
  from jax_impl.step import Trainer
  from parity import weights
  run = preset("gpt2-tiny")
  t = Trainer.build(run, weights.init_params(run.model, run.train.seed))
  from jax_impl import optim
  inside = optax.chain(optim.clip_by_global_norm_deepspeed(1.0),
                       optax.adam(t.schedule, eps=0.0, eps_root=run.train.eps))
  got = js.optimizer_probe(inside, t.schedule, t.state.params, run.model, run.train, False)
  assert got["eps_placement"] == "inside" and got["bias_correction"] is True and got["decay_set"] == []
  assert got["clip_rule"] == "global-l2"
  plain = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(t.schedule))
  assert js.optimizer_probe(plain, t.schedule, t.state.params, run.model, run.train, False)["clip_rule"] == "other"
  no_bc = optax.chain(optim.clip_by_global_norm_deepspeed(1.0), optim.optimizer_update(
      {"type": "adamw",
       "params": {"betas": [run.train.beta1, run.train.beta2], "eps": run.train.eps, "weight_decay": 0.1,
                                   "bias_correction": False}}, t.schedule, mask=None))
  got = js.optimizer_probe(no_bc, t.schedule, t.state.params, run.model, run.train, False)
  assert got["eps_placement"] == "outside" and got["bias_correction"] is False
  assert len(got["decay_set"]) == len(t.canonical_params())  # mask None: every tensor decayed
  assert got["weight_decay"] == 0.1  # -delta / lr of a float32 update, 6 significant digits


# ------------------------------------------------------------------ the torch sides' probes on wrong objects
@pytest.mark.requires_torch
def test_torch_probes_detect_wrong_objects():
  import torch
  from torch_impl import semantics as ts
  from torch_impl.layers import _apply_rope
  from torch_impl.model import build_model
  from parity import weights
  assert ts.gelu_form(torch.nn.GELU(approximate="none")) == "erf"
  assert ts.gelu_form(torch.nn.GELU(approximate="tanh")) == "tanh"
  assert ts.rotary_layout(_apply_rope, 8) == "half-split"

  def interleaved(x, cos, sin):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[..., 0::2], sin[..., 0::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).reshape(x.shape)
  assert ts.rotary_layout(interleaved, 8) == "interleaved"
  assert ts.norm_of(torch.nn.LayerNorm(8, eps=1e-3))["eps"] == 1e-3
  spec = apply_overrides(preset("gpt2-tiny"), {"model.norm": "rmsnorm", "model.norm_eps": 1e-6}).model
  model = build_model(spec, weights.init_params(spec, 0))
  assert ts.norm_of(model.h[0].ln_1) == {"form": "rmsnorm", "eps": 1e-6, "stats_dtype": "float32"}
  train = preset("gpt2-tiny").train
  from torch_impl.model import micro_loss
  dev = torch.device("cpu")
  assert ts.label_shift(lambda f, x: micro_loss(f, x, dev), train) == 1
  twice = lambda f, x: micro_loss(f, x, dev, ts._stand_in_arrays(x.shape[1] - 1),
                                  plants=frozenset({"labels_shifted_twice"}))
  assert ts.label_shift(twice, train) == 2
  p = torch.nn.Parameter(torch.zeros(1))
  assert ts.adam_form(torch.optim.Adam([p], eps=1e-8), torch.float32, 1e-8)["eps_placement"] == "outside"
  assert ts.adam_form(torch.optim.SGD([p], lr=0.1), torch.float32, 1e-8)["eps_placement"] is None
  prec = torch.get_float32_matmul_precision()
  try:
    torch.set_float32_matmul_precision("high")
    assert ts.matmul_precision() == "high"
  finally:
    torch.set_float32_matmul_precision(prec)


@pytest.mark.requires_torch
def test_torch_decay_set_reads_the_optimizer_groups_and_the_plant():
  from torch_impl import semantics as ts
  from torch_impl.baseline import TorchTrainer
  from parity import weights
  run = preset("gpt2-tiny")
  init = weights.init_params(run.model, run.train.seed)
  good = ts.semantics_card(TorchTrainer(run, init), "torch", frozenset())["items"]
  planted = ts.semantics_card(TorchTrainer(run, init, plants=frozenset({"decay_biases"})), "torch",
                              frozenset({"decay_biases"}))["items"]
  assert not any(n.endswith(".bias") for n in good["optimizer.decay_set"])
  assert "h.0.mlp.fc.bias" in planted["optimizer.decay_set"] and "ln_f.bias" in planted["optimizer.decay_set"]
  assert good["optimizer.eps_placement"] == "outside" and good["optimizer.bias_correction"] is True


@pytest.mark.requires_jax
@pytest.mark.requires_torch
@pytest.mark.parametrize("mask", ("matrices", "no_bias_norm", "all"))
def test_every_side_decays_what_train_decay_mask_names(mask):
  """train.decay_mask (a port's training stack, parity.migrate._stack) reaches the optimizer each side builds: the
  JAX chain and the torch param groups decay exactly parity.weights.decays(name, mask) (scan_layers too)."""
  from jax_impl.semantics import semantics_card as jax_card
  from jax_impl.step import Trainer
  from torch_impl import semantics as ts
  from torch_impl.baseline import TorchTrainer
  from parity import weights
  run = apply_overrides(preset("gpt2-tiny"), {"train.decay_mask": mask})
  init = weights.init_params(run.model, run.train.seed)
  want = sorted(n for n in weights.param_shapes(run.model) if weights.decays(n, mask))
  assert ts.semantics_card(TorchTrainer(run, init), "torch", frozenset())["items"]["optimizer.decay_set"] == want
  for scan in (False, True):
    r = apply_overrides(run, {"jax.scan_layers": scan})
    assert jax_card(Trainer.build(r, init), frozenset())["items"]["optimizer.decay_set"] == want, scan


FAMILIES = ("llama3-tiny", "qwen2-tiny", "qwen3-tiny", "gemma2-tiny", "gemma3-tiny", "mistral-tiny")
"""The newer model families' run presets (parity.presets)."""
LLAMA = ['model.norm="rmsnorm"', 'model.mlp="swiglu"', 'model.position="rope"', "model.bias=false",
         "model.norm_eps=1e-6", "model.n_kv_heads=2"]
GRID = [(p, None, None, []) for p in ("gpt2-tiny", "gpt2-small-cpu", "gpt2-mini", "sft-tiny")] + [
    ("gpt2-tiny", None, prec, over) for prec in ("bf16", "fp16") for over in ([], LLAMA)] + [
    ("gpt2-tiny", None, None, LLAMA), ("gpt2-tiny", None, None, ['train.optimizer="adam"']),
    ("gpt2-tiny", None, None, ['train.optimizer="sgd"'])] + [
    ("gpt2-tiny", plan, None, []) for plan in ("zero0", "zero1", "zero2-offload", "zero3", "zero3-offload-all",
                                               "scan-offload", "zero2-offload-scan", "act-offload",
                                               "zero3-act-offload")] + [
    (family, None, prec, []) for family in FAMILIES for prec in (None, "bf16")] + [
    ("gemma3-tiny", "zero3", None, []), ("gemma3-tiny", "scan-offload", None, [])]


@pytest.mark.slow
@pytest.mark.process  # in one process, but deepspeed.initialize starts its op-build and compiler probes
@pytest.mark.requires_jax
@pytest.mark.requires_deepspeed
@pytest.mark.parametrize("name, plan, precision, overrides", GRID,
                         ids=[f"{n}-{pl or ''}-{pr or ''}-{len(o)}" for n, pl, pr, o in GRID])
def test_no_false_alarm_on_the_presets_and_plans(name, plan, precision, overrides):
  """Every side's card of a correct run agrees: the presets, bf16/fp16, a Llama-like model, each optimizer and the
  plans that build in one process (zero3-fsdp4 needs 4 JAX devices: its worker sets them; the compare covers it)."""
  import os
  os.environ.setdefault("PARITY_ALLOW_CPU", "1")
  from jax_impl.semantics import semantics_card as jcard
  from jax_impl.step import Trainer
  from parity import weights
  from parity.pipeline.resolve import resolve_run
  from torch_impl.baseline import TorchTrainer
  from torch_impl.engine import DeepSpeedTrainer
  from torch_impl.semantics import semantics_card as tcard
  run = resolve_run(name, plan=plan, precision=precision, **({"overrides": overrides} if overrides else {}))
  spec = run.spec
  init = run.init_params if run.init_params is not None else weights.init_params(spec.model, spec.train.seed)
  ref = jcard(Trainer.build(spec, init), frozenset())
  others = {"torch": tcard(TorchTrainer(spec, init), "torch", frozenset())}
  if spec.train.optimizer != "lamb":
    others["deepspeed"] = tcard(DeepSpeedTrainer(spec, init, run.deepspeed_config), "deepspeed", frozenset())
  for side, card in others.items():
    assert card_lib.diff_cards(ref, card) == [], card_lib.diff_text("jax", side, card_lib.diff_cards(ref, card))


@pytest.mark.requires_jax
@pytest.mark.requires_torch
@pytest.mark.parametrize("overrides, plants, item, value", [
    ({"model.attn_scale": 0.2}, frozenset(), "attention.scale", 0.2),  # the scale the attention module multiplies by
    ({"train.lr_schedule": "Constant"}, frozenset(), "lr.step0", 1e-3),  # the scheduler's first lr (no warmup)
    ({"train.layout": "padded"}, frozenset({"labels_shifted_twice"}), "loss.label_shift", 2),
    ({"train.optimizer": "sgd"}, frozenset(), "optimizer.eps_placement", None),
])
def test_both_sides_read_the_same_wrong_convention(overrides, plants, item, value):
  from jax_impl.semantics import semantics_card as jcard
  from jax_impl.step import Trainer
  from parity import weights
  from torch_impl.baseline import TorchTrainer
  from torch_impl.semantics import semantics_card as tcard
  run = apply_overrides(preset("gpt2-tiny"), overrides)
  init = weights.init_params(run.model, run.train.seed)
  for card in (jcard(Trainer.build(run, init, plants=plants), plants),
               tcard(TorchTrainer(run, init, plants=plants), "torch", plants)):
    got = card["items"][item]
    assert got == value or (isinstance(value, float) and got == pytest.approx(value, rel=1e-5)), (item, got)


@pytest.mark.requires_torch
def test_torch_card_reads_dropout_and_the_forward_dtype_from_the_module():
  import torch
  from torch_impl.baseline import TorchTrainer
  from torch_impl.semantics import semantics_card
  from parity import weights
  run = apply_overrides(preset("gpt2-tiny"), {"train.precision": "bf16"})
  trainer = TorchTrainer(run, weights.init_params(run.model, run.train.seed))
  assert semantics_card(trainer, "torch", frozenset())["items"]["dtypes.params"] == "bfloat16"
  trainer.model.h[0].drop = torch.nn.Dropout(0.1)  # a module the spec does not know of
  items = semantics_card(trainer, "torch", frozenset())["items"]
  assert items["dropout"] == 0.1 and items["dtypes.master"] == "float32" and items["dtypes.moments"] == "float32"


# ------------------------------------------------------------------ one plant per model family
FAMILY_PLANTS = [
    ("llama3-tiny", "torch", {"model.rope_scaling": {"rope_type": "linear", "factor": 2.0}}, frozenset(),
     "rotary.per_layer jax=((0.576056, 1.28917e-06, 1.0), (0.576056, 1.28917e-06, 1.0)) "
     "torch=((0.5, 5.15669e-06, 1.0), (0.5, 5.15669e-06, 1.0))"),
    ("qwen2-tiny", "torch", {}, frozenset({"decay_biases"}),
     "optimizer.decay_set jax=11 names (none the other lacks) torch=13 names (2 the other lacks: h.0.attn.qkv.bias, "
     "h.1.attn.qkv.bias)"),
    ("qwen3-tiny", "jax", {"model.attn_scale": 0.25}, frozenset(), "attention.scale torch=0.176777 jax=0.25"),
    ("gemma2-tiny", "torch", {"model.attn_softcap": 50.0}, frozenset(), "attention.softcap jax=2.0 torch=50.0"),
    ("gemma3-tiny", "jax", {"model.rope_local_theta": 1000000.0}, frozenset(),
     "rotary.per_layer torch=((1.0, 0.000177828, 1.0), (1.0, 0.000177828, 1.0), (0.125, 2.96422e-07, 1.0)) "
     "jax=((1.0, 2.37137e-06, 1.0), (1.0, 2.37137e-06, 1.0), (0.125, 2.96422e-07, 1.0))"),
    ("mistral-tiny", "jax", {"model.sliding_window": 16}, frozenset(), "attention.window torch=(8, 8) jax=(16, 16)"),
]


@pytest.mark.requires_jax
@pytest.mark.requires_torch
@pytest.mark.parametrize("name, side, overrides, plants, expected", FAMILY_PLANTS, ids=[p[0] for p in FAMILY_PLANTS])
def test_one_plant_per_family_differs_naming_the_item_and_both_values(name, side, overrides, plants, expected):
  """The per-family plant (a `--perturb SIDE:model.<field>` or decay_biases) on one side against the other side's
  card of the preset: exactly that item differs, the text naming both values (the FAIL at step 0 of a compare)."""
  from jax_impl.semantics import semantics_card as jcard
  from jax_impl.step import Trainer
  from parity import weights
  from torch_impl.baseline import TorchTrainer
  from torch_impl.semantics import semantics_card as tcard
  base = preset(name)
  init = weights.init_params(base.model, base.train.seed)

  def card(s, run, pl):
    return (jcard(Trainer.build(run, init, plants=pl), pl) if s == "jax"
            else tcard(TorchTrainer(run, init, plants=pl), "torch", pl))
  other = "torch" if side == "jax" else "jax"
  good = card(other, base, frozenset())
  assert card_lib.diff_cards(good, card(side, base, frozenset())) == []  # no false alarm unperturbed
  diffs = card_lib.diff_cards(good, card(side, apply_overrides(base, overrides), plants))
  probe = [d for d in diffs if d[0] == "forward.probe_loss"]  # a model field changes the forward probe's loss too
  assert bool(probe) == bool(overrides), probe
  rest = [d for d in diffs if d[0] != "forward.probe_loss"]
  text = re.sub(r", sha256:[0-9a-f]{12}", "", card_lib.diff_text(other, side, rest))  # rotary rows' digests
  assert text == "semantics: " + expected


def test_a_rotary_difference_inside_the_row_shows_in_its_digest():
  """Two yarn scalings that differ only in beta_fast: the two angles read out are equal, the rows are not."""
  from parity import architecture
  base = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32}
  rows = [card_lib.rope_row(*(t[1] for t in architecture.rope_tables(2, 32, 10000.0, {**base, "beta_fast": b})))
          for b in (32, 16)]
  assert rows[0][:3] == rows[1][:3] and rows[0][3] != rows[1][3]
  assert card_lib.diff_cards({"items": {"rotary.per_layer": [rows[0]]}}, {"items": {"rotary.per_layer": [rows[1]]}})


@pytest.mark.requires_jax
@pytest.mark.requires_torch
def test_family_probes_read_the_built_objects():
  """Each probe reads what the step runs: a q/k norm swapped on the torch module, the norm form under (1 + w), the
  window of a mask, the rotary row of a yarn table (its attention factor)."""
  import torch
  from jax_impl import semantics as js
  from torch_impl import semantics as ts
  from torch_impl.layers import RMSNorm
  from torch_impl.model import build_model
  from parity import architecture, weights
  spec = preset("qwen3-tiny").model
  model = build_model(spec, weights.init_params(spec, 0))
  assert ts.family_items(model, 32)["attention.qk_norm"] == "rmsnorm"
  model.h[0].attn.ln_q = RMSNorm(spec.head_dim, 1e-3, plus_one=True)
  got = ts.family_items(model, 32)
  assert got["attention.qk_norm"] == "rmsnorm(1+w)" and got["attention.qk_norm_eps"] == 1e-3
  assert ts.norm_of(torch.nn.LayerNorm(8))["form"] == "layernorm"
  gemma = preset("gemma2-tiny").model
  assert card_lib.norm_probe(lambda x: js._norm_apply(gemma, x), gemma.d_model)["form"] == "rmsnorm(1+w)"
  band = np.tril(np.ones((6, 6), bool)) & ~np.tril(np.ones((6, 6), bool), -3)
  assert card_lib.window_of(band) == 3 and card_lib.window_of(np.tril(np.ones((6, 6), bool))) == "full"
  yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
  cos, sin = architecture.rope_tables(2, 8, 10000.0, yarn)
  assert card_lib.rope_row(cos[1], sin[1])[2] == card_lib.sig(architecture.attention_factor(yarn), 6) != 1.0


def test_the_gate_holds_each_side_against_the_first_card_only(tmp_path):
  """jax, deepspeed (planted), torch: deepspeed stops on its difference from jax, torch (jax's card) trains; with
  jax planted both later sides stop, each naming jax."""
  from parity.protocol.semantics import CardDiffers, gate
  sides, req = ("jax", "deepspeed", "torch"), {"run_id": None}
  gate(tmp_path, "jax", sides, req, _card("jax"))
  with pytest.raises(CardDiffers, match="mlp.gelu_form jax=tanh deepspeed=erf"):
    gate(tmp_path, "deepspeed", sides, req, _card("deepspeed", **{"mlp.gelu_form": "erf"}))
  gate(tmp_path, "torch", sides, req, _card("torch"))  # agrees with jax, the reference: trains
  with pytest.raises(CardDiffers, match="mlp.gelu_form jax=erf torch=tanh"):
    gate(tmp_path / "b", "jax", sides, req, _card("jax", **{"mlp.gelu_form": "erf"})) or gate(
        tmp_path / "b", "torch", sides, req, _card("torch"))


# ------------------------------------------------------------------ dtypes.moments reads both Adam moments
@pytest.mark.requires_jax
def test_jax_card_reads_the_first_moment_dtype_too():
  """optax's mu_dtype keeps the first moment in bfloat16 beside a float32 second moment: the card read nu only and
  said 'float32', agreeing with a side whose moments are both float32."""
  import jax
  import jax.numpy as jnp
  import optax
  from jax_impl.semantics import semantics_card
  from jax_impl.step import Trainer, TrainState
  from parity import weights
  run = preset("gpt2-tiny")
  t = Trainer.build(run, weights.init_params(run.model, run.train.seed))
  assert semantics_card(t, frozenset())["items"]["dtypes.moments"] == "float32"
  is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
  bf16_mu = jax.tree.map(lambda x: x._replace(mu=jax.tree.map(lambda m: m.astype(jnp.bfloat16), x.mu))
                         if is_adam(x) else x, t.state.opt_state, is_leaf=is_adam)
  assert any(is_adam(x) for x in jax.tree.leaves(t.state.opt_state, is_leaf=is_adam))
  t.state = TrainState(params=t.state.params, opt_state=bf16_mu)
  got = semantics_card(t, frozenset())["items"]["dtypes.moments"]
  assert got == "first bfloat16, second float32" == card_lib.moments_dtype(["bfloat16"], ["float32"])
  assert card_lib.diff_cards(_card("jax", **{"dtypes.moments": got}), _card("torch", **{"dtypes.moments": "float32"}))


@pytest.mark.requires_torch
def test_torch_adam_probe_reads_the_first_moment_dtype_too():
  import torch
  from torch_impl import semantics as ts

  class Bf16FirstMoment(torch.optim.AdamW):  # keeps exp_avg in bfloat16 (as a low-memory Adam does)
    def step(self, closure=None):
      out = super().step(closure)
      for st in self.state.values():
        st["exp_avg"] = st["exp_avg"].to(torch.bfloat16)
      return out
  p = torch.nn.Parameter(torch.zeros(2))
  assert ts.adam_form(torch.optim.AdamW([p], eps=1e-8), torch.float32, 1e-8)["moments"] == "float32"
  moments = ts.adam_form(Bf16FirstMoment([p], eps=1e-8), torch.float32, 1e-8)["moments"]
  assert moments == "first bfloat16, second float32"
