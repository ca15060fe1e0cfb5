"""The code students really write, as the defects found in it were reproduced (issue 23):
each test failed on the code before its fix."""

from __future__ import annotations

import pytest
import torch
from IPython.core.error import UsageError

MiB = 1 << 20

MODEL = """
import torch
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda()
x = torch.randn(4096, 256, device="cuda")
"""

OWN_AMP = """
with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
    loss = model(x).float().pow(2).mean()
loss.backward()
"""


def _sim_model(ip):
    ip.run_line_magic("gpusim", "on --gpu T4")
    ip.run_cell(MODEL)


# -- 2: a knob's value takes the type of the cell's own variable -------------------------
def test_a_flag_of_the_cells_own_gets_true_or_false(ip):
    _sim_model(ip)
    ip.run_cell("amp = False")
    panel = ip.run_cell_magic("gpumem", "--whatif -o -q", OWN_AMP)
    assert panel.baseline_report.error is None and panel.baseline.amp == "off"
    assert "amp" in panel.controls
    fp32 = panel.report.peak
    panel.set(amp="fp16")
    assert panel.error is None and panel.report.error is None
    assert panel.report.peak < fp32  # the fp16 activations are half the size
    assert ip.user_ns["amp"] is False  # the notebook's own variable is untouched


def test_a_flag_that_is_on_is_the_baseline(ip):
    _sim_model(ip)
    ip.run_cell("amp = True")
    panel = ip.run_cell_magic("gpumem", "--whatif -o -q", OWN_AMP)
    assert panel.baseline.amp == "fp16" and panel.baseline_report.error is None
    on = panel.report.peak
    panel.set(amp="off")
    assert panel.report.error is None and panel.report.peak > on


def test_a_variable_the_cell_fails_with_falls_back_to_memmagic_applying_the_knob(ip):
    _sim_model(ip)
    ip.run_cell('amp = "float16"')  # a name of the cell's own, which memmagic cannot follow
    own = OWN_AMP.replace("dtype=torch.float16, enabled=amp", "dtype=getattr(torch, amp)")
    panel = ip.run_cell_magic("gpumem", "--whatif -o -q", own)
    assert panel.baseline_report.error is None
    assert any(n.startswith("memmagic applies amp itself: the cell failed with its own "
                            "variables") for n in panel.baseline_report.notes)
    panel.set(amp="bf16")
    assert panel.report.error is None and "amp bf16" in panel.setting.label()
