"""Matplotlib charts of reports. Never touches pyplot state or rcParams; every plot
function takes ``ax=None`` (a new :class:`matplotlib.figure.Figure` when None) and returns
the Axes.

Charts are drawn for a notebook in either theme: the figure and axes are transparent,
and text, ticks and reference lines are a mid grey that reads on a light and on a dark
background. Sizes on the axes are in binary units (KiB, MiB, GiB) of bytes.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..report import COLORS, MemoryReport, format_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["plot_breakdown", "breakdown_figure", "breakdown_chart", "plot_comparison",
           "plot_sweep", "plot_fit_map", "plot_timeline", "timeline_figure", "timeline_chart",
           "figure_png", "Chart", "merged_spans"]

# Text, ticks and reference lines: the grey with the most contrast on both a white and a
# dark (#111) page: 4.5:1 on white, 4.2:1 on #111 (#8a8a8a was 3.5:1 on white).
FG = "#767676"
# The card's capacity and what does not fit it: a red that reads on both backgrounds.
ALERT = "#e0483e"
# Light fills of the phases on the timeline (alpha applied when drawn).
PHASE_COLORS = {"forward": "#4c78a8", "backward": "#f58518", "recompute": "#b279a2",
                "optimizer": "#e45756"}
PHASE_SHORT = {"forward": "fwd", "backward": "bwd", "recompute": "recomp", "optimizer": "opt"}
UNATTRIBUTED = "#9a9a9a"
# A capacity more than this many times the highest value drawn is a note, not the scale.
CAPACITY_FACTOR = 3.0
DISPLAY_DPI = 100   # the size a chart is shown at (CSS pixels per inch)
RENDER_DPI = 200    # what its PNG holds: 2x, sharp on a high-density display


def _unit(n: int) -> tuple[float, str]:
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return scale, name
    return 1, "B"


def _new_axes(figsize: tuple[float, float]) -> "Axes":
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained", dpi=DISPLAY_DPI)
    return fig.add_subplot()


def _theme(ax: "Axes") -> None:
    """Transparent background; grey text, ticks and spines (readable in both themes)."""
    fig = ax.figure
    fig.patch.set_alpha(0.0)
    ax.set_facecolor("none")
    ax.tick_params(colors=FG, which="both")
    for side, spine in ax.spines.items():
        spine.set_color(FG)
        if side in ("top", "right"):
            spine.set_visible(False)
    ax.xaxis.label.set_color(FG)
    ax.yaxis.label.set_color(FG)
    ax.title.set_color(FG)


def _legend(ax: "Axes", handles: list, labels: list[str], **kw: Any) -> None:
    if not handles:
        return
    opts = dict(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="medium", frameon=False,
                labelcolor=FG)
    opts.update(kw)
    ax.legend(handles, labels, **opts)


def held_categories(reports: Sequence[MemoryReport]) -> list[str]:
    """Categories with bytes in any of ``reports``, in COLORS order."""
    return [c for c in COLORS if any(r.breakdown.get(c, 0) > 0 for r in reports)]


def _capacity_note(ax: "Axes", capacity: int, name: str | None) -> None:
    """The card's capacity, off the scale: an arrow pointing right at the value axis' far
    edge, labelled (horizontal bars)."""
    ax.annotate(f"{name or 'GPU'}: {format_bytes(capacity)}", xy=(1.0, 0.5),
                xycoords="axes fraction", xytext=(-24, 0), textcoords="offset points",
                ha="right", va="center", color=ALERT, fontsize="small",
                arrowprops=dict(arrowstyle="->", color=ALERT, lw=1.4))


def _capacity_handle(capacity: int, name: str | None) -> tuple[Any, str]:
    """A legend entry for a capacity above the chart's scale: a red up-arrow, labelled."""
    from matplotlib.lines import Line2D

    return Line2D([], [], ls="none", marker="^", ms=7, color=ALERT), above_scale(capacity, name)


def above_scale(capacity: int, name: str | None) -> str:
    """The legend's words for a capacity above the chart's scale."""
    return f"{name or 'GPU'}: {format_bytes(capacity)}\n(above this scale)"


