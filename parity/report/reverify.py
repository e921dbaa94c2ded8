"""Re-verifying a finished run from its own records: every check of report.json recomputed, by the functions
`parity compare` used, from the files the sides and their reruns left, and compared with what report.json states.

What is read (nothing is run):
  request.json, init.safetensors          the spec the sides ran and the initial weights
  <side>/semantics.json                   each side's semantics card (the 'semantics' checks and the card table)
  <side>/placement.json                   a JAX side's compiled placement (the 'placement' check and section)
  <side>/summary.json, steps.jsonl,       each side's status, records, final params and moments
    final.safetensors, final_moments.safetensors   (parity.pipeline.collect.side_outputs: a side whose files are not
                                          whole is downgraded exactly as `parity compare` did)
  noise/<side>/...                        the reduction-order reruns, when report.json has a noise_envelope section
  repeat/<side>/, resume/<side>/          the determinism and resume reruns, when it has those sections
  equivalence/<kind>/<side>/              the --equivalence reruns, for the kinds and sides its section names
and what is recomputed: parity.verdict.sides.compare_sides, parity.pipeline.reruns.envelope_result (then
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
from parity.pipeline.collect import placement_entry, side_outputs
from parity.pipeline.equivalence import equivalence_from_folders
from parity.pipeline.reruns import (RerunContext, backend_result, determinism_outcome, determinism_section,
                                    envelope_result, resume_outcome, resume_section)
from parity.protocol.layout import FINAL_MOMENTS, read_moments, read_steps, read_summary
from parity.protocol.semantics import SEMANTICS_FILE, read_card
from parity.report.build import params_table_json, perturbations_ran, semantics_section, series_json, verdict_json
from parity.report.placement_view import placement_section
from parity.sizing.measured import predicted_vs_measured
from parity.report.runconfig import run_as_compared
from parity.spec import RunSpec, SpecError, config_hash, to_dict
from parity.verdict.check import Check
from parity.verdict.gating import mark_backend_decided, mark_envelope_decided
from parity.verdict.sides import compare_sides, verdict
from parity.verdict.tolerances import TOLERANCES

__all__ = ["Unverifiable", "Recomputed", "recompute", "differences", "check_from_json"]

_COMPARED = ("name", "metric", "sides", "value", "tolerance", "passed", "first_failing_step", "worst", "gating",
             "detail")
"""The fields of a stored check compared with its recomputed twin (its 'reason' is the tolerance table's text)."""
_MAX_LINES = 6


class Unverifiable(Exception):
  """The checks cannot be recomputed: a record they rest on is missing or unreadable (the message names it)."""


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
    kw[k] = float("nan") if v is None else float(v) if isinstance(v, str) else v
  kw["sides"] = tuple(kw.get("sides") or ("?", "?"))
  return Check(**kw)


def _json(x: Any) -> Any:
  return json.loads(json.dumps(x, default=str))


def _same(a: Any, b: Any) -> bool:
  """a == b as JSON text (a NaN equals a NaN; mapping order aside)."""
  return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _spec(rd: Path, d: dict) -> tuple[RunSpec, dict]:
  """(the RunSpec the sides ran, request.json as read), the spec checked against report.json's run and config_hash."""
  try:
    req = json.loads((rd / "request.json").read_text())
    spec = from_dict(RunSpec, req["run"])
  except (OSError, ValueError, KeyError, TypeError, SpecError) as exc:
    raise Unverifiable(f"request.json cannot be read as the run's request ({type(exc).__name__}: {exc})") from None
  same_run = run_as_compared(d.get("run")) == run_as_compared(_json(to_dict(spec)))  # keys newer specs added: defaults
  if d.get("config_hash") != config_hash(spec) or not same_run:
    raise Unverifiable(f"report.json's 'run' / 'config_hash' ({d.get('config_hash')!r}) are not the request.json the "
                       f"sides ran ({config_hash(spec)!r})")
  if list(d["sides"]) != list(spec.sides):
    raise Unverifiable(f"report.json's sides {list(d['sides'])} are not the sides the run had {list(spec.sides)}")
  return spec, req


def _side_run(out: Path, side: str, stored: dict | None = None):
  """harness.runner.SideRun of a finished worker from its summary.json (the harness writes the status it decided
  there). A side with no summary.json keeps its stored status only when it is not 'ok' (e.g. 'not_run': a side
  never started has no folder); such a status can only fail the verdict."""
  from harness.runner import SideRun  # harness: lazily (docs/architecture.md)
  summ = read_summary(out / "summary.json")
  if summ is None or not isinstance(summ, dict):
    if stored is None or stored.get("status") == "ok":
      raise Unverifiable(f"{out / 'summary.json'} is missing or not JSON")
    return SideRun(side=side, status=str(stored["status"]), returncode=None, wall_s=0.0, peak_rss_bytes=None,
                   summary=stored.get("summary") or {}, error=stored.get("error"))
  return SideRun(side=side, status=str(summ.get("status")), returncode=None, wall_s=0.0, peak_rss_bytes=None,
                 summary=summ, error=summ.get("error"))


def _collect(rd: Path, d: dict, spec, run_id: str | None) -> tuple[dict, dict]:
  """({side: {status, steps, final, moments}} as parity.pipeline.collect.collect_sides gives, {side: SideRun})."""
  data, runs = {}, {}
  for side in spec.sides:
    sr = _side_run(rd / side, side, d["sides"][side])
    steps, final = side_outputs(rd / side, sr, run_id, expected_steps=spec.train.steps)
    data[side] = {"status": sr.status, "steps": steps, "final": final,
                  "moments": read_moments(rd / side / FINAL_MOMENTS) if final else None,
                  "semantics": read_card(rd / side / SEMANTICS_FILE, run_id),
                  "placement": placement_entry(rd / side, side, sr.summary, run_id),
                  "device": (sr.summary or {}).get("device")}
    runs[side] = sr
  return data, runs


def _stored_section(ctx, d: dict, key: str, folder: str, what: str) -> tuple[Any, dict]:
  """(report.json's rerun section `key`, its 'runs' mapping or {}); (None, {}) without the section.

  Raises:
    Unverifiable: the section is missing although run_dir/<folder>/request.json shows `what` were started (and the
      run was not stopped before writing it).
  """
  sec = d.get(key)
  if sec is None:
    if (ctx.run_dir / folder / "request.json").exists() and not _stopped(d):
      raise Unverifiable(f"{folder}/request.json shows {what} were started, but report.json has no {key} section")
    return None, {}
  return sec, sec.get("runs") if isinstance(sec, dict) and isinstance(sec.get("runs"), dict) else {}


def _noise(ctx, d: dict, main_checks: list) -> tuple[list, Any]:
  """The noise-envelope checks and section from run_dir/noise/ (when report.json has the section), the main checks
  it decides marked reported only."""
  from harness.self_runs import NOISE_DIR  # harness: lazily
  sec, runs = _stored_section(ctx, d, "noise_envelope", NOISE_DIR, "the reduction-order reruns")
  if sec is None:
    return [], None
  outputs = {}
  for side in ctx.ok_sides:
    out = ctx.run_dir / NOISE_DIR / side
    sr = _side_run(out, side)
    sr.wall_s = (runs.get(side) or {}).get("wall_s", 0.0)  # the harness's clock: not in the files
    outputs[side] = (sr, *side_outputs(out, sr, ctx.run_id, expected_steps=ctx.spec.train.steps))
  res = envelope_result(ctx, outputs)
  mark_envelope_decided(main_checks, res.decides, ctx.spec.train.precision)
  return res.checks, res.section


def _backend(ctx, d: dict, main_checks: list) -> tuple[list, Any]:
  """The backend checks and section from run_dir/backend/ (when report.json has the section), the main checks they
  decide marked reported only."""
  from harness.self_runs import BACKEND_DIR  # harness: lazily
  sec, runs = _stored_section(ctx, d, "backend", BACKEND_DIR, "the host-CPU reruns")
  if sec is None:
    return [], None
  outputs = {}
  for side in runs:
    out = ctx.run_dir / BACKEND_DIR / side
    sr = _side_run(out, side)
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


def _stopped(d: dict) -> bool:
  """report.json holds a failing 'reruns' check: the reruns stopped (a file could not be written or read)."""
  return any(isinstance(c, dict) and c.get("metric") == "reruns" and c.get("passed") is False for c in d["checks"])


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


def _repeats(ctx, d: dict, interrupted: bool) -> tuple[list, dict, dict]:
  """The determinism and resume checks (and sections) from run_dir/repeat/ and resume/, for the prefix and
  checkpoint step report.json names; every finished side must have them unless the run was interrupted."""
  from harness.self_runs import REPEAT_DIR, RESUME_DIR  # harness: lazily
  det_sec = d.get("determinism") if isinstance(d.get("determinism"), dict) else {}
  res_sec = d.get("resume") if isinstance(d.get("resume"), dict) else {}
  prefix = _one_int({v.get("steps_checked") for v in det_sec.values() if isinstance(v, dict)},
                    "determinism steps_checked") or 0
  resumed_at = _one_int({v.get("resumed_at_step") for v in res_sec.values() if isinstance(v, dict)},
                        "resume resumed_at_step")
  resume_at = None if resumed_at is None else resumed_at - 1
  if not interrupted and not _stopped(d):
    _check_repeat_request(ctx.run_dir / REPEAT_DIR / "request.json", prefix, resume_at)
  sides = [s for s in ctx.ok_sides if not interrupted or s in det_sec or s in res_sec]
  dets, ress, dsec, rsec = [], [], {}, {}
  for side in sides if prefix > 0 or resume_at is not None else ():
    sr = _side_run(ctx.run_dir / REPEAT_DIR / side, side)
    if prefix > 0:
      dets.append(c := determinism_outcome(ctx, side, prefix,
                                           read_steps(ctx.run_dir / REPEAT_DIR / side / "steps.jsonl")))
      dsec[side] = determinism_section(c, prefix, sr)
    if resume_at is None:
      continue
    resumed = None
    if sr.status == "ok":
      out = ctx.run_dir / RESUME_DIR / side
      rr = _side_run(out, side)
      resumed = (rr, *side_outputs(out, rr, ctx.run_id, expected_steps=ctx.spec.train.steps - resume_at - 1))
    ress.append(c := resume_outcome(ctx, side, resume_at, sr, resumed))
    rsec[side] = resume_section(c, resume_at)
  return dets + ress, dsec, rsec


def _equivalence(ctx, d: dict) -> tuple[list, dict]:
  """The --equivalence checks and section from run_dir/equivalence/ (parity.pipeline.equivalence), for the kinds and
  sides report.json's section names."""
  stored = d.get("equivalence") if isinstance(d.get("equivalence"), dict) else {}
  try:
    return equivalence_from_folders(ctx, stored)
  except (OSError, ValueError, KeyError, TypeError) as exc:
    raise Unverifiable(f"the equivalence reruns in equivalence/ cannot be read ({type(exc).__name__}: {exc})") from None


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
  d, rd = report.data, Path(report.run_dir)
  spec, request = _spec(rd, d)
  try:
    init = weights.load(rd / "init.safetensors")
  except Exception as exc:  # missing, truncated, foreign
    raise Unverifiable(f"init.safetensors cannot be read ({type(exc).__name__}: {exc})") from None
  run_id = (d.get("run_folder") or {}).get("run_id") if isinstance(d.get("run_folder"), dict) else None
  data, runs = _collect(rd, d, spec, run_id)
  checks, table = compare_sides(data, spec=spec, init=init)
  ctx = RerunContext(rd, spec, run_id, 0.0, init, data)
  interrupted = str(d["verdict"]["message"]).startswith("INTERRUPTED")
  backend_checks, backend_sec = _backend(ctx, d, checks)
  noise_checks, noise_sec = _noise(ctx, d, checks)
  repeat_checks, dsec, rsec = _repeats(ctx, d, interrupted)
  stopped = [check_from_json(c) for c in d["checks"] if c.get("metric") == "reruns" and c.get("passed") is False
             and c.get("gating", True) is True]  # the reruns stopped (a file not written): a failure, as stored
  eq_checks, eq_sec = _equivalence(ctx, d)
  every = checks + backend_checks + noise_checks + repeat_checks + eq_checks + stopped
  v = verdict_json(verdict(every, {s: sr.status for s, sr in runs.items()}), interrupted)
  series = {s: _json(series_json(x["steps"])) for s, x in data.items()}
  return Recomputed(checks=_json([c.to_json() for c in every]), params_table=_json(params_table_json(table)),
                    verdict=_json(v),
                    statuses={s: sr.status for s, sr in runs.items()},
                    series=series, rendered=_rendered(rd, request, d, runs, series, run_id),
                    sections={"noise_envelope": _json(noise_sec), "determinism": _json(dsec), "resume": _json(rsec),
                              "equivalence": _json(eq_sec), "backend": _json(backend_sec)},
                    tolerances={spec.train.precision: {m: {"atol": t.atol, "rtol": t.rtol} for m, t in
                                                       TOLERANCES[spec.train.precision].items()}})


def _rendered(rd: Path, request: dict, d: dict, runs: dict, series: dict, run_id: str | None = None
              ) -> dict[str, Any]:
  """Recomputation.rendered: the data card from request.json (`request`, as _spec read it), the summaries from the
  sides' summary.json (a side without one keeps what report.json stores: _side_run), the perturbations and memory
  tables over them, the semantics cards and table from the sides' semantics.json (build.semantics_section), and the
  placement section from the sides' placement.json and summaries (parity.report.placement_view.placement_section)."""
  card = request.get("data")
  sides = {s: {**(d["sides"].get(s) or {}), "summary": _json(sr.summary), "series": series[s]}
           for s, sr in runs.items()}
  memory = predicted_vs_measured({**d, "sides": sides})
  return {"data": _json(card), "summaries": {s: x["summary"] for s, x in sides.items()},
          "perturbations": _json(perturbations_ran(rd, sides)), "memory": _json(memory),
          "semantics": _json(semantics_section(rd, list(runs), run_id)),
          "placement": _json(placement_section(rd, sides))}


def _rendered_lines(d: dict, rec: Recomputed) -> list[str]:
  """One line per rendered part of report.json (data card, side summaries, perturbations, memory table) that is not
  what the run's files give."""
  r, out = rec.rendered, []
  if not _same(d.get("data"), r["data"]):
    out.append("its data card ('data') is not request.json's")
  for side, summ in r["summaries"].items():
    if not _same(((d.get("sides") or {}).get(side) or {}).get("summary"), summ):
      out.append(f"sides.{side}.summary is not {side}/summary.json")
  if not _same(d.get("perturbations") or [], r["perturbations"]):
    out.append("its perturbations table is not what request.json and the sides' summaries give")
  if not _same((d.get("memory") or {}).get("predicted_vs_measured"), r["memory"]):
    out.append("its memory table is not what the sides' summaries give")
  if not _same(d.get("semantics"), r["semantics"]):
    out.append("its semantics cards ('semantics') are not the sides' semantics.json")
  return out + _placement_lines(d, r["placement"])


def _placement_lines(d: dict, again: dict) -> list[str]:
  """The line for report.json 'placement' when it is not what the sides' placement.json and summary.json give; a
  report without the section (written before it existed) is named only when the run's files record a placement."""
  if "placement" not in d:
    recorded = [s for s, e in again["sides"].items() if e["kind"] != "torch" and e["status"] != "missing"]
    return [f"it has no placement section, but {', '.join(recorded)} recorded one"] if recorded else []
  if not _same(d["placement"], again):
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


def differences(d: dict, rec: Recomputed) -> list[str]:
  """What report.json `d` states that its recomputation `rec` does not: stored checks (values, tolerances, pass and
  gating flags, steps, details), the verdict, the params table, each side's status and series, the rerun sections
  and the tolerance table; at most a few lines, the rest counted. [] when everything agrees."""
  out = _check_lines(d.get("checks") or [], rec.checks)
  sv = d.get("verdict") or {}
  if not all(_same(sv.get(k), rec.verdict.get(k)) for k in ("passed", "message", "first_failure")):
    out.insert(0, f"the stored verdict says {'PASS' if sv.get('passed') else 'FAIL'} ({sv.get('message')!r}) but "
                  f"the run's records give {rec.verdict['message']!r}")
  if not _same(d.get("params_table"), rec.params_table):
    rows = d.get("params_table") if isinstance(d.get("params_table"), list) else []
    first = next((i for i, (a, b) in enumerate(zip(rows, rec.params_table)) if not _same(a, b)), min(len(rows),
                                                                                          len(rec.params_table)))
    out.append(f"params_table differs from the recomputed one from row {first} on ({len(rows)} stored rows, "
               f"{len(rec.params_table)} recomputed)")
  for side, st in rec.statuses.items():
    stored = (d.get("sides") or {}).get(side) or {}
    if stored.get("status") != st:
      out.append(f"sides.{side}.status is stored {stored.get('status')!r}, its records give {st!r}")
    if not _same(stored.get("series"), rec.series[side]):
      keys = [k for k in rec.series[side] if not _same((stored.get("series") or {}).get(k), rec.series[side][k])]
      out.append(f"sides.{side}.series ({', '.join(keys) or 'keys'}) is not {side}/steps.jsonl")
  if not _same(_noise_section(d.get("noise_envelope")), _noise_section(rec.sections["noise_envelope"])):
    out.append("the noise_envelope section is not what noise/ gives")
  if not _same(d.get("backend"), rec.sections["backend"]):
    out.append("the backend section is not what backend/ gives")
  for name in ("determinism", "resume", "equivalence"):
    if not _same(d.get(name) or {}, rec.sections[name]):
      out.append(f"the {name} section is not what the rerun folders give")
  out += _rendered_lines(d, rec)
  stored_tol = {p: {m: {k: t.get(k) for k in ("atol", "rtol")} for m, t in tab.items() if isinstance(t, dict)}
                for p, tab in (d.get("tolerances") or {}).items() if isinstance(tab, dict)}
  if not _same(stored_tol, rec.tolerances):
    out.append("its tolerance table is not the one in force (it was written by another parity version, or edited)")
  return out if len(out) <= _MAX_LINES else out[:_MAX_LINES] + [f"and {len(out) - _MAX_LINES} more differences"]
