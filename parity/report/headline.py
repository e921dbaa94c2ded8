"""What a run was and what it found, in one line each: the model's name (`model_label`), the run's title
(`run_title`), the verdict sentence (`verdict_parts`, `verdict_sentence`), a side's error in one clause
(`error_clause`) and the write errors that still hold (`open_write_errors`). One source for report.html, report.md,
the card, the figures, the comparison page and the terminal, so they never disagree; plain text, callers escape."""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Mapping

from parity.hf import family_of_spec
from parity.protocol.disk_full import DISK_FULL, written_file
from parity.protocol.layout import FOLDER_GONE
from parity.report.cells import first_clause, fmt, fmt_count, pair_label
from parity.report.check_table import measure_label
from parity.report.run_record import CheckRecord, RunRecord
from parity.spec import ModelSpec, from_dict
from parity.weights import n_params

__all__ = ["model_label", "run_title", "open_write_errors", "error_clause", "verdict_parts", "verdict_sentence"]


def _model_facts(rec: RunRecord) -> tuple[str | None, int | None]:
  """(HF family of the run's model or None, its trainable parameter count or None) from report.json's run.model."""
  try:
    spec = from_dict(ModelSpec, rec.run.model)
  except Exception:  # an older or edited report: the title keeps what it can
    return None, None
  try:
    family = family_of_spec(spec)
  except Exception:  # a layout no HF family has (HFFormatError)
    family = None
  return family, n_params(spec)


def model_label(rec: RunRecord) -> str:
  """The model a run trained, as every page names it: 'gpt2-tiny (gpt2 family, 120.6 K params)'; for a run started
  from a Hugging Face checkpoint (`--hf-model`, report.json 'checkpoint') the checkpoint, not the preset that only gave
  the training settings: 'checkpoint llama (LlamaForCausalLM, llama family, 107.5 K params; training settings of
  gpt2-tiny)'. Used by run_title (report.html, report.md, card.json, the figures) and the comparison page."""
  family, n = _model_facts(rec)
  facts = [f"{family} family" if family else None, f"{fmt_count(n)} params" if n is not None else None]
  path, arch = rec.checkpoint_path, rec.checkpoint_architecture
  if path:
    inner = ", ".join(x for x in [arch, *facts] if x)
    return (f"checkpoint {Path(path).name} ({inner}; training settings of {rec.preset})")
  inner = ", ".join(x for x in facts if x)
  return f"{rec.preset}" + (f" ({inner})" if inner else "")


def run_title(rec: RunRecord) -> str:
  """'gpt2-tiny (gpt2 family, 120.6 K params) · plan zero2-offload · fp32 · 3 steps · jax, torch': what the figures
  and the pages are about (model_label names the model: the checkpoint of an `--hf-model` run)."""
  plan = rec.plan.name if rec.plan else None
  source = rec.migration.source if rec.migration else None
  plan_txt = f"DeepSpeed config {source}" if source else (f"plan {plan}" if plan else "own plans")
  if rec.run.precision is None or rec.run.steps is None:
    raise KeyError("run.train")  # a report without its run section: callers keep what they can
  return (f"{model_label(rec)} · {plan_txt} · {rec.run.precision} · {rec.run.steps} steps · "
          f"{', '.join(rec.sides)}")


def open_write_errors(rec: RunRecord, run_dir=None) -> list[Mapping]:
  """report.json's write_errors that still hold: an error of a rendered file (report.html, report.md, card.json, the
  PNGs) that now exists in the run folder (`run_dir`, else report.json's run_dir; '*.png': any PNG there) was mended
  by a later `parity report` re-render, and a page that named it would contradict the folder. Errors of
  report.json and metrics.jsonl, which a re-render does not write, always hold."""
  folder = Path(run_dir if run_dir is not None else rec.run_dir or ".")
  out = []
  for e in rec.write_errors:
    name = Path(str(e.get("file", ""))).name
    rendered = name in ("report.html", "report.md", "card.json") or name.endswith(".png")  # what a re-render rewrites
    # '*.png' (the plots as one entry) is the only pattern the writer records; any other name is a literal file name
    there = rendered and (any(folder.glob("*.png")) if name == "*.png" else (folder / name).exists())
    if not there:
      out.append(e)
  return out


_OS_ERRORS = sorted({os.strerror(i) for i in range(1, 134)} - {"Unknown error"}, key=len, reverse=True)
"""The operating system's error texts ('No space left on device'): a side's error that ends in one is named by it."""


