"""Pairs whose sides ran on different backends (JAX on a TPU or GPU, PyTorch on the host CPU): their fp32 tolerance
from the accelerator's measured shift, and a bound on that shift.

The fp32 table (parity.verdict.tolerances) was measured between sides on one CPU. A side on an accelerator computes
the same program with other arithmetic (TPU v5e: tanh 7e-5 relative, exp 4e-6; CPU: ~2e-7), so a correct pair can
exceed it (gpt2-tiny, 30 steps, JAX on the chip vs torch on the CPU: 1.38e-5 nats against 1e-5; gemma3-tiny at step
0: 2.15e-5, its tanh-GELU). The accelerator side is therefore rerun on the host CPU (harness.self_runs.run_backend:
same request, batches and weights), and for every step t

    |a(t) - b(t)| <= atol + rtol |a(t)| + shift_a(t) + shift_b(t),     shift_x(t) = |x(t) - x_cpu(t)|

where atol/rtol are the fp32 table's (shift 0 for a side that ran on the CPU). This is the triangle inequality: the
table bounds the two frameworks on one backend, and the measured shift is exactly what the other backend adds, so a
correct pair cannot fail it and a framework difference larger than the table still does. The shift itself is bounded
too ('backend_shift <side>', tolerance 'backend_shift'), so an accelerator that computes fp32 at a lower precision
(a TPU matmul in one bf16 pass is 2e-3 relative) FAILs even though the pair bound grants its shift.

The pair bound alone admits a framework error up to table + both shifts (2.9e-5 at the chip's measured shift, up to
4.1e-4 at the shift bound): a torch error of 1.34e-5 (1.34x the table) PASSed it against a JAX folder from the TPU.
So each such pair is also judged on one backend ('<metric>_one_backend a~b', `one_backend_check`): the accelerator
side's host-CPU rerun against the other side (or its rerun), at the fp32 table and no shift. The two frameworks meet
on the CPU as in a one-machine run, and the accelerator's own arithmetic is judged by the shift bound alone.
Numpy only."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from parity.verdict.check import Check
from parity.verdict.steps import series_check, steps_by_index
from parity.verdict.tolerances import tolerance

__all__ = ["BACKEND_METRICS", "SHIFT_TOLERANCE", "SHIFT_GROWTH", "on_accelerator", "device_class", "shifts",
           "backend_pair_check", "backend_shift_check", "shift_bounds", "update_error_caught", "one_backend_check"]

BACKEND_METRICS = ("loss", "grad_norm", "val_loss")
"""Per-step metrics whose pair check takes the backend shift (the params check keeps its own per-element rule)."""


def on_accelerator(device: object) -> bool:
  """Whether a side's summary.json 'device' names an accelerator (a TPU or GPU device), not the host CPU."""
  text = str(device or "").lower()
  return bool(text) and "cpu" not in text


def device_class(device: object) -> str:
  """'cpu' | 'tpu' | 'gpu' | the text itself, of a summary.json 'device' ('TFRT_CPU_0', 'cpu', 'TPU_0(...)',
  'cuda:0', 'cuda (NVIDIA H200)', 'rocm:0')."""
  text = str(device or "").lower()
  if not text or "cpu" in text:
    return "cpu"
  if text.startswith("tpu"):
    return "tpu"
  return "gpu" if any(k in text for k in ("cuda", "gpu", "rocm")) else text


def shifts(main: Sequence[dict], on_cpu: Sequence[dict]) -> dict[str, dict[int, float]]:
  """metric -> (step -> |main - on_cpu|) for BACKEND_METRICS over the steps both recorded."""
  out: dict[str, dict[int, float]] = {}
  for m in BACKEND_METRICS:
    a, b = steps_by_index(main, m), steps_by_index(on_cpu, m)
    out[m] = {k: abs(a[k] - b[k]) for k in sorted(set(a) & set(b))}
  return out


