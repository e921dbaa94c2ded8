"""jax.offload_opt_ratio, the JAX port of DeepSpeed's offload_optimizer.ratio (ZeRO-Offload++): part of the optimizer
state in host memory, the rest on the device. Which moments go (DeepSpeed's rule per param leaf), the bytes each
memory holds (live, predicted, in the compiled step), the numbers (never changed), the spec's errors and the planner's
choice of a ratio."""
import dataclasses
import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from parity.hf import MODEL_PRESETS  # noqa: E402
from parity.sizing import measured, memory, plans  # noqa: E402
from parity.sizing.memory_jax import jax_state_bytes, opt_split, param_leaves  # noqa: E402
from parity.spec import JaxPlan, RunSpec, SpecError  # noqa: E402
from parity.weights import init_params  # noqa: E402

from jax_impl import offload, offload_equality, stream  # noqa: E402
from jax_impl.placement import placement_record  # noqa: E402
from jax_impl.step import Trainer  # noqa: E402
from tests.test_jax_stream_options import LLAMA, TRAIN  # noqa: E402

GiB = 2**30
SHAPE = (TRAIN.grad_accum_steps, TRAIN.micro_batch_size, TRAIN.seq_len + 1)

# LLAMA's param elements, canonical order: wte 64·32 = 2048; per block ln_1 32, qkv (4 + 2·2)·8·32 = 2048, proj
# 32·32 = 1024, ln_2 32, gate / up / proj 48·32 = 1536 each (7744 a block, 23232 for 3); ln_f 32; lm_head 2048.
TOTAL = 2048 + 3 * 7744 + 32 + 2048  # 27360
CASES = {
    # scan layout, r = 0.5 (>= 13680): from the end lm_head 2048, ln_f 32, then the stacked mlp proj, up, gate
    # (3·1536 each): 15904 after the gate, the first sum to reach it
    "scan-0.5": (JaxPlan(scan_layers=True, offload_opt_ratio=0.5), 15904,
                 {"lm_head/kernel", "ln_f/scale", "h/mlp/proj/kernel", "h/mlp/up/kernel", "h/mlp/gate/kernel"}),
    # unrolled, r = 0.3 (>= 8208): lm_head, ln_f, then block 2 from its end: mlp proj, up, gate, ln_2, attn proj
    # (7744) and qkv (9792)
    "unrolled-0.3": (JaxPlan(offload_opt_ratio=0.3), 9792,
                     {"lm_head/kernel", "ln_f/scale", "h_2/mlp/proj/kernel", "h_2/mlp/up/kernel",
                      "h_2/mlp/gate/kernel", "h_2/ln_2/scale", "h_2/attn/proj/kernel", "h_2/attn/qkv/kernel"}),
}


def _moment_kinds(state) -> dict[str, dict[str, str]]:
  """{'mu': {param path: memory kind}, 'nu': ..., 'scalars': {state path: kind}} of a live optimizer state."""
  out: dict[str, dict[str, str]] = {"mu": {}, "nu": {}, "scalars": {}}
  for path, x in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]:
    keys = [str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path]
    group = next((k for k in keys if k in ("mu", "nu")), "scalars")
    name = "/".join(keys[keys.index(group) + 1:]) if group != "scalars" else "/".join(keys)
    out[group][name] = x.sharding.memory_kind
  return out


@pytest.mark.parametrize("layout", ["streamed", "whole-tree", "deferred"])
def test_every_ratio_gives_the_no_offload_numbers_bitwise(layout, monkeypatch):
  """r in {0.3, 0.5, 1}: params, mu and nu after 3 fp32 steps equal the run that offloads nothing, bit for bit
  (jax_impl.offload_equality: the reference is the same plan in device memory), through the layer-streamed update
  (also with the params offloaded), the whole-tree update (unrolled) and the deferred update; on CPU the moves lower
  to nothing, so this checks that the split placement and the per-leaf moves leave every value alone. The deferred
  update against the in-step reference is bitwise here (clip on; test_jax_stream_options holds it to ulps where XLA
  fuses the two differently)."""
  monkeypatch.setattr(stream, "OPTIONS", stream.StreamOptions(deferred=layout == "deferred"))
  scan = layout != "whole-tree"
  named = {f"r={r}": JaxPlan(scan_layers=scan, offload_opt_ratio=r) for r in (0.3, 0.5, 1.0)}
  if layout == "streamed":
    named["r=0.5+params"] = JaxPlan(scan_layers=True, offload_params=True, zero_stage=3, offload_opt_ratio=0.5)
  for name, plan in named.items():  # the path under test is the one these runs take, and r < 1 splits the state
    run = RunSpec(model=LLAMA, train=TRAIN, jax=plan)
    assert stream.streams_update(run) == scan and stream.defers_update(run) == (layout == "deferred"), name
    assert opt_split(run).partial == (plan.offload_opt_ratio < 1), name
  rows = offload_equality.offload_equality(named, 3, model=LLAMA, train=TRAIN)
  assert [(r["plan"], r["bitwise"]) for r in rows] == [(n, True) for n in named], rows
  assert all("offload_opt_state=False" in r["reference"] for r in rows)


