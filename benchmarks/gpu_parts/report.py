"""Markdown of the accelerator benchmark's JSON (benchmarks/gpu.py writes both; the grid flow's sections:
report_grid.py). No jax, no torch."""
from __future__ import annotations

from typing import Any

from benchmarks.gpu_parts.common import MFU_NOTE, peak_flops
from benchmarks.gpu_parts.fixed_flow import SIDES as FLOW_SIDES

GiB = 2**30
SIDES = tuple(FLOW_SIDES)
"""The fixed flow's sides, in its order."""
PUBLISHED_KEPT = "18-42 %"
"""Tokens/s kept with full optimizer-state offload over PCIe in published results (the quoted range)."""


def mfu_pair(d: dict[str, Any], key: str | None = None) -> str:
  """'6N / strict' MFU of a derived record (common.mfu_fields; `key`: one accumulation's entry of per-run dicts); a
  record made before the strict count shows the 6N figure alone."""
  six, strict = d.get("mfu"), d.get("mfu_strict")
  if key is not None:
    six, strict = (six or {}).get(key), (strict or {}).get(key)
  return _num(six, ".1%") if strict is None else f"{_num(six, '.1%')} / {_num(strict, '.1%')}"


def _num(x: Any, fmt: str = ".3g", unit: str = "") -> str:
  return "n/a" if x is None else f"{x:{fmt}}{unit}"


def _bytes(n: int | None) -> str:
  if n is None:
    return "n/a"
  return f"{n / GiB:.2f} GiB" if n >= 0.1 * GiB else f"{n / 2**20:.2f} MiB"


def _params(n: int | None) -> str:
  return "n/a" if n is None else (f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.3g} M")


def _hidden(h: float | None) -> str:
  """The hidden share of the moves; outside [0, 1] it says why instead of an impossible percentage."""
  if h is None:
    return "n/a"
  if h < 0:
    return f"0 % (offload adds {1 - h:.1f}x the moves' time: other costs dominate)"
  return "100 % (the offload run was not slower)" if h > 1 else f"{h:.0%}"


def _link(link: dict | None) -> str:
  if not link:
    return "not measured"
  return f"{link['h2d_gbs']:.1f} / {link['d2h_gbs']:.1f} GB/s ({link['source']})"


def failed_parts(data: dict) -> list[str]:
  """Records that failed (a part's process, a confirming run, or a largest-model search stopped by a probe error); a
  part this machine cannot run (ok None, 'not_run') is not a failure."""
  out = [name for name, r in data["records"].items() if isinstance(r, dict) and r.get("ok") is False]
  lg = (data["records"].get("jax_largest") or {})
  found = lg.get("result") or lg.get("partial") or {}
  if any(p.get("status") == "error" for r in (found.get("largest") or {}).values() for p in r.get("probes", [])):
    out.append("jax_largest probes")
  if "sizing" in data["records"] and data["records"]["sizing"].get("micro_fixed") is None:
    out.append("sizing")  # no fixed size: the train part ran nothing
  out += [name for name, r in data["records"].items() if name.startswith("largest_")
          and any(p.get("status") == "error" for p in r.get("probes", []))]
  return out


def _device_line(dev: dict) -> str:
  if dev.get("name") is None:
    return "Device: none (CPU)" + (f"; looked like a TPU VM ({dev['tpu_evidence']}) but the chip could not be read"
                                   if dev.get("tpu_evidence") else "") + "."
  kinds = f"; memory kinds {', '.join(dev['memory_kinds'])}" if dev.get("memory_kinds") else ""
  opened = f"; opening it took {dev['probe_open_s']:.1f} s" if dev.get("probe_open_s") else ""
  return (f"Device: **{dev['name']}** ({dev.get('kind')}) x {dev.get('count') or 1}, "
          f"{_bytes(dev.get('memory_total_bytes'))} each ({dev.get('memory_source')}){kinds}{opened}.")


