"""The checks of a report as rows a reader takes in: what each value is (`measure_label`), its tolerance as text
(`tolerance_text`), where that tolerance comes from (`check_source`), its detail in plain words (`plain_detail`),
one row per check (`check_rows`) and one per metric (`metric_rows`). Plain text; callers escape."""
from __future__ import annotations

import math
import re
from typing import Any, Mapping

from parity.report.cells import fmt, pair_label
from parity.report.run_record import CheckRecord, RunRecord

__all__ = ["METRIC_LABEL", "RATIO_LABEL", "per_tensor_rule", "measure_label", "tolerance_text", "plain_detail",
           "check_source", "updates_detail", "check_rows", "metric_rows"]


METRIC_LABEL = {"loss": "max abs Δloss", "val_loss": "abs Δval_loss at the worst step (relative to tolerance)",
                "grad_norm": "abs Δgrad_norm at the worst step (relative to tolerance)",
                "lr": "abs Δlr at the worst step (relative to tolerance)",
                "params": "worst tensor: element abs Δ", "params_zero_grad": "max abs Δ (zero-grad slices)",
                "completed": "steps both ran", "updates": "steps with lr > 0 on both sides",
                "determinism": "differing fields", "resume": "differing fields",
                "loss_envelope": "worst window: rms Δloss", "val_loss_envelope": "worst window: rms Δval_loss",
                "grad_norm_envelope": "worst window: rms rel. Δgrad_norm",
                "params_envelope": "worst tensor: element abs Δ", "loss_scale": "max abs Δloss_scale",
                "skipped": "max abs Δ (1: skipped on one side only)",
                "semantics": "semantics card items that differ",
                "placement": "places the compiled step contradicts the plan"}
"""How each metric's value reads (no '|': these labels go into Markdown table cells)."""
METRIC_LABEL.update({f"equivalence_{k}{d}": "max abs Δloss against its own rerun" for k in ("ga", "ranks", "packing")
                     for d in ("", "_distance")})  # --equivalence (parity.verdict.equivalence)


RATIO_LABEL = "worst tensor: max abs Δ / how far it moved from init (ratio)"
"""What a params / params_envelope value is under the per-tensor rule (parity.verdict.params: the fallback)."""


def per_tensor_rule(c: CheckRecord) -> bool:
  """Whether a params / params_envelope check was decided by the per-tensor ratio rule (its value is then
  max|a - b| / distance moved, not one element's |Δ|): its detail names the rule (parity.verdict.params)."""
  return c.metric in ("params", "params_envelope") and "rule: per-tensor" in str(c.detail or "")


def measure_label(c: CheckRecord) -> str:
  """What one check's value is (METRIC_LABEL of its metric; a params check under the per-tensor rule: RATIO_LABEL)."""
  return RATIO_LABEL if per_tensor_rule(c) else METRIC_LABEL.get(c.metric, c.metric)


def tolerance_text(c: CheckRecord, tolerances: Mapping) -> str:
  """The tolerance of a check as a reader should take it: an absolute bound as the number; a relative one as
  'rtol × value' with the bound it gave (never a bare '0' that reads as exact equality)."""
  tol = tolerances.get(c.metric) or {}
  atol, rtol = tol.get("atol"), tol.get("rtol")
  if c.metric in ("determinism", "resume"):
    return "bit-identical"
  if c.metric == "completed":
    return f"all {fmt(c.tolerance, 'g')} steps"
  if c.metric == "updates":
    return f"at least {fmt(c.tolerance, 'g')} step"
  if c.tolerance == 0 and not atol and not rtol:
    return "0 (must be equal)"
  if c.metric == "params" and rtol and per_tensor_rule(c):
    return f"{fmt(c.tolerance)} (ratio bound: the tensor's max abs Δ ≤ {rtol:g} × how far it moved from init)"
  if c.metric == "params" and rtol:
    return f"{fmt(c.tolerance)} ({rtol:g} × how far the tensor moved from init, + an Adam noise term per element)"
  if atol == 0 and rtol:
    if not c.tolerance and c.value == 0:  # the "worst" step of an all-zero Δ is any step, lr 0 ones too
      return f"relative: {rtol:g} × value (every difference is 0, so no one step's bound is quoted)"
    if not c.tolerance:
      return f"relative: {rtol:g} × value (the values compared are 0 at the step quoted)"
    return f"{fmt(c.tolerance)} (relative: {rtol:g} × value)"
  if atol and rtol:
    return f"{fmt(c.tolerance)} ({atol:g} + {rtol:g} × value)"
  return fmt(c.tolerance)


