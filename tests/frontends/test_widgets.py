"""The what-if panel, driven as a browser would: set widget values in a real
InteractiveShell and check the rendered state and numbers."""

from __future__ import annotations

import gc
import sys

import pytest
import torch
from IPython.core.error import UsageError

from memmagic.backends.sim.session import shell_session
from memmagic.report import format_bytes

from tests.whatif.test_engine import HANDLES


@pytest.fixture
def panel(ip):
    return ip.run_cell_magic("gpumem", "--whatif --batch-size 8 --gpu T4 -o", HANDLES)


def test_the_panel_has_a_control_per_knob_that_applies(panel):
    assert set(panel.controls) == {"amp", "batch_size", "checkpointing", "weights_dtype",
                                   "grad_mode", "offload", "optimizer", "inplace", "gpu"}
    assert panel.controls["batch_size"].value == 8
    assert panel.chart.value.startswith("<svg class='memmagic-chart'")
    assert "peak 67.92 MiB" in panel.chart.value
    assert repr(panel) == "<memmagic what-if: batch 8, on T4 -> peak 67.92 MiB, fits T4>"


def test_moving_controls_re_runs_and_redraws(panel):
    svg = panel.chart.value
    panel.controls["batch_size"].value = 32
    big = panel.report
    assert panel.setting.batch_size == 32 and big.peak > 2 * panel.baseline_report.peak
    assert panel.chart.value != svg and "effective 32" in panel.text.value
    assert f"peak {format_bytes(big.peak)}" in panel.chart.value  # the new bar beside the baseline
    panel.controls["amp"].value = "bf16"
    amp = panel.report
    assert amp.breakdown["activations"] < big.breakdown["activations"]
    panel.controls["checkpointing"].value = True
    assert panel.report.breakdown["activations"] < amp.breakdown["activations"]
    assert "saves" in panel.text.value or "costs" in panel.text.value
    assert repr(panel).startswith("<memmagic what-if: batch 32, amp bf16, ckpt, on T4 -> peak ")
    assert "(baseline 67.92 MiB)" in repr(panel)


def test_fp16_weights_halve_the_parameters(panel):
    panel.controls["weights_dtype"].value = "fp16"
    assert 2 * panel.report.breakdown["parameters"] == panel.baseline_report.breakdown["parameters"]


def test_a_setting_that_runs_out_of_memory_is_an_answer_not_an_error(ip):
    """Moving a control to a setting that does not fit the card shows that it does not fit:
    what it needs at least, where it ran out, and the breakdown when it did (the chart).
    A setting that cannot run at all says why, with the controls back where the chart is."""
    panel = ip.run_cell_magic("gpumem", "--whatif --batch-size 8 --gpu T4 "
                                        "--range batch_size=1:4096 -o", HANDLES)
    panel.set(batch_size=32)
    svg = panel.chart.value
    panel.set(gpu="laptop-4GB", batch_size=4096)
    r = panel.report
    assert panel.error is None and r.failed_request is not None and r.fits is False
    assert (panel.setting.batch_size, panel.setting.gpu) == (4096, "laptop-4GB")
    least = r.live_at_failure + r.failed_request
    assert sum(r.breakdown.values()) > 0  # the breakdown when it ran out
    assert "does not fit" in panel.status.value and "re-run failed" not in panel.status.value
    assert f"needs more than {format_bytes(least)}" in panel.status.value
    assert f"more than {format_bytes(least)}" in panel.text.value
    assert "out of memory" in panel.text.value and "does NOT fit" in panel.text.value
    assert panel.chart.value != svg and "when it ran out" in panel.chart.value
    assert repr(panel).endswith(f"does NOT fit laptop-4GB (needs more than {format_bytes(least)})>")
    panel.set(gpu="T4", batch_size=16)  # and back
    assert panel.error is None and panel.status.value == "" and panel.report.fits


def test_a_cell_that_raises_at_some_batch_size(ip):
    src = HANDLES + "assert batch_size < 64, 'too big for this cell'\n"
    p = ip.run_cell_magic("gpumem", "--whatif --batch-size 8 -o", src)
    p.controls["batch_size"].value = 64
    assert "too big for this cell" in p.error and p.setting.batch_size == 8
    assert p.controls["batch_size"].value == 8  # back where the chart is
    p.controls["batch_size"].value = 16
    assert p.error is None and p.setting.batch_size == 16
    with pytest.raises(ValueError, match=r"panel.set\(batch_size=64\): .*too big for this cell"):
        p.set(batch_size=64)
    assert p.setting.batch_size == 16 and p.controls["batch_size"].value == 16


def test_set_takes_a_batch_off_the_sliders_marks_and_refuses_a_bad_one_in_a_line(ip):
    p = ip.run_cell_magic("gpumem", "--whatif --batch-size 8 -o", HANDLES)
    p.set(batch_size=24)
    assert p.setting.batch_size == 24 and 24 in p.controls["batch_size"].options
    assert p.report.peak > p.baseline_report.peak
    for bad in (0, "many"):
        with pytest.raises(ValueError) as info:
            p.set(batch_size=bad)
        assert "\n" not in str(info.value) and "batch" in str(info.value)
    assert p.setting.batch_size == 24


