"""The tracker of a simulated run: which storages are on the simulated GPU, fed to the
allocator model.

:class:`SimTracker` is the StorageTracker's dispatch mode, extended: it rewrites
``device=`` again at the dispatch level (function modes are off inside ``backward()`` and
checkpoint recompute), decides for each new storage whether it lives on the simulated GPU
("device") or on the host, rounds device storages like the CUDA allocator, feeds them to
the allocator model (which may raise a simulated out-of-memory), answers ``.item()`` with
a placeholder when the value is unknown (:mod:`.values`), keeps small known values
(:mod:`.constants`), and enforces the op/time budget.

The same dispatch step raises :class:`SimulatedDeviceMismatchError` where CUDA would raise
"Expected all tensors to be on the same device" (:mod:`.mismatch`). Only devices the
simulation knows count: a factory called from C++ (a composite op, a backward formula)
takes the device of some tensor's options, which the simulation cannot see, so such
storages and what is computed from them are "unsure" and never reported.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from ...core import _torch_private as _priv
from ...core.interrupts import atomic
from ...report import Category, format_bytes
from ...core.snapshot import allocator_history, allocator_segments
from ...core.tracking import Entry, StorageTracker, held_by
from .allocator import AllocatorFull, CachingAllocatorModel, round_request
from .constants import drop_unfounded_in_place, propagate
from .gpus import CudaContext
from .errors import (
    RERUN_HINT,
    SimulatedOutOfMemoryError,
    SimulationBudgetExceeded,
    SimulationUnsupported,
)
from .cudnn import CONV_OPS, conv_workspaces
from .kernels import FIXED_OUTPUT_OPS, fix_outputs
from .mismatch import check_same_device, device_rule
from .rewrite import kernel_call_args
from .state import CPU, META, SimState, is_cuda_device
from .values import read_scalar
from .workspaces import BLAS_OPS, REDUCTION_OPS, Workspaces

if TYPE_CHECKING:
    from ...trace import Trace

__all__ = ["SimTracker"]

_aten = torch.ops.aten
_LOCAL_SCALAR = _aten._local_scalar_dense.default
_EQUAL = _aten.equal.default  # torch.equal: a bool read of eq(a, b).all() (see _equal)
_ALLCLOSE = _aten.allclose.default  # torch.allclose: isclose(a, b).all() read (_allclose)
# an inference tensor has no autograd keys: t.item() of one reaches the dispatch level as
# aten.item itself, in inference mode or out of it (decomposed only below it): the same read
_ITEM = _aten.item.default
_INFERENCE = torch.is_inference_mode_enabled
_WHOLE: set = set()  # ops with no composite kernel to decompose (in inference mode)
_PRIM_DEVICE = torch.ops.prim.device.default
# tensor.record_stream(s) reached from C++ or a hook (DeepSpeed's ZeRO-3): the simulated GPU
# runs one stream, so there is nothing to wait for (Python calls stop at the rewrite mode)
_RECORD_STREAM = _aten.record_stream.default
# kernels of quantized weights (a library's namespace, or aten's packed-weight ops) -> the
# library named in the report's note: their outputs count at the sizes of their fake (meta)
# kernels; buffers the CUDA kernels allocate inside themselves are not known
_QUANTIZED_KERNELS: dict[object, str] = {
    "bitsandbytes": "bitsandbytes", "torchao": "torchao",
    **{op.default: "torch's packed-weight" for op in (
        _aten._weight_int4pack_mm, _aten._weight_int8pack_mm, _aten._convert_weight_to_int4pack,
        _aten._weight_int4pack_mm_with_scales_and_zeros)},
}
_FOUND_INF_OPS = {_aten._amp_foreach_non_finite_check_and_unscale_.default}
# ops that take a storage: FakeTensorMode's (class-wide) dispatch cache would key on the
# storage object itself and keep it, and its memory, alive for good
_STORAGE_SETS = {_aten.set_.source_Storage, _aten.set_.source_Storage_storage_offset}
# flex_attention and its backward: higher-order operators that reach the tracker as ops
_FUSED_ATTENTION = frozenset(_priv.attention_hops())
# torch's while_loop: how often it runs its body follows from tensor values (FakeTensorMode
# would need unbacked symbolic sizes for what it carries)
_WHILE_LOOP = _priv.while_loop_hop()
WHILE_LOOP_REFUSED = ("torch's while_loop cannot be simulated: how many times it runs its "
                      "body follows from tensor values, which a simulation does not have; "
                      f"{RERUN_HINT}")
_PHASE_WORDS = {"forward": " during forward", "backward": " during backward (loss.backward())",
                "recompute": " while backward recomputed a checkpointed forward",
                "optimizer": " during optimizer.step()"}


def _uncached(func, args: tuple, kwargs: dict):
    """``func`` run with FakeTensorMode's dispatch cache off (see _STORAGE_SETS)."""
    with _priv.fake_cache_off(args[0].fake_mode):
        return func(*args, **kwargs)


