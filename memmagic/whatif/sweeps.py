"""Sweeps and the batch-size finder, on top of the what-if engine (:class:`~memmagic.whatif.engine.Cell`).

:func:`sweep` runs a knob (the batch size by default) across values for each strategy (a
combination of other knobs: AMP, checkpointing, ...) and returns a :class:`Sweep`: the
reports per strategy, the largest value that fits the card for each, and a chart.
:func:`find_batch_size` returns the largest batch size that fits a memory budget with a
safety margin (doubling, then bisection), as a :class:`BatchSearch` that says how it
found it; :func:`find_seq_len` the longest context (sequence length) the same way. Knows nothing of IPython or widgets.
"""

from __future__ import annotations

import gc
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Sequence, Union

from .evaluated import peaks_at
from .knobs import BATCH_DIM, KNOBS, SEQ_DIM, KnobError, Setting, resizing, targeting
from .plane import CONTEXT_CURVE, bisect_largest, largest_within, line_through, point
from ..report import MemoryReport, format_bytes, needed

if TYPE_CHECKING:
    from .engine import Cell
    from .plane import SizePlane

__all__ = ["Sweep", "sweep", "Interpolated", "default_strategies", "parse_values",
           "BatchSearch", "find_batch_size", "find_seq_len", "run_sweep_option"]

# what a sweep runs by default: the batch size
_BATCH = resizing(BATCH_DIM).name


def _fits(report: MemoryReport, limit: int | None, card: bool) -> bool:
    """Whether the run fits ``limit`` bytes: the card's size (``card``: what it needs of the
    whole card, the CUDA context with it) or a budget given for PyTorch's allocator."""
    if report.error is not None or report.failed_request is not None:
        return False
    return limit is None or report.need_of(card) <= limit


def parse_values(text: str, knob: str = _BATCH) -> tuple[int, ...]:
    """Knob values from ``"1:512"`` (the powers of two from 1 to 512, both ends included)
    or ``"8,16,24"`` (those values)."""
    k = KNOBS.get(knob)
    if k is None or k.kind != "int":
        ints = [n for n, kk in KNOBS.items() if kk.kind == "int"]
        raise ValueError(f"a sweep runs an integer knob ({', '.join(ints)}), not {knob!r}")
    s = str(text).replace(" ", "")
    try:
        if ":" in s:
            lo_s, hi_s = s.split(":", 1)
            lo, hi = int(lo_s), int(hi_s)
            if lo < 1 or hi < lo:
                raise ValueError
            vals = []
            v = 1
            while v <= hi:
                if v >= lo:
                    vals.append(v)
                v *= 2
            if not vals or vals[0] != lo:
                vals.insert(0, lo)
            if vals[-1] != hi:
                vals.append(hi)
            out = tuple(vals)
        else:
            out = tuple(sorted({int(x) for x in s.split(",") if x}))
    except ValueError:
        raise ValueError(f"sweep values are LO:HI (powers of two between them, e.g. 1:512) or "
                         f"a list (8,16,32), not {text!r}") from None
    if not out:
        raise ValueError(f"no values in {text!r}")
    for v in out:
        k.check(v)
    return out


def default_strategies(cell: "Cell", applicable: Sequence[str] | None = None) -> dict[str, Setting]:
    """One strategy per combination of the knobs that are a sweep's axes (``Knob.strategy``:
    AMP off / bf16, checkpointing off / on), of those that apply to ``cell``: up to four,
    named "fp32", "amp bf16", "ckpt", ..."""
    names = applicable if applicable is not None else cell.applicable()
    axes: list[list[tuple[str, dict[str, Any]]]] = []
    for knob in KNOBS.values():
        if knob.strategy is not None and knob.name in names:
            off, on, value = knob.strategy
            axes.append([(off, {}), (on, {knob.name: value})])
    out: dict[str, Setting] = {}
    for combo in itertools.product(*axes) if axes else [()]:
        label = " + ".join(n for n, _ in combo if n) or "as written"
        values: dict[str, Any] = {}
        for _, v in combo:
            values.update(v)
        out[label] = Setting(**values)
    return out


