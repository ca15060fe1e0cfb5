"""Sizes read off runs: what simulated runs of one cell at other sizes say about a size
that was not run.

A run's allocations, as the simulated allocator logged them and the tracker saw them, are
its *shape* (what was allocated and freed, in order) and its *sizes*
(:func:`allocation_shape`). Runs of one cell at several batch sizes or context lengths that
have one shape differ only in sizes, and a transformer step's sizes are polynomials in the
batch ``b`` and the context ``s``: weights a constant, activations ``b*s*c``, attention
scores ``b*s*s*c``, masks ``s*s*c``. :class:`SizePlane` fits each size exactly (integer
arithmetic) on a basis of monomials ``b^i s^j`` through as many runs as the basis has
(:data:`BASIS`: six runs on a 2 x 3 lattice, or :data:`BILINEAR`: four on a 2 x 2, for the
fit map; :data:`BATCH_LINE`, :data:`CONTEXT_LINE`, :data:`CONTEXT_CURVE`: lines and a
parabola through runs that differ in one size, for sweeps, the finders and the panel). A
reduction's staging buffers (a kernel's sizes: no such polynomial) are recomputed from
their fitted recipes (:func:`memmagic.backends.sim.reduction_scratch`); a size a kernel
pads to its tile is a polynomial in the context rounded up to that tile
(:func:`_fit_rounded`). At a new size the sizes are evaluated and the allocator model
replays the log on the card: it fits when no request fails. A plane is trusted only where
runs it was not drawn through check it, byte for byte (:meth:`SizePlane.checked_by`).
Knows nothing of IPython or widgets.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

if TYPE_CHECKING:
    from ..report import MemoryReport

__all__ = ["SizePlane", "allocation_shape", "shape_of", "line_through", "point",
           "largest_within", "bisect_largest", "BASIS", "BILINEAR",
           "BATCH_LINE", "CONTEXT_LINE", "CONTEXT_CURVE"]

# the monomials b^i s^j of a size, in this order
BASIS = ((0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2))
# without the squares of the context: four runs on a 2 x 2 lattice (attention kernels keep no
# b*s*s scores)
BILINEAR = ((0, 0), (0, 1), (1, 0), (1, 1))
# through runs that differ in one size: a line in the batch; a line or a parabola in the context
BATCH_LINE = ((0, 0), (1, 0))
CONTEXT_LINE = ((0, 0), (0, 1))
CONTEXT_CURVE = ((0, 0), (0, 1), (0, 2))
Basis = Sequence[tuple[int, int]]
_INT64_SAFE = 1 << 62
# what a kernel may round the context up to (its tile: :func:`_fit_rounded`)
_ROUNDINGS = tuple(1 << k for k in range(1, 13))

def allocation_shape(run: MemoryReport, exclude: frozenset = frozenset()
                     ) -> tuple[tuple, list[int]] | None:
    """What a simulated run did, as a shape and sizes: the allocator's allocs and frees (keys
    numbered by first use) and where its peaks restart, then the tracker's device events
    (storages numbered the same way) and the bytes live at the start; the sizes are the
    allocs' then the events'. Frees in a row are taken in key order (autocast empties its
    cache in the order of addresses: their order moves no peak). None without a
    replayable allocator log. ``exclude``: storages left out (a reduction's staging
    buffers, which :class:`memmagic.whatif.fitmap.SizePlane` recomputes)."""
    trace = getattr(run, "trace", None)
    log = getattr(trace, "allocator_log", None)
    if log is None or getattr(log, "start", None) is None:
        return None
    known = trace.__dict__.setdefault("_shapes", {})  # a run's shape is read once per exclude
    if exclude not in known:
        known[exclude] = _shape(trace, log, exclude)
    return known[exclude]


def _shape(trace: Any, log: Any, exclude: frozenset) -> tuple[tuple, list[int]] | None:
    """:func:`allocation_shape` of a run's trace and allocator log."""
    steps, restart, failed = _log_steps(log.entries, exclude, log.restart)
    if failed is not None:
        return None
    allocs = _frees_sorted(steps)
    events = _device_events(trace, log.entries, exclude)
    if events is None:
        return None
    live = sum(n for s, n in trace.seed.items() if trace.pool_of.get(s) == "device")
    sizes = [n for code, n in allocs if not code & 1]
    shape = (tuple(c for c, _ in allocs), restart, len(sizes), tuple(c for c, _ in events), live)
    return shape, sizes + [n for _, n in events]


