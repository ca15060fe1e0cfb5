"""The doctor ranks fixes for what ran: the batch the magic was asked for, a run that ran out
of memory read as "more than" what it needs at least, no weight conversion offered for a
quantized model, and no row for a fix the cell already makes."""

from __future__ import annotations

import pytest

from memmagic import doctor
from memmagic.pipeline import ranking_engine

STEP = """
import torch
torch.manual_seed(0)
x = torch.randn(batch_size, 2048, device="cuda")
y = model(x)
y.float().pow(2).mean().backward()
"""
MODEL = "import torch\nmodel = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)]).cuda()\n"


def test_after_an_out_of_memory_at_the_asked_batch_the_fixes_are_for_that_batch(ip):
    ip.run_line_magic("gpusim", "on --gpu laptop-4GB")
    try:
        ip.run_cell(MODEL + "batch_size = 2\n")
        r = ip.run_cell_magic("gpumem", "--batch-size 65536 --advise --no-raise -o -q --no-chart",
                              STEP)
    finally:
        ip.run_line_magic("gpusim", "off")
    assert r.failed_request is not None
    advice = r.advice
    assert advice.baseline.label == "as run (batch 65536)" and advice.baseline.out_of_memory
    batch_rows = [s for s in advice.strategies if set(s.knobs) == {"batch_size"}]
    assert batch_rows and all("(from 65536)" in s.label for s in batch_rows)
    # the halvings, and the largest batch that fits by the line through them, run
    assert [s.label for s in batch_rows if "," in s.label] == [
        "batch 48896 (from 65536), the largest that fits"]
    assert any(s.fits for s in batch_rows)
    # a row that ran out reads "more than" what it needs at least: never below a smaller
    # batch that ran to its end
    by_batch = sorted(batch_rows, key=lambda s: s.knobs["batch_size"])
    needs = [s.peak for s in by_batch]
    assert needs == sorted(needs)
    table = {row[0]: row for row in advice.strategy_rows()}
    assert table["as run (batch 65536)"][1].startswith("> ")


def test_an_out_of_memory_rows_peak_is_what_it_needs_at_least():
    engine = ranking_engine(MODEL + "y = model(torch.randn(8192, 2048, device='cuda')).sum()\n",
                            gpu_memory="256MiB")
    base, _, _ = doctor.rank(engine, knobs=())
    r = engine.run()
    assert base.out_of_memory and base.label == "as written"
    assert base.peak == r.live_at_failure + r.failed_request > r.peak


def test_no_weight_conversion_is_offered_for_a_4bit_model(ip):
    pytest.importorskip("bitsandbytes")
    ip.run_line_magic("gpusim", "on --gpu T4")
    try:
        ip.run_cell("import torch\nimport bitsandbytes as bnb\n"
                    "lin = bnb.nn.Linear4bit(1024, 1024, bias=False, quant_type='nf4', "
                    "compute_dtype=torch.bfloat16).cuda()\n"
                    "x = torch.randn(64, 1024, device='cuda', dtype=torch.bfloat16)\n")
        engine = ip.run_cell_magic("gpumem", "--whatif -o", "lin(x).float().sum()\n").cell
    finally:
        ip.run_line_magic("gpusim", "off")
    assert "weights_dtype" not in engine.applicable()
    _, rows, _ = doctor.rank(engine, combine=False)
    assert not [s for s in rows if "weights" in s.label]


def test_a_fix_the_cell_already_makes_gets_no_row_but_a_note():
    own_autocast = (MODEL + "with torch.autocast('cuda', dtype=torch.bfloat16):\n"
                    "    y = model(torch.randn(256, 2048, device='cuda'))\n"
                    "y.float().sum().backward()\n")
    _, rows, notes = doctor.rank(ranking_engine(own_autocast, gpu="T4"), knobs=("amp",))
    # the cell's own bf16 autocast: AMP bf16 is not re-run (AMP fp16, another dtype and
    # a GradScaler, keeps its row)
    assert [s.label for s in rows] == ["AMP fp16"]
    assert ("AMP bf16: not re-run, the cell runs every model call under autocast bf16 "
            "already") in notes
    # a model call outside its autocast: AMP bf16 changes that one, and is re-run
    _, rows, notes = doctor.rank(ranking_engine(own_autocast + "model(torch.randn(8, 2048, "
                                                "device='cuda'))\n", gpu="T4"), knobs=("amp",))
    assert sorted(s.label for s in rows) == ["AMP bf16", "AMP fp16"]