def _header(data: dict) -> list[str]:
  h, dev = data["header"], data["device"]
  cpu = dev.get("name") is None
  title = "TPU" if dev.get("kind") == "tpu" else "GPU"
  out = [f"# {title} benchmark — {h['date']} — {dev.get('name') or 'CPU (tiny check: no accelerator)'}", "",
         f"Mode: **{h['mode']}**, {h.get('flow', 'fixed')} flow"
         f"{' — every figure below is a CPU/tiny figure, not a GPU one' if cpu else ''}"
         f"{' (the sides ran at the same time)' if data.get('sides_concurrent') else ''}. "
         f"{h['machine']} ({dev.get('cpu_usable')} usable), Python {h['python']}; host memory "
         f"{_bytes(dev.get('host_total_bytes'))} ({_bytes(dev.get('host_available_bytes'))} available); suite wall "
         f"time {data['suite_wall_s']:.0f} s.", "", _device_line(dev), "",
         "Versions: " + ", ".join(f"{k} {v}" for k, v in h["versions"].items() if v) + ". Not installed: " +
         (", ".join(k for k, v in h["versions"].items() if not v) or "none") + ".", "",
         "Environment (XLA and libtpu flags, the TPU runtime's settings, JAX's): " +
         (", ".join(f"`{k}={v}`" for k, v in h["env"].items()) or "none set") + ".", ""]
  if h.get("sockets") and not h["sockets"].get("allowed"):
    out += [f"Sockets: {h['sockets']['means']}", ""]
  skipped = {**{k: r["not_run"] for k, r in data["records"].items() if isinstance(r, dict) and r.get("not_run")},
             **(data.get("not_run") or {})}
  if skipped:
    out += ["Parts not run: " + "; ".join(f"**{k}** — {v}" for k, v in skipped.items()), ""]
  if dev.get("nvidia_smi"):
    out += ["```", dev["nvidia_smi"].rstrip(), "```", ""]
  return out


def _raw(data: dict) -> list[str]:
  rec = data["records"]
  if "torch_raw" not in rec and "jax_raw" not in rec:
    return []
  out = ["## Host <-> device bandwidth", "", "| stack | path | GB/s median | GB/s best | bytes |",
         "|---|---|---|---|---|"]
  for name in ("torch_raw", "jax_raw"):
    r = rec.get(name)
    if not r:
      continue
    if r.get("not_run"):
      out.append(f"| {name} | {r['not_run']} | | | |")
      continue
    if not r.get("ok"):
      out.append(f"| {name} | failed: {r.get('failure')} ({r.get('detail')}) | | | |")
      continue
    bw = r["result"]["bandwidth"]
    for path, v in bw.items():
      if isinstance(v, dict) and "median_gbs" in v:
        out.append(f"| {name} | {path} | {v['median_gbs']:.2f} | {v['best_gbs']:.2f} | {_bytes(v['bytes'])} |")
    out.append(f"| {name} | ({bw.get('kind')}{'; ' + bw['error'] if bw.get('error') else ''}) | | | |")
  out += ["", "## Matmul throughput", "", "| stack | dtype | n | TFLOP/s (median) | of the data-sheet peak |",
          "|---|---|---|---|---|"]
  for name in ("torch_raw", "jax_raw"):
    r = rec.get(name)
    if r and r.get("ok"):
      mm = r["result"]["matmul"]
      for k, v in mm.items():
        if isinstance(v, dict):
          peak = peak_flops(mm["device"], k)
          out.append(f"| {name} ({mm['device']}) | {k} | {mm['n']} | {v['tflops']:.2f} | "
                     f"{_num(v['tflops'] * 1e12 / peak if peak else None, '.0%')} |")
  return out + [""]


def _train(data: dict) -> list[str]:
  rec = data["records"]
  sz = rec.get("sizing")
  if not sz:
    return []
  out = ["## Each side on one fixed GPT size", "", *[f"    {line}" for line in sz.get("why", [])], "",
         "| run | plan | micro x seq | tokens/s | step s (median) | MFU 6N / strict | peak device | peak host RSS | "
         "link h2d / d2h |",
         "|---|---|---|---|---|---|---|---|---|"]
  names = [f"{s}_{c}" for s in SIDES for c in ("fixed", "cost_offload", "cost_none")]
  for name, r in ((n, rec[n]) for n in names if n in rec):
    if "same_as" in r:
      out.append(f"| {name} | same run as {r['same_as']} | | | | | | | |")
      continue
    if r.get("not_run"):
      out.append(f"| {name} | {r['not_run']} | | | | | | | |")
      continue
    c = r.get("config", {})
    if not r.get("ok"):
      out.append(f"| {name} | {c.get('plan')} | {c.get('micro_batch')} x {c.get('seq_len')} | failed: "
                 f"{r.get('failure')} ({r.get('detail')}) | | | | | |")
      continue
    res, d = r["result"], r["derived"]
    opt = f" ({res['optimizer']})" if res.get("optimizer") else ""
    out.append(f"| {name} | {c['plan']}{opt} | {c['micro_batch']} x {c['seq_len']} | {res['tokens_per_s']:.4g} | "
               f"{res['median_s']:.4g} | {mfu_pair(d)} | {_bytes(res['peak_device_bytes'])} | "
               f"{_bytes(res['peak_host_rss_bytes'])} | {_link(d['link'])} |")
  out += ["", f"{MFU_NOTE}; each against the device's "
          "dense bf16 peak (NVIDIA data sheet; n/a on CPU). Peak device: the allocator's peak in the steps "
          "(JAX `peak_bytes_in_use`, torch `max_memory_allocated`); peak host: the process's VmHWM from the "
          "trainer's build on.", ""]
  return out + _offload(data)


