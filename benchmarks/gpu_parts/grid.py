"""The train grid's figures and what they say about offload (imports neither jax nor torch).

The grid (the TPU flow's train part) times each JAX plan of --jax-plans on one model at each gradient accumulation of
--grad-accum (jax_train --grad-accum: one process per plan). For each offload plan and accumulation, against the
grid's no-offload plan at the same accumulation (`offload_row`):

  added       = step_offload - step_none: the seconds offload adds to a step.
  transfer    = moved / rate: the step's host<->device bytes (the compiled step's S(5) entry buffers, both
                directions) at the in-step rate jax_raw measured (a donated pinned_host round trip inside jit,
                both directions' bytes / s: what a step's offloaded state sees).
  overlap     = 1 - added / transfer: the share of the moves' time the step hid behind compute; clamped to [0, 1]
                with a note saying why (added < 0: the offload run was faster, noise; added > transfer: offload
                costs more than its moves at that rate, other work such as the streamed update dominates).
  link_bound  = t_none / max(t_none, transfer): the most of the no-offload speed a step can keep when its moves
                overlap perfectly (1 when they fit under the compute), and `achieved` = kept / link_bound, kept =
                tokens/s offload / tokens/s none.
  mem_saved   = (device peak none - device peak offload) / the bytes the plan keeps in host memory: the share of
                the offloaded bytes the device peak actually drops by (compiled device figures, memory_analysis:
                XLA's peak less the host buffers, common.compiled_device_peak).
"""
from __future__ import annotations

from typing import Any, Mapping

from benchmarks.gpu_parts.common import recorded_device_bytes, sizing_modules

HOST_KINDS = ("pinned_host", "unpinned_host")


def offloads(plan: str) -> bool:
  """Whether a plan of parity.sizing.plans.PLANS (or NAME@POLICY, sizing.plan_variant) keeps state or activations in
  host memory on the JAX side."""
  from benchmarks.gpu_parts.sizing import plan_variant
  _, plans = sizing_modules()
  name, remat = plan_variant(plan)
  jp = plans.PLANS[name].jax
  return bool(jp.offload_params or jp.offload_opt_state or "offload" in (remat or jp.remat))


def in_step_rate(raw: Mapping[str, Any] | None) -> dict[str, Any] | None:
  """{'gbs', 'source'} of the in-step host<->device rate from jax_raw's record (its donated round trip; from what the
  part wrote before it was stopped, when it was), else None."""
  raw = raw or {}
  bw = (raw.get("result") or raw.get("partial") or {}).get("bandwidth") or {}
  trip = bw.get("jit_round_trip_donated")
  if not trip or not trip.get("median_gbs"):
    return None
  cpu = "cpu" in str(bw.get("kind", "")).lower()
  return {"gbs": trip["median_gbs"], "source": "jax_raw jit_round_trip_donated (donated pinned_host buffers, both "
          "directions' bytes / s, median)" + ("; CPU: every memory kind is the same RAM" if cpu else "")}


def overlap(added_s: float, transfer_s: float | None) -> tuple[float | None, str]:
  """(1 - added / transfer clamped to [0, 1], the note); (None, why) without a transfer time."""
  if not transfer_s:
    return None, "no transfer time (no bytes moved or no measured rate)"
  raw = 1 - added_s / transfer_s
  if raw > 1:
    return 1.0, f"clamped from {raw:.2f}: the offload run was not slower (noise between runs)"
  if raw < 0:
    return 0.0, (f"clamped from {raw:.2f}: offload adds {added_s / transfer_s:.1f}x its moves' time at the measured "
                 "rate, so other work (the streamed update, the moves' own overheads) dominates")
  return raw, ""


def host_bytes(result: Mapping[str, Any]) -> int:
  """The bytes a jax_train result keeps in host memory kinds (its state per memory kind)."""
  kinds = result.get("state_bytes_by_memory_kind") or {}
  return int(sum(kinds.get(k, 0) for k in HOST_KINDS))


def offload_row(none: Mapping[str, Any], off: Mapping[str, Any], host: int, rate_gbs: float | None) -> dict[str, Any]:
  """The module docstring's figures for one offload run `off` against the no-offload run `none` (jax_train --grad-accum
  run records of the same accumulation); `host`: the offload plan's host bytes."""
  t_none, t_off = none["median_s"], off["median_s"]
  added = t_off - t_none
  moved = off.get("moved_bytes_per_step") or 0
  transfer = moved / (rate_gbs * 1e9) if rate_gbs and moved else None
  ov, note = overlap(added, transfer)
  kept = t_none / t_off
  bound = t_none / max(t_none, transfer) if transfer else None
  peak_none, peak_off = (recorded_device_bytes(r.get("compiled")) for r in (none, off))  # device only, no host
  saved = (peak_none - peak_off) / host if host and peak_none is not None and peak_off is not None else None
  return {"grad_accum": off["grad_accum"], "tokens_per_s_none": none["tokens_per_s"],
          "tokens_per_s_offload": off["tokens_per_s"], "kept": kept, "step_s_none": t_none, "step_s_offload": t_off,
          "added_s": added, "moved_bytes_per_step": moved, "transfer_s": transfer, "overlap": ov,
          "overlap_note": note, "link_bound": bound, "achieved_of_link_bound": kept / bound if bound else None,
          "device_peak_none": peak_none, "device_peak_offload": peak_off, "host_bytes": host,
          "mem_saved_of_host": saved}


def summary(results: Mapping[str, Mapping[str, Any]], plans: list[str], rate: dict | None) -> dict[str, Any]:
  """{'none_plan', 'rate', 'rows': [offload_row + 'plan' per offload plan and accumulation], 'missing': [why a pair
  has no row]} of the grid's results ({plan: jax_train --grad-accum result})."""
  none_plan = next((p for p in plans if not offloads(p)), None)
  out: dict[str, Any] = {"none_plan": none_plan, "rate": rate, "rows": [], "missing": []}
  if none_plan is None:
    out["missing"].append("no plan without offload in --jax-plans to compare against")
    return out
  base = {r["grad_accum"]: r for r in (results.get(none_plan) or {}).get("runs", []) if r.get("status") == "ok"}
  for plan in plans:
    if plan == none_plan or not offloads(plan):
      continue
    res = results.get(plan) or {}
    for run in res.get("runs", []):
      ga = run["grad_accum"]
      if run.get("status") != "ok" or ga not in base:
        out["missing"].append(f"{plan} at grad accum {ga}: " + (
            f"{run.get('status')} ({run.get('error', '')[:120]})" if run.get("status") != "ok"
            else f"{none_plan} did not run at grad accum {ga}"))
        continue
      out["rows"].append({"plan": plan, **offload_row(base[ga], run, host_bytes(res), rate and rate["gbs"])})
  return out
