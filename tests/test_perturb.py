"""--perturb reaches the side it names, on every side, with and without --deepspeed-config, or is refused (exit 2)
naming the key and why; the run folder keeps the DeepSpeed config and says which tokens ran
(item 8). In-process: resolve_run + prepare_run_dir + SideIO (what a worker reads) + the DeepSpeed config builder;
one real run proves the DeepSpeed side trained the perturbed lr."""
from __future__ import annotations

import functools
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from parity.report.run_record import RunRecord

from conftest import requires_all
from parity.data import load_corpus
from parity.errors import SpecError
from parity.migrate._reverse import port_for_compare
from parity.numerics import schedule
from parity.numerics.ds_json import TRAIN_KEY_PATHS, config_value, deepspeed_json
from parity.pipeline.folder import DS_GIVEN, DS_RESOLVED, PERTURBABLE, inputs_record, parse_perturb, prepare_run_dir
from parity.pipeline.perturb import plan_perturbations, side_fields, trains
from parity.pipeline.resolve import resolve_run
from parity.presets import preset
from parity.protocol.control import ControlError, derive_request
from parity.protocol.side import SideIO
from parity.overrides import apply_overrides
from parity.spec import to_dict

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("jax", "torch", "deepspeed")

VARIANTS = {"adamw": {}, "fp16": {"train.precision": "fp16"}, "sgd": {"train.optimizer": "sgd", "train.momentum": 0.9},
            "lamb": {"train.optimizer": "lamb"}, "rope": {"model.position": "rope"},
            "padded": {"train.layout": "padded", "data": "sft-demo", "model.vocab_size": 258, "model.max_seq_len": 128,
                       "train.seq_len": 128, "train.grad_accum_steps": 2},  # 2 micro batches: the normalisations differ
            "gemma": {"model.norm": "rmsnorm", "model.mlp": "geglu", "model.position": "rope", "model.bias": False,
                      "model.sliding_window": 4, "model.layer_types": ["sliding", "full"],
                      "model.rope_local_theta": 100.0}}
"""Runs (over gpt2-tiny, 6 steps: fp32 AdamW, WarmupCosineLR from the train fields, learned positions, GELU) in which
each key shapes the training: its HOME."""
HOME = {**{k: "fp16" for k in ("train.loss_scale", "train.initial_scale_power", "train.loss_scale_window",
                               "train.hysteresis", "train.consecutive_hysteresis", "train.min_loss_scale")},
        **{k: "sgd" for k in ("train.momentum", "train.dampening", "train.nesterov")},
        **{k: "lamb" for k in ("train.lamb_max_coeff", "train.lamb_min_coeff", "train.eps_inside_sqrt")},
        "model.rope_theta": "rope", "model.rope_scaling": "rope", "train.loss_normalization": "padded",
        **{k: "gemma" for k in ("model.rope_local_theta", "model.sliding_window", "model.layer_types",
                                "model.norm_plus_one")}}
VALUES = {
    "model.norm_eps": 1e-3, "model.gelu_approximate": False, "model.attn_scale": 0.2, "model.rope_theta": 500.0,
    "train.lr": 2e-3, "train.warmup_steps": 2, "train.warmup_min_ratio": 0.1, "train.cos_min_ratio": 0.5,
    "train.lr_schedule": "Constant",
    "train.lr_schedule_params": {"total_num_steps": 6, "warmup_num_steps": 2, "warmup_type": "log"},
    "train.beta1": 0.8, "train.beta2": 0.999, "train.eps": 1e-6, "train.weight_decay": 0.0, "train.grad_clip": 0.5,
    "train.precision": "bf16", "train.loss_scale": 128.0, "train.initial_scale_power": 8,
    "train.loss_scale_window": 10, "train.hysteresis": 1, "train.consecutive_hysteresis": True,
    "train.min_loss_scale": 2.0, "train.optimizer": "adam", "train.momentum": 0.5, "train.dampening": 0.1,
    "train.nesterov": True, "train.lamb_max_coeff": 5.0, "train.lamb_min_coeff": 0.05, "train.eps_inside_sqrt": True,
    "train.loss_normalization": "micro_mean", "model.rope_scaling": {"rope_type": "linear", "factor": 2.0},
    "model.rope_local_theta": 50.0, "model.attn_softcap": 5.0, "model.final_softcap": 3.0, "model.sliding_window": 8,
    "model.layer_types": ["full", "sliding"], "model.embed_scale": 8.0, "model.norm_plus_one": True,
    "train.decay_mask": "no_bias_norm"}