# -- the breakdown at the peak ---------------------------------------------------------------
def plot_breakdown(report: MemoryReport, ax: "Axes | None" = None, *, label: str | None = None,
                   y: float = 0.0) -> "Axes":
    """One horizontal stacked bar: the peak split by category (only categories with bytes,
    each with its size in the legend), the level before the cell, the reserved peak, and
    the target GPU's capacity: as a line when it is near the bar, otherwise as a labelled
    arrow at the right edge (the capacity never becomes the scale of a small bar)."""
    if ax is None:
        ax = _new_axes((7, 1.9))
    _theme(ax)
    marks = [report.peak, report.before, report.reserved_peak or 0]
    top = max(max(marks), 1)
    cap = report.gpu_memory
    cap_on_scale = cap is not None and cap <= CAPACITY_FACTOR * top
    scale, unit = _unit(max(top, cap or 0) if cap_on_scale else top)
    handles, labels = [], []
    left = 0.0
    for name, value, share in report.breakdown_rows():
        if value > 0:
            bar = ax.barh(y, value / scale, left=left, color=COLORS[name], height=0.6)
            handles.append(bar)
            labels.append(f"{name} {format_bytes(value)} ({share:.0%})")
            left += value / scale
    if report.unattributed > 0:
        bar = ax.barh(y, report.unattributed / scale, left=left, color="none",
                      edgecolor=UNATTRIBUTED, hatch="//", height=0.6)
        handles.append(bar)
        labels.append(f"unattributed {format_bytes(report.unattributed)}")
    if report.before:
        handles.append(ax.axvline(report.before / scale, color=FG, lw=1.2, ls=":"))
        labels.append(f"before {format_bytes(report.before)}")
    if report.reserved_peak is not None:
        handles.append(ax.axvline(report.reserved_peak / scale, color=FG, lw=1.2, ls="--"))
        labels.append(f"reserved peak {format_bytes(report.reserved_peak)}")
    right = top / scale * 1.06
    if cap is not None:
        name = report.gpu_name or "GPU"
        if cap_on_scale:
            line = ax.axvline(cap / scale, color=ALERT, lw=1.5, label=name)
            handles.append(line)
            labels.append(f"{name} {format_bytes(cap)}")
            right = max(right, cap / scale * 1.04)
        else:
            _capacity_note(ax, cap, name)
            right = top / scale * 1.55  # room for the note beside the bar
    ax.set_yticks([y], [label or "at the peak"], color=FG)
    ax.set_xlabel(f"{unit} · peak {format_bytes(report.peak)} ({report.backend})")
    ax.set_xlim(0, right)
    ax.set_ylim(y - 0.6, y + 0.6)
    _legend(ax, handles, labels)
    return ax


def breakdown_figure(report: MemoryReport, **kwargs: Any) -> "Figure":
    """A new ``matplotlib.figure.Figure`` holding :func:`plot_breakdown` of ``report``."""
    ax = _new_axes((7, 1.9))
    plot_breakdown(report, ax, **kwargs)
    return ax.figure


# -- several reports side by side -----------------------------------------------------------
def plot_comparison(reports: Sequence[MemoryReport], labels: Sequence[str],
                    ax: "Axes | None" = None) -> "Axes":
    """One stacked bar per report (categories in the order of ``COLORS``), all on one
    scale, with each bar's peak (and reserved peak where known) marked and written above
    it, and the target GPU's capacity as context: a line when it is near the bars, a
    labelled note at the top edge when it would dwarf them. Only categories that hold
    bytes in some report are in the legend."""
    reports, labels = list(reports), [str(s) for s in labels]
    if not reports:
        raise ValueError("plot_comparison needs at least one report")
    if len(labels) != len(reports):
        raise ValueError(f"plot_comparison needs one label per report: {len(reports)} "
                         f"reports, {len(labels)} labels")
    if ax is None:
        ax = _new_axes((max(4.5, 1.5 + 1.3 * len(reports)), 3.4))
    _theme(ax)
    top, caps, on_scale, (scale, unit) = comparison_scale(reports)
    cats = held_categories(reports)
    width = 0.6
    xs = list(range(len(reports)))
    handles: dict[str, Any] = {}
    for x, r in zip(xs, reports):
        _comparison_bar(ax, x, r, cats, scale, width, handles)
    ymax = top / scale * 1.32  # room for the values written above the bars
    for cap, name in on_scale.items():
        ymax = max(ymax, _capacity_line(ax, cap, name, scale))
    ax.set_xticks(xs, labels, color=FG)
    ax.set_xlim(-0.6, len(reports) - 0.4)
    ax.set_ylim(0, ymax)
    ax.set_ylabel(unit)
    names = [c for c in cats if c in handles] + (["unattributed"] if "unattributed" in handles else [])
    hs, ls = [handles[n] for n in names], names
    for cap, name in caps.items():
        if cap not in on_scale:
            h, text = _capacity_handle(cap, name)
            hs.append(h)
            ls.append(text)
    _legend(ax, hs, ls)
    return ax


