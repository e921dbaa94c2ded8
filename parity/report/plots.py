"""Figures of a report (matplotlib, Agg backend): each function takes plain data and returns a Figure.

Reusable by any page (the single-run report, the multi-run page): `to_svg` / `to_png` turn a Figure into inline
SVG text or PNG bytes. Conventions every figure follows:
  * curves of different sides differ by line style and marker, never by an offset of the data; when they coincide
    the axes say "curves coincide" so a reader knows why only one line is visible;
  * legends sit outside the data (below the axes);
  * titles name the run (preset / plan / precision) and are wrapped at word boundaries, never cut.
Figures are closed by `to_svg` / `to_png`; callers that keep a Figure must close it themselves.
No warning of matplotlib or numpy raised while a figure is built or rendered reaches the user (`quiet`): a
cosmetic remark of the plotting library, naming an internal file, says nothing about parity.
"""
from __future__ import annotations

import functools
import io
import math
import textwrap
import warnings
from typing import Callable, Mapping, Sequence, TypeVar

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

__all__ = ["STYLES", "quiet", "wrap_title", "to_svg", "to_png", "line_figure", "loss_figure", "delta_figure",
           "memory_figure", "throughput_figure", "across_runs_figure", "coincide", "finite"]

STYLES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1, 1, 1)), "v"), ((0, (1, 3)), "x"))
"""(line style, marker) per curve index: identical curves stay distinguishable without moving any data."""
WIDTH_IN = 10.0
"""Figure width in inches (1100 px at the 110 dpi of the PNGs)."""
_F = TypeVar("_F", bound=Callable)


def quiet(fn: _F) -> _F:
  """`fn` with every warning raised inside it ignored (each figure builder and renderer of this module)."""
  @functools.wraps(fn)
  def run(*args, **kwargs):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      return fn(*args, **kwargs)
  return run  # type: ignore[return-value]


def finite(v) -> float:
  """A plotted value: numbers as float, anything else (None, 'inf' strings of report.json) as NaN."""
  return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else float("nan")


def wrap_title(text: str, width_in: float = WIDTH_IN, fontsize: float = 10.0) -> str:
  """`text` wrapped at word boundaries to fit a figure `width_in` inches wide (about 0.55 em per character)."""
  chars = max(20, int(width_in * 72 / (fontsize * 0.55)))
  return "\n".join(textwrap.fill(part, chars, break_long_words=False, break_on_hyphens=False)
                   for part in text.split("\n"))


def _style(i: int) -> dict:
  """Curve i: its line style and hollow marker, drawn wider and larger the earlier it comes, so a later curve drawn
  on top of an identical one leaves the earlier visible around it."""
  ls, marker = STYLES[i % len(STYLES)]
  return {"ls": ls, "marker": marker, "lw": max(0.9, 3.0 - 0.7 * i), "ms": max(3.5, 11.0 - 2.5 * i), "mfc": "none",
          "mew": 1.3}


