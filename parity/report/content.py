"""What a report page says, as plain rows and sentences built from report.json: one source for report.html,
report.md, the card and the terminal, so they never disagree. Nothing here formats for one medium (no HTML, no
Markdown): cells are plain text; callers escape them."""
from __future__ import annotations

import math
import statistics
from typing import Any

__all__ = ["fmt_bytes", "fmt", "run_title", "verdict_parts", "verdict_sentence", "check_rows", "metric_rows", "side_rows", "throughput_rows",
           "throughput_note", "plan_rows", "environment_rows", "METRIC_LABEL", "tolerance_text", "backend",
           "pair_label", "WARMUP_STEPS", "plain_detail", "step_times", "doctor_rows", "rank_table"]

METRIC_LABEL = {"loss": "max abs Δloss", "val_loss": "abs Δval_loss at the worst step (relative to tolerance)",
                "grad_norm": "abs Δgrad_norm at the worst step (relative to tolerance)",
                "lr": "abs Δlr at the worst step (relative to tolerance)",
                "params": "worst tensor: element abs Δ", "params_zero_grad": "max abs Δ (zero-grad slices)",
                "completed": "steps both ran", "updates": "steps with lr > 0 on both sides", "determinism": "differing fields", "resume": "differing fields",
                "loss_envelope": "worst window: rms Δloss", "val_loss_envelope": "worst window: rms Δval_loss",
                "grad_norm_envelope": "worst window: rms rel. Δgrad_norm",
                "params_envelope": "worst tensor: element abs Δ", "loss_scale": "max abs Δloss_scale",
                "skipped": "max abs Δ (1: skipped on one side only)"}
"""How each metric's value reads (no '|': these labels go into Markdown table cells)."""
WARMUP_STEPS = 1
"""Steps left out of the step-time figures: step 0 carries one-time work (allocations, lazy init, first kernels)."""


def fmt_bytes(n) -> str:
  """Bytes in binary units ('1.5 MiB'); 'n/a' for None."""
  if n is None:
    return "n/a"
  n = float(n)
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n:.1f} TiB"


def fmt(v, spec: str = ".3g") -> str:
  """A number formatted with `spec`; None -> 'n/a'; text as is."""
  if v is None:
    return "n/a"
  if isinstance(v, str):
    return v
  if isinstance(v, float) and not math.isfinite(v):
    return str(v)
  if isinstance(v, int) and not isinstance(v, bool) and spec == ".3g":
    return str(v)  # an integer (a pid, a step, a count) whole, not 1.23e+04
  return format(v, spec)


def pair_label(sides) -> str:
  """'jax vs torch' for a two-side check, the one side otherwise ('jax#determinism' names the rerun)."""
  sides = list(sides or [])
  if len(sides) == 2 and not str(sides[1]).startswith(f"{sides[0]}#"):
    return f"{sides[0]} vs {sides[1]}"
  return str(sides[0]) if sides else ""


def run_title(d: dict) -> str:
  """'gpt2-tiny · plan zero2-offload · fp32 · 3 steps · jax, torch': what the figures and the page are about."""
  plan = (d.get("plan") or {}).get("name")
  mig = d.get("migration") or {}
  plan_txt = f"DeepSpeed config {mig['source']}" if mig.get("source") else (f"plan {plan}" if plan else "own plans")
  t = d["run"]["train"]
  return (f"{d['preset']} · {plan_txt} · {t['precision']} · {t['steps']} steps · "
          f"{', '.join(d['sides'])}")


def _side_stop(d: dict) -> list[str]:
  out = []
  for name, s in d["sides"].items():
    if s["status"] != "ok":
      n = (s.get("summary") or {}).get("steps_completed", len(s["series"]["loss"]))
      out.append(f"{name} stopped after {n} of {d['run']['train']['steps']} steps ({s['status']})")
  return out


