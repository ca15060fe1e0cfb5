"""Backends: each runs code and returns a :class:`~memmagic.report.MemoryReport`.

One small interface (:class:`Backend`): ``execute(run, namespace)`` calls ``run`` with the
namespace the code must see, measures it, and returns an :class:`Outcome` that holds the
report, the value, and the exception if the code failed (never swallowed: the caller
re-raises it after rendering). The simulated backend hands ``run`` a sandboxed namespace.
"""

from __future__ import annotations

import sys
from typing import Any

from ..core.failures import cuda_usable
from .base import DECODE_STEPS, Backend, BackendUnavailable, Measurement, Outcome, compiled_note

__all__ = ["Backend", "Outcome", "Measurement", "BackendUnavailable", "get_backend", "BACKEND_NAMES",
           "DECODE_STEPS", "simulation_running", "compiled_note", "cuda_usable"]

BACKEND_NAMES = ("auto", "cuda", "cpu", "sim")


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