def test_a_row_with_the_baselines_own_figures_becomes_a_note():
    from memmagic.doctor.ranking import Strategy, _without_repeats

    base = Strategy("as written", {}, 100, 128, True)
    same, other = Strategy("AMP bf16", {"amp": "bf16"}, 100, 128, True), \
        Strategy("batch 4", {"batch_size": 4}, 60, 64, True)
    notes: list[str] = []
    assert _without_repeats([same, other], base, "cell", notes) == [other]
    assert notes == ['AMP bf16: the same figures as the "as written" row (the cell already '
                     'does this, or it changes nothing here)']


def test_the_command_line_speaks_of_the_script_and_ranks_what_ran(tmp_path, capsys, clean_state):
    from memmagic.frontends import cli

    script = tmp_path / "train.py"
    script.write_text("import torch\n"
                      "model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)]).cuda()\n"
                      "for _ in range(2):\n"
                      "    model(torch.randn(64, 4096, device='cuda')).sum().backward()\n")
    assert cli.main(["run", "--gpu-memory", "300MiB", "--whatif", "amp=bf16", str(script)]) == 1
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "cell" not in text.lower()
    assert "The failed script's local variables were released" in text
    assert "the failed script's frames" in text and "script failed: " in text
    rows = [line.split("  ")[1] for line in captured.out.splitlines()
            if line.startswith("  ") and ("> " in line or "fits" in line)]
    assert "as run (amp bf16)" in rows[0] and not [r for r in rows if r.startswith("AMP bf16")]
    assert "the script does not take its batch size on its command line" in captured.out


# a cell that builds its model and optimizer and runs out of memory in its first backward
BUILDS_AND_FAILS = """
import torch
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)]).cuda()
opt = torch.optim.AdamW(model.parameters())
x = torch.randn(batch_size, 2048, device="cuda")
model(x).float().pow(2).mean().backward()
opt.step()
"""


def test_a_cell_that_built_its_model_and_ran_out_is_not_repeated_per_micro_step():
    # the run that failed built model and opt: accumulation (the cell repeated per
    # micro-step) would build them again, so it is not offered (it was, and each row ran
    # the cell to fail with a KnobError at its end)
    engine = ranking_engine(BUILDS_AND_FAILS, {"batch_size": 8192}, gpu_memory="512MiB")
    base, rows, _ = doctor.rank(engine, combine=False)
    assert base.out_of_memory
    engine.run()
    assert engine.last_info.built == ["model", "opt"]
    assert "accum_steps" not in engine.applicable()
    assert not [s for s in rows if "accumulate" in s.label]
    assert any(s.fits for s in rows if set(s.knobs) == {"batch_size"})


def test_optimizer_rows_are_not_rerun_when_the_run_failed_before_its_first_step():
    engine = ranking_engine(BUILDS_AND_FAILS, {"batch_size": 8192}, gpu_memory="512MiB")
    base, rows, notes = doctor.rank(engine, combine=False)
    assert not [s for s in rows if "optimizer" in s.knobs]
    assert ("optimizer: not re-run, the cell ran out of memory before its first optimizer "
            "step began (where an optimizer makes its state), so it would run out at the "
            "same place") in notes
    # run anyway, an optimizer row runs out exactly where the cell did
    again = engine.run(optimizer="sgd")
    first = engine.run()
    assert engine.last_info.steps_begun == 0
    assert (again.failed_request, again.live_at_failure) == (first.failed_request,
                                                            first.live_at_failure)


def test_optimizer_rows_are_rerun_when_the_run_failed_in_its_optimizer_step():
    # the step's state is what does not fit: another optimizer is a real fix
    cell = BUILDS_AND_FAILS.replace("batch_size, 2048", "2, 2048") + "opt.step()\n"
    engine = ranking_engine(cell, {"batch_size": 2}, gpu_memory="300MiB")
    base, rows, notes = doctor.rank(engine, combine=False)
    assert base.out_of_memory
    engine.run()
    assert engine.last_info.steps_begun == 1
    sgd = [s for s in rows if s.knobs == {"optimizer": "sgd-momentum"}]
    assert sgd and sgd[0].fits
    assert not [n for n in notes if "not re-run" in n]


def test_rows_that_run_out_exactly_as_the_cell_did_become_one_note():
    # out of memory in the optimizer step: offloading saved activations (all freed by then)
    # runs out at the same place, with the same tensors live
    cell = BUILDS_AND_FAILS.replace("batch_size, 2048", "2, 2048") + "opt.step()\n"
    engine = ranking_engine(cell, {"batch_size": 2}, gpu_memory="300MiB")
    base, rows, notes = doctor.rank(engine, knobs=("offload", "optimizer"), combine=False)
    assert base.out_of_memory
    assert [s.label for s in rows] == ["optimizer: Adafactor (factored state)",
                                       "optimizer: SGD with momentum (1 state)"]
    assert ('offload saved activations to CPU: ran out of memory exactly as the "as written" '
            'row did (the same tensors live, the same request): they change nothing before '
            'that point') in notes
