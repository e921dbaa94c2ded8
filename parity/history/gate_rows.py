"""The gate's rows: one GateRow per metric and side (parity.history.gates says what each gate holds and why), from two
Snapshots: the verdict and configuration rows (`verdict_row`, `config_row`), a side's rows (`side_rows`: steps, the
per-step series in its band, final weights, step time, peak RSS, state bytes) and a card baseline's pair rows
(`pair_row`)."""
from __future__ import annotations

from parity.history.bands import flag_changes
from parity.history.gates import GATES, SERIES_METRICS, Band, GateRow
from parity.history.snapshot import Snapshot
from parity.inputs import ascii_number
from parity.report.read import finite_number
from parity.report.runconfig import VOLATILE_KEYS, config_diff
from parity.verdict.steps import series_check
from parity.verdict.tolerances import tolerance

__all__ = ["verdict_row", "config_row", "side_rows", "pair_row", "flags_row"]


def flags_row(new: Snapshot, base: Snapshot) -> GateRow:
  """The numerics-flags row: 'reported' naming each flag that differs (parity.history.bands.flag_changes), 'ok' when
  equal, 'skipped' when a run recorded none. Never MOVED: a flag change explains a move, the other gates judge it."""
  gate = GATES["numerics_flags"].reason
  if new.numerics_flags is None or base.numerics_flags is None:
    return GateRow("numerics_flags", "", "n/a" if base.numerics_flags is None else "recorded",
                   "n/a" if new.numerics_flags is None else "recorded", "", gate, "skipped",
                   "not recorded by both (runs written before environment.json kept them)")
  changed = flag_changes(new, base)
  if not changed:
    return GateRow("numerics_flags", "", "same", "same", "", gate, "ok")
  return GateRow("numerics_flags", "", "", "", "; ".join(changed), gate, "reported",
                 f"{len(changed)} flag{'s' * (len(changed) > 1)} changed: not a gate, the bitwise band is off")


def _fmt(v, spec: str = ".6g") -> str:
  return "n/a" if v is None else format(v, spec) if isinstance(v, (int, float)) else str(v)


def config_row(new: Snapshot, base: Snapshot) -> GateRow:
  """The configuration gate: MOVED naming every key that differs (change: 'key base -> new; ...'), ok when equal.
  A card without its configuration (written before cards kept it) is compared by config hash and precision."""
  gate = GATES["config"].reason
  if new.config and base.config:
    diff = {k: v for k, v in config_diff(base.config, new.config, missing=_ABSENT).items()
            if k not in VOLATILE_KEYS}
    changes = [f"{k} {_show(a, k)} -> {_show(b, k)}" for k, (a, b) in diff.items()]
    how = "every key"
  else:
    changes = [] if new.precision == base.precision else [f"train.precision {base.precision!r} -> {new.precision!r}"]
    if new.config_hash and base.config_hash and new.config_hash != base.config_hash:
      changes.append(f"config hash {base.config_hash} -> {new.config_hash} (the card keeps no keys; `parity report "
                     "BASELINE_RUN` writes a card that does; the hash also covers sides, data.path and timeout_s)")
    if not changes and not (new.config_hash and base.config_hash):
      return GateRow("config", "", "n/a", "n/a", "", gate, "skipped",
                     "configuration not recorded by both (compared: precision only, equal)")
    how = "config hash and precision"
  if not changes:
    return GateRow("config", "", "same", "same", "", gate, "ok", f"compared: {how}")
  return GateRow("config", "", "", "", "; ".join(changes), gate, "MOVED",
                 f"{len(changes)} difference{'s' * (len(changes) > 1)} (compared: {how}); gate runs of one "
                 "configuration, or make a new baseline")


_ABSENT = object()
"""A configuration key one run does not hold at all (config_diff's `missing`): shown 'absent'; a null value is None."""


