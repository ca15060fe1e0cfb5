"""Keeping real objects out of a simulated cell's reach, and fake ones out of the notebook.

Functions defined in earlier cells see the notebook through ``__globals__``, which *is*
the user namespace dict, so the sandbox works in that dict: :meth:`Sandbox.enter` swaps
each value that holds tensors (tensors, modules, optimizers, schedulers, GradScalers,
DataLoaders, containers, objects that reach tensors) for a deep copy whose tensors are
fake twins (same shapes, dtypes, devices, no data); :meth:`Sandbox.exit` puts every
original key and value back, and turns every name the cell created into a
:class:`SimulatedValue` placeholder (modules, functions and classes stay), so a later
real cell fails with a one-line message instead of tripping on a fake tensor.

With a persistent simulated GPU (``shadow``, see :mod:`.session`) the exit follows the
cell instead: names it made or rebound keep what it bound (a placeholder for what holds
simulated tensors, the value itself otherwise), names it deleted stay deleted, and the
simulated objects are kept in the shadow for the next simulated cell; real objects of
earlier real cells are still restored bit-identical, and values that reach no tensor are
not copied at all (the cell works on them for real, as on a GPU).

A what-if run (the doctor's, the panel's, a sweep's) starts from a *copy* of the notebook's
simulated GPU and must leave the notebook as it found it: its sandbox (``whatif``) copies
plain data too (a GradScaler before its first step, which makes its scale then; a list a
training loop appends its losses to; :func:`_copied_plain`), so that the run works on the
copy, as on that copy of the card.

Objects reachable only from elsewhere (a closure cell, a default argument, a module
attribute) are not swapped: tensor *ops* on them still run on fakes (the fake mode turns
real inputs into fakes), but Python-level assignments to them would stick.
"""

from __future__ import annotations

import copy
import types
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ...core import _torch_private as _priv
from ...core.patching import Patches
from ...core.tracking import held_by
from .constants import CONSTANT_NUMEL
from .values import SimulatedValue

__all__ = ["Sandbox", "Shadow", "sanitize_value", "contains_fake", "reachable_tensors", "copy_value",
           "copy_optimizer"]

_SKIP_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "_ih", "_oh", "_dh", "_", "__", "___",
               "__builtins__", "__builtin__", "__name__", "__doc__", "__spec__", "__loader__",
               "__package__"}
# the most objects a plain value a what-if run copies may hold, as many as contains_tensor
# walks (a larger one, a corpus kept as a list of ints, is worked on as it is)
PLAIN_COPY_LIMIT = 10_000
_ATOMIC = (type(None), bool, int, float, complex, str, bytes, range, type, types.ModuleType,
           types.FunctionType, types.BuiltinFunctionType, types.MethodType, torch.dtype,
           torch.device, torch.Size)


@dataclass
class Shadow:
    """What the persistent simulated GPU keeps for one notebook name (see .session):
    ``shown``, the object the notebook's namespace holds under the name; ``value``, the
    simulated object a simulated cell gets instead."""

    shown: Any
    value: Any


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    return type(value).__name__


def _reached(value: Any, limit: int, visits: list[int] | None = None) -> Iterator[Any]:
    """The objects ``value`` reaches, each once (a bounded walk over containers, dict keys,
    ``__dict__`` and a wrapper tensor's inner tensors; placeholders of the notebook's
    simulated GPU hold nothing here), until ``limit`` of them; ``visits``: [0], counts
    every item visited, plain values too, and stops the walk past ``limit`` of those."""
    seen: set[int] = set()
    stack = [value]
    while stack and len(seen) < limit:
        v = stack.pop()
        if visits is not None:
            visits[0] += 1
            if visits[0] > limit:
                return
        if id(v) in seen or isinstance(v, _ATOMIC) or type(v) is SimulatedValue:
            continue
        seen.add(id(v))
        yield v
        if isinstance(v, torch.Tensor):
            inner = held_by(v)  # a wrapper subclass (DTensor, a torchao weight)
            if inner is not None:
                stack.extend(inner)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack.extend(v)
        else:
            d = getattr(v, "__dict__", None)
            if isinstance(d, dict):
                stack.extend(d.values())


def _reachable_tensors(value: Any, limit: int = 10_000) -> Iterator[torch.Tensor]:
    """Tensors ``value`` reaches (:func:`_reached`)."""
    return (v for v in _reached(value, limit) if isinstance(v, torch.Tensor))


