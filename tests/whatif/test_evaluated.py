"""Whole reports read off runs: a batch size or context length answered from runs at other
values of it, equal to a real run byte for byte where it answers, marked as evaluated, and
no answer (a run) where the runs do not agree."""

from __future__ import annotations

import pytest

from memmagic import Cell
from memmagic.backends.sim import resolve_target
from memmagic.whatif import fitmap as F
from memmagic.whatif.evaluated import EvaluatedReport, evaluate
from tests.whatif.test_fitmap import BERT, GPT2, LLAMA, MANUAL

pytest.importorskip("transformers")

VIT = """
import torch
from transformers import ViTConfig, ViTForImageClassification
model = ViTForImageClassification(ViTConfig(hidden_size=128, intermediate_size=256,
                                            num_hidden_layers=2, num_attention_heads=4,
                                            image_size=64, patch_size=8, num_labels=10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(batch_size, 3, 64, 64, device="cuda")
model(pixel_values=x, labels=torch.zeros(batch_size, dtype=torch.long, device="cuda")).loss.backward()
opt.step()
"""

# a cell that splits its batch into micro-batches itself
ACCUM = """
import torch
torch.manual_seed(0)
w = torch.nn.Linear(64, 256).cuda()
opt = torch.optim.Adam(w.parameters())
for _ in range(accum_steps):
    x = torch.randn(batch_size // accum_steps, 128, 64, device="cuda")
    w(x).relu().sum(0).float().pow(2).mean().backward()
opt.step()
"""

# every field a report's reader sees, and what the panel draws
FIELDS = ("before", "peak", "after", "reserved_peak", "reserved_after", "peak_op",
          "peak_module", "peak_phase", "peak_label", "breakdown", "breakdown_before",
          "timeline", "modules")


def _cell(source: str, card: str, **defaults) -> Cell:
    return Cell(source, {"batch_size": 2, "seq_len": 64}, backend_options={"gpu": card},
                defaults=defaults)


def _runs(cell: Cell, knob: str, values) -> dict:
    base = cell.setting()
    return {base.replace(**{knob: v}): cell.run(base.replace(**{knob: v}), strict=True)
            for v in values}


def _same(evaluated: EvaluatedReport, run) -> None:
    for name in FIELDS:
        assert getattr(evaluated, name) == getattr(run, name), name
    assert evaluated.fits == run.fits


@pytest.mark.parametrize("source, card, defaults, knob, values, targets", [
    (GPT2, "A100-80GB", {}, "batch_size", (4, 6, 8), (10, 24)),
    (GPT2, "T4", {"amp": "fp16"}, "batch_size", (4, 8, 16), (32,)),
    (GPT2, "A100-80GB", {"amp": "bf16", "checkpointing": True}, "seq_len", (128, 256, 512),
     (384, 1024)),
    (LLAMA, "H100-80GB", {}, "seq_len", (128, 256, 384, 512), (768,)),
    (LLAMA, "A100-80GB", {"checkpointing": True}, "batch_size", (2, 4, 6), (10,)),
    (BERT, "A100-80GB", {"amp": "bf16"}, "batch_size", (2, 4, 8), (16,)),
    (MANUAL, "T4", {}, "seq_len", (128, 256, 384, 512), (640,)),  # scores in context**2
    (VIT, "T4", {}, "batch_size", (4, 8, 16), (12, 64)),
    # accumulation: a forward sees the micro-batch, and the line is drawn in it
    (ACCUM, "T4", {"accum_steps": 2}, "batch_size", (8, 16, 32), (24, 64)),
], ids=["gpt2-batch", "gpt2-t4-fp16", "gpt2-bf16-ckpt-context", "llama-gqa-context",
        "llama-ckpt-batch", "bert-bf16", "manual-attention-parabola", "vit-batch",
        "gpt2-accumulation"])
def test_an_evaluated_size_is_what_a_run_gives_byte_for_byte(source, card, defaults, knob,
                                                              values, targets):
    cell = _cell(source, card, **defaults)
    runs = _runs(cell, knob, values)
    for v in targets:
        target = cell.setting().replace(**{knob: v})
        got = evaluate(runs, target)
        assert isinstance(got, EvaluatedReport), v
        assert got.interpolated and got.source.startswith("evaluated, not run")
        assert str(got).startswith("evaluated (not run): peak ") and "evaluated" in got.summary()
        assert any(n.kind == "evaluated" for n in got.notes)
        _same(got, cell.run(target, strict=True))


def test_a_size_that_does_not_fit_is_evaluated_whole():
    # a run that does not fit stops where the card runs out; the evaluated one says what the
    # whole step needs, and that the card cannot hold it
    cell = _cell(GPT2, "T4", amp="fp16")
    runs = _runs(cell, "batch_size", (4, 8, 16))
    big = cell.setting().replace(batch_size=16384)
    got = evaluate(runs, big)
    run = cell.run(big)
    assert run.failed_request is not None and got.fits is False and got.ran_out
    assert got.reserved_peak > run.gpu_memory > run.live_at_failure
    # the same need as a run on a T4 without a memory limit
    whole = F._roomy(cell, resolve_target("T4")).run(batch_size=16384, strict=True)
    assert (got.peak, got.breakdown) == (whole.peak, whole.breakdown)


