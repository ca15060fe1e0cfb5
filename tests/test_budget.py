"""Memory budgets as tests (issue 26, item 2): check_budget, the pytest marker and fixture,
and budgets on the course's models."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from memmagic import BudgetExceeded, check_budget, zoo

MiB = 1 << 20


def _step(name: str) -> None:
    """One training step of a course model, written for a GPU."""
    model, batch = zoo.build(name, device="cuda")
    zoo.train_step(model, torch.optim.AdamW(model.parameters()), batch)


def test_check_budget_passes_under_the_budget_and_returns_the_report():
    r = check_budget(lambda: torch.ones(1024, 1024, device="cuda"), "32MiB", gpu="T4")
    # a 4 MiB tensor: the allocator reserves a 20 MiB segment for it (large pool)
    assert r.backend == "sim" and r.peak == 4 * MiB and r.need == 20 * MiB


def test_check_budget_fails_over_the_budget_with_the_report_in_the_message():
    with pytest.raises(BudgetExceeded) as info:
        check_budget(lambda: torch.ones(1024, 1024, device="cuda"), "3MiB", gpu="T4")
    text = str(info.value)
    assert text.startswith("<lambda> needs 20.00 MiB (reserved peak), 17.00 MiB over its budget of 3.00 MiB")
    assert "memmagic [sim]" in text and info.value.report.peak == 4 * MiB


def test_check_budget_fails_a_run_that_does_not_fit_the_card():
    with pytest.raises(BudgetExceeded, match="ran out of memory on the simulated T4"):
        check_budget(lambda: torch.empty(16 << 30, dtype=torch.uint8, device="cuda"), gpu="T4")
    with pytest.raises(ValueError, match="needs a budget"):
        check_budget(lambda: None)
    with pytest.raises(ValueError, match="positive size"):
        check_budget(lambda: None, -1, gpu="T4")


PLUGIN_TESTS = '''
import pytest
import torch

@pytest.mark.memory_budget("64MiB", gpu="T4")
def test_small():
    torch.ones(1024, 1024, device="cuda").sum()

@pytest.mark.memory_budget("16MiB", gpu="T4")
def test_big():
    x = torch.ones(2048, 2048, device="cuda")
    y = x * 2

@pytest.mark.memory_budget(gpu="T4")
def test_too_big_for_the_card():
    torch.empty(16 << 30, dtype=torch.uint8, device="cuda")

def test_fixture(memory_budget):
    r = memory_budget(lambda: torch.ones(256, device="cuda"), "4MiB", gpu="T4")
    assert r.peak == 1024

def test_unmarked_runs_for_real():
    assert not torch.ones(1).is_cuda
'''


def test_the_pytest_marker_and_fixture(tmp_path):
    (tmp_path / "test_budgets_here.py").write_text(textwrap.dedent(PLUGIN_TESTS))
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                          "--strict-markers", "-c", "/dev/null", str(tmp_path)],
                         capture_output=True, text=True, cwd=tmp_path)
    out = run.stdout
    assert "2 failed, 3 passed" in out, out
    assert "FAILED test_budgets_here.py::test_big" in out
    assert "FAILED test_budgets_here.py::test_too_big_for_the_card" in out
    assert "BudgetExceeded: test_big.<locals>" not in out  # the test's own name is used
    # x and y, 16 MiB each, in one 32 MiB reserved; the plugin's own frames are hidden
    assert "test_big needs 32.00 MiB (reserved peak), 16.00 MiB over its budget of 16.00 MiB" in out
    assert "pytest_plugin.py" not in out and "budget.py" not in out
    assert "ran out of memory on the simulated T4" in out


# -- budgets on the course's models: what one training step needs of a T4 (reserved peak:
# 104 MiB for the MLP, 102 MiB for each transformer), with about 25% of room ------------
@pytest.mark.memory_budget("128MiB", gpu="T4")
def test_the_course_mlp_step_stays_under_128_mib():
    _step("mlp")


@pytest.mark.memory_budget("128MiB", gpu="T4")
def test_the_course_transformer_step_stays_under_128_mib():
    _step("transformer")


@pytest.mark.memory_budget("128MiB", gpu="T4")
def test_the_course_nanogpt_step_stays_under_128_mib():
    _step("nanogpt")
