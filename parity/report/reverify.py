"""Re-verifying a finished run from its own records: every check of report.json recomputed, by the functions
`parity compare` used, from the files the sides and their reruns left, and compared with what report.json states.

What is read (nothing is run):
  request.json, init.safetensors          the spec the sides ran and the initial weights
  <side>/semantics.json                   each side's semantics card (the 'semantics' checks and the card table)
  <side>/placement.json                   a JAX side's compiled placement (the 'placement' check and section)
  <side>/summary.json, steps.jsonl,       each side's status, records, final params and moments
    final.safetensors, final_moments.safetensors   (parity.protocol.outputs.side_outputs: a side whose files are not
                                          whole is downgraded exactly as `parity compare` did)
  noise/<side>/...                        the reduction-order reruns, when report.json has a noise_envelope section
  repeat/<side>/, resume/<side>/          the determinism and resume reruns, when it has those sections
  equivalence/<kind>/<side>/              the --equivalence reruns, for the kinds and sides its section names
and what is recomputed: parity.verdict.sides.compare_sides, parity.verdict.reruns.envelope_result (then
parity.verdict.gating.mark_envelope_decided), determinism_outcome and resume_outcome, and parity.verdict.sides.verdict.
The tolerances are the ones in force (parity.verdict.tolerances); a report stored with another table is named.
What the report renders beside the checks is compared with its source too: the data card (request.json 'data'),
each side's summary (<side>/summary.json), the perturbations table (parity.report.build.perturbations_ran over
those summaries), the memory table (parity.sizing.measured.predicted_vs_measured over them) and the placement section
(<side>/placement.json and the summaries' transfers, parity.report.placement_view.placement_section).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from parity import weights
from parity.fields import from_dict
from parity.inputs import ascii_number
from parity.protocol.layout import FINAL_MOMENTS, read_moments
from parity.protocol.outputs import placement_entry, side_outputs
from parity.protocol.semantics import SEMANTICS_FILE, read_card
from parity.report.build import params_table_json, perturbations_ran, semantics_section, series_json, verdict_json
from parity.report.placement_view import placement_section, records_placement
from parity.report.reverify_reruns import Unverifiable, rerun_checks, side_run
from parity.report.run_record import RunRecord
from parity.sizing.measured import predicted_vs_measured
from parity.report.runconfig import run_as_compared
from parity.spec import RunSpec, SpecError, config_hash, to_dict
from parity.verdict.check import Check
from parity.verdict.reruns import RerunContext
from parity.verdict.sides import compare_sides, verdict
from parity.verdict.tolerances import TOLERANCES

__all__ = ["Unverifiable", "Recomputed", "recompute", "differences", "check_from_json"]

_COMPARED = ("name", "metric", "sides", "value", "tolerance", "passed", "first_failing_step", "worst", "gating",
             "detail")
"""The fields of a stored check compared with its recomputed twin (its 'reason' is the tolerance table's text)."""
_MAX_LINES = 6


@dataclasses.dataclass
class Recomputed:
  """What report.json should state, recomputed from the run's records (JSON forms, as build_report stores them)."""
  checks: list[dict]
  params_table: list[dict]
  verdict: dict
  statuses: dict[str, str]
  series: dict[str, dict]
  sections: dict[str, Any]
  tolerances: dict
  rendered: dict[str, Any]
  """report.json key -> its recomputed value, for what is rendered beside the checks: 'data' (the data card),
  'summaries' ({side: summary}), 'perturbations', 'memory' (its predicted_vs_measured rows), 'semantics' (the cards
  and their table), 'placement' (parity.report.placement_view.placement_section)."""


def check_from_json(d: dict):
  """A parity.verdict.check.Check back from its to_json form (non-finite value/tolerance were stored as None or
  text)."""
  fields = {f.name for f in dataclasses.fields(Check)}
  kw = {k: v for k, v in d.items() if k in fields}
  for k in ("value", "tolerance"):
    v = kw.get(k)
    kw[k] = float("nan") if v is None else ascii_number(v, float) if isinstance(v, str) else v
  kw["sides"] = tuple(kw.get("sides") or ("?", "?"))
  return Check(**kw)


def _json(x: Any) -> Any:
  return json.loads(json.dumps(x, default=str))


def _same(a: Any, b: Any) -> bool:
  """a == b as JSON text (a NaN equals a NaN; mapping order aside)."""
  return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _spec(rd: Path, stored: RunRecord) -> tuple[RunSpec, dict]:
  """(the RunSpec the sides ran, request.json as read), the spec checked against report.json's run and config_hash."""
  try:
    req = json.loads((rd / "request.json").read_text())
    spec = from_dict(RunSpec, req["run"])
  except (OSError, ValueError, KeyError, TypeError, SpecError) as exc:
    raise Unverifiable(f"request.json cannot be read as the run's request ({type(exc).__name__}: {exc})") from None
  same_run = run_as_compared(stored.stored("run")) == run_as_compared(_json(to_dict(spec)))  # newer keys: defaults
  if stored.config_hash != config_hash(spec) or not same_run:
    raise Unverifiable(f"report.json's 'run' / 'config_hash' ({stored.config_hash!r}) are not the request.json the "
                       f"sides ran ({config_hash(spec)!r})")
  if list(stored.sides) != list(spec.sides):
    raise Unverifiable(f"report.json's sides {list(stored.sides)} are not the sides the run had {list(spec.sides)}")
  return spec, req


def _collect(rd: Path, stored: RunRecord, spec, run_id: str | None) -> tuple[dict, dict]:
  """({side: {status, steps, final, moments}} as parity.pipeline.collect.collect_sides gives, {side: SideRun})."""
  data, runs = {}, {}
  for side in spec.sides:
    sr = side_run(rd / side, side, stored.sides[side])
    steps, final = side_outputs(rd / side, sr, run_id, expected_steps=spec.train.steps)
    data[side] = {"status": sr.status, "steps": steps, "final": final,
                  "moments": read_moments(rd / side / FINAL_MOMENTS) if final else None,
                  "semantics": read_card(rd / side / SEMANTICS_FILE, run_id),
                  "placement": placement_entry(rd / side, side, sr.summary, run_id),
                  "device": (sr.summary or {}).get("device")}
    runs[side] = sr
  return data, runs


def recompute(report) -> Recomputed:
  """Every check, the params table, the verdict and the rerun sections of a loaded report, recomputed from the
  run folder's records (see the module docstring; nothing is run).

  Args:
    report: parity.report.build.Report as parity.report.read.load_report returns it.
  Returns:
    Recomputed, in report.json's JSON forms.
  Raises:
    Unverifiable: a record the checks rest on is missing or unreadable, or report.json's run is not the run's
      request (the message names the file or key).
  """
  d, rd = report.record, Path(report.run_dir)
  spec, request = _spec(rd, d)
  try:
    init = weights.load(rd / "init.safetensors")
  except Exception as exc:  # missing, truncated, foreign
    raise Unverifiable(f"init.safetensors cannot be read ({type(exc).__name__}: {exc})") from None
  run_id = d.run_folder.run_id
  data, runs = _collect(rd, d, spec, run_id)
  checks, table = compare_sides(data, spec=spec, init=init)
  ctx = RerunContext(rd, spec, run_id, 0.0, init, data)
  interrupted = d.verdict.interrupted
  reruns, sections = rerun_checks(ctx, d, checks, interrupted)
  stopped = [check_from_json(c.json) for c in d.checks if c.metric == "reruns" and c.passed is False
             and c.gating is True]  # the reruns stopped (a file not written): a failure, as stored
  every = checks + reruns + stopped
  v = verdict_json(verdict(every, {s: sr.status for s, sr in runs.items()}), interrupted)
  series = {s: _json(series_json(x["steps"])) for s, x in data.items()}
  return Recomputed(checks=_json([c.to_json() for c in every]), params_table=_json(params_table_json(table)),
                    verdict=_json(v),
                    statuses={s: sr.status for s, sr in runs.items()},
                    series=series, rendered=_rendered(rd, request, d, runs, series, run_id),
                    sections={k: _json(v) for k, v in sections.items()},
                    tolerances={spec.train.precision: {m: {"atol": t.atol, "rtol": t.rtol} for m, t in
                                                       TOLERANCES[spec.train.precision].items()}})


def _rendered(rd: Path, request: dict, d: RunRecord, runs: dict, series: dict, run_id: str | None = None
              ) -> dict[str, Any]:
  """Recomputation.rendered: the data card from request.json (`request`, as _spec read it), the summaries from the
  sides' summary.json (a side without one keeps what report.json stores: _side_run), the perturbations and memory
  tables over them, the semantics cards and table from the sides' semantics.json (build.semantics_section), and the
  placement section from the sides' placement.json and summaries (parity.report.placement_view.placement_section)."""
  card = request.get("data")
  sides = {s: {**(d.sides[s].json if s in d.sides else {}), "summary": _json(sr.summary), "series": series[s]}
           for s, sr in runs.items()}
  memory = predicted_vs_measured({**d.json, "sides": sides})  # the report as stored, its sides as recorded
  return {"data": _json(card), "summaries": {s: x["summary"] for s, x in sides.items()},
          "perturbations": _json(perturbations_ran(rd, sides)), "memory": _json(memory),
          "semantics": _json(semantics_section(rd, list(runs), run_id)),
          "placement": _json(placement_section(rd, sides))}


def _rendered_lines(d: RunRecord, rec: Recomputed) -> list[str]:
  """One line per rendered part of report.json (data card, side summaries, perturbations, memory table) that is not
  what the run's files give."""
  r, out = rec.rendered, []
  if not _same(d.stored("data"), r["data"]):
    out.append("its data card ('data') is not request.json's")
  for side, summ in r["summaries"].items():
    if not _same(d.sides[side].json.get("summary") if side in d.sides else None, summ):
      out.append(f"sides.{side}.summary is not {side}/summary.json")
  if not _same(d.stored("perturbations") or [], r["perturbations"]):
    out.append("its perturbations table is not what request.json and the sides' summaries give")
  if not _same(d.memory.get("predicted_vs_measured"), r["memory"]):
    out.append("its memory table is not what the sides' summaries give")
  if not _same(d.stored("semantics"), r["semantics"]):
    out.append("its semantics cards ('semantics') are not the sides' semantics.json")
  return out + _placement_lines(d, r["placement"])


def _placement_lines(d: RunRecord, again: dict) -> list[str]:
  """The line for report.json 'placement' when it is not what the sides' placement.json and summary.json give; a
  report without the section (written before it existed) is named only when the run's files record a placement."""
  if "placement" not in d.present:
    recorded = [s for s, e in again["sides"].items() if records_placement(e)]
    return [f"it has no placement section, but {', '.join(recorded)} recorded one"] if recorded else []
  if not _same(d.placement, again):
    return ["its placement section ('placement') is not the sides' placement.json / summary.json transfers"]
  return []


def _check_lines(stored: list, again: list[dict]) -> list[str]:
  """One line per stored check that is not its recomputed twin (same position), or per check only one side has."""
  names = [c.get("name") if isinstance(c, dict) else None for c in stored]
  if names != [c["name"] for c in again]:
    extra = [n for n in names if n not in {c["name"] for c in again}]
    lost = [c["name"] for c in again if c["name"] not in names]
    return [f"its checks are not the ones the run's records give (stored only: {extra or 'none'}; "
            f"recomputed only: {lost or 'none'}; stored {len(names)}, recomputed {len(again)})"]
  out = []
  for i, (s, r) in enumerate(zip(stored, again)):
    bad = [k for k in _COMPARED if not _same(s.get(k, True if k == "gating" else None), r.get(k))]
    parts = [f"{k} stored {s.get(k)!r}, recomputed {r.get(k)!r}" for k in bad if k != "detail"]
    if "detail" in bad:
      parts.append("its detail differs" if parts else f"detail stored {s.get('detail')!r}, recomputed {r['detail']!r}")
    if parts:
      out.append(f"checks[{i}] ({r['name']}): {'; '.join(parts)}")
  return out


def _noise_section(sec: Any) -> Any:
  """The noise_envelope section without the harness's wall-clock seconds (not in the files)."""
  if not isinstance(sec, dict):
    return sec
  runs = {s: {k: v for k, v in (r or {}).items() if k != "wall_s"} for s, r in (sec.get("runs") or {}).items()}
  return {**sec, "runs": runs}


def differences(d: RunRecord, rec: Recomputed) -> list[str]:
  """What report.json (the RunRecord `d`) states that its recomputation `rec` does not: stored checks (values,
  tolerances, pass and gating flags, steps, details), the verdict, the params table, each side's status and series,
  the rerun sections and the tolerance table; at most a few lines, the rest counted. [] when everything agrees."""
  out = _check_lines([c.json for c in d.checks], rec.checks)
  sv = d.verdict.json
  if not all(_same(sv.get(k), rec.verdict.get(k)) for k in ("passed", "message", "first_failure")):
    out.insert(0, f"the stored verdict says {'PASS' if sv.get('passed') else 'FAIL'} ({sv.get('message')!r}) but "
                  f"the run's records give {rec.verdict['message']!r}")
  if not _same(d.params_table, rec.params_table):
    rows = d.params_table if isinstance(d.params_table, list) else []
    first = next((i for i, (a, b) in enumerate(zip(rows, rec.params_table)) if not _same(a, b)), min(len(rows),
                                                                                          len(rec.params_table)))
    out.append(f"params_table differs from the recomputed one from row {first} on ({len(rows)} stored rows, "
               f"{len(rec.params_table)} recomputed)")
  for side, st in rec.statuses.items():
    stored = d.sides.get(side)
    status, series = (stored.status, stored.series) if stored is not None else (None, None)
    if status != st:
      out.append(f"sides.{side}.status is stored {status!r}, its records give {st!r}")
    if not _same(series, rec.series[side]):
      keys = [k for k in rec.series[side] if not _same((series or {}).get(k), rec.series[side][k])]
      out.append(f"sides.{side}.series ({', '.join(keys) or 'keys'}) is not {side}/steps.jsonl")
  if not _same(_noise_section(d.noise_envelope), _noise_section(rec.sections["noise_envelope"])):
    out.append("the noise_envelope section is not what noise/ gives")
  if not _same(d.backend, rec.sections["backend"]):
    out.append("the backend section is not what backend/ gives")
  for name in ("determinism", "resume", "equivalence"):
    if not _same(d.stored(name) or {}, rec.sections[name]):
      out.append(f"the {name} section is not what the rerun folders give")
  out += _rendered_lines(d, rec)
  stored_tol = {p: {m: {k: t.get(k) for k in ("atol", "rtol")} for m, t in tab.items() if isinstance(t, dict)}
                for p, tab in d.tolerances.items() if isinstance(tab, dict)}
  if not _same(stored_tol, rec.tolerances):
    out.append("its tolerance table is not the one in force (it was written by another parity version, or edited)")
  return out if len(out) <= _MAX_LINES else out[:_MAX_LINES] + [f"and {len(out) - _MAX_LINES} more differences"]