# a cell that makes its batch of whole copies of a tensor: batch 6 runs as batch 4
ROUNDS = """
import torch
torch.manual_seed(0)
w = torch.nn.Linear(64, 64).cuda()
x = torch.randn(4, 256, 64, device="cuda").repeat(batch_size // 4, 1, 1)
w(x).relu().sum().backward()
"""


def test_a_value_between_the_runs_multiples_is_run():
    # runs at multiples of 4 lie on a line, and cannot see that the cell rounds between them
    cell = _cell(ROUNDS, "T4")
    runs = _runs(cell, "batch_size", (4, 8, 12))
    base = cell.setting()
    assert evaluate(runs, base.replace(batch_size=6)) is None
    assert cell.run(base.replace(batch_size=6)).peak == runs[base.replace(batch_size=4)].peak
    _same(evaluate(runs, base.replace(batch_size=20)), cell.run(base.replace(batch_size=20)))


def test_too_few_runs_or_runs_off_the_line_give_no_answer():
    cell = _cell(MANUAL, "T4")
    base = cell.setting()
    # two runs draw a line but nothing checks it
    assert evaluate(_runs(cell, "seq_len", (128, 256)), base.replace(seq_len=512)) is None
    # scores grow as context**2: three runs are not on a line, and nothing checks a parabola
    assert evaluate(_runs(cell, "seq_len", (128, 256, 512)), base.replace(seq_len=1024)) is None
    # runs that differ in another knob too are not the family
    runs = _runs(cell, "batch_size", (2, 4))
    runs[base.replace(batch_size=8, amp="bf16")] = cell.run(base.replace(batch_size=8, amp="bf16"))
    assert evaluate(runs, base.replace(batch_size=16)) is None


def test_the_panel_reads_a_size_off_its_runs():
    pytest.importorskip("ipywidgets")
    from memmagic.frontends.widgets import WhatIfPanel

    cell = _cell(GPT2, "T4", amp="fp16")
    panel = WhatIfPanel(cell, debounce_s=0)
    for b in (8, 16):
        panel.set(batch_size=b)
    assert (panel.runs, panel.evaluated) == (3, 0)  # the baseline at 2, 8, 16
    panel.set(batch_size=32)
    assert (panel.runs, panel.evaluated) == (3, 1) and panel.report.interpolated
    assert "evaluated, not run" in panel.text.value and "evaluated" in panel.chart.value
    assert repr(panel).startswith("<memmagic what-if: batch 32, amp fp16, seq 64, on T4 -> peak ")
    assert "(evaluated)" in repr(panel)
    _same(panel.report, cell.run(cell.setting().replace(batch_size=32), strict=True))
    # off: every size is run
    off = WhatIfPanel(cell, debounce_s=0, evaluate=False)
    for b in (8, 16, 32):
        off.set(batch_size=b)
    assert (off.runs, off.evaluated) == (4, 0) and not off.report.interpolated


def test_a_run_that_ran_out_of_memory_checks_the_line_up_to_where_it_stopped():
    # two whole runs draw the line; a run that ran out of memory checks it up to the request
    # that failed, and the whole step it did not finish is read off the line
    cell = _cell(GPT2, "T4", amp="fp16")
    runs = _runs(cell, "batch_size", (4, 8))
    big = cell.setting().replace(batch_size=16384)
    assert evaluate(runs, big) is None  # nothing checks the line yet
    stopped = cell.run(big)
    assert stopped.failed_request is not None
    got = evaluate({**runs, big: stopped}, big)
    assert got.ran_out and got.fits is False
    assert "checked by the run at batch 16384 up to where it ran out of memory" in got.source
    whole = F._roomy(cell, resolve_target("T4")).run(batch_size=16384, strict=True)
    assert (got.peak, got.breakdown) == (whole.peak, whole.breakdown)
    # a run that ran out elsewhere than the line says (another cell's run) checks nothing
    other = _cell(BERT, "T4", amp="fp16").run(big)
    assert other.failed_request is not None and evaluate({**runs, big: other}, big) is None
    # and it checks other sizes too: batch 8192 is read off without a run
    half = evaluate({**runs, big: stopped}, big.replace(batch_size=8192))
    assert half.ran_out and half.peak < got.peak


def test_the_panel_answers_a_setting_that_ran_out_with_what_it_needs():
    pytest.importorskip("ipywidgets")
    from memmagic.frontends.widgets import WhatIfPanel

    cell = _cell(GPT2, "T4", amp="fp16")
    panel = WhatIfPanel(cell, debounce_s=0)
    panel.set(batch_size=8)
    panel.set(batch_size=16384)  # runs, runs out of memory, and checks the line
    r = panel.report
    assert r.interpolated and r.stopped.failed_request is not None and r.fits is False
    assert "does not fit" in panel.status.value and "(evaluated)" in panel.status.value
    panel.set(batch_size=12288)  # read off: no run
    assert (panel.runs, panel.evaluated) == (3, 1) and panel.report.ran_out
