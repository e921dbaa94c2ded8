"""The worker end of the run protocol: `SideIO` (a worker's inputs and the writers of its outputs) and `main_guard`.

A worker is `python -m <module> run_dir/request.json --side <side>` (the module from `parity.protocol.workers`); it
uses `SideIO` for every file of `parity.protocol.layout`, so both frameworks write identical records, and
`SideIO.control()` for the run-control keys (`parity.protocol.control`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import resource
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from parity import weights
from parity.data import batch_dtype
from parity.dataset.reference import in_example_targets, token_weights

from parity.numerics import schedule
from parity.protocol.control import RunControl, parse_control
from parity.protocol.ranks import rank_env, rank_stderr, write_rank_record
from parity.protocol.layout import (CHECKPOINT_DIR, CHECKPOINT_META, CHECKPOINT_SCHEMA, DEBUG_KEYS, FINAL_MOMENTS,
                                    LAUNCH_ENV, PLANTED_HANG, PLANTED_KILL, SIDE_PLANT_KEYS, REQUEST_SCHEMA,
                                    SUMMARY_SCHEMA, parse_debug_value, loss_tokens_per_s,
                                    step_time_median, tokens_per_s)
from parity.protocol.workers import SIDE_WORKERS
from parity.overrides import apply_overrides
from parity.spec import RunSpec, TrainSpec, config_hash, from_dict, to_dict, without_layout_defaults

__all__ = ["SideIO", "main_guard", "exit_now", "check_batch_shapes", "check_batch_dtype", "peak_rss_bytes",
           "ExampleArrays", "check_example_arrays"]


@dataclasses.dataclass(frozen=True)
class ExampleArrays:
  """The arrays beside the tokens of a padded/packed batch, as a side's step and eval take them (numpy).

  Attributes:
    segment_ids: int32 (A, M, T): 0 on padding, 1.. per example of a row (attention never crosses two ids).
    positions: int32 (A, M, T): each input's position within its example.
    weights: float32 (A, M, T): each target's weight in the micro-batch loss sum(weights * ce), already times the
      side's factor (docs/data-examples.md "The model level": A*W*w on torch/DeepSpeed, A*w on JAX, w in eval).
  A is the micro batches of a step (E validation batches in eval), M this rank's rows, T = train.seq_len.
  """
  segment_ids: np.ndarray
  positions: np.ndarray
  weights: np.ndarray

  def at(self, step: int) -> "ExampleArrays":
    """Step `step`'s arrays (A, M, T) of whole-run arrays (steps, A, M, T)."""
    return ExampleArrays(self.segment_ids[step], self.positions[step], self.weights[step])

  def rows(self, sl: slice) -> "ExampleArrays":
    """These arrays' rows `sl` of each micro batch (a rank's, parity.protocol.ranks.rank_rows)."""
    return ExampleArrays(self.segment_ids[:, sl], self.positions[:, sl], self.weights[:, sl])


def check_example_arrays(arrays: dict, shape: Sequence[int], names: dict) -> None:
  """Refuses example arrays whose shape or dtype does not fit the token batches of `shape` (..., T + 1).

  Raises:
    ValueError: naming the file, its shape/dtype and what this run needs; the fix is a fresh run folder.
  """
  want = tuple(shape[:-1]) + (shape[-1] - 1,)
  dtypes = {"loss_mask": np.dtype(bool), "segment_ids": np.dtype(np.int32), "positions": np.dtype(np.int32)}
  for name, arr in arrays.items():
    if tuple(arr.shape) != want or arr.dtype != dtypes[name]:
      raise ValueError(f"{names[name]} has shape {tuple(arr.shape)} and dtype {arr.dtype.name}; this run needs "
                       f"{want} {dtypes[name].name} (the token batches' shape less the last target); regenerate the "
                       "run folder")