def _ran(report: "Point") -> bool:
    return report.error is None and report.failed_request is None


@dataclass(frozen=True)
class Interpolated:
    """A sweep's value that was not run. The simulated runs at ``lo`` and ``hi`` (value,
    report) made the same allocations and frees in the same order, and the run at
    ``check`` between them made exactly those, each of the size on the straight line
    through its sizes at ``lo`` and ``hi`` (a reduction's staging buffers: what their
    recipes give), with the peaks the replay below gives (:func:`_line`). The peak and
    reserved peak are the simulated allocator's when it replays those allocations at the
    line's sizes for ``value``, from the state the runs began in, and the tracker's over
    the run's trace at those sizes (:func:`memmagic.whatif.evaluated.peaks_at`). It has no
    breakdown, timeline or notes: those come from a run (``exact=True``)."""

    value: int
    peak: int
    reserved_peak: int | None
    lo: tuple[int, MemoryReport]
    hi: tuple[int, MemoryReport]
    check: int
    # the context: the run in the middle of a parabola through ``lo``, it and ``hi``
    # (``check`` is then a fourth run), where the sizes are not lines in it
    through: int | None = None
    interpolated: ClassVar[bool] = True
    error: ClassVar[None] = None
    failed_request: ClassVar[None] = None

    @property
    def need(self) -> int:
        return needed(self.peak, self.reserved_peak)  # type: ignore[return-value]

    def __getattr__(self, name: str) -> Any:
        """What the two runs share (the card, the context, the backend)."""
        if name in ("gpu_name", "gpu_memory", "context", "backend", "device"):
            return getattr(self.lo[1], name)
        raise AttributeError(f"an interpolated sweep value has no {name!r}: run it "
                             f"(cell.run(...) at {self.value}, or sweep(..., exact=True))")

    card_need = MemoryReport.card_need
    need_of = MemoryReport.need_of
    fits = MemoryReport.fits

    @property
    def source(self) -> str:
        if self.through is not None:
            return (f"interpolated between the runs at {self.lo[0]} and {self.hi[0]}: the "
                    "simulated allocator replaying their allocations at sizes on the "
                    f"parabolas through theirs and the run at {self.through}'s, checked by "
                    f"the run at {self.check}")
        return (f"interpolated between the runs at {self.lo[0]} and {self.hi[0]}: the "
                "simulated allocator replaying their allocations at sizes on the lines "
                f"through theirs, checked by the run at {self.check}")

    def __str__(self) -> str:
        return f"~{format_bytes(self.peak)} peak at {self.value}, {self.source}"


def _line(a: int, ra: MemoryReport, c: int, rc: MemoryReport) -> "SizePlane":
    """The line through the simulated runs at ``a`` and ``c`` of a whole-number knob
    (:func:`memmagic.whatif.plane.line_through`: each allocation's size on it, a
    reduction's staging buffers from their recipes; ``ok`` False where the runs did
    different things)."""
    return line_through({a: ra, c: rc})


Point = Union[MemoryReport, Interpolated]


