"""The tests' numpy side, `fake`: a whole side in this one file, registered through one record (docs/adding-a-side.md).

`FakeSide` implements every method of the `parity.protocol.loop.Side` protocol with a few lines of numpy: a
deterministic "gradient" of the params and the batch, DeepSpeed's learning-rate schedule, an Adam update, an fp16
loss scale that halves on a forced overflow, and checkpoints as one .npz. tests/test_loop.py drives the one training
loop with it in-process (milliseconds a run); tests/test_sides.py registers `RECORD` and shows that the launcher, the
worker lookup, the sizing model, the report and the install and socket checks all pick the side up from it.

What a side brings, and where it is here:
  the Side              FakeSide
  its worker module     this module: `python -m fake_side run_dir/request.json --side fake` (`main`)
  its memory model      `memory_rows` (parity.sizing.memory.estimate calls it through the record)
  its plan row          `plan_text` (parity.report.setup_table.plan_rows calls it through the record)
  its record            RECORD, registered by `registered()` (in-process) and by `main` (in its worker process)
Nothing else in the repository names it.
"""
from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path
from typing import Iterator

import numpy as np

from parity.numerics import schedule
from parity.protocol.loop import SideSummary, run_train
from parity.protocol.ranks import rank_rows
from parity.protocol.side import main_guard
from parity.sides import SideRecord, register_side, unregister_side

NAME = "fake"
"""The side's name: run_dir/fake/, `--sides jax,fake`."""
FLOAT64 = 8
"""FakeSide keeps its params p and Adam second moments v in float64 on the host: 8 bytes an element each."""

class FakeSide:
  """A numpy `Side`: params p (canonical names, float64), g = 1e-3 cos(p + mean(batch) / V), AdamW-free Adam.

  loss = mean over tensors of mean(p^2) + mean(batch) / V (NaN once poisoned); the lr of an update is
  schedule.train_lr(train, updates applied), so a skipped fp16 step repeats it, as DeepSpeed's does.

  Args:
    moments_fail_at: raise RuntimeError from the n-th canonical_moments call (0-based), to test the fallback.
    card: the items of its semantics card (parity.semantics.DIFFED), or None for no card.
  Attributes (what the loop did, for the tests): calls (method names in order), probes (steps probed).
  """

  def __init__(self, moments_fail_at: int | None = None, card: dict | None = None):
    self.moments_fail_at, self.moment_calls = moments_fail_at, 0
    self.card = card
    self.calls: list[str] = []
    self.probes: list[int] = []
    self.in_training = False

  # ---------------------------------------------------------------- build
  def build(self, io) -> None:
    self.calls.append("build")
    self.run, self.rank, self.world = io.run, io.rank, io.world
    self.p = {k: v.astype(np.float64) for k, v in io.init_params().items()}
    self.v = {k: np.zeros_like(v) for k, v in self.p.items()}
    self.updates, self.steps_run = 0, 0
    self.scale = 2.0 ** self.run.train.initial_scale_power

  def restore(self, folder: Path, meta: dict) -> None:
    self.calls.append(f"restore {meta['step']}")
    with np.load(folder / "state.npz") as z:
      self.p = {k: z[f"p/{k}"] for k in self.p}
      self.v = {k: z[f"v/{k}"] for k in self.v}
      self.updates, self.scale = int(z["updates"]), float(z["scale"])

  def op_build_s(self) -> float:
    return 0.0

  def semantics(self, io) -> dict | None:
    """The semantics card `card` (items), or None: no card (the default)."""
    return None if self.card is None else {"items": dict(self.card), "info": {"side": "fake"}}

  def compile(self, batch_shape, val_shape, dtype, examples: bool = False) -> float:
    self.calls.append(f"compile {tuple(batch_shape)} {None if val_shape is None else tuple(val_shape)}"
                      + (" examples" if examples else ""))
    return 0.25

  def loss_weight_factor(self) -> float:  # the torch convention: micro-batch losses averaged, then ranks
    return float(self.run.train.grad_accum_steps * self.world)

  def rank_arrays(self, arrays):
    if self.world == 1:
      return arrays
    return arrays.rows(rank_rows(self.run.train.micro_batch_size, self.rank, self.world))

  @contextlib.contextmanager
  def training(self):
    self.in_training = True
    try:
      yield
    finally:
      self.in_training = False

  # ---------------------------------------------------------------- steps
  def rank_batch(self, batches: np.ndarray, step: int) -> np.ndarray:
    if self.world == 1:
      return np.asarray(batches[step])
    return np.asarray(batches[step, :, rank_rows(self.run.train.micro_batch_size, self.rank, self.world)])

  def synchronize(self) -> None:
    self.calls.append("sync")

  def _loss(self, tokens: np.ndarray, arrays=None) -> float:
    """Stream: mean(p^2) + mean(tokens) / V. Padded/packed: the mean over micro batches of sum(weights * target) / V
    (a weighted 'cross-entropy' of the targets, as the real sides' sum(w * ce)) instead of mean(tokens) / V."""
    data = (np.mean(tokens) if arrays is None else
            np.mean(np.sum(arrays.weights * tokens[..., 1:], axis=(1, 2))))
    return float(np.mean([np.mean(p * p) for p in self.p.values()]) + data / self.run.model.vocab_size)

  def step(self, batch, *, probe: bool, force_overflow: bool, arrays=None) -> dict:
    assert self.in_training, "a step ran outside side.training()"
    t = self.run.train
    fp16 = t.precision == "fp16"
    if force_overflow and not fp16:
      raise ValueError(f"force_overflow (debug overflow_at_steps) needs train.precision='fp16'; this run has "
                       f"train.precision={t.precision!r}")
    self.calls.append("step")
    if probe:
      self.probes.append(self.steps_run)
    self.steps_run += 1
    x = float(np.mean(batch)) / self.run.model.vocab_size
    lr, scale, loss = schedule.train_lr(t, self.updates), self.scale, self._loss(batch, arrays)
    g = {k: 1e-3 * np.cos(p + x) for k, p in self.p.items()}
    norm = math.sqrt(sum(float(np.sum(v * v)) for v in g.values()))
    extra = {"loss_scale": scale, "skipped": force_overflow} if fp16 else {}
    if force_overflow:
      self.scale = scale / 2
      return {"loss": loss, "grad_norm": float("inf"), "lr": lr, **extra}
    self.updates += 1
    b2 = t.beta2
    for k in self.p:
      self.v[k] = b2 * self.v[k] + (1 - b2) * g[k] ** 2
      self.p[k] = self.p[k] - lr * g[k] / (np.sqrt(self.v[k] / (1 - b2 ** self.updates)) + t.eps)
    return {"loss": loss, "grad_norm": norm, "lr": lr, **extra}

  def eval_loss(self, val: np.ndarray, arrays=None) -> float:
    self.calls.append("eval")
    return self._loss(val, arrays)

  def canonical_params(self) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float32) for k, v in self.p.items()}

  def canonical_moments(self) -> dict[str, np.ndarray]:
    n, self.moment_calls = self.moment_calls, self.moment_calls + 1
    if self.run.train.optimizer not in ("adam", "adamw"):
      raise KeyError(f"train.optimizer {self.run.train.optimizer!r} keeps no Adam second moment")
    if self.moments_fail_at is not None and n >= self.moments_fail_at:
      raise RuntimeError("exp_avg_sq not found")
    corr = 1 - self.run.train.beta2 ** self.updates if self.updates else 1.0
    return {k: np.sqrt(v / corr).astype(np.float32) for k, v in self.v.items()}

  def poison(self) -> None:
    self.p = {k: np.full_like(v, np.nan) for k, v in self.p.items()}

  # ---------------------------------------------------------------- checkpoints and summary
  def save(self, folder: Path, step: int) -> dict:
    self.calls.append(f"save {step}")
    np.savez(folder / "state.npz", updates=self.updates, scale=self.scale,
             **{f"p/{k}": v for k, v in self.p.items()}, **{f"v/{k}": v for k, v in self.v.items()})
    return {"format": "fake npz"}

  def versions(self) -> dict[str, str]:
    return {"numpy": np.__version__}

  def close(self) -> None:
    self.calls.append("close")

  def summary(self) -> SideSummary:
    nbytes = sum(v.nbytes for v in self.p.values()) + sum(v.nbytes for v in self.v.values())
    return SideSummary(versions=self.versions(), device="cpu", peak_device_bytes=None,
                       state_bytes_by_memory_kind={"host": nbytes}, extra={"fake_updates": self.updates})


