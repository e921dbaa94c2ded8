"""Each side of a report as rows: status, losses, times and memory (`side_rows`; what its memory cells are made of:
`memory_notes`), throughput (`throughput_rows`, the caveat under it: `throughput_note`), memory predicted vs
measured (`memory_rows`, `memory_gaps`), the ranks of a multi-rank side (`rank_table`), and the throughput rules
the card and the comparison page share (`step_times`, `side_tokens_per_s`, from parity.protocol.layout). Plain
text; callers escape."""
from __future__ import annotations

import math
from typing import Any

from parity.protocol.layout import loss_tokens_per_s, step_time_median, warm_step_times, warmup_steps_left_out
from parity.protocol.layout import tokens_per_s as layout_tokens_per_s
from parity.protocol.memory_figures import RUNTIME_HOLD, compiled_memory, own_host_rss, peak_device
from parity.report.hardware import hardware_caveat
from parity.report.cells import compact, fmt, fmt_bytes
from parity.report.run_record import RunRecord, SideRecord
from parity.sizing.measured import kinds_of, predicted_vs_measured

__all__ = ["backend", "step_times", "tokens_per_step", "side_tokens_per_s", "step_loss_tokens",
           "side_loss_tokens_per_s", "throughput_columns", "warmup_phrase", "side_rows",
           "host_rss_cell", "device_memory_cell", "memory_notes", "state_by_kind", "MEMORY_UNMEASURED_WHY",
           "memory_rows", "memory_gaps", "rank_table", "throughput_rows", "throughput_note"]


def backend(s: SideRecord) -> str:
  """'cpu' or 'gpu' (or the device text) of a side, from its summary's device field."""
  dev = s.device
  low = dev.lower()
  if not dev:
    return "n/a"
  if low.startswith("cpu"):
    return "cpu"
  return "gpu" if any(k in low for k in ("cuda", "gpu", "rocm")) else dev


def step_times(s: SideRecord) -> list[float]:
  """A side's step seconds that count for throughput: the one rule, parity.protocol.layout.warm_step_times (the
  summary writer, the card, the comparison page and the gate use it too)."""
  return warm_step_times(s.values("step_time_s"))


def tokens_per_step(rec: RunRecord) -> int | None:
  """micro_batch_size * grad_accum_steps * seq_len of the run (TrainSpec.tokens_per_step); None when not stored."""
  vals = [rec.run.train.get(k) for k in ("micro_batch_size", "grad_accum_steps", "seq_len")]
  return math.prod(vals) if all(isinstance(v, int) and not isinstance(v, bool) for v in vals) else None


def side_tokens_per_s(rec: RunRecord, s: SideRecord) -> float | None:
  """tokens/s of a side: tokens per step / the median of `step_times` (parity.protocol.layout.tokens_per_s); the
  summary's own figure (same rule, written by the side) when the report does not store the batch shape."""
  n = tokens_per_step(rec)
  if n is None:
    return s.summary.get("tokens_per_s")
  return layout_tokens_per_s(s.values("step_time_s"), n)


def step_loss_tokens(rec: RunRecord) -> list[int] | None:
  """Loss tokens of each optimizer step of a padded/packed run (report.json data.card.loss_tokens_per_step, from the
  materialised loss mask, all micro batches and ranks); None on a stream run, where every target carries the loss
  and loss tokens/s equals tokens/s (the report then shows tokens/s alone)."""
  return rec.data.loss_tokens_per_step


def side_loss_tokens_per_s(rec: RunRecord, s: SideRecord) -> float | None:
  """Loss tokens/s of a side (parity.protocol.layout.loss_tokens_per_s over the steps it recorded, each step's count
  from `step_loss_tokens`); the summary's own figure when the report has no step numbers; None on a stream run."""
  per_step = step_loss_tokens(rec)
  if per_step is None:
    return None
  steps, times = s.values("step"), s.values("step_time_s")
  if not steps:
    return s.summary.get("loss_tokens_per_s")
  counts = [per_step[k] if isinstance(k, int) and 0 <= k < len(per_step) else None for k in steps]
  return loss_tokens_per_s(times, counts)


def throughput_columns(rec: RunRecord) -> list[tuple[str, str]]:
  """(row key, heading) of the throughput figures a table shows: tokens/s, and loss tokens/s beside it on a
  padded/packed run (on stream the two are equal, so the second column would only repeat the first)."""
  return [("tokens_per_s", "tokens/s")] + ([("loss_tokens_per_s", "loss tokens/s")] if step_loss_tokens(rec) else [])


