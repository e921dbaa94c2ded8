"""Predicted beside measured memory of a finished run (report.json), per side, category and memory kind: the memory
model's figures (parity.sizing.memory.estimate) set against what each side measured of its live state (numpy only).
"""
from __future__ import annotations

import json
from typing import Any

from parity.sizing.memory import CATEGORIES, KINDS, estimate, totals
from parity.sizing.memory_jax import jax_group_bytes
from parity.spec import RunSpec, from_dict

__all__ = ["JAX_GROUPS", "predicted_vs_measured", "kinds_of"]

def _run_of(report: dict[str, Any]) -> RunSpec:
  return from_dict(RunSpec, report["run"])


JAX_GROUPS = {"params": "params", "opt_state": "optimizer_moments"}
"""JAX state group (summary 'state_memory_kinds') -> the category of the other sides it is measured as (the params are
the fp32 masters; opt_state is Adam's mu and nu plus three scalar counters, 12 bytes)."""


def _host_or_device(kind: str) -> str:
  return "host" if kind.endswith("host") else kind


def kinds_of(placed: str) -> list[str]:
  """The memory kinds of one entry of a summary's 'state_memory_kinds' (jax_impl.offload.state_memory_kinds):
  ['pinned_host'], or ['device', 'pinned_host'] for 'mixed(device,pinned_host)' (a partly offloaded optimizer
  state)."""
  placed = str(placed)
  return placed[len("mixed("):-1].split(",") if placed.startswith("mixed(") and placed.endswith(")") else [placed]


def _placed_kinds(summ: dict[str, Any]) -> dict[str, set[str]]:
  """State group -> the kinds ('device', 'host') its live leaves are in, from the summary's 'state_memory_kinds'."""
  return {g: {_host_or_device(k) for k in kinds_of(v)} for g, v in (summ.get("state_memory_kinds") or {}).items()}


def _jax_rows_compared(run: RunSpec, summ: dict[str, Any]) -> list[dict[str, Any]]:
  """JAX rows in the categories of the DeepSpeed and torch rows. Predicted: params and optimizer moments (opt_state)
  by parity.sizing.memory_jax.jax_group_bytes, exactly as the live arrays (a partly offloaded optimizer state in both
  kinds); gradients and activations, which exist while the step runs, by `estimate`. Measured: the live state bytes
  of a memory kind where that kind holds one group alone (summary 'state_memory_kinds'), the group's other kind 0
  when it holds none there; a kind that two groups share is one measured 'state' row (predicted None: the predicted
  bars already have both; ratio: against their sum), and a group in it is not measured alone there (nor, when its
  every kind is shared, at all). master_params and buffers: 0 (the JAX state holds no such arrays).
  Gradients and activations live inside the jitted step: not measured (None)."""
  pred = totals(estimate(run, sides=("jax",)), "jax")
  for group, by_kind in jax_group_bytes(run).items():
    pred[JAX_GROUPS[group]] = {k: sum(b for kind, b in by_kind.items() if _host_or_device(kind) == k) for k in KINDS}
  by_kind: dict[str, int] = {}
  for k, v in (summ.get("state_bytes_by_memory_kind") or {}).items():
    by_kind[_host_or_device(k)] = by_kind.get(_host_or_device(k), 0) + int(v)
  placed = _placed_kinds(summ)
  owners = {k: [g for g, kinds in placed.items() if k in kinds] for k in KINDS}
  meas: dict[tuple[str, str], int | None] = {}
  if by_kind:
    for cat in ("master_params", "buffers"):
      meas.update({(cat, k): 0 for k in KINDS})
    for group, cat in JAX_GROUPS.items():
      kinds = placed.get(group, set())
      alone = bool(kinds) and all(owners[k] == [group] for k in kinds)
      for k in KINDS:
        if owners[k] == [group]:
          meas[(cat, k)] = by_kind.get(k, 0)
        elif alone:
          meas[(cat, k)] = 0
  rows = [_row("jax", cat, kind, pred[cat][kind], meas.get((cat, kind))) for cat in CATEGORIES for kind in KINDS]
  for kind in KINDS:
    if by_kind and len(owners[kind]) > 1:  # ratio against the predicted rows it sums
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