reachable_tensors = _reachable_tensors


def contains_tensor(value: Any, limit: int = 10_000) -> bool:
    """Whether ``value`` reaches a tensor."""
    return any(True for _ in _reachable_tensors(value, limit))


def is_simulated(t: torch.Tensor) -> bool:
    """Whether ``t`` is a simulated tensor: a FakeTensor, or a wrapper subclass over them."""
    inner = held_by(t)
    return _priv.is_fake(t) if inner is None else bool(inner) and all(map(_priv.is_fake, inner))


def contains_fake(value: Any, limit: int = 10_000) -> bool:
    """Whether ``value`` reaches a FakeTensor."""
    return any(_priv.is_fake(t) for t in _reachable_tensors(value, limit))


def sanitize_value(value: Any, name: str = "the cell's value", shown: str | None = None,
                   live: bool = False) -> Any:
    """The value a simulated cell returns, safe to hand to the notebook. ``shown``: its
    repr taken inside the simulation (what a GPU run would print, values aside)."""
    if value is None or isinstance(value, _ATOMIC):
        return value
    if contains_fake(value):
        return SimulatedValue(name, _describe(value), live=live, shown=shown)
    return value


def _within(value: Any, limit: int) -> bool:
    """Whether ``value`` holds at most ``limit`` items, plain values too (:func:`_reached`)."""
    visits = [0]
    for _ in _reached(value, limit, visits):
        pass
    return visits[0] <= limit


# the modules whose plain objects a what-if run copies: Python's containers, torch's
# objects (a GradScaler), the notebook's own classes; a library's (a tokenizer, a dataset)
# may be large or costly to copy, and is worked on as it is
_PLAIN_MODULES = ("builtins", "collections", "__main__", "torch")


def _copied_plain(value: Any) -> bool:
    """Whether a what-if run copies ``value``, which holds no tensor: one of
    :data:`_PLAIN_MODULES`' objects of at most :data:`PLAIN_COPY_LIMIT` items."""
    module = (type(value).__module__ or "").partition(".")[0]
    return module in _PLAIN_MODULES and _within(value, PLAIN_COPY_LIMIT)


def _worth_swapping(value: Any) -> bool:
    if isinstance(value, _ATOMIC) or isinstance(value, SimulatedValue):
        return False
    mod = type(value).__module__ or ""
    if mod.startswith(("numpy", "pandas", "IPython", "matplotlib", "ipykernel", "ipywidgets")):
        return False
    return True


def copy_optimizer(opt: torch.optim.Optimizer, memo: dict) -> torch.optim.Optimizer:
    """An optimizer's copy with every attribute of its own: its deepcopy keeps only
    ``defaults``, ``state`` and ``param_groups`` (``Optimizer.__getstate__``), where a
    subclass keeps more (nanochat's MuonAdamW its step counts as 0-d tensors) and its
    hooks. An LR scheduler's mark on its ``step`` (an instance attribute, to check that
    ``optimizer.step()`` runs before ``scheduler.step()``) would call the original: the
    copy gets the same mark, calling its class's ``step`` of the moment (so the what-if
    knobs' step gates apply to it)."""
    new = _copied_attributes(opt, memo, skip=("step",))
    marked = vars(opt).get("step")
    if marked is None or not hasattr(marked, "_wrapped_by_lr_sched"):
        if marked is not None:
            vars(new)["step"] = copy_value(marked, memo)
        return new
    ref = weakref.ref(new)

    def step(*args: Any, _ref=ref, **kwargs: Any) -> Any:
        opt = _ref()
        opt._opt_called = True
        return type(opt).step(opt, *args, **kwargs)
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    vars(new)["step"] = step
    return new


def _copied_attributes(value: Any, memo: dict, skip: tuple[str, ...] = ()) -> Any:
    """A copy of ``value`` made the way deepcopy copies an object whose class defines no
    copy path of its own: a new instance (no ``__init__``) with a copy of each attribute
    (but ``skip``), set as deepcopy sets state (no ``__setattr__``, no ``__setstate__``)."""
    new = type(value).__new__(type(value))  # raises for a class that needs arguments
    memo[id(value)] = new
    attrs = vars(new)
    for k, v in vars(value).items():
        if k not in skip:
            attrs[k] = copy_value(v, memo)
    return new


