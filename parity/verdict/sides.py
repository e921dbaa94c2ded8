"""A run's comparison and its verdict: every pairwise check of every pair of sides (`compare_sides`), and the one
verdict from those checks and the sides' statuses (`verdict`)."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

import numpy as np

from parity.verdict.check import Check
from parity.numerics.adam import adam_step_sum
from parity.verdict.params import param_checks
from parity.verdict.placement import placement_check
from parity.semantics import DIFFED, diff_cards, diff_text
from parity.verdict.steps import FP16_SERIES, SERIES_METRICS, completion_check, series_check, updates_check

__all__ = ["compare_sides", "Verdict", "verdict", "METRIC_ORDER", "semantics_check", "SEMANTICS_REASON"]

SEMANTICS_REASON = ("the semantics cards (parity.protocol.semantics: what each side's step runs, read from its own "
                    "objects before step 1) must agree item for item; any difference changes the math")

METRIC_ORDER = {m: i for i,
                m in enumerate(("semantics", "placement", "completed", "updates", "skipped", "loss_scale",
                                *SERIES_METRICS, "loss_envelope",
                                            "grad_norm_envelope", "val_loss_envelope", "params", "params_envelope",
                                            "params_zero_grad", "noise_rerun", "resume", "determinism"))}
"""Which of two checks failing at the same step is named first in the verdict (earlier here: named first)."""


def compare_sides(sides: dict[str, dict], *, spec, init: dict[str, np.ndarray]) -> tuple[list[Check], list[dict]]:
  """All pairwise checks.

  Args:
    sides: side -> {'status': str, 'steps': list of StepRecord dicts, 'final': params dict or None, and
      optionally 'moments': parity.protocol.read_moments output or None, 'semantics': the side's semantics card
      (parity.protocol.semantics.read_card) or None: a pair with both cards gets a 'semantics' check, after its
      other checks, 'placement': parity.pipeline.collect's placement entry of a side that writes placement.json
      (the one-side 'placement' check of each such side, after every pair's checks:
      parity.verdict.placement.placement_check)}.
      Insertion order decides the reference of each pair (the earlier side).
    spec: the RunSpec.
    init: canonical initial params.
  Returns:
    (checks, per-tensor param table).
  """
  precision = spec.train.precision
  checks, table = [], []
  for (na, a), (nb, b) in itertools.combinations(sides.items(), 2):
    checks.append(completion_check(na, a["status"], len(a["steps"]), nb, b["status"], len(b["steps"]),
                                   spec.train.steps))
    if a["steps"] and b["steps"]:
      checks.append(updates_check(na, a["steps"], nb, b["steps"], spec.train.steps))
    for metric in SERIES_METRICS + (FP16_SERIES if precision == "fp16" else ()):
      c = series_check(metric, na, a["steps"], nb, b["steps"], precision)
      if c is not None:
        checks.append(c)
    if a.get("final") is not None and b.get("final") is not None:
      # the most one Adam side can move an element (numerics.adam.adam_step_sum; the betas set how far past lr a step
      # goes)
      lr_sum = adam_step_sum([r["lr"] for r in a["steps"] if not r.get("skipped")], spec.train.beta1,
                             spec.train.beta2)
      pc, pt = param_checks(na, a["final"], nb, b["final"], init, spec.model, precision, lr_sum,
                            moments={na: a.get("moments"), nb: b.get("moments")},
                            adam_updates=spec.train.optimizer in ("adam", "adamw"))
      checks.extend(pc)
      table.extend(pt)
    if a.get("semantics") is not None and b.get("semantics") is not None:  # last of the pair: the earlier checks
      # keep their places; the verdict names it first anyway (step 0, METRIC_ORDER)
      checks.append(semantics_check(na, a["semantics"], nb, b["semantics"]))
  # last: the pairs' checks keep their places; the verdict names a failing one first anyway (step 0, METRIC_ORDER)
  checks.extend(c for c in (placement_check(n, d.get("placement"), d["status"]) for n, d in sides.items()) if c)
  return checks, table


def semantics_check(na: str, card_a: dict, nb: str, card_b: dict) -> Check:
  """The 'semantics' check of two sides' cards: FAILs at step 0 when any DIFFED item differs, its detail naming each
  item and both values ('semantics: mlp.gelu_form jax=tanh deepspeed=erf'); value: the number of items differing."""
  diffs = diff_cards(card_a, card_b)
  detail = diff_text(na, nb, diffs) if diffs else f"semantics cards agree ({len(DIFFED)} items)"
  return Check(name=f"semantics {na}~{nb}", metric="semantics", sides=(na, nb), value=float(len(diffs)),
               tolerance=0.0, passed=not diffs, first_failing_step=0 if diffs else None,
               worst=diffs[0][0] if diffs else None, detail=detail, reason=SEMANTICS_REASON)


@dataclasses.dataclass
class Verdict:
  """passed: every side ran and every check held. first_failure: the failing check that broke
  earliest (by step, then by metric order), None when passed. message: one line."""
  passed: bool
  first_failure: Check | None
  message: str

  def to_json(self) -> dict:
    """The verdict as JSON data (report.json's 'verdict'): passed, message and the first failure's essentials."""
    return {"passed": self.passed, "message": self.message,
            "first_failure": None if self.first_failure is None else {
                "check": self.first_failure.name, "metric": self.first_failure.metric,
                "sides": list(self.first_failure.sides), "step": self.first_failure.first_failing_step,
                "value": self.first_failure.to_json()["value"], "tolerance": self.first_failure.tolerance}}


def verdict(checks: Sequence[Check], statuses: dict[str, str]) -> Verdict:
  """The run's verdict from its checks and each side's status."""
  failing = [c for c in checks if not c.passed and c.gating]
  bad_sides = {s: st for s, st in statuses.items() if st != "ok"}
  if len(statuses) == 1:
    (side, st), = statuses.items()
    if failing:  # e.g. a resume check of the one side
      first = min(failing, key=lambda c: METRIC_ORDER.get(c.metric, 99))
      return Verdict(False, first, f"FAIL: {side}: {first.name}: {first.detail}")
    return Verdict(st == "ok", None, f"ONE SIDE: {side} {'ran ok' if st == 'ok' else 'did not finish (' + st + ')'}; "
                   "nothing to compare (run two or more sides for a parity verdict)")
  if not failing and not bad_sides:
    gating = sum(c.gating for c in checks)
    extra = len(checks) - gating
    more = f" (+{extra} reported only)" if extra else ""
    return Verdict(True, None, f"PASS: {gating} checks within tolerance across {len(statuses)} sides{more}")
  inf = float("inf")
  failing.sort(key=lambda c: (c.first_failing_step if c.first_failing_step is not None else inf,
                              METRIC_ORDER.get(c.metric, 99)))
  first = failing[0] if failing else None
  parts = []
  if bad_sides:
    parts.append("side(s) did not finish: " + ", ".join(f"{s} ({st})" for s, st in bad_sides.items()))
  if first is not None and len(first.sides) == 1:  # a one-side check (placement): the side and what it found
    where = f" at step {first.first_failing_step}" if first.first_failing_step is not None else ""
    parts.append(f"{first.metric} of {first.sides[0]} fails{where}: {first.detail}")
  elif first is not None:
    where = f" at step {first.first_failing_step}" if first.first_failing_step is not None else ""
    parts.append(f"{first.metric} {first.sides[0]} vs {first.sides[1]} first breaks tolerance{where}: {first.detail}")
  return Verdict(False, first, "FAIL: " + "; ".join(parts))
