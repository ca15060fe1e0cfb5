"""The ``torch.cuda`` a simulated cell sees: queries answer from the simulation.

``is_available()`` is True, there is one device, ``memory_allocated()`` and friends read
the simulated tracker and allocator model, ``reset_peak_memory_stats()`` resets the
simulation's own counters (never a real device's), ``empty_cache()`` releases the model's
free segments, ``synchronize()`` does nothing. ``mem_get_info()`` and
``get_device_properties()`` answer for the target card, or for :data:`DEFAULT_CARD` when
none is named (:func:`install_default_card_note` says so in the report).

``memory_stats()`` is the allocator model's own statistics under torch's names, so
``memory_summary()`` is torch's own table (with a line saying it is simulated);
``memory._record_memory_history()``, ``memory._snapshot()`` and
``memory._dump_snapshot(path)`` record and write the model's history as a memory_viz
snapshot. Events and streams run as one stream: events record and wait, ``query()`` is
True, and ``elapsed_time`` is a marked placeholder (nothing is timed); work issued on a
side stream runs as on the default one (the report says so).

What cannot be simulated (CUDA graphs, memory pools) raises :class:`SimulationUnsupported`
when used; the classes among them stay real classes until then, so annotations such as
``torch.cuda.CUDAGraph | None`` (evaluated when transformers is imported), ``isinstance``
checks and subclasses work.
"""

from __future__ import annotations

import contextlib
import pickle
import sys
from dataclasses import dataclass
from typing import Any

import torch

from ...report import format_bytes
from ...snapshot import PICKLE_PROTOCOL
from .device import SimulatedFloat
from .errors import RERUN_HINT, SimulationUnsupported
from .gpus import DEFAULT_CAPABILITY, GPUS, GPUSpec
from ...patching import Patches

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


# torch's own memory_summary, which formats whatever memory_stats() answers (the patched
# one during a run): kept from import time, before any run patches it
_TORCH_MEMORY_SUMMARY = torch.cuda.memory.memory_summary

_STREAMS_NOTE = ("CUDA streams and events ran as one stream: work on a side stream ran as "
                 "on the default one (on a GPU the allocator caches blocks per stream, so "
                 "reserved memory can be higher there), and events time nothing")


class _SimStreamEvents:
    """Events and streams of one simulated run (see the module docstring)."""

    def __init__(self, state, notes: list[str]) -> None:
        self.state, self.notes = state, notes
        sim = self

        class Stream(torch.Stream):
            """A CUDA stream in a simulation: everything runs in order on one stream. A
            ``torch.Stream`` (of the CPU underneath) so that ops taking a stream
            (``tensor.record_stream(s)``) accept it."""

            def __new__(cls, device=None, priority: int = 0, **kwargs: Any):
                return super().__new__(cls, device="cpu")

            def __init__(self, device=None, priority: int = 0, **kwargs: Any) -> None:
                self._priority = priority

            device = property(lambda self: torch.device("cuda", 0))
            priority = property(lambda self: self._priority)
            cuda_stream = property(lambda self: 0)

            def __repr__(self) -> str:
                return "<torch.cuda.Stream device=cuda:0 cuda_stream=0x0 [simulated]>"

            @staticmethod
            def priority_range() -> tuple[int, int]:
                return (0, -5)  # (least, greatest) on current NVIDIA GPUs

            def query(self) -> bool:
                return True

            def synchronize(self) -> None:
                return None

            def wait_stream(self, stream) -> None:
                return None

            def wait_event(self, event) -> None:
                return None

            def record_event(self, event=None):
                event = event if event is not None else Event()
                event.record(self)
                return event

        class Event:
            """A CUDA event in a simulation: records and waits; times nothing."""

            def __init__(self, enable_timing: bool = False, blocking: bool = False,
                         interprocess: bool = False, external: bool = False) -> None:
                self.enable_timing = enable_timing
                self.recorded = False

            def __repr__(self) -> str:
                return "<torch.cuda.Event [simulated]>"

            def record(self, stream=None) -> None:
                self.recorded = True

            def wait(self, stream=None) -> None:
                return None

            def query(self) -> bool:
                return True

            def synchronize(self) -> None:
                return None

            def elapsed_time(self, end_event) -> float:
                if not (self.enable_timing and end_event.enable_timing):
                    raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
                if not (self.recorded and end_event.recorded):
                    raise RuntimeError("Both events must be recorded before calculating elapsed time.")
                sim.state.note_read("torch.cuda.Event.elapsed_time (a simulation times nothing)")
                return SimulatedFloat(1.0)

        self.Stream, self.Event = Stream, Event
        self.default = Stream()
        self.current = self.default

    def side_stream_used(self) -> None:
        if _STREAMS_NOTE not in self.notes:
            self.notes.append(_STREAMS_NOTE)

    def current_stream(self, device=None):
        return self.current

    def default_stream(self, device=None):
        return self.default

    def set_stream(self, stream) -> None:
        if stream is not None:
            if stream is not self.default:
                self.side_stream_used()
            self.current = stream

    @contextlib.contextmanager
    def stream(self, stream):
        """``with torch.cuda.stream(s):`` (None: no change)."""
        if stream is None:
            yield
            return
        prev = self.current
        self.set_stream(stream)
        try:
            yield
        finally:
            self.current = prev