def test_set_refuses_a_value_a_choice_control_does_not_offer_and_moves_nothing(panel):
    """A value no button, checkbox or dropdown offers is a ValueError in one line naming the
    values offered (it was a traitlets TraitError, with the controls before it moved)."""
    for bad, offered in (({"amp": None}, "('off', 'fp16', 'bf16')"), ({"amp": "fp8"}, "'bf16'"),
                         ({"batch_size": 32, "optimizer": "lion"}, "'adamw'"),
                         ({"checkpointing": "maybe"}, "(False, True)"), ({"gpu": "H900"}, "'H200'")):
        with pytest.raises(ValueError) as info:
            panel.set(**bad)
        assert "\n" not in str(info.value) and "not one of the values" in str(info.value)
        assert offered in str(info.value)
    assert panel.controls["batch_size"].value == 8 and panel.controls["amp"].value == "off"
    assert panel.setting == panel.baseline
    panel.set(gpu="H100")  # a card by another of its names
    assert panel.controls["gpu"].value == "H100-80GB" and panel.error is None


def test_accumulation_shows_micro_and_effective_batch(ip):
    from tests.whatif.test_engine import ACCUM

    p = ip.run_cell_magic("gpumem", "--whatif --batch-size 32 -o", ACCUM)
    p.controls["accum_steps"].value = 4
    assert "effective 32, micro-batch 8 x 4 steps" in p.text.value
    assert p.report.peak < p.baseline_report.peak


def test_the_panel_uses_objects_of_earlier_cells(ip):
    ip.run_cell("from memmagic import zoo\nmodel, batch = zoo.build('mlp', 'cpu')\n"
                "opt = torch.optim.SGD(model.parameters(), lr=0.1)")
    w = ip.user_ns["model"].blocks[0].fc.weight.clone()
    p = ip.run_cell_magic("gpumem", "--whatif -o", "model.cuda()\n"
                          "model.loss(*[t.cuda() for t in batch]).backward()\nopt.step()\n")
    assert p.controls["batch_size"].value == 64 and "accum_steps" in p.controls
    p.set(batch_size=256)
    assert p.report.peak > p.baseline_report.peak and p.error is None
    assert any("batch resized along dim 0 (from 64)" in n for n in p.report.notes)
    p.set(batch_size=256, accum_steps=4)
    assert p.error is None and any("ran 4 times" in n for n in p.report.notes)
    # the real objects are untouched, the namespace holds what it held
    assert torch.equal(ip.user_ns["model"].blocks[0].fc.weight, w)
    assert ip.user_ns["model"].blocks[0].fc.weight.device.type == "cpu"
    assert "loss" not in ip.user_ns


def test_the_knob_options_work_without_widgets(ip):
    r = ip.run_cell_magic("gpumem", "--backend sim --batch-size 16 --amp bf16 --checkpointing "
                          "-o -q", HANDLES)
    assert any("what-if setting: batch 16, amp bf16, ckpt" in n for n in r.notes)
    base = ip.run_cell_magic("gpumem", "--backend sim --batch-size 16 -o -q", HANDLES)
    assert r.peak < base.peak


def test_whatif_without_ipywidgets_says_what_to_install(ip, monkeypatch):
    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    with pytest.raises(UsageError, match=r"pip install 'ipywidgets>=8'"):
        ip.run_cell_magic("gpumem", "--whatif --batch-size 8", HANDLES)
    r = ip.run_cell_magic("gpumem", "--backend sim --batch-size 8 --amp fp16 -o -q", HANDLES)
    assert r.error is None


@pytest.mark.parametrize("line, msg", [
    ("--whatif --amp fp8", "--amp: amp must be one of off, fp16, bf16"),
    ("--whatif", "give its starting value with --batch-size N"),
    ("--whatif --batch-size 8 --range batch_size=9:2", "9 is above 2"),
    ("--sweep amp=1:4", "integer knob"),
    ("--checkpointing 3x", "--checkpointing takes on, off or a module class name"),
])
def test_misuse_is_one_line(ip, line, msg):
    with pytest.raises(UsageError, match=msg):
        ip.run_cell_magic("gpumem", line, HANDLES)


def test_the_panels_re_runs_leave_the_notebooks_simulated_gpu_alone(ip):
    ip.run_cell_magic("gpumem", "--backend sim -q", "import torch\nkeep = torch.ones(1024, device='cuda')\n")
    session = shell_session(ip)
    held = session.card.live_bytes()
    p = ip.run_cell_magic("gpumem", "--whatif --batch-size 8 -o", HANDLES)
    p.set(batch_size=16, amp="fp16")
    assert session.card.live_bytes() == held
    assert sorted(session.card.shadow) == ["keep"]


