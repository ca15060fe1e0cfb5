"""Build the course notebooks from their sources: read each ``notebooks/src/NN_name.py``
(jupytext's percent format: ``# %%`` code cells, ``# %% [markdown]`` cells), execute it in
a fresh kernel and write ``notebooks/NN_name.ipynb`` with its outputs (nbval checks them).

    python notebooks/build.py                  # all notebooks
    python notebooks/build.py 01               # the ones whose name contains 01
    python notebooks/build.py 01 --out /tmp/x  # write the .ipynb there, not over notebooks/

To change a notebook, edit its source and rebuild it. Magics are commented out in the
source (``# %load_ext memmagic``, ``# %%gpumem ...``) and restored by jupytext when it reads
the file; cell tags go in the cell's header (``# %% tags=["raises-exception"]``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jupytext
import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_raw_cell

HERE = Path(__file__).parent
SOURCES = HERE / "src"
sys.path.insert(0, str(HERE))

from run import execute  # noqa: E402  (same folder)


def sources() -> list[Path]:
    """The percent source of every course notebook, in order."""
    return sorted(SOURCES.glob("[0-9][0-9]_*.py"))


def notebook_of(source: Path) -> nbformat.NotebookNode:
    """The notebook the source makes, before it runs: jupytext's cells (type, source, cell
    metadata) with stable ids (``cell-00``, ``cell-01``...: a rebuild changes only what ran
    differently) and the python3 kernel."""
    new_cell = {"code": new_code_cell, "markdown": new_markdown_cell, "raw": new_raw_cell}
    cells = [new_cell[cell.cell_type](cell.source, metadata=dict(cell.metadata), id=f"cell-{i:02d}")
             for i, cell in enumerate(jupytext.read(source, fmt="py:percent").cells)]
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def build(source: Path, out_dir: Path = HERE) -> float:
    """Write ``source``'s notebook into ``out_dir`` and execute it there in a fresh kernel
    (working directory: notebooks/); return the seconds it took."""
    path = Path(out_dir) / f"{source.stem}.ipynb"
    nbformat.write(notebook_of(source), path)
    start = time.perf_counter()
    execute(str(path), write=True)
    took = time.perf_counter() - start
    print(f"wrote and executed {path} in {took:.0f} s")
    return took


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="build only the notebooks whose name contains one of these")
    ap.add_argument("--out", type=Path, default=HERE, help="folder for the .ipynb (default: notebooks/)")
    args = ap.parse_args(argv)
    chosen = [s for s in sources() if not args.names or any(n in s.name for n in args.names)]
    if not chosen:
        ap.error(f"no source in {SOURCES} matches {args.names}")
    args.out.mkdir(parents=True, exist_ok=True)
    for source in chosen:
        build(source, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
