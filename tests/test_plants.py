"""Planted data bugs as `--perturb SIDE:KEY=true` (parity.protocol.layout.PLANT_KEYS,
docs/data-examples.md "Planted bugs").

In process: the keys parse; a plant that cannot have an effect is refused with its reason (stream layout, padded
rows for the mask and position plants, rotary positions for the position plant, data without a second example in
a row or without prompt tokens); JAX (jax_impl.step.example_loss_kwargs) and torch (torch_impl.model.micro_loss,
which the DeepSpeed side runs too) apply each model-level plant identically, and it moves the loss far beyond fp32.
Processes (one module-scoped cache, each run once): every plant FAILs a compare naming the loss at step 0, on
packed or padded rows of a tiny JSONL of varying lengths (two three-side compares: a plant on jax and one on
DeepSpeed each, torch clean); `parity diagnose` names layer 0's attention probabilities for the dropped mask and the
embedding (where learned positions are added) for the positions.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import requires_deepspeed, requires_jax, requires_torch
from parity.dataset.examples import Example
from parity.dataset.layouts import build_batches
from parity.dataset.reference import in_example_targets, token_weights
from parity.dataset.demo import short_prompt_jsonl
from parity.pipeline.folder import parse_perturb
from parity.pipeline.perturb import plan_perturbations
from parity.pipeline.plants import check_plants_on_data, data_reason, normalization_reason
from parity.presets import preset
from parity.protocol.layout import PLANT_KEYS, parse_debug_value
from parity.overrides import apply_overrides
from parity.spec import ModelSpec, SpecError

ROOT = Path(__file__).resolve().parents[1]
V, T = 64, 16
LENGTHS = (5, 9, 3, 12, 21, 7, 4, 11, 6, 14)  # 21 > T + 1: truncated
PROMPTS = (2, 4, 1, 5, 6, 0, 1, 3, 2, 7)


def _batches(layout: str):
  rng = np.random.default_rng(7)
  ex = [Example(ids=rng.integers(1, V, n).astype(np.uint32), loss=np.arange(n) >= max(p, 1), record=i + 1)
        for i, (n, p) in enumerate(zip(LENGTHS, PROMPTS))]
  return build_batches(ex, steps=1, grad_accum_steps=2, micro_batch_size=2, seq_len=T, seed=0, vocab_size=V,
                       layout=layout, pad_id=0)


def _spec(layout: str, **model):
  return apply_overrides(preset("sft-tiny"), {"train.layout": layout, **{f"model.{k}": v for k, v in model.items()}})


# ----------------------------------------------------------------------------- keys and refusals


def test_plant_keys_take_true_only():
  assert parse_perturb(["torch:loss_on_prompt=true"], ("jax", "torch")) == {"torch": {"loss_on_prompt": True}}
  for bad in (False, 1, "yes"):
    with pytest.raises(ValueError, match="planted bug: it takes true"):
      parse_debug_value("labels_shifted_twice", bad)


@pytest.mark.parametrize("layout,key,model,why", [
    ("stream", "labels_shifted_twice", {}, "stream layout has none"),
    ("padded", "attention_mask_dropped", {}, "never reads padding"),
    ("padded", "positions_not_restarted", {}, "starts at slot 0"),
    ("packed", "positions_not_restarted", {"position": "rope", "rope_theta": 500.0}, "rotary positions"),
])
def test_a_plant_that_cannot_have_an_effect_is_refused_with_its_reason(layout, key, model, why):
  with pytest.raises(SpecError, match=rf"--perturb torch:{key}=true changes nothing the torch side trains: .*{why}"):
    plan_perturbations(_spec(layout, **model), {"torch": {key: True}})


def test_plants_that_can_act_are_planned_for_their_side_only():
  rope = _spec("packed", position="rope", rope_theta=500.0)
  both = {"attention_mask_dropped": True, "positions_not_restarted": True}
  assert plan_perturbations(rope, {"jax": both}).perturb == {"jax": both}  # rotary shifts matter across documents
  for layout, keys in (("packed", PLANT_KEYS), ("padded", ("labels_shifted_twice", "loss_on_prompt"))):
    for key in keys:
      plan = plan_perturbations(_spec(layout), {"torch": {key: True}})
      assert plan.perturb == {"torch": {key: True}} and plan.records == []  # no spec field moves


def test_data_that_hides_a_plant_is_refused():
  packed = _batches("packed")
  assert int(packed.segment_ids.max()) >= 2 and all(data_reason(k, packed.loss_mask, packed.segment_ids) is None
                                                    for k in PLANT_KEYS)
  one = np.where(packed.segment_ids > 0, 1, 0).astype(np.int32)  # every row one example
  assert "second example" in data_reason("attention_mask_dropped", packed.loss_mask, one)
  no_prompt = in_example_targets(packed.loss_mask, packed.segment_ids)
  with pytest.raises(SpecError, match="loss_on_prompt=true changes nothing.*no prompt tokens"):
    check_plants_on_data({"jax": {"loss_on_prompt": True}}, no_prompt, packed.segment_ids)


def test_a_perturbation_alike_on_every_side_is_refused():
  """The same bug on every compared side PASSed a comparison (labels_shifted_twice on jax and
  torch gave PASS, exit 0): refused, naming the key and the fix; on two of three sides it is a difference."""
  spec = dataclasses.replace(_spec("padded"), sides=("jax", "torch"))
  with pytest.raises(SpecError, match="labels_shifted_twice=True on every compared side .*plant it on one side only"):
    plan_perturbations(spec, {"jax": {"labels_shifted_twice": True}, "torch": {"labels_shifted_twice": True}})
  three = dataclasses.replace(spec, sides=("jax", "deepspeed", "torch"))
  both = {"jax": {"labels_shifted_twice": True}, "torch": {"labels_shifted_twice": True}}
  assert plan_perturbations(three, both).perturb == both  # deepspeed is the clean one
  assert plan_perturbations(spec, {"jax": {"train.lr": 0.002}, "torch": {"train.lr": 0.003}}).perturb
  kill = {"jax": {"kill_at_step": 1}, "torch": {"kill_at_step": 1}}  # a fault injection on every side: its own test
  assert plan_perturbations(spec, kill).perturb == kill


def test_micro_mean_on_batches_where_it_equals_tokens_is_refused():
  """Rows that all hold the same number of loss tokens (e.g. long examples truncated to full rows) make micro_mean
  and tokens the same objective whatever the ranks: refused (it once PASSed, exit 0)."""
  packed = _batches("packed")
  assert normalization_reason(packed.loss_mask) is None  # varying lengths: the plant acts
  full = np.ones_like(packed.loss_mask, dtype=bool)
  assert "same number of loss tokens" in normalization_reason(full)
  with pytest.raises(SpecError, match="train.loss_normalization=micro_mean changes nothing the torch side"):
    check_plants_on_data({"torch": {"train.loss_normalization": "micro_mean"}}, full, packed.segment_ids)
  uneven_rows = full.copy()
  uneven_rows[:, :, 0, -3:] = False  # row 0 of each micro batch holds fewer: two ranks (a row each) weigh them apart
  assert normalization_reason(uneven_rows, 2) is None
  assert "same number of loss tokens" in normalization_reason(uneven_rows, 1)  # one rank: each micro batch alike


@pytest.mark.parametrize("world", [1, 2])
def test_micro_mean_that_changes_nothing_on_this_run_s_ranks_is_refused(world):
  """`--perturb torch:train.loss_normalization=micro_mean` on one rank without gradient accumulation PASSed labelled
  'applied': the refusal weighed one rank per row, not the run's ranks. Rows of different lengths, one micro batch a
  step: on one rank that micro batch is the step (one loss); on --nproc 2, ranks that each hold the same number of
  loss tokens are one loss too; ranks that hold different numbers are not."""
  mask = np.zeros((3, 1, 2, T), dtype=bool)  # (steps, A=1, B=2 rows, T)
  mask[:, :, 0, :5] = True
  mask[:, :, 1, :11] = True  # row 1 holds more loss tokens than row 0
  plant = {"torch": {"train.loss_normalization": "micro_mean"}}
  seg = mask.astype(np.int32)
  if world == 1:
    with pytest.raises(SpecError, match="micro_mean changes nothing the torch side trains: the run has one rank and "
                                        "one micro batch a step .*train.grad_accum_steps > 1 or --nproc 2"):
      check_plants_on_data(plant, mask, seg, world=1)
    two = np.concatenate([mask, mask], axis=1)  # A=2: micro batches of 16 and 10 loss tokens: it acts
    two[:, 1, 1, 5:] = False
    assert normalization_reason(two, 1) is None
  else:
    check_plants_on_data(plant, mask, seg, world=2)  # a row a rank, 5 vs 11 loss tokens: the plant acts
    same = mask.copy()
    same[:, :, 1, 5:] = False  # both ranks hold 5 loss tokens a step: one loss
    with pytest.raises(SpecError, match=r"micro_mean changes nothing the torch side trains: .*\(2 rank\(s\) x 1 micro "
                                        r"batch\(es\) of 1 row\(s\)\) holds the same number of loss tokens"):
      check_plants_on_data(plant, same, seg, world=2)


@pytest.mark.parametrize("layout", ("padded", "packed"))
def test_loss_on_prompt_adds_exactly_the_prompt_targets(layout):
  b = _batches(layout)
  got = in_example_targets(b.loss_mask, b.segment_ids)
  assert not (b.loss_mask & ~got).any() and (got & ~b.loss_mask).sum() > 0
  seg = b.segment_ids
  crossing = np.zeros_like(got)
  crossing[..., :-1] = seg[..., :-1] != seg[..., 1:]
  assert not (got & crossing & ~b.loss_mask).any()  # never a target of the next example or padding
  assert not (got & (seg == 0)).any()


# ----------------------------------------------------------------------------- the frameworks apply them alike

GPT2 = ModelSpec(vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_seq_len=32)
MODEL_PLANTS = ("attention_mask_dropped", "positions_not_restarted", "labels_shifted_twice")


@requires_jax
@requires_torch
def test_jax_and_torch_apply_each_model_plant_alike_and_it_moves_the_loss():
  """Per plant: the step objective sum over micro batches of the weighted loss, JAX and torch, agree to 1e-5 nats
  (fp32, the LOSS_ATOL of tests/test_model_masks.py) and differ from the correct one by > 1e-3 (100x that)."""
  import jax
  import torch
  from jax_impl import layout, model as jm
  from jax_impl.step import example_loss_kwargs
  from torch_impl import model as tm
  from parity.protocol.side import ExampleArrays
  from parity.weights import param_shapes
  jax.config.update("jax_default_matmul_precision", "highest")
  rng = np.random.default_rng(3)
  canon = {k: (0.3 * rng.standard_normal(s)).astype(np.float32) for k, s in param_shapes(GPT2).items()}
  params, model = layout.to_flax(canon, GPT2), tm.build_model(GPT2, canon)
  b = _batches("packed")
  arrays = ExampleArrays(b.segment_ids[0], b.positions[0], token_weights(b.loss_mask, "tokens")[0].astype(np.float32))
  tokens = b.tokens[0]

  def objective(plants):
    fn = lambda micro: jm.loss_fn(params, micro["tokens"], GPT2, **example_loss_kwargs(micro, plants))  # eager:
    j = sum(float(fn({"tokens": tokens[a].astype(np.int32), "segment_ids": arrays.segment_ids[a],  # 4 jits cost more
                      "positions": arrays.positions[a], "weights": arrays.weights[a]})) for a in range(2))
    with torch.no_grad():
      t = sum(float(tm.micro_loss(model, tokens[a], torch.device("cpu"), arrays, a, plants)) for a in range(2))
    return j, t

  right = objective(frozenset())
  assert abs(right[0] - right[1]) <= 1e-5
  for key in MODEL_PLANTS:
    j, t = objective(frozenset({key}))
    assert abs(j - t) <= 1e-5, key
    assert abs(j - right[0]) > 1e-3, key


# ----------------------------------------------------------------------------- processes

PLANTED = {  # compare -> (layout, {side: its plant}); torch is the clean reference of both, so each pair with torch
    # fails on its one plant, and DeepSpeed carries one plant on each layout
    "packed": ("packed", {"jax": "attention_mask_dropped", "deepspeed": "positions_not_restarted"}),
    "padded": ("padded", {"jax": "labels_shifted_twice", "deepspeed": "loss_on_prompt"}),
}
# the smallest run that shows each: gpt2-tiny's width (sft-tiny), rows of 48, no eval, one process per side; 3 steps:
# sft-tiny warms up over 3 steps from lr 0, and a run whose lr is 0 on every step fails the `updates` check. Two
# compares of three sides (6 workers) cover the four plants; each plant on one side also checks that the other two
# pairs stay apart from it (the planted side fails against both others)
SMALL = ("--preset", "sft-tiny", "--set", "train.seq_len=48", "--set", "train.eval_every=0")


def _jsonl(folder: Path) -> Path:
  """Pre-tokenized examples of 6..40 tokens, each with a prompt of 1..n/2 tokens without loss (-100 labels)."""
  return short_prompt_jsonl(folder / "short.jsonl")


def _cli(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "parity.cli", *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """name -> (exit code, report.json or diagnose.json or None, output), each run once, when a test first asks."""
  base = tmp_path_factory.mktemp("plants")
  data, cache = _jsonl(base), {}

  def get(name: str):
    if name not in cache:
      out = base / name
      if name.startswith("diagnose"):
        plant = {"diagnose-mask": ["--perturb", "torch:attention_mask_dropped=true"],
                 "diagnose-positions": ["--perturb", "torch:positions_not_restarted=true"]}[name]
        p = _cli("diagnose", *SMALL, "--set", f"data={data}", "--set", "train.layout=packed", "--out", str(out),
                 *plant)
        file = out / "diagnose.json"
      else:
        layout, plants = PLANTED[name]
        perturb = [a for side, key in plants.items() for a in ("--perturb", f"{side}:{key}=true")]
        p = _cli("compare", *SMALL, "--steps", "3", "--sides", "jax,torch,deepspeed", "--data", str(data), "--set",
                 f"train.layout={layout}", "--determinism-steps", "0", "--no-progress", "--out", str(out), *perturb,
                 "--train-anyway-on-card-diff")  # labels_shifted_twice is on the card: the loss must see it too
        file = out / "report.json"
      cache[name] = (p.returncode, json.loads(file.read_text()) if file.exists() else None, p.stdout + p.stderr)
    return cache[name]

  return get


@pytest.mark.slow
@pytest.mark.process
@requires_jax
@requires_deepspeed
@pytest.mark.parametrize("name", list(PLANTED))
def test_each_plant_fails_a_compare_naming_the_loss_at_step_0(runs, name):
  rc, rep, out = runs(name)
  assert rc == 1 and rep is not None, out[-3000:]
  assert rep["verdict"]["passed"] is False
  checks = {(c["metric"], tuple(sorted(c["sides"]))): c for c in rep["checks"] if len(c.get("sides") or ()) == 2}
  for side, key in PLANTED[name][1].items():
    pair = tuple(sorted((side, "torch")))
    loss = checks[("loss", pair)]
    assert loss["passed"] is False and loss["first_failing_step"] == 0, (key, loss)
    assert all(checks[(m, pair)]["passed"] for m in ("completed", "updates", "lr")), key  # lr > 0: a real compare
    assert f"planted bug {side}: {key} = true" in out, key
  if name == "padded":  # labels_shifted_twice is a convention of the semantics card: named first, at step 0
    assert "loss.label_shift jax=2 torch=1" in out
  else:
    assert "loss of" in out and "first exceeds its tolerance at step 0" in out


@pytest.mark.process
def test_a_hidden_plant_exits_2_before_any_side_starts(tmp_path):
  p = _cli("compare", *SMALL, "--steps", "2", "--sides", "jax,torch", "--no-progress", "--out", str(tmp_path / "r"),
           "--perturb", "torch:attention_mask_dropped=true")
  assert p.returncode == 2 and "never reads padding" in p.stderr and "Traceback" not in p.stderr
  assert not (tmp_path / "r").exists()


@pytest.mark.slow
@pytest.mark.process
@requires_jax
@requires_deepspeed  # the process guard cannot tell a diagnose from a run that starts DeepSpeed
@pytest.mark.parametrize("name,first", [("diagnose-mask", "h.0.attn.probs"), ("diagnose-positions", "embed")])
def test_diagnose_localises_the_mask_and_position_plants_on_packed_rows(runs, name, first):
  """The dropped mask first changes layer 0's attention probabilities (its scores tap is taken before the mask);
  learned positions are added at the embedding, so the positions plant shows there, before layer 0's attention.
  Each is the other's control: the mask plant's first difference comes after the embedding taps, which agree on the
  same packed step when only the mask differs."""
  rc, d, out = runs(name)
  assert d is not None, out[-3000:]
  got = (d.get("first") or {}).get("name")
  assert got == first and rc == (0 if first is None else 1), out[-3000:]


def _compare(*argv) -> tuple[int, str]:
  import contextlib
  import io
  from parity.cli import main
  err = io.StringIO()
  with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    rc = main([str(a) for a in argv])
  return rc, err.getvalue()


def test_compare_refuses_micro_mean_on_one_rank_and_checks_the_nproc_ranks(tmp_path, monkeypatch):
  """The no-op micro_mean plant through `parity compare` (exit 2, nothing left behind, no side started), and the
  ranks it is checked for: --nproc's, not one per row."""
  import parity.pipeline.compare as C
  plant = ["--preset", "sft-tiny", "--steps", "2", "--set", "train.grad_accum_steps=1", "--no-progress",
           "--perturb", "torch:train.loss_normalization=micro_mean"]
  rc, err = _compare("compare", *plant, "--out", tmp_path / "one")
  assert rc == 2 and "micro_mean changes nothing the torch side trains: the run has one rank" in err, err
  assert not (tmp_path / "one").exists()
  seen = {}

  def stop(*a, **k):
    seen.update(k)
    raise SpecError("stopped before the folder")
  monkeypatch.setattr(C, "open_run_folder", stop)
  rc, err = _compare("compare", *plant, "--nproc", "2", "--out", tmp_path / "two")
  assert rc == 2 and seen["world"] == 2, err
