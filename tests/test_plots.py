from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from memmagic.plots import breakdown_chart, plot_breakdown  # noqa: E402
from memmagic.report import MemoryReport  # noqa: E402


def report(**kw):
    base = dict(backend="sim", device="sim", before=2**20, peak=5 * 2**20, after=3 * 2**20, wall_s=0.0,
                breakdown={"parameters": 2**20, "activations": 3 * 2**20, "other": 2**20})
    base.update(kw)
    return MemoryReport(**base)


def test_bar_segments_follow_the_breakdown():
    ax = plot_breakdown(report())
    widths = sorted(round(p.get_width(), 3) for p in ax.patches)
    assert widths == [1.0, 1.0, 3.0]  # MiB
    assert "MiB" in ax.get_xlabel()


def test_target_gpu_line_is_drawn():
    ax = plot_breakdown(report(gpu_name="T4", gpu_memory=16 * 2**30))
    assert any(line.get_label() == "T4" for line in ax.lines)


def test_chart_has_png_and_stable_text():
    c = breakdown_chart(report())
    assert c._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"
    assert repr(c) == "<memmagic chart: breakdown at peak (sim)>"
