"""Placeholders for values a simulation does not have.

Fake tensors have shapes, not data. What user code reads from one stands in for the
value a GPU run would read, marked so it is not taken for a result:

* a read of one element (``.item()``, ``float(loss)``) gives :func:`placeholder_scalar`:
  a :class:`SimulatedFloat` 1.0 or :class:`SimulatedInt` 0 (printed ``1.0(simulated)``,
  arithmetic on them stays marked), False for bools, but for the test of an ``assert``
  (``assert torch.isnan(w).sum() == 0``, ``assert torch.equal(a, b)``), which is taken to
  hold, as on a GPU that runs the code correctly (:func:`assert_holds`);
* ``.tolist()``, ``.numpy()`` and ``repr`` answer from a tensor's constant when it has one
  (values that follow from constants and shapes, see :mod:`.constants`), with
  placeholders otherwise (:func:`tensor_tolist`, :func:`tensor_numpy`, :func:`tensor_repr`);
* a name of the notebook that holds what a simulated cell made holds a
  :class:`SimulatedValue`: its repr says so, any other use raises a one-line error.
"""

from __future__ import annotations

import dis
import functools
import sys
from typing import Any, Callable

import torch

from ...core import _torch_private as _priv
from ...core.interrupts import atomic
from .errors import SimulatedValueError

__all__ = ["SimulatedFloat", "SimulatedInt", "placeholder_scalar", "holds_placeholder", "marked",
           "tensor_tolist",
           "tensor_numpy", "tensor_repr", "read_scalar", "SimulatedValue", "forget"]


class SimulatedFloat(float):
    """A float a simulated read returns in place of a value the simulation does not have:
    it computes as its number and prints with a mark, so it is not taken for a result."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"{float.__repr__(self)}(simulated)"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return float.__format__(self, spec) + "(simulated)" if spec else repr(self)


class SimulatedInt(int):
    """The int counterpart of :class:`SimulatedFloat`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"{int.__repr__(self)}(simulated)"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return int.__format__(self, spec) + "(simulated)" if spec else repr(self)


def marked(value: Any) -> Any:
    """``value`` as a marked placeholder when it is a plain float or int."""
    if type(value) is float:
        return SimulatedFloat(value)
    if type(value) is int:
        return SimulatedInt(value)
    return value


def _marked_arith(cls, base):
    """Arithmetic on a marked placeholder gives a marked result (``total += loss.item()``),
    and so does rounding it (``round(tokens / elapsed)``, ``math.floor``): a number made
    from a placeholder is never printed as a result. (``int(x)`` cannot keep the mark:
    Python makes its result a plain int.)"""
    def wrap(name):
        op = getattr(base, name)

        def method(self, *args):
            out = op(self, *args)
            return tuple(marked(x) for x in out) if type(out) is tuple else marked(out)
        method.__name__ = name
        return method

    for name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
                 "__truediv__", "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__",
                 "__rmod__", "__pow__", "__rpow__", "__neg__", "__pos__", "__abs__",
                 "__round__", "__floor__", "__ceil__", "__trunc__", "__divmod__",
                 "__rdivmod__"):
        if hasattr(base, name):
            setattr(cls, name, wrap(name))


_marked_arith(SimulatedFloat, float)
_marked_arith(SimulatedInt, int)


_MARKED = (SimulatedFloat, SimulatedInt)


def holds_placeholder(data: Any) -> bool:
    """Whether ``data`` (an argument of a torch call: a number, or lists and tuples of
    them) holds a placeholder (:class:`SimulatedFloat`, :class:`SimulatedInt`). (On every
    torch call of a simulation: a loop, no generator.)"""
    if isinstance(data, _MARKED):
        return True
    if isinstance(data, (list, tuple)):
        for x in data:
            if isinstance(x, _MARKED) or isinstance(x, (list, tuple)) and holds_placeholder(x):
                return True
    return False


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