def error_clause(summ: dict) -> str:
  """A side's error in one short clause, from its summary's error and traceback (parity.protocol.side.SideIO.fail):
  'writing final.safetensors: No space left on device' (the file a parity frame of the traceback was writing, and
  the OS error the message ends in), else the message's first line without a trailing '(...)' (at most 160 characters);
  the harness's 'No space left on device (disk full while writing PATH)' whole; '' when the summary holds no error."""
  err = str(summ.get("error") or "").strip().splitlines()[0] if summ.get("error") else ""
  if not err:
    return ""
  if err.startswith(f"{DISK_FULL} (disk full while writing "):  # the harness named it (parity.protocol.disk_full)
    return err
  os_err = next((e for e in _OS_ERRORS if e.lower() in err.lower()), None)
  cause = os_err or re.sub(r"\s+\([^()]*\)$", "", err) or err  # a trailing '(explanation)' left out
  cause = cause if len(cause) <= 160 else cause[:157] + "..."
  frames = re.findall(r'File "[^"]*parity[^"]*", line \d+, in \w+\n\s+(.*)', str(summ.get("traceback") or ""))
  files = [written_file(f) for f in frames]
  files = [f for f in files if f]
  return f"writing {files[-1]}: {cause}" if files and os_err else cause


def _side_stop(rec: RunRecord) -> list[str]:
  """'torch stopped after 4 of 4 steps (crashed writing final.safetensors: No space left on device)' per side that
  did not finish: its status and its error (error_clause)."""
  out = []
  for name, s in rec.sides.items():
    if s.status != "ok":
      n = s.summary.get("steps_completed", len(s.values("loss")))
      why = error_clause(s.summary)
      why = (f" {why}" if why.startswith("writing ") else f": {why}") if why else ""
      out.append(f"{name} stopped after {n} of {rec.run.steps} steps ({s.status}{why})")
  return out


def _folder_gone(rec: RunRecord) -> str | None:
  """The verdict sentence of a run whose folder vanished under it (parity.protocol.layout.FOLDER_GONE in a side's
  error): the folder, the side it stopped and the sides never started; None otherwise."""
  marker = FOLDER_GONE.split("{folder}")[1]
  errors = {n: str(s.summary.get("error") or "") for n, s in rec.sides.items()}
  hit = next((e for e in errors.values() if marker in e), None)
  if hit is None:
    return None
  folder = hit[hit.index("the run folder ") + len("the run folder "):hit.index(marker)]
  ran = [f"{n} stopped after {rec.sides[n].summary.get('steps_completed', 0)} of {rec.run.steps} steps"
         for n, e in errors.items() if marker in e and not e.startswith("not started")]
  never = [n for n, e in errors.items() if e.startswith("not started") and marker in e]
  parts = ran + ([f"{', '.join(never)} {'was' if len(never) == 1 else 'were'} not started"] if never else [])
  return (f"FAIL: the run folder {folder} was deleted or moved while the run was running (its inputs and the sides' "
          f"records went with it){': ' + '; '.join(parts) if parts else ''}.")


def _worst(checks: list[CheckRecord]) -> CheckRecord:
  return max(checks, key=lambda c: (c.value or 0) / (c.tolerance or 1e-300))


def _loss_headline(rec: RunRecord) -> str | None:
  """The loss figure of a PASS sentence, quoting the bound that decided: the per-step loss tolerance where the loss
  checks gate; where they are reported only (bf16/fp16 with the noise envelope) the loss envelope's worst window and
  its bound, then the per-step difference with its non-gating bound named as such."""
  loss = [c for c in rec.checks if c.metric == "loss" and isinstance(c.value, (int, float))]
  if not loss:
    return None
  worst = _worst(loss)
  step = f" at step {worst.worst}" if isinstance(worst.worst, int) else ""
  per_step = f"largest per-step loss difference {fmt(worst.value)}{step} ({pair_label(worst.sides)})"
  if worst.gating:
    return f"{per_step}, tolerance {fmt(worst.tolerance)}"
  env = [c for c in rec.checks if c.metric == "loss_envelope" and c.gating and isinstance(c.value, (int, float))]
  if not env:
    return f"{per_step}, tolerance {fmt(worst.tolerance)} (reported only)"
  e = _worst(env)
  where = f", {e.worst}" if e.worst else ""
  return (f"in {rec.precision} the noise envelope decides: worst loss window rms Δloss {fmt(e.value)} "
          f"({pair_label(e.sides)}{where}) within its envelope bound {fmt(e.tolerance)}; {per_step}, "
          f"against a per-step bound of {fmt(worst.tolerance)} that is reported only")


