"""Backends: each runs code and returns a :class:`~memmagic.report.MemoryReport`.

One small interface (:class:`Backend`): ``execute(run, namespace)`` calls ``run`` with the
namespace the code must see, measures it, and returns an :class:`Outcome` that holds the
report, the value, and the exception if the code failed (never swallowed: the caller
re-raises it after rendering). The simulated backend hands ``run`` a sandboxed namespace.
"""

from __future__ import annotations

import sys
from abc import ABC
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable

from ..failures import cuda_usable
from ..report import MemoryReport

__all__ = ["Backend", "Outcome", "BackendUnavailable", "get_backend", "BACKEND_NAMES",
           "simulation_running", "compiled_note", "cuda_usable"]

BACKEND_NAMES = ("auto", "cuda", "cpu", "sim")


class BackendUnavailable(RuntimeError):
    """The asked-for backend cannot run here; the message says what to use instead."""


@dataclass
class Outcome:
    report: MemoryReport
    value: Any = None
    error: BaseException | None = None


class Measurement:
    """What ``Backend.measuring()`` (and ``memmagic.track()``) yields; ``report`` is set
    when the block exits, and the report's numbers read through it (``m.peak``,
    ``m.breakdown``, ``m.summary()``)."""

    report: MemoryReport | None = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        report = self.report
        if report is None:
            raise AttributeError(
                f"the measurement has no {name!r} yet: its numbers are there once the "
                "with-block has ended (m.report, m.peak, ...)")
        return getattr(report, name)

    def __repr__(self) -> str:
        return ("<Measurement: running>" if self.report is None
                else f"<Measurement : {self.report}>")


class Backend(ABC):
    """Real-run backends implement :meth:`measuring`; the simulated one overrides
    :meth:`execute` (it must hand the code a sandboxed namespace)."""

    name: str

    def measuring(self, roots: list | None = None) -> AbstractContextManager[Measurement]:
        """A context manager measuring its body; the report is set on exit, also on error.

        ``roots``: where the tensors that exist already can be found (a notebook's
        namespace); None looks through every object of the process."""
        raise NotImplementedError(
            f"the {self.name} backend cannot measure a with-block; "
            "pass a function to memmagic.measure() instead")

    def execute(self, run: Callable[[dict], Any], namespace: dict) -> Outcome:
        """Run ``run(ns)`` under measurement; never raises what ``run`` raised."""
        __tracebackhide__ = True
        value = error = None
        holder = Measurement()
        try:
            with self.measuring([namespace] if namespace else None) as holder:
                value = run(namespace)
        except BaseException as exc:  # handed back to the caller, who re-raises it
            error = exc
        if holder.report is None:  # the measurement itself failed to start: not the code's error
            assert error is not None
            raise error
        return Outcome(holder.report, value, error)

    def measure(self, fn: Callable[[], Any]) -> Outcome:
        """Measure a zero-argument callable."""
        return self.execute(lambda _ns: fn(), {})


def compiled_note(calls: int) -> str:
    """The note of a run in which ``torch.compile``'d code ran (eagerly) ``calls`` times."""
    return (f"torch.compile'd code ran eagerly here ({calls} call{'s' if calls != 1 else ''}): "
            "these are the eager path's numbers, usually an upper bound for the compiled run "
            "(its fused kernels keep fewer intermediate tensors; mode='reduce-overhead' adds "
            "CUDA-graph buffers); the code compiles as usual outside the measurement")


def simulation_running() -> bool:
    """Whether a simulated run is in progress (code inside it runs on fake tensors)."""
    sim = sys.modules.get(__name__ + ".sim.backend")
    return sim is not None and sim.simulation_active()


def get_backend(name: str = "auto", **options: Any) -> Backend:
    """The backend called ``name``; ``auto`` is ``cuda`` when a GPU is usable, else ``cpu``.

    Options go to the backend (``device=`` for cuda, ``gpu=``/``gpu_memory=`` for sim, ...).
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {', '.join(BACKEND_NAMES)}, not {name!r}")
    if name != "sim" and simulation_running():  # the sim backend says so itself
        from .sim import SimulationUnsupported

        raise SimulationUnsupported(
            f"a measurement (backend {name!r}) cannot run inside a simulated one (the code "
            "there runs on the simulated GPU, which only the simulation measures): measure "
            "the inner code in a cell of its own; after %gpusim on every cell is a simulated "
            "one, so run it after %gpusim off")
    if name == "auto":
        name = "cuda" if cuda_usable() else "cpu"
    if name == "cuda":
        from .cuda import CUDABackend

        return CUDABackend(**options)
    if name == "cpu":
        from .cpu import CPUBackend

        return CPUBackend(**options)
    try:
        from .sim import SimBackend
    except ImportError as exc:  # pragma: no cover - until the simulated device lands
        raise BackendUnavailable(
            "the simulated CUDA device is not available in this build; use --backend cpu"
        ) from exc
    return SimBackend(**options)
