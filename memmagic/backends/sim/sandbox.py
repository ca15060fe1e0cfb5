"""Keeping real objects out of a simulated cell's reach, and fake ones out of the notebook.

Functions defined in earlier cells see the notebook through ``__globals__``, which *is*
the user namespace dict, so the sandbox works in that dict: :meth:`Sandbox.enter` swaps
each value that holds tensors (tensors, modules, optimizers, schedulers, GradScalers,
DataLoaders, containers, objects that reach tensors) for a deep copy whose tensors are
fake twins (same shapes, dtypes, devices, no data); :meth:`Sandbox.exit` puts every
original key and value back, and turns every name the cell created into a
:class:`SimulatedValue` placeholder (modules, functions and classes stay), so a later
real cell fails with a one-line message instead of tripping on a fake tensor.

Objects reachable only from elsewhere (a closure cell, a default argument, a module
attribute) are not swapped: tensor *ops* on them still run on fakes (the fake mode turns
real inputs into fakes), but Python-level assignments to them would stick.
"""

from __future__ import annotations

import copy

import types
from typing import Any, Callable, Iterator

import torch

from ... import _torch_private as _priv
from .errors import SimulatedValueError

__all__ = ["Sandbox", "SimulatedValue", "sanitize_value", "contains_fake"]

_SKIP_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "_ih", "_oh", "_dh", "_", "__", "___",
               "__builtins__", "__builtin__", "__name__", "__doc__", "__spec__", "__loader__",
               "__package__"}
_ATOMIC = (type(None), bool, int, float, complex, str, bytes, range, type, types.ModuleType,
           types.FunctionType, types.BuiltinFunctionType, types.MethodType, torch.dtype,
           torch.device, torch.Size)
_RERUN = "rerun the cell that made it without --backend sim"


class SimulatedValue:
    """Stands for a value a simulated cell made: it has no data. Its repr says so; any
    other use raises :class:`SimulatedValueError` with a one-line message."""

    __slots__ = ("_name", "_what")

    def __init__(self, name: str, what: str) -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_what", what)

    def _fail(self, *args: Any, **kwargs: Any):
        raise SimulatedValueError(
            f"{object.__getattribute__(self, '_name')} ({object.__getattribute__(self, '_what')}) "
            f"was made by a --backend sim cell and has no data; {_RERUN}")

    def __repr__(self) -> str:
        return (f"<simulated {object.__getattribute__(self, '_what')} "
                f"'{object.__getattribute__(self, '_name')}': no data; {_RERUN}>")

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


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    return type(value).__name__


def _reachable_tensors(value: Any, limit: int = 10_000) -> Iterator[torch.Tensor]:
    """Tensors ``value`` reaches (bounded walk over containers, dict keys and __dict__)."""
    seen: set[int] = set()
    stack = [value]
    while stack and len(seen) < limit:
        v = stack.pop()
        if id(v) in seen or isinstance(v, _ATOMIC):
            continue
        seen.add(id(v))
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack.extend(v)
        else:
            d = getattr(v, "__dict__", None)
            if isinstance(d, dict):
                stack.extend(d.values())


def contains_fake(value: Any, limit: int = 10_000) -> bool:
    """Whether ``value`` reaches a FakeTensor."""
    return any(_priv.is_fake(t) for t in _reachable_tensors(value, limit))


def sanitize_value(value: Any, name: str = "the cell's value") -> Any:
    """The value a simulated cell returns, safe to hand to the notebook."""
    if value is None or isinstance(value, _ATOMIC):
        return value
    if contains_fake(value):
        return SimulatedValue(name, _describe(value))
    return value


def _worth_swapping(value: Any) -> bool:
    if isinstance(value, _ATOMIC) or isinstance(value, SimulatedValue):
        return False
    mod = type(value).__module__ or ""
    if mod.startswith(("numpy", "pandas", "IPython", "matplotlib", "ipykernel", "ipywidgets")):
        return False
    return True


class Sandbox:
    """Swap the namespace's values for fake copies during a simulated run (see module doc)."""

    def __init__(self, namespace: dict, fake_mode, replacements: dict[int, Any] | None = None) -> None:
        self.ns = namespace
        self.fake_mode = fake_mode
        self.replacements = replacements or {}
        self.saved: dict[str, Any] | None = None
        self.fakes: list[tuple[torch.Tensor, torch.Tensor]] = []  # (real, fake)
        self.not_isolated: list[str] = []
        self._memo: dict[int, Any] = {}

    # -- fake copies --------------------------------------------------------------------
    def _fake_tensor(self, t: torch.Tensor, memo: dict) -> torch.Tensor:
        key = id(t)
        if key in memo:
            return memo[key]
        if _priv.is_fake(t):
            memo[key] = t
            return t
        f = _priv.fake_copy(self.fake_mode, t)
        memo[key] = f
        self.fakes.append((t, f))
        return f

    def _copy(self, value: Any, memo: dict) -> Any:
        if isinstance(value, torch.Tensor):
            return self._fake_tensor(value, memo)
        sandbox = self

        def tensor_deepcopy(t, m):
            return sandbox._fake_tensor(t, m)

        old_t = torch.Tensor.__deepcopy__
        old_p = torch.nn.Parameter.__deepcopy__
        torch.Tensor.__deepcopy__ = tensor_deepcopy  # type: ignore[method-assign]
        torch.nn.Parameter.__deepcopy__ = tensor_deepcopy  # type: ignore[method-assign]
        try:
            return copy.deepcopy(value, memo)
        finally:
            torch.Tensor.__deepcopy__ = old_t  # type: ignore[method-assign]
            torch.nn.Parameter.__deepcopy__ = old_p  # type: ignore[method-assign]

    # -- enter / exit -------------------------------------------------------------------
    def enter(self) -> None:
        ns = self.ns
        self.saved = dict(ns)
        memo = self._memo
        for key, value in list(ns.items()):
            rep = self.replacements.get(id(value))
            if rep is not None:
                ns[key] = rep
                continue
            if key in _SKIP_NAMES or (key.startswith("_") and (key[1:].isdigit() or key.startswith("_i"))):
                continue
            if not _worth_swapping(value):
                continue
            try:
                ns[key] = self._copy(value, memo)
            except Exception:
                if contains_real_tensor(value):
                    self.not_isolated.append(key)
        _priv.forget_fake_memo(self.fake_mode)

    def exit(self) -> None:
        """Restore every original key/value; new names become placeholders."""
        if self.saved is None:
            return
        ns, saved = self.ns, self.saved
        self.saved = None
        created = [k for k in ns if k not in saved]
        for k in created:
            v = ns[k]
            if isinstance(v, (types.ModuleType, types.FunctionType, type, types.BuiltinFunctionType)):
                continue
            if k.startswith("__") and k.endswith("__"):
                continue  # what exec() adds (__builtins__) and module-level dunders
            ns[k] = SimulatedValue(k, _describe(v))
        for k, v in saved.items():
            if k not in ns or ns[k] is not v:
                ns[k] = v
        self._memo.clear()
        self.fakes.clear()


def contains_real_tensor(value: Any, limit: int = 10_000) -> bool:
    """Whether ``value`` reaches a real (not fake) tensor."""
    return any(not _priv.is_fake(t) for t in _reachable_tensors(value, limit))


