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
                                     stream.StreamOptions(in_place=True), stream.StreamOptions(enabled=False)],
                         ids=["unroll2", "unroll-all", "in-place", "whole-tree"])
def test_every_layout_gives_the_default_numbers_bitwise(plan, options, monkeypatch):
  want_p, want_m = _final_state(plan, stream.StreamOptions(), monkeypatch)
  got_p, got_m = _final_state(plan, options, monkeypatch)
  assert set(got_p) == set(want_p)
  for k in want_p:
    assert np.array_equal(got_p[k], want_p[k]), k
    assert np.array_equal(got_m[k], want_m[k]), k
  assert not all(np.array_equal(want_p[k], v) for k, v in init_params(LLAMA, 0).items())  # the steps did update


def test_streamed_update_is_on_only_with_scan_and_offload(monkeypatch):
  base = RunSpec(model=LLAMA, train=TRAIN)
  assert stream.streams_update(dataclasses.replace(base, jax=JaxPlan(scan_layers=True)))
  assert not stream.streams_update(dataclasses.replace(base, jax=JaxPlan(scan_layers=False)))
  assert not stream.streams_update(dataclasses.replace(base, jax=JaxPlan(scan_layers=True, offload_opt_state=False)))
  monkeypatch.setattr(stream, "OPTIONS", stream.StreamOptions(enabled=False))
  assert not stream.streams_update(dataclasses.replace(base, jax=JaxPlan(scan_layers=True)))
