"""`parity join A B [--out DIR]`: one verdict and one report over folders of one request whose sides ran on
different machines (docs/join.md).

The folders are read and verified first (parity.pipeline.join_sources: each as its run left it, all the same request,
no side twice, the same reruns); nothing is written before they pass. Then the joined folder is claimed as a run
folder is (parity.pipeline.claim: new or empty, --force moves an earlier run aside) and filled:

  request.json, config.json   the request with every side (the first folder's sides first: its first side is the
                              reference), each side's perturbations from its own folder, run_id null (each side's files
                              keep their own run's id; the join checked each against its folder) and 'join': the
                              record of what was joined (`join_record`: folders, run ids, hashes, each side's machine)
  inputs                      init.safetensors, batches.npy, ... of the first folder (the others hold the same bytes),
                              hard links where the file system allows, copies otherwise; a DeepSpeed side's
                              deepspeed_config.resolved.json and migration.json/.md from its folder
  <side>/, <rerun>/<side>/    each side's folder and its rerun folders (noise/, repeat/, resume/, backend/) from the
                              folder that ran it, linked or copied as they are
  environment.json            each side's machine (host, device, backend) and each framework's probe from the folder
                              that ran it; sources/<label>/ keeps each folder's request, report, card and environment
and the verdict is the one every run's verification computes from its folder (parity.report.reverify.recompute:
collect, compare_sides, the noise-envelope and other reruns' checks from their folders, the verdict), so every check
of a one-machine run applies to the joined pair unchanged; build_report and write_all write the report.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

from harness.runner import SideRun
from parity.inputs import InputError
from parity.pipeline.claim import RunFolderError, RunIOError, claim_run_dir
from parity.pipeline.folder import DS_RESOLVED, ENVIRONMENT_FILE, default_run_dir, write_new
from parity.pipeline.join_sources import (JOINED_FILES, Source, check_reruns, check_same_request, check_sides,
                                          read_source)
from parity.pipeline.request_source import sha256_of
from parity.protocol.layout import read_steps
from parity.report import Report, build_report, write_all
from parity.report.reverify import Unverifiable, check_from_json, recompute
from parity.report.side_table import backend
from parity.sides import reads_plan, side_record
from parity.spec import RunSpec, config_hash, to_dict
from parity.verdict.sides import verdict

__all__ = ["join_runs", "join_record", "joined_spec", "RERUN_SECTIONS", "SOURCE_FILES"]

RERUN_SECTIONS = ("noise_envelope", "determinism", "resume", "equivalence", "backend")
"""report.json's rerun sections: each folder's, merged per side, tell the verification which reruns to recompute."""
SOURCE_FILES = ("request.json", "report.json", "card.json", ENVIRONMENT_FILE)
"""Each joined folder's own records, kept in <joined>/sources/<label>/."""


def join_runs(paths: Sequence[str | Path], *, out: str | Path | None = None, force: bool = False,
              command: str | None = None) -> Report:
  """Joins finished run folders of one request into one verdict and report (the module docstring).

  Args:
    paths: two or more `parity compare` folders, in the order their sides go (the first folder's first side is the
      reference of every pair).
    out: the joined folder, new or empty (default runs/<time>-join-<hash>); force: move an earlier run there aside.
    command: the command line recorded in the lock and report.
  Returns:
    The Report (written to `out`): exit_code 0 PASS, 1 FAIL or a side that did not finish.
  Raises:
    InputError, RunFolderError (exit 2): a folder that cannot be joined (join_sources names the file, both folders
      and the fix), or an --out that is one of them; RunIOError (exit 1): a file of the joined folder not written.
  """
  t0 = time.time()
  if len(paths) < 2:
    raise InputError(f"parity join needs two or more run folders, got {len(paths)}: the folders of one request whose "
                     "sides ran on different machines")
  sources = [read_source(p, _label(i)) for i, p in enumerate(paths)]
  check_sides(sources)
  for src in sources[1:]:
    check_same_request(sources[0], src)
  check_reruns(sources)
  spec = joined_spec(sources)
  folder = Path(out) if out is not None else default_run_dir(spec, "join")
  _check_out(folder, sources)
  claim = claim_run_dir(folder, force=force, command=command)
  try:
    record = join_record(sources)
    try:
      _fill(folder, sources, spec, record)
    except OSError as exc:
      raise RunIOError(exc.errno, f"cannot write the joined folder {folder} ({exc}); it holds what was written so "
                                  "far (rerun with --force to move it aside)") from None
    report = _report(folder, sources, spec, record, claim, command, t0)
    write_all(report)
  finally:
    claim.release()
  return report