def copy_value(value: Any, memo: dict) -> Any:
    """``copy.deepcopy(value, memo)``; where an object's own copy path fails (its
    ``__getstate__``/``__reduce__`` reads a simulated value), the copy is rebuilt from its
    attributes, the way deepcopy copies an object that defines neither: the same state,
    its tensors copied as the card's are. Raises when that fails too."""
    before = set(memo)
    try:
        return copy.deepcopy(value, memo)
    except Exception:
        # what the failed attempt memoised is half-built: forget it
        for key in [k for k in memo if k not in before and k != id(memo)]:
            del memo[key]
        if id(value) in memo:
            return memo[id(value)]
        if type(value) in (list, dict):
            out = type(value)()
            memo[id(value)] = out
            if isinstance(out, list):
                out.extend(copy_value(v, memo) for v in value)
            else:
                for k, v in value.items():
                    out[copy_value(k, memo)] = copy_value(v, memo)
            return out
        if type(value) is tuple:
            out = tuple(copy_value(v, memo) for v in value)
            return memo.setdefault(id(value), out)
        state = getattr(value, "__dict__", None)
        if not isinstance(state, dict) or isinstance(value, (torch.Tensor, type)):
            raise
        return _copied_attributes(value, memo)


class Sandbox:
    """Swap the namespace's values for fake copies during a simulated run (see module doc)."""

    def __init__(self, namespace: dict, fake_mode, replacements: dict[int, Any] | None = None,
                 shadow: dict | None = None, whatif: bool = False) -> None:
        """``shadow``: the persistent simulated GPU's name -> Shadow map (see .session),
        or None for a one-off run (every name is restored afterwards); ``whatif``: the run
        is on a copy of it (plain data is copied too: see the module's docstring)."""
        self.ns = namespace
        self.whatif = whatif
        self.fake_mode = fake_mode
        self.replacements = replacements or {}
        self.shadow = shadow
        self.saved: dict[str, Any] | None = None
        self.fakes: list[tuple[torch.Tensor, torch.Tensor]] = []  # (real, fake)
        self.not_isolated: list[str] = []
        # ids only, so that what the cell deletes is freed when it deletes it
        self.restored: dict[str, tuple[Any, int]] = {}  # name -> (shown, id(simulated object))
        self.copies: dict[str, int] = {}                # name -> id(the fake copy made for it)
        self._memo: dict[int, Any] = {}

    # -- fake copies --------------------------------------------------------------------
    def _fake_tensor(self, t: torch.Tensor, memo: dict) -> torch.Tensor:
        key = id(t)
        if key in memo:
            return memo[key]
        if is_simulated(t):
            memo[key] = t
            return t
        f = _priv.fake_copy(self.fake_mode, t, CONSTANT_NUMEL)
        memo[key] = f
        self.fakes.append((t, f))
        return f

    def _copy(self, value: Any, memo: dict) -> Any:
        if isinstance(value, torch.Tensor):
            return self._fake_tensor(value, memo)
        def tensor_deepcopy(t, m):
            return self._fake_tensor(t, m)

        patches = Patches()
        try:
            patches.set(torch.Tensor, "__deepcopy__", tensor_deepcopy)
            patches.set(torch.nn.Parameter, "__deepcopy__", tensor_deepcopy)
            patches.set(torch.optim.Optimizer, "__deepcopy__", copy_optimizer)
            return copy.deepcopy(value, memo)
        finally:
            patches.restore()

    # -- enter / exit -------------------------------------------------------------------
    def enter(self) -> None:
        ns = self.ns
        self.saved = dict(ns)
        memo = self._memo
        persistent = self.shadow is not None
        given = self._give_back(memo) if persistent else {}
        for key, value in list(ns.items()):
            sim = given.pop(key, None)
            if sim is not None:
                ns[key] = sim
                continue
            rep = self.replacements.get(id(value))
            if rep is not None:
                ns[key] = rep
                continue
            if _skipped(key):
                continue
            if not _worth_swapping(value):
                continue
            if persistent and not contains_tensor(value) and not (
                    self.whatif and _copied_plain(value)):
                continue  # plain data: the cell works on the real thing, as on a GPU
            try:
                ns[key] = self._copy(value, memo)
            except Exception:
                if contains_real_tensor(value):
                    self.not_isolated.append(key)
            else:
                if ns[key] is not value:
                    self.copies[key] = id(ns[key])
        _priv.forget_fake_memo(self.fake_mode)

    def release(self) -> None:
        """Drop the sandbox's own references to the fake copies (after they were counted),
        so that a tensor the cell deletes is freed when it is deleted."""
        self._memo.clear()
        self.fakes.clear()

    def _give_back(self, memo: dict) -> dict[str, Any]:
        """The shadow's simulated objects for the names that still show what the last
        simulated cell left; a real object a simulated copy stands for is copied to that
        copy wherever else the namespace reaches it (memo), its tensors too."""
        ns, shadow = self.ns, self.shadow
        given: dict[str, Any] = {}
        keep = memo.setdefault(id(memo), [])
        for key, sh in shadow.items():
            if key not in ns or ns[key] is not sh.shown:
                continue  # rebound or deleted by a real cell: the simulated object goes
            given[key] = sh.value
            self.restored[key] = (sh.shown, id(sh.value))
            if isinstance(sh.shown, (SimulatedValue, _ATOMIC)):
                continue
            memo[id(sh.shown)] = sh.value
            keep.append(sh.shown)
            for real, fake in _paired_tensors(sh.shown, sh.value):
                memo[id(real)] = fake
                keep.append(real)
        shadow.clear()  # the cell's namespace holds them now (and may delete them)
        return given

    def exit(self) -> None:
        """Restore every original key/value; new names become placeholders (with a
        persistent simulated GPU: see :meth:`_exit_persistent`)."""
        if self.saved is None:
            return
        if self.shadow is not None:
            self._exit_persistent()
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

    def _exit_persistent(self) -> None:
        """The namespace as the cell left it, with real objects of real cells shown for the
        names the cell only used; the shadow keeps the simulated objects."""
        ns, saved, shadow = self.ns, self.saved, self.shadow
        self.saved = None
        new: dict[str, Any] = {}
        for key in list(ns):
            if _skipped(key) or (key.startswith("__") and key.endswith("__")):
                continue
            v = ns[key]
            back = self.restored.get(key)
            if back is not None and id(v) == back[1]:      # the same simulated object
                ns[key] = back[0]
                new[key] = Shadow(back[0], v)
                continue
            if self.copies.get(key) == id(v):              # a real object's simulated copy
                ns[key] = saved[key]
                new[key] = Shadow(saved[key], v)
                continue
            if key in saved and v is saved[key]:
                # not copied (plain data, a placeholder, a module): real, unless the cell
                # put simulated tensors into it
                if not isinstance(v, (_ATOMIC, SimulatedValue)) and contains_fake(v):
                    new[key] = self._placeholder(key, v)
                continue
            # made or rebound by the cell
            if isinstance(v, (types.ModuleType, types.FunctionType, type,
                              types.BuiltinFunctionType, SimulatedValue)):
                continue
            if not isinstance(v, _ATOMIC) and contains_fake(v):
                new[key] = self._placeholder(key, v)
        shadow.clear()
        shadow.update(new)
        self.restored.clear()
        self.copies.clear()
        self._memo.clear()
        self.fakes.clear()

    def _placeholder(self, key: str, value: Any):
        ph = SimulatedValue(key, _describe(value), live=True)
        self.ns[key] = ph
        return Shadow(ph, value)


def _skipped(key: str) -> bool:
    """IPython's own names (history, outputs): never swapped."""
    return key in _SKIP_NAMES or (key.startswith("_") and (key[1:].isdigit() or key.startswith("_i")))


def _paired_tensors(real: Any, fake: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(real tensor, its simulated counterpart) of a module and its simulated copy, by name."""
    if isinstance(real, torch.nn.Module) and isinstance(fake, torch.nn.Module):
        for getter in ("named_parameters", "named_buffers"):
            fakes = dict(getattr(fake, getter)(remove_duplicate=False))
            for name, t in getattr(real, getter)(remove_duplicate=False):
                f = fakes.get(name)
                if f is not None:
                    yield t, f


def contains_real_tensor(value: Any, limit: int = 10_000) -> bool:
    """Whether ``value`` reaches a real (not fake) tensor."""
    return any(not is_simulated(t) for t in _reachable_tensors(value, limit))


