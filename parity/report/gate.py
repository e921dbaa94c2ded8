"""The regression gate: a new run against a stored one (`parity compare --baseline`, `parity check NEW BASELINE`).

Golden values in the style large training projects keep them (Megatron-LM's functional tests hold `lm loss`
deterministic and iteration time / allocated memory within a relative band; NeMo's golden values the same): every
metric has a gate, and the reason for its width sits next to it (GATES). Per side, over the steps both ran:

  verdict      a baseline that held parity must still hold it.
  steps        the new run completes every step the baseline completed.
  loss, val_loss, grad_norm, lr   per step, |new - baseline| <= atol + rtol * |baseline| with the run's own
               cross-framework tolerance (parity.verdict.tolerances, the same precision; the looser of the two
               precisions when they differ). A rerun of the same command on the same machine is bit-identical
               in fp32 (docs/report-compare.md), so the band is quiet on a rerun; every entry is far below a planted
               lr change (train.lr 1e-3 vs 1.1e-3 on gpt2-tiny, warmup 1: lr moves by 10 % at step 2, the loss
               by 0.0136 nats at step 3, 1360x the fp32 band).
  step_time    the side's median step time at most STEP_TIME_BAND slower than the baseline's (absolute time:
               skipped when the baseline was written on another machine, or when either run shared the machine
               with other work (load above the core count), which is then said).
  peak_rss     the side's peak host RSS at most PEAK_RSS_BAND higher than the baseline's.
  state_bytes  bytes of training state per memory kind, equal (sizes of the live arrays: a function of the model,
               precision and plan only).

Which machine wrote a run: <run>/environment.json when present (host, CPU model, versions), else report.json's
`environment` plus each side's summary (platform, CPU count, backend); only fields both runs recorded are compared.
Different package versions never fail the gate; they are named. A card (card.json next to a run, see
parity.report.card) is accepted as a baseline too: it holds key figures, not per-step series, so the per-step gates
become final-value gates on what it holds.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from parity.inputs import InputError  # noqa: F401
from parity.report.finished import _atomic_write
from parity.report.snapshot import (Snapshot, _max_dloss, _num, _peak_load, _versions, load_baseline, machine_identity,  # noqa: F401
                                    machine_identity_from_env, pair_key, snapshot_from_card, snapshot_from_report)

__all__ = ["GATES", "Gate", "Snapshot", "GateRow", "GateResult", "load_baseline", "snapshot_from_report",
           "check_against", "write_gate", "STEP_TIME_BAND", "PEAK_RSS_BAND", "SERIES_METRICS"]

STEP_TIME_BAND = 0.5
"""Median step time may be at most 50 % slower than the baseline's, and only when both runs had the machine to
themselves (1-minute load around each side at most the core count, report.json sides.<side>.load) on the same
machine. Measured on this project's 2 shared CPU cores (gpt2-tiny, jax and torch, the same command 6 times, 3 and 20
steps, load 4-12 from other jobs): medians spread 6.6x (jax, 5.6-37 ms) and 9x (torch, 0.17-1.5 s), so a loaded
machine's times are skipped, not gated. Megatron-LM's functional tests hold iteration time within 5 % on dedicated
GPUs; a few-step median of a CPU run is not that steady, so 1.5x: it still catches a side that became twice as slow."""
PEAK_RSS_BAND = 0.25
"""Peak host RSS may be at most 25 % above the baseline's. Measured over the same 6 reruns: jax 408-445 MiB (9.2 %
spread: allocator and compile-cache noise), torch 315.8-316.0 MiB; Megatron-LM holds allocated GPU bytes within 5 %,
but host RSS of a framework process is noisier. 25 % leaves 2.7x over the measured spread; a growth of the training
state itself is caught exactly by state_bytes."""
SERIES_METRICS = ("loss", "val_loss", "grad_norm", "lr")


@dataclasses.dataclass(frozen=True)
class Gate:
  """One gate: what it compares, how (series: the tolerance table per step; slower/higher: a one-sided relative
  band; equal: exact; verdict: pass stays pass), whether it measures absolute time, and why it is that wide."""
  metric: str
  kind: str
  band: float | None
  absolute_time: bool
  reason: str


_SERIES_REASON = ("per step, the run's own cross-framework tolerance for this precision "
                  "(parity.verdict.tolerances); a same-machine rerun is bit-identical in fp32")
GATES: dict[str, Gate] = {
    "verdict": Gate("verdict", "verdict", None, False, "a run that held parity must still hold it"),
    "steps": Gate("steps", "steps", None, False, "every step the baseline completed must complete again"),
    **{m: Gate(m, "series", None, False, _SERIES_REASON) for m in SERIES_METRICS},
    "step_time": Gate("step_time", "slower", STEP_TIME_BAND, True,
                      "median step time at most 50 % slower, same machine with load <= cores only (loaded 2-core "
                      "reruns spread 6.6x-9x: skipped, not gated)"),
    "peak_rss": Gate("peak_rss", "higher", PEAK_RSS_BAND, False,
                     "peak host RSS at most 25 % higher; 6 reruns spread 9.2 % (jax) and 0.1 % (torch)"),
    "state_bytes": Gate("state_bytes", "equal", 0.0, False,
                        "sizes of the live state arrays: fixed by model, precision and plan"),
}


@dataclasses.dataclass
class GateRow:
  """One line of the gate table: metric, side, the two values (text), the change, the gate, the outcome.
  status: 'ok', 'MOVED' (outside the gate: exit 1), 'skipped' (the note says why), 'reported' (not gating)."""
  metric: str
  side: str
  baseline: str
  new: str
  change: str
  gate: str
  status: str
  note: str = ""


@dataclasses.dataclass
class GateResult:
  """The gate's outcome: rows (GateRow), notes (machine, versions, configuration), and the sources compared."""
  baseline: str
  new: str
  rows: list[GateRow]
  notes: list[str]
  cross_machine: bool

  @property
  def passed(self) -> bool:
    """No row MOVED (outside its gate) and no row FAIL (the new run's own verdict fails)."""
    return not any(r.status in ("MOVED", "FAIL") for r in self.rows)

  @property
  def exit_code(self) -> int:
    """0 within every gate, 1 outside one."""
    return 0 if self.passed else 1

  @property
  def moved(self) -> list[GateRow]:
    return [r for r in self.rows if r.status in ("MOVED", "FAIL")]

  def message(self) -> str:
    if self.passed:
      return f"GATE PASS: every metric within its gate against baseline {self.baseline}"
    names = sorted({f"{r.metric} ({r.side})" if r.side else r.metric for r in self.moved})
    return f"GATE FAIL: outside its gate against baseline {self.baseline}: {', '.join(names)}"

  def to_json(self) -> dict:
    return {"passed": self.passed, "message": self.message(), "baseline": self.baseline, "new": self.new,
            "cross_machine": self.cross_machine, "notes": self.notes,
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "gates": {k: dataclasses.asdict(g) for k, g in GATES.items()}}

  def to_markdown(self) -> str:
    """The table of what moved (GFM: no raw '|' in a cell), the notes, and each gate with its reason."""
    out = [f"# parity regression gate: {'PASS' if self.passed else 'FAIL'}", "", f"**{self.message()}**", "",
           f"- new run: `{self.new}`", *[f"- {n}" for n in self.notes], "",
           "| metric | side | baseline | new | change | gate | result |", "|---|---|---|---|---|---|---|"]
    for r in self.rows:
      res = f"**{r.status}**" if r.status in ("MOVED", "FAIL") else r.status
      cells = [r.metric, r.side, r.baseline, r.new, r.change, r.gate, res + (f" ({r.note})" if r.note else "")]
      out.append("| " + " | ".join(_md_cell(c) for c in cells) + " |")
    out += ["", "## Gates and why they are that wide", "", "| gate | kind | reason |", "|---|---|---|"]
    out += [f"| {g.metric} | {g.kind} | {_md_cell(g.reason)} |" for g in GATES.values()]
    return "\n".join(out) + "\n"