def warmup_phrase(rec: RunRecord) -> str:
  """How many leading steps each side's throughput leaves out ('the first 2 steps left out as warmup'), per side
  when they differ."""
  timed = {n: len([t for t in s.values("step_time_s") if isinstance(t, (int, float))]) for n, s in rec.sides.items()}
  left = {n: ("none" if k == 0 else warmup_steps_left_out(k)) for n, k in timed.items()}
  say = lambda k: ("no step timed" if k == "none" else "no step left out (one step ran)" if k == 0 else
                   f"the first {'step' if k == 1 else f'{k} steps'} left out as warmup")
  if len(set(left.values())) <= 1:
    return say(next(iter(left.values()), 0))
  return ", ".join(f"{n}: {say(k)}" for n, k in left.items())


def _init_s(s: SideRecord) -> str:
  """A side's own init time; 'n/a' for a side that did not finish or never reported it (not 0.0)."""
  v = s.summary.get("init_s")
  if s.status != "ok" and not v:
    return "n/a"
  return fmt(v, ".1f")


def side_rows(rec: RunRecord) -> list[dict[str, Any]]:
  """One row per side: side, status, steps, loss (first → last), val_loss, tokens_per_s, loss_tokens_per_s ('n/a'
  on stream: `throughput_columns`), init_s, compile_s, op_build_s, peak_rss (`host_rss_cell`), peak_device
  (`device_memory_cell`), memory_kinds (text), backend."""
  rows = []
  for name, s in rec.sides.items():
    summ, loss = s.summary, s.values("loss")
    kinds = state_by_kind(summ)
    rows.append({"side": name, "status": s.status, "steps": summ.get("steps_completed", len(loss)),
                 "loss": f"{fmt(loss[0] if loss else None, '.4f')} → {fmt(loss[-1] if loss else None, '.4f')}",
                 "val_loss": fmt((s.values("val_loss") or [None])[-1], ".4f"),
                 "tokens_per_s": fmt(side_tokens_per_s(rec, s), ",.0f"),
                 "loss_tokens_per_s": fmt(side_loss_tokens_per_s(rec, s), ",.0f"), "init_s": _init_s(s),
                 "compile_s": fmt(summ.get("compile_s"), ".1f") if s.status == "ok" else "n/a",
                 "op_build_s": fmt(summ.get("op_build_s"), ".1f") if "op_build_s" in summ else "none",
                 "peak_rss": host_rss_cell(s), "peak_device": device_memory_cell(summ), "memory_kinds": kinds or "n/a",
                 "backend": backend(s)})
  return rows


def _runtime_words(platform: str | None) -> str:
  """"the TPU runtime's mapping made when it opened the chip" (another accelerator: "... the device")."""
  name = str(platform or "accelerator")
  return f"the {name.upper()} runtime's mapping made when it opened the {'chip' if name == 'tpu' else 'device'}"


def host_rss_cell(s: SideRecord) -> str:
  """A side's host RSS: its own (the peak less the runtime's mapping, parity.protocol.memory_figures.own_host_rss)
  with the peak and the mapping beside it ('612.0 MiB (peak 13.8 GiB less 13.3 GiB TPU runtime mapping)'), or the
  raw peak where no mapping was recorded (the summary's, else the harness's wait4 figure)."""
  summ, peak = s.summary, s.peak_rss_bytes
  own, mapping = own_host_rss(summ, peak)
  if mapping is None:
    return fmt_bytes(peak)
  name = str(summ.get("host_rss_backend") or "accelerator").upper()
  return f"{fmt_bytes(own)} (peak {fmt_bytes(peak)} less {fmt_bytes(mapping)} {name} runtime mapping)"


def device_memory_cell(summ: dict) -> str:
  """A side's peak device memory with its source ('7.7 GiB (compiled memory analysis)', '5.4 MiB (allocator
  peak)', '13.8 GiB (runtime memory_stats)'; parity.protocol.memory_figures.peak_device: never the step's host
  buffers); 'n/a' where there is none (the CPU)."""
  value, source = peak_device(summ)
  return fmt_bytes(value) + (f" ({source})" if value is not None and source else "")


def _compiled_figures(summ: dict) -> tuple[int | None, str | None, int | None]:
  """(device bytes, how, host bytes) of the compiled step: from its memory_analysis where the summary has one (a
  summary written before the split is read the same way), else the fields the side stored."""
  ma = summ.get("memory_analysis")
  if ma:
    got = compiled_memory(ma)
    return got["device"], got["device_from"], got["host"]
  return summ.get("peak_device_bytes_compiled"), summ.get("peak_device_compiled_from"), summ.get("host_bytes_compiled")