# -- reads of a fake tensor ---------------------------------------------------------------------
def tensor_tolist(t: torch.Tensor, note_read: Callable[[str], None]) -> Any:
    """``t.tolist()``: its constant's values, or placeholders (``note_read("tolist")``)."""
    const = _priv.fake_constant(t)
    if const is not None:  # a value that follows from constants and shapes: real
        with _priv.no_python_modes():
            return const.tolist()
    note_read("tolist")
    return _nested(tuple(t.shape), placeholder_scalar(t.dtype))


def tensor_numpy(t: torch.Tensor, note_read: Callable[[str], None]):
    """``t.numpy()``: a copy of its constant, or an array of placeholders."""
    import numpy as np

    const = _priv.fake_constant(t)
    if const is not None:
        with _priv.no_python_modes():
            return const.numpy().copy()
    note_read("numpy")
    name = _NUMPY_DTYPES.get(t.dtype, "float32")
    return np.full(tuple(t.shape), placeholder_scalar(t.dtype), dtype=name)


def tensor_repr(t: torch.Tensor, device: str) -> str:
    """``repr(t)`` as on ``device`` ("cuda:0" or "cpu"): its constant's, or a line saying
    it has no values."""
    grad = ", requires_grad=True" if t.requires_grad else ""
    const = _priv.fake_constant(t)
    if const is not None:
        with _priv.no_python_modes():
            text = repr(const)
        if device != "cpu":
            text = text[:-1] + f", device='{device}')" if text.endswith(")") else text
        return text
    return (f"tensor(<simulated: no values>, size={tuple(t.shape)}, dtype={t.dtype}, "
            f"device='{device}'{grad})")


def read_scalar(func, t: torch.Tensor, zero: Callable[[], bool],
                note_read: Callable[[str], None]) -> Any:
    """``aten._local_scalar_dense`` of ``t``: the value the fake mode knows (a constant, an
    optimizer's step count), else the value that makes an ``assert`` it is the test of
    hold (:func:`assert_holds`), else a placeholder (0 where ``zero()`` says the value is
    known to be 0)."""
    const = _priv.fake_constant(t)
    if const is not None:
        with _priv.no_python_modes():
            return const.item()
    try:
        return func(t)
    except (_priv.DataDependentOutputException, _priv.UnsupportedOperatorException):
        pass
    held = assert_holds(sys._getframe(1)) if t.dtype == torch.bool else None
    if held is not None:
        note_read("the test of an assert, taken to hold")
        return held
    known_zero = zero()
    if not known_zero:
        note_read("item")
    return placeholder_scalar(t.dtype, known_zero)


# where a bool read is an assert's test: the current instruction (or the call right before the
# test) and the jump over the raise, names as Python 3.11 to 3.13 spell them
_BEFORE_TEST = frozenset({"CALL", "PRECALL", "CALL_KW", "CALL_FUNCTION_EX", "TO_BOOL", "CACHE"})
_TESTS = {"POP_JUMP_FORWARD_IF_TRUE": True, "POP_JUMP_IF_TRUE": True,
          "POP_JUMP_FORWARD_IF_FALSE": False, "POP_JUMP_IF_FALSE": False}


def assert_holds(frame: Any) -> bool | None:
    """Where the innermost frame from ``frame`` out that is not torch's or memmagic's is at
    the test of an ``assert`` (its jump over ``LOAD_ASSERTION_ERROR``, or a call whose
    result that jump tests: ``assert torch.equal(a, b)``), the bool that skips the raise;
    None elsewhere. An assertion about values holds on a GPU that runs the code as its
    author meant; the simulation's placeholder, False, would fail it."""
    from ...core.failures import is_machinery, torch_dir

    while frame is not None and (frame.f_code.co_filename.startswith(torch_dir())
                                 or is_machinery(frame.f_code.co_filename)):
        frame = frame.f_back
    if frame is None:
        return None
    code = _instructions(frame.f_code)
    i = code[1].get(frame.f_lasti)
    if i is None:
        return None
    ops = code[0]
    while i + 1 < len(ops) and ops[i] in _BEFORE_TEST and ops[i] not in _TESTS:
        i += 1
    if ops[i] in _TESTS and i + 1 < len(ops) and ops[i + 1] == "LOAD_ASSERTION_ERROR":
        return _TESTS[ops[i]]
    return None


