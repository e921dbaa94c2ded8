"""The one training loop of every side (`run_train(io, side)`) and the `Side` protocol it drives.

A side's worker is an adapter: it sets its framework's environment, imports the framework, and hands `run_train`
an object with the `Side` methods (`jax_impl.side.JaxSide`, `torch_impl.side.TorchSide`;
tests/test_loop.py's `FakeSide` is a numpy one). The loop owns everything the workers share, in this order:

  run control      `io.control()` (refusals end as 'crashed'), then the multi-rank checkpoint refusal
                   (`check_checkpoint_ranks`), then the batch files' shapes (`io.training_batches()`)
  build            `side.build(io)`, `side.restore(...)` when resuming, the semantics card (`side.semantics(io)`,
                   written and diffed against the earlier sides' before step 1: parity.protocol.semantics.gate),
                   `side.op_build_s()` taken off init_s,
                   `io.ready()`, `side.compile(...)` (its seconds are summary.json's compile_s)
  each step        inside `side.training()`: `io.before_step` (fault injection; `side.poison` for nan_at_step),
                   the timed part between two `side.synchronize()` calls: this rank's batch (`side.rank_batch`)
                   and the step (the first step this process runs is the state-bytes probe, outside the median),
                   the validation loss on eval steps, `io.record`; a non-finite loss or grad norm stops the run
                   (status 'nan', exit 3); Adam's moments are accumulated for the params rule
                   (`AdamSensitivity`; a side that cannot give them falls back, named in extra.moments_error);
                   the checkpoint after step `save_checkpoint_at_step`
  finish           `side.summary()` fields, the canonical params and moments (status ok only), `io.finish`,
                   then `side.close()` (every rank waits for the others and leaves the process group)

Imports neither jax nor torch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any, ContextManager, Protocol, runtime_checkable

import numpy as np

from parity.protocol.control import RunControl
from parity.protocol.ranks import multirank_checkpoint_refusal, rank_rows
from parity.protocol.side import ExampleArrays, SideIO
from parity import semantics as semantics_card
from parity.protocol.semantics import gate as card_gate
from parity.numerics.adam import AdamSensitivity

__all__ = ["Side", "SideSummary", "run_train", "check_checkpoint_ranks", "EXIT_OK", "EXIT_CRASHED", "EXIT_NAN",
           "MOMENT_ERRORS"]

EXIT_OK, EXIT_CRASHED, EXIT_NAN = 0, 1, 3
"""A worker's exit codes: ok, crashed (summary.json carries the traceback: `main_guard`), non-finite loss."""
MOMENT_ERRORS = (ValueError, KeyError, RuntimeError)
"""What `Side.canonical_moments` raises when the side keeps no usable Adam moments (not an Adam, a ZeRO state it
cannot gather): the params rule then falls back to its per-tensor form and the summary names the error."""

Metrics = dict[str, float | bool]


@dataclasses.dataclass
class SideSummary:
  """The fields a side adds to its summary.json (`SideIO.finish`'s keywords).

  Attributes:
    versions: framework -> version string (python is added by SideIO).
    device: where the side computed, in words (e.g. 'cpu', 'cuda (NVIDIA H200)', 'TFRT_CPU_0').
    peak_device_bytes: peak accelerator memory, bytes; None on the CPU. The JAX side's is the runtime's hold where
      memory_stats gives it, else the larger of the allocator's peak and the compiled step's device figure, never
      the step's host buffers (parity.protocol.memory_figures.device_memory_fields; every reading, and which was
      taken, are in `extra`).
    state_bytes_by_memory_kind: bytes of the training state (params, gradients, optimizer) per memory kind
      ('device', 'host', 'pinned_host', ...).
    extra: side-specific summary fields (JSON-ready), merged into summary.json at the top level.
  """
  versions: dict[str, str]
  device: str
  peak_device_bytes: int | None
  state_bytes_by_memory_kind: dict[str, int]
  extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@runtime_checkable