def backend_pair_check(metric: str, a_side: str, a: Sequence[dict], b_side: str, b: Sequence[dict],
                       shift: dict[str, dict[int, float]], precision: str) -> Check | None:
  """'<metric>_backend a~b': each step within the table's bound plus both sides' measured shift (module docstring).

  Args:
    shift: side -> (step -> |side - side on the CPU|) of this metric, for the sides that ran on an accelerator.
  Returns:
    The Check, or None when the sides share no step of the metric or no side has a shift.
  """
  tol = tolerance(precision, metric)
  sa, sb = steps_by_index(a, metric), steps_by_index(b, metric)
  sides = [s for s in (a_side, b_side) if s in shift]
  common = sorted(set(sa) & set(sb).intersection(*[shift[s] for s in sides])) if sides else []
  if not common:
    return None
  va, vb = (np.array([x[k] for k in common], np.float64) for x in (sa, sb))
  extra = np.sum([[shift[s][k] for k in common] for s in sides], axis=0)
  table = tol.atol + tol.rtol * np.abs(va)
  diff = np.abs(va - vb)
  allowed = table + extra
  with np.errstate(invalid="ignore", divide="ignore"):
    ratio = np.where(np.isfinite(diff), diff / np.maximum(allowed, 1e-300), np.inf)
  i = int(np.argmax(ratio))
  bad = ~(diff <= allowed)
  first = common[int(np.argmax(bad))] if bad.any() else None
  label = " + ".join(f"{s}'s shift {shift[s][common[i]]:.3g}" for s in sides)
  detail = (f"|Δ{metric}| = {diff[i]:.3g} at step {common[i]} vs {allowed[i]:.3g} = fp32 table {table[i]:.3g} + "
            f"{label} (each accelerator side against its rerun on the host CPU); {int(bad.sum())} of "
            f"{len(common)} steps over")
  return Check(name=f"{metric}_backend {a_side}~{b_side}", metric=f"{metric}_backend", sides=(a_side, b_side),
               value=float(diff[i]), tolerance=float(allowed[i]), passed=not bad.any(), first_failing_step=first,
               worst=common[i], detail=detail, reason=tolerance(precision, metric).reason + " " + __doc__.split(
                   "\n\n")[0].replace("\n", " "))


SHIFT_TOLERANCE = {"loss": "backend_shift", "val_loss": "backend_shift_val_loss",
                   "grad_norm": "backend_shift_grad_norm"}
"""Per BACKEND_METRICS, the tolerance entry bounding the shift itself: each metric whose pair bound takes the shift
has its shift bounded, so no metric can grant itself an accelerator-only error."""


SHIFT_GROWTH = 8.0
"""K of the growth bound (`shift_bounds`): a later step's loss shift may be at most K x the run's own step-0 shift
(K x sqrt(t / 16) past step 16). Measured on a TPU v5e over 44 correct chip runs (the 30-cell grid's 15 fp32 cells,
14 plants, the gpt2-tiny join; tests/data/tpu_v5e): the largest shift of a run was at most 3.5x its step-0 shift
(gpt2-tiny: each step's batch draws a fresh forward error of the step-0 size; the max of 16 draws is ~2.5 of them),
1.0-1.7x for the rope families, whose step-0 shift is already their largest. 8 leaves 2.3x over the worst."""
SHIFT_GROWTH_STEPS = 16
"""Steps over which SHIFT_GROWTH was measured; past them the bound grows as sqrt(t / 16), as a sum of independent
per-step rounding differences does."""
SHIFT_FLOOR_ULPS = 4
"""The step-0 shift taken as at least this many float32 ulps of the step-0 loss (1.9e-6 at 5.5 nats): a step-0 shift
of 0 or 1 ulp is a lucky draw, not an accelerator that computes like the CPU (measured step-0 shifts of correct chip
runs: 2 to 55 ulps)."""


def shift_bounds(shift: dict[int, float], values: dict[int, float], atol: float) -> tuple[dict[int, float], str]:
  """The bound on each step's loss shift of an accelerator side, and its derivation in words.

  Step 0 runs the initial weights: its shift is the accelerator's forward arithmetic alone, before any update, so
  no update error can enlarge it; it is held to `atol` (the 'backend_shift' table entry). Every later step t is
  held to min(atol, K x g(t) x s0), where s0 = max(the run's own step-0 shift, SHIFT_FLOOR_ULPS ulps of the step-0
  loss), K = SHIFT_GROWTH and g(t) = max(1, sqrt(t / SHIFT_GROWTH_STEPS)): the run's own rounding difference, as
  large as it may grow. An error only the accelerator makes in the update (a wrong update scale, a wrong gradient)
  leaves step 0 alone and moves the later steps past that.
  """
  if 0 not in shift or not np.isfinite(shift[0]):
    return {k: atol for k in shift}, f"table {atol:.3g} (no step-0 shift to derive a tighter bound from)"
  loss0 = abs(float(values.get(0, 1.0)))
  loss0 = loss0 if np.isfinite(loss0) and loss0 > 0 else 1.0  # no usable step-0 loss: the ulps of 1 nat
  floor = SHIFT_FLOOR_ULPS * float(np.spacing(np.float32(loss0)))
  s0 = max(float(shift[0]), floor)
  grow = lambda k: max(1.0, float(np.sqrt(k / SHIFT_GROWTH_STEPS)))
  bounds = {k: (atol if k == 0 else min(atol, SHIFT_GROWTH * grow(k) * s0)) for k in shift}
  raised = f" raised to {SHIFT_FLOOR_ULPS} ulps of the loss" if floor > shift[0] else ""
  how = (f"step 0 (the accelerator's forward arithmetic at the initial weights) <= {atol:.3g}; step t >= 1 <= "
         f"min({atol:.3g}, {SHIFT_GROWTH:g} x max(1, sqrt(t / {SHIFT_GROWTH_STEPS})) x {s0:.3g}), {s0:.3g} = this "
         f"run's step-0 shift {shift[0]:.3g}{raised}")
  return bounds, how


