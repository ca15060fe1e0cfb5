"""Backends: each runs code and returns a :class:`~memmagic.report.MemoryReport`.

One small interface (:class:`Backend`): ``execute(run, namespace)`` calls ``run`` with the
namespace the code must see, measures it, and returns an :class:`Outcome` that holds the
report, the value, and the exception if the code failed (never swallowed: the caller
re-raises it after rendering). The simulated backend hands ``run`` a sandboxed namespace.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

from ..report import MemoryReport

__all__ = ["Backend", "Outcome", "BackendUnavailable", "get_backend", "BACKEND_NAMES"]

BACKEND_NAMES = ("auto", "cuda", "cpu", "sim")


class BackendUnavailable(RuntimeError):
    """The asked-for backend cannot run here; the message says what to use instead."""


@dataclass
class Outcome:
    report: MemoryReport
    value: Any = None
    error: BaseException | None = None


class Backend(ABC):
    name: str

    @abstractmethod
    def execute(self, run: Callable[[dict], Any], namespace: dict) -> Outcome:
        """Run ``run(ns)`` under measurement; never raises what ``run`` raised."""

    def measure(self, fn: Callable[[], Any]) -> Outcome:
        """Measure a zero-argument callable."""
        return self.execute(lambda _ns: fn(), {})


def cuda_usable() -> bool:
    import torch

    try:
        return bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0
    except Exception:
        return False


def get_backend(name: str = "auto", **options: Any) -> Backend:
    """The backend called ``name``; ``auto`` is ``cuda`` when a GPU is usable, else ``cpu``.

    Options go to the backend (``device=`` for cuda, ``gpu=``/``gpu_memory=`` for sim, ...).
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {', '.join(BACKEND_NAMES)}, not {name!r}")
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
