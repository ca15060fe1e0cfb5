"""Rewriting the CUDA device onto fake CPU tensors, and tracking which storages are on
the simulated GPU.

A FakeTensor on the CUDA device cannot be used on a CPU-only build (autograd on one
aborts the process), so every tensor of the simulation is a fake *CPU* tensor, and this
module keeps the fiction:

* :class:`DeviceRewriteMode` (a TorchFunctionMode) rewrites ``device="cuda"`` arguments,
  ``.cuda()``, ``.cpu()``, ``.to(...)`` (which copy between "devices", as on a GPU) and the
  default device, answers ``Tensor.device``/``is_cuda`` with ``cuda:0`` for tensors on the
  simulated GPU, and returns placeholders for ``.tolist()``/``.numpy()``;
* :class:`SimTracker` (the StorageTracker's dispatch mode, extended) rewrites ``device=``
  again at the dispatch level (function modes are off inside ``backward()`` and
  checkpoint recompute), decides for each new storage whether it lives on the simulated
  GPU ("device") or on the host, rounds device storages like the CUDA allocator, feeds
  them to the allocator model (which may raise a simulated out-of-memory), answers
  ``.item()`` with a placeholder when the value is unknown, and enforces the op/time budget;
* the same dispatch step raises :class:`SimulatedDeviceMismatchError` where CUDA would
  raise "Expected all tensors to be on the same device": an op mixing a tensor on the
  simulated GPU with a CPU tensor that is not a 0-dim scalar (indexing with CPU indices,
  copies and the other ops CUDA lets cross devices are allowed). Only devices the
  simulation knows count: a factory called from C++ (a composite op, a backward formula)
  takes the device of some tensor's options, which the simulation cannot see, so such
  storages and what is computed from them are "unsure" and never reported. Backward is
  not checked (its ops follow a forward that passed the check).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from ... import _torch_private as _priv
from ...report import Category, format_bytes
from ...snapshot import allocator_history, allocator_segments
from ...tracking import StorageTracker, Entry
from .allocator import AllocatorFull, CachingAllocatorModel, round_request
from .kernels import mkldnn_rnn_workspace
from .workspaces import BLAS_OPS, Workspaces
from .errors import (
    RERUN_HINT,
    SimulatedDeviceMismatchError,
    SimulatedOutOfMemoryError,
    SimulationBudgetExceeded,
    SimulationUnsupported,
)

__all__ = ["SimState", "DeviceRewriteMode", "SimTracker", "is_cuda_device", "CUDA0", "CPU"]

CUDA0 = torch.device("cuda", 0)
CPU = torch.device("cpu")
META = torch.device("meta")
_aten = torch.ops.aten
_LOCAL_SCALAR = _aten._local_scalar_dense.default
_PRIM_DEVICE = torch.ops.prim.device.default
_RNN_LAYER = _aten.mkldnn_rnn_layer.default
_RNN_LAYER_BACKWARD = _aten.mkldnn_rnn_layer_backward.default
_BATCH_NORMS = {_aten.native_batch_norm.default, _aten._native_batch_norm_legit.default,
                _aten._native_batch_norm_legit_functional.default,
                _aten._native_batch_norm_legit.no_stats}
_BN_UPDATES = {_aten.native_batch_norm.default, _aten._native_batch_norm_legit.default}
_HALF = (torch.float16, torch.bfloat16)
_FOUND_INF_OPS = {_aten._amp_foreach_non_finite_check_and_unscale_.default}


_DEVICE_KINDS: dict[object, bool] = {}
_OTHER_OK = ("cpu", "meta")


def is_cuda_device(dev: object) -> bool | None:
    """True for the simulated GPU (``'cuda'``, ``'cuda:0'``, ``torch.device('cuda')``,
    the index ``0``), False for the CPU or meta, None for "not a device". Raises
    :class:`SimulationUnsupported` for a device the simulation does not have (a second
    GPU, ``'mps'``, ``'xpu'``...), as a real machine with one CUDA GPU would fail there."""
    if isinstance(dev, bool) or not isinstance(dev, (torch.device, str, int)):
        return None
    try:
        return _DEVICE_KINDS[dev]
    except (KeyError, TypeError):
        pass
    if isinstance(dev, int):
        d = torch.device("cuda", dev) if dev >= 0 else None
    else:
        try:
            d = torch.device(dev)
        except (RuntimeError, ValueError):
            return None  # not a device string: torch raises its own error
    name = str(dev) if isinstance(dev, torch.device) else dev
    if d is None or (d.type == "cuda" and d.index not in (None, 0)):
        raise SimulationUnsupported(
            f"device {name!r} is not simulated: the simulated machine has one GPU, cuda:0; "
            "use device='cuda' (or 'cuda:0')")
    if d.type != "cuda" and d.type not in _OTHER_OK:
        raise SimulationUnsupported(
            f"device {name!r} is not simulated: the simulation models one CUDA GPU; use "
            "device='cuda' for the GPU or 'cpu' for the host")
    kind = d.type == "cuda"
    try:
        _DEVICE_KINDS[dev] = kind
    except TypeError:
        pass
    return kind


def _int_device(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``t.to(0)`` / ``device=0``: an int is a CUDA index, which ``_parse_to`` would resolve
    through the (absent) accelerator: name the device instead."""
    if args and isinstance(args[0], int) and not isinstance(args[0], bool):
        is_cuda_device(args[0])  # raises for another index
        args = (CUDA0, *args[1:])
    dev = kwargs.get("device")
    if isinstance(dev, int) and not isinstance(dev, bool):
        is_cuda_device(dev)
        kwargs = {**kwargs, "device": CUDA0}
    return args, kwargs