def _markevery(i: int, n_curves: int, n_points: int) -> tuple[int, int] | None:
  """Markers of every curve on the same points, every (n_points // 12)-th from step 0; None (every point) for short
  series. Not staggered per curve: staggered markers on coinciding curves read as the sides disagreeing at those
  steps (a newcomer read three values at steps 0-2 off one grad-norm curve); on shared points the markers of
  coinciding curves nest (earlier curves' are larger, parity.report.plots._style), which reads as agreement."""
  if n_points <= 12:
    return None
  return (0, max(1, n_points // 12))


def _legend_below(fig: Figure, ax, ncol: int | None = None) -> None:
  handles, labels = ax.get_legend_handles_labels()
  if handles:
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=ncol or min(3, len(labels)),
              fontsize=8, frameon=False)


def _new(title: str, ncols: int = 1, height_in: float = 3.6) -> tuple[Figure, list]:
  fig, axes = plt.subplots(1, ncols, figsize=(WIDTH_IN, height_in), squeeze=False)
  text = wrap_title(title)
  fig.suptitle(text, fontsize=10)
  # room above the axes for every line of the title and an axes title below it (a long run title wraps)
  fig.subplots_adjust(top=1 - (14 * (text.count("\n") + 1) + 26) / (72 * height_in))
  return fig, list(axes[0])


def coincide(curves: Mapping[str, tuple[Sequence, Sequence]], rel: float = 1e-3) -> float | None:
  """max |a - b| over the common x of every pair of curves, when it is below `rel` × the y range of all curves
  (the curves would draw on top of each other), else None. curves: label -> (xs, ys)."""
  vals = [finite(y) for _, ys in curves.values() for y in ys]
  vals = [v for v in vals if not math.isnan(v)]
  if len(curves) < 2 or not vals:
    return None
  span = (max(vals) - min(vals)) or abs(max(vals)) or 1.0
  worst = 0.0
  items = [dict(zip(xs, map(finite, ys))) for xs, ys in curves.values()]
  for i, a in enumerate(items):
    for b in items[i + 1:]:
      common = [x for x in a if x in b and not (math.isnan(a[x]) or math.isnan(b[x]))]
      if not common:
        return None
      worst = max(worst, max(abs(a[x] - b[x]) for x in common))
  return worst if worst <= rel * span else None


@quiet
def line_figure(curves: Mapping[str, tuple[Sequence, Sequence]], *, title: str, ylabel: str, xlabel: str = "step",
                log: bool = False, points: Mapping[str, tuple[Sequence, Sequence]] | None = None,
                note: str | None = None, vlines: Mapping[str, Sequence] | None = None) -> Figure:
  """One axes of curves (label -> (xs, ys); None/non-finite values leave gaps), each in its own STYLES entry;
  `points` (label -> (xs, ys)) drawn as markers only (e.g. skipped steps, held-out loss). When the curves
  coincide the axes say so (with the largest difference); `note` adds a line under it. vlines: label -> x values
  marked by a vertical band across the axes (e.g. the steps a side skipped)."""
  fig, (ax,) = _new(title)
  n = len(curves)
  for i, (label, (xs, ys)) in enumerate(curves.items()):
    ys = [finite(y) for y in ys]
    ax.plot(list(xs), ys, label=label, markevery=_markevery(i, n, len(ys)), **_style(i))
  for j, (label, (xs, ys)) in enumerate((points or {}).items()):
    ax.plot(list(xs), [finite(y) for y in ys], ls="none", marker="*x+P"[j % 4], ms=max(5, 13 - 3 * j), label=label)
  for k, (label, xs) in enumerate((vlines or {}).items()):
    for n_x, x in enumerate(xs):
      ax.axvspan(x - 0.3, x + 0.3, color=f"C{3 + k}", alpha=0.15, lw=0, label=label if n_x == 0 else None)
  if log:
    ax.set_yscale("log")
  if xlabel == "step":
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  lines = []
  same = coincide(curves)
  if same is not None:
    xsets = [set(xs) for xs, _ in curves.values()]
    where = "" if all(x == xsets[0] for x in xsets) else f" on the {len(set.intersection(*xsets))} steps all ran"
    lines.append(f"curves coincide{where} (largest difference {same:.3g})")
  if note:
    lines.append(note)
  if lines:  # above the axes, never over the data
    ax.set_title("; ".join(lines), loc="left", fontsize=8, color="0.25")
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3)
  _legend_below(fig, ax)
  return fig


@quiet
def loss_figure(sides: Mapping[str, Mapping], *, title: str) -> Figure:
  """Training loss of every side overlaid (+ held-out loss as stars). sides: name -> report.json series
  ({step, loss, val_step, val_loss}) plus an optional 'status' used in the label when not 'ok'."""
  curves = {(n if s.get("status", "ok") == "ok" else f"{n} ({s['status']})"): (s["step"], s["loss"])
            for n, s in sides.items()}
  points = {f"{n} held-out": (s["val_step"], s["val_loss"]) for n, s in sides.items() if s.get("val_step")}
  return line_figure(curves, title=title, ylabel="loss (nats/token)", points=points)


@quiet
def delta_figure(pairs: Mapping[str, tuple[Sequence, Sequence]], *, title: str, tolerance: float | None,
                 tolerance_label: str = "tolerance", envelopes: Mapping[str, tuple[Sequence, Sequence]] | None = None,
                 ylabel: str = "|Δloss| (nats)") -> Figure:
  """Per-step |difference| of each pair on a log scale, with the tolerance line and the noise envelopes.

  pairs, envelopes: label -> (steps, |Δ| per step). Exact zeros cannot sit on a log axis: they are drawn as
  markers on a floor line labelled "= 0" (a decade below the smallest nonzero value or the tolerance), not as
  spikes down to an arbitrary 1e-12."""
  from matplotlib.ticker import MaxNLocator
  fig, (ax,) = _new(title)
  series = {k: [finite(v) for v in ys] for k, (_, ys) in {**pairs, **(envelopes or {})}.items()}
  pos = [v for ys in series.values() for v in ys if v > 0]
  ref = [v for v in (min(pos) if pos else None, tolerance) if v]
  floor = min(ref) / 30 if ref else 1e-12  # off the decade ticks, so the line reads as "= 0" only
  n = len(pairs)
  for i, (label, (xs, ys)) in enumerate(pairs.items()):
    ys = [finite(y) for y in ys]
    st = _style(i)
    ax.plot(list(xs), [y if y > 0 else float("nan") for y in ys], label=label,
            markevery=_markevery(i, n, len(ys)), **st)
    zx = [x for x, y in zip(xs, ys) if y == 0]
    if zx:
      ax.plot(zx, [floor] * len(zx), ls="none", marker=st["marker"], ms=6, mfc="none", color=ax.lines[-1].get_color(),
              label=f"{label}: exactly 0 ({len(zx)} steps)")
  for j, (label, (xs, ys)) in enumerate((envelopes or {}).items()):
    ax.plot(list(xs), [y if finite(y) > 0 else float("nan") for y in map(finite, ys)], ls=":", lw=1.1,
            color=str(0.25 + 0.2 * (j % 3)), marker=".", label=label)
  if tolerance:
    ax.axhline(tolerance, color="crimson", ls="--", lw=1.2, label=f"{tolerance_label} {tolerance:.3g}")
  ax.set_yscale("log")
  ax.axhline(floor, color="0.6", lw=0.8)
  ax.text(1.005, floor, "= 0", transform=ax.get_yaxis_transform(), va="center", fontsize=8, color="0.35")
  top = max([*pos, tolerance or 0.0, floor]) * 3  # both limits set: never equal (one point, or only zeros)
  ax.set_autoscaley_on(False)  # the autoscaler would first try equal limits when only the floor line is drawn
  ax.set_ylim(floor / 3, top)
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  ax.set_xlabel("step")
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3, which="both")
  _legend_below(fig, ax, ncol=2)
  return fig


