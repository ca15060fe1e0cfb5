"""The what-if panel's SVG chart: the same comparison as plots.plot_comparison, as markup."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from memmagic.charts.plots import ALERT
from memmagic.report import COLORS
from memmagic.charts.svg import comparison_svg

from tests.frontends.test_browser import html_problems
from test_plots import GiB, MiB, report

NS = {"s": "http://www.w3.org/2000/svg"}


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)


def bars(root: ET.Element) -> list[tuple[str, float, str]]:
    """(fill, height, tooltip) of each bar segment (legend swatches are 12 x 12)."""
    out = []
    for r in root.iter("{http://www.w3.org/2000/svg}rect"):
        title = r.find("s:title", NS)
        if title is not None:
            out.append((r.get("fill"), float(r.get("height")), title.text))
    return out


def test_bars_stack_the_breakdown_to_scale_with_tooltips():
    a = report()  # the helper's breakdown
    b = report(peak=2 * a.peak, breakdown={k: 2 * v for k, v in a.breakdown.items()})
    root = parse(comparison_svg([a, b], ["baseline\nbatch 8", "now\nbatch 16"]))
    segs = bars(root)
    held = [c for c in COLORS if a.breakdown[c] > 0]
    assert [f for f, _, _ in segs] == [COLORS[c] for c in held] * 2
    n = len(held)
    for (_, h1, t1), (_, h2, t2) in zip(segs[:n], segs[n:]):
        assert h2 == pytest.approx(2 * h1, rel=1e-3)
        assert t1.split(":")[0] == t2.split(":")[0]
    text = "".join(root.itertext())
    assert "peak" in text and "baseline" in text and "batch 16" in text


def test_the_card_is_a_line_near_the_bars_and_a_legend_entry_far_above():
    near = parse(comparison_svg([report(gpu_name="tiny", gpu_memory=8 * MiB)], ["a"]))
    lines = [ln for ln in near.iter("{http://www.w3.org/2000/svg}line")
             if ln.get("class") == "memmagic-capacity"]
    assert len(lines) == 1 and lines[0].get("stroke") == ALERT
    far = comparison_svg([report(gpu_name="A100", gpu_memory=80 * GiB)], ["a"])
    assert "memmagic-capacity" not in far and "A100: 80.00 GiB" in far and "above this scale" in far


def test_a_bar_that_does_not_fit_says_so_in_red():
    r = report(gpu_name="tiny", gpu_memory=1 * MiB)
    assert r.fits is False
    root = parse(comparison_svg([r], ["a"]))
    label = next(t for t in root.iter("{http://www.w3.org/2000/svg}text")
                 if t.get("class") == "memmagic-bar-label")
    assert label.get("fill") == ALERT and "does not fit tiny" in "".join(label.itertext())


def test_the_markup_is_self_contained_and_escaped():
    svg = comparison_svg([report()], ["<b>&"])
    assert html_problems(svg) == []
    assert "&lt;b&gt;&amp;" in svg
    with pytest.raises(ValueError, match="one label per report"):
        comparison_svg([report()], [])