@dataclass(frozen=True)
class Sweep:
    """Reports of a knob run across ``values`` for each strategy. ``curves[strategy]`` is
    (value, report) per value, where a report is a run's :class:`MemoryReport` or an
    :class:`Interpolated` point (``report.interpolated``); ``capacity`` (bytes) the card's
    memory where known."""

    knob: str
    values: tuple[int, ...]
    curves: Mapping[str, tuple[tuple[int, Point], ...]]
    capacity: int | None = None
    capacity_name: str | None = None
    wall_s: float = 0.0
    strategies: Mapping[str, Setting] = field(default_factory=dict, repr=False)
    card: bool = False  # capacity is the runs' card (the CUDA context counts), not a budget

    def largest_fitting(self) -> dict[str, int | None]:
        """Per strategy, the largest value whose run fits the card (None: none fits); without
        a capacity, the largest value that ran without error."""
        out: dict[str, int | None] = {}
        for name, pts in self.curves.items():
            ok = [v for v, r in pts if _fits(r, self.capacity, self.card)]
            out[name] = max(ok) if ok else None
        return out

    @property
    def runs(self) -> int:
        """How many of the points are runs (the others are interpolated)."""
        return sum(not r.interpolated for pts in self.curves.values() for _, r in pts)

    @property
    def interpolated(self) -> int:
        """How many points were read off a line between runs (see :class:`Interpolated`)."""
        return sum(r.interpolated for pts in self.curves.values() for _, r in pts)

    def __str__(self) -> str:
        best = self.largest_fitting()
        where = (f"fits {self.capacity_name or 'the GPU'} ({format_bytes(self.capacity)})"
                 if self.capacity is not None else "runs")
        parts = [f"{name}: {self.knob} {v if v is not None else 'none'}" for name, v in best.items()]
        how = f"{self.runs} runs"
        if self.interpolated:
            how += f" + {self.interpolated} interpolated between runs, each line checked by a run"
        return (f"sweep of {self.knob} {self.values[0]}..{self.values[-1]} "
                f"({len(self.values)} values x {len(self.curves)} strategies: {how}, "
                f"{self.wall_s:.1f} s); largest that {where}: " + "; ".join(parts))

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(f"<Sweep : {self}>")

    def figure(self):
        """A ``matplotlib.figure.Figure`` of peak against the knob, one line per strategy."""
        from ..charts.plots import plot_sweep

        curves = {name: [(v, r if r.error is None else None) for v, r in pts]
                  for name, pts in self.curves.items()}
        ax = plot_sweep(curves, capacity=self.capacity, capacity_name=self.capacity_name,
                        knob=self.knob, card=self.card)
        return ax.figure

    def chart(self):
        """The sweep as a displayable chart with a one-line text repr."""
        from ..charts.plots import Chart

        return Chart(self.figure(), f"<memmagic chart: sweep of {self.knob} "
                                    f"{self.values[0]}..{self.values[-1]}, "
                                    f"{len(self.curves)} strategies>")


def sweep(cell: "Cell", knob: str = _BATCH, values: Sequence[int] | str = "1:512",
          strategies: Mapping[str, Setting] | None = None, *,
          setting: Setting | Mapping[str, Any] | None = None,
          capacity: int | None = None, stop_after_failure: bool = True,
          exact: bool = False) -> Sweep:
    """Run ``knob`` across ``values`` for each strategy (default: :func:`default_strategies`)
    on top of ``setting``. ``capacity`` (bytes) defaults to the target GPU of the runs.
    With ``stop_after_failure`` a strategy stops at its first run that fails or runs out
    of memory (larger values would too): its curve has no points beyond it.

    Unless ``exact``, the ends run, then halves: where the run in the middle of a stretch
    shows the simulated runs at its ends to be straight lines in the knob (see
    :class:`Interpolated`), the values between are replayed, not run: ``Interpolated``
    points, marked so in the text and the chart. The values on either side of the
    largest that fits are always runs; runs without the simulated allocator's log (the
    CPU and CUDA backends) are all run."""
    vals = parse_values(values, knob) if isinstance(values, str) else tuple(sorted(set(values)))
    if knob not in KNOBS or KNOBS[knob].kind != "int":
        raise ValueError(f"a sweep runs an integer knob, not {knob!r}")
    base = cell.setting(setting)
    strats = dict(strategies) if strategies is not None else default_strategies(
        cell, cell.applicable(setting=base.replace(**{knob: vals[0]})))
    t0 = time.perf_counter()
    curves: dict[str, tuple[tuple[int, Point], ...]] = {}
    cap, cap_name = capacity, None
    for name, strat in strats.items():
        s0 = base.replace(**strat.changed())
        points = [v for v in vals if _splits(s0, knob, v)]
        curve = _Curve(lambda v, s0=s0: cell.run(s0.replace(**{knob: v}), strict=True),
                       points, stop_after_failure, exact, knob == resizing(SEQ_DIM).name)
        for r in curve.reports.values():
            cap = r.gpu_memory if cap is None else cap
            cap_name = r.gpu_name if cap_name is None else cap_name
        curves[name] = curve.settle(cap, capacity is None)
    return Sweep(knob, vals, curves, cap, cap_name, time.perf_counter() - t0, strats,
                 card=capacity is None)