def comparison_scale(reports: Sequence[MemoryReport]) -> tuple[int, dict[int, str], dict[int, str], tuple[float, str]]:
    """The scale of a comparison of ``reports`` (this chart's and the panel's, see
    :mod:`memmagic.charts.svg`): the highest value drawn, the target GPUs' capacities (bytes
    to name), those near enough to be drawn to scale, and (bytes per unit, unit)."""
    top = max(max(r.peak, r.reserved_peak or 0, sum(r.breakdown.values())) for r in reports)
    top = max(top, 1)
    caps: dict[int, str] = {}
    for r in reports:
        if r.gpu_memory is not None:
            caps.setdefault(r.gpu_memory, r.gpu_name or "GPU")
    on_scale = {c: n for c, n in caps.items() if c <= CAPACITY_FACTOR * top}
    return top, caps, on_scale, _unit(max([top, *on_scale]))


def _comparison_bar(ax: "Axes", x: int, r: MemoryReport, cats: list[str], scale: float,
                    width: float, handles: dict[str, Any]) -> None:
    """One report's stacked bar, its peak (and reserved peak) marked and written above it;
    the legend's handles are collected in ``handles``."""
    bottom = 0.0
    for c in cats:
        v = r.breakdown.get(c, 0)
        if v > 0:
            handles[c] = ax.bar(x, v / scale, width, bottom=bottom, color=COLORS[c])
            bottom += v / scale
    rest = r.peak - sum(r.breakdown.values())
    if rest > 0:  # cuda: what the allocator held that no category explains
        handles["unattributed"] = ax.bar(x, rest / scale, width, bottom=bottom, color="none",
                                         edgecolor=UNATTRIBUTED, hatch="//")
    ax.hlines(r.peak / scale, x - width / 2 - 0.06, x + width / 2 + 0.06, color=FG, lw=1.6)
    text = f"peak {format_bytes(r.peak)}"
    level = r.peak
    if r.reserved_peak is not None and r.reserved_peak != r.peak:
        ax.hlines(r.reserved_peak / scale, x - width / 2 - 0.06, x + width / 2 + 0.06,
                  color=FG, lw=1.2, ls="--")
        text += f"\nreserved {format_bytes(r.reserved_peak)}"
        level = max(level, r.reserved_peak)
    if r.fits is False:
        text += f"\ndoes not fit {r.gpu_name or 'GPU'}"
    ax.annotate(text, (x, level / scale), xytext=(0, 3), textcoords="offset points",
                ha="center", va="bottom", fontsize="small",
                color=ALERT if r.fits is False else FG)


def _capacity_line(ax: "Axes", cap: int, name: str, scale: float) -> float:
    """A GPU's capacity as a labelled line; returns the y limit that shows it."""
    ax.axhline(cap / scale, color=ALERT, lw=1.5)
    ax.annotate(f"{name} {format_bytes(cap)}", (1.0, cap / scale),
                xycoords=("axes fraction", "data"), xytext=(0, 2), textcoords="offset points",
                ha="right", va="bottom", color=ALERT, fontsize="small")
    return cap / scale * 1.1


