"""What a joined folder's report says of its making (`parity join`, parity.pipeline.join): the folders it joins, each
side's machine, the inputs they share. Data for report.md, report.html, card.json and the terminal, from report.json
run_folder.join (the same record as request.json 'join'); nothing for a run that is not a join."""
from __future__ import annotations

from typing import Any, Mapping

from parity.report.run_record import RunRecord

__all__ = ["JOIN_HEADERS", "join_of", "join_intro", "join_rows", "join_card", "join_lines"]

JOIN_HEADERS = ("side", "folder", "run id", "host", "device (backend)", "OS / CPU / GPUs")
"""Columns of `join_rows`."""


def join_of(run: RunRecord) -> Mapping | None:
  """The run's join record (report.json run_folder.join), None for a run that is not a join."""
  rec = run.run_folder.join
  return rec if isinstance(rec, Mapping) and isinstance(rec.get("folders"), list) else None


def _short(h: Any) -> str:
  return f"{h[:12]}.." if isinstance(h, str) else "n/a"


def _backend_note(rec: dict) -> str:
  """A sentence when the sides ran on different kinds of device and no folder reran its accelerator side on its host
  CPU (report.json 'backend'): the pair is then held to the fp32 table as measured on one CPU."""
  kinds = {str((m or {}).get("backend") or "") for m in (rec.get("sides") or {}).values()}
  return (" The sides ran on different kinds of device; a pair of them is held to the fp32 table plus each "
          "accelerator side's shift only where that side's folder reran it on its host CPU (backend/, the report's "
          "'backend' section)." if len(kinds - {"", "n/a"}) > 1 else "")


def join_intro(run: RunRecord) -> str:
  """One paragraph: which folders were joined (path, run id, request.json and report.json sha256), the inputs they
  share (sha256), and that the first folder's first side is the reference; '' for a run that is not a join."""
  rec = join_of(run)
  if rec is None:
    return ""
  folders = "; ".join(f"{f.get('label')}: {f.get('path')} (run id {f.get('run_id')}, sides "
                      f"{', '.join(f.get('sides') or [])}, request.json sha256 {_short(f.get('request_sha256'))}, "
                      f"report.json sha256 {_short(f.get('report_sha256'))}, its own verdict: {f.get('verdict')})"
                      for f in rec["folders"])
  inputs = ", ".join(f"{n} {_short(h)}" for n, h in (rec.get("inputs") or {}).items())
  return (f"This folder joins {len(rec['folders'])} runs of one request, each made on its own machine (parity "
          f"join): {folders}. They share their inputs (sha256): {inputs or 'n/a'}. Each side's files are its own "
          f"folder's; every check is computed here as in one run, the first side being the reference."
          + _backend_note(rec))


def join_rows(run: RunRecord) -> list[list[str]]:
  """One row per side (JOIN_HEADERS): the folder it came from, that run's id, the host it ran on, its device and
  backend, the host's OS, CPU and GPUs; [] for a run that is not a join."""
  rec = join_of(run)
  if rec is None:
    return []
  run_ids = {f.get("label"): f.get("run_id") for f in rec["folders"]}
  rows = []
  for side, m in (rec.get("sides") or {}).items():
    m = m or {}
    where = " / ".join(str(x) for x in (m.get("platform"), m.get("cpu_model"), ", ".join(m.get("gpus") or []))
                       if x) or "n/a"
    rows.append([side, str(m.get("folder")), str(run_ids.get(m.get("folder")) or "n/a"),
                 str(m.get("hostname") or "n/a"), f"{m.get('device') or 'n/a'} ({m.get('backend') or 'n/a'})", where])
  return rows


def join_card(run: RunRecord) -> dict | None:
  """card.json 'join': {folders [{label, path, run_id, request_sha256}], sides {side: {folder, host, device,
  backend}}, inputs {file: sha256}}; None for a run that is not a join."""
  rec = join_of(run)
  if rec is None:
    return None
  return {"folders": [{k: f.get(k) for k in ("label", "path", "run_id", "request_sha256")} for f in rec["folders"]],
          "sides": {s: {"folder": m.get("folder"), "host": m.get("hostname"), "device": m.get("device"),
                        "backend": m.get("backend")} for s, m in (rec.get("sides") or {}).items()},
          "inputs": dict(rec.get("inputs") or {})}


def join_lines(run: RunRecord) -> list[str]:
  """Terminal lines: one per joined folder, then one per side with where it ran; [] for a run that is not a join."""
  rec = join_of(run)
  if rec is None:
    return []
  out = [f"joined {f.get('label')}: {f.get('path')} (run {f.get('run_id')}, request.json sha256 "
         f"{_short(f.get('request_sha256'))})" for f in rec["folders"]]
  out += [f"  {r[0]} from {r[1]}: {r[3]}, {r[4]}" for r in join_rows(run)]
  return out
