"""All the doctor says about one cell as one :class:`Advice`, and how it reads (text and
HTML)."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..core.failures import is_out_of_memory
from ..report import MemoryReport, format_bytes
from .holders import NamespaceSnapshot, Retained, html_table, namespace_view, retained, snapshot
from .oom import OOMDescription, describe_oom
from .ranking import Strategy, fits_text, ranking_rows
from .tracebacks import TracebackHold, traceback_holdings


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
            rows.append((s.label, more + format_bytes(s.peak), delta, reserved, fits_text(s)))
        return rows

    def __str__(self) -> str:
        return "\n".join(self.lines()) or "the doctor found nothing to say"

    def lines(self) -> list[str]:
        """What :meth:`__str__` says, a line each (none where the doctor found nothing)."""
        parts = []
        if self.oom is not None:
            parts.append(str(self.oom))
        if self.failure is not None:
            parts.append(str(self.failure))
        if self.retained is not None and (self.retained.rows or self.retained.unnamed):
            parts.append(str(self.retained))
        if self.strategies:
            parts.append("strategies, by peak (re-run with each):")
            rows = self.strategy_rows()
            width = max([44] + [len(r[0]) for r in rows])  # the longest label sets the column
            for label, peak, delta, reserved, fits in rows:
                parts.append(f"  {label:<{width}} {peak:>12} {delta:>12} {reserved:>12}  {fits}")
        parts.extend(f"note: {n}" for n in self.notes)
        return parts

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
            out.append(html_table("strategies, by peak (re-run with each)",
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


def advise(namespace: Mapping[str, Any] | None = None, *, report: MemoryReport | None = None,
           error: BaseException | None = None, since: NamespaceSnapshot | None = None,
           engine: Callable[[], Any] | None = None, strategies: bool = False,
           world_sizes: Sequence[int] = (), gpu: Any = None, gpu_memory: int | str | None = None,
           bound: Iterable[str] = (), on_device: Callable[[Any], bool] | None = None,
           unit: str = "cell") -> Advice:
    """Everything the doctor can say about one cell, as data.

    ``report``/``error``: the measured run and its exception (an out of memory is
    described; any other error's traceback holdings are measured, never cleared);
    ``since``: the :func:`snapshot` taken before the cell (the retained table then lists
    what the cell left); ``engine`` with ``strategies=True``: the factory of the what-if
    engine to re-run the cell with each knob (called once, only when a ranking is asked
    for; the pipeline's :func:`memmagic.pipeline.ranking_engine` builds one); ``world_sizes``:
    also simulate FSDP2 over these GPU counts; ``bound``: the names the cell assigns (after
    an out of memory, what of them still holds memory is named; ``on_device``: see
    :func:`freed_by_del`)."""
    notes: list[str] = []
    ret = retained(namespace, since=since, report=report) if namespace is not None else None
    oom = failure = None
    if error is not None:
        if is_out_of_memory(error):
            if report is not None:
                oom = describe_oom(report, error, namespace, bound, on_device, unit=unit)
        else:
            failure = traceback_holdings(error, namespace)
    baseline, ranked = None, ()
    if strategies or world_sizes:
        baseline, ranked, more = ranking_rows(engine, namespace, strategies=strategies,
                                              world_sizes=world_sizes, gpu=gpu,
                                              gpu_memory=gpu_memory, unit=unit)
        notes += more
    return Advice(ret, failure, oom, ranked, baseline, tuple(notes))


def before_cell(namespace: Mapping[str, Any], session: Any = None) -> NamespaceSnapshot:
    """What the namespace holds before a cell (the retained table then lists what the cell
    left); ``session``: the notebook's simulated GPU, whose objects the names stand for."""
    return snapshot(namespace_view(namespace, session))


def after_cell(namespace: Mapping[str, Any], report: MemoryReport, error: BaseException | None,
               *, full: bool, session: Any = None, since: NamespaceSnapshot | None = None,
               engine: Callable[[], Any] | None = None, bound: Iterable[str] = (),
               unit: str = "cell") -> Advice | None:
    """The doctor after a cell ran, as the pipeline asks it: with ``full`` always (and
    FSDP2 rows after an out of memory); after a failed cell, the short advice; an out of
    memory is ranked when ``engine`` (the factory of the re-runs) is given. ``session``:
    the notebook's simulated GPU, or None; ``unit``: what ran, in the front end's words
    ("cell", "script")."""
    if error is None and not full:
        return None
    view = namespace_view(namespace, session)
    if error is None:
        return advise(view, report=report, since=since)
    if not is_out_of_memory(error):
        return advise(view, report=report, error=error)
    return advise(view, report=report, error=error, engine=engine,
                  strategies=engine is not None, world_sizes=(2, 4, 8) if full else (),
                  bound=bound, on_device=on_card(session), unit=unit)


def on_card(session: Any) -> Callable[[Any], bool] | None:
    """On the notebook's simulated GPU: whether a simulated tensor is on the card (the
    card's tracker knows; the host's tensors are fake too). None elsewhere."""
    tracker = getattr(getattr(session, "card", None), "tracker", None)
    if tracker is None:
        return None

    def on_device(t: Any) -> bool:
        entry = tracker.entry_of(t)
        return entry is None or entry.pool == "device"

    return on_device
