from __future__ import annotations

import struct

import matplotlib
import pytest

matplotlib.use("Agg")

from matplotlib.patches import Rectangle  # noqa: E402

from memmagic.charts.plots import (ALERT, breakdown_chart, figure_png, plot_breakdown,  # noqa: E402
                            plot_comparison, plot_sweep)
from memmagic.report import COLORS, MemoryReport  # noqa: E402

MiB, GiB = 2**20, 2**30


def report(**kw):
    base = dict(backend="sim", device="sim", before=2**20, peak=5 * 2**20, after=3 * 2**20, wall_s=0.0,
                breakdown={"parameters": 2**20, "activations": 3 * 2**20, "other": 2**20})
    base.update(kw)
    return MemoryReport(**base)


def bars(ax):
    return [p for p in ax.patches if isinstance(p, Rectangle)]


def texts(ax):
    return [t.get_text() for t in ax.texts]


def legend_labels(ax):
    leg = ax.get_legend()
    return [t.get_text() for t in leg.get_texts()] if leg else []


def png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", png[16:24])


# -- the breakdown ------------------------------------------------------------------------
def test_bar_segments_follow_the_breakdown():
    ax = plot_breakdown(report())
    widths = sorted(round(p.get_width(), 3) for p in bars(ax))
    assert widths == [1.0, 1.0, 3.0]  # MiB
    assert "MiB" in ax.get_xlabel()


def test_legend_lists_only_categories_with_bytes():
    ax = plot_breakdown(report())
    names = [s.split()[0] for s in legend_labels(ax)]
    assert names == ["parameters", "activations", "other", "before"]
    assert "gradients" not in " ".join(legend_labels(ax))


def test_target_gpu_near_the_bar_is_a_line_on_the_scale():
    ax = plot_breakdown(report(gpu_name="tiny", gpu_memory=8 * MiB))
    assert any(line.get_color() == ALERT and line.get_xdata()[0] == 8.0 for line in ax.lines)
    assert ax.get_xlim()[1] >= 8.0


def test_target_gpu_that_dwarfs_the_bar_is_a_note_not_the_scale():
    ax = plot_breakdown(report(gpu_name="T4", gpu_memory=16 * GiB))
    assert "MiB" in ax.get_xlabel()
    assert ax.get_xlim()[1] < 10  # the bar (5 MiB) fills most of the axis
    assert "T4: 16.00 GiB" in texts(ax)
    assert not any(line.get_color() == ALERT for line in ax.lines)


def test_chart_is_transparent_2x_png_with_display_size_and_stable_text():
    c = breakdown_chart(report())
    png, meta = c._repr_png_()
    w, h = png_size(png)
    assert (w, h) == (2 * meta["width"], 2 * meta["height"])
    assert meta == {"width": 700, "height": 190}
    assert repr(c) == "<memmagic chart: breakdown at peak (sim)>"
    assert c.figure.patch.get_alpha() == 0.0


def test_figure_png_is_deterministic():
    fig = breakdown_chart(report()).figure
    assert figure_png(fig, dpi=80) == figure_png(fig, dpi=80)
    assert png_size(figure_png(fig, dpi=80)) == (560, 152)
    # a fresh figure of the same report gives the same bytes on its first rendering
    assert figure_png(breakdown_chart(report()).figure, dpi=80) == figure_png(fig, dpi=80)


def test_plots_leave_rcparams_alone():
    before = dict(matplotlib.rcParams)
    plot_breakdown(report(gpu_name="T4", gpu_memory=16 * GiB))
    plot_comparison([report()], ["a"])
    with pytest.raises(ValueError):
        plot_comparison([report()], ["a", "b"])
    assert dict(matplotlib.rcParams) == before


