"""The fit map: for a card, which (batch size, context length) pairs of a cell fit, read off
a few simulated runs instead of one run per pair.

Four runs on a 2 x 2 lattice of (batch, context) (six on a 2 x 3 where a size grows with
the context's square), on a card of the target's kind that nothing outgrows, give a
:class:`~memmagic.whatif.plane.SizePlane`: each allocation's size as a polynomial in the
batch and the context (see :mod:`memmagic.whatif.plane`). At a pair the sizes are
evaluated: where the bytes live at once are more than the card, it does not fit; else the
allocator model replays the log on a card of the target's size, and it fits when no
request fails. :func:`fit_map` checks the plane against runs before it trusts it (the far
corner, byte for byte; then the boundary it found at the first, middle and last contexts:
the largest batch that fits, its sizes byte for byte, and the one above, unless its sizes
alone overflow the card), and falls back to runs where a check fails. Knows nothing of
IPython or widgets.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from ..report import format_bytes
from .knobs import BATCH_DIM, SEQ_DIM, resizing, targeting
from .plane import BASIS, BILINEAR, SizePlane

if TYPE_CHECKING:
    from .engine import Cell
    from ..report import MemoryReport

__all__ = ["FitMap", "SizePlane", "fit_map", "run_fitmap_option"]

# contexts of a map whose pairs are run one by one (where the plane cannot be used)
FALLBACK_CONTEXTS = 8


@dataclass
class FitMap:
    """Which (batch size, context length) pairs of a cell fit a card.

    ``largest[s]`` is the largest batch size in ``batch`` that fits at context ``s`` (None:
    none does), for each ``s`` of ``seqs``; a pair fits when its batch is at most that
    (the memory a step needs grows with its batch). ``method``: "plane" (read off four
    or six runs, :class:`SizePlane`, checked by ``checks``) or "runs" (a run per tried pair,
    where the plane could not be used: ``notes`` say why). ``runs`` counts the simulated
    runs it took."""

    card: str
    capacity: int
    batch: tuple[int, int]
    seqs: tuple[int, ...]
    largest: dict[int, int | None]
    method: str
    runs: int
    lattice: tuple[tuple[int, int], ...] = ()
    checks: tuple[tuple[int, int, bool], ...] = ()  # (b, s, fits) of the checking runs
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    evaluated: int = 0  # pairs answered by the plane

    def fits(self, batch: int, seq: int) -> bool | None:
        """Whether (batch, seq) fits (None: ``seq`` is not one of the map's contexts)."""
        if seq not in self.largest:
            return None
        top = self.largest[seq]
        return top is not None and batch <= top

    def largest_batch(self, seq: int) -> int | None:
        return self.largest.get(seq)

    def longest_context(self, batch: int) -> int | None:
        """The longest context of the map at which ``batch`` fits (None: none)."""
        ok = [s for s, top in self.largest.items() if top is not None and batch <= top]
        return max(ok) if ok else None

    @property
    def source(self) -> str:
        if self.method == "plane":
            return (f"sim: {self.evaluated} pairs evaluated from the runs at "
                    f"{_pairs(self.lattice)} (sizes as polynomials in batch and context, "
                    f"replayed by the allocator model), checked by runs at "
                    f"{_pairs((b, s) for b, s, _ in self.checks)}")
        return f"sim: {self.runs} runs"

    def __str__(self) -> str:
        mid = self.seqs[len(self.seqs) // 2]
        parts = [f"context {s}: batch {self.largest[s] if self.largest[s] is not None else 'none'}"
                 for s in (self.seqs[0], mid, self.seqs[-1])]
        return (f"fit map on {self.card} ({format_bytes(self.capacity)}): batch "
                f"{self.batch[0]}..{self.batch[1]} x context {self.seqs[0]}..{self.seqs[-1]} "
                f"({len(self.seqs)} contexts, {self.runs} runs, {self.wall_s:.1f} s); largest "
                f"batch that fits at " + ", ".join(parts))

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(f"<FitMap : {self}>")

    def figure(self):
        """A ``matplotlib.figure.Figure``: the (context, batch) plane, the pairs that fit
        shaded, the boundary, the runs it was read from and the checks."""
        from ..charts.plots import plot_fit_map

        return plot_fit_map(self).figure

    def chart(self):
        """The map as a displayable chart with a one-line text repr."""
        from ..charts.plots import Chart

        return Chart(self.figure(), f"<memmagic chart: fit map on {self.card}, batch "
                                    f"{self.batch[0]}..{self.batch[1]} x context "
                                    f"{self.seqs[0]}..{self.seqs[-1]}>")


def _pairs(points) -> str:
    return ", ".join(f"({b}, {s})" for b, s in points)


def _grid(lo: int, hi: int, points: int, step: int) -> tuple[int, ...]:
    """Up to ``points`` values from ``lo`` to ``hi``, multiples of ``step``, evenly spaced."""
    lo, hi = -(-lo // step) * step, hi // step * step
    if hi < lo:
        raise ValueError(f"no context between {lo} and {hi} is a multiple of {step}")
    n = (hi - lo) // step + 1
    if n <= points:
        return tuple(range(lo, hi + 1, step))
    return tuple(sorted({lo + round(i * (n - 1) / (points - 1)) * step for i in range(points)}))


def fit_map(cell: "Cell", *, gpu: Any = None, gpu_memory: Any = None,
            batch: tuple[int, int] = (1, 64), seq: tuple[int, int] | None = None,
            points: int = 64, step: int = 128, method: str = "plane",
            setting: Any = None) -> FitMap:
    """The (batch size, context length) pairs of ``cell`` that fit a card: for each of
    ``points`` contexts from ``seq`` = (lo, hi) (multiples of ``step``; default: from
    ``step`` to twice the cell's own, ``step`` halved, down to 8, until that range holds
    four), the largest batch in ``batch`` = (lo, hi) that fits.

    The card is ``gpu`` (a name, "T4") or ``gpu_memory``, else the cell's own target. The
    cell must read ``batch_size`` and ``seq_len`` or name the batch and token tensors
    memmagic resizes (see :mod:`memmagic.whatif.knobs`). Four or six runs on a larger card
    of the same kind give a :class:`SizePlane`; every other pair is evaluated from it,
    checked by runs (see the module's docstring); where it cannot be used, each tried pair
    is run (on at most FALLBACK_CONTEXTS contexts). ``method="runs"`` runs each tried pair at every
    context (the slow way, to compare). ``setting``: the other knobs of the runs (AMP,
    checkpointing; a :class:`Setting` or a dict, as ``cell.run`` takes it; its target card
    is the map's unless ``gpu`` or ``gpu_memory`` says otherwise)."""
    from ..backends.sim import resolve_target
    from .sweeps import check_search

    t0 = time.perf_counter()
    check_search(cell, "simulation", 0.0)
    base = cell.setting(setting)
    target = _target(cell, base, gpu, gpu_memory, resolve_target)
    blo, bhi = (int(v) for v in batch)
    if not 1 <= blo < bhi:
        raise ValueError(f"batch takes (lo, hi) with 1 <= lo < hi, not {batch!r}")
    if method not in ("plane", "runs"):
        raise ValueError(f"method is 'plane' or 'runs', not {method!r}")
    step = _default_step(base, seq, int(step))
    seqs = _contexts(base, seq, points, step)
    m = _Mapper(cell, target, base)
    if method == "runs":
        m.plane = _NO_PLANE
        largest = _boundaries(m.fits, seqs, blo, bhi)
    else:
        m.read_plane(blo, bhi, seqs, step)
        largest = _boundaries(m.fits, seqs, blo, bhi) if m.plane.ok else {}
    if m.plane.ok:
        m.check_boundary(largest, seqs, blo, bhi)
    if not m.plane.ok and method == "plane":  # a run per tried pair, on fewer contexts
        seqs = _grid(seqs[0], seqs[-1], FALLBACK_CONTEXTS, step)
        m.notes.append(f"so each tried pair was run, at {len(seqs)} contexts")
        largest = _boundaries(m.fits, seqs, blo, bhi)
    m.notes.append("a pair fits when its batch is at most the largest that fits at its context "
                   "(memory grows with the batch); the CUDA context counts, as in a run's verdict")
    ok = m.plane.ok
    return FitMap(target.name, target.total_memory, (blo, bhi), seqs, largest,
                  "plane" if ok else "runs", m.runs, m.lattice if ok else (),
                  tuple(m.checks) if ok else (), m.notes, time.perf_counter() - t0,
                  m.evaluated if ok else 0)


def _default_step(base: Any, seq: tuple[int, int] | None, step: int) -> int:
    """``step``, halved (down to 8) while the default contexts (``seq`` not given: from the
    step to twice the cell's own) would be fewer than four: a cell of a short context
    (an RNN's 128 steps) still gets a map."""
    own = getattr(base, resizing(SEQ_DIM).name) if seq is None else None
    while own is not None and step > 8 and max(2 * own, 2 * step) // step < 4:
        step //= 2
    return step


def _contexts(base: Any, seq: tuple[int, int] | None, points: int, step: int
              ) -> tuple[int, ...]:
    """The map's contexts: ``points`` multiples of ``step`` in ``seq`` (default: from
    ``step`` to twice the context of ``base``, the runs' setting)."""
    if seq is None:
        own = getattr(base, resizing(SEQ_DIM).name)
        if own is None:
            raise ValueError("the cell has no context length to start from: give seq=(lo, hi) "
                             "(--fitmap seq=LO:HI)")
        seq = (step, max(2 * own, 2 * step))
    seqs = _grid(int(seq[0]), int(seq[1]), int(points), int(step))
    if len(seqs) < 3:
        raise ValueError(f"the fit map needs at least 3 contexts between {seq[0]} and {seq[1]} "
                         f"(multiples of {step})")
    return seqs


class _NoPlane:
    """The plane of a map asked to run every pair."""

    ok = False


_NO_PLANE = _NoPlane()


class _Mapper:
    """One fit map's runs: on a roomy card of the target's kind (the lattice, the far
    corner) and on the target itself (the checks of the boundary, the fallback)."""

    def __init__(self, cell: "Cell", target: Any, base: Any) -> None:
        from ..backends.sim import cuda_context

        self.roomy, self.real = _roomy(cell, target), _on_card(cell, target)
        self.base = base.replace(**{targeting().name: None})  # the copies' options say it
        context = cuda_context(target)  # what a run's verdict counts beside the allocator
        self.room = target.total_memory - (context.nbytes if context is not None else 0)
        self.runs = self.evaluated = 0
        self.each_s: float | None = None  # the longest run's wall time so far
        self.notes: list[str] = []
        self.checks: list[tuple[int, int, bool]] = []
        self.lattice: tuple[tuple[int, int], ...] = ()
        self.plane: SizePlane | Any = None

    def run(self, engine: "Cell", b: int, s: int) -> "MemoryReport":
        return self.run_all(engine, [(b, s)])[b, s]

    def run_all(self, engine: "Cell", pairs: Sequence[tuple[int, int]], warm: int = 0
                ) -> dict[tuple[int, int], "MemoryReport"]:
        """Runs of ``engine`` at each (batch, context) of ``pairs``, side by side where the
        machine has the cores, the first ``warm`` here first
        (:func:`memmagic.core.forked.run_all`)."""
        from ..backends.sim import OP_CACHES
        from ..core.forked import run_all

        self.runs += len(pairs)
        b_name, s_name = resizing(BATCH_DIM).name, resizing(SEQ_DIM).name
        done = run_all(lambda p: engine.run(self.base.replace(**{b_name: p[0], s_name: p[1]}),
                                            strict=True), pairs, warm, self.each_s,
                       OP_CACHES)
        for ok, out in done:
            if not ok:
                raise out
            self.each_s = max(self.each_s or 0.0, out.wall_s)
        return {p: out for p, (_, out) in zip(pairs, done)}

    def read_plane(self, blo: int, bhi: int, seqs: Sequence[int], step: int) -> None:
        """The plane through the lattice's runs, checked byte for byte at the far corner: the
        largest batch, at the longest context that is an odd multiple of ``step`` (a kernel
        that rounds a size to a coarser multiple shows there). First a 2 x 2 lattice, sizes
        linear in the context (attention kernels keep no scores); where the far corner
        disagrees, a third context, sizes up to its square."""
        bs = (max(blo, bhi // 4), max(blo + 1, bhi // 2))
        # odd, even and odd multiples of the step: a size rounded up to a coarser multiple
        # is then no polynomial in the context through them, but one in the context rounded
        # up (plane.rounding), which the far corner, an odd multiple, checks
        n = len(seqs)
        ss = tuple(_near(seqs, seqs[i * n // 4], step, odd)
                   for i, odd in ((1, True), (2, False), (3, True)))
        if len(set(ss)) < 3:
            ss = (seqs[0], seqs[n // 2], seqs[-1])
        far = max((s for s in seqs if s // step % 2), default=seqs[-1])
        runs: dict[tuple[int, int], "MemoryReport"] = {}
        for basis, contexts in ((BILINEAR, ss[1:]), (BASIS, ss)):
            self.lattice = tuple((b, s) for b in bs for s in contexts)
            # the far corner beside the lattice: it checks whichever plane they give
            runs.update(self.run_all(self.roomy, [p for p in (*self.lattice, (bhi, far))
                                                  if p not in runs], warm=not runs))
            plane = self.plane = SizePlane({p: runs[p] for p in self.lattice}, bs, contexts,
                                           basis)
            if not plane.ok:
                why = (f"the runs at {_pairs(self.lattice)} cannot be read as one plane "
                       f"({plane.reason})")
                continue
            if plane.checked_by(bhi, far, runs[bhi, far]):
                self.checks.append((bhi, far, _verdict(plane, bhi, far, self.room) is True))
                return
            plane.ok = False
            why = (f"the run at batch {bhi}, context {far} differs from the plane through the "
                   f"runs at {_pairs(self.lattice)}")
        self.notes.append(why)

    def fits(self, b: int, s: int) -> bool:
        """Whether (b, s) fits the target: by the plane where it answers, else by a run."""
        if self.plane.ok:
            v = _verdict(self.plane, b, s, self.room)
            if v is not None:
                self.evaluated += 1
                return v
        return bool(self.run(self.real, b, s).fits)

    def check_boundary(self, largest: dict[int, int | None], seqs: Sequence[int], blo: int,
                       bhi: int) -> None:
        """Runs on the target at the boundary of the first, middle and last contexts: the
        largest batch found to fit (its sizes the plane's, byte for byte), and the one above
        it, unless the plane's sizes alone hold more at once than the card (no allocator
        could fit them: that needs no run)."""
        plane, beyond, tried = self.plane, [], []
        for s in (seqs[0], seqs[len(seqs) // 2], seqs[-1]):
            top = largest[s]
            for b in ([top] if top is not None else []) + ([(top or blo - 1) + 1]
                                                           if (top or 0) < bhi else []):
                if b != top and plane.overflows(b, s, self.room):
                    beyond.append((b, s))
                else:
                    tried.append((b, s))
        runs = self.run_all(self.real, tried, warm=1)  # side by side; judged in order
        for b, s in tried:
            ok = bool(runs[b, s].fits)
            self.checks.append((b, s, ok))
            if ok != self.fits(b, s) or ok and not plane.sizes_checked_by(b, s, runs[b, s]):
                self.notes.append(f"the run at batch {b}, context {s} disagrees with the plane")
                plane.ok = False
                return
        if beyond:
            self.notes.append(f"not run: {_pairs(beyond)}, above the boundary, whose sizes on "
                              "the plane hold more at once than the card, whatever the allocator "
                              "does")


def _near(seqs: Sequence[int], s: int, step: int, odd: bool) -> int:
    """The context of ``seqs`` nearest ``s`` that is an odd (or even) multiple of ``step``
    (``s`` where there is none)."""
    pick = [c for c in seqs if (c // step % 2 == 1) == odd]
    return min(pick, key=lambda c: abs(c - s)) if pick else s


def _boundaries(fits, seqs: Sequence[int], lo: int, hi: int) -> dict[int, int | None]:
    """The largest batch that fits at each context, each search starting from the boundary
    of the context before (it moves little from one to the next)."""
    out: dict[int, int | None] = {}
    prev = hi
    for s in seqs:
        out[s] = _boundary(lambda b, s=s: fits(b, s), lo, hi, prev)
        prev = out[s] if out[s] is not None else lo
    return out


def run_fitmap_option(cell: "Cell", option: str) -> FitMap:
    """The fit map of ``--fitmap`` (``""``, ``"batch=1:64"``, ``"batch=1:64,seq=128:4096"``,
    ``"seq=32:2048,step=32"``: the contexts' step)."""
    ranges: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in option.replace(" ", "").split(","))):
        name, _, span = part.partition("=")
        lo, _, hi = span.partition(":")
        ok = (span.isdigit() and int(span) > 0 if name == "step"
              else name in ("batch", "seq") and lo.isdigit() and hi.isdigit())
        if not ok or name in ranges:
            raise ValueError(f"--fitmap takes batch=LO:HI, seq=LO:HI and step=N (e.g. --fitmap "
                             f"batch=1:64,seq=128:4096,step=64), not {option!r}")
        ranges[name] = int(span) if name == "step" else (int(lo), int(hi))
    try:
        return fit_map(cell, **ranges)
    except _NoCard:
        raise ValueError("--fitmap needs a card: add --gpu (e.g. --gpu T4) or --gpu-memory, "
                         "or run it under %gpusim on --gpu T4") from None


def _verdict(plane: SizePlane, b: int, s: int, room: int) -> bool | None:
    """Whether (b, s) fits by the plane when the allocator may reserve ``room`` bytes (the
    card less its CUDA context; None: no answer)."""
    if plane.overflows(b, s, room):  # more than the card holds, at some point
        return False
    acts = plane.actions_at(b, s)
    return None if acts is None else plane.replay(acts, room) is not None


def _boundary(fits, lo: int, hi: int, start: int) -> int | None:
    """The largest b in [lo, hi] with fits(b) (None: none), fits taken to hold below it:
    gallops from ``start`` (the boundary of the context before, which moves little), then
    bisects. (``sweeps._largest``, the finders', doubles from the bottom instead.)"""
    start = min(max(start, lo), hi)
    if fits(start):
        good, step = start, 1
        while good < hi:
            b = min(hi, good + step)
            if not fits(b):
                bad = b
                break
            good, step = b, step * 2
        else:
            return good
    else:
        bad, step = start, 1
        while True:
            b = max(lo, bad - step)
            if fits(b):
                good = b
                break
            if b == lo:
                return None
            bad, step = b, step * 2
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def _target(cell: "Cell", base: Any, gpu: Any, gpu_memory: Any, resolve) -> Any:
    """The card of the map: the one asked, else the setting's (``base``), else the cell's."""
    opts = cell.backend_options
    if gpu is None and gpu_memory is None:
        gpu, gpu_memory = (opts.get(o) for o in _card_options())
        own = getattr(base, targeting().name)
        if own is not None:
            gpu, gpu_memory = own, None
    target = resolve(gpu, gpu_memory)
    if target is None:
        raise _NoCard("a fit map needs a card: fit_map(cell, gpu='T4') (or gpu_memory='16GiB')")
    return target


class _NoCard(ValueError):
    """No card to draw a fit map for."""


def _on_card(cell: "Cell", target: Any) -> "Cell":
    """A copy of ``cell`` that runs on ``target``."""
    import copy

    other = copy.copy(cell)
    option, *_ = names = _card_options()
    opts = {k: v for k, v in cell.backend_options.items() if k not in names}
    other.backend_options = {**opts, option: target}
    # the target card's knob: the options say the card now
    other.baseline = cell.baseline.replace(**{targeting().name: None})
    return other


def _card_options() -> tuple[str, ...]:
    """The backend options that name the card: its own (``gpu``) and those it replaces."""
    by = targeting().backend
    return (by.option, *by.replaces)


def _roomy(cell: "Cell", target: Any) -> "Cell":
    """A copy of ``cell`` on a card of ``target``'s kind (its kernels, its multiprocessors)
    that nothing outgrows: the lattice's runs must not run out of memory."""
    from ..backends.sim import CardSpec

    card = target.resized_from or target
    big = CardSpec(f"{card.name} (no memory limit)", 1 << 50, card.capability,
                   card.multi_processor_count, resized_from=card)
    return _on_card(cell, big)