def _splits(setting: Setting, knob: str, value: int) -> bool:
    """Whether ``knob=value`` is a setting (a batch that accumulation steps can split)."""
    try:
        setting.replace(**{knob: value}).check_batch()
    except KnobError:
        return False
    return True


class _Curve:
    """One strategy's points: the ends run, then halves until the run in the middle of a
    stretch checks the lines through its ends (the values between are replayed, see
    :class:`Interpolated`); a failed end is bisected for the first value that fails."""

    def __init__(self, run: Callable[[int], MemoryReport], values: Sequence[int],
                 stop_after_failure: bool, exact: bool, curves: bool = False) -> None:
        # curves: the knob is the context, whose sizes may be parabolas (attention scores)
        self._run, self.values, self.curves = run, list(values), curves
        self.reports: dict[int, MemoryReport] = {}
        self.points_between: dict[int, Interpolated] = {}
        self.last = len(self.values) - 1  # the last index with a point
        if exact or len(self.values) < 4:
            self._run_in_order(0, stop_after_failure)
            return
        if not _ran(self.get(0)):
            self.last = 0 if stop_after_failure else self._run_in_order(1, False)
            return
        if not _ran(self.get(self.last)):
            if not stop_after_failure:
                self._run_in_order(1, False)
                return
            lo, hi = 0, self.last
            while hi - lo > 1:  # the first failure: larger values fail too
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if _ran(self.get(mid)) else (lo, mid)
            self.last = hi
            self._fill(0, lo)
            return
        self._fill(0, self.last)

    def get(self, i: int) -> MemoryReport:
        v = self.values[i]
        if v not in self.reports:
            self.reports[v] = self._run(v)
        return self.reports[v]

    def _run_in_order(self, start: int, stop: bool) -> int:
        for i in range(start, len(self.values)):
            if not _ran(self.get(i)) and stop:
                self.last = i
                break
        return self.last

    def _fill(self, i: int, j: int) -> None:
        """Points for the values between indices ``i`` and ``j`` (both run and fine)."""
        if j - i < 2:
            return
        if not (_ran(self.get(i)) and _ran(self.get(j))):  # no line through a failed run
            for k in range(i + 1, j):
                self.get(k)
            return
        m = (i + j) // 2
        points = self._between(i, m, j) if _ran(self.get(m)) else None
        if points is None and m - i >= 2 and _ran(self.get(m)) and _ran(self.get(i + 1)):
            # the smallest value alone often differs (a batch of one takes other paths)
            points = self._between(i + 1, m, j)
        if points is None:
            self._fill(i, m)
            self._fill(m, j)
            return
        self.points_between.update(points)

    def _between(self, i: int, m: int, j: int) -> dict[int, Interpolated] | None:
        """The values between ``i`` and ``j`` read off the runs at ``i`` and ``j``, when the
        run at ``m`` checks the way (None: it does not, or a value cannot be replayed)."""
        (a, b, c), (ra, rb, rc) = ((self.values[k] for k in (i, m, j)),
                                   (self.get(k) for k in (i, m, j)))
        line, check, through = _line(a, ra, c, rc), m, None
        if not (line.ok and line.checked_by(b, 1, rb)):
            found = self._parabola(i, m, j)
            if found is None:
                return None
            line, check, through = found, (i + m) // 2, b
        out: dict[int, Interpolated] = {}
        for k in range(i + 1, j):
            if k in (m, check):
                continue
            v = self.values[k]
            peaks = peaks_at(line, *point(v, line.basis))
            if peaks is None:
                return None
            out[v] = Interpolated(v, *peaks, (a, ra), (c, rc), self.values[check], through)
        return out

    def _parabola(self, i: int, m: int, j: int) -> "SizePlane | None":
        """The context's sizes on parabolas through the runs at ``i``, ``m`` and ``j``,
        checked by a run halfway between ``i`` and ``m`` (None: not the context, no value
        there, or it does not check them)."""
        q = (i + m) // 2
        if not self.curves or q in (i, m) or not _ran(self.get(q)):
            return None
        runs = {self.values[k]: self.get(k) for k in (i, m, j)}
        curve = line_through(runs, CONTEXT_CURVE)
        ok = curve.ok and curve.checked_by(*point(self.values[q], CONTEXT_CURVE), self.get(q))
        return curve if ok else None

    def points(self) -> list[tuple[int, Point]]:
        return [(v, self.reports[v] if v in self.reports else self.points_between[v])
                for v in self.values[: self.last + 1]]

    def settle(self, limit: int | None, card: bool) -> tuple[tuple[int, Point], ...]:
        """The points, with every value next to a change of verdict (fits ``limit`` / does
        not) run rather than interpolated: the largest that fits comes from a run."""
        while True:
            pts = self.points()
            if limit is None:
                return tuple(pts)
            fit = [_fits(r, limit, card) for _, r in pts]
            edges = {k for k in range(1, len(pts)) if fit[k] != fit[k - 1]} | \
                    {k - 1 for k in range(1, len(pts)) if fit[k] != fit[k - 1]}
            todo = [k for k in sorted(edges) if pts[k][1].interpolated]
            if not todo:
                return tuple(pts)
            for k in todo:
                self.points_between.pop(pts[k][0])
                self.get(k)


