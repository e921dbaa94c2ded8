"""How a run was set up, as rows: the plan pair, each side's plan and placements (`plan_rows`), what reproduces it
(`environment_rows`, environment.json's block: `doctor_rows`), its `--perturb` changes and whether each took
(`perturbation_rows`, `perturbation_lines`) and what it trained on (`inputs_lines`). Plain text; callers escape."""
from __future__ import annotations

import json

from parity.protocol.layout import (ACCELERATOR_PLANT_KEYS, DEBUG_KEYS, OFFLOAD_PLANT_KEYS, OPTIMIZER_PLANT_KEYS,
                                    PLANT_KEYS)
from parity.report.cells import fmt, fmt_bytes
from parity.report.env_rows import block_rows, readable
from parity.report.run_record import RunRecord
from parity.report.side_table import backend, state_by_kind
from parity.sides import all_sides, load_ref

__all__ = ["plan_rows", "deepspeed_plan_text", "jax_plan_text", "fsdp_plan_text", "environment_rows", "doctor_rows",
           "PERTURB_HEADERS", "perturbation_rows", "perturbation_lines", "inputs_lines"]


def plan_rows(rec: RunRecord) -> list[tuple[str, str]]:
  """(label, text) rows: the plan pair (or the DeepSpeed config file it came from), each side's plan as it describes
  itself (parity.side_plans: `describe`), and each side's placements."""
  plan, mig = rec.plan, rec.migration
  rows = []
  if mig and mig.source:
    rows.append(("memory plan", f"from the DeepSpeed config {mig.source} (port status: {mig.status}; "
                                f"key-by-key table in {mig.file})"))
  elif plan and plan.name:
    how = {"default": "the preset's own plans match this pair", "auto": "chosen by --plan auto",
           "user": "given with --plan"}.get(plan.chosen_by, plan.chosen_by or "")
    extra = f"; then {', '.join(plan.overrides)}" if plan.overrides else ""
    rows.append(("plan pair", f"{plan.name} ({how}{extra})" + (f": {plan.why}" if plan.why else "")
                 + (f"; {plan.fsdp}" if isinstance(plan.fsdp, str) else "")))
  else:
    rows.append(("plan pair", "none: the sides' own plans match no named pair"))
  for record in all_sides():  # a plan no side ran is not shown as if it had (design review, 2026-12-02)
    text = load_ref(record.plan_text)(rec) if record.name in rec.sides and record.plan_text else None
    if text is not None:
      rows.append((record.plan_label, text))
  for name, s in rec.sides.items():
    summ = s.summary
    if summ.get("state_memory_kinds"):
      rows.append((f"{name} placed", state_by_kind(summ)))
    elif summ.get("state_bytes_by_category"):
      rows.append((f"{name} placed", ", ".join(
          f"{cat} " + " + ".join(f"{fmt_bytes(b)} {k}" for k, b in kinds.items() if b)
          for cat, kinds in summ["state_bytes_by_category"].items() if any(kinds.values()))))
  return rows


def _described(rec: RunRecord, section: str) -> str | None:
  """The plan in RunSpec section `section` of the run in its own words (parity.side_plans: its `describe`), None when
  the report stores no such section (written before it existed)."""
  plan = rec.run.plans.get(section)
  return plan.describe() if plan is not None else None


def deepspeed_plan_text(rec: RunRecord) -> str | None:
  """The DeepSpeed side's plan row (its record's plan_text): DeepSpeedPlan.describe."""
  return _described(rec, "deepspeed")


def jax_plan_text(rec: RunRecord) -> str | None:
  """The JAX side's plan row (its record's plan_text): JaxPlan.describe."""
  return _described(rec, "jax")


def fsdp_plan_text(rec: RunRecord) -> str | None:
  """The FSDP2 side's plan row (its record's plan_text): FsdpPlan.describe, with its offload's pinning as asked and
  as built; None for a report written before the fsdp section."""
  text, plan = _described(rec, "fsdp"), rec.run.plans.get("fsdp")
  return None if text is None else text + (f"; {_fsdp_pinning(rec, plan)}" if plan.offload else "")


def _fsdp_pinning(rec: RunRecord, plan) -> str:
  """The plan's pin_memory and, where the side recorded what it built (summary.json fsdp.pin_memory), that: a
  machine without CUDA cannot pin, so the two can differ."""
  side = rec.sides.get("fsdp")
  built = (side.summary.get("fsdp") if side is not None else None) or {}
  asked = f"pin_memory {plan.pin_memory}"
  if "pin_memory" in built and built["pin_memory"] != plan.pin_memory:
    return f"{asked} asked, {built['pin_memory']} as built (no CUDA: host memory cannot be pinned)"
  return asked


