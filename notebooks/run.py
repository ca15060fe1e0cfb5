"""Execute notebooks headlessly and print what each cell showed (text outputs).

    python notebooks/run.py notebooks/01_first_steps.ipynb          # run, print, change nothing
    python notebooks/run.py --write notebooks/01_first_steps.ipynb  # also store the outputs
    python notebooks/run.py --all                                   # run every notebook: time and errors

``--all`` is the one-command check of the whole course: each notebook runs in a fresh
kernel; a cell that fails (outside cells tagged ``raises-exception``) or shows an error on
stderr (IPython's ``UsageError``) makes the command exit 1. Stored notebooks are left
unchanged unless ``--write`` is given.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).parent
LIMIT_S = 60  # each notebook must run top to bottom within this on a CPU-only machine


def coalesce_streams(nb: nbformat.NotebookNode) -> None:
    """Merge consecutive stream outputs of the same name (how they are chunked depends on
    timing; nbval compares them merged)."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        merged: list = []
        for out in cell.outputs:
            if (out.output_type == "stream" and merged and merged[-1].output_type == "stream"
                    and merged[-1].name == out.name):
                merged[-1].text += out.text
            else:
                merged.append(out)
        cell.outputs = merged
        cell.metadata.pop("execution", None)  # per-run timestamps: noise in the stored file


def execute(path: str, *, write: bool = False, timeout: int = 600) -> nbformat.NotebookNode:
    """Run the notebook at ``path`` in a fresh kernel (working directory: notebooks/).
    Raises nbclient's CellExecutionError on a failing cell not tagged raises-exception."""
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(HERE)}}).execute()
    coalesce_streams(nb)
    if write:
        nbformat.write(nb, path)
    return nb


def problems(nb: nbformat.NotebookNode) -> list[str]:
    """Error outputs and stderr errors in cells that are not expected to fail."""
    found = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or "raises-exception" in cell.metadata.get("tags", []):
            continue
        for out in cell.outputs:
            if out.output_type == "error":
                found.append(f"cell {i}: {out.ename}: {out.evalue}")
            elif out.output_type == "stream" and out.name == "stderr" and "Error" in out.text:
                found.append(f"cell {i}: stderr: {out.text.strip().splitlines()[0]}")
    return found


def text_of(output: nbformat.NotebookNode) -> str:
    if output.output_type == "stream":
        return output.text
    if output.output_type == "error":
        return "\n".join(output.traceback)
    data = output.get("data", {})
    return data.get("text/plain", "") + "\n"


def run_all(write: bool) -> int:
    failed = 0
    for path in sorted(HERE.glob("[0-9][0-9]_*.ipynb")):
        start = time.perf_counter()
        try:
            nb = execute(str(path), write=write)
            found = problems(nb)
        except Exception as exc:  # CellExecutionError, timeouts
            found = [f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"]
        took = time.perf_counter() - start
        slow = f" (over the {LIMIT_S} s limit)" if took > LIMIT_S else ""
        status = "ok" if not found else "FAILED"
        print(f"{path.name:<40} {took:5.1f} s  {status}{slow}")
        for line in found:
            print(f"    {line}")
        failed += bool(found) or bool(slow)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*")
    ap.add_argument("--all", action="store_true", help="run every numbered notebook in notebooks/")
    ap.add_argument("--write", action="store_true", help="store the new outputs in the notebook")
    args = ap.parse_args(argv)
    if args.all:
        return run_all(args.write)
    if not args.notebooks:
        ap.error("name notebooks to run, or --all")
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
