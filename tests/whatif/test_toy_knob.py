"""A knob is one entry: a toy knob defined here, in one place, shows up in the magic's
options, the what-if panel, the memory doctor's candidates and a sweep; the batch size
knob under another name is still the batch everywhere (code finds it by its entry)."""

from __future__ import annotations

import dataclasses

import pytest
from IPython.core.error import UsageError

from memmagic import doctor
from memmagic.whatif.engine import Cell
from memmagic.whatif.knobs import KNOBS, Control, Doctor, Knob, Option
from memmagic.whatif.sweeps import find_batch_size, sweep

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
                option=Option("What-if knob: a toy ballast of TOY - 1 MiB.", metavar="TOY"),
                panel=Control("slider", range=(1, 8)),
                doctor=Doctor(lambda known: [("toy ballast 2", {"toy": 2})]))
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
    from memmagic.frontends.magics import MemMagics

    assert "--toy TOY" in MemMagics.gpumem.__doc__


def test_the_option_goes_when_the_knob_goes(ip):
    knob = Knob("toy2", "toy", "bool", False, "nothing", option=Option("What-if knob: nothing."))
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

    from memmagic.frontends.widgets import WhatIfPanel

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


# -- the batch under another name --------------------------------------------------------------
@pytest.fixture
def samples():
    """The batch size knob renamed ``samples`` (the variable a cell reads too), in its place
    in KNOBS: every use of the batch must find it by its entry (``resize=BATCH_DIM``)."""
    saved = dict(KNOBS)
    old = KNOBS["batch_size"]
    knob = dataclasses.replace(
        old, name="samples", label="samples",
        doctor=dataclasses.replace(old.doctor, fixes=lambda known: [
            (f"samples {known.batch // 2}", {"samples": known.batch // 2})]))
    KNOBS.clear()
    KNOBS.update({k.name: k for k in (knob if k is old else k for k in saved.values())})
    try:
        yield knob
    finally:
        KNOBS.clear()
        KNOBS.update(saved)


def test_the_batch_knob_is_found_by_its_entry_not_its_name(samples):
    import torch

    from memmagic.whatif.knobs import Setting

    assert list(KNOBS)[1] == "samples" and "batch_size" not in KNOBS
    s = Setting(samples=64, accum_steps=4)
    assert (s.label(), s.micro_batch) == ("batch 64 (4 x 16)", 16)
    assert Cell(CELL, {"torch": torch}).baseline.samples is None  # it makes its batch
    ns = {"torch": torch, "x": torch.randn(64, 512)}
    cell = Cell("model = torch.nn.Linear(512, 512, device='cuda')\n"
                "model(x.to('cuda')).sum().backward()", ns)
    assert cell.baseline.samples == 64 and "samples" in cell.applicable()
    small = cell.run(samples=16)
    assert any(n == "samples 16: x resized along dim 0 (from 64)" for n in small.notes)
    split = cell.run(samples=64, accum_steps=4)
    assert any(n.startswith("accum_steps 4: the cell ran 4 times on micro-batches of 16 "
                            "(effective batch 64)") for n in split.notes)
    assert split.peak == small.peak < cell.run().peak
    _, rows, notes = doctor.rank(cell, combine=False)
    assert {"samples": 32} in [r.knobs for r in rows] and doctor.BATCH_HINT not in notes
    _, _, notes = doctor.rank(Cell(CELL, {"torch": torch}), combine=False)
    assert doctor.BATCH_HINT in notes  # no batch to shrink: the entry's note says why


def test_a_cell_that_reads_the_renamed_batch_variable_gets_it(samples):
    import torch

    reads = Cell("x = torch.randn(samples, 1024, device='cuda', requires_grad=True)\n"
                 "(x * 2).sum().backward()", {"torch": torch}, defaults={"samples": 8})
    assert reads.reads == {"samples"} and reads.run(samples=64).peak > reads.run().peak
    found = find_batch_size(reads, budget="64MiB", margin=0.0, high=1 << 14)
    assert found.knob == "samples" and found.value is not None
    assert found.how.startswith(f"{found.value} is the largest batch whose")


def test_the_panel_sweeps_the_renamed_batch(samples):
    pytest.importorskip("ipywidgets")
    import torch

    from memmagic.frontends.widgets import WhatIfPanel

    ns = {"torch": torch, "x": torch.randn(8, 512)}
    panel = WhatIfPanel(Cell("model = torch.nn.Linear(512, 512, device='cuda')\n"
                             "model(x.to('cuda')).sum().backward()", ns))
    assert "samples" in panel.controls and panel.sweep_button.description == "sweep samples"
    panel.controls["samples"].options = (1, 2, 4, 8)
    result = panel.run_sweep()
    assert result.knob == "samples" and result.values == (1, 2, 4, 8)
