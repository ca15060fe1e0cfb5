"""Who holds memory after a cell: the tensors the namespace keeps alive, the names that
hold them, the autograd graphs they pin, and the classic leaks named with their fix."""

from __future__ import annotations

import html
import re
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..report import MemoryReport, format_bytes
from ..core.objgraph import saved_tensors, walk
from ..trace import Category


# IPython's bookkeeping names: never holders of the user's data, or aliases of Out
_SKIP_NAMES = frozenset({"In", "_ih", "_oh", "_dh", "_i", "_ii", "_iii", "exit", "quit",
                         "get_ipython", "__builtins__", "__builtin__", "__name__", "__doc__",
                         "__package__", "__loader__", "__spec__", "__file__", "__cached__"})
_HISTORY = re.compile(r"^_(\d+|_{0,2})$")  # _, __, ___, _12
_INPUT_HISTORY = re.compile(r"^_i\d+$")


# -- walking the namespace -----------------------------------------------------------------
def name_rank(path: str) -> int:
    """How readable a holder's name is (lower first): variables and their attributes,
    then closures, then IPython's Out, then the _N history."""
    if path.startswith("Out["):
        return 3
    if _HISTORY.match(path.split("[", 1)[0].split(".", 1)[0]):
        return 4
    if "<closure>" in path:
        return 2
    return 1


def _readable(path: str) -> tuple[int, int]:
    """The order in which holders' names are shown: the most readable first."""
    return name_rank(path), len(path)


_MODULE = " (module)"  # the walk's group of a module's parameters and buffers


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


def storage_of(t: Any) -> tuple[int, int] | None:
    """(storage key, bytes) of a tensor; None for storage-less tensors (and meta ones,
    which hold no memory)."""
    from ..core._torch_private import storage_key
    from ..core._torch_private import wrapper_inner_tensors

    try:
        inner = wrapper_inner_tensors(t)
        t = inner[0] if inner else t
        if t.device.type == "meta":
            return None
        st = t.untyped_storage()
        return storage_key(st), int(st.nbytes())
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None


def found_in(roots: Iterable[tuple[str, Any]]) -> _Found:
    """Every tensor reachable from ``roots`` ((name, object) pairs), with the paths holding
    it: the one object-graph walk (:func:`memmagic.core.objgraph.walk`), with names, through
    the references a user makes (not library internals)."""
    found = _Found()

    def add(t: Any, category: Category, path: str, group: str | None) -> None:
        info = storage_of(t)
        if info is None:
            return
        key, _ = info
        found.tensors.setdefault(key, t)
        paths = found.paths.setdefault(key, [])
        if path not in paths:
            paths.append(path)
        found.kind.setdefault(key, _KINDS.get(category, "tensor"))
        old = found.groups.get(key)
        if group is not None and (old is None or old.endswith(_MODULE) and group.endswith(_MODULE)
                                  and _readable(group) < _readable(old)):
            # of two modules that hold it, the one named as the user would (``model``, not
            # a submodule reached through a bound method: peft's
            # ``model.base_model_prepare_inputs_for_generation.__self__``)
            found.groups[key] = group

    found.truncated = not walk(roots, add, names=True, internals=False)
    return found


def namespace_roots(namespace: Mapping[str, Any]) -> list[tuple[str, Any]]:
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
    out.sort(key=lambda kv: (name_rank(kv[0]), kv[0]))
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
def graph_of(t: Any) -> tuple[list[Any], int, int]:
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
class NamespaceSnapshot:
    """The storages the namespace held at one moment (take one before a cell)."""

    refs: Mapping[int, Any]  # storage key -> weakref to the storage (or None)

    def holds(self, key: int, storage: Any) -> bool:
        ref = self.refs.get(key)
        if ref is None:
            return key in self.refs
        return ref() is storage


