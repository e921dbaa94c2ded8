"""The folders `parity join` joins: each read and verified as its run left it, then held against the first one for
being the same request (docs/join.md). Every refusal is an InputError (exit 2) naming the file, both folders and the
fix; nothing is written before all of them pass.

What is checked, in order:
  each folder   a finished `parity compare` run (report.json, not interrupted, not itself a join); its request.json
                and input files have the sha256 its report.json recorded (a file changed after the run is named); then
                the whole folder re-verifies (parity.report.read.verify_report: every artifact re-hashed, every check
                recomputed from its records).
  each pair     the same run: the resolved spec but `IGNORED_KEYS` (the side list, the per-side time limit and the data
                path, which name this machine), the same batches (batches.npy, val_batches.npy, the example arrays by
                sha256), the same initial weights (init.safetensors by sha256, or by its tensors: safetensors writes
                its metadata in no fixed order), the same data (request.json data.sha256), the same DeepSpeed config
                file when one was given; no side in two folders; the same reruns (noise envelope, determinism steps,
                resume step), since the joined verdict holds every pair to what each side's machine measured.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from parity.fields import from_dict
from parity.inputs import InputError, load_json
from parity.pipeline.request_source import DS_GIVEN, REQUEST_INPUTS, sha256_of
from parity.report.build import Report
from parity.report.finished import load_finished
from parity.report.page import read_environment
from parity.report.read import verify_report
from parity.report.run_record import RunRecord
from parity.report.runconfig import config_diff, flatten, run_as_compared, tensor_digest
from parity.spec import RunSpec, SpecError

__all__ = ["Source", "IGNORED_KEYS", "JOINED_FILES", "read_source", "check_same_request", "check_sides",
           "check_reruns"]

IGNORED_KEYS = ("sides", "timeout_s", "data")
"""Spec keys two folders of one request may differ in: which sides each ran, how long a side may run there, and where
the data lay on that machine (the data itself is compared by its sha256 and by the batches cut from it)."""
JOINED_FILES = (*REQUEST_INPUTS, DS_GIVEN)
"""The input files both folders must hold alike (those either holds)."""
_WHAT = {"batches.npy": "did not train on the same batches", "val_batches.npy": "did not validate on the same batches",
         "init.safetensors": "did not start from the same initial weights",
         DS_GIVEN: "were not given the same DeepSpeed config"}


@dataclasses.dataclass(frozen=True)
class Source:
  """One folder of a join, read and verified (`read_source`).

  Attributes: label ('A', 'B', ... in command-line order), path (absolute), report (its report.json), request (its
  request.json), spec (the RunSpec its sides ran), environment (its environment.json, None when absent).
  """
  label: str
  path: Path
  report: Report
  request: dict
  spec: RunSpec
  environment: dict | None

  @property
  def record(self) -> RunRecord:
    """Its report.json as a RunRecord (parity.report.run_record)."""
    return self.report.record

  @property
  def sides(self) -> tuple[str, ...]:
    return tuple(self.record.sides)

  @property
  def name(self) -> str:
    """'A (/abs/path)': how messages name the folder."""
    return f"{self.label} ({self.path})"

  def recorded(self, name: str) -> str | None:
    """The sha256 report.json recorded for the folder's file `name` (relative path), None when it records none."""
    rec = self.record.artifact(name)
    return rec.get("sha256") if isinstance(rec, dict) else None


def read_source(path: str | Path, label: str) -> Source:
  """Reads and verifies one folder (the module docstring's 'each folder'). Raises InputError naming what fails."""
  p = Path(path)
  report = load_finished(p)  # InputError: not a folder, no report.json, an unfinished or foreign run
  where = f"{label} ({p})"
  if report.record.verdict.interrupted:
    raise InputError(f"{where} is an interrupted run (its verdict: {report.record.verdict.message[:120]}); a join "
                     "takes finished runs: rerun it")
  request = load_json(p / "request.json", what="request")
  if not isinstance(request, dict) or not isinstance(request.get("run"), dict):
    raise InputError(f"{p / 'request.json'}: not a parity run request (no 'run' section)")
  if request.get("join") is not None:
    raise InputError(f"{where} is itself a joined folder; join the folders it was made of (its report names them)")
  _check_recorded_files(p, report, label)
  problems = verify_report(report)
  if problems:
    raise InputError(f"{where} cannot be joined: its report does not re-verify from its files: {problems[0]}")
  try:
    spec = from_dict(RunSpec, request["run"])
  except (SpecError, TypeError, ValueError) as exc:
    raise InputError(f"{p / 'request.json'}: its run cannot be read ({exc})") from None
  return Source(label=label, path=p.absolute(), report=report, request=request, spec=spec,
                environment=read_environment(p))


def _check_recorded_files(p: Path, report: Report, label: str) -> None:
  """Each of request.json and JOINED_FILES that the folder holds must have the sha256 its report.json recorded."""
  for name in ("request.json", *JOINED_FILES):
    f, rec = p / name, report.record.artifact(name)
    if not f.is_file():
      if isinstance(rec, dict):
        raise InputError(f"{label}: {f} is missing; its report.json records it (sha256 {str(rec.get('sha256'))[:12]}..)"
                         ": restore it, or rerun that folder")
      continue
    if not isinstance(rec, dict) or "sha256" not in rec:
      raise InputError(f"{label}: {f} is not recorded by {p / 'report.json'} (no sha256 for it): a join takes only "
                       "files a finished run recorded; rerun that folder")
    now = sha256_of(f)
    if now != rec["sha256"]:
      raise InputError(f"{label}: {f} changed after its run (report.json records sha256 {rec['sha256'][:12]}.., the "
                       f"file now has {now[:12]}..): the folder no longer holds what its sides ran; restore the file, "
                       "or rerun that folder")