def memory_notes(rec: RunRecord) -> list[str]:
  """The sentences under the sides' table that say what the memory cells are made of, one per side and figure: the
  peak RSS and the runtime's mapping in it, and the peak device memory with the figures behind it and the compiled
  step's host buffers named as host memory."""
  out = []
  for name, s in rec.sides.items():
    summ, peak = s.summary, s.peak_rss_bytes
    own, mapping = own_host_rss(summ, peak)
    if mapping is not None:
      out.append(f"{name}: peak RSS {fmt_bytes(peak)}, of which {fmt_bytes(mapping)} is "
                 f"{_runtime_words(summ.get('host_rss_backend'))}; the side's own host RSS is {fmt_bytes(own)}")
    value, source = peak_device(summ)
    compiled, how, host = _compiled_figures(summ)
    if value is None or not source or compiled is None:
      continue
    allocator = summ.get("peak_device_bytes_allocator", summ.get("peak_device_bytes"))
    if source == RUNTIME_HOLD:
      why = (f"bytes in use + the program's reserved region after the steps; the allocator peak "
             f"{fmt_bytes(allocator)}, the compiled memory analysis of the train step {fmt_bytes(compiled)}, from "
             f"{how}")
    else:
      why = (f"the larger of the allocator peak {fmt_bytes(allocator)} and the compiled memory analysis of the train "
             f"step {fmt_bytes(compiled)}, from {how}")
    tail = f"; the step's host buffers, {fmt_bytes(host)}, are host memory and not in it" if host else ""
    out.append(f"{name}: peak device memory {fmt_bytes(value)}, the {source} ({why}){tail}")
  return out


def state_by_kind(summ: dict) -> str:
  """A side's training-state bytes per memory kind, with the state groups each kind holds where the side says
  (JAX: 'device: 471.0 KiB (params), pinned_host: 942.0 KiB (opt_state)'; a group in several kinds, a partly
  offloaded optimizer state, is named under each); '' when the summary has neither."""
  by_kind = summ.get("state_bytes_by_memory_kind") or {}
  placed = {g: kinds_of(v) for g, v in (summ.get("state_memory_kinds") or {}).items()}
  kinds = list(dict.fromkeys([*by_kind, *(k for ks in placed.values() for k in ks)]))
  groups = {k: [g for g, ks in placed.items() if k in ks] for k in kinds}
  return ", ".join(f"{k}: {fmt_bytes(by_kind.get(k))}" + (f" ({', '.join(groups[k])})" if groups[k] else "")
                   for k in kinds)


MEMORY_UNMEASURED_WHY = {"activations": "no side measures them", "gradients": "inside the jitted step, not state"}
"""Why a category has no measured figure on a side (memory_gaps), by category; gradients: the JAX side's only."""


def memory_rows(rec: RunRecord) -> list[dict[str, Any]]:
  """report.json's memory rows, in the categories every side shares: recomputed from the run and the sides'
  summaries (parity.sizing.measured.predicted_vs_measured, a function of report.json alone), so a report written
  before the JAX side had them (one 'state' row) renders like with like; the stored rows when that fails."""
  stored = rec.memory_rows
  if not any(r.get("side") == "jax" and r.get("category") == "state" for r in stored):
    return stored
  try:
    return predicted_vs_measured(dict(rec.json))  # a function of report.json alone (parity.sizing.measured)
  except Exception:  # an edited report: draw what it holds
    return stored


def memory_gaps(rec: RunRecord) -> str:
  """The plain statement under the memory figure: which categories are predicted only, on which sides, and why;
  '' when every predicted category is measured. Read from report.json memory.predicted_vs_measured."""
  rows = [r for r in memory_rows(rec) if r["category"] != "peak_rss"]
  missing: dict[str, list[str]] = {}
  for side in dict.fromkeys(r["side"] for r in rows):
    for cat in dict.fromkeys(r["category"] for r in rows if r["side"] == side):
      mine = [r for r in rows if r["side"] == side and r["category"] == cat]
      together = cat in ("params", "optimizer_moments") and any(  # measured in one 'state' row with the other
          r["side"] == side and r["category"] == "state" and r["measured"] is not None for r in rows)
      if any(r["predicted"] for r in mine) and all(r["measured"] is None for r in mine) and not together:
        missing.setdefault(cat, []).append(side)
  shared = sorted({r["side"] for r in rows if r["category"] == "state" and r["measured"] is not None})
  parts = [f"{cat.replace('_', ' ')} on {', '.join(ss)}" + (f" ({MEMORY_UNMEASURED_WHY[cat]})"
                                                             if cat in MEMORY_UNMEASURED_WHY else "")
           for cat, ss in missing.items()]
  out = ("Predicted only, not measured (cross-hatched in the predicted bar, absent from the measured one): "
         + "; ".join(parts) + ". Every side's bars carry the same categories: compare predicted with predicted, "
         "measured with measured") if parts else ""
  if shared:
    out += (". " if out else "") + (f"{', '.join(shared)}: params and optimizer state share one memory kind, so they "
                                   "are measured together ('state')")
  return out


