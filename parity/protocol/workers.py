"""The worker modules: which module runs which side for which job, read from the sides' records (parity.sides).

Every process that runs framework code is `python -m harness.boot <module> ...` started by `harness` (the only
place that launches processes), and the module comes from here:

  job 'train'        a side of `parity compare` (and its reruns): `<module> run_dir/request.json --side S`
  job 'diagnose'     one step with every intermediate tensor (`parity diagnose`), same arguments
  job 'port_verify'  a ported DeepSpeed config's optimizer run N steps (`parity port --verify`):
                     `<module> REQUEST.json OUT.npz`

A side's modules are its record's `workers` (docs/adding-a-side.md); the tables below are views of the registry, so
a side registered later is in them.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

from parity.sides import JOBS, all_sides

__all__ = ["WORKERS", "JOBS", "worker_module", "workers_for", "SIDE_WORKERS", "DIAGNOSE_WORKERS"]


def _pairs() -> dict[tuple[str, str], str]:
  """(side, job) -> module over every registered side, jobs in JOBS order within a side."""
  return {(r.name, job): r.workers[job] for r in all_sides() for job in JOBS if job in r.workers}


class _RegistryView(Mapping):
  """A read-only mapping computed from the side registry at each use (`build`: () -> dict)."""

  def __init__(self, build):
    self._build = build

  def __getitem__(self, key):
    return self._build()[key]

  def __iter__(self) -> Iterator:
    return iter(self._build())

  def __len__(self) -> int:
    return len(self._build())

  def __repr__(self) -> str:
    return repr(self._build())


def workers_for(job: str) -> dict[str, str]:
  """{side: module} of one job, in registry order.

  Raises:
    ValueError: an unknown job (the message lists JOBS).
  """
  if job not in JOBS:
    raise ValueError(f"unknown worker job {job!r}; the jobs are {', '.join(JOBS)}")
  return {r.name: r.workers[job] for r in all_sides() if job in r.workers}


def worker_module(side: str, job: str = "train") -> str:
  """The module that runs `side` for `job`.

  Raises:
    ValueError: an unknown job, or a side that has no worker for it (the message lists the sides that do).
  """
  sides = workers_for(job)
  if side not in sides:
    raise ValueError(f"no {job!r} worker for side {side!r}; the sides with one are {', '.join(sides)}")
  return sides[side]


WORKERS: Mapping[tuple[str, str], str] = _RegistryView(_pairs)
"""(side, job) -> the worker module (dotted, run with `python -m`)."""
SIDE_WORKERS: Mapping[str, str] = _RegistryView(lambda: workers_for("train"))
"""Side name -> the module running that side of a comparison (job 'train')."""
DIAGNOSE_WORKERS: Mapping[str, str] = _RegistryView(lambda: workers_for("diagnose"))
"""Side name -> the module running `parity diagnose` for that side (job 'diagnose')."""