class SimState:
    """What the function mode and the dispatch mode share during one simulated run."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda                  # False: kernels="cpu", the simulated GPU is the CPU
        self.target: str | None = None    # pool forced for storages created right now
        self.pending = "host"             # pool of the storages the current op creates
        self.default_cuda = False         # torch.set_default_device("cuda") was called
        self.cuda_seen = False
        self.zero_read_serials: set[int] = set()  # storages whose reads are 0 (found_inf)
        self.data_reads = 0
        # (user line or None, what) -> reads: the report names lines, not internal reads
        self.read_ops: dict[tuple[str | None, str], int] = {}
        self.tracker: "SimTracker | None" = None
        self.in_dispatch = 0              # >0 while torch's own dispatch code runs
        self.rnn_ran = False              # an RNN layer ran in this cell

    def begin_run(self) -> None:
        """Per-cell counters back to zero (the state of a persistent simulated GPU lasts
        across cells: its default device and its tensors' pools stay)."""
        self.target = None
        self.pending = "host"
        self.cuda_seen = False
        self.data_reads = 0
        self.read_ops = {}
        self.in_dispatch = 0
        self.rnn_ran = False

    def fake_device(self, t: torch.Tensor, real: torch.device) -> torch.device:
        """``FakeTensor.device`` during a run: cuda:0 for tensors on the simulated GPU, as
        seen by user and torch Python code; the real (CPU) device inside dispatch."""
        if self.in_dispatch or not self.cuda or real.type != "cpu":
            return real
        return CUDA0 if self.pool_of(t) == "device" else real

    def note_read(self, what: str) -> None:
        """A read of values the simulation does not have, counted by the user's line."""
        self.data_reads += 1
        where = user_line(sys._getframe(1))
        key = (where, what)
        self.read_ops[key] = self.read_ops.get(key, 0) + 1

    def pool_of(self, t: torch.Tensor) -> str:
        if not self.cuda:
            return "device"
        tr = self.tracker
        if tr is None:
            return "host"
        try:
            entry = tr.entry_of(t)
        except (RuntimeError, NotImplementedError, TypeError):
            return "host"
        return "host" if entry is None else entry.pool


_TORCH_DIR = os.path.dirname(torch.__file__)
_MEMMAGIC_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_STDLIB = os.path.dirname(os.__file__)


def is_user_file(filename: str) -> bool:
    """Whether code in ``filename`` is the user's (a cell, their module), not torch's,
    memmagic's, the standard library's or an installed package's."""
    return not (filename.startswith((_TORCH_DIR, _MEMMAGIC_DIR, _STDLIB))
                or "site-packages" in filename or "dist-packages" in filename)


def user_line(frame) -> str | None:
    """'line N (`source`)' of the innermost frame of the user's code, from ``frame`` out."""
    import linecache

    while frame is not None:
        code = frame.f_code
        if is_user_file(code.co_filename):
            src = linecache.getline(code.co_filename, frame.f_lineno).strip()
            return f"line {frame.f_lineno}" + (f" (`{src}`)" if src else "")
        frame = frame.f_back
    return None


class SimulatedFloat(float):
    """A float a simulated read returns in place of a value the simulation does not have:
    it computes as its number and prints with a mark, so it is not taken for a result."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"{float.__repr__(self)}(simulated)"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return float.__format__(self, spec) + "(simulated)"


class SimulatedInt(int):
    """The int counterpart of :class:`SimulatedFloat`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"{int.__repr__(self)}(simulated)"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return int.__format__(self, spec) + "(simulated)"


def _marked_arith(cls, base):
    """Arithmetic on a marked placeholder gives a marked result (``total += loss.item()``)."""
    def wrap(name):
        op = getattr(base, name)

        def method(self, *args):
            out = op(self, *args)
            if type(out) is float:
                return SimulatedFloat(out)
            if type(out) is int:
                return SimulatedInt(out)
            return out
        method.__name__ = name
        return method

    for name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
                 "__truediv__", "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__",
                 "__rmod__", "__pow__", "__rpow__", "__neg__", "__pos__", "__abs__"):
        if hasattr(base, name):
            setattr(cls, name, wrap(name))


_marked_arith(SimulatedFloat, float)
_marked_arith(SimulatedInt, int)


def placeholder_scalar(dtype: torch.dtype, zero: bool = False) -> Any:
    """The value a simulated read of a tensor element returns: 1.0 for floats, 0 for ints
    (marked: they print as ``1.0(simulated)``), False for bools; ``zero``: a value known to
    be 0 (GradScaler's found_inf without infs), unmarked."""
    if dtype == torch.bool:
        return False
    if dtype.is_floating_point:
        return 0.0 if zero else SimulatedFloat(1.0)
    if dtype.is_complex:
        return complex(0.0 if zero else 1.0)
    return 0 if zero else SimulatedInt(0)


_NUMPY_DTYPES = {
    torch.float64: "float64", torch.float32: "float32", torch.float16: "float16",
    torch.bfloat16: "float32", torch.int64: "int64", torch.int32: "int32", torch.int16: "int16",
    torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool", torch.complex64: "complex64",
    torch.complex128: "complex128",
}


def _nested(shape: tuple[int, ...], value: Any) -> Any:
    if not shape:
        return value
    return [_nested(shape[1:], value) for _ in range(shape[0])]