def check_batch_shapes(shape: Sequence[int], val_shape: Sequence[int] | None, train: TrainSpec, *,
                       names: tuple[str, str] = ("batches.npy", "val_batches.npy")) -> None:
  """Refuses batch files that do not fit the run, before a framework sees them (both workers call it).

  Args:
    shape: batches.npy's shape; the run needs (>= train.steps, grad_accum_steps, micro_batch_size, seq_len + 1).
    val_shape: val_batches.npy's shape, (eval_batches, micro_batch_size, seq_len + 1); None: not read (no eval).
    train: the side's TrainSpec.
    names: the two files as the request names them (for the message).
  Raises:
    ValueError: naming the file, its shape and the shape this run needs; the fix is a fresh run folder.
  """
  want = (train.grad_accum_steps, train.micro_batch_size, train.seq_len + 1)
  if len(shape) != 4 or shape[0] < train.steps or tuple(shape[1:]) != want:
    raise ValueError(f"{names[0]} has shape {tuple(shape)}; this run needs (>= {train.steps}, *{want}) "
                     "(steps, grad_accum_steps, micro_batch_size, seq_len + 1); regenerate the run folder")
  if val_shape is not None and (len(val_shape) != 3 or tuple(val_shape[1:]) != want[1:]):
    raise ValueError(f"{names[1]} has shape {tuple(val_shape)}; this run needs (eval_batches, *{want[1:]}) "
                     "(eval_batches, micro_batch_size, seq_len + 1); regenerate the run folder")


def check_batch_dtype(dtype: Any, vocab_size: int, name: str = "batches.npy") -> None:
  """Refuses a batch file whose dtype is not the one the vocabulary implies (`parity.data.batch_dtype`: uint16 up
  to 65,536 ids, else uint32), before a framework sees it (SideIO.batches and val_batches call it).

  Raises:
    ValueError: naming the file, its dtype, the dtype model.vocab_size implies; the fix is a fresh run folder.
  """
  want = batch_dtype(vocab_size)
  if np.dtype(dtype) != want:
    raise ValueError(f"{name} holds {np.dtype(dtype).name} token ids; model.vocab_size={vocab_size} needs "
                     f"{want.name} (the harness writes that dtype); regenerate the run folder")


def _built_from(run: RunSpec) -> dict[str, Any]:
  """summary.json 'spec': the model and train sections this side built from (a stream run without the layout
  fields at their defaults, as its summaries were before they existed: parity.spec.without_layout_defaults)."""
  d = to_dict(run)
  return {"model": d["model"], "train": without_layout_defaults(d["train"], stream_only=True)}


