"""The tables of benchmarks/tpu_parts/kernels.py from one run's records (no jax here).

Overlap, per program of the `overlap` child against `compute` and `copies` of the same child (same process):
  hidden   (t_compute + t_copies - t_program) / min(t_compute, t_copies), clamped to [0, 1]: the share of the
           shorter of the two that ran under the longer (1: all of it; 0: in series).
MFU, per `mfu` row: tokens/s x training FLOPs per token / the chip's bf16 peak, counted two ways (`mfu_counts`): 6N
(parity.sizing.cost.flops_per_token: 6N + 12 L H Q s, every param, the untied input embedding's gather included,
attention dense) and strict (parity.sizing.cost.strict_flops_per_token: matmul params only; attention's causal half
for flash, which skips the masked blocks, dense for exact, which computes every score); flash against exact: the
tokens/s ratio and the first step's |loss difference| on the same weights and batch.
Agreement, from the `agree` child (one training from the same GPT-2 init on copy-task batches per case): the largest
|loss difference| over the steps of flash against exact (both bf16), and of the exact kernel's bf16 run against its
fp32 run, the rounding every bf16 run carries already. ratio = the first / the second: at or below 1, the kernel's
own rounding is inside bf16's.
"""
from __future__ import annotations

from typing import Any

from benchmarks.gpu_parts.common import compiled_device_peak, mfu_fields


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


def mfu_counts(row: dict[str, Any]) -> tuple[float | None, float | None]:
  """(6N, strict) MFU of one `mfu` row: its own fields, or for a row recorded before the strict count, the strict
  figure derived from its model (kernels.model_spec), seq, kernel, tokens/s and peak (common.mfu_fields)."""
  if "mfu_strict" in row or not (row.get("tokens_per_s") and row.get("peak_flops") and row.get("model")):
    return row.get("mfu"), row.get("mfu_strict")
  from benchmarks.tpu_parts.kernels import model_spec
  got = mfu_fields(model_spec(row["model"]), row["seq"], row["tokens_per_s"], row["peak_flops"],
                   causal_skip=row.get("kernel") == "flash")
  return row.get("mfu"), got["mfu_strict"]


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
  """Per layout of the headroom child: the device memory its step left free (the ballast bisection), what that saves
  against no offload, the state bytes it keeps in host memory and the share of those the device got back; the
  runtime's hold (`held`: memory_stats read right after the warm step, bytes in use + the program's reserved
  region, parity.protocol.memory_figures.runtime_device_bytes) and the share it gives back (`held_share`, the
  headline figure: a reading, where the bisection has a 0.21-0.26 GB bracket); and memory_analysis's readings:
  `device` = XLA's peak less the step's host buffers, `host` = those buffers, `xla_peak` = XLA's peak as it reads
  (host included), `sum_peak` = argument + output + temp - alias. The row's `peak_bytes_in_use` is not used: the
  child runs every layout in one process, so after the first it holds the earlier layouts' ballast."""
  from parity.protocol.memory_figures import runtime_device_bytes
  rows = [r for r in rec.get("rows") or [] if r.get("headroom_bytes") is not None]
  ref_row = next((r for r in rows if r["variant"] == "no-offload"), None)
  ref = None if ref_row is None else ref_row["headroom_bytes"]
  ref_held = None if ref_row is None else runtime_device_bytes(ref_row.get("memory_stats_after_step"))
  out = []
  for r in rows:
    peak = compiled_device_peak(r.get("memory_analysis"))
    host = sum(v for k, v in (r.get("state_bytes_by_kind") or {}).items() if k != "device")
    saved = None if ref is None else r["headroom_bytes"] - ref
    held = runtime_device_bytes(r.get("memory_stats_after_step"))
    held_saved = None if ref_held is None or held is None else ref_held - held
    out.append({"variant": r["variant"], "headroom": r["headroom_bytes"], "bracket": r.get("bracket_bytes"),
                "saved": saved, "on_host": host, "share": saved / host if saved is not None and host else None,
                "held": held, "held_saved": held_saved,
                "held_share": held_saved / host if held_saved is not None and host else None,
                "device": peak["device_bytes"], "host": peak["host_bytes"], "xla_peak": peak["xla_peak_bytes"],
                "sum_peak": peak["peak_bytes"]})
  return out


def _headroom_lines(rec: dict[str, Any]) -> list[str]:
  rows = headroom_rows(rec)
  if not rows and not rec.get("rows"):
    return []
  lines = ["", f"## Device memory each layout leaves free during its step (rc {rec.get('rc')})", "",
           "| layout | device held (runtime) GB | saved vs no offload GB | state on host GB | saved / on host "
           "(runtime) | free beside the step (ballast) GB | saved / on host (ballast) | compiled device GB | compiled "
           "host buffers GB |", "|---|---|---|---|---|---|---|---|---|"]
  g = lambda x: _fmt(None if x is None else x / 1e9, ".2f")
  for r in rows:
    lines.append(f"| {r['variant']} | {g(r['held'])} | {g(r['held_saved'])} | {g(r['on_host'])} | "
                 f"{_fmt(r['held_share'], '.0%')} | {g(r['headroom'])} | {_fmt(r['share'], '.0%')} | "
                 f"{g(r['device'])} | {g(r['host'])} |")
  lines += ["", "device held: memory_stats after the warm step, bytes in use + the program's reserved region; "
            "compiled device: XLA's peak_memory_in_bytes less the step's host buffers (pinned_host, host memory)."]
  lines += [f"- {r.get('variant')}: {r['error'][:200]}" for r in rec.get("rows") or [] if r.get("error")]
  return lines


def mfu_device_bytes(row: dict[str, Any]) -> tuple[int | None, str]:
  """(bytes, source) of an `mfu` row's device memory: the runtime's hold after its steps (memory_stats: bytes in use +
  the program's reserved region) where recorded, else the compiled step's device figure (XLA's peak less the step's
  host buffers, offload_report.device_bytes); (None, '') for a row that kept only the compiler's sum, which is not a
  device peak on a TPU."""
  from benchmarks.tpu_parts.offload_report import device_bytes
  from parity.protocol.memory_figures import runtime_device_bytes
  held = runtime_device_bytes(row.get("memory_stats_after_steps"))
  if held is not None:
    return held, "runtime"
  compiled = device_bytes(row)
  return (compiled, "compiled") if compiled is not None else (None, "")


def _device_cell(row: dict[str, Any]) -> str:
  value, source = mfu_device_bytes(row)
  return "" if value is None else f"{value / 1e9:.2f} ({source})"


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
              "| model | params | plan | kernel | micro x GA x seq | tokens/s | MFU (6N) | MFU (strict) | device peak "
              "GB | first loss |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in mfu["rows"]:
      plan = "deferred opt offload" if (r.get("stream") or {}).get("deferred") else "no offload"
      if r.get("error"):
        lines.append(f"| {r.get('model')} | | {plan} | {r.get('kernel')} | | {r['error'][:160]} | | | | |")
        continue
      lines.append(f"| {r['model']} | {r['n_params'] / 1e6:.0f}M | {plan} | {r['kernel']} | "
                   f"{r['micro']} x {r['grad_accum']} x {r['seq']} | {r['tokens_per_s']:,.0f} | "
                   f"{_fmt(mfu_counts(r)[0], '.1%')} | {_fmt(mfu_counts(r)[1], '.1%')} | "
                   f"{_device_cell(r)} | {r['first_loss']:.6f} |")
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
