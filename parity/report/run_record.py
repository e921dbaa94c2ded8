"""A finished run, read once, typed: `read_run(folder) -> RunRecord` (report.json checked section by section, then
parsed), `RunRecord.of(data)` for report.json data already in memory (a report just built). With its section records
(parity.report.run_sections), the one place that reads report.json's keys: the pages, the card, the terminal, the
verifier, the comparison page, the regression gate and `parity join` read a run through these records (a test counts
the raw reads left elsewhere: none).

The records are what report.json states (parity.report has its schema), never recomputed: a field the file lacks (an
edited or older report) is None, {} or () and renders as 'n/a'; `json` on a record is its section as stored, for the
verifier (parity.report.reverify), which compares what the file states with what the run's files give."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

from parity.inputs import InputError, load_json
from parity.protocol.layout import REPORT_FILE
from parity.sides import find_side
from parity.report.run_sections import (CheckRecord, DataRecord, EnvironmentRecord, FailureRecord, MigrationRecord,
                                        NotRunRecord, PlanChoice, RerunRecord, RunConfig, RunFolderRecord, SideRecord,
                                        VerdictRecord)
from parity.report.run_sections import as_mapping as _map

__all__ = ["REPORT_SCHEMA", "REPORT_KEYS", "read_run", "RunRecord", "CheckRecord", "SideRecord", "VerdictRecord",
           "FailureRecord",
           "RunConfig", "PlanChoice", "MigrationRecord", "EnvironmentRecord", "RunFolderRecord", "DataRecord",
           "RerunRecord", "NotRunRecord"]

REPORT_SCHEMA = "parity.report/3"
"""/3 (2026-12-02): report.json 'semantics' (each side's semantics card and the item table), the cards hashed as side
artifacts and re-verified; /2: the rerun folders, the example arrays and what is rendered beside the checks are
verified. An older report is refused naming the version (`read_run`), not re-verified as changed."""
REPORT_KEYS = ("schema", "created_utc", "run_dir", "preset", "checkpoint", "config_hash", "run", "data",
               "environment", "migration", "verdict", "tolerances", "checks", "params_table", "sides", "sides_not_run",
               "timing", "plan", "noise_envelope", "determinism", "resume", "equivalence", "backend", "memory",
               "run_folder", "semantics", "placement", "artifacts", "inputs", "deepspeed_files", "perturbations",
               "write_errors", "report_written_to")
"""Every top-level key report.json may hold (parity.report.build.build_report writes them; parity.report.write adds
write_errors and report_written_to)."""
_CHECK_KEYS = ("name", "value", "tolerance", "passed", "first_failing_step")


@dataclasses.dataclass(frozen=True)
class RunRecord:
  """What report.json states of a finished run, typed (the schema: parity.report). Sections kept as stored JSON
  (noise_envelope, backend, equivalence, semantics, placement, memory, perturbations, inputs, deepspeed_files,
  tolerances, params_table, artifacts, timing) are read by the view of the report that shows them; `json` is the whole
  file as stored and `present` the sections it holds."""
  schema: str | None
  created_utc: str | None
  run_dir: str | None
  preset: str | None
  checkpoint: Mapping | None
  config_hash: str | None
  run: RunConfig
  data: DataRecord
  environment: EnvironmentRecord
  migration: MigrationRecord | None
  verdict: VerdictRecord
  tolerances: Mapping
  checks: tuple[CheckRecord, ...]
  params_table: Any
  sides: Mapping[str, SideRecord]
  sides_not_run: Mapping[str, NotRunRecord]
  timing: Mapping
  plan: PlanChoice | None
  noise_envelope: Any
  determinism: Mapping[str, RerunRecord]
  resume: Mapping[str, RerunRecord]
  equivalence: Mapping
  backend: Any
  memory: Mapping
  run_folder: RunFolderRecord
  semantics: Any
  placement: Any
  artifacts: Mapping
  inputs: Mapping
  deepspeed_files: Mapping
  perturbations: tuple
  write_errors: tuple
  report_written_to: str | None
  present: frozenset
  json: Mapping

  @classmethod
  def of(cls, data: Mapping) -> "RunRecord":
    """The record of report.json data (as parsed; a section missing or of another type reads as empty); a RunRecord
    is returned as it is."""
    if isinstance(data, RunRecord):
      return data
    d = _map(data)
    sides = {str(n): SideRecord.of(str(n), s) for n, s in _map(d.get("sides")).items()}
    not_run = {str(n): NotRunRecord(reason=_map(w).get("reason"), named=_map(w).get("named"))
               for n, w in _map(d.get("sides_not_run")).items()}
    checks = d.get("checks") if isinstance(d.get("checks"), list) else []
    ckpt = d.get("checkpoint")
    return cls(
        schema=d.get("schema"), created_utc=d.get("created_utc"), run_dir=d.get("run_dir"), preset=d.get("preset"),
        checkpoint=ckpt if isinstance(ckpt, Mapping) else None, config_hash=d.get("config_hash"),
        run=RunConfig(_map(d.get("run"))), data=DataRecord.of(d.get("data")),
        environment=EnvironmentRecord.of(d.get("environment")), migration=MigrationRecord.of(d.get("migration")),
        verdict=VerdictRecord.of(d.get("verdict")), tolerances=_map(d.get("tolerances")),
        checks=tuple(CheckRecord.of(c) for c in checks), params_table=d.get("params_table"), sides=sides,
        sides_not_run=not_run, timing=_map(d.get("timing")), plan=PlanChoice.of(d.get("plan")),
        noise_envelope=d.get("noise_envelope"),
        determinism=_reruns(d.get("determinism")), resume=_reruns(d.get("resume")),
        equivalence=_map(d.get("equivalence")), backend=d.get("backend"), memory=_map(d.get("memory")),
        run_folder=RunFolderRecord.of(d.get("run_folder")), semantics=d.get("semantics"),
        placement=d.get("placement"), artifacts=_map(d.get("artifacts")), inputs=_map(d.get("inputs")),
        deepspeed_files=_map(d.get("deepspeed_files")), perturbations=tuple(d.get("perturbations") or ()),
        write_errors=tuple(e for e in d.get("write_errors") or () if isinstance(e, Mapping)),
        report_written_to=d.get("report_written_to"), present=frozenset(d), json=d)

  @property
  def precision(self) -> str | None:
    """The run's train.precision."""
    return self.run.precision

  @property
  def checkpoint_path(self) -> str | None:
    """The Hugging Face checkpoint folder (`--hf-model`) the run started from, None for seeded weights."""
    return (self.checkpoint or {}).get("path")

  @property
  def checkpoint_architecture(self) -> str | None:
    """That checkpoint's config.json architectures[0], None when unknown."""
    return (self.checkpoint or {}).get("architecture")

  @property
  def tolerance_table(self) -> Mapping:
    """The stored tolerance table of the run's precision ({metric: {atol, rtol, reason}}; {} when not stored)."""
    return _map(self.tolerances.get(self.precision))

  def side_plans(self) -> dict[str, Any]:
    """side -> the plan it ran (its record's plan section, parity.sides; RunConfig.plans), for the sides of the run
    that run one, in the run's order."""
    plans, records = self.run.plans, {s: find_side(s) for s in self.sides}
    return {s: plans[r.plan] for s, r in records.items() if r is not None and r.plan in plans}

  def check_named(self, name: Any) -> CheckRecord:
    """The stored check of that name (an empty record when there is none)."""
    return next((c for c in self.checks if c.name == name), CheckRecord.of({}))

  def side_status(self) -> dict[str, str]:
    """side -> its stored status."""
    return {n: s.status for n, s in self.sides.items()}

  @property
  def memory_rows(self) -> list:
    """The stored memory table (memory.predicted_vs_measured rows)."""
    return list(self.memory.get("predicted_vs_measured") or [])

  @property
  def memory_note(self) -> str | None:
    return self.memory.get("note")

  @property
  def semantics_cards(self) -> dict[str, Mapping]:
    """side -> its stored semantics card, for the sides that wrote one."""
    return {s: c for s, c in _map(_map(self.semantics).get("cards")).items() if c is not None}

  @property
  def semantics_rows(self) -> list:
    """The stored semantics item table ([{item, values {side: value}, agree}])."""
    return list(_map(self.semantics).get("rows") or [])

  def stored(self, key: str) -> Any:
    """Section `key` (one of REPORT_KEYS) exactly as report.json stores it, None when absent: what the verifier
    holds against what the run's files give (parity.report.reverify compares the two as JSON)."""
    if key not in REPORT_KEYS:
      raise KeyError(f"{key!r} is not a report.json section (REPORT_KEYS)")
    return self.json.get(key)

  def artifact(self, rel: str) -> Any:
    """What report.json records of a run file (relative path): {sha256, bytes}, or {error} for one that could not be
    read when the report was written; None when not recorded."""
    return self.artifacts.get(rel)


def _reruns(sec: Any) -> dict[str, RerunRecord]:
  return {str(s): RerunRecord.of(x) for s, x in _map(sec).items() if isinstance(x, Mapping)}


def _need(ok: bool, path: Path, what: str) -> None:
  if not ok:
    raise InputError(f"{path}: {what}; the file is incomplete or not written by `parity compare` "
                     "(rerun the comparison to get a fresh report)")


def _check_sections(data: Any, path: Path) -> None:
  """Refuses report.json data that lacks what every reader needs (verdict, sides, checks; each side's status,
  summary and series; determinism's shape), naming the key. Raises InputError."""
  v = data.get("verdict")
  _need(isinstance(v, dict) and isinstance(v.get("passed"), bool) and isinstance(v.get("message"), str), path,
        "section 'verdict' must hold 'passed' (true/false) and 'message' (text)")
  sides = data.get("sides")
  _need(isinstance(sides, dict), path, "section 'sides' is missing or not a mapping")
  for name, s in sides.items():
    _need(isinstance(s, dict) and isinstance(s.get("status"), str) and isinstance(s.get("summary"), dict),
          path, f"sides.{name} must hold 'status' (text) and 'summary' (mapping)")
    series = s.get("series")
    _need(isinstance(series, dict) and isinstance(series.get("loss"), list)
          and isinstance(series.get("val_loss"), list), path,
          f"sides.{name}.series must hold 'loss' and 'val_loss' (lists)")
  checks = data.get("checks")
  _need(isinstance(checks, list), path, "section 'checks' is missing or not a list")
  for i, ch in enumerate(checks):
    _need(isinstance(ch, dict) and all(k in ch for k in _CHECK_KEYS), path,
          f"checks[{i}] must hold {', '.join(_CHECK_KEYS)}")
  det = data.get("determinism")
  _need(det is None or (isinstance(det, dict) and all(isinstance(x, dict) and "deterministic" in x
                                                      for x in det.values())), path,
        "section 'determinism' must map each side to {deterministic, ...}")


def read_run(folder: str | Path) -> RunRecord:
  """The RunRecord of a finished run folder, its report.json checked section by section first.

  Args:
    folder: the folder `parity compare` wrote.
  Raises:
    InputError: no such folder or report.json (a `parity diagnose` folder named as such); not UTF-8 JSON; another
      report schema (named, with the version this one reads); a missing or mistyped section (verdict, sides,
      checks; each side's status, summary and series; determinism) named with the key.
  """
  run_dir = Path(folder)
  path = run_dir / REPORT_FILE
  if not run_dir.is_dir():
    raise InputError(f"{run_dir} is not a folder: pass the folder of a finished `parity compare` run")
  if not path.exists() and any((run_dir / n).exists() for n in ("diagnose.md", "diagnose.json")):
    raise InputError(f"{run_dir} holds a `parity diagnose` run, not a comparison: its result is in "
                     f"{run_dir / 'diagnose.md'} (and diagnose.json); `parity report` reads `parity compare` folders")
  if not path.exists():
    raise InputError(f"{path} does not exist: pass the folder of a finished `parity compare` run (it may have "
                     "been interrupted before the report was written)")
  try:
    data: Any = load_json(path, what="report")
  except InputError as exc:
    raise InputError(f"{exc} (the run may have been interrupted while writing it)") from None
  schema = data.get("schema") if isinstance(data, dict) else None
  if isinstance(schema, str) and schema.startswith("parity.report/") and schema != REPORT_SCHEMA:
    raise InputError(f"{path}: written by another parity version (report schema {schema!r}; this version reads "
                     f"{REPORT_SCHEMA!r}, whose report hashes and re-verifies more of the run's files); rerun "
                     "`parity compare` with this version for a report it can verify")
  _need(isinstance(data, dict) and schema == REPORT_SCHEMA, path,
        f"not a parity report (expected schema {REPORT_SCHEMA!r})")
  _check_sections(data, path)
  return RunRecord.of(data)