def _op_info(func) -> tuple[bool, str, bool]:
    """(mutates its inputs, name, outputs need a fix-up) of an op, computed once."""
    schema = _priv.op_schema(func)
    mutating = bool(schema is not None and schema.is_mutable) or func in _FOUND_INF_OPS
    return mutating, func.__name__, func in FIXED_OUTPUT_OPS


@atomic
class SimTracker(StorageTracker):
    """The StorageTracker of a simulated run (see the module docstring)."""

    # op -> the run's CUDA kernel registered for it on the autograd key (dropout, SDPA): what
    # inference mode, which skips that key, runs in place of the op's composite kernel
    own_kernels: dict = {}

    def __init__(self, state: SimState, *, allocator: CachingAllocatorModel | None,
                 max_ops: int, max_seconds: float, gpu_name: str | None = None) -> None:
        super().__init__(self._include_pending, self._round_pending)
        self.s = state
        state.tracker = self
        self.allocator = allocator
        self.max_ops = max_ops
        self.max_seconds = max_seconds
        self.deadline = float("inf")
        self.gpu_name = gpu_name
        # serial -> bytes of its block in the allocator model (what a copy of the card or
        # a model of another card re-allocates)
        self.alloc_bytes: dict[int, int] = {}
        self._requested = 0  # bytes of the storage being tracked, before rounding
        # torch.cuda.max_memory_* counters (resettable by the cell)
        self.cuda_peak = 0
        self.cuda_reserved_peak = 0
        # torch.cuda.max_memory_allocated(): the allocator model's blocks (a block can be up
        # to 1 MiB larger than its request: the large pool does not split off less), as
        # torch counts them; cuda_peak counts the storages (the breakdown's sum)
        self.cuda_allocated_peak = 0
        self.oom_live = 0        # device bytes live when the request failed
        self.oom_event = -1      # the last event before it
        self.oom_op = 0          # the op (1-based) whose request failed
        # torch.cuda.memory._record_memory_history on the simulated allocator: memory_viz
        # entries of earlier cells, and where the recording starts in this cell's log
        self.history: list[dict] | None = None
        self.history_from = 0
        self.history_max: int | None = None
        # torch.cuda.set_per_process_memory_fraction: the share of the card the process may
        # reserve (None: all of it)
        self.memory_fraction: float | None = None
        self.card_memory = 0  # the card's bytes (what the OOM message calls its capacity)
        self.cuda_context: CudaContext | None = None  # held beside the allocator (gpus.cuda_context)
        # serials of storages whose device the simulation guessed (factories called from
        # C++ code, and what is computed from them): never used to report a device mismatch
        self._unsure: set[int] = set()
        self._out_unsure = False
        # serial -> (recipe, index) of a reduction's scratch buffer (see _take_scratch), and
        # each reduction that may stage one, as (allocator log length then, recipe)
        self.scratch: dict[int, tuple[tuple, int]] = {}
        self.scratch_sites: list[tuple[int | None, tuple]] = []
        self._device_rules: dict[object, str] = {}
        self._op_info: dict[object, tuple[bool, str, bool]] = {}
        # FakeOutputCache of the run (set by the backend): outputs from metadata
        self.fast: Callable[[Any, tuple, dict], Any] | None = None
        # cuBLAS workspaces of the simulated GPU (set by the backend for CUDA kernels)
        self.workspaces: Workspaces | None = None

    def start_clock(self) -> None:
        self.deadline = time.perf_counter() + self.max_seconds

    # -- a simulated GPU that lasts across cells ----------------------------------------------
    persistent = False  # True: the tracker of a SimSession's card (see rearm and close)

    def rearm(self, max_ops: int, max_seconds: float) -> None:
        """Ready for the next cell: what is live stays live (it is the next ``before``);
        the per-cell counters, events and the allocator's peak start again."""
        self.max_ops, self.max_seconds = max_ops, max_seconds
        self.deadline = float("inf")
        self.ops = 0
        self.events = []  # new lists: the last report's trace keeps its own
        self.saved_events = []
        self.op_log = []
        self.frames = {}
        self._seq_starts, self._seq_paths = [], []
        self.step_label = None
        self.module_stack.clear()
        self.phase_override = None
        self._last_op = None
        self.oom_live, self.oom_event, self.oom_op = 0, -1, 0
        self.history_from = 0
        self._closed = False
        self.quiet = 0
        self.scratch_sites = []
        self._forget_freed()
        a = self.allocator
        self._restart_report_peaks()
        if a is not None:
            # the cell's allocator history (for memory_viz snapshots), stamped with op indices
            a.start_log(clock=lambda: self.ops)

    def _forget_freed(self) -> None:
        """Drop what the per-storage tables keep for storages freed before this cell (their
        pool, role, saver, owner, stack, and the serial sets): the last cell's trace has its
        own copy, and a card that lasts a notebook would keep an entry for every storage it
        ever made (about 0.8 MB per re-run of a training cell). The tables are emptied and
        refilled, so that their memory shrinks too."""
        live = {e.serial for e in self._live.values()}
        for table in (self.pool_of, self.roles, self.saver, self.owner, self.frames, self.scratch):
            kept = {s: v for s, v in table.items() if s in live}
            if len(kept) < len(table):
                table.clear()
                table.update(kept)
        for serials in (self.frozen, self._unsure, self.s.zero_read_serials,
                        self.s.pinned_serials):
            serials.intersection_update(live)

    def restart(self) -> None:
        """The cell starts now (after a what-if knob's setup): the report's allocator peaks
        too (its cache keeps what the setup freed, as a GPU's would; torch.cuda's own
        counters are the card's and stay)."""
        super().restart()
        self._restart_report_peaks()

    def _restart_report_peaks(self) -> None:
        """The report's reserved and allocated peaks start from what the allocator holds."""
        a = self.allocator
        if a is not None:
            a.restart_peaks()

    def trace(self) -> Trace:
        """The run's trace, with the allocator model's history of the cell attached as
        ``allocator_log`` (:class:`~.allocator.AllocatorLog`; None without a CUDA model).
        While the cell's code records the allocator's history, what it recorded so far
        moves to :attr:`history`, framed by this trace (a later cell's snapshot has it)."""
        trace = super().trace()
        trace.scratch = {k: v for k, v in self.scratch.items() if k in trace.pool_of}
        trace.scratch_sites = list(self.scratch_sites)
        a = self.allocator
        if a is not None and a.logging:
            trace.allocator_log = log = a.take_log(keep_logging=True)
            if self.history is not None:
                self.history = self._history_of(trace, log.entries)
                self.history_from = len(log.entries)
        return trace

    # -- torch.cuda.memory._record_memory_history / _snapshot ---------------------------------
    def record_history(self, on: bool, max_entries: int | None = None) -> None:
        """Start (or, ``on`` False, stop and drop) the allocator history that
        :meth:`memory_snapshot` returns, keeping at most ``max_entries`` entries."""
        a = self.allocator
        if not on:
            self.history, self.history_max = None, None
            return
        if a is None or not a.logging:
            raise SimulationUnsupported(
                "the allocator history needs the simulated CUDA allocator (a run with CUDA "
                f"kernels); {RERUN_HINT}")
        if self.history is None:
            self.history = []
            self.history_from = len(a.take_log(keep_logging=True).entries)
        self.history_max = max_entries

    def _history_of(self, trace: Trace, log_entries: list[dict]) -> list[dict]:
        out = self.history + allocator_history(trace, log_entries[self.history_from:])
        if self.history_max is not None and len(out) > self.history_max:
            out = out[len(out) - self.history_max:]  # a ring buffer, as torch keeps
        return out

    def memory_snapshot(self) -> dict:
        """What ``torch.cuda.memory._snapshot()`` returns, from the allocator model: its
        segments and blocks now, and the history recorded since
        ``_record_memory_history`` (empty when it is off)."""
        a = self.allocator
        if a is None:
            raise SimulationUnsupported(
                "a memory snapshot needs the simulated CUDA allocator (a run with CUDA "
                f"kernels); {RERUN_HINT}")
        trace = super().trace()
        log = a.take_log(keep_logging=True)
        entries = [] if self.history is None else self._history_of(trace, log.entries)
        return {"segments": allocator_segments(trace, log.segments), "device_traces": [entries]}

    def close(self) -> None:
        """A persistent card keeps listening for frees between cells (a tensor deleted in
        a later cell, or dropped with its name, frees its block, as on a GPU)."""
        if not self.persistent:
            super().close()

    def live_device_bytes(self) -> int:
        return self.current["device"]

    def _include_pending(self, t: torch.Tensor) -> str | None:
        dev = _priv.fake_device(t)
        if dev is not None and dev.type == "meta":
            return None  # a meta tensor holds no memory (FSDP2's and torchtitan's model init)
        return self.s.pending

    def _round_pending(self, n: int) -> int:
        self._requested = n  # what the storage asks for: the allocator's "requested" bytes
        return round_request(n) if (self.s.cuda and self.s.pending == "device") else n

    # -- allocator ------------------------------------------------------------------------
    def _add(self, entry: Entry, delta: int) -> None:
        if entry.pool == "device" and self.allocator is not None:
            self._allocate(entry, delta)  # a request the card cannot take never counts
        super()._add(entry, delta)
        if entry.pool == "device":
            cur = self.current["device"]
            if cur > self.cuda_peak:
                self.cuda_peak = cur

    def _allocate(self, entry: Entry, delta: int) -> None:
        a = self.allocator
        serial = entry.serial
        old = self.alloc_bytes.pop(serial, 0)
        new = old + delta
        if old > 0:
            a.free(serial)
        if new > 0:
            req = self._requested
            try:
                a.malloc(serial, new, req if 0 < req <= new and round_request(req) == new else None)
            except AllocatorFull as full:
                if old > 0:  # a resize that failed keeps its old block
                    a.malloc(serial, old)
                    self.alloc_bytes[serial] = old
                entry.nbytes = old  # what this storage holds: its release frees only that
                # every failed request raises, as on a GPU (code may catch it and go on);
                # the report describes the last one
                self.oom_live = self.current["device"]
                self.oom_event = len(self.events) - 1
                self.oom_op = self.ops
                # not kept here: code that catches the error must free what the failed
                # frames held as soon as its handler ends, as on a GPU (the error's
                # traceback holds those frames)
                # from None: the user sees CUDA's error alone, not our AllocatorFull
                raise self._oom_error(full) from None
            self.alloc_bytes[serial] = new
        self._follow_peaks(a)

    def _follow_peaks(self, a: CachingAllocatorModel) -> None:
        """torch.cuda's max_memory_allocated / reserved follow the allocator model."""
        if a.allocated > self.cuda_allocated_peak:
            self.cuda_allocated_peak = a.allocated
        if a.reserved > self.cuda_reserved_peak:
            self.cuda_reserved_peak = a.reserved

    def replay_transients(self, steps: list[tuple[Any, int | None]], live: set) -> None:
        """Allocate (``bytes``) or free (None) each key of ``steps`` in turn in the allocator
        model: the transient buffers of a step that was evaluated, not run (no storage, no
        event); ``live`` keeps the keys allocated and not freed yet. torch.cuda's peaks follow
        them. Raises :class:`AllocatorFull` where a request does not fit."""
        a = self.allocator
        for key, n in steps:
            if n is None:
                a.free(key)
                live.discard(key)
                continue
            a.malloc(key, n)
            live.add(key)
            self._follow_peaks(a)

    def replay_storages(self, steps: list[tuple[Any, int | None, Any]], live: dict) -> None:
        """Allocate (``bytes``) or free (None) each key of ``steps`` (key, bytes, (role,
        frames) or None) in turn as a device storage of its own with no tensor: the
        tracker's events, current bytes and peaks and the allocator model move as a run's
        storage of that size would move them (a call that was evaluated, not run); ``live``:
        key -> the entry of each one allocated and not freed yet. Raises the out-of-memory
        error where a request does not fit."""
        for key, n, made_like in steps:
            if n is None:
                entry = live.pop(key)
                self._add(entry, -entry.nbytes)
                continue
            self._serial += 1
            entry = Entry(self._serial, round_request(n), "device")
            self.pool_of[entry.serial] = "device"
            if made_like is not None:
                role, frames = made_like
                if role is not None:
                    self.roles[entry.serial] = role
                if frames is not None and self.record_frames:
                    self.frames[entry.serial] = frames
            self._requested = n
            self._add(entry, entry.nbytes)
            live[key] = entry

    @property
    def context_bytes(self) -> int:
        """The CUDA context's bytes on the card (0: none counted)."""
        return self.cuda_context.nbytes if self.cuda_context is not None else 0

    def allowed(self, total: int, fraction: float | None = None) -> int:
        """What the allocator may reserve on a card of ``total`` bytes: what the CUDA context
        leaves, and no more than ``fraction`` of the card once one is set (torch's
        ``set_per_process_memory_fraction``; cudaMalloc still fails past the free memory)."""
        room = total - self.context_bytes
        return room if fraction is None else min(int(fraction * total), room)

    def _oom_error(self, full: AllocatorFull) -> SimulatedOutOfMemoryError:
        phase, where, label = self.context()
        live = self.current["device"]  # what the report counts live at the failure
        cached = max(full.reserved - live, 0)
        # torch's words (CUDACachingAllocator.cpp's OutOfMemoryError), then where it ran out
        total, allowed = self.card_memory or full.capacity, ""
        if self.memory_fraction is not None and self.card_memory:
            allowed = f"{format_bytes(full.capacity)} allowed; "
        free = max(total - self.context_bytes - full.reserved, 0)  # what cudaMemGetInfo says
        msg = (f"CUDA out of memory (simulated). Tried to allocate {format_bytes(full.size)}. "
               f"GPU 0 has a total capacity of {format_bytes(total)} of which "
               f"{format_bytes(free)} is free. {allowed}Of the allocated memory "
               f"{format_bytes(live)} is allocated by PyTorch, and "
               f"{format_bytes(cached)} is reserved by PyTorch but unallocated. If reserved "
               "but unallocated memory is large try setting "
               "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation. "
               f"Ran out at {self._oom_location(phase, where, label)}.")
        return SimulatedOutOfMemoryError(msg, op=self._last_op, module=where, size=full.size)

    def _oom_location(self, phase: str, where: str | None, label: str | None) -> str:
        """Where the op that ran out runs: 'aten.mm (label) in module m during forward'."""
        op = self._last_op
        loc = f"aten.{op}" if op else "an allocation"
        if label:
            loc += f" ({label})"
        if where:
            loc += f" in module {where}"
        return loc + _PHASE_WORDS.get(phase, "")

    # -- dispatch -------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # the per-op path of every simulated op: what every op needs stays inline (its
        # cost adds to every op FakeTensorMode runs); rarer steps are methods
        if func is _PRIM_DEVICE:
            # C++ asking a fake tensor its device (FakeTensor.__torch_dispatch__'s answer,
            # without FakeTensorMode's dispatch): not an op, not counted
            mode = getattr(args[0], "fake_mode", None)
            if mode is not None:
                return META if mode.in_kernel_invocation else args[0].fake_device
        if func is _RECORD_STREAM:
            return None
        s = self.s
        s.in_dispatch += 1
        try:
            if self.quiet:  # memmagic's own op (the saved-tensor hook's detach)
                return func(*args, **(kwargs or {}))
            if _INFERENCE() and func not in _WHOLE and (
                    out := self._in_parts(func, args, kwargs or {})) is not NotImplemented:
                return out
            forced = s.target
            if kwargs:
                dev = kwargs.get("device")
                if dev is not None and is_cuda_device(dev):
                    kwargs = {**kwargs, "device": CPU}
                    forced = "device"
            else:
                kwargs = {}
            n = self.ops + 1
            if n > self.max_ops or (not n & 1023 and time.perf_counter() > self.deadline):
                raise self._over_budget(n)
            if func is _LOCAL_SCALAR or func is _ITEM:
                return self._read_scalar(_LOCAL_SCALAR, args[0])
            special = _SPECIAL_OPS.get(func)  # reads of values, refusals
            if special is not None:
                return special(self, *args, **kwargs)
            if forced is not None:
                pool = forced if s.cuda else "device"
                self._out_unsure = False
            else:
                pool = self.pool_from_inputs(func, args, kwargs)
            if pool == "device":
                s.cuda_seen = True
                if func not in BLAS_OPS:
                    self._note_kernel(func)
            s.pending = pool
            fast = self.fast if func not in _STORAGE_SETS else _uncached
            out = func(*args, **kwargs) if fast is None else fast(func, args, kwargs)
            out = propagate(func, args, kwargs, out, pool == "device" and s.cuda)
            info = self._op_info.get(func)
            if info is None:
                info = self._op_info[func] = _op_info(func)
            mutating, name, fixup = info
            if fixup:
                out = fix_outputs(func, args, kwargs, out)
            out = self._record_outputs(func, name, mutating, args, kwargs, out)
            if pool == "device" and (func in BLAS_OPS or func in REDUCTION_OPS or func in CONV_OPS):
                self._kernel_scratch(func, args, kwargs)
            return out
        finally:
            s.in_dispatch -= 1

    def _in_parts(self, func, args, kwargs):
        """In inference mode a composite op (linear, matmul, scaled_dot_product_attention, |,
        bool()) reaches the modes whole: its parts, as autograd's key sends them outside it
        (through the CUDA kernel the run registered on that key, :attr:`own_kernels`);
        NotImplemented for an op with no composite kernel."""
        own = self.own_kernels.get(func)
        with self:
            out = func.decompose(*args, **kwargs) if own is None else own(*args, **kwargs)
        if out is NotImplemented:
            _WHOLE.add(func)
        return out

    def _note_kernel(self, func) -> None:
        """Remember the library kernels (quantized weights) and flex_attention calls that
        ran on the device, for the report's notes."""
        s = self.s
        lib = _QUANTIZED_KERNELS.get(func.namespace) or _QUANTIZED_KERNELS.get(func)
        if lib is not None:
            s.library_kernels.setdefault(lib, set()).add(func.__name__.partition(".")[0])
        elif func in _FUSED_ATTENTION:
            s.flex_attention_calls += 1

    def _over_budget(self, n: int) -> SimulationBudgetExceeded:
        if n > self.max_ops:
            return SimulationBudgetExceeded(
                f"the simulation stopped after {self.max_ops} tensor operations (max_ops): "
                "a loop that depends on tensor values, or more steps than a simulation "
                "needs; simulate fewer iterations or raise max_ops")
        return SimulationBudgetExceeded(
            f"the simulation stopped after {self.max_seconds:g} s (max_seconds): simulate "
            f"fewer iterations (a script: memmagic run --steps N), or give a cell longer: "
            f"%%gpumem --max-seconds {4 * self.max_seconds:g} on its first line")

    def _record_outputs(self, func, name: str, mutating: bool, args: tuple, kwargs: dict, out):
        """Count the op and track what it made or changed; ``out``."""
        seq = isinstance(out, (tuple, list))
        first = (out[0] if out else None) if seq else out
        dev = _priv.fake_device(first) if isinstance(first, torch.Tensor) else None
        if dev is not None and dev.type == "cuda":
            raise SimulationUnsupported(
                f"a CUDA tensor slipped through the simulation at aten.{name}; {RERUN_HINT}")
        self.log_op(name, args, kwargs)
        serial0 = self._serial
        if mutating:
            self._record_mutation(func, args, kwargs, out)
        elif isinstance(out, torch.Tensor):
            self.track(out)  # in the pool (and rounding) of s.pending, set above
        elif seq:
            self._visit(out, False)
        if self._out_unsure and self._serial > serial0:
            self._unsure.update(range(serial0 + 1, self._serial + 1))
        return out

    def _record_mutation(self, func, args: tuple, kwargs: dict, out) -> None:
        drop_unfounded_in_place(func, args, kwargs)
        self._visit(out, True)
        for a in args:
            self._visit(a, True)
        for a in kwargs.values():
            self._visit(a, True)
        if func in _FOUND_INF_OPS:  # GradScaler's found_inf reads 0 (no inf here)
            serial = self.serial_of(args[1])
            if serial is not None:
                self.s.zero_read_serials.add(serial)

    def _take_workspaces(self, func, args, kwargs) -> None:
        """Allocate the cuBLAS/cuBLASLt workspaces this matmul makes torch allocate (once per
        thread, kept for the life of the simulated GPU; see .workspaces): after its output,
        as torch takes them when the matmul first uses its handle."""
        ws = self.workspaces
        thread = "backward" if _priv.in_backward() else "main"
        self._last_op = func.__name__  # an OOM here is this op's
        for key, size in ws.needed(func, args, kwargs, thread):
            ws.held[key] = self.hold_workspace(round_request(size))[1]

    def _take_conv_workspaces(self, func, args) -> None:
        """cuDNN's workspace of each pass of a convolution (see .cudnn): allocated after
        its outputs, freed when the pass is queued (and, at a shape's first call with
        ``cudnn.benchmark`` on, the search's buffers and the emptied cache); how each size
        was found is counted for the report's note."""
        counts = self.s.cudnn_workspaces
        a, probe = self.allocator, object()  # a key no block of the allocator has
        self._last_op = func.__name__  # an OOM here is this op's
        for nbytes, how in conv_workspaces(func, args, self.workspaces.conv_plans):
            if how == "benchmark empty cache":  # torch frees what the search left cached
                counts[how] = counts.get(how, 0) + 1
                if a is not None:
                    a.empty_cache()
                continue
            if how == "benchmark search" and a is not None and not a.would_fit(
                    [(probe, round_request(nbytes)), (probe, None)], round_request(nbytes)):
                # the search skips an engine whose workspace the card cannot give it
                nbytes, how = 0, "benchmark search skipped"
            counts[how] = counts.get(how, 0) + 1
            if nbytes > 0:  # one after the other: each freed before the next
                self._take_scratch([nbytes])

    def _kernel_scratch(self, func, args, kwargs) -> None:
        """After a device op's outputs: the cuBLAS workspaces a matmul takes and keeps, and
        the transient buffers a kernel takes beside its outputs (a reduction's staging,
        cuDNN's convolution workspaces) and frees."""
        if self.workspaces is not None:
            if func in BLAS_OPS:
                self._take_workspaces(func, args, kwargs)
            elif func in REDUCTION_OPS:
                self._take_scratch(*self.workspaces.scratch(func, args, kwargs))
            elif func in CONV_OPS and self.s.cuda:
                self._take_conv_workspaces(func, args)

    def hold_scratch(self, nbytes: int, op: str) -> int:
        """A kernel's transient buffer of ``nbytes`` on the device, held until
        :meth:`release_scratch` (cuDNN's RNN workspace, held across the call's outputs:
        .cudnn_rnn); its serial. Raises the out-of-memory error a GPU would raise here, as
        ``op``'s."""
        self._last_op = op
        return self.hold_workspace(round_request(nbytes), nbytes)[0]

    def release_scratch(self, serial: int) -> None:
        self._on_free(-serial, serial)

    def _take_scratch(self, sizes: list[int], recipe: tuple | None = None) -> None:
        """A kernel's transient buffers (a reduction's staging memory): allocated beside
        its output, freed when it is queued (see .workspaces.reduction_scratch). Each
        one's ``recipe`` and index in it are kept (``scratch``: serial -> (recipe, i)), and
        the reduction as a site (``scratch_sites``), staging or not."""
        if recipe is not None and self.allocator is not None:
            # where a staging buffer may be, staged or not (another size may stage)
            self.scratch_sites.append((self.allocator.log_length, recipe))
        serials = [self.hold_workspace(round_request(n))[0] for n in sizes]
        for i, serial in enumerate(serials):
            if recipe is not None:
                self.scratch[serial] = (recipe, i)
            self._on_free(-serial, serial)

    def hold_workspace(self, nbytes: int, requested: int | None = None) -> tuple[int, int]:
        """Allocate a workspace of ``nbytes`` on the device for the life of the GPU (no
        storage: a key of its own, never freed); (its serial, its bytes). ``requested``:
        the bytes asked for, before rounding (the allocator's history shows them). Raises
        the OOM a GPU would raise here."""
        self._serial += 1
        entry = Entry(self._serial, nbytes, "device")
        self.pool_of[entry.serial] = "device"
        self.roles[entry.serial] = Category.WORKSPACES
        self._requested = nbytes if requested is None else requested
        self._add(entry, entry.nbytes)
        self._live[-entry.serial] = entry
        return entry.serial, entry.nbytes

    def release_workspaces(self) -> int:
        """Free every workspace :meth:`hold_workspace` holds (torch's
        ``_clear_cublas_workspaces``); the next matmul allocates them again. Bytes freed."""
        freed = 0
        for e in self.held_workspaces():
            self._on_free(-e.serial, e.serial)
            freed += e.nbytes
        if self.workspaces is not None:
            self.workspaces.held.clear()
        return freed

    def held_workspaces(self) -> list[Entry]:
        """The entries of the workspaces :meth:`hold_workspace` holds on the device."""
        return [e for k, e in list(self._live.items()) if k < 0 and e.pool == "device"]

    def pool_from_inputs(self, func, args, kwargs) -> str:
        """The pool of the op's outputs: "device" when any input tensor is on the simulated
        GPU. Also decides whether the outputs' device is *known* (``self._out_unsure``) and
        checks that the inputs' devices could meet in one op on a GPU."""
        if not self.s.cuda:
            return "device"
        live, key = self._live, _priv.storage_key
        unsure = self._unsure
        dev_sure = dev_unsure = host_sure = host_unsure = seen = False
        for a in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(a, torch.Tensor):
                ts = (a,)
            elif isinstance(a, (list, tuple)):
                ts = a
            else:
                continue
            for t in ts:
                if not isinstance(t, torch.Tensor):
                    continue
                seen = True
                if held_by(t) is not None:  # a wrapper subclass: where its inner tensors are
                    e = self.entry_of(t)
                else:
                    e = live.get(key(t.untyped_storage()))
                if e is None:
                    host_unsure = True  # made where the simulation did not see: device unknown
                elif e.pool == "device":
                    if unsure and e.serial in unsure:
                        dev_unsure = True
                    else:
                        dev_sure = True
                elif unsure and e.serial in unsure:
                    host_unsure = True
                else:
                    host_sure = True
        if dev_sure or dev_unsure:
            if dev_sure and host_sure:
                self._check_same_device(func, args, kwargs)
            self._out_unsure = not dev_sure
            return "device"
        if not seen:
            # a factory called from C++ (a composite op, a backward formula) takes the
            # device of some tensor's options, which the simulation cannot see: the GPU
            # inside backward/recompute, and inside a torch function given a GPU tensor
            # (SDPA's math kernel makes its causal mask with the query's options)
            self._out_unsure = True
            if self.s.cuda_seen and (_priv.in_backward()
                                     or self._on_device(kernel_call_args() or ())):
                return "device"
            return "host"
        self._out_unsure = host_unsure
        return "host"

    def _on_device(self, args: tuple) -> bool:
        """Whether a tensor of ``args`` (or of a list in them) is on the simulated GPU."""
        for a in args:
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, torch.Tensor) and self.s.pool_of(t) == "device":
                    return True
        return False

    def _check_same_device(self, func, args, kwargs) -> None:
        """Raise what CUDA raises when an op mixes a CPU and a CUDA tensor (:mod:`.mismatch`)."""
        rule = self._device_rules.get(func)
        if rule is None:
            rule = self._device_rules[func] = device_rule(func)
        check_same_device(func, args, kwargs, rule, self._known_device)

    def _known_device(self, t: torch.Tensor) -> str | None:
        """The pool of ``t`` when the simulation knows it, None for a guessed device and
        for a CPU scalar (and an empty placeholder)."""
        e = self._live.get(_priv.storage_key(t.untyped_storage()))
        if e is None or e.serial in self._unsure:
            return None
        if e.pool == "host" and (t.dim() == 0 or t.numel() == 0):
            return None  # a CPU scalar (and an empty placeholder)
        return e.pool

    def _equal(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        """``torch.equal`` as CUDA's kernel computes it (ATen's ``cuda_equal``): False for
        other sizes, True for no elements or the same view of one storage, else ``eq(a,
        b).all()`` read into Python, its tensors made on the way (the read: a constant's
        value, the test of an assert, else the placeholder, False)."""
        if a.shape != b.shape:
            return False
        if a.numel() == 0 or (_priv.storage_key(a.untyped_storage())
                              == _priv.storage_key(b.untyped_storage())
                              and a.storage_offset() == b.storage_offset()
                              and a.stride() == b.stride()):
            return True
        with self:
            both = _aten.all.default(_aten.eq.Tensor(a, b))
        return self._read_scalar(_LOCAL_SCALAR, both)

    def _allclose(self, a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-05,
                  atol: float = 1e-08, equal_nan: bool = False) -> bool:
        """``torch.allclose`` as ATen computes it, ``isclose(a, b).all()`` read into Python,
        its tensors made on the way: the value where both are known, else True, noted: the
        check of one computation against another (a tutorial's ``assert``, a solver's loop
        until it converges) holds on a GPU that runs the code as its author meant, where
        the placeholder, False, would fail it or never end."""
        with self:
            both = _aten.all.default(_aten.isclose.default(a, b, rtol, atol, equal_nan))
        const = _priv.fake_constant(both)
        if const is not None:
            with _priv.no_python_modes():
                return bool(const.item())
        self.s.value_reads += 1
        self.s.note_read("allclose, taken to hold")
        return True

    def _read_scalar(self, func, t: torch.Tensor):
        self.s.value_reads += 1
        holding = self.s.holding  # a check of values (backend._install_value_checks)
        if holding is not None and t.dtype == torch.bool and _priv.fake_constant(t) is None:
            self.s.note_read(f"{holding}, taken to hold")
            return True

        def zero() -> bool:
            serial = self.serial_of(t)
            return serial is not None and serial in self.s.zero_read_serials

        return read_scalar(func, t, zero, self.s.note_read)


def _refuse_while_loop(tracker: SimTracker, *args, **kwargs):
    raise SimulationUnsupported(WHILE_LOOP_REFUSED)


# ops the per-op path hands to a method of their own
_SPECIAL_OPS = {_EQUAL: SimTracker._equal, _ALLCLOSE: SimTracker._allclose,
                _WHILE_LOOP: _refuse_while_loop}
