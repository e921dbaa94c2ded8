"""What each side ran of the run's `--perturb` values and fault injections (report.json 'perturbations'): the
value read back from the side's own records, and whether it was applied."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from parity.numerics import schedule
from parity.numerics.ds_json import TRAIN_KEY_PATHS, config_value
from parity.protocol.layout import (ACCELERATOR_PLANT_KEYS, DEBUG_KEYS, OFFLOAD_PLANT_KEYS, OPTIMIZER_PLANT_KEYS,
                                    PLANT_KEYS)
from parity.overrides import apply_overrides
from parity.spec import RunSpec, from_dict

__all__ = ["LR_KEYS", "ran_value", "perturbations_ran"]


def _request(run_dir: Path) -> dict[str, Any]:
  try:
    return json.loads((Path(run_dir) / "request.json").read_text())
  except (OSError, ValueError):
    return {}


LR_KEYS = frozenset({"train.lr", "train.lr_schedule", "train.lr_schedule_params", "train.warmup_steps",
                     "train.warmup_min_ratio", "train.cos_min_ratio"})
"""Perturbation keys that shape the learning rate of each step: the steps' own lr is read back for them."""
_GROUP_KEYS = {"train.beta1": ("betas", 0), "train.beta2": ("betas", 1), "train.eps": ("eps", None),
               "train.weight_decay": ("weight_decay", None), "train.momentum": ("momentum", None),
               "train.dampening": ("dampening", None), "train.nesterov": ("nesterov", None),
               "train.lamb_max_coeff": ("max_coeff", None), "train.lamb_min_coeff": ("min_coeff", None),
               "train.eps_inside_sqrt": ("eps_inside_sqrt", None)}
"""Spec keys the DeepSpeed optimizer's param groups hold (summary.json optimizer_hyperparams): (name, index)."""


def ran_value(side: dict, key: str) -> dict[str, Any]:
  """The value of spec `key` a side ran with, read from what it recorded, and where it was read.

  Order: the DeepSpeed optimizer's own param groups (optimizer_hyperparams; weight_decay: the decayed group's, the
  largest), then the DeepSpeed config the side was given (summary.json ds_config), then the spec the side built
  itself from (summary.json spec). Returns {value, from}; {value: None, from: 'nothing: ...'} when the side
  wrote no summary.
  """
  summ = side.get("summary") or {}
  groups = summ.get("optimizer_hyperparams") or []
  if key in _GROUP_KEYS and groups and all(_GROUP_KEYS[key][0] in g for g in groups):
    name, idx = _GROUP_KEYS[key]
    vals = [g[name] if idx is None else g[name][idx] for g in groups]
    return {"value": max(vals) if name == "weight_decay" else vals[0],
            "from": f"the DeepSpeed optimizer's param groups, {name}"}
  found, value = config_value(summ.get("ds_config"), key)
  if found:
    return {"value": value, "from": f"its DeepSpeed config, {TRAIN_KEY_PATHS.get(key, 'bf16/fp16.enabled')}"}
  node: Any = summ.get("spec")
  for part in key.split("."):
    node = node.get(part) if isinstance(node, dict) else None
  if isinstance(summ.get("spec"), dict):
    return {"value": node, "from": "the spec it built itself from, summary.json spec"}
  return {"value": None, "from": "nothing: the side wrote no summary.json"}


def _peak_lr(side: dict) -> float | None:
  vals = [v for v in ((side.get("series") or {}).get("lr") or []) if isinstance(v, (int, float)) and v == v]
  return max(vals) if vals else None


def _same(a: Any, b: Any) -> bool:
  if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
    return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=0.0)
  if isinstance(a, str) and isinstance(b, str):
    return a.lower() == b.lower()
  if isinstance(a, dict) and isinstance(b, dict):  # a config's scheduler params hold every default; the spec's fewer
    return all(k in b and _same(v, b[k]) for k, v in a.items())
  return a == b


def _expected_peak(request: dict[str, Any], side: str) -> float | None:
  """The highest lr the side's perturbed spec schedules over the run (parity.numerics.schedule.train_lr)."""
  try:
    fields = {k: v for k, v in ((request.get("perturb") or {}).get(side) or {}).items() if k not in DEBUG_KEYS}
    t = apply_overrides(from_dict(RunSpec, request["run"]), fields).train
    return max(schedule.train_lr(t, k) for k in range(t.steps))
  except (KeyError, TypeError, ValueError):
    return None


