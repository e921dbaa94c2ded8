"""FSDP2 in the plan pairs: the pairs that keep the same state in the same places on all three
engines, ZeRO-3 <-> JAX zero_stage 3 <-> fully_shard (`zero3`) and ZeRO-3 with params and optimizer on the host <->
JAX scan-offload <-> fully_shard + CPUOffloadPolicy (`scan-offload`), each PASSing jax~deepspeed~fsdp on 1 rank and
the FSDP2 side on 2 ranks against the 1-rank sides at the project's fp32 tolerances."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from parity.report.run_record import RunRecord

from conftest import requires_all
from test_fsdp import _side  # a side's status, steps, final params and moments, as compare_sides reads them
from parity.sizing import cost, plans
from parity.spec import FsdpPlan, RunSpec

SIDES = ("jax", "deepspeed", "fsdp")
STEPS = 3
SMALL = {"model.n_layers": 2, "train.eval_every": 0}


def test_the_fsdp_plans_of_the_pairs():
  with_fsdp = {n: p.fsdp for n, p in plans.PLANS.items() if p.fsdp is not None}
  assert with_fsdp == {"zero3": FsdpPlan(), "zero3-fsdp4": FsdpPlan(), "zero3-offload-all": FsdpPlan(offload=True),
                       "scan-offload": FsdpPlan(offload=True), "zero3-act-offload": FsdpPlan(activation_offload=True),
                       "zero3-offload-all-remat": FsdpPlan(offload=True, activation_checkpointing=True),
                       "scan-offload-remat": FsdpPlan(offload=True, activation_checkpointing=True)}
  for name, fsdp in with_fsdp.items():  # every FSDP2 pair is ZeRO-3 (FSDP2 always shards the params)
    ds = plans.PLANS[name].deepspeed
    assert ds.zero_stage == 3 and fsdp.offload == (ds.offload_param == "cpu")
    assert fsdp.activation_checkpointing == (ds.activation_checkpointing and not ds.cpu_checkpointing)
    assert fsdp.activation_offload == ds.cpu_checkpointing
  assert set(with_fsdp) == {n for n, p in plans.PLANS.items() if p.deepspeed.zero_stage == 3}
  run = RunSpec(sides=SIDES)
  assert plans.apply_plan(run, "scan-offload").fsdp == FsdpPlan(offload=True)
  assert plans.apply_plan(run, "zero2").fsdp == run.fsdp  # no counterpart: the run's own FSDP2 plan is kept
  assert plans.plan_of(plans.apply_plan(run, "scan-offload")) == "scan-offload"
  # a run with an fsdp side names a pair only when the FSDP2 plan is the pair's too; without the side it is not asked
  mixed = dataclasses.replace(plans.apply_plan(run, "scan-offload"), fsdp=FsdpPlan())
  assert plans.plan_of(mixed) is None
  assert plans.plan_of(dataclasses.replace(mixed, sides=("jax", "deepspeed"))) == "scan-offload"


def test_compare_resolves_the_pair_into_the_fsdp_plan():
  from parity.pipeline.resolve import resolve_run
  r = resolve_run("gpt2-tiny", plan="scan-offload", sides=list(SIDES))
  assert r.spec.fsdp.offload is True and r.spec.deepspeed.offload_param == "cpu" and r.spec.jax.scan_layers is True
  r = resolve_run("gpt2-tiny", plan="zero3", sides=list(SIDES), overrides={"fsdp.reshard_after_forward": False})
  assert r.spec.fsdp == FsdpPlan(reshard_after_forward=False)  # an override goes on top of the pair
  assert r.plan["overrides"] == ["fsdp.reshard_after_forward=false"]


def test_a_pair_without_an_fsdp2_plan_is_refused_with_the_fsdp_side_and_auto_costs_it():
  """`--plan zero2 --sides deepspeed,fsdp` ran FSDP2's own sharded plan under a report titled 'plan zero2', and
  `--plan auto --sides jax,fsdp` chose zero0, which FSDP2 has no counterpart of. A named pair
  without an FSDP2 plan is refused naming the reason and the pairs that have one; auto costs the fsdp side; without
  --plan the report's plan row says the fsdp side ran its own plan."""
  from parity.pipeline.resolve import resolve_run
  from parity.report.setup_table import plan_rows
  from parity.spec import SpecError
  for plan, reason in (("zero2", "ZeRO-0/1/2"), ("act-offload", "ZeRO-0/1/2")):
    with pytest.raises(SpecError, match=rf"--plan {plan}: no FSDP2 counterpart \(.*{reason}.*zero3-act-offload"):
      resolve_run("gpt2-tiny", plan=plan, sides=["deepspeed", "fsdp"])
  assert resolve_run("gpt2-tiny", plan="zero2", sides=["deepspeed", "jax"]).plan["name"] == "zero2"
  auto = resolve_run("gpt2-tiny", plan="auto", sides=["jax", "fsdp"])
  assert plans.PLANS[auto.plan["name"]].fsdp is not None and auto.spec.fsdp == plans.PLANS[auto.plan["name"]].fsdp
  default = resolve_run("gpt2-tiny", sides=["jax", "deepspeed", "fsdp"])
  assert default.plan["name"] == "zero2-offload" and "fsdp side runs the run's own fsdp plan" in default.plan["fsdp"]
  d = {"plan": default.plan, "run": {"jax": {}, "deepspeed": {"zero_stage": 2}, "fsdp": {}}, "sides": {}}
  assert "the fsdp side runs the run's own fsdp plan" in dict(plan_rows(RunRecord.of(d)))["plan pair"]