# Ops that take tensors on different devices on CUDA (device_check: NoCheck in
# native_functions.yaml, not TensorIterator-based): copies, views of another tensor's
# shape, storage swaps, the CTC losses (targets and lengths may stay on the CPU).
_ANY_DEVICE = {"copy_", "copy", "_copy_from", "_copy_from_and_resize", "_to_copy", "to",
               "lift", "lift_fresh", "lift_fresh_copy", "set_", "is_set_to", "is_same_size",
               "_has_same_storage_numel", "expand_as", "view_as", "reshape_as",
               "broadcast_tensors", "empty_like", "resize_as_", "_foreach_copy_", "_foreach_copy",
               "ctc_loss", "_ctc_loss", "_ctc_loss_backward", "_cudnn_ctc_loss",
               "_use_cudnn_ctc_loss", "record_stream", "_resize_output_"}
_INDEX_OPS = {"index", "_unsafe_index", "index_put", "index_put_", "_index_put_impl_",
              "_unsafe_index_put"}


# Factories whose values follow from their arguments alone: a small output is computed
# for real and carried as the fake tensor's constant, so FakeTensorMode propagates real
# values through ops on such constants (up to CONSTANT_NUMEL) and reads give real numbers.
CONSTANT_NUMEL = 4096
_VALUE_FACTORIES = {
    _aten.arange.default, _aten.arange.start, _aten.arange.start_step, _aten.linspace.default,
    _aten.logspace.default, _aten.zeros.default, _aten.ones.default, _aten.full.default,
    _aten.eye.default, _aten.eye.m, _aten.scalar_tensor.default, _aten.tril_indices.default,
    _aten.triu_indices.default,
}


# Factories from another tensor whose values are one fill value: (op, the fill from args)
_FILL_FACTORIES = {
    _aten.ones_like.default: lambda a, k: 1, _aten.zeros_like.default: lambda a, k: 0,
    _aten.full_like.default: lambda a, k: a[1], _aten.new_ones.default: lambda a, k: 1,
    _aten.new_zeros.default: lambda a, k: 0, _aten.new_full.default: lambda a, k: a[2],
}
_VALUE_FACTORIES = _VALUE_FACTORIES | set(_FILL_FACTORIES)
# ops whose result a known operand decides alone: x | True, x & False, x * 0 (a GPU's
# stopping criteria: ``unfinished & ~(max_len_done | eos_hit)``)
_OR_OPS = {_aten.bitwise_or.Tensor, _aten.logical_or.default}
# ops whose outputs hold no values (uninitialized memory): never constants
_UNINITIALIZED = {_aten.empty.memory_format, _aten.empty_like.default, _aten.new_empty.default,
                  _aten.new_empty_strided.default, _aten.empty_strided.default,
                  _aten.empty_permuted.default}
_AND_OPS = {_aten.bitwise_and.Tensor, _aten.logical_and.default, _aten.mul.Tensor}


def _with_values(func, args, kwargs, out):
    """``out`` (a fake factory output) with its real values as its constant, when small."""
    if (not isinstance(out, torch.Tensor) or out.numel() > CONSTANT_NUMEL
            or out.dtype.is_complex or _priv.fake_constant(out) is not None):
        return out
    mode = getattr(out, "fake_mode", None)
    if mode is None:
        return out
    fill = _FILL_FACTORIES.get(func)
    with _priv.no_python_modes():
        if fill is not None:
            real = torch.full(tuple(out.shape), fill(args, kwargs), dtype=out.dtype)
        else:
            real = func(*args, **{**kwargs, "device": CPU})
    return _priv.constant_fake(mode, real, out)


def _drop_unfounded(args, kwargs, out) -> None:
    """Outputs may carry values only when every tensor input did: the meta kernels of ops
    on unknown data (``_embedding_bag``) make their outputs with ``new_empty`` on a known
    input, which FakeTensorMode turns into constants of uninitialized memory."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if not any(getattr(o, "constant", None) is not None for o in outs if isinstance(o, torch.Tensor)):
        return
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (tuple, list)) else (a,)):
            if _priv.is_fake(t) and t.constant is None:  # real tensors are known
                for o in outs:
                    if isinstance(o, torch.Tensor):
                        _priv.drop_constant(o)
                return


_WRITTEN: dict = {}


def _written_args(func) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments ``func`` writes to, from its schema (cached)."""
    w = _WRITTEN.get(func)
    if w is None:
        schema = _priv.op_schema(func)
        w = tuple((i, p.name) for i, p in enumerate(schema.arguments if schema else ())
                  if p.alias_info is not None and p.alias_info.is_write)
        _WRITTEN[func] = w
    return w


def _drop_unfounded_in_place(func, args, kwargs) -> None:
    """After an in-place op (``add_``, ``native_batch_norm``'s running stats,
    ``_foreach_lerp_``): a written tensor keeps its values only when every tensor it was
    computed from had values. FakeTensorMode forgets the constant of a tensor an op writes
    to, but not of tensors inside a list argument (Adam's small moment buffers would stay
    zeros forever), not on a hit of its own dispatch cache, and not when the op cache
    answered instead of it."""
    for i, name in _written_args(func):
        target = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(target, torch.Tensor):
            target = (target,)
        elif not isinstance(target, (list, tuple)):
            continue
        if not any(getattr(t, "constant", None) is not None for t in target):
            continue
        lists, singles = [], []
        for a in (*args, *kwargs.values()):
            if a is target:
                continue
            if isinstance(a, (list, tuple)) and len(a) == len(target) and len(target) > 1:
                lists.append(a)
            elif isinstance(a, torch.Tensor):
                singles.append(a)
            elif isinstance(a, (list, tuple)):
                singles.extend(t for t in a if isinstance(t, torch.Tensor))
        unknown = any(_priv.is_fake(t) and t.constant is None for t in singles)
        for j, t in enumerate(target):
            if getattr(t, "constant", None) is None:
                continue
            if unknown or any(isinstance(lst[j], torch.Tensor) and _priv.is_fake(lst[j])
                              and lst[j].constant is None for lst in lists):
                _priv.drop_constant(t)


