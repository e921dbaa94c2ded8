"""Re-verifying the reruns of a finished run (parity.report.reverify): the noise envelope from noise/, the host-CPU
reruns from backend/, determinism and resume from repeat/ and resume/, the --equivalence reruns from
equivalence/<kind>/, each recomputed from the files its workers left by the functions that computed it during the
run (parity.verdict.reruns, parity.verdict.equivalence); nothing is run."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

from parity.protocol.layout import (BACKEND_DIR, EQUIVALENCE_DIR, NOISE_DIR, REPEAT_DIR, REQUEST_FILE, RESUME_DIR,
                                    STEPS_FILE, SUMMARY_FILE, read_steps, read_summary)
from parity.protocol.outputs import SideRun, rerun_outputs, side_outputs, stored_side_run
from parity.report.run_record import RunRecord, SideRecord
from parity.verdict.check import Check
from parity.verdict.equivalence import equivalence_outcome, equivalence_section, not_prepared
from parity.verdict.gating import mark_backend_decided, mark_envelope_decided
from parity.verdict.reruns import (backend_result, determinism_outcome, determinism_section, envelope_result,
                                   resume_outcome, resume_section)

__all__ = ["Unverifiable", "side_run", "stopped", "rerun_checks"]


class Unverifiable(Exception):
  """The checks cannot be recomputed: a record they rest on is missing or unreadable (the message names it)."""


def side_run(out: Path, side: str, stored: SideRecord | None = None) -> SideRun:
  """parity.protocol.outputs.SideRun of a finished worker from its summary.json (the harness writes the status it
  decided there). A side with no summary.json keeps its stored status only when it is not 'ok' (e.g. 'not_run': a side
  never started has no folder); such a status can only fail the verdict. stored: report.json's record of the side."""
  summ = read_summary(out / SUMMARY_FILE)
  if summ is None or not isinstance(summ, dict):
    if stored is None or stored.status == "ok":
      raise Unverifiable(f"{out / SUMMARY_FILE} is missing or not JSON")
    return SideRun(side=side, status=str(stored.status), returncode=None, wall_s=0.0, peak_rss_bytes=None,
                   summary=dict(stored.summary), error=stored.error)
  return SideRun(side=side, status=str(summ.get("status")), returncode=None, wall_s=0.0, peak_rss_bytes=None,
                 summary=summ, error=summ.get("error"))


def _stored_section(ctx, d: RunRecord, sec: Any, key: str, folder: str, what: str) -> tuple[Any, dict]:
  """(report.json's rerun section `sec` (its key `key`), its 'runs' mapping or {}); (None, {}) without the section.

  Raises:
    Unverifiable: the section is missing although run_dir/<folder>/request.json shows `what` were started (and the
      run was not stopped before writing it).
  """
  if sec is None:
    if (ctx.run_dir / folder / REQUEST_FILE).exists() and not stopped(d):
      raise Unverifiable(f"{folder}/request.json shows {what} were started, but report.json has no {key} section")
    return None, {}
  return sec, sec.get("runs") if isinstance(sec, dict) and isinstance(sec.get("runs"), dict) else {}


def _noise(ctx, d: RunRecord, main_checks: list) -> tuple[list, Any]:
  """The noise-envelope checks and section from run_dir/noise/ (when report.json has the section), the main checks
  it decides marked reported only."""
  sec, runs = _stored_section(ctx, d, d.noise_envelope, "noise_envelope", NOISE_DIR, "the reduction-order reruns")
  if sec is None:
    return [], None
  outputs = {}
  for side in ctx.ok_sides:
    out = ctx.run_dir / NOISE_DIR / side
    sr = side_run(out, side)
    sr.wall_s = (runs.get(side) or {}).get("wall_s", 0.0)  # the harness's clock: not in the files
    outputs[side] = (sr, *side_outputs(out, sr, ctx.run_id, expected_steps=ctx.spec.train.steps))
  res = envelope_result(ctx, outputs)
  mark_envelope_decided(main_checks, res.decides, ctx.spec.train.precision)
  return res.checks, res.section