def _loss_headline(d: dict) -> str | None:
  loss = [c for c in d["checks"] if c["metric"] == "loss" and isinstance(c.get("value"), (int, float))]
  if not loss:
    return None
  worst = max(loss, key=lambda c: (c["value"] or 0) / (c["tolerance"] or 1e-300))
  step = f" at step {worst['worst']}" if isinstance(worst.get("worst"), int) else ""
  gate = "" if worst.get("gating", True) else "; in this precision the noise envelope decides"
  return (f"largest per-step loss difference {fmt(worst['value'])}{step} ({pair_label(worst['sides'])}), "
          f"tolerance {fmt(worst['tolerance'])}{gate}")


def first_clause(text: str) -> str:
  """`text` up to its first ';' outside brackets (a ';' inside '(...)' does not end the clause, so the clause keeps
  its brackets balanced); the whole text when there is none."""
  depth = 0
  for i, ch in enumerate(text):
    depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(ch, 0)
    if ch == ";" and depth <= 0:
      return text[:i].rstrip()
  return text


def verdict_parts(d: dict) -> tuple[str, str, str]:
  """(kind, sentence, sub) of the verdict: kind 'pass' | 'fail' | 'warn' (one side, interrupted); the sentence
  names the pair, the metric and the step; sub counts the checks."""
  v, t = d["verdict"], d["run"]["train"]
  checks = d["checks"]
  gating = [c for c in checks if c.get("gating", True)]
  failing = [c for c in gating if not c["passed"]]
  sub = (f"{len(gating) - len(failing)} of {len(gating)} gating checks passed"
         + (f" (+{len(checks) - len(gating)} reported only)" if len(checks) > len(gating) else "")
         + f" · {run_title(d)}")
  msg = v["message"]
  if msg.startswith(("ONE SIDE", "INTERRUPTED")):
    return "warn", msg, sub
  if v["passed"]:
    head = _loss_headline(d)
    sides = list(d["sides"])
    return "pass", (f"PASS: {', '.join(sides[:-1])} and {sides[-1]} agree within tolerance on every check over all "
                    f"{t['steps']} steps" + (f"; {head}." if head else ".")), sub
  parts = _side_stop(d)
  ff = v.get("first_failure")
  if ff and ff.get("metric") == "updates":  # nothing exceeded a tolerance: there was nothing to compare
    c = next((c for c in checks if c["name"] == ff["check"]), {})
    parts.append(f"{pair_label(ff['sides'])}: {c.get('detail') or 'no step with lr > 0 was compared'}")
  elif ff and ff.get("metric") != "completed":
    c = next((c for c in checks if c["name"] == ff["check"]), {})
    step = f" at step {ff['step']}" if ff.get("step") is not None else ""
    label = METRIC_LABEL.get(ff["metric"], ff["metric"])
    parts.append(f"{ff['metric']} of {pair_label(ff['sides'])} first exceeds its tolerance{step} "
                 f"(tolerance {fmt(ff['tolerance'])}; {label} over the run {fmt(ff['value'])})"
                 + (" on the steps both sides ran" if _side_stop(d) else ""))
    if c.get("detail") and ff["metric"] in ("params", "params_zero_grad"):
      parts[-1] += f"; {first_clause(c['detail'])}"
  return "fail", "FAIL: " + "; ".join(parts or [msg.removeprefix("FAIL: ")]) + ".", sub


def verdict_sentence(d: dict) -> str:
  """verdict_parts' sentence; the stored verdict message when the report lacks what the sentence needs (a report
  written by an older parity)."""
  try:
    return verdict_parts(d)[1]
  except (KeyError, TypeError, IndexError, ValueError):
    return d["verdict"]["message"]


