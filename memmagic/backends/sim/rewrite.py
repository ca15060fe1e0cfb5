"""Rewriting the CUDA device onto fake CPU tensors, at the function level.

A FakeTensor on the CUDA device cannot be used on a CPU-only build (autograd on one
aborts the process), so every tensor of the simulation is a fake *CPU* tensor.
:class:`DeviceRewriteMode` (a TorchFunctionMode) keeps the fiction for Python code: it
rewrites ``device="cuda"`` arguments, ``.cuda()``, ``.cpu()``, ``.to(...)`` (which copy
between "devices", as on a GPU) and the default device, answers ``Tensor.device``/``is_cuda``
with ``cuda:0`` for tensors on the simulated GPU, and answers ``.tolist()``/``.numpy()``/
``repr`` from :mod:`.values`. Function modes are off inside ``backward()`` and checkpoint
recompute, so the tracker (:mod:`.tracker`) rewrites ``device=`` again at the dispatch level.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from ...core import _torch_private as _priv
from ...core.interrupts import atomic
from .errors import RERUN_HINT, SimulationUnsupported
from .packed import pack_padded, pad_packed
from ...core.tracking import held_by
from .state import CPU, SimState, gpu_device, is_cuda_device
from .values import holds_placeholder, marked, tensor_numpy, tensor_repr, tensor_tolist

__all__ = ["DeviceRewriteMode"]


def _is_meta(dev: object) -> bool:
    return (dev == "meta" or isinstance(dev, torch.device) and dev.type == "meta"
            or isinstance(dev, str) and dev.startswith("meta:"))


def _int_device(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``t.to(0)`` / ``device=0``: an int is a CUDA index, which ``_parse_to`` would resolve
    through the (absent) accelerator: name the device instead."""
    if args and isinstance(args[0], int) and not isinstance(args[0], bool):
        is_cuda_device(args[0])  # raises for another index
        args = (gpu_device(), *args[1:])
    dev = kwargs.get("device")
    if isinstance(dev, int) and not isinstance(dev, bool):
        is_cuda_device(dev)
        kwargs = {**kwargs, "device": gpu_device()}
    return args, kwargs


_STORAGES = (torch.UntypedStorage, torch.TypedStorage)


def _over_storage(storage, kwargs: dict) -> int:
    """How many elements ``torch.asarray(storage, dtype=...)`` views: a real storage's bytes
    (safetensors reads a checkpoint so, transformers' ``from_pretrained`` through it) become a
    simulated tensor of that size, with no data, like every tensor of the simulation."""
    nbytes = storage.nbytes()
    dtype = kwargs.get("dtype") or getattr(storage, "dtype", torch.uint8)
    return nbytes // dtype.itemsize


# the files whose frames stand between a torch function this mode routed and the ops its
# C++ code dispatches: this package's kernels and dispatch mode, torch's op and mode plumbing
_PLUMBING = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
             *_priv.dispatch_plumbing_files())


def kernel_call_args() -> tuple | None:
    """The arguments of the torch function (as :class:`DeviceRewriteMode` routed it) whose
    C++ code runs the op being dispatched now, with no Python code between them: what a
    factory torch's C++ code calls takes its device from (SDPA's math kernel makes its
    causal mask with the query's options). None where Python code runs in between (a
    saved-tensor hook's ``torch.empty``, a decomposition written in Python: their
    factories without a device are on the CPU) or no torch function was routed."""
    f = sys._getframe(1)
    route = DeviceRewriteMode._route.__code__
    while f is not None:
        code = f.f_code
        if code is route:
            return f.f_locals.get("args")
        if not code.co_filename.startswith(_PLUMBING):
            return None
        f = f.f_back
    return None


