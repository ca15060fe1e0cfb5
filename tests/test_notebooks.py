"""The tutorial notebooks: each runs top to bottom in a fresh kernel without an error,
and the stored copies are what such a run produced.

nbval (pyproject's addopts) compares every stored output with a re-run, but it fails a cell
only on an error *message*: IPython's UsageError is printed on stderr and passes nbval.
nbclient fails on the cell's execute reply, so it catches those too; ``problems`` also
reads the outputs for error text on stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook, new_output

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
sys.path.insert(0, str(NOTEBOOK_DIR))

from run import execute, problems  # noqa: E402

NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))


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
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_without_errors(path):
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
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    with pytest.raises(CellExecutionError, match="UsageError"):
        execute(str(path))