def snapshot(namespace: Mapping[str, Any]) -> NamespaceSnapshot:
    """What the namespace holds now: the storages of every tensor reachable from it, and
    of the autograd graphs they keep (for :func:`retained` ``since=``)."""
    refs: dict[int, Any] = {}
    for key, t in _reach(found_in(namespace_roots(namespace))).items():
        try:
            refs[key] = weakref.ref(t.untyped_storage())
        except (TypeError, RuntimeError, NotImplementedError):
            refs[key] = None
    return NamespaceSnapshot(refs)


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
        return html_table(str(self).splitlines()[0], ("holder", "size", "autograd graph", "problem / fix"),
                           self.table())


def _what(t: Any) -> str:
    try:
        shape = "x".join(str(d) for d in t.shape) or "scalar"
        return f"{shape} {str(t.dtype).replace('torch.', '')}"
    except Exception:
        return type(t).__name__


def retained(namespace: Mapping[str, Any], *, since: NamespaceSnapshot | None = None,
             report: MemoryReport | None = None) -> Retained:
    """The tensors the namespace holds that were not there in ``since`` (the snapshot
    taken before the cell; None: every tensor held), largest first, with their holders,
    the autograd graphs they pin, and the leaks named with their fix."""

    found = found_in(namespace_roots(namespace))
    new = {k: t for k, t in found.tensors.items() if since is None or not since.holds(k, _storage_obj(t))}
    # groups (a module's parameters, an optimizer's state, a list of tensors) become one row
    rows: list[dict[str, Any]] = []
    by_group: dict[str, dict[str, Any]] = {}
    for key, t in new.items():
        paths = sorted(found.paths[key], key=_readable)
        group = found.groups.get(key)
        nbytes = storage_of(t)[1]
        if group is not None and (group.endswith(_MODULE) or group.endswith("(optimizer state)")
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
        counted_here = [(t, storage_of(t)[1]) for t in new.values()] + graph_saved
        workspaces = _workspaces_made(report)
        unnamed = max(report.retained - _as_allocated(counted_here, report) - workspaces, 0)
    return Retained(tuple(out), unnamed, since is not None, workspaces)


def _pin_graphs(rows: list[dict[str, Any]], counted: set[int], since: NamespaceSnapshot | None
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
            saved, n, c = graph_of(t)
            nodes += n
            chain = max(chain, c)
            for s in saved:
                info = storage_of(s)
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
    roots = namespace_roots(namespace)
    mine = [(k, v) for k, v in roots if k in wanted
            and not isinstance(v, (torch.nn.Module, torch.optim.Optimizer))]
    others = [(k, v) for k, v in roots if k not in {m for m, _ in mine}]
    kept = set(_reach(found_in(others)))
    held: dict[int, Any] = {}
    holders = []
    for name, value in mine:
        new = {k: t for k, t in _reach(found_in([(name, value)])).items()
               if k not in kept and (on_device is None or on_device(t))}
        if new:
            holders.append(name)
            held.update(new)
    nbytes = _as_allocated([(t, storage_of(t)[1]) for t in held.values()], report)
    return tuple(holders), nbytes


def _reach(found: _Found) -> dict[int, Any]:
    """Storage key -> tensor of everything ``found`` holds and the graphs its tensors keep."""
    out = dict(found.tensors)
    for t in list(found.tensors.values()):
        for s in graph_of(t)[0]:
            info = storage_of(s)
            if info is not None:
                out.setdefault(info[0], s)
    return out


def _as_allocated(storages: Iterable[tuple[Any, int]], report: MemoryReport) -> int:
    """The bytes ``report`` counts for these (tensor, storage bytes): only those on its
    device (a simulated GPU's tensors are fake; the real CPU scalars an autograd graph
    saves are not on it), in multiples of 512 bytes on a CUDA allocator, real or simulated."""
    from ..core._torch_private import is_fake

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
    from ..core._torch_private import wrapper_inner_tensors

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
    if r["group"] is not None and r["group"].endswith(_MODULE):
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
    only_history = all(name_rank(p) >= 3 for p in names)
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

def html_table(caption: str, head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    th = "".join(f"<th style='text-align:left'>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return (f"<table><caption style='text-align:left'>{html.escape(caption)}</caption>"
            f"<thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>")
