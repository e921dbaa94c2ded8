"""The worker end of the run protocol: `SideIO` (a worker's inputs and the writers of its outputs) and `main_guard`.

A worker is `python -m <module> run_dir/request.json --side <side>` (the module from `parity.protocol.workers`); it
uses `SideIO` for every file of `parity.protocol.layout`, so both frameworks write identical records, and
`SideIO.control()` for the run-control keys (`parity.protocol.control`).
"""
from __future__ import annotations

import json
import math
import os
import platform
import resource
import shutil
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from parity import weights

from parity.numerics import schedule
from parity.protocol.control import RunControl, parse_control
from parity.protocol.ranks import rank_env, rank_stderr, write_rank_record
from parity.protocol.layout import (CHECKPOINT_DIR, CHECKPOINT_META, CHECKPOINT_SCHEMA, DEBUG_KEYS, FINAL_MOMENTS,
                                    LAUNCH_ENV, PLANTED_HANG, PLANTED_KILL, REQUEST_SCHEMA, SUMMARY_SCHEMA, parse_debug_value)
from parity.protocol.workers import SIDE_WORKERS
from parity.spec import RunSpec, TrainSpec, apply_overrides, config_hash, from_dict, to_dict

__all__ = ["SideIO", "main_guard", "check_batch_shapes", "peak_rss_bytes"]


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


def peak_rss_bytes() -> int:
  """Peak resident set size of this process, bytes (getrusage ru_maxrss is KiB on Linux)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class SideIO:
  """A worker's view of one run: its inputs, and the writers of its outputs.

  Args:
    request_path: run_dir/request.json.
    side: 'jax', 'deepspeed' or 'torch'.
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
    """uint16 (steps, grad_accum_steps, micro_batch_size, seq_len + 1), memory-mapped."""
    return np.load(self.run_dir / self.request["batches"], mmap_mode="r")

  def val_batches(self) -> np.ndarray:
    """uint16 (eval_batches, micro_batch_size, seq_len + 1)."""
    return np.load(self.run_dir / self.request["val_batches"])

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
    self.steps_done = step + 1
    # an fp16 step skipped on overflow reports grad_norm inf, as DeepSpeed does: that is not a failure
    return math.isfinite(rec["loss"]) and (rec["skipped"] or math.isfinite(rec["grad_norm"]))

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
    warm = times[2:] if len(times) > 3 else times[1:] or times
    med = statistics.median(warm) if warm else None
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
        "tokens_per_s": (self.run.train.tokens_per_step / med) if med else None,
        "peak_device_bytes": peak_device_bytes,
        "peak_host_rss_bytes": peak_rss_bytes(),
        "state_bytes_by_memory_kind": state_bytes_by_memory_kind or {},
        "perturbed": {**self.perturbed, **{k: list(v) if isinstance(v, tuple) else v for k, v in self.debug.items()}},
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
    headline = f"{type(exc).__name__}: {exc}".strip().splitlines()
    extra = {**(kw.pop("extra", None) or {}), "traceback": "".join(traceback.format_exception(exc))[-8000:]}
    return self.finish("crashed", error=" ".join(x.strip() for x in headline)[:2000], extra=extra, **kw)


def main_guard(side_main: Callable[[SideIO], int], argv: list[str] | None = None) -> int:
  """Shared worker entry: parses `request.json --side S`, runs `side_main`, reports crashes."""
  import argparse
  ap = argparse.ArgumentParser(description="parity worker: runs one side of a comparison")
  ap.add_argument("request", help="run_dir/request.json")
  ap.add_argument("--side", required=True, choices=sorted(SIDE_WORKERS))
  args = ap.parse_args(argv)
  io = SideIO(args.request, args.side)
  try:
    return side_main(io)
  except Exception as exc:  # reported in summary.json; the harness reads it
    io.fail(exc)
    print(f"[{args.side}] crashed: {exc!r}", file=sys.stderr)
    traceback.print_exc()
    return 1