class Side(Protocol):
  """What a side provides to be trained, evaluated, checkpointed and compared (`run_train` calls these in order).

  Arrays are numpy unless said otherwise. Token ids are uint16 (uint32 when model.vocab_size > 65,536); a training
  batch is (A, M, T + 1) = (train.grad_accum_steps, train.micro_batch_size, train.seq_len + 1), inputs [..., :-1],
  targets [..., 1:]; validation batches are (E, M, T + 1), E = train.eval_batches. Losses are mean token
  cross-entropies in nats; learning rates are the rate the step's update applied. Canonical names and layouts are
  `parity.weights.param_shapes(model)`'s (the torch layout), float32.

  An adapter may subclass Side to inherit the defaults of op_build_s, compile, training, rank_batch and synchronize.
  """

  def build(self, io: SideIO) -> None:
    """Builds the model and optimizer from `io.run` (the resolved RunSpec), `io.init_params()` (canonical float32
    initial weights), `io.rank` / `io.world` (this process's rank and the side's world size) and `io.request`;
    keeps `io` as `self.io`."""

  def semantics(self, io: SideIO) -> dict[str, Any] | None:
    """The semantics card of what this side's step runs, read from its built objects (called once after `build`
    and `restore`, before step 1): {'items': {item: value} (parity.semantics.DIFFED), 'info': {...}}.
    Default None: no card (the run's 'semantics' check then leaves this side out)."""
    return None

  def restore(self, folder: Path, meta: dict[str, Any]) -> None:
    """Restores the whole training state from a checkpoint this side saved (`save`); meta is its meta.json
    (`meta['step']` = K: training continues at step K + 1). Raises on a checkpoint it cannot restore."""

  def op_build_s(self) -> float:
    """Seconds `build` spent building framework ops (DeepSpeed's JIT ops): not initialisation, so off init_s.
    Default 0.0."""
    return 0.0

  def compile(self, batch_shape: tuple[int, ...], val_shape: tuple[int, ...] | None, dtype: np.dtype,
              examples: bool = False) -> float:
    """Prepares the step (and the eval, when val_shape is not None) for these shapes (A, M, T + 1) / (E, M, T + 1)
    and this token dtype; returns the seconds spent compiling. examples (passed only when True: padded/packed):
    the step and eval also take ExampleArrays. Default: nothing to compile (eager), 0.0."""
    return 0.0

  def training(self) -> ContextManager[Any]:
    """The context the steps run in (e.g. JAX's transfer guard: every host<->device move explicit). Default: none."""
    return contextlib.nullcontext()

  def rank_batch(self, batches: np.ndarray, step: int) -> Any:
    """This rank's part of step `step`'s batch: batches is batches.npy (steps, A, M, T + 1), memory-mapped; rank k
    of N trains on rows [k*m, (k+1)*m) of each micro batch, m = M / N (parity.protocol.ranks.rank_rows). Returns
    what `step` takes. Default: those rows as a host array (A, M / N, T + 1); JAX gives a global jax.Array."""
    io = self.io
    if io.world == 1:
      return np.asarray(batches[step])
    return np.asarray(batches[step, :, rank_rows(io.run.train.micro_batch_size, io.rank, io.world)])

  def loss_weight_factor(self) -> float:
    """The factor of the padded/packed loss weights this side's step needs (docs/data-examples.md "The model
    level"): A * W by default (a loss divided by A before backward, ranks averaged: torch, DeepSpeed); JAX (the
    whole global micro batch in one program) A."""
    t = self.io.run.train
    return float(t.grad_accum_steps * self.io.world)

  def rank_arrays(self, arrays: ExampleArrays) -> Any:
    """This rank's rows of one step's ExampleArrays (A, M, T), as `rank_batch` takes its rows; what `step`'s
    `arrays` takes. Default: the rows [k*m, (k+1)*m) (parity.protocol.ranks.rank_rows)."""
    io = self.io
    return arrays if io.world == 1 else arrays.rows(rank_rows(io.run.train.micro_batch_size, io.rank, io.world))

  def synchronize(self) -> None:
    """Waits for the device's queued work; the loop calls it before and after the timed step (CUDA is asynchronous).
    Default: nothing (a side whose `step` blocks until its results are ready)."""

  def step(self, batch: Any, *, probe: bool, force_overflow: bool, arrays: Any = None) -> Metrics:
    """One optimizer step over `rank_batch`'s batch.

    Args:
      arrays: padded/packed layouts only (passed only then: a stream-only side need not take it): `rank_arrays`'
        ExampleArrays of this step; the micro-batch loss is then sum(weights * ce) with the segment ids and
        positions given to the model (docs/data-examples.md "The model level"), and the loss reported the mean
        over the micro batches of it (the step objective L).
      probe: measure the state bytes around the update (the first step this process runs).
      force_overflow: make this step's scaled gradient overflow (debug overflow_at_steps; fp16 only).
    Returns:
      loss (mean over the micro batches, of the whole global batch with several ranks), grad_norm (global L2 norm
      before clipping; inf on a skipped step), lr (float); fp16 adds loss_scale (the scale this step used) and
      skipped (bool: the update was skipped on overflow).
    Raises:
      ValueError: force_overflow on a run that is not fp16.
      parity.numerics.loss_scale.LossScaleAtMinimum: an overflow at train.min_loss_scale (DeepSpeed raises).
    """

  def eval_loss(self, val: np.ndarray, arrays: Any = None) -> float:
    """Validation loss (nats) of the current params over the host val batches (E, M, T + 1). arrays (padded/
    packed only, as `step`'s; all rows, weights per batch summing to 1): the mean over batches of sum(w * ce)."""

  def canonical_params(self) -> dict[str, np.ndarray]:
    """The current float32 master params, canonical names and shapes (a collective with several ranks)."""

  def canonical_moments(self) -> dict[str, np.ndarray]:
    """Adam's bias-corrected per-element gradient RMS sqrt(v / (1 - beta2^t)), canonical names and shapes, float32;
    zeros before the first update (a collective with several ranks).

    Raises:
      KeyError, ValueError or RuntimeError (MOMENT_ERRORS): the optimizer keeps no Adam second moment.
    """

  def poison(self) -> None:
    """Makes the next loss NaN (fault injection nan_at_step), e.g. by filling the params with NaN."""

  def save(self, folder: Path, step: int) -> dict[str, Any] | None:
    """Writes the whole training state after `step` into the empty `folder`; returns JSON-ready fields for the
    checkpoint's meta.json (e.g. format) or None."""

  def versions(self) -> dict[str, str]:
    """Framework -> version string, for checkpoints' meta.json."""

  def summary(self) -> SideSummary:
    """The fields this side adds to summary.json (called once, after the last step, before the final reads)."""

  def close(self) -> None:
    """Ends the side's runtime after `io.finish` on a run that ended normally (ok or nan; not called when a step
    raised, where a collective could wait on a dead rank). With several ranks: every rank waits for the others,
    then leaves the process group, so no rank exits while a peer still reads its sockets (gloo aborts a peer
    whose connection is reset: a finished run would be reported killed). Default: nothing."""