def _label(i: int) -> str:
  return chr(ord("A") + i) if i < 26 else f"F{i + 1}"


def joined_spec(sources: Sequence[Source]) -> RunSpec:
  """The first folder's spec with every folder's sides, in order (the first folder's first side is the reference)."""
  sides = tuple(s for src in sources for s in src.sides)
  return dataclasses.replace(sources[0].spec, sides=sides).validate()


def _check_out(folder: Path, sources: Sequence[Source]) -> None:
  """Refuses (RunFolderError) an --out that is one of the folders, or holds one (--force would move it aside)."""
  here = folder.absolute().resolve()
  for src in sources:
    there = src.path.resolve()
    if here == there or there.is_relative_to(here):
      raise RunFolderError(f"--out {folder} {'is' if here == there else 'holds'} {src.name}: the joined folder must "
                           "be a new one, apart from the folders it joins (--force would move them aside); choose "
                           "another --out")


def _machine(src: Source, side: str) -> dict[str, Any]:
  """Where `side` of `src` ran: the folder, host, OS, CPU, GPUs (its environment.json, else report.json's
  environment), the device its summary names and that device's backend (parity.report.side_table.backend)."""
  env = src.environment or {}
  host = env.get("host") if isinstance(env.get("host"), dict) else {}
  rep_env, entry = src.record.environment, src.record.sides[side]
  gpus = env.get("gpus") if isinstance(env.get("gpus"), list) else []
  return {"folder": src.label, "hostname": host.get("hostname") or rep_env.hostname,
          "platform": host.get("os") or rep_env.platform,
          "cpu_model": host.get("cpu_model") or rep_env.cpu_model,
          "gpus": [g.get("name") for g in gpus if isinstance(g, dict) and g.get("name")],
          "device": entry.summary.get("device"), "backend": backend(entry)}


def join_record(sources: Sequence[Source]) -> dict[str, Any]:
  """What a joined folder records of its making (request.json 'join', report.json run_folder.join): each folder
  {label, path, run_id, sides, command, verdict, request_sha256, report_sha256}, each side's machine (`_machine`) and
  the sha256 of the inputs every folder shares."""
  folders = [{"label": s.label, "path": str(s.path), "run_id": s.record.run_folder.run_id,
              "sides": list(s.sides), "command": s.record.run_folder.command,
              "verdict": s.record.verdict.message, "request_sha256": s.recorded("request.json"),
              "report_sha256": sha256_of(s.path / "report.json")} for s in sources]
  sides = {side: _machine(s, side) for s in sources for side in s.sides}
  inputs = {n: sources[0].recorded(n) for n in JOINED_FILES if sources[0].recorded(n)}
  return {"folders": folders, "sides": sides, "inputs": inputs}


# ----------------------------------------------------------------------------- the joined folder's files
def _link_or_copy(src: str | Path, dst: str | Path) -> None:
  """A hard link of `src` at `dst` (a new name), or a copy where the file system refuses links; a symbolic link is
  followed either way, so the joined folder holds files, never links into a source folder (a copy of it, or a
  source moved or removed, would leave the link dangling and the folder unverifiable). The side folders are copied
  with copytree(symlinks=False) for the same reason."""
  target = os.path.realpath(src)  # os.link's follow_symlinks is not honoured on Linux (link(2) never follows)
  try:
    os.link(target, dst)
  except OSError:
    shutil.copy2(target, dst)


