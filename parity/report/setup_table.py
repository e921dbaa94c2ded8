"""How a run was set up, as rows: the plan pair and each side's placements (`plan_rows`), what reproduces it
(`environment_rows`, environment.json's block: `doctor_rows`), its `--perturb` changes and whether each took
(`perturbation_rows`, `perturbation_lines`) and what it trained on (`inputs_lines`). Plain text; callers escape."""
from __future__ import annotations

import json

from parity.protocol.layout import DEBUG_KEYS, OFFLOAD_PLANT_KEYS, OPTIMIZER_PLANT_KEYS, PLANT_KEYS
from parity.report.cells import fmt, fmt_bytes
from parity.report.env_rows import block_rows, readable
from parity.report.side_table import backend, state_by_kind
from parity.sides import all_sides, load_ref

__all__ = ["plan_rows", "deepspeed_plan_text", "jax_plan_text", "fsdp_plan_text", "environment_rows", "doctor_rows",
           "PERTURB_HEADERS", "perturbation_rows", "perturbation_lines", "inputs_lines"]


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
    rows.append(("plan pair", f"{plan['name']} ({how}{extra})" + (f": {plan['why']}" if plan.get("why") else "")
                 + (f"; {plan['fsdp']}" if isinstance(plan.get("fsdp"), str) else "")))
  else:
    rows.append(("plan pair", "none: the sides' own plans match no named pair"))
  for record in all_sides():  # a plan no side ran is not shown as if it had (design review, 2026-12-02)
    text = load_ref(record.plan_text)(d) if record.name in d["sides"] and record.plan_text else None
    if text is not None:
      rows.append((record.plan_label, text))
  for name, s in d["sides"].items():
    summ = s.get("summary") or {}
    if summ.get("state_memory_kinds"):
      rows.append((f"{name} placed", state_by_kind(summ)))
    elif summ.get("state_bytes_by_category"):
      rows.append((f"{name} placed", ", ".join(
          f"{cat} " + " + ".join(f"{fmt_bytes(b)} {k}" for k, b in kinds.items() if b)
          for cat, kinds in summ["state_bytes_by_category"].items() if any(kinds.values()))))
  return rows


def deepspeed_plan_text(d: dict) -> str:
  """The DeepSpeed side's plan row (its record's plan_text): ZeRO stage, offloads, activation checkpointing."""
  ds = d["run"]["deepspeed"]
  ckpt = ("activation checkpointing" + (" with cpu_checkpointing (block inputs on the host)"
                                        if ds.get("cpu_checkpointing") else "")
          if ds.get("activation_checkpointing") else "no activation checkpointing")
  return (f"ZeRO-{ds['zero_stage']}, offload_optimizer {ds.get('offload_optimizer')}, "
          f"offload_param {ds.get('offload_param')}, {ckpt}")


def jax_plan_text(d: dict) -> str:
  """The JAX side's plan row (its record's plan_text): offloads, remat, scan_layers, ZeRO stage, data axis."""
  j = d["run"]["jax"]
  return (f"offload_opt_state {j.get('offload_opt_state')}, offload_params {j.get('offload_params')}, remat "
          f"{j.get('remat')}, scan_layers {j.get('scan_layers')}, zero_stage {j.get('zero_stage')}, data_parallel "
          f"{j.get('data_parallel', 1)}")


def fsdp_plan_text(d: dict) -> str | None:
  """The FSDP2 side's plan row (its record's plan_text), or None for a report written before the fsdp section."""
  f = d["run"].get("fsdp")
  if not isinstance(f, dict):
    return None
  return ("fully_shard on every block and the root, "
          + ("CPUOffloadPolicy (params, gradients and optimizer state on the host, "
             f"{_fsdp_pinning(d, f)})" if f.get("offload") else "no offload")
          + f", reshard_after_forward {f.get('reshard_after_forward')}"
          + (", activations saved for the backward in host memory (save_on_cpu)"
             if f.get("activation_offload") else "")
          + (", every block recomputed in the backward (activation checkpointing)"
             if f.get("activation_checkpointing") else ""))


def _fsdp_pinning(d: dict, plan: dict) -> str:
  """The plan's pin_memory and, where the side recorded what it built (summary.json fsdp.pin_memory), that: a
  machine without CUDA cannot pin, so the two can differ."""
  built = ((d["sides"].get("fsdp") or {}).get("summary") or {}).get("fsdp") or {}
  asked = f"pin_memory {plan.get('pin_memory')}"
  if "pin_memory" in built and built["pin_memory"] != plan.get("pin_memory"):
    return f"{asked} asked, {built['pin_memory']} as built (no CUDA: host memory cannot be pinned)"
  return asked


