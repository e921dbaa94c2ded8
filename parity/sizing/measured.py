"""Predicted beside measured memory of a finished run (report.json), per side, category and memory kind: the memory
model's figures (parity.sizing.memory.estimate) set against what each side measured of its live state (numpy only).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from parity.sizing.memory import CATEGORIES, KINDS, estimate, totals
from parity.sizing.memory_jax import jax_state_bytes
from parity.spec import RunSpec, from_dict

__all__ = ["JAX_GROUPS", "predicted_vs_measured"]

def _run_of(report: dict[str, Any]) -> RunSpec:
  return from_dict(RunSpec, report["run"])


JAX_GROUPS = {"params": "params", "opt_state": "optimizer_moments"}
"""JAX state group (summary 'state_memory_kinds') -> the category of the other sides it is measured as (the params are
the fp32 masters; opt_state is Adam's mu and nu plus three scalar counters, 12 bytes)."""


def _jax_group_bytes(run: RunSpec) -> dict[str, int]:
  """Bytes per device of each JAX state group, {'params', 'opt_state'}: memory_jax.jax_state_bytes of the same run
  with the two groups placed in different memory kinds (params on the device, opt_state on the host)."""
  split = dataclasses.replace(run, jax=dataclasses.replace(run.jax, offload_params=False, offload_opt_state=True))
  by_kind = jax_state_bytes(split)
  return {"params": by_kind.get("device", 0), "opt_state": by_kind.get(run.jax.host_memory_kind, 0)}


def _jax_rows_compared(run: RunSpec, summ: dict[str, Any]) -> list[dict[str, Any]]:
  """JAX rows in the categories of the DeepSpeed and torch rows. Predicted: params and optimizer moments (opt_state)
  by parity.sizing.memory_jax, exactly as the live arrays (`_jax_group_bytes`); gradients and activations, which exist
  while the step runs, by `estimate`. Measured: the live state bytes of
  a group's memory kind, where that kind holds the group alone (summary 'state_memory_kinds'); when params and
  opt_state share a kind, their total is one measured 'state' row (predicted None: the predicted bar already has
  both; ratio: against their sum) and neither category is measured alone. master_params and buffers: 0 (the JAX state
  holds no such arrays).
  Gradients and activations live inside the jitted step: not measured (None)."""
  pred = totals(estimate(run, sides=("jax",)), "jax")
  for group, cat in JAX_GROUPS.items():
    kind = "host" if (run.jax.offload_params if group == "params" else run.jax.offload_opt_state) else "device"
    pred[cat] = {k: (_jax_group_bytes(run)[group] if k == kind else 0) for k in KINDS}
  by_kind: dict[str, int] = {}
  for k, v in (summ.get("state_bytes_by_memory_kind") or {}).items():
    key = "host" if k.endswith("host") else k
    by_kind[key] = by_kind.get(key, 0) + int(v)
  placed = {g: ("host" if k.endswith("host") else k) for g, k in (summ.get("state_memory_kinds") or {}).items()}
  meas: dict[tuple[str, str], int | None] = {}
  shared: set[str] = set()
  if by_kind:
    for cat in ("master_params", "buffers"):
      meas.update({(cat, k): 0 for k in KINDS})
    for group, cat in JAX_GROUPS.items():
      kind = placed.get(group)
      if kind is not None and list(placed.values()).count(kind) == 1:
        meas.update({(cat, k): by_kind.get(k, 0) if k == kind else 0 for k in KINDS})
      elif kind is not None:
        shared.add(kind)
  rows = [_row("jax", cat, kind, pred[cat][kind], meas.get((cat, kind))) for cat in CATEGORIES for kind in KINDS]
  for kind in KINDS:
    if kind in shared:  # ratio against the two predicted rows it sums
      both = sum(pred[c][kind] for c in JAX_GROUPS.values())
      rows.append({**_row("jax", "state", kind, None, by_kind.get(kind)),
                   "ratio": by_kind.get(kind, 0) / both if both else None})
  return rows


def predicted_vs_measured(report_json: dict[str, Any] | str) -> list[dict[str, Any]]:
  """Rows (side, category, memory kind, predicted, measured, ratio) for a finished run's report.json.

  Every side in the same categories (CATEGORIES), predicted by `estimate`. DeepSpeed, torch and fsdp: measured by
  torch_impl.memory on the live tensors (max over the probed moments of step 0); fsdp predicted for its summary's
  nproc ranks (parity.sizing.fsdp_memory, rank 0's shards). JAX: `_jax_rows_compared`
  (measured per state group from its memory kind's live bytes). measured None: the side does not measure that
  category (activations on every side; JAX gradients, inside the step). Every side also gets its peak host RSS
  (measured only: it includes the libraries and the data). ratio = measured / predicted (None when either is
  missing or predicted is 0).
  """
  if isinstance(report_json, str):
    with open(report_json) as f:
      report_json = json.load(f)
  run = _run_of(report_json)
  rows: list[dict[str, Any]] = []
  for side, info in report_json.get("sides", {}).items():
    summ = info.get("summary") or {}
    if side in ("deepspeed", "torch", "fsdp"):
      ranks = int(summ.get("nproc") or 1) if side == "fsdp" else 1  # FSDP2 shards over its ranks (rank 0's figures)
      pred = totals(estimate(run, ranks=ranks, sides=(side,)), side)
      meas = summ.get("state_bytes_by_category") or {}
      order = lambda c: (CATEGORIES.index(c) if c in CATEGORIES else len(CATEGORIES), c)  # as JAX's
      for cat in sorted(set(CATEGORIES) | set(meas), key=order):
        for kind in KINDS:
          rows.append(_row(side, cat, kind, pred.get(cat, {}).get(kind), (meas.get(cat) or {}).get(kind)))
    elif side == "jax":
      rows += _jax_rows_compared(run, summ)
    rows.append(_row(side, "peak_rss", "host", None, summ.get("peak_host_rss_bytes")))
  return rows


def _row(side: str, category: str, kind: str, predicted: int | None, measured: int | None) -> dict[str, Any]:
  ratio = measured / predicted if predicted and measured is not None else None
  return {"side": side, "category": category, "memory_kind": kind, "predicted": predicted,
          "measured": measured, "ratio": ratio}