def _fill(folder: Path, sources: Sequence[Source], spec: RunSpec, record: dict) -> None:
  """Writes every file of the joined folder but the report (the module docstring). Raises OSError."""
  first = sources[0]
  ds_src = next((s for s in sources if reads_plan(s.sides, "deepspeed")), first)  # the DeepSpeed config's side
  for name in JOINED_FILES:
    if (first.path / name).is_file():
      _link_or_copy(first.path / name, folder / name)
  for name in (DS_RESOLVED, "migration.json", "migration.md"):
    src = next((s for s in (ds_src, *sources) if (s.path / name).is_file()), None)
    if src is not None:
      _link_or_copy(src.path / name, folder / name)
  _launch(folder, sources)
  for src in sources:
    _copy_sides(src, folder)
    keep = folder / "sources" / src.label
    keep.mkdir(parents=True)
    for name in SOURCE_FILES:
      if (src.path / name).is_file():
        shutil.copy2(src.path / name, keep / name)
  write_new(folder / "config.json", json.dumps(to_dict(spec), indent=2))
  write_new(folder / ENVIRONMENT_FILE, json.dumps(_environment(sources, record), indent=1, default=str) + "\n")
  write_new(folder / "request.json", json.dumps(_request(sources, spec, record), indent=2))  # last, as a run's


def _launch(folder: Path, sources: Sequence[Source]) -> None:
  """launch.json (ranks per side, nodes) when every folder was launched alike; none when they differ (a side's ranks
  are in its own summary.json, and the report names them per side)."""
  texts = {(s.path / "launch.json").read_text() if (s.path / "launch.json").is_file() else None for s in sources}
  if len(texts) == 1 and (sources[0].path / "launch.json").is_file():
    _link_or_copy(sources[0].path / "launch.json", folder / "launch.json")


def _copy_sides(src: Source, folder: Path) -> None:
  """The folder's side folders, and each rerun folder's (<rerun>/<side>/) with the rerun's own top-level files
  (its derived request) from the first folder that has them."""
  for side in src.sides:
    if (src.path / side).is_dir():
      shutil.copytree(src.path / side, folder / side, symlinks=False, copy_function=_link_or_copy)
  for sub in sorted(p for p in src.path.iterdir() if p.is_dir() and p.name not in src.sides and p.name != "sources"):
    mine = [s for s in src.sides if (sub / s).is_dir()]
    if not mine:
      continue
    (folder / sub.name).mkdir(exist_ok=True)
    for side in mine:
      shutil.copytree(sub / side, folder / sub.name / side, symlinks=False, copy_function=_link_or_copy)
    for f in sub.iterdir():
      if f.is_file() and not (folder / sub.name / f.name).exists():
        _link_or_copy(f, folder / sub.name / f.name)


def _request(sources: Sequence[Source], spec: RunSpec, record: dict) -> dict[str, Any]:
  """The joined request.json: the first folder's, with every side, each side's perturbations from its own folder,
  the DeepSpeed side's DeepSpeed config, run_id null and the join record."""
  first = sources[0]
  ds_src = next((s for s in sources if reads_plan(s.sides, "deepspeed")), first)  # the DeepSpeed config's side
  req = {k: v for k, v in first.request.items() if k != "request_from"}
  req.update(run_id=None, run=to_dict(spec), config_hash=config_hash(spec),
             perturb={side: kv for s in sources for side, kv in (s.request.get("perturb") or {}).items()
                      if side in s.sides},
             perturbations=[r for s in sources for r in (s.request.get("perturbations") or [])
                            if r.get("side") in s.sides],
             deepspeed_config=ds_src.request.get("deepspeed_config"),
             deepspeed_files=ds_src.request.get("deepspeed_files"), join=record)
  return req


