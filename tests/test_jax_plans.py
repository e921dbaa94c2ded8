"""JaxPlan techniques on one device: scan over layers, remat/activation-offload policies, gradient
accumulation, host offload evidence per option, and the exact state-bytes prediction."""
import dataclasses
import functools
import json

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from parity.sizing import memory  # noqa: E402
from parity.sizing.memory_jax import jax_state_bytes  # noqa: E402
from parity.spec import REMAT_POLICIES, JaxPlan, ModelSpec, RunSpec, TrainSpec  # noqa: E402
from parity.weights import init_params  # noqa: E402

from jax_impl import model as M  # noqa: E402
from jax_impl import layout  # noqa: E402
from jax_impl import offload, remat, stream, worker  # noqa: E402
from jax_impl.step import Trainer  # noqa: E402

GPT2 = ModelSpec(vocab_size=64, d_model=32, n_layers=3, n_heads=2, max_seq_len=16)
LLAMA = ModelSpec(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, norm="rmsnorm",
                  mlp="swiglu", position="rope", bias=False, tie_embeddings=False, d_ff=48)
TRAIN = TrainSpec(steps=3, micro_batch_size=2, grad_accum_steps=2, seq_len=8, warmup_steps=1, lr=1e-2, eval_every=0)


def tokens(shape, seed=0):
  return np.random.default_rng(seed).integers(0, GPT2.vocab_size, shape).astype(np.uint16)


def value_and_grad(spec, params, tok, **kw):
  return jax.jit(jax.value_and_grad(lambda p: M.loss_fn(p, tok, spec, **kw)))(params)


def assert_trees_close(got, want, atol, what):
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=0, atol=atol, err_msg=f"{what}: {k}")


def trainer(plan: JaxPlan, train: TrainSpec = TRAIN, model: ModelSpec = GPT2) -> Trainer:
  t = Trainer.build(RunSpec(model=model, train=train, jax=plan), init_params(model, 0))
  t.compile((train.grad_accum_steps, train.micro_batch_size, train.seq_len + 1), None)
  return t


# ----------------------------------------------------------------------------- scan over layers