def _measured_categories(rows: Sequence[Mapping]) -> set[tuple[str, str]]:
  """(side, category) pairs a side measured (any memory kind with a measured figure, 0 included); a measured 'state'
  row (JAX params and opt_state in one memory kind, measured together) covers params and optimizer moments."""
  out = {(r["side"], r["category"]) for r in rows if r["measured"] is not None}
  return out | {(s, c) for s, cat in out if cat == "state" for c in ("params", "optimizer_moments")}


@quiet
def memory_figure(rows: Sequence[Mapping], *, title: str) -> Figure:
  """Memory per side as stacked bars, predicted beside measured: left by category (params, gradients, fp32 master,
  optimizer moments, activations, ...), right by memory kind (device / host). Every side's bars stack the same
  categories in the same colours; a predicted segment of a category the side does not measure (activations; the
  JAX gradients, inside the step) is cross-hatched ("predicted only"), so the measured bar beside it is read as
  lacking exactly those. Each bar carries its total (MiB) on top.

  rows: {side, category, memory_kind, predicted, measured} (bytes; None = not known), e.g. report.json
  parity.sizing.measured.predicted_vs_measured; 'peak_rss' rows (whole-process figures) are left out."""
  from matplotlib.patches import Patch
  rows = [r for r in rows if r["category"] != "peak_rss"]
  fig, axes = _new(title, ncols=2, height_in=4.2)
  sides = list(dict.fromkeys(r["side"] for r in rows))
  xs = [3 * i + j for i in range(len(sides)) for j in (0, 1)]  # a gap between sides: pairs read as pairs
  cmap = plt.get_cmap("tab10")
  measured = _measured_categories(rows)
  for ax, key in zip(axes, ("category", "memory_kind")):
    stacks = list(dict.fromkeys(r[key] for r in rows if (r["predicted"] or r["measured"])))
    bottom = [0.0] * len(xs)
    predicted_only, labelled = False, {}
    for ci, cat in enumerate(stacks):
      for xi, (s, w) in enumerate((s, w) for s in sides for w in ("predicted", "measured")):
        v = sum((r[w] or 0) for r in rows if r["side"] == s and r[key] == cat) / 2**20
        if not v:
          continue
        only = key == "category" and w == "predicted" and (s, cat) not in measured
        predicted_only |= only
        hatch = "xx" if only else ("//" if key == "memory_kind" and "host" in cat else None)
        ax.bar(xs[xi], v, bottom=bottom[xi], color=cmap(ci % 10), hatch=hatch, edgecolor="white")
        if cat not in labelled:  # a plain swatch per category (the first segment drawn may be hatched)
          labelled[cat] = Patch(facecolor=cmap(ci % 10), edgecolor="white",
                                hatch="//" if key == "memory_kind" and "host" in cat else None)
        bottom[xi] += v
    for x, b in zip(xs, bottom):
      if b:
        ax.text(x, b, f"{b:.3g}", ha="center", va="bottom", fontsize=7)
    for i, s in enumerate(sides):
      if not any(r["side"] == s and r["measured"] is not None for r in rows):
        ax.text(3 * i + 1, 0, "not\nmeasured", ha="center", va="bottom", fontsize=7, color="0.4")
      ax.text(3 * i + 0.5, -0.13, s, transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize=8,
              fontweight="bold")
    ax.set_xticks(xs, ["pred.", "meas."] * len(sides), fontsize=7)
    ax.set_ylim(0, max(bottom + [1e-3]) * 1.15)
    ax.set_ylabel("MiB")
    ax.set_title(f"by {key.replace('_', ' ')} (pred.: predicted, meas.: measured)", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    handles = list(labelled.values())
    labels = ["params + optimizer moments (measured together)" if c == "state" else c.replace("_", " ")
              for c in labelled]
    if predicted_only:
      handles.append(Patch(facecolor="white", edgecolor="0.3", hatch="xx"))
      labels.append("cross-hatched: predicted only (not measured)")
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, fontsize=8, frameon=False)
  return fig


