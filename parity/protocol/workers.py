"""The one registry of worker modules: which module runs which side for which job.

Every process that runs framework code is `python -m harness.boot <module> ...` started by `harness` (the only
place that launches processes), and the module comes from here:

  job 'train'        a side of `parity compare` (and its reruns): `<module> run_dir/request.json --side S`
  job 'diagnose'     one step with every intermediate tensor (`parity diagnose`), same arguments
  job 'port_verify'  a ported DeepSpeed config's optimizer run N steps (`parity port --verify`):
                     `<module> REQUEST.json OUT.npz`

Adding a side means adding its rows here (docs/architecture.md).
"""
from __future__ import annotations

__all__ = ["WORKERS", "JOBS", "worker_module", "workers_for", "SIDE_WORKERS", "DIAGNOSE_WORKERS"]

JOBS = ("train", "diagnose", "port_verify")
WORKERS: dict[tuple[str, str], str] = {
    ("jax", "train"): "jax_impl.worker",
    ("deepspeed", "train"): "torch_impl.worker",
    ("torch", "train"): "torch_impl.worker",
    ("fsdp", "train"): "torch_impl.fsdp_worker",
    ("jax", "diagnose"): "jax_impl.diagnose",
    ("torch", "diagnose"): "torch_impl.diagnose",  # DeepSpeed runs the torch model: it is diagnosed as 'torch'
    ("jax", "port_verify"): "jax_impl.port_verify",
    ("deepspeed", "port_verify"): "torch_impl.port_verify",
}
"""(side, job) -> the worker module (dotted, run with `python -m`)."""


def workers_for(job: str) -> dict[str, str]:
  """{side: module} of one job, in registry order.

  Raises:
    ValueError: an unknown job (the message lists JOBS).
  """
  if job not in JOBS:
    raise ValueError(f"unknown worker job {job!r}; the jobs are {', '.join(JOBS)}")
  return {side: module for (side, j), module in WORKERS.items() if j == job}


def worker_module(side: str, job: str = "train") -> str:
  """The module that runs `side` for `job`.

  Raises:
    ValueError: an unknown job, or a side that has no worker for it (the message lists the sides that do).
  """
  sides = workers_for(job)
  if side not in sides:
    raise ValueError(f"no {job!r} worker for side {side!r}; the sides with one are {', '.join(sides)}")
  return sides[side]


SIDE_WORKERS = workers_for("train")
"""Side name -> the module running that side of a comparison (job 'train')."""
DIAGNOSE_WORKERS = workers_for("diagnose")
"""Side name -> the module running `parity diagnose` for that side (job 'diagnose')."""