def _why(run: Path, side: str, checks) -> str:
  """What a failed run says of itself: the side's status and error, and each rank's exit code and stderr tail."""
  summary = json.loads((run / side / "summary.json").read_text()) if (run / side / "summary.json").exists() else {}
  ranks = [(r.get("rank"), r.get("status"), r.get("exit_code")) for r in summary.get("ranks", [])]
  tails = {p.name: p.read_text(errors="replace")[-1500:] for p in sorted((run / side).glob("*stderr*"))}
  return f"{side}: {summary.get('status')} {summary.get('error')}; ranks {ranks}; checks {checks}; stderr {tails}"


@pytest.mark.process
@pytest.mark.slow
@requires_all
@pytest.mark.parametrize("plan", ["zero3", "scan-offload", "zero3-act-offload"])
def test_the_pair_passes_on_one_rank_and_on_two_ranks(tmp_path, plan):
  """Each FSDP2 plan pair (docs/plans.md): jax, deepspeed and fsdp PASS on one rank and on two, and every side on two
  ranks agrees with every side on one at the fp32 tolerances (the ranks change the summation order only)."""
  import parity
  from parity import weights
  from parity.pipeline.resolve import resolve_run
  from parity.verdict.sides import compare_sides
  kw = dict(steps=STEPS, plan=plan, overrides=SMALL, determinism_steps=0, noise_envelope=False)
  one = parity.compare("gpt2-tiny", sides=list(SIDES), out=tmp_path / "n1", **kw)
  assert one.passed, [c for c in one.checks if not c.passed]
  rep = json.loads((tmp_path / "n1" / "report.json").read_text())
  assert rep["plan"]["name"] == plan and rep["run"]["fsdp"]["offload"] == (plan == "scan-offload")
  summary = {s: json.loads((tmp_path / "n1" / s / "summary.json").read_text()) for s in SIDES}
  kinds = summary["fsdp"]["state_bytes_by_memory_kind"]
  assert (kinds["host"] > 0 and kinds["device"] == 0) if plan == "scan-offload" else kinds["host"] == 0
  act = plan == "zero3-act-offload"  # activations in host memory, each side by its own mechanism
  assert rep["run"]["fsdp"]["activation_offload"] == act and (rep["run"]["jax"]["remat"] == "offload_names") == act
  assert summary["deepspeed"]["optimizer"]["cpu_checkpointing"] == act  # read back from deepspeed.checkpointing
  assert "FSDP2 plan" in (tmp_path / "n1" / "report.md").read_text()
  two = parity.compare("gpt2-tiny", sides=list(SIDES), out=tmp_path / "n2", nproc=2, **kw)
  assert two.passed, [_why(tmp_path / "n2", s, two.checks) for s in SIDES]
  spec = resolve_run("gpt2-tiny", plan=plan, steps=STEPS, sides=list(SIDES), overrides=SMALL).spec
  init = weights.load(tmp_path / "n1" / "init.safetensors")
  for a in SIDES:
    for b in SIDES:
      pair = {f"{a}@1": _side(tmp_path / "n1", a), f"{b}@2": _side(tmp_path / "n2", b)}
      checks, _ = compare_sides(pair, spec=spec, init=init)  # the project's fp32 tolerances
      bad = [c for c in checks if not c.passed]
      assert not bad and len(pair[f"{b}@2"]["steps"]) == STEPS, (a, b, bad)


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.requires_torch
@pytest.mark.parametrize("key,built", [("activation_offload", "save_on_cpu"),
                                       ("activation_checkpointing",
                                        "torch.utils.checkpoint (non-reentrant), every block")])
