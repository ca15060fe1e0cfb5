"""Whole reports read off runs instead of run: a size knob's value (the batch size, the
context length) answered from simulated runs of the same cell at other values.

Where three or more simulated runs of a cell differ only in one size knob, made the same
allocations and frees in the same order, and each allocation's size lies on one line (the
context: or one parabola) through some of them (a :class:`~memmagic.whatif.plane.SizePlane`,
checked byte for byte by every run it was not drawn through), a value of that knob is
*evaluated*: each allocation's size is read off its line, the simulated allocator replays
the run's log at those sizes on the card (peaks, reserved, whether a request fails), and
the run's trace with those sizes gives the breakdown at the peak, where the peak is
reached, the timeline and the per-module rows. The result is an :class:`EvaluatedReport`,
a :class:`~memmagic.report.MemoryReport` marked ``interpolated`` whose source says which
runs it was read off. What it cannot know it leaves out: host memory, the allocator's
snapshot. Knows nothing of IPython or widgets.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

from .knobs import BATCH_DIM, SEQ_DIM, KnobError, Setting, resizing
from .plane import largest_within, point
from ..report import MemoryReport, Note
from ..trace import Category, Trace

if TYPE_CHECKING:
    from .plane import SizePlane

__all__ = ["EvaluatedReport", "evaluate", "evaluated_report", "largest_fitting", "peaks_at",
           "remember", "run_wanted", "unread_gap"]

# bytes a replay may reserve when it answers what a setting that does not fit needs
_NO_LIMIT = 1 << 62
# the lines a caller's ``planes`` keeps (each holds its runs)
_PLANES = 8


@dataclass(frozen=True)
class EvaluatedReport(MemoryReport):
    """A report read off runs at other values of one size knob (see the module docstring).
    ``read_off``: the words saying which runs; ``ran_out``: a request failed when the
    allocator replayed it on the card (the setting does not fit; ``peak`` and
    ``reserved_peak`` are then what it needs, replayed without the card's limit);
    ``stopped``: the run of this very setting that ran out of memory, where it was run
    and checked the line up to there (:func:`evaluate` counts it as such a run)."""

    interpolated: ClassVar[bool] = True
    read_off: str = ""
    ran_out: bool = False
    stopped: MemoryReport | None = field(default=None, repr=False, compare=False)

    @property
    def fits(self) -> bool | None:
        if self.gpu_memory is None:
            return None
        return False if self.ran_out else MemoryReport.fits.fget(self)  # type: ignore[attr-defined]

    @property
    def source(self) -> str:
        return f"evaluated, not run: {self.read_off}"

    def __str__(self) -> str:
        return f"evaluated (not run): {MemoryReport.__str__(self)}"


def _resized(run: MemoryReport, acts: tuple[list[dict], int, list[int]]) -> Trace | None:
    """``run``'s trace with each device allocation of the bytes its allocator entry asks in
    ``acts`` (:meth:`SizePlane.actions_at`, in the order of the run's own allocations; the
    tracker holds them rounded up to 512) and each free of what its allocation held. The
    run's staging buffers give way to the ones ``acts`` recomputes, put in at their sites
    (allocated and freed within the reduction's op, as the tracker records them). None
    where ``run`` made another number of allocations."""
    from ..backends.sim import round_request

    trace = run.trace
    scratch = getattr(trace, "scratch", {})
    plain, staged = _split(acts)
    own = [e["key"] for e in trace.allocator_log.entries
           if e["action"] == "alloc" and e["key"] not in scratch]
    if len(own) != len(plain):
        return None
    asked: dict[Any, list[int]] = {}
    for k, n in zip(own, plain):
        asked.setdefault(k, []).append(n)
    pool_of, roles = dict(trace.pool_of), dict(trace.roles)
    held: dict[int, int] = {}
    out: list[tuple[int, int, int]] = []
    moved: list[int] = []  # each event's index in ``out``
    done, op_now = 0, 0

    def stage(upto: int) -> None:  # the staging buffers put in before kept entry ``upto``
        for serial, delta in staged.get(upto, ()):
            pool_of[serial], roles[serial] = "device", Category.WORKSPACES.value
            out.append((serial, delta, op_now))

    for serial, delta, op in trace.events:
        device = delta and trace.pool_of.get(serial) == "device" and serial not in scratch
        if device:
            stage(done)  # within the op before: what autograd saved after it comes after them
            done += 1
        moved.append(len(out))
        if serial in scratch:
            continue
        if device:
            if delta > 0:
                delta = held[serial] = round_request(asked[serial].pop(0))
            else:
                delta = -held.pop(serial, -delta)
        out.append((serial, delta, op))
        op_now = op
    stage(done)
    moved.append(len(out))
    saved = [(moved[n], serial, d) for n, serial, d in trace.saved_events]
    return Trace(ops=trace.ops, events=out, saved_events=saved, pool_of=pool_of, roles=roles,
                 seed=trace.seed, saver=trace.saver, owner=trace.owner, frames=trace.frames,
                 before=trace.before, frozen=trace.frozen)


def _split(acts: tuple[list[dict], int, list[int]]
           ) -> tuple[list[int], dict[int, list[tuple[int, int]]]]:
    """The sizes of ``acts``' allocations that are not staging buffers, in order, and its
    staging buffers' allocations and frees (serial of their own, signed bytes) by the
    number of other allocator actions before them."""
    entries, _restart, sizes = acts
    sizes_it = iter(sizes)
    plain: list[int] = []
    staged: dict[int, list[tuple[int, int]]] = {}
    serials: dict[Any, tuple[int, int]] = {}
    kept = 0
    for e in entries:
        n = next(sizes_it) if e["action"] == "alloc" else 0
        if not isinstance(e["key"], tuple):  # ("staging", site, buffer) otherwise
            plain += [n] if e["action"] == "alloc" else []
            kept += 1
            continue
        if e["action"] == "alloc":
            serials[e["key"]] = (-1 - len(serials), n)
        serial, size = serials[e["key"]]
        staged.setdefault(kept, []).append((serial, size if e["action"] == "alloc" else -size))
    return plain, staged


def _peak(trace: Trace) -> tuple[int, int, int, int]:
    """(before, peak, after, peak event) of the device bytes live over ``trace.events``
    (the tracker's: the first event that reaches the highest; -1 when none passes the
    start)."""
    live = before = sum(n for s, n in trace.seed.items() if trace.pool_of.get(s) == "device")
    peak, at = live, -1
    for i, (serial, delta, _op) in enumerate(trace.events):
        if trace.pool_of.get(serial) == "device":
            live += delta
            if live > peak:
                peak, at = live, i
    return before, peak, live, at


def _read_off(plane: "SizePlane", b: int, s: int
              ) -> tuple[tuple[list[dict], int, list[int]], Trace] | None:
    """The allocator's actions at (``b``, ``s``) on ``plane`` and its first run's trace at
    those sizes (:func:`_resized`); None where the plane gives no sizes there."""
    acts = plane.actions_at(b, s) if plane.ok else None
    resized = None if acts is None else _resized(plane.run, acts)
    return None if resized is None else (acts, resized)


def peaks_at(plane: "SizePlane", b: int, s: int) -> tuple[int, int] | None:
    """(peak, reserved peak) at (``b``, ``s``) read off ``plane``: the tracker's device
    bytes at their highest over its first run's trace at those sizes, and the allocator's
    reserved peak replaying them on the card; None where the plane gives no sizes there or
    a request fails on the card."""
    read = _read_off(plane, b, s)
    replayed = None if read is None else plane.replay(read[0])
    return None if replayed is None else (_peak(read[1])[1], replayed[1])


def evaluated_report(plane: "SizePlane", b: int, s: int, read_off: str) -> EvaluatedReport | None:
    """The report at (``b``, ``s``) read off ``plane``: its sizes there, the allocator
    replayed on the card, its first run's trace at those sizes; None where the plane gives
    no sizes there (run it)."""
    t0 = time.perf_counter()
    read = _read_off(plane, b, s)
    if read is None:
        return None
    (acts, resized), run = read, plane.run
    model = plane.log.replayed(acts[2], None, acts[0], acts[1])
    ran_out = model is None
    if ran_out:
        model = plane.log.replayed(acts[2], _NO_LIMIT, acts[0], acts[1])
        if model is None:
            return None
    before, peak, after, at = _peak(resized)
    resized.peak_event = at
    op = resized.op(resized.peak_op_index)
    name, module, phase, label = op if op is not None else (None, None, None, None)
    notes = tuple(run.notes) + (Note(
        f"evaluated, not run: {read_off}; host memory and the allocator's snapshot come "
        "from runs only", "evaluated"),)
    return EvaluatedReport(
        backend=run.backend, device=run.device, before=before, peak=peak, after=after,
        wall_s=time.perf_counter() - t0, breakdown=resized.breakdown_at(at),
        breakdown_before=run.breakdown_before,
        reserved_peak=model.reserved_peak, reserved_after=model.reserved,
        peak_op=name, peak_module=module, peak_phase=phase, peak_label=label,
        gpu_name=run.gpu_name, gpu_memory=run.gpu_memory, context=run.context,
        notes=notes, timeline=tuple((o, sum(c.values())) for o, c in resized.timeline()),
        modules=tuple(resized.module_rows(peak)), trace=resized,
        read_off=read_off, ran_out=ran_out)


def evaluate(runs: Mapping[Setting, MemoryReport], setting: Setting,
             planes: dict | None = None) -> EvaluatedReport | None:
    """``setting`` read off ``runs`` (simulated runs keyed by their settings; reports
    marked ``interpolated`` are not runs and are passed over): where runs that differ
    from it only in the batch size lie on one line, or only in the context length on one
    line or parabola, each checked byte for byte by at least one run it was not drawn
    through (a run that ran out of memory checks it up to the request that failed), at a
    multiple of the greatest common divisor of their values (the batch: micro-batches).
    None where there are too few such runs, they do not agree, or the value falls
    between such multiples (run it). ``planes``: a dict
    the caller keeps between calls, where the lines found are kept (a family of runs is
    then checked once)."""
    for dim in (BATCH_DIM, SEQ_DIM):
        knob = resizing(dim)
        v = getattr(setting, knob.name)
        found = None if v is None else _cached(planes, *_family(runs, setting, dim, v), dim)
        # runs at multiples of g cannot see what the cell does between them (a cell that
        # makes its batch of whole copies of a tensor rounds it): such a value is run
        if found is None or v // _per_size(setting, dim) % math.gcd(*found[1], *found[2]):
            continue
        report = evaluated_report(*_at(found, setting, dim, v))
        if report is not None:
            return report
    return None


def largest_fitting(runs: Mapping[Setting, MemoryReport], setting: Setting, dim: int,
                    step: int = 1, planes: dict | None = None
                    ) -> tuple[int, EvaluatedReport] | None:
    """The largest value of the size knob of ``dim`` (the batch: a micro-batch that is a
    multiple of ``step``, times the micro-steps; the context: a multiple of ``step``) that
    fits the card, between the largest of ``runs`` that fits and ``setting``'s own, which
    does not: read off the line (or parabola) through the runs that differ from
    ``setting`` only in that size, as :func:`evaluate` reads a value off them. None where
    ``setting`` fits, no such run fits or the runs give no checked line. Else (the value,
    its report), or (the value, None) where the largest is a value that was run (its run
    is the report). Not held to the runs' multiples (:func:`evaluate` is): the doctor runs
    the value it names. ``planes``: as for :func:`evaluate`."""
    below = _below(runs, setting, dim)
    if below is None:
        return None
    v, k, family, stopped, fitting = below
    found = _cached(planes, family, stopped, dim)
    if found is None:
        return None
    start, ref = max(fitting), family[max(fitting)]
    n = largest_within(found[0], ref.gpu_memory, ref.context or 0, start, v // k - 1, step)
    if n is None:
        return None
    if n == start:
        return start * k, None
    report = evaluated_report(*_at(found, setting, dim, n * k))
    return None if report is None else (n * k, report)


def unread_gap(runs: Mapping[Setting, MemoryReport], setting: Setting, dim: int, step: int,
               planes: dict | None = None) -> tuple[list[int], int] | None:
    """Where ``setting`` does not fit and values of the size knob of ``dim`` lie untried
    between the largest run that fits and the smallest that ran out, but the runs give no
    checked line (:func:`largest_fitting` then reads nothing off): the values of the
    runs that fit, and the smallest that ran out. None elsewhere. ``step``: as for
    :func:`largest_fitting`."""
    below = _below(runs, setting, dim)
    if below is None:
        return None
    v, k, family, stopped, fitting = below
    out = min([x * k for x in stopped] + [v])
    if out - max(fitting) * k <= step * k or _cached(planes, family, stopped, dim) is not None:
        return None
    return sorted(x * k for x in fitting), out


def _below(runs: Mapping[Setting, MemoryReport], setting: Setting, dim: int
           ) -> tuple[int, int, dict, dict, list[int]] | None:
    """What :func:`largest_fitting` and :func:`unread_gap` start from: ``setting``'s value
    of the size knob of ``dim``, the micro-steps it is divided by (:func:`_per_size`), the
    runs that differ from it only in that size (:func:`_family`) and the values among them
    that fit below it. None where ``setting`` has no such value, was not run or fits, or
    no smaller run fits."""
    knob, k = resizing(dim).name, _per_size(setting, dim)
    v, own = getattr(setting, knob), runs.get(setting)
    if v is None or own is None or own.fits is not False:
        return None
    family, stopped = _family(runs, setting, dim, v)
    fitting = [x for x, r in family.items() if r.fits and x * k < v]
    return (v, k, family, stopped, fitting) if fitting else None


def run_wanted(runs: Mapping[Setting, MemoryReport], setting: Setting, dim: int,
               planes: dict | None = None) -> int | None:
    """The value of the size knob of ``dim`` to run next so that :func:`largest_fitting`
    has a line (or a parabola): where some of the runs that differ from ``setting`` in
    that size ran out of memory and too few fit (the batch: one; the context: one, or two
    that give no checked line), half the smallest that fits; where none fits, half the
    smallest that ran (the batch: in whole micro-batches, at least 2 of them, since a
    dimension of 1 takes another path); else None. ``planes``: as for :func:`evaluate`."""
    knob, k = resizing(dim).name, _per_size(setting, dim)
    if getattr(setting, knob) is None:
        return None
    family, stopped = _family(runs, setting, dim, None)
    fitting = sorted(x for x, r in family.items() if r.fits)
    if stopped and not fitting:  # a batch far too big: smaller ones first
        fitting = [min([*family, *stopped])]
    elif not stopped or not fitting or len(fitting) > (1 if dim == BATCH_DIM else 2):
        return None
    if len(fitting) == 2 and _cached(planes, family, stopped, dim) is not None:
        return None
    return fitting[0] // 2 * k if fitting[0] // 2 >= 2 else None


def _at(found: tuple["SizePlane", list[int], list[int]], setting: Setting, dim: int, v: int
        ) -> tuple["SizePlane", int, int, str]:
    """(plane, batch, context, the words saying which runs) of value ``v`` of the size knob
    of ``dim``, read off the line ``found`` (:func:`_family_plane`): the arguments of
    :func:`evaluated_report`."""
    plane, xs, stopped = found
    k = _per_size(setting, dim)  # the line is in the micro-batch
    xs, stopped = [x * k for x in xs], [x * k for x in stopped]
    where = ("between" if xs[0] < v < xs[-1] else "beyond")
    noun = resizing(dim).sizes.noun
    return (plane, *point(v // k, plane.basis),
            f"each allocation's size on the {'line' if len(plane.basis) == 2 else 'parabola'} "
            f"through the simulated runs at {noun} {', '.join(map(str, xs))} ({where} them)"
            + (f", checked by the run{'s' if len(stopped) > 1 else ''} at {noun} "
               f"{', '.join(map(str, stopped))} up to where {'they' if len(stopped) > 1 else 'it'} "
               "ran out of memory" if stopped else ""))


def remember(runs: Mapping[Setting, MemoryReport], setting: Setting, planes: dict) -> None:
    """After a run of ``setting`` (in ``runs``): read what it did, and find the lines its
    families of runs make, now, while the caller waits for the run anyway, so that a
    later :func:`evaluate` off them is quick (kept on its trace and in ``planes``)."""
    from .plane import shape_of

    shape_of(runs[setting])
    for dim in (BATCH_DIM, SEQ_DIM):
        if getattr(setting, resizing(dim).name) is not None:
            _cached(planes, *_family(runs, setting, dim, None), dim)


def _family(runs: Mapping[Setting, MemoryReport], setting: Setting, dim: int, v: int | None
            ) -> tuple[dict[int, MemoryReport], dict[int, MemoryReport]]:
    """The runs among ``runs`` that are ``setting`` but for the size knob of ``dim``, by
    its value (the batch: the micro-batch, :func:`_per_size`): the whole answers (no
    error, not evaluated) but ``v``'s, and those that ran out of memory (``v``'s too)."""
    knob, k = resizing(dim).name, _per_size(setting, dim)
    same = sorted(((getattr(s, knob), getattr(r, "stopped", None) or r) for s, r in runs.items()
                   if getattr(s, knob) is not None and _same_but(s, setting, knob)),
                  key=lambda xr: xr[0])
    same = [(x // k, r) for x, r in same if not r.interpolated]
    return ({x: r for x, r in same if x * k != v and r.error is None},
            {x: r for x, r in same if r.failed_request is not None})


def _per_size(setting: Setting, dim: int) -> int:
    """What a family's values are divided by for the line: the micro-steps for the batch
    (a forward sees the micro-batch; its sizes are polynomials in that), else 1."""
    return setting.micro_steps if dim == BATCH_DIM else 1


def _family_plane(family: Mapping[int, MemoryReport], stopped: Mapping[int, MemoryReport],
                  dim: int) -> tuple["SizePlane", list[int], list[int]] | None:
    """The line (the batch; the context first) or parabola (the context) through runs of
    ``family`` (value: report), the values of the whole runs it holds for, and those of
    the runs in ``stopped`` (that ran out of memory) that check it: drawn through some,
    checked byte for byte by all the others, and by every run of ``stopped`` up to the
    request that failed (at least one check). Tried on the most runs first, then the
    largest sizes (a cell that takes another path at small sizes leaves those out); None
    where none holds."""
    from .plane import BATCH_LINE, CONTEXT_CURVE, CONTEXT_LINE, line_through

    xs = sorted(family)
    windows = sorted(((i, j) for i in range(len(xs)) for j in range(i + 1, len(xs) + 1)),
                     key=lambda w: (w[0] - w[1], -w[0]))
    for basis in ((BATCH_LINE,) if dim == BATCH_DIM else (CONTEXT_LINE, CONTEXT_CURVE)):
        k = len(basis)
        for i, j in windows:
            ws = xs[i:j]
            if len(ws) < k or len(ws) + len(stopped) <= k:
                continue
            drawn = [ws[0], ws[len(ws) // 2], ws[-1]] if k == 3 else [ws[0], ws[-1]]
            plane = line_through({x: family[x] for x in drawn}, basis)
            if plane.ok and all(plane.checked_by(*point(x, basis), family[x])
                                for x in ws if x not in drawn) and all(
                    plane.checked_until_out_of_memory(*point(x, basis), r)
                    for x, r in stopped.items()):
                return plane, ws, sorted(stopped)
    return None


def _cached(planes: dict | None, family: Mapping[int, MemoryReport],
            stopped: Mapping[int, MemoryReport], dim: int
            ) -> tuple["SizePlane", list[int], list[int]] | None:
    """:func:`_family_plane`, kept in ``planes`` by the family's runs (which the entry holds,
    so that their ids stay theirs)."""
    if planes is None:
        return _family_plane(family, stopped, dim)
    key = (dim, tuple((x, id(r)) for x, r in sorted(family.items())),
           tuple((x, id(r)) for x, r in sorted(stopped.items())))
    if key not in planes:
        while len(planes) >= _PLANES:
            planes.pop(next(iter(planes)))
        planes[key] = (_family_plane(family, stopped, dim),
                       [*family.values(), *stopped.values()])
    return planes[key][0]


def _same_but(s: Setting, setting: Setting, knob: str) -> bool:
    """Whether ``s`` is ``setting`` but for ``knob`` (and a valid setting with its value)."""
    try:
        return s.replace(**{knob: getattr(setting, knob)}) == setting
    except KnobError:
        return False
