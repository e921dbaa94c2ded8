"""What an equivalence rerun finds (`--equivalence ga,ranks,packing`): each side trained again on the same examples
in another, mathematically equivalent shape, and held against its own main run. The pipeline runs the reruns
(parity.pipeline.equivalence); `equivalence_outcome` and `equivalence_section` compute the check and the report
section from what they left, for the run and again for parity.report.reverify.

What the check is (`equivalence_outcome`, one Check per kind and side, sides (side, 'side#kind')):
  With train.loss_normalization 'tokens' the objective of every step is the same sum over the same loss tokens
  divided by the same count, so in exact arithmetic the two runs are identical; only the grouping of the float32
  sums (micro batches, ranks, rows, attention over masked slots) changes. In fp32 the check gates (metric
  'equivalence_<kind>'): per step |Δloss| <= EQUIVALENCE_LOSS, |Δgrad_norm| within the fp32 grad_norm entry, and
  the final params within the fp32 params rule of parity.verdict.params (the one the sides are held to).
  With 'micro_mean' (the mean of micro-batch means) the two shapes weight tokens differently wherever micro batches
  hold different numbers of loss tokens: the runs are not meant to agree. The same figures are reported, not gated
  (metric 'equivalence_<kind>_distance', parity.verdict.gating.ALWAYS_REPORTED_ONLY): how far apart they are is
  the result. bf16/fp16 runs are reported the same way: no fp32-rounding bound holds there and no equivalence
  tolerance has been measured at those precisions.
report.json 'equivalence': {kind: {method, normalization, gating, rerun: {changed, nproc}, loss_tokens_per_step,
sides: {side: {status, error, max_abs_loss_diff, worst_step, max_grad_norm_rel_diff, params_max_abs_diff,
params_ratio_max, passed}}}}.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from parity.numerics.adam import adam_step_sum
from parity.spec import RunSpec
from parity.verdict.check import Check
from parity.verdict.gating import EQUIVALENCE_DISTANCE
from parity.verdict.params import param_checks, param_ratios
from parity.verdict.steps import steps_by_index
from parity.verdict.tolerances import Tolerance, tolerance

__all__ = ["EQUIVALENCE_LOSS", "DISTANCE_METRICS", "METHODS", "equivalence_metric", "equivalence_outcome",
           "equivalence_section", "not_prepared"]

DISTANCE_METRICS = EQUIVALENCE_DISTANCE
"""The reported-only form of each check (micro_mean, bf16/fp16): never gating (parity.verdict.gating)."""
METHODS = {
    "ga": "GA k x micro batch m against GA 1 x micro batch k*m: the same rows of every step (the arrays reshaped)",
    "ranks": "N ranks against 1 rank (1 rank against 2): the same global micro batches, split over the ranks",
    "packing": "the same examples of every step packed several per row against padded one per row (re-laid out "
               "with the main run's examples_per_step; same pieces and loss tokens per step, checked)"}
EQUIVALENCE_LOSS = Tolerance(1e-5, 0.0, (
    "Per-step training loss of one side against its own equivalence rerun, nats, train.loss_normalization 'tokens', "
    "fp32: the same sum over the same loss tokens over the same count, grouped otherwise (micro batches, ranks, "
    "rows), so only float32 reduction order differs. The bound is the fp32 cross-stack loss entry (1e-5: two "
    "independent stacks agree to <= 4.3e-6), which covers any reordering of the same sums. Measured 2026-12-02, "
    "jax, torch and deepspeed, 3 steps (docs/data-examples.md): sft-tiny padded, ga and packing <= 2.4e-7; 200 short "
    "examples packed at seq_len 64, ga <= 4.8e-7, ranks (1 vs 2) <= 4.8e-7, packing <= 9.5e-7 (>= 10x below the "
    "bound); the same packed runs under micro_mean differ by 3.1e-3 (ga) and 2.7e-3 (packing), >= 270x above it."))


def equivalence_metric(kind: str, spec: RunSpec) -> str:
  """'equivalence_<kind>' (gating: tokens in fp32) or 'equivalence_<kind>_distance' (reported only)."""
  gating = spec.train.loss_normalization == "tokens" and spec.train.precision == "fp32"
  return f"equivalence_{kind}" if gating else f"equivalence_{kind}_distance"


@dataclasses.dataclass
class Figures:
  """What one side's pair gives: max |Δloss| (nats) and its step, max relative |Δgrad_norm|, the params checks and
  the worst element |Δ| and per-tensor ratio of the final params."""
  loss: float
  worst_step: int | None
  first_bad: int | None
  grad_norm: float
  grad_ok: bool
  params: list[Check]
  params_abs: float | None
  params_ratio: float | None


def _figures(main: dict, rerun_steps: list[dict], final: dict | None, moments, spec: RunSpec, init: dict,
             side: str, kind: str) -> Figures:
  """The pair's figures under the fp32 bounds (EQUIVALENCE_LOSS, the grad_norm entry, the params rule)."""
  la, lb = steps_by_index(main["steps"], "loss"), steps_by_index(rerun_steps, "loss")
  common = sorted(set(la) & set(lb))
  d = {s: abs(la[s] - lb[s]) for s in common}
  bad = [s for s in common if not d[s] <= EQUIVALENCE_LOSS.atol]
  worst = max(common, key=lambda s: d[s] if np.isfinite(d[s]) else np.inf) if common else None
  ga, gb = steps_by_index(main["steps"], "grad_norm"), steps_by_index(rerun_steps, "grad_norm")
  gtol = tolerance("fp32", "grad_norm")
  gd = [(abs(ga[s] - gb[s]), gtol.atol + gtol.rtol * abs(ga[s]), abs(ga[s])) for s in sorted(set(ga) & set(gb))]
  params, pabs, pratio = [], None, None
  if main.get("final") is not None and final is not None:
    lr_sum = adam_step_sum([r["lr"] for r in main["steps"] if not r.get("skipped")], spec.train.beta1,
                           spec.train.beta2)
    params, table = param_checks(side, main["final"], f"{side}#{kind}", final, init, spec.model, "fp32", lr_sum,
                                 moments={side: main.get("moments"), f"{side}#{kind}": moments},
                                 adam_updates=spec.train.optimizer in ("adam", "adamw"))
    pabs = max((r["max_abs_diff"] for r in table), default=0.0)
    pratio = max(param_ratios(main["final"], final, init, spec.model).values(), default=0.0)
  return Figures(loss=d[worst] if worst is not None else float("nan"), worst_step=worst,
                 first_bad=bad[0] if bad else None,
                 grad_norm=max((x / max(r, 1e-30) for x, _, r in gd), default=0.0),
                 grad_ok=all(x <= allowed for x, allowed, _ in gd), params=params, params_abs=pabs,
                 params_ratio=pratio)


