"""What every figure shares: the machine description, paired A/B timing, and the
figure/row containers that end up in ``results/<name>.json``.

Speed figures are ratios of two things timed side by side in one process, alternating
A and B (ABBA order, so a drift in machine load hits both sides alike), and the figure
is the median of the per-pair ratios. Absolute times are kept in the JSON for context.
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = [
    "Figure", "Paired", "paired", "machine_info", "slug", "status_of", "median",
    "code_version", "write_results", "RESULTS_DIR",
]

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def machine_info() -> dict[str, Any]:
    """Where the numbers were taken: CPU, cores, OS, Python, torch, GPU (if any)."""
    import torch

    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": _cores(),
        "torch_threads": torch.get_num_threads(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": None,
    }
    try:
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            info["gpu"] = torch.cuda.get_device_name(0)
            info["cuda"] = torch.version.cuda
    except Exception:  # a broken driver is "no GPU" for the benchmarks
        pass
    info["label"] = (f"{info['gpu']} + " if info["gpu"] else "") + f"{info['cpu']}, {info['cores']} cores"
    return info


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def slug(text: str) -> str:
    """'Intel(R) Xeon(R) Processor' -> 'intel-xeon-processor'."""
    text = re.sub(r"\((r|tm|c)\)", "", text.lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")[:60] or "unknown"


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


# -- paired timing ------------------------------------------------------------------------
@dataclass
class Paired:
    """Times of A and B taken alternately; ``ratio`` is the median of per-pair B/A."""

    a_s: list[float]
    b_s: list[float]

    @property
    def ratios(self) -> list[float]:
        return [b / a for a, b in zip(self.a_s, self.b_s)]

    @property
    def ratio(self) -> float:
        return median(self.ratios)

    def to_dict(self) -> dict[str, Any]:
        return {"a_s": [round(x, 6) for x in self.a_s], "b_s": [round(x, 6) for x in self.b_s],
                "ratios": [round(x, 4) for x in self.ratios], "median_ratio": round(self.ratio, 4),
                "median_a_s": round(median(self.a_s), 6), "median_b_s": round(median(self.b_s), 6)}

    def spread(self, invert: bool = False) -> str:
        """'min-max' of the per-pair ratios (B/A, or A/B with ``invert``): the noise."""
        rs = [1 / r for r in self.ratios] if invert else self.ratios
        return f"{min(rs):.2f}-{max(rs):.2f}"


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def paired(a: Callable[[], Any], b: Callable[[], Any], reps: int, warmup: int = 1) -> Paired:
    """Time ``a`` and ``b`` ``reps`` times each, alternating in ABBA order.

    ``warmup`` untimed calls of each come first (allocator, caches, lazy imports); pass 0
    when the caller warmed them up. A ``gc.collect()`` precedes every pair, outside the
    timing, so a full collection is not charged at random to one side.
    """
    for _ in range(warmup):
        a()
        b()
    a_s: list[float] = []
    b_s: list[float] = []
    for i in range(reps):
        gc.collect()
        if i % 2 == 0:
            a_s.append(_timed(a))
            b_s.append(_timed(b))
        else:
            b_s.append(_timed(b))
            a_s.append(_timed(a))
    return Paired(a_s, b_s)


# -- figures ------------------------------------------------------------------------------
def status_of(ok: bool | None) -> str:
    return "n/a" if ok is None else ("pass" if ok else "miss")


@dataclass
class Figure:
    """One figure of issue 4: rows of raw numbers plus how to show them.

    ``columns`` are (row key, header, kind); kind is one of text, x (a ratio printed as
    1.23x), pct (a signed relative error), bytes, s (seconds), status.
    """

    key: str
    title: str
    method: str
    target: str
    columns: list[tuple[str, str, str]]
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    metric: tuple[str, str] | None = None  # (row key, kind) summarised in docs/benchmarks.md

    @property
    def status(self) -> str:
        marks = {r.get("status", "n/a") for r in self.rows}
        if "miss" in marks:
            return "miss"
        if "pass" in marks:
            return "pass"
        return "n/a"

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "title": self.title, "method": self.method,
                "target": self.target, "status": self.status,
                "columns": [list(c) for c in self.columns], "rows": self.rows,
                "notes": self.notes, "metric": list(self.metric) if self.metric else None}


# -- the results file ------------------------------------------------------------------
def code_version() -> dict[str, Any]:
    """The commit the numbers were taken at, and the memmagic files that differed from it."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        try:
            # rstrip only: a porcelain line starts with a space (" M path")
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                  timeout=10).stdout.rstrip()
        except (OSError, subprocess.SubprocessError):
            return ""

    dirty = [line[3:] for line in git("status", "--porcelain", "--", "memmagic", "benchmarks").splitlines()]
    return {"commit": git("rev-parse", "HEAD") or None, "uncommitted": dirty}


def write_results(figures: list[Figure], *, kind: str, quick: bool, out: Path,
                  command: str, started: float, extra: dict[str, Any] | None = None,
                  code: dict[str, Any] | None = None) -> Path:
    """``code``: :func:`code_version` taken when the run started (the code it imported);
    taken now when not given."""
    machine = machine_info()
    ident = slug(machine["gpu"]) if kind == "gpu" and machine["gpu"] else f"{slug(machine['cpu'])}-{machine['cores']}c"
    name = f"{'quick-' if quick else ''}{kind}-{ident}"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    data = {
        "name": name, "file": f"results/{path.name}", "kind": kind, "quick": quick,
        "command": command, "date": now_iso(), "elapsed_s": round(time.perf_counter() - started, 1),
        "machine": machine, "code": code or code_version(), **(extra or {}),
        "figures": {f.key: f.to_dict() for f in figures},
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path