def environment_rows(rec: RunRecord, extra: dict | None = None) -> list[tuple[str, str]]:
  """(label, text) rows to reproduce the run: date, command, project git revision (+ dirty), config hash, Python,
  OS, CPU model and count, load, per-side devices, package versions. `extra`: environment.json of the run folder
  (harness doctor block) when present; its keys are listed after the report's own. When environment.json's commit
  (the sides' start) is not the report-time revision, the revision row names both."""
  e = rec.environment
  git = e.git or {}
  na = lambda v: "n/a" if v is None else v  # a key the report lacks
  rows = [("date (UTC)", na(rec.created_utc)),
          ("command", rec.run_folder.command or "n/a"),
          ("project git revision", (f"{git['rev'][:12]}" + (" (uncommitted changes)" if git.get("dirty") else
                                                             " (clean)")) if git.get("rev")
                                    else "n/a (not a git checkout)"),
          ("config hash", na(rec.config_hash)),
          ("Python / OS", f"{na(e.python)} / {na(e.platform)}"),
          ("CPU", f"{e.cpu_model or e.machine or 'n/a'}, {na(e.cpu_count)} CPUs"),
          ("load average (1/5/15 min) at report time", ", ".join(map(str, e.load_avg)) or "n/a")]
  for name, s in rec.sides.items():
    rows.append((f"{name} device", f"{s.summary.get('device', 'n/a')} ({backend(s)})"))
  rows.append(("versions", ", ".join(f"{k} {v}" for k, v in e.versions.items())))
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


def perturbation_rows(rec: RunRecord) -> list[list[str]]:
  """One row per requested `--perturb` spec change (report.json 'perturbations'), cells as PERTURB_HEADERS: the
  request, the fields it moves, the DeepSpeed config values written (path was → now), the value every side ran as
  read back from its own records (and where), the steps' peak lr for lr keys, and the result: 'applied', 'NOT
  APPLIED: <side> ran <value>' or 'unknown: <side> did not finish'."""
  rows = []
  for p in rec.perturbations:
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


def perturbation_lines(rec: RunRecord) -> list[str]:
  """One terminal line per `--perturb` (perturbation_rows): 'perturbation deepspeed: train.lr = 0.002: applied
  (deepspeed: 0.002, read from its steps)' or 'NOT APPLIED: ...'; a planted fault (DEBUG_KEYS: kill_at_step, ...)
  is named as one; [] for a run without perturbations."""
  out = []
  for p, r in zip(rec.perturbations, perturbation_rows(rec)):
    if p.get("key") in OPTIMIZER_PLANT_KEYS:
      out.append(f"planted bug {r[0]} (the side applies it to its own optimizer's decay set: the semantics card)")
    elif p.get("key") in PLANT_KEYS:
      out.append(f"planted bug {r[0]} (the side applies it to its own inputs and model: docs/data-examples.md)")
    elif p.get("key") in OFFLOAD_PLANT_KEYS:
      out.append(f"planted bug {r[0]} (the side's backward pass reads a wrong saved residual, its forward unchanged: "
                 "docs/plans.md)")
    elif p.get("key") in ACCELERATOR_PLANT_KEYS:
      out.append(f"planted accelerator-only error {r[0]}: " + (
          "applied (the side ran on an accelerator)" if p.get("applied") else
          "NOT APPLIED (the side applies it on an accelerator only; this one ran on the CPU)"
          if p.get("applied") is False else "the side did not finish"))
    elif p.get("key") in DEBUG_KEYS:
      out.append(f"planted fault {r[0]} (debug: no spec value to apply)")
    else:
      out.append(f"perturbation {r[0]}: {r[-1]}" + (f" ({r[3]})" if r[3] else ""))
  return out


def inputs_lines(rec: RunRecord) -> list[str]:
  """Sentences on what the run trained on and the DeepSpeed config files kept in the run folder (report.json
  'inputs' and 'deepspeed_files'); [] when the report has neither (an older report)."""
  out = []
  inp = rec.inputs
  if inp:
    ckpt = f"Initial weights: the checkpoint {inp['checkpoint']}. " if inp.get("checkpoint") else ""
    out.append(f"{ckpt}Data: {inp.get('data')}, tokens: {inp.get('tokenizer')}.")
  files = rec.deepspeed_files
  given, resolved = files.get("given"), files.get("resolved")
  if given:
    out.append(f"DeepSpeed config as given: {given['file']} (a byte copy of {given['source']}, sha256 "
               f"{given['sha256']}).")
  if resolved:
    out.append(f"DeepSpeed config the DeepSpeed side ran (\"auto\" filled, its --perturb written in): "
               f"{resolved['file']} (sha256 {resolved['sha256']}).")
  return out
