"""The CUDA backend: the real caching allocator's numbers, with the tracker for the breakdown.

It never calls ``torch.cuda.reset_peak_memory_stats``: the peak counter is global per
device (pytorch issue 16266), and resetting it would clobber a measurement around the
cell (the user's own ``max_memory_allocated()`` reading, or an outer ``%%gpumem``).
Instead:

* if the global ``max_memory_allocated`` rose during the cell, the cell reached a new
  all-time peak and that counter *is* the cell's peak (exact);
* otherwise the cell's peak lies below an earlier one, and memmagic replays the
  allocator's own event trace (``torch.cuda.memory._record_memory_history``, switched on
  for the cell's duration with no stack capture, or read from the user's recording when
  one is already running) from ``memory_allocated()`` at the start;
* if no trace is available (too many events for the buffer), the tracker's op-level peak
  is used and the report says so.

``max_memory_reserved`` is handled the same way with the trace's segment events.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch

from ..core import _torch_private as _priv
from ..core.failures import error_text
from ..report import MemoryReport
from ..core.tracking import Tracking
from ..core.failures import cuda_usable
from .base import Backend, BackendUnavailable, Measurement

__all__ = ["CUDABackend", "AllocatorProbe", "replay_peak", "CUDA_NOTES"]

CUDA_NOTES = (
    "from the CUDA caching allocator: excludes the CUDA context (hundreds of MiB in "
    "nvidia-smi) and memory of other processes; includes 512-byte rounding and workspaces "
    "torch allocates through it",
)
TRACE_ENTRIES = 1 << 20


def replay_peak(start: int, events: list[tuple[str, int]], up: set[str], down: set[str]) -> int:
    """Highest running total reached from ``start`` by ``events`` of (action, size)."""
    cur = peak = start
    for action, size in events:
        if action in up:
            cur += size
            peak = max(peak, cur)
        elif action in down:
            cur -= size
    return peak


def round_512(n: int) -> int:
    """What the CUDA caching allocator holds for an n-byte request (multiples of 512)."""
    return -(-n // 512) * 512


_ALLOC_UP, _ALLOC_DOWN = {"alloc"}, {"free_completed"}
_SEG_UP, _SEG_DOWN = {"segment_alloc", "segment_map"}, {"segment_free", "segment_unmap"}


class AllocatorProbe:
    """The few torch.cuda calls the backend makes; tests substitute a fake allocator."""

    def __init__(self, device: int) -> None:
        self.device = device
        self._we_record = False
        self._start_len = 0
        self.keep_snapshot = False  # stop_trace keeps the allocator's own snapshot
        self.snapshot: dict | None = None

    def name(self) -> str:
        return torch.cuda.get_device_name(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def counters(self) -> tuple[int, int, int, int]:
        d = self.device
        return (torch.cuda.memory_allocated(d), torch.cuda.max_memory_allocated(d),
                torch.cuda.memory_reserved(d), torch.cuda.max_memory_reserved(d))

    def _traces(self) -> list[dict]:
        snap = _priv.memory_snapshot(self.device)
        traces = snap.get("device_traces", [])
        return traces[self.device] if len(traces) > self.device else []

    def start_trace(self) -> None:
        existing = self._traces()
        if existing:  # somebody records already: read theirs, change nothing
            self._start_len = len(existing)
            return
        _priv.record_memory_history("all", stacks="python", max_entries=TRACE_ENTRIES,
                                    device=self.device, clear_history=True)
        self._we_record = True
        self._start_len = 0

    def stop_trace(self) -> list[tuple[str, int]] | None:
        """Events since :meth:`start_trace`, or None when the buffer overflowed. With
        ``keep_snapshot``, the allocator's whole snapshot (segments and the cell's events,
        with Python stacks) is kept in ``snapshot``: what PyTorch's memory_viz page opens."""
        try:
            if self.keep_snapshot:
                snap = _priv.memory_snapshot(self.device)
                traces = snap.get("device_traces", [])
                if len(traces) > self.device and self._start_len:
                    traces[self.device] = traces[self.device][self._start_len:]
                self.snapshot = snap
            traces = self._traces()
            if len(traces) >= TRACE_ENTRIES or len(traces) < self._start_len:
                return None
            return [(e["action"], int(e["size"])) for e in traces[self._start_len:]]
        finally:
            if self._we_record:
                self._we_record = False
                _priv.record_memory_history(None, device=self.device)