def plot_sweep(curves: Mapping[str, Sequence[tuple[int, MemoryReport | None]]], *,
               capacity: int | None = None, capacity_name: str | None = None,
               knob: str = "batch_size", ax: "Axes | None" = None,
               card: bool | None = None) -> "Axes":
    """Memory needed against a knob's value, one line per strategy.

    ``curves`` maps a strategy's name to (knob value, report) points; a report of None is
    a run that failed or ran out of memory, drawn as an x at the top of the chart; an
    interpolated point (``report.interpolated``, see :class:`memmagic.whatif.sweeps.Interpolated`)
    is a ring, a run a dot. The
    value plotted is the reserved peak where the report has one (what must fit on the
    card), else the peak. ``capacity`` (bytes; default: the first report's target GPU) is
    drawn as a line, and the largest knob value whose run fits it is ringed per strategy:
    on the card (``card``; default: when ``capacity`` is the reports' card) with the CUDA
    context the report counts, else within a budget for the allocator.
    Values spanning more than 8x are drawn on a log2 axis.
    """
    from matplotlib.transforms import blended_transform_factory

    if ax is None:
        ax = _new_axes((7, 3.6))
    _theme(ax)
    reports = [r for pts in curves.values() for _, r in pts if r is not None]
    if card is None:
        card = capacity is None
    if capacity is None:
        for r in reports:
            if r.gpu_memory is not None:
                capacity, capacity_name = r.gpu_memory, capacity_name or r.gpu_name
                break

    top = max([r.need for r in reports] + [1])
    cap_on_scale = capacity is not None and capacity <= CAPACITY_FACTOR * top
    scale, unit = _unit(max(top, capacity or 0) if cap_on_scale else top)
    ymax = max(top, capacity or 0) / scale * 1.15 if cap_on_scale else top / scale * 1.18
    failed_y = blended_transform_factory(ax.transData, ax.transAxes)
    vals_all = sorted({v for pts in curves.values() for v, _ in pts})
    for i, (name, pts) in enumerate(curves.items()):
        pts = sorted(pts, key=lambda p: p[0])
        color = _sweep_line(ax, name, pts, f"C{i % 10}", scale, failed_y)
        if capacity is not None:
            _ring_largest_fit(ax, pts, color, scale, capacity, knob, vals_all, card)
    if capacity is not None and cap_on_scale:
        _capacity_line_left(ax, capacity, capacity_name or "GPU", scale)
    _knob_axis(ax, vals_all)
    ax.set_ylim(0, ymax)
    ax.set_xlabel(knob)
    ax.set_ylabel(f"memory needed ({unit})")
    _sweep_legend(ax, curves, None if cap_on_scale else capacity, capacity_name)
    return ax


def _sweep_legend(ax: "Axes", curves: Mapping[str, Sequence[tuple[int, Any]]],
                  off_scale: int | None, capacity_name: str | None) -> None:
    """The strategies, then what the marks mean where the chart has them: interpolated
    values, failed runs, a capacity above the scale."""
    from matplotlib.lines import Line2D

    h, lab = ax.get_legend_handles_labels()
    if any(r is not None and r.interpolated for pts in curves.values() for _, r in pts):
        h.append(Line2D([], [], ls="none", marker="o", ms=5, mfc="none", color=FG))
        lab.append("interpolated between runs\n(each line checked by a run)")
    if any(r is None for pts in curves.values() for _, r in pts):
        h.append(Line2D([], [], ls="none", marker="x", mew=2, color=FG))
        lab.append("failed / out of memory")
    if off_scale is not None:
        ch, ct = _capacity_handle(off_scale, capacity_name)
        h.append(ch)
        lab.append(ct)
    _legend(ax, h, lab)


def _sweep_line(ax: "Axes", name: str, pts: list[tuple[int, MemoryReport | None]], color: str,
                scale: float, failed_y: Any) -> str:
    """One strategy's line, its failed runs as an x at the top; returns its color."""
    ok = [(v, r.need / scale) for v, r in pts if r is not None]
    line = ax.plot([v for v, _ in ok], [y for _, y in ok], lw=1.8, color=color, label=name)[0]
    color = line.get_color()
    for interpolated in (False, True):  # a run: a dot; a value read off a line: a ring
        xy = [(v, r.need / scale) for v, r in pts if r is not None and r.interpolated == interpolated]
        if xy:
            ax.plot([v for v, _ in xy], [y for _, y in xy], ls="none", marker="o",
                    ms=5 if interpolated else 4, mew=1.2, color=color,
                    mfc="none" if interpolated else color)
    bad = [v for v, r in pts if r is None]
    if bad:
        ax.plot(bad, [0.97] * len(bad), ls="none", marker="x", ms=8, mew=2, color=color,
                transform=failed_y)
    return color