def run_sweep_option(cell: "Cell", option: str) -> Sweep:
    """The sweep of ``--sweep KNOB=VALUES`` (``batch_size=1:512``, ``batch_size=8,16,32``)."""
    knob, _, values = option.partition("=")
    if not values:
        raise ValueError("--sweep takes KNOB=LO:HI, e.g. --sweep batch_size=1:512")
    return sweep(cell, knob.strip(), parse_values(values, knob.strip()))


# -- the batch-size and context finders ------------------------------------------------------


@dataclass(frozen=True)
class BatchSearch:
    """The largest batch size (or sequence length: ``knob``) that fits ``limit`` =
    ``budget`` x (1 - ``margin``) bytes.

    ``trials`` holds (size, bytes needed or None when the run failed, fits) in the order
    they ran; ``method`` is "simulation" (runs on the simulated GPU) or "trials" (real runs
    on the GPU, each out-of-memory error caught and cleaned up after)."""

    batch_size: int | None
    budget: int
    margin: float
    trials: tuple[tuple[int, int | None, bool], ...]
    method: str
    device: str = ""
    report: MemoryReport | None = field(default=None, repr=False)
    knob: str = _BATCH
    card: bool = False  # budget is the card's size: the CUDA context counts in each run
    # the size the line through two runs (the context: the parabola through three) named,
    # then run
    guessed: int | None = None

    @property
    def value(self) -> int | None:
        """The size found (the batch size, or the sequence length for ``find_seq_len``)."""
        return self.batch_size

    @property
    def seq_len(self) -> int | None:
        return self.batch_size if self.knob == resizing(SEQ_DIM).name else None

    @property
    def limit(self) -> int:
        return int(self.budget * (1 - self.margin))

    @property
    def how(self) -> str:
        """How the size was found, in words."""
        ups = []
        for b, _n, fits in self.trials:
            ups.append(f"{b} {'fits' if fits else 'does not'}")
        where = "on the simulated GPU" if self.method == "simulation" else "by real runs on the GPU"
        knob = KNOBS[self.knob]
        noun = knob.sizes.noun if knob.sizes is not None else knob.label
        verdict = (f"{self.value} is the largest {noun}" if self.value is not None
                   else f"no {knob.label} tried")
        context = " with the CUDA context" if self.card and self.report and self.report.context else ""
        return (f"{verdict} whose {'reserved ' if self.method == 'simulation' else ''}peak{context} stays "
                f"under {format_bytes(self.limit)} ({1 - self.margin:.0%} of "
                f"{format_bytes(self.budget)}); {len(self.trials)} runs {where} "
                f"({self.device}), {self._search}: " + ", ".join(ups))

    @property
    def _search(self) -> str:
        if self.guessed is None:
            return "doubling then bisecting"
        seq = self.knob == resizing(SEQ_DIM).name
        named = (f"doubling until {'three' if seq else 'two'} runs made the same allocations, "
                 f"whose sizes on a {'parabola' if seq else 'line'} through theirs named "
                 f"{self.guessed}")
        if self.guessed == self.value:
            return f"{named}, then running it and the size after it"
        return f"{named}, which the runs did not bear out, then searching on from them"

    def __str__(self) -> str:
        return self.how

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(f"<BatchSearch : {self.knob}={self.value}; {self.how}>")


