"""Printing the regression gate (`parity compare --baseline`, `parity check`): its table, notes and outcome."""
from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from parity.history.gate import GateResult

__all__ = ["print_gate"]


def print_gate(result: GateResult, con: Console) -> None:
  """The gate's table (metric, side, baseline, new, change, gate, result), its notes and the one-line outcome
  (parity.history.gate.GateResult), on console `con`. Every cell is printed as written (rich.markup.escape): a key or
  value "[a, b]" is not rich markup."""
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
  con.print(f"[{style}]{escape(result.message())}[/{style}]", soft_wrap=True)