@pytest.mark.parametrize("spec", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_scan_layout_maps_both_ways_and_equals_the_unrolled_model(spec):
  canonical = init_params(spec, 0)
  stacked = layout.to_flax(canonical, spec, scan_layers=True)
  assert set(stacked) >= {layout.LAYERS} and not any(k.startswith("h_") for k in stacked)
  assert stacked[layout.LAYERS]["attn"]["qkv"]["kernel"].shape[0] == spec.n_layers  # layer axis 0
  back = layout.from_flax(stacked, spec, scan_layers=True)
  assert all(np.array_equal(back[k], canonical[k]) for k in canonical)
  tok = tokens((2, 9))
  l0, g0 = value_and_grad(spec, layout.to_flax(canonical, spec), tok)
  l1, g1 = value_and_grad(spec, stacked, tok, scan_layers=True, layer_to_device=True)
  np.testing.assert_allclose(float(l1), float(l0), rtol=0, atol=1e-6)
  assert_trees_close(layout.from_flax(g1, spec, scan_layers=True), layout.from_flax(g0, spec), 1e-6, "grad")


def test_scan_layout_rejects_mismatched_trees():
  with pytest.raises(ValueError, match="differ across layers"):
    layout.tree_from_canonical({"h.0.ln_1.weight": True, "h.1.ln_1.weight": False}, n_layers=2)


# ----------------------------------------------------------------------------- remat / activation offload


@functools.cache
def _without_remat():
  """GPT2's loss and gradients without remat on tokens((2, 9)): the reference of every policy, compiled once
  (each parametrization compiled it again: 5 of 15 compiles of the test were this one)."""
  return value_and_grad(GPT2, layout.to_flax(init_params(GPT2, 0), GPT2), tokens((2, 9)))


@pytest.mark.parametrize("policy", REMAT_POLICIES[1:])
def test_remat_policies_give_the_same_loss_and_gradients(policy):
  canonical, tok = init_params(GPT2, 0), tokens((2, 9))
  l0, g0 = _without_remat()
  l1, g1 = value_and_grad(GPT2, layout.to_flax(canonical, GPT2), tok, remat=policy)
  l2, g2 = value_and_grad(GPT2, layout.to_flax(canonical, GPT2, scan_layers=True), tok, remat=policy, scan_layers=True)
  assert float(l1) == pytest.approx(float(l0), abs=1e-6) and float(l2) == pytest.approx(float(l0), abs=1e-6)
  assert_trees_close(layout.from_flax(g1, GPT2), layout.from_flax(g0, GPT2), 1e-6, policy)
  assert_trees_close(layout.from_flax(g2, GPT2, scan_layers=True), layout.from_flax(g0, GPT2), 1e-6, f"{policy}+scan")


@pytest.mark.parametrize("policy,to_host", [
    ("none", 0), ("full", 0), ("save_dots", 0), ("save_dots_no_batch", 0),
    ("offload_names", len(remat.RESIDUAL_NAMES) * GPT2.n_layers), ("offload_dots_no_batch", None)])
def test_activation_offload_is_planned_in_the_jaxpr(policy, to_host):
  """On CPU, activation offload exists only in the jaxpr of the differentiated step.

  jax 0.10.2 lowers the policy's in-jit `device_put` to host memory to nothing on the CPU backend
  (docs/numerics.md): neither the lowered StableHLO nor the compiled HLO carries a host annotation, so
  the test reads the jaxpr, where `offload_names` moves each named residual of each block to host
  memory (and back in the backward pass). That the names sit on real residuals is what makes the
  count exact: a name on a value the backward does not read would not be offloaded.
  """
  params, tok = layout.to_flax(init_params(GPT2, 0), GPT2), tokens((2, 9))
  traced = jax.jit(jax.grad(lambda p: M.loss_fn(p, tok, GPT2, remat=policy))).trace(params)
  moves = remat.device_puts_in_jaxpr(str(traced.jaxpr))
  if to_host is None:
    assert moves["to_host"] > 0 and moves["to_device"] == moves["to_host"], moves
  else:
    assert moves == {"to_host": to_host, "to_device": to_host}, moves
  lowered = traced.lower().as_text()
  assert "pinned_host" not in lowered and "annotate_device_placement" not in lowered  # CPU drops it


def test_offload_policy_uses_the_plan_host_kind():
  pol = remat.policy("offload_names", "unpinned_host")
  assert callable(pol)
  with pytest.raises(ValueError, match="jax.remat must be one of"):
    remat.policy("offload_everything")


# ----------------------------------------------------------------------------- gradient accumulation


def test_grad_accumulation_equals_one_micro_batch_of_the_same_total():
  accum = trainer(JaxPlan(offload_opt_state=False))
  whole = trainer(JaxPlan(offload_opt_state=False), dataclasses.replace(TRAIN, grad_accum_steps=1, micro_batch_size=4))
  b = tokens((TRAIN.steps, 2, 2, 9))
  for step in range(TRAIN.steps):
    m_acc, m_one = accum.step(b[step]), whole.step(b[step].reshape(1, 4, 9))
    assert m_acc["loss"] == pytest.approx(m_one["loss"], abs=2e-6)
    assert m_acc["grad_norm"] == pytest.approx(m_one["grad_norm"], rel=2e-5)
    assert m_acc["lr"] == m_one["lr"]
  assert_trees_close(accum.canonical_params(), whole.canonical_params(), 2e-6, "params")


# ----------------------------------------------------------------------------- host offload evidence

OFFLOAD_PLANS = {
    "opt_state": JaxPlan(offload_opt_state=True),
    "params": JaxPlan(offload_opt_state=False, offload_params=True),
    "both": JaxPlan(offload_opt_state=True, offload_params=True),
    "scan_params": JaxPlan(offload_opt_state=False, offload_params=True, scan_layers=True),
    "scan_opt_state": JaxPlan(offload_opt_state=True, scan_layers=True),
    "scan_all_names": JaxPlan(offload_opt_state=True, offload_params=True, scan_layers=True, remat="offload_names"),
}


@pytest.fixture(scope="module")
def offloaded():
  """Each offload plan trained for TRAIN.steps steps: name -> (trainer, losses)."""
  b = tokens((TRAIN.steps, 2, 2, 9))
  out = {"default": None}
  for name, plan in {"default": JaxPlan(), **OFFLOAD_PLANS}.items():
    t = trainer(plan)
    out[name] = (t, [t.step(x)["loss"] for x in b])
  return out


@pytest.mark.parametrize("name", list(OFFLOAD_PLANS))
def test_compiled_entry_buffers_in_host_space_are_exactly_the_offloaded_state(offloaded, name):
  """The compiled step's entry parameters/results in memory space S(5) are exactly the leaves of
  the offloaded groups (params first, then opt_state, then the batch / metrics: never)."""
  t, _ = offloaded[name]
  plan = t.run.jax
  n_p, n_o = len(jax.tree.leaves(t.state.params)), len(jax.tree.leaves(t.state.opt_state))
  args, results = offload.entry_buffers(t.compiled_text)
  want = [plan.offload_params] * n_p + [plan.offload_opt_state] * n_o
  kept = t.kept_args()  # jit prunes unused inputs (the clip state's previous norm when on device)
  assert [host for _, host in args] == [(want + [False])[i] for i in kept]
  assert [host for _, host in results] == want + [False] * 3  # loss, grad_norm, lr
  ev = t.offload_evidence()
  state_bytes = offload.bytes_by_memory_kind(t.state)
  host = ev["offload_params"]["host_to_device_bytes"] + ev["offload_opt_state"]["host_to_device_bytes"]
  leaves = jax.tree.leaves(t.state)
  pruned_host = sum(x.nbytes for i, (x, h) in enumerate(zip(leaves, want)) if h and i not in kept)
  assert pruned_host <= 4  # at most the clip state's previous norm, which the step never reads
  assert host == state_bytes.get("pinned_host", 0) - pruned_host
  group_host = {"offload_params": sum(x.nbytes for x in jax.tree.leaves(t.state.params)) * plan.offload_params,
                "offload_opt_state": sum(x.nbytes for x in jax.tree.leaves(t.state.opt_state)) * plan.offload_opt_state}
  for option in ("offload_params", "offload_opt_state"):
    assert ev[option]["device_to_host_bytes"] == group_host[option]  # every offloaded leaf is written back
    assert ev[option]["moved_bytes_per_step"] == ev[option]["host_to_device_bytes"] + group_host[option]


def test_scan_param_offload_moves_each_layer_in_the_scan_body(offloaded):
  """The per-layer host->device move is an in-jit device_put: dropped by the CPU lowering, so it is
  asserted from the jaxpr. Forward/backward: one move per stacked leaf in the scan body, and no move of a
  gradient: the gradient is taken with respect to a device anchor (jax_impl.offload.anchored_loss), so it
  is born on the device (through the move itself, its transpose would send each layer's gradient slice to
  host memory and the step would move it back). The layer-streamed update (jax_impl.stream): the non-layer
  params to device once, then per layer one move in and one move back per stacked leaf."""
  t, _ = offloaded["scan_params"]
  n_stacked = len(jax.tree.leaves(t.state.params[layout.LAYERS]))
  n_all = len(jax.tree.leaves(t.state.params))
  fwd_bwd = {"to_host": 0, "to_device": n_stacked}
  update = {"to_host": n_stacked, "to_device": (n_all - n_stacked) + n_stacked}
  assert t.offload_evidence()["jaxpr_device_puts"] == {k: fwd_bwd[k] + update[k] for k in fwd_bwd}
  assert offloaded["scan_all_names"][0].offload_evidence()["jaxpr_device_puts"]["to_host"] > 0
  assert offloaded["params"][0].offload_evidence()["jaxpr_device_puts"] == {"to_host": 0, "to_device": 0}


def streamed_update_scan(t: Trainer):
  """The layer scan equation of trainer `t`'s streamed update, traced on a zero gradient."""
  def update(grads, opt_state, params):
    opt_state = stream.scalars_to_device(t.placement, opt_state, params)
    return stream.streamed_update(t.run, t.placement, grads, opt_state, params)

  grads = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), t.state.params)
  jaxpr = jax.make_jaxpr(update)(grads, t.state.opt_state, t.state.params).jaxpr
  (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
  return scan


def test_scan_opt_state_offload_streams_the_moments_one_layer_at_a_time(offloaded):
  """Moments in host memory with scan_layers: the update brings the optimizer's scalars and the
  non-layer moments to the device once, and each layer's mu and nu slices in and out of the scan body;
  the whole-state move of the unstreamed update (every moment leaf at once) is gone."""
  t, _ = offloaded["scan_opt_state"]
  n_stacked = len(jax.tree.leaves(t.state.params[layout.LAYERS]))
  n_all = len(jax.tree.leaves(t.state.params))
  n_scalars = len(jax.tree.leaves(t.state.opt_state)) - 2 * n_all
  assert n_scalars == 3  # the clip's norm, Adam's count, the schedule's count
  moves = t.offload_evidence()["jaxpr_device_puts"]
  assert moves == {"to_host": 2 * n_stacked, "to_device": n_scalars + 2 * (n_all - n_stacked) + 2 * n_stacked}
  scan = streamed_update_scan(t)
  assert scan.params["length"] == t.run.model.n_layers
  body = scan.params["jaxpr"].jaxpr
  assert remat.device_puts_in_jaxpr(str(body)) == {"to_host": 2 * n_stacked, "to_device": 2 * n_stacked}
  # What one iteration brings to the device is one layer's mu and nu; the memory model's in-step row
  # is the non-layer moments plus two such slices (the one in use and the one XLA prefetches).
  puts = [e for e in body.eqns if e.primitive.name == "device_put" and "Device" in str(e.params["devices"])]
  per_layer = sum(v.aval.size * v.aval.dtype.itemsize for e in puts for v in e.invars)
  n_block = memory.block_params(t.run.model)
  assert per_layer == 2 * 4 * n_block
  (row,) = [r for r in memory.estimate(t.run, sides=("jax",)) if r.category == "optimizer_moments"
            and r.note.startswith("in-step (update: fetched")]
  outside = memory.param_count(t.run.model) - t.run.model.n_layers * n_block
  assert row.bytes == 2 * 4 * outside + 2 * per_layer
  unstreamed = offloaded["opt_state"][0].offload_evidence()["jaxpr_device_puts"]
  assert unstreamed == {"to_host": 0, "to_device": 0}  # the plain update: moved at the jit boundary


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_streamed_update_equals_the_whole_tree_update_in_mixed_precision(precision):
  """bf16 and fp16 (a forced overflow at step 1, a natural one possible at 2**20) under the layer-streamed
  update give the unstreamed plan's losses, norms, loss scales, skips and final params: the global norm
  and the overflow are taken over the whole gradient before the per-layer updates."""
  train = dataclasses.replace(TRAIN, steps=4, precision=precision, initial_scale_power=20, hysteresis=1,
                              loss_scale_window=2)
  b = tokens((train.steps, 2, 2, 9), seed=3)
  out = {}
  for name, plan in {"plain": JaxPlan(offload_opt_state=False, scan_layers=True),
                     "streamed": JaxPlan(offload_opt_state=True, offload_params=True, scan_layers=True)}.items():
    t = trainer(plan, train)
    if plan.offload_params:  # the compute-dtype cast runs per layer on the device, never on the host stack
      half = {"bf16": "bf16", "fp16": "f16"}[precision]
      assert f"{half}<host>" not in t.jaxpr_text and "f32<host>" in t.jaxpr_text
    kw = lambda i: {"force_overflow": i == 1} if precision == "fp16" else {}
    out[name] = ([t.step(x, **kw(i)) for i, x in enumerate(b)], t.canonical_params())
  (plain, p_plain), (streamed, p_streamed) = out["plain"], out["streamed"]
  if precision == "fp16":
    assert [m["skipped"] for m in streamed] == [m["skipped"] for m in plain] and streamed[1]["skipped"]
    assert [m["loss_scale"] for m in streamed] == [m["loss_scale"] for m in plain]
  for key in ("loss", "grad_norm", "lr"):
    np.testing.assert_allclose([m[key] for m in streamed], [m[key] for m in plain], rtol=1e-6, err_msg=key)
  assert_trees_close(p_streamed, p_plain, 1e-6, "params")


@pytest.mark.parametrize("name", list(OFFLOAD_PLANS))
def test_every_plan_trains_like_the_default(offloaded, name):
  _, want = offloaded["default"]
  t, got = offloaded[name]
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-6, err_msg=name)
  assert offload.state_memory_kinds(t.state) == {g: t.placement.kind(g) for g in ("params", "opt_state")}