def plain_detail(text: str | None) -> str:
  """A check's detail as a reader takes it: '0 of 52 tensors over' reads 'all 52 tensors within tolerance',
  'N of M tensors over' reads 'N of M tensors over tolerance'; a grad_norm/lr 'max |Δ| = v at step s' (the step
  whose difference is nearest its relative bound, parity.verdict.steps.series_check) says so; 'over 1 steps' reads
  'over 1 step'."""
  text = re.sub(r"\b0 of (\d+) tensors over\b", r"all \1 tensors within tolerance", text or "")
  text = re.sub(r"\b(\d+ of \d+ tensors over)\b(?! tolerance)", r"\1 tolerance", text)
  text = re.sub(r"^max \|Δ(\w+)\| = 0 at step \d+ \(tolerance \S+\) over (\d+) steps?",
                lambda m: f"|Δ{m[1]}| = 0 on every step compared ({m[2]} step{'' if m[2] == '1' else 's'})", text)
  # a relative tolerance: the step quoted is the one nearest its bound, not always the largest difference
  text = re.sub(r"^max \|Δ(grad_norm|lr)\| = (\S+) at step (\d+) \(tolerance (\S+)\)",
                r"|Δ\1| = \2 at step \3, the step nearest its tolerance (\4 there),", text)
  # the grad_norm envelope compares relative differences (parity.verdict.envelope): its detail says so
  text = re.sub(r"^(worst window steps \S+: )rms \|Δgrad_norm\| ", r"\1rms rel. |Δgrad_norm| ", text)
  return re.sub(r"\bover 1 steps\b", "over 1 step", text)


def _schedule(rec: RunRecord) -> str:
  """The learning-rate schedule the run used (run.train.lr_schedule: a DeepSpeed scheduler type, or Constant)."""
  return str(rec.run.lr_schedule or "WarmupCosineLR")


def check_source(c: CheckRecord, rec: RunRecord) -> str:
  """Where a check's tolerance comes from (its stored reason), naming what this run ran: the lr reason is written
  once for every schedule, so the schedule it names is the run's own (run.train.lr_schedule)."""
  text = c.reason or ""
  if c.metric == "lr":
    sched = _schedule(rec)
    what = "no scheduler: a constant lr" if sched == "Constant" else f"DeepSpeed {sched}, the schedule this run used"
    text = re.sub(r"\(DeepSpeed \w+\)", f"({what})", text)
  return text


def _zero_lr_steps(rec: RunRecord, c: CheckRecord) -> list[int]:
  """Steps of an 'updates' check's pair where the lr was 0 (or missing) on either side: the steps it did not count."""
  sides = [rec.sides.get(s) for s in c.sides]
  if len(sides) != 2:
    return []
  lrs = [dict(zip(s.values("step"), s.values("lr"))) if s is not None else {} for s in sides]
  return [st for st in sorted(set(lrs[0]) & set(lrs[1])) if not (lrs[0][st] and lrs[1][st])]


