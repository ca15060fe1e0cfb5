"""The one walk of the object graph: from some roots (a notebook's namespace, a failed
cell's frames) to the tensors they hold, with what each tensor is there for.

Two callers, one walk, one skip list:

* the tracker (:func:`memmagic.core.tracking.reachable_existing`) wants every tensor that
  exists before a run, with its category, fast, and nothing else:
  ``walk(..., names=False, internals=True)``;
* the doctor (:mod:`memmagic.doctor`) wants the names that hold each tensor
  (``model.fc.weight``, ``history[3]``, a closure's variable) and the groups they form
  (a module's parameters, an optimizer's state, a list of tensors):
  ``walk(..., names=True, internals=False)``.

``internals=True`` follows every reference the ``internals=False`` walk follows, and also
those of library internals, which hold tensors but make no name a user would recognize:
the private attributes of modules, an optimizer's attributes beyond its state (its
parameter groups), dictionaries' keys and the attributes of torch's own objects (a
DataLoader's dataset, a GradScaler's scale). Neither walks into the objects of the
packages in :data:`SKIP_PACKAGES` (they reach the whole interpreter, or are memmagic's own
machinery) nor into the values in :data:`ATOMIC`.

Also here: :func:`saved_tensors`, the tensors an autograd graph saved for backward.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Iterable, Iterator

import torch

from . import _torch_private as _priv
from ..trace import Category

__all__ = ["ATOMIC", "SKIP_PACKAGES", "MAX_OBJECTS", "Report", "walk", "saved_tensors",
           "optimizer_state"]

# Values that hold no tensor (or only through the interpreter): never walked into.
ATOMIC = (str, bytes, bytearray, int, float, complex, bool, type(None), range, slice,
          type, types.ModuleType, types.BuiltinFunctionType, types.CodeType,
          torch.dtype, torch.device)
# Objects of these packages reach the whole interpreter (the shell, the kernel), or are
# memmagic's own: never walk into them (their tensors, modules and optimizers still count).
SKIP_PACKAGES = frozenset({"IPython", "ipykernel", "traitlets", "zmq", "jupyter_client",
                           "tornado", "asyncio", "matplotlib", "ipywidgets", "comm", "memmagic"})
# torch's own objects (not tensors, modules or optimizers): walked only with internals=True
_LIBRARY = "torch"
# a module's registries of parameters, buffers and submodules: walked through its own API
_REGISTRIES = frozenset({"_parameters", "_buffers", "_modules"})
MAX_OBJECTS = 200_000

# report(tensor, category, path, group): path and group are None when names=False
Report = Callable[[torch.Tensor, Category, "str | None", "str | None"], None]


class _Held:
    """A stack entry with a name, a group or a category. Without names, the objects that
    need none wait on the stack as they are (the walk's hot path: no entry built)."""

    __slots__ = ("path", "obj", "group", "category")

    def __init__(self, path: str | None, obj: Any, group: str | None = None,
                 category: Category | None = None) -> None:
        self.path, self.obj, self.group, self.category = path, obj, group, category


def _held(names: bool, path: str | None, obj: Any, group: str | None = None,
          category: Category | None = None) -> Any:
    return _Held(path, obj, group, category) if names or category is not None else obj


def walk(roots: Iterable[tuple[str | None, Any]], report: Report, *,
         max_objects: int = MAX_OBJECTS, names: bool = True, internals: bool = False) -> bool:
    """Call ``report`` for each tensor reachable from ``roots`` ((name, object) pairs), in
    the order a reader meets them, and for the ``.grad`` of each leaf among them.

    A tensor is reported once for each path that reaches it (so every name that holds it
    is known); other objects are walked once. ``names=False``: no paths or groups are built
    (faster; ``path`` and ``group`` are None). ``internals``: see the module docstring.
    The category is the holder's (a module's parameters and buffers, an optimizer's
    state, a tensor's ``.grad``), else the tensor's own (a ``Parameter`` or other).
    Returns False when the walk stopped after ``max_objects`` objects, True when done.
    """
    seen: set[int] = set()
    stack: list[Any] = [_held(names, n, v) for n, v in reversed(list(roots))]
    while stack:
        obj = stack.pop()
        path = group = category = None
        if type(obj) is _Held:
            path, group, category, obj = obj.path, obj.group, obj.category, obj.obj
        if isinstance(obj, torch.Tensor):
            _report_tensor(report, obj, category, path, group, names)
            continue
        if isinstance(obj, ATOMIC) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if len(seen) > max_objects:
            return False
        tp = type(obj)
        if not names and (tp is list or tp is tuple):  # the hot path of a big namespace
            stack.extend(obj)
        elif not names and tp is dict:
            stack.extend(obj.values())
            if internals:
                stack.extend(k for k in obj if not isinstance(k, ATOMIC))
        else:
            stack.extend(_children(obj, path, names, internals))
    return True


def _report_tensor(report: Report, t: torch.Tensor, category: Category | None,
                   path: str | None, group: str | None, names: bool) -> None:
    if category is None:
        category = Category.PARAMETERS if isinstance(t, torch.nn.Parameter) else Category.OTHER
    report(t, category, path, group)
    grad = t.grad if t.is_leaf else None
    if grad is not None:
        report(grad, Category.GRADIENTS, f"{path}.grad" if names else None, group)


def _children(obj: Any, path: str | None, names: bool, internals: bool) -> list[Any]:
    """What ``obj`` holds, in the order to push it on the walk's stack (the last is
    walked first)."""
    if isinstance(obj, torch.nn.Module):
        try:
            return _module_children(obj, path, names, internals)
        except Exception:  # a module that cannot list its tensors: walk it as an object
            return _attribute_children(obj, path, names) if internals else []
    if isinstance(obj, torch.optim.Optimizer):
        return _optimizer_children(obj, path, names, internals)
    if isinstance(obj, dict):
        return _dict_children(obj, path, names, internals)
    if isinstance(obj, (list, tuple)):
        return _sequence_children(obj, path, names)
    if isinstance(obj, (set, frozenset)):
        return [_held(names, f"{path}{{...}}" if names else None, v) for v in obj]
    if isinstance(obj, types.FunctionType):
        return _closure_children(obj, path, names)
    if isinstance(obj, types.MethodType):
        return [_held(names, f"{path}.__self__" if names else None, obj.__self__)]
    package = (type(obj).__module__ or "").split(".", 1)[0]
    if package in SKIP_PACKAGES or (package == _LIBRARY and not internals):
        return []
    return _attribute_children(obj, path, names)


def _module_children(module: torch.nn.Module, path: str | None, names: bool,
                     internals: bool) -> list[Any]:
    """A module's parameters and buffers (its submodules' included, as one group), and the
    other attributes of it and its submodules (private ones only with ``internals``)."""
    group = f"{path} (module)" if names else None
    out: list[Any] = []
    for name, p in module.named_parameters(recurse=True):
        out.append(_Held(f"{path}.{name}" if names else None, p, group, Category.PARAMETERS))
    for name, b in module.named_buffers(recurse=True):
        out.append(_Held(f"{path}.{name}" if names else None, b, group, Category.BUFFERS))
    for m_path, m in module.named_modules():  # plain attributes (model.cache)
        for attr, value in vars(m).items():
            if isinstance(value, torch.nn.Module):
                continue
            if attr.startswith("_") and (not internals or attr in _REGISTRIES):
                continue
            sub = f"{path}.{m_path + '.' if m_path else ''}{attr}" if names else None
            out.append(_held(names, sub, value))
    return out


def optimizer_state(opt: torch.optim.Optimizer) -> Iterator[tuple[int, Any, Any]]:
    """(index of the parameter, key, value) of each entry of an optimizer's state."""
    for i, state in enumerate(opt.state.values()):
        if isinstance(state, dict):
            for k, v in state.items():
                yield i, k, v


def _optimizer_children(opt: torch.optim.Optimizer, path: str | None, names: bool,
                        internals: bool) -> list[Any]:
    group = f"{path} (optimizer state)" if names else None
    out: list[Any] = [_Held(f"{path}.state[{i}][{k!r}]" if names else None, v, group,
                            Category.OPTIMIZER_STATE) for i, k, v in optimizer_state(opt)]
    if internals:  # its parameter groups (the parameters, when no module names them)
        out.extend(_attribute_children(opt, path, names))
    return out


def _dict_children(d: dict, path: str | None, names: bool, internals: bool) -> list[Any]:
    items = list(d.items())
    if names:
        out: list[Any] = [_Held(f"{path}[{_key(k)}]", v) for k, v in reversed(items)]
    else:
        out = [v for _, v in items]
    if internals:
        out.extend(_held(names, f"{path}<key>" if names else None, k) for k, _ in items
                   if not isinstance(k, ATOMIC))
    return out


def _sequence_children(seq: list | tuple, path: str | None, names: bool) -> list[Any]:
    """A list's or tuple's items; two tensors or more in it make a group (``xs[...]``)."""
    if not names:
        return list(seq)
    tensors = sum(isinstance(v, torch.Tensor) for v in seq)
    group = f"{path}[...]" if tensors >= 2 else None
    return [_Held(f"{path}[{i}]", seq[i], group if isinstance(seq[i], torch.Tensor) else None)
            for i in range(len(seq) - 1, -1, -1)]


def _closure_children(fn: types.FunctionType, path: str | None, names: bool) -> list[Any]:
    out: list[Any] = []
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        out.append(_held(names, f"{path}.<closure>.{name}" if names else None, value))
    return out


def _attribute_children(obj: Any, path: str | None, names: bool) -> list[Any]:
    d = getattr(obj, "__dict__", None)
    if not isinstance(d, dict):
        return []
    if not names:
        return [d]
    return [_Held(f"{path}.{k}", v) for k, v in reversed(list(d.items()))]


def _key(value: Any) -> str:
    """How a dictionary key reads in a path: ``stats['loss']``, ``Out[12]``, ``d[<tuple>]``."""
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (int, float, bool)) or value is None:
        return repr(value)
    return f"<{type(value).__name__}>"


