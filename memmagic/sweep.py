"""Sweeps and the batch-size finder, on top of the what-if engine (:class:`~memmagic.cell.Cell`).

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
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from .knobs import KNOBS, KnobError, Setting
from .report import MemoryReport, format_bytes

if TYPE_CHECKING:
    from .cell import Cell

__all__ = ["Sweep", "sweep", "default_strategies", "parse_values", "BatchSearch",
           "find_batch_size", "find_seq_len", "run_sweep_option"]


def _fits(report: MemoryReport, limit: int | None, card: bool) -> bool:
    """Whether the run fits ``limit`` bytes: the card's size (``card``: what it needs of the
    whole card, the CUDA context with it) or a budget given for PyTorch's allocator."""
    if report.error is not None or report.failed_request is not None:
        return False
    return limit is None or report.need_of(card) <= limit


def parse_values(text: str, knob: str = "batch_size") -> tuple[int, ...]:
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


@dataclass(frozen=True)
class Sweep:
    """Reports of a knob run across ``values`` for each strategy. ``curves[strategy]`` is
    (value, report) per value; ``capacity`` (bytes) the card's memory where known."""

    knob: str
    values: tuple[int, ...]
    curves: Mapping[str, tuple[tuple[int, MemoryReport], ...]]
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

    def __str__(self) -> str:
        best = self.largest_fitting()
        where = (f"fits {self.capacity_name or 'the GPU'} ({format_bytes(self.capacity)})"
                 if self.capacity is not None else "runs")
        parts = [f"{name}: {self.knob} {v if v is not None else 'none'}" for name, v in best.items()]
        return (f"sweep of {self.knob} {self.values[0]}..{self.values[-1]} "
                f"({len(self.values)} values x {len(self.curves)} strategies, "
                f"{self.wall_s:.1f} s); largest that {where}: " + "; ".join(parts))

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(f"<Sweep : {self}>")

    def figure(self):
        """A ``matplotlib.figure.Figure`` of peak against the knob, one line per strategy."""
        from .plots import plot_sweep

        curves = {name: [(v, r if r.error is None else None) for v, r in pts]
                  for name, pts in self.curves.items()}
        ax = plot_sweep(curves, capacity=self.capacity, capacity_name=self.capacity_name,
                        knob=self.knob, card=self.card)
        return ax.figure

    def chart(self):
        """The sweep as a displayable chart with a one-line text repr."""
        from .plots import Chart

        return Chart(self.figure(), f"<memmagic chart: sweep of {self.knob} "
                                    f"{self.values[0]}..{self.values[-1]}, "
                                    f"{len(self.curves)} strategies>")


def sweep(cell: "Cell", knob: str = "batch_size", values: Sequence[int] | str = "1:512",
          strategies: Mapping[str, Setting] | None = None, *,
          setting: Setting | Mapping[str, Any] | None = None,
          capacity: int | None = None, stop_after_failure: bool = True) -> Sweep:
    """Run ``knob`` across ``values`` for each strategy (default: :func:`default_strategies`)
    on top of ``setting``. ``capacity`` (bytes) defaults to the target GPU of the runs.
    With ``stop_after_failure`` a strategy stops at its first run that fails or runs out
    of memory (larger values would too): its curve has no points beyond it."""
    vals = parse_values(values, knob) if isinstance(values, str) else tuple(sorted(set(values)))
    if knob not in KNOBS or KNOBS[knob].kind != "int":
        raise ValueError(f"a sweep runs an integer knob, not {knob!r}")
    base = cell.setting(setting)
    strats = dict(strategies) if strategies is not None else default_strategies(
        cell, cell.applicable(setting=base.replace(**{knob: vals[0]})))
    t0 = time.perf_counter()
    curves: dict[str, tuple[tuple[int, MemoryReport], ...]] = {}
    cap, cap_name = capacity, None
    for name, strat in strats.items():
        pts: list[tuple[int, MemoryReport]] = []
        s0 = base.replace(**strat.changed())
        for v in vals:
            try:
                s = s0.replace(**{knob: v})
                s.check_batch()
            except KnobError:
                continue  # a batch accumulation cannot split: not a point of this curve
            r = cell.run(s, strict=True)
            pts.append((v, r))
            if cap is None and r.gpu_memory is not None:
                cap = r.gpu_memory
            if cap_name is None and r.gpu_name is not None:
                cap_name = r.gpu_name
            if stop_after_failure and (r.error is not None or r.failed_request is not None):
                break
        curves[name] = tuple(pts)
    return Sweep(knob, vals, curves, cap, cap_name, time.perf_counter() - t0, strats,
                 card=capacity is None)


def run_sweep_option(cell: "Cell", option: str) -> Sweep:
    """The sweep of ``--sweep KNOB=VALUES`` (``batch_size=1:512``, ``batch_size=8,16,32``)."""
    knob, _, values = option.partition("=")
    if not values:
        raise ValueError("--sweep takes KNOB=LO:HI, e.g. --sweep batch_size=1:512")
    return sweep(cell, knob.strip(), parse_values(values, knob.strip()))


