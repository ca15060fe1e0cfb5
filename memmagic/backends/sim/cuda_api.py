"""The ``torch.cuda`` a simulated cell sees: queries answer from the simulation.

``is_available()`` is True, there is one device, ``memory_allocated()`` and friends read
the simulated tracker and allocator model, ``reset_peak_memory_stats()`` resets the
simulation's own counters (never a real device's), ``empty_cache()`` releases the model's
free segments, ``synchronize()`` does nothing. ``mem_get_info()`` and
``get_device_properties()`` answer for the target card, or for :data:`DEFAULT_CARD` when
none is named (:func:`install_default_card_note` says so in the report). :class:`SimulatedCuda` is
that ``torch.cuda``: one instance per run, its methods the simulated functions.

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
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ...core import _torch_private as _priv
from ...core.interrupts import atomic
from ...report import format_bytes
from ...core.snapshot import PICKLE_PROTOCOL
from .constants import seed_gpu_draws
from .values import SimulatedFloat, SimulatedInt
from .errors import RERUN_HINT, SimulationUnsupported
from .state import local_gpu
from .gpus import DEFAULT_CAPABILITY, GPUS, CardSpec
from ...core.patching import Patches

__all__ = ["SimDeviceProperties", "SimulatedCuda", "check_device", "install_default_card_note",
           "DEFAULT_CARD", "SIMULATED_CUDA_VERSION", "SIMULATED_CUDNN_VERSION"]

# The card the size queries (``mem_get_info``, ``get_device_properties``) answer for when
# none is named: the sm_80 card whose kernels the simulation picks by default.
DEFAULT_CARD: CardSpec = GPUS.get("a100-40gb") or CardSpec("A100-40GB", 40_536 << 20, (8, 0), 108)
_CARD_QUERIES = ("mem_get_info", "get_device_properties", "get_device_name")
# ``torch.version.cuda`` that code outside torch reads in a simulated run: the CUDA runtime
# of the build the simulation's recorded figures were measured with (docs/fidelity.md:
# torch 2.11.0+cu130 on the H200)
SIMULATED_CUDA_VERSION = "13.0"
# ``torch.backends.cudnn.version()`` code outside torch reads in a simulated run: that build's
# cuDNN, as the recorded GPU figures (results/gpu-check-*.json) report it
SIMULATED_CUDNN_VERSION = 91900


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
_CLOCK_NOTE = ("torch.cuda.synchronize() waited for nothing: a simulation runs no kernels, so "
               "the times the script takes with the host's clock (time.time, "
               "time.perf_counter) and what it reckons from them (tokens a second) are the "
               "simulation's own, not a GPU's")


def _asked_by_torch(frame: Any) -> bool:
    """Whether the code of ``frame`` is torch's or memmagic's (which read the CPU build's
    own answers in a simulated run), not a library's or the user's."""
    caller = frame.f_globals.get("__name__", "") or ""
    return caller.partition(".")[0] in ("torch", "memmagic")


def _to_outside_code(own: Callable[[], Any], answer: Any) -> Callable[[], Any]:
    """``own`` (a ``torch.backends.cudnn`` query) answering ``answer`` to code outside torch
    and memmagic, as on a CUDA build with cuDNN (pytorch/tutorials' memory_format asks
    ``cudnn.version() >= 7603``; the CPU build's None stopped it), and its own answer to
    torch (whose CPU kernels must not take the cuDNN path)."""
    def query() -> Any:
        return own() if _asked_by_torch(sys._getframe(1)) else answer

    return query


class _CudaBuildVersion(types.ModuleType):
    """``torch.version`` for a simulated run: a CUDA build's to code outside torch, the
    build's own to torch and memmagic.

    Libraries ask ``torch.version.cuda`` before a GPU feature (transformers'
    ``TrainingArguments(tf32=True)`` refuses a simulated A100 where it is None), so it must
    say CUDA; but torch's own modules read it as they are first imported (``flop_counter``
    then takes the Triton path for the rest of the process), so torch keeps reading the
    CPU build's None. Once the run ends (``done``) everyone reads the build's own again:
    a module that kept this object answers as torch does."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__(real.__name__, real.__doc__)
        self.__dict__.update(_real=real, _on=True)

    def __getattribute__(self, name: str) -> Any:
        d = types.ModuleType.__getattribute__(self, "__dict__")
        if name == "cuda" and d["_on"]:
            if not _asked_by_torch(sys._getframe(1)):
                return SIMULATED_CUDA_VERSION
        if name in ("__dict__", "done"):
            return types.ModuleType.__getattribute__(self, name)
        return getattr(d["_real"], name)

    def done(self) -> None:
        self.__dict__["_on"] = False


