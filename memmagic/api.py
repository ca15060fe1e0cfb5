"""The Python API for scripts: ``measure(fn)`` and ``with track() as m: ...``.

Knows nothing of IPython.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

from .backends import Measurement, get_backend
from .core.failures import NO_GPU_HINT, add_note_once, needs_missing_cuda
from .pipeline import CellRequest, RequestError, run_cell
from .report import MemoryReport

__all__ = ["measure", "track"]

_SIMULATE = 'memmagic.measure(fn, backend="sim")'  # how a script says "simulate a GPU"


def measure(fn: Callable[[], Any], *, backend: str = "auto", **options: Any) -> MemoryReport:
    """Run ``fn()`` and return the :class:`MemoryReport` of what it did to memory.

    ``backend`` is "auto" (cuda when a GPU is usable, else cpu), "cuda", "cpu" or "sim";
    ``options`` go to the backend (``gpu=``, ``gpu_memory=`` for sim, ...). The call takes
    the pipeline's road (:func:`memmagic.pipeline.run_cell`), as a cell of the magic does.
    If ``fn`` raises, the same exception propagates with the report up to the failure
    attached as ``exc.memmagic_report`` (and, where CUDA code failed for want of a GPU, a
    note that ``backend="sim"`` simulates one).
    """
    if not callable(fn):
        raise TypeError(f"measure() needs a function to call, got {type(fn).__name__}")
    request = CellRequest("", backend=backend, run=lambda _namespace: fn(),
                          backend_options=options, simulate=_SIMULATE)
    try:
        result = run_cell(request)
    except RequestError as exc:  # the backend's own error, as get_backend raised it
        raise (exc.__cause__ or exc) from None
    if result.error is not None:
        _attach(result.error, result.report)
        raise result.error
    return result.report


@contextmanager
def track(*, backend: str = "auto", **options: Any) -> Iterator[Measurement]:
    """Measure a with-block on a real device (cuda or cpu); ``m.report`` is set on exit.

    >>> with track(backend="cpu") as m:
    ...     y = torch.ones(1024)
    >>> m.report.increment
    4096
    """
    be = get_backend(backend, **options)
    holder = None
    try:
        with be.measuring() as holder:
            yield holder
    except BaseException as exc:
        if holder is not None and holder.report is not None:
            _attach(exc, holder.report)
        if needs_missing_cuda(exc):
            add_note_once(exc, NO_GPU_HINT.format(how=_SIMULATE))
        raise


def _attach(error: BaseException, report: MemoryReport) -> None:
    try:
        error.memmagic_report = report  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        pass
