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


# -- misuse: one line that says what to do (issue 36, item 7) ---------------------------------
MISUSE_TESTS = '''
import pytest
import torch

@pytest.mark.memory_budget("64MiB", gpu="GTX9999")
def test_unknown_card():
    torch.ones(3, device="cuda")

@pytest.mark.memory_budget("lots", gpu="T4")
def test_bad_budget():
    torch.ones(3, device="cuda")

def test_unknown_card_with_the_fixture(memory_budget):
    memory_budget(lambda: torch.ones(3, device="cuda"), "64MiB", gpu="GTX9999")

@pytest.fixture
def weights():
    return torch.ones(4, device="cuda")

@pytest.mark.memory_budget("64MiB", gpu="T4")
def test_cuda_fixture(weights):
    weights.sum()

def test_cuda_fixture_with_the_fixture(weights, memory_budget):
    memory_budget(lambda: weights.sum(), "64MiB", gpu="T4")

@pytest.mark.memory_budget("64MiB", gpu="T4")
def test_own_error():
    raise ValueError("the test's own")
'''


def _sections(out: str) -> dict[str, list[str]]:
    """pytest's report by test: the lines under each ``____ name ____`` header."""
    sections: dict[str, list[str]] = {}
    lines = None
    for line in out.splitlines():
        head = line.strip("_ ")
        if line.startswith("____") and head:
            lines = sections.setdefault(head.removeprefix("ERROR at setup of "), [])
        elif line.startswith("===="):
            lines = None
        elif lines is not None and line.strip():
            lines.append(line)
    return sections


def test_plugin_misuse_is_one_line(tmp_path):
    (tmp_path / "test_misuse_here.py").write_text(textwrap.dedent(MISUSE_TESTS))
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                          "-c", "/dev/null", str(tmp_path)],
                         capture_output=True, text=True, cwd=tmp_path)
    out = run.stdout
    got = _sections(out)
    for name in ("test_unknown_card", "test_bad_budget"):
        assert len(got[name]) == 1, got[name]
    assert got["test_unknown_card"][0].startswith("memory_budget: unknown GPU 'GTX9999'; choose one of")
    assert "T4" in got["test_unknown_card"][0]
    assert got["test_bad_budget"][0].startswith("memory_budget: cannot read 'lots' as a size")
    # check_budget called by the test: the test's line and the error, not the backend's depths
    fixture = "\n".join(got["test_unknown_card_with_the_fixture"])
    assert "E       ValueError: unknown GPU 'GTX9999'" in fixture and "gpus.py" not in fixture
    assert len(got["test_unknown_card_with_the_fixture"]) <= 6, fixture
    assert "ValueError: the test's own" in "\n".join(got["test_own_error"])  # not the marker's
    if not torch.cuda.is_available():  # a fixture that makes CUDA tensors without a GPU
        for name in ("test_cuda_fixture", "test_cuda_fixture_with_the_fixture"):
            line, = got[name]
            assert line.startswith("memory_budget: a fixture needs a GPU at "
                                   "test_misuse_here.py:18 in weights"), line
            assert "fixtures run before the test, outside the simulated GPU" in line
            assert "make the CUDA tensors in the test itself" in line