@pytest.mark.parametrize("name", ["default", *OFFLOAD_PLANS])
def test_predicted_state_bytes_equal_the_live_arrays(offloaded, name):
  t, _ = offloaded[name]
  dev = t.placement.mesh.devices.flat[0]
  assert jax_state_bytes(t.run) == offload.bytes_by_memory_kind(t.state, dev)


# ----------------------------------------------------------------------------- offload changes no value


def test_each_offload_plan_has_a_device_twin_differing_only_in_memory():
  from jax_impl.offload_equality import offload_plans, reference_plan
  from parity.sizing.plans import PLANS
  plans = offload_plans({n: p.jax for n, p in PLANS.items()})
  assert {p.scan_layers for p in plans.values()} == {False, True}
  for option in ("offload_opt_state", "offload_params"):
    assert {p.scan_layers for p in plans.values() if getattr(p, option)} == {False, True}, option
  assert {(p.remat, p.scan_layers) for p in plans.values() if p.remat in remat.OFFLOAD_POLICIES} == {
      (r, s) for r in remat.OFFLOAD_POLICIES for s in (False, True)}
  assert "zero0" not in plans and "zero3-fsdp4" not in plans  # nothing offloaded; four devices
  twin = reference_plan(PLANS["zero3-act-offload"].jax)
  assert (twin.remat, twin.offload_opt_state, twin.offload_params, twin.zero_stage) == ("save_names", False, False, 3)
  assert reference_plan(PLANS["act-offload"].jax).remat == "save_dots_no_batch"


