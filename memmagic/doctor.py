"""The memory doctor: who holds memory after a cell, what a failed cell keeps, what an
out of memory was made of, and which fix saves how much.

* :func:`snapshot` / :func:`retained`: the tensors a cell left alive, largest first, with
  the names that hold them in the namespace (``history[3]``, ``model.cache``,
  ``stats['loss']``, a closure's variable, IPython's ``Out[12]`` and ``_``), the bytes of
  autograd graphs they pin, and the classic leaks named with their fix.
* :func:`traceback_holdings` / :func:`free_traceback`: what a failed cell's traceback
  keeps alive (IPython keeps it for ``%debug``) and the one call that frees it;
  :func:`release_failed_cell` frees it after an out of memory and says how much.
* :func:`describe_oom`: what was requested, what was live by category, by holder and by
  module, and which op, phase and line asked.
* :func:`advise`: all of it as one :class:`Advice`, with the strategies ranked by the peak
  a re-run with each knob gives (through :mod:`memmagic.cell`) and FSDP2 rows
  (:mod:`memmagic.sharding`).

Sizes are ``int`` bytes of tensor storage (the simulation's 512-byte rounding is not
applied here: a fake tensor counts its storage's bytes). Knows nothing of IPython: the
notebook's names (``Out``, ``_``) are read from the namespace handed in.
"""

from __future__ import annotations

import html
import re
import sys
import traceback
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from .failures import (clear_frame, is_machinery, is_out_of_memory, is_user_file,
                       release_call_closures, requested_bytes)
from .report import MemoryReport, format_bytes, needed
from .objgraph import saved_tensors, walk
from .trace import Category

__all__ = ["Holder", "Retained", "Snapshot", "TracebackHold", "OOMDescription", "Strategy",
           "Advice", "snapshot", "retained", "traceback_holdings", "free_traceback",
           "release_failed_cell", "describe_oom", "rank", "advise", "namespace_view", "FREE_CALL"]

FREE_CALL = "memmagic.doctor.free_traceback()"

# IPython's bookkeeping names: never holders of the user's data, or aliases of Out
_SKIP_NAMES = frozenset({"In", "_ih", "_oh", "_dh", "_i", "_ii", "_iii", "exit", "quit",
                         "get_ipython", "__builtins__", "__builtin__", "__name__", "__doc__",
                         "__package__", "__loader__", "__spec__", "__file__", "__cached__"})
_HISTORY = re.compile(r"^_(\d+|_{0,2})$")  # _, __, ___, _12
_INPUT_HISTORY = re.compile(r"^_i\d+$")


# -- walking the namespace -----------------------------------------------------------------
def _rank(path: str) -> int:
    """How readable a holder's name is (lower first): variables and their attributes,
    then closures, then IPython's Out, then the _N history."""
    if path.startswith("Out["):
        return 3
    if _HISTORY.match(path.split("[", 1)[0].split(".", 1)[0]):
        return 4
    if "<closure>" in path:
        return 2
    return 1


@dataclass
class _Found:
    """What the walk saw: for each storage key, the tensor and the paths holding it."""

    tensors: dict[int, Any] = field(default_factory=dict)       # key -> a tensor on it
    paths: dict[int, list[str]] = field(default_factory=dict)   # key -> holder paths
    kind: dict[int, str] = field(default_factory=dict)          # key -> parameter/gradient/state/...
    groups: dict[int, str] = field(default_factory=dict)        # key -> owner group (module / optimizer / list)
    truncated: bool = False


# the doctor's word for each category the walk gives a tensor
_KINDS = {Category.PARAMETERS: "parameter", Category.BUFFERS: "buffer",
          Category.GRADIENTS: "gradient", Category.OPTIMIZER_STATE: "optimizer state",
          Category.OTHER: "tensor"}


def _storage(t: Any) -> tuple[int, int] | None:
    """(storage key, bytes) of a tensor; None for storage-less tensors."""
    from ._torch_private import storage_key
    from ._torch_private import wrapper_inner_tensors

    try:
        inner = wrapper_inner_tensors(t)
        t = inner[0] if inner else t
        st = t.untyped_storage()
        return storage_key(st), int(st.nbytes())
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None


def _walk(roots: Iterable[tuple[str, Any]]) -> _Found:
    """Every tensor reachable from ``roots`` ((name, object) pairs), with the paths holding
    it: the one object-graph walk (:func:`memmagic.objgraph.walk`), with names, through
    the references a user makes (not library internals)."""
    found = _Found()

    def add(t: Any, category: Category, path: str, group: str | None) -> None:
        info = _storage(t)
        if info is None:
            return
        key, _ = info
        found.tensors.setdefault(key, t)
        paths = found.paths.setdefault(key, [])
        if path not in paths:
            paths.append(path)
        found.kind.setdefault(key, _KINDS.get(category, "tensor"))
        if group is not None:
            found.groups.setdefault(key, group)

    found.truncated = not walk(roots, add, names=True, internals=False)
    return found


