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

__all__ = ["BACKEND_METRICS", "SHIFT_TOLERANCE", "on_accelerator", "device_class", "shifts", "backend_pair_check",
           "backend_shift_check", "one_backend_check"]

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


def backend_shift_check(side: str, device: str, shift: dict[int, float], precision: str, metric: str = "loss",
                        values: dict[int, float] | None = None) -> Check | None:
  """'backend_shift <side>' (loss; '<metric>_backend_shift <side>' for the others): the largest |metric - metric on
  the CPU| of a side that ran on an accelerator against tolerance SHIFT_TOLERANCE[metric] (atol + rtol |value|,
  values: the side's own per-step values, for a relative bound); None without a shared step."""
  if not shift:
    return None
  tol = tolerance(precision, SHIFT_TOLERANCE[metric])
  allowed = {k: tol.atol + tol.rtol * abs((values or {}).get(k, 0.0)) for k in shift}
  ratio = {k: (shift[k] / allowed[k] if np.isfinite(shift[k]) else np.inf) for k in shift}
  k = max(ratio, key=lambda s: ratio[s])
  bad = [s for s in sorted(shift) if not (np.isfinite(shift[s]) and shift[s] <= allowed[s])]
  name = f"backend_shift {side}" if metric == "loss" else f"{metric}_backend_shift {side}"
  return Check(name=name, metric="backend_shift" if metric == "loss" else f"{metric}_backend_shift", sides=(side,),
               value=float(shift[k]), tolerance=float(allowed[k]), passed=not bad,
               first_failing_step=bad[0] if bad else None, worst=k,
               detail=f"{side} on {device} vs the same run on the host CPU: |Δ{metric}| = {shift[k]:.3g} at step {k} "
                      f"(bound {allowed[k]:.3g}); {len(bad)} of {len(shift)} steps over",
               reason=tol.reason)


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