def tolerance_text(c: dict, tolerances: dict) -> str:
  """The tolerance of a check as a reader should take it: an absolute bound as the number; a relative one as
  'rtol × value' with the bound it gave (never a bare '0' that reads as exact equality)."""
  tol = tolerances.get(c["metric"]) or {}
  atol, rtol = tol.get("atol"), tol.get("rtol")
  if c["metric"] in ("determinism", "resume"):
    return "bit-identical"
  if c["metric"] == "completed":
    return f"all {fmt(c['tolerance'], 'g')} steps"
  if c["metric"] == "updates":
    return f"at least {fmt(c['tolerance'], 'g')} step"
  if c["tolerance"] == 0 and not atol and not rtol:
    return "0 (must be equal)"
  if c["metric"] == "params" and rtol:
    return f"{fmt(c['tolerance'])} ({rtol:g} × how far the tensor moved from init, + an Adam noise term per element)"
  if atol == 0 and rtol:
    if not c["tolerance"]:
      return f"relative: {rtol:g} × value (the values compared are 0 here)"
    return f"{fmt(c['tolerance'])} (relative: {rtol:g} × value)"
  if atol and rtol:
    return f"{fmt(c['tolerance'])} ({atol:g} + {rtol:g} × value)"
  return fmt(c["tolerance"])


def plain_detail(text: str | None) -> str:
  """A check's detail as a reader takes it: '0 of 52 tensors over' reads 'all 52 tensors within tolerance',
  'N of M tensors over' reads 'N of M tensors over tolerance'."""
  import re
  text = re.sub(r"\b0 of (\d+) tensors over\b", r"all \1 tensors within tolerance", text or "")
  return re.sub(r"\b(\d+ of \d+ tensors over)\b(?! tolerance)", r"\1 tolerance", text)


def check_rows(d: dict) -> list[dict[str, Any]]:
  """One row per check: name, metric, pair, measure (what the value is), value, tolerance (text), source (why
  that tolerance: the measurement it comes from), result ('pass' | 'FAIL' | 'pass (reported only)' | ...),
  first_failing_step, detail, passed, gating."""
  tols = (d.get("tolerances") or {}).get(d["run"]["train"]["precision"], {})
  rows = []
  for c in d["checks"]:
    gating = c.get("gating", True)
    result = ("pass" if c["passed"] else "FAIL") + ("" if gating else " (reported only)")
    rows.append({"name": c["name"], "metric": c["metric"], "pair": pair_label(c["sides"]),
                 "measure": METRIC_LABEL.get(c["metric"], c["metric"]), "value": fmt(c["value"]),
                 "tolerance": tolerance_text(c, tols), "source": c.get("reason") or "", "result": result,
                 "first_failing_step": fmt(c["first_failing_step"], "d"), "detail": plain_detail(c.get("detail")),
                 "passed": bool(c["passed"]), "gating": gating})
  return rows


def metric_rows(d: dict) -> list[dict[str, Any]]:
  """One row per metric (the checks of every pair folded): metric, measure, checks (count), failed (count),
  worst (its pair), value, tolerance, source, result, first_failing_step, gating. The worst check is the one
  furthest over (or closest to) its tolerance."""
  rows: dict[str, list[dict]] = {}
  for r, c in zip(check_rows(d), d["checks"]):
    rows.setdefault(r["metric"], []).append({**r, "_ratio": _ratio(c)})
  out = []
  for metric, rs in rows.items():
    failed = [r for r in rs if not r["passed"]]
    worst = max(failed or rs, key=lambda r: r["_ratio"])
    gating = any(r["gating"] for r in rs)
    result = (f"FAIL ({len(failed)} of {len(rs)})" if failed else f"pass ({len(rs)} of {len(rs)})") + \
        ("" if gating else ", reported only")
    out.append({"metric": metric, "measure": worst["measure"], "checks": len(rs), "failed": len(failed),
                "worst": worst["pair"], "value": worst["value"], "tolerance": worst["tolerance"],
                "source": worst["source"], "result": result, "first_failing_step": worst["first_failing_step"],
                "gating": gating, "passed": not failed})
  return out