def _md_cell(text: str) -> str:
  return str(text).replace("|", "\\|").replace("\n", " ")


def _fmt(v, spec: str = ".6g") -> str:
  return "n/a" if v is None else format(v, spec) if isinstance(v, (int, float)) else str(v)


def _looser(a: str, b: str) -> str:
  """Of two precisions, the one whose loss tolerance is wider (both are named in the notes when they differ)."""
  from parity.verdict.tolerances import TOLERANCES
  known = [p for p in (a, b) if p in TOLERANCES]
  if not known:
    raise InputError(f"no tolerance table for precision {a!r}; known: {sorted(TOLERANCES)}")
  return max(known, key=lambda p: TOLERANCES[p]["loss"].atol)


def _machine_notes(new: dict[str, str], base: dict[str, str]) -> tuple[list[str], bool]:
  """Notes on where each run was written; True when the baseline's machine differs in a field both recorded."""
  common = [k for k in ("host", "cpu_model", "cpu_count", "gpu", "backend", "machine") if k in new and k in base]
  moved = [f"{k} {base[k]!r} -> {new[k]!r}" for k in common if new[k] != base[k]]
  if moved:
    return [f"the baseline was written on another machine ({'; '.join(moved)}): absolute-time gates "
            f"({', '.join(k for k, g in GATES.items() if g.absolute_time)}) are skipped, not failed"], True
  if not {"host", "cpu_model"} & set(common):
    return [f"machine: neither run recorded its host or CPU model together (compared: {', '.join(common) or 'none'})"
            "; taken as the same machine, so time gates apply"], False
  return [f"same machine ({', '.join(f'{k} {new[k]}' for k in common)})"], False