def test_activation_offload_and_checkpointing_change_no_number(tmp_path, key, built):
  """fsdp.activation_offload (torch.autograd.graph.save_on_cpu around each forward) keeps what the backward needs in
  host memory and recomputes nothing; fsdp.activation_checkpointing keeps each block's input and recomputes the block
  (with CPUOffloadPolicy here, so FSDP2 all-gathers the host shards again for the recompute). Either way every step
  record's loss and grad norm and every final param equal the run without it, bit for bit (on the CPU the saved
  tensors are already host memory: the hooks run, nothing moves)."""
  import numpy as np
  import parity
  from parity import weights
  kw = dict(steps=2, sides=["fsdp"], determinism_steps=0, noise_envelope=False)
  runs = {}
  for on in (False, True):
    out = tmp_path / f"{key}_{on}"
    report = parity.compare("gpt2-tiny", out=out, overrides={**SMALL, "train.grad_accum_steps": 2, f"fsdp.{key}": on,
                                                              "fsdp.offload": key == "activation_checkpointing"}, **kw)
    assert report.passed, report.checks
    summary = json.loads((out / "fsdp" / "summary.json").read_text())
    assert summary["fsdp"][key] == (built if on else None)
    runs[on] = (_side(out, "fsdp"), weights.load(out / "fsdp" / "final.safetensors"))
  (a, fa), (b, fb) = runs[False], runs[True]
  assert [(r["loss"], r["grad_norm"]) for r in a["steps"]] == [(r["loss"], r["grad_norm"]) for r in b["steps"]]
  assert all(np.array_equal(fa[k], fb[k]) for k in fa)


@pytest.mark.parametrize("devices", [1, 8])
def test_parity_plan_costs_the_fsdp_pairs_of_llama_7b_on_h100(devices, tmp_path, capsys):
  """`parity plan --model llama-7b --sides deepspeed,jax,fsdp` (1 and 8 x H100): every ZeRO-3 pair is costed with
  the FSDP2 model (parity.sizing.fsdp_memory), every other pair is ranked last naming why, and the JSON says so."""
  from parity.cli import main
  from parity.sizing import memory
  from parity.hf import MODEL_PRESETS
  out = tmp_path / "plan.json"
  rc = main(["plan", "--model", "llama-7b", "--hardware", "H100", "--devices", str(devices),
             "--sides", "deepspeed,jax,fsdp", "--json", str(out)])
  text = capsys.readouterr().out
  assert rc == 0 and "fsdp GiB" in text
  ranked = {r["name"]: r for r in json.loads(out.read_text())["ranked"]}
  costed = {n for n, r in ranked.items() if r["step_s"] is not None and r["step_s"] != float("inf")}
  assert costed == {"zero3", "zero3-offload-all", "scan-offload", "zero3-act-offload", "zero3-offload-all-remat",
                    "scan-offload-remat"}
  for name in set(ranked) - costed:
    assert any("no FSDP2 counterpart" in p for p in ranked[name]["problems"]), ranked[name]
  best, cands = plans.choose_plan(MODEL_PRESETS["llama-7b"], memory.model_preset_train(MODEL_PRESETS["llama-7b"]),
                                  plans.HARDWARE["H100"], devices=devices, sides=("deepspeed", "jax", "fsdp"))
  c = {x.name: x for x in cands}
  train = dataclasses.replace(memory.model_preset_train(MODEL_PRESETS["llama-7b"]),
                              micro_batch_size=memory.model_preset_train(MODEL_PRESETS["llama-7b"]).micro_batch_size
                              * devices)
  for name in costed:  # the planner's fsdp figures are the memory model's
    peak = memory.fsdp_peak_bytes(MODEL_PRESETS["llama-7b"], train, plans.PLANS[name].fsdp, devices)
    assert (c[name].peak_device_bytes["fsdp"], c[name].host_bytes["fsdp"]) == (peak["device"], peak["host"])
  assert c["scan-offload"].host_bytes["fsdp"] > 0 and c["zero3"].host_bytes["fsdp"] == 0
  assert best.name == ("scan-offload-remat" if devices == 1 else "zero3")  # 1: at jax.offload_opt_ratio 0.25