def _ratio(c: dict) -> float:
  v, t = c.get("value"), c.get("tolerance")
  if not isinstance(v, (int, float)):
    return math.inf if not c.get("passed") else 0.0
  if not isinstance(t, (int, float)) or t == 0:
    return 0.0 if v == 0 else math.inf
  return abs(v) / abs(t)


def backend(s: dict) -> str:
  """'cpu' or 'gpu' (or the device text) of a side, from its summary's device field."""
  dev = str((s.get("summary") or {}).get("device") or "")
  low = dev.lower()
  if not dev:
    return "n/a"
  if low.startswith("cpu"):
    return "cpu"
  return "gpu" if any(k in low for k in ("cuda", "gpu", "rocm")) else dev


def step_times(s: dict) -> list[float]:
  ts = [t for t in s["series"].get("step_time_s") or [] if isinstance(t, (int, float))]
  return ts[WARMUP_STEPS:] if len(ts) > WARMUP_STEPS else ts


def _init_s(s: dict) -> str:
  """A side's own init time; 'n/a' for a side that did not finish or never reported it (not 0.0)."""
  v = (s.get("summary") or {}).get("init_s")
  if s["status"] != "ok" and not v:
    return "n/a"
  return fmt(v, ".1f")


def side_rows(d: dict) -> list[dict[str, Any]]:
  """One row per side: side, status, steps, loss (first → last), val_loss, tokens_per_s, init_s, compile_s,
  op_build_s, peak_rss, peak_device, memory_kinds (text), backend."""
  rows = []
  for name, s in d["sides"].items():
    summ, loss = s.get("summary") or {}, s["series"]["loss"]
    by_kind = summ.get("state_bytes_by_memory_kind") or {}
    placed = summ.get("state_memory_kinds") or {}
    kinds = ", ".join(f"{k} on {v}" for k, v in placed.items()) or ", ".join(
        f"{k}: {fmt_bytes(b)}" for k, b in by_kind.items())
    rows.append({"side": name, "status": s["status"], "steps": summ.get("steps_completed", len(loss)),
                 "loss": f"{fmt(loss[0] if loss else None, '.4f')} → {fmt(loss[-1] if loss else None, '.4f')}",
                 "val_loss": fmt((s["series"].get("val_loss") or [None])[-1], ".4f"),
                 "tokens_per_s": fmt(summ.get("tokens_per_s"), ",.0f"), "init_s": _init_s(s),
                 "compile_s": fmt(summ.get("compile_s"), ".1f") if s["status"] == "ok" else "n/a",
                 "op_build_s": fmt(summ.get("op_build_s"), ".1f") if "op_build_s" in summ else "none",
                 "peak_rss": fmt_bytes(summ.get("peak_host_rss_bytes") or s.get("harness_peak_rss_bytes")),
                 "peak_device": fmt_bytes(summ.get("peak_device_bytes")), "memory_kinds": kinds or "n/a",
                 "backend": backend(s)})
  return rows


def rank_table(s: dict) -> tuple[list[str], list[list[str]]] | None:
  """(columns, rows) of a multi-rank side's summary 'ranks' list (harness.ranks: rank, status, pid, exit code, peak
  RSS, ...; *_bytes fields in binary units), None for a one-process side."""
  ranks = [r for r in ((s.get("summary") or {}).get("ranks") or []) if isinstance(r, dict)]
  if not ranks:
    return None
  cols = list(dict.fromkeys(k for r in ranks for k in r))
  cell = lambda k, v: fmt_bytes(v) if "bytes" in k and isinstance(v, (int, float)) else (  # noqa: E731
      _compact(v) if isinstance(v, (dict, list)) else fmt(v))
  # a *_bytes column's cells say their unit (fmt_bytes: KiB/MiB/GiB), so its header drops "bytes"
  head = lambda c: c.removesuffix("_bytes").replace("_", " ")  # noqa: E731
  return [head(c) for c in cols], [[cell(k, r.get(k)) for k in cols] for r in ranks]


