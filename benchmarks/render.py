"""Tables from figure dicts (as stored in results/*.json): plain text and markdown."""

from __future__ import annotations

import statistics

from typing import Any

from memmagic.report import format_bytes

__all__ = ["cell", "text_table", "markdown_figure", "markdown_results"]


def cell(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if kind == "x":
        return f"{value:.3g}x" if value < 100 else f"{value:.0f}x"
    if kind == "pct":
        return f"{value * 100:+.3f}%" if abs(value) < 0.01 else f"{value * 100:+.1f}%"
    if kind == "bytes":
        return format_bytes(int(value))
    if kind == "s":
        return f"{value * 1000:.0f} ms" if value < 10 else f"{value:.1f} s"
    return str(value)


def _grid(fig: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    cols = fig["columns"]
    head = [h for _, h, _ in cols]
    body = [[cell(r.get(k), kind) for k, _, kind in cols] for r in fig["rows"]]
    return head, body


def text_table(fig: dict[str, Any]) -> str:
    head, body = _grid(fig)
    widths = [max(len(x) for x in col) for col in zip(head, *body)] if body else [len(h) for h in head]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    out = [f"== {fig['title']}  [{fig['status'].upper()}]",
           f"   target: {fig['target']}", f"   method: {fig['method']}",
           line(head), line(["-" * w for w in widths])]
    out += [line(r) for r in body]
    out += [f"   note: {n}" for n in fig.get("notes", [])]
    return "\n".join(out)


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|")


def _where(meta: dict[str, Any]) -> str:
    """'<machine> (<n> torch threads)': where a results file was taken."""
    m = meta["machine"]
    n = m.get("torch_threads")
    return m["label"] + (f" ({n} torch thread{'s' if n != 1 else ''})" if n else "")


# for results files written before figures carried their metric
_DEFAULT_METRIC = {
    "a_overhead": ("ratio", "x"), "b_sim_speed": ("speedup", "x"), "c_accuracy": ("error", "pct"),
    "c_loops": ("error", "pct"),
    "d_peers": ("sim_cpu_err", "pct"), "e_whatif": ("latency_s", "s"),
    "a_gpu_overhead": ("ratio_bd", "x"), "c_gpu_accuracy": ("alloc_err", "pct"),
    "d_gpu_peers": ("sim_err", "pct"),
}


def markdown_figure(fig: dict[str, Any], meta: dict[str, Any]) -> str:
    head, body = _grid(fig)
    m = meta["machine"]
    where = _where(meta)
    out = [
        f"**{_md_escape(fig['title'])}** — {fig['status']} (target: {_md_escape(fig['target'])})",
        "",
        f"<sub>Taken on {_md_escape(where)}, torch {m['torch']}, {meta['date'][:10]} "
        f"(`{meta['command']}`, {meta['file']}). {_md_escape(fig['method'])}</sub>",
        "",
        "| " + " | ".join(_md_escape(h) for h in head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
    ]
    out += ["| " + " | ".join(_md_escape(c) for c in r) + " |" for r in body]
    for n in fig.get("notes", []):
        out.append("")
        out.append(f"<sub>Note: {_md_escape(n)}</sub>")
    return "\n".join(out)


def headline(fig: dict[str, Any]) -> str:
    """'median 1.19x (1.00x to 1.39x)' over the figure's metric column, or '-'."""
    metric = fig.get("metric") or _DEFAULT_METRIC.get(fig.get("key", ""))
    if not metric:
        return "-"
    key, kind = metric
    values = sorted(r[key] for r in fig["rows"]
                    if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool))
    if not values:
        texts = {r.get(key) for r in fig["rows"] if isinstance(r.get(key), str)}
        return "; ".join(sorted(texts)) or "-"
    name = next((h for k, h, _ in fig["columns"] if k == key), key)
    if key.endswith("_err"):  # the error column of an estimator: name the estimator
        name = next((h for k, h, _ in fig["columns"] if k == key[:-4]), name) + " error"
    mid = statistics.median(values)
    if len(values) == 1:
        return f"{name}: {cell(mid, kind)}"
    return f"{name}: median {cell(mid, kind)} ({cell(values[0], kind)} to {cell(values[-1], kind)})"


def _passes(fig: dict[str, Any]) -> str:
    marks = [r.get("status", "n/a") for r in fig["rows"]]
    judged = [m for m in marks if m in ("pass", "miss")]
    if not judged:
        return fig["status"]
    return f"{fig['status']} ({judged.count('pass')}/{len(judged)} rows pass)"


def _figures(results: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(figure, the results it came from), kinds in the order given, figures by key."""
    kinds = list(dict.fromkeys(res.get("kind", "cpu") for res in results))
    pairs = [(fig, res) for res in results for fig in res["figures"].values()]
    return sorted(pairs, key=lambda p: (kinds.index(p[1].get("kind", "cpu")), p[0]["key"]))


def markdown_summary(results: list[dict[str, Any]]) -> str:
    out = ["| figure | result | target | status | taken on |", "|---|---|---|---|---|"]
    for fig, res in _figures(results):
        where = f"{_where(res)}, torch {res['machine']['torch']}, {res['date'][:10]}"
        out.append("| " + " | ".join(_md_escape(x) for x in (
            fig["title"].split(":")[0], headline(fig), fig["target"], _passes(fig), where)) + " |")
    return "\n".join(out)


def markdown_results(results: list[dict[str, Any]]) -> str:
    """A summary table, then each figure's full table folded in a <details> block (marked
    ``markdown="1"`` so that mkdocs' md_in_html renders the table inside; GitHub ignores it)."""
    parts = ["<!-- generated by `python -m benchmarks.readme` from results/*.json; do not edit by hand -->",
             markdown_summary(results)]
    for fig, res in _figures(results):
        parts.append(f"<details markdown=\"1\"><summary>{_md_escape(fig['title'])}</summary>\n\n"
                     f"{markdown_figure(fig, res)}\n\n</details>")
    return "\n\n".join(parts) + "\n"
