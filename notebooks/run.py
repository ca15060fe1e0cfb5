"""Execute a notebook headlessly and print what each cell showed (text outputs).

    python notebooks/run.py notebooks/01_first_steps.ipynb          # run, print, change nothing
    python notebooks/run.py --write notebooks/01_first_steps.ipynb  # also store the outputs
"""

from __future__ import annotations

import argparse
import sys

import nbformat
from nbclient import NotebookClient


def execute(path: str, *, write: bool = False, timeout: int = 600) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": "notebooks"}}).execute()
    if write:
        nbformat.write(nb, path)
    return nb


def text_of(output: nbformat.NotebookNode) -> str:
    if output.output_type == "stream":
        return output.text
    if output.output_type == "error":
        return "\n".join(output.traceback)
    data = output.get("data", {})
    return data.get("text/plain", "") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="+")
    ap.add_argument("--write", action="store_true", help="store the new outputs in the notebook")
    args = ap.parse_args(argv)
    for path in args.notebooks:
        print(f"=== {path}")
        nb = execute(path, write=args.write)
        for cell in nb.cells:
            if cell.cell_type != "code":
                continue
            print(f"\nIn [{cell.execution_count}]: " + cell.source.replace("\n", "\n    "))
            for out in cell.outputs:
                sys.stdout.write(text_of(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
