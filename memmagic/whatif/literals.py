"""Knob sizes written out as numbers: ``batch_size = 64`` at the top level of a cell or a
script, set once.

A cell or a script that sets a knob's variable (``batch_size``, ``seq_len``,
``accum_steps``) once, at its top level, to a whole number written out takes that knob
there: :func:`assigned_constants` finds the line, and a run at another value runs the
source with the number replaced (:func:`with_assignments`: the same text, only that number
changed, so every line stays where it is and the user's file or cell is not touched).
``batch_size, seq_len = 16, 1024`` sets each once too. A variable set twice, or to
anything else (``16 * 4``, ``+= 8``, a loop's target, ``b, s = sizes``), is not one: its
value is the code's to compute. Functions' and classes' bodies are not the
top level. Knows nothing of IPython or of scripts."""

from __future__ import annotations

import ast
from typing import Any, Callable, Iterable, Iterator

__all__ = ["Numbers", "assigned_constants", "with_assignments", "module_scope"]


class Numbers:
    """The sizes ``source`` sets once to a number written out (:attr:`at`: variable ->
    (line, value), for the knobs a script may take on its command line: ``batch_size``,
    ``seq_len``, ``accum_steps``) and its text compiled with other values there, once for
    each set of values (``compile``: text -> what runs it). None: no source, no numbers."""

    def __init__(self, source: str | None, compile: Callable[[str], Any]) -> None:
        from .knobs import KNOBS

        self.source, self._compile = source, compile
        sized = {k.var for k in KNOBS.values() if k.script_flags}
        nodes, keyed = _found(source, sized) if source is not None else ({}, set())
        self.at = {var: (node.lineno, node.value) for var, node in nodes.items()}
        # those of a settings dict's entries (``{"batch_size": 8}``): no variable holds them
        self.keyed = keyed
        self._compiled: dict[tuple, Any] = {}

    def written(self, var: str) -> str:
        """How the source sets ``var``: ``batch_size = 8`` or ``"batch_size": 8``."""
        number = self.at[var][1]
        return f'"{var}": {number}' if var in self.keyed else f"{var} = {number}"

    def changed(self, values: dict[str, Any]) -> dict[str, int]:
        """The whole numbers of ``values`` that differ from the ones written at :attr:`at`."""
        return {var: values[var] for var, (_, number) in self.at.items()
                if isinstance(values.get(var), int) and not isinstance(values[var], bool)
                and values[var] != number}

    def compiled(self, values: dict[str, Any]) -> Any | None:
        """``source`` compiled with :meth:`changed`'s values in place of its numbers; None
        where none changes (the source as written runs)."""
        new = self.changed(values)
        if not new:
            return None
        key = tuple(sorted(new.items()))
        if key not in self._compiled:
            assert self.source is not None
            self._compiled[key] = self._compile(with_assignments(self.source, new))
        return self._compiled[key]


def assigned_constants(source: str, names: Iterable[str]) -> dict[str, tuple[int, int]]:
    """variable of ``names`` -> (line, value) where ``source``'s top level sets it, once, to a
    whole number written out; {} where ``source`` is not Python (a cell of IPython syntax)."""
    return {var: (node.lineno, node.value) for var, node in _literals(source, names).items()}


def with_assignments(source: str, values: dict[str, int]) -> str:
    """``source`` with the number each variable of ``values`` is set to (see
    :func:`assigned_constants`) replaced by its value there, the rest of the text as it is."""
    nodes = _literals(source, values)
    lines = source.splitlines(keepends=True)
    # from the last line and column back, so that earlier positions stay valid
    for var, node in sorted(nodes.items(), key=lambda kv: (kv[1].lineno, kv[1].col_offset),
                            reverse=True):
        if node.lineno != node.end_lineno:
            continue
        raw = lines[node.lineno - 1].encode("utf-8")  # ast's columns count UTF-8 bytes
        raw = raw[:node.col_offset] + str(int(values[var])).encode() + raw[node.end_col_offset:]
        lines[node.lineno - 1] = raw.decode("utf-8")
    return "".join(lines)


def _literals(source: str, names: Iterable[str]) -> dict[str, ast.Constant]:
    """variable of ``names`` -> the whole-number literal ``source``'s top level sets it to
    (see :func:`_found`)."""
    return _found(source, names)[0]


def _found(source: str, names: Iterable[str]) -> tuple[dict[str, ast.Constant], set[str]]:
    """(variable of ``names`` -> the whole-number literal ``source``'s top level sets it to,
    once (``b = 16``, ``b, s = 16, 1024``; no other binding of it in the module's scope: a
    loop's, a ``with``'s, a walrus's, an unpacking's of a value, an augmented
    assignment's); where no variable of that name is bound there, the one entry of a
    settings dict written out under that name (``{"batch_size": 32}``, ``dict(batch_size=32)``,
    rasbt's ``OTHER_SETTINGS``), the variables found as such entries: no variable holds the
    value a run is given)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}, set()
    names = set(names)
    found: dict[str, ast.Constant] = {}
    bound: dict[str, int] = {}
    keyed: dict[str, list[ast.AST]] = {}
    for node in module_scope(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load) and node.id in names:
            bound[node.id] = bound.get(node.id, 0) + 1
        for name, value in _entries(node):
            if name in names:
                keyed.setdefault(name, []).append(value)
        target = (node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1
                  else node.target if isinstance(node, ast.AnnAssign) else None)
        for name, value in _pairs(target, getattr(node, "value", None)):
            if name.id in names and _whole(value):
                found[name.id] = value
    out = {var: node for var, node in found.items() if bound.get(var) == 1}
    entries = {var: values[0] for var, values in keyed.items()
               if var not in bound and len(values) == 1 and _whole(values[0])}
    return {**out, **entries}, set(entries)  # type: ignore[dict-item]


def _whole(node: ast.AST) -> bool:
    return (isinstance(node, ast.Constant) and isinstance(node.value, int)
            and not isinstance(node.value, bool))


def _entries(node: ast.AST) -> list[tuple[str, ast.AST]]:
    """(key, value) of a dict written out: ``{"batch_size": 8}``'s string keys, or the
    keywords of ``dict(batch_size=8)``."""
    if isinstance(node, ast.Dict):
        return [(k.value, v) for k, v in zip(node.keys, node.values)
                if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "dict"):
        return [(kw.arg, kw.value) for kw in node.keywords if kw.arg is not None]
    return []


def _pairs(target: ast.AST | None, value: ast.AST | None) -> list[tuple[ast.Name, ast.AST]]:
    """(name, the expression it is set to) of an assignment's target and value: ``b = 16``,
    and each name of ``b, s = 16, 1024`` with the element at its place (a tuple or list
    of names set from one of as many elements, no starred one)."""
    if isinstance(target, ast.Name) and value is not None:
        return [(target, value)]
    if (isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List))
            and len(target.elts) == len(value.elts)
            and not any(isinstance(e, ast.Starred) for e in (*target.elts, *value.elts))):
        return [(t, v) for t, v in zip(target.elts, value.elts) if isinstance(t, ast.Name)]
    return []


def module_scope(tree: ast.Module) -> Iterator[ast.AST]:
    """Every node of a module that runs in its own scope: not the bodies of its functions
    and classes (their ``def`` and ``class`` statements are), nor lambdas and
    comprehensions, whose variables are their own."""
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda,
                             ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue
        todo.extend(ast.iter_child_nodes(node))
