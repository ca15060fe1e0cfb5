"""The ``torch.cuda`` a simulated cell sees: queries answer from the simulation.

``is_available()`` is True, there is one device, ``memory_allocated()`` and friends read
the simulated tracker and allocator model, ``reset_peak_memory_stats()`` resets the
simulation's own counters (never a real device's), ``empty_cache()`` releases the model's
free segments, ``synchronize()`` does nothing. ``mem_get_info()`` and
``get_device_properties()`` answer for the target card, or for :data:`DEFAULT_CARD` when
none is named (:func:`install_default_card_note` says so in the report).

What cannot be simulated (events, streams, CUDA graphs, memory pools) raises
:class:`SimulationUnsupported` when used; the classes among them stay real classes until
then, so annotations such as ``torch.cuda.CUDAGraph | None`` (evaluated when
transformers is imported), ``isinstance`` checks and subclasses work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...report import format_bytes
from .errors import RERUN_HINT, SimulationUnsupported
from .gpus import DEFAULT_CAPABILITY, GPUS, GPUSpec
from .patching import Patches

__all__ = ["SimDeviceProperties", "install_cuda_api", "install_default_card_note", "DEFAULT_CARD"]

# The card the size queries (``mem_get_info``, ``get_device_properties``) answer for when
# none is named: the sm_80 card whose kernels the simulation picks by default.
DEFAULT_CARD: GPUSpec = GPUS.get("a100-40gb") or GPUSpec("A100-40GB", 40_536 << 20, (8, 0), 108)
_CARD_QUERIES = ("mem_get_info", "get_device_properties", "get_device_name")


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


class _UnsupportedAttribute(SimulationUnsupported, AttributeError):
    """An attribute of an unsupported CUDA class was used (also an AttributeError, so
    ``hasattr`` and ``getattr(..., default)`` answer as for a missing attribute)."""


class _UnsupportedMeta(type):
    """Metaclass of the stand-ins: public class attributes (``Stream.priority_range``)
    fail with the one-line message; private and dunder names stay plain lookups, so
    ``X | None``, annotations, ``isinstance`` and ``typing`` work as for any class."""

    _what: str

    def __getattr__(cls, name: str):
        if name.startswith("_"):
            raise AttributeError(f"type object {cls.__name__!r} has no attribute {name!r}")
        raise _UnsupportedAttribute(f"{cls._what}.{name} cannot be simulated; {RERUN_HINT}")


def _unsupported_class(what: str) -> type:
    """A real class standing in for ``what`` (``torch.cuda.Event``, ``Stream``,
    ``CUDAGraph``...): it can be named in annotations (``torch.cuda.CUDAGraph | None``),
    checked with ``isinstance`` (nothing is an instance) and subclassed; constructing it,
    or a subclass, raises :class:`SimulationUnsupported` naming the class."""
    module, _, short = what.rpartition(".")

    def __new__(cls, *args: Any, **kwargs: Any):
        raise SimulationUnsupported(f"{what} cannot be simulated; {RERUN_HINT}")

    return _UnsupportedMeta(short, (), {
        "__new__": __new__, "__module__": module, "__qualname__": short, "_what": what,
        "__doc__": f"{what} in a simulation: constructing it raises SimulationUnsupported.",
    })


def install_cuda_api(patches: Patches, tracker, target: GPUSpec | None,
                     autocast: dict[str, Any]) -> None:
    """Patch ``torch.cuda`` (and its ``memory``/``amp`` submodules) for the run."""
    import torch.cuda.amp
    import torch.cuda.memory as cmem

    cuda = torch.cuda
    card = target or DEFAULT_CARD  # kernels follow DEFAULT_CAPABILITY without a target
    name = card.name
    capability = target.capability if target else DEFAULT_CAPABILITY
    props = SimDeviceProperties(
        name=name, total_memory=card.total_memory, major=capability[0], minor=capability[1],
        multi_processor_count=card.multi_processor_count)

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
        """(free, total) bytes of the card: total less what the allocator model reserved
        (the CUDA context, which also takes room on a real card, is not counted)."""
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
        "is_current_stream_capturing": lambda: False,
        "Event": _unsupported_class("torch.cuda.Event"), "Stream": _unsupported_class("torch.cuda.Stream"),
        "ExternalStream": _unsupported_class("torch.cuda.ExternalStream"),
        "CUDAGraph": _unsupported_class("torch.cuda.CUDAGraph"), "graph": _unsupported_class("torch.cuda.graph"),
        "MemPool": _unsupported_class("torch.cuda.MemPool"),
        "stream": _unsupported("torch.cuda.stream"),
        "current_stream": _unsupported("torch.cuda.current_stream"),
        "default_stream": _unsupported("torch.cuda.default_stream"),
        "make_graphed_callables": _unsupported("torch.cuda.make_graphed_callables"),
        "graph_pool_handle": _unsupported("torch.cuda.graph_pool_handle"),
        "use_mem_pool": _unsupported("torch.cuda.use_mem_pool"),
    }
    for attr, value in values.items():
        if hasattr(cuda, attr):
            patches.set(cuda, attr, value)
        if hasattr(cmem, attr):
            patches.set(cmem, attr, value)
    patches.set(torch.cuda.amp, "autocast", autocast["cuda_amp_autocast"])


def install_default_card_note(patches: Patches, notes: list[str]) -> None:
    """With no target card named, make the size queries (``mem_get_info``,
    ``get_device_properties``, ``get_device_name``) add one note to ``notes`` saying that
    :data:`DEFAULT_CARD` answered. Call after :func:`install_cuda_api`."""
    import torch.cuda.memory as cmem

    note = (f"no GPU was named: torch.cuda's card queries (mem_get_info, get_device_properties) "
            f"answered for a {DEFAULT_CARD.name} ({format_bytes(DEFAULT_CARD.total_memory)}); "
            "name the card (--gpu) to size it (nothing runs out of memory without one)")

    def noting(query):
        def answer(*args: Any, **kwargs: Any):
            if note not in notes:
                notes.append(note)
            return query(*args, **kwargs)
        answer.__name__ = getattr(query, "__name__", "query")
        answer.__doc__ = getattr(query, "__doc__", None)
        return answer

    for attr in _CARD_QUERIES:
        for mod in (torch.cuda, cmem):
            if hasattr(mod, attr):
                patches.set(mod, attr, noting(getattr(mod, attr)))