def _ring_largest_fit(ax: "Axes", pts: list[tuple[int, MemoryReport | None]], color: str,
                      scale: float, capacity: int,
                      knob: str, vals_all: list[int], card: bool) -> None:
    """Ring (and name) the largest knob value whose run fits ``capacity``."""
    fit = [v for v, r in pts if r is not None and r.failed_request is None
           and r.need_of(card) <= capacity]
    if not fit:
        return
    best = max(fit)
    y = next(r.need for v, r in pts if v == best and r is not None) / scale
    ax.plot([best], [y], ls="none", marker="o", ms=13, mfc="none", mew=1.6, color=color)
    ha = "right" if best == vals_all[-1] and len(vals_all) > 1 else (
        "left" if best == vals_all[0] and len(vals_all) > 1 else "center")
    ax.annotate(f"{knob}={best} fits", (best, y), xytext=(0, 9), textcoords="offset points",
                ha=ha, va="bottom", fontsize="small", color=color)


def _knob_axis(ax: "Axes", vals: list[int]) -> None:
    """Ticks at the knob's values; a log2 axis when they span more than 8x."""
    if vals and vals[0] > 0 and vals[-1] / vals[0] > 8:
        ax.set_xscale("log", base=2)
        ax.set_xticks(vals, [str(v) for v in vals])
        ax.minorticks_off()
    elif vals:
        ax.set_xticks(vals, [str(v) for v in vals])


def _capacity_line_left(ax: "Axes", cap: int, name: str, scale: float) -> None:
    """A GPU's capacity as a line, labelled at the left edge."""
    ax.axhline(cap / scale, color=ALERT, lw=1.5)
    ax.annotate(f"{name} {format_bytes(cap)}", (0.0, cap / scale),
                xycoords=("axes fraction", "data"), xytext=(3, 2), textcoords="offset points",
                ha="left", va="bottom", color=ALERT, fontsize="small")


