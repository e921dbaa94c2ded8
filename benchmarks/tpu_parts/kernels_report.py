"""The tables of benchmarks/tpu_parts/kernels.py from one run's records (no jax here).

Overlap, per program of the `overlap` child against `compute` and `copies` of the same child (same process):
  hidden   (t_compute + t_copies - t_program) / min(t_compute, t_copies), clamped to [0, 1]: the share of the
           shorter of the two that ran under the longer (1: all of it; 0: in series).
MFU, per `mfu` row: tokens/s x training FLOPs per token (parity.sizing.cost.flops_per_token: 6N + 12 L H Q s) / the
chip's bf16 peak; flash against exact: the tokens/s ratio and the first step's |loss difference| on the same weights
and batch.
Agreement, from the `agree` child (one training from the same GPT-2 init on copy-task batches per case): the largest
|loss difference| over the steps of flash against exact (both bf16), and of the exact kernel's bf16 run against its
fp32 run, the rounding every bf16 run carries already. ratio = the first / the second: at or below 1, the kernel's
own rounding is inside bf16's.
"""
from __future__ import annotations

from typing import Any

from benchmarks.gpu_parts.common import compiled_device_peak


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


def agreement(rec: dict[str, Any]) -> dict[str, Any] | None:
  """The agree child's comparison (module docstring), or None when a case it needs did not run."""
  runs = {(r.get("precision"), r.get("kernel")): r.get("losses") for r in rec.get("rows") or []}
  exact16, exact32, flash16 = runs.get(("bf16", "exact")), runs.get(("fp32", "exact")), runs.get(("bf16", "flash"))
  if not exact16 or not exact32:
    return None
  gap = lambda a, b: max(abs(x - y) for x, y in zip(a, b, strict=True))
  out = {"steps": len(exact16), "bf16_vs_fp32": gap(exact16, exact32), "first_loss": exact16[0],
         "last_loss": exact16[-1]}
  if flash16:
    out["flash_vs_exact"] = gap(flash16, exact16)
    out["ratio"] = out["flash_vs_exact"] / out["bf16_vs_fp32"] if out["bf16_vs_fp32"] else None
  return out


def headroom_rows(rec: dict[str, Any]) -> list[dict[str, Any]]:
  """Per layout of the headroom child: the device memory its step left free, what that saves against no offload,
  the state bytes it keeps in host memory, the share of those the device got back, and memory_analysis's two
  readings of the device peak (XLA's peak_memory_in_bytes; argument + output + temp - alias) for comparison."""
  rows = [r for r in rec.get("rows") or [] if r.get("headroom_bytes") is not None]
  ref = next((r["headroom_bytes"] for r in rows if r["variant"] == "no-offload"), None)
  out = []
  for r in rows:
    peak = compiled_device_peak(r.get("memory_analysis"))
    host = sum(v for k, v in (r.get("state_bytes_by_kind") or {}).items() if k != "device")
    saved = None if ref is None else r["headroom_bytes"] - ref
    out.append({"variant": r["variant"], "headroom": r["headroom_bytes"], "bracket": r.get("bracket_bytes"),
                "saved": saved, "on_host": host, "share": saved / host if saved is not None and host else None,
                "xla_peak": peak["xla_peak_bytes"], "sum_peak": peak["peak_bytes"]})
  return out


def _headroom_lines(rec: dict[str, Any]) -> list[str]:
  rows = headroom_rows(rec)
  if not rows and not rec.get("rows"):
    return []
  lines = ["", f"## Device memory each layout leaves free during its step (rc {rec.get('rc')})", "",
           "| layout | free beside the step GB | saved vs no offload GB | state on host GB | saved / on host | "
           "XLA peak GB | arg+out+temp-alias GB |", "|---|---|---|---|---|---|---|"]
  g = lambda x: _fmt(None if x is None else x / 1e9, ".2f")
  for r in rows:
    lines.append(f"| {r['variant']} | {g(r['headroom'])} | {g(r['saved'])} | {g(r['on_host'])} | "
                 f"{_fmt(r['share'], '.0%')} | {g(r['xla_peak'])} | {g(r['sum_peak'])} |")
  lines += [f"- {r.get('variant')}: {r['error'][:200]}" for r in rec.get("rows") or [] if r.get("error")]
  return lines


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
  lines += _headroom_lines(ch.get("headroom") or {})
  lines += _agree_lines(ch.get("agree") or {})
  return "\n".join(lines) + "\n"


def _agree_lines(rec: dict[str, Any]) -> list[str]:
  if not rec.get("rows"):
    return []
  lines = ["", f"## Flash against exact in training ({rec.get('model')}, {rec.get('steps')} steps, micro "
           f"{rec.get('micro')} x seq {rec.get('seq')}, copy-task batches; rc {rec.get('rc')})", ""]
  lines += [f"- {r.get('precision')} {r.get('kernel')}: {r['error'][:200]}" for r in rec["rows"] if r.get("error")]
  a = agreement(rec)
  if a:
    lines.append(f"- exact bf16 loss {a['first_loss']:.4f} -> {a['last_loss']:.4f}; max |bf16 - fp32| (exact) "
                 f"{a['bf16_vs_fp32']:.3e}")
    if "flash_vs_exact" in a:
      lines.append(f"- max |flash - exact| (bf16) {a['flash_vs_exact']:.3e}: {_fmt(a.get('ratio'), '.2f')} of it")
  return lines
