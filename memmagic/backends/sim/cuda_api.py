"""The ``torch.cuda`` a simulated cell sees: queries answer from the simulation.

``is_available()`` is True, there is one device, ``memory_allocated()`` and friends read
the simulated tracker and allocator model, ``reset_peak_memory_stats()`` resets the
simulation's own counters (never a real device's), ``empty_cache()`` releases the model's
free segments, ``synchronize()`` does nothing. What cannot be simulated (events, streams,
CUDA RNG state, graphs) raises :class:`SimulationUnsupported`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...report import format_bytes
from .errors import RERUN_HINT, SimulationUnsupported
from .gpus import DEFAULT_CAPABILITY, GPUSpec
from .patching import Patches

__all__ = ["SimDeviceProperties", "install_cuda_api"]


@dataclass(frozen=True)
class SimDeviceProperties:
    """What ``torch.cuda.get_device_properties`` returns in a simulation."""

    name: str
    total_memory: int
    major: int
    minor: int
    multi_processor_count: int
    is_integrated: bool = False
    is_multi_gpu_board: bool = False

    def __repr__(self) -> str:
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // 2**20}MB, "
                f"multi_processor_count={self.multi_processor_count}) [simulated]")


def _unsupported(what: str):
    def fail(*args: Any, **kwargs: Any):
        raise SimulationUnsupported(f"{what} cannot be simulated; {RERUN_HINT}")
    fail.__name__ = what.rsplit(".", 1)[-1]
    return fail


class _Unsupported:
    """A class whose construction fails with a clear message (torch.cuda.Event, Stream...)."""

    def __init__(self, what: str) -> None:
        self._what = what

    def __call__(self, *args: Any, **kwargs: Any):
        raise SimulationUnsupported(f"{self._what} cannot be simulated; {RERUN_HINT}")

    def __getattr__(self, name: str):
        raise SimulationUnsupported(f"{self._what}.{name} cannot be simulated; {RERUN_HINT}")


def install_cuda_api(patches: Patches, tracker, target: GPUSpec | None,
                     autocast: dict[str, Any]) -> None:
    """Patch ``torch.cuda`` (and its ``memory``/``amp`` submodules) for the run."""
    import torch.cuda.amp
    import torch.cuda.memory as cmem

    cuda = torch.cuda
    name = target.name if target else "simulated GPU"
    props = SimDeviceProperties(
        name=name, total_memory=target.total_memory if target else 0,
        major=(target.capability if target else DEFAULT_CAPABILITY)[0],
        minor=(target.capability if target else DEFAULT_CAPABILITY)[1],
        multi_processor_count=target.multi_processor_count if target else 0)

    def _check_device(device=None) -> None:
        if device is None:
            return
        idx = device if isinstance(device, int) else torch.device(device).index
        if idx not in (None, 0):
            raise SimulationUnsupported(f"the simulation has one GPU (cuda:0), not cuda:{idx}; {RERUN_HINT}")

    def memory_allocated(device=None) -> int:
        _check_device(device)
        return tracker.current["device"]

    def max_memory_allocated(device=None) -> int:
        _check_device(device)
        return tracker.cuda_peak

    def memory_reserved(device=None) -> int:
        _check_device(device)
        a = tracker.allocator
        return a.reserved if a is not None else tracker.current["device"]

    def max_memory_reserved(device=None) -> int:
        _check_device(device)
        return tracker.cuda_reserved_peak if tracker.allocator is not None else tracker.cuda_peak

    def reset_peak_memory_stats(device=None) -> None:
        _check_device(device)
        tracker.cuda_peak = tracker.current["device"]
        a = tracker.allocator
        tracker.cuda_reserved_peak = a.reserved if a is not None else 0

    def empty_cache() -> None:
        if tracker.allocator is not None:
            tracker.allocator.empty_cache()

    def memory_stats(device=None) -> dict[str, int]:
        _check_device(device)
        return {
            "allocated_bytes.all.current": memory_allocated(), "allocated_bytes.all.peak": max_memory_allocated(),
            "reserved_bytes.all.current": memory_reserved(), "reserved_bytes.all.peak": max_memory_reserved(),
            "active_bytes.all.current": memory_allocated(), "active_bytes.all.peak": max_memory_allocated(),
        }

    def memory_summary(device=None, abbreviated: bool = False) -> str:
        _check_device(device)
        return (f"simulated {name}: allocated {format_bytes(memory_allocated())} "
                f"(peak {format_bytes(max_memory_allocated())}), reserved "
                f"{format_bytes(memory_reserved())} (peak {format_bytes(max_memory_reserved())})")

    def mem_get_info(device=None) -> tuple[int, int]:
        _check_device(device)
        total = props.total_memory
        return (max(total - memory_reserved(), 0), total)

    values: dict[str, Any] = {
        "is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
        "is_initialized": lambda: True, "init": lambda: None, "set_device": _check_device,
        "get_device_name": lambda device=None: (_check_device(device), name)[1],
        "get_device_properties": lambda device=None: (_check_device(device), props)[1],
        "get_device_capability": lambda device=None: (props.major, props.minor),
        "is_bf16_supported": lambda including_emulation=True: props.major >= 8,
        "synchronize": lambda device=None: None, "ipc_collect": lambda: None,
        "memory_allocated": memory_allocated, "max_memory_allocated": max_memory_allocated,
        "memory_reserved": memory_reserved, "max_memory_reserved": max_memory_reserved,
        "memory_cached": memory_reserved, "max_memory_cached": max_memory_reserved,
        "reset_peak_memory_stats": reset_peak_memory_stats,
        "reset_max_memory_allocated": reset_peak_memory_stats,
        "reset_max_memory_cached": reset_peak_memory_stats,
        "reset_accumulated_memory_stats": lambda device=None: None,
        "empty_cache": empty_cache, "memory_stats": memory_stats, "memory_summary": memory_summary,
        "mem_get_info": mem_get_info,
        "manual_seed": lambda seed: None, "manual_seed_all": lambda seed: None,
        "seed": lambda: None, "seed_all": lambda: None,
        # checkpoint saves and restores the CUDA RNG state: a simulation has no values
        "get_rng_state": lambda device="cuda": torch.zeros(16, dtype=torch.uint8, device="meta"),
        "set_rng_state": lambda new_state, device="cuda": None,
        "get_rng_state_all": lambda: [torch.zeros(16, dtype=torch.uint8, device="meta")],
        "set_rng_state_all": lambda new_states: None,
        "Generator": _Unsupported("torch.cuda.Generator"),
        "Event": _Unsupported("torch.cuda.Event"), "Stream": _Unsupported("torch.cuda.Stream"),
        "stream": _Unsupported("torch.cuda.stream"),
        "current_stream": _Unsupported("torch.cuda.current_stream"),
        "default_stream": _Unsupported("torch.cuda.default_stream"),
        "CUDAGraph": _Unsupported("torch.cuda.CUDAGraph"), "graph": _Unsupported("torch.cuda.graph"),
    }
    for attr, value in values.items():
        if hasattr(cuda, attr):
            patches.set(cuda, attr, value)
        if hasattr(cmem, attr):
            patches.set(cmem, attr, value)
    patches.set(torch.cuda.amp, "autocast", autocast["cuda_amp_autocast"])
