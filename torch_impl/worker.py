"""Worker of the PyTorch sides: `python -m torch_impl.worker run_dir/request.json --side deepspeed|torch`.

Reads the request through `parity.protocol.side.SideIO`, trains with the DeepSpeed
engine (`--side deepspeed`) or the plain-torch baseline (`--side torch`), and
writes steps.jsonl, summary.json, final.safetensors and final_moments.safetensors
(Adam's sqrt(v_hat)). Exit codes: 0 ok,
1 crashed (summary carries the traceback), 3 non-finite loss or grad norm.

Run control (`SideIO.control()`): with resume_from, the trainer is built from the initial
weights and then restored from the checkpoint (`torch_impl.checkpoint.restore`), and training
continues at the checkpoint's step + 1; with save_checkpoint_at_step K, the complete state
after step K is saved (`torch_impl.checkpoint.save`); stop_after_step S ends after step S.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

from parity.verdict.params import AdamSensitivity
from parity.protocol.ranks import rank_rows
from parity.protocol.side import SideIO, main_guard

EXIT_OK, EXIT_NAN = 0, 3


def _determinism(seed: int) -> None:
  """Seeds torch and asks for deterministic kernels (warn-only where none exists).

  Deterministic mode also NaN-fills every `torch.empty` by default; DeepSpeed
  allocates its ZeRO buckets (reduce_bucket_size, 5e8 elements) that way on each
  step, which made a ZeRO-2 offload step ~300x slower and cost 2 GB of RSS. The
  fill only exposes reads of uninitialised memory, so it is turned off.
  """
  import torch
  os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
  torch.manual_seed(seed)
  torch.use_deterministic_algorithms(True, warn_only=True)
  torch.utils.deterministic.fill_uninitialized_memory = False


def _make_trainer(io: SideIO, params: dict[str, np.ndarray]):
  if io.side == "deepspeed":
    from torch_impl.engine import DeepSpeedTrainer
    return DeepSpeedTrainer(io.run, params, io.request.get("deepspeed_config"))
  if io.side == "torch":
    from torch_impl.baseline import TorchTrainer
    return TorchTrainer(io.run, params)
  raise ValueError(f"torch_impl.worker runs the 'deepspeed' and 'torch' sides; got --side {io.side}")


def _finish_kwargs(trainer) -> dict:
  """versions/device/memory fields of summary.json, from the trainer."""
  import torch
  from torch_impl import memory, ops
  info = trainer.describe()
  state = trainer.state_bytes()
  cuda = trainer.device.type == "cuda"
  return {"versions": info.pop("versions"),
          "device": f"cuda ({torch.cuda.get_device_name(trainer.device)})" if cuda else "cpu",
          "peak_device_bytes": int(torch.cuda.max_memory_allocated(trainer.device)) if cuda else None,
          "state_bytes_by_memory_kind": memory.by_memory_kind(state),
          "extra": {"state_bytes_by_category": state, "op_build_s": ops.build_s(), **info}}


def _rank_batch(io: SideIO, batches: np.ndarray, step: int) -> np.ndarray:
  """This rank's rows of step `step`'s micro batches, (A, micro_batch_size / world, T + 1) uint16: all of them with
  one rank; rank k of N reads rows [k*m, (k+1)*m) of each micro batch, m = micro_batch_size / N (docs/multirank.md)."""
  if io.world == 1:
    return np.asarray(batches[step])
  return np.asarray(batches[step, :, rank_rows(io.run.train.micro_batch_size, io.rank, io.world)])


def _check_ranks(io: SideIO, control) -> None:
  """Refuses what a multi-rank torch side does not do yet: checkpoints (each rank would write its own)."""
  if io.world > 1 and (control.save_at is not None or control.resume_dir is not None):
    raise ValueError(f"save_checkpoint_at_step/resume_from with {io.world} ranks: checkpoints of multi-rank sides "
                     "are not supported yet; run --resume-at with --nproc 1")


def side_main(io: SideIO) -> int:
  """Trains one torch side as the request describes; returns the exit code."""
  import torch
  from torch_impl import checkpoint
  from torch_impl.distributed import world_mean
  control = io.control()  # refusals (bad keys, a checkpoint of another run) end here, as 'crashed'
  _check_ranks(io, control)
  t = io.run.train
  _determinism(t.seed)
  trainer = _make_trainer(io, io.init_params())
  if control.resume_dir is not None:
    checkpoint.restore(trainer, control.resume_dir, control.resume_meta)
  batches, val = io.training_batches()  # shapes checked (parity.protocol.side.check_batch_shapes)
  sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
  from torch_impl import ops
  io.launch_time += ops.build_s()  # time in DeepSpeed op builds is not initialisation: off init_s (op_build_s)
  io.ready()
  sens, moments_error = AdamSensitivity(t.eps), None  # per-element Adam sensitivity for the params rule
  for step in control.steps():
    io.before_step(step, poison=trainer.poison)
    micro = _rank_batch(io, batches, step)
    sync()
    t0 = time.perf_counter()
    forced = {"force_overflow": True} if io.forced_overflow(step) else {}
    probe = step == control.first_step  # the first step is outside the median step time
    metrics = trainer.step(micro, probe=probe, **forced)
    metrics["loss"] = world_mean(metrics["loss"])  # several ranks: the whole micro batch's loss (rank means averaged)
    sync()
    dt = time.perf_counter() - t0
    val_loss = trainer.eval_loss(val) if val is not None and io.is_eval_step(step) else None
    if not io.record(step, step_time_s=dt, val_loss=val_loss, **metrics):
      io.finish("nan", error=f"non-finite loss or grad norm at step {step}: {metrics}", **_finish_kwargs(trainer))
      return EXIT_NAN
    if not metrics.get("skipped") and moments_error is None:
      try:  # the params rule falls back to its per-tensor form without them, and says so
        sens.add(trainer.final_moments(), float(metrics["lr"]))
      except (ValueError, KeyError, RuntimeError) as exc:
        moments_error = f"{type(exc).__name__}: {exc}"
    if step == control.save_at:
      io.save_checkpoint(step, lambda folder: checkpoint.save(trainer, folder, step),
                         trainer.describe()["versions"])
  kw = _finish_kwargs(trainer)
  moments = None
  if moments_error is None:
    rms = trainer.final_moments()
    moments = {"grad_rms": rms, "sensitivity": sens.result(rms)}
  else:
    kw["extra"]["moments_error"] = moments_error
  io.finish("ok", final_params=trainer.final_params(), final_moments=moments, **kw)
  return EXIT_OK


def main(argv: list[str] | None = None) -> int:
  return main_guard(side_main, argv)


if __name__ == "__main__":
  sys.exit(main())
