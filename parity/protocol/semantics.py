"""The semantics card in the run folder: each side writes run_dir/<side>/semantics.json (`gate`) after build and
before step 1, and compares it with the cards of the sides that ran before it (the card and its diff:
parity.semantics).

How "before step 1" is enforced (`gate`): the sides run one after another (their timings must not share the
machine), so when side k has built its model and optimizer, the cards of sides 1..k-1 of this run are already on
disk. Side k writes its card, then compares it with the first of them (the reference: a planted middle side
stops itself, not the correct sides after it); on a difference it raises `CardDiffers` before its
first step, which ends it as 'crashed' through the ordinary worker path (main_guard: summary.json names the items and
both values), so the harness's killed/hung/crashed reporting is unchanged, and a side that dies before writing its
card is reported as today. The first side has nothing to compare against and trains (a pre-pass building every side
once more only to read its card would cost a second build of each side on every run); the report's 'semantics'
check (parity.verdict.sides.semantics_check, recomputed from the card files) is the FAIL at step 0 either way. With
request.json `train_anyway_on_card_diff: true` (`parity compare --train-anyway-on-card-diff`) a side that differs
trains anyway and only the check FAILs. Derived requests (the reruns: repeat/, resume/, noise/, equivalence/) write
their card but do not gate: the main run decided. A side whose `semantics` returns None writes no card; the check
then compares only the sides that have one.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from parity.semantics import SEMANTICS_SCHEMA, diff_cards, diff_text

__all__ = ["SEMANTICS_FILE", "TRAIN_ANYWAY_KEY", "CardDiffers", "read_card", "gate"]

SEMANTICS_FILE = "semantics.json"
"""In run_dir/<side>/: the side's semantics card (parity.semantics)."""
TRAIN_ANYWAY_KEY = "train_anyway_on_card_diff"
"""request.json key (bool): a side whose card differs from an earlier side's trains anyway."""


class CardDiffers(ValueError):
  """A side's semantics card differs from an earlier side's (the message names every item and both values)."""


def read_card(path: Path, run_id: str | None = None) -> dict[str, Any] | None:
  """The card at `path`, or None when it is missing, not a card, or of another run (run_id given and not its)."""
  try:
    card = json.loads(Path(path).read_text())
  except (OSError, ValueError):
    return None
  if not isinstance(card, dict) or card.get("schema") != SEMANTICS_SCHEMA or not isinstance(card.get("items"), dict):
    return None
  if run_id is not None and card.get("run_id") != run_id:
    return None
  return card


def gate(run_dir: Path, side: str, sides: Sequence[str], request: Mapping[str, Any], card: dict[str, Any], *,
         write: bool = True) -> None:
  """Writes `card` to run_dir/<side>/semantics.json (`write`: rank 0 only), then compares it with the reference card:
  the first side before `side` in `sides` that wrote one (this run's: request run_id), so a planted middle side stops
  itself, not the correct sides after it; the module docstring says why this is "before step 1".

  Raises:
    CardDiffers: a difference, unless request[TRAIN_ANYWAY_KEY] or the request is a derived one (a rerun).
  """
  if write:
    out = Path(run_dir) / side / SEMANTICS_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(card, indent=2, sort_keys=True))
  if request.get(TRAIN_ANYWAY_KEY) or request.get("derived_from") is not None or side not in sides:
    return
  problems = []
  for earlier in list(sides)[:list(sides).index(side)]:  # the reference: the first earlier side with a card
    theirs = read_card(Path(run_dir) / earlier / SEMANTICS_FILE, request.get("run_id"))
    if theirs is None:
      continue
    diffs = diff_cards(theirs, card)
    if diffs:
      problems.append(diff_text(earlier, side, diffs))
    break
  if problems:
    raise CardDiffers("; ".join(problems) + " -- stopped before step 1 (the semantics cards differ; "
                      "`parity compare --train-anyway-on-card-diff` trains anyway)")