def _uncounted(rec: RunRecord, c: CheckRecord) -> str:
  """' (of 6; not counted: steps 0, 1, lr 0)': what an 'updates' value leaves out, for its 'value is' cell."""
  zero = _zero_lr_steps(rec, c)
  first = rec.sides.get(c.sides[0])
  total = len(first.values("step")) if first is not None else 0
  names = ", ".join(map(str, zero[:4])) + (", ..." if len(zero) > 4 else "")
  return f" (of {total}; not counted: step{'s' if len(zero) > 1 else ''} {names}, lr 0)" if zero else ""


def updates_detail(c: CheckRecord, rec: RunRecord) -> str:
  """The 'updates' detail with the reason the uncounted steps were left out: 'steps 0, 1 not counted: lr 0 there
  (the start of WarmupLR's warmup: no weight moves)'."""
  text = c.detail or ""
  zero = _zero_lr_steps(rec, c)
  if not zero or "not counted" in text:
    return text
  names = ", ".join(map(str, zero[:8])) + (f" and {len(zero) - 8} more" if len(zero) > 8 else "")
  first = rec.sides[c.sides[0]].values("step") or [0]
  at_start = zero == list(range(first[0], first[0] + len(zero)))
  why = (f"the start of {_schedule(rec)}'s warmup" if at_start and _schedule(rec).startswith("Warmup")
         else "the schedule gives lr 0 there")
  return (f"{text}; step{'s' if len(zero) > 1 else ''} {names} not counted: lr 0 on at least one side ({why}), "
          "so no weight moved")


def check_rows(rec: RunRecord) -> list[dict[str, Any]]:
  """One row per check: name, metric, pair, measure (what the value is), value, tolerance (text), source (why
  that tolerance: the measurement it comes from), result ('pass' | 'FAIL' | 'pass (reported only)' | ...),
  first_failing_step, detail, passed, gating."""
  tols = rec.tolerance_table
  rows = []
  for c in rec.checks:
    result = ("pass" if c.passed else "FAIL") + ("" if c.gating else " (reported only)")
    rows.append({"name": c.name, "metric": c.metric, "pair": pair_label(c.sides),
                 "measure": measure_label(c) + (_uncounted(rec, c) if c.metric == "updates" else ""),
                 "value": fmt(c.value),
                 "tolerance": tolerance_text(c, tols), "source": check_source(c, rec), "result": result,
                 "first_failing_step": fmt(c.first_failing_step, "d"),
                 "detail": plain_detail(updates_detail(c, rec) if c.metric == "updates" else c.detail),
                 "passed": bool(c.passed), "gating": c.gating})
  return rows


def metric_rows(rec: RunRecord) -> list[dict[str, Any]]:
  """One row per metric (the checks of every pair folded): metric, measure, checks (count), failed (count),
  worst (its pair), value, tolerance, source, result, first_failing_step, gating. The worst check is the one
  furthest over (or closest to) its tolerance."""
  rows: dict[str, list[dict]] = {}
  for r, c in zip(check_rows(rec), rec.checks):
    rows.setdefault(r["metric"], []).append({**r, "_ratio": _ratio(c)})
  out = []
  for metric, rs in rows.items():
    failed = [r for r in rs if not r["passed"]]
    worst = max(failed or rs, key=lambda r: r["_ratio"])
    gating = any(r["gating"] for r in rs)
    result = (f"FAIL ({len(failed)} of {len(rs)})" if failed else f"pass ({len(rs)} of {len(rs)})") + \
        ("" if gating else ", reported only")
    out.append({"metric": metric, "measure": worst["measure"], "checks": len(rs), "failed": len(failed),
                "worst": worst["pair"], "value": worst["value"], "tolerance": worst["tolerance"],
                "source": worst["source"], "result": result, "first_failing_step": worst["first_failing_step"],
                "gating": gating, "passed": not failed})
  return out


def _ratio(c: CheckRecord) -> float:
  v, t = c.value, c.tolerance
  if not isinstance(v, (int, float)):
    return math.inf if not c.passed else 0.0
  if not isinstance(t, (int, float)) or t == 0:
    return 0.0 if v == 0 else math.inf
  return abs(v) / abs(t)