def check_checkpoint_ranks(world: int, control: RunControl) -> None:
  """Refuses a checkpoint (save or resume) of a side run with several ranks: each rank would write its own.

  Raises:
    ValueError: naming the run-control keys, the ranks and the fix (`MULTIRANK_CHECKPOINTS`).
  """
  if world > 1 and (control.save_at is not None or control.resume_dir is not None):
    raise ValueError(multirank_checkpoint_refusal("save_checkpoint_at_step/resume_from", world))


def run_train(io: SideIO, side: Side) -> int:
  """Trains one side as the request describes (the module docstring's order); returns the exit code.

  Raises whatever the side raises (`main_guard` writes it as a 'crashed' summary, exit 1).
  """
  control = io.control()  # refusals (bad keys, a checkpoint of another run) end here, as 'crashed'
  check_checkpoint_ranks(io.world, control)
  batches, val = io.training_batches()  # shapes checked (parity.protocol.side.check_batch_shapes)
  side.build(io)
  if control.resume_dir is not None:
    side.restore(control.resume_dir, control.resume_meta or {})
  _card(io, side)
  io.launch_time += side.op_build_s()  # op builds are not initialisation: off init_s (the side's summary has them)
  io.ready()
  arrays = val_arrays = None  # the stream layout: no arrays, the step and eval called as always
  if io.request.get("examples"):
    arrays, val_arrays = io.example_arrays(side.loss_weight_factor(), batches.shape,
                                           None if val is None else val.shape)
  io.compile_s = side.compile(tuple(batches.shape[1:]), None if val is None else tuple(val.shape), batches.dtype,
                              **({} if arrays is None else {"examples": True}))
  sens = AdamSensitivity(io.run.train.eps)  # per-element Adam sensitivity for the params rule (parity.verdict.params)
  with side.training():
    status, error, moments_error = _steps(io, side, control, (batches, arrays), (val, val_arrays), sens)
  fields = side.summary()
  extra = dict(fields.extra)
  if moments_error is not None:
    extra["moments_error"] = moments_error
  params = moments = None
  if status == "ok":
    if moments_error is None:
      rms = side.canonical_moments()
      moments = {"grad_rms": rms, "sensitivity": sens.result(rms)}
    params = side.canonical_params()
  io.finish(status, final_params=params, final_moments=moments, error=error, versions=fields.versions,
            device=fields.device, peak_device_bytes=fields.peak_device_bytes,
            state_bytes_by_memory_kind=fields.state_bytes_by_memory_kind, extra=extra)
  side.close()  # after the summary is on disk: a failure to leave the group cannot lose the run's results
  return EXIT_OK if status == "ok" else EXIT_NAN


