"""The what-if panel's chart as SVG markup: reports side by side, drawn in a few
milliseconds and sent to the browser as text in an ``ipywidgets.HTML`` value.

A control change used to redraw the panel's chart with matplotlib and send it as a PNG:
about 150 ms, more than the simulated re-run itself. This chart is the same comparison as
:func:`memmagic.charts.plots.plot_comparison` (stacked bars by category in ``COLORS``, each bar's
peak and reserved peak marked and written above it, the card's capacity as a line or,
when it would dwarf the bars, in the legend), built from the same scale
(:func:`~memmagic.charts.plots.comparison_scale`). It needs no JavaScript of its own: every front
end that shows ipywidgets (JupyterLab, Notebook 7, VS Code, Voila, Colab) shows an HTML
widget's SVG. Text and lines are the mid grey of the matplotlib charts, readable on a
light and a dark page; each bar segment has a tooltip with its size. Static reports keep
the matplotlib charts (PNG).
"""

from __future__ import annotations

import html
from typing import Sequence

from .plots import ALERT, FG, UNATTRIBUTED, above_scale, comparison_scale, held_categories
from ..report import COLORS, MemoryReport, format_bytes

__all__ = ["comparison_svg"]

# the drawing's own units (it scales to the output's width, at most this many CSS pixels)
_W, _H = 620, 300
_PLOT = (62, 20, 372, 232)  # left, top, right, bottom of the bars' area
_LEGEND_X = 392
_BAR_W = 76
_FONT = "font-family:var(--jp-ui-font-family, var(--vscode-font-family, sans-serif))"


def comparison_svg(reports: Sequence[MemoryReport], labels: Sequence[str]) -> str:
    """``reports`` side by side as one ``<svg>`` element; ``labels`` (one per report, lines
    split by newlines) under the bars."""
    reports, labels = list(reports), [str(s) for s in labels]
    if not reports or len(labels) != len(reports):
        raise ValueError(f"comparison_svg needs one label per report: {len(reports)} "
                         f"reports, {len(labels)} labels")
    top, caps, on_scale, (scale, unit) = comparison_scale(reports)
    ymax = top / scale * 1.32  # room for the values written above the bars
    for cap in on_scale:
        ymax = max(ymax, cap / scale * 1.1)
    chart = _Chart(ymax, scale, len(reports))
    parts = chart.axis(unit)
    cats = held_categories(reports)
    held: list[str] = []
    for i, (r, label) in enumerate(zip(reports, labels)):
        parts += chart.bar(i, r, cats, held)
        parts += chart.label(i, label)
    for cap, name in on_scale.items():
        parts += chart.capacity(cap, name)
    legend = [(COLORS[c], c) for c in cats if c in held]
    if "unattributed" in held:
        legend.append(("none", "unattributed"))
    off = [above_scale(cap, name) for cap, name in caps.items() if cap not in on_scale]
    parts += _legend(legend, off)
    body = "".join(parts)
    return (f"<svg class='memmagic-chart' xmlns='http://www.w3.org/2000/svg' "
            f"viewBox='0 0 {_W} {_H}' width='100%' role='img' "
            f"style='max-width:{_W}px;height:auto;{_FONT}' font-size='12'>"
            f"<title>{html.escape(_summary(reports, labels))}</title>{body}</svg>")


