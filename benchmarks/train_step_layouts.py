"""Benchmark: the full training step (loss + backward + optimizer update) of the sides' own trainers on `packed`
batches against `stream` at the same shapes (target: >= 0.95x the tokens/s of stream), JAX and
torch, each measured in one process with interleaved rounds.

benchmarks/masked_step.py measured the model's forward + backward alone; this one runs what a side runs per optimizer
step, through the same objects and calls as the workers:
  jax    jax_impl.step.Trainer.build(run, init) + compile(batch shape, examples=...) + Trainer.step(batch): the
         jitted step with the state donated, optimizer state in pinned_host memory (the JaxPlan defaults), AdamW,
         clipping, the LR schedule; packed: the `example_batch` dict (tokens, segment ids, positions, weights A*w).
  torch  torch_impl.baseline.TorchTrainer(run, init).step(micro batches, arrays=...): torch.optim.AdamW, DeepSpeed's
         clipping and schedule, deterministic kernels as torch_impl.worker sets them; packed: ExampleArrays
         (weights A*W*w), so the boolean SDPA attn_mask is built from the segment ids in every forward.
Both steps of a pair take the same token ids (steps, A, M, T + 1) of parity.dataset.layouts.build_batches (packed
layout, examples of random lengths in [T/8, T/2+1]) and cycle through `--data-steps` different optimizer steps; the
stream step reads them as windows (no mask, positions 0..T-1, mean loss), so both process A*M*T tokens per step and
the ratio is the cost of the masks alone. ratio = tokens/s packed / tokens/s stream = t_stream / t_packed per round.
The timing and interleaving are benchmarks/masked_step.py's (`interleave`); the two trainers are built and warmed up
before the first timed round, so compilation is not counted.

Writes benchmarks/results/train_step_layouts.json and .md (date, machine, load, versions, command, per-round ratios).

Usage: python benchmarks/train_step_layouts.py [--frameworks jax,torch] [--shapes gpt2-tiny,gpt2-d256-t256,
       llama-d256-t256] [--rounds 12] [--grad-accum 1] [--threads 2]
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks.masked_step import (SHAPES, header_lines, interleave, interleaved_parser, pinned_record,  # noqa: E402
                                    run_shapes)
from parity.dataset.examples import Example  # noqa: E402
from parity.dataset.layouts import build_batches  # noqa: E402
from parity.dataset.reference import token_weights  # noqa: E402
from parity.environment import load_1min  # noqa: E402
from parity.protocol.side import ExampleArrays  # noqa: E402
from parity.spec import ModelSpec, RunSpec, TrainSpec  # noqa: E402
from parity.weights import init_params  # noqa: E402


def run_spec(model: ModelSpec, m: int, t: int, a: int) -> RunSpec:
  """The run both trainers build: fp32, AdamW, the default schedule over many steps (the LR never reaches 0)."""
  return RunSpec(model=model, train=TrainSpec(steps=10_000, micro_batch_size=m, grad_accum_steps=a, seq_len=t,
                                              warmup_steps=10, eval_every=0, layout="packed"))


def packed_data(run: RunSpec, steps: int, seed: int = 0) -> dict[str, Any]:
  """`steps` packed optimizer steps: tokens (steps, A, M, T + 1) in batch_dtype, the arrays, padding, loss tokens."""
  tr, vocab = run.train, run.model.vocab_size
  rng = np.random.default_rng(seed)
  lengths = rng.integers(max(2, tr.seq_len // 8), tr.seq_len // 2 + 2, size=8 * steps * tr.grad_accum_steps
                         * tr.micro_batch_size)
  examples = [Example(ids=rng.integers(0, vocab, n).astype(np.uint32), loss=np.arange(n) >= n // 3, record=i + 1)
              for i, n in enumerate(lengths)]
  bb = build_batches(examples, steps=steps, grad_accum_steps=tr.grad_accum_steps, micro_batch_size=tr.micro_batch_size,
                     seq_len=tr.seq_len, seed=seed, vocab_size=vocab, layout="packed")
  return {"tokens": bb.tokens, "segment_ids": bb.segment_ids, "positions": bb.positions,
          "w": token_weights(bb.loss_mask, "tokens"), "padding_fraction": float((bb.segment_ids == 0).mean()),
          "loss_token_fraction": float(bb.loss_mask.mean()), "examples_per_step": int(bb.examples_per_step)}


def _arrays(data: dict, factor: float) -> ExampleArrays:
  """The whole run's ExampleArrays with the side's weight factor (parity.protocol.side.SideIO.example_arrays)."""
  return ExampleArrays(data["segment_ids"], data["positions"], (factor * data["w"]).astype(np.float32))


def _cycle(step: Callable[[int], Any], n: int) -> Callable[[], None]:
  """A no-argument call running step(0), step(1), ..., step(n - 1), step(0), ... (one optimizer step a call)."""
  state = {"i": 0}

  def call() -> None:
    step(state["i"] % n)
    state["i"] += 1
  return call


def jax_steps(run: RunSpec, data: dict) -> dict[str, Any]:
  """Two `jax_impl.step.Trainer` objects (stream, packed) on the same weights, compiled for the data's shapes."""
  import jax  # the framework under test, in this process only when asked for
  from jax_impl.step import Trainer, example_batch
  init = init_params(run.model, seed=0)
  tokens = data["tokens"]
  stream_run = dataclasses.replace(run, train=dataclasses.replace(run.train, layout="stream"))
  stream, packed = Trainer.build(stream_run, init), Trainer.build(run, init)
  stream.compile(tokens.shape[1:], None, tokens.dtype)
  packed.compile(tokens.shape[1:], None, tokens.dtype, examples=True)
  arrays = _arrays(data, float(run.train.grad_accum_steps))  # JaxSide.loss_weight_factor: A
  n = len(tokens)
  del jax
  return {"stream": _cycle(lambda s: stream.step(tokens[s]), n),
          "packed": _cycle(lambda s: packed.step(example_batch(tokens[s], arrays.at(s))), n),
          "compile_s": {"stream": stream.compile_s, "packed": packed.compile_s}}