def _absorbed(func, args, out):
    """``out`` with its values where one known operand decides them (all-True for or,
    all-False or zero for and/mul); ``out`` unchanged otherwise."""
    if (not isinstance(out, torch.Tensor) or out.numel() > CONSTANT_NUMEL
            or _priv.fake_constant(out) is not None or len(args) < 2):
        return out
    mode = getattr(out, "fake_mode", None)
    if mode is None:
        return out
    for a in args[:2]:
        const = _priv.fake_constant(a) if isinstance(a, torch.Tensor) else None
        if const is None:
            continue
        with _priv.no_python_modes():
            if func in _OR_OPS and out.dtype == torch.bool and bool(const.all()):
                return _priv.constant_fake(mode, torch.ones(tuple(out.shape), dtype=torch.bool), out)
            if func in _AND_OPS and not bool(const.any()) and not out.dtype.is_floating_point:
                return _priv.constant_fake(mode, torch.zeros(tuple(out.shape), dtype=out.dtype), out)
    return out


def _device_rule(func) -> str:
    """How CUDA checks the devices of ``func``'s inputs: "any" (no check), "index" (indices
    on the CPU or on the indexed tensor's device), "lists" (foreach and fused optimizer
    ops: the tensor lists agree; scalar and lr tensors may stay on the CPU) or "same"."""
    packet = getattr(func, "overloadpacket", None)
    name = getattr(packet, "__name__", "") or str(func)
    if getattr(func, "namespace", "aten") != "aten" or name in _ANY_DEVICE:
        return "any"
    if name in _INDEX_OPS:
        return "index"
    if name.startswith(("_foreach_", "_fused_")):
        return "lists"
    return "same"


def _op_info(func) -> tuple[bool, str, bool]:
    """(mutates its inputs, name, outputs need a fix-up) of an op, computed once."""
    schema = _priv.op_schema(func)
    mutating = bool(schema is not None and schema.is_mutable) or func in _FOUND_INF_OPS
    fixup = func is _RNN_LAYER or func is _RNN_LAYER_BACKWARD or func in _BATCH_NORMS
    return mutating, func.__name__, fixup


def _fix_outputs(func, args, kwargs, out):
    """Outputs where the fake (meta) kernel differs from the real kernel's memory."""
    if func is _RNN_LAYER:
        if out[3].numel() == 0:
            ws = mkldnn_rnn_workspace(args, kwargs)
            if ws:
                out = (*out[:3], args[0].new_empty((ws,), dtype=torch.uint8))
    elif func is _RNN_LAYER_BACKWARD:
        if out[3] is out[4]:
            # the meta kernel returns one bias gradient twice; the real kernel returns two
            out = (*out[:4], torch.empty_like(out[3]), *out[5:])
    else:  # batch norms
        if func in _BN_UPDATES and len(args) > 5 and args[5] is True:
            # training updates the running stats (the schema does not say it writes them,
            # so nothing else forgets their values)
            for t in args[3:5]:
                if isinstance(t, torch.Tensor):
                    _priv.drop_constant(t)
        if out[1].dtype in _HALF:
            # the CPU and CUDA kernels keep the saved mean/invstd in fp32 for half inputs
            out = (out[0], *(o.new_empty(o.shape, dtype=torch.float32) for o in out[1:3]),
                   *out[3:])
    # made below the simulation's dispatch: FakeTensorMode keeps new_empty of a tensor that
    # carries a constant as a constant of uninitialized memory
    for o in out:
        if isinstance(o, torch.Tensor):
            _priv.drop_constant(o)
    return out