@pytest.mark.parametrize("case", list(CASES))
def test_the_last_leaves_in_parameter_order_go_to_the_host_until_they_hold_the_ratio(case):
  """DeepSpeed's rule (stage3.py: the last `ratio` share of the sub-groups on the CPU), per param leaf: the moments
  of exactly the leaves the worked sums above name live in pinned_host, every other moment in device memory, the
  scalars on the host as at r = 1; the realised share reaches the ratio by less than the last leaf added."""
  plan, host_elements, host = CASES[case]
  run = RunSpec(model=LLAMA, train=TRAIN, jax=plan)
  split = opt_split(run)
  assert sum(math.prod(s) for _, s, _ in param_leaves(run)) == TOTAL
  assert (split.host_elements, split.total_elements) == (host_elements, TOTAL)
  assert split.share >= plan.offload_opt_ratio and split.share == host_elements / TOTAL
  last = min(math.prod(s) for n, s, _ in param_leaves(run) if n == split.host[0])
  assert (host_elements - last) / TOTAL < plan.offload_opt_ratio  # one leaf fewer would not reach it
  t = Trainer.build(run, init_params(LLAMA, 0))
  kinds = _moment_kinds(t.state)
  for moment in ("mu", "nu"):
    assert {n for n, k in kinds[moment].items() if k == "pinned_host"} == host, moment
    assert {n for n, k in kinds[moment].items() if k != "pinned_host"} == set(kinds[moment]) - host
    assert {k for n, k in kinds[moment].items() if n not in host} == {"device"}
  assert set(kinds["scalars"].values()) == {"pinned_host"}
  assert offload.state_memory_kinds(t.state) == {"params": "device", "opt_state": "mixed(device,pinned_host)"}
  full = Trainer.build(dataclasses.replace(run, jax=dataclasses.replace(plan, offload_opt_ratio=1.0)),
                       init_params(LLAMA, 0))
  assert set(_moment_kinds(full.state)["mu"].values()) == {"pinned_host"} and full.placement.opt_host is None


@pytest.mark.parametrize("case", list(CASES))
def test_the_bytes_in_host_memory_are_the_offloaded_moments(case):
  """Live (bytes_by_memory_kind), predicted (jax_state_bytes, the memory model's rows, predicted-vs-measured) and
  compiled (placement.json's opt_state rows) agree: the host holds 2 moments x 4 bytes x the offloaded elements plus
  the 12 bytes of scalars, the device the rest."""
  plan, host_elements, _ = CASES[case]
  run = RunSpec(model=LLAMA, train=TRAIN, jax=plan)
  t = Trainer.build(run, init_params(LLAMA, 0))
  live = offload.bytes_by_memory_kind(t.state, jax.devices()[0])
  params = 4 * TOTAL
  assert live == jax_state_bytes(run) == {"pinned_host": 8 * host_elements + 12,
                                          "device": params + 8 * (TOTAL - host_elements)}
  rows = memory.estimate(run, sides=("jax",))
  resident = {r.kind: r.bytes for r in rows if r.category == "optimizer_moments" and not r.note.startswith("in-step")}
  assert resident == {"host": 8 * host_elements, "device": 8 * (TOTAL - host_elements)}
  report = {"run": dataclasses.asdict(run), "sides": {"jax": {"summary": {
      "state_memory_kinds": offload.state_memory_kinds(t.state), "state_bytes_by_memory_kind": live}}}}
  got = {(r["category"], r["memory_kind"]): r for r in measured.predicted_vs_measured(report) if r["side"] == "jax"}
  assert got[("optimizer_moments", "host")]["measured"] == 8 * host_elements + 12
  assert got[("optimizer_moments", "host")]["predicted"] == 8 * host_elements + 12
  assert got[("state", "device")]["ratio"] == 1.0  # params and the device moments share the device
  assert got[("optimizer_moments", "device")]["measured"] is None
  from parity.report.cells import fmt_bytes
  from parity.report.side_table import state_by_kind  # the report's 'jax placed' row names opt_state under both
  assert state_by_kind(report["sides"]["jax"]["summary"]) == (
      f"device: {fmt_bytes(live['device'])} (params, opt_state), pinned_host: {fmt_bytes(live['pinned_host'])} "
      "(opt_state)")
  t.compile(SHAPE, None)
  rec = placement_record(t)
  opt = {r["role"]: r for r in rec["classes"] if r["class"] == "opt_state"}
  assert {r["expected"] for r in opt.values()} == {r["memory_space"] for r in opt.values()} == {"mixed"}
  # jit prunes unused arguments from the entry: the clip state's recorded norm, a 4-byte host scalar
  assert opt["argument"]["host_bytes"] + 4 * opt["argument"]["pruned"] == live["pinned_host"]
  assert opt["result"]["host_bytes"] == live["pinned_host"] and rec["mismatches"] == []
  ev = t.offload_evidence()["offload_opt_state"]
  assert ev["device_to_host_bytes"] == live["pinned_host"]  # only the host part goes back each step
  from parity.report.placement_view import class_rows  # the report says the realised share beside "as planned"
  share = opt["result"]["host_bytes"] / opt["result"]["bytes"]
  verdicts = [r[-1] for r in class_rows(rec)[0] if r[0] == "opt_state"]
  assert f"as planned ({share:.0%} of its bytes in host memory)" in verdicts and 0 < share < 1