def equivalence_outcome(kind: str, side: str, main: dict, rerun, rerun_steps: list[dict],
                        final: dict | None, moments, spec: RunSpec, init: dict) -> tuple[Check, dict[str, Any]]:
  """One side's equivalence check from its main run and its rerun (this module's docstring), and its row of the
  report section.

  Args:
    main: the main run's collected side ({'status', 'steps', 'final', 'moments'}, parity.pipeline.collect).
    rerun, rerun_steps, final, moments: the rerun's SideRun, StepRecords, final params (None: not whole) and
      moments (parity.protocol.read_moments, or None).
  Returns:
    (Check, row). Check: value max |Δloss| over the steps (nats), tolerance EQUIVALENCE_LOSS.atol; passed when every
    step's loss and grad_norm and the final params are within their fp32 bounds; gating per `equivalence_metric`.
    row: {status, error, normalization (the loss normalisation this side's rerun trained: its summary.json spec,
    which keeps a --perturb of the side; else the run's), max_abs_loss_diff, worst_step, max_grad_norm_rel_diff,
    params_max_abs_diff, params_ratio_max, passed, gating}.
  """
  metric = equivalence_metric(kind, spec)
  gating = not metric.endswith("_distance")
  name, pair = f"equivalence {kind} {side}", (side, f"{side}#{kind}")
  ran = (((rerun.summary or {}).get("spec") or {}).get("train") or {}).get("loss_normalization")
  row = {"status": rerun.status, "error": rerun.error, "normalization": ran or spec.train.loss_normalization,
         "max_abs_loss_diff": None, "worst_step": None, "max_grad_norm_rel_diff": None, "params_max_abs_diff": None,
         "params_ratio_max": None}
  if rerun.status != "ok" or final is None:
    c = Check(name=name, metric=metric, sides=pair, value=float("nan"), tolerance=EQUIVALENCE_LOSS.atol,
              passed=False, detail=f"the {kind} rerun did not finish ({rerun.status}): {rerun.error}",
              reason=EQUIVALENCE_LOSS.reason, gating=gating)
    return c, {**row, "passed": False, "gating": gating}
  f = _figures(main, rerun_steps, final, moments, spec, init, side, kind)
  params_ok = all(c.passed for c in f.params)
  steps_ok = len(rerun_steps) == len(main["steps"]) and f.first_bad is None and bool(np.isfinite(f.loss))
  detail = (f"max |Δloss| = {f.loss:.3g} at step {f.worst_step} over {len(rerun_steps)} steps; max relative "
            f"|Δgrad_norm| = {f.grad_norm:.3g}" + ("" if f.grad_ok else " (over the fp32 grad_norm bound)")
            + f"; final params: worst element |Δ| = {_g(f.params_abs)}, worst tensor |Δ| / moved = "
            f"{_g(f.params_ratio)}" + ("" if params_ok else " (over the fp32 params rule)"))
  if not gating:
    why = ("micro_mean: a mean of micro-batch means weights tokens by their micro batch, so reshaping the step "
           "changes the objective on uneven examples" if spec.train.loss_normalization == "micro_mean" else
           f"{spec.train.precision}: no fp32-rounding bound applies")
    detail = f"reported only ({why}): " + detail
  passed = steps_ok and f.grad_ok and params_ok
  first = f.first_bad if f.first_bad is not None else f.worst_step
  c = Check(name=name, metric=metric, sides=pair, value=f.loss, tolerance=EQUIVALENCE_LOSS.atol, passed=passed,
            first_failing_step=None if passed else first, worst=f.worst_step, detail=detail,
            reason=EQUIVALENCE_LOSS.reason, gating=gating)
  row.update(max_abs_loss_diff=f.loss, worst_step=f.worst_step, max_grad_norm_rel_diff=f.grad_norm,
             params_max_abs_diff=f.params_abs, params_ratio_max=f.params_ratio)
  return c, {**row, "passed": passed, "gating": gating}