# -- the batch-size and context finders ------------------------------------------------------
_WORDS = {"batch_size": ("batch", "batch size"), "seq_len": ("sequence length", "sequence length")}


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
    knob: str = "batch_size"
    card: bool = False  # budget is the card's size: the CUDA context counts in each run

    @property
    def value(self) -> int | None:
        """The size found (the batch size, or the sequence length for ``find_seq_len``)."""
        return self.batch_size

    @property
    def seq_len(self) -> int | None:
        return self.batch_size if self.knob == "seq_len" else None

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
        one, what = _WORDS[self.knob]
        verdict = (f"{self.value} is the largest {one}" if self.value is not None
                   else f"no {what} tried")
        context = " with the CUDA context" if self.card and self.report and self.report.context else ""
        return (f"{verdict} whose {'reserved ' if self.method == 'simulation' else ''}peak{context} stays "
                f"under {format_bytes(self.limit)} ({1 - self.margin:.0%} of "
                f"{format_bytes(self.budget)}); {len(self.trials)} runs {where} "
                f"({self.device}), doubling then bisecting: " + ", ".join(ups))

    def __str__(self) -> str:
        return self.how

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(f"<BatchSearch : {self.knob}={self.value}; {self.how}>")


def find_batch_size(cell: "Cell", *, budget: int | str | None = None, margin: float = 0.1,
                    setting: Setting | Mapping[str, Any] | None = None, low: int = 1,
                    high: int = 1 << 16, method: str = "simulation") -> BatchSearch:
    """The largest batch size (a multiple of the setting's accumulation steps) whose run
    needs at most ``budget * (1 - margin)`` bytes (the reserved peak on the simulated GPU,
    with the CUDA context where the card counts one: ``MemoryReport.card_need``).

    ``budget`` defaults to the target card's memory (``gpu=`` of the cell or setting; on a
    real GPU, ``torch.cuda.get_device_properties().total_memory``). ``method``:
    "simulation" runs the cell on the simulated GPU (the cell's backend must be "sim");
    "trials" runs it for real on a CUDA GPU, catching each out-of-memory error and
    emptying the allocator's cache after every run. Doubles from ``low`` until a run does
    not fit (or ``high``), then bisects."""
    return _find_largest(cell, "batch_size", budget, margin, setting, low, high, method)


def find_seq_len(cell: "Cell", *, budget: int | str | None = None, margin: float = 0.1,
                 setting: Setting | Mapping[str, Any] | None = None, low: int = 16,
                 high: int = 1 << 17, step: int = 16, method: str = "simulation") -> BatchSearch:
    """The longest context: the largest sequence length (a multiple of ``step``) whose run
    needs at most ``budget * (1 - margin)`` bytes, at the setting's batch size. The cell
    reads ``seq_len``, or memmagic cuts or repeats the token tensors it names (see
    :func:`find_batch_size` for ``budget``, ``margin`` and ``method``)."""
    return _find_largest(cell, "seq_len", budget, margin, setting, low, high, method, step)


def _find_largest(cell: "Cell", knob: str, budget: int | str | None, margin: float,
                  setting: Setting | Mapping[str, Any] | None, low: int, high: int,
                  method: str, step: int | None = None) -> BatchSearch:
    from .report import parse_bytes

    _check_search(cell, method, margin)
    base = cell.setting(setting)
    if step is None:
        step = base.accum_steps
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
                raise ValueError(f"find_{'batch_size' if knob == 'batch_size' else 'seq_len'} "
                                 "needs a budget: pass budget= (bytes or '10GiB') or give the "
                                 "cell a target GPU (gpu='T4')")
        ok = _fits(r, int(budget * (1 - margin)), card)
        trials.append((b, None if r.error else r.need_of(card), ok))
        reports[b] = r
        if method == "trials":
            _clean_cuda()
        return ok

    lo_ok = _largest(trial, low, high, step)
    assert budget is not None
    device = next(iter(reports.values())).device if reports else ""
    return BatchSearch(lo_ok, int(budget), margin, tuple(trials), method, device,
                       reports.get(lo_ok) if lo_ok is not None else None, knob, card)


def _check_search(cell: "Cell", method: str, margin: float) -> None:
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


def _largest(fits: Callable[[int], bool], low: int, high: int, step: int) -> int | None:
    """The largest multiple of ``step`` in [low, high] for which ``fits`` holds, doubling
    from ``low`` until it does not, then bisecting (None: not even the first fits)."""
    lo_ok: int | None = None
    b = max(step, (low + step - 1) // step * step)
    hi_bad: int | None = None
    while b <= high:
        if fits(b):
            lo_ok = b
            b *= 2
        else:
            hi_bad = b
            break
    if lo_ok is not None and hi_bad is not None:
        lo, hi = lo_ok, hi_bad
        while hi - lo > step:
            mid = (lo + hi) // 2 // step * step
            if mid <= lo:
                break
            if fits(mid):
                lo = mid
            else:
                hi = mid
        lo_ok = lo
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