def _environment(sources: Sequence[Source], record: dict) -> dict[str, Any]:
  """The joined environment.json: which folder each side came from and where it ran (join_record 'sides'), each
  folder's host in one line, and each framework's probe from the folder whose side uses it."""
  frameworks: dict[str, Any] = {}
  for src in sources:
    probes = (src.environment or {}).get("frameworks") or {}
    for side in src.sides:
      fw = side_record(side).framework  # the framework environment.json probes for it
      if fw in probes:
        frameworks.setdefault(fw, probes[fw])
  hosts = {}
  for src in sources:
    m = _machine(src, src.sides[0])
    hosts[src.label] = ", ".join(str(x) for x in (m["hostname"], m["platform"], m["cpu_model"], *m["gpus"]) if x)
  return {"schema": "parity.environment/1", "quick": True, "joined": {s.label: str(s.path) for s in sources},
          "hosts": hosts, "sides": record["sides"], "frameworks": frameworks, "run_id": None}


# ----------------------------------------------------------------------------- the verdict and the report
def _stub(sources: Sequence[Source], spec: RunSpec) -> dict[str, Any]:
  """What the verification (parity.report.reverify.recompute) reads of a report besides the folder: the joined run,
  each side's stored entry, each folder's rerun sections merged per side (which reruns to recompute, their wall
  seconds) and any failing 'reruns' check of a folder whose reruns stopped (a failure, carried as the folder has it)."""
  stopped = [c.json for s in sources for c in s.record.checks
             if c.metric == "reruns" and c.passed is False and c.gating is True]
  sections = {}
  for name in RERUN_SECTIONS:
    merged = None
    for s in sources:
      merged = _union(merged, s.record.stored(name))
    sections[name] = merged if merged is not None or name in ("noise_envelope", "backend") else {}
  return {"config_hash": config_hash(spec), "run": json.loads(json.dumps(to_dict(spec))),
          "sides": {side: s.record.sides[side].json for s in sources for side in s.sides},
          "verdict": {"message": ""}, "run_folder": {"run_id": None}, "checks": stopped, **sections}


def _union(a: Any, b: Any) -> Any:
  """Two report sections merged: mappings key by key (a side's entry from the folder that has it), else the first."""
  if a is None:
    return b
  if isinstance(a, dict) and isinstance(b, dict):
    return {k: _union(a.get(k), b.get(k)) for k in {**a, **b}}
  return a


def _report(folder: Path, sources: Sequence[Source], spec: RunSpec, record: dict, claim, command: str | None,
            t0: float) -> Report:
  """The joined report: the verification's recomputation of the joined folder (every check, the reruns' checks and
  sections, each side's status and summary), assembled by build_report."""
  try:
    rec = recompute(Report(data=_stub(sources, spec), run_dir=folder))
  except Unverifiable as exc:
    raise InputError(f"the joined folder {folder} cannot be judged from its files: {exc}") from None
  checks = [check_from_json(c) for c in rec.checks]
  stored = {side: s.record.sides[side] for s in sources for side in s.sides}
  side_runs = {side: SideRun(side=side, status=rec.statuses[side], returncode=e.returncode,
                             wall_s=float(e.wall_s or 0.0), peak_rss_bytes=e.harness_peak_rss_bytes,
                             summary=rec.rendered["summaries"][side],
                             error=(rec.rendered["summaries"][side] or {}).get("error") or e.error)
               for side, e in stored.items()}
  timing = [s.record.timing for s in sources]
  first = sources[0].record
  return build_report(
      spec=spec, preset_name=first.preset or "joined", run_dir=folder, data_info=sources[0].request.get("data"),
      side_runs=side_runs, side_steps={side: read_steps(folder / side / "steps.jsonl") for side in stored},
      checks=checks, params_table=rec.params_table, verdict=verdict(checks, rec.statuses),
      wall_s=sum(float(t.get("wall_s") or 0.0) for t in timing) + time.time() - t0,
      prepare_s=sum(float(t.get("prepare_s") or 0.0) for t in timing), plan=first.stored("plan"), reruns=rec.sections,
      reruns_s=sum(float(t.get("self_runs_s") or 0.0) for t in timing),
      run_folder={"run_id": None, "moved_aside_to": str(claim.moved_to) if claim.moved_to else None,
                  "stale_lock_taken_over": claim.stale_lock, "command": command, "join": record},
      side_loads={side: e.load for side, e in stored.items()},
      checkpoint=first.checkpoint_path)