# ----------------------------------------------------------------------------- what the record points at


def memory_rows(run, ranks: int = 1) -> list:
  """The fake's predicted memory (its record's memory_rows): float64 params and second moments, on the host, every
  rank holding them whole (parity.sizing.memory.Row, per rank); FakeSide.summary measures the same arrays."""
  from parity.sizing.memory import Row, param_count  # the sizing model, where it is asked for
  n = param_count(run.model)
  return [Row(NAME, "params", "host", FLOAT64 * n, "float64"),
          Row(NAME, "optimizer_moments", "host", FLOAT64 * n, "float64 second moment (no first moment)")]


def plan_text(run) -> str:
  """The fake's plan row in the report (its record's plan_text; `run` is the report's RunRecord): what it runs, not a
  section."""
  return "numpy on the host: float64 params and Adam second moments, no first moment, no sharding"


RECORD = SideRecord(
    name=NAME, framework="torch", label="NumPy fake",  # torch: its loss weights and rank rows follow torch's
    workers={"train": "fake_side"},  # this module (tests/ on PYTHONPATH)
    modules=("numpy",), extra=None,  # the base install has numpy: no extra to name
    plan_text="fake_side:plan_text", memory_rows="fake_side:memory_rows")
"""The one record of the fake side: defaults for all it does not have (a plan section, thread records, the chip,
sockets on one rank, a hostfile launcher)."""


@contextlib.contextmanager
def registered() -> Iterator[SideRecord]:
  """RECORD registered for the `with` block (a test's), unregistered after, so other tests see the four sides."""
  register_side(RECORD)
  try:
    yield RECORD
  finally:
    unregister_side(NAME)


def main(argv: list[str] | None = None) -> int:
  """The worker: registers the side in this process, then runs the one loop over a FakeSide."""
  register_side(RECORD)
  return main_guard(lambda io: run_train(io, FakeSide()), argv)


if __name__ == "__main__":
  sys.exit(main())
