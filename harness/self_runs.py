"""Runs that hold one side against itself: the noise envelope, determinism, and checkpoint/resume.

Each lives in a subfolder of the comparison's run folder, with its own request.json that points at
the parent's weights and batches (`parity.protocol.derive_request`):

  run_dir/noise/     each side rerun with every step's micro batches, and the rows of each micro
                     batch, in reverse order (batches.npy of its own). The mean loss and the
                     accumulated gradient are the same numbers in exact arithmetic; only the order
                     of floating-point reductions changes. |loss - loss_noise| per step is the noise
                     envelope of that side at this precision (parity.verdict.envelope.envelope_check).
  run_dir/repeat/    each side rerun for a prefix (steps 0..K, `stop_after_step`), optionally saving
                     a checkpoint at step R (`save_checkpoint_at_step`); bitwise equal to the main run
                     when the side is deterministic.
  run_dir/resume/    each side resumed in a new process from repeat/'s checkpoint (`resume_from`),
                     running steps R+1..end; bitwise equal to the main run when checkpointing is exact.
  run_dir/backend/   each side that ran on an accelerator, rerun on the host CPU (the same request, batches and
                     weights; JAX_PLATFORMS=cpu, no CUDA device visible): |side - side on CPU| per step is how far
                     that backend's arithmetic moves the side (parity.verdict.backend).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np

from harness.runner import SideRun, run_side
from parity.protocol import derive_request, read_steps
from parity.protocol.layout import BACKEND_DIR, NOISE_DIR, REPEAT_DIR, RESUME_DIR

__all__ = ["NOISE_DIR", "REPEAT_DIR", "RESUME_DIR", "BACKEND_DIR", "CPU_ENV", "reversed_batches", "run_noise",
           "run_repeat", "run_resume", "run_backend"]

CPU_ENV = {"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}
"""The environment that puts a side on the host CPU: JAX's CPU backend only, no CUDA device for torch."""


def reversed_batches(batches_samtp1: np.ndarray) -> np.ndarray:
  """The same tokens with each step's micro batches, and each micro batch's rows, in reverse order.

  Args:
    batches_samtp1: token ids (steps, grad_accum_steps, micro_batch_size, seq_len + 1).
  Returns:
    A contiguous array of the same shape and dtype. Every step holds the same sequences, so its mean
    loss and accumulated gradient are unchanged in exact arithmetic.
  Raises:
    ValueError: the array is not 4-D.
  """
  if batches_samtp1.ndim != 4:
    raise ValueError(f"batches must be (steps, grad_accum_steps, micro_batch_size, seq_len + 1); "
                     f"got shape {batches_samtp1.shape}")
  return np.ascontiguousarray(batches_samtp1[:, ::-1, ::-1, :])


def run_noise(run_dir: Path, side: str, *, timeout_s: float,
              on_progress: Callable[[str, int], None] | None = None) -> tuple[SideRun, list[dict]]:
  """Reruns `side` on reversed batches in run_dir/noise/, configured exactly as its main run (perturbations
  included: the rerun must differ from that run by reduction order only). Returns (run, its StepRecords)."""
  sub = derive_request(run_dir, NOISE_DIR, batches="batches.npy").parent  # refuses another run's noise/ folder
  tmp = sub / "batches.npy.tmp.npy"  # always from this run's batches, never a file found there
  np.save(tmp, reversed_batches(np.load(Path(run_dir) / "batches.npy", mmap_mode="r")))
  tmp.replace(sub / "batches.npy")
  _reverse_example_arrays(Path(run_dir), sub)
  sr = run_side(sub, side, timeout_s=timeout_s, on_progress=on_progress)
  return sr, read_steps(sub / side / "steps.jsonl")


def _reverse_example_arrays(run_dir: Path, sub: Path) -> None:
  """Padded/packed: the training arrays beside the batches reversed the same way (`reversed_batches`' axes), written
  into `sub` and named by its request; nothing on the stream layout."""
  path = sub / "request.json"
  request = json.loads(path.read_text())
  arrays = (request.get("examples") or {}).get("arrays")
  if not arrays:
    return
  for name, file in list(arrays.items()):
    src = np.load(run_dir / Path(file).name, mmap_mode="r")
    tmp = sub / f"{name}.npy.tmp.npy"
    np.save(tmp, np.ascontiguousarray(src[:, ::-1, ::-1, :]))
    tmp.replace(sub / f"{name}.npy")
    arrays[name] = f"{name}.npy"
  path.write_text(json.dumps(request, indent=2))


def run_backend(run_dir: Path, side: str, *, timeout_s: float) -> tuple[SideRun, list[dict]]:
  """Reruns `side` on the host CPU (CPU_ENV) in run_dir/backend/, configured exactly as its main run (same request,
  batches, weights and perturbations): only the backend's arithmetic differs. Returns (run, its StepRecords)."""
  sub = derive_request(run_dir, BACKEND_DIR).parent
  sr = run_side(sub, side, timeout_s=timeout_s, env=dict(CPU_ENV))
  return sr, read_steps(sub / side / "steps.jsonl")


def run_repeat(run_dir: Path, side: str, *, stop_after_step: int, save_checkpoint_at_step: int | None,
               timeout_s: float) -> tuple[SideRun, list[dict]]:
  """Reruns `side` (same request, perturbations included) for steps 0..stop_after_step in run_dir/repeat/."""
  keys = {"stop_after_step": int(stop_after_step)}
  if save_checkpoint_at_step is not None:
    keys["save_checkpoint_at_step"] = int(save_checkpoint_at_step)
  sub = derive_request(run_dir, REPEAT_DIR, **keys).parent
  sr = run_side(sub, side, timeout_s=timeout_s)
  return sr, read_steps(sub / side / "steps.jsonl")


def run_resume(run_dir: Path, side: str, *, timeout_s: float) -> tuple[SideRun, list[dict], Path]:
  """Resumes `side` from run_dir/repeat/<side>/checkpoint in a new process, in run_dir/resume/.

  Returns:
    (run, its StepRecords (from the checkpoint step + 1 on), the folder holding its final.safetensors).
  """
  sub = derive_request(run_dir, RESUME_DIR, resume_from=f"../{REPEAT_DIR}/{{side}}/checkpoint").parent
  sr = run_side(sub, side, timeout_s=timeout_s)
  return sr, read_steps(sub / side / "steps.jsonl"), sub / side
