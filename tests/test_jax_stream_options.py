"""The layer-streamed update's layouts (jax_impl.stream.StreamOptions) change where XLA puts the copies, never the
numbers: each gives the default layout's params and Adam moments bitwise after a few fp32 steps."""
import dataclasses

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from parity.spec import JaxPlan, ModelSpec, RunSpec, TrainSpec  # noqa: E402
from parity.weights import init_params  # noqa: E402

from jax_impl import stream  # noqa: E402
from jax_impl.step import Trainer  # noqa: E402

LLAMA = ModelSpec(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=16, norm="rmsnorm",
                  mlp="swiglu", position="rope", bias=False, tie_embeddings=False, d_ff=48)
TRAIN = TrainSpec(steps=3, micro_batch_size=2, grad_accum_steps=2, seq_len=8, warmup_steps=1, lr=1e-2, eval_every=0,
                  grad_clip=1.0)


_REFERENCE: dict = {}
"""The default layout's final state per plan, computed once for the module (each case compares one layout to it)."""


def _reference(plan: JaxPlan, monkeypatch) -> tuple[dict, dict]:
  if plan not in _REFERENCE:
    _REFERENCE[plan] = _final_state(plan, stream.StreamOptions(), monkeypatch)
  return _REFERENCE[plan]


def _final_state(plan: JaxPlan, options: stream.StreamOptions, monkeypatch) -> tuple[dict, dict]:
  monkeypatch.setattr(stream, "OPTIONS", options)
  t = Trainer.build(RunSpec(model=LLAMA, train=TRAIN, jax=plan), init_params(LLAMA, 0))
  shape = (TRAIN.grad_accum_steps, TRAIN.micro_batch_size, TRAIN.seq_len + 1)
  t.compile(shape, None)
  rng = np.random.default_rng(1)
  for _ in range(3):
    t.step(rng.integers(0, LLAMA.vocab_size, shape).astype(np.uint16))
  return t.canonical_params(), t.canonical_moments()


@pytest.mark.parametrize("plan", [JaxPlan(scan_layers=True), JaxPlan(scan_layers=True, offload_params=True)],
                         ids=["opt-offload", "params-and-opt-offload"])
@pytest.mark.parametrize("options", [stream.StreamOptions(unroll=2), stream.StreamOptions(unroll=0),
                                     stream.StreamOptions(in_place=True), stream.StreamOptions(enabled=False),
                                     stream.StreamOptions(home_after_loop=True), stream.StreamOptions(in_place=False)],
                         ids=["unroll2", "unroll-all", "in-place", "whole-tree", "home-after-loop", "beside"])
def test_every_layout_gives_the_default_numbers_bitwise(plan, options, monkeypatch):
  want_p, want_m = _reference(plan, monkeypatch)
  got_p, got_m = _final_state(plan, options, monkeypatch)
  assert set(got_p) == set(want_p)
  for k in want_p:
    assert np.array_equal(got_p[k], want_p[k]), k
    assert np.array_equal(got_m[k], want_m[k]), k
  assert not all(np.array_equal(want_p[k], v) for k, v in init_params(LLAMA, 0).items())  # the steps did update


def test_the_update_is_in_place_by_default_only_when_the_params_are_offloaded(monkeypatch):
  base = RunSpec(model=LLAMA, train=TRAIN)
  assert stream.updates_in_place(dataclasses.replace(base, jax=JaxPlan(scan_layers=True, offload_params=True)))
  assert not stream.updates_in_place(dataclasses.replace(base, jax=JaxPlan(scan_layers=True)))
  monkeypatch.setattr(stream, "OPTIONS", stream.StreamOptions(in_place=False))
  assert not stream.updates_in_place(dataclasses.replace(base, jax=JaxPlan(scan_layers=True, offload_params=True)))
  monkeypatch.setattr(stream, "OPTIONS", stream.StreamOptions(in_place=True))
  assert stream.updates_in_place(dataclasses.replace(base, jax=JaxPlan(scan_layers=True)))


def test_streamed_update_is_on_only_with_scan_and_offload(monkeypatch):
  base = RunSpec(model=LLAMA, train=TRAIN)
  assert stream.streams_update(dataclasses.replace(base, jax=JaxPlan(scan_layers=True)))
  assert not stream.streams_update(dataclasses.replace(base, jax=JaxPlan(scan_layers=False)))
  assert not stream.streams_update(dataclasses.replace(base, jax=JaxPlan(scan_layers=True, offload_opt_state=False)))
  monkeypatch.setattr(stream, "OPTIONS", stream.StreamOptions(enabled=False))
  assert not stream.streams_update(dataclasses.replace(base, jax=JaxPlan(scan_layers=True)))


