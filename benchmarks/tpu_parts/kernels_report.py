"""The tables of benchmarks/tpu_parts/kernels.py from one run's records (no jax here).

Overlap, per program of the `overlap` child against `compute` and `copies` of the same child (same process):
  hidden   (t_compute + t_copies - t_program) / min(t_compute, t_copies), clamped to [0, 1]: the share of the
           shorter of the two that ran under the longer (1: all of it; 0: in series).
MFU, per `mfu` row: tokens/s x training FLOPs per token (parity.sizing.cost.flops_per_token: 6N + 12 L H Q s) / the
chip's bf16 peak; flash against exact: the tokens/s ratio and the first step's |loss difference| on the same weights
and batch.
"""
from __future__ import annotations

from typing import Any


def hidden_share(t_compute: float, t_copies: float, t_both: float) -> float:
  """Share of the shorter of compute and copies that overlapped the longer (module docstring), in [0, 1]."""
  shorter = min(t_compute, t_copies)
  if shorter <= 0:
    return 0.0
  return max(0.0, min(1.0, (t_compute + t_copies - t_both) / shorter))


def overlap_rows(rec: dict[str, Any]) -> list[dict[str, Any]]:
  """One row per program of an overlap child's record, with its hidden share where compute and copies were timed."""
  rows = rec.get("rows") or {}
  t_c = (rows.get("compute") or {}).get("seconds")
  t_x = (rows.get("copies") or {}).get("seconds")
  out = []
  for name, r in rows.items():
    row = {"program": name, "seconds": r.get("seconds"), "error": r.get("error")}
    if t_c and t_x and r.get("seconds") and name not in ("compute", "copies"):
      row["hidden"] = hidden_share(t_c, t_x, r["seconds"])
    out.append(row)
  return out


def flash_pairs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """flash against exact for each (model, plan, stream) both kernels ran: speed ratio and first-loss difference."""
  key = lambda r: (r.get("model"), str(r.get("plan")), str(r.get("stream")))
  exact = {key(r): r for r in rows if r.get("kernel") == "exact" and r.get("tokens_per_s")}
  out = []
  for r in rows:
    e = exact.get(key(r))
    if r.get("kernel") == "flash" and r.get("tokens_per_s") and e:
      out.append({"model": r["model"], "speedup": r["tokens_per_s"] / e["tokens_per_s"],
                  "first_loss_diff": abs(r["first_loss"] - e["first_loss"])})
  return out


def _fmt(x: Any, spec: str = ".3g") -> str:
  return "" if x is None else format(x, spec) if isinstance(x, (int, float)) else str(x)


def markdown(result: dict[str, Any]) -> str:
  ch = result.get("children", {})
  lines = [f"# Overlap and attention kernels ({result.get('mode')}, {result.get('date')})", ""]
  for name in ("overlap", "overlap-flags"):
    rec = ch.get(name)
    if not rec:
      continue
    lines += [f"## {name}: {rec.get('layers')} layers x {_fmt((rec.get('slice_bytes') or 0) / 2**20)} MiB slices, "
              f"{rec.get('matmuls_per_layer')} matmuls of {rec.get('matmul_dim')} per layer (rc {rec.get('rc')})", "",
              "| program | ms | hidden |", "|---|---|---|"]
    for row in overlap_rows(rec):
      ms = None if row["seconds"] is None else row["seconds"] * 1e3
      lines.append(f"| {row['program']} | {_fmt(ms, '.2f') or row['error']} | {_fmt(row.get('hidden'), '.0%')} |")
    lines.append("")
  mfu = ch.get("mfu") or {}
  if mfu.get("rows"):
    lines += [f"## Step and MFU (rc {mfu.get('rc')})", "",
              "| model | params | plan | kernel | micro x GA x seq | tokens/s | MFU | device peak GB | first loss |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in mfu["rows"]:
      plan = "deferred opt offload" if (r.get("stream") or {}).get("deferred") else "no offload"
      if r.get("error"):
        lines.append(f"| {r.get('model')} | | {plan} | {r.get('kernel')} | | {r['error'][:160]} | | | |")
        continue
      lines.append(f"| {r['model']} | {r['n_params'] / 1e6:.0f}M | {plan} | {r['kernel']} | "
                   f"{r['micro']} x {r['grad_accum']} x {r['seq']} | {r['tokens_per_s']:,.0f} | "
                   f"{_fmt(r.get('mfu'), '.1%')} | "
                   f"{_fmt(r.get('device_peak_bytes', 0) / 1e9, '.2f')} | {r['first_loss']:.6f} |")
    pairs = flash_pairs(mfu["rows"])
    if pairs:
      lines += ["", "| model | flash / exact tokens/s | first-step loss |flash - exact| |", "|---|---|---|"]
      lines += [f"| {p['model']} | {p['speedup']:.2f} | {p['first_loss_diff']:.2e} |" for p in pairs]
  return "\n".join(lines) + "\n"
