"""Which checks do not decide the verdict (gating False, "reported only"), in one place: the writer
(parity.pipeline.reruns) marks checks through it and the verifier (parity.report.read) accepts a reported-only check
only where it allows one, so the two cannot drift apart.

Two kinds exist:
  ALWAYS_REPORTED_ONLY  metrics that never gate: 'determinism' (a rerun of one side's first steps; GPU kernels do
                        not promise bit-identical results), and the equivalence checks' '_distance' form
                        (micro_mean or bf16/fp16: how far apart the two shapes are is the result, not a failure).
  ENVELOPE_DECIDES      in bf16/fp16, a pairwise check of one of these metrics stops gating when the noise envelope
                        check named beside it exists for the same pair: the envelope decides, the fixed table is
                        reported (parity.verdict.tolerances, the bf16 'loss' entry says why).
  BACKEND_DECIDES       a pairwise loss/grad_norm/val_loss check of two sides on different backends stops gating
                        when the '<metric>_backend' check for the pair exists (parity.verdict.backend).
and one state: NOT_RUN_REPORTED_ONLY, a check of these metrics that could not run (no value: the 'placement' check
of a side that finished without a usable placement.json, parity.verdict.placement) is reported only, saying why.
"""
from __future__ import annotations

from typing import Iterable

from parity.verdict.check import Check
from parity.verdict.envelope import ENVELOPE_METRICS

__all__ = ["ALWAYS_REPORTED_ONLY", "EQUIVALENCE_DISTANCE", "ENVELOPE_DECIDES", "NOT_RUN_REPORTED_ONLY",
           "BACKEND_DECIDES", "mark_envelope_decided", "mark_backend_decided", "reported_only_allowed"]

EQUIVALENCE_DISTANCE = ("equivalence_ga_distance", "equivalence_ranks_distance", "equivalence_packing_distance")
"""The reported-only form of the --equivalence checks (micro_mean or bf16/fp16: how far apart, never a failure;
parity.pipeline.equivalence)."""
ALWAYS_REPORTED_ONLY = ("determinism", *EQUIVALENCE_DISTANCE)
"""Check metrics stored with gating False whatever the precision."""
NOT_RUN_REPORTED_ONLY = ("placement",)
"""Check metrics stored with gating False when they could not run (value None in report.json: NaN)."""
ENVELOPE_DECIDES = {**{m: f"{m}_envelope" for m in ENVELOPE_METRICS}, "params": "params_envelope"}
"""Pairwise metric -> the noise-envelope check metric that decides instead of it in bf16/fp16."""


BACKEND_DECIDES = {"loss": "loss_backend", "grad_norm": "grad_norm_backend", "val_loss": "val_loss_backend"}
"""Pairwise metric -> the check that decides instead of it for a pair whose sides ran on different backends (fp32:
the table plus each accelerator side's measured shift against its CPU rerun, parity.verdict.backend)."""


def mark_backend_decided(checks: Iterable[Check], decides: set) -> None:
  """Marks the pairwise checks a '<metric>_backend' check decides instead (decides: {(metric, a, b)}) as reported
  only, the detail saying so."""
  for c in checks:
    if c.metric in BACKEND_DECIDES and (c.metric, *c.sides) in decides and c.gating:
      c.gating = False
      c.detail += (" (reported only: the sides ran on different backends; the table plus the measured backend shift "
                   "decides)")


def mark_envelope_decided(checks: Iterable[Check], decides: set, precision: str) -> None:
  """Marks the pairwise checks a noise-envelope check decides instead as reported only (gating False, the detail
  says so); nothing in fp32, where the fixed table gates and envelope checks are added beside it.

  Args:
    checks: the pairwise checks of the main runs (parity.verdict.sides.compare_sides), changed in place.
    decides: {(metric, side a, side b)} of the envelope checks that were computed (parity.pipeline.reruns
      RerunResult.decides); a metric outside ENVELOPE_DECIDES is never marked.
    precision: 'fp32' | 'bf16' | 'fp16'.
  """
  if precision == "fp32":
    return
  for c in checks:
    if c.metric in ENVELOPE_DECIDES and (c.metric, *c.sides) in decides:
      c.gating = False
      c.detail += f" (reported only: in {precision} the noise envelope decides)"


def reported_only_allowed(check: dict, checks: list[dict], precision: str | None) -> bool:
  """Whether a stored check (report.json form) may be reported only: its metric is in ALWAYS_REPORTED_ONLY, it is a
  NOT_RUN_REPORTED_ONLY check without a value (it could not run), or precision is bf16/fp16 and `checks` hold the
  envelope check that decides it for the same pair of sides."""
  metric = check.get("metric")
  if metric in ALWAYS_REPORTED_ONLY or (metric in NOT_RUN_REPORTED_ONLY and check.get("value") is None):
    return True
  if metric in BACKEND_DECIDES and any(c.get("metric") == BACKEND_DECIDES[metric] and list(c.get("sides") or ())
                                       == list(check.get("sides") or ()) for c in checks):
    return True
  env = ENVELOPE_DECIDES.get(metric)
  if env is None or precision in (None, "fp32"):
    return False
  return any(c.get("metric") == env and list(c.get("sides") or ()) == list(check.get("sides") or ())
             for c in checks)
