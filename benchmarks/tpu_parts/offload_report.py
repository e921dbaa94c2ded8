"""The tables of benchmarks/tpu_parts/offload.py, and the figures derived from one run's records (no jax here).

Derived, per offload variant against the no-offload row at the same tokens per step (same run, same process):
  transfer_s     bytes the step moves between host and device / the in-step rate of both directions together
                 (the `rates` child's `both`: a jitted program reading and writing a pinned_host buffer)
  added_s        median step time with offload - without
  hidden         1 - added_s / transfer_s: the share of the copy time that overlaps compute (clamped to [0, 1])
  link_bound     t0 / max(t0, transfer_s): the best tokens/s ratio a link of that rate allows (1 when the copies
                 fit inside the compute)
  of_bound       (t0 / t) / link_bound: how much of that bound the variant reaches
  saved          (device peak without offload - with) / the bytes the variant keeps in host memory; the device
                 peak is `device_bytes`: never the step's host buffers, nor the compiler's argument + output + temp -
                 alias, which on a TPU counts temporaries the runtime does not hold at once
MFU, per row, two counts against the chip's bf16 peak: 6N (the row's flops_per_token: 6N + 12 L H Q s, every param,
the untied input embedding's gather included) and strict (`strict_flops`: matmul params only; attention dense, as
the exact kernel these rows run computes every score).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

GB = 1e9
PEAK_BF16 = {"TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v5": 459e12, "TPU v6 lite": 918e12,
             "TPU v6e": 918e12}
"""bf16 dense peak FLOP/s per chip from Google Cloud's TPU data sheets (v5e 197, v5p 459, v6e Trillium 918 TFLOP/s);
the device_kind strings jax reports, most specific first."""


def peak_bf16(device_kind: str | None) -> float | None:
  for key, value in PEAK_BF16.items():
    if device_kind and device_kind.startswith(key):
      return value
  return None


def strict_flops(row: dict) -> float | None:
  """Strict FLOPs per token of a timed row (parity.sizing.cost.strict_flops_per_token, attention dense): its own
  field, or for a row recorded before it, derived from the model whose 6N count the row carries (offload.model_spec,
  full or tiny); None when neither matches."""
  if row.get("strict_flops_per_token") or not row.get("flops_per_token"):
    return row.get("strict_flops_per_token")
  from benchmarks.tpu_parts.offload import model_spec
  from parity.sizing.cost import flops_per_token, strict_flops_per_token
  for tiny in (False, True):
    model = model_spec(tiny)
    if flops_per_token(model, row["seq"]) == row["flops_per_token"]:
      return float(strict_flops_per_token(model, row["seq"]))
  return None


def host_info() -> dict[str, Any]:
  """Cores, memory and the XLA/TPU environment of the machine the driver runs on."""
  mem = None
  try:
    for line in Path("/proc/meminfo").read_text().splitlines():
      if line.startswith("MemTotal:"):
        mem = int(line.split()[1]) * 1024
  except OSError:
    pass
  env = {k: v for k, v in os.environ.items() if k.startswith(("XLA_", "LIBTPU", "TPU_", "JAX_"))}
  return {"cpus": os.cpu_count(), "memory_bytes": mem, "env": env}


def _host_bytes(row: dict) -> int:
  kinds = row.get("state_bytes_by_kind") or {}
  return int(sum(v for k, v in kinds.items() if k != "device"))


def device_bytes(row: dict) -> int | None:
  """A timed row's compiled device figure: XLA's peak less the step's host buffers (from the row's memory_analysis,
  parity.protocol.memory_figures.compiled_peak_bytes, or its own 'device_peak_bytes' where it says how it was had,
  'device_from'); None for a row that kept only the compiler's sum argument + output + temp - alias, which on a TPU
  counts temporaries the runtime does not hold at once (not a device peak)."""
  from parity.protocol.memory_figures import compiled_peak_bytes
  if row.get("memory_analysis"):
    return compiled_peak_bytes(row["memory_analysis"])[0]
  return row.get("device_peak_bytes") if row.get("device_from") else None


def derive(rows: list[dict], both_gbs: float | None) -> list[dict]:
  """Each timed row with the derived figures of the module docstring (rows without a time are passed through)."""
  base = {r["grad_accum"]: r for r in rows if r.get("variant") == "no-offload" and "median_s" in r}
  out = []
  for r in rows:
    d = dict(r)
    b = base.get(r.get("grad_accum"))
    if "median_s" in r:
      d["device_bytes"] = device_bytes(r)
    if "median_s" in r and b is not None:
      t0, t = b["median_s"], r["median_s"]
      d["vs_no_offload"] = t0 / t
      host = _host_bytes(r)
      d["host_state_bytes"] = host
      base_device = device_bytes(b)
      if host and base_device and d["device_bytes"] is not None:
        d["saved_fraction"] = (base_device - d["device_bytes"]) / host
      moved = r.get("entry_moved_bytes") or 0
      if moved and both_gbs:
        transfer = moved / (both_gbs * GB)
        added = t - t0
        bound = t0 / max(t0, transfer)
        d.update(transfer_s=transfer, added_s=added, hidden=min(1.0, max(0.0, 1 - added / transfer)),
                 link_bound=bound, of_bound=(t0 / t) / bound)
    out.append(d)
  return out


def _f(x: Any, fmt: str = "{:.3g}") -> str:
  return "" if x is None else fmt.format(x)


def _timing_table(title: str, child: dict, both_gbs: float | None) -> list[str]:
  lines = [f"### {title}", "", f"device {child.get('device')}, LIBTPU_INIT_ARGS: `{child.get('libtpu_init_args')}`",
           "", "| variant | tokens/step | tokens/s | × no-offload | MFU (6N) | MFU (strict) | device peak GB "
           "(compiled) | on host GB | saved / on host | moved GB | transfer ms | added ms | hidden | of link bound |",
           "|" + "---|" * 14]
  peak = peak_bf16(child.get("device"))
  for r in derive(child.get("rows", []), both_gbs):
    if "error" in r:
      lines.append(f"| {r['variant']} | GA {r['grad_accum']} | {r['error'][:160]} |" + " |" * 11)
      continue
    mfu = r["tokens_per_s"] * r["flops_per_token"] / peak if peak else None
    strict = strict_flops(r)
    mfu_strict = r["tokens_per_s"] * strict / peak if peak and strict else None
    lines.append("| " + " | ".join([
        r["variant"], str(r["tokens_per_step"]), _f(r["tokens_per_s"], "{:,.0f}"), _f(r.get("vs_no_offload"),
                                                                                        "{:.2f}"),
        _f(mfu, "{:.1%}"), _f(mfu_strict, "{:.1%}"), _f(r.get("device_bytes") and r["device_bytes"] / GB, "{:.2f}"),
        _f(r.get("host_state_bytes", 0) / GB, "{:.2f}"),
        _f(r.get("saved_fraction"), "{:.0%}"), _f(r.get("entry_moved_bytes", 0) / GB, "{:.2f}"),
        _f(r.get("transfer_s") and r["transfer_s"] * 1e3, "{:.0f}"), _f(r.get("added_s") and r["added_s"] * 1e3,
                                                                        "{:.0f}"),
        _f(r.get("hidden"), "{:.0%}"), _f(r.get("of_bound"), "{:.0%}")]) + " |")
  return lines + [""]


def markdown(result: dict) -> str:
  ch = result.get("children", {})
  rates = ch.get("rates", {})
  both = (rates.get("both") or {}).get("gb_per_s")
  lines = [f"# Host offload on {rates.get('device') or ch.get('timing', {}).get('device')}: copies, overlap, memory",
           "", f"{result.get('date')}, mode {result.get('mode')}, host {result.get('host', {}).get('cpus')} CPUs, "
           f"{_f((result.get('host', {}).get('memory_bytes') or 0) / 2**30, '{:.0f}')} GiB", "",
           "## In-step copy rates (pinned_host <-> device)", "", "| direction | GB/s | seconds |", "|---|---|---|"]
  for k in ("h2d", "d2h", "both"):
    r = rates.get(k) or {}
    lines.append(f"| {k} | {_f(r.get('gb_per_s'), '{:.2f}')} | {_f(r.get('seconds'), '{:.4f}')} "
                 f"{r.get('error', '')[:120]} |")
  lines += ["", "## Offload on/off in fp32 (tiny llama, same init and batches)", "",
            "| variant | remat | against | bitwise | max abs param diff | max abs moment diff | losses equal |",
            "|---|---|---|---|---|---|---|"]
  for r in ch.get("equality", {}).get("rows", []):
    if "error" in r:
      lines.append(f"| {r['variant']} | {r['remat']} | {r.get('reference')} | error: {r['error'][:160]} | | | |")
    else:
      lines.append(f"| {r['variant']} | {r['remat']} | {r.get('reference', '')} | {r['bitwise']} | "
                   f"{r['max_abs_param_diff']:.3g} | "
                   f"{r['max_abs_moment_diff']:.3g} | {r['loss_equal']} |")
  lines.append("")
  for key, title in (("timing", "Step timing, default XLA flags"), ("flags", "Step timing, host-offload flags")):
    if key in ch:
      lines += _timing_table(title, ch[key], both)
  for key, c in ch.items():
    if c.get("rc") not in (0, None) or "log_tail" in c:
      lines += [f"child {key}: rc {c.get('rc')}", "```", str(c.get("log_tail", ""))[-1500:], "```", ""]
  return "\n".join(lines)
