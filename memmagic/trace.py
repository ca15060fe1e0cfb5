"""The record of one tracker-based run: which op, module and phase made each storage, when
it was freed, and the allocations and frees in order. Plain data; importing this module
needs no torch.

A :class:`Trace` is what the tracker (:mod:`memmagic.core.tracking`) leaves behind; the report
summarises it, and the timeline, the per-module table and the snapshot writer read it.
Op indices count the tracked ops of the run from 1; index 0 is "before the run".
All sizes are ``int`` bytes, as the allocator would hold them (512-byte rounding on a
simulated GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterator, Sequence

__all__ = ["Category", "Trace", "Storage", "ModuleRow", "PHASES", "CATEGORY_ORDER", "PRIORITY",
           "NO_MODULE", "module_rows_at"]


class Category(str, Enum):
    """What a tensor is for. The values are the keys of ``MemoryReport.breakdown``."""

    PARAMETERS = "parameters"
    BUFFERS = "buffers"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATIONS = "activations"  # tensors autograd saved for backward
    KV_CACHE = "kv_cache"  # a transformers model's key/value cache (past_key_values)
    WORKSPACES = "workspaces"  # library workspaces (cuBLAS) held through the allocator
    OTHER = "other"  # inputs, outputs, temporaries

    def __str__(self) -> str:
        return self.value


# What an op was part of. "recompute": a checkpointed forward run again during backward.
PHASES = ("forward", "backward", "recompute", "optimizer", "other")
NO_MODULE = "(outside modules)"

# A storage keeps the most specific role it ever had (activations is a state, see below).
PRIORITY = {
    Category.OTHER.value: 0,
    Category.ACTIVATIONS.value: 1,
    Category.KV_CACHE.value: 2,
    Category.OPTIMIZER_STATE.value: 3,
    Category.GRADIENTS.value: 4,
    Category.BUFFERS.value: 5,
    Category.PARAMETERS.value: 6,
    Category.WORKSPACES.value: 7,
}
CATEGORY_ORDER = tuple(c.value for c in Category)
_ACT = Category.ACTIVATIONS.value
_OTHER = Category.OTHER.value


@dataclass(frozen=True)
class Storage:
    """One storage the run saw. ``op`` is the index of the op that made it (0: it existed
    before the run); ``freed`` the op index at which it was released (None: live at the
    end). ``category`` is its role (an "other" storage counts as activations while autograd
    holds it for backward); ``saved_by`` the module whose op first saved it for backward."""

    serial: int
    nbytes: int
    pool: str
    category: str
    op: int
    op_name: str | None
    module: str | None
    phase: str | None
    freed: int | None
    saved_by: str | None
    frames: tuple[tuple[str, int, str], ...] = ()  # (file, line, function), innermost first


@dataclass(frozen=True)
class ModuleRow:
    """One module of the per-module table. ``activations``: bytes it saved for backward
    that were live at the peak; ``activations_max``: the most it held saved at any moment;
    ``share``: activations / the run's peak; ``parameters``/``gradients``: bytes of the
    parameters it owns directly (children's count in their own rows) and their grads."""

    module: str
    activations: int
    activations_max: int
    share: float
    parameters: int
    gradients: int

    @property
    def depth(self) -> int:
        return 0 if self.module == NO_MODULE else self.module.count(".") + 1


def _truncate(path: str, depth: int | None) -> str:
    if depth is None or path == NO_MODULE:
        return path
    return ".".join(path.split(".")[:max(depth, 1)])


def module_rows_at(rows: Sequence[ModuleRow], depth: int | None, peak: int) -> list[ModuleRow]:
    """``rows`` (one per module path) summed up to ``depth`` levels (1: the root module;
    None: as they are), largest activations first. Attribution is additive, so the
    activations of the rows always sum to the same total."""
    acc: dict[str, list[int]] = {}
    for r in rows:
        key = _truncate(r.module, depth)
        a = acc.setdefault(key, [0, 0, 0, 0])
        a[0] += r.activations
        a[1] += r.activations_max
        a[2] += r.parameters
        a[3] += r.gradients
    out = [ModuleRow(k, v[0], v[1], v[0] / peak if peak else 0.0, v[2], v[3])
           for k, v in acc.items()]
    out.sort(key=lambda r: (-r.activations, -r.parameters, r.module))
    return out


class Trace:
    """What a tracker recorded in one run (see the module docstring).

    ``ops[i - 1]`` is (name, module path, phase, label) of op ``i`` (label: the autograd
    node a backward op runs for, "softmax backward", or the optimizer of a step, "Adam"); ``events`` are
    (serial, delta bytes, op index) in order; ``saved_events`` are (number of events
    before it, serial, +1 saved / -1 released by autograd); ``seed`` maps the serials
    that existed before the run to their bytes; ``frozen`` holds the serials of
    parameters that do not require grad.
    """

    def __init__(self, *, ops: list[tuple[str, str | None, str, str | None]],
                 events: list[tuple[int, int, int]],
                 saved_events: list[tuple[int, int, int]],
                 pool_of: dict[int, str], roles: dict[int, str], seed: dict[int, int],
                 saver: dict[int, str | None], owner: dict[int, str],
                 frames: dict[int, tuple] | None = None,
                 peak_event: int = -1, before: int = 0,
                 allocator_log: object | None = None, frozen: frozenset[int] = frozenset()
                 ) -> None:
        self.ops = ops
        self.events = events
        self.saved_events = saved_events
        self.pool_of = pool_of
        self.roles = roles
        self.seed = seed
        self.saver = saver
        self.owner = owner
        self.frames = frames or {}
        # the allocator's own history of the run where a backend keeps one (the sim's
        # CachingAllocatorModel: an AllocatorLog); the snapshot writer reads it
        self.allocator_log = allocator_log
        self.peak_event = peak_event
        self.before = before
        self.frozen = frozen  # serials of parameters that do not require grad
        # the last event before a request failed (an out of memory), where a backend knows
        # it: what was live then (a kernel's own buffers are let go as the error unwinds)
        self.failure_event: int | None = None
        # the op whose request failed (1-based; 0: unknown): ops after it ran as the error
        # unwound (a profiler range's exit, a finally's frees)
        self.failure_op = 0
        self._storages: list[Storage] | None = None
        self._folded: tuple | None = None  # (key, what _folds read off the trace as it was)

    def __repr__(self) -> str:
        return f"<Trace: {len(self.ops)} ops, {len(self.events)} events>"

    # -- ops ----------------------------------------------------------------------------
    def op(self, index: int) -> tuple[str, str | None, str, str | None] | None:
        """(name, module, phase, label) of op ``index`` (1-based); None for 0 or out of range."""
        return self.ops[index - 1] if 0 < index <= len(self.ops) else None

    def phase_spans(self) -> list[tuple[str, int, int]]:
        """(phase, first op, last op) for each run of consecutive ops in one phase."""
        spans: list[tuple[str, int, int]] = []
        for i, (_, _, phase, _) in enumerate(self.ops, start=1):
            if spans and spans[-1][0] == phase:
                spans[-1] = (phase, spans[-1][1], i)
            else:
                spans.append((phase, i, i))
        return spans

    @property
    def peak_op_index(self) -> int:
        """The op during which the device peak was reached (0: the peak is the start)."""
        return self.events[self.peak_event][2] if self.peak_event >= 0 else 0

    # -- categories over time -------------------------------------------------------------
    def _category(self, serial: int, saved: dict[int, int]) -> str:
        role = self.roles.get(serial, _OTHER)
        if PRIORITY[role] < PRIORITY[_ACT] and saved.get(serial, 0) > 0:
            return _ACT
        return role

    def _replay(self) -> Iterator[tuple[int, int, dict[str, int], dict[int, int], dict[int, int], list[int]]]:
        """Yield (event index, op index, device bytes per category, live bytes, saved counts,
        serials changed by this step) after each event, starting with (-1, 0, ...) for the
        start; the dicts are the replay's own (copy what you keep)."""
        live = {s: n for s, n in self.seed.items() if self.pool_of.get(s) == "device"}
        saved: dict[int, int] = {}
        cats = dict.fromkeys(CATEGORY_ORDER, 0)
        sv = self.saved_events
        j = 0
        changed: list[int] = []

        def apply_saved(upto: int) -> None:
            nonlocal j
            while j < len(sv) and sv[j][0] <= upto:
                _, serial, d = sv[j]
                j += 1
                nbytes = live.get(serial, 0)
                old = self._category(serial, saved)
                saved[serial] = saved.get(serial, 0) + d
                new = self._category(serial, saved)
                changed.append(serial)
                if nbytes and old != new:
                    cats[old] -= nbytes
                    cats[new] += nbytes

        for s, n in live.items():
            cats[self._category(s, saved)] += n
        apply_saved(0)
        yield -1, 0, cats, live, saved, list(live)
        pool_of, category, nsv = self.pool_of, self._category, len(sv)
        for i, (serial, delta, op) in enumerate(self.events):
            changed = []
            if pool_of.get(serial) == "device":
                cats[category(serial, saved)] += delta
                n = live.get(serial, 0) + delta
                if n:
                    live[serial] = n
                else:
                    live.pop(serial, None)
                changed.append(serial)
            if j < nsv and sv[j][0] <= i + 1:
                apply_saved(i + 1)
            yield i, op, cats, live, saved, changed

    def _folds(self, max_points: int = 2000) -> tuple:
        """What a report reads off the trace, in one replay of it: the device bytes per
        category after the peak event (None: no such event), the timeline (see
        :meth:`timeline`), and per module path the activations live at the peak and the most
        held at once (see :meth:`module_rows`). Kept for the trace as it is now."""
        key = (self.peak_event, len(self.events), len(self.saved_events), max_points)
        if self._folded is not None and self._folded[0] == key:
            return self._folded[1]
        timeline, modules, at_peak = _TimelineFold(), _ModuleFold(self), None
        for i, op, cats, live, saved, changed in self._replay():
            timeline.feed(i, op, cats, changed)
            modules.feed(live, saved, changed)
            if i == self.peak_event:
                at_peak = dict(cats)
                modules.mark_peak()
        out = (at_peak, timeline.points(max_points), modules.act_peak, modules.act_max)
        self._folded = (key, out)
        return out

    def breakdown_at(self, event_index: int) -> dict[str, int]:
        """Device bytes per category after event ``event_index`` (-1: at the start)."""
        if event_index == self.peak_event:
            at_peak = self._folds()[0]
            if at_peak is not None:
                return dict(at_peak)
        for i, _, cats, _, _, _ in self._replay():
            if i == event_index:
                return dict(cats)
        raise IndexError(f"no event {event_index} in this trace ({len(self.events)} events)")

    def most(self, category: str) -> int:
        """The most device bytes of ``category`` live at once over the run (activations:
        what a pipeline stage's micro-batches in flight hold)."""
        return max(cats[category] for _, _, cats, _, _, _ in self._replay())

    def timeline(self, max_points: int = 2000) -> list[tuple[int, dict[str, int]]]:
        """(op index, device bytes per category) at the end of each op that allocated or
        freed on the device, preceded by the op's own high point where that is above both
        its start and its end; thinned to ``max_points`` (the peak is always kept)."""
        return list(self._folds(max_points)[1])

    def live_at(self, event_index: int | None = None) -> list[tuple[Storage, str]]:
        """The device storages live after event ``event_index`` (default: the peak), each
        with its category at that moment (an "other" storage autograd held for backward
        then is "activations"), largest first."""
        at = self.peak_event if event_index is None else event_index
        by_serial = {s.serial: s for s in self.storages()}
        for i, _, _, live, saved, _ in self._replay():
            if i == at:
                out = [(by_serial[serial], self._category(serial, saved))
                       for serial, n in live.items() if n > 0 and serial in by_serial]
                out.sort(key=lambda p: (-p[0].nbytes, p[0].serial))
                return out
        raise IndexError(f"no event {at} in this trace ({len(self.events)} events)")

    def frozen_parameters_at(self, event_index: int | None = None) -> int:
        """Device bytes of parameters that do not require grad (a frozen base model under
        LoRA) live after event ``event_index`` (default: the peak)."""
        if not self.frozen:
            return 0
        return sum(st.nbytes for st, cat in self.live_at(event_index)
                   if cat == Category.PARAMETERS.value and st.serial in self.frozen)

    # -- storages -------------------------------------------------------------------------
    def storages(self) -> list[Storage]:
        """Every storage of the run (those that existed before it too), in serial order."""
        if self._storages is not None:
            return self._storages
        made: dict[int, int] = {}
        freed: dict[int, int] = {}
        size: dict[int, int] = dict(self.seed)
        cur: dict[int, int] = dict(self.seed)
        for serial, delta, op in self.events:
            n = cur.get(serial, 0)
            if n == 0 and delta > 0 and serial not in made and serial not in self.seed:
                made[serial] = op
            n += delta
            cur[serial] = n
            if n > size.get(serial, 0):
                size[serial] = n
            if n <= 0 and delta < 0:
                freed[serial] = op
            elif serial in freed:
                del freed[serial]
        out = []
        for serial in sorted(size):
            op = made.get(serial, 0)
            info = self.op(op)
            saved_by = self.saver.get(serial)
            out.append(Storage(
                serial=serial, nbytes=size[serial], pool=self.pool_of.get(serial, "device"),
                category=self.roles.get(serial, _OTHER), op=op,
                op_name=info[0] if info else None, module=info[1] if info else None,
                phase=info[2] if info else None, freed=freed.get(serial),
                saved_by=saved_by if serial in self.saver else None,
                frames=self.frames.get(serial, ())))
        self._storages = out
        return out

    def _largest(self, serials) -> dict[int, int]:
        """The most bytes each of ``serials`` held (a :class:`Storage`'s ``nbytes``), without
        making the run's storages (an evaluation loop's run has hundreds of thousands)."""
        size = {s: n for s, n in self.seed.items() if s in serials}
        cur = dict(size)
        for serial, delta, _ in self.events:
            if serial in serials:
                n = cur[serial] = cur.get(serial, 0) + delta
                if n > size.get(serial, 0):
                    size[serial] = n
        return size

    # -- per module -------------------------------------------------------------------------
    def module_rows(self, peak: int) -> list[ModuleRow]:
        """One row per module path (full paths, leaf attribution): activations saved by the
        module's own ops that are live at the peak (they sum to the activations category
        there), the most it held saved at once, and the parameters it owns and their grads.
        Storages saved outside any module are the row :data:`NO_MODULE`."""
        _, _, act_peak, act_max = self._folds()
        params: dict[str, int] = {}
        grads: dict[str, int] = {}
        final = self._largest(self.owner)
        for serial, path in self.owner.items():
            if self.pool_of.get(serial) != "device":
                continue
            role = self.roles.get(serial)
            n = final.get(serial, 0)
            if role == Category.PARAMETERS.value:
                params[path] = params.get(path, 0) + n
            elif role == Category.GRADIENTS.value:
                grads[path] = grads.get(path, 0) + n
        names = set(act_peak) | set(act_max) | set(params) | set(grads)
        rows = [ModuleRow(m, act_peak.get(m, 0), act_max.get(m, 0),
                          act_peak.get(m, 0) / peak if peak else 0.0,
                          params.get(m, 0), grads.get(m, 0)) for m in names]
        rows.sort(key=lambda r: (-r.activations, -r.parameters, r.module))
        return rows


class _TimelineFold:
    """:meth:`Trace.timeline` fed one replayed event at a time (see :meth:`Trace._folds`)."""

    def __init__(self) -> None:
        self.out: list[tuple[int, dict[str, int]]] = []
        self.op, self.start, self.high_total, self.high = 0, 0, -1, None
        self.prev_total = 0
        self.last: dict[str, int] = {}

    def feed(self, i: int, op: int, cats: dict[str, int], changed: list[int]) -> None:
        if not changed and i >= 0:  # a host storage's event: no device bytes moved
            return
        total = sum(cats.values())
        if i == -1:
            self.out.append((0, dict(cats)))
            self.prev_total, self.last = total, dict(cats)
            self.op, self.start, self.high_total = 0, total, total
            return
        if op != self.op:
            self._close()
            self.op, self.start, self.high = op, self.prev_total, None
            self.high_total = self.prev_total
        if total > self.high_total:
            self.high_total, self.high = total, dict(cats)
        self.prev_total, self.last = total, dict(cats)

    def _close(self) -> None:
        """The op that ended: its high point where that is above both its start and its
        end, then its end."""
        out = self.out
        if self.high is not None and self.high_total > self.prev_total and self.high_total > self.start:
            out.append((self.op, self.high))
        if out[-1][0] != self.op or sum(out[-1][1].values()) != self.prev_total:
            out.append((self.op, dict(self.last)))

    def points(self, max_points: int) -> list[tuple[int, dict[str, int]]]:
        self._close()
        points = self.out
        if len(points) > max_points:
            peak_i = max(range(len(points)), key=lambda k: sum(points[k][1].values()))
            step = len(points) / max_points
            keep = {int(k * step) for k in range(max_points)} | {len(points) - 1, peak_i}
            points = [p for k, p in enumerate(points) if k in keep]
        return points


class _ModuleFold:
    """The activations per module of :meth:`Trace.module_rows`, fed one replayed event at a
    time (see :meth:`Trace._folds`): a storage counts for its saver while it is live, saved,
    and of a role below activations (what the activations category counts); only the
    serials an event changed are looked at."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.act_now: dict[str, int] = {}
        self.act_max: dict[str, int] = {}
        self.act_peak: dict[str, int] = {}
        self.counted: dict[int, int] = {}  # serial -> bytes counted for its module now

    def feed(self, live: dict[int, int], saved: dict[int, int], changed: list[int]) -> None:
        trace, counted, act_now = self.trace, self.counted, self.act_now
        touched: list[str] = []
        for serial in changed:
            n = live.get(serial, 0)
            now = n if (n and saved.get(serial, 0) > 0
                        and trace._category(serial, saved) == _ACT) else 0
            was = counted.get(serial, 0)
            if now != was:
                m = trace.saver.get(serial) or NO_MODULE
                act_now[m] = act_now.get(m, 0) + now - was
                if now:
                    counted[serial] = now
                else:
                    counted.pop(serial, None)
                touched.append(m)
        act_max = self.act_max
        for m in touched:  # the most each held after the event (not within it)
            if act_now[m] > act_max.get(m, 0):
                act_max[m] = act_now[m]

    def mark_peak(self) -> None:
        """The activations each module holds now are those live at the peak."""
        self.act_peak = {m: n for m, n in self.act_now.items() if n}