def install_cuda_api(patches: Patches, tracker, target: GPUSpec | None,
                     autocast: dict[str, Any], notes: list[str] | None = None) -> None:
    """Patch ``torch.cuda`` (and its ``memory``/``amp`` submodules) for the run; ``notes``
    receives what the report should say about events and streams."""
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
        if a is not None:
            a.reset_peak_stats()

    def reset_accumulated_memory_stats(device=None) -> None:
        _check_device(device)
        if tracker.allocator is not None:
            tracker.allocator.reset_accumulated_stats()

    def empty_cache() -> None:
        if tracker.allocator is not None:
            tracker.allocator.empty_cache()

    def memory_stats(device=None) -> dict[str, int]:
        """The allocator model's statistics under torch's names; without the model (CPU
        kernels), the tracker's allocated and peak bytes alone."""
        _check_device(device)
        a = tracker.allocator
        if a is not None:
            out = a.memory_stats()
            # the counter max_memory_allocated() reads (a cell may reset it)
            out["allocated_bytes.all.peak"] = max_memory_allocated()
            out["reserved_bytes.all.peak"] = max_memory_reserved()
            return out
        return {
            "allocated_bytes.all.current": memory_allocated(), "allocated_bytes.all.peak": max_memory_allocated(),
            "reserved_bytes.all.current": memory_reserved(), "reserved_bytes.all.peak": max_memory_reserved(),
            "active_bytes.all.current": memory_allocated(), "active_bytes.all.peak": max_memory_allocated(),
        }

    def memory_summary(device=None, abbreviated: bool = False) -> str:
        """torch's own table of :func:`memory_stats` (it reads the patched one), marked
        as the simulation's."""
        _check_device(device)
        head = (f"simulated {name} (memmagic's model of the CUDA caching allocator; "
                "the CUDA context and other processes are not counted)")
        if tracker.allocator is None:
            return (f"{head}: allocated {format_bytes(memory_allocated())} "
                    f"(peak {format_bytes(max_memory_allocated())}), reserved "
                    f"{format_bytes(memory_reserved())} (peak {format_bytes(max_memory_reserved())})")
        return head + "\n" + _TORCH_MEMORY_SUMMARY(device=0, abbreviated=abbreviated)

    def _record_memory_history(enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
        """torch's signature: ``enabled`` None (off), "state" or "all"; ``max_entries``
        (or the old ``trace_alloc_max_entries``) bounds the history."""
        _check_device(kwargs.get("device"))
        on = enabled not in (None, False)
        max_entries = kwargs.get("max_entries", kwargs.get("trace_alloc_max_entries"))
        if max_entries in (None, sys.maxsize):
            max_entries = None
        if kwargs.get("clear_history"):
            tracker.record_history(False)
        tracker.record_history(on, max_entries)

    def _snapshot(device=None, *args: Any, **kwargs: Any) -> dict:
        _check_device(device)
        return tracker.memory_snapshot()

    def _dump_snapshot(filename: str = "dump_snapshot.pickle", *args: Any, **kwargs: Any) -> None:
        data = tracker.memory_snapshot()
        with open(filename, "wb") as f:
            pickle.dump(data, f, protocol=PICKLE_PROTOCOL)  # what the memory_viz page reads

    def memory_snapshot(*args: Any, **kwargs: Any) -> list[dict]:
        return tracker.memory_snapshot()["segments"]

    def set_per_process_memory_fraction(fraction: float, device=None) -> None:
        """As torch: the allocator refuses to reserve more than ``fraction`` of the card
        (an out-of-memory error then, as on a smaller card); it lasts for the simulated
        GPU, as for a process."""
        _check_device(device)
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        a = tracker.allocator
        if a is not None:
            a.capacity = int(fraction * props.total_memory)
        tracker.memory_fraction = None if fraction == 1.0 else fraction
        tracker.card_memory = props.total_memory

    def get_per_process_memory_fraction(device=None) -> float:
        _check_device(device)
        return 1.0 if tracker.memory_fraction is None else tracker.memory_fraction

    def mem_get_info(device=None) -> tuple[int, int]:
        """(free, total) bytes of the card: total less what the allocator model reserved
        (the CUDA context, which also takes room on a real card, is not counted)."""
        _check_device(device)
        total = props.total_memory
        return (max(total - memory_reserved(), 0), total)

    streams = _SimStreamEvents(tracker.s, notes if notes is not None else [])

    class device:  # noqa: N801 (torch's name): ``with torch.cuda.device(0):``
        def __init__(self, device) -> None:
            _check_device(device if device is not None and device != -1 else None)
            self.idx = 0

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: Any) -> bool:
            return False

    def device_of(obj) -> device:
        return device(None)

    values: dict[str, Any] = {
        "is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
        "is_initialized": lambda: True, "init": lambda: None, "set_device": _check_device,
        "get_device_name": lambda device=None: (_check_device(device), name)[1],
        "get_device_properties": lambda device=None: (_check_device(device), props)[1],
        "get_device_capability": lambda device=None: (props.major, props.minor),
        # torch: True from sm_80, and before that (T4, V100) when a bfloat16 tensor can be
        # made on the card, which CUDA builds can: emulated
        "is_bf16_supported": lambda including_emulation=True: props.major >= 8 or bool(including_emulation),
        "synchronize": lambda device=None: None, "ipc_collect": lambda: None,
        "memory_allocated": memory_allocated, "max_memory_allocated": max_memory_allocated,
        "memory_reserved": memory_reserved, "max_memory_reserved": max_memory_reserved,
        "memory_cached": memory_reserved, "max_memory_cached": max_memory_reserved,
        "reset_peak_memory_stats": reset_peak_memory_stats,
        "reset_max_memory_allocated": reset_peak_memory_stats,
        "reset_max_memory_cached": reset_peak_memory_stats,
        "reset_accumulated_memory_stats": reset_accumulated_memory_stats,
        "empty_cache": empty_cache, "memory_stats": memory_stats, "memory_summary": memory_summary,
        "mem_get_info": mem_get_info,
        "set_per_process_memory_fraction": set_per_process_memory_fraction,
        "get_per_process_memory_fraction": get_per_process_memory_fraction,
        "_record_memory_history": _record_memory_history, "_snapshot": _snapshot,
        "_dump_snapshot": _dump_snapshot, "memory_snapshot": memory_snapshot,
        "manual_seed": lambda seed: None, "manual_seed_all": lambda seed: None,
        "seed": lambda: None, "seed_all": lambda: None,
        # checkpoint saves and restores the CUDA RNG state: a simulation has no values
        "get_rng_state": lambda device="cuda": torch.zeros(16, dtype=torch.uint8, device="meta"),
        "set_rng_state": lambda new_state, device="cuda": None,
        "get_rng_state_all": lambda: [torch.zeros(16, dtype=torch.uint8, device="meta")],
        "set_rng_state_all": lambda new_states: None,
        "is_current_stream_capturing": lambda: False,
        "device": device, "device_of": device_of,
        "Event": streams.Event, "Stream": streams.Stream,
        "stream": streams.stream, "set_stream": streams.set_stream,
        "current_stream": streams.current_stream, "default_stream": streams.default_stream,
        "ExternalStream": _unsupported_class("torch.cuda.ExternalStream"),
        "CUDAGraph": _unsupported_class("torch.cuda.CUDAGraph"), "graph": _unsupported_class("torch.cuda.graph"),
        "MemPool": _unsupported_class("torch.cuda.MemPool"),
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
    _install_accelerator_api(patches, values, _check_device)
    # the device-generic classes (torch.Stream(0), torch.Event()): the simulated GPU's
    patches.set(torch, "Stream", streams.Stream)
    patches.set(torch, "Event", streams.Event)


def _install_accelerator_api(patches: Patches, cuda: dict[str, Any], check_device) -> None:
    """``torch.accelerator`` (and its ``memory`` module) answer as on a machine whose
    accelerator is the simulated GPU: PyTorch's own tutorials pick the device with
    ``torch.accelerator.current_accelerator().type if torch.accelerator.is_available()
    else "cpu"``, which must take the GPU path here."""
    acc = getattr(torch, "accelerator", None)
    if acc is None:
        return
    mem = getattr(acc, "memory", None)

    values: dict[str, Any] = {
        "is_available": lambda: True, "device_count": lambda: 1,
        "current_accelerator": lambda check_available=False: torch.device("cuda"),
        "current_device_index": lambda: 0, "current_device_idx": lambda: 0,
        "set_device_index": check_device, "set_device_idx": check_device,
        "device_index": cuda["device"],  # ``with torch.accelerator.device_index(0):``
        "synchronize": lambda device=None, /: check_device(device),
        "current_stream": lambda device=None, /: cuda["current_stream"](device),
        "set_stream": cuda["set_stream"],
        "empty_cache": cuda["empty_cache"], "empty_host_cache": lambda: None,
        "get_memory_info": lambda device_index=None, /: cuda["mem_get_info"](device_index),
        "Graph": _unsupported_class("torch.accelerator.Graph"),
        "_snapshot": cuda["_snapshot"],
    }
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved", "memory_stats", "reset_peak_memory_stats",
                 "reset_accumulated_memory_stats"):
        values[name] = cuda[name]
    for attr, value in values.items():
        for mod in (acc, mem):
            if mod is not None and hasattr(mod, attr):
                patches.set(mod, attr, value)


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