def test_the_ratio_is_checked_with_the_key_value_and_fix():
  assert JaxPlan(offload_opt_ratio=0.25).validate().offload_opt_ratio == 0.25
  for bad in (0, 0.0, -0.5, 1.5, True, "half"):
    with pytest.raises(SpecError, match=r"jax\.offload_opt_ratio must be a number in \(0, 1\]"):
      JaxPlan(offload_opt_ratio=bad).validate()
  with pytest.raises(SpecError, match="jax.offload_opt_ratio 0.5 offloads part of the optimizer state, but "
                                      "jax.offload_opt_state is false .* set jax.offload_opt_state=true"):
    JaxPlan(offload_opt_state=False, offload_opt_ratio=0.5).validate()
  assert JaxPlan(offload_opt_ratio=0.5, scan_layers=True).describe() == "offload_opt_state, offload_opt_ratio 0.5, " \
                                                                          "scan_layers"
  with pytest.raises(ValueError, match="pass make_placement"):  # which moments go to the host depends on the model
    offload.make_placement(JaxPlan(offload_opt_ratio=0.5))


def test_the_planner_offloads_the_smallest_share_that_fits():
  """llama-1b, bf16, 1 x 2048, one TPU v5e (14.4 GiB usable): scan-offload-remat does not fit with the optimizer state
  on the device, fits with all of it on the host; of OPT_RATIOS, 0.25 does not fit and 0.5 does: the planner runs it
  at 0.5 (the memory model's peaks, checked here, are what decide), moving less each step, and says why."""
  model = MODEL_PRESETS["llama-1b"]
  train = memory.model_preset_train(model)
  hw = plans.HARDWARE["TPU-v5e"]
  usable = int(hw.device_bytes * 0.9)
  best, ranked = plans.choose_plan(model, train, hw, sides=("jax",))
  assert best is not None and best.name == "scan-offload-remat" and best.jax_opt_ratio == 0.5
  run = plans.with_plan(RunSpec(model=model, train=train), plans.PLANS["scan-offload-remat"])
  at = lambda **kw: dataclasses.replace(run, jax=dataclasses.replace(run.jax, **kw))
  peak = lambda r: memory.peak_device_bytes(memory.estimate(r, sides=("jax",)), "jax")
  assert peak(at(offload_opt_state=False)) > usable >= peak(run)  # the rule applies
  assert peak(at(offload_opt_ratio=0.25)) > usable >= peak(at(offload_opt_ratio=0.5)) == best.peak_device_bytes["jax"]
  full = plans.step_time(run, "jax", hw, memory.estimate(run, sides=("jax",)))
  assert best.transfer_s < full[2]  # only the host share moves
  note = best.notes[0]
  assert note.startswith("jax offload_opt_ratio 0.5: the smallest of 0.25, 0.5, 0.75, 1 whose device bytes fit")
  assert "0.25 needs" in note and "--set jax.offload_opt_ratio=0.5" in note
  share = opt_split(at(offload_opt_ratio=0.5)).share
  assert f"{share:.0%} of the moment bytes on the host" in note
  small = plans.choose_plan(MODEL_PRESETS["gpt2-124m"], train, hw, sides=("jax",))[1]  # fits without offload:
  assert all(c.jax_opt_ratio is None and not c.notes for c in small)  # every pair keeps its own plan
  ranked_json = plans.ranking_json(best, ranked)["ranked"]
  assert next(c for c in ranked_json if c["name"] == best.name)["jax_opt_ratio"] == 0.5


