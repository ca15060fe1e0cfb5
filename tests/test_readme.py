"""Every ```python block of the README runs as pasted, in order, in a fresh Jupyter kernel;
so do the blocks of each reference page in docs/, page by page (each in a fresh kernel that
has run the README's first block, ``%load_ext memmagic``, as a reader's notebook has).
Blocks that are not meant to run as pasted (a shell command, a test file) are fenced as
```` ``` ```` or ```` ```bash ````, not ```` ```python ````."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(path: Path) -> list[str]:
    return [m.group(1) for m in _BLOCK.finditer(path.read_text(encoding="utf-8"))]


def readme_blocks() -> list[str]:
    return python_blocks(README)


def docs_pages_with_blocks() -> list[Path]:
    return [p for p in sorted(DOCS.glob("*.md")) if python_blocks(p)]


def run_in_a_fresh_kernel(sources: list[str], cwd: Path) -> list[str]:
    """Run the cells in order in a new kernel; one line per cell that raised (or printed a
    UsageError, which IPython writes to stderr without raising)."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src.rstrip("\n")) for src in sources]
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(cwd)}})
    client.execute()
    errors = []
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                errors.append(f"block {i + 1}: {out['ename']}: {out['evalue']}")
            elif out.get("output_type") == "stream" and out.get("name") == "stderr" \
                    and "UsageError" in out.get("text", ""):
                errors.append(f"block {i + 1}: {out['text'].strip()}")
    return errors


def test_the_readme_has_python_blocks():
    blocks = readme_blocks()
    assert len(blocks) >= 3
    assert blocks[0].strip() == "%load_ext memmagic"


def test_the_docs_pages_have_python_blocks():
    """The blocks that moved from the README to the reference pages are still there."""
    pages = {p.name: python_blocks(p) for p in docs_pages_with_blocks()}
    assert {"magic.md", "whatif.md", "several-gpus.md"} <= set(pages), sorted(pages)
    assert sum(len(b) for b in pages.values()) >= 3


@pytest.mark.slow
def test_every_readme_block_runs_as_pasted_in_a_fresh_kernel(tmp_path):
    errors = run_in_a_fresh_kernel(readme_blocks(), tmp_path)
    assert not errors, "\n".join(errors)


@pytest.mark.slow
@pytest.mark.parametrize("page", docs_pages_with_blocks(), ids=lambda p: p.name)
def test_every_docs_block_runs_as_pasted_in_a_fresh_kernel(page, tmp_path):
    blocks = python_blocks(page)
    errors = run_in_a_fresh_kernel([readme_blocks()[0]] + blocks, tmp_path)
    # block 1 is the README's %load_ext: number the page's own blocks from 1
    errors = [re.sub(r"^block (\d+)", lambda m: f"{page.name} block {int(m.group(1)) - 1}", e)
              for e in errors]
    assert not errors, "\n".join(errors)
