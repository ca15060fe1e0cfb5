"""``python -m benchmarks.readme``: regenerate the benchmark tables in docs/benchmarks.md.

Only the text between ``<!-- benchmarks:start -->`` and ``<!-- benchmarks:end -->`` is
replaced, from the newest full (non-quick) take of each figure of each kind (cpu, gpu)
in results/. Each table says the machine, torch version and date it was taken on. Without
the markers (or without the page) the tables are printed instead. ``--docs FILE`` writes
another page; ``--readme`` is the option's old name (the tables lived in README.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .render import markdown_results

__all__ = ["latest_results", "update_readme", "main", "START", "END", "DOCS_PAGE"]

ROOT = Path(__file__).resolve().parent.parent
DOCS_PAGE = ROOT / "docs" / "benchmarks.md"  # the page the tables live on
START = "<!-- benchmarks:start -->"
END = "<!-- benchmarks:end -->"


def latest_results(results_dir: Path, *, include_quick: bool = False) -> list[dict[str, Any]]:
    """The newest take of every figure, cpu first: for each kind (cpu, gpu), results files
    from newest to oldest (by the date recorded inside), each with only the figures no
    newer file of that kind has (a run of some figures, ``--only c``, supersedes just
    those). Files left with no figure are dropped."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or "figures" not in data or "date" not in data:
            continue
        if data.get("quick") and not include_quick:
            continue
        data.setdefault("file", f"results/{path.name}")
        runs.setdefault(data.get("kind", "cpu"), []).append(data)
    out: list[dict[str, Any]] = []
    for kind in sorted(runs, key=lambda k: (k != "cpu", k)):
        taken: set[str] = set()
        for data in sorted(runs[kind], key=lambda d: d["date"], reverse=True):
            figures = {k: f for k, f in data["figures"].items() if k not in taken}
            taken.update(figures)
            if figures:
                out.append({**data, "figures": figures})
    return out


def update_readme(text: str, tables: str, start_marker: str = START,
                  end_marker: str = END) -> str | None:
    """``text`` (any markdown page) with the block between the markers replaced; None if the
    markers are absent."""
    start = text.find(start_marker)
    end = text.find(end_marker, start + len(start_marker)) if start >= 0 else -1
    if start < 0 or end < 0:
        return None
    return text[: start + len(start_marker)] + "\n" + tables + text[end:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.readme", description=__doc__)
    p.add_argument("--results", type=Path, default=ROOT / "results")
    p.add_argument("--docs", "--readme", dest="docs", type=Path, nargs="?", const=DOCS_PAGE,
                   default=DOCS_PAGE, metavar="FILE",
                   help="the page whose markers get the tables (default: docs/benchmarks.md; "
                        "--readme is the old name)")
    p.add_argument("--include-quick", action="store_true",
                   help="also use quick-mode results (never for the docs of a release)")
    p.add_argument("--print", action="store_true", help="print the tables, change nothing")
    args = p.parse_args(argv)
    results = latest_results(args.results, include_quick=args.include_quick)
    if not results:
        print(f"no results in {args.results}: run `python -m benchmarks` first", file=sys.stderr)
        return 1
    tables = markdown_results(results)
    text = None if args.print or not args.docs.exists() else args.docs.read_text(encoding="utf-8")
    new = update_readme(text, tables) if text is not None else None
    if new is None:
        if not args.print:
            print(f"{args.docs.name}: no {START} ... {END} markers; the tables are below",
                  file=sys.stderr)
        sys.stdout.write(tables)
        return 0
    if new != text:
        args.docs.write_text(new, encoding="utf-8")
    print(f"updated {args.docs} from {', '.join(r['file'] for r in results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