def environment_rows(d: dict, extra: dict | None = None) -> list[tuple[str, str]]:
  """(label, text) rows to reproduce the run: date, command, project git revision (+ dirty), config hash, Python,
  OS, CPU model and count, load, per-side devices, package versions. `extra`: environment.json of the run folder
  (harness doctor block) when present; its keys are listed after the report's own. When environment.json's commit
  (the sides' start) is not the report-time revision, the revision row names both."""
  e = d.get("environment") or {}
  git = e.get("git") or {}
  rows = [("date (UTC)", d.get("created_utc", "n/a")),
          ("command", (d.get("run_folder") or {}).get("command") or "n/a"),
          ("project git revision", (f"{git['rev'][:12]}" + (" (uncommitted changes)" if git.get("dirty") else
                                                             " (clean)")) if git.get("rev")
                                    else "n/a (not a git checkout)"),
          ("config hash", d.get("config_hash", "n/a")),
          ("Python / OS", f"{e.get('python', 'n/a')} / {e.get('platform', 'n/a')}"),
          ("CPU", f"{e.get('cpu_model') or e.get('machine') or 'n/a'}, {e.get('cpu_count', 'n/a')} CPUs"),
          ("load average (1/5/15 min) at report time", ", ".join(map(str, e.get("load_avg_1_5_15") or [])) or "n/a")]
  for name, s in d["sides"].items():
    summ = s.get("summary") or {}
    rows.append((f"{name} device", f"{summ.get('device', 'n/a')} ({backend(s)})"))
  rows.append(("versions", ", ".join(f"{k} {v}" for k, v in (e.get("versions") or {}).items())))
  started = str(((extra or {}).get("git") or {}).get("commit") or "")
  if git.get("rev") and started and not str(git["rev"]).startswith(started[:12]) and not started.startswith(
      str(git["rev"])[:12]):
    rows[2] = (rows[2][0], f"{rows[2][1]} when the report was written; the sides started at {started[:12]} "
                           "(environment.json): the checkout changed during the run")
  return rows + doctor_rows(extra or {})


def doctor_rows(env: dict) -> list[tuple[str, str]]:
  """(label, text) rows of environment.json (harness doctor block, schema parity.environment/1): host fields one
  per row, installed packages on one row, git commit/branch/dirty, CUDA driver, GPUs, each framework's backend,
  one row per worker-thread variable, host limit and numerics flag (parity.report.env_rows); any other key as
  readable text, never JSON (the raw blocks stay in environment.json)."""
  rows: list[tuple[str, str]] = []
  for key, val in env.items():
    if key in ("schema", "run_id", "quick"):
      continue
    if key == "host" and isinstance(val, dict):
      for k, v in val.items():
        rows.append((f"host {k.replace('_', ' ')}", fmt_bytes(v) if k.endswith("_bytes") else
                     (", ".join(map(str, v)) if isinstance(v, list) and all(not isinstance(x, dict) for x in v)
                      else v if isinstance(v, str) else readable(v))))
    elif key == "packages" and isinstance(val, dict):
      rows.append(("packages", ", ".join(f"{k} {v}" for k, v in val.items() if v) or "n/a"))
    elif key == "git" and isinstance(val, dict):
      rev = str(val.get("commit") or val.get("rev") or "n/a")[:12]
      state = "uncommitted changes" if val.get("dirty") else "clean"
      extra = f", {val['changed_files']} files changed" if val.get("changed_files") else ""
      rows.append(("git (environment.json)", f"{rev} on {val.get('branch', '?')} ({state}{extra})"))
    elif key == "frameworks" and isinstance(val, dict):
      for fw, info in val.items():
        rows.append((f"{fw} backend", info if isinstance(info, str) else readable(info)))
    else:  # worker threads, host limits, numerics flags: one row per setting (parity.report.env_rows)
      rows += block_rows(key, val)
  return rows


PERTURB_HEADERS = ("perturbation", "what it changes", "written into the DeepSpeed config", "value each side ran",
                   "peak lr of each side's steps", "result")
"""Columns of `perturbation_rows` (report.html and report.md)."""