"""A value for every perturbable key that differs from its HOME run's."""
REFUSED_ON_ADAMW = {k for k, v in HOME.items() if v not in ("adamw", "gemma")}
"""On the plain AdamW fp32 GPT-2 run these keys change nothing (loss scaling is fp16 only, SGD/Lamb fields, rotary
base with learned positions): each must be refused, never accepted and dropped."""
REFUSED_WITH_CONFIG = {
    "train.optimizer": "it changes optimizer.type of ",  # the DeepSpeed side runs the file's sections as written
    "train.lr_schedule": "are not Constant params",  # the config's schedule is given by lr_schedule_params
    **{k: "it shapes only the default WarmupCosineLR" for k in ("train.warmup_steps", "train.warmup_min_ratio",
                                                                "train.cos_min_ratio")}}
"""With a DeepSpeed config the ported spec gives the schedule as lr_schedule_params, so the WarmupCosineLR fields
change nothing and lr_schedule alone is not a valid schedule (every side); on the DeepSpeed side a change of a
section's type is refused."""
REFUSED_ON_EVERY_SIDE_WITH_CONFIG = {k for k in REFUSED_WITH_CONFIG if k != "train.optimizer"}
NOT_IN_CONFIG = {"train.loss_normalization", "train.decay_mask"}
"""Train keys no DeepSpeed config holds: parity applies them on every side (the loss weights it hands the step, the
param groups the training stack passes), so, like model keys, they reach the DeepSpeed side through its spec and
leave its config as it is."""


def test_every_key_has_a_value_and_a_home():
  assert set(VALUES) == set(PERTURBABLE)


@functools.lru_cache(maxsize=None)
def _spec(variant: str):
  return apply_overrides(preset("gpt2-tiny"), {"train.steps": 6, **VARIANTS[variant]}).validate()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  path = tmp_path_factory.mktemp("corpus") / "text.txt"
  path.write_text("parity perturbations reach the side they name. " * 400)
  return load_corpus(str(path))


def _get(tree, dotted):
  for part in dotted.split("."):
    tree = tree[part]
  return tree


def _same(a, b):
  return a == pytest.approx(b, rel=1e-12) if isinstance(a, float) else a == b


@pytest.mark.parametrize("key", sorted(PERTURBABLE))
def test_every_key_reaches_every_side_without_a_deepspeed_config(key, corpus, tmp_path):
  """Each side's worker (SideIO: what jax_impl/torch_impl workers build from) runs the perturbed value, and the
  DeepSpeed side's config (deepspeed_json of that spec: what ds_config hands deepspeed.initialize) carries it."""
  spec, value = _spec(HOME.get(key, "adamw")), VALUES[key]
  pert = parse_perturb([f"{s}:{key}={json.dumps(value)}" for s in SIDES], SIDES, spec)
  req = prepare_run_dir(spec, tmp_path, perturb=pert, corpus=corpus)["request"]
  assert [(r["side"], r["key"], r["value"]) for r in req["perturbations"]] == [(s, key, value) for s in SIDES]
  for side in SIDES:
    run = SideIO(tmp_path / "request.json", side).run
    assert _same(_get(to_dict(run), key), value), side
    assert trains(run) != trains(spec), f"{side}: {key}={value} changed nothing it trains"
  found, got = config_value(deepspeed_json(SideIO(tmp_path / "request.json", "deepspeed").run), key)
  if key == "train.lr_schedule":  # Constant: DeepSpeed gets no scheduler block, the optimizer's lr throughout
    assert not found
  elif key in TRAIN_KEY_PATHS:
    assert found and _in_config(key, got, value), (key, got)


def _in_config(key, got, value):
  """A DeepSpeed config's value `got` is the spec's `value`: the optimizer by its DeepSpeed type name, scheduler
  params as given (the config also holds DeepSpeed's defaults)."""
  if key == "train.optimizer":
    return got == schedule.OPTIMIZERS[value]
  if key == "train.lr_schedule_params":
    return all(got.get(k) == v for k, v in value.items())
  return _same(got, value)


