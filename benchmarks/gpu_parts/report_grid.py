"""Markdown of the grid flow's records (benchmarks/gpu_parts/grid_flow.py): the train grid, its offload figures, the
largest model by compiling and the runs that confirm it. No jax, no torch."""
from __future__ import annotations

from typing import Any

from benchmarks.gpu_parts.common import MFU_NOTE, recorded_device_bytes
from benchmarks.gpu_parts.report import _bytes, _num, _params, mfu_pair
from parity.protocol.memory_figures import runtime_device_bytes


def sections(data: dict) -> list[str]:
  """The grid flow's sections ([] for the fixed flow)."""
  rec = data["records"]
  if "grid_plan" not in rec:
    return []
  return _grid(rec) + _offload(rec) + _largest(rec)


def _run_cells(r: dict[str, Any], mfu: str, host: int | None) -> str:
  if r.get("status") != "ok":
    return f"{r.get('status')}: {r.get('error', '')[:160]} | | | | | | |"
  c = r.get("compiled") or {}
  return (f"{r['tokens_per_s']:.4g} | {r['median_s']:.4g} | {mfu} | {_bytes(recorded_device_bytes(c))} "
          f"(host buffers {_bytes(c.get('host_bytes'))}) | {_bytes(host)} | {_bytes(r.get('moved_bytes_per_step'))} | "
          f"{_num(r.get('compile_s'), '.1f')} |")


def _grid(rec: dict) -> list[str]:
  gp = rec["grid_plan"]
  if "depth" not in gp:
    return []
  out = ["## Train grid: JAX plans x gradient accumulation", "",
         f"Depth {gp['depth']} layers: {gp.get('depth_how')}.", *[f"    {line}" for line in gp.get("memory_model", [])],
         "", "| plan | grad accum | tokens / step | tokens/s | step s (median) | MFU 6N / strict | compiled device "
         "peak | host state | moved / step | compile s |", "|---|---|---|---|---|---|---|---|---|---|"]
  for plan in gp["jax_plans"]:
    r = rec.get(f"grid_{plan}") or {}
    if not r.get("ok"):
      out.append(f"| {plan} | | | failed: {r.get('failure', 'not run')} ({r.get('detail', '')}) | | | | | | |")
      continue
    res, d = r["result"], r.get("derived") or {}
    host = sum((res.get("state_bytes_by_memory_kind") or {}).get(k, 0) for k in ("pinned_host", "unpinned_host"))
    for run in res["runs"]:
      mfu = mfu_pair(d, str(run["grad_accum"]))
      out.append(f"| {plan} | {run['grad_accum']} | {run['tokens_per_step']} | {_run_cells(run, mfu, host)}")
  c = next((rec[f"grid_{p}"].get("config") for p in gp["jax_plans"] if rec.get(f"grid_{p}", {}).get("config")), {})
  out += ["", f"Model: d_model {c.get('d_model')}, {c.get('n_layers')} layers, micro batch {c.get('micro_batch')} x "
          f"seq {c.get('seq_len')}, {c.get('precision')}. {MFU_NOTE}; each against the device's dense "
          "peak at the run's precision (common.PEAK_FLOPS; n/a on a CPU). Compiled device peak: the step's "
          "memory_analysis, XLA's peak_memory_in_bytes less the step's host buffers (pinned_host arguments and "
          "outputs, which XLA's peak counts; they are beside it, host memory); host state: the bytes the plan keeps "
          "in pinned_host.", ""]
  return out


def _overlap(row: dict) -> str:
  text = _num(row.get("overlap"), ".0%")
  return f"{text} ({row['overlap_note']})" if row.get("overlap_note") else text