# -- function level -------------------------------------------------------------------------
class DeviceRewriteMode(TorchFunctionMode):
    """See the module docstring. Cheap for ordinary calls: one dict lookup and a kwargs check."""

    def __init__(self, state: SimState) -> None:
        super().__init__()
        self.s = state
        T = torch.Tensor
        h: dict[Callable, Callable] = {
            T.cuda: self._cuda, T.cpu: self._cpu, T.to: self._to,
            T.pin_memory: self._pin_memory, T.is_pinned: lambda f, a, k: False,
            T.type_as: lambda f, a, k: self._to(T.to, (a[0], a[1]), {}),
            T.new_tensor: self._new, T.new: self._new,
            T.tolist: self._tolist, T.numpy: self._numpy, T.__array__: self._array,
            T.__repr__: self._repr, T.__str__: self._repr,
            _priv.PARSE_TO_FUNCTION: self._parse_to, T.__deepcopy__: self._deepcopy,
            T.item: self._marked_read,  # (int(t) and float(t) return plain numbers: Python
                                        # makes exact ints and floats of what __int__ gives)
            T.data.__set__: self._set_data,
            T.record_stream: lambda f, a, k: None,  # one stream: nothing to wait for
        }
        if state.cuda:
            h.update({
                torch.device: self._device,
                T.is_cuda.__get__: self._is_cuda,
                T.is_cpu.__get__: lambda f, a, k: self.s.pool_of(a[0]) != "device",
                T.get_device: lambda f, a, k: 0 if self.s.pool_of(a[0]) == "device" else -1,
            })
        self._handlers = h
        self._factories = _priv.device_constructors()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        handler = self._handlers.get(func)
        if handler is not None:
            return handler(func, args, kwargs or {})
        if kwargs:
            dev = kwargs.get("device")
            if dev is not None:
                cuda = is_cuda_device(dev)
                if cuda is not None:
                    kwargs = dict(kwargs)
                    kwargs["device"] = CPU
                    return self._call(func, args, kwargs, "device" if (cuda or not self.s.cuda) else "host")
        if func in self._factories:
            # a factory with no device: on the CPU, or on the GPU after
            # set_default_device("cuda") (which also moves ``torch.tensor(t)``); a tensor
            # argument (``torch.tensor(t)``, ``as_tensor(t)``) keeps its own device
            if self.s.default_cuda:
                return self._call(func, args, kwargs or {}, "device")
            if self.s.cuda and not (args and isinstance(args[0], torch.Tensor)):
                return self._call(func, args, kwargs or {}, "host")
        return func(*args, **kwargs) if kwargs else func(*args)

    def _call(self, func, args, kwargs, pool: str):
        s = self.s
        prev, s.target = s.target, pool
        try:
            return func(*args, **kwargs)
        finally:
            s.target = prev

    # -- properties --------------------------------------------------------------------
    def _is_cuda(self, func, args, kwargs):
        return self.s.pool_of(args[0]) == "device"

    # -- moves ------------------------------------------------------------------------
    def _move(self, t: torch.Tensor, dst: str, dtype=None, non_blocking=False, copy=False,
              memory_format=torch.preserve_format) -> torch.Tensor:
        s = self.s
        if s.cuda and s.pool_of(t) != dst:
            copy = True
        if not s.cuda:
            dst = "device"
        return self._call(torch.Tensor.to, (t,), dict(
            device=CPU, dtype=dtype, non_blocking=non_blocking, copy=copy,
            memory_format=memory_format), dst)

    def _cuda(self, func, args, kwargs):
        t = args[0]
        dev = args[1] if len(args) > 1 else kwargs.get("device")
        if dev is not None and is_cuda_device(dev) is False:
            raise SimulationUnsupported(f".cuda({dev!r}) is not a CUDA device; {RERUN_HINT}")
        return self._move(t, "device", non_blocking=kwargs.get("non_blocking", False),
                          memory_format=kwargs.get("memory_format", torch.preserve_format))

    def _cpu(self, func, args, kwargs):
        t = args[0]
        if self.s.cuda and self.s.pool_of(t) == "device":
            return self._move(t, "host", memory_format=kwargs.get("memory_format", torch.preserve_format))
        return t

    def _parse_to(self, func, args, kwargs):
        """``nn.Module.to``'s parser: the simulated device of a tensor argument, an int
        index as cuda:N (the real parser would ask the absent accelerator)."""
        if args and isinstance(args[0], torch.Tensor):
            other = args[0]
            device = CUDA0 if self.s.cuda and self.s.pool_of(other) == "device" else CPU
            non_blocking = kwargs.get("non_blocking", args[1] if len(args) > 1 else False)
            return device, other.dtype, non_blocking, kwargs.get("memory_format")
        args, kwargs = _int_device(args, kwargs)
        return func(*args, **kwargs)

    def _to(self, func, args, kwargs):
        t, rest = args[0], args[1:]
        copy = kwargs.get("copy", False)
        if rest and isinstance(rest[0], torch.Tensor):  # t.to(other, non_blocking, copy)
            other = rest[0]
            device = CUDA0 if self.s.pool_of(other) == "device" and self.s.cuda else CPU
            dtype, non_blocking = other.dtype, kwargs.get("non_blocking", rest[1] if len(rest) > 1 else False)
            memory_format = kwargs.get("memory_format", torch.preserve_format)
        else:
            pk = {k: v for k, v in kwargs.items() if k != "copy"}
            rest, pk = _int_device(rest, pk)
            device, dtype, non_blocking, memory_format = _priv.parse_to(*rest, **pk)
            if memory_format is None:
                memory_format = torch.preserve_format
        if device is not None:
            is_cuda_device(device)  # a device the simulation does not have: say so
        if device is None:
            dst = self.s.pool_of(t)
        elif device.type == "cuda":
            dst = "device"
        elif device.type == "cpu":
            dst = "host"
        else:  # meta and friends: nothing to rewrite
            return func(*args, **kwargs)
        return self._move(t, dst, dtype, non_blocking, copy, memory_format)

    def _new(self, func, args, kwargs):  # t.new_tensor(data): on t's device
        if "device" in kwargs and kwargs["device"] is not None:
            cuda = is_cuda_device(kwargs["device"])
            kwargs = {**kwargs, "device": CPU}
            return self._call(func, args, kwargs, "device" if (cuda or not self.s.cuda) else "host")
        return self._call(func, args, kwargs, self.s.pool_of(args[0]) if self.s.cuda else "device")

    def _device(self, func, args, kwargs):
        """``torch.device(0)``: an index alone names the accelerator's device, cuda:0 here
        (the real call asks the absent accelerator and fails)."""
        if len(args) == 1 and not kwargs and type(args[0]) is int:
            return func("cuda", args[0])
        return func(*args, **kwargs)

    def _set_data(self, func, args, kwargs):  # t.data = new (nn.Module.to, _apply)
        out = func(*args, **kwargs)
        _priv.adopt_constant(args[0], args[1])
        return out

    def _pin_memory(self, func, args, kwargs):
        return self._call(torch.Tensor.clone, (args[0],), {}, "host" if self.s.cuda else "device")

    def _marked_read(self, func, args, kwargs):
        """``t.item()``: a placeholder comes back marked (C++ turns what the dispatch level
        returns into a plain number)."""
        reads = self.s.data_reads
        value = func(*args, **kwargs)
        if self.s.data_reads == reads:
            return value  # a real value (a constant) or a known zero
        if type(value) is float:
            return SimulatedFloat(value)
        if type(value) is int:
            return SimulatedInt(value)
        return value

    def _deepcopy(self, func, args, kwargs):
        """``copy.deepcopy`` of a fake tensor carrying a constant: a clone, as torch does
        for tensors without host data (torch copies the storage of a tensor whose
        ``data_ptr`` is not 0, and a constant's is not, onto a meta tensor: an error)."""
        t, memo = args[0], args[1] if len(args) > 1 else kwargs.get("memo", {})
        if type(t) is not _priv.FakeTensor or _priv.fake_constant(t) is None or not t.is_leaf:
            import warnings

            with warnings.catch_warnings():  # torch asks a fake tensor for its data pointer
                warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
                return func(*args, **kwargs)
        if id(t) in memo:
            return memo[id(t)]
        import copy

        with torch.no_grad():
            new = t.clone()
        new.requires_grad_(t.requires_grad)
        # the clone has its own fake mode, device and constant; the rest (user attributes)
        for key, value in t.__dict__.items():
            if key not in new.__dict__:
                setattr(new, key, copy.deepcopy(value, memo))
        memo[id(t)] = new
        return new

    # -- values a simulation does not have ---------------------------------------------------
    def _tolist(self, func, args, kwargs):
        t = args[0]
        const = _priv.fake_constant(t)
        if const is not None:  # a value that follows from constants and shapes: real
            with _priv.no_python_modes():
                return const.tolist()
        self.s.note_read("tolist")
        return _nested(tuple(t.shape), placeholder_scalar(t.dtype))

    def _numpy(self, func, args, kwargs):
        import numpy as np

        t = args[0]
        const = _priv.fake_constant(t)
        if const is not None:
            with _priv.no_python_modes():
                return const.numpy().copy()
        self.s.note_read("numpy")
        name = _NUMPY_DTYPES.get(t.dtype, "float32")
        return np.full(tuple(t.shape), placeholder_scalar(t.dtype), dtype=name)

    def _array(self, func, args, kwargs):
        arr = self._numpy(func, args[:1], {})
        dtype = args[1] if len(args) > 1 else kwargs.get("dtype")
        return arr.astype(dtype) if dtype is not None else arr

    def _repr(self, func, args, kwargs):
        t = args[0]
        dev = "cuda:0" if self.s.cuda and self.s.pool_of(t) == "device" else "cpu"
        grad = ", requires_grad=True" if t.requires_grad else ""
        const = _priv.fake_constant(t)
        if const is not None:
            with _priv.no_python_modes():
                text = repr(const)
            if dev != "cpu":
                text = text[:-1] + f", device='{dev}')" if text.endswith(")") else text
            return text
        return (f"tensor(<simulated: no values>, size={tuple(t.shape)}, dtype={t.dtype}, "
                f"device='{dev}'{grad})")