def _roots(namespace: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The namespace's entries worth walking, the user's names first."""
    out = []
    for name, value in namespace.items():
        if not isinstance(name, str) or name in _SKIP_NAMES or _INPUT_HISTORY.match(name):
            continue
        if name.startswith("__") and not _HISTORY.match(name):
            continue
        if isinstance(value, (types.ModuleType, type)):
            continue
        out.append((name, value))
    out.sort(key=lambda kv: (_rank(kv[0]), kv[0]))
    return out


def namespace_view(namespace: Mapping[str, Any], session: Any = None) -> dict[str, Any]:
    """The namespace as the doctor should walk it: with a notebook-wide simulated GPU
    (a :class:`~memmagic.backends.sim.session.SimSession`), the names that hold simulated
    objects stand for those objects (the namespace itself holds one-line placeholders)."""
    view = dict(namespace)
    card = getattr(session, "card", None)
    for name, shadow in (getattr(card, "shadow", None) or {}).items():
        view[name] = shadow.value
    return view


# -- autograd graphs -----------------------------------------------------------------------
def _graph(t: Any) -> tuple[list[Any], int, int]:
    """(saved tensors, number of nodes, length of the chain of additions at the root) of
    the autograd graph behind ``t``."""
    fn = getattr(t, "grad_fn", None)
    if fn is None:
        return [], 0, 0
    seen: set[int] = set()
    saved: list[Any] = list(saved_tensors(fn, seen))
    chain = 0
    node = fn
    while node is not None and type(node).__name__.startswith("AddBackward"):
        chain += 1
        nxt = [n for n, _ in node.next_functions if n is not None]
        node = next((n for n in nxt if type(n).__name__.startswith("AddBackward")), None)
    return saved, len(seen), chain


# -- retained memory -------------------------------------------------------------------------
@dataclass(frozen=True)
class Snapshot:
    """The storages the namespace held at one moment (take one before a cell)."""

    refs: Mapping[int, Any]  # storage key -> weakref to the storage (or None)

    def holds(self, key: int, storage: Any) -> bool:
        ref = self.refs.get(key)
        if ref is None:
            return key in self.refs
        return ref() is storage


def snapshot(namespace: Mapping[str, Any]) -> Snapshot:
    """What the namespace holds now: the storages of every tensor reachable from it, and
    of the autograd graphs they keep (for :func:`retained` ``since=``)."""
    refs: dict[int, Any] = {}
    for key, t in _reach(_walk(_roots(namespace))).items():
        try:
            refs[key] = weakref.ref(t.untyped_storage())
        except (TypeError, RuntimeError, NotImplementedError):
            refs[key] = None
    return Snapshot(refs)


@dataclass(frozen=True)
class Holder:
    """One row of the retained table: a tensor (or a group: a module's parameters, an
    optimizer's state, a list of tensors) and the names that hold it. Bytes.

    ``graph_bytes``: storages saved for backward by the autograd graph the tensor keeps
    alive (counted once, for the largest holder), ``graph_nodes`` the nodes of that graph;
    ``problem`` and ``fix`` say what is wrong in one sentence, and what to write instead."""

    names: tuple[str, ...]
    nbytes: int
    tensors: int = 1
    what: str = ""
    graph_bytes: int = 0
    graph_nodes: int = 0
    problem: str | None = None
    fix: str | None = None

    @property
    def name(self) -> str:
        return self.names[0] if self.names else "(unnamed)"

    @property
    def total(self) -> int:
        """The tensor's bytes plus what its graph pins."""
        return self.nbytes + self.graph_bytes


@dataclass(frozen=True)
class Retained:
    """The tensors a cell left alive (or, without ``since``, everything the namespace
    holds), largest first. ``unnamed``: bytes the cell retained (the report's
    ``retained``) that no name explains (held by library code, C++ or a cycle); None when
    no report was given."""

    rows: tuple[Holder, ...]
    unnamed: int | None = None
    since_cell: bool = True
    # bytes of library workspaces (cuBLAS) the cell made and torch keeps: no name holds
    # them, and they are no leak (the report's ``workspaces``)
    workspaces: int = 0

    @property
    def total(self) -> int:
        return sum(r.total for r in self.rows)

    @property
    def leaks(self) -> tuple[Holder, ...]:
        """Rows with a problem (an accumulated loss, tensors kept with their graphs)."""
        return tuple(r for r in self.rows if r.problem)

    def __getitem__(self, name: str) -> Holder:
        for r in self.rows:
            if name in r.names:
                return r
        raise KeyError(f"no retained tensor is held by {name!r}; held: {[r.name for r in self.rows]}")

    def table(self, limit: int = 10) -> list[tuple[str, str, str, str]]:
        """(holder, size, autograd graph, problem and fix) for the largest ``limit`` rows."""
        out = []
        for r in self.rows[:limit]:
            names = ", ".join(r.names[:3]) + (f" (+{len(r.names) - 3})" if len(r.names) > 3 else "")
            graph = (f"pins {format_bytes(r.graph_bytes)} ({r.graph_nodes} nodes)"
                     if r.graph_nodes else "")
            advice = " ".join(x for x in (r.problem, r.fix) if x)
            out.append((names, format_bytes(r.nbytes) + (f" ({r.what})" if r.what else ""), graph, advice))
        return out

    def __str__(self) -> str:
        head = "retained by the cell" if self.since_cell else "held by the namespace"
        if not self.rows:
            line = f"{head}: nothing named"
        else:
            line = f"{head}: {format_bytes(self.total)} in {len(self.rows)} holder(s)"
        if self.unnamed:
            line += f"; {format_bytes(self.unnamed)} held by no name"
        if self.workspaces:
            line += f"; {format_bytes(self.workspaces)} of cuBLAS workspaces torch keeps"
        lines = [line]
        for names, size, graph, advice in self.table():
            lines.append(f"  {names:<30} {size:>24}  {graph}" + (f"\n    {advice}" if advice else ""))
        return "\n".join(lines)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))

    def _repr_html_(self) -> str:
        return _html_table(str(self).splitlines()[0], ("holder", "size", "autograd graph", "problem / fix"),
                           self.table())


def _what(t: Any) -> str:
    try:
        shape = "x".join(str(d) for d in t.shape) or "scalar"
        return f"{shape} {str(t.dtype).replace('torch.', '')}"
    except Exception:
        return type(t).__name__