@atomic
class DeviceRewriteMode(TorchFunctionMode):
    """See the module docstring. Cheap for ordinary calls: one dict lookup and a kwargs check."""

    def __init__(self, state: SimState) -> None:
        super().__init__()
        self.s = state
        T = torch.Tensor
        h: dict[Callable, Callable] = {
            T.cuda: self._cuda, T.cpu: self._cpu, T.to: self._to,
            T.pin_memory: self._pin_memory, T.is_pinned: self._is_pinned,
            T.type_as: lambda f, a, k: self._to(T.to, (a[0], a[1]), {}),
            T.new_tensor: self._new, T.new: self._new,
            T.tolist: self._tolist, T.numpy: self._numpy, T.__array__: self._array,
            T.__repr__: self._repr, T.__str__: self._repr, T.__format__: self._format,
            _priv.PARSE_TO_FUNCTION: self._parse_to, T.__deepcopy__: self._deepcopy,
            T.item: self._marked_read,  # (int(t) and float(t) return plain numbers: Python
                                        # makes exact ints and floats of what __int__ gives)
            T.data.__set__: self._set_data,
            T.record_stream: lambda f, a, k: None,  # one stream: nothing to wait for
            T.data_ptr: self._data_ptr,
            torch.lstm: self._cpu_rnn, torch.gru: self._cpu_rnn, torch.rnn_tanh: self._cpu_rnn,
            torch.rnn_relu: self._cpu_rnn,
            _priv.PACK_PADDED_FUNCTION: pack_padded, _priv.PAD_PACKED_FUNCTION: pad_packed,
        }
        if state.cuda:
            h.update({
                torch.device: self._device,
                T.is_cuda.__get__: self._is_cuda,
                T.device.__get__: self._wrapper_device,
                T.is_cpu.__get__: lambda f, a, k: self.s.pool_of(a[0]) != "device",
                T.get_device: lambda f, a, k: 0 if self.s.pool_of(a[0]) == "device" else -1,
            })
        self._handlers = h
        self._factories = _priv.device_constructors()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = self._route(func, types, args, kwargs)
        if holds_placeholder(args) or (kwargs and holds_placeholder(tuple(kwargs.values()))):
            _forget_values(func, args, out)  # made from a placeholder: its values are unknown
        return out

    def _route(self, func, types, args, kwargs):
        handler = self._handlers.get(func)
        if handler is not None:
            return handler(func, args, kwargs or {})
        if func is torch.asarray and args and isinstance(args[0], _STORAGES):
            args = (_over_storage(args[0], kwargs or {}),)  # then placed as any factory's
            func, kwargs = torch.empty, {k: v for k, v in (kwargs or {}).items()
                                         if k in ("dtype", "device")}
        if kwargs and kwargs.get("pin_memory"):  # a page-locked host tensor (see _pinned)
            return self._pinned(func(*args, **{k: v for k, v in kwargs.items()
                                               if k != "pin_memory"}))
        if kwargs:
            dev = kwargs.get("device")
            if dev is not None and not _is_meta(dev):  # the meta device holds no memory
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
        """``func`` with the storages it makes in ``pool`` (the run's state, per call)."""
        s = self.s
        prev, s.target = s.target, pool
        try:
            return func(*args, **kwargs)
        finally:
            s.target = prev

    def _cpu_rnn(self, func, args, kwargs):
        """An LSTM, GRU or plain RNN stack (``torch._VF.gru``, what ``nn.GRU`` calls). On the
        simulated GPU it runs as cuDNN's (.cudnn_rnn); one that stays on the CPU kernels'
        memory there (LSTM projections, cuDNN switched off) is counted for the
        report's note."""
        x = args[0] if args else None
        s = self.s
        taken = sum(s.cudnn_rnn_calls.values())
        out = func(*args, **kwargs)
        if (s.cuda and isinstance(x, torch.Tensor) and s.pool_of(x) == "device"
                and sum(s.cudnn_rnn_calls.values()) == taken):
            name = func.__name__.upper()
            s.cpu_rnn_calls[name] = s.cpu_rnn_calls.get(name, 0) + 1
        return out

    # -- properties --------------------------------------------------------------------
    def _is_cuda(self, func, args, kwargs):
        return self.s.pool_of(args[0]) == "device"

    def _wrapper_device(self, func, args, kwargs):
        """``t.device`` of a wrapper subclass (a FakeTensor answers from its own property):
        where its inner tensors are, as user and torch Python code see it (DTensor takes
        its device from its local tensor's real one in C++: the CPU's), and of a tensor
        torch.func wraps (inside ``vmap``, ``grad``, ``jvp``): the wrapped one's; the real
        device inside dispatch, as a FakeTensor's."""
        t = args[0]
        if self.s.in_dispatch:
            return func(*args)
        if held_by(t) is None:  # torch.func's wrappers (vmap, grad): the one inside's device
            inner = _priv.functorch_unwrapped(t)
            return func(*args) if inner is t else self.s.device_of(inner)
        return self.s.device_of(t)

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
            non_blocking = kwargs.get("non_blocking", args[1] if len(args) > 1 else False)
            return self.s.device_of(other), other.dtype, non_blocking, kwargs.get("memory_format")
        args, kwargs = _int_device(args, kwargs)
        return func(*args, **kwargs)

    def _to(self, func, args, kwargs):
        t, rest = args[0], args[1:]
        copy = kwargs.get("copy", False)
        if rest and isinstance(rest[0], torch.Tensor):  # t.to(other, non_blocking, copy)
            other = rest[0]
            device = self.s.device_of(other)
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
        self.s.refilled(args[0])
        return out

    def _data_ptr(self, func, args, kwargs):
        """The simulated address (a fake tensor's own is 0, with a warning that blames the
        caller's code)."""
        try:
            address = self.s.data_ptr(args[0])
        except (RuntimeError, NotImplementedError, TypeError):  # a wrapper with no storage
            address = None
        if address is not None:
            return address
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            return func(*args, **kwargs)

    def _pin_memory(self, func, args, kwargs):
        return self._pinned(self._call(torch.Tensor.clone, (args[0],), {},
                                       "host" if self.s.cuda else "device"))

    def _pinned(self, t):
        """``t``, a host tensor made page-locked (``pin_memory()``, a factory's
        ``pin_memory=True``, which FakeTensorMode refuses): host memory as any other, and
        ``is_pinned()`` says so for it and its views."""
        tr = self.s.tracker
        serial = tr.serial_of(t) if tr is not None and isinstance(t, torch.Tensor) else None
        if serial is not None:
            self.s.pinned_serials.add(serial)
        return t

    def _is_pinned(self, func, args, kwargs) -> bool:
        tr = self.s.tracker
        serial = tr.serial_of(args[0]) if tr is not None else None
        return serial is not None and serial in self.s.pinned_serials

    def _deepcopy(self, func, args, kwargs):
        """``copy.deepcopy`` of a fake tensor carrying a constant: a clone, as torch does
        for tensors without host data (torch copies the storage of a tensor whose
        ``data_ptr`` is not 0, and a constant's is not, onto a meta tensor: an error)."""
        t, memo = args[0], args[1] if len(args) > 1 else kwargs.get("memo", {})
        if type(t) is not _priv.FakeTensor or _priv.fake_constant(t) is None or not t.is_leaf:
            with warnings.catch_warnings():  # torch asks a fake tensor for its data pointer
                warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
                return func(*args, **kwargs)
        if id(t) in memo:
            return memo[id(t)]
        with torch.no_grad():
            new = t.clone()
        new.requires_grad_(t.requires_grad)
        # the clone has its own fake mode, device and constant; the rest (user attributes)
        for key, value in t.__dict__.items():
            if key not in new.__dict__:
                setattr(new, key, copy.deepcopy(value, memo))
        memo[id(t)] = new
        return new

    # -- values a simulation does not have (see .values) ---------------------------------------
    def _marked_read(self, func, args, kwargs):
        """``t.item()``: a placeholder comes back marked (C++ turns what the dispatch level
        returns into a plain number)."""
        reads = self.s.data_reads
        value = func(*args, **kwargs)
        if self.s.data_reads == reads:
            return value  # a real value (a constant) or a known zero
        return marked(value)

    def _tolist(self, func, args, kwargs):
        self.s.value_reads += 1
        return tensor_tolist(args[0], self.s.note_read)

    def _numpy(self, func, args, kwargs):
        self.s.value_reads += 1
        return tensor_numpy(args[0], self.s.note_read)

    def _array(self, func, args, kwargs):
        arr = self._numpy(func, args[:1], {})
        dtype = args[1] if len(args) > 1 else kwargs.get("dtype")
        return arr.astype(dtype) if dtype is not None else arr

    def _format(self, func, args, kwargs):
        """``f"{t:.4f}"`` as torch formats a tensor: a 0-d one by its value (a marked
        placeholder where the simulation has none, as ``t.item()``), any other by its str."""
        t, spec = args[0], (args[1] if len(args) > 1 else "")
        if t.dim() == 0:
            return format(self._marked_read(torch.Tensor.item, (t,), {}), spec)
        if not spec:
            return self._repr(func, args, kwargs)
        return func(*args, **kwargs)  # torch's TypeError for a spec on a tensor of values

    def _repr(self, func, args, kwargs):
        t = args[0]
        return tensor_repr(t, "cuda:0" if self.s.cuda and self.s.pool_of(t) == "device" else "cpu")


# the operators that change their left operand (``losses[k] = x``, ``t += x``)
_IN_PLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__imatmul__",
                               "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
                               "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"})


def _forget_values(func, args, out) -> None:
    """A tensor computed from a placeholder (``torch.tensor([loss.item()])``, ``losses[k] =
    loss.item()``, ``t * x.item()``) has values the simulation does not know: it carries no
    constant, so what is read from it later is a marked placeholder too, not the
    placeholder's number passed off as a result. The output, and the tensor an in-place
    op (``__setitem__``, ``add_``) changed."""
    name = getattr(func, "__name__", "")
    in_place = name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.startswith("_"))
    targets = [out, *(args[:1] if in_place else ())]
    while targets:
        x = targets.pop()
        if isinstance(x, torch.Tensor):
            _priv.drop_constant(x)
        elif isinstance(x, (list, tuple)):
            targets.extend(x)