class CUDABackend(Backend):
    """Real run on a CUDA device. ``breakdown=False`` skips the tracker (lowest overhead)."""

    name = "cuda"

    def __init__(self, device: int | None = None, breakdown: bool = True,
                 probe: AllocatorProbe | None = None, snapshot: bool = False) -> None:
        """``snapshot=True`` keeps the allocator's own snapshot of the cell on the report
        (``report.cuda_snapshot``, for :func:`memmagic.core.snapshot.write_snapshot`)."""
        if probe is None:
            if not cuda_usable():
                raise BackendUnavailable(
                    "no usable CUDA GPU here; use --backend cpu (real run on the CPU) "
                    "or --backend sim (simulated GPU)")
            count = torch.cuda.device_count()
            device = torch.cuda.current_device() if device is None else int(device)
            if not 0 <= device < count:
                raise BackendUnavailable(f"no CUDA device {device}: this machine has {count}")
            probe = AllocatorProbe(device)
        self.device = probe.device
        self.breakdown = breakdown
        self.probe = probe
        self.snapshot = bool(snapshot)

    def _include(self, t: torch.Tensor) -> str | None:
        d = t.device
        return "device" if d.type == "cuda" and (d.index or 0) == self.device else None

    @contextmanager
    def measuring(self, roots: list | None = None) -> Iterator[Measurement]:
        __tracebackhide__ = True
        probe = self.probe
        holder = Measurement()
        probe.synchronize()
        a0, m0, r0, mr0 = probe.counters()
        tracking = Tracking(self._include, round_512, roots=roots) if self.breakdown else None
        error: BaseException | None = None
        t0 = time.perf_counter()
        if self.snapshot:
            probe.keep_snapshot, probe.snapshot = True, None
        probe.start_trace()
        try:
            if tracking is None:
                yield holder
            else:
                with tracking:
                    yield holder
            probe.synchronize()  # an asynchronous kernel error surfaces here
        except BaseException as exc:
            error = exc
            raise
        finally:
            wall_s = time.perf_counter() - t0
            events = probe.stop_trace()
            holder.report = self._report(probe, (a0, m0, r0, mr0), probe.counters(), events,
                                         tracking, wall_s, error)

    def _report(self, probe: "AllocatorProbe", start: tuple[int, int, int, int],
                end: tuple[int, int, int, int], events: list[tuple[str, int]] | None,
                tracking: Tracking | None, wall_s: float,
                error: BaseException | None) -> MemoryReport:
        a0, m0, r0, mr0 = start
        a1, m1, r1, mr1 = end
        notes = list(CUDA_NOTES)
        tr = tracking.result if tracking is not None else None
        if m1 > m0:  # a new all-time peak: the counter is exact
            peak = m1
        elif events is not None:
            peak = replay_peak(a0, events, _ALLOC_UP, _ALLOC_DOWN)
        else:
            peak = max(a0, a1, a0 + (tr.peak - tr.before) if tr else 0)
            notes.append("allocator trace overflowed: peak estimated from tensor tracking")
        if mr1 > mr0:
            reserved = mr1
        elif events is not None:
            reserved = replay_peak(r0, events, _SEG_UP, _SEG_DOWN)
        else:
            reserved = max(r0, r1)
        breakdown_before = tr.breakdown_before if tr is not None else {}
        if tr is not None:
            breakdown = tr.breakdown
            notes.append("breakdown from tensor tracking at its own peak; "
                         "'unattributed' is what the allocator held beyond it")
        else:
            breakdown = {}
            notes.append("no breakdown (breakdown=False)")
        if tr is not None and getattr(tr, "compiled_calls", 0):
            from .base import compiled_note

            notes.append(compiled_note(tr.compiled_calls))
        return MemoryReport(
            backend="cuda", device=f"cuda:{self.device} ({probe.name()})", before=a0,
            peak=peak, after=a1, wall_s=wall_s, breakdown=breakdown,
            breakdown_before=breakdown_before, reserved_peak=reserved,
            reserved_after=r1, peak_op=tr.peak_op if tr else None,
            peak_module=tr.peak_module if tr else None, error=error_text(error),
            notes=tuple(notes), timeline=tuple(tr.timeline) if tr else (),
            peak_phase=tr.peak_phase if tr else None, peak_label=tr.peak_label if tr else None,
            modules=tuple(tr.trace.module_rows(tr.peak)) if tr and tr.trace else (),
            trace=tr.trace if tr else None,
            cuda_snapshot=getattr(probe, "snapshot", None) if self.snapshot else None,
        )
