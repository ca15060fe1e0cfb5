"""Sweeps and the batch-size finder on the simulated GPU; the --sweep magic."""

from __future__ import annotations

import subprocess
import sys

import pytest

from memmagic.whatif.engine import Cell, Setting
from memmagic.whatif.sweeps import (BatchSearch, Sweep, default_strategies, find_batch_size,
                            parse_values, sweep)

MLP = """
import torch
from memmagic import zoo
model, _ = zoo.build("mlp", device="cuda", checkpointing=checkpointing)
x = torch.randn(batch_size, 1, 28, 28, device="cuda")
y = torch.randint(10, (batch_size,), device="cuda")
model.loss(x, y).backward()
"""


@pytest.fixture(scope="module")
def cell():
    return Cell(MLP, {}, defaults={"batch_size": 64}, backend_options={"gpu": "T4"})


def test_parse_values():
    assert parse_values("1:512") == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    assert parse_values("3:20") == (3, 4, 8, 16, 20)
    assert parse_values("8,16, 24") == (8, 16, 24)
    with pytest.raises(ValueError, match="LO:HI"):
        parse_values("big")
    with pytest.raises(ValueError, match="integer knob"):
        parse_values("1:4", "amp")


def test_default_strategies_are_the_combinations_that_apply(cell):
    assert default_strategies(cell, ["amp", "checkpointing"]) == {
        "fp32": Setting(), "fp32 + ckpt": Setting(checkpointing=True),
        "amp bf16": Setting(amp="bf16"), "amp bf16 + ckpt": Setting(amp="bf16", checkpointing=True)}
    assert list(default_strategies(cell, ["batch_size"])) == ["as written"]


def test_a_sweep_gives_a_curve_per_strategy_and_the_largest_that_fits(cell):
    s = sweep(cell, "batch_size", [64, 1024], {"fp32": Setting(), "amp": Setting(amp="bf16")})
    assert list(s.curves) == ["fp32", "amp"] and s.capacity_name == "T4"
    for pts in s.curves.values():
        peaks = [r.peak for _, r in pts]
        assert peaks[0] < peaks[1]
    assert s.largest_fitting() == {"fp32": 1024, "amp": 1024}
    assert str(s).startswith("sweep of batch_size 64..1024 (2 values x 2 strategies")
    assert repr(s.chart()) == "<memmagic chart: sweep of batch_size 64..1024, 2 strategies>"
    assert s.chart()._repr_png_()[0].startswith(b"\x89PNG")


def test_a_strategy_stops_at_its_first_out_of_memory():
    c = Cell(MLP, {}, defaults={"batch_size": 64}, backend_options={"gpu": "laptop-4GB"})
    s = sweep(c, "batch_size", [1024, 1 << 20, 1 << 21], {"fp32": Setting()})
    pts = s.curves["fp32"]
    assert [v for v, _ in pts] == [1024, 1 << 20]  # 2**21 not run: 2**20 ran out
    assert pts[-1][1].fits is False and s.largest_fitting() == {"fp32": 1024}


def test_find_batch_size_keeps_the_margin_and_says_how(cell):
    found = find_batch_size(cell, budget="256MiB", margin=0.2)
    assert isinstance(found, BatchSearch) and found.method == "simulation"
    b = found.batch_size
    assert b is not None and found.report.need <= found.limit == int(256 * 2**20 * 0.8)
    over = cell.run(batch_size=b + 1)
    assert over.need > found.limit
    assert found.how.startswith(f"{b} is the largest batch whose reserved peak stays under 204.80 MiB "
                                "(80% of 256.00 MiB)")
    assert [t[0] for t in found.trials][:3] == [1, 2, 4]  # doubling first


def test_the_line_through_two_runs_guesses_the_largest_batch_and_two_runs_bear_it_out(
        cell, monkeypatch):
    """After two batches that fit and made the same allocations, the line through them
    (each allocation's size, the allocator replayed) names the boundary; it and the batch
    after it are run. The answer is the doubling-and-bisecting search's, in fewer runs."""
    from memmagic.whatif import sweeps

    found = find_batch_size(cell, budget="256MiB", margin=0.2)
    b = found.batch_size
    runs = [t[0] for t in found.trials]
    assert runs[-2:] == [b, b + 1] and found.trials[-2][2] and not found.trials[-1][2]
    assert found.guessed == b and f"through theirs named {b}, then running it" in found.how
    # without the line (the runs look different to it): the same answer, more runs
    original = sweeps._line

    def blind(*args):
        line = original(*args)
        line.ok = False
        return line
    monkeypatch.setattr(sweeps, "_line", blind)
    plain = find_batch_size(cell, budget="256MiB", margin=0.2)
    assert plain.batch_size == b and len(plain.trials) > len(found.trials)


