"""The batch in the memory model, the resource check and the planner: token ids in their stored
dtype (uint16 / uint32 by vocabulary), the mask arrays of padded/packed runs with each side's dtypes, the attention
mask, the run folder's example arrays, and the padding fraction. In-process, closed-form figures."""
from __future__ import annotations

import dataclasses

import pytest

from parity.inputs import InputError
from parity.presets import preset
from parity.sizing import batches, memory, plans, resources
from parity.spec import SpecError


def _padded():
  return preset("sft-tiny")  # padded, A=2, M=4, T=128, vocab 258


def _stream(run):
  return dataclasses.replace(run, train=dataclasses.replace(run.train, layout="stream"), data="stdlib")


def _rows(run, side):
  return [r for r in memory.estimate(run, sides=(side,)) if batches.is_batch_row(r.note)]


@pytest.mark.parametrize("vocab, itemsize, name", [(50257, 2, "uint16"), (65536, 2, "uint16"),
                                                    (151936, 4, "uint32")])
def test_jax_token_rows_use_the_stored_dtype_of_the_vocabulary(vocab, itemsize, name):
  run = preset("gpt2-tiny")
  run = dataclasses.replace(run, model=dataclasses.replace(run.model, vocab_size=vocab))
  t = run.train
  (row,) = _rows(run, "jax")  # a stream run: the ids alone, no mask
  assert row.bytes == t.grad_accum_steps * t.micro_batch_size * (t.seq_len + 1) * itemsize and name in row.note
  (torch_row,) = _rows(run, "torch")  # torch embeds int64 ids of one micro batch, whatever the stored dtype
  assert torch_row.bytes == t.micro_batch_size * (t.seq_len + 1) * 8


def test_padded_rows_count_each_sides_mask_dtypes_and_the_attention_mask():
  run = _padded()
  a, m, t = run.train.grad_accum_steps, run.train.micro_batch_size, run.train.seq_len
  jax = {r.note: r for r in _rows(run, "jax")}
  masks = next(r for n, r in jax.items() if "segment ids int32" in n)
  assert masks.bytes == a * m * t * (4 + 4 + 4) and masks.category == "buffers"
  attn = next(r for n, r in jax.items() if "attention mask" in n)
  assert attn.bytes == m * t * t and attn.category == "activations"
  torch_masks = next(r for r in _rows(run, "torch") if "segment ids int64" in r.note)
  assert torch_masks.bytes == m * t * (8 + 8 + 4)
  # torch holds everything of the batch in the forward/backward phase: the peak grows by exactly the mask bytes
  grow = memory.peak_device_bytes(memory.estimate(run, sides=("torch",)), "torch") - memory.peak_device_bytes(
      memory.estimate(_stream(run), sides=("torch",)), "torch")
  assert grow == torch_masks.bytes + m * t * t
  # the batch is no model state: the comparison with DeepSpeed's estimator keeps its scope
  rel = lambda r: memory.estimate_json(r)["deepspeed_estimator"]["relation"]
  assert rel(run) == rel(_stream(run))
  assert memory.totals(memory.estimate(run), "jax") == memory.totals(memory.estimate(_stream(run)), "jax")


def test_the_resource_check_counts_the_example_arrays_and_names_the_token_dtype():
  run = _padded()
  pad, stream = resources.estimate_resources(run), resources.estimate_resources(_stream(run))
  t = run.train
  targets = t.steps * t.grad_accum_steps * t.micro_batch_size * t.seq_len
  assert stream.examples_bytes == 0 and pad.examples_bytes == batches.example_host_bytes(run) > targets * 20
  assert pad.memory_bytes - stream.memory_bytes >= pad.examples_bytes
  assert pad.disk_bytes - stream.disk_bytes == 2 * batches.example_file_bytes(run)
  big = dataclasses.replace(run, model=dataclasses.replace(run.model, vocab_size=151936),
                            train=dataclasses.replace(run.train, steps=2 * 10**9))
  with pytest.raises(InputError, match=r"x 4 bytes, uint32 ids of model.vocab_size=151936.*mask arrays"):
    resources.check_resources(big, "/tmp")


def test_the_planner_gives_tokens_per_s_of_the_real_positions():
  model, train = preset("gpt2-tiny").model, preset("gpt2-tiny").train
  hw = plans.HARDWARE["H100"]
  best, ranked = plans.choose_plan(model, train, hw)
  inputs = plans.plan_inputs(hw, train, padding_fraction=0.25)
  row = next(r for r in plans.ranking_json(best, ranked, inputs)["ranked"] if r["name"] == best.name)
  assert row["tokens_per_s"] == pytest.approx(train.tokens_per_step / best.step_s)
  assert row["non_padding_tokens_per_s"] == pytest.approx(0.75 * row["tokens_per_s"])
  assert "tokens_per_s" not in plans.ranking_json(best, ranked)["ranked"][0]  # no inputs: no throughput
  with pytest.raises(SpecError, match="--padding-fraction"):
    plans.plan_inputs(hw, train, padding_fraction=1.0)
  with pytest.raises(ValueError, match="padding fraction"):
    batches.counted_tokens_per_s(1.0, -0.1)