def _version_notes(new: dict[str, str], base: dict[str, str]) -> list[str]:
  """Versions of the packages both runs recorded (a card keeps fewer than a run folder's environment.json: a
  package one side did not record is not a difference)."""
  changed = [f"{k} {base[k]} -> {new[k]}" for k in sorted(set(new) & set(base)) if new[k] != base[k]]
  return [f"versions differ (not a gate; they explain what moved): {', '.join(changed)}"] if changed else \
      ["same package versions"]


_VOLATILE = ("data.path",)  # keys that name where a file was, not what was run


def _config_notes(new: Snapshot, base: Snapshot) -> list[str]:
  from parity.report.multi import config_diff
  if not new.config or not base.config:
    if new.config_hash and base.config_hash:
      return ["same configuration (config hash)" if new.config_hash == base.config_hash else
              f"configuration differs from the baseline (config hash {base.config_hash} -> {new.config_hash}; the "
              "card does not say which keys)"]
    return ["configuration: not recorded by both, not compared"]
  new, base = new.config, base.config
  diff = {k: v for k, v in config_diff(base, new).items() if k not in _VOLATILE}
  if not diff:
    return ["same configuration"]
  items = [f"{k} {a!r} -> {b!r}" for k, (a, b) in list(diff.items())[:12]]
  more = f" and {len(diff) - 12} more" if len(diff) > 12 else ""
  return [f"configuration differs from the baseline: {', '.join(items)}{more}"]


def check_against(new: Snapshot, base: Snapshot) -> GateResult:
  """Every gate of GATES for `new` against `base`, per side the baseline ran.

  Returns a GateResult: rows per metric and side (MOVED: outside its gate), notes naming a different machine,
  different package versions and configuration changes. Raises InputError for an unknown precision."""
  precision = _looser(new.precision, base.precision)
  notes, cross = _machine_notes(new.machine, base.machine)
  notes += _version_notes(new.versions, base.versions) + _config_notes(new, base)
  if new.precision != base.precision:
    notes.append(f"precision {base.precision} -> {new.precision}: the per-step gates use {precision}'s (looser) band")
  if base.series is None or new.series is None:
    notes.append(f"{'the baseline' if base.series is None else 'the new run'} is a card: per-step series are not "
                 "compared; each pair's max |Δloss| and each side's loss at the card's steps are gated instead")
  rows = [_verdict_row(new, base)]
  for side in base.sides:
    if side not in new.sides:
      rows.append(GateRow("side", side, "ran", "absent", "", "every baseline side runs", "MOVED",
                          f"run the new comparison with --sides including {side}"))
      continue
    rows += _side_rows(side, new, base, precision, cross)
  if base.series is None or new.series is None:
    rows += [_pair_row(pair, new.max_dloss.get(pair), b, precision) for pair, b in base.max_dloss.items()]
  extra = [s for s in new.sides if s not in base.sides]
  if extra:
    notes.append(f"sides not in the baseline (not gated): {', '.join(extra)}")
  return GateResult(baseline=str(base.source), new=str(new.source), rows=rows, notes=notes, cross_machine=cross)