def _show(v, key: str = "") -> str:
  """A config value as the change column shows it: 'absent' (the key is not there: _ABSENT), a sha256 cut to 12 hex
  digits (labelled `tensors-sha256:` for a .safetensors input, compared by parity.report.runconfig.tensor_digest over
  its tensors, not its file bytes: design review, 2026-12-02), else repr (a null value: None)."""
  if v is _ABSENT:
    return "absent"
  if isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v):
    return f"{'tensors-sha256' if key.endswith('.safetensors') else 'sha256'}:{v[:12]}"
  return repr(v)


def verdict_row(new: Snapshot, base: Snapshot) -> GateRow:
  """The verdict gate: a new run that does not hold parity never passes the gate (status FAIL, whatever the
  baseline's verdict: a gate that lets a non-parity run through is wrong); PASS -> FAIL is MOVED."""
  reason = GATES["verdict"].reason + "; a run that does not hold parity never passes the gate"
  change = "" if base.passed == new.passed else ("now fails" if base.passed else "now passes")
  cells = ("verdict", "", "PASS" if base.passed else "FAIL", "PASS" if new.passed else "FAIL", change, reason)
  if not new.passed:
    return GateRow(*cells, "MOVED" if base.passed else "FAIL", "gating: the new run does not hold parity")
  return GateRow(*cells, "ok", "" if base.passed else "the baseline did not hold parity; the new run does")


def side_rows(side: str, new: Snapshot, base: Snapshot, precision: str, cross: bool, band: Band) -> list[GateRow]:
  """The rows of one side the baseline ran: steps completed, the per-step series in `band` (bitwise or the
  `precision` tolerance; a card baseline: its loss points), final weights (bitwise band only), median step time
  (skipped when `cross`: another machine, or when either run was busy), peak RSS and state bytes per memory kind."""
  nf, bf = new.figures[side], base.figures[side]
  rows = []
  bs, ns = bf.get("steps_completed"), nf.get("steps_completed")
  if bs is not None and ns is not None:
    rows.append(GateRow("steps", side, str(bs), str(ns), "" if ns == bs else f"{ns - bs:+d}",
                        GATES["steps"].reason, "MOVED" if ns < bs else "ok"))
  if base.series is not None and new.series is not None:
    series_row = _bitwise_row if band.bitwise else _series_row
    rows += [r for m in SERIES_METRICS if (r := series_row(m, side, new, base, precision)) is not None]
  elif base.series is None:
    rows += _card_loss_rows(side, new, bf, precision, band.bitwise)
  if band.bitwise:
    rows.append(_final_params_row(side, new, base))
  skip = "the baseline is from another machine" if cross else _busy(side, nf, bf, new.machine, base.machine)
  rows.append(_band_row("step_time", side, bf.get("step_time_s_median"), nf.get("step_time_s_median"), "s",
                        skip=skip))
  rows.append(_band_row("peak_rss", side, bf.get("peak_rss_bytes"), nf.get("peak_rss_bytes"), "B"))
  bk, nk = bf.get("state_bytes") or {}, nf.get("state_bytes") or {}
  for kind in sorted(set(bk) | set(nk)):
    b, n = bk.get(kind), nk.get(kind)
    status, note = "ok" if b == n else "MOVED", ""
    if b is None and n is not None:  # only the new run has this kind: nothing in the baseline to hold it to
      status, note = "skipped", "the baseline recorded none for this memory kind (its side did not finish)"
    rows.append(GateRow("state_bytes", f"{side} ({kind})", _fmt(b, ","), _fmt(n, ","),
                        "" if b == n or b is None or n is None else f"{n - b:+,d} B", "equal", status, note))
  return rows