def verdict_parts(rec: RunRecord) -> tuple[str, str, str]:
  """(kind, sentence, sub) of the verdict: kind 'pass' | 'fail' | 'warn' (one side, interrupted); the sentence
  names the pair, the metric and the step; sub counts the checks."""
  v, checks = rec.verdict, rec.checks
  gating = [c for c in checks if c.gating]
  failing = [c for c in gating if not c.passed]
  sub = (f"{len(gating) - len(failing)} of {len(gating)} gating checks passed"
         + (f" (+{len(checks) - len(gating)} reported only)" if len(checks) > len(gating) else "")
         + f" · {run_title(rec)}")
  msg = v.message
  if msg.startswith(("ONE SIDE", "INTERRUPTED")):
    return "warn", msg, sub
  if v.passed:
    head = _loss_headline(rec)
    sides = list(rec.sides)
    over = [c.name for c in checks if not c.passed]  # reported-only checks (the gating ones all passed)
    scope = "every check" if not over else (f"every gating check ({len(over)} reported-only check"
                                            + ("s over their bounds" if len(over) > 1 else " over its bound")
                                            + f": {', '.join(over)})")
    return "pass", (f"PASS: {', '.join(sides[:-1])} and {sides[-1]} agree within tolerance on {scope} over all "
                    f"{rec.run.steps} steps" + (f"; {head}." if head else ".")), sub
  gone = _folder_gone(rec)
  if gone is not None:  # the folder went away under the run: that is the whole story, not a side's bug
    return "fail", gone, sub
  parts = _side_stop(rec)
  ff = v.first_failure
  c = rec.check_named(ff.check if ff else None)
  if ff and ff.metric == "updates" and parts:  # a side stopped in the warmup: the stop is the cause
    gone = [n for n in ff.sides if n not in rec.sides or rec.sides[n].status != "ok"] or ["a side"]
    parts.append(f"{pair_label(ff.sides)}: no optimizer update was compared before {' and '.join(gone)} stopped "
                 "(lr was 0 on the steps both sides ran)")
  elif ff and ff.metric == "updates":  # nothing exceeded a tolerance: there was nothing to compare
    parts.append(f"{pair_label(ff.sides)}: {c.detail or 'no step with lr > 0 was compared'}")
  elif ff and ff.metric == "semantics":  # the cards differ: name the items and both values, at step 0
    parts.append(f"{pair_label(ff.sides)} differ before step 1, {c.detail or 'semantics cards differ'}")
  elif ff and ff.metric == "placement":  # one side's compiled step against its plan, at step 0
    parts.append(f"{pair_label(ff.sides)}'s compiled step differs from its plan before step 1, "
                 f"{c.detail or 'placement: the compiled memory spaces differ'}")
  elif ff and ff.metric != "completed" and ff.value is None:  # nothing was measured: say why, not
    # "exceeds its tolerance" (an equivalence rerun killed by SIGKILL once read "... over the run n/a")
    parts.append(f"{ff.metric} of {pair_label(ff.sides)} could not be measured: "
                 f"{first_clause(c.detail or 'no value was recorded')}")
  elif ff and ff.metric != "completed":
    step = f" at step {ff.step}" if ff.step is not None else ""
    label = measure_label(dataclasses.replace(c, metric=ff.metric))
    parts.append(f"{ff.metric} of {pair_label(ff.sides)} first exceeds its tolerance{step} "
                 f"(tolerance {fmt(ff.tolerance)}; {label} over the run {fmt(ff.value)})"
                 + (" on the steps both sides ran" if _side_stop(rec) else ""))
    if c.detail and ff.metric in ("params", "params_zero_grad"):
      parts[-1] += f"; {first_clause(c.detail)}"
  return "fail", "FAIL: " + "; ".join(parts or [msg.removeprefix("FAIL: ")]) + ".", sub


def verdict_sentence(rec: RunRecord) -> str:
  """verdict_parts' sentence; the stored verdict message when the report lacks what the sentence needs (a report
  written by an older parity)."""
  try:
    return verdict_parts(rec)[1]
  except (KeyError, TypeError, IndexError, ValueError):
    return rec.verdict.message