@pytest.mark.parametrize("key", sorted(REFUSED_ON_ADAMW))
@pytest.mark.parametrize("side", SIDES)
def test_a_key_that_changes_nothing_is_refused_naming_it_and_why(key, side):
  spec = _spec("adamw")
  with pytest.raises(SpecError, match=f"--perturb {side}:{key}=.* changes nothing the {side} side trains: "
                                      r"(loss scaling runs only in fp16|train.optimizer 'adamw' does not read it"
                                      r"|model.position is 'learned'|on the stream layout every micro batch)|"
                                      f"--perturb {side}: train.nesterov needs train.momentum > 0"):
    plan_perturbations(spec, parse_perturb([f"{side}:{key}={json.dumps(VALUES[key])}"], SIDES, spec))


def test_the_runs_own_value_is_refused_as_no_change():
  spec = _spec("adamw")
  with pytest.raises(SpecError, match="jax:train.lr=0.001 changes nothing .* the run already has train.lr=0.001"):
    plan_perturbations(spec, {"jax": {"train.lr": spec.train.lr}})


def _write_config(tmp_path: Path, cfg: dict, name: str = "ds.json") -> Path:
  path = tmp_path / name
  path.write_text(json.dumps(cfg, indent=1))
  return path


ISSUE_CONFIG = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.95], "eps": 1e-8,
                                                          "weight_decay": "auto"}},
                "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                             "warmup_num_steps": "auto"}},
                "zero_optimization": {"stage": 2}, "gradient_clipping": "auto"}
"""The issue's ds_auto.json: optimizer lr "auto", fixed betas, a WarmupLR whose peak is "auto"."""


@pytest.mark.parametrize("key", sorted(PERTURBABLE))
def test_every_key_on_the_deepspeed_side_with_a_deepspeed_config(key, tmp_path):
  """The user's file (every value fixed, as deepspeed_json writes the HOME run): the perturbation is written into
  the config the DeepSpeed side runs, and porting that config back (parity.migrate's reading) trains the value; or
  it is refused naming the key. The user's file is never changed."""
  home = _spec(HOME.get(key, "adamw"))
  path = _write_config(tmp_path, deepspeed_json(home))
  before = path.read_bytes()
  run = resolve_run("gpt2-tiny", deepspeed_config=path, steps=6, overrides=VARIANTS[HOME.get(key, "adamw")])
  value = VALUES[key]
  if key in REFUSED_WITH_CONFIG:
    with pytest.raises(SpecError, match=f"--perturb deepspeed:{key}=.*{REFUSED_WITH_CONFIG[key]}"):
      plan_perturbations(run.spec, {"deepspeed": {key: value}}, run.deepspeed_config, source=str(path))
    return
  plan = plan_perturbations(run.spec, {"deepspeed": {key: value}}, run.deepspeed_config, source=str(path))
  ported = port_for_compare(json.loads(json.dumps(plan.deepspeed_config)), run.spec)[0]
  want = apply_overrides(run.spec, plan.perturb["deepspeed"])
  in_config = key.startswith("train.") and key not in NOT_IN_CONFIG
  assert trains(ported if in_config else want) == trains(want) != trains(run.spec)
  if in_config:
    assert _same(_get(to_dict(ported), key), value) or key == "train.lr_schedule_params"
  found, got = config_value(plan.deepspeed_config, key)
  if key in TRAIN_KEY_PATHS and key != "train.lr_schedule_params":
    assert found and _same(got, value), (key, got)
  if not in_config:
    assert plan.deepspeed_config == run.deepspeed_config and plan.records[0]["deepspeed_config"] == []
  assert path.read_bytes() == before


