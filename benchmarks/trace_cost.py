"""Figure f: what the trace costs (issue 8, item 7), measured side by side in one run.

* cpu: the plain step (A) against the step measured by the cpu backend with its per-op
  trace (B): the same ratio as figure 3a, target within 1.05x;
* the per-op record itself: the same measured step with the per-op record switched off
  (``StorageTracker.trace_ops = False``: ops counted, nothing kept per op) against it on,
  on the cpu backend and on the simulated GPU (target: the simulated run no more than
  10% slower with it);
* the trace's memory per 1,000 ops (its op and event tables, ``sys.getsizeof``).
"""

from __future__ import annotations

import gc
import sys
from typing import Any

import torch

from memmagic import zoo
from memmagic.backends import get_backend
from memmagic.core.tracking import StorageTracker

from .cases import Config, cell_source, cpu_cannot_run, runner, sim_backend, warm_step
from .common import Figure, paired, status_of

__all__ = ["trace_cost", "CPU_TARGET", "SIM_TARGET"]

CPU_TARGET = 1.05
SIM_TARGET = 1.10


class _NoPerOpRecord:
    """While entered, trackers count ops but record nothing per op."""

    def __enter__(self) -> None:
        StorageTracker.trace_ops = False

    def __exit__(self, *exc: Any) -> None:
        StorageTracker.trace_ops = True


def _trace_bytes(trace) -> int:
    size = sys.getsizeof(trace.ops) + sum(sys.getsizeof(o) for o in trace.ops)
    size += sys.getsizeof(trace.events) + sum(sys.getsizeof(e) for e in trace.events)
    size += sys.getsizeof(trace.saved_events) + sum(sys.getsizeof(e) for e in trace.saved_events)
    return size


def trace_cost(configs: list[Config], reps: int) -> Figure:
    fig = Figure(
        "f_trace", "3f. What the trace costs: per-op record on and off, and its memory",
        f"cpu: plain step (A) vs '%%gpumem --backend cpu' with the trace (B); record: the "
        f"measured step (cpu) or simulated cell (sim) with the per-op record off (A) vs on "
        f"(B); ABBA, {reps} pairs, median of per-pair B/A; memory = the trace's op and event "
        "tables per 1,000 ops",
        f"cpu with trace at most {CPU_TARGET:.2f}x the plain step; sim with the record at most "
        f"{SIM_TARGET:.2f}x without it",
        [("case", "case", "text"), ("precision", "precision", "text"), ("ckpt", "ckpt", "text"),
         ("cpu_ratio", "cpu: traced/plain", "x"), ("cpu_record", "cpu: record on/off", "x"),
         ("sim_record", "sim: record on/off", "x"), ("ops", "ops (sim)", "text"),
         ("kib_per_kop", "KiB per 1,000 ops", "text"), ("status", "targets", "text")],
        metric=("sim_record", "x"),
    )
    cpu = get_backend("cpu")
    sim, why = sim_backend()
    for cfg in configs:
        row: dict[str, Any] = dict(cfg.row())
        ok: list[bool] = []
        if cpu_cannot_run(cfg) is None:
            ok.append(_cpu_cost(cpu, cfg, reps, row))
        else:
            row.update(cpu_ratio=cpu_cannot_run(cfg), cpu_record=cpu_cannot_run(cfg))
        if sim is not None:
            ok.append(_sim_cost(sim, cfg, reps, row))
        else:
            row.update(sim_record=why)
        row["status"] = status_of(all(ok) if ok else None)
        fig.rows.append(row)
    fig.notes.append(f"torch ran {torch.get_num_threads()} intra-op thread(s)")
    return fig


def _cpu_cost(cpu, cfg: Config, reps: int, row: dict[str, Any]) -> bool:
    """The cpu backend's columns of ``row``; whether the traced step met its target."""
    ns, _ = warm_step(cfg)
    model, opt, batch = ns["model"], ns["opt"], ns["batch"]
    step = lambda: zoo.train_step(model, opt, batch, amp=cfg.amp)  # noqa: E731
    # as a notebook cell is measured: the namespace is where existing tensors are found
    measured = lambda: cpu.execute(lambda _ns: step(), ns)  # noqa: E731

    def unrecorded() -> None:
        with _NoPerOpRecord():
            measured()

    p = paired(step, measured, reps)
    q = paired(unrecorded, measured, reps)
    row.update(cpu_ratio=p.ratio, cpu_record=q.ratio,
               cpu_timing=p.to_dict(), cpu_record_timing=q.to_dict())
    del model, opt, batch, step, measured
    ns.clear()
    gc.collect()
    return p.ratio <= CPU_TARGET


def _sim_cost(sim, cfg: Config, reps: int, row: dict[str, Any]) -> bool:
    """The sim backend's columns of ``row``; whether the record met its target."""
    run = runner(cell_source(cfg, "cuda"))

    def simulated() -> Any:
        out = sim.execute(run, {})
        if out.error is not None:
            raise out.error
        return out.report

    def sim_unrecorded() -> None:
        with _NoPerOpRecord():
            simulated()

    q = paired(sim_unrecorded, simulated, reps)
    report = simulated()
    n = len(report.trace.ops)
    row.update(sim_record=q.ratio, sim_timing=q.to_dict(), ops=str(n),
               kib_per_kop=f"{_trace_bytes(report.trace) / n * 1000 / 1024:.1f}" if n else "-")
    return q.ratio <= SIM_TARGET