def _offload(data: dict) -> list[str]:
  off = data.get("offload") or {}
  if not off:
    return []
  out = ["## Offload cost and overlap", "",
         "| side | tokens/s offload | tokens/s none | kept | bytes moved / step | their time at the measured "
         "bandwidth | step time offload - none | hidden | link h2d / d2h |", "|---|---|---|---|---|---|---|---|---|"]
  for side, o in off.items():
    if "error" in o or "not_run" in o:
      out.append(f"| {side} | {o.get('error') or o['not_run']} | | | | | | | |")
      continue
    out.append(f"| {side} | {o['tokens_per_s_offload']:.4g} | {o['tokens_per_s_none']:.4g} | {o['kept']:.1%} | "
               f"{_bytes(o['moved_bytes_per_step'])} ({o['moved_source']}) | {_num(o['transfer_s_at_measured_bw'])} s"
               f" | {o['offload_adds_s']:.3g} s | {_hidden(o['hidden_fraction'])} | {_link(o['link'])} |")
  return out + ["", f"kept = tokens/s with full optimizer-state offload / without, same model and batch (published "
                f"PCIe results: {PUBLISHED_KEPT}). hidden = 1 - (step time offload adds) / (transfer time at the "
                "measured bandwidth, mean of both directions): the share of the moves the step overlaps with "
                "compute (the added time of DeepSpeed and FSDP2 also holds their optimizer step on the CPU, so their "
                "figures are lower bounds).", ""]


def _largest(data: dict) -> list[str]:
  rec = data["records"]
  rows = [(s, rec[f"largest_{s}"]) for s in SIDES if f"largest_{s}" in rec
          and not rec[f"largest_{s}"].get("not_run")]
  if not rows:
    return []
  out = ["## Largest model each side trains", "",
         "| side | plan | width | largest n_layers trained (params) | smallest failed | search | probes | link |",
         "|---|---|---|---|---|---|---|---|"]
  for side, r in rows:
    probes = ", ".join(f"{p['n_layers']}: {p['status']}" for p in r["probes"]) or "none"
    params = f" ({_params(r['largest_params'])})" if r.get("largest_params") else ""
    out.append(f"| {side} | {r['plan']} | d_model {r['d_model']}, seq {r['seq_len']}, micro 1 | {r['largest_ok']}"
               f"{params} | {_num(r['smallest_failed'], 'd')} | {'complete' if r['complete'] else 'lower bound'}: "
               f"{r['stopped']} | {probes} | {_link(r.get('link'))} |")
  out += ["", "Doubling from the start (" + "; ".join(f"{s}: {r['start']} layers, {r['start_why']}" for s, r in rows)
          + "), then bisection to 1/8 of the depth; 'host-limit' = not started, the memory model's host bytes "
          "exceed the node's available memory.", ""]
  return out


def _failures(data: dict) -> list[str]:
  failed = failed_parts(data)
  if not failed:
    return ["Every part that can run on this machine ran." if data.get("not_run") else "All parts ran."]
  out = ["## Failed parts", ""]
  for name in failed:
    r = data["records"].get(name) or data["records"]["jax_largest"]
    if name == "sizing":
      out += ["**sizing**: no micro batch needs offload and fits with it: " + " ".join(r.get("why", [])), ""]
      continue
    tail = r.get("stderr_tail") or "; ".join(p.get("stderr_tail", "") for p in r.get("probes", []))
    out += [f"**{name}**: {r.get('failure', 'probe error')} {r.get('detail', '')}", ""]
    out += ["```", tail[-1500:], "```", ""] if tail.strip() else []
  return out


def markdown(data: dict) -> str:
  """The report: header (date, machine, versions, nvidia-smi), bandwidth, matmul, fixed size, offload, largest."""
  from benchmarks.gpu_parts import report_grid
  return "\n".join(_header(data) + _raw(data) + _train(data) + report_grid.sections(data) + _largest(data) +
                   _failures(data)) + "\n"