def _verdict_row(new: Snapshot, base: Snapshot) -> GateRow:
  """The verdict gate: a new run that does not hold parity never passes the gate (status FAIL, whatever the
  baseline's verdict: a gate that lets a non-parity run through is wrong); PASS -> FAIL is MOVED."""
  reason = GATES["verdict"].reason + "; a run that does not hold parity never passes the gate"
  change = "" if base.passed == new.passed else ("now fails" if base.passed else "now passes")
  cells = ("verdict", "", "PASS" if base.passed else "FAIL", "PASS" if new.passed else "FAIL", change, reason)
  if not new.passed:
    return GateRow(*cells, "MOVED" if base.passed else "FAIL", "gating: the new run does not hold parity")
  return GateRow(*cells, "ok", "" if base.passed else "the baseline did not hold parity; the new run does")


def _side_rows(side: str, new: Snapshot, base: Snapshot, precision: str, cross: bool) -> list[GateRow]:
  nf, bf = new.figures[side], base.figures[side]
  rows = []
  bs, ns = bf.get("steps_completed"), nf.get("steps_completed")
  if bs is not None and ns is not None:
    rows.append(GateRow("steps", side, str(bs), str(ns), "" if ns == bs else f"{ns - bs:+d}",
                        GATES["steps"].reason, "MOVED" if ns < bs else "ok"))
  if base.series is not None and new.series is not None:
    rows += [r for m in SERIES_METRICS if (r := _series_row(m, side, new, base, precision)) is not None]
  elif base.series is None:
    rows += _card_loss_rows(side, new, bf, precision)
  skip = "the baseline is from another machine" if cross else _busy(side, nf, bf, new.machine, base.machine)
  rows.append(_band_row("step_time", side, bf.get("step_time_s_median"), nf.get("step_time_s_median"), "s",
                        skip=skip))
  rows.append(_band_row("peak_rss", side, bf.get("peak_rss_bytes"), nf.get("peak_rss_bytes"), "B"))
  bk, nk = bf.get("state_bytes") or {}, nf.get("state_bytes") or {}
  for kind in sorted(set(bk) | set(nk)):
    b, n = bk.get(kind), nk.get(kind)
    rows.append(GateRow("state_bytes", f"{side} ({kind})", _fmt(b, ","), _fmt(n, ","),
                        "" if b == n or b is None or n is None else f"{n - b:+,d} B", "equal",
                        "ok" if b == n else "MOVED"))
  return rows


def _series_row(metric: str, side: str, new: Snapshot, base: Snapshot, precision: str) -> GateRow | None:
  """The per-step gate of one metric: parity.verdict.steps.series_check with the baseline as reference."""
  from parity.verdict.steps import series_check
  from parity.verdict.tolerances import tolerance
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


