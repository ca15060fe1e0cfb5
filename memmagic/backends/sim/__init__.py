"""The simulated CUDA device (``--backend sim``): GPU memory numbers without a GPU.

A cell written for a GPU runs unchanged on fake tensors (metadata, no data): the CUDA
device is rewritten onto fake CPU tensors (:mod:`.device`), CUDA's kernels and autocast
policy are modeled where the CPU's use memory differently (:mod:`.kernels`,
:mod:`.autocast`), ops whose outputs FakeTensorMode computed once for such inputs are
answered from metadata (:mod:`.op_cache`), reserved memory comes from a model of the caching allocator
(:mod:`.allocator`), ``torch.cuda`` queries answer from the simulation (:mod:`.cuda_api`),
and the notebook's objects are swapped for fake copies during the run (:mod:`.sandbox`).
"""

from __future__ import annotations

from .backend import KERNELS, SIM_NOTES, SimBackend, clear_op_cache
from .errors import (
    SimulatedDeviceMismatchError,
    SimulatedOutOfMemoryError,
    SimulatedValueError,
    SimulationBudgetExceeded,
    SimulationError,
    SimulationUnsupported,
)
from .gpus import GPUS, GPUSpec, resolve_target
from .sandbox import SimulatedValue

__all__ = [
    "SimBackend", "KERNELS", "SIM_NOTES", "clear_op_cache", "GPUS", "GPUSpec", "resolve_target",
    "SimulationError", "SimulationUnsupported", "SimulationBudgetExceeded",
    "SimulatedOutOfMemoryError", "SimulatedValueError", "SimulatedDeviceMismatchError",
    "SimulatedValue",
]
