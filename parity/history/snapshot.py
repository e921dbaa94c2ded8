"""What the regression gate compares: a run's key figures (`Snapshot`) read from a finished run folder or from its
card.json, with the machine and package versions it ran on (parity.history.gate compares two of them)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from parity.inputs import InputError, ascii_number, load_json
from parity.numerics_flags import SIDE_KEYS, flag_values
from parity.protocol.semantics import SEMANTICS_FILE, read_card
from parity.report.card import CARD_SCHEMA
from parity.report.finished import load_finished
from parity.report.read import finite_number, peak_load, verify_report
from parity.report.run_record import RunRecord
from parity.report.runconfig import final_digests, gate_config, proven_deterministic, thread_settings

__all__ = ["Snapshot", "machine_identity", "machine_identity_from_env", "snapshot_from_report", "unfinished_reason",
           "refuse_unfinished", "pair_key", "load_baseline", "snapshot_from_card", "run_flags"]


@dataclasses.dataclass
class Snapshot:
  """What a gate compares: one run's figures, read from a run folder (with per-step series) or a card (without).

  Attributes:
    source: the folder or card file. kind: 'run' or 'card'. precision: train.precision.
    passed, verdict: the run's verdict. sides: side names.
    series: side -> step records [{step, loss, grad_norm, lr, val_loss?}] (None for a card).
    figures: side -> {steps_completed, step_time_s_median (s), peak_rss_bytes, state_bytes ({kind: bytes}),
      final_loss (nats)}; a figure not recorded is None.
    versions: package -> version. machine: identity fields (see machine_identity). config: the run spec, dotted
      keys as `gate_config` gives them ({} for a card written before cards kept it). config_hash:
      parity.spec.config_hash. max_dloss: 'a~b' -> max |Δloss| (nats) of the pair's loss check. created: when the
      run was written (text).
    determinism: side -> steps the run's own determinism rerun (report.json `determinism`) found bit-identical in a
      new process; a side whose rerun differed, did not run or did not finish is absent.
    final_digest: side -> parity.report.runconfig.tensor_digest of its final.safetensors; absent when not recorded.
    threads: side -> its thread settings (parity.report.runconfig.thread_settings); a side that recorded none is
      absent. None: the source keeps no thread records at all (a card written before cards kept them).
    unfinished: why the run is no finished measurement ('' when it is): it was interrupted (verdict INTERRUPTED), or
      a side never ran (status not_run).
    numerics_flags: the flags that change offload or numerics (`run_flags`: environment.json's numerics_flags
      values and each side's semantics-card matmul precision), {key: text | None (unset)}; None: not recorded.
  """
  source: Path
  kind: str
  precision: str
  passed: bool
  verdict: str
  sides: list[str]
  series: dict[str, list[dict]] | None
  figures: dict[str, dict[str, Any]]
  versions: dict[str, str]
  machine: dict[str, str]
  config: dict[str, Any]
  config_hash: str = ""
  max_dloss: dict[str, float | None] = dataclasses.field(default_factory=dict)
  created: str = ""
  determinism: dict[str, int] = dataclasses.field(default_factory=dict)
  final_digest: dict[str, str] = dataclasses.field(default_factory=dict)
  threads: dict[str, dict[str, str | None]] | None = dataclasses.field(default_factory=dict)
  unfinished: str = ""
  numerics_flags: dict[str, str | None] | None = None


def machine_identity(run_dir: Path, rec: RunRecord) -> dict[str, str]:
  """The fields that say which machine wrote a run: host, cpu_model, cpu_count, machine, platform, backend, gpu.

  report.json's `environment` (hostname and CPU model, in newer reports) and each side's summary (`device`: the
  backend) first; <run_dir>/environment.json (harness.doctor's block), when present, overrides them. Fields no
  source recorded are left out."""
  out: dict[str, str] = {}
  env = rec.environment
  for k, v in (("host", env.hostname), ("cpu_model", env.cpu_model), ("cpu_count", env.cpu_count),
               ("machine", env.machine), ("platform", env.platform)):
    if v not in (None, ""):
      out[k] = str(v)
  backends = sorted({s.device.split(":")[0] for s in rec.sides.values()} - {""})
  if backends:
    out["backend"] = ",".join(backends)
  out.update(machine_identity_from_env(_environment_json(run_dir)))
  return out


def machine_identity_from_env(env: dict) -> dict[str, str]:
  """host, cpu_model, cpu_count and gpu from an environment.json block ({host: {hostname, cpu_model,
  cpu_cores_logical}, gpus: {gpus: ['0, NVIDIA H200, ...']}}); {} for an empty block."""
  host = env.get("host") if isinstance(env.get("host"), dict) else {}
  out = {k: str(host[src]) for k, src in (("host", "hostname"), ("cpu_model", "cpu_model"),
                                          ("cpu_count", "cpu_cores_logical")) if host.get(src) not in (None, "")}
  gpus = (env.get("gpus") or {}).get("gpus") if isinstance(env.get("gpus"), dict) else None
  if isinstance(gpus, list) and gpus:
    names = [str(g).split(",")[1].strip() if "," in str(g) else str(g) for g in gpus]
    out["gpu"] = ", ".join(f"{names.count(n)}x {n}" for n in sorted(set(names)))
  return out


def _environment_json(run_dir: Path) -> dict:
  """<run_dir>/environment.json (parity.pipeline.folder.write_environment), {} when absent or unreadable: it adds
  detail, the gate does not depend on it."""
  try:
    d = json.loads((Path(run_dir) / "environment.json").read_text(encoding="utf-8"))
  except (OSError, ValueError):
    return {}
  return d if isinstance(d, dict) else {}


def run_flags(run_dir: Path, sides) -> dict[str, str | None] | None:
  """The numerics flags of a run folder (parity.numerics_flags): environment.json's `numerics_flags` values, plus
  '<side> matmul.precision' from each side's semantics.json (SIDE_KEYS; the precision its step ran with). None when
  neither was recorded (a run written before they were kept)."""
  out = flag_values(_environment_json(run_dir).get("numerics_flags"))
  for side in sides:
    card = read_card(Path(run_dir) / side / SEMANTICS_FILE)
    for key in SIDE_KEYS if card else ():
      if key in card["items"]:
        out = out if out is not None else {}
        v = card["items"][key]
        out[f"{side} {key}"] = None if v is None else str(v)
  return out


def _versions(run_dir: Path, rec: RunRecord) -> dict[str, str]:
  """package -> version: report.json's environment.versions, completed by environment.json's packages."""
  out = {k: str(v) for k, v in rec.environment.versions.items() if v is not None}
  pk = _environment_json(run_dir).get("packages")
  if isinstance(pk, dict):
    out.update({k: str(v) for k, v in pk.items() if v is not None})
  return out


def snapshot_from_report(report) -> Snapshot:
  """A Snapshot of a loaded Report (parity.report.build.Report)."""
  rec, rd = report.record, Path(report.run_dir)
  series, figures = {}, {}
  for side, s in rec.sides.items():
    ser = s.series
    recs = [{"step": st, **{m: ser[m][i] for m in ("loss", "grad_norm", "lr") if m in ser}}
            for i, st in enumerate(ser["step"])]
    by_step = {r["step"]: r for r in recs}
    for st, v in zip(s.values("val_step"), s.values("val_loss")):
      if st in by_step:
        by_step[st]["val_loss"] = v
    series[side] = recs
    summ, loss = s.summary, s.values("loss")
    losses = [x for x in loss if finite_number(x) is not None]
    figures[side] = {"steps_completed": summ.get("steps_completed", len(loss)),
                     "step_time_s_median": finite_number(summ.get("step_time_s_median")),
                     "load": peak_load(s.load), "peak_rss_bytes": finite_number(s.peak_rss_bytes),
                     "state_bytes": dict(summ.get("state_bytes_by_memory_kind") or {}),
                     "final_loss": losses[-1] if losses else None}
  return Snapshot(source=rd, kind="run", precision=rec.precision, passed=bool(rec.verdict.passed),
                  verdict=rec.verdict.message, sides=list(rec.sides), series=series, figures=figures,
                  versions=_versions(rd, rec), machine=machine_identity(rd, rec), config=gate_config(rec, rd),
                  config_hash=str(rec.config_hash or ""), max_dloss=_max_dloss(rec.checks),
                  created=str(rec.created_utc or ""), determinism=proven_deterministic(rec),
                  final_digest=final_digests(rec, rd), threads=thread_settings(rec),
                  unfinished=unfinished_reason(rec.verdict.message, rec.side_status()),
                  numerics_flags=run_flags(rd, list(rec.sides)))


def unfinished_reason(verdict: str, status: dict[str, Any]) -> str:
  """Why a run is no finished measurement, '' when it is: its verdict message says INTERRUPTED (a Ctrl-C or SIGTERM
  stopped it; parity.report.build.verdict_json), or a side's status (side -> status; {} when not kept) is not_run."""
  if str(verdict).startswith("INTERRUPTED"):
    return "it was interrupted (verdict INTERRUPTED): stopped before every side and check finished"
  never = sorted(s for s, st in status.items() if st == "not_run")
  return f"side(s) {', '.join(never)} never ran (status not_run)" if never else ""


def refuse_unfinished(snap: Snapshot, flag: str) -> None:
  """Raises InputError (exit 2) when baseline `snap` is no finished run: its figures are partial, so every gate
  against it would blame what merely did not run. flag: how the user gave it ('--baseline', 'BASELINE')."""
  if snap.unfinished:
    raise InputError(f"{flag} {snap.source}: not a finished run: {snap.unfinished}; a baseline must be a run that "
                     "completed: rerun its command to completion (a new --out) and gate against that")


def pair_key(pair) -> str:
  """The one key a pair has in a Snapshot: 'a~b', from a sides list ['a', 'b'], a check's 'a~b' or a card's
  'a vs b' (parity.report.cells.pair_label), so a run and a card baseline name a pair alike."""
  if isinstance(pair, (list, tuple)):
    return "~".join(str(x) for x in pair)
  return str(pair).replace(" vs ", "~")


def _max_dloss(checks) -> dict[str, float | None]:
  """'a~b' -> the `loss` check's value (max |loss_a - loss_b|, nats) of each pair (checks: the run's CheckRecords)."""
  return {pair_key(c.sides): finite_number(c.value) for c in checks if c.metric == "loss"}


def load_baseline(path: str | Path, flag: str = "--baseline") -> Snapshot:
  """The baseline a new run is gated against: a finished run folder (its report.json) or a card (card.json, or a
  folder holding only a card).

  flag: how the user gave the path, for messages ('--baseline' for compare, 'BASELINE' for `parity check`).
  Raises:
    InputError (exit 2): no such path; a folder that is neither a finished run nor holds a card (named: what is
      missing); a run whose files changed since its verdict (verify_report's lines); a card that is not one; a run
      or card that did not finish (interrupted, a side not run: `refuse_unfinished`).
  """
  p = Path(path)
  if not p.exists():
    raise InputError(f"{flag} {p}: no such file or folder; pass a finished run folder or its card.json")
  if p.is_dir() and not (p / "report.json").exists() and (p / "card.json").is_file():
    p = p / "card.json"
  if p.is_file():
    snap = snapshot_from_card(p)
  else:
    report = load_finished(p)
    problems = verify_report(report)
    if problems:
      raise InputError(f"baseline {p} cannot be trusted: {'; '.join(problems)}")
    snap = snapshot_from_report(report)
  refuse_unfinished(snap, flag)
  return snap


def snapshot_from_card(path: Path) -> Snapshot:
  """A Snapshot of a verification card (card.json, schema parity.report.card.CARD_SCHEMA): key figures per side, the
  max |Δloss| per pair, versions and backend; no per-step series. The machine is read from environment.json beside
  the card when there is one. Raises InputError naming what the file lacks."""
  card = load_json(path, what="card")
  if not isinstance(card, dict) or card.get("schema") != CARD_SCHEMA or not isinstance(card.get("verdict"), dict) \
      or not isinstance(card.get("compared"), dict) or not isinstance(card.get("key_figures"), dict):
    raise InputError(f"{path}: not a parity card (expected schema {CARD_SCHEMA!r} with verdict, compared and "
                     "key_figures); pass the card.json `parity compare` wrote, or its run folder")
  comp, kf = card["compared"], card["key_figures"]
  wrong = [name for name, value, types in (("compared.sides", comp.get("sides"), (list,)),
                                           ("backend", card.get("backend"), (dict, type(None))),
                                           ("versions", card.get("versions"), (dict, type(None))))
           if not isinstance(value, types) or (name == "compared.sides" and not all(isinstance(x, str) for x in value))]
  if wrong:
    raise InputError(f"{path}: not a parity card ({', '.join(wrong)} of the wrong type: compared.sides is a list of "
                     "side names, backend and versions are objects); pass the card.json `parity compare` wrote")
  sides = list(comp["sides"])

  def per_side(key: str) -> dict:
    v = kf.get(key)
    return v if isinstance(v, dict) else {}
  def number(key: str, side: str) -> float | None:
    return finite_number(per_side(key).get(side))
  figures = {side: {"steps_completed": None, "step_time_s_median": number("step_time_s_median", side),
                    "peak_rss_bytes": number("peak_host_rss_bytes", side),
                    "state_bytes": dict(per_side("state_bytes_by_memory_kind").get(side) or {}),
                    "final_loss": number("final_loss", side), "load": number("load", side),
                    "loss_at_steps": {_step(k): finite_number(v) for k, v in (per_side("loss_at_steps").get(side) or {})
                                      .items() if _step(k) is not None and finite_number(v) is not None}}
             for side in sides}
  backends = sorted({str(b) for b in (card.get("backend") or {}).values() if b})
  machine = {"backend": ",".join(backends)} if backends else {}
  rec = card.get("machine") if isinstance(card.get("machine"), dict) else {}  # cards written since the machine was kept
  machine.update({k: str(v) for k, v in rec.items() if v not in (None, "")})
  env = _environment_json(path.parent)
  if env:
    machine.update(machine_identity_from_env(env))
  return Snapshot(source=path, kind="card", precision=str(comp.get("precision") or "fp32"),
                  passed=bool(card["verdict"].get("passed")), verdict=str(card["verdict"].get("message", "")),
                  sides=sides, series=None, figures=figures,
                  versions={k: str(v) for k, v in (card.get("versions") or {}).items() if v is not None},
                  machine=machine, config=dict(comp["config"]) if isinstance(comp.get("config"), dict) else {},
                  config_hash=str(comp.get("config_hash") or ""),
                  max_dloss={pair_key(k): finite_number(v) for k, v in per_side("max_abs_dloss").items()},
                  created=str(card.get("created_utc") or ""), determinism=_card_determinism(card.get("determinism")),
                  final_digest={str(k): str(v) for k, v in per_side("final_params_digest").items() if v},
                  threads=_card_threads(card.get("threads")),
                  unfinished=unfinished_reason(str(card["verdict"].get("message", "")), {}),
                  numerics_flags=flag_values(env.get("numerics_flags")) if env else None)


def _step(key) -> int | None:
  """A loss_at_steps key (a step number in ASCII digits) as an int, else None."""
  try:
    return ascii_number(str(key), sign=False)
  except ValueError:
    return None


def _card_threads(rec) -> dict[str, dict[str, str | None]] | None:
  """A card's `threads` {side: {key: value}} (cards written before it was kept have none: None, unknown)."""
  if not isinstance(rec, dict):
    return None
  return {str(s): {str(k): None if v is None else str(v) for k, v in t.items()} for s, t in rec.items()
          if isinstance(t, dict)}


def _card_determinism(det) -> dict[str, int]:
  """A card's `determinism` {side: steps checked} (cards written before it was kept have none: {})."""
  if not isinstance(det, dict):
    return {}
  return {str(s): n for s, n in det.items() if isinstance(n, int) and not isinstance(n, bool) and n > 0}