@functools.lru_cache(maxsize=256)
def _instructions(code: Any) -> tuple[list[str], dict[int, int]]:
    """``code``'s instructions' names, and each one's place by its offset."""
    ops = list(dis.get_instructions(code))
    return [op.opname for op in ops], {op.offset: i for i, op in enumerate(ops)}


# -- what the notebook holds for a simulated object ------------------------------------------------
_RERUN = "rerun the cell that made it without --backend sim"
_LIVE = ("use it in simulated cells (%%gpumem --backend sim, or every cell after %gpusim on); "
         "a real cell cannot")
_GONE = "the simulated GPU was reset since: rerun the cell that made it"


@atomic
class SimulatedValue:
    """Stands for a value a simulated cell made: it has no data. Its repr says so; any
    other use raises :class:`SimulatedValueError` with a one-line message. ``live``: the
    value lives on a persistent simulated GPU (later simulated cells get it)."""

    __slots__ = ("_name", "_what", "_state", "_shown")

    def __init__(self, name: str, what: str, live: bool = False, shown: str | None = None) -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_what", what)
        object.__setattr__(self, "_state", "live" if live else "rerun")
        object.__setattr__(self, "_shown", shown)

    def _advice(self) -> str:
        state = object.__getattribute__(self, "_state")
        if state == "live":
            return f"lives on the simulated GPU and has no data here; {_LIVE}"
        if state == "gone":
            return f"was on the simulated GPU; {_GONE}"
        return f"was made by a --backend sim cell and has no data; {_RERUN}"

    def _fail(self, *args: Any, **kwargs: Any):
        raise SimulatedValueError(
            f"{object.__getattribute__(self, '_name')} ({object.__getattribute__(self, '_what')}) "
            f"{object.__getattribute__(self, '_advice')()}")

    def __repr__(self) -> str:
        shown = object.__getattribute__(self, "_shown")
        if shown is not None:  # what the GPU run would show
            return f"{shown}\n[an object of the simulated GPU: a real cell cannot use it]"
        return (f"<simulated {object.__getattribute__(self, '_what')} "
                f"'{object.__getattribute__(self, '_name')}': "
                f"{object.__getattribute__(self, '_advice')()}>")

    def __getattr__(self, name: str):
        if name.startswith("_repr_") or name in ("_ipython_display_", "_ipython_canary_method_should_not_exist_"):
            raise AttributeError(name)  # let IPython fall back to __repr__
        self._fail()

    def __setattr__(self, name: str, value: Any) -> None:
        self._fail()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        for a in list(args) + list((kwargs or {}).values()):
            if isinstance(a, SimulatedValue):
                a._fail()
        raise SimulatedValueError(f"a value made by a --backend sim cell has no data; {_RERUN}")

    __call__ = __iter__ = __len__ = __bool__ = __float__ = __int__ = __index__ = _fail
    __getitem__ = __setitem__ = __delitem__ = __contains__ = _fail
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = _fail
    __rtruediv__ = __floordiv__ = __mod__ = __pow__ = __matmul__ = __neg__ = __abs__ = _fail
    __lt__ = __le__ = __gt__ = __ge__ = __format__ = __enter__ = __exit__ = _fail
    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other: object) -> bool:
        return self is other


def forget(value: SimulatedValue) -> None:
    """The simulated GPU ``value`` lived on was reset: it says so from now on."""
    object.__setattr__(value, "_state", "gone")
