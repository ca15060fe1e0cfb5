"""The anatomy of an out of memory: what was requested, what was live by category, by
holder and by module, and which op, phase and line asked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from ..core.failures import requested_bytes, user_line_in
from ..report import MemoryReport, format_bytes
from .holders import found_in, freed_by_del, name_rank, namespace_roots, storage_of


# -- out of memory --------------------------------------------------------------------------
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
        where = _where(self.op, self.phase, self.module, self.line)
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


def _live_holders(namespace: Mapping[str, Any], live: int, unit: str = "cell"
                  ) -> list[tuple[str, int]]:
    """(holder, bytes) of what the namespace holds, largest first, and the rest of ``live``
    as the failed cell's (``unit``'s) frames."""
    found = found_in(namespace_roots(namespace))
    per: dict[str, int] = {}
    for key, t in found.tensors.items():
        group = found.groups.get(key)
        name = group.split(" (")[0] if group else sorted(found.paths[key], key=name_rank)[0]
        per[name] = per.get(name, 0) + storage_of(t)[1]
    holders = sorted(per.items(), key=lambda kv: -kv[1])[:8]
    rest = live - sum(per.values())
    if rest > 0:
        holders.append((f"the failed {unit}'s frames (activations, temporaries)", rest))
    return holders


def failure_site(report: MemoryReport, error: BaseException | None = None
                 ) -> tuple[str | None, str | None, str | None]:
    """(op, phase, module) where ``report``'s run ran out of memory: the op whose request
    failed where the trace knows it, else its last op (or what the error names)."""
    op = phase = module = None
    trace = report.trace
    if trace is not None and trace.ops:
        name, module, phase, _label = trace.op(trace.failure_op) or trace.ops[-1]
        op = name.split(".", 1)[0]
    op = (getattr(error, "op", None) or op or "").split(".", 1)[0] or None
    module = getattr(error, "module", None) or module
    return op, phase, module


def failure_words(report: MemoryReport) -> str:
    """Where a run ran out of memory, in a few words ("at mm, during forward, in
    `model.layers.4.mlp`"); '' where unknown."""
    return ", ".join(_where(*failure_site(report)))


def _where(op: str | None, phase: str | None, module: str | None,
           line: str | None = None) -> list[str]:
    """The words that say where an out of memory happened: its op, phase, module and line,
    those known."""
    return [x for x in (f"at {op}" if op else None, f"during {phase}" if phase else None,
                        f"in `{module}`" if module else None, line) if x]


def describe_oom(report: MemoryReport, error: BaseException | None = None,
                 namespace: Mapping[str, Any] | None = None, bound: Iterable[str] = (),
                 on_device: Callable[[Any], bool] | None = None, *, unit: str = "cell"
                 ) -> OOMDescription:
    """What the out of memory of ``report``'s run was made of (call it before the failed
    cell's frames are cleared: their bytes are what the namespace does not explain);
    ``bound``: the names the cell assigns (what of them still holds memory is named, see
    :func:`freed_by_del` for ``on_device``); ``unit``: what ran ("cell", "script")."""
    requested = report.failed_request
    if requested is None and error is not None:
        requested = requested_bytes(error)
    live = report.live_at_failure if report.live_at_failure is not None else report.after
    trace = report.trace
    if trace is not None and trace.events:
        at = trace.failure_event
        by_category = trace.breakdown_at(len(trace.events) - 1 if at is None else at)
    else:
        by_category = dict(report.breakdown)
    holders = _live_holders(namespace, live or 0, unit) if namespace is not None else []
    by_module = tuple((r.module, r.activations) for r in report.modules_at(None) if r.activations)
    op, phase, module = failure_site(report, error)
    line = user_line_in(error.__traceback__) if error is not None else None
    left, left_bytes = (), 0
    if namespace is not None and bound:
        left, left_bytes = freed_by_del(namespace, bound, report, on_device)
    return OOMDescription(requested, live, report.gpu_memory, dict(by_category), tuple(holders),
                          by_module, op, phase, module, line, left, left_bytes)


