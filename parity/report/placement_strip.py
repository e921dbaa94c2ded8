"""The copy schedule strip of report.html: one bar per host<->device copy of a JAX side's compiled step,
from its start to its done position in the entry computation's schedule, coloured by direction, labelled with the
tensor class and bytes. Plain inline SVG (no script, no stylesheet of its own); input: placement.json 'transfers'
(parity.report.placement_view reads and checks it)."""
from __future__ import annotations

import html
from typing import Any

from parity.report.cells import fmt, fmt_bytes

__all__ = ["COLOURS", "strip_extent", "bar_x", "strip_svg", "WIDTH", "GUTTER", "PAD"]

COLOURS = {"h2d": "#1f6fb4", "d2h": "#d9661f"}
"""Bar colour per direction (h2d: host to device, d2h: device to host)."""
WIDTH, GUTTER, PAD, TOP, ROW, BAR = 960, 250, 16, 34, 16, 10
"""SVG user units: total width, the label gutter left of the axis, right padding, the legend band above the bars,
the row pitch and the bar height."""


def strip_extent(transfers: dict[str, Any]) -> tuple[int, bool]:
  """(positions the axis spans, whether that is the entry computation's instruction count): transfers
  'entry_instructions' when placement.json records it (a whole number >= every copy's done), else the last copy's
  done position (at least 1)."""
  last = max((c["done"] for c in transfers.get("copies") or []), default=0)
  n = transfers.get("entry_instructions")
  if isinstance(n, int) and not isinstance(n, bool) and n >= max(last, 1):
    return n, True
  return max(last, 1), False


def bar_x(pos: float, extent: int) -> float:
  """The x coordinate (SVG user units) of schedule position `pos` on an axis of `extent` positions, 2 decimals."""
  return round(GUTTER + pos / extent * (WIDTH - GUTTER - PAD), 2)


def _bar(i: int, c: dict, extent: int) -> str:
  y = TOP + i * ROW
  x0, x1 = bar_x(c["start"], extent), bar_x(c["done"], extent)
  tip = (f"{c['tensor']}: {c['direction']}, {fmt_bytes(c['bytes'])}, positions {c['start']} to {c['done']}, "
         f"{fmt(c['window_ops'])} ops in its window")
  label = f"{c['class']} {fmt_bytes(c['bytes'])}"
  return (f'<text x="{GUTTER - 6}" y="{y + BAR - 1}" text-anchor="end" font-size="11">{html.escape(label)}</text>'
          f'<rect class="copy {c["direction"]}" data-start="{c["start"]}" data-done="{c["done"]}" x="{x0}" y="{y}" '
          f'width="{max(round(x1 - x0, 2), 1.5)}" height="{BAR}" fill="{COLOURS[c["direction"]]}">'
          f'<title>{html.escape(tip)}</title></rect>')


def _axis(y: float, extent: int, counted: bool) -> str:
  ticks = "".join(f'<line x1="{bar_x(t, extent)}" y1="{y}" x2="{bar_x(t, extent)}" y2="{y + 4}" stroke="#555"/>'
                  f'<text x="{bar_x(t, extent)}" y="{y + 15}" text-anchor="middle" font-size="10">{t}</text>'
                  for t in sorted({round(extent * k / 4) for k in range(5)}))
  what = ("instruction position in the entry computation" if counted else
          "instruction position in the entry computation (axis ends at the last copy's done position: the "
          "instruction count is not recorded)")
  return (f'<line x1="{GUTTER}" y1="{y}" x2="{WIDTH - PAD}" y2="{y}" stroke="#555"/>{ticks}'
          f'<text x="{GUTTER}" y="{y + 30}" font-size="11">{html.escape(what)}</text>')


def strip_svg(transfers: dict[str, Any]) -> str:
  """The strip of placement.json 'transfers' (known: true) as an <svg> element: one <rect class="copy DIRECTION">
  per copy (sorted by start, then done; data-start/data-done its positions), x from `bar_x(start)` to
  `bar_x(done)` (at least 1.5 units wide), its label left of the axis, its full tensor name in a <title>."""
  copies = sorted(transfers.get("copies") or [], key=lambda c: (c["start"], c["done"]))
  extent, counted = strip_extent(transfers)
  height = TOP + len(copies) * ROW + 44
  legend = "".join(f'<rect x="{GUTTER + k * 170}" y="8" width="14" height="{BAR}" fill="{COLOURS[d]}"/>'
                   f'<text x="{GUTTER + k * 170 + 20}" y="17" font-size="11">{d} ({what})</text>'
                   for k, (d, what) in enumerate((("h2d", "host to device"), ("d2h", "device to host"))))
  bars = "".join(_bar(i, c, extent) for i, c in enumerate(copies))
  return (f'<svg xmlns="http://www.w3.org/2000/svg" class="copy-strip" viewBox="0 0 {WIDTH} {height}" '
          f'width="{WIDTH}" height="{height}" role="img" aria-label="host-device copy schedule" '
          f'font-family="system-ui, sans-serif">{legend}{bars}{_axis(TOP + len(copies) * ROW + 2, extent, counted)}'
          "</svg>")
