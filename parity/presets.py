"""The run presets: named RunSpecs a run starts from (`parity compare --preset NAME`, a config's `preset:`).

Model-size presets for the memory model and planner (gpt2-124m, llama-7b, ...) are parity.hf.MODEL_PRESETS.
"""
from __future__ import annotations

from parity.errors import SpecError
from parity.spec import ModelSpec, RunSpec, TrainSpec

__all__ = ["PRESETS", "DEFAULT_PRESET", "preset"]

PRESETS: dict[str, RunSpec] = {
    # ~3.4 M params; all three sides finish in a few minutes on 2 CPU cores.
    "gpt2-small-cpu": RunSpec(),
    # ~0.1 M params, for tests: seconds per side. lr 1e-3: at 3e-3 a loss spike near step 35 makes two
    # correct fp32 stacks drift apart past 1e-5 by step ~40 (rounding amplified by unstable training).
    "gpt2-tiny": RunSpec(
        model=ModelSpec(d_model=64, n_layers=2, n_heads=2, max_seq_len=64),
        train=TrainSpec(steps=16, micro_batch_size=4, seq_len=32, lr=1e-3, warmup_steps=3,
                        eval_every=8, eval_batches=2)),
    # ~0.5 M params, 100 steps: the configuration shared/NUMERICS.md measured.
    "gpt2-mini": RunSpec(
        model=ModelSpec(d_model=128, n_layers=2, n_heads=4, max_seq_len=64),
        train=TrainSpec(steps=100, micro_batch_size=8, seq_len=64, warmup_steps=10, eval_every=25)),
    # The padded SFT path end to end without a download (issue #20 item 9): docstring -> body pairs of this Python's
    # stdlib, byte-level (parity.dataset.demo: vocab 258, PAD 256, EOS 257), gpt2-tiny's width, 128-token rows
    # (longer examples are truncated and counted in the data card), eval on the held-out last 10% of the examples.
    "sft-tiny": RunSpec(
        model=ModelSpec(d_model=64, n_layers=2, n_heads=2, max_seq_len=128, vocab_size=258),
        train=TrainSpec(steps=8, micro_batch_size=4, grad_accum_steps=2, seq_len=128, lr=1e-3, warmup_steps=3,
                        eval_every=4, eval_batches=2, layout="padded"),
        data="sft-demo"),
}
DEFAULT_PRESET = "gpt2-small-cpu"


def preset(name: str) -> RunSpec:
  """Returns the named preset. Raises SpecError listing the known names."""
  try:
    return PRESETS[name]
  except (KeyError, TypeError):  # TypeError: a config's `preset:` that is a list or mapping
    raise SpecError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}") from None