def _bitwise_row(metric: str, side: str, new: Snapshot, base: Snapshot, precision: str) -> GateRow | None:
  """The bitwise band of one metric: every step both runs recorded it must hold the same value (None: neither run
  recorded `metric`). change: the largest |Δ| and the first step that differs."""
  b_by = {r["step"]: r[metric] for r in base.series[side] if metric in r}
  n_by = {r["step"]: r[metric] for r in new.series[side] if metric in r}
  steps = sorted(set(b_by) & set(n_by))
  if not steps:
    return None
  differ = [s for s in steps if b_by[s] != n_by[s]]
  gate = "bit-identical at every step (the baseline proved it reproduces bit for bit)"
  if not differ:
    return GateRow(metric, side, _fmt(b_by[steps[-1]]), _fmt(n_by[steps[-1]]), f"|Δ| 0 at every step ({len(steps)})",
                   gate, "ok")
  worst = max(differ, key=lambda s: _absdiff(b_by[s], n_by[s]))
  change = f"|Δ| {_absdiff(b_by[worst], n_by[worst]):.3g} at step {worst}; first differs at step {differ[0]} " \
           f"({len(differ)} of {len(steps)} steps)"
  return GateRow(metric, side, _fmt(b_by[worst]), _fmt(n_by[worst]), change, gate, "MOVED")


def _absdiff(a, b) -> float:
  """|a - b| of two recorded values; inf when one is not a number (NaN or inf stored as None or text)."""
  a, b = finite_number(a), finite_number(b)
  return float("inf") if a is None or b is None else abs(a - b)


def _final_params_row(side: str, new: Snapshot, base: Snapshot) -> GateRow:
  """The bitwise band's weight gate: final.safetensors holds the same tensors bit for bit (equal tensor_digest)."""
  b, n = base.final_digest.get(side), new.final_digest.get(side)
  gate = "final.safetensors: the same tensors bit for bit (parity.report.runconfig.tensor_digest)"
  if b is None or n is None:
    return GateRow("final_params", side, _fmt(b), _fmt(n), "", gate, "skipped", "not recorded by both")
  return GateRow("final_params", side, b[:12], n[:12], "" if b == n else "other tensor bytes", gate,
                 "ok" if b == n else "MOVED")


def _series_row(metric: str, side: str, new: Snapshot, base: Snapshot, precision: str) -> GateRow | None:
  """The per-step gate of one metric: parity.verdict.steps.series_check with the baseline as reference."""
  c = series_check(metric, "baseline", base.series[side], "new", new.series[side], precision)
  if c is None:
    return None
  tol = tolerance(precision, metric)
  at = c.worst
  bv = next((r.get(metric) for r in base.series[side] if r["step"] == at), None)
  nv = next((r.get(metric) for r in new.series[side] if r["step"] == at), None)
  change = f"|Δ| {_fmt(c.value, '.3g')} at step {at}" + \
      (f"; first outside at step {c.first_failing_step}" if c.first_failing_step is not None else "")
  gate = f"|Δ| ≤ {tol.atol:g} + {tol.rtol:g}·|baseline| per step ({precision} tolerance)"
  return GateRow(metric, side, _fmt(bv), _fmt(nv), change, gate, "ok" if c.passed else "MOVED")


def _card_loss_rows(side: str, new: Snapshot, bf: dict, precision: str, bitwise: bool = False) -> list[GateRow]:
  """A card baseline's loss gate of one side: the loss at each step the card kept, and the final loss, within the
  run's own loss tolerance (atol + rtol·|baseline|, the per-step band of the series gate), or equal when the
  side's band is bitwise."""
  tol = tolerance(precision, "loss")
  gate = "bit-identical (the baseline proved it reproduces bit for bit)" if bitwise else \
      f"|Δ| ≤ {tol.atol:g} + {tol.rtol:g}·|baseline| ({precision} loss tolerance)"
  new_by_step = {r["step"]: finite_number(r.get("loss")) for r in (new.series or {}).get(side) or []}
  pts = [(f"loss (step {st})", b, new_by_step.get(st)) for st, b in sorted((bf.get("loss_at_steps") or {}).items())]
  pts.append(("final_loss", bf.get("final_loss"), (new.figures.get(side) or {}).get("final_loss")))
  rows = []
  for metric, b, n in pts:
    if b is None or n is None:
      if metric == "final_loss":
        rows.append(GateRow(metric, side, _fmt(b), _fmt(n), "", gate, "skipped", "not recorded by both"))
      continue
    moved = n != b if bitwise else abs(n - b) > tol.atol + tol.rtol * abs(b)
    rows.append(GateRow(metric, side, _fmt(b), _fmt(n), f"|Δ| {abs(n - b):.3g}", gate, "MOVED" if moved else "ok"))
  return rows