def rank_table(s: SideRecord) -> tuple[list[str], list[list[str]]] | None:
  """(columns, rows) of a multi-rank side's summary 'ranks' list (harness.ranks: rank, status, pid, exit code, peak
  RSS, ...; *_bytes fields in binary units), None for a one-process side."""
  ranks = [r for r in (s.summary.get("ranks") or []) if isinstance(r, dict)]
  if not ranks:
    return None
  cols = list(dict.fromkeys(k for r in ranks for k in r))
  cell = lambda k, v: fmt_bytes(v) if "bytes" in k and isinstance(v, (int, float)) else (
      compact(v) if isinstance(v, (dict, list)) else fmt(v))
  # a *_bytes column's cells say their unit (fmt_bytes: KiB/MiB/GiB), so its header drops "bytes"
  head = lambda c: c.removesuffix("_bytes").replace("_", " ")
  return [head(c) for c in cols], [[cell(k, r.get(k)) for k in cols] for r in ranks]


def throughput_rows(rec: RunRecord) -> list[dict[str, Any]]:
  """Per side: backend, repeats (steps timed after the warmup, step_times), step time min / median / max (s), tokens/s,
  loss tokens/s ('n/a' on stream), machine load (1-minute average) at the side's start and end, op build seconds (kept
  out of init)."""
  rows = []
  for name, s in rec.sides.items():
    ts, summ = step_times(s), s.summary
    load = s.load or {}
    lo = "n/a" if not load.get("start") else f"{load['start'][0]:.2f} → {fmt((load.get('end') or [None])[0], '.2f')}"
    rows.append({"side": name, "backend": backend(s), "repeats": len(ts),
                 "min_s": fmt(min(ts) if ts else None, ".4g"),
                 "median_s": fmt(step_time_median(s.values("step_time_s")), ".4g"),
                 "max_s": fmt(max(ts) if ts else None, ".4g"),
                 "tokens_per_s": fmt(side_tokens_per_s(rec, s), ",.0f"),
                 "loss_tokens_per_s": fmt(side_loss_tokens_per_s(rec, s), ",.0f"), "load": lo,
                 "op_build_s": fmt(summ.get("op_build_s"), ".1f") if "op_build_s" in summ else "none"})
  return rows


def throughput_note(rec: RunRecord) -> str:
  """The plain caveat under the throughput figures (where each side computed: a CPU backend, or sides on different
  hardware, parity.report.hardware.hardware_caveat; one sample per step, sides in sequence)."""
  hardware = hardware_caveat(rec)
  parts = [hardware] if hardware else []
  unknown = sorted(n for n, s in rec.sides.items() if backend(s) == "n/a" and side_tokens_per_s(rec, s) is not None)
  if unknown:  # a side that did not finish: the harness wrote its summary, without a device (newcomer, 2026-12-02)
    parts.append(f"{', '.join(unknown)}: device not recorded (the side did not finish; its figures are from the "
                 "steps it recorded)")
  loads = [x for s in rec.sides.values() for x in ((s.load or {}).get("start") or [None])[:1]
           + ((s.load or {}).get("end") or [None])[:1] if isinstance(x, (int, float))]
  cpus = rec.environment.cpu_count
  busy = bool(loads and cpus and max(loads) > 0.8 * cpus)
  spread = (f" (1-minute load {min(loads):.2f} to {max(loads):.2f}" + (f" on {cpus} CPUs: busy" if busy else "") + ")"
            if loads and len(rec.sides) > 1 else "")
  parts.append(("sides ran one after another on a shared machine, each under its own load" + spread
                if len(rec.sides) > 1 else "one side on a shared machine")
               + f"; each step is one sample ({warmup_phrase(rec)}); tokens/s = "
               + (f"{tokens_per_step(rec):,} " if tokens_per_step(rec) else "") + "tokens per step / the median of "
               "the same steps" + _loss_tokens_phrase(rec)
               + ("; DeepSpeed op builds and loads (an op built before still costs its load) are timed apart "
                  "(op build/load s), not in init" if "deepspeed" in rec.sides else ""))
  if busy and not spread:
    parts.append(f"the machine was busy while they ran (1-minute load up to {max(loads):.1f} on {cpus} CPUs)")
  return "; ".join(parts) + "."


def _loss_tokens_phrase(rec: RunRecord) -> str:
  """How loss tokens/s is counted (padded/packed), or that it equals tokens/s (stream)."""
  per_step = step_loss_tokens(rec)
  if per_step is None:
    return "; every target carries the loss (stream), so loss tokens/s equals tokens/s"
  return (f"; loss tokens/s = the loss-carrying targets of the same steps (padding and no-loss tokens left out; "
          f"{min(per_step):,} to {max(per_step):,} a step), averaged, / the same median")
