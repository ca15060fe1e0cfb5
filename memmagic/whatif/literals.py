"""Knob sizes written out as numbers: ``batch_size = 64`` at the top level of a cell or a
script, set once (or, where no variable of that name is set there, one number given under
that name: ``{"batch_size": 64}``, ``DataLoader(ds, batch_size=64)``, ``train(64)`` for a
``def train(batch_size)`` of the same source).

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
from typing import Any, Callable, Iterable, Iterator, Mapping

__all__ = ["Numbers", "assigned_constants", "with_assignments", "module_scope"]


class Numbers:
    """The sizes ``source`` sets once to a number written out (:attr:`at`: variable ->
    (line, value), for the knobs a script may take on its command line: ``batch_size``,
    ``seq_len``, ``accum_steps``) and its text compiled with other values there, once for
    each set of values (``compile``: text -> what runs it). None: no source, no numbers."""

    def __init__(self, source: str | None, compile: Callable[[str], Any],
                 namespace: Mapping[str, Any] | None = None) -> None:
        from .knobs import KNOBS

        self.source, self._compile = source, compile
        # where the functions the source calls by name may be (an earlier cell's)
        self._namespace = namespace or {}
        sized = {k.var for k in KNOBS.values() if k.script_flags}
        # what a call or a settings dict may call a size (TrainingArguments'
        # per_device_train_batch_size: the batch)
        self._aliases = {dest: k.var for k in KNOBS.values() if k.script_flags
                         for dest in k.script_dests if dest != k.var}
        nodes, keyed = (_found(source, sized, self._namespace, self._aliases)
                        if source is not None else ({}, {}))
        self.at = {var: (node[0].lineno, node[0].value) for var, node in nodes.items()}
        # those given under the name, not set to a variable (a settings dict's entry, a
        # call's argument): no variable holds them; var -> how the source writes them
        self.keyed = keyed
        self._compiled: dict[tuple, Any] = {}

    def written(self, var: str) -> str:
        """How the source sets ``var``: ``batch_size = 8``, ``"batch_size": 8``,
        ``batch_size=8`` (a call's keyword) or ``train(8)``."""
        return self.keyed.get(var) or f"{var} = {self.at[var][1]}"

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
            self._compiled[key] = self._compile(with_assignments(self.source, new,
                                                                 self._namespace, self._aliases))
        return self._compiled[key]


def assigned_constants(source: str, names: Iterable[str]) -> dict[str, tuple[int, int]]:
    """variable of ``names`` -> (line, value) where ``source``'s top level sets it, once, to a
    whole number written out; {} where ``source`` is not Python (a cell of IPython syntax)."""
    return {var: (nodes[0].lineno, nodes[0].value)
            for var, nodes in _literals(source, names).items()}


def with_assignments(source: str, values: dict[str, int],
                     namespace: Mapping[str, Any] | None = None,
                     aliases: Mapping[str, str] | None = None) -> str:
    """``source`` with the number each variable of ``values`` is set to (see
    :func:`assigned_constants`) replaced by its value there, the rest of the text as it is
    (``namespace``, ``aliases``: as :func:`_found` takes them)."""
    nodes = [(var, node) for var, each in _found(source, values, namespace, aliases)[0].items()
             for node in each]
    lines = source.splitlines(keepends=True)
    # from the last line and column back, so that earlier positions stay valid
    for var, node in sorted(nodes, key=lambda vn: (vn[1].lineno, vn[1].col_offset),
                            reverse=True):
        if node.lineno != node.end_lineno:
            continue
        raw = lines[node.lineno - 1].encode("utf-8")  # ast's columns count UTF-8 bytes
        raw = raw[:node.col_offset] + str(int(values[var])).encode() + raw[node.end_col_offset:]
        lines[node.lineno - 1] = raw.decode("utf-8")
    return "".join(lines)


def _literals(source: str, names: Iterable[str]) -> dict[str, list[ast.Constant]]:
    """variable of ``names`` -> the whole-number literals where ``source``'s top level sets
    it (see :func:`_found`)."""
    return _found(source, names)[0]


def _found(source: str, names: Iterable[str], namespace: Mapping[str, Any] | None = None,
           aliases: Mapping[str, str] | None = None
           ) -> tuple[dict[str, list[ast.Constant]], dict[str, str]]:
    """(variable of ``names`` -> the whole-number literal ``source``'s top level sets it to,
    once (``b = 16``, ``b, s = 16, 1024``; no other binding of it in the module's scope: a
    loop's, a ``with``'s, a walrus's, an unpacking's of a value, an augmented
    assignment's), as a list of one; where no variable of that name is bound there, the
    numbers given under that name (:func:`_entries`: a settings dict's entry, rasbt's
    ``OTHER_SETTINGS``; a call's keyword, ``DataLoader(ds, batch_size=32)``; an argument
    of a function the source defines, or ``namespace`` holds (an earlier cell's) where the
    source binds no such name, ``train(32)``; under a name of
    ``aliases``, the variable it maps to: ``per_device_train_batch_size=32``), where each is
    the same whole number written out (two loaders of one batch size: both are set); and
    those variables found given so, each with how the source writes it: no variable holds
    the value a run is given)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}, {}
    names = set(names)
    found: dict[str, ast.Constant] = {}
    bound: dict[str, int] = {}
    keyed: dict[str, list[tuple[ast.AST, str]]] = {}
    defs = _defined(tree, namespace or {})
    for node in module_scope(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load) and node.id in names:
            bound[node.id] = bound.get(node.id, 0) + 1
        for name, value, how in _entries(node, defs):
            name = (aliases or {}).get(name, name)
            if name in names:
                keyed.setdefault(name, []).append((value, how))
        target = (node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1
                  else node.target if isinstance(node, ast.AnnAssign) else None)
        for name, value in _pairs(target, getattr(node, "value", None)):
            if name.id in names and _whole(value):
                found[name.id] = value
    out = {var: [node] for var, node in found.items() if bound.get(var) == 1}
    entries = {var: sorted(given, key=lambda vh: (vh[0].lineno, vh[0].col_offset))
               for var, given in keyed.items() if var not in bound
               and all(_whole(v) for v, _ in given)
               and len({v.value for v, _ in given}) == 1}  # type: ignore[attr-defined]
    return ({**out, **{var: [v for v, _ in given] for var, given in entries.items()}},
            {var: given[0][1].format(given[0][0].value)  # type: ignore[attr-defined]
             for var, given in entries.items()})


def _whole(node: ast.AST) -> bool:
    return (isinstance(node, ast.Constant) and isinstance(node.value, int)
            and not isinstance(node.value, bool))


def _entries(node: ast.AST, defs: dict[str, list[str]]) -> list[tuple[str, ast.AST, str]]:
    """(name, value, how it is written: a format of the number) of what ``node`` gives
    under a name: a dict written out's string keys (``{"batch_size": 8}``), a call's
    keywords (``dict(batch_size=8)``, ``DataLoader(ds, batch_size=8)``), and the
    positional arguments of a call of a function of ``defs`` (the source's own
    ``def train(batch_size)``: ``train(8)``) by its parameters' names."""
    if isinstance(node, ast.Dict):
        return [(k.value, v, f'"{k.value}": {{}}') for k, v in zip(node.keys, node.values)
                if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    if not isinstance(node, ast.Call):
        return []
    out = [(kw.arg, kw.value, f"{kw.arg}={{}}") for kw in node.keywords if kw.arg is not None]
    params = defs.get(node.func.id, ()) if isinstance(node.func, ast.Name) else ()
    for param, arg in zip(params, node.args):
        if isinstance(arg, ast.Starred):
            break
        out.append((param, arg, f"{node.func.id}({{}})"))  # type: ignore[union-attr]
    return out


def _defined(tree: ast.Module, namespace: Mapping[str, Any]) -> dict[str, list[str]]:
    """Function name -> its positional parameters' names, of each function the module's
    scope defines once (and binds that name nowhere else: an import, an assignment), and of
    each Python function of ``namespace`` it calls by a name it does not bind (only those
    are read: :func:`_positional`)."""
    defs: dict[str, list[str]] = {}
    seen: dict[str, int] = {}
    called: set[str] = set()
    for node in module_scope(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            called.add(node.func.id)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            seen[node.name] = seen.get(node.name, 0) + 1
            a = node.args
            defs[node.name] = [p.arg for p in (*a.posonlyargs, *a.args)]
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            seen[node.id] = seen.get(node.id, 0) + 1
        elif isinstance(node, ast.alias):
            name = (node.asname or node.name).split(".")[0]
            seen[name] = seen.get(name, 0) + 1
    earlier = {name: _positional(namespace.get(name)) for name in called - set(seen)
               if not name.startswith("_")}
    return {**{name: params for name, params in earlier.items() if params is not None},
            **{name: params for name, params in defs.items() if seen[name] == 1}}


def _positional(f: Any) -> list[str] | None:
    """The positional parameters' names of ``f``, a Python function (None: not one)."""
    import inspect
    import types

    if not isinstance(f, types.FunctionType):
        return None
    try:
        params = inspect.signature(f).parameters.values()
    except (TypeError, ValueError):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


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