def _log_steps(entries: list[dict], exclude: frozenset, restart_at: int = -1
               ) -> tuple[list[tuple[int, int]], int, int | None]:
    """An allocator log's allocs and frees as (code, size) steps (code 2 * id for an alloc,
    2 * id + 1 for a free, keys numbered by first use; ``exclude``: keys left out), the
    steps before entry ``restart_at`` (all of them where it is past the end), and the bytes
    of the request that failed, where one did: the steps stop there (None: none failed)."""
    ids: dict[Any, int] = {}
    steps: list[tuple[int, int]] = []
    restart = None
    for n, e in enumerate(entries):
        if n == restart_at:
            restart = len(steps)
        if e["action"] == "oom":
            return steps, len(steps) if restart is None else restart, e["size"]
        if e["action"] in ("alloc", "free_completed") and e["key"] not in exclude:
            free = e["action"] != "alloc"
            steps.append((2 * ids.setdefault(e["key"], len(ids)) + free, 0 if free else e["size"]))
    return steps, len(steps) if restart is None else restart, None


def _device_events(trace: Any, entries: list[dict], exclude: frozenset = frozenset()
                   ) -> list[tuple[int, int]] | None:
    """The tracker's device events as (code, bytes requested): the bytes its allocator
    entry asked for (the tracker holds them rounded up to 512), or the event's own for a
    storage from before the log; None where an event is not one allocator entry's
    (``exclude``: storages left out)."""
    from ..backends.sim import round_request

    asked: dict[Any, list[int]] = {}
    for e in entries:
        if e["action"] == "alloc":
            asked.setdefault(e["key"], []).append(e["size"])
    held: dict[Any, int] = {}
    ids: dict[Any, int] = {}
    out = []
    for serial, delta, _op in trace.events:
        if trace.pool_of.get(serial) != "device" or not delta or serial in exclude:
            continue
        if delta > 0:
            queue = asked.get(serial)
            if not queue or round_request(queue[0]) != delta:
                return None
            held[serial] = n = queue.pop(0)
        else:
            n = held.pop(serial, -delta)
            if round_request(n) != -delta:
                return None
        out.append((2 * ids.setdefault(serial, len(ids)) + (delta < 0), n))
    return _frees_sorted(out)


