"""The course notebooks' sources (``notebooks/src/NN_name.py``, jupytext percent format) are
exactly the committed notebooks: the cells ``notebooks/build.py`` makes from a source (type,
text, id, metadata) equal the stored ``.ipynb``'s, character for character. No kernel runs.

Edit a source without rebuilding its notebook (or the other way round) and this fails:
``python notebooks/build.py NN`` brings them together again.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import nbformat
import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
sys.path.insert(0, str(NOTEBOOK_DIR))

import course_tools  # noqa: E402
from build import notebook_of, sources  # noqa: E402

SOURCES = sources()
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))


def stored(source: Path) -> nbformat.NotebookNode:
    return nbformat.read(NOTEBOOK_DIR / f"{source.stem}.ipynb", as_version=4)


def code_cells(source: Path) -> list[str]:
    return [c.source for c in notebook_of(source).cells if c.cell_type == "code"]


def test_one_source_per_notebook():
    assert [s.stem for s in SOURCES] == [p.stem for p in NOTEBOOKS]
    assert len(SOURCES) >= 16


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_the_source_makes_the_stored_cells(source):
    built, nb = notebook_of(source), stored(source)
    assert len(built.cells) == len(nb.cells)
    for new, old in zip(built.cells, nb.cells):
        where = f"{source.name}, {old.id}"
        assert new.id == old.id, where
        assert new.cell_type == old.cell_type, where
        assert new.source == old.source, where
        assert new.metadata == old.metadata, where
    assert built.metadata["kernelspec"] == nb.metadata["kernelspec"]


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_gpu_only_cells_are_ignored_by_nbval(source):
    for cell in notebook_of(source).cells:
        tags = cell.metadata.get("tags", [])
        if "gpu-only" in tags:
            assert "nbval-ignore-output" in tags, cell.id


def test_magics_come_back_from_the_commented_source():
    """jupytext comments magics out in the .py (so it lints) and restores them on read."""
    first = SOURCES[0]
    assert "\n# %load_ext memmagic\n" in first.read_text(encoding="utf-8")
    assert code_cells(first)[0].startswith("%load_ext memmagic\n")


def test_every_course_notebook_starts_with_the_shared_setup():
    for source in SOURCES[1:]:
        assert code_cells(source)[0] == course_tools.SETUP, source.name


@pytest.mark.parametrize("snippet", [course_tools.bars, course_tools.make_cnn], ids=lambda f: f.__name__)
def test_shared_snippets_are_copied_exactly(snippet):
    """A notebook keeps its copy of a shared snippet in a cell; the copy is the module's."""
    text = inspect.getsource(snippet)
    header = text.splitlines()[0]
    found = []
    for source in SOURCES:
        copies = [c for c in code_cells(source) if header in c]
        for cell in copies:
            assert cell.startswith(text.rstrip("\n")), f"{source.name}: {snippet.__name__} differs"
        if copies:
            found.append(source.name[:2])
    assert len(found) >= 2, f"{snippet.__name__} is shared: found in {found}"