def _offload(rec: dict) -> list[str]:
  s = rec.get("grid_summary")
  if not s:
    return []
  rate = s.get("rate")
  out = ["## Offload cost and overlap (grid)", "",
         f"Against **{s.get('none_plan')}** at the same accumulation; in-step rate "
         f"{_num(rate and rate['gbs'], '.2f')} GB/s ({rate['source'] if rate else 'not measured'}).", "",
         "| plan | grad accum | tokens/s offload / none | kept | added s / step | moved / step | transfer s at the "
         "rate | overlap | link bound | achieved of it | device peak none / offload | on host | saved / on host |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in s.get("rows", []):
    out.append(f"| {r['plan']} | {r['grad_accum']} | {r['tokens_per_s_offload']:.4g} / {r['tokens_per_s_none']:.4g} "
               f"| {r['kept']:.1%} | {r['added_s']:.3g} | {_bytes(r['moved_bytes_per_step'])} | "
               f"{_num(r['transfer_s'])} | {_overlap(r)} | {_num(r['link_bound'], '.0%')} | "
               f"{_num(r['achieved_of_link_bound'], '.0%')} | {_bytes(r['device_peak_none'])} / "
               f"{_bytes(r['device_peak_offload'])} | {_bytes(r['host_bytes'])} | {_num(r['mem_saved_of_host'], '.0%')}"
               " |")
  out += [f"| (missing) | {m} | | | | | | | | | | | |" for m in s.get("missing", [])]
  return out + ["", "kept = tokens/s offload / none. added = step offload - step none. transfer = bytes moved per "
                "step (the compiled step's host-memory entry buffers, both directions) / the in-step rate. overlap "
                "= 1 - added / transfer, clamped to [0, 1] (the note says from what and why). link bound = t_none / "
                "max(t_none, transfer): the most of the no-offload speed a step keeps if its moves hide behind "
                "compute; achieved = kept / link bound. saved / on host = (device peak none - offload) / the bytes "
                "the plan keeps on the host.", ""]


def _probe_text(p: dict) -> str:
  device = recorded_device_bytes(p)
  peak = f", {_bytes(device)}" if device is not None else ""
  took = f", {p['compile_s']:.0f} s" if p.get("compile_s") is not None else ""
  return f"{p['n_layers']}: {p['status']}{peak}{took}"


def _confirm_memory(res: dict) -> str:
  """A confirming run's device memory with its source: the runtime's hold (memory_stats: bytes in use + the
  program's reserved region) where recorded, else the compiled device figure; the step's host buffers apart."""
  compiled = res.get("compiled") or {}
  runtime = runtime_device_bytes(res.get("device_memory_stats"))
  device = (f"device {_bytes(runtime)} (runtime; compiled {_bytes(recorded_device_bytes(compiled))})"
            if runtime is not None else f"device {_bytes(recorded_device_bytes(compiled))} (compiled)")
  host = compiled.get("host_bytes")
  return device + (f", host buffers {_bytes(host)}" if host else "")


def _confirm(rec: dict, plan: str) -> str:
  c = next((r for k, r in rec.items() if k.startswith(f"confirm_{plan}_")), None)
  if not c:
    return "not run"
  res = (c.get("result") or {})
  step = f", step {res['median_s']:.3g} s, {_confirm_memory(res)}" if res.get("median_s") else ""
  return f"{c['n_layers']} layers: **{c['status']}** ({c.get('detail', '')}{step}; {_num(c.get('wall_s'), '.0f')} s)"


def _largest(rec: dict) -> list[str]:
  lg = rec.get("jax_largest")
  if not lg:
    return []
  found = lg.get("result") or lg.get("partial") or {}
  state = "" if lg.get("ok") else f" (the part {lg.get('failure')}: {lg.get('detail')}; what it wrote before)"
  out = ["## Largest model by compiling", "",
         f"Device limit {_bytes(found.get('bytes_limit'))} ({found.get('bytes_limit_source')}), host "
         f"{_bytes(found.get('host_bytes'))}, d_model {found.get('d_model')}, seq {found.get('seq_len')}, micro batch 1"
         f"{state}.", "", "| plan | start | probes (n: status, compiled device peak, compile s) | largest that fits "
         "(params) | smallest that does not | search | confirmed by a 2-step run |", "|---|---|---|---|---|---|---|"]
  for plan, r in (found.get("largest") or {}).items():
    params = f" ({_params(r['largest_params'])})" if r.get("largest_params") else ""
    search = ("complete" if r.get("complete") else "lower bound") + f": {r.get('stopped', 'stopped')}"
    out.append(f"| {plan} | {r.get('start')} | {'; '.join(_probe_text(p) for p in r.get('probes', []))} | "
               f"{r.get('largest_ok', 0)}{params} | {_num(r.get('smallest_failed'), 'd')} | {search} | "
               f"{_confirm(rec, plan)} |")
  return out + ["", "A probe compiles the train step from abstract inputs (no weights): 'oom' = XLA refused it for "
                "memory or its compiled device peak exceeds the limit (XLA's peak less the step's host buffers, "
                "--fit-by xla; the compiler's argument + output + temp - alias, --fit-by sum); 'host-limit' = the "
                "memory model's host bytes (the confirming run fills its state in place: no weight copies; on a TPU "
                "plus the runtime's own, its premapped region among them) exceed the host's, so it was not compiled, "
                "or it compiled with host buffers the host cannot hold. Doubling from the memory model's prediction, "
                "then bisection (to 1/8 of the depth unless --largest-resolution says otherwise). The confirming run "
                "trains the largest depth for 2 steps in its own process: 'hung' = killed at its timeout. Its device "
                "memory is the runtime's (memory_stats: bytes in use + the program's reserved region) where recorded, "
                "else the compiled device peak; the step's host buffers are host memory, beside it.", ""]
