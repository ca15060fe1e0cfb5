"""Live-storage tracking at op granularity, and attribution of storages to categories.

:class:`StorageTracker` is a ``TorchDispatchMode`` that records each storage an op outputs,
once, and notices its release through a weakref callback on the storage. It therefore
sees every tensor allocation that goes through the dispatcher; it does not see buffers a
kernel allocates and frees internally (mkldnn, sort, cuDNN/cuBLAS workspaces).

:class:`Tracking` is the context manager the backends use: it seeds the tracker with the
tensors that already exist (so they count in ``before``), installs the role hooks
(module forward hooks, optimizer step hooks, saved-tensor hooks) and removes everything
in ``finally``. While it runs, ``torch.compile``'d code runs eagerly (:class:`EagerCompiled`).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import sys
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.nn.modules.module as _module_mod
from torch.optim.optimizer import (
    Optimizer,
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from . import _torch_private as _priv
from . import objgraph
from .interrupts import atomic
from .patching import Patches
from .failures import is_machinery, torch_dir
from ..trace import PRIORITY as _PRIORITY, Category, Trace

__all__ = ["StorageTracker", "Tracking", "TrackResult", "scan_existing", "reachable_existing",
           "Pool", "Trace"]

# Which pool a tensor's storage counts in: "device" (the measured device), "host", or None.
Pool = str
IncludeFn = Callable[[torch.Tensor], "Pool | None"]

# A storage keeps the most specific role it ever had: trace.PRIORITY (Category is a str
# enum, so its members and their values are the same keys).


def _identity(n: int) -> int:
    return n


_WRAPPER_TYPES: dict[type, bool] = {}


def held_by(t: torch.Tensor) -> list[torch.Tensor] | None:
    """The inner tensors holding the memory of a wrapper tensor subclass (a DTensor's local
    shard, torchao's quantized data and scales), None for a tensor that holds its own.
    A wrapper has no memory of its own and its ops dispatch their inner ops, so trackers
    count it by these. (Whether a class wraps is asked once per class.)"""
    tp = type(t)
    wraps = _WRAPPER_TYPES.get(tp)
    if wraps is None:
        wraps = _WRAPPER_TYPES[tp] = _priv.is_wrapper_subclass(t)
    return _priv.wrapper_inner_tensors(t) if wraps else None


@dataclass
class Entry:
    serial: int
    nbytes: int
    pool: str
    ref: weakref.ref | None = None


@dataclass(frozen=True)
class TrackResult:
    """Numbers one :class:`Tracking` run produced. Sizes in bytes."""

    before: int
    peak: int
    after: int
    breakdown: dict[str, int]
    peak_op: str | None
    peak_module: str | None
    peak_phase: str | None
    host_before: int
    host_peak: int
    host_after: int
    ops: int
    timeline: list[tuple[int, int]] = field(default_factory=list)  # (op index, live device bytes)
    breakdown_before: dict[str, int] = field(default_factory=dict)
    compiled_calls: int = 0  # calls of torch.compile'd code, which ran eagerly
    trace: Trace | None = None
    peak_label: str | None = None  # the autograd node (backward) or optimizer (step) at the peak


@atomic
class StorageTracker(_priv.TrackerMode):
    # torch.cond, scan, map (control-flow higher-order operators) reach __torch_dispatch__
    # as one op and run there as without the mode (without it torch stops them: "no rule
    # registered for HigherOrderOperator"): what they return is tracked, not the tensors
    # their branches make and drop inside
    supports_higher_order_operators = True
    """Records live storages op by op.

    ``include(t)`` says which pool a tensor's storage counts in ("device" or "host") or
    None to ignore it. ``round_bytes`` maps a storage's size to what the allocator would
    hold for it (identity for the CPU, 512-byte rounding for CUDA).
    """

    def __init__(self, include: IncludeFn, round_bytes: Callable[[int], int] = _identity) -> None:
        super().__init__()
        self.include = include
        self.round_bytes = round_bytes
        self._live: dict[int, Entry] = {}
        self._serial = 0
        self.pool_of: dict[int, str] = {}
        self._seed: dict[int, int] = {}
        self.roles: dict[int, Category] = {}
        self.frozen: set[int] = set()  # parameters that do not require grad (LoRA's base)
        self.events: list[tuple[int, int, int]] = []  # (serial, delta bytes, op index)
        # (number of events before it, serial, +1 saved / -1 released by autograd)
        self.saved_events: list[tuple[int, int, int]] = []
        self.current = {"device": 0, "host": 0}
        self.peak = {"device": 0, "host": 0}
        self.before = {"device": 0, "host": 0}
        self.peak_event = -1
        self.peak_op: str | None = None
        self._last_op: str | None = None
        self.peak_module: str | None = None
        self.peak_phase: str | None = None
        self.ops = 0
        # dotted paths of the modules whose forward runs, outermost first ("model.blocks.1")
        self.module_stack: list[str] = []
        self.phase_override: str | None = None  # "optimizer" while a step runs
        self._mutating: dict[object, bool] = {}
        self._closed = False
        self.quiet = 0  # >0 while memmagic itself runs ops (the saved-tensor hook's detach)
        # the trace: (name, module, phase) of every op; which module first saved each
        # storage for backward; which module owns each parameter and gradient storage
        self.op_log: list[tuple[str, str | None, str, str | None]] = []
        self.saver: dict[int, str | None] = {}
        self.owner: dict[int, str] = {}
        # autograd node numbers at which the module path changed (forward), to name the
        # module a backward op belongs to
        self._seq_starts: list[int] = []
        self._seq_paths: list[str | None] = []
        self.record_frames = False  # keep the user's stack for each new storage (snapshots)
        self.frames: dict[int, tuple] = {}
        self.peak_label: str | None = None  # backward: the autograd node ("softmax backward")
        self.step_label: str | None = None  # the optimizer whose step runs ("Adam")
        # (op, (phase, module, label)) a peak reached now is said to be in: a call that was
        # evaluated, not run, takes the context of the call that ran in its place
        self.stand_in: tuple | None = None

    # -- storage bookkeeping ----------------------------------------------------------
    def _on_free(self, key: int, serial: int) -> None:
        entry = self._live.get(key)
        if entry is None or entry.serial != serial or self._closed:
            return
        del self._live[key]
        self._add(entry, -entry.nbytes)

    def _add(self, entry: Entry, delta: int) -> None:
        pool = entry.pool
        self.events.append((entry.serial, delta, self.ops))
        cur = self.current[pool] + delta
        self.current[pool] = cur
        if cur > self.peak[pool]:
            self.peak[pool] = cur
            if pool == "device":
                self.peak_event = len(self.events) - 1
                self._peak_context()

    def _peak_context(self) -> None:
        if self.stand_in is not None:
            self.peak_op, (phase, module, label) = self.stand_in
        else:
            self.peak_op = self._last_op
            phase, module, label = self.context()
        self.peak_phase, self.peak_module, self.peak_label = phase, module, label

    @contextlib.contextmanager
    def standing_in(self, context: tuple | None):
        """While it lasts, a peak is said to be reached in ``context`` (op, (phase, module,
        label)): that of a call that ran, where one evaluated from it stands in its place."""
        self.stand_in = context
        try:
            yield
        finally:
            self.stand_in = None

    def context(self) -> tuple[str, str | None, str | None]:
        """(phase, module path, autograd node label) of the op running now. In backward the
        module is the one whose forward made the autograd node being run."""
        if self.phase_override:
            label = self.step_label
            if label and self._last_op and self._last_op.startswith(("_foreach_", "_fused_")):
                label += ", foreach" if self._last_op.startswith("_foreach_") else ", fused"
            return self.phase_override, self.module_stack[-1] if self.module_stack else None, label
        if _priv.in_backward():
            if self.module_stack:  # a checkpointed forward, run again for backward
                return "recompute", self.module_stack[-1], None
            node = _priv.current_autograd_node()
            if node is None:
                return "backward", None, None
            seq, node_name = node
            i = bisect.bisect_right(self._seq_starts, seq) - 1
            return "backward", self._seq_paths[i] if i >= 0 else None, _node_label(node_name)
        if self.module_stack:
            return "forward", self.module_stack[-1], None
        return ("forward" if self._grad_op else "other"), None, None

    _grad_op = False  # the op running now made an autograd node (outside modules)
    _last_seq = -1

    def enter_module(self, path: str) -> None:
        self.module_stack.append(path)
        self._mark_path(path)

    def exit_module(self) -> None:
        if self.module_stack:
            self.module_stack.pop()
        self._mark_path(self.module_stack[-1] if self.module_stack else None)

    def _mark_path(self, path: str | None) -> None:
        if _priv.in_backward():
            return  # recompute: its nodes are run by the backward that made them
        seq = _priv.next_sequence_nr()
        if self._seq_starts and self._seq_starts[-1] == seq:
            self._seq_paths[-1] = path
        else:
            self._seq_starts.append(seq)
            self._seq_paths.append(path)

    # False: count ops but keep no per-op record (the trace then has no ops; benchmarks
    # use it to time what the per-op record costs, side by side)
    trace_ops = True

    def log_op(self, name: str, args: tuple, kwargs: dict | None) -> None:
        """The per-op bookkeeping every tracker shares: count the op, remember its name,
        module and phase (for the trace and the peak's words)."""
        self.ops += 1
        self._last_op = name
        if not self.trace_ops:
            return
        if not self.module_stack and not self.phase_override:
            # outside modules an op is part of the forward when it made an autograd node
            # (its node was made before the op dispatched here, so the count moved on)
            seq = _priv.next_sequence_nr()
            self._grad_op = seq != self._last_seq
            self._last_seq = seq
        else:
            self._grad_op = False
        phase, module, label = self.context()
        self.op_log.append((name, module, phase, label))

    def track(self, t: torch.Tensor, role: Category = Category.OTHER) -> int | None:
        """Start tracking ``t``'s storage (if not yet tracked); return its serial or None.
        A wrapper subclass: its inner tensors' storages, the first one's serial."""
        inner = held_by(t)
        if inner is not None:
            serials = [self.track(i, role) for i in inner]
            return next((s for s in serials if s is not None), None)
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return None  # sparse and other storage-less tensors
        key = _priv.storage_key(st)
        entry = self._live.get(key)
        if entry is None:
            pool = self.include(t)
            if pool is None:
                return None
            self._serial += 1
            serial = self._serial
            entry = Entry(serial, self.round_bytes(st.nbytes()), pool)
            self.pool_of[serial] = pool
            try:
                entry.ref = weakref.ref(st, lambda _r, k=key, s=serial: self._on_free(k, s))
            except TypeError:
                return None
            self._live[key] = entry
            if self.record_frames:
                self.frames[serial] = _user_frames()
            self._add(entry, entry.nbytes)
        if role is not Category.OTHER:
            self.note_serial(entry.serial, role)
        return entry.serial

    def recheck_size(self, t: torch.Tensor) -> None:
        """After a mutating op: an existing storage may have been resized (resize_, out=)."""
        inner = held_by(t)
        if inner is not None:
            for i in inner:
                self.recheck_size(i)
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return
        entry = self._live.get(_priv.storage_key(st))
        if entry is None:
            self.track(t)
            return
        size = self.round_bytes(st.nbytes())
        if size != entry.nbytes:
            delta = size - entry.nbytes
            entry.nbytes = size
            self._add(entry, delta)

    def entry_of(self, t: torch.Tensor) -> Entry | None:
        """The live entry of ``t``'s storage (None when it is not tracked); of a wrapper
        subclass, its first tracked inner tensor's."""
        inner = held_by(t)
        if inner is not None:
            return next((e for e in map(self.entry_of, inner) if e is not None), None)
        try:
            return self.storage_entry(t.untyped_storage())
        except (RuntimeError, NotImplementedError, TypeError):
            return None

    def storage_entry(self, storage: torch.UntypedStorage) -> Entry | None:
        """The live entry of an untyped storage (None when it is not tracked)."""
        return self._live.get(_priv.storage_key(storage))

    def serial_of(self, t: torch.Tensor) -> int | None:
        entry = self.entry_of(t)
        return None if entry is None else entry.serial

    def saved(self, serial: int, delta: int) -> None:
        """Autograd started (+1) or stopped (-1) holding this storage for backward."""
        if not self._closed:
            self.saved_events.append((len(self.events), serial, delta))
            if delta > 0 and serial not in self.saver:
                self.saver[serial] = self.module_stack[-1] if self.module_stack else None

    def note_serial(self, serial: int, role: Category) -> None:
        old = self.roles.get(serial, Category.OTHER)
        if _PRIORITY[role] > _PRIORITY[old]:
            self.roles[serial] = role

    def note_cache(self, cache: object) -> None:
        """What a model's ``past_key_values`` holds plays the KV-cache role (the outermost
        model's output's, after each of its calls)."""
        objgraph.walk([(None, cache)], lambda x, *_: self.note(x, Category.KV_CACHE), names=False)

    def note(self, t: object, role: Category, trainable: bool | None = None) -> None:
        """Record that ``t``'s storage plays ``role`` (only for storages already tracked).
        A parameter is trainable when it requires grad (a wrapper's inner tensors take
        the wrapper's ``trainable``)."""
        if not isinstance(t, torch.Tensor):
            return
        if trainable is None:
            trainable = t.requires_grad
        inner = held_by(t)
        if inner is not None:
            for i in inner:  # a quantized weight's scales are part of the parameter
                self.note(i, role, trainable)
            return
        try:
            key = _priv.storage_key(t.untyped_storage())
        except (RuntimeError, NotImplementedError, TypeError):
            return
        entry = self._live.get(key)
        if entry is not None:
            self.note_serial(entry.serial, role)
            if role is Category.PARAMETERS:
                (self.frozen.discard if trainable else self.frozen.add)(entry.serial)

    def seed(self, tensors: Iterable[tuple[torch.Tensor, Category]]) -> None:
        """Register tensors that exist before the run: they count in ``before``."""
        for t, role in tensors:
            self.track(t, role)
        self.before = dict(self.current)
        self._seed = {e.serial: e.nbytes for e in self._live.values()}
        self.events.clear()
        self.peak = dict(self.current)
        self.peak_event = -1
        self.peak_op = self.peak_module = self.peak_phase = self.peak_label = None

    def restart(self) -> None:
        """The run starts now: what is live is ``before`` (a run's setup done inside the
        tracking, as a what-if knob's conversion of the model, is not the run's)."""
        self.seed(())

    # -- dispatch -----------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.quiet:
            return out
        self.log_op(func.__name__ if hasattr(func, "__name__") else str(func), args, kwargs)
        mutating = self._mutating.get(func)
        if mutating is None:
            schema = _priv.op_schema(func)
            mutating = bool(schema is not None and schema.is_mutable)
            self._mutating[func] = mutating
        self._visit(out, mutating)
        if mutating:
            for a in list(args) + list((kwargs or {}).values()):
                self._visit(a, True)
        return out

    def _visit(self, obj: object, mutating: bool) -> None:
        if isinstance(obj, torch.Tensor):
            if mutating:
                self.recheck_size(obj)
            else:
                self.track(obj)
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                self._visit(o, mutating)

    # -- results ------------------------------------------------------------------------
    def close(self) -> None:
        """Stop listening for frees: later releases no longer change the numbers."""
        self._closed = True
        for entry in self._live.values():
            entry.ref = None

    def trace(self) -> Trace:
        """The run's :class:`~memmagic.trace.Trace`: a copy of the tables, restricted to
        the storages of this run (a tracker that lasts across cells keeps growing)."""
        events, saved_events = list(self.events), list(self.saved_events)
        seed = dict(self._seed)
        serials = set(seed)
        serials.update(e[0] for e in events)
        serials.update(e[1] for e in saved_events)
        pool_of, roles, saver, owner = self.pool_of, self.roles, self.saver, self.owner
        return Trace(
            ops=list(self.op_log), events=events, saved_events=saved_events,
            pool_of={s: pool_of[s] for s in serials if s in pool_of},
            roles={s: Category(roles[s]).value for s in serials if s in roles},
            seed=seed, saver={s: saver[s] for s in serials if s in saver},
            owner={s: owner[s] for s in serials if s in owner},
            frames={s: self.frames[s] for s in serials if s in self.frames},
            peak_event=self.peak_event, before=self.before["device"],
            frozen=frozenset(s for s in serials if s in self.frozen))

    def timeline(self, max_points: int = 2000) -> list[tuple[int, int]]:
        """(op index, live device bytes) through the run: :meth:`Trace.timeline` summed."""
        return [(op, sum(c.values())) for op, c in self.trace().timeline(max_points)]


_LABELS: dict[str, str] = {}


def _node_label(node_name: str) -> str:
    """``SoftmaxBackward0`` -> ``softmax backward``; ``AccumulateGrad`` -> ``accumulate grad``."""
    label = _LABELS.get(node_name)
    if label is None:
        head, sep, tail = node_name.rpartition("Backward")
        if sep and (not tail or tail.isdigit()):
            label = f"{_snake(head)} backward"
        else:
            label = _snake(node_name)
        _LABELS[node_name] = label
    return label


def _snake(name: str) -> str:
    out = []
    for i, ch in enumerate(name):
        if ch.isupper() and i and (not name[i - 1].isupper() or
                                   (i + 1 < len(name) and name[i + 1].islower())):
            out.append(" ")
        out.append(ch.lower())
    return "".join(out).replace("_", " ").strip()


def _user_frames(limit: int = 8) -> tuple[tuple[str, int, str], ...]:
    """(file, line, function) of the Python frames outside torch and memmagic's machinery
    (:func:`memmagic.core.failures.is_machinery`: the model zoo's frames are the program's),
    innermost first: where the program asked for a storage."""
    out = []
    f = sys._getframe(2)
    torch_code = torch_dir()
    while f is not None and len(out) < limit:
        name = f.f_code.co_filename
        if not (name.startswith(torch_code) or is_machinery(name)):
            out.append((name, f.f_lineno, f.f_code.co_name))
        f = f.f_back
    return tuple(out)


# -- tensors that exist before a run --------------------------------------------------------
_KIND_CACHE: dict[type, str | None] = {}


def _kind(tp: type) -> str | None:
    if issubclass(tp, torch.Tensor):
        kind = "tensor"
    elif issubclass(tp, torch.nn.Module):
        kind = "module"
    elif issubclass(tp, Optimizer):
        kind = "optimizer"
    else:
        kind = None
    _KIND_CACHE[tp] = kind
    return kind


def _with_saved(found: list[tuple[torch.Tensor, Category]]) -> list[tuple[torch.Tensor, Category]]:
    """``found`` plus the tensors saved by the autograd graphs behind its tensors."""
    seen: set[int] = set()
    roots = [t.grad_fn for t, _ in found if t.grad_fn is not None]
    for root in roots:
        for t in objgraph.saved_tensors(root, seen):
            found.append((t, Category.ACTIVATIONS))
    return found


@atomic
def scan_existing() -> list[tuple[torch.Tensor, Category]]:
    """Every tensor reachable from Python objects now, with its category.

    Finds tensors through the garbage collector (parameters, buffers of modules, ``.grad``,
    optimizer state, any other tensor) and the tensors saved by live autograd graphs.
    Tensors held only by C++ code other than autograd graphs are not found.
    """
    found: list[tuple[torch.Tensor, Category]] = []

    def add(t: torch.Tensor, category: Category, path: None, group: None) -> None:
        found.append((t, category))

    cache = _KIND_CACHE
    gc.collect()  # garbage that is only waiting for the collector is not the program's
    for obj in gc.get_objects():  # the hot loop of a scan: one dict lookup per object
        kind = cache.get(type(obj), "?")
        if kind is None:
            continue
        if kind == "?":
            kind = _kind(type(obj))
            if kind is None:
                continue
        if kind == "tensor":  # the walk's rule for a tensor: it, and a leaf's .grad
            objgraph.walk(((None, obj),), add, names=False)
        elif kind == "module":
            found.extend((b, Category.BUFFERS) for b in _priv.own_buffers(obj).values()
                         if b is not None)
        else:
            found.extend((v, Category.OPTIMIZER_STATE) for _, _, v in objgraph.optimizer_state(obj)
                         if isinstance(v, torch.Tensor))
    return _with_saved(found)


@atomic
def reachable_existing(roots: Iterable[object], max_objects: int = objgraph.MAX_OBJECTS
                       ) -> list[tuple[torch.Tensor, Category]] | None:
    """Tensors reachable from ``roots`` (a notebook's namespace), with their categories,
    and the tensors the autograd graphs behind them saved.

    The one object-graph walk (:func:`memmagic.core.objgraph.walk`), following library
    internals too (an optimizer's parameter groups, a DataLoader's dataset). Much faster
    than :func:`scan_existing` in a big process. Returns None when the walk exceeds
    ``max_objects`` (the caller then scans everything).
    """
    found: list[tuple[torch.Tensor, Category]] = []
    done = objgraph.walk(((None, r) for r in roots), lambda t, c, p, g: found.append((t, c)),
                         max_objects=max_objects, names=False, internals=True)
    return _with_saved(found) if done else None


@atomic
class _Channel:
    """How saved tensors reach one tracker; cut when the tracking ends, so the autograd
    graphs that outlive a measurement hold this stub, never the tracker and its tables."""

    __slots__ = ("tracker",)

    def __init__(self, tracker: StorageTracker) -> None:
        self.tracker: StorageTracker | None = tracker


_ANOMALY_HINT = (" Hint: the backtrace further above shows the operation that failed to "
                 "compute its gradient. The variable in question was changed in there or "
                 "anywhere later. Good luck!")
_PLAIN_HINT = (" Hint: enable anomaly detection to find the operation that failed to compute "
               "its gradient, with torch.autograd.set_detect_anomaly(True, check_nan=False).")


@atomic
class _Saved:
    """What our pack hook hands autograd in place of a saved tensor. It must change nothing
    about the program autograd runs:

    * no reference cycle: a tensor an op saves from its own output (relu, sigmoid, exp)
      points at that op's node through ``grad_fn``, and the node holds what the pack hook
      returned; Python's gc cannot see through the C++ graph, so holding the tensor would
      keep every forward graph that is never run backward alive for good (the cycle
      ``saved_tensors_hooks``'s documentation warns of). Outputs are kept as a detached
      alias (same storage and version counter, no ``grad_fn``); inputs are kept as they
      are, as autograd itself keeps them;
    * the in-place check: autograd skips its version check when hooks are installed, so
      :meth:`unpack` makes it, with autograd's own message;
    * a note to each tracker that was told of the tensor when autograd lets go of it (its
      graph ran backward or was dropped).
    """

    __slots__ = ("tensor", "version", "node_type", "output_nr", "marks")

    def __init__(self, tensor: torch.Tensor, marks: list[tuple[_Channel, int]]) -> None:
        self.version = _priv.tensor_version(tensor)
        self.marks = marks
        if _priv.made_by_newest_node(tensor):
            self.node_type = type(tensor.grad_fn)  # a class: no reference to the node
            self.output_nr = tensor.output_nr
            self.tensor = tensor.detach()
        else:
            self.node_type = None
            self.output_nr = 0
            self.tensor = tensor

    def unpack(self) -> torch.Tensor:
        t = self.tensor
        now = _priv.tensor_version(t)
        if now != self.version:
            raise RuntimeError(self._modified_message(now))
        return t

    def _modified_message(self, now: int) -> str:
        t = self.tensor
        msg = ("one of the variables needed for gradient computation has been modified by an "
               f"inplace operation: [{t.type()} [{', '.join(str(d) for d in t.shape)}]]")
        node_type = self.node_type
        output_nr = self.output_nr
        if node_type is None and t.grad_fn is not None:  # a saved input: its node now
            node_type, output_nr = type(t.grad_fn), t.output_nr
        if node_type is not None:
            name = node_type.__name__
            if _priv.version_error_names_forward_op():
                name = _forward_name(name)
            msg += f", which is output {output_nr} of {name},"
        msg += f" is at version {now}; expected version {self.version} instead."
        return msg + (_ANOMALY_HINT if torch.is_anomaly_enabled() else _PLAIN_HINT)

    def __del__(self) -> None:
        for channel, serial in self.marks:
            tracker = channel.tracker
            if tracker is not None:
                tracker.saved(serial, -1)


def _forward_name(node_name: str) -> str:
    """``SigmoidBackward0`` -> ``Sigmoid``: how autograd names a node's forward op."""
    head, sep, tail = node_name.rpartition("Backward")
    return head if sep and (not tail or tail.isdigit()) else node_name


# Role hooks of the trackings running now, outermost first. Only the outermost installs
# saved-tensor hooks (autograd calls only the innermost pack hook) and tells all of them.
_ACTIVE_HOOKS: list["RoleHooks"] = []


def innermost_tracker() -> "StorageTracker | None":
    """The tracker of the innermost tracking running now (None outside any)."""
    return _ACTIVE_HOOKS[-1].t if _ACTIVE_HOOKS else None


# -- role hooks ---------------------------------------------------------------------------
def _note_quantization_state(t: StorageTracker, p: torch.Tensor) -> None:
    """The tensors a quantized weight keeps beside its packed data are parameters too (frozen):
    bitsandbytes' ``quant_state`` (absmax, code, the nested state of double quantization)
    and 8-bit weights' ``SCB`` scales, held as long as the weight is."""
    attrs = getattr(p, "__dict__", None)
    if not attrs:
        return
    held = [(None, attrs[a]) for a in ("quant_state", "SCB") if attrs.get(a) is not None]
    if held:
        objgraph.walk(held, lambda x, *_: t.note(x, Category.PARAMETERS), names=False)


@atomic
class RoleHooks:
    """Global module / optimizer / saved-tensor hooks that tell the tracker what storages are."""

    def __init__(self, tracker: StorageTracker, namespaces: list[dict] | None = None) -> None:
        self.t = tracker
        self.params: dict[int, weakref.ref] = {}  # tensors hash by id but compare elementwise
        self.param_path: dict[int, str] = {}  # id(parameter) -> path of the module owning it
        self.optimizers: dict[int, weakref.ref] = {}  # whose step began (it may not end)
        self._names: dict[int, str] = {}  # id(module) -> its name in its parent (or root name)
        self._qual: dict[int, str] = {}  # id(module) -> its qualified name in its root
        self._paths: dict[int, str] = {}  # id(module) -> the first full path it ran under
        self._namespaces = namespaces or []  # where a root module's variable name is found
        self._handles: list = []
        self._parents: list = []  # modules whose forward runs, beside tracker.module_stack
        self._saved_ctx = None
        self._patches = Patches()  # torch's functions the hooks need changed while installed
        self.channel = _Channel(tracker)

    def _root_name(self, module, kind: type | None = None) -> str:
        """The name of a module called with no module running: its path in the outermost
        module of the notebook that contains it (``model.layers.1``, ``layers.1``), else
        the variable that holds it (``model``), else its type (``kind``: the type to name
        it by, for a compiled wrapper the module it wraps).

        The owner's path wins over a variable: in ``for l in model.layers: h = l(h)`` the
        loop variable ``l`` holds each layer in turn, and naming them all ``l`` would merge
        every layer's rows into one."""
        direct = owned = None
        for ns in self._namespaces:
            try:
                items = list(ns.items())
            except RuntimeError:  # the namespace changed while we looked
                continue
            for k, v in items:
                if not isinstance(k, str) or k.startswith("_") or not isinstance(v, torch.nn.Module):
                    continue
                if v is module:
                    direct = direct or k
                    continue
                path = _path_in(v, module)
                # the outermost owner gives the longest path (model.layers.1, not layers.1)
                if path and (owned is None or path.count(".") > owned[0]):
                    owned = (path.count("."), f"{k}.{path}")
        if owned is not None:
            return owned[1]
        return direct or _class_name(kind or type(module))

    def _pre_forward(self, module, args):
        t = self.t
        inner = _compiled_inner(module)
        if inner is not None:  # torch.compile's wrapper: the module it wraps stands for it
            if id(inner) not in self._names:
                if t.module_stack and self._parent is not None:
                    for child_name, child in _priv.child_modules(self._parent).items():
                        if child is module:
                            self._names[id(inner)] = child_name
                            break
                elif not t.module_stack:
                    self._names[id(inner)] = self._root_name(module, type(inner))
                    self._learn_paths(inner)
            return
        path = None if t.module_stack else self._paths.get(id(module))
        name = self._names.get(id(module))
        if path is None and name is None:
            if not t.module_stack:
                name = self._root_name(module)
                self._learn_paths(module)
            else:
                name = _class_name(type(module))
                parent = self._parent
                if parent is not None:
                    for child_name, child in _priv.child_modules(parent).items():
                        if child is module:
                            name = child_name
                            break
                    else:
                        mine, theirs = self._qual.get(id(module)), self._qual.get(id(parent))
                        if mine and theirs is not None and mine.startswith(theirs):
                            name = mine[len(theirs):].lstrip(".") or name
            self._names[id(module)] = name
        if path is None:
            # a module called with no module running whose path is known (checkpoint's
            # recompute of a block, a block called on its own) keeps that path
            path = f"{t.module_stack[-1]}.{name}" if t.module_stack else name
            self._paths.setdefault(id(module), path)
        owner = t.owner
        for p in _priv.own_parameters(module).values():
            if p is not None:
                t.note(p, Category.PARAMETERS)
                _note_quantization_state(t, p)
                self.params.setdefault(id(p), weakref.ref(p))
                self.param_path.setdefault(id(p), path)
                serial = t.serial_of(p)
                if serial is not None and serial not in owner:
                    owner[serial] = path
                if p.grad is not None:
                    t.note(p.grad, Category.GRADIENTS)
        for b in _priv.own_buffers(module).values():
            if b is not None:
                t.note(b, Category.BUFFERS)
        t.enter_module(path)
        self._parents.append(module)

    def _learn_paths(self, root: torch.nn.Module) -> None:
        """The qualified names of what a root contains, so that a module called from a
        container that is never called itself (a ModuleList) is named by its path
        ("blocks.1"), not its type (also inside a ``torch.compile`` wrapper)."""
        try:
            self._qual.update((id(m), qn) for qn, m in root.named_modules())
        except Exception:
            pass

    def _param_registered(self, module, name, param):
        if param is not None:
            self.t.note(param, Category.PARAMETERS)
            self.params.setdefault(id(param), weakref.ref(param))

    def _buffer_registered(self, module, name, buffer):
        if buffer is not None:
            self.t.note(buffer, Category.BUFFERS)

    @property
    def _parent(self):
        return self._parents[-1] if self._parents else None

    def _post_forward(self, module, args, output):
        if _compiled_inner(module) is not None:
            return
        t = self.t
        t.exit_module()
        cache = getattr(output, "past_key_values", None)
        if cache is not None and not self._parents[:-1]:  # the outermost model's output
            t.note_cache(cache)
        if self._parents:
            self._parents.pop()
        for b in _priv.own_buffers(module).values():  # BatchNorm replaces running stats in place or anew
            if b is not None:
                t.note(b, Category.BUFFERS)

    def _optimizer(self, opt, args, kwargs, *, post: bool) -> None:
        t = self.t
        if not post:
            try:
                self.optimizers.setdefault(id(opt), weakref.ref(opt))
            except TypeError:
                pass
        for group in opt.param_groups:
            for p in group["params"]:
                t.note(p, Category.PARAMETERS)
                self.params.setdefault(id(p), weakref.ref(p))
                if p.grad is not None:
                    t.note(p.grad, Category.GRADIENTS)
        for state in opt.state.values():
            if isinstance(state, dict):
                for v in state.values():
                    t.note(v, Category.OPTIMIZER_STATE)
        t.phase_override = None if post else "optimizer"
        t.step_label = None if post else type(opt).__name__

    @staticmethod
    def _pack(tensor):
        marks = []
        quiet = []
        try:
            for hooks in _ACTIVE_HOOKS:
                t = hooks.t
                serial = t.serial_of(tensor)
                if serial is not None:
                    t.saved(serial, +1)
                    marks.append((hooks.channel, serial))
                t.quiet += 1  # the pack's own detach is not an op of the program
                quiet.append(t)
            return _Saved(tensor, marks)
        finally:
            for t in quiet:
                t.quiet -= 1

    @staticmethod
    def _unpack(packed):
        return packed.unpack()

    def install(self) -> None:
        reg = self._handles.append
        reg(_module_mod.register_module_parameter_registration_hook(self._param_registered))
        reg(_module_mod.register_module_buffer_registration_hook(self._buffer_registered))
        reg(_module_mod.register_module_forward_pre_hook(self._pre_forward))
        reg(_module_mod.register_module_forward_hook(self._post_forward, always_call=True))
        reg(register_optimizer_step_pre_hook(lambda o, a, k: self._optimizer(o, a, k, post=False)))
        reg(register_optimizer_step_post_hook(lambda o, a, k: self._optimizer(o, a, k, post=True)))
        if not _ACTIVE_HOOKS:
            # read how this torch words its in-place error while its own check still runs
            # (the hooks below switch it off; _Saved.unpack makes it, in the same words)
            _priv.version_error_names_forward_op()
            self._saved_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saved_ctx.__enter__()
            self._let_functorch_run(self._saved_ctx.pack_hook)
        _ACTIVE_HOOKS.append(self)

    def _let_functorch_run(self, pack_hook: Callable) -> None:
        """torch.func's ``grad``, ``vjp``, ``jacrev`` and ``hessian`` refuse to run with any
        saved-tensor hooks installed (``disable_saved_tensors_hooks``): while one runs, ours
        are lifted where they are the only ones (what it saves then counts as "other", not
        as a module's activations); the user's own hooks still refuse it, as without
        memmagic."""
        original = torch.autograd.graph.disable_saved_tensors_hooks

        @contextlib.contextmanager
        def disable_saved_tensors_hooks(error_message: str):
            with _priv.saved_tensors_hooks_lifted(pack_hook), original(error_message):
                yield

        self._patches.set(torch.autograd.graph, "disable_saved_tensors_hooks",
                          disable_saved_tensors_hooks)

    def final_notes(self) -> None:
        """At the end: gradients of every parameter seen are gradients, and the state of
        every optimizer whose step began is optimizer state (a step that ran out of memory
        while making it never reached the post-step hook)."""
        for ref in list(self.optimizers.values()):
            opt = ref()
            for state in (opt.state.values() if opt is not None else ()):
                if isinstance(state, dict):
                    for v in state.values():
                        self.t.note(v, Category.OPTIMIZER_STATE)
        owner = self.t.owner
        for key, ref in list(self.params.items()):
            p = ref()
            if p is None:
                continue
            self.t.note(p, Category.PARAMETERS)  # .to()/.half() gave it a new storage
            _note_quantization_state(self.t, p)
            path = self.param_path.get(key)
            serial = self.t.serial_of(p)
            if path is not None and serial is not None:
                owner.setdefault(serial, path)
            if p.grad is not None:
                self.t.note(p.grad, Category.GRADIENTS)
                serial = self.t.serial_of(p.grad)
                if path is not None and serial is not None:
                    owner.setdefault(serial, path)

    def uninstall(self) -> None:
        self.channel.tracker = None
        try:
            if self in _ACTIVE_HOOKS:
                _ACTIVE_HOOKS.remove(self)
            if self._saved_ctx is not None:
                self._saved_ctx.__exit__(None, None, None)
                self._saved_ctx = None
        finally:
            self._patches.restore()
            for h in self._handles:
                h.remove()
            self._handles.clear()


# -- torch.compile'd code ------------------------------------------------------------------
class EagerCompiled:
    """Runs ``torch.compile``'d code eagerly while installed, and counts its calls.

    Dynamo does not trace under a dispatch mode such as the tracker: it skips the frame and
    marks its code "skip" for good, so the function would never compile again in the
    session. Under the stance ``"force_eager"`` (``torch.compiler.set_stance``) dynamo never
    sees the frame and its caches stay as they were; a later call outside the
    measurement compiles as usual. ``calls`` counts calls of compiled functions and
    modules (through dynamo's private callback-from-stance function, asked once per
    call for the callback to use; absent, the calls are not counted).
    """

    def __init__(self) -> None:
        self.calls = 0
        self._stance = None
        self._module = None
        self._name = ""
        self._wrapped = None
        self._filter = None

    def install(self) -> None:
        set_stance = getattr(torch.compiler, "set_stance", None)
        if set_stance is None:  # torch < 2.6: nothing to do it with
            return
        try:
            self._stance = set_stance("force_eager")
        except RuntimeError:  # measuring from inside a compiled region: leave dynamo alone
            return
        # a compiled module warns on every call while the tracking's global module hooks
        # are installed: they are memmagic's, not the program's
        before = list(warnings.filters)
        warnings.filterwarnings("ignore", message=_HOOKS_WARNING, category=UserWarning)
        if warnings.filters[0] not in before:
            self._filter = warnings.filters[0]
        slot = _priv.dynamo_stance_callback_slot()
        if slot is None:
            return
        module, name = slot
        original = getattr(module, name)

        def callback_from_stance(callback):
            if callback is not None and callback is not False:  # a compiled callable runs
                self.calls += 1
            return original(callback)

        self._module, self._name, self._wrapped = module, name, original
        setattr(module, name, callback_from_stance)

    def uninstall(self) -> None:
        try:
            if self._module is not None:
                setattr(self._module, self._name, self._wrapped)
                self._module = self._wrapped = None
        finally:
            try:
                if self._filter is not None:
                    _remove_warning_filter(self._filter)
                    self._filter = None
            finally:
                if self._stance is not None:
                    stance, self._stance = self._stance, None
                    stance.__exit__(None, None, None)


atomic(EagerCompiled.install)  # (not its callback: that one runs the user's compiled code)
atomic(EagerCompiled.uninstall)

_HOOKS_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks on modules"


def _remove_warning_filter(entry: tuple) -> None:
    """Take out the one filter ``warnings.filterwarnings`` added (the program's own, added
    since, stay)."""
    try:
        warnings.filters.remove(entry)
    except ValueError:  # the program reset the filters: nothing of ours is left
        return
    mutated = getattr(warnings, "_filters_mutated", None)  # drop the registries' cached verdicts
    if mutated is not None:
        mutated()


def _path_in(owner: torch.nn.Module, module: torch.nn.Module) -> str | None:
    """The qualified name of ``module`` inside ``owner`` (``layers.1``), with compiled
    wrappers seen through (their ``_orig_mod`` is no part of a path); None when ``owner``
    does not contain it, or contains it only as the module a compiled wrapper wraps."""
    try:
        for qn, m in owner.named_modules():
            if m is module and qn:
                path = ".".join(p for p in qn.split(".") if p != "_orig_mod")
                return path or None
    except Exception:  # a module that cannot list its children
        return None
    return None


def _class_name(cls: type) -> str:
    """A module's class name as the user wrote it: FSDP2's ``fully_shard`` swaps a module's
    class for ``FSDP<Name>(FSDPModule, <Name>)``, which is not a class of theirs."""
    bases = cls.__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule" and cls.__name__ == f"FSDP{bases[1].__name__}":
        cls = bases[1]
    return cls.__name__


def _compiled_inner(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module a ``torch.compile(module)`` wrapper (``OptimizedModule``) wraps, else None."""
    return _priv.compiled_inner(module)


# -- the context manager the backends use -----------------------------------------------
def _namespaces(roots) -> list[dict]:
    """The dicts among ``roots`` (a notebook's namespace): where root modules are named."""
    if isinstance(roots, dict):
        return [roots]
    return [r for r in (roots or ()) if isinstance(r, dict)]


@atomic
class Tracking:
    """Track live storages while the body runs; ``result`` is set on exit (also on error).

    Installs a dispatch mode, global module and optimizer hooks and saved-tensor hooks,
    and removes all of them in ``finally``. Exceptions are never swallowed.
    """

    def __init__(self, include: IncludeFn, round_bytes: Callable[[int], int] = _identity,
                 *, seed: bool = True, roots: Iterable[object] | None = None) -> None:
        """``seed``: count the tensors that exist already in ``before``. They are found by
        walking from ``roots`` (e.g. a notebook's namespace) when given, else, or when
        that walk is too large, through the garbage collector (complete but slower)."""
        self.tracker = StorageTracker(include, round_bytes)
        self._roots = roots
        self._hooks = RoleHooks(self.tracker, _namespaces(roots))
        self._compiled = EagerCompiled()
        self._seed = seed
        self.result: TrackResult | None = None
        self.wall_s = 0.0
        self._t0 = 0.0

    def __enter__(self) -> "Tracking":
        if self._seed:
            found = reachable_existing(self._roots) if self._roots is not None else None
            self.tracker.seed(scan_existing() if found is None else found)
        try:
            self._compiled.install()
            self._hooks.install()
            try:
                self.tracker.__enter__()
            except BaseException:
                self._hooks.uninstall()
                raise
        except BaseException:
            self._compiled.uninstall()
            raise
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, et, ev, tb) -> bool:
        self.wall_s = time.perf_counter() - self._t0
        try:
            self.tracker.__exit__(et, ev, tb)
        finally:
            try:
                self._hooks.uninstall()
            finally:
                try:
                    self._compiled.uninstall()
                finally:
                    self._finish()
        return False

    def _note_modules(self) -> None:
        """Parameters and buffers of the modules the roots hold (a namespace) are what they
        are, even when no forward ran: ``.cuda()``/``.to()`` replace buffers without the
        registration hook (``Module._apply`` assigns ``_buffers`` directly)."""
        roots = self._roots
        if not isinstance(roots, dict):
            return
        t = self.tracker
        for value in list(roots.values()):
            items = value if isinstance(value, (list, tuple)) else (value,)
            for v in items:
                if not isinstance(v, torch.nn.Module):
                    continue
                try:
                    for b in v.buffers():
                        t.note(b, Category.BUFFERS)
                    for p in v.parameters():
                        t.note(p, Category.PARAMETERS)
                        if p.grad is not None:
                            t.note(p.grad, Category.GRADIENTS)
                except Exception:  # a module that cannot list its tensors: leave it
                    continue

    def _finish(self) -> None:
        t = self.tracker
        try:
            self._hooks.final_notes()
            self._note_modules()
        finally:
            t.close()
        trace = t.trace()
        self.result = TrackResult(
            before=t.before["device"],
            peak=t.peak["device"],
            after=t.current["device"],
            breakdown=trace.breakdown_at(t.peak_event),
            peak_op=t.peak_op,
            peak_module=t.peak_module,
            peak_phase=t.peak_phase,
            host_before=t.before["host"],
            host_peak=t.peak["host"],
            host_after=t.current["host"],
            ops=t.ops,
            timeline=[(op, sum(c.values())) for op, c in trace.timeline()],
            breakdown_before=trace.breakdown_at(-1),
            compiled_calls=self._compiled.calls,
            trace=trace,
            peak_label=t.peak_label,
        )