class _Chart:
    """Bytes to the drawing's coordinates: ``ymax`` units of ``scale`` bytes at the top,
    ``n`` bars spread along the bottom."""

    def __init__(self, ymax: float, scale: float, n: int) -> None:
        self.ymax, self.scale, self.n = ymax, scale, n

    def y(self, nbytes: float) -> float:
        left, top, right, bottom = _PLOT
        return bottom - (bottom - top) * (nbytes / self.scale) / self.ymax

    def x(self, i: int) -> float:
        left, _top, right, _bottom = _PLOT
        return left + (right - left) * (i + 0.5) / self.n

    def axis(self, unit: str) -> list[str]:
        left, top, right, bottom = _PLOT
        out = [f"<line x1='{left}' y1='{bottom}' x2='{right}' y2='{bottom}' stroke='{FG}'/>",
               f"<line x1='{left}' y1='{top}' x2='{left}' y2='{bottom}' stroke='{FG}'/>"]
        for v in _ticks(self.ymax):
            y = self.y(v * self.scale)
            out.append(f"<line x1='{left - 4}' y1='{y:.1f}' x2='{left}' y2='{y:.1f}' stroke='{FG}'/>"
                       f"<text x='{left - 7}' y='{y + 4:.1f}' text-anchor='end' fill='{FG}'>"
                       f"{v:g}</text>")
        out.append(f"<text x='14' y='{(top + bottom) / 2:.0f}' text-anchor='middle' fill='{FG}' "
                   f"transform='rotate(-90 14 {(top + bottom) / 2:.0f})'>{unit}</text>")
        return out

    def bar(self, i: int, r: MemoryReport, cats: list[str], held: list[str]) -> list[str]:
        """One report's stacked bar, its peak (and reserved peak) marked and written above."""
        x0, out, below = self.x(i) - _BAR_W / 2, [], 0
        for c in cats:
            v = r.breakdown.get(c, 0)
            if v > 0:
                out.append(self._segment(x0, below, v, f"fill='{COLORS[c]}'", f"{c}: {format_bytes(v)}"))
                below += v
                held.append(c)
        rest = r.peak - sum(r.breakdown.values())
        if rest > 0:  # cuda: what the allocator held that no category explains
            out.append(self._segment(x0, below, rest, f"fill='none' stroke='{UNATTRIBUTED}' "
                                     "stroke-dasharray='3 2'", f"unattributed: {format_bytes(rest)}"))
            held.append("unattributed")
        lines = [f"peak {format_bytes(r.peak)}"]
        level = r.peak
        out.append(self._mark(i, r.peak, ""))
        if r.reserved_peak is not None and r.reserved_peak != r.peak:
            out.append(self._mark(i, r.reserved_peak, " stroke-dasharray='5 3' stroke-width='1.2'"))
            lines.append(f"reserved {format_bytes(r.reserved_peak)}")
            level = max(level, r.reserved_peak)
        if r.fits is False:
            lines.append(f"does not fit {r.gpu_name or 'GPU'}")
        color = ALERT if r.fits is False else FG
        y = self.y(level) - 5 - 14 * (len(lines) - 1)
        spans = "".join(f"<tspan x='{self.x(i):.1f}' dy='{0 if k == 0 else 14}'>{html.escape(t)}</tspan>"
                        for k, t in enumerate(lines))
        out.append(f"<text class='memmagic-bar-label' x='{self.x(i):.1f}' y='{y:.1f}' "
                   f"text-anchor='middle' fill='{color}' font-size='11'>{spans}</text>")
        return out

    def _segment(self, x0: float, below: int, nbytes: int, paint: str, tip: str) -> str:
        y_top, y_bottom = self.y(below + nbytes), self.y(below)
        return (f"<rect x='{x0:.1f}' y='{y_top:.2f}' width='{_BAR_W}' "
                f"height='{max(y_bottom - y_top, 0):.2f}' {paint}><title>{html.escape(tip)}</title></rect>")

    def _mark(self, i: int, nbytes: int, style: str) -> str:
        y, half = self.y(nbytes), _BAR_W / 2 + 5
        return (f"<line x1='{self.x(i) - half:.1f}' y1='{y:.2f}' x2='{self.x(i) + half:.1f}' "
                f"y2='{y:.2f}' stroke='{FG}' stroke-width='1.6'{style}/>")

    def label(self, i: int, text: str) -> list[str]:
        _left, _top, _right, bottom = _PLOT
        spans = "".join(f"<tspan x='{self.x(i):.1f}' dy='{14 if k else 0}'>{html.escape(t)}</tspan>"
                        for k, t in enumerate(text.split("\n")))
        return [f"<text x='{self.x(i):.1f}' y='{bottom + 16}' text-anchor='middle' fill='{FG}' "
                f"font-size='11'>{spans}</text>"]

    def capacity(self, cap: int, name: str) -> list[str]:
        left, _top, right, _bottom = _PLOT
        y = self.y(cap)
        return [f"<line class='memmagic-capacity' x1='{left}' y1='{y:.2f}' x2='{right}' "
                f"y2='{y:.2f}' stroke='{ALERT}' stroke-width='1.5'/>"
                f"<text x='{right}' y='{y - 4:.2f}' text-anchor='end' fill='{ALERT}' font-size='11'>"
                f"{html.escape(name)} {format_bytes(cap)}</text>"]


def _ticks(ymax: float) -> list[float]:
    """Round values from 0 to ``ymax``: four to eight of them, steps of 1, 2 or 5 x 10^k."""
    import math

    raw = ymax / 5 if ymax > 0 else 1.0
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return [k * step for k in range(int(ymax / step) + 1)]


def _legend(entries: list[tuple[str, str]], notes: list[str]) -> list[str]:
    out, y = [], _PLOT[1] + 6
    for fill, name in entries:
        paint = (f"fill='{fill}'" if fill != "none" else
                 f"fill='none' stroke='{UNATTRIBUTED}' stroke-dasharray='3 2'")
        out.append(f"<rect x='{_LEGEND_X}' y='{y - 10}' width='12' height='12' {paint}/>"
                   f"<text x='{_LEGEND_X + 18}' y='{y}' fill='{FG}'>{html.escape(name.replace('_', ' '))}</text>")
        y += 19
    for note in notes:
        first, *rest = note.split("\n")
        out.append(f"<text x='{_LEGEND_X}' y='{y + 4}' fill='{ALERT}'>&#9650; {html.escape(first)}"
                   + "".join(f"<tspan x='{_LEGEND_X + 14}' dy='14'>{html.escape(t)}</tspan>" for t in rest)
                   + "</text>")
        y += 19 + 14 * len(rest)
    return out


def _summary(reports: Sequence[MemoryReport], labels: Sequence[str]) -> str:
    """The chart in words (its accessible name)."""
    return "; ".join(f"{' '.join(label.split())}: peak {format_bytes(r.peak)}"
                     + (f", reserved {format_bytes(r.reserved_peak)}" if r.reserved_peak else "")
                     for r, label in zip(reports, labels))