def _card_loss_rows(side: str, new: Snapshot, bf: dict, precision: str) -> list[GateRow]:
  """A card baseline's loss gate of one side: the loss at each step the card kept, and the final loss, within the
  run's own loss tolerance (atol + rtol·|baseline|, the per-step band of the series gate)."""
  from parity.verdict.tolerances import tolerance
  tol = tolerance(precision, "loss")
  gate = f"|Δ| ≤ {tol.atol:g} + {tol.rtol:g}·|baseline| ({precision} loss tolerance)"
  new_by_step = {r["step"]: _num(r.get("loss")) for r in (new.series or {}).get(side) or []}
  pts = [(f"loss (step {st})", b, new_by_step.get(st)) for st, b in sorted((bf.get("loss_at_steps") or {}).items())]
  pts.append(("final_loss", bf.get("final_loss"), (new.figures.get(side) or {}).get("final_loss")))
  rows = []
  for metric, b, n in pts:
    if b is None or n is None:
      if metric == "final_loss":
        rows.append(GateRow(metric, side, _fmt(b), _fmt(n), "", gate, "skipped", "not recorded by both"))
      continue
    moved = abs(n - b) > tol.atol + tol.rtol * abs(b)
    rows.append(GateRow(metric, side, _fmt(b), _fmt(n), f"|Δ| {abs(n - b):.3g}", gate, "MOVED" if moved else "ok"))
  return rows


def _pair_row(pair: str, n: float | None, b: float | None, precision: str) -> GateRow:
  """A card baseline's loss gate: the pair's max |Δloss| may grow by at most the loss tolerance (the band two correct
  stacks may differ by; a card keeps no per-step series)."""
  from parity.verdict.tolerances import tolerance
  atol = tolerance(precision, "loss").atol
  gate = f"at most the baseline's + {atol:g} ({precision} loss tolerance)"
  if n is None or b is None:
    return GateRow("max_dloss", pair, _fmt(b, ".3g"), _fmt(n, ".3g"), "", gate, "skipped", "not recorded by both")
  return GateRow("max_dloss", pair, _fmt(b, ".3g"), _fmt(n, ".3g"), f"{n - b:+.3g}", gate,
                 "MOVED" if n > b + atol else "ok")


def _busy(side: str, nf: dict, bf: dict, nm: dict[str, str], bm: dict[str, str]) -> str:
  """Why the step-time gate of `side` cannot be trusted ('' when it can): the 1-minute load average around the
  side, in either run, above the machine's core count (other work shared the cores: measured here, reruns at load
  4-12 on 2 cores spread the median step time by 1.4x-6x), or a run that did not record its load."""
  out = []
  for which, f, m in (("baseline", bf, bm), ("new run", nf, nm)):
    load, cores = f.get("load"), _num(float(m["cpu_count"])) if str(m.get("cpu_count", "")).isdigit() else None
    if load is None or cores is None:
      out.append(f"the {which} did not record the machine's load")
    elif load > cores:
      out.append(f"the machine was busy during the {which} (load {load:.1f} on {cores:.0f} cores)")
  return "; ".join(out) + ("; times are not comparable" if out else "")


def _band_row(metric: str, side: str, b, n, unit: str, skip: str = "") -> GateRow:
  """A one-sided relative gate (GATES[metric].band): new may exceed the baseline by at most that fraction."""
  g = GATES[metric]
  gate = f"at most +{g.band:.0%}"
  fmt = (lambda x: _fmt(x, ".4g") + " s") if unit == "s" else (lambda x: _fmt(x, ",.0f") + " B")
  if b is None or n is None or b <= 0:
    return GateRow(metric, side, fmt(b) if b is not None else "n/a", fmt(n) if n is not None else "n/a", "", gate,
                   "skipped", "not recorded by both runs")
  change = f"{n / b - 1:+.1%}"
  if skip:
    return GateRow(metric, side, fmt(b), fmt(n), change, gate, "skipped", skip)
  return GateRow(metric, side, fmt(b), fmt(n), change, gate, "MOVED" if n > b * (1 + g.band) else "ok")


def write_gate(result: GateResult, folder: str | Path) -> dict[str, Path]:
  """Writes gate.json and gate.md into `folder` (each through a temporary file). Returns name -> path.
  Raises OSError when a file cannot be written."""
  folder = Path(folder)
  paths = {"json": folder / "gate.json", "md": folder / "gate.md"}
  _atomic_write(paths["json"], lambda p: p.write_text(json.dumps(result.to_json(), indent=2)))
  _atomic_write(paths["md"], lambda p: p.write_text(result.to_markdown()))
  return paths
