"""The tutorial notebooks: each runs top to bottom in a fresh kernel without an error,
and the stored copies are what such a run produced.

nbval (pyproject's addopts) re-runs every notebook and compares each output with the stored
one. A cell ending in IPython's UsageError raises no error message (it prints on stderr), so
nbval catches it only as an output that differs: it does whenever the stored copy is clean,
which ``test_stored_outputs_come_from_one_fresh_run`` makes sure of (``problems`` reads the
outputs for error text on stderr). Cells tagged ``nbval-ignore-output`` are not compared: the
notebooks holding one are run a second time through nbclient, which fails on the execute reply.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook, new_output

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
sys.path.insert(0, str(NOTEBOOK_DIR))

from run import execute, problems  # noqa: E402

NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
UNCOMPARED = [p for p in NOTEBOOKS if "nbval-ignore-output" in p.read_text()]
KERNEL = {"name": "python3", "display_name": "Python 3", "language": "python"}


def test_the_course_is_there():
    names = [p.name[:2] for p in NOTEBOOKS]
    assert names == sorted(set(names)), "one notebook per number"
    assert {"01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11"} <= set(names)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_outputs_come_from_one_fresh_run(path):
    """Code cells were executed once each, in order, from a fresh kernel (counts 1, 2, 3...),
    and no stored output is an error, except in cells tagged raises-exception."""
    nb = nbformat.read(path, as_version=4)
    counts = [c.execution_count for c in nb.cells if c.cell_type == "code"]
    assert counts == list(range(1, len(counts) + 1))
    assert problems(nb) == []


@pytest.mark.slow
@pytest.mark.parametrize("path", UNCOMPARED, ids=lambda p: p.stem)
def test_notebook_with_uncompared_cells_runs_without_errors(path):
    nb = execute(str(path))  # raises CellExecutionError on a failing cell
    assert problems(nb) == []


def test_problems_reads_usage_errors_and_error_outputs():
    bad = new_notebook(cells=[
        new_code_cell("%gpumem --no-such-option", outputs=[
            new_output("stream", name="stderr", text="UsageError: unrecognized arguments\n")]),
        new_code_cell("1/0", outputs=[new_output("error", ename="ZeroDivisionError",
                                                 evalue="division by zero", traceback=[])]),
        new_code_cell("1/0", metadata={"tags": ["raises-exception"]}, outputs=[
            new_output("error", ename="ZeroDivisionError", evalue="division by zero", traceback=[])]),
    ])
    found = problems(bad)
    assert len(found) == 2
    assert "UsageError" in found[0] and "ZeroDivisionError" in found[1]


@pytest.mark.slow
def test_nbclient_fails_on_a_usage_error(tmp_path):
    """The reason this file exists: a cell that ends in IPython's UsageError fails here."""
    from nbclient.exceptions import CellExecutionError

    path = tmp_path / "usage.ipynb"
    nb = new_notebook(cells=[new_code_cell("%load_ext memmagic"),
                             new_code_cell("%%gpumem --no-such-option\npass")])
    nb.metadata["kernelspec"] = KERNEL
    nbformat.write(nb, path)
    with pytest.raises(CellExecutionError, match="UsageError"):
        execute(str(path))


@pytest.mark.slow
def test_nbval_fails_a_usage_error_against_a_clean_stored_copy(tmp_path):
    """Why the other notebooks need no second run: the re-run's stderr is an output the clean
    stored copy lacks. (A stored copy that shows the UsageError too would pass nbval; the
    stored-outputs test refuses that.)"""
    import subprocess

    path = tmp_path / "usage.ipynb"
    nb = new_notebook(cells=[
        new_code_cell("%load_ext memmagic", execution_count=1),
        new_code_cell("%%gpumem --no-such-option\npass", execution_count=2)])
    nb.metadata["kernelspec"] = KERNEL
    nbformat.write(nb, path)
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                          "-c", "/dev/null", "--nbval", "--nbval-current-env", str(path)],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 1, run.stdout
    assert "1 failed, 1 passed" in run.stdout
    assert "Unexpected output fields from running code: {'stderr'}" in run.stdout