def test_a_guess_the_runs_do_not_bear_out_bounds_the_search():
    """A line that names too large a size (its run does not fit) or too small a one (the
    size after it fits too): the search goes on from what those runs showed."""
    from memmagic.whatif.sweeps import _largest

    for truth, g in ((37, 50), (37, 20), (37, 37), (37, 36)):
        ran: list[int] = []

        def fits(v):
            ran.append(v)
            return v <= truth
        assert _largest(fits, 1, 1 << 16, 1, lambda a, c: g) == truth, (truth, g, ran)
        if g == truth:
            assert ran == [1, 2, 37, 38]
        assert len(ran) == len(set(ran))  # no size run twice


def test_find_batch_size_respects_accumulation():
    src = MLP.replace("batch_size", "micro_batch_size").replace(
        "model.loss(x, y).backward()", "for _ in range(accum_steps):\n    model.loss(x, y).backward()")
    c = Cell(src, {}, defaults={"batch_size": 64})
    assert c.reads == {"micro_batch_size", "accum_steps", "checkpointing"}
    found = find_batch_size(c, budget="160MiB", setting={"accum_steps": 4}, high=1 << 14)
    assert found.batch_size % 4 == 0 and found.batch_size > 4
    plain = find_batch_size(c, budget="160MiB", high=1 << 14)
    assert found.batch_size > plain.batch_size


def test_the_finders_take_the_card_as_fit_map_does():
    """``find_batch_size(cell, gpu="T4")`` (a user wrote it so after ``fit_map(cell,
    gpu="T4")`` and got "unexpected keyword argument 'gpu'"): the card of the search, as a
    cell made for that card searches it; an unknown card is one line."""
    from memmagic.whatif.knobs import KnobError
    import torch

    from memmagic.whatif.sweeps import find_seq_len

    src = ("x = torch.randn(batch_size, seq_len, 1 << 14, device='cuda', requires_grad=True)\n"
           "(x * 2).sum().backward()\n")
    ns = {"torch": torch, "batch_size": 8, "seq_len": 64}
    asked = find_batch_size(Cell(src, ns), gpu="T4")
    assert asked.value == find_batch_size(Cell(src, ns, gpu="T4")).value
    assert asked.report.gpu_name == "T4" and asked.value > 8
    assert (find_seq_len(Cell(src, ns), gpu="T4").value
            == find_seq_len(Cell(src, ns, gpu="T4")).value)
    with pytest.raises(KnobError, match="not 'T5'"):
        find_batch_size(Cell(src, ns), gpu="T5")


def test_find_batch_size_misuse(cell):
    with pytest.raises(ValueError, match="margin"):
        find_batch_size(cell, margin=1.5)
    with pytest.raises(ValueError, match="method must be"):
        find_batch_size(cell, method="guess")
    with pytest.raises(ValueError, match="backend='cuda'"):
        find_batch_size(cell, method="trials")
    with pytest.raises(ValueError, match="budget"):
        find_batch_size(Cell(MLP, {}, defaults={"batch_size": 8}), high=2)


def test_the_sweep_magic(ip):
    s = ip.run_cell_magic("gpumem", "--sweep batch_size=32:128 --gpu T4 -o -q", MLP)
    assert isinstance(s, Sweep) and s.values == (32, 64, 128)
    assert set(s.curves) == {"fp32", "fp32 + ckpt", "amp bf16", "amp bf16 + ckpt"}
    assert all(v == 128 for v in s.largest_fitting().values())
    assert not any(k in ip.user_ns for k in ("model", "x", "y"))