def _run_keys(spec_map: dict[str, Any]) -> dict[str, Any]:
  """A request's 'run' as dotted keys, the fields added later at their defaults, less IGNORED_KEYS."""
  flat = flatten(run_as_compared(spec_map))
  return {k: v for k, v in flat.items() if k.split(".")[0] not in IGNORED_KEYS}


def check_same_request(first: Source, other: Source) -> None:
  """Refuses (InputError) `other` when it is not the run `first` is (the module docstring's 'each pair'): the spec, the
  input files and the data, each difference named with both folders and the fix (`--request`)."""
  fix = f"rerun {other.label} with `parity compare --request {first.path / 'request.json'} --sides ...`"
  diff = config_diff(_run_keys(first.request["run"]), _run_keys(other.request["run"]))
  if diff:
    shown = "; ".join(f"{k} {a!r} vs {b!r}" for k, (a, b) in list(diff.items())[:4])
    more = f" (and {len(diff) - 4} more)" if len(diff) > 4 else ""
    raise InputError(f"{other.path / 'request.json'} is not the run of {first.path / 'request.json'}: {shown}{more} "
                     f"({other.label} vs {first.label}); the two folders were not made from the same request: {fix}")
  for name in JOINED_FILES:
    a, b = first.recorded(name), other.recorded(name)
    if a == b or (name == "init.safetensors" and a and b and _same_tensors(first, other)):
      continue
    show = lambda h: f"{h[:12]}.." if h else "absent"
    raise InputError(f"{other.path / name} differs from {first.path / name} (sha256 {show(b)} vs {show(a)}): the two "
                     f"runs {_WHAT.get(name, 'did not lay out the same examples')}; {fix}")
  da, db = (s.request.get("data") or {} for s in (first, other))
  if da.get("sha256") != db.get("sha256"):
    raise InputError(f"{other.label}'s data {db.get('source')!r} (sha256 {str(db.get('sha256'))[:12]}..) is not "
                     f"{first.label}'s {da.get('source')!r} (sha256 {str(da.get('sha256'))[:12]}..) "
                     f"({other.path / 'request.json'} vs {first.path / 'request.json'}); {fix}")


def _same_tensors(first: Source, other: Source) -> bool:
  """Both init.safetensors hold the same tensors (parity.report.runconfig.tensor_digest: the metadata left out)."""
  a, b = (tensor_digest(s.path / "init.safetensors") for s in (first, other))
  return a is not None and a == b


def check_sides(sources: list[Source]) -> None:
  """Refuses (InputError) a side that two folders ran, naming it and both folders, and a folder given twice."""
  seen: dict[str, Source] = {}
  paths: dict[Path, Source] = {}
  for src in sources:
    real = src.path.resolve()
    if real in paths:
      raise InputError(f"{src.name} is the same folder as {paths[real].label}: give each folder once (the folders of "
                       "one request made on different machines)")
    paths[real] = src
    for side in src.sides:
      if side in seen:
        raise InputError(f"side {side!r} ran in both {seen[side].name} and {src.name}: a join takes each side from "
                         f"one folder; rerun one of them with --sides without {side}")
      seen[side] = src


def _reruns(src: Source) -> dict[str, Any]:
  """What reruns a folder made, as the flags that ask for them: noise envelope (on/off), --determinism-steps,
  --resume-at, --equivalence kinds."""
  rec = src.record
  det = {v.steps_checked for v in rec.determinism.values()}
  res = {v.resumed_at_step for v in rec.resume.values()}
  return {"--noise-envelope": rec.noise_envelope is not None, "--determinism-steps": sorted(det) or [0],
          "--resume-at": sorted(r - 1 for r in res if isinstance(r, int)) or None,
          "--equivalence": sorted(rec.equivalence)}


def check_reruns(sources: list[Source]) -> None:
  """Refuses (InputError) folders whose reruns differ (each named with its flag; a folder none of whose sides finished
  made none and is left out), and --equivalence reruns, which a join does not carry over."""
  for src in sources:
    kinds = _reruns(src)["--equivalence"]
    if kinds:
      raise InputError(f"{src.name} ran --equivalence {','.join(kinds)}: a join does not carry equivalence reruns "
                       "over; rerun it without --equivalence (and check equivalence in each folder on its own)")
  ran = [s for s in sources if any(e.status == "ok" for e in s.record.sides.values())]
  first = ran[0] if ran else None
  if first is not None and first.spec.train.precision != "fp32" and not _reruns(first)["--noise-envelope"]:
    raise InputError(f"{first.name} ran in {first.spec.train.precision} without the noise envelope: a "
                     f"{first.spec.train.precision} verdict rests on each side's reduction-order rerun, which a "
                     "one-side run makes only when asked (a run of two sides or more on one machine makes it by "
                     "default); rerun each half with --noise-envelope")
  for src in ran[1:]:  # a folder none of whose sides finished reran nothing (its verdict already fails the join)
    a, b = _reruns(first), _reruns(src)
    for flag in a:
      if a[flag] != b[flag]:
        raise InputError(f"{src.name} and {first.name} ran different reruns: {flag} {_said(b[flag])} vs "
                         f"{_said(a[flag])}; the joined verdict holds each pair to both sides' reruns: run both "
                         f"halves with the same {flag}")


def _said(v: Any) -> str:
  if isinstance(v, bool):
    return "on" if v else "off"
  if isinstance(v, list):
    return ",".join(map(str, v)) or "none"
  return "none" if v is None else str(v)
