"""jax_impl.offload: memory kinds of the live state, compiler evidence, bit-identical results."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")

from parity.spec import JaxPlan, ModelSpec, RunSpec, TrainSpec  # noqa: E402
from parity.weights import init_params  # noqa: E402

from jax_impl import offload  # noqa: E402
from jax_impl.step import Trainer  # noqa: E402

MODEL = ModelSpec(vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_seq_len=16)
TRAIN = TrainSpec(steps=3, micro_batch_size=2, grad_accum_steps=2, seq_len=8, warmup_steps=1, lr=1e-2, eval_every=0)
PLANS = {
    "none": JaxPlan(offload_opt_state=False),
    "opt": JaxPlan(offload_opt_state=True),
    "all": JaxPlan(offload_opt_state=True, offload_params=True),
}


def batches(n=TRAIN.steps, seed=0):
  shape = (n, TRAIN.grad_accum_steps, TRAIN.micro_batch_size, TRAIN.seq_len + 1)
  return np.random.default_rng(seed).integers(0, MODEL.vocab_size, shape).astype(np.uint16)


def trainer(plan: JaxPlan, compile_=True) -> Trainer:
  t = Trainer.build(RunSpec(model=MODEL, train=TRAIN, jax=plan), init_params(MODEL, 0))
  if compile_:
    t.compile(batches().shape[1:], None)
  return t


@pytest.fixture(scope="module")
def trained():
  """Each plan trained for TRAIN.steps steps: name -> (trainer, [metrics per step])."""
  out = {}
  for name, plan in PLANS.items():
    t = trainer(plan)
    out[name] = (t, [t.step(b) for b in batches()])
  return out


@pytest.mark.parametrize("name,want", [
    ("none", {"params": "device", "opt_state": "device"}),
    ("opt", {"params": "device", "opt_state": "pinned_host"}),
    ("all", {"params": "pinned_host", "opt_state": "pinned_host"}),
])
def test_state_memory_kinds_before_and_after_steps(trained, name, want):
  t, _ = trained[name]
  assert offload.state_memory_kinds(t.state) == want  # after the steps: the out shardings keep the plan
  fresh = trainer(PLANS[name], compile_=False)
  assert offload.state_memory_kinds(fresh.state) == want
  for leaf in jax.tree.leaves(t.state.opt_state):
    assert leaf.sharding.memory_kind == want["opt_state"]


def test_bytes_by_memory_kind_adds_up(trained):
  t, _ = trained["opt"]
  nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
  got = offload.bytes_by_memory_kind(t.state)
  assert got == {"device": nbytes(t.state.params), "pinned_host": nbytes(t.state.opt_state)}
  assert offload.bytes_by_memory_kind(trained["none"][0].state) == {"device": nbytes(t.state)}


def test_lowered_and_compiled_text_show_the_host_placement(trained):
  n_opt = len(jax.tree.leaves(trained["opt"][0].state.opt_state))
  n_all = n_opt + len(jax.tree.leaves(trained["all"][0].state.params))
  for name, n_host in (("none", 0), ("opt", n_opt), ("all", n_all)):
    t, _ = trained[name]
    ev = offload.offload_evidence(t.lowered_text, t.compiled_text)
    # each offloaded leaf is an entry argument and an entry result in host memory
    assert ev["lowered_host_args_results"] == 2 * n_host, (name, ev)
    assert ev["compiled_host_entry_buffers"] == 2 * n_host, (name, ev)
    assert ev["lowered_host_placements"] == n_host, (name, ev)  # the out-sharding annotations


def test_offload_is_bit_identical_to_no_offload(trained):
  ref_t, ref_metrics = trained["none"]
  ref_params = ref_t.canonical_params()
  for name in ("opt", "all"):
    t, metrics = trained[name]
    assert metrics == ref_metrics, name
    for k, v in t.canonical_params().items():
      np.testing.assert_array_equal(v, ref_params[k], err_msg=f"{name}: {k}")
  assert all(np.isfinite(m["loss"]) for m in ref_metrics)
  assert ref_metrics[0]["lr"] == 0.0 and ref_metrics[2]["lr"] > 0


def test_no_recompilation_on_the_second_step():
  t = trainer(PLANS["opt"], compile_=False)
  batch_shd = t.placement.batch_sharding()
  state = t.state
  for b in batches():
    state, _ = t.jit_step(state, jax.device_put(b, batch_shd))
  assert t.jit_step._cache_size() == 1
  assert offload.state_memory_kinds(state)["opt_state"] == "pinned_host"


def test_missing_host_memory_kind_is_rejected():
  class FakeDevice:
    def addressable_memories(self):
      return []

  class FakeMesh:
    devices = np.array([FakeDevice()], dtype=object)

  with pytest.raises(ValueError, match="pinned_host"):
    offload.make_placement(JaxPlan(offload_opt_state=True), FakeMesh())


def test_offload_evidence_parses_an_entry_layout():
  compiled = ("HloModule m, entry_computation_layout={(f32[4]{0}, f32[4]{0:S(5)})->(f32[4]{0}, f32[4]{0:S(5)})}, "
              "allow_spmd_sharding_propagation_to_parameters={false}\n ENTRY ... f32[4]{0:S(5)} copy")
  ev = offload.offload_evidence('x {mhlo.memory_kind = "pinned_host"}', compiled)
  assert ev == {"lowered_host_args_results": 1, "lowered_host_placements": 0,
                "compiled_host_entry_buffers": 2, "compiled_host_buffers": 3}
