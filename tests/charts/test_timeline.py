from __future__ import annotations

import dataclasses

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from memmagic.api import measure  # noqa: E402
from memmagic.charts.plots import (ALERT, merged_spans, plot_timeline, timeline_chart,  # noqa: E402
                            timeline_figure)
from memmagic.report import MemoryReport  # noqa: E402

MiB, GiB = 2**20, 2**30


def train(steps: int = 2, accum: int = 2):
    def run():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                    torch.nn.Linear(512, 10))
        opt = torch.optim.Adam(model.parameters())
        for _ in range(steps):
            for _ in range(accum):
                model(torch.randn(32, 256)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return run


@pytest.fixture(scope="module")
def rep() -> MemoryReport:
    return measure(train(), backend="cpu")


def texts(ax):
    return [t.get_text() for t in ax.texts]


def legend_labels(ax):
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_stack_follows_the_trace_and_reaches_the_peak(rep):
    ax = plot_timeline(rep, capacity=False)
    cats = [c for c in legend_labels(ax) if "(phase)" not in c]
    points = rep.trace.timeline()
    assert cats == [c for c in ("parameters", "buffers", "gradients", "optimizer_state",
                                "activations", "workspaces", "other")
                    if any(p[1].get(c, 0) for p in points)]
    assert ax.get_ylabel() == "MiB"
    # the top of the stack at its highest is the report's peak
    tops = [max(v[1] for v in poly.get_paths()[0].vertices) for poly in ax.collections]
    assert max(tops) == pytest.approx(rep.peak / MiB, rel=1e-9)


def test_phases_shaded_and_each_span_labelled_once(rep):
    ax = plot_timeline(rep, capacity=False)
    labels = texts(ax)
    # two steps of two accumulated micro-batches: four backward spans, two optimizer steps
    assert labels.count("backward") + labels.count("bwd") == 4
    assert labels.count("optimizer") + labels.count("opt") == 2
    assert "backward (phase)" in legend_labels(ax) and "optimizer (phase)" in legend_labels(ax)


def test_peak_marked_and_named(rep):
    ax = plot_timeline(rep)
    op = rep.trace.peak_op_index
    assert any(list(ln.get_xdata()) == [op, op] for ln in ax.lines)
    assert f"peak {rep.peak / MiB:.2f} MiB" in texts(ax)
    assert rep.peak_words and rep.peak_words in ax.get_title(loc="left").replace("\n", " ")


def test_capacity_line_when_near_the_peak_and_a_note_when_far(rep):
    near = dataclasses.replace(rep, gpu_name="tiny", gpu_memory=2 * rep.peak)
    ax = plot_timeline(near)
    assert any(ln.get_color() == ALERT and ln.get_ydata()[0] == pytest.approx(2 * rep.peak / MiB)
               for ln in ax.lines)
    far = dataclasses.replace(rep, gpu_name="T4", gpu_memory=16 * GiB)
    ax = plot_timeline(far)
    assert ax.get_ylim()[1] < 4 * rep.peak / MiB
    assert any(s.startswith("T4: 16.00 GiB") for s in legend_labels(ax))
    ax = plot_timeline(far, capacity=False)
    assert not any("T4" in s for s in legend_labels(ax))


def test_no_trace_is_a_clear_error():
    cuda = MemoryReport(backend="cuda", device="cuda:0", before=0, peak=MiB, after=0, wall_s=0.0)
    with pytest.raises(ValueError, match="backend='sim'"):
        plot_timeline(cuda)
    with pytest.raises(ValueError, match="no op-by-op trace"):
        timeline_chart(cuda)


def test_timeline_chart_has_stable_text_and_png(rep):
    c = timeline_chart(rep)
    assert repr(c) == "<memmagic chart: timeline (cpu)>"
    png, meta = c._repr_png_()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and meta == {"width": 900, "height": 340}
    assert timeline_figure(rep).axes[0].get_xlim()[1] == len(rep.trace.ops)


def test_short_other_runs_between_one_phase_merge():
    spans = [("forward", 1, 10), ("other", 11, 11), ("forward", 12, 20), ("other", 21, 21),
             ("backward", 22, 40), ("other", 41, 60), ("backward", 61, 70),
             ("optimizer", 71, 80)]
    assert merged_spans(spans, 80) == [("forward", 1, 20), ("backward", 22, 40),
                                        ("backward", 61, 70), ("optimizer", 71, 80)]
