"""Sweeps and the batch-size finder on the simulated GPU; the --sweep magic."""

from __future__ import annotations

import subprocess
import sys

import pytest

from memmagic.cell import Cell, Setting
from memmagic.sweep import (BatchSearch, Sweep, default_strategies, find_batch_size,
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


def test_find_batch_size_respects_accumulation():
    src = MLP.replace("batch_size", "micro_batch_size").replace(
        "model.loss(x, y).backward()", "for _ in range(accum_steps):\n    model.loss(x, y).backward()")
    c = Cell(src, {}, defaults={"batch_size": 64})
    assert c.reads == {"micro_batch_size", "accum_steps", "checkpointing"}
    found = find_batch_size(c, budget="160MiB", setting={"accum_steps": 4}, high=1 << 14)
    assert found.batch_size % 4 == 0 and found.batch_size > 4
    plain = find_batch_size(c, budget="160MiB", high=1 << 14)
    assert found.batch_size > plain.batch_size


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
    code = ("import sys, memmagic.cell, memmagic.knobs, memmagic.sweep\n"
            "print([m for m in ('IPython', 'ipywidgets', 'matplotlib') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