def _card(io: SideIO, side: Side) -> None:
  """The side's semantics card, written and gated before step 1 (parity.protocol.semantics.gate: raises
  CardDiffers, which ends the side as 'crashed', when it differs from an earlier side's and the run does not train
  anyway)."""
  made = side.semantics(io)
  if made is None:
    return
  card = semantics_card.make_card(io.side, io.request.get("run_id"), made.get("items") or {}, made.get("info") or {})
  card_gate(io.run_dir, io.side, list(io.run.sides), io.request, card, write=io.rank == 0)


def _steps(io: SideIO, side: Side, control: RunControl, train: tuple, held_out: tuple,
           sens: AdamSensitivity) -> tuple[str, str | None, str | None]:
  """The steps of `control` over train = (batches, ExampleArrays or None) and held_out = (val or None, its
  ExampleArrays or None); returns (status 'ok' or 'nan', the nan error, the moments error or None)."""
  (batches, arrays), (val, val_arrays) = train, held_out
  extra = (lambda step: {}) if arrays is None else (lambda step: {"arrays": side.rank_arrays(arrays.at(step))})
  val_extra = {} if val_arrays is None else {"arrays": val_arrays}
  moments_error = None
  for step in control.steps():
    io.before_step(step, poison=side.poison)
    forced = io.forced_overflow(step)
    side.synchronize()
    t0 = time.perf_counter()  # the batch's move to the device is inside, whichever method makes it
    batch = side.rank_batch(batches, step)
    metrics = side.step(batch, probe=step == control.first_step, force_overflow=forced, **extra(step))
    side.synchronize()
    step_time_s = time.perf_counter() - t0
    val_loss = side.eval_loss(val, **val_extra) if val is not None and io.is_eval_step(step) else None
    if not io.record(step, step_time_s=step_time_s, val_loss=val_loss, **metrics):
      return "nan", f"non-finite loss or grad norm at step {step}: {metrics}", moments_error
    if not metrics.get("skipped") and moments_error is None:
      try:  # the params rule falls back to its per-tensor form without them, and says so
        sens.add(side.canonical_moments(), float(metrics["lr"]))
      except MOMENT_ERRORS as exc:
        moments_error = f"{type(exc).__name__}: {exc}"
    if step == control.save_at:
      io.save_checkpoint(step, lambda folder: side.save(folder, step), side.versions())
  return "ok", None, moments_error