def throughput_rows(d: dict) -> list[dict[str, Any]]:
  """Per side: backend, repeats (steps timed after WARMUP_STEPS), step time min / median / max (s), tokens/s,
  machine load (1-minute average) at the side's start and end, op build seconds (kept out of init)."""
  rows = []
  for name, s in d["sides"].items():
    ts, summ = step_times(s), s.get("summary") or {}
    load = s.get("load") or {}
    lo = "n/a" if not load.get("start") else f"{load['start'][0]:.2f} → {fmt((load.get('end') or [None])[0], '.2f')}"
    rows.append({"side": name, "backend": backend(s), "repeats": len(ts),
                 "min_s": fmt(min(ts) if ts else None, ".4g"),
                 "median_s": fmt(statistics.median(ts) if ts else None, ".4g"),
                 "max_s": fmt(max(ts) if ts else None, ".4g"),
                 "tokens_per_s": fmt(summ.get("tokens_per_s"), ",.0f"), "load": lo,
                 "op_build_s": fmt(summ.get("op_build_s"), ".1f") if "op_build_s" in summ else "none"})
  return rows


def throughput_note(d: dict) -> str:
  """The plain caveat under the throughput figures (a CPU backend, one sample per step, sides in sequence)."""
  cpus = {n for n, s in d["sides"].items() if backend(s) == "cpu"}
  parts = []
  if cpus:
    parts.append(f"CPU backend ({', '.join(sorted(cpus))}): throughput is not representative of GPU training")
  parts.append("sides ran one after another on a shared machine; each step is one sample (the first step left "
               "out as warmup); DeepSpeed op builds are timed apart (op build s), not in init")
  loads = [x for s in d["sides"].values() for x in ((s.get("load") or {}).get("start") or [None])[:1]
           + ((s.get("load") or {}).get("end") or [None])[:1] if isinstance(x, (int, float))]
  cpus = (d.get("environment") or {}).get("cpu_count")
  if loads and cpus and max(loads) > 0.8 * cpus:
    parts.append(f"the machine was busy while they ran (1-minute load up to {max(loads):.1f} on {cpus} CPUs)")
  return "; ".join(parts) + "."


def plan_rows(d: dict) -> list[tuple[str, str]]:
  """(label, text) rows: the plan pair (or the DeepSpeed config file it came from) and each side's placements."""
  plan, mig = d.get("plan") or {}, d.get("migration") or {}
  rows = []
  if mig.get("source"):
    rows.append(("memory plan", f"from the DeepSpeed config {mig['source']} (port status: {mig.get('status')}; "
                                f"key-by-key table in {mig.get('file', 'migration.md')})"))
  elif plan.get("name"):
    how = {"default": "the preset's own plans match this pair", "auto": "chosen by --plan auto",
           "user": "given with --plan"}.get(plan.get("chosen_by"), plan.get("chosen_by") or "")
    extra = f"; then {', '.join(plan['overrides'])}" if plan.get("overrides") else ""
    rows.append(("plan pair", f"{plan['name']} ({how}{extra})" + (f": {plan['why']}" if plan.get("why") else "")))
  else:
    rows.append(("plan pair", "none: the sides' own plans match no named pair"))
  j, ds = d["run"]["jax"], d["run"]["deepspeed"]
  rows.append(("DeepSpeed plan", f"ZeRO-{ds['zero_stage']}, offload_optimizer {ds.get('offload_optimizer')}, "
                                 f"offload_param {ds.get('offload_param')}"))
  rows.append(("JAX plan", f"offload_opt_state {j.get('offload_opt_state')}, offload_params {j.get('offload_params')}, "
                           f"remat {j.get('remat')}, scan_layers {j.get('scan_layers')}, zero_stage "
                           f"{j.get('zero_stage')}, data_parallel {j.get('data_parallel', 1)}"))
  for name, s in d["sides"].items():
    summ = s.get("summary") or {}
    if summ.get("state_memory_kinds"):
      rows.append((f"{name} placed", ", ".join(f"{k} on {v}" for k, v in summ["state_memory_kinds"].items())))
    elif summ.get("state_bytes_by_category"):
      rows.append((f"{name} placed", ", ".join(
          f"{cat} " + " + ".join(f"{fmt_bytes(b)} {k}" for k, b in kinds.items() if b)
          for cat, kinds in summ["state_bytes_by_category"].items() if any(kinds.values()))))
  return rows