@pytest.mark.parametrize("key", sorted(PERTURBABLE))
@pytest.mark.parametrize("side", ("jax", "torch"))
def test_every_key_on_the_spec_sides_with_a_deepspeed_config(key, side, tmp_path):
  """With --deepspeed-config the JAX and torch sides run the ported spec: every key reaches them (or is refused
  as changing nothing, exactly as without the config)."""
  home = HOME.get(key, "adamw")
  run = resolve_run("gpt2-tiny", deepspeed_config=_write_config(tmp_path, deepspeed_json(_spec(home))), steps=6,
                    overrides=VARIANTS[home])
  if key in REFUSED_ON_EVERY_SIDE_WITH_CONFIG:
    with pytest.raises(SpecError, match=f"--perturb {side}:{key}=.*{REFUSED_WITH_CONFIG[key]}"):
      plan_perturbations(run.spec, {side: {key: VALUES[key]}}, run.deepspeed_config)
    return
  plan = plan_perturbations(run.spec, {side: {key: VALUES[key]}}, run.deepspeed_config)
  assert plan.deepspeed_config == run.deepspeed_config  # the DeepSpeed side runs the file as resolved
  assert trains(apply_overrides(run.spec, plan.perturb[side])) != trains(run.spec)


def test_keys_that_only_work_together_are_judged_together(tmp_path):
  """lr_schedule=Constant needs lr_schedule_params=null on a run whose schedule has params: together they apply on
  JAX; on the DeepSpeed side they would remove the config's scheduler section, which is refused naming it."""
  run = resolve_run("gpt2-tiny", deepspeed_config=_write_config(tmp_path, deepspeed_json(_spec("adamw"))), steps=6)
  both = {"train.lr_schedule": "Constant", "train.lr_schedule_params": None}
  plan = plan_perturbations(run.spec, {"jax": both}, run.deepspeed_config)
  assert [r["key"] for r in plan.records] == list(both)
  assert set(schedule.train_lr(apply_overrides(run.spec, plan.perturb["jax"]).train, k) for k in range(6)) == {1e-3}
  with pytest.raises(SpecError, match="--perturb deepspeed:train.lr_schedule=Constant.*changes scheduler.type of "):
    plan_perturbations(run.spec, {"deepspeed": both}, run.deepspeed_config)


def test_issue_lr_on_an_auto_lr_config_reaches_the_deepspeed_side(corpus, tmp_path):
  """`--perturb deepspeed:train.lr=0.002` with optimizer lr "auto": before, the DeepSpeed side ran 0.001 and the
  run passed. Now the config it runs has lr 0.002 and the WarmupLR peak 0.002 (it was "auto", i.e. the lr), the
  lr of its steps peaks at 0.002, JAX's at 0.001, and the user's file is untouched (a byte copy in the folder)."""
  path = _write_config(tmp_path, ISSUE_CONFIG, "ds_auto.json")
  run = resolve_run("gpt2-tiny", deepspeed_config=path, steps=6)
  pert = parse_perturb(["deepspeed:train.lr=0.002"], run.spec.sides, run.spec)
  out = tmp_path / "run"
  req = prepare_run_dir(run.spec, out, perturb=pert, corpus=corpus, deepspeed_config=run.deepspeed_config,
                        deepspeed_source=path)["request"]
  ds = req["deepspeed_config"]
  assert ds["optimizer"]["params"]["lr"] == 0.002 and ds["scheduler"]["params"]["warmup_max_lr"] == 0.002
  kind, params = ds["scheduler"]["type"], {**schedule.SCHEDULER_DEFAULTS["WarmupLR"], **ds["scheduler"]["params"]}
  assert max(schedule.lr_at(kind, params, ds["optimizer"]["params"]["lr"], k) for k in range(6)) == 0.002
  assert max(schedule.train_lr(SideIO(out / "request.json", "deepspeed").run.train, k) for k in range(6)) == 0.002
  assert max(schedule.train_lr(SideIO(out / "request.json", "jax").run.train, k) for k in range(6)) == 0.001
  assert json.loads((out / DS_RESOLVED).read_text()) == ds
  assert (out / DS_GIVEN).read_bytes() == path.read_bytes() == json.dumps(ISSUE_CONFIG, indent=1).encode()
  assert req["deepspeed_files"]["given"]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
  rec = req["perturbations"][0]
  assert [c["path"] for c in rec["deepspeed_config"]] == ["optimizer.params.lr", "scheduler.params.warmup_max_lr"]
  assert "warmup_max_lr" in rec["note"]