def _applied(row: dict[str, Any], sides: dict) -> bool | None:
  """Whether the perturbed side ran the requested value (and, for lr keys, the peak lr its perturbed spec schedules,
  read from its steps); None when that side did not finish (nothing complete to read back)."""
  side = sides.get(row["side"]) or {}
  if side.get("status") != "ok":
    return None
  ok = _same(row["value"], row["ran"][row["side"]]["value"])
  if "peak_lr" in row and row["peak_lr"].get(row["side"]) is not None and row["expected_peak_lr"] is not None:
    ok = ok and math.isclose(row["peak_lr"][row["side"]], row["expected_peak_lr"], rel_tol=1e-5)
  return bool(ok)


def perturbations_ran(run_dir: Path, sides: dict) -> list[dict[str, Any]]:
  """report.json 'perturbations': every requested `--perturb` spec change with the value each side ran.

  Args:
    run_dir: the run folder (request.json 'perturbations', as parity.pipeline.perturb.plan_perturbations wrote
      them; an older or derived request without them: its 'perturb' fields).
    sides: report.json 'sides' (each side's summary and series).
  Returns:
    [{side, key, value (requested), applies, deepspeed_config, note, ran {side: {value, from}}, peak_lr {side} and
      expected_peak_lr (lr keys), applied (True/False; None when the perturbed side did not finish)}], then the
    fault injections (`_injections`: applies None); [] for none.
  """
  req = _request(run_dir)
  recs = req.get("perturbations")
  if recs is None:
    recs = [{"side": sd, "key": k, "value": v, "applies": {k: v}, "deepspeed_config": None, "note": None}
            for sd, kv in (req.get("perturb") or {}).items() for k, v in kv.items() if k not in DEBUG_KEYS]
  out = []
  for r in recs:
    row = {k: r.get(k) for k in ("side", "key", "value", "applies", "deepspeed_config", "note")}
    row["ran"] = {name: ran_value(s, r["key"]) for name, s in sides.items()}
    if r["key"] in LR_KEYS:
      row["peak_lr"] = {name: _peak_lr(s) for name, s in sides.items()}
      row["expected_peak_lr"] = _expected_peak(req, r["side"])
    row["applied"] = _applied(row, sides)
    out.append(row)
  return out + _injections(req, sides)


def _recorded_injection(side: dict, key: str) -> dict[str, Any]:
  """{value, from} of fault injection / planted bug `key` as a side recorded it (summary.json 'perturbed'); a side
  whose summary has no 'perturbed' record (one the harness wrote for a side that timed out or was killed) says so
  rather than naming a record that is not there."""
  summ = side.get("summary") or {}
  if not summ:
    return {"value": None, "from": "nothing: the side wrote no summary.json"}
  if not isinstance(summ.get("perturbed"), dict):
    why = " (the harness wrote it: the side did not finish)" if side.get("status") != "ok" else ""
    return {"value": None, "from": f"nothing: its summary.json{why} has no perturbed record"}
  return {"value": summ["perturbed"].get(key), "from": "summary.json perturbed"}


def _injections(request: dict[str, Any], sides: dict) -> list[dict[str, Any]]:
  """The fault injections (DEBUG_KEYS: nan_at_step, kill_at_step, ...) each side was asked for, with what each side
  recorded of them (summary.json 'perturbed'); applied is None when the side did not finish (a kill or hang does
  not let it)."""
  out = []
  for side, kv in (request.get("perturb") or {}).items():
    for key in (k for k in kv if k in DEBUG_KEYS):
      ran = {n: _recorded_injection(s, key) for n, s in sides.items()}
      done = (sides.get(side) or {}).get("status") == "ok" or (ran.get(side) or {}).get("value") is not None
      out.append({"side": side, "key": key, "value": kv[key], "applies": None, "deepspeed_config": None,
                  "note": ("a planted optimizer bug" if key in OPTIMIZER_PLANT_KEYS else "a planted data bug"
                           if key in PLANT_KEYS else "a planted activation-offload bug" if key in OFFLOAD_PLANT_KEYS
                           else "a planted accelerator-only error" if key in ACCELERATOR_PLANT_KEYS
                           else "a fault injection"), "ran": ran,
                  "applied": _same(kv[key], ran[side]["value"]) if done and side in ran else None})
  return out