# -- the timeline of a run ------------------------------------------------------------------
def merged_spans(spans: Sequence[tuple[str, int, int]], n_ops: int) -> list[tuple[str, int, int]]:
    """The forward/backward/recompute/optimizer spans with short runs of "other" ops between
    two spans of one phase absorbed (a loss computed between forward and backward, a
    ``zero_grad``), so a training step reads as three spans, not a dozen."""
    gap = max(3, n_ops // 200)
    out: list[tuple[str, int, int]] = []
    for phase, first, last in spans:
        if phase not in PHASE_COLORS:
            continue
        if out and out[-1][0] == phase and first - out[-1][2] - 1 <= gap:
            out[-1] = (phase, out[-1][1], last)
        else:
            out.append((phase, first, last))
    return out


def plot_fit_map(fit_map: Any, ax: "Axes | None" = None) -> "Axes":
    """The (context length, batch size) plane of a :class:`memmagic.whatif.fitmap.FitMap`:
    the pairs that fit shaded, the boundary (the largest batch that fits at each context)
    as a step line, the runs it was read from as dots and the checking runs as rings
    (filled where the run fit)."""
    if ax is None:
        ax = _new_axes((7, 3.6))
    _theme(ax)
    seqs = list(fit_map.seqs)
    lo, hi = fit_map.batch
    tops = [fit_map.largest[s] if fit_map.largest[s] is not None else lo - 0.5 for s in seqs]
    ax.fill_between(seqs, lo - 0.5, tops, step="mid", color="#54a24b", alpha=0.35, lw=0,
                    label="fits")
    ax.fill_between(seqs, tops, hi + 0.5, step="mid", color=ALERT, alpha=0.12, lw=0,
                    label="does not fit")
    ax.step(seqs, tops, where="mid", color="#2f6f2a", lw=1.5, label="largest batch that fits")
    if fit_map.lattice:
        xs, ys = zip(*[(s, b) for b, s in fit_map.lattice])
        ax.scatter(xs, [min(y, hi) for y in ys], s=18, color=FG, zorder=3,
                   label="runs the plane is read from")
    labelled: set[bool] = set()  # one legend entry for the runs that fit, one for the others
    for b, s, ok in fit_map.checks:
        ax.scatter([s], [min(b, hi)], s=46, facecolors="#2f6f2a" if ok else "none",
                   edgecolors="#2f6f2a" if ok else ALERT, zorder=4, lw=1.3,
                   label=None if ok in labelled else f"check run: {'fits' if ok else 'does not fit'}")
        labelled.add(ok)
    ax.set_xlim(seqs[0], seqs[-1])
    ax.set_ylim(lo - 0.5, hi + 0.5)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("batch size")
    how = (f"read off {len(fit_map.lattice)} runs, checked by {len(fit_map.checks)}"
           if fit_map.method == "plane" else f"{fit_map.runs} runs")
    ax.set_title(f"what fits {fit_map.card} ({format_bytes(fit_map.capacity)}): {how}",
                 color=FG, fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    _legend(ax, handles, labels, fontsize=8)
    return ax


def plot_timeline(report: MemoryReport, ax: "Axes | None" = None, *,
                  capacity: bool = True) -> "Axes":
    """Live device bytes per category against the op index, as a stacked area, from the
    report's trace (``report.trace.timeline()``): forward, backward, recompute and
    optimizer phases shaded and labelled (once per span, where there is room), the peak
    marked and named (``report.peak_words``), and the target GPU's capacity as a line when
    it is within 3x of the peak (otherwise as a note). ``capacity=False`` leaves it out.

    Raises ValueError for a report without a trace (a cuda run measures the allocator's
    counters, not ops: use backend "sim" or "cpu" for a timeline).
    """
    trace = report.trace
    if trace is None:
        raise ValueError(
            f"this {report.backend} report has no op-by-op trace, which the timeline is drawn "
            "from: only the tracker-based backends ('cpu', 'sim') record one; measure with "
            "backend='sim' (or 'cpu') to see the timeline")
    points = trace.timeline()
    if ax is None:
        ax = _new_axes((9, 3.4))
    _theme(ax)
    n_ops = max(len(trace.ops), points[-1][0] if points else 0, 1)
    totals = [sum(c.values()) for _, c in points]
    top = max(totals + [report.peak, 1])
    cap = report.gpu_memory if capacity else None
    cap_on_scale = cap is not None and cap <= CAPACITY_FACTOR * top
    scale, unit = _unit(max(top, cap or 0) if cap_on_scale else top)
    cats = [c for c in COLORS if any(p[1].get(c, 0) > 0 for p in points)]
    xs, ys = _steps(points, cats, n_ops, scale)
    if cats:
        polys = ax.stackplot(xs, *[ys[c] for c in cats], colors=[COLORS[c] for c in cats],
                             lw=0, zorder=2)
    else:
        polys = []
    data_top = top / scale
    ymax = max(data_top, cap / scale if cap_on_scale else 0) * 1.28
    spans = merged_spans(trace.phase_spans(), n_ops)
    _phase_bands(ax, spans, n_ops)
    _mark_peak(ax, trace.peak_op_index, report.peak, n_ops, scale)
    if cap is not None and cap_on_scale:
        _capacity_line_left(ax, cap, report.gpu_name or "GPU", scale)
    words = report.peak_words
    title = f"live memory by category ({report.backend})"
    if words:
        title += f": peak {words}"
    ax.set_title("\n".join(textwrap.wrap(title, 95)), loc="left", fontsize="medium", color=FG)
    ax.set_xlim(0, n_ops)
    ax.set_ylim(0, ymax)
    ax.set_xlabel("op index (tracked tensor operations, in order)")
    ax.set_ylabel(unit)
    hs, ls = list(polys), list(cats)
    _phase_legend(spans, hs, ls)
    if cap is not None and not cap_on_scale:
        h, text = _capacity_handle(cap, report.gpu_name)
        hs.append(h)
        ls.append(text)
    _legend(ax, hs, ls)
    return ax


def _steps(points: Sequence[tuple[int, Mapping[str, int]]], cats: list[str], n_ops: int,
           scale: float) -> tuple[list[float], dict[str, list[float]]]:
    """A step drawing of the timeline: the bytes after an op hold until the next op that
    changes them. (x values, y values per category)."""
    xs: list[float] = []
    ys: dict[str, list[float]] = {c: [] for c in cats}
    for k, (op, c) in enumerate(points):
        if k:
            xs.append(op)
            for name in cats:
                ys[name].append(ys[name][-1])
        xs.append(op)
        for name in cats:
            ys[name].append(c.get(name, 0) / scale)
    xs.append(n_ops)
    for name in cats:
        ys[name].append(ys[name][-1] if ys[name] else 0.0)
    return xs, ys


def _phase_bands(ax: "Axes", spans: list[tuple[str, int, int]], n_ops: int) -> None:
    """Phases as light bands, with a label at the top of each span that has room for one."""
    ax_width_in = ax.figure.get_figwidth() * 0.75
    band = ax.get_xaxis_transform()  # x in ops, y in axes fraction
    for phase, first, last in spans:
        color = PHASE_COLORS[phase]
        ax.axvspan(first - 1, last, color=color, alpha=0.10, lw=0, zorder=0)
        ax.axvspan(first - 1, last, ymin=0.91, ymax=1.0, color=color, alpha=0.35, lw=0,
                   zorder=1)
        room_in = (last - first + 1) / n_ops * ax_width_in
        for text in (phase, PHASE_SHORT[phase]):
            if len(text) * 7.5 * 0.6 / 72 + 0.03 <= room_in:
                ax.text((first - 1 + last) / 2, 0.955, text, transform=band, ha="center",
                        va="center", fontsize=7.5, color=FG, clip_on=True, zorder=3)
                break


def _mark_peak(ax: "Axes", peak_op: int, peak: int, n_ops: int, scale: float) -> None:
    ax.axvline(peak_op, color=FG, lw=1, ls=":")
    ax.plot([peak_op], [peak / scale], marker="v", ms=7, color=ALERT, ls="none")
    right = peak_op > 0.6 * n_ops
    ax.annotate(f"peak {format_bytes(peak)}", (peak_op, peak / scale),
                xytext=(-6 if right else 6, 4), textcoords="offset points",
                ha="right" if right else "left", va="bottom", fontsize="small", color=ALERT)


def _phase_legend(spans: list[tuple[str, int, int]], hs: list[Any], ls: list[str]) -> None:
    """Add a legend entry for each phase that has a span."""
    from matplotlib.patches import Patch

    for phase in PHASE_COLORS:
        if any(p == phase for p, _, _ in spans):
            hs.append(Patch(color=PHASE_COLORS[phase], alpha=0.35, lw=0))
            ls.append(f"{phase} (phase)")


def timeline_figure(report: MemoryReport, **kwargs: Any) -> "Figure":
    """A new ``matplotlib.figure.Figure`` holding :func:`plot_timeline` of ``report``."""
    ax = _new_axes((9, 3.4))
    plot_timeline(report, ax, **kwargs)
    return ax.figure


# -- display ------------------------------------------------------------------------------
def figure_png(fig: "Figure", dpi: int = RENDER_DPI) -> bytes:
    """``fig`` as PNG bytes with a transparent background; the same figure gives the same
    bytes (no software/date metadata), which widgets and tests rely on."""
    import io
    import warnings

    buf = io.BytesIO()
    with warnings.catch_warnings():
        # long labels (a transformers model's module paths) can leave constrained layout no
        # room; matplotlib then keeps the plain layout, which is what the chart needs
        warnings.filterwarnings("ignore", "constrained_layout not applied", UserWarning)
        # constrained layout settles on the second pass: lay out first, so the first PNG of
        # a figure is the same as every later one
        fig.draw_without_rendering()
        fig.savefig(buf, format="png", dpi=dpi, transparent=True, metadata={"Software": None})
    return buf.getvalue()


class Chart:
    """A figure shown as PNG, with a stable one-line text repr (what nbval compares).

    The PNG is rendered at 2x (``RENDER_DPI``) and displayed at the figure's size at
    ``DISPLAY_DPI``: sharp on a high-density display, the same size on any other."""

    def __init__(self, figure: "Figure", text: str) -> None:
        self.figure, self.text = figure, text

    def _repr_png_(self) -> tuple[bytes, dict[str, int]]:
        w, h = self.figure.get_size_inches()
        return (figure_png(self.figure, RENDER_DPI),
                {"width": int(round(w * DISPLAY_DPI)), "height": int(round(h * DISPLAY_DPI))})

    def __repr__(self) -> str:
        return self.text

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text)


def breakdown_chart(report: MemoryReport) -> Chart:
    """The breakdown chart of ``report`` as a displayable :class:`Chart`."""
    return Chart(breakdown_figure(report), f"<memmagic chart: breakdown at peak ({report.backend})>")


def timeline_chart(report: MemoryReport) -> Chart:
    """The timeline of ``report`` as a displayable :class:`Chart` (ValueError without a
    trace, see :func:`plot_timeline`)."""
    return Chart(timeline_figure(report), f"<memmagic chart: timeline ({report.backend})>")