def test_issue_beta2_on_fixed_betas_is_written_into_the_config():
  """`--perturb deepspeed:train.beta2=0.999` on a config with fixed betas [0.9, 0.95]: the config the DeepSpeed
  side runs has betas [0.9, 0.999] (before, the file's 0.95 ran and the run passed)."""
  import tempfile
  path = _write_config(Path(tempfile.mkdtemp()), ISSUE_CONFIG)
  run = resolve_run("gpt2-tiny", deepspeed_config=path, steps=6)
  plan = plan_perturbations(run.spec, {"deepspeed": {"train.beta2": 0.999}}, run.deepspeed_config)
  assert plan.deepspeed_config["optimizer"]["params"]["betas"] == [0.9, 0.999]
  assert run.deepspeed_config["optimizer"]["params"]["betas"] == [0.9, 0.95]
  assert plan.records[0]["deepspeed_config"] == [{"path": "optimizer.params.betas", "was": [0.9, 0.95],
                                                  "now": [0.9, 0.999], "for": ["train.beta2"]}]


@pytest.mark.parametrize("key, why", [
    ("train.warmup_steps", "it shapes only the default WarmupCosineLR"),
    ("train.cos_min_ratio", "it shapes only the default WarmupCosineLR"),
])
@pytest.mark.parametrize("side", SIDES)
def test_schedule_fields_a_config_schedule_ignores_are_refused_on_every_side(key, why, side, tmp_path):
  """Under the config's WarmupLR (params given), warmup_steps/cos_min_ratio change nothing: refused on every side,
  never silently run."""
  run = resolve_run("gpt2-tiny", deepspeed_config=_write_config(tmp_path, ISSUE_CONFIG), steps=6)
  with pytest.raises(SpecError, match=f"--perturb {side}:{key}=.*{why}.*perturb train.lr_schedule_params instead"):
    plan_perturbations(run.spec, {side: {key: VALUES[key]}}, run.deepspeed_config)


def test_a_config_without_the_section_runs_the_perturbation_from_the_sides_spec(tmp_path):
  """No optimizer section: DeepSpeed gets the client optimizer built from the side's spec, so lr/beta2 reach it
  through the spec (nothing to write); precision has no section there and is refused naming why."""
  run = resolve_run("gpt2-tiny", deepspeed_config=_write_config(
      tmp_path, {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 1}}), steps=6)
  plan = plan_perturbations(run.spec, {"deepspeed": {"train.lr": 0.002, "train.beta2": 0.999}}, run.deepspeed_config)
  assert plan.deepspeed_config == run.deepspeed_config and "optimizer" not in plan.deepspeed_config
  assert [r["deepspeed_config"] for r in plan.records] == [[], []]
  with pytest.raises(SpecError, match="deepspeed:train.precision=bf16: .* no section that holds it"):
    plan_perturbations(run.spec, {"deepspeed": {"train.precision": "bf16"}}, run.deepspeed_config)


def test_derived_requests_cannot_change_the_deepspeed_configs_perturbations(corpus, tmp_path):
  path = _write_config(tmp_path, ISSUE_CONFIG)
  run = resolve_run("gpt2-tiny", deepspeed_config=path, steps=6)
  out = tmp_path / "run"
  prepare_run_dir(run.spec, out, perturb={"deepspeed": {"train.beta2": 0.999}}, corpus=corpus,
                  deepspeed_config=run.deepspeed_config, deepspeed_source=path)
  with pytest.raises(ControlError, match="cannot change them"):
    derive_request(out, "again", perturb={"jax": {"train.beta2": 0.999}})
  derived = json.loads(derive_request(out, "same", perturb={"deepspeed": {"train.beta2": 0.999}}).read_text())
  assert derived["perturbations"] is None and derived["deepspeed_config"]["optimizer"]["params"]["betas"][1] == 0.999


def test_inputs_say_which_tokens_ran_and_that_the_checkpoints_tokenizer_did_not(corpus, tmp_path):
  (tmp_path / "tokenizer.json").write_text("{}")
  rec = inputs_record(corpus, str(tmp_path))
  assert rec["tokens"] == "bytes" and rec["checkpoint_tokenizer_used"] is False
  assert "UTF-8 bytes" in rec["tokenizer"] and "tokenizer (tokenizer.json) was not used" in rec["tokenizer"]
  assert inputs_record(corpus, None)["checkpoint_tokenizer_used"] is None