def _backend(ctx, d: RunRecord, main_checks: list) -> tuple[list, Any]:
  """The backend checks and section from run_dir/backend/ (when report.json has the section), the main checks they
  decide marked reported only."""
  sec, runs = _stored_section(ctx, d, d.backend, "backend", BACKEND_DIR, "the host-CPU reruns")
  if sec is None:
    return [], None
  outputs = {}
  for side in runs:
    out = ctx.run_dir / BACKEND_DIR / side
    sr = side_run(out, side)
    outputs[side] = (sr, side_outputs(out, sr, ctx.run_id, expected_steps=ctx.spec.train.steps)[0])
  res = backend_result(ctx, outputs)
  mark_backend_decided(main_checks, res.decides)
  return res.checks, res.section


def _one_int(values: set, what: str) -> int | None:
  if not values:
    return None
  if len(values) != 1 or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
    raise Unverifiable(f"report.json's {what} is not one step count: {sorted(map(str, values))}")
  return next(iter(values))


def stopped(d: RunRecord) -> bool:
  """report.json holds a failing 'reruns' check: the reruns stopped (a file could not be written or read)."""
  return any(c.metric == "reruns" and c.passed is False for c in d.checks)


def _check_repeat_request(path: Path, prefix: int, resume_at: int | None) -> None:
  """The repeat run's request.json (parity.protocol.derive_request) records what was started: steps 0..stop_after_step
  with stop = max(prefix - 1, resume_at), a checkpoint at save_checkpoint_at_step = resume_at. Raises Unverifiable
  when report.json's determinism/resume sections claim another prefix or checkpoint than that, or reruns that never
  started (or none where they did)."""
  try:
    req = json.loads(path.read_text()) if path.exists() else None
  except (OSError, ValueError) as exc:
    raise Unverifiable(f"{path.parent.name}/request.json cannot be read ({exc})") from None
  if req is None:
    if prefix or resume_at is not None:
      raise Unverifiable(f"report.json has determinism/resume sections but {path.parent.name}/request.json is missing")
    return
  stop, ckpt = req.get("stop_after_step") if isinstance(req, dict) else None, (req or {}).get("save_checkpoint_at_step")
  consistent = ckpt == resume_at and isinstance(stop, int) and (
      prefix == stop + 1 if resume_at is None or stop > resume_at else 0 <= prefix <= stop + 1)
  if not consistent:
    raise Unverifiable(f"{path.parent.name}/request.json started steps 0..{stop} with a checkpoint at {ckpt}, but "
                       f"report.json's sections give {prefix} determinism steps and a resume from {resume_at}")


def _repeats(ctx, d: RunRecord, interrupted: bool) -> tuple[list, dict, dict]:
  """The determinism and resume checks (and sections) from run_dir/repeat/ and resume/, for the prefix and
  checkpoint step report.json names; every finished side must have them unless the run was interrupted."""
  det_sec, res_sec = d.determinism, d.resume
  prefix = _one_int({v.steps_checked for v in det_sec.values()}, "determinism steps_checked") or 0
  resumed_at = _one_int({v.resumed_at_step for v in res_sec.values()}, "resume resumed_at_step")
  resume_at = None if resumed_at is None else resumed_at - 1
  if not interrupted and not stopped(d):
    _check_repeat_request(ctx.run_dir / REPEAT_DIR / REQUEST_FILE, prefix, resume_at)
  sides = [s for s in ctx.ok_sides if not interrupted or s in det_sec or s in res_sec]
  dets, ress, dsec, rsec = [], [], {}, {}
  for side in sides if prefix > 0 or resume_at is not None else ():
    sr = side_run(ctx.run_dir / REPEAT_DIR / side, side)
    if prefix > 0:
      dets.append(c := determinism_outcome(ctx, side, prefix,
                                           read_steps(ctx.run_dir / REPEAT_DIR / side / STEPS_FILE)))
      dsec[side] = determinism_section(c, prefix, sr)
    if resume_at is None:
      continue
    resumed = None
    if sr.status == "ok":
      out = ctx.run_dir / RESUME_DIR / side
      rr = side_run(out, side)
      resumed = (rr, *side_outputs(out, rr, ctx.run_id, expected_steps=ctx.spec.train.steps - resume_at - 1))
    ress.append(c := resume_outcome(ctx, side, resume_at, sr, resumed))
    rsec[side] = resume_section(c, resume_at)
  return dets + ress, dsec, rsec


