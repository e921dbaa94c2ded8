"""The equivalence checks of a report (report.json 'equivalence', parity.verdict.equivalence) as rows: one per kind
and side, the same in report.md, report.html and the terminal. Plain text; callers escape."""
from __future__ import annotations

from parity.report.cells import fmt
from parity.report.run_record import RunRecord

__all__ = ["EQUIVALENCE_HEADERS", "equivalence_rows", "equivalence_intro", "equivalence_lines"]

EQUIVALENCE_HEADERS = ["check", "side", "normalization", "rerun", "max abs Δloss", "worst step",
                       "max rel. Δgrad norm", "params: worst element abs Δ", "params: max abs Δ / moved", "result"]


def _rerun(sec: dict) -> str:
  """The rerun's changed settings, e.g. 'grad_accum_steps=1, micro_batch_size=8' (eval_every left out)."""
  r = sec.get("rerun") or {}
  parts = [f"{k}={v}" for k, v in (r.get("changed") or {}).items() if k != "eval_every"]
  if r.get("nproc") is not None:
    parts.append(f"nproc={r['nproc']}")
  return ", ".join(parts) or "n/a"


def _result(row: dict, gating: bool) -> str:
  if row.get("status") not in (None, "ok") or row.get("max_abs_loss_diff") is None:
    return f"FAIL: {row.get('error') or row.get('status')}" if gating else f"not measured: {row.get('error')}"
  if not gating:
    return "reported only (distance)"
  return "PASS" if row.get("passed") else "FAIL"


def equivalence_rows(rec: RunRecord) -> list[list[str]]:
  """One row per kind and side (EQUIVALENCE_HEADERS); [] when the run asked for none."""
  out = []
  for kind, sec in rec.equivalence.items():
    for side, row in (sec.get("sides") or {}).items():
      norm = row.get("normalization") or sec.get("normalization")  # the side's own: a --perturb it kept
      out.append([kind, side, str(norm), _rerun(sec), fmt(row.get("max_abs_loss_diff")),
                  fmt(row.get("worst_step")), fmt(row.get("max_grad_norm_rel_diff")),
                  fmt(row.get("params_max_abs_diff")), fmt(row.get("params_ratio_max")),
                  _result(row, bool(sec.get("gating")))])
  return out


def equivalence_intro(rec: RunRecord) -> str:
  """The sentence above the table: what each kind compares and when it gates."""
  secs = rec.equivalence
  what = "; ".join(f"{k}: {s.get('method')}" for k, s in secs.items())
  return (f"Each side trained again in an equivalent shape and held against its own main run ({what}). With "
          "loss_normalization 'tokens' in fp32 each must hold to fp32 rounding (max abs Δloss ≤ 1e-05 nats, "
          "grad norm and final params within the fp32 rules); with 'micro_mean' (or bf16/fp16) the distance is "
          "reported, not gated: a mean of micro-batch means is not invariant to these reshapes on uneven examples.")


def equivalence_lines(rec: RunRecord) -> list[str]:
  """One terminal line per kind and side: 'equivalence ga jax: max |Δloss| 3e-07, PASS'."""
  return [f"equivalence {r[0]} {r[1]} ({r[2]}): max |Δloss| {r[4]} at step {r[5]}, params |Δ|/moved {r[8]}: {r[9]}"
          for r in equivalence_rows(rec)]