def retained(namespace: Mapping[str, Any], *, since: Snapshot | None = None,
             report: MemoryReport | None = None) -> Retained:
    """The tensors the namespace holds that were not there in ``since`` (the snapshot
    taken before the cell; None: every tensor held), largest first, with their holders,
    the autograd graphs they pin, and the leaks named with their fix."""

    found = _walk(_roots(namespace))
    new = {k: t for k, t in found.tensors.items() if since is None or not since.holds(k, _storage_obj(t))}
    # groups (a module's parameters, an optimizer's state, a list of tensors) become one row
    rows: list[dict[str, Any]] = []
    by_group: dict[str, dict[str, Any]] = {}
    for key, t in new.items():
        paths = sorted(found.paths[key], key=lambda p: (_rank(p), len(p)))
        group = found.groups.get(key)
        nbytes = _storage(t)[1]
        if group is not None and (group.endswith("(module)") or group.endswith("(optimizer state)")
                                  or group.endswith("[...]")):
            g = by_group.get(group)
            if g is None:
                g = by_group[group] = dict(names=[group.split(" (")[0]], nbytes=0, tensors=0,
                                           members=[], kind=found.kind.get(key, "tensor"),
                                           group=group)
                rows.append(g)
            g["nbytes"] += nbytes
            g["tensors"] += 1
            g["members"].append((key, t, paths))
            prefix = group.split(" (")[0].removesuffix("[...]")
            g["names"].extend(p for p in paths if not p.startswith(prefix) and p not in g["names"])
            continue
        rows.append(dict(names=paths, nbytes=nbytes, tensors=1, members=[(key, t, paths)],
                         kind=found.kind.get(key, "tensor"), group=None))
    # graphs: saved storages the cell made, counted once, for the largest holder first
    rows.sort(key=lambda r: -r["nbytes"])
    graph_saved = _pin_graphs(rows, set(found.tensors), since)
    out = [_holder(r) for r in rows]
    out.sort(key=lambda h: (-h.total, h.name))
    unnamed, workspaces = None, 0
    if report is not None and since is not None:
        counted_here = [(t, _storage(t)[1]) for t in new.values()] + graph_saved
        workspaces = _workspaces_made(report)
        unnamed = max(report.retained - _as_allocated(counted_here, report) - workspaces, 0)
    return Retained(tuple(out), unnamed, since is not None, workspaces)


def _pin_graphs(rows: list[dict[str, Any]], counted: set[int], since: Snapshot | None
                ) -> list[tuple[Any, int]]:
    """Give each row the autograd graphs its tensors pin (storages the cell made, counted
    once, for the first row that reaches them); (tensor, bytes) of each storage counted."""
    import torch

    graph_saved: list[tuple[Any, int]] = []
    for r in rows:
        gbytes = nodes = chain = graphs = 0
        for key, t, _ in r["members"]:
            if not isinstance(t, torch.Tensor) or t.grad_fn is None:
                continue
            graphs += 1
            saved, n, c = _graph(t)
            nodes += n
            chain = max(chain, c)
            for s in saved:
                info = _storage(s)
                if info is None or info[0] in counted:
                    continue
                if since is not None and since.holds(info[0], _storage_obj(s)):
                    continue
                counted.add(info[0])
                gbytes += info[1]
                graph_saved.append((s, info[1]))
        r.update(graph_bytes=gbytes, graph_nodes=nodes, chain=chain, graphs=graphs)
    return graph_saved


def freed_by_del(namespace: Mapping[str, Any], names: Iterable[str], report: MemoryReport,
                 on_device: Callable[[Any], bool] | None = None) -> tuple[tuple[str, ...], int]:
    """What ``del`` of these names would free on the device: (the names, in the
    namespace's order, that hold any device storage no other name reaches, tensors or the
    autograd graphs they keep; the bytes of those storages as ``report``'s device counts
    them). Modules and optimizers are left out: they are what the next attempt needs.
    ``on_device(tensor)``: whether a tensor is on the device, where the tensor alone does
    not tell (the simulated GPU's host tensors are fake too)."""
    import torch

    wanted = set(names)
    roots = _roots(namespace)
    mine = [(k, v) for k, v in roots if k in wanted
            and not isinstance(v, (torch.nn.Module, torch.optim.Optimizer))]
    others = [(k, v) for k, v in roots if k not in {m for m, _ in mine}]
    kept = set(_reach(_walk(others)))
    held: dict[int, Any] = {}
    holders = []
    for name, value in mine:
        new = {k: t for k, t in _reach(_walk([(name, value)])).items()
               if k not in kept and (on_device is None or on_device(t))}
        if new:
            holders.append(name)
            held.update(new)
    nbytes = _as_allocated([(t, _storage(t)[1]) for t in held.values()], report)
    return tuple(holders), nbytes


def _reach(found: _Found) -> dict[int, Any]:
    """Storage key -> tensor of everything ``found`` holds and the graphs its tensors keep."""
    out = dict(found.tensors)
    for t in list(found.tensors.values()):
        for s in _graph(t)[0]:
            info = _storage(s)
            if info is not None:
                out.setdefault(info[0], s)
    return out