def saved_tensors(fn: object, seen: set[int]) -> Iterator[torch.Tensor]:
    """Tensors saved for backward by the autograd graph reachable from ``fn`` (a node);
    ``seen`` collects the ids of the nodes walked (and skips those already in it).

    A node of torch's own ops keeps them as ``_saved_*`` attributes; a node of a custom
    ``torch.autograd.Function`` (the node is its ``ctx``) keeps them in ``ctx.saved_tensors``
    (``save_for_backward``) and in the attributes its forward set (``ctx.mask = mask``)."""
    stack = [fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for value in _node_values(node):
            values = value if isinstance(value, (tuple, list)) else (value,)
            for v in values:
                if isinstance(v, torch.Tensor):
                    yield v
        for nxt, _ in getattr(node, "next_functions", ()):
            stack.append(nxt)


def _node_values(node: object) -> Iterator[Any]:
    """What one autograd node keeps for its backward (see :func:`saved_tensors`)."""
    yield from _priv.node_saved_values(node)
    if not isinstance(node, torch.autograd.function.BackwardCFunction):
        return
    try:
        yield node.saved_tensors  # type: ignore[attr-defined]
    except Exception:  # freed by an earlier backward, or a hook refused
        pass
    yield from getattr(node, "__dict__", {}).values()