def _short(v) -> str:
  return fmt(v, ".6g") if isinstance(v, float) else json.dumps(v, default=str) if not isinstance(v, str) else v


def perturbation_rows(d: dict) -> list[list[str]]:
  """One row per requested `--perturb` spec change (report.json 'perturbations'), cells as PERTURB_HEADERS: the
  request, the fields it moves, the DeepSpeed config values written (path was → now), the value every side ran as
  read back from its own records (and where), the steps' peak lr for lr keys, and the result: 'applied', 'NOT
  APPLIED: <side> ran <value>' or 'unknown: <side> did not finish'."""
  rows = []
  for p in d.get("perturbations") or []:
    applies = "; ".join(f"{k} = {_short(v)}" for k, v in (p.get("applies") or {}).items())
    if p.get("note"):
      applies = f"{applies} ({p['note']})" if applies else p["note"]
    cfg = p.get("deepspeed_config")
    written = ("n/a" if p.get("applies") is None else
               "n/a: the DeepSpeed side builds its config from the spec" if cfg is None else
               "; ".join(f"{c['path']}: {_short(c['was'])} → {_short(c['now'])}" for c in cfg) or
               "nothing: that config has no such value; the side takes it from its spec")
    ran = "; ".join(f"{n}: {_short(r['value'])}, read from {r['from']}" for n, r in (p.get("ran") or {}).items())
    peak = "; ".join(f"{n}: {fmt(v, '.6g')}" for n, v in (p.get("peak_lr") or {}).items())
    if peak and p.get("expected_peak_lr") is not None:
      peak += f" (perturbed spec schedules {fmt(p['expected_peak_lr'], '.6g')})"
    got = ((p.get("ran") or {}).get(p["side"]) or {}).get("value")
    result = {True: "applied", None: f"unknown: {p['side']} did not finish"}.get(
        p.get("applied"), f"NOT APPLIED: {p['side']} ran {_short(got)}")
    rows.append([f"{p['side']}: {p['key']} = {_short(p['value'])}", applies, written, ran, peak or "n/a", result])
  return rows


def perturbation_lines(d: dict) -> list[str]:
  """One terminal line per `--perturb` (perturbation_rows): 'perturbation deepspeed: train.lr = 0.002: applied
  (deepspeed: 0.002, read from its steps)' or 'NOT APPLIED: ...'; a planted fault (DEBUG_KEYS: kill_at_step, ...)
  is named as one; [] for a run without perturbations."""
  out = []
  for p, r in zip(d.get("perturbations") or [], perturbation_rows(d)):
    if p.get("key") in OPTIMIZER_PLANT_KEYS:
      out.append(f"planted bug {r[0]} (the side applies it to its own optimizer's decay set: the semantics card)")
    elif p.get("key") in PLANT_KEYS:
      out.append(f"planted bug {r[0]} (the side applies it to its own inputs and model: docs/data-examples.md)")
    elif p.get("key") in OFFLOAD_PLANT_KEYS:
      out.append(f"planted bug {r[0]} (the side's backward pass reads a wrong saved residual, its forward unchanged: "
                 "docs/plans.md)")
    elif p.get("key") in DEBUG_KEYS:
      out.append(f"planted fault {r[0]} (debug: no spec value to apply)")
    else:
      out.append(f"perturbation {r[0]}: {r[-1]}" + (f" ({r[3]})" if r[3] else ""))
  return out


def inputs_lines(d: dict) -> list[str]:
  """Sentences on what the run trained on and the DeepSpeed config files kept in the run folder (report.json
  'inputs' and 'deepspeed_files'); [] when the report has neither (an older report)."""
  out = []
  inp = d.get("inputs") or {}
  if inp:
    ckpt = f"Initial weights: the checkpoint {inp['checkpoint']}. " if inp.get("checkpoint") else ""
    out.append(f"{ckpt}Data: {inp.get('data')}, tokens: {inp.get('tokenizer')}.")
  files = d.get("deepspeed_files") or {}
  given, resolved = files.get("given"), files.get("resolved")
  if given:
    out.append(f"DeepSpeed config as given: {given['file']} (a byte copy of {given['source']}, sha256 "
               f"{given['sha256']}).")
  if resolved:
    out.append(f"DeepSpeed config the DeepSpeed side ran (\"auto\" filled, its --perturb written in): "
               f"{resolved['file']} (sha256 {resolved['sha256']}).")
  return out
