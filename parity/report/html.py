"""HTML building blocks for self-contained report pages: every function returns a string, the page needs no network,
no server and no script (figures are inline SVG from parity.report.plots.to_svg).

Text is escaped unless wrapped in `Raw` (already HTML). Used by the single-run page (parity.report.page) and the
multi-run page; keep it free of report.json knowledge.
"""
from __future__ import annotations

import html as _html
from typing import Iterable, Sequence

__all__ = ["Raw", "esc", "page", "table", "section", "figure", "banner", "kv_table", "details", "code", "badge",
           "CSS"]


class Raw(str):
  """A string that is already HTML: inserted as is by `table`, `kv_table`, `section`..."""


def esc(x) -> str:
  """`x` as HTML text: Raw as is, None as 'n/a', anything else str() and escaped."""
  if isinstance(x, Raw):
    return str(x)
  return _html.escape("n/a" if x is None else str(x))


CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;margin:0;color:#1d1d1f;
  background:#fafafa}
main{max-width:1180px;margin:0 auto;padding:18px 28px 60px}
h1{font-size:22px;margin:8px 0 4px} h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
h3{font-size:15px;margin:18px 0 6px}
.banner{border-radius:8px;padding:14px 18px;margin:12px 0 6px;font-size:16px;border:1px solid}
.banner.pass{background:#e9f7ee;border-color:#7cc493} .banner.fail{background:#fdecec;border-color:#e08a8a}
.banner.warn{background:#fff6e0;border-color:#e6c36a}
.banner .sub{font-size:13px;color:#444;margin-top:6px}
table{border-collapse:collapse;margin:6px 0 12px;background:#fff;font-size:13px}
th,td{border:1px solid #d6d6d6;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f0f0f3;font-weight:600} td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
tr.fail td{background:#fff1f1} tr.info td{color:#555}
.badge{display:inline-block;border-radius:4px;padding:0 6px;font-size:12px;font-weight:600}
.badge.pass{background:#d3f0dc;color:#17612f} .badge.fail{background:#f8d4d4;color:#8a1616}
.badge.info{background:#e6e6ea;color:#444}
figure{margin:10px 0 18px;background:#fff;border:1px solid #e2e2e2;border-radius:6px;padding:8px}
figure svg{width:100%;max-width:1100px;height:auto;display:block} figcaption{font-size:12px;color:#555;margin-top:4px}
code,pre{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px}
pre{background:#f4f4f6;padding:8px;overflow-x:auto;white-space:pre-wrap;word-break:break-word}
.note{color:#555;font-size:13px} details{margin:4px 0} summary{cursor:pointer;color:#333}
.kv th{width:220px}
"""


def page(title: str, body: str, *, css: str = CSS) -> str:
  """A complete HTML5 document: `title` (escaped) and `body` (HTML) with the inline stylesheet; no external
  resource of any kind."""
  return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
          f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
          f"<title>{esc(title)}</title><style>{css}</style></head>\n<body><main>\n{body}\n</main></body></html>\n")


def table(headers: Sequence[str], rows: Iterable[Sequence], *, row_classes: Sequence[str | None] | None = None,
          numeric: Sequence[int] = ()) -> str:
  """A <table>: `headers` (escaped), `rows` of cells (escaped unless Raw); `row_classes` per row ('fail', 'info');
  columns listed in `numeric` are right-aligned."""
  rows = list(rows)
  classes = list(row_classes or [None] * len(rows))
  head = "".join(f"<th>{esc(h)}</th>" for h in headers)
  body = []
  for r, cls in zip(rows, classes):
    cells = "".join(f"<td class=\"num\">{esc(c)}</td>" if i in numeric else f"<td>{esc(c)}</td>"
                    for i, c in enumerate(r))
    body.append(f"<tr class=\"{cls}\">{cells}</tr>" if cls else f"<tr>{cells}</tr>")
  return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def kv_table(pairs: Iterable[tuple[str, object]]) -> str:
  """A two-column key/value table (keys escaped, values escaped unless Raw)."""
  rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in pairs)
  return f"<table class=\"kv\"><tbody>{rows}</tbody></table>"


def section(title: str, body: str, *, anchor: str | None = None, level: int = 2) -> str:
  """A heading (escaped) followed by `body` (HTML); `anchor` sets the heading's id for in-page links."""
  ident = f" id=\"{esc(anchor)}\"" if anchor else ""
  return f"<section><h{level}{ident}>{esc(title)}</h{level}>\n{body}\n</section>\n"


def figure(svg: str, caption: str | None = None, *, key: str | None = None) -> str:
  """An inline SVG figure (from parity.report.plots.to_svg) with an optional caption (escaped)."""
  cap = f"<figcaption>{esc(caption)}</figcaption>" if caption else ""
  data = f" data-plot=\"{esc(key)}\"" if key else ""
  return f"<figure{data}>{svg}{cap}</figure>"


def banner(kind: str, sentence: str, sub: str | None = None) -> str:
  """The verdict box: kind 'pass' | 'fail' | 'warn'; `sentence` and `sub` escaped unless Raw."""
  extra = f"<div class=\"sub\">{esc(sub)}</div>" if sub else ""
  return f"<div class=\"banner {esc(kind)}\" id=\"verdict\"><strong>{esc(sentence)}</strong>{extra}</div>"


def badge(kind: str, text: str) -> Raw:
  """A small coloured label: kind 'pass' | 'fail' | 'info'."""
  return Raw(f"<span class=\"badge {esc(kind)}\">{esc(text)}</span>")


def details(summary: str, body: str) -> Raw:
  """A collapsed block (no script: the browser's <details>): `summary` escaped, `body` HTML."""
  return Raw(f"<details><summary>{esc(summary)}</summary>{body}</details>")


def code(text: str, block: bool = False) -> Raw:
  """`text` as inline <code> or a <pre> block (escaped)."""
  return Raw(f"<pre>{esc(text)}</pre>" if block else f"<code>{esc(text)}</code>")