def pair_row(pair: str, n: float | None, b: float | None, precision: str, bitwise: bool = False) -> GateRow:
  """A card baseline's loss gate: the pair's max |Δloss| may grow by at most the loss tolerance (the band two correct
  stacks may differ by; a card keeps no per-step series), or must be equal when both sides' bands are bitwise."""
  atol = tolerance(precision, "loss").atol
  gate = "equal (both sides bitwise)" if bitwise else f"at most the baseline's + {atol:g} ({precision} loss tolerance)"
  if n is None or b is None:
    return GateRow("max_dloss", pair, _fmt(b, ".3g"), _fmt(n, ".3g"), "", gate, "skipped", "not recorded by both")
  moved = n != b if bitwise else n > b + atol
  return GateRow("max_dloss", pair, _fmt(b, ".3g"), _fmt(n, ".3g"), f"{n - b:+.3g}", gate, "MOVED" if moved else "ok")


def _count(value) -> float | None:
  """A recorded count (cpu_count: an int, or its text in ASCII digits) as a float, else None."""
  try:
    return float(ascii_number(str(value), sign=False))
  except ValueError:
    return None


def _busy(side: str, nf: dict, bf: dict, nm: dict[str, str], bm: dict[str, str]) -> str:
  """Why the step-time gate of `side` cannot be trusted ('' when it can): the 1-minute load average around the
  side, in either run, above the machine's core count (other work shared the cores: measured here, reruns at load
  4-12 on 2 cores spread the median step time by 1.4x-6x), or a run that did not record its load."""
  out = []
  for which, f, m in (("baseline", bf, bm), ("new run", nf, nm)):
    cores = _count(m.get("cpu_count"))
    load = f.get("load")
    if load is None or cores is None:
      out.append(f"the {which} did not record the machine's load")
    elif load > cores:
      out.append(f"the machine was busy during the {which} (load {load:.1f} on {cores:.0f} cores)")
  return "; ".join(out) + ("; times are not comparable" if out else "")


def _band_row(metric: str, side: str, b, n, unit: str, skip: str = "") -> GateRow:
  """A one-sided gate (GATES[metric]): new may exceed the baseline by at most its relative band plus its absolute
  slack (step_time: STEP_TIME_SLACK_S); a new figure past the band but inside the slack is ok, and the note says so."""
  g = GATES[metric]
  slack = f" + {g.slack * 1e3:g} ms" if g.slack and unit == "s" else f" + {g.slack:g}" if g.slack else ""
  gate = f"at most +{g.band:.0%}{slack}"
  fmt = (lambda x: _fmt(x, ".4g") + " s") if unit == "s" else (lambda x: _fmt(x, ",.0f") + " B")
  if b is None or n is None or b <= 0:
    return GateRow(metric, side, fmt(b) if b is not None else "n/a", fmt(n) if n is not None else "n/a", "", gate,
                   "skipped", "not recorded by both runs")
  change = f"{n / b - 1:+.1%}"
  if skip:
    return GateRow(metric, side, fmt(b), fmt(n), change, gate, "skipped", skip)
  if n > b * (1 + g.band) + g.slack:
    return GateRow(metric, side, fmt(b), fmt(n), change, gate, "MOVED")
  note = (f"past +{g.band:.0%} by {_fmt(n - b * (1 + g.band), '.3g')} {unit}, inside the{slack.removeprefix(' +')} "
          "slack: a median this short is dispatch and timer jitter" if n > b * (1 + g.band) else "")
  return GateRow(metric, side, fmt(b), fmt(n), change, gate, "ok", note)
