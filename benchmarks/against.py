"""Figures taken with another commit's memmagic beside this tree's, in one run
(``python -m benchmarks --only w --against REV``).

The other commit's ``memmagic/`` is extracted with ``git archive`` into a temporary folder;
each measurement then runs in a fresh Python process of its own, once with that folder
first on ``PYTHONPATH`` and once with this tree's, alternating which goes first from one
measurement to the next. The measuring code (``benchmarks/``) is this tree's in both, so
the two differ only in the memmagic they import.

``python -m benchmarks.against '{"fn": ..., "kwargs": {...}}'`` is the child: it runs
``benchmarks.figures.<fn>(**kwargs)`` and prints the row it returns as JSON.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["Against"]

ROOT = Path(__file__).resolve().parent.parent
_MARK = "benchmarks.against row: "


class Against:
    """The memmagic of commit ``rev`` (extracted until :meth:`close`), to measure beside."""

    def __init__(self, rev: str, threads: int = 1) -> None:
        self.threads = threads
        sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
        if not sha:
            raise SystemExit(f"--against {rev!r}: not a commit of this repository")
        self.rev, self.sha = rev, sha
        self.label = sha[:7]
        self.dir = Path(tempfile.mkdtemp(prefix=f"memmagic-{self.label}-"))
        archive = subprocess.run(["git", "archive", "--format=tar", sha, "memmagic"], cwd=ROOT,
                                 capture_output=True, check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(self.dir, filter="data")
        self.method = (f"; beside the same measurement with commit {self.label}'s memmagic "
                       f"({_git('log', '-1', '--format=%s', sha)[:80]!r}): each in a fresh "
                       "process, the two alternating in order")

    def pair(self, fn: str, kwargs: dict[str, Any], turn: int) -> tuple[dict, dict]:
        """(this tree's row, the other commit's row) of ``benchmarks.figures.<fn>``; ``turn``
        (the measurement's index) decides which runs first."""
        order = [None, self.dir] if turn % 2 == 0 else [self.dir, None]
        rows = {str(code): _child(code, fn, kwargs, self.threads) for code in order}
        return rows[str(None)], rows[str(self.dir)]

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


def _child(code: Path | None, fn: str, kwargs: dict[str, Any], threads: int) -> dict[str, Any]:
    """``fn``'s row from a fresh process importing memmagic from ``code`` (None: this tree)."""
    env = dict(os.environ)
    paths = [str(code)] if code is not None else []
    env["PYTHONPATH"] = os.pathsep.join(paths + [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    out = subprocess.run([sys.executable, "-m", "benchmarks.against",
                          json.dumps({"fn": fn, "kwargs": kwargs, "threads": threads})],
                         # the working folder comes first on sys.path (-m): the memmagic measured
                         cwd=code if code is not None else ROOT, env=env, capture_output=True,
                         text=True)
    for line in reversed(out.stdout.splitlines()):
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"case": kwargs.get("case"), "median_s": f"failed: {tail[0]}"[:160],
            "first_s": f"failed: {tail[0]}"[:160]}


def memmagic_file() -> dict[str, str]:
    """The child's memmagic, as imported (what the tests check)."""
    import memmagic

    return {"file": memmagic.__file__}


def _main(argv: list[str]) -> int:
    import warnings

    import torch

    from . import figures

    job = json.loads(argv[0])
    torch.manual_seed(0)
    warnings.filterwarnings("ignore", message="PyTorch was compiled without cuDNN")  # as run.py
    if job["threads"] > 0:
        torch.set_num_threads(job["threads"])
    if ":" in job["fn"]:  # "module:function", a module of this package
        import importlib

        mod, name = job["fn"].split(":")
        fn = getattr(importlib.import_module(f"benchmarks.{mod}"), name)
    else:
        fn = getattr(figures, job["fn"], None) or globals()[job["fn"]]
    row = fn(**job["kwargs"])
    print(_MARK + json.dumps(row, default=str), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