def torch_steps(run: RunSpec, data: dict) -> dict[str, Any]:
  """Two `torch_impl.baseline.TorchTrainer` objects (stream, packed), deterministic as the torch side runs."""
  from torch_impl.baseline import TorchTrainer  # the framework under test
  from torch_impl.side import _determinism
  _determinism(run.train.seed)
  init = init_params(run.model, seed=0)
  tokens = data["tokens"]
  stream_run = dataclasses.replace(run, train=dataclasses.replace(run.train, layout="stream"))
  stream, packed = TorchTrainer(stream_run, init), TorchTrainer(run, init)
  arrays = _arrays(data, float(run.train.grad_accum_steps))  # TorchSide factor A*W, W = 1
  n = len(tokens)
  return {"stream": _cycle(lambda s: stream.step(tokens[s]), n),
          "packed": _cycle(lambda s: packed.step(tokens[s], arrays=arrays.at(s)), n)}


def _markdown(out: dict) -> str:
  lines = [*header_lines(out, "Full training step, packed vs stream"),
           "Step = the side's trainer step (loss + backward + clipping + optimizer update + schedule), jax_impl.step."
           "Trainer / torch_impl.baseline.TorchTrainer. ratio = tokens/s packed / tokens/s stream (= t_stream / "
           "t_packed per round; target >= 0.95); fastest = the ratio of the two fastest rounds; cpu = the median "
           "over rounds of the ratio of this process's CPU time (less sensitive to other processes' load).", "",
           "| framework | shape | A x M x T | padding | loss-token share | stream ms (median) | packed ms (median) "
           "| ratio min | median | max | fastest | cpu |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in out["results"]:
    lines.append(f"| {r['framework']} | {r['shape']} | {r['A']} x {r['M']} x {r['T']} | {r['padding_fraction']:.3f} "
                 f"| {r['loss_token_fraction']:.3f} | {1e3 * r['stream_s_median']:.2f} "
                 f"| {1e3 * r['packed_s_median']:.2f} | {r['ratio_min']:.3f} | {r['ratio_median']:.3f} "
                 f"| {r['ratio_max']:.3f} | {r['ratio_of_fastest']:.3f} | {r['cpu_ratio_median']:.3f} |")
  lines += ["", "Per-round ratios (wall and CPU) are in train_step_layouts.json."]
  return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
  ap = interleaved_parser(__doc__, "train_step_layouts", 12)
  ap.add_argument("--grad-accum", type=int, default=1, help="micro batches per optimizer step (A)")
  ap.add_argument("--data-steps", type=int, default=4, help="different optimizer steps of data to cycle through")
  a = ap.parse_args(argv)
  out = pinned_record("train_step_layouts.py", argv, a.threads)
  builders = {"jax": jax_steps, "torch": torch_steps}

  def measure(fw: str, shape: str) -> tuple[dict, dict]:
    model, m, t = SHAPES[shape]
    run = run_spec(model, m, t, a.grad_accum)
    data = packed_data(run, a.data_steps)
    steps = builders[fw](run, data)
    res = interleave(steps, a.rounds, a.per_round, a.warmup)
    return {"A": a.grad_accum, "M": m, "T": t,
            **{k: data[k] for k in ("padding_fraction", "loss_token_fraction", "examples_per_step")},
            **({"compile_s": steps["compile_s"]} if "compile_s" in steps else {})}, res

  run_shapes(a, out, measure)
  out["host"]["load_1min_end"] = load_1min()
  Path(a.out + ".json").write_text(json.dumps(out, indent=1) + "\n")
  Path(a.out + ".md").write_text(_markdown(out))


if __name__ == "__main__":
  main()
