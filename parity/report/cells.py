"""Plain-text cells of the report pages: numbers, bytes, parameter counts, pair labels, clauses. Nothing here knows
report.json's layout or formats for one medium (no HTML, no Markdown): callers escape the text."""
from __future__ import annotations

import json
import math

__all__ = ["fmt_bytes", "fmt", "pair_label", "fmt_count", "first_clause", "compact"]


def fmt_bytes(n) -> str:
  """Bytes in binary units ('1.5 MiB'); 'n/a' for None."""
  if n is None:
    return "n/a"
  n = float(n)
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n:.1f} TiB"


def fmt(v, spec: str = ".3g") -> str:
  """A number formatted with `spec`; None -> 'n/a'; text as is."""
  if v is None:
    return "n/a"
  if isinstance(v, str):
    return v
  if isinstance(v, float) and not math.isfinite(v):
    return str(v)
  if isinstance(v, int) and not isinstance(v, bool) and spec == ".3g":
    return str(v)  # an integer (a pid, a step, a count) whole, not 1.23e+04
  return format(v, spec)


def pair_label(sides) -> str:
  """'jax vs torch' for a two-side check, the one side otherwise ('jax#determinism' names the rerun)."""
  sides = list(sides or [])
  if len(sides) == 2 and not str(sides[1]).startswith(f"{sides[0]}#"):
    return f"{sides[0]} vs {sides[1]}"
  return str(sides[0]) if sides else ""


def fmt_count(n: int) -> str:
  """A parameter count as a reader takes it: '120.6 K', '1.56 B', '999'."""
  for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
    if n >= div:
      return f"{n / div:.4g} {unit}"
  return str(n)


def first_clause(text: str) -> str:
  """`text` up to its first ';' outside brackets (a ';' inside '(...)' does not end the clause, so the clause keeps
  its brackets balanced); the whole text when there is none."""
  depth = 0
  for i, ch in enumerate(text):
    depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(ch, 0)
    if ch == ";" and depth <= 0:
      return text[:i].rstrip()
  return text


def compact(v) -> str:
  """A JSON value as one line of text (at most 600 characters: longer text ends in "...")."""
  text = json.dumps(v, default=str, separators=(", ", ": "))
  return text if len(text) <= 600 else text[:597] + "..."