def peak_rss_bytes() -> int:
  """Peak resident set size of this process, bytes (getrusage ru_maxrss is KiB on Linux)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class SideIO:
  """A worker's view of one run: its inputs, and the writers of its outputs.

  Args:
    request_path: run_dir/request.json.
    side: 'jax', 'deepspeed', 'torch' or 'fsdp'.
  Attributes:
    run: the RunSpec for this side, with this side's debug overrides applied.
    debug: this side's fault injections (subset of DEBUG_KEYS -> step).
    out: run_dir/<side>/.
  """

  def __init__(self, request_path: str | Path, side: str):
    self.launch_time = float(os.environ.get(LAUNCH_ENV, time.time()))
    self.request_path = Path(request_path)
    self.run_dir = self.request_path.parent
    self.request = json.loads(self.request_path.read_text())
    if self.request.get("schema") != REQUEST_SCHEMA:
      raise ValueError(f"{request_path}: schema {self.request.get('schema')!r}, expected {REQUEST_SCHEMA!r}")
    self.side = side
    self.out = self.run_dir / side
    self.out.mkdir(parents=True, exist_ok=True)
    perturb = dict(self.request.get("perturb", {}).get(side, {}))
    self.debug = {k: parse_debug_value(k, perturb.pop(k)) for k in DEBUG_KEYS if k in perturb}
    self.plants = frozenset(k for k in SIDE_PLANT_KEYS if self.debug.get(k))
    """This side's planted bugs (PLANT_KEYS: its step applies them to its own inputs and model; PLACEMENT_PLANT_KEYS:
    the JAX side compiles its step against another placement than the plan's; FSDP_PLANT_KEYS: the FSDP2 side's
    reduce dtype or one rank's shard; OFFLOAD_PLANT_KEYS: the JAX side's backward reads a wrong saved residual;
    FAMILY_PLANT_KEYS: a convention of the model family run wrong)."""
    base = from_dict(RunSpec, self.request["run"])
    self.run = apply_overrides(base, perturb) if perturb else base
    self.perturbed = perturb
    self.rank, self.world = rank_env()
    """This process's rank and the side's world size (parity.protocol.ranks); only rank 0 writes the run's files."""
    if self.world > 1:
      self._own_stderr()
      write_rank_record(self.out, self.rank, pid=os.getpid(), status="running", host=platform.node())
    self._steps = open(self.out / "steps.jsonl" if self.rank == 0 else os.devnull, "w")
    self._step_times: list[float] = []
    self._step_loss_tokens: list[int] = []
    """Loss tokens of each recorded step, aligned with _step_times (`record`)."""
    self._loss_tokens: np.ndarray | None = None
    """int64 (steps,): loss tokens per optimizer step of a padded/packed run (`example_arrays`); None on stream."""
    self._t_ready: float | None = None
    self.compile_s = 0.0
    self.steps_done = 0
    self._control: RunControl | None = None
    self._checkpoint_info: dict[str, Any] | None = None
    if self.rank == 0:
      (self.out / "pid").write_text(str(os.getpid()))

  def _own_stderr(self) -> None:
    """Multi-rank: moves this process's fd 2 to run_dir/<side>/rank<k>.stderr, so every rank's errors are its own."""
    sys.stderr.flush()
    fd = os.open(rank_stderr(self.out, self.rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.close(fd)

  # ------------------------------------------------------------------ run control
  def control(self) -> RunControl:
    """The request's run-control keys, checked against the run and (when resuming) the checkpoint.

    Call it first in a worker, so a refusal becomes a 'crashed' summary naming the key.
    Raises:
      ControlError: a malformed key, a stop/save step outside the steps this run trains, or a
        resume_from checkpoint that is missing, incomplete, from another side, or of another
        model/train spec or state layout; the message names the key, the request file and the folder.
    """
    if self._control is None:
      self._control = parse_control(self.request, self.request_path, self.side, self.run)
      self.steps_done = self._control.first_step  # a resumed run starts with the checkpoint's steps done
    return self._control

  @property
  def checkpoint_dir(self) -> Path:
    """run_dir/<side>/checkpoint/, where `save_checkpoint` writes."""
    return self.out / CHECKPOINT_DIR

  def save_checkpoint(self, step: int, write: Callable[[Path], dict[str, Any] | None],
                      versions: dict[str, str] | None = None) -> Path:
    """Saves the side's training state after `step`: replaces checkpoint/, calls `write`, then writes meta.json.

    Args:
      step: the optimizer step just completed (0-based); a resumed run continues at step + 1.
      write: writes the framework's files into the (empty) folder it is given; returns extra
        JSON-ready fields for meta.json (e.g. format, tag) or None.
      versions: framework versions, stored in meta.json.
    Returns:
      The checkpoint folder.
    """
    folder = self.checkpoint_dir
    if folder.exists():
      shutil.rmtree(folder)
    folder.mkdir(parents=True)
    t0 = time.time()
    extra = write(folder) or {}
    save_s = time.time() - t0
    meta = {"schema": CHECKPOINT_SCHEMA, "side": self.side, "step": step, "steps_completed": step + 1,
            "run": to_dict(self.run), "config_hash": config_hash(self.run),
            "data_sha256": (self.request.get("data") or {}).get("sha256"),
            "versions": {"python": platform.python_version(), **(versions or {})},
            "created_unix_s": time.time(), "save_s": save_s, **extra}
    (folder / CHECKPOINT_META).write_text(json.dumps(meta, indent=2, default=str))
    self._checkpoint_info = {"step": step, "path": str(folder), "save_s": save_s}
    return folder

  def _control_summary(self, status: str) -> dict[str, Any]:
    """Summary fields of the run-control keys (none when the request has none or they were refused)."""
    ctl, out = self._control, {}
    if ctl is None:
      return out
    if ctl.stop_after_step is not None and status == "ok":
      out["stopped_after_step"] = ctl.stop_after_step
    if ctl.resume_dir is not None:
      out["resumed_from_step"] = ctl.resumed_from_step
      out["resumed_from"] = str(ctl.resume_dir)
    if self._checkpoint_info is not None:
      out["checkpoint"] = self._checkpoint_info
    return out

  # ------------------------------------------------------------------ inputs
  def init_params(self) -> dict[str, np.ndarray]:
    """Canonical float32 initial weights, checked against this side's model spec."""
    return weights.load(self.run_dir / self.request["init_weights"], self.run.model)

  def batches(self) -> np.ndarray:
    """Token ids (steps, grad_accum_steps, micro_batch_size, seq_len + 1), memory-mapped: uint16, or uint32 when
    model.vocab_size > 65,536. Raises ValueError: another dtype (`check_batch_dtype`)."""
    arr = np.load(self.run_dir / self.request["batches"], mmap_mode="r")
    check_batch_dtype(arr.dtype, self.run.model.vocab_size, self.request["batches"])
    return arr

  def val_batches(self) -> np.ndarray:
    """Token ids (eval_batches, micro_batch_size, seq_len + 1), the dtype of `batches`. Raises ValueError: another
    dtype (`check_batch_dtype`)."""
    arr = np.load(self.run_dir / self.request["val_batches"])
    check_batch_dtype(arr.dtype, self.run.model.vocab_size, self.request["val_batches"])
    return arr

  def training_batches(self) -> tuple[np.ndarray, np.ndarray | None]:
    """(batches, val_batches or None when train.eval_every is 0), their shapes checked (`check_batch_shapes`).

    Raises:
      ValueError: a file's shape is not what this run needs (the message names the file and the shape wanted).
    """
    batches = self.batches()
    val = self.val_batches() if self.run.train.eval_every > 0 else None
    check_batch_shapes(batches.shape, None if val is None else val.shape, self.run.train,
                       names=(self.request["batches"], self.request.get("val_batches", "val_batches.npy")))
    return batches, val

  def _example_file_arrays(self, key: str, shape: Sequence[int]) -> dict[str, np.ndarray] | None:
    """request.json 'examples'[key]'s arrays (loss_mask, segment_ids, positions), checked against `shape`."""
    names = (self.request.get("examples") or {}).get(key)
    if not names:
      return None
    arrays = {name: np.load(self.run_dir / file, mmap_mode="r") for name, file in names.items()}
    check_example_arrays(arrays, shape, names)
    return arrays

  def example_arrays(self, factor: float, batches_shape: Sequence[int], val_shape: Sequence[int] | None
                     ) -> tuple[ExampleArrays | None, ExampleArrays | None]:
    """(training, validation) ExampleArrays of a padded/packed run, the whole global batch; (None, None) on stream.

    Training weights: float32(factor * w), w = parity.dataset.reference.token_weights(loss_mask,
    train.loss_normalization, world) in float64 (factor: the side's, `Side.loss_weight_factor`); under the plant
    loss_on_prompt the loss mask is every in-example target (parity.dataset.reference.in_example_targets);
    validation: w of each batch alone under 'tokens' (the mean over batches of sum(w * ce) is the validation loss).
    Raises:
      ValueError: an array's shape or dtype does not fit the batches (`check_example_arrays`).
      parity.data.DataError: micro_mean with a rank's micro batch without a loss token.
    """
    train = self._example_file_arrays("arrays", batches_shape)
    if train is None:
      return None, None
    mask = np.asarray(train["loss_mask"])
    if "loss_on_prompt" in self.plants:  # the planted bug: prompt targets not zeroed (docs/data-examples.md)
      mask = in_example_targets(mask, np.asarray(train["segment_ids"]))
    self._loss_tokens = mask.sum(axis=(1, 2, 3), dtype=np.int64)  # global: every micro batch and rank
    w = token_weights(mask, self.run.train.loss_normalization, self.world)
    out = ExampleArrays(np.asarray(train["segment_ids"]), np.asarray(train["positions"]),
                        (factor * w).astype(np.float32))
    val = self._example_file_arrays("val_arrays", val_shape) if val_shape is not None else None
    if val is None:
      return out, None
    vw = token_weights(np.asarray(val["loss_mask"])[:, None], "tokens")[:, 0].astype(np.float32)
    return out, ExampleArrays(np.asarray(val["segment_ids"]), np.asarray(val["positions"]), vw)

  def forced_overflow(self, step: int) -> bool:
    """True when this side must make step `step`'s gradient overflow (debug `overflow_at_steps`)."""
    return step in self.debug.get("overflow_at_steps", ())

  def lr(self, step: int) -> float:
    """Learning rate DeepSpeed's WarmupCosineLR applies at optimizer step `step`."""
    return schedule.train_lr(self.run.train, step)

  def is_eval_step(self, step: int) -> bool:
    t = self.run.train
    return t.eval_every > 0 and ((step + 1) % t.eval_every == 0 or step == t.steps - 1)

  # ------------------------------------------------------------------ hooks
  def ready(self) -> None:
    """Marks the end of initialisation (imports, model build, weight load)."""
    self._t_ready = time.time()

  def before_step(self, step: int, poison: Callable[[], None] | None = None) -> None:
    """Applies injected faults scheduled for this step (testing only); with `fault_rank`, on that rank only."""
    if self.debug.get("fault_rank", self.rank) != self.rank:
      return
    who = f" of rank {self.rank}" if self.world > 1 else ""
    if self.debug.get("kill_at_step") == step:
      self._steps.flush()
      sys.stderr.write(f"{PLANTED_KILL} at step {step} (perturb kill_at_step): SIGKILL to this worker{who}\n")
      sys.stderr.flush()
      os.kill(os.getpid(), signal.SIGKILL)
    if self.debug.get("hang_at_step") == step:
      sys.stderr.write(f"{PLANTED_HANG} at step {step} (perturb hang_at_step){who}\n")
      sys.stderr.flush()
      while True:
        time.sleep(3600)
    if self.debug.get("raise_at_step") == step:
      raise RuntimeError(f"injected failure at step {step} (perturb raise_at_step)")
    if self.debug.get("nan_at_step") == step and poison is not None:
      poison()

  # ------------------------------------------------------------------ outputs
  def record(self, step: int, *, loss: float, grad_norm: float, lr: float, step_time_s: float,
             loss_scale: float = 1.0, skipped: bool = False, val_loss: float | None = None) -> bool:
    """Appends one StepRecord and flushes it.

    Returns False when the loss is not finite, or the grad norm is not finite on a step that was not
    skipped (an fp16 step skipped on overflow reports grad_norm inf, as DeepSpeed does).
    """
    rec = {"step": step, "loss": float(loss), "grad_norm": float(grad_norm), "lr": float(lr),
           "loss_scale": float(loss_scale), "skipped": bool(skipped), "step_time_s": float(step_time_s),
           "tokens": self.run.train.tokens_per_step}
    if val_loss is not None:
      rec["val_loss"] = float(val_loss)
    self._steps.write(json.dumps(rec) + "\n")
    self._steps.flush()
    self._step_times.append(step_time_s)
    self._step_loss_tokens.append(self.loss_tokens(step))
    self.steps_done = step + 1
    # an fp16 step skipped on overflow reports grad_norm inf, as DeepSpeed does: that is not a failure
    return math.isfinite(rec["loss"]) and (rec["skipped"] or math.isfinite(rec["grad_norm"]))

  def loss_tokens(self, step: int) -> int:
    """Loss-carrying targets of optimizer step `step`, all micro batches and ranks: the loss mask's count of a
    padded/packed run (once `example_arrays` read it), else every target (TrainSpec.tokens_per_step)."""
    lt = self._loss_tokens
    return int(lt[step]) if lt is not None and 0 <= step < len(lt) else self.run.train.tokens_per_step

  def finish(self, status: str, *, final_params: dict[str, np.ndarray] | None = None, error: str | None = None,
             final_moments: dict[str, dict[str, np.ndarray]] | None = None, versions: dict[str, str] | None = None,
             device: str = "cpu", peak_device_bytes: int | None = None,
             state_bytes_by_memory_kind: dict[str, int] | None = None, extra: dict[str, Any] | None = None) -> dict:
    """Writes final.safetensors and FINAL_MOMENTS (each when given; moments only with params) and summary.json.

    final_moments: {'grad_rms': ..., 'sensitivity': ...}, each canonical name -> float32 array (FINAL_MOMENTS).
    Returns the summary. A rank other than 0 of a multi-rank side writes only its rank<k>.json (`_finish_rank`).
    """
    if self.rank != 0:
      return self._finish_rank(status, error)
    if final_params is not None:
      weights.save(final_params, self.out / "final.safetensors",
                   metadata={"side": self.side, **weights.spec_metadata(self.run.model)})
      if final_moments is not None:
        flat = {f"{kind}/{name}": arr for kind, tree in final_moments.items() for name, arr in tree.items()}
        weights.save(flat, self.out / FINAL_MOMENTS, metadata={"side": self.side, "kind": "adam_moments"})
      else:  # never leave an earlier run's moments beside these params
        (self.out / FINAL_MOMENTS).unlink(missing_ok=True)
    times = self._step_times
    med = step_time_median(times)  # the one throughput rule (layout.warm_step_times)
    t_ready = self._t_ready or time.time()
    summary = {
        "schema": SUMMARY_SCHEMA,
        "run_id": self.request.get("run_id"),  # the harness reads only summaries of its own run
        "side": self.side,
        "status": status,
        "error": error,
        "steps_completed": self.steps_done,
        "versions": {"python": platform.python_version(), **(versions or {})},
        "device": device,
        "host": {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
                 "cpu_count": os.cpu_count(), "platform": platform.platform()},
        "init_s": t_ready - self.launch_time,
        "compile_s": self.compile_s,
        "train_s": float(sum(times)),
        "step_time_s_median": med,
        "tokens_per_s": tokens_per_s(times, self.run.train.tokens_per_step),
        "loss_tokens_per_s": loss_tokens_per_s(times, self._step_loss_tokens),  # = tokens_per_s on stream
        "peak_device_bytes": peak_device_bytes,
        "peak_host_rss_bytes": peak_rss_bytes(),
        "state_bytes_by_memory_kind": state_bytes_by_memory_kind or {},
        "perturbed": {**self.perturbed, **{k: list(v) if isinstance(v, tuple) else v for k, v in self.debug.items()}},
        "spec": _built_from(self.run),  # what this side built from
        **self._control_summary(status),
        **(extra or {}),
    }
    if self.world > 1:
      summary["nproc"] = self.world
    self._steps.close()
    (self.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if self.world > 1:
      self._finish_rank(status, error)
    return summary

  def _finish_rank(self, status: str, error: str | None) -> dict:
    """This rank's end in run_dir/<side>/rank<k>.json: status, error, steps, peak RSS (bytes); returns it."""
    record = {"status": status, "error": error, "steps_completed": self.steps_done, "peak_rss_bytes": peak_rss_bytes()}
    self._steps.close()
    write_rank_record(self.out, self.rank, **record)
    return {"side": self.side, "rank": self.rank, **record}

  def fail(self, exc: BaseException, **kw) -> dict:
    """Writes a 'crashed' summary: `error` is the exception's own one-line message (what a user reads in the
    report), `traceback` its last 8000 characters (the full one is in the side's stderr.log)."""
    headline = [x for x in f"{type(exc).__name__}: {exc}".strip().splitlines() if x.strip()]
    if any(x.startswith("Traceback (most recent call last)") for x in headline[1:]):  # an exception that carries
      headline = [headline[0], "...", headline[-1]]  # others' tracebacks (DCP's CheckpointException): first, cause
    extra = {**(kw.pop("extra", None) or {}), "traceback": "".join(traceback.format_exception(exc))[-8000:]}
    return self.finish("crashed", error=" ".join(x.strip() for x in headline)[:2000], extra=extra, **kw)


def exit_now(code: int) -> None:
  """Ends a worker process with `code` once `main_guard` has returned: flushes Python's logging handlers, stdout
  and stderr, then `os._exit`, skipping interpreter teardown. Every file of the run is written and closed by then
  (steps.jsonl, summary.json, the rank record, the final tensors). The torch workers use it because the C++
  threads of their runtime can abort in teardown after a finished run: "terminate called without an active
  exception" (SIGABRT) on rank 0 of a 2-rank ZeRO-3 offload_param run, deepspeed 0.19.8 / torch 2.13, 1 in 3 runs
  here. torchrun then reports the rank killed, and a run that finished would be reported as a side that did not.
  A crash (code 1) exits through `sys.exit` as before: a rank that fails because a peer was killed must not exit
  before torchrun has seen the killed peer, which torchrun names as the root cause only when it dies first."""
  if code == 1:
    sys.exit(code)
  import logging
  logging.shutdown()
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it
      pass
  os._exit(code)


def main_guard(side_main: Callable[[SideIO], int], argv: list[str] | None = None) -> int:
  """Shared worker entry: parses `request.json --side S`, runs `side_main`, reports crashes."""
  import argparse
  ap = argparse.ArgumentParser(description="parity worker: runs one side of a comparison")
  ap.add_argument("request", help="run_dir/request.json")
  ap.add_argument("--side", required=True, choices=sorted(SIDE_WORKERS))  # every registered side (parity.sides)
  args = ap.parse_args(argv)
  io = SideIO(args.request, args.side)
  try:
    return side_main(io)
  except (KeyboardInterrupt, SystemExit, GeneratorExit):
    raise
  except BaseException as exc:  # reported in summary.json; the harness reads it. BaseException: DCP's
    io.fail(exc)  # CheckpointException (torch 2.13) is one, and once slipped past as a bare traceback
    print(f"[{args.side}] crashed: {exc!r}", file=sys.stderr)
    traceback.print_exc()
    return 1
