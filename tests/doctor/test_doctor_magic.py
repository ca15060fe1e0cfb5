"""The memory doctor through the magic: --advise, and the advice after a failed cell."""

from __future__ import annotations

import pytest

from memmagic.backends.sim.session import shell_session

LEAKY = """
model = torch.nn.Linear(256, 256)
epoch_loss = 0
for _ in range(3):
    loss = model(torch.randn(64, 256)).pow(2).mean()
    epoch_loss += loss
"""


def test_advise_names_the_classic_leak_and_its_fix(ip):
    r = ip.run_cell_magic("gpumem", "--backend cpu --advise -o -q", LEAKY)
    assert r.advice is not None and r.advice.retained is not None
    rows = {n: row for row in r.advice.retained.rows for n in row.names}
    assert "epoch_loss" in rows
    row = rows["epoch_loss"]
    assert row.problem and "epoch_loss" in row.problem
    assert "item()" in row.fix or "detach()" in row.fix
    assert r.to_dict()["advice"]["retained"]["rows"]


def test_no_advice_without_the_option_on_a_good_cell(ip):
    r = ip.run_cell_magic("gpumem", "--backend cpu -o -q", "x = torch.ones(1024)")
    assert r.advice is None


def test_a_simulated_out_of_memory_gets_fixes_ranked_by_rerunning(ip):
    cell = ("model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)]).cuda()\n"
            "opt = torch.optim.Adam(model.parameters())\n"
            "x = torch.randn(batch_size, 2048, device='cuda')\n"
            "model(x).sum().backward()\n"
            "opt.step()\n")
    ip.run_cell("batch_size = 4096")
    r = ip.run_cell_magic("gpumem", "--backend sim --gpu-memory 256MiB --no-raise -o -q", cell)
    assert r.failed_request is not None
    advice = r.advice
    assert advice is not None and advice.oom is not None
    assert advice.oom.requested == r.failed_request
    assert advice.strategies, "the fixes were re-run"
    peaks = [s.peak for s in advice.strategies if s.peak is not None and not s.out_of_memory]
    assert peaks == sorted(peaks)
    assert any(s.fits for s in advice.strategies)


def test_another_error_keeps_its_traceback_and_says_what_it_holds(ip):
    cell = ("def step():\n    big = torch.ones(1 << 20)\n    raise ValueError('boom')\n"
            "step()")
    result = ip.run_cell(f"%%gpumem --backend cpu -q -v rep\n{cell}")
    assert isinstance(result.error_in_exec, ValueError)
    r = ip.user_ns["rep"]
    assert r.advice is not None and r.advice.failure is not None
    assert r.advice.failure.nbytes >= 4 << 20
    assert "free_traceback" in r.advice.failure.fix


def test_fixes_of_a_simulated_oom_start_from_the_state_before_the_cell(ip):
    """The failed cell bound ``x`` (64 MiB) before it ran out of memory: its fixes are ranked
    from a copy of the notebook's simulated GPU without it (re-running the cell as it
    is would hold the old ``x`` while making the new one), and smaller batches fit."""
    ip.run_cell("batch_size = 16384")
    ip.run_cell_magic("gpumem", "--backend sim --gpu-memory 96MiB -q",
                      "model = torch.nn.Linear(1024, 1024).cuda()")
    cell = ("x = torch.randn(batch_size, 1024, device='cuda')\n"
            "model(x).relu().sum().backward()\n")
    r = ip.run_cell_magic("gpumem", "--backend sim --gpu-memory 96MiB --no-raise -o -q", cell)
    assert r.failed_request is not None
    fits = [s for s in r.advice.strategies if s.fits]
    assert fits and all("batch" in s.label for s in fits), [(s.label, s.fits) for s in r.advice.strategies]
    session = shell_session(ip)
    assert "x" in session.card.shadow and "model" in session.card.shadow  # the card is as it was