def test_parity_plan_prints_the_ratio_and_why(capsys):
  from parity.cli import main
  assert main(["plan", "--model", "llama-1b", "--hardware", "TPU-v5e", "--sides", "jax"]) == 0
  out = " ".join(capsys.readouterr().out.split())
  assert "scan-offload-remat (jax ratio 0.5)" in out and "choice: scan-offload-remat" in out
  assert "jax offload_opt_ratio 0.5: the smallest of 0.25, 0.5, 0.75, 1 whose device bytes fit" in out
  assert np.isfinite(float(out.split("estimated throughput of scan-offload-remat: ")[1].split()[0].replace(",", "")))


def test_the_streamed_update_moves_only_the_offloaded_moments():
  """Scan layout, r = 0.5 (CASES: the stacked mlp gate/up/proj and the non-layer ln_f and lm_head offloaded): the
  step's jaxpr brings the 3 scalars and the 2 non-layer host moments (mu and nu each) to the device once, and each
  layer's slices of the 3 host stacks in and out of the scan body; the device-resident moments are never moved. What
  one iteration brings in is the memory model's in-step row: the host non-layer moments plus two such slices."""
  from jax_impl import remat
  plan, _, _ = CASES["scan-0.5"]
  t = Trainer.build(RunSpec(model=LLAMA, train=TRAIN, jax=plan), init_params(LLAMA, 0))
  t.compile(SHAPE, None)
  assert t.offload_evidence()["jaxpr_device_puts"] == {"to_host": 2 * 3, "to_device": 3 + 2 * 2 + 2 * 3}

  from tests.test_jax_plans import streamed_update_scan
  body = streamed_update_scan(t).params["jaxpr"].jaxpr
  assert remat.device_puts_in_jaxpr(str(body)) == {"to_host": 2 * 3, "to_device": 2 * 3}
  puts = [e for e in body.eqns if e.primitive.name == "device_put" and "Device" in str(e.params["devices"])]
  per_layer = sum(v.aval.size * v.aval.dtype.itemsize for e in puts for v in e.invars)
  assert per_layer == 2 * 4 * 3 * 1536  # mu and nu of one layer's gate, up and proj
  (row,) = [r for r in memory.estimate(t.run, sides=("jax",)) if r.category == "optimizer_moments"
            and r.note.startswith("in-step (update: fetched")]
  assert row.bytes == 2 * 4 * (2048 + 32) + 2 * per_layer and "the offloaded part" in row.note


def test_plan_auto_runs_the_planners_ratio():
  """--plan auto runs the chosen pair with the share of the optimizer state the planner chose, and records why."""
  from parity.pipeline.resolve import resolve_run
  r = resolve_run(model="llama-1b", plan="auto", hardware="TPU-v5e", sides=["jax"])
  assert r.plan["name"] == "scan-offload-remat" and r.spec.jax.offload_opt_ratio == 0.5
  assert r.spec.jax == dataclasses.replace(plans.PLANS["scan-offload-remat"].jax, offload_opt_ratio=0.5)
  assert r.plan["why"][0].startswith("jax offload_opt_ratio 0.5: the smallest of 0.25, 0.5, 0.75, 1")


def test_the_ratio_grid_is_checked_and_1_costs_the_pairs_as_named(capsys):
  from parity.cli import main
  model, hw = MODEL_PRESETS["llama-1b"], plans.HARDWARE["TPU-v5e"]
  train = memory.model_preset_train(model)
  for bad in ((), (0.5,), (0.5, 0.25, 1.0), (0.0, 1.0), (0.5, 1.5)):
    with pytest.raises(SpecError, match=r"--opt-ratios.*increasing shares in \(0, 1\], the last 1"):
      plans.choose_plan(model, train, hw, sides=("jax",), opt_ratios=bad)
  full, ranked = plans.choose_plan(model, train, hw, sides=("jax",), opt_ratios=(1.0,))
  assert all(c.jax_opt_ratio is None and not c.notes for c in ranked)  # every pair as named
  best, _ = plans.choose_plan(model, train, hw, sides=("jax",), opt_ratios=(0.5, 1.0))
  assert (best.name, best.jax_opt_ratio) == ("scan-offload-remat", 0.5) and "of 0.5, 1 whose" in best.notes[0]
  assert (full.name, full.jax_opt_ratio) == ("scan-offload-remat", None) and full.transfer_s > best.transfer_s
  assert main(["plan", "--model", "llama-1b", "--hardware", "TPU-v5e", "--opt-ratios", "half,1"]) == 2
  assert "--opt-ratios 'half,1': comma-separated shares in (0, 1]" in capsys.readouterr().err