def _equivalence(ctx, d: RunRecord) -> tuple[list, dict]:
  """The --equivalence checks and section from run_dir/equivalence/ (parity.verdict.equivalence), for the kinds and
  sides report.json's section names."""
  try:
    return _equivalence_from_folders(ctx, d.equivalence)
  except (OSError, ValueError, KeyError, TypeError) as exc:
    raise Unverifiable(f"the equivalence reruns in equivalence/ cannot be read ({type(exc).__name__}: {exc})") from None


def _read_prepared(folder: Path) -> dict[str, Any]:
  """The record parity.pipeline.equivalence_inputs.prepare_equivalence left in a rerun folder's request.json."""
  record = json.loads((folder / REQUEST_FILE).read_text())["equivalence"]
  return {"folder": folder, "train": record["changed"], "nproc": record["nproc"],
          "loss_tokens_per_step": record["loss_tokens_per_step"]}


def _equivalence_from_folders(ctx, stored: Mapping) -> tuple[list[Check], dict[str, Any]]:
  """The equivalence checks and section recomputed from run_dir/equivalence/<kind>/ for the kinds and sides that
  report.json's section `stored` names (nothing is run). A kind whose rerun was not prepared keeps the reason stored
  (its folder holds no request of its own).

  Raises:
    OSError, ValueError, KeyError: a rerun request that cannot be read (the caller names the folder).
  """
  checks, section = [], {}
  for kind, sec in stored.items():
    sides = list((sec or {}).get("sides") or {})
    if (sec or {}).get("rerun") is None:
      rows = {s: sec["sides"][s] for s in sides}
      checks += [dataclasses.replace(not_prepared(kind, s, ctx.spec, ""), detail=rows[s].get("error")) for s in sides]
      section[kind] = equivalence_section(kind, ctx.spec, None, rows)
      continue
    folder = ctx.run_dir / EQUIVALENCE_DIR / kind
    prepared, rows = _read_prepared(folder), {}
    for side in sides:
      sr = stored_side_run(folder, side)
      c, rows[side] = equivalence_outcome(kind, side, ctx.side_data[side], sr,
                                          *rerun_outputs(folder, side, sr, ctx.run_id, ctx.spec.train.steps),
                                          ctx.spec, ctx.init)
      checks.append(c)
    section[kind] = equivalence_section(kind, ctx.spec, prepared, rows)
  return checks, section


def rerun_checks(ctx, d: RunRecord, main_checks: list, interrupted: bool) -> tuple[list[Check], dict[str, Any]]:
  """Every rerun's checks, in the order `parity compare` appends them (backend, noise envelope, determinism and
  resume, equivalence), and the report sections they give ({'noise_envelope', 'determinism', 'resume',
  'equivalence', 'backend'}), recomputed from the rerun folders for the sections report.json (`d`) names; the main
  checks the backend and envelope checks decide are marked reported only, as in the run. ctx: the main run's
  parity.verdict.reruns.RerunContext; interrupted: the run was stopped (a side's reruns may be missing)."""
  backend_checks, backend_sec = _backend(ctx, d, main_checks)
  noise_checks, noise_sec = _noise(ctx, d, main_checks)
  repeat_checks, dsec, rsec = _repeats(ctx, d, interrupted)
  eq_checks, eq_sec = _equivalence(ctx, d)
  return (backend_checks + noise_checks + repeat_checks + eq_checks,
          {"noise_envelope": noise_sec, "determinism": dsec, "resume": rsec, "equivalence": eq_sec,
           "backend": backend_sec})
