"""Printing the regression gate (`parity compare --baseline`, `parity check`): its table, notes and outcome."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from parity.history.gate import GateResult

__all__ = ["print_gate", "pass_summary"]


def pass_summary(result: GateResult, table: Path | str | None = None) -> str:
  """The counts of a passing gate, the rest of its one outcome line: '97 checks within their bounds (3 skipped, 2
  reported; 4 notes); the table and notes: <table> or --verbose' (`table`: gate.md when the gate wrote one)."""
  counts = Counter(r.status for r in result.rows)
  within = counts.pop("ok", 0)
  extra = [f"{n} {status}" for status, n in sorted(counts.items())]
  extra += [f"{len(result.notes)} note{'s' if len(result.notes) != 1 else ''}"] if result.notes else []
  where = f"{table} or --verbose" if table else "--verbose"
  return (f"{within} check{'s' if within != 1 else ''} within their bounds"
          + (f" ({', '.join(extra)})" if extra else "") + f"; the table{' and notes' if result.notes else ''}: {where}")


def print_gate(result: GateResult, con: Console, *, verbose: bool = False, table: Path | str | None = None) -> None:
  """The gate's table (metric, side, baseline, new, change, gate, result), its notes and its one outcome line
  (parity.history.gate.GateResult), on console `con`. A passing gate prints only that line, with its counts and
  where the table is (pass_summary), unless `verbose`; a failing one always prints everything, the outcome line
  naming `table` (gate.md) when the gate wrote one. Every cell is printed as written (rich.markup.escape): a key or
  value "[a, b]" is not rich markup."""
  if result.passed and not verbose:
    con.print(f"[bold green]{escape(result.message())}[/bold green]; {escape(pass_summary(result, table))}",
              soft_wrap=True)
    return
  t = Table(title=f"regression gate — {escape(str(result.new))} against {escape(str(result.baseline))}")
  for col in ("metric", "side", "baseline", "new", "change", "gate", "result"):
    t.add_column(col)
  for r in result.rows:
    res = f"[red]{r.status}[/red]" if r.status in ("MOVED", "FAIL") else r.status
    t.add_row(*(escape(str(x)) for x in (r.metric, r.side, r.baseline, r.new, r.change, r.gate)),
              res + (f" ({escape(str(r.note))})" if r.note else ""))
  con.print(t)
  for n in result.notes:
    con.print(f"- {escape(str(n))}", soft_wrap=True)
  style = "bold green" if result.passed else "bold red"
  where = f"; the table: {escape(str(table))} (also gate.json)" if table else ""
  con.print(f"[{style}]{escape(result.message())}[/{style}]{where}", soft_wrap=True)