@pytest.mark.parametrize("train", [TRAIN, dataclasses.replace(TRAIN, precision="bf16"),
                                   dataclasses.replace(TRAIN, grad_clip=0.0)], ids=["fp32-clip", "bf16", "no-clip"])
def test_a_deferred_update_gives_the_same_steps_and_state(train, monkeypatch):
  """StreamOptions.deferred applies each step's update at the start of the next: the losses and learning rates of
  every step are the in-step layout's bitwise, and the norms and the settled state after the last are within 2 ulps
  (steps taken with nothing reading the state in between, so the steps themselves apply the pending updates)."""
  plan = JaxPlan(scan_layers=True)

  def run(options):
    monkeypatch.setattr(stream, "OPTIONS", options)
    t = Trainer.build(RunSpec(model=LLAMA, train=train, jax=plan), init_params(LLAMA, 0))
    shape = (train.grad_accum_steps, train.micro_batch_size, train.seq_len + 1)
    t.compile(shape, None)
    rng = np.random.default_rng(1)
    metrics = [t.step(rng.integers(0, LLAMA.vocab_size, shape).astype(np.uint16)) for _ in range(4)]
    return t, metrics, t.canonical_params(), t.canonical_moments()

  t0, m0, p0, v0 = run(stream.StreamOptions())
  t1, m1, p1, v1 = run(stream.StreamOptions(deferred=True))
  assert t0.state.pending is None and t1.state.pending is not None and t1.jit_settle is not None
  assert [(m["loss"], m["lr"]) for m in m1] == [(m["loss"], m["lr"]) for m in m0]
  # the norm is reduced in another place of another program: XLA may sum it in another order (seen: 1 ulp without
  # the clip, where the norm is only reported), so it is held to 2 ulps of float32; with the clip on it is bitwise
  np.testing.assert_allclose([m["grad_norm"] for m in m1], [m["grad_norm"] for m in m0], rtol=2 * 2**-23, atol=0)
  # XLA may contract the same update's ops differently at the start of a step than at its end (seen on CPU without
  # the clip: 3 of 2,048 elements of one tensor 5.8e-11 apart). Adam moves an element by at most ~lr a step, so each
  # step's rounding of that move is within 2 ulps of lr: over 4 steps, 8 * 2^-23 * lr, plus 2 ulps of the value.
  update_ulps = 4 * 2 * 2**-23 * train.lr
  for k in p0:
    np.testing.assert_allclose(p1[k], p0[k], rtol=2 * 2**-23, atol=update_ulps, err_msg=k)
    # the moments come from gradients of those params: ulp-level apart at the tensor's scale (measured: 2.3e-7 of
    # the tensor's largest element without the clip); 4 ulps of that largest element
    np.testing.assert_allclose(v1[k], v0[k], rtol=0, atol=4 * 2**-23 * float(np.max(np.abs(v0[k]))), err_msg=k)
  assert not bool(t1.state.pending.valid)  # the reads settled it
  # a step after the settle goes on from the settled state as the in-step layout does
  rng = np.random.default_rng(9)
  batch = rng.integers(0, LLAMA.vocab_size, (train.grad_accum_steps, train.micro_batch_size, train.seq_len + 1))
  a, b = t1.step(batch.astype(np.uint16)), t0.step(batch.astype(np.uint16))
  assert a["lr"] == b["lr"]
  np.testing.assert_allclose(a["loss"], b["loss"], rtol=4 * 2**-23)  # from params within ulps of each other
  for k, v in t0.canonical_params().items():
    np.testing.assert_allclose(t1.canonical_params()[k], v, rtol=2 * 2**-23, atol=5 / 4 * update_ulps, err_msg=k)


def test_a_deferred_update_is_only_taken_where_it_applies(monkeypatch):
  monkeypatch.setattr(stream, "OPTIONS", stream.StreamOptions(deferred=True))
  base = RunSpec(model=LLAMA, train=TRAIN)
  assert stream.defers_update(dataclasses.replace(base, jax=JaxPlan(scan_layers=True)))
  assert not stream.defers_update(dataclasses.replace(base, jax=JaxPlan(scan_layers=True, offload_params=True)))
  assert not stream.defers_update(dataclasses.replace(base, jax=JaxPlan(scan_layers=False)))
  fp16 = dataclasses.replace(base, train=dataclasses.replace(TRAIN, precision="fp16"), jax=JaxPlan(scan_layers=True))
  assert not stream.defers_update(fp16)