class _Reads:
    """Where the simulated events of the run in progress count a data read. Set through the
    run's undo log: the classes below hold no run (a module imported during a simulation
    keeps them in its annotations, ``torch.cuda.Stream | None``, for the process's life)."""

    note: Callable[[str], None] | None = None


_READS = _Reads()


class SimEvent:
    """A CUDA event in a simulation: records and waits; times nothing (its
    ``elapsed_time`` is a marked placeholder, counted as a data read)."""

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
        if _READS.note is not None:
            _READS.note("torch.cuda.Event.elapsed_time (a simulation times nothing)")
        return SimulatedFloat(1.0)


def _nvml_reading(name: str) -> Callable[..., int]:
    """``torch.cuda.<name>()`` (NVML's reading of the device: its utilization, temperature,
    power, clock): a marked 0, a read of a value the simulation does not have."""

    def reading(device=None) -> int:
        check_device(device)
        if _READS.note is not None:
            _READS.note(f"torch.cuda.{name} (a simulation measures no device)")
        return SimulatedInt(0)

    reading.__name__ = name
    return reading


class SimStream(torch.Stream):
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
        event = event if event is not None else SimEvent()
        event.record(self)
        return event


class _SimStreamEvents:
    """Events and streams of one simulated run (see the module docstring)."""

    def __init__(self, state, notes: list[str]) -> None:
        self.state, self.notes = state, notes
        self.Event, self.Stream = SimEvent, SimStream
        self.default = self.Stream()
        self.current = self.default

    def side_stream_used(self) -> None:
        self.say(_STREAMS_NOTE)

    def say(self, note: str) -> None:
        if note not in self.notes:
            self.notes.append(note)

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


def device_index(device) -> int | None:
    """The CUDA index ``device`` names (``1``, ``"cuda:1"``, ``torch.device("cuda", 1)``);
    None for none named."""
    if device is None or isinstance(device, int):
        return device
    return torch.device(device).index


def check_device(device=None) -> None:
    """Refuse a device other than the one simulated GPU (``torch.cuda.set_device``): cuda:0,
    or a job's rank's own GPU (``local_gpu``)."""
    idx = device_index(device)
    if idx not in (None, 0, local_gpu()):
        raise SimulationUnsupported(f"the simulation has one GPU (cuda:0), not cuda:{idx}; {RERUN_HINT}")


class _DeviceContext:
    """``with torch.cuda.device(0):`` (and ``torch.accelerator.device_index``): the one GPU."""

    def __init__(self, device) -> None:
        check_device(device if device is not None and device != -1 else None)
        self.idx = 0

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return False


_DeviceContext.__name__ = _DeviceContext.__qualname__ = "device"  # torch's name

# What SimulatedCuda installs on torch.cuda (and torch.cuda.memory, where torch has the
# name): torch's name -> the SimulatedCuda attribute that answers it, where they differ
_RENAMED = {
    "set_device": "check_device", "memory_cached": "memory_reserved",
    "max_memory_cached": "max_memory_reserved",
    "reset_max_memory_allocated": "reset_peak_memory_stats",
    "reset_max_memory_cached": "reset_peak_memory_stats",
    "_record_memory_history": "record_memory_history", "_snapshot": "snapshot",
    "_dump_snapshot": "dump_snapshot", "_clear_cublas_workspaces": "clear_cublas_workspaces",
}
# installed even where this torch build has no such name (a CPU build lacks CUDA's)
_INSTALLED_ALWAYS = frozenset({"_clear_cublas_workspaces"})
_CUDA_NAMES = (
    "is_available", "device_count", "current_device", "is_initialized", "init", "set_device",
    "get_device_name", "get_device_properties", "get_device_capability", "is_bf16_supported",
    "synchronize", "ipc_collect", "memory_allocated", "max_memory_allocated", "memory_reserved",
    "max_memory_reserved", "memory_cached", "max_memory_cached", "reset_peak_memory_stats",
    "reset_max_memory_allocated", "reset_max_memory_cached", "reset_accumulated_memory_stats",
    "empty_cache", "memory_stats", "memory_summary", "mem_get_info",
    "set_per_process_memory_fraction", "get_per_process_memory_fraction",
    "_record_memory_history", "_snapshot", "_dump_snapshot", "memory_snapshot", "manual_seed",
    "manual_seed_all", "seed", "seed_all", "get_rng_state", "set_rng_state",
    "get_rng_state_all", "set_rng_state_all", "is_current_stream_capturing", "device",
    "device_of", "_clear_cublas_workspaces", "device_memory_used", "list_gpu_processes",
    "utilization", "memory_usage", "temperature", "power_draw", "clock_rate",
)
# NVML's readings of the device (torch.cuda.utilization() ...): a marked placeholder each,
# counted as a read of values the simulation does not have
_NVML_READINGS = ("utilization", "memory_usage", "temperature", "power_draw", "clock_rate")
_STREAM_NAMES = ("Event", "Stream", "stream", "set_stream", "current_stream", "default_stream")
_UNSUPPORTED_CLASSES = ("ExternalStream", "CUDAGraph", "graph", "MemPool")
_UNSUPPORTED_FUNCTIONS = ("make_graphed_callables", "graph_pool_handle", "use_mem_pool")
_ACCELERATOR_SAME = ("memory_allocated", "max_memory_allocated", "memory_reserved",
                     "max_memory_reserved", "memory_stats", "reset_peak_memory_stats",
                     "reset_accumulated_memory_stats", "empty_cache")


