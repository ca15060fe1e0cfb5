"""Matplotlib charts of reports. Never touches pyplot state; returns the Axes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .report import COLORS, MemoryReport, format_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["plot_breakdown", "breakdown_figure", "breakdown_chart", "Chart"]



def _unit(n: int) -> tuple[float, str]:
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return scale, name
    return 1, "B"


def plot_breakdown(report: MemoryReport, ax: "Axes | None" = None, *, label: str | None = None,
                   y: float = 0.0) -> "Axes":
    """One horizontal stacked bar: the peak split by category, with the before level and
    the target GPU (if any) as vertical lines."""
    if ax is None:
        from matplotlib.figure import Figure

        ax = Figure(figsize=(7, 1.8), layout="constrained").add_subplot()
    top = max(report.peak, report.reserved_peak or 0, report.gpu_memory or 0, 1)
    scale, unit = _unit(top)
    left = 0.0
    for name, value, _ in report.breakdown_rows():
        if value:
            ax.barh(y, value / scale, left=left, color=COLORS[name], label=name, height=0.6)
            left += value / scale
    if report.unattributed > 0:
        ax.barh(y, report.unattributed / scale, left=left, color="#eeeeee", hatch="//",
                label="unattributed", height=0.6)
    ax.axvline(report.before / scale, color="black", lw=1, ls=":", label="before")
    if report.reserved_peak is not None:
        ax.axvline(report.reserved_peak / scale, color="#555555", lw=1, ls="--", label="reserved peak")
    if report.gpu_memory is not None:
        ax.axvline(report.gpu_memory / scale, color="red", lw=1.5, label=f"{report.gpu_name or 'GPU'}")
    ax.set_yticks([y], [label or report.backend])
    ax.set_xlabel(f"{unit} (peak {format_bytes(report.peak)}, {report.backend})")
    ax.set_xlim(0, top / scale * 1.05)
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), loc="upper left", bbox_to_anchor=(1.01, 1.0),
              fontsize="small", frameon=False)
    return ax


def breakdown_figure(report: MemoryReport, **kwargs: Any):
    """A new ``matplotlib.figure.Figure`` holding :func:`plot_breakdown` of ``report``."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 1.8), layout="constrained")
    plot_breakdown(report, fig.add_subplot(), **kwargs)
    return fig


class Chart:
    """A figure shown as PNG, with a stable one-line text repr (what nbval compares)."""

    def __init__(self, figure, text: str) -> None:
        self.figure, self.text = figure, text

    def _repr_png_(self) -> bytes:
        import io

        buf = io.BytesIO()
        self.figure.savefig(buf, format="png", dpi=100, metadata={"Software": None})
        return buf.getvalue()

    def __repr__(self) -> str:
        return self.text


def breakdown_chart(report: MemoryReport) -> Chart:
    """The breakdown chart of ``report`` as a displayable :class:`Chart`."""
    return Chart(breakdown_figure(report), f"<memmagic chart: breakdown at peak ({report.backend})>")