@quiet
def throughput_figure(step_times: Mapping[str, Sequence[float]], tokens_per_s: Mapping[str, float | None], *,
                      title: str, note: str | None = None) -> Figure:
  """Left: tokens/s per side (bars); right: the distribution of per-step times after warmup (box + every step as a
  dot; log scale when the sides differ by more than 20x). step_times: side -> seconds per step."""
  fig, (ax1, ax2) = _new(title, ncols=2, height_in=3.8)
  names = list(step_times)
  tps = [finite(tokens_per_s.get(n)) for n in names]
  ax1.bar(range(len(names)), [0 if math.isnan(v) else v for v in tps], color=[f"C{i}" for i in range(len(names))])
  for i, v in enumerate(tps):
    ax1.text(i, 0 if math.isnan(v) else v, "n/a" if math.isnan(v) else f"{v:,.0f}", ha="center", va="bottom",
             fontsize=8)
  ax1.set_xticks(range(len(names)), names)
  ax1.set_ylabel("tokens/s")
  ax1.set_title("throughput", fontsize=9)
  data = [[t for t in map(finite, step_times[n]) if not math.isnan(t)] for n in names]
  shown = [(i, d) for i, d in enumerate(data) if d]
  if shown:
    ax2.boxplot([d for _, d in shown], positions=[i for i, _ in shown], widths=0.5, showfliers=False)
    for i, d in shown:
      ax2.plot([i + 0.18 * ((k % 5) - 2) / 2 for k in range(len(d))], d, ls="none", marker=STYLES[i % 6][1],
               ms=4, mfc="none", color=f"C{i}")
    lo, hi = min(min(d) for _, d in shown), max(max(d) for _, d in shown)
    if lo > 0 and hi / lo > 20:
      ax2.set_yscale("log")
  ax2.set_xticks(range(len(names)), names)
  ax2.set_ylabel("seconds per step")
  ax2.set_title("step time after warmup (each dot one step)", fontsize=9)
  for ax in (ax1, ax2):
    ax.grid(alpha=0.3, axis="y")
  if note:
    fig.text(0.5, 0.005, wrap_title(note, fontsize=8), ha="center", va="bottom", fontsize=8, color="0.3")
  return fig


@quiet
def across_runs_figure(runs: Sequence[str], values: Mapping[str, Sequence], *, title: str, ylabel: str,
                       log: bool = False) -> Figure:
  """One metric across runs (a sweep, or before/after an upgrade): x = run labels in order, one styled line per
  series (e.g. per side or per pair). values: series label -> one value per run (None: not measured)."""
  fig, (ax,) = _new(title)
  for i, (label, ys) in enumerate(values.items()):
    ax.plot(range(len(runs)), [finite(y) for y in ys], label=label, **_style(i))
  ax.set_xticks(range(len(runs)), [textwrap.fill(r, 18) for r in runs], fontsize=8)
  if log:
    ax.set_yscale("log")
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3)
  _legend_below(fig, ax)
  same = coincide({k: (list(range(len(runs))), v) for k, v in values.items()})
  if same is not None:
    ax.set_title(f"curves coincide (largest difference {same:.3g})", loc="left", fontsize=8, color="0.25")
  return fig


@quiet
def to_svg(fig: Figure, salt: str, close: bool = True) -> str:
  """The figure as standalone SVG text (glyphs as paths: no font needed), closed afterwards unless `close` is
  False. `salt` makes its element ids unique on a page holding several SVGs (use the figure's key)."""
  buf = io.StringIO()
  with matplotlib.rc_context({"svg.hashsalt": salt, "svg.fonttype": "path"}):
    fig.savefig(buf, format="svg", bbox_inches="tight")
  if close:
    plt.close(fig)
  text = buf.getvalue()
  return text[text.index("<svg"):]


@quiet
def to_png(fig: Figure, dpi: int = 110, close: bool = True) -> bytes:
  """The figure as PNG bytes (legend and wrapped title kept: tight bounding box), closed afterwards unless `close`
  is False."""
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
  if close:
    plt.close(fig)
  return buf.getvalue()