@pytest.mark.slow
def test_every_offload_plan_trains_bitwise_like_its_device_twin():
  """Every offload plan of PLANS, with and without scan_layers (jax_impl.offload_equality.offload_plans: 12 on one
  device), against the same plan with everything in device memory and the offload remat policy's device twin: after
  3 fp32 steps the params and Adam's mu and nu are bitwise equal (on CPU the moves lower to nothing, so this holds
  the offload's program structure, the streamed update and the per-layer moves, to the same arithmetic; an
  accelerator runs the same call with real moves). The positive control: the planted stale residual on the two
  offload remat policies comes back far from bitwise, so the comparison can fail."""
  from jax_impl.offload_equality import offload_equality, offload_plans
  from parity.sizing.plans import PLANS
  plans = offload_plans({n: p.jax for n, p in PLANS.items()})
  rows = offload_equality(plans, 3)
  assert [r["plan"] for r in rows] == list(plans)
  assert all(r["bitwise"] for r in rows), [r for r in rows if not r["bitwise"]]
  act = {n: p for n, p in plans.items() if p.remat in remat.OFFLOAD_POLICIES and p.scan_layers}
  for r in offload_equality(act, 3, plants=frozenset({"offload_residual_stale"})):
    assert not r["bitwise"] and r["max_abs_param_diff"] > 1e-4 and "mlp.proj.weight" in r["worst_param"], r


