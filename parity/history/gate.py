"""The regression gate: a new run against a stored one (`parity compare --baseline`, `parity check NEW BASELINE`).

`check_against` applies every gate of parity.history.gates (each with the reason for its width) to two Snapshots
(parity.history.snapshot: a finished run folder or a card) and returns a GateResult; `write_gate` writes gate.json
and gate.md beside the new run, `read_gate` reads the outcome back (the comparison page, parity.history.comparison,
uses it; the gate never uses the page)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from parity.history.bands import (flag_notes, looser_precision, machine_notes, pair_bitwise, side_bands, thread_notes,
                                  version_notes)
from parity.history.gate_rows import config_row, flags_row, pair_row, side_rows, verdict_row
from parity.history.gates import GATES, Band, GateRow
from parity.history.snapshot import Snapshot, refuse_unfinished
from parity.report.write import atomic_write

__all__ = ["GateResult", "check_against", "write_gate", "read_gate"]


@dataclasses.dataclass
class GateResult:
  """The gate's outcome: rows (GateRow), notes (machine, versions, configuration), and the sources compared."""
  baseline: str
  new: str
  rows: list[GateRow]
  notes: list[str]
  cross_machine: bool
  bands: dict[str, Band] = dataclasses.field(default_factory=dict)

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
    names = sorted({f"{r.metric} ({r.side})" if r.side else r.metric for r in self.moved if r.metric != "config"})
    names = [f"config ({_first(r.change.split('; '), 3)})" for r in self.moved if r.metric == "config"] + names
    done = next((r for r in self.moved if r.metric == "finished"), None)
    if done:
      return (f"GATE FAIL: the new run {self.new} did not finish: {done.change}; it cannot pass: rerun it to "
              "completion")
    return f"GATE FAIL: outside its gate against baseline {self.baseline}: {', '.join(names)}"

  def to_json(self) -> dict:
    return {"passed": self.passed, "message": self.message(), "baseline": self.baseline, "new": self.new,
            "cross_machine": self.cross_machine, "notes": self.notes,
            "bands": {k: dataclasses.asdict(b) for k, b in self.bands.items()},
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


def _first(items: list[str], n: int) -> str:
  """The first n items joined by '; ', with 'and K more' when there are more."""
  return "; ".join(items[:n]) + (f"; and {len(items) - n} more in the config row" if len(items) > n else "")


def _md_cell(text: str) -> str:
  return str(text).replace("|", "\\|").replace("\n", " ")


def check_against(new: Snapshot, base: Snapshot) -> GateResult:
  """Every gate of GATES for `new` against `base`, per side the baseline ran.

  Returns a GateResult: rows per metric and side (MOVED: outside its gate; the config row names each key that
  differs), each side's Band (bitwise or the cross-framework tolerance, with why), notes naming a different machine
  and different package versions and thread settings. A new run that did not finish (Snapshot.unfinished) gets
  one FAIL row saying so and nothing else (its partial figures are no measurement). Raises InputError for an
  unknown precision, or a baseline that did not finish (`refuse_unfinished`)."""
  refuse_unfinished(base, "baseline")
  if new.unfinished:
    return _unfinished_result(new, base)
  precision = looser_precision(new.precision, base.precision)
  notes, cross = machine_notes(new.machine, base.machine)
  notes += version_notes(new.versions, base.versions)
  notes += thread_notes(new, base)
  notes += flag_notes(new, base)
  rows = [verdict_row(new, base), config_row(new, base), flags_row(new, base)]
  bands = side_bands(new, base, config_same=rows[1].status != "MOVED")
  notes += [f"{side}: {b.reason}" for side, b in bands.items()]
  if new.precision != base.precision:
    notes.append(f"precision {base.precision} -> {new.precision} (a configuration difference: the gate fails); the "
                 f"per-step gates use {precision}'s (looser) band")
  if base.series is None or new.series is None:
    notes.append(f"{'the baseline' if base.series is None else 'the new run'} is a card: per-step series are not "
                 "compared; each pair's max |Δloss| and each side's loss at the card's steps are gated instead")
  for side in base.sides:
    if side not in new.sides:
      rows.append(GateRow("side", side, "ran", "absent", "", "every baseline side runs", "MOVED",
                          f"run the new comparison with --sides including {side}"))
      continue
    rows += side_rows(side, new, base, precision, cross, bands[side])
  if base.series is None or new.series is None:
    rows += [pair_row(pair, new.max_dloss.get(pair), b, precision, pair_bitwise(pair, bands))
             for pair, b in base.max_dloss.items()]
  extra = [s for s in new.sides if s not in base.sides]
  if extra:
    notes.append(f"sides not in the baseline (not gated): {', '.join(extra)}")
  return GateResult(baseline=str(base.source), new=str(new.source), rows=rows, notes=notes, cross_machine=cross,
                    bands=bands)


def _unfinished_result(new: Snapshot, base: Snapshot) -> GateResult:
  """The gate of a new run that did not finish: one FAIL row (the run, why), no per-metric rows: a figure missing
  because the run stopped is not a regression of that figure."""
  row = GateRow("finished", "", "finished", "not finished", new.unfinished,
                "a run that stopped early is no measurement: it cannot pass", "FAIL",
                "rerun it to completion, then gate it")
  return GateResult(baseline=str(base.source), new=str(new.source), rows=[row], cross_machine=False,
                    notes=[f"the new run did not finish: {new.unfinished}; no metric is compared"])


def write_gate(result: GateResult, folder: str | Path) -> dict[str, Path]:
  """Writes gate.json and gate.md into `folder` (each through a temporary file). Returns name -> path.
  Raises OSError when a file cannot be written."""
  folder = Path(folder)
  paths = {"json": folder / "gate.json", "md": folder / "gate.md"}
  atomic_write(paths["json"], lambda p: p.write_text(json.dumps(result.to_json(), indent=2)))
  atomic_write(paths["md"], lambda p: p.write_text(result.to_markdown()))
  return paths


def read_gate(run_dir: str | Path) -> tuple[str, bool | None]:
  """The outcome of the regression gate stored in <run_dir>/gate.json (written by `parity compare --baseline`):
  (its one-line message, whether it passed); ('', None) when there is none or it cannot be read. The comparison page
  uses it so that a run that failed its gate is never counted as green."""
  try:
    g = json.loads((Path(run_dir) / "gate.json").read_text(encoding="utf-8"))
  except (OSError, ValueError):
    return "", None
  if not isinstance(g, dict):
    return "", None
  passed = g.get("passed")
  return str(g.get("message") or ""), passed if isinstance(passed, bool) else None