def environment_rows(d: dict, extra: dict | None = None) -> list[tuple[str, str]]:
  """(label, text) rows to reproduce the run: date, command, project git revision (+ dirty), config hash, Python,
  OS, CPU model and count, load, per-side devices, package versions. `extra`: environment.json of the run folder
  (harness doctor block) when present; its keys are listed after the report's own."""
  e = d.get("environment") or {}
  git = e.get("git") or {}
  rows = [("date (UTC)", d.get("created_utc", "n/a")),
          ("command", (d.get("run_folder") or {}).get("command") or "n/a"),
          ("project git revision", (f"{git['rev'][:12]}" + (" (uncommitted changes)" if git.get("dirty") else
                                                             " (clean)")) if git.get("rev") else "n/a (not a git checkout)"),
          ("config hash", d.get("config_hash", "n/a")),
          ("Python / OS", f"{e.get('python', 'n/a')} / {e.get('platform', 'n/a')}"),
          ("CPU", f"{e.get('cpu_model') or e.get('machine') or 'n/a'}, {e.get('cpu_count', 'n/a')} CPUs"),
          ("load average (1/5/15 min) at report time", ", ".join(map(str, e.get("load_avg_1_5_15") or [])) or "n/a")]
  for name, s in d["sides"].items():
    summ = s.get("summary") or {}
    rows.append((f"{name} device", f"{summ.get('device', 'n/a')} ({backend(s)})"))
  rows.append(("versions", ", ".join(f"{k} {v}" for k, v in (e.get("versions") or {}).items())))
  return rows + doctor_rows(extra or {})


def doctor_rows(env: dict) -> list[tuple[str, str]]:
  """(label, text) rows of environment.json (harness doctor block, schema parity.environment/1): host fields one
  per row, installed packages on one row, git commit/branch/dirty, CUDA driver, GPUs, each framework's backend;
  any other key compactly."""
  rows: list[tuple[str, str]] = []
  for key, val in env.items():
    if key in ("schema", "run_id", "quick"):
      continue
    if key == "host" and isinstance(val, dict):
      for k, v in val.items():
        rows.append((f"host {k.replace('_', ' ')}", fmt_bytes(v) if k.endswith("_bytes") else
                     (", ".join(map(str, v)) if isinstance(v, list) and all(not isinstance(x, dict) for x in v)
                      else v if isinstance(v, str) else _compact(v))))
    elif key == "packages" and isinstance(val, dict):
      rows.append(("packages", ", ".join(f"{k} {v}" for k, v in val.items() if v) or "n/a"))
    elif key == "git" and isinstance(val, dict):
      rev = str(val.get("commit") or val.get("rev") or "n/a")[:12]
      state = "uncommitted changes" if val.get("dirty") else "clean"
      extra = f", {val['changed_files']} files changed" if val.get("changed_files") else ""
      rows.append(("git (environment.json)", f"{rev} on {val.get('branch', '?')} ({state}{extra})"))
    elif key == "frameworks" and isinstance(val, dict):
      for fw, info in val.items():
        rows.append((f"{fw} backend", info if isinstance(info, str) else _compact(info)))
    else:
      rows.append((key.replace("_", " "), "none" if val is None else val if isinstance(val, str) else _compact(val)))
  return rows


def _compact(v) -> str:
  import json
  text = json.dumps(v, default=str, separators=(", ", ": "))
  return text if len(text) <= 600 else text[:597] + "..."