@pytest.mark.slow
def test_100_control_changes_leak_nothing(ip):
    p = ip.run_cell_magic("gpumem", "--whatif --batch-size 8 -o", HANDLES)
    p.cache_enabled = False
    values = [("batch_size", 8), ("amp", "bf16"), ("batch_size", 16), ("checkpointing", True),
              ("amp", "off"), ("checkpointing", False)]
    for name, v in values:  # once: the simulator's op caches fill for each new shape
        p.controls[name].value = v
    gc.collect()
    tensors, objects = _count(), len(gc.get_objects())
    for i in range(100):
        name, v = values[i % len(values)]
        p.controls[name].value = v
    assert p.runs == 106 and p.error is None  # the baseline, 5 warm-up changes, 100
    gc.collect()
    assert _count() <= tensors
    assert len(gc.get_objects()) < objects + 200  # measured: +0 to +50 after warm-up


def _count() -> int:
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def test_timeline_and_snapshot_options(ip, tmp_path, capsys):
    path = tmp_path / "run.pickle"
    r = ip.run_cell_magic("gpumem", f"--backend sim --timeline --snapshot {path} -o",
                          "import torch\nx = torch.randn(64, 64, device='cuda', requires_grad=True)\n"
                          "(x @ x).sum().backward()\n")
    assert r.error is None and path.stat().st_size > 0
    assert f"wrote {path}" in capsys.readouterr().out


SIM_SETUP = """\
from memmagic import zoo
model, batch = zoo.build('mlp', 'cuda')
opt = torch.optim.AdamW(model.parameters())
"""
SIM_STEP = "loss = model.loss(*batch)\nloss.backward()\nopt.step()\nopt.zero_grad()\n"


def test_the_panel_uses_objects_earlier_simulated_cells_left(ip):
    """A notebook on the simulated GPU: cell 1 builds the model there, cell 2 trains it;
    the panel on cell 2 re-runs it from a copy of the card, never touching the notebook's."""
    ip.run_cell_magic("gpumem", "--backend sim --gpu T4 -q", SIM_SETUP)
    first = ip.run_cell_magic("gpumem", "--backend sim --gpu T4 -o -q --no-chart", SIM_STEP)
    assert first.error is None, first.error
    session = shell_session(ip)
    held, reserved = session.card.live_bytes(), session.card.reserved_bytes()
    names = sorted(session.card.shadow)
    real = ip.run_cell_magic("gpumem", "--backend sim --gpu T4 -o -q --no-chart", SIM_STEP)
    assert session.card.live_bytes() == held  # a second step holds what the first did
    p = ip.run_cell_magic("gpumem", "--whatif --gpu T4 -o", SIM_STEP)
    assert p.error is None, p.error
    base = p.baseline_report
    # the copy starts where the notebook's card is: the same before, peak and reserved as
    # the cell's own run on that card
    assert base.before == real.before == held
    assert base.peak == real.peak and base.reserved_peak == real.reserved_peak
    assert base.after == real.after and base.reserved_after == real.reserved_after
    assert p.controls["batch_size"].value == 64  # the simulated batch's first dimension
    p.set(batch_size=256)
    assert p.error is None and p.report.peak > base.peak
    p.set(batch_size=64, weights_dtype="bf16")  # the copy of the model is converted
    assert p.error is None and p.report.peak < base.peak
    # halved, but for 512-B rounding of the small biases
    assert abs(p.report.breakdown["parameters"] * 2 - base.breakdown["parameters"]) <= 4096
    assert any("optimizer state tensors made before the conversion" in n for n in p.report.notes)
    # the notebook's card is as it was: its bytes, its cache, its names
    assert session.card.live_bytes() == held and session.card.reserved_bytes() == reserved
    assert sorted(session.card.shadow) == names
    assert "loss" in ip.user_ns  # a placeholder of the real simulated cell's, kept
    again = ip.run_cell_magic("gpumem", "--backend sim --gpu T4 -o -q --no-chart", SIM_STEP)
    assert again.before == held and again.peak == real.peak


def test_a_copy_of_the_simulated_gpu_that_no_longer_fits_says_so(ip):
    ip.run_cell_magic("gpumem", "--backend sim --gpu A100-80GB -q",
                      "import torch\nbig = torch.empty(20 * 2**30, dtype=torch.uint8, device='cuda')\n")
    p = ip.run_cell_magic("gpumem", "--whatif --gpu A100-80GB -o",
                          "y = big[:batch_size].float()\n" if False else "y = big.sum()\n")
    assert p.error is None
    with pytest.raises(ValueError, match="do not fit on T4"):  # set() says why, in a line
        p.set(gpu="T4")
    assert p.error is not None and "do not fit on T4" in str(p.error)
    assert p.setting.gpu == "A100-80GB" and p.controls["gpu"].value == "A100-80GB"