# -- comparison ---------------------------------------------------------------------------
def test_comparison_one_stacked_bar_per_report_on_one_scale():
    small = report(peak=5 * MiB, reserved_peak=8 * MiB)
    big = report(peak=10 * MiB, breakdown={"parameters": 2 * MiB, "gradients": 2 * MiB,
                                           "activations": 6 * MiB})
    ax = plot_comparison([small, big], ["small", "big"])
    heights = {}
    for p in bars(ax):
        x = round(p.get_x() + p.get_width() / 2)
        heights[x] = heights.get(x, 0) + p.get_height()
    assert heights == {0: pytest.approx(5.0), 1: pytest.approx(10.0)}
    # stacked in COLORS order: the bottom of each bar is parameters
    first = [p for p in bars(ax) if round(p.get_x() + p.get_width() / 2) == 1]
    assert [matplotlib.colors.to_hex(p.get_facecolor()) for p in first] == [
        COLORS["parameters"], COLORS["gradients"], COLORS["activations"]]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["small", "big"]
    assert "peak 5.00 MiB\nreserved 8.00 MiB" in texts(ax)
    assert "peak 10.00 MiB" in texts(ax)
    assert legend_labels(ax) == ["parameters", "gradients", "activations", "other"]
    assert ax.get_ylim()[1] >= 10.0


def test_comparison_capacity_is_context_not_scale():
    a = report(gpu_name="T4", gpu_memory=16 * GiB)
    ax = plot_comparison([a, a], ["x", "y"])
    assert ax.get_ylabel() == "MiB"
    assert ax.get_ylim()[1] < 10
    assert any("T4: 16.00 GiB" in s for s in legend_labels(ax))
    near = report(gpu_name="tiny", gpu_memory=6 * MiB, peak=7 * MiB, reserved_peak=7 * MiB)
    ax = plot_comparison([near], ["x"])
    assert any(line.get_color() == ALERT for line in ax.lines)
    assert "does not fit tiny" in texts(ax)[0]


def test_comparison_needs_one_label_per_report():
    with pytest.raises(ValueError, match="one label per report"):
        plot_comparison([report()], [])
    with pytest.raises(ValueError, match="at least one report"):
        plot_comparison([], [])


# -- sweep --------------------------------------------------------------------------------
def sweep_curves():
    def r(peak, reserved=None):
        return report(peak=peak * MiB, reserved_peak=None if reserved is None else reserved * MiB)

    return {"fp32": [(8, r(100, 120)), (16, r(200, 230)), (32, None)],
            "amp": [(8, r(60)), (16, r(110)), (32, r(210)), (64, r(420))]}


def test_sweep_plots_reserved_where_known_and_failed_points_as_x():
    ax = plot_sweep(sweep_curves(), capacity=256 * MiB, capacity_name="card")
    lines = {ln.get_label(): ln for ln in ax.lines}
    assert list(lines["fp32"].get_ydata()) == [120, 230]
    assert list(lines["amp"].get_ydata()) == [60, 110, 210, 420]
    xs = [ln for ln in ax.lines if ln.get_marker() == "x"]
    assert len(xs) == 1 and list(xs[0].get_xdata()) == [32]
    assert "failed / out of memory" in legend_labels(ax)
    assert ax.get_xlabel() == "batch_size"


def test_sweep_marks_the_largest_value_that_fits_per_strategy():
    ax = plot_sweep(sweep_curves(), capacity=256 * MiB, capacity_name="card", knob="B")
    assert "B=16 fits" in texts(ax)   # fp32: 16 fits (230 MiB), 32 failed
    assert "B=32 fits" in texts(ax)   # amp: 32 fits (210), 64 needs 420
    assert "card 256.00 MiB" in texts(ax)
    assert any(ln.get_color() == ALERT for ln in ax.lines)


def test_sweep_capacity_from_reports_and_off_the_scale():
    curves = {"a": [(1, report(gpu_name="T4", gpu_memory=16 * GiB)), (2, None)]}
    ax = plot_sweep(curves)
    assert ax.get_ylim()[1] < 10  # MiB: the card does not set the scale
    assert any("T4: 16.00 GiB" in s for s in legend_labels(ax))
    assert "batch_size=1 fits" in texts(ax)