def find_batch_size(cell: "Cell", *, budget: int | str | None = None, margin: float = 0.1,
                    setting: Setting | Mapping[str, Any] | None = None, low: int = 1,
                    high: int = 1 << 16, method: str = "simulation",
                    gpu: Any = None) -> BatchSearch:
    """The largest batch size (a multiple of the setting's accumulation steps) whose run
    needs at most ``budget * (1 - margin)`` bytes (the reserved peak on the simulated GPU,
    with the CUDA context where the card counts one: ``MemoryReport.card_need``).

    ``gpu``: the card to fit ("T4"; as ``fit_map(cell, gpu=...)`` takes it), else the
    cell's or the setting's. ``budget`` defaults to the target card's memory (on a
    real GPU, ``torch.cuda.get_device_properties().total_memory``). ``method``:
    "simulation" runs the cell on the simulated GPU (the cell's backend must be "sim");
    "trials" runs it for real on a CUDA GPU, catching each out-of-memory error and
    emptying the allocator's cache after every run. Doubles from ``low`` until a run does
    not fit (or ``high``), then bisects."""
    return _find_largest(cell, resizing(BATCH_DIM).name, budget, margin,
                         _on_gpu(cell, setting, gpu), low, high, method)


def find_seq_len(cell: "Cell", *, budget: int | str | None = None, margin: float = 0.1,
                 setting: Setting | Mapping[str, Any] | None = None, low: int = 16,
                 high: int = 1 << 17, step: int = 16, method: str = "simulation",
                 gpu: Any = None) -> BatchSearch:
    """The longest context: the largest sequence length (a multiple of ``step``) whose run
    needs at most ``budget * (1 - margin)`` bytes, at the setting's batch size. The cell
    reads ``seq_len``, or memmagic cuts or repeats the token tensors it names (see
    :func:`find_batch_size` for ``gpu``, ``budget``, ``margin`` and ``method``)."""
    return _find_largest(cell, resizing(SEQ_DIM).name, budget, margin,
                         _on_gpu(cell, setting, gpu), low, high, method, step)


def _on_gpu(cell: "Cell", setting: Setting | Mapping[str, Any] | None, gpu: Any
            ) -> Setting | Mapping[str, Any] | None:
    """``setting`` on the card ``gpu`` (its target card knob; ``setting`` as it is where
    ``gpu`` is None)."""
    if gpu is None:
        return setting
    return cell.setting(setting).replace(**{targeting().name: gpu})