def _cli(*args, timeout=900):
  return subprocess.run([sys.executable, "-m", "parity.cli", *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout)


def test_cli_refuses_an_unreachable_perturbation_with_exit_2(tmp_path, capsys):
  """In-process (cli.main: the refusal comes before any side starts)."""
  from parity.cli import main
  code = main(["compare", "--preset", "gpt2-tiny", "--steps", "4", "--no-progress", "--out", str(tmp_path / "r"),
               "--perturb", "torch:train.momentum=0.9"])
  err = capsys.readouterr().err
  assert code == 2, err[-2000:]
  assert "torch:train.momentum=0.9 changes nothing the torch side trains" in err and "Traceback" not in err
  assert not (tmp_path / "r").exists()


@pytest.mark.process
@requires_all
@pytest.mark.slow
def test_real_run_deepspeed_side_trains_the_perturbed_lr_and_the_report_reads_it_back(tmp_path):
  """The issue's command (its two perturbations at once), two sides: the DeepSpeed side's own steps.jsonl peaks at
  lr 0.002 (torch, running the port, 0.001), its optimizer's param groups hold beta2 0.999, the run fails (a planted
  difference is caught, not passed), and report.json/md/card state the value each side ran."""
  cfg = _write_config(tmp_path, ISSUE_CONFIG, "ds_auto.json")
  out = tmp_path / "run"
  p = _cli("compare", "--preset", "gpt2-tiny", "--steps", "6", "--deepspeed-config", str(cfg), "--sides",
           "torch,deepspeed", "--perturb", "deepspeed:train.lr=0.002", "--perturb", "deepspeed:train.beta2=0.999",
           "--determinism-steps", "0", "--no-progress", "--out", str(out),
           "--train-anyway-on-card-diff")  # the card names beta2 at step 0; both sides train on to show the lr
  assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
  lr = {s: [json.loads(x)["lr"] for x in (out / s / "steps.jsonl").read_text().splitlines()] for s in
        ("torch", "deepspeed")}
  assert max(lr["deepspeed"]) == pytest.approx(0.002, rel=1e-6) and max(lr["torch"]) == pytest.approx(0.001, rel=1e-6)
  rep = json.loads((out / "report.json").read_text())
  row, beta2 = rep["perturbations"]
  assert row["applied"] is True and row["ran"]["deepspeed"]["value"] == 0.002 and row["ran"]["torch"]["value"] == 0.001
  assert row["peak_lr"]["deepspeed"] == pytest.approx(0.002, rel=1e-6)
  assert beta2["applied"] is True and beta2["ran"]["torch"]["value"] == 0.95
  assert beta2["ran"]["deepspeed"] == {"value": 0.999, "from": "the DeepSpeed optimizer's param groups, betas"}
  sha = hashlib.sha256(cfg.read_bytes()).hexdigest()
  card = json.loads((out / "card.json").read_text())
  assert card["compared"]["deepspeed_config_sha256"] == sha == rep["deepspeed_files"]["given"]["sha256"]
  assert card["compared"]["perturbations"] == [
      {"side": "deepspeed", "key": "train.lr", "value": 0.002, "applied": True},
      {"side": "deepspeed", "key": "train.beta2", "value": 0.999, "applied": True}]
  md = (out / "report.md").read_text()
  assert "## Perturbations" in md and "deepspeed: train.lr = 0.002" in md and DS_GIVEN in md
  assert "Perturbations" in (out / "report.html").read_text()


def test_hf_model_run_records_the_checkpoint_and_that_its_tokenizer_did_not_run(tmp_path):
  """--hf-model: request.json, report.json (run_inputs), the report's Inputs line and the card say which data and
  tokens ran (the byte stream) and that the checkpoint's own tokenizer was not used."""
  from parity import hf, weights
  from parity.pipeline.folder import open_run_folder
  from parity.report import setup_table
  from parity.report.build import run_inputs
  from parity.report.card import card_inputs
  from parity.report.markdown import perturbation_markdown
  ckpt = tmp_path / "ckpt"
  spec = apply_overrides(preset("gpt2-tiny"), {"model.vocab_size": 256}).model
  hf.save_hf_checkpoint(ckpt, spec, weights.init_params(spec, 3))
  (ckpt / "tokenizer.json").write_text("{}")
  text = tmp_path / "text.txt"
  text.write_text("bytes, not the checkpoint's tokens. " * 400)
  run = resolve_run("gpt2-tiny", hf_model=ckpt, steps=4, data=str(text))
  prep = open_run_folder(run, tmp_path / "run", {})
  prep.claim.release()
  inputs = run_inputs(prep.path)["inputs"]
  assert inputs["checkpoint"] == str(ckpt.absolute()) and inputs["checkpoint_tokenizer_used"] is False
  assert inputs["tokens"] == "bytes" and inputs["checkpoint_tokenizer_files"] == ["tokenizer.json"]
  (line,) = setup_table.inputs_lines(RunRecord.of({"inputs": inputs}))
  assert line.startswith(f"Initial weights: the checkpoint {ckpt.absolute()}. Data: {text}")
  assert "UTF-8 bytes" in line and "tokenizer (tokenizer.json) was not used" in line
  assert "## Inputs" in "\n".join(perturbation_markdown(RunRecord.of({"inputs": inputs})))
  card = card_inputs(RunRecord.of({"inputs": inputs}))
  assert card["checkpoint_tokenizer_used"] is False and "checkpoint" not in card  # the card's checkpoint: report.json's


def test_the_report_says_not_applied_when_a_side_ran_another_value(corpus, tmp_path):
  """What today's main did (the DeepSpeed side ran the file's lr 0.001 under deepspeed:train.lr=0.002) is stated
  as NOT APPLIED, read back from that side's own records (its config and its steps' lr), never as applied."""
  from parity.report import setup_table
  from parity.report.build import perturbations_ran
  path = _write_config(tmp_path, ISSUE_CONFIG)
  run = resolve_run("gpt2-tiny", deepspeed_config=path, steps=6)
  out = tmp_path / "run"
  prepare_run_dir(run.spec, out, perturb={"deepspeed": {"train.lr": 0.002}}, corpus=corpus,
                  deepspeed_config=run.deepspeed_config, deepspeed_source=path)
  lr = [schedule.train_lr(run.spec.train, k) for k in range(6)]  # the unperturbed schedule: 0.001 at the peak
  sides = {"jax": {"status": "ok", "summary": {"spec": to_dict(run.spec)}, "series": {"lr": lr}},
           "deepspeed": {"status": "ok", "summary": {"ds_config": run.deepspeed_config, "spec": to_dict(run.spec)},
                         "series": {"lr": lr}}}
  (row,) = perturbations_ran(out, sides)
  assert row["applied"] is False and row["ran"]["deepspeed"] == {"value": 0.001, "from":
                                                                 "its DeepSpeed config, optimizer.params.lr"}
  rows = setup_table.perturbation_rows(RunRecord.of({"perturbations": [row]}))
  assert rows[0][-1] == "NOT APPLIED: deepspeed ran 0.001"
  sides["deepspeed"]["summary"]["ds_config"] = json.loads((out / DS_RESOLVED).read_text())
  sides["deepspeed"]["series"]["lr"] = [2 * x for x in lr]
  assert perturbations_ran(out, sides)[0]["applied"] is True
  sides["deepspeed"]["series"]["lr"] = lr  # the config says 0.002 but the steps ran 0.001: still not applied
  assert perturbations_ran(out, sides)[0]["applied"] is False
  sides["deepspeed"]["status"] = "crashed"
  assert setup_table.perturbation_rows(RunRecord.of({"perturbations": perturbations_ran(out, sides)}))[0][-1] == (
      "unknown: deepspeed did not finish")


@pytest.mark.parametrize("schedule_over, moves", [
    ({"train.lr_schedule": "WarmupLR", "train.lr_schedule_params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 2}},
     True),   # the peak equals train.lr: tied, it moves with it
    ({"train.lr_schedule": "WarmupLR", "train.lr_schedule_params": {"warmup_num_steps": 2}}, False),  # peak = lr
    ({"train.lr_schedule": "WarmupLR", "train.lr_schedule_params": {"warmup_max_lr": 5e-4, "warmup_num_steps": 2}},
     None),   # a peak of its own: train.lr changes nothing
    ({"train.lr_schedule": "OneCycle", "train.lr_schedule_params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3,
                                                                    "cycle_first_step_size": 3}}, None),
])
def test_lr_under_a_schedule_with_its_own_lr(schedule_over, moves):
  spec = apply_overrides(_spec("adamw"), schedule_over).validate()
  if moves is None:
    with pytest.raises(SpecError, match="jax:train.lr=0.002 changes nothing .* takes its learning rate from "
                                        "train.lr_schedule_params"):
      plan_perturbations(spec, {"jax": {"train.lr": 2e-3}})
    return
  plan = plan_perturbations(spec, {"jax": {"train.lr": 2e-3}})
  run = apply_overrides(spec, plan.perturb["jax"])
  assert max(schedule.train_lr(run.train, k) for k in range(6)) == pytest.approx(2e-3)
  assert ("train.lr_schedule_params" in plan.perturb["jax"]) is moves


def test_fault_injections_are_listed_with_what_each_side_recorded(corpus, tmp_path):
  from parity.report import setup_table
  from parity.report.build import perturbations_ran
  spec = _spec("adamw")
  prepare_run_dir(spec, tmp_path, perturb={"jax": {"train.lr": 2e-3, "nan_at_step": 2}}, corpus=corpus)
  lr = [schedule.train_lr(apply_overrides(spec, {"train.lr": 2e-3}).train, k) for k in range(6)]
  sides = {"jax": {"status": "nan", "summary": {"spec": to_dict(spec), "perturbed": {"nan_at_step": 2}},
                   "series": {"lr": lr}},
           "torch": {"status": "ok", "summary": {"spec": to_dict(spec), "perturbed": {}}, "series": {"lr": lr}}}
  lr_row, nan_row = perturbations_ran(tmp_path, sides)
  assert lr_row["key"] == "train.lr" and lr_row["applied"] is None  # jax stopped at its NaN: not read back
  assert nan_row["key"] == "nan_at_step" and nan_row["applied"] is True
  assert nan_row["ran"]["torch"]["value"] is None
  cells = setup_table.perturbation_rows(RunRecord.of({"perturbations": [nan_row]}))[0]
  assert cells[:3] == ["jax: nan_at_step = 2", "a fault injection", "n/a"]


def test_the_same_side_and_key_twice_is_refused_not_overwritten():
  """`--perturb jax:train.lr=0.002 --perturb jax:train.lr=0.003` ran 0.003 and dropped 0.002."""
  from parity.pipeline.folder import parse_perturb
  from parity.spec import SpecError
  with pytest.raises(SpecError, match=r"jax:train.lr is already given \(jax:train.lr=0.002\)"):
    parse_perturb(["jax:train.lr=0.002", "jax:train.lr=0.003"], ["jax", "torch"])
  assert parse_perturb(["jax:train.lr=0.002", "torch:train.lr=0.003"], ["jax", "torch"]) == \
      {"jax": {"train.lr": 0.002}, "torch": {"train.lr": 0.003}}


@pytest.mark.parametrize("name,item,match", [
    ("mistral-tiny", 'jax:model.layer_types=["sliding", "sliding"]', "the layer kinds the run already has"),
    ("gpt2-tiny", "torch:model.sliding_window=40", r"window of 40, at least train.seq_len \(32\)"),
    ("qwen2-tiny", 'jax:model.rope_scaling={"rope_type": "linear", "factor": 1.0}', "a factor of 1 scales nothing"),
    ("qwen2-tiny", 'jax:model.rope_scaling={"rope_type": "yarn", "factor": 1.0, '
                   '"original_max_position_embeddings": 16}', "rotary frequencies it already has"),
])
def test_a_family_field_that_changes_nothing_is_refused_with_its_own_reason(name, item, match):
  spec = preset(name)
  with pytest.raises(SpecError, match=match):
    plan_perturbations(spec, parse_perturb([item], SIDES, spec))


@pytest.mark.parametrize("name,item", [("qwen2-tiny", 'jax:model.rope_scaling={"rope_type": "linear", "factor": 2.0}'),
                                       ("mistral-tiny", "torch:model.sliding_window=4"),
                                       ("gemma2-tiny", "jax:model.final_softcap=1.0"),
                                       ("gpt2-tiny", "jax:model.sliding_window=8")])
def test_a_family_field_that_changes_the_model_is_planned(name, item):
  spec = preset(name)
  plan = plan_perturbations(spec, parse_perturb([item], SIDES, spec))
  side = item.split(":")[0]
  assert trains(apply_overrides(spec, side_fields(spec, plan.perturb[side]))) != trains(spec)