# -- dispatch level ---------------------------------------------------------------------------
class SimTracker(StorageTracker):
    """The StorageTracker of a simulated run (see the module docstring)."""

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
        self._alloc_bytes: dict[int, int] = {}
        self._requested = 0  # bytes of the storage being tracked, before rounding
        # torch.cuda.max_memory_* counters (resettable by the cell)
        self.cuda_peak = 0
        self.cuda_reserved_peak = 0
        self.oom_live = 0        # device bytes live when the request failed
        self.oom_event = -1      # the last event before it
        # torch.cuda.memory._record_memory_history on the simulated allocator: memory_viz
        # entries of earlier cells, and where the recording starts in this cell's log
        self.history: list[dict] | None = None
        self.history_from = 0
        self.history_max: int | None = None
        # torch.cuda.set_per_process_memory_fraction: the share of the card the process may
        # reserve (None: all of it)
        self.memory_fraction: float | None = None
        self.card_memory = 0  # the card's bytes, when a fraction is set
        # serials of storages whose device the simulation guessed (factories called from
        # C++ code, and what is computed from them): never used to report a device mismatch
        self._unsure: set[int] = set()
        self._out_unsure = False
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
        self.oom_live, self.oom_event = 0, -1
        self.history_from = 0
        self._closed = False
        self.quiet = 0
        a = self.allocator
        if a is not None:
            a.reserved_peak = a.reserved
            a.allocated_peak = a.allocated
            # the cell's allocator history (for memory_viz snapshots), stamped with op indices
            a.start_log(clock=lambda: self.ops)

    def trace(self) -> Trace:
        """The run's trace, with the allocator model's history of the cell attached as
        ``allocator_log`` (:class:`~.allocator.AllocatorLog`; None without a CUDA model).
        While the cell's code records the allocator's history, what it recorded so far
        moves to :attr:`history`, framed by this trace (a later cell's snapshot has it)."""
        trace = super().trace()
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

    def _include_pending(self, t: torch.Tensor) -> str:
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
        old = self._alloc_bytes.pop(serial, 0)
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
                    self._alloc_bytes[serial] = old
                entry.nbytes = old  # what this storage holds: its release frees only that
                # every failed request raises, as on a GPU (code may catch it and go on);
                # the report describes the last one
                self.oom_live = self.current["device"]
                self.oom_event = len(self.events) - 1
                # not kept here: code that catches the error must free what the failed
                # frames held as soon as its handler ends, as on a GPU (the error's
                # traceback holds those frames)
                # from None: the user sees CUDA's error alone, not our AllocatorFull
                raise self._oom_error(full) from None
            self._alloc_bytes[serial] = new
        if a.reserved > self.cuda_reserved_peak:
            self.cuda_reserved_peak = a.reserved

    def _oom_error(self, full: AllocatorFull) -> SimulatedOutOfMemoryError:
        phase, where, label = self.context()
        op = self._last_op
        live = self.current["device"]  # what the report counts live at the failure
        cached = max(full.reserved - live, 0)
        loc = f"aten.{op}" if op else "an allocation"
        if label:
            loc += f" ({label})"
        if where:
            loc += f" in module {where}"
        loc += {"forward": " during forward", "backward": " during backward (loss.backward())",
                "recompute": " while backward recomputed a checkpointed forward",
                "optimizer": " during optimizer.step()"}.get(phase, "")
        # torch's words (CUDACachingAllocator.cpp's OutOfMemoryError), then where it ran out
        total, allowed = full.capacity, ""
        if self.memory_fraction is not None and self.card_memory:
            total = self.card_memory
            allowed = f"{format_bytes(full.capacity)} allowed; "
        free = max(total - full.reserved, 0)
        msg = (f"CUDA out of memory (simulated). Tried to allocate {format_bytes(full.size)}. "
               f"GPU 0 has a total capacity of {format_bytes(total)} of which "
               f"{format_bytes(free)} is free. {allowed}Of the allocated memory "
               f"{format_bytes(live)} is allocated by PyTorch, and "
               f"{format_bytes(cached)} is reserved by PyTorch but unallocated. If reserved "
               "but unallocated memory is large try setting "
               "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation. "
               f"Ran out at {loc}.")
        return SimulatedOutOfMemoryError(msg, op=op, module=where, size=full.size)

    # -- dispatch -------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # the per-op path of every simulated op: kept flat (one call for the pool, one per
        # new output storage) because its cost adds to every op FakeTensorMode runs
        if func is _PRIM_DEVICE:
            # C++ asking a fake tensor its device (FakeTensor.__torch_dispatch__'s answer,
            # without FakeTensorMode's dispatch): not an op, not counted
            t = args[0]
            mode = getattr(t, "fake_mode", None)
            if mode is not None:
                return META if mode.in_kernel_invocation else t.fake_device
        s = self.s
        s.in_dispatch += 1
        try:
            if self.quiet:  # memmagic's own op (the saved-tensor hook's detach)
                return func(*args, **(kwargs or {}))
            forced = s.target
            if kwargs:
                dev = kwargs.get("device")
                if dev is not None and is_cuda_device(dev):
                    kwargs = {**kwargs, "device": CPU}
                    forced = "device"
            else:
                kwargs = {}
            n = self.ops + 1
            if n > self.max_ops:
                raise SimulationBudgetExceeded(
                    f"the simulation stopped after {self.max_ops} tensor operations (max_ops): "
                    "a loop that depends on tensor values, or more steps than a simulation "
                    "needs; simulate fewer iterations or raise max_ops")
            if not n & 1023 and time.perf_counter() > self.deadline:
                raise SimulationBudgetExceeded(
                    f"the simulation stopped after {self.max_seconds:g} s (max_seconds): "
                    "simulate fewer iterations or raise max_seconds")
            if func is _LOCAL_SCALAR:
                return self._read_scalar(func, args[0])
            if forced is not None:
                pool = forced if s.cuda else "device"
                self._out_unsure = False
            else:
                pool = self._pool_from_inputs(func, args, kwargs)
            if pool == "device":
                s.cuda_seen = True
                if func in BLAS_OPS and self.workspaces is not None:
                    self._take_workspaces(func, args, kwargs)
            s.pending = pool
            fast = self.fast
            out = func(*args, **kwargs) if fast is None else fast(func, args, kwargs)
            if func in _VALUE_FACTORIES:
                out = _with_values(func, args, kwargs, out)
            elif func in _OR_OPS or func in _AND_OPS:
                out = _absorbed(func, args, out)
            elif func in _UNINITIALIZED and isinstance(out, torch.Tensor):
                _priv.drop_constant(out)
            else:
                _drop_unfounded(args, kwargs, out)
            info = self._op_info.get(func)
            if info is None:
                info = self._op_info[func] = _op_info(func)
            mutating, name, fixup = info
            if fixup:
                out = _fix_outputs(func, args, kwargs, out)
                if func is _RNN_LAYER:
                    s.rnn_ran = True
            seq = isinstance(out, (tuple, list))
            first = (out[0] if out else None) if seq else out
            dev = _priv.fake_device(first) if isinstance(first, torch.Tensor) else None
            if dev is not None and dev.type == "cuda":
                raise SimulationUnsupported(
                    f"a CUDA tensor slipped through the simulation at aten.{name}; {RERUN_HINT}")
            self.log_op(name, args, kwargs)
            serial0 = self._serial
            if mutating:
                _drop_unfounded_in_place(func, args, kwargs)
                self._visit(out, True)
                for a in args:
                    self._visit(a, True)
                for a in kwargs.values():
                    self._visit(a, True)
                if func in _FOUND_INF_OPS:  # GradScaler's found_inf reads 0 (no inf here)
                    serial = self.serial_of(args[1])
                    if serial is not None:
                        s.zero_read_serials.add(serial)
            elif isinstance(out, torch.Tensor):
                self.track(out)  # in the pool (and rounding) of s.pending, set above
            elif seq:
                self._visit(out, False)
            if self._out_unsure and self._serial > serial0:
                self._unsure.update(range(serial0 + 1, self._serial + 1))
            return out
        finally:
            s.in_dispatch -= 1

    def _take_workspaces(self, func, args, kwargs) -> None:
        """Allocate the cuBLAS/cuBLASLt workspaces this matmul makes torch allocate (once per
        thread, kept for the life of the simulated GPU; see .workspaces)."""
        ws = self.workspaces
        thread = "backward" if _priv.in_backward() else "main"
        self._last_op = func.__name__  # an OOM here is this op's
        for key, size in ws.needed(func, args, kwargs, thread):
            ws.held[key] = self.hold_workspace(round_request(size))[1]

    def hold_workspace(self, nbytes: int) -> tuple[int, int]:
        """Allocate a workspace of ``nbytes`` on the device for the life of the GPU (no
        storage: a key of its own, never freed); (its serial, its bytes). Raises the OOM
        a GPU would raise here."""
        self._serial += 1
        entry = Entry(self._serial, nbytes, "device")
        self.pool_of[entry.serial] = "device"
        self.roles[entry.serial] = Category.WORKSPACES
        self._requested = nbytes
        self._add(entry, entry.nbytes)
        self._live[-entry.serial] = entry
        return entry.serial, entry.nbytes

    def _pool_from_inputs(self, func, args, kwargs) -> str:
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
            # device of some tensor's options, which the simulation cannot see
            self._out_unsure = True
            if self.s.cuda_seen and _priv.in_backward():
                return "device"  # factories inside backward/recompute run on the GPU
            return "host"
        self._out_unsure = host_unsure
        return "host"

    def _check_same_device(self, func, args, kwargs) -> None:
        """Raise what CUDA raises when an op gets a CPU tensor and a CUDA tensor (a 0-dim
        CPU tensor is a scalar CUDA accepts). Only tensors whose device the simulation
        knows count; ops that move tensors between devices, and backward (whose ops
        follow a forward that passed this check), are not checked."""
        rule = self._device_rules.get(func)
        if rule is None:
            rule = self._device_rules[func] = _device_rule(func)
        if rule == "any" or _priv.in_backward():
            return
        schema = _priv.op_schema(func)
        names = [a.name for a in schema.arguments] if schema is not None else []
        live, unsure = self._live, self._unsure

        def device_of(t) -> str | None:
            e = live.get(_priv.storage_key(t.untyped_storage()))
            if e is None or e.serial in unsure:
                return None
            if e.pool == "host" and (t.dim() == 0 or t.numel() == 0):
                return None  # a CPU scalar (and an empty placeholder)
            return e.pool

        found: list[tuple[str, str]] = []  # (pool, argument) in argument order
        items = list(zip(names, args)) + list(kwargs.items())
        if rule == "index":  # indices may be on the CPU or on the indexed tensor's device
            if len(args) > 1 and isinstance(args[0], torch.Tensor) and device_of(args[0]) == "host":
                for t in args[1] if isinstance(args[1], (list, tuple)) else ():
                    if isinstance(t, torch.Tensor) and device_of(t) == "device":
                        raise SimulatedDeviceMismatchError(
                            "would fail on a GPU: indices should be either on cpu or on the same "
                            "device as the indexed tensor (cpu); move the indexed tensor or the "
                            "indices with .cuda() or .to(device)", op=func.__name__, argument="indices")
            return
        for name, a in items:
            if rule == "lists" and not isinstance(a, (list, tuple)):
                continue  # foreach/fused scalars and lr tensors may stay on the CPU
            for t in (a,) if isinstance(a, torch.Tensor) else a if isinstance(a, (list, tuple)) else ():
                if isinstance(t, torch.Tensor):
                    pool = device_of(t)
                    if pool is not None:
                        found.append((pool, name))
        pools = {p for p, _ in found}
        if len(pools) < 2:
            return
        first = found[0][0]
        other = next(n for p, n in found if p != first)
        devs = ("cuda:0", "cpu") if first == "device" else ("cpu", "cuda:0")
        raise SimulatedDeviceMismatchError(
            f"would fail on a GPU: Expected all tensors to be on the same device, but found at "
            f"least two devices, {devs[0]} and {devs[1]}! (argument '{other}' of "
            f"aten.{func.__name__}); move the CPU tensor with .cuda() or .to(device)",
            op=func.__name__, argument=other)

    def _read_scalar(self, func, t: torch.Tensor):
        const = _priv.fake_constant(t)
        if const is not None:  # a value the fake mode knows (an optimizer's step count)
            with _priv.no_python_modes():
                return const.item()
        try:
            return func(t)
        except (_priv.DataDependentOutputException, _priv.UnsupportedOperatorException):
            pass
        serial = self.serial_of(t)
        zero = serial is not None and serial in self.s.zero_read_serials
        if not zero:
            self.s.note_read("item")
        return placeholder_scalar(t.dtype, zero)