def update_error_caught(bounds: dict[int, float], values: dict[int, float]) -> float | None:
  """The smallest accelerator-only update error (relative: 1e-3 for every update 0.1% too large) the loss shift
  bound catches in this run, or None when the loss did not move. An update scaled by 1 + e moves the step-t loss by
  about e x c x (loss(0) - loss(t)), c = 0.49 measured on the chip (gpt2-tiny, 16 steps: an update 0.1% too large
  moved the step-15 loss by 4.12e-4 where it had fallen 0.848 nats); the error is caught where that exceeds the
  step's bound at some step."""
  if 0 not in values:
    return None
  fell = {k: abs(values[0] - values[k]) for k in bounds if k in values and k > 0}
  ratios = [bounds[k] / (0.49 * d) for k, d in fell.items() if np.isfinite(d) and d > 1e-6]
  return min(ratios) if ratios else None


def backend_shift_check(side: str, device: str, shift: dict[int, float], precision: str, metric: str = "loss",
                        values: dict[int, float] | None = None) -> Check | None:
  """'backend_shift <side>' (loss; '<metric>_backend_shift <side>' for the others): each step's |metric - metric on
  the CPU| of a side that ran on an accelerator against tolerance SHIFT_TOLERANCE[metric] (atol + rtol |value|,
  values: the side's own per-step values, for a relative bound); for the loss, later steps also against the run's
  own step-0 shift grown by at most SHIFT_GROWTH (`shift_bounds`). None without a shared step."""
  if not shift:
    return None
  tol = tolerance(precision, SHIFT_TOLERANCE[metric])
  values = values or {}
  allowed = {k: tol.atol + tol.rtol * abs(values.get(k, 0.0)) for k in shift}
  how, caught = "", None
  if metric == "loss":
    allowed, how = shift_bounds(shift, values, tol.atol)
    caught = update_error_caught(allowed, values)
  ratio = {k: (shift[k] / allowed[k] if np.isfinite(shift[k]) and allowed[k] > 0
              else 0.0 if shift[k] == 0 else np.inf) for k in shift}
  k = max(ratio, key=lambda s: ratio[s])
  bad = [s for s in sorted(shift) if not (np.isfinite(shift[s]) and shift[s] <= allowed[s])]
  name = f"backend_shift {side}" if metric == "loss" else f"{metric}_backend_shift {side}"
  detail = (f"{side} on {device} vs the same run on the host CPU: |Δ{metric}| = {shift[k]:.3g} at step {k} "
            f"(bound {allowed[k]:.3g}); {len(bad)} of {len(shift)} steps over")
  if how:
    detail += f"; bounds: {how}"
  if caught is not None:
    detail += f"; this run would catch an accelerator-only update error >= {100 * caught:.2g}%"
  return Check(name=name, metric="backend_shift" if metric == "loss" else f"{metric}_backend_shift", sides=(side,),
               value=float(shift[k]), tolerance=float(allowed[k]), passed=not bad,
               first_failing_step=bad[0] if bad else None, worst=k, detail=detail,
               reason=tol.reason + (" Later steps: " + " ".join(shift_bounds.__doc__.split("\n\n")[1].split())
                                    if metric == "loss" else ""))

def one_backend_check(metric: str, a_side: str, a_cpu: Sequence[dict], b_side: str, b_cpu: Sequence[dict],
                      reran: Sequence[str], precision: str) -> Check | None:
  """'<metric>_one_backend a~b': the pair on the host CPU alone, at the fp32 table with no shift (module docstring).

  Args:
    a_cpu, b_cpu: each side's steps on the host CPU: the rerun's for a side that ran on an accelerator (named in
      `reran`), the main run's for one that ran on the CPU.
  Returns:
    The Check, or None when the two share no step of the metric.
  """
  c = series_check(metric, a_side, a_cpu, b_side, b_cpu, precision)
  if c is None:
    return None
  on = " and ".join(f"{s}'s host-CPU rerun" for s in (a_side, b_side) if s in reran)
  c.name, c.metric = f"{metric}_one_backend {a_side}~{b_side}", f"{metric}_one_backend"
  c.detail = f"{c.detail}; on the host CPU alone ({on}), at the fp32 table: no backend shift granted"
  return c