def _frees_sorted(steps: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``steps`` (code, size) with each run of frees (odd codes) in code order."""
    out: list[tuple[int, int]] = []
    frees: list[tuple[int, int]] = []
    for step in steps:
        if step[0] & 1:
            frees.append(step)
            continue
        out += sorted(frees)
        frees = []
        out.append(step)
    return out + sorted(frees)


def _weights(bs: Sequence[int], ss: Sequence[int], basis: Basis = BASIS
             ) -> tuple[list[list[int]], int]:
    """(W, D): integer weights with ``D * c = W @ y``, where ``y`` are a size's values at the
    lattice points ``[(b, s) for b in bs for s in ss]`` and ``c`` its coefficients on
    ``basis`` (as many monomials as points). Exact: the inverse of the lattice's design
    matrix, in fractions."""
    pts = [(b, s) for b in bs for s in ss]
    n = len(basis)
    m = [[Fraction(b ** i * s ** j) for i, j in basis] + [Fraction(int(r == c)) for c in range(n)]
         for r, (b, s) in enumerate(pts)]
    for c in range(n):  # Gauss-Jordan
        p = next(r for r in range(c, n) if m[r][c] != 0)
        m[c], m[p] = m[p], m[c]
        pivot = m[c][c]
        m[c] = [v / pivot for v in m[c]]
        for r in range(n):
            if r != c and m[r][c] != 0:
                f = m[r][c]
                m[r] = [a - f * b for a, b in zip(m[r], m[c])]
    inv = [row[n:] for row in m]
    d = 1
    for row in inv:
        for v in row:
            d = math.lcm(d, v.denominator)
    return [[int(v * d) for v in row] for row in inv], d


def _fit(weights: list[list[int]], d: int, values: Sequence[Sequence[int]]) -> list[list[int] | None]:
    """Per column of ``values`` (one row per lattice point), its integer coefficients on
    :data:`BASIS`, or None where they are not whole numbers (no such polynomial)."""
    out: list[list[int] | None] = []
    for col in zip(*values):
        coef = []
        for row in weights:
            num = sum(w * y for w, y in zip(row, col))
            q, r = divmod(num, d)
            if r:
                coef = None
                break
            coef.append(q)
        out.append(coef)
    return out


def _monomials(b: int, s: int, basis: Basis = BASIS) -> list[int]:
    return [b ** i * s ** j for i, j in basis]


def _round_up(s: int, r: int) -> int:
    return -(-s // r) * r


def _fit_rounded(coefs: list[list[int] | None], values: Sequence[Sequence[int]],
                 bs: Sequence[int], ss: Sequence[int], basis: Basis) -> dict[int, int] | None:
    """The sizes ``coefs`` has no polynomial for (None), fitted in the context rounded up to
    a power of two R instead (a kernel that pads its sequence to a multiple of its tile:
    memory-efficient attention's workspace to 64, flash attention's to 128), the smallest R
    that gives whole coefficients through the lattice: their coefficients are put in
    ``coefs``; returns {column: R}. None where some size has none (or the basis has no
    context)."""
    missing = [i for i, c in enumerate(coefs) if c is None]
    if not missing:
        return {}
    if not any(j for _, j in basis):
        return None
    rounding: dict[int, int] = {}
    for r in _ROUNDINGS:
        rs = [_round_up(s, r) for s in ss]
        if rs == list(ss) or len(set(rs)) < len(rs):  # nothing rounded, or points merged
            continue
        weights, d = _weights(bs, rs, basis)
        for i, c in zip(missing, _fit(weights, d, [[row[i] for i in missing] for row in values])):
            if c is not None:
                coefs[i], rounding[i] = c, r
        missing = [i for i in missing if i not in rounding]
        if not missing:
            return rounding
    return None


class SizePlane:
    """Simulated runs of one cell on the lattice ``bs`` x ``ss`` (2 batch sizes x 3 context
    lengths for :data:`BASIS`, x 2 for :data:`BILINEAR`; one size for the lines), and each
    allocation's size as a polynomial through them.

    A reduction's staging buffers are left out of the comparison: each reduction that may
    stage one is a *site*, at the same place of every run, whose buffers (none, or a
    staging buffer and its semaphores) are recomputed from its fitted recipe at each size.
    ``ok`` says whether the runs did the same things in the same order and every other
    size is such a polynomial; ``reason`` says why not."""

    def __init__(self, runs: dict[tuple[int, int], "MemoryReport"], bs: Sequence[int],
                 ss: Sequence[int], basis: Basis = BASIS) -> None:
        self.bs, self.ss, self.basis = tuple(bs), tuple(ss), tuple(basis)
        self.ok, self.reason = False, ""
        pts = [(b, s) for b in self.bs for s in self.ss]
        shapes, plans = [], []
        for p in pts:
            sh, plan = shape_of(runs[p]), _plan(runs[p].trace)
            if sh is None or plan is None:
                self.reason = (f"the run at batch {p[0]}, context {p[1]} has no replayable "
                               "allocator log (it failed, or ran out of memory)")
                return
            shapes.append(sh)
            plans.append(plan)
        first = shapes[0][0]
        entries, restart, sites = plans[0]
        if any(sh[0] != first for sh in shapes) or any(
                (len(e), r, [(pos, _form(rc)) for pos, rc in st])
                != (len(entries), restart, [(pos, _form(rc)) for pos, rc in sites])
                for e, r, st in plans):
            self.reason = ("the runs at the lattice's sizes did different things (the cell "
                           "takes another path at some of them)")
            return
        self.shape, self.entries, self.restart = first, entries, restart
        # the first run: the one whose log the sizes replay and whose trace they resize
        self.point, self.run, self.log = pts[0], runs[pts[0]], runs[pts[0]].trace.allocator_log
        weights, d = _weights(self.bs, self.ss, self.basis)
        values = [sh[1] for sh in shapes]
        coefs = _fit(weights, d, values)
        # {column: R} of the sizes that are polynomials in the context rounded up to R
        self.rounding = _fit_rounded(coefs, values, self.bs, self.ss, self.basis)
        if self.rounding is None:
            self.reason = ("an allocation's size is not a polynomial in the batch and the "
                           "context, nor in the context rounded up to a power of two (a "
                           "kernel that rounds its sizes otherwise)")
            return
        self.coefs = coefs
        # each site: its place among the entries, its recipe's form, its whole numbers fitted
        self.sites = []
        for i, (pos, recipe) in enumerate(sites):
            ints = [list(plan[2][i][1][0]) + list(plan[2][i][1][1]) for plan in plans]
            fitted = _fit(weights, d, ints)
            if any(c is None for c in fitted):
                self.reason = "a reduction's sizes are not polynomials in the batch and the context"
                return
            self.sites.append((pos, _form(recipe), fitted))
        import numpy as np

        self._numpy = None
        self._floor: tuple | None = None  # _floor_plan's arrays, made when first asked
        # int64 arithmetic where no size up to 64 times the lattice's overflows it
        self._limits = (64 * max(self.bs), 64 * max(self.ss))
        top = _monomials(self._limits[0], self._limits[1] + max(_ROUNDINGS), self.basis)
        if all(sum(abs(c) * m for c, m in zip(co, top)) < _INT64_SAFE for co in coefs):
            self._numpy = np.array(coefs, dtype=np.int64)
            by: dict[int, list[int]] = {}
            for col, r in self.rounding.items():
                by.setdefault(r, []).append(col)
            self._rounded = [(r, np.array(cols), self._numpy[cols]) for r, cols in by.items()]
        self.ok = True

    def sizes_at(self, b: int, s: int) -> list[int] | None:
        """The sizes of the allocations that are not staging buffers at batch ``b``, context
        ``s`` (None: one would be below one byte)."""
        m = _monomials(b, s, self.basis)
        if self._numpy is not None and b <= self._limits[0] and s <= self._limits[1]:
            import numpy as np

            out = self._numpy @ np.array(m, dtype=np.int64)
            for r, cols, coefs in self._rounded:
                out[cols] = coefs @ np.array(_monomials(b, _round_up(s, r), self.basis),
                                             dtype=np.int64)
            sizes = out.tolist()
        else:
            ms = {r: _monomials(b, _round_up(s, r), self.basis)
                  for r in {1, *self.rounding.values()}}
            sizes = [sum(c * x for c, x in zip(co, ms[self.rounding.get(i, 1)]))
                     for i, co in enumerate(self.coefs)]
        return sizes if min(sizes, default=1) >= 1 else None

    def allocated_floor(self, b: int, s: int) -> int | None:
        """A floor under the allocated peak at (b, s), found without the allocator model:
        the bytes allocated at the start, plus each alloc's request, less what each free
        gives back, at their most (a block is at least its request; staging buffers are
        left out). Where it is over what the card lets the allocator reserve, a request
        fails there. None where no sizes are read off at (b, s)."""
        import numpy as np

        sizes = self.sizes_at(b, s)
        if sizes is None or max(sizes, default=0) > _INT64_SAFE >> 16:
            return None
        if self._floor is None:
            self._floor = _floor_plan(self.entries, self.log.start)
        column, sign, given_back, start = self._floor
        allocs = np.array(sizes[:self.shape[2]] or [0], dtype=np.int64)
        live = np.cumsum(sign * allocs[column] - given_back)
        return start + max(int(live.max(initial=0)), 0)

    def overflows(self, b: int, s: int, room: int) -> bool:
        """Whether the sizes at (b, s) alone hold more than ``room`` bytes at once
        (:meth:`allocated_floor`): then no allocator fits them in ``room``."""
        floor = self.allocated_floor(b, s)
        return floor is not None and floor > room

    def actions_at(self, b: int, s: int) -> tuple[list[dict], int, list[int]] | None:
        """What the allocator does at (b, s): its allocs and frees (with each site's
        staging buffers put in), the entry from which peaks count, and the allocs' sizes."""
        from ..backends.sim import reduction_scratch, round_request

        sizes = self.sizes_at(b, s)
        if sizes is None:
            return None
        m = _monomials(b, s, self.basis)
        n_alloc = self.shape[2]
        alloc_sizes = iter(sizes[:n_alloc])
        entries: list[dict] = []
        out_sizes: list[int] = []
        restart = None
        sites = iter(self.sites)
        site = next(sites, None)
        for i, e in enumerate(self.entries + [None]):
            while site is not None and site[0] == i:
                pos, (rank, dims, acc, sms, threads), fitted = site
                ints = [sum(c * x for c, x in zip(co, m)) for co in fitted]
                got = reduction_scratch(tuple(ints[:rank]), tuple(ints[rank:]), set(dims), acc,
                                        sms, threads)
                keys = [("staging", pos, j) for j in range(len(got))]
                entries += [{"action": "alloc", "key": k} for k in keys]
                out_sizes += [round_request(n) for n in got]  # as the tracker asks for them
                entries += [{"action": "free_completed", "key": k} for k in keys]
                site = next(sites, None)
            if i == self.restart:
                restart = len(entries)
            if e is None:
                break
            entries.append(e)
            if e["action"] == "alloc":
                out_sizes.append(next(alloc_sizes))
        return entries, len(entries) if restart is None else restart, out_sizes

    def at(self, b: int, s: int, capacity: int | None = None) -> tuple[int, int] | None:
        """(allocated peak, reserved peak) of the allocator model replaying the actions at
        (b, s), on a card that lets it reserve ``capacity`` bytes (None: no limit; a
        request that does not fit: None)."""
        acts = self.actions_at(b, s) if self.ok else None
        return None if acts is None else self.replay(acts, capacity)

    def replay(self, acts: tuple[list[dict], int, list[int]], capacity: int | None = None
               ) -> tuple[int, int] | None:
        """:meth:`at` for actions :meth:`actions_at` gave."""
        entries, restart, sizes = acts
        return self.log.replay(sizes, capacity, entries, restart)

    def checked_until_out_of_memory(self, b: int, s: int, run: "MemoryReport") -> bool:
        """Whether a run at (b, s) that ran out of memory did, up to the request that failed,
        exactly what the plane gives there: the same allocs and frees in the same order,
        each of the same size (staging buffers aside), and the failed request the plane's
        next allocation."""
        done = _until_out_of_memory(run) if self.ok else None
        sizes = self.sizes_at(b, s) if done is not None else None
        if done is None or sizes is None:
            return False
        codes, got, failed = done
        k = len(got)
        return (codes == self.shape[0][:len(codes)] and k < self.shape[2]
                and got == sizes[:k] and sizes[k] == failed)

    def sizes_checked_by(self, b: int, s: int, run: "MemoryReport") -> bool:
        """Whether the run at (b, s) made the allocs and frees the plane gives there, in the
        same order, each of the same size (staging buffers aside): on any card."""
        if not self.ok:
            return False
        sh = shape_of(run)
        sizes = self.sizes_at(b, s)
        return sh is not None and sizes is not None and sh[0] == self.shape and sh[1] == sizes

    def checked_by(self, b: int, s: int, run: "MemoryReport") -> bool:
        """Whether the run at (b, s) did exactly what the plane gives there: the same
        allocs and frees in the same order, each of the same size (staging buffers too), and
        the same allocated and reserved peaks."""
        if not self.sizes_checked_by(b, s, run):
            return False
        acts = self.actions_at(b, s)
        log = run.trace.allocator_log
        done = [e for e in log.entries if e["action"] in ("alloc", "free_completed")]
        asked = [e["size"] for e in done if e["action"] == "alloc"]
        if [e["action"] for e in done] != [e["action"] for e in acts[0]] or asked != acts[2]:
            return False
        return self.replay(acts) == log.replay(asked)


def _floor_plan(entries: list[dict], start: Any) -> tuple[Any, Any, Any, int]:
    """What :meth:`SizePlane.allocated_floor` adds up, per entry of ``entries`` (allocs
    and frees): the column of the alloc's size (a free's: its alloc's), +1, -1 or 0 (a
    free of a block from before the log), what such a free gives back (its block's size
    in the model ``start``), and the bytes ``start`` has allocated."""
    import numpy as np

    rows: list[tuple[int, int, int]] = []  # (column, sign, given back) per entry
    open_: dict[Any, int] = {}
    n = 0
    for e in entries:
        key = e["key"]
        if e["action"] == "alloc":
            open_[key] = n
            rows.append((n, 1, 0))
            n += 1
        elif key in open_:
            rows.append((open_.pop(key), -1, 0))
        else:
            rows.append((0, 0, start.size_of(key)))
    column, sign, given_back = np.array(rows, dtype=np.int64).reshape(-1, 3).T
    return column, sign, given_back, start.allocated


def _until_out_of_memory(run: "MemoryReport") -> tuple[tuple, list[int], int] | None:
    """What a simulated run that ran out of memory did until the request that failed, as
    :func:`allocation_shape` gives it without its staging buffers (codes, alloc sizes),
    and that request's bytes; None for a run that did not run out."""
    trace = getattr(run, "trace", None)
    log = getattr(trace, "allocator_log", None)
    if log is None or run.failed_request is None:
        return None
    steps, _restart, failed = _log_steps(log.entries, frozenset(getattr(trace, "scratch", ())))
    if failed is None:
        return None
    steps = _frees_sorted(steps)
    return tuple(c for c, _ in steps), [n for c, n in steps if not c & 1], failed


def line_through(runs: Mapping[int, "MemoryReport"], basis: Basis = BATCH_LINE) -> SizePlane:
    """The line (or curve) through simulated runs that differ in one size, by its value, as
    many as ``basis`` has monomials: a basis in ``b`` takes the value as the batch, one in
    ``s`` as the context (:func:`point`)."""
    xs = sorted(runs)
    in_b = any(i for i, _ in basis)
    return SizePlane({point(x, basis): runs[x] for x in xs},
                     *((xs, [1]) if in_b else ([1], xs)), basis)


def point(x: int, basis: Basis) -> tuple[int, int]:
    """(batch, context) of a value of the one size ``basis`` is in (the other is 1: its
    power is 0)."""
    return (x, 1) if any(i for i, _ in basis) else (1, x)


def largest_within(plane: SizePlane, limit: int, context: int, start: int, high: int,
                   step: int) -> int | None:
    """The largest multiple of ``step`` in [``start``, ``high``] that fits ``limit`` by
    ``plane`` (each allocation's size read off it at :func:`point` of the value, the
    allocator replayed on the card: no request fails, and what it needs plus ``context``
    is within ``limit``); None where it cannot say (``start`` does not fit, or a size is
    off the plane's whole bytes)."""
    from ..report import needed

    def fits(v: int) -> bool | None:
        if plane.overflows(*point(v, plane.basis), limit - context):  # reserved is more
            return False
        acts = plane.actions_at(*point(v, plane.basis))
        if acts is None:  # a size off the plane's whole bytes: it cannot say
            return None
        at = plane.replay(acts)  # None: a request failed on the card
        return at is not None and needed(*at) + context <= limit

    if not plane.ok or not fits(start):
        return None
    # start fits by the plane; the size past the range stands for one that does not
    lo = bisect_largest(fits, start, high // step * step + step, step)
    return None if lo is None else min(lo, high)


def bisect_largest(fits: Callable[[int], bool | None], lo: int, hi: int, step: int
                   ) -> int | None:
    """The largest multiple of ``step`` between ``lo`` (which fits) and ``hi`` (which does
    not) that fits, by bisection; None as soon as ``fits`` cannot say (None)."""
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        ok = fits(mid)
        if ok is None:
            return None
        lo, hi = (mid, hi) if ok else (lo, mid)
    return lo


def shape_of(run: "MemoryReport") -> tuple[tuple, list[int]] | None:
    """A run's allocation shape without its staging buffers (:func:`allocation_shape`), as
    a plane compares and fits it (read once per run, then kept on its trace)."""
    return allocation_shape(run, exclude=frozenset(getattr(run.trace, "scratch", ())))


def _plan(trace: Any) -> tuple[list[dict], int, list[tuple[int, tuple]]] | None:
    """A run's allocs and frees without its staging buffers, the one from which peaks
    count, and its sites as (their place among those, recipe)."""
    log = getattr(trace, "allocator_log", None)
    if log is None or getattr(log, "start", None) is None:
        return None
    staging = getattr(trace, "scratch", {})
    kept: list[dict] = []
    at: list[int] = []  # kept entries before each raw entry
    restart = None
    for n, e in enumerate(log.entries):
        at.append(len(kept))
        if n == log.restart:
            restart = len(kept)
        if e["action"] == "oom":
            return None
        if e["action"] in ("alloc", "free_completed") and e["key"] not in staging:
            kept.append({"action": e["action"], "key": e["key"]})
    at.append(len(kept))
    sites = [(at[pos] if pos is not None and pos < len(at) else len(kept), recipe)
             for pos, recipe in getattr(trace, "scratch_sites", ())]
    return kept, len(kept) if restart is None else restart, sites


def _form(recipe: tuple) -> tuple:
    """What must agree between runs for a site's recipe to be fitted: all but its sizes."""
    shape, strides, dims, acc, sms, threads = recipe
    return len(shape), dims, acc, sms, threads