def _as_allocated(storages: Iterable[tuple[Any, int]], report: MemoryReport) -> int:
    """The bytes ``report`` counts for these (tensor, storage bytes): only those on its
    device (a simulated GPU's tensors are fake; the real CPU scalars an autograd graph
    saves are not on it), in multiples of 512 bytes on a CUDA allocator, real or simulated."""
    from ._torch_private import is_fake

    if report.backend == "sim":
        return sum(-(-n // 512) * 512 for t, n in storages if is_fake(t))
    if report.backend == "cuda":
        return sum(-(-n // 512) * 512 for t, n in storages if t.device.type == "cuda")
    return sum(n for t, n in storages if t.device.type == "cpu" and not is_fake(t))


def _workspaces_made(report: MemoryReport) -> int:
    """Bytes of workspaces (cuBLAS) the run made and left allocated, from its trace."""
    trace = getattr(report, "trace", None)
    if trace is None:
        return 0
    return sum(st.nbytes for st in trace.storages()
               if st.category == Category.WORKSPACES.value and st.freed is None
               and st.op > 0 and st.pool == "device")


def _storage_obj(t: Any) -> Any:
    from ._torch_private import wrapper_inner_tensors

    try:
        inner = wrapper_inner_tensors(t)
        return (inner[0] if inner else t).untyped_storage()
    except Exception:
        return None


def _holder(r: dict[str, Any]) -> Holder:
    names = tuple(r["names"])
    name = names[0]
    members = r["members"]
    t0 = members[0][1]
    if r["group"] is not None and r["group"].endswith("(module)"):
        what = f"{r['tensors']} parameters and buffers"
    elif r["group"] is not None and r["group"].endswith("(optimizer state)"):
        what = f"optimizer state, {r['tensors']} tensors"
    elif r["tensors"] > 1:
        what = f"{r['tensors']} tensors"
    else:
        what = _what(t0)
    problem = fix = None
    gb, nodes = r["graph_bytes"], r["graph_nodes"]
    pinned = f"{format_bytes(gb)} of saved tensors" if gb else f"{nodes} graph nodes"
    only_history = all(_rank(p) >= 3 for p in names)
    if r["chain"] >= 2 and r["tensors"] == 1 and getattr(t0, "numel", lambda: 2)() == 1:
        problem = (f"`{name}` adds up {r['chain']} losses with their autograd graphs "
                   f"({pinned} kept alive): every iteration's graph stays in memory.")
        fix = f"Accumulate `loss.item()` (a float) or `loss.detach()` into `{name}` instead."
    elif r["tensors"] > 1 and r["graphs"] >= 2:
        problem = (f"`{name}` keeps {r['graphs']} tensors with their autograd graphs "
                   f"({pinned}).")
        fix = "Store `loss.item()` or `out.detach()` instead (or compute them under torch.no_grad())."
    elif only_history and r["graphs"]:
        out_name = next((p for p in names if p.startswith("Out[")), name)
        problem = (f"IPython keeps a cell's result in `{out_name}` and `_`, here with its "
                   f"autograd graph ({pinned}).")
        fix = (f"End the cell with `;` (or `.detach()` it); `del {out_name}` or "
               "`%reset -f out` frees it now.")
    elif only_history:
        out_name = next((p for p in names if p.startswith("Out[")), name)
        problem = f"IPython keeps a cell's result in `{out_name}` and `_`."
        fix = f"End the cell with `;`; `del {out_name}` or `%reset -f out` frees it now."
    elif r["graphs"] and gb:
        problem = f"`{name}` keeps its autograd graph alive ({pinned})."
        fix = f"Keep `{name}.detach()` (or compute it under torch.no_grad()) if no backward follows."
    return Holder(names=names, nbytes=r["nbytes"], tensors=r["tensors"], what=what,
                  graph_bytes=gb, graph_nodes=nodes, problem=problem, fix=fix)


# -- a failed cell ------------------------------------------------------------------------------
@dataclass(frozen=True)
class TracebackHold:
    """What a failed cell's traceback keeps alive beyond the namespace. Bytes.

    ``names`` are the frame variables holding them (``step:x``: variable ``x`` of function
    ``step``); ``freed`` is set once the frames were cleared (bytes released)."""

    nbytes: int
    names: tuple[str, ...] = ()
    freed: int | None = None
    out_of_memory: bool = False

    @property
    def fix(self) -> str:
        return FREE_CALL

    def __str__(self) -> str:
        if self.freed is not None:
            return (f"the failed cell's local variables were released ({format_bytes(self.freed)} "
                    "of tensors freed)")
        if not self.nbytes:
            return "the traceback keeps no tensors alive"
        names = ", ".join(self.names[:4]) + (" ..." if len(self.names) > 4 else "")
        return (f"the traceback (kept for %debug) holds {format_bytes(self.nbytes)} of tensors "
                f"({names}); {FREE_CALL} frees it")

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def _frames(tb: Any) -> Iterator[Any]:
    while tb is not None:
        yield tb.tb_frame
        tb = tb.tb_next


def _tb_of(error_or_tb: Any) -> Any:
    if isinstance(error_or_tb, BaseException):
        return error_or_tb.__traceback__
    return error_or_tb


def _machinery(frame: Any) -> bool:
    """A frame of memmagic's own measuring code (the backends, the tracker): what it holds
    is the measurement's, released by the backend, not the user's."""
    return is_machinery(frame.f_code.co_filename)


def traceback_holdings(error: BaseException | Any, namespace: Mapping[str, Any] | None = None
                       ) -> TracebackHold:
    """Bytes of tensors (and the autograd graphs they keep) that only the failed cell's
    traceback holds: its function frames' variables, minus what ``namespace`` holds."""
    tb = _tb_of(error)
    ns_keys: set[int] = set()
    if namespace is not None:
        ns_found = _walk(_roots(namespace))
        ns_keys = set(ns_found.tensors)
        for t in list(ns_found.tensors.values()):
            for s in _graph(t)[0]:
                info = _storage(s)
                if info is not None:
                    ns_keys.add(info[0])
    roots = []
    for f in _frames(tb):
        if f.f_locals is f.f_globals or _machinery(f):
            continue  # the cell's own (module) frame: its variables are the namespace
        code = f.f_code.co_name
        for k, v in list(f.f_locals.items()):
            roots.append((f"{code}:{k}", v))
    found = _walk(roots)
    total = 0
    names: list[str] = []
    counted = set(ns_keys)
    for key, t in found.tensors.items():
        if key in counted:
            continue
        counted.add(key)
        total += _storage(t)[1]
        names.extend(p for p in found.paths[key] if p not in names)
        for s in _graph(t)[0]:
            info = _storage(s)
            if info is not None and info[0] not in counted:
                counted.add(info[0])
                total += info[1]
    return TracebackHold(total, tuple(names))


def free_traceback(error: BaseException | None = None) -> int:
    """Clear the local variables of the frames of ``error``'s traceback (default: the
    last error, ``sys.last_exc`` / ``sys.last_traceback``, which IPython keeps for
    ``%debug``), so the tensors only they hold are freed. ``%debug`` still opens, without
    those variables. Returns how many frames were cleared."""
    import gc

    tbs = []
    if error is not None:
        tbs.append(_tb_of(error))
    else:
        exc = getattr(sys, "last_exc", None)
        if exc is not None:
            tbs.append(exc.__traceback__)
        tbs.append(getattr(sys, "last_traceback", None))
    cleared = 0
    seen: set[int] = set()
    for tb in tbs:
        release_call_closures(tb)
        for f in _frames(tb):
            if id(f) in seen or f.f_locals is f.f_globals:
                continue
            seen.add(id(f))
            if clear_frame(f):
                cleared += 1
    gc.collect()
    return cleared


def release_failed_cell(error: BaseException, namespace: Mapping[str, Any] | None = None
                        ) -> TracebackHold:
    """After an out of memory: clear the failed cell's frames (the next cell needs the
    memory; ``%debug`` then shows no variables) and say how many bytes that freed."""
    hold = traceback_holdings(error, namespace)
    release_call_closures(_tb_of(error))
    for f in _frames(_tb_of(error)):
        if f.f_locals is not f.f_globals:
            clear_frame(f)
    import gc

    gc.collect()
    return TracebackHold(hold.nbytes, hold.names, freed=hold.nbytes, out_of_memory=True)


# -- out of memory --------------------------------------------------------------------------
def _user_frame(tb: Any) -> tuple[str, int, str, str] | None:
    """(file, line, function, source) of the innermost frame of the user's code."""
    best = None
    for fs in traceback.extract_tb(tb):
        if not is_user_file(fs.filename):
            continue
        best = (fs.filename, fs.lineno or 0, fs.name, (fs.line or "").strip())
    return best


@dataclass(frozen=True)
class OOMDescription:
    """What an out of memory was made of. Bytes.

    ``requested``: the allocation that failed; ``live``: bytes live when it failed;
    ``by_category``: those bytes per category; ``by_holder``: (name, bytes) of what the
    namespace holds (the model, the optimizer, the batch) and the failed cell's frames
    (the rest: its activations and temporaries); ``by_module``: (module, activation bytes);
    ``op``/``phase``/``module``/``line``: where it asked; ``left``/``left_bytes``: names
    the failed cell assigns that still hold memory no other name holds (a loss with its
    autograd graph, a batch), and its bytes: re-running earlier cells does not free it
    (on a GPU neither), ``del`` does."""

    requested: int | None
    live: int | None
    capacity: int | None
    by_category: Mapping[str, int]
    by_holder: tuple[tuple[str, int], ...]
    by_module: tuple[tuple[str, int], ...]
    op: str | None
    phase: str | None
    module: str | None
    line: str | None
    left: tuple[str, ...] = ()
    left_bytes: int = 0

    @property
    def del_line(self) -> str | None:
        """The line that frees what the failed cell's names still hold (None: nothing)."""
        return f"del {', '.join(self.left)}" if self.left else None

    def __str__(self) -> str:
        req = format_bytes(self.requested) if self.requested is not None else "an unknown amount"
        head = f"out of memory: asked for {req} with {format_bytes(self.live)} live"
        if self.capacity:
            head += f" on a {format_bytes(self.capacity)} card"
        where = [x for x in (f"at {self.op}" if self.op else None,
                             f"during {self.phase}" if self.phase else None,
                             f"in `{self.module}`" if self.module else None,
                             self.line) if x]
        lines = [head + (" (" + ", ".join(where) + ")" if where else "")]
        cats = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.by_category.items() if v)
        if cats:
            lines.append(f"  live by category: {cats}")
        if self.by_holder:
            lines.append("  live by holder: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in self.by_holder))
        if self.by_module:
            lines.append("  activations by module: " + ", ".join(
                f"{k} {format_bytes(v)}" for k, v in self.by_module[:5]))
        if self.left:
            lines.append(f"  {self.left_text()}")
        return "\n".join(lines)

    def left_text(self) -> str:
        names = ", ".join(f"`{n}`" for n in self.left)
        return (f"{names}, which this cell assigns, still hold{'s' if len(self.left) == 1 else ''} "
                f"{format_bytes(self.left_bytes)} (tensors and the autograd graphs they keep): "
                f"`{self.del_line}` frees it; re-running earlier cells does not")

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def _live_holders(namespace: Mapping[str, Any], live: int) -> list[tuple[str, int]]:
    """(holder, bytes) of what the namespace holds, largest first, and the rest of ``live``
    as the failed cell's frames."""
    found = _walk(_roots(namespace))
    per: dict[str, int] = {}
    for key, t in found.tensors.items():
        group = found.groups.get(key)
        name = group.split(" (")[0] if group else sorted(found.paths[key], key=_rank)[0]
        per[name] = per.get(name, 0) + _storage(t)[1]
    holders = sorted(per.items(), key=lambda kv: -kv[1])[:8]
    rest = live - sum(per.values())
    if rest > 0:
        holders.append(("the failed cell's frames (activations, temporaries)", rest))
    return holders


def describe_oom(report: MemoryReport, error: BaseException | None = None,
                 namespace: Mapping[str, Any] | None = None, bound: Iterable[str] = (),
                 on_device: Callable[[Any], bool] | None = None) -> OOMDescription:
    """What the out of memory of ``report``'s run was made of (call it before the failed
    cell's frames are cleared: their bytes are what the namespace does not explain);
    ``bound``: the names the cell assigns (what of them still holds memory is named, see
    :func:`freed_by_del` for ``on_device``)."""
    requested = report.failed_request
    if requested is None and error is not None:
        requested = requested_bytes(error)
    live = report.live_at_failure if report.live_at_failure is not None else report.after
    trace = report.trace
    if trace is not None and trace.events:
        by_category = trace.breakdown_at(len(trace.events) - 1)
    else:
        by_category = dict(report.breakdown)
    holders = _live_holders(namespace, live or 0) if namespace is not None else []
    by_module = tuple((r.module, r.activations) for r in report.modules_at(None) if r.activations)
    op = phase = module = None
    if trace is not None and trace.ops:
        name, module, phase, _label = trace.ops[-1]
        op = name.split(".", 1)[0]
    op = (getattr(error, "op", None) or op or "").split(".", 1)[0] or None
    module = getattr(error, "module", None) or module
    line = None
    if error is not None:
        uf = _user_frame(error.__traceback__)
        if uf is not None:
            line = f"line {uf[1]}" + (f" (`{uf[3]}`)" if uf[3] else "")
    left, left_bytes = (), 0
    if namespace is not None and bound:
        left, left_bytes = freed_by_del(namespace, bound, report, on_device)
    return OOMDescription(requested, live, report.gpu_memory, dict(by_category), tuple(holders),
                          by_module, op, phase, module, line, left, left_bytes)


# -- strategies --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Strategy:
    """One row of the ranking: a knob setting and the peak a re-run with it gave. Bytes."""

    label: str
    knobs: Mapping[str, Any]
    peak: int | None
    reserved_peak: int | None = None
    fits: bool | None = None
    reason: str | None = None  # why it could not be measured, or where it ran out
    out_of_memory: bool = False  # the re-run ran out of memory on the target card

    @property
    def need(self) -> int | None:
        """What decides fitting (:func:`memmagic.report.needed`)."""
        return needed(self.peak, self.reserved_peak)


def _fits_text(s: Strategy) -> str:
    if s.out_of_memory:
        return f"does not fit ({s.reason})"
    return {True: "fits", False: "does not fit", None: ""}[s.fits]


def _order(s: Strategy) -> tuple:
    """Ranking order: measured peaks (live tensor bytes), smallest first; the reserved
    peak decides whether a row fits. Runs that ran out of memory (their
    peak is only what they reached) after them; unmeasured last."""
    return (s.peak is None, s.out_of_memory, s.peak or 0, s.label)


# -- advice ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Advice:
    """What the doctor found for one cell: retained memory, what a failure keeps or was made
    of, and the strategies ranked by peak (smallest first). Bytes."""

    retained: Retained | None = None
    failure: TracebackHold | None = None
    oom: OOMDescription | None = None
    strategies: tuple[Strategy, ...] = ()
    baseline: Strategy | None = None
    notes: tuple[str, ...] = ()

    @property
    def best(self) -> Strategy | None:
        """The first strategy that fits (the smallest peak that fits), else the smallest."""
        fitting = [s for s in self.strategies if s.fits]
        pool = fitting or [s for s in self.strategies if s.peak is not None]
        return pool[0] if pool else None

    def strategy_rows(self) -> list[tuple[str, str, str, str, str]]:
        """(strategy, peak, change vs the cell as written, reserved peak, fits) for the cell
        as written and each ranked strategy."""
        rows = []
        base = None  # a change is only shown against a baseline that ran to its end
        if self.baseline is not None and not self.baseline.out_of_memory:
            base = self.baseline.peak
        for s in ((self.baseline,) if self.baseline else ()) + self.strategies:
            if s.peak is None:
                rows.append((s.label, "n/a", "", "", s.reason or ""))
                continue
            delta = ""
            if base is not None and s is not self.baseline and not s.out_of_memory:
                delta = format_bytes(s.peak - base, signed=True)
            more = "> " if s.out_of_memory else ""
            reserved = format_bytes(s.reserved_peak) if s.reserved_peak is not None else ""
            rows.append((s.label, more + format_bytes(s.peak), delta, reserved, _fits_text(s)))
        return rows

    def __str__(self) -> str:
        parts = []
        if self.oom is not None:
            parts.append(str(self.oom))
        if self.failure is not None:
            parts.append(str(self.failure))
        if self.retained is not None and (self.retained.rows or self.retained.unnamed):
            parts.append(str(self.retained))
        if self.strategies:
            parts.append("strategies, by peak (re-run with each):")
            for label, peak, delta, reserved, fits in self.strategy_rows():
                parts.append(f"  {label:<44} {peak:>12} {delta:>12} {reserved:>12}  {fits}")
        parts.extend(f"note: {n}" for n in self.notes)
        return "\n".join(parts) if parts else "the doctor found nothing to say"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))

    def _repr_html_(self) -> str:
        out = []
        if self.oom is not None:
            out.append(f"<pre>{html.escape(str(self.oom))}</pre>")
        if self.failure is not None:
            out.append(f"<p>{html.escape(str(self.failure))}</p>")
        if self.retained is not None and (self.retained.rows or self.retained.unnamed):
            out.append(self.retained._repr_html_())
        if self.strategies:
            out.append(_html_table("strategies, by peak (re-run with each)",
                                   ("strategy", "peak", "change", "reserved", "fits"),
                                   self.strategy_rows()))
        out.extend(f"<p><i>{html.escape(n)}</i></p>" for n in self.notes)
        return "<div class='memmagic-doctor'>" + "".join(out) + "</div>"

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready)."""
        return {
            "retained": None if self.retained is None else {
                "unnamed": self.retained.unnamed,
                "rows": [dict(names=list(r.names), nbytes=r.nbytes, tensors=r.tensors, what=r.what,
                              graph_bytes=r.graph_bytes, graph_nodes=r.graph_nodes,
                              problem=r.problem, fix=r.fix) for r in self.retained.rows]},
            "failure": None if self.failure is None else dict(
                nbytes=self.failure.nbytes, names=list(self.failure.names), freed=self.failure.freed,
                fix=self.failure.fix),
            "oom": None if self.oom is None else dict(
                requested=self.oom.requested, live=self.oom.live, capacity=self.oom.capacity,
                by_category=dict(self.oom.by_category), by_holder=[list(x) for x in self.oom.by_holder],
                by_module=[list(x) for x in self.oom.by_module], op=self.oom.op, phase=self.oom.phase,
                module=self.oom.module, line=self.oom.line, left=list(self.oom.left),
                left_bytes=self.oom.left_bytes),
            "strategies": [dict(label=s.label, knobs=dict(s.knobs), peak=s.peak,
                                reserved_peak=s.reserved_peak, fits=s.fits, reason=s.reason,
                                out_of_memory=s.out_of_memory)
                           for s in self.strategies],
            "notes": list(self.notes),
        }


def _html_table(caption: str, head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    th = "".join(f"<th style='text-align:left'>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return (f"<table><caption style='text-align:left'>{html.escape(caption)}</caption>"
            f"<thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>")


def advise(namespace: Mapping[str, Any] | None = None, *, report: MemoryReport | None = None,
           error: BaseException | None = None, since: Snapshot | None = None,
           cell: Any = None, strategies: bool = False, world_sizes: Sequence[int] = (),
           gpu: Any = None, gpu_memory: int | str | None = None, bound: Iterable[str] = (),
           on_device: Callable[[Any], bool] | None = None) -> Advice:
    """Everything the doctor can say about one cell, as data.

    ``report``/``error``: the measured run and its exception (an out of memory is
    described; any other error's traceback holdings are measured, never cleared);
    ``since``: the :func:`snapshot` taken before the cell (the retained table then lists
    what the cell left); ``cell`` with ``strategies=True``: the cell to re-run with each
    knob (a :class:`memmagic.cell.Cell`, or source text) to rank the fixes;
    ``world_sizes``: also simulate FSDP2 over these GPU counts; ``bound``: the names the
    cell assigns (after an out of memory, what of them still holds memory is named;
    ``on_device``: see :func:`freed_by_del`)."""
    notes: list[str] = []
    ret = retained(namespace, since=since, report=report) if namespace is not None else None
    oom = failure = None
    if error is not None:
        if is_out_of_memory(error):
            if report is not None:
                oom = describe_oom(report, error, namespace, bound, on_device)
        else:
            failure = traceback_holdings(error, namespace)
    baseline, ranked = None, ()
    if strategies or world_sizes:
        baseline, ranked, more = _ranking(cell, namespace, strategies=strategies,
                                       world_sizes=world_sizes, gpu=gpu, gpu_memory=gpu_memory,
                                       report=report)
        notes += more
    return Advice(ret, failure, oom, ranked, baseline, tuple(notes))


# why no smaller batch was tried, and how to let the doctor try them
BATCH_HINT = ("no smaller batch was tried: the cell makes its batch with a fixed size. Write "
              "the size as a variable the cell reads (batch_size = 4096 in an earlier cell, "
              "then torch.randn(batch_size, ...) in this one), or make the batch in an earlier "
              "cell, and the doctor re-runs the cell with smaller batches")


def _candidates(applicable: Sequence[str], batch: int | None, optimizer: str | None,
                seq: int | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(label, knobs) of every single fix that applies to the cell (each knob's ``fixes``)."""
    from .knobs import KNOBS, Fixes

    known = Fixes(batch, optimizer, seq)
    return [fix for name in applicable if KNOBS[name].fixes is not None
            for fix in KNOBS[name].fixes(known)]


def _measure(cell: Any, label: str, knobs: Mapping[str, Any]) -> Strategy:
    from .knobs import KnobError

    try:
        r = cell.run(**knobs)
    except (KnobError, ValueError, TypeError) as exc:
        return Strategy(label, dict(knobs), None, reason=str(exc))
    if r.error and r.failed_request is None:
        return Strategy(label, dict(knobs), None, reason=f"the cell failed: {r.error}")
    if r.failed_request is not None:  # ran out of memory: the card's capacity was not enough
        return Strategy(label, dict(knobs), r.peak, r.reserved_peak, False,
                        reason=f"out of memory asking for {format_bytes(r.failed_request)}",
                        out_of_memory=True)
    return Strategy(label, dict(knobs), r.peak, r.reserved_peak, r.fits)


def _as_cell(cell: Any, namespace: Mapping[str, Any] | None, gpu: Any, gpu_memory: Any) -> Any:
    from .cell import Cell

    if isinstance(cell, Cell):
        return cell
    if not isinstance(cell, str):
        raise TypeError(f"cell must be a memmagic.cell.Cell or source text, not {type(cell).__name__}")
    options: dict[str, Any] = {}
    if gpu is not None:
        options["gpu"] = gpu
    if gpu_memory is not None:
        options["gpu_memory"] = gpu_memory
    return Cell(cell, dict(namespace or {}), backend="sim", backend_options=options)


def rank(cell: Any, namespace: Mapping[str, Any] | None = None, *, gpu: Any = None,
         gpu_memory: int | str | None = None, world_sizes: Sequence[int] = (),
         combine: bool = True, knobs: Sequence[str] | None = None
         ) -> tuple[Strategy, tuple[Strategy, ...], list[str]]:
    """Re-run ``cell`` (a :class:`memmagic.cell.Cell`, or source text run on the
    simulated GPU) with each fix that applies to it, and rank them by the peak each gives
    (reserved where known; smallest first). With a target card (``gpu``/``gpu_memory``,
    or the Cell's), when no single fix fits, the smallest combination that fits is
    searched (greedy: the best fixes of different knobs added one at a time, at most 4).
    ``world_sizes`` adds FSDP2 rows (:func:`memmagic.sharding.simulate_fsdp`); ``knobs``
    limits the fixes tried to these knobs (names of :data:`memmagic.knobs.KNOBS`).
    Returns (the cell as written, the ranked fixes, notes)."""
    c = _as_cell(cell, namespace, gpu, gpu_memory)
    notes: list[str] = []
    baseline = _measure(c, "as written", {})
    applicable = c.applicable()
    if knobs is not None:
        applicable = [k for k in applicable if k in knobs]
    info = c.last_info
    optimizer = None
    if info is not None and info.optimizers_built:
        optimizer = info.optimizers_built[0].lower()
    if "batch_size" not in applicable and (knobs is None or "batch_size" in knobs):
        notes.append(BATCH_HINT)
    rows = [_measure(c, label, knobs)
            for label, knobs in _candidates(applicable, c.baseline.batch_size, optimizer,
                                            c.baseline.seq_len)]
    targeted = baseline.fits is not None or any(s.fits is not None for s in rows)
    if combine and targeted and not baseline.fits and not any(s.fits for s in rows):
        combo = _combine(c, baseline, rows)
        if combo is not None:
            rows.append(combo)
    if world_sizes:
        source = getattr(c, "source", None)
        if source is None:
            notes.append("FSDP2 rows need the cell's source text (a function cell has none)")
        else:
            options = c.backend_options
            rows += _shard_rows(source, c.namespace, world_sizes, options.get("gpu", gpu),
                                options.get("gpu_memory", gpu_memory))
            notes.append(_NCCL_NOTE)
    rows.sort(key=_order)
    return baseline, tuple(rows), notes


def _combine(cell: Any, baseline: Strategy, rows: Sequence[Strategy]) -> Strategy | None:
    """The smallest combination of fixes (one value per knob) that fits, found greedily."""
    if baseline.need is None:
        return None
    best_per_knob: dict[str, Strategy] = {}
    for s in rows:
        if s.need is None or s.need >= baseline.need or len(s.knobs) != 1:
            continue
        knob = next(iter(s.knobs))
        family = "batch" if knob in ("batch_size", "accum_steps") else knob
        if family == "amp" and "weights_dtype" in best_per_knob:
            continue
        cur = best_per_knob.get(family)
        if cur is None or s.need < cur.need:
            best_per_knob[family] = s
    ordered = sorted(best_per_knob.values(), key=lambda s: s.need)
    knobs: dict[str, Any] = {}
    labels: list[str] = []
    last = None
    for s in ordered[:4]:
        knobs.update(s.knobs)
        labels.append(s.label)
        if len(labels) < 2:
            continue
        last = _measure(cell, " + ".join(labels), knobs)
        if last.fits:
            return last
    return last


def _ranking(cell: Any, namespace: Mapping[str, Any] | None, *, strategies: bool,
             world_sizes: Sequence[int], gpu: Any, gpu_memory: Any, report: MemoryReport | None
             ) -> tuple[Strategy | None, tuple[Strategy, ...], list[str]]:
    if cell is None:
        return None, (), ["the strategies need the cell's code to re-run (cell=)"]
    if strategies:
        return rank(cell, namespace, gpu=gpu, gpu_memory=gpu_memory, world_sizes=world_sizes)
    source = getattr(cell, "source", cell)
    rows = _shard_rows(source, namespace, world_sizes, gpu, gpu_memory)
    rows.sort(key=_order)
    return None, tuple(rows), [_NCCL_NOTE] if rows else []


# What the FSDP2 rows leave out: the simulation runs them on a fake process group (no NCCL)
_NCCL_NOTE = ("FSDP2 and tensor-parallel rows leave out NCCL's own buffers on each GPU "
              "(outside PyTorch's allocator, they grow with channels and peers: about 1.06 GB "
              "per GPU on 8 H100s "
              "before an all-to-all, NVIDIA/nccl#1685; about 1.6 GB with one communicator after "
              "an all-reduce, NVIDIA/nccl#864): leave that room beside the rows' figures")


def _shard_rows(cell: Any, namespace: Mapping[str, Any] | None, world_sizes: Sequence[int],
                gpu: Any, gpu_memory: Any) -> list[Strategy]:
    """FSDP2 rows for each of ``world_sizes``, and tensor-parallel rows where the notebook's
    model carries its own TP plan (a transformers model's ``tp_plan``)."""
    from . import sharding

    source = getattr(cell, "source", cell)
    runs = [sharding.simulate_fsdp]
    if _has_tp_plan(namespace):
        runs.append(sharding.simulate_tp)
    out = []
    for simulate in runs:
        for n in world_sizes:
            r = simulate(source, namespace, world_size=n, gpu=gpu, gpu_memory=gpu_memory)
            out.append(Strategy(r.label(), {f"{r.style}_world_size": n}, r.peak,
                                r.reserved_peak, r.fits, r.reason))
    return out


def _has_tp_plan(namespace: Mapping[str, Any] | None) -> bool:
    """Whether a model the namespace names (on the notebook's simulated GPU too) carries a
    tensor-parallel plan."""
    import torch

    from .backends.sim import session_of

    ns = dict(namespace or {})
    session = session_of(ns)
    shadow = session.card.shadow if session is not None and session.card is not None else {}
    for key, value in ns.items():
        sh = shadow.get(key)
        if sh is not None and sh.shown is value:
            value = sh.value
        if isinstance(value, torch.nn.Module) and getattr(value, "tp_plan", None):
            return True
    return False
