"""What the report shows of the sides' semantics cards (report.json 'semantics', parity.report.build.semantics_section):
the item table of report.md and report.html and the card.json block. A run without cards (a report of sides that
wrote none) shows nothing."""
from __future__ import annotations

import json
from typing import Any

from parity.report.run_record import RunRecord
from parity.semantics import ITEM_ATOL, LIST_ATOL, NAME_LISTS, layers_text, precision_rows

__all__ = ["semantics_headers", "semantics_rows", "semantics_card_block", "SEMANTICS_INTRO", "PRECISION_INTRO",
           "precision_headers", "precision_table"]

PRECISION_INTRO = ("The precision settings each side ran with (its card's info): backend, device, its framework's "
                   "float32 matmul setting and the environment flags that can change rounding. A difference is shown, "
                   "not failed: the matmul.precision item above gates, and a pair on two backends is held to the "
                   "table plus the accelerator side's measured shift (the *_backend checks).")

SEMANTICS_INTRO = ("Each side's conventions, read from its own built model and optimizer before step 1 "
                   "(parity.semantics): a row that differs is the 'semantics' check's FAIL at step 0.")


def _sides_with_cards(rec: RunRecord) -> list[str]:
  return list(rec.semantics_cards)


def _value(v: Any, item: str = "optimizer.decay_set") -> str:
  """A card value as a table cell: a name list (the decay set) by its length and first names, a per-layer list
  (rotary.per_layer, attention.window) in round brackets."""
  if isinstance(v, list) and item not in NAME_LISTS:
    return layers_text(v)
  if isinstance(v, list):
    return f"{len(v)} names: " + ", ".join(map(str, v[:3])) + (", ..." if len(v) > 3 else "")
  return "null" if v is None else v if isinstance(v, str) else json.dumps(v)


def semantics_headers(rec: RunRecord) -> list[str]:
  """['item', <side>..., 'agree'] over the sides with a card."""
  return ["item", *_sides_with_cards(rec), "agree"]


def semantics_rows(rec: RunRecord) -> list[list[str]]:
  """One row per card item: the item, each side's value, 'yes' or 'NO'; [] without cards."""
  sides = _sides_with_cards(rec)
  if not sides:
    return []
  return [[r["item"], *(_value(r["values"].get(s), r["item"]) for s in sides), agree_text(r)]
          for r in rec.semantics_rows]


def agree_text(row: dict[str, Any]) -> str:
  """'yes' (the same value on every side), 'NO', or, for an item compared within a tolerance (ITEM_ATOL:
  forward.probe_loss; LIST_ATOL: optimizer.betas) whose values differ, 'yes, within 2.5e-05' (the tolerance, so two
  different numbers never read as equal)."""
  if not row["agree"]:
    return "NO"
  if row["item"] in LIST_ATOL:
    same = len({json.dumps(v) for v in row["values"].values()}) < 2
    return "yes" if same else f"yes, within {LIST_ATOL[row['item']]:.2g}"
  values = [float(v) for v in row["values"].values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
  if row["item"] not in ITEM_ATOL or len(set(values)) < 2:
    return "yes"
  tol = max(ITEM_ATOL[row["item"]](a, b) for a in values for b in values)
  return f"yes, within {tol:.2g}"


def semantics_card_block(rec: RunRecord) -> dict[str, Any] | None:
  """card.json 'semantics': {agree, differences [{item, values {side: value}}], items {side: {item: value}},
  precision_settings {differences [{setting, values}], values {setting: {side: value}}} (shown, not gating)}; None
  without cards."""
  cards = rec.semantics_cards
  if not cards:
    return None
  diffs = [{"item": r["item"], "values": r["values"]} for r in rec.semantics_rows if not r["agree"]]
  settings = precision_rows(cards)
  return {"agree": not diffs, "differences": diffs,
          "items": {s: (c or {}).get("items") for s, c in cards.items()},
          "precision_settings": {"differences": [{"setting": r["setting"], "values": r["values"]}
                                                 for r in settings if r["agree"] is False],
                                 "values": {r["setting"]: r["values"] for r in settings}}}


def precision_headers(rec: RunRecord) -> list[str]:
  """['setting', <side>..., 'same'] over the sides whose card records precision settings."""
  rows = precision_rows(rec.semantics_cards)
  return ["setting", *(rows[0]["values"] if rows else []), "same"]


def precision_table(rec: RunRecord) -> list[list[str]]:
  """One row per precision setting: each side's value ('unset' for an unset variable), 'yes' or 'differs'; []
  without such cards."""
  return [[r["setting"], *("unset" if v is None else str(v) for v in r["values"].values()),
           "yes" if r["agree"] else "framework's own words" if r["agree"] is None else "differs"]
          for r in precision_rows(rec.semantics_cards)]

