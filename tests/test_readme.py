"""Every ```python block of the README runs as pasted, in order, in a fresh Jupyter kernel."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def readme_blocks() -> list[str]:
    return [m.group(1) for m in _BLOCK.finditer(README.read_text(encoding="utf-8"))]


def test_the_readme_has_python_blocks():
    blocks = readme_blocks()
    assert len(blocks) >= 3
    assert blocks[0].strip() == "%load_ext memmagic"


@pytest.mark.slow
def test_every_readme_block_runs_as_pasted_in_a_fresh_kernel(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src.rstrip("\n")) for src in readme_blocks()]
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    errors = []
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                errors.append(f"block {i + 1}: {out['ename']}: {out['evalue']}")
            elif out.get("output_type") == "stream" and out.get("name") == "stderr" \
                    and "UsageError" in out.get("text", ""):
                errors.append(f"block {i + 1}: {out['text'].strip()}")
    assert not errors, "\n".join(errors)
