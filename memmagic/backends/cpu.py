"""The CPU backend: runs the code for real on the CPU and tracks live tensor storage."""

from __future__ import annotations

import platform
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from ..core import _torch_private as _priv
from ..core.failures import error_text
from ..report import MemoryReport
from ..core.tracking import Tracking
from .base import Backend, Measurement, compiled_note

__all__ = ["CPUBackend", "CPU_NOTES"]

CPU_NOTES = (
    "CPU tensor storage tracked op by op; buffers a kernel allocates and frees inside "
    "itself (mkldnn, sort) and memory outside tensors (Python objects, the allocator's "
    "own overhead) are not counted",
)


def _cpu_name() -> str:
    return platform.processor() or platform.machine() or "cpu"


def _on_cpu(t: torch.Tensor) -> str | None:
    # a FakeTensor (of a simulated run, kept by a traceback) is metadata without memory
    return "device" if t.device.type == "cpu" and not _priv.is_fake(t) else None


class CPUBackend(Backend):
    """Real run on the CPU. ``before`` counts every CPU tensor that exists at the start."""

    name = "cpu"

    def __init__(self, **options: Any) -> None:
        if options:
            raise TypeError(f"the cpu backend takes no options, got {sorted(options)}")

    @contextmanager
    def measuring(self, roots: list | None = None) -> Iterator[Measurement]:
        __tracebackhide__ = True
        holder = Measurement()
        tracking = Tracking(_on_cpu, roots=roots)
        error = None
        try:
            with tracking:
                yield holder
        except BaseException as exc:
            error = exc
            raise
        finally:
            holder.report = report_from_tracking(
                tracking, "cpu", f"cpu ({_cpu_name()})", CPU_NOTES, error)


def report_from_tracking(tracking: Tracking, backend: str, device: str,
                         notes: tuple[str, ...], error: BaseException | None,
                         **extra: Any) -> MemoryReport:
    """A MemoryReport from a finished :class:`Tracking` (the cpu and sim backends)."""
    r = tracking.result
    assert r is not None
    notes = tuple(notes)
    if r.compiled_calls:
        notes += (compiled_note(r.compiled_calls),)
    return MemoryReport(
        backend=backend, device=device, before=r.before, peak=r.peak, after=r.after,
        wall_s=tracking.wall_s, breakdown=r.breakdown, breakdown_before=r.breakdown_before,
        peak_op=r.peak_op,
        peak_module=r.peak_module, peak_phase=r.peak_phase, peak_label=r.peak_label,
        modules=tuple(r.trace.module_rows(r.peak)) if r.trace is not None else (),
        trace=r.trace,
        error=error_text(error), notes=notes, timeline=tuple(r.timeline), **extra,
    )