def test_the_engine_knows_nothing_of_ipython_or_widgets():
    code = ("import sys, memmagic.whatif.engine, memmagic.whatif.knobs, memmagic.whatif.sweeps\n"
            "print([m for m in ('IPython', 'ipywidgets', 'matplotlib') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- values read off lines between runs (sweep.Interpolated) ----------------------------------
def _peaks(s):
    return {name: [(v, r.peak, r.reserved_peak) for v, r in pts] for name, pts in s.curves.items()}


def test_interpolated_values_are_the_runs_to_the_byte(cell):
    fast = sweep(cell, "batch_size", "1:512")
    exact = sweep(cell, "batch_size", "1:512", exact=True)
    assert exact.interpolated == 0 and exact.runs == 40
    assert 0 < fast.interpolated and fast.runs + fast.interpolated == 40
    assert _peaks(fast) == _peaks(exact)  # peak and reserved peak of every value
    assert fast.largest_fitting() == exact.largest_fitting()
    assert f"{fast.runs} runs + {fast.interpolated} interpolated between runs" in str(fast)
    point = next(r for pts in fast.curves.values() for _, r in pts if r.interpolated)
    assert point.lo[0] < point.check < point.hi[0] or point.lo[0] < point.value < point.hi[0]
    assert "interpolated between the runs at" in point.source and point.gpu_name == "T4"
    with pytest.raises(AttributeError, match="run it"):
        point.breakdown


def test_the_values_beside_the_largest_that_fits_are_runs(cell):
    exact = dict(sweep(cell, "batch_size", "1:4096", {"fp32": Setting()}, exact=True).curves["fp32"])
    budget = (exact[1024].need + exact[2048].need) // 2  # between two values on a line
    s = sweep(cell, "batch_size", "1:4096", {"fp32": Setting()}, capacity=budget)
    pts = s.curves["fp32"]
    assert s.largest_fitting() == {"fp32": 1024} and s.interpolated > 0
    settled = dict(pts)
    assert not settled[1024].interpolated and not settled[2048].interpolated
    assert [(v, r.need) for v, r in pts] == [(v, exact[v].need) for v, _ in pts]


@pytest.mark.parametrize("step", [
    # the scores of a batch against itself: bytes grow with the batch squared
    "s = x @ x.T\ns.relu().sum().backward()\n",
    # a chunk per 32 rows: how many allocations there are depends on the batch
    "sum(c.relu().sum() for c in x.split(32)).backward()\n",
], ids=["quadratic", "chunked"])
def test_what_is_not_linear_in_the_batch_is_run(step):
    src = "import torch\nx = torch.randn(batch_size, 512, device='cuda', requires_grad=True)\n" + step
    c = Cell(src, {}, defaults={"batch_size": 8})
    fast = sweep(c, "batch_size", "1:2048", {"as written": Setting()})
    exact = sweep(c, "batch_size", "1:2048", {"as written": Setting()}, exact=True)
    assert _peaks(fast) == _peaks(exact)


def test_the_chart_rings_interpolated_values(cell):
    from matplotlib.lines import Line2D

    s = sweep(cell, "batch_size", "1:512", {"fp32": Setting()})
    ax = s.figure().axes[0]
    hollow = [ln for ln in ax.lines if isinstance(ln, Line2D) and ln.get_markerfacecolor() == "none"
              and ln.get_markersize() < 8]  # (the largest that fits has a ring of its own)
    ringed = {int(v) for ln in hollow for v in ln.get_xdata()}
    assert ringed == {v for v, r in s.curves["fp32"] if r.interpolated} and ringed
    assert any("interpolated between runs" in t.get_text() for t in ax.get_legend().get_texts())


def test_a_context_sweep_reads_attention_scores_off_parabolas():
    # scores in the context's square: no line through two contexts holds, a parabola
    # through three does, and a fourth run checks it
    from tests.whatif.test_fitmap import MANUAL

    c = Cell(MANUAL, {"batch_size": 2, "seq_len": 128}, backend_options={"gpu": "T4"})
    values = list(range(128, 2049, 128))
    fast = sweep(c, "seq_len", values, {"as written": Setting()})
    exact = sweep(c, "seq_len", values, {"as written": Setting()}, exact=True)
    assert _peaks(fast) == _peaks(exact)
    assert fast.runs == 4 and fast.interpolated == 12 and exact.runs == 16
    point = next(r for _, r in fast.curves["as written"] if r.interpolated)
    assert point.through is not None and "parabolas through theirs and the run at" in point.source
