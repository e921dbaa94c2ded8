"""Runs that hold one side against itself: the noise envelope, determinism, and checkpoint/resume.

Each lives in a subfolder of the comparison's run folder, with its own request.json that points at
the parent's weights and batches (`parity.protocol.derive_request`):

  run_dir/noise/     each side rerun with every step's micro batches in reverse order and the rows of
                     each micro batch reordered (`noise_row_order`: reversed, and on several ranks
                     dealt across them; batches.npy of its own). The mean loss and the accumulated
                     gradient are the same numbers in exact arithmetic; only the order of floating-point
                     reductions changes. |loss - loss_noise| per step is the noise envelope of that side
                     at this precision (parity.verdict.envelope.envelope_check).
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
from parity.protocol.ranks import read_launch

__all__ = ["NOISE_DIR", "REPEAT_DIR", "RESUME_DIR", "BACKEND_DIR", "CPU_ENV", "noise_row_order", "noise_blind_reason",
           "reversed_batches", "run_order", "run_noise",
           "run_repeat", "run_resume", "run_backend"]

CPU_ENV = {"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}
"""The environment that puts a side on the host CPU: JAX's CPU backend only, no CUDA device for torch."""


def noise_row_order(rows: int, world: int = 1, across_ranks: bool = True) -> np.ndarray:
  """The order of a micro batch's rows in the noise rerun: a permutation that changes how every sum over rows is
  grouped, so that the rerun differs from the run by rounding and by nothing else.

  Why not plain reversal on several ranks: rank k trains rows [k*r, (k+1)*r) (r = rows / world,
  parity.protocol.ranks.rank_rows). Reversal hands rank k the rows of rank world-1-k, reversed, so each rank sums
  the same rows, and with r <= 2 in the other order; and world 2 sums the ranks' two partials in the other order.
  A sum of two terms is commutative in IEEE arithmetic (a + b == b + a, bit for bit), so with 2 rows per rank on 2
  ranks the reversed rerun repeats the run exactly (measured: gemma2-tiny bf16 packed, 2 ranks, micro batch 4: the
  rerun's grad norm bit-identical to the run's on steps 0-8 for jax and 0-10 for deepspeed, where 1 rank differs
  from step 0), and the envelope falls to its floor. Dealing the rows across the ranks first (rank k gets rows k,
  k + world, ... of the original order, then all reversed) gives every rank other rows, so each partial sum, and
  the sum of the partials, is grouped differently.

  Args:
    rows: B, the global micro batch; world: the ranks it is split over (B a multiple of it).
    across_ranks: rows may move between ranks (train.loss_normalization 'tokens': one token mean over the step).
      False for 'micro_mean', whose objective is a mean per rank's micro batch: then each rank keeps one original
      rank's rows (the whole order reversed).
  Returns:
    int64 indices (B,): new row j is old row order[j].
  """
  idx = np.arange(rows, dtype=np.int64)
  if across_ranks and world > 1 and rows // world >= 2:
    idx = idx.reshape(world, rows // world).T.reshape(-1)  # deal: rank k's slots hold rows k, k + world, ...
  return np.ascontiguousarray(idx[::-1])


def noise_blind_reason(rows: int, grad_accum_steps: int, world: int = 1, across_ranks: bool = True) -> str | None:
  """Why no reordering of rows and micro batches can change the rounding of a step (`noise_row_order`), or None.

  Each sum a reorder can regroup then has at most two terms: at most 2 rows per rank that keep their rank (1 row per
  rank, or 'micro_mean', or 1 rank), at most 2 ranks, at most 2 micro batches. a + b == b + a exactly, so the rerun
  would repeat the run bit for bit and measure no noise at all.
  """
  r = rows // max(world, 1)
  regroups = r >= 3 or (across_ranks and world > 1 and r >= 2) or world >= 3 or grad_accum_steps >= 3
  if regroups:
    return None
  where = f"{r} row{'s' if r != 1 else ''} per rank on {world} rank{'s' if world != 1 else ''}"
  return (f"every sum a reordering could regroup has at most two terms here ({where}, {grad_accum_steps} micro "
          f"batch{'es' if grad_accum_steps != 1 else ''} a step), and a + b == b + a exactly in floating point, so "
          "the reduction-order rerun would repeat each side bit for bit and measure no noise")


def reversed_batches(batches_samtp1: np.ndarray, order: np.ndarray | None = None) -> np.ndarray:
  """The same tokens with each step's micro batches in reverse order and each micro batch's rows in `order`.

  Args:
    batches_samtp1: token ids (steps, grad_accum_steps, micro_batch_size, seq_len + 1), or an example array of
      that layout (segment ids, positions, loss mask).
    order: the rows' order (`noise_row_order`); None: reversed (one rank).
  Returns:
    A contiguous array of the same shape and dtype. Every step holds the same sequences, so its mean
    loss and accumulated gradient are unchanged in exact arithmetic.
  Raises:
    ValueError: the array is not 4-D, or `order` is not a permutation of its rows.
  """
  if batches_samtp1.ndim != 4:
    raise ValueError(f"batches must be (steps, grad_accum_steps, micro_batch_size, seq_len + 1); "
                     f"got shape {batches_samtp1.shape}")
  rows = batches_samtp1.shape[2]
  order = np.arange(rows)[::-1] if order is None else np.asarray(order)
  if sorted(order.tolist()) != list(range(rows)):
    raise ValueError(f"row order {order.tolist()} is not a permutation of the {rows} rows of a micro batch")
  return np.ascontiguousarray(batches_samtp1[:, ::-1][:, :, order, :])


def run_order(run_dir: Path) -> np.ndarray:
  """`noise_row_order` of the run in run_dir: its micro batch, its ranks (launch.json, times jax.data_parallel) and
  its loss normalisation (request.json)."""
  request = json.loads((Path(run_dir) / "request.json").read_text())
  train, jx = request["run"]["train"], request["run"].get("jax") or {}
  launch = read_launch(run_dir)
  world = int(launch["nproc"]) * int(launch["nnodes"]) * int(jx.get("data_parallel") or 1)
  return noise_row_order(int(train["micro_batch_size"]), world,
                         across_ranks=train.get("loss_normalization", "tokens") == "tokens")


def run_noise(run_dir: Path, side: str, *, timeout_s: float,
              on_progress: Callable[[str, int], None] | None = None) -> tuple[SideRun, list[dict]]:
  """Reruns `side` on reversed batches in run_dir/noise/, configured exactly as its main run (perturbations
  included: the rerun must differ from that run by reduction order only). Returns (run, its StepRecords)."""
  sub = derive_request(run_dir, NOISE_DIR, batches="batches.npy").parent  # refuses another run's noise/ folder
  tmp = sub / "batches.npy.tmp.npy"  # always from this run's batches, never a file found there
  order = run_order(run_dir)
  np.save(tmp, reversed_batches(np.load(Path(run_dir) / "batches.npy", mmap_mode="r"), order))
  tmp.replace(sub / "batches.npy")
  _reverse_example_arrays(Path(run_dir), sub, order)
  sr = run_side(sub, side, timeout_s=timeout_s, on_progress=on_progress)
  return sr, read_steps(sub / side / "steps.jsonl")


def _reverse_example_arrays(run_dir: Path, sub: Path, order: np.ndarray | None = None) -> None:
  """Padded/packed: the training arrays beside the batches reordered the same way (`reversed_batches` with `order`),
  written into `sub` and named by its request; nothing on the stream layout."""
  path = sub / "request.json"
  request = json.loads(path.read_text())
  arrays = (request.get("examples") or {}).get("arrays")
  if not arrays:
    return
  for name, file in list(arrays.items()):
    src = np.load(run_dir / Path(file).name, mmap_mode="r")
    tmp = sub / f"{name}.npy.tmp.npy"
    np.save(tmp, reversed_batches(src, order))
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
