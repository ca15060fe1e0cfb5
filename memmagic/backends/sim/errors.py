"""Errors the simulated device raises. Each message is one line that says what to do."""

from __future__ import annotations

import torch

__all__ = ["SimulationError", "SimulationUnsupported", "SimulationBudgetExceeded",
           "SimulatedOutOfMemoryError", "SimulatedValueError", "SimulatedDeviceMismatchError",
           "AllocatorConfigError", "RERUN_HINT"]

RERUN_HINT = "run the cell with --backend cpu (real run on the CPU) or on a GPU"


class SimulationError(RuntimeError):
    """Base class of the simulator's own errors."""


class SimulationUnsupported(SimulationError):
    """The cell does something a simulation cannot do (custom CUDA kernels, CUDA events
    and streams, reading a CUDA RNG, a device the rewriting missed)."""


class AllocatorConfigError(SimulationError, ValueError):
    """``PYTORCH_CUDA_ALLOC_CONF`` holds a value torch refuses (torch would fail at the
    first CUDA call): no simulated GPU can be made with it."""


class SimulationBudgetExceeded(SimulationError):
    """The run exceeded ``max_ops`` or ``max_seconds`` (often a loop whose end depends on
    tensor values, which a simulation does not know)."""


class SimulatedOutOfMemoryError(torch.OutOfMemoryError):
    """The simulated allocator ran out of the target GPU's memory at this op, as
    ``torch.OutOfMemoryError`` would on the card. ``op``/``module`` say where."""

    def __init__(self, message: str, *, op: str | None = None, module: str | None = None,
                 size: int = 0) -> None:
        super().__init__(message)
        self.op, self.module, self.size = op, module, size


class SimulatedDeviceMismatchError(SimulationError):
    """The cell mixes a CPU tensor and a CUDA tensor in one op, which raises on a GPU (a
    0-dim CPU tensor is accepted, as CUDA does). The message is CUDA's, after the user's
    line and "would fail on a GPU"; ``op`` names the aten op, ``argument`` the argument
    on the other device."""

    def __init__(self, message: str, *, op: str | None = None, argument: str | None = None) -> None:
        super().__init__(message)
        self.op, self.argument = op, argument


class SimulatedValueError(SimulationError):
    """A value made by a simulated cell was used outside it (it has no data)."""