@atomic
class SimulatedCuda:
    """The ``torch.cuda`` of one simulated run: its methods are the simulated functions
    (see the module docstring), answering from ``tracker`` (a
    :class:`~.tracker.SimTracker`) and its allocator model, for ``target`` (or
    :data:`DEFAULT_CARD`). :meth:`install` puts them on ``torch.cuda``, its ``memory``
    and ``amp`` modules and ``torch.accelerator`` through an undo log; ``notes`` receives
    what the report should say about events and streams."""

    device = _DeviceContext
    check_device = staticmethod(check_device)

    def __init__(self, tracker, target: CardSpec | None, notes: list[str] | None = None) -> None:
        self.tracker = tracker
        card = target or DEFAULT_CARD  # kernels follow DEFAULT_CAPABILITY without a target
        self.name = card.name
        capability = target.capability if target else DEFAULT_CAPABILITY
        self.props = SimDeviceProperties(
            name=card.name, total_memory=card.total_memory, major=capability[0],
            minor=capability[1], multi_processor_count=card.multi_processor_count)
        self.streams = _SimStreamEvents(tracker.s, notes if notes is not None else [])
        self._nvtx_depth = 0  # the run's open NVTX ranges
        self._peak_read = False  # the run asked max_memory_allocated()

    # -- installing ------------------------------------------------------------------------
    def api(self) -> dict[str, Any]:
        """torch.cuda's name -> what answers it in the simulation."""
        out = {name: (_nvml_reading(name) if name in _NVML_READINGS
                      else getattr(self, _RENAMED.get(name, name))) for name in _CUDA_NAMES}
        out.update((name, getattr(self.streams, name)) for name in _STREAM_NAMES)
        out.update((name, _unsupported_class(f"torch.cuda.{name}")) for name in _UNSUPPORTED_CLASSES)
        out.update((name, _unsupported(f"torch.cuda.{name}")) for name in _UNSUPPORTED_FUNCTIONS)
        return out

    def install(self, patches: Patches, autocast: dict[str, Any]) -> None:
        """Patch ``torch.cuda`` (and its ``memory``/``amp`` submodules), ``torch.accelerator``
        and the device-generic ``torch.Stream``/``torch.Event`` for the run."""
        import torch.cuda.amp
        import torch.cuda.memory as cmem

        for attr, value in self.api().items():
            if hasattr(torch.cuda, attr) or attr in _INSTALLED_ALWAYS:
                patches.set(torch.cuda, attr, value)
            if hasattr(cmem, attr):
                patches.set(cmem, attr, value)
        patches.set(torch.cuda.amp, "autocast", autocast["cuda_amp_autocast"])
        import torch.cuda.nvtx as nvtx

        # NVTX's markers (DeepSpeed marks every step; a CPU build raises "NVTX functions not
        # installed") mark a profiler's timeline and hold no memory
        for attr, value in {"range_push": self.range_push, "range_pop": self.range_pop,
                            "range_start": lambda msg: 0, "range_end": lambda range_id: None,
                            "mark": lambda msg: None}.items():
            patches.set(nvtx, attr, value)
        patches.set(_READS, "note", self.streams.state.note_read)
        patches.call_on_restore(self._blocks_note)
        version = _CudaBuildVersion(torch.version)
        patches.set(torch, "version", version)
        patches.call_on_restore(version.done)
        cudnn = torch.backends.cudnn
        for attr, answer in (("version", SIMULATED_CUDNN_VERSION), ("is_available", True)):
            patches.set(cudnn, attr, _to_outside_code(getattr(cudnn, attr), answer))
        self.install_accelerator(patches)
        # the device-generic classes (torch.Stream(0), torch.Event()): the simulated GPU's
        patches.set(torch, "Stream", self.streams.Stream)
        patches.set(torch, "Event", self.streams.Event)

    def install_accelerator(self, patches: Patches) -> None:
        """``torch.accelerator`` (and its ``memory`` module) answer as on a machine whose
        accelerator is the simulated GPU: PyTorch's own tutorials pick the device with
        ``torch.accelerator.current_accelerator().type if torch.accelerator.is_available()
        else "cpu"``, which must take the GPU path here."""
        acc = getattr(torch, "accelerator", None)
        if acc is None:
            return
        mem = getattr(acc, "memory", None)
        values: dict[str, Any] = {
            "is_available": lambda: True, "device_count": self.device_count,
            "current_accelerator": lambda check_available=False: torch.device("cuda"),
            "current_device_index": lambda: 0, "current_device_idx": lambda: 0,
            "set_device_index": check_device, "set_device_idx": check_device,
            "device_index": self.device,  # ``with torch.accelerator.device_index(0):``
            "synchronize": lambda device=None, /: (check_device(device),
                                                   self.synchronize(device))[-1],
            "current_stream": lambda device=None, /: self.streams.current_stream(device),
            "set_stream": self.streams.set_stream, "empty_host_cache": lambda: None,
            "get_memory_info": lambda device_index=None, /: self.mem_get_info(device_index),
            "Graph": _unsupported_class("torch.accelerator.Graph"),
            "_snapshot": self.snapshot,
        }
        values.update((name, getattr(self, name)) for name in _ACCELERATOR_SAME)
        for attr, value in values.items():
            for mod in (acc, mem):
                if mod is not None and hasattr(mod, attr):
                    patches.set(mod, attr, value)
        owner, attr = _priv.accelerator_slot()  # what torch's own code asks (FSDP2's mesh)
        patches.set(owner, attr, lambda check=False: torch.device("cuda"))

    def _blocks_note(self) -> None:
        """Where the run asked ``max_memory_allocated()`` (a script printing its peak), what
        torch's count of the run's peak is beside the report's: they differ by the blocks'
        rounding."""
        a, tracker = self.tracker.allocator, self.tracker
        if not self._peak_read or a is None:
            return
        blocks, storages = a.allocated_peak, tracker.peak["device"]
        if blocks > storages:
            self.streams.say(
                f"torch.cuda.max_memory_allocated() counts the allocator's blocks: "
                f"{format_bytes(blocks)} at the run's peak, {format_bytes(blocks - storages)} "
                f"above the peak shown here, which counts the tensors' storages (what the "
                f"breakdown adds up to); a block in the large pool can be up to 1 MiB larger "
                f"than its request, where what is left is too small to split off")

    # -- NVTX ranges: the depth of the range started or ended, from 0, as torch answers ----
    def range_push(self, msg: str) -> int:
        self._nvtx_depth += 1
        return self._nvtx_depth - 1

    def range_pop(self) -> int:
        self._nvtx_depth = max(self._nvtx_depth - 1, 0)
        return self._nvtx_depth

    # -- the device --------------------------------------------------------------------------
    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        """1; as rank 0 of a job (``--world-size``), the GPUs of its node (up to 8)."""
        return self.tracker.s.node_gpus

    def current_device(self) -> int:
        return local_gpu()  # 0, or a job's rank's own GPU on its node

    def is_initialized(self) -> bool:
        return True

    def init(self) -> None:
        return None

    def get_device_name(self, device=None) -> str:
        self._check_on_node(device)
        return self.name

    def get_device_properties(self, device=None) -> SimDeviceProperties:
        self._check_on_node(device)
        return self.props

    def _check_on_node(self, device) -> None:
        """A GPU of the node may be asked about (as rank 0 of a job, the other ranks' GPUs
        are the same card); only cuda:0 runs anything."""
        idx = device_index(device)
        if idx is None or not 0 <= idx < self.device_count():
            check_device(device)

    def get_device_capability(self, device=None) -> tuple[int, int]:
        return (self.props.major, self.props.minor)

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        # torch: True from sm_80, and before that (T4, V100) when a bfloat16 tensor can be
        # made on the card, which CUDA builds can: emulated
        return self.props.major >= 8 or bool(including_emulation)

    def synchronize(self, device=None) -> None:
        """Waits for nothing; the report says that host-clock timings are the simulation's."""
        self.streams.say(_CLOCK_NOTE)

    def ipc_collect(self) -> None:
        return None

    def device_of(self, obj) -> _DeviceContext:
        return _DeviceContext(None)

    def is_current_stream_capturing(self) -> bool:
        return False

    # -- seeds: the simulation's own draws on the GPU (random indices); no state to save --
    def manual_seed(self, seed) -> None:
        seed_gpu_draws(seed)

    def manual_seed_all(self, seed) -> None:
        seed_gpu_draws(seed)

    def seed(self) -> None:
        seed_gpu_draws(None)

    def seed_all(self) -> None:
        seed_gpu_draws(None)

    # checkpoint saves and restores the CUDA RNG state
    def get_rng_state(self, device="cuda") -> torch.Tensor:
        return torch.zeros(16, dtype=torch.uint8, device="meta")

    def set_rng_state(self, new_state, device="cuda") -> None:
        return None

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [torch.zeros(16, dtype=torch.uint8, device="meta")]

    def set_rng_state_all(self, new_states) -> None:
        return None

    # -- memory ------------------------------------------------------------------------------
    def memory_allocated(self, device=None) -> int:
        """The allocator model's allocated blocks, as torch counts them (with the allocator
        model; the tracked storages, rounded to 512 bytes, without it)."""
        check_device(device)
        a = self.tracker.allocator
        return a.allocated if a is not None else self.tracker.current["device"]

    def max_memory_allocated(self, device=None) -> int:
        check_device(device)
        self._peak_read = True
        tracker = self.tracker
        return tracker.cuda_allocated_peak if tracker.allocator is not None else tracker.cuda_peak

    def memory_reserved(self, device=None) -> int:
        check_device(device)
        a = self.tracker.allocator
        return a.reserved if a is not None else self.tracker.current["device"]

    def max_memory_reserved(self, device=None) -> int:
        check_device(device)
        tracker = self.tracker
        return tracker.cuda_reserved_peak if tracker.allocator is not None else tracker.cuda_peak

    def reset_peak_memory_stats(self, device=None) -> None:
        check_device(device)
        tracker = self.tracker
        tracker.cuda_peak = tracker.current["device"]
        a = tracker.allocator
        tracker.cuda_reserved_peak = a.reserved if a is not None else 0
        tracker.cuda_allocated_peak = a.allocated if a is not None else 0
        if a is not None:
            a.reset_peak_stats()

    def reset_accumulated_memory_stats(self, device=None) -> None:
        check_device(device)
        if self.tracker.allocator is not None:
            self.tracker.allocator.reset_accumulated_stats()

    def clear_cublas_workspaces(self) -> None:
        """``torch.cuda._clear_cublas_workspaces()`` (what PyTorch's memory tests call
        before reading ``memory_allocated()``): frees the cuBLAS and cuBLASLt workspaces
        of every thread; their blocks stay cached (reserved), and the next matmul takes
        them again, as on a GPU."""
        self.tracker.release_workspaces()

    def empty_cache(self) -> None:
        if self.tracker.allocator is not None:
            self.tracker.allocator.empty_cache()

    def memory_stats(self, device=None) -> dict[str, int]:
        """The allocator model's statistics under torch's names; without the model (CPU
        kernels), the tracker's allocated and peak bytes alone."""
        check_device(device)
        a = self.tracker.allocator
        if a is not None:
            out = a.memory_stats()
            # the counter max_memory_allocated() reads (a cell may reset it)
            out["allocated_bytes.all.peak"] = self.max_memory_allocated()
            out["reserved_bytes.all.peak"] = self.max_memory_reserved()
            return out
        allocated, peak = self.memory_allocated(), self.max_memory_allocated()
        return {
            "allocated_bytes.all.current": allocated, "allocated_bytes.all.peak": peak,
            "reserved_bytes.all.current": self.memory_reserved(),
            "reserved_bytes.all.peak": self.max_memory_reserved(),
            "active_bytes.all.current": allocated, "active_bytes.all.peak": peak,
        }

    def memory_summary(self, device=None, abbreviated: bool = False) -> str:
        """torch's own table of :meth:`memory_stats` (it reads the patched one), marked
        as the simulation's."""
        check_device(device)
        head = (f"simulated {self.name} (memmagic's model of the CUDA caching allocator; "
                "the CUDA context and other processes are not counted)")
        if self.tracker.allocator is None:
            return (f"{head}: allocated {format_bytes(self.memory_allocated())} "
                    f"(peak {format_bytes(self.max_memory_allocated())}), reserved "
                    f"{format_bytes(self.memory_reserved())} "
                    f"(peak {format_bytes(self.max_memory_reserved())})")
        return head + "\n" + _TORCH_MEMORY_SUMMARY(device=0, abbreviated=abbreviated)

    def device_memory_used(self, device=None) -> int:
        """What NVML (nvidia-smi) says the card uses: the CUDA context and what the
        allocator model reserved (this process alone on the card)."""
        check_device(device)
        return self.tracker.context_bytes + self.memory_reserved()

    def list_gpu_processes(self, device=None) -> str:
        """torch's listing of the card's processes: this one, with
        :meth:`device_memory_used`."""
        import os

        check_device(device)
        mib = self.device_memory_used() / (1024 * 1024)
        return "\n".join([f"GPU:{self.current_device()}",
                          f"process {os.getpid():>10d} uses {mib:>12.3f} MB GPU memory"])

    def mem_get_info(self, device=None) -> tuple[int, int]:
        """(free, total) bytes of the card: total less the CUDA context (a published
        figure, see gpus.cuda_context) and what the allocator model reserved."""
        check_device(device)
        total = self.props.total_memory
        return (max(total - self.tracker.context_bytes - self.memory_reserved(), 0), total)

    def set_per_process_memory_fraction(self, fraction: float, device=None) -> None:
        """As torch: the allocator refuses to reserve more than ``fraction`` of the card
        (an out-of-memory error then, as on a smaller card); it lasts for the simulated
        GPU, as for a process."""
        check_device(device)
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        tracker = self.tracker
        if tracker.allocator is not None:
            tracker.allocator.capacity = tracker.allowed(self.props.total_memory, fraction)
        tracker.memory_fraction = None if fraction == 1.0 else fraction
        tracker.card_memory = self.props.total_memory

    def get_per_process_memory_fraction(self, device=None) -> float:
        check_device(device)
        fraction = self.tracker.memory_fraction
        return 1.0 if fraction is None else fraction

    # -- the allocator's history (memory_viz snapshots) ------------------------------------
    def record_memory_history(self, enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
        """``torch.cuda.memory._record_memory_history``: ``enabled`` None (off), "state" or
        "all"; ``max_entries`` (or the old ``trace_alloc_max_entries``) bounds the history."""
        check_device(kwargs.get("device"))
        on = enabled not in (None, False)
        max_entries = kwargs.get("max_entries", kwargs.get("trace_alloc_max_entries"))
        if max_entries in (None, sys.maxsize):
            max_entries = None
        if kwargs.get("clear_history"):
            self.tracker.record_history(False)
        self.tracker.record_history(on, max_entries)

    def snapshot(self, device=None, *args: Any, **kwargs: Any) -> dict:
        """``torch.cuda.memory._snapshot``."""
        check_device(device)
        return self.tracker.memory_snapshot()

    def dump_snapshot(self, filename: str = "dump_snapshot.pickle", *args: Any, **kwargs: Any) -> None:
        """``torch.cuda.memory._dump_snapshot``: what the memory_viz page reads."""
        data = self.tracker.memory_snapshot()
        with open(filename, "wb") as f:
            pickle.dump(data, f, protocol=PICKLE_PROTOCOL)

    def memory_snapshot(self, *args: Any, **kwargs: Any) -> list[dict]:
        return self.tracker.memory_snapshot()["segments"]


def install_default_card_note(patches: Patches, notes: list[str]) -> None:
    """With no target card named, make the size queries (``mem_get_info``,
    ``get_device_properties``, ``get_device_name``) add one note to ``notes`` saying that
    :data:`DEFAULT_CARD` answered. Call after :meth:`SimulatedCuda.install`."""
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
