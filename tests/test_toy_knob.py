"""A knob is one entry: a toy knob defined here, in one place, shows up in the magic's
options, the what-if panel, the memory doctor's candidates and a sweep."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from memmagic import doctor
from memmagic.cell import Cell
from memmagic.knobs import KNOBS, Knob
from memmagic.sweep import sweep

MiB = 1 << 20
CELL = """
model = torch.nn.Linear(512, 512, device="cuda")
x = torch.randn(64, 512, device="cuda")
model(x).sum().backward()
"""


def _apply_toy(a, value: int) -> None:
    """Hold ``value - 1`` MiB on the model's device from its first call to the run's end."""
    if value == 1:
        return
    import torch

    held: list = []

    def grab(module, args):
        device = next(module.parameters()).device
        held.append(torch.empty((value - 1) * MiB, dtype=torch.uint8, device=device))
        a.note(f"toy {value}: {value - 1} MiB held from the first model call")
        return None

    a.at_call(grab)
    a.undo_later(held.clear)


@pytest.fixture
def toy():
    knob = Knob("toy", "toy ballast", "int", 1, "ballast held from the first model call",
                low=1, high=64, apply=_apply_toy, needs="model", short="toy",
                help="What-if knob: a toy ballast of TOY - 1 MiB.", metavar="TOY",
                panel="slider", panel_range=(1, 8),
                fixes=lambda known: [("toy ballast 2", {"toy": 2})])
    KNOBS["toy"] = knob
    try:
        yield knob
    finally:
        del KNOBS["toy"]


def test_the_toy_knob_is_a_magic_option(ip, toy):
    base = ip.run_cell_magic("gpumem", "--backend sim -o -q", "import torch" + CELL)
    more = ip.run_cell_magic("gpumem", "--backend sim -o -q --toy 5", "import torch" + CELL)
    assert more.peak - base.peak == 4 * MiB
    assert any(n.startswith("toy 5: 4 MiB held") and n.kind == "knob" for n in more.notes)
    with pytest.raises(UsageError, match="--toy: toy must be between 1 and 64"):
        ip.run_cell_magic("gpumem", "--backend sim -q --toy 99", "import torch" + CELL)
    from memmagic.magics import MemMagics

    assert "--toy TOY" in MemMagics.gpumem.__doc__


def test_the_option_goes_when_the_knob_goes(ip):
    knob = Knob("toy2", "toy", "bool", False, "nothing", help="What-if knob: nothing.")
    KNOBS["toy2"] = knob
    try:
        ip.run_cell_magic("gpumem", "--backend sim -q --toy2", "import torch")
    finally:
        del KNOBS["toy2"]
    with pytest.raises(UsageError, match="unrecognized arguments: --toy2"):
        ip.run_cell_magic("gpumem", "--backend sim -q --toy2", "import torch")


def test_the_toy_knob_is_a_panel_control(toy):
    pytest.importorskip("ipywidgets")
    import torch

    from memmagic.widgets import WhatIfPanel

    panel = WhatIfPanel(Cell(CELL, {"torch": torch}))
    assert "toy" in panel.knobs and list(panel.controls["toy"].options) == [1, 2, 4, 8]
    base = panel.report.peak
    panel.set(toy=4)
    assert panel.setting.toy == 4 and panel.report.peak - base == 3 * MiB
    assert "toy 4" in panel.setting.label()


def test_the_toy_knob_is_a_doctor_candidate_and_a_sweep(toy):
    import torch

    cell = Cell(CELL, {"torch": torch})
    _, rows, _ = doctor.rank(cell, combine=False)
    toy_rows = [r for r in rows if r.knobs == {"toy": 2}]
    assert [r.label for r in toy_rows] == ["toy ballast 2"]
    result = sweep(cell, "toy", [1, 2, 4], strategies={"as written": cell.setting()})
    peaks = [r.peak for _, r in result.curves["as written"]]
    assert [b - peaks[0] for b in peaks] == [0, 1 * MiB, 3 * MiB]