def test_fsdp_offload_transfers_per_step():
  """CPUOffloadPolicy moves each rank's fp32 shards to the device for every micro batch's forward and backward and
  its fp32 gradient shards back once: 4·N/W·(2·GAS + 1) bytes; reshard_after_forward=False fetches once per micro
  batch; no offload moves nothing."""
  from parity.sizing import memory
  from parity.presets import PRESETS
  base = PRESETS["gpt2-tiny"]
  n, ga = memory.param_count(base.model), 3
  run = dataclasses.replace(base, train=dataclasses.replace(base.train, grad_accum_steps=ga), sides=("fsdp",))
  part = -(-n // 2)
  assert cost.transfer_bytes(dataclasses.replace(run, fsdp=FsdpPlan(offload=True)), "fsdp", [], 2) == \
      4 * part * (2 * ga + 1)
  assert cost.transfer_bytes(dataclasses.replace(run, fsdp=FsdpPlan(offload=True, reshard_after_forward=False)),
                               "fsdp", [], 2) == 4 * part * (ga + 1)
  assert cost.transfer_bytes(run, "fsdp", [], 2) == 0


def test_the_engine_line_names_each_engines_fastest_fitting_pair_and_what_it_leaves_out():
  from parity.hf import MODEL_PRESETS
  from parity.sizing import memory
  m = MODEL_PRESETS["llama-7b"]
  t = memory.model_preset_train(m)
  sides = ("deepspeed", "jax", "fsdp")
  _, one = plans.choose_plan(m, t, plans.HARDWARE["H100"], devices=1, sides=sides)
  line = plans.engine_choice(one, "1 x H100")
  assert line.startswith("engine, each by its own side's estimated step time (a row's step is its slowest side's): "
                         "stay on PyTorch (FSDP2 scan-offload-remat, ")  # FSDP2's fastest; zero3-offload-all* as fast
  assert "JAX's fastest that fits is scan-offload" in line and "leaves out its optimizer step on the CPU" in line
  _, eight = plans.choose_plan(m, t, plans.HARDWARE["H100"], devices=8, sides=sides)
  assert plans.engine_choice(eight, "8 x H100").startswith(
      "engine, each by its own side's estimated step time (a row's step is its slowest side's): either (JAX zero3, ")
  _, tiny = plans.choose_plan(m, t, plans.custom_hardware(plans.HARDWARE["H100"], device_gib=4), sides=sides)
  assert plans.engine_choice(tiny, "1 x 4 GiB") == "engine: neither JAX nor FSDP2 fits 1 x 4 GiB with any pair"
  _, no_fsdp = plans.choose_plan(m, t, plans.HARDWARE["H100"], sides=("deepspeed", "jax"))
  assert plans.engine_choice(no_fsdp, "1 x H100") is None  # one engine costed: nothing to choose between


@pytest.mark.requires_torch
def test_recompute_block_runs_the_block_again_in_the_backward():
  """torch_impl.fsdp.recompute_block (GPT.checkpoint under fsdp.activation_checkpointing) really recomputes: the
  block's forward runs twice per forward + backward, and the gradients equal the plain call's."""
  import torch
  from torch_impl.fsdp import recompute_block
  calls = []

  class Block(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.w = torch.nn.Parameter(torch.linspace(-1, 1, 12).reshape(3, 4))

    def forward(self, x, rope, mask=None):
      calls.append(1)
      return torch.tanh(x @ self.w.T) * rope

  block, x, rope = Block(), torch.randn(2, 4, requires_grad=True), torch.randn(2, 3)
  recompute_block(block, x, rope).sum().backward()
  assert len(calls) == 2
  g_ckpt, gx_ckpt = block.w.grad.clone(), x.grad.clone()
  block.w.grad, x.grad = None, None
  block(x, rope).sum().backward()
  assert torch.equal(g_ckpt, block.w.grad) and torch.equal(gx_ckpt, x.grad)


@pytest.mark.process
@pytest.mark.slow
@requires_all
def test_a_remat_pair_passes_with_its_fsdp2_plan(tmp_path):
  """scan-offload-remat's FSDP2 plan (CPUOffloadPolicy + activation checkpointing): jax~deepspeed~fsdp PASS, and the
  report's FSDP2 row says every block is recomputed."""
  import parity
  run = parity.compare("gpt2-tiny", sides=list(SIDES), out=tmp_path / "r", steps=STEPS, plan="scan-offload-remat",
                       overrides=SMALL, determinism_steps=0, noise_envelope=False)
  assert run.passed, [_why(tmp_path / "r", s, run.checks) for s in SIDES]
  rep = json.loads((tmp_path / "r" / "report.json").read_text())
  assert rep["plan"]["name"] == "scan-offload-remat" and rep["run"]["fsdp"]["activation_checkpointing"] is True
  report_md = (tmp_path / "r" / "report.md").read_text()
  assert "every block recomputed in the backward (activation checkpointing)" in report_md
