"""The one-side 'placement' check: the compiled step keeps every tensor class in the memory space its plan names
(run_dir/<side>/placement.json, written by the JAX worker from its compiled step: jax_impl.placement).

It FAILs at step 0 naming the class and both memory spaces ('placement: opt_state planned pinned_host, compiled in
device memory (59/59 buffers in, 59/59 out)'). A side that finished without a usable placement.json gets the check
as not run (reported only, saying why); a side that did not finish gets none. Numpy-free, framework-free.
"""
from __future__ import annotations

from typing import Any, Mapping

from parity.protocol.placement import host_ops_of, judged_mismatches, split_host_compute
from parity.verdict.check import Check

__all__ = ["placement_check", "PLACEMENT_REASON", "mismatch_text"]

PLACEMENT_REASON = ("the compiled step must keep each tensor class (params, optimizer state, batch, metrics, the remat "
                    "policy's residuals) in the memory space its JaxPlan names, and compute on the device: read from "
                    "the executable's entry layout (host memory spaces S(5)/S(6)), its jaxpr and, on GPU and TPU, its "
                    "HLO copies and ops (docs/plans.md 'Placement from the compiled step'); any difference FAILs, but "
                    "scalar ops of at most 8 bytes that XLA keeps in host memory are listed only "
                    "(parity.protocol.placement.BOOKKEEPING_BYTES)")
FINISHED = ("ok", "nan")
"""Statuses of a side that compiled and trained (a NaN run stopped after its step ran)."""


def _planned(m: Mapping[str, Any], rec: Mapping[str, Any]) -> str:
  kind = (rec.get("plan") or {}).get("host_memory_kind") or "host"
  return kind if m.get("expected") == "host" else str(m.get("expected"))


def mismatch_text(rec: Mapping[str, Any], mismatches: list[dict] | None = None) -> list[str]:
  """One phrase per class the record's mismatches name, its roles folded: 'opt_state planned pinned_host, compiled
  in device memory (59/59 buffers in, 59/59 out)'; a compute or residual mismatch says what it saw. mismatches: the
  record's judged_mismatches when the caller has them already."""
  out: dict[tuple, list[Mapping[str, Any]]] = {}
  for m in judged_mismatches(dict(rec)) if mismatches is None else mismatches:
    out.setdefault((m.get("class"), m.get("expected"), m.get("compiled"), m.get("role") == "compute"), []).append(m)
  phrases = []
  for (cls, _, compiled, compute), ms in out.items():
    counts = [f"{m['buffers']['mismatched']}/{m['buffers']['of']} buffers {'in' if m['role'] == 'argument' else 'out'}"
              for m in ms if isinstance(m.get("buffers"), Mapping)]
    where = "computed in host memory" if compute else f"compiled in {compiled} memory"
    extra = f" ({', '.join(counts)})" if counts else f" ({ms[0].get('detail')})"
    phrases.append(f"{cls} planned {_planned(ms[0], rec)}, {where}{extra}")
  return phrases


def _agree(rec: Mapping[str, Any]) -> str:
  """'params device, opt_state pinned_host, batch device, metrics device; activations device' (the argument rows,
  the metrics, the residuals' expectation)."""
  kind = (rec.get("plan") or {}).get("host_memory_kind") or "host"
  seen: dict[str, str] = {}
  for row in rec.get("classes") or []:
    seen.setdefault(row.get("class"), kind if row.get("expected") == "host" else str(row.get("expected")))
  acts = (rec.get("activations") or {}).get("expected")
  tail = f"; activations {kind if acts == 'host' else acts}" if acts else ""
  return ", ".join(f"{c} {k}" for c, k in seen.items()) + tail


def placement_check(side: str, entry: Mapping[str, Any] | None, status: str) -> Check | None:
  """The 'placement <side>' check, or None (a side without a placement record to expect, or one that did not finish).

  Args:
    side: the side's name.
    entry: parity.pipeline.collect's {'record': placement.json's dict or None, 'problem': why it is None}; None for
      a side whose worker writes no placement.json.
    status: the side's status.
  Returns:
    A Check with sides (side,): value the number of mismatches, tolerance 0, FAIL at step 0 naming each class; not
    run (reported only, value NaN) when the record is missing or not this run's.
  """
  if entry is None or status not in FINISHED:
    return None
  rec = entry.get("record")
  name = f"placement {side}"
  if rec is None:  # reported only: parity.verdict.gating.NOT_RUN_REPORTED_ONLY allows it for a check that could not run
    return Check(name=name, metric="placement", sides=(side,), value=float("nan"), tolerance=0.0, passed=False,
                 detail=f"placement: not run: {entry.get('problem') or 'no placement.json'}", reason=PLACEMENT_REASON,
                 gating=False)
  mismatches = judged_mismatches(dict(rec))
  phrases = mismatch_text(rec, mismatches)
  detail = ("placement: " + "; ".join(phrases) if phrases
            else f"placement: every tensor class where the plan puts it ({_agree(rec)})") + _bookkeeping(rec)
  return Check(name=name, metric="placement", sides=(side,), value=float(len(mismatches)),
               tolerance=0.0, passed=not phrases, first_failing_step=0 if phrases else None,
               worst=mismatches[0].get("class") if phrases else None, detail=detail, reason=PLACEMENT_REASON)


def _bookkeeping(rec: Mapping[str, Any]) -> str:
  """'; listed, not failed: 43 scalar ops XLA computes in host memory (172 bytes: add x30, compare x2, ...)' or ''."""
  _, small, _ = split_host_compute(host_ops_of(rec))
  if not small:
    return ""
  counts: dict[str, int] = {}
  for op in small:
    counts[str(op.get("opcode"))] = counts.get(str(op.get("opcode")), 0) + 1
  ops = ", ".join(f"{k} x{n}" for k, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
  total = sum(int(op.get("bytes") or 0) for op in small)
  return (f"; listed, not failed: {len(small)} scalar ops XLA computes in host memory, the offloaded update "
          f"count's bookkeeping ({total} bytes: {ops})")