def _find_largest(cell: "Cell", knob: str, budget: int | str | None, margin: float,
                  setting: Setting | Mapping[str, Any] | None, low: int, high: int,
                  method: str, step: int | None = None) -> BatchSearch:
    from ..report import parse_bytes

    check_search(cell, method, margin)
    base = cell.setting(setting)
    if step is None:
        step = base.micro_steps
    if isinstance(budget, str):
        budget = parse_bytes(budget)
    trials: list[tuple[int, int | None, bool]] = []
    reports: dict[int, MemoryReport] = {}
    card = budget is None  # the card's own size: what a run needs of the whole card

    def trial(b: int) -> bool:
        r = cell.run(base.replace(**{knob: b}), strict=True)
        nonlocal budget
        if budget is None:
            budget = r.gpu_memory if r.gpu_memory is not None else _cuda_total(method)
            if budget is None:
                raise ValueError(f"find_{knob} needs a budget: pass budget= (bytes or '10GiB') "
                                 "or give the cell a target GPU (gpu='T4')")
        ok = _fits(r, int(budget * (1 - margin)), card)
        trials.append((b, None if r.error else r.need_of(card), ok))
        reports[b] = r
        if method == "trials":
            _clean_cuda()
        return ok

    guessed: list[int] = []

    def guess(a: int, c: int) -> int | None:  # the boundary the line through runs gives
        if method != "simulation":
            return None
        if knob == resizing(SEQ_DIM).name:
            # the context: the parabola through the last three that fit (attention scores
            # and causal masks grow as its square, which two tiny contexts hide)
            xs = [b for b, _n, ok in trials if ok and b <= c][-3:]
            if len(xs) < 3:
                return None
            line = line_through({x: reports[x] for x in xs}, CONTEXT_CURVE)
        else:
            line = _line(a, reports[a], c, reports[c])
        g = _line_boundary(line, reports[a], int(budget * (1 - margin)), card, c, high, step)
        guessed[:] = [] if g is None or g <= c else [g]
        return g

    lo_ok = _largest(trial, low, high, step, guess)
    assert budget is not None
    device = next(iter(reports.values())).device if reports else ""
    return BatchSearch(lo_ok, int(budget), margin, tuple(trials), method, device,
                       reports.get(lo_ok) if lo_ok is not None else None, knob, card,
                       guessed[0] if guessed else None)


def check_search(cell: "Cell", method: str, margin: float) -> None:
    """ValueError in one line for a search the cell cannot take (``method``: "simulation"
    on the sim backend, "trials" on a GPU; ``margin``: a fraction)."""
    if method not in ("simulation", "trials"):
        raise ValueError(f"method must be 'simulation' or 'trials', not {method!r}")
    if not 0 <= margin < 1:
        raise ValueError(f"margin is a fraction of the budget in [0, 1), not {margin!r}")
    if method == "simulation" and cell.backend_name != "sim":
        raise ValueError("method='simulation' needs a Cell with backend='sim'; "
                         "use method='trials' for real runs on a GPU")
    if method == "trials" and cell.backend_name not in ("cuda", "auto"):
        raise ValueError("method='trials' runs the cell for real on a GPU: make the Cell with "
                         "backend='cuda'")


def _line_boundary(line: "SizePlane", base: MemoryReport, limit: int, card: bool, start: int,
                   high: int, step: int) -> int | None:
    """The largest multiple of ``step`` in [start, high] that fits ``limit`` by the line
    (:func:`_line`; :func:`memmagic.whatif.plane.largest_within`): the run's CUDA context
    counts where ``card`` (what a run needs of the whole card)."""
    return largest_within(line, limit, (base.context or 0) if card else 0, start, high, step)


def _largest(fits: Callable[[int], bool], low: int, high: int, step: int,
             guess: Callable[[int, int], int | None] | None = None) -> int | None:
    """The largest multiple of ``step`` in [low, high] for which ``fits`` holds, doubling
    from ``low`` until it does not, then bisecting (None: not even the first fits).
    ``guess(a, c)``, after each two sizes that fit, may name the largest that fits (what
    the simulated runs at ``a`` and ``c`` say by a line): the first it names and the size
    after it are run; where they bear it out the search ends there, else they bound it."""
    lo_ok: int | None = None
    b = max(step, (low + step - 1) // step * step)
    hi_bad: int | None = None
    while b <= high:
        if not fits(b):
            hi_bad = b
            break
        prev, lo_ok = lo_ok, b
        g = guess(prev, b) if guess is not None and prev is not None else None
        if g is not None and g > b:
            guess = None  # one guess: where it misses, the runs it took bound the rest
            if not fits(g):
                hi_bad = g
                break
            lo_ok = g
            if g + step > high or not fits(g + step):
                return g
            lo_ok = b = g + step
        b *= 2
    if lo_ok is not None and hi_bad is not None:
        lo_ok = bisect_largest(fits, lo_ok, hi_bad, step)
    return lo_ok


def _cuda_total(method: str) -> int | None:
    if method != "trials":
        return None
    import torch

    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def _clean_cuda() -> None:
    """After a real trial: free what the run left (an OOM's frames are already cleared)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