# ----------------------------------------------------------------------------- worker device count


def test_worker_forces_the_host_device_count_from_the_request(tmp_path):
  req = tmp_path / "request.json"
  req.write_text(json.dumps({"run": {"jax": {"data_parallel": 4}}}))
  env = {}
  assert worker.force_host_devices([str(req), "--side", "jax"], env) == 4
  assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  assert worker.force_host_devices([str(req)], env) is None and env["XLA_FLAGS"].endswith("=8")
  req.write_text(json.dumps({"run": {"jax": {"data_parallel": 1}}}))
  assert worker.force_host_devices([str(req)], {}) is None


# ----------------------------------------------------------------------------- the GPU memory script, on CPU


@pytest.mark.process
def test_gpu_memory_script_runs_its_cpu_check(tmp_path):
  """benchmarks/gpu_memory.py (what a machine with a GPU runs) works end to end on CPU in --tiny mode."""
  import subprocess
  import sys
  from pathlib import Path
  script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_memory.py"
  proc = subprocess.run([sys.executable, str(script), "--tiny", "--plans", "scan-offload", "--steps", "1",
                         "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  (r,) = json.loads((tmp_path / "gpu-memory.json").read_text())["results"]
  assert r["state_memory_kinds"] == {"params": "pinned_host", "opt_state": "pinned_host"}
  assert r["predicted_peak_device_bytes"] > 0 and r["memory_analysis"] and len(r["step_s"]) == 1
  assert r["jaxpr_device_puts"]["to_device"] > 0  # the per-layer moves of the forward pass and the update
  assert "`scan-offload`" in (tmp_path / "gpu-memory.md").read_text()
  bad = subprocess.run([sys.executable, str(script), "--plans", "zero9", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
  assert bad.returncode == 2 and "zero9" in bad.stderr
