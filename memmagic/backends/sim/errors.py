"""Errors the simulated device raises. Each message is one line that says what to do."""

from __future__ import annotations

import re

import torch

from ...core.failures import register_simulated_errors

__all__ = ["SimulationError", "SimulationUnsupported", "SimulationBudgetExceeded",
           "SimulatedOutOfMemoryError", "SimulatedValueError", "SimulatedDeviceMismatchError",
           "SimulatedSizeError", "size_error", "AllocatorConfigError", "StageWaits",
           "waits_for_a_stage", "RERUN_HINT"]

RERUN_HINT = "run the cell or script with --backend cpu (a real run on the CPU) or on a GPU"


class SimulationError(RuntimeError):
    """Base class of the simulator's own errors."""


class SimulationUnsupported(SimulationError):
    """The cell does something a simulation cannot do (custom CUDA kernels, CUDA events
    and streams, reading a CUDA RNG, a device the rewriting missed)."""


class StageWaits(SimulationUnsupported):
    """A pipeline stage of the rank that ran needs the shapes of the tensors an earlier
    stage sends it, and no rank of the job run so far has run that stage (memmagic.jobs
    runs such a rank again once the others have)."""


def waits_for_a_stage(error: BaseException | None) -> bool:
    """Whether a run stopped at a pipeline stage that waits for an earlier stage."""
    return isinstance(error, StageWaits)


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


class SimulatedSizeError(SimulationError):
    """A tensor whose sizes multiply past a 64-bit count (``torch.randn(10**12, 10**12)``),
    which torch refuses on a GPU too, before any allocation. The message is CUDA's, after
    "would fail on a GPU", with what to do; ``op`` names the aten op."""

    def __init__(self, message: str, *, op: str | None = None) -> None:
        super().__init__(message)
        self.op = op


# they stand for an error of the simulated code (the traceback is cut below the user's line)
register_simulated_errors(SimulationError, SimulatedOutOfMemoryError)


# torch's words for it: its C++ size checks (CUDA and the CPU) and fake tensors' meta kernels
_OVERFLOW = re.compile(r"^(Storage size calculation overflowed with sizes=\[[^\]]*\]|"
                       r"numel: integer multiplication overflow)")


def size_error(error: BaseException) -> SimulatedSizeError | None:
    """The :class:`SimulatedSizeError` for an op of the simulated run that failed because
    its sizes overflow (None for any other error), with the failed op's traceback; it
    stands for the error, whose fake-tensor internals it hides."""
    m = _OVERFLOW.match(str(error)) if isinstance(error, RuntimeError) else None
    if m is None:
        return None
    func, args = _failed_op(error.__traceback__)
    cuda = m.group(1)
    sizes = args[0] if args else None
    if (cuda.startswith("numel") and isinstance(sizes, (list, tuple)) and sizes
            and all(isinstance(n, int) for n in sizes)
            and not any(isinstance(a, torch.Tensor) for a in args)):
        # a factory (randn, rand, ...): CUDA allocates its output first, and says so there
        cuda = f"Storage size calculation overflowed with sizes={list(sizes)}"
    new = SimulatedSizeError(f"would fail on a GPU: {cuda}; the sizes multiply past what a "
                             "64-bit count holds: check them", op=getattr(func, "__name__", None))
    new.__suppress_context__ = True
    return new.with_traceback(error.__traceback__)


def _failed_op(tb) -> tuple[object, tuple]:
    """(aten op, its arguments) of the outermost dispatch of the failed op in ``tb``: the op
    the user's code called, before any decomposition."""
    from ...core._torch_private import OpOverload

    while tb is not None:
        local = tb.tb_frame.f_locals
        func, args = local.get("func"), local.get("args")
        if isinstance(func, OpOverload) and isinstance(args, tuple):
            return func, args
        tb = tb.tb_next
    return None, ()