def _g(x: float | None) -> str:
  return "n/a" if x is None else f"{x:.3g}"


def equivalence_section(kind: str, spec: RunSpec, prepared: dict | None, sides: dict[str, dict]) -> dict[str, Any]:
  """report.json equivalence[kind] (this module's docstring); sides: side -> its row (`equivalence_outcome`)."""
  return {"method": METHODS[kind], "normalization": spec.train.loss_normalization,
          "gating": not equivalence_metric(kind, spec).endswith("_distance"),
          "rerun": None if prepared is None else {"changed": prepared["train"], "nproc": prepared["nproc"]},
          "loss_tokens_per_step": None if prepared is None else prepared["loss_tokens_per_step"], "sides": sides}


def not_prepared(kind: str, side: str, spec: RunSpec, exc: Exception) -> Check:
  """The failing check of a side whose `kind` rerun could not be prepared (`exc` says why)."""
  return Check(name=f"equivalence {kind} {side}", metric=equivalence_metric(kind, spec), sides=(side, f"{side}#{kind}"),
               value=float("nan"), tolerance=EQUIVALENCE_LOSS.atol, passed=False,
               detail=f"the {kind} rerun could not be prepared: {exc}", reason=EQUIVALENCE_LOSS.reason,
               gating=not equivalence_metric(kind, spec).endswith("_distance"))
