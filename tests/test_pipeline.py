"""The one path of a cell (memmagic.pipeline), used from Python as the magic uses it."""

from __future__ import annotations

import pytest
import torch

import memmagic
from memmagic.pipeline import CellRequest, RequestError, make_cell, run_cell

STEP = """
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512)).cuda()
x = torch.randn(256, 512, device="cuda")
model(x).sum().backward()
"""


def test_run_cell_returns_the_report_value_and_error():
    ns = {"torch": torch}
    r = run_cell(CellRequest("y = torch.ones(1024, device='cuda')\ny.numel()", ns,
                             backend="sim", gpu="T4"))
    assert r.error is None and r.value == 1024 and r.report.peak == 4096
    assert r.report.fits is True and "y" in ns
    failed = run_cell(CellRequest("raise KeyError('k')", {}, backend="sim"))
    assert isinstance(failed.error, KeyError) and failed.report.error == "KeyError: 'k'"
    assert memmagic.run_cell is run_cell


def test_knobs_in_a_request_are_applied_and_said_in_notes():
    plain = run_cell(CellRequest(STEP, {"torch": torch}, backend="sim"))
    amp = run_cell(CellRequest(STEP, {"torch": torch}, backend="sim", knobs={"amp": "bf16"}))
    assert amp.report.breakdown["activations"] < plain.report.breakdown["activations"]
    kinds = {n.kind for n in amp.report.notes}
    assert {"setting", "knob"} <= kinds
    assert [n for n in amp.report.notes if n.kind == "setting"] == ["what-if setting: amp bf16"]


def test_the_card_size_note_is_said_once_with_the_options_as_typed():
    r = run_cell(CellRequest("y = 1", {}, backend="sim", gpu="T4", gpu_memory="6GiB"))
    card = [n for n in r.report.notes if n.kind == "card"]
    assert len(card) == 1 and card[0].startswith("--gpu-memory 6GiB replaced the T4's")


@pytest.mark.parametrize("request_, message", [
    (CellRequest("y = 1", {}, backend="cpu", gpu="T4"), "add --backend sim"),
    (CellRequest("y = 1", {}, backend="sim", knobs={"amp": "fp8"}), "--amp: amp must be one of"),
    (CellRequest("y = 1", {}, backend="sim", knobs={"nope": 1}), "unknown knob 'nope'"),
    (CellRequest("y = 1", {}, backend="tpu"), "backend must be one of"),
    (CellRequest("y = 1", {}, backend="sim", breakdown=False), "--no-breakdown applies to"),
    (CellRequest("y = 1", {}, backend="cpu", max_seconds=5), "--max-seconds bounds a simul"),
    (CellRequest("y = 1", {}, backend="sim", max_seconds=0), "--max-seconds needs a positive"),
])
def test_a_request_that_cannot_run_is_one_line(request_, message):
    with pytest.raises(RequestError, match=message) as info:
        run_cell(request_)
    assert "\n" not in str(info.value)


def test_make_cell_gives_the_engine_with_the_requests_knobs_as_baseline():
    cell = make_cell(CellRequest(STEP, {"torch": torch}, backend="sim", gpu="T4",
                                 knobs={"checkpointing": "on", "amp": "fp16"}))
    assert cell.baseline.amp == "fp16" and cell.baseline.checkpointing is True
    assert cell.baseline.gpu == "T4"


def test_a_cell_given_longer_runs_longer_and_one_over_its_time_says_how_to_give_it_longer():
    loop = "x = torch.ones(8, device='cuda')\nfor _ in range(N):\n    x = x + 1\n"
    slow = run_cell(CellRequest(loop, {"torch": torch, "N": 10**7}, backend="sim",
                                max_seconds=0.05))
    assert type(slow.error).__name__ == "SimulationBudgetExceeded"
    assert "stopped after 0.05 s" in str(slow.error)
    assert "%%gpumem --max-seconds 0.2 on its first line" in str(slow.error)
    ok = run_cell(CellRequest(loop, {"torch": torch, "N": 3000}, backend="sim",
                              max_seconds=600))
    assert ok.error is None
