"""The backends' one small interface: :class:`Backend` (``execute(run, namespace)``), the
:class:`Outcome` it returns, the :class:`Measurement` a with-block yields, and the error a
backend raises when it cannot run here. Every backend module builds on this one; the
package (:mod:`memmagic.backends`) picks among them."""

from __future__ import annotations

from abc import ABC
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable

from ..report import MemoryReport

__all__ = ["Backend", "Outcome", "Measurement", "BackendUnavailable", "compiled_note",
           "DECODE_STEPS"]

# how the simulated GPU runs transformers' generate() decode steps (the sim backend's
# decode=): read off a line through three that ran, or each one op by op
DECODE_STEPS = ("evaluate", "run")


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
        prepare = getattr(run, "prepare", None)
        failed_setup = None
        if prepare is not None:  # the run's setup, before the measurement starts
            try:
                prepare(namespace)
            except BaseException as exc:  # the run's error, as in the sim (reported below)
                failed_setup = exc
        try:
            with self.measuring([namespace] if namespace else None) as holder:
                if failed_setup is not None:
                    raise failed_setup
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
