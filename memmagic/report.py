"""Result objects and byte formatting. Importing this module needs no torch.

All sizes are ``int`` bytes. Formatting happens here and only here.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

# Category lives with the trace (what the tracker records); the report re-exports it
from .trace import Category, ModuleRow, Trace, module_rows_at

__all__ = ["Category", "MemoryReport", "Footer", "JobRanks", "RankRow", "format_bytes",
           "parse_bytes", "needed", "Note", "notes_of"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: int | None, *, signed: bool = False) -> str:
    """Format a byte count with binary units: ``format_bytes(3 * 2**20) == '3.00 MiB'``.

    ``signed=True`` prefixes ``+`` for positive numbers (for deltas). ``None`` is ``'n/a'``.
    """
    if n is None:
        return "n/a"
    sign = "-" if n < 0 else ("+" if signed and n > 0 else "")
    value = float(abs(n))
    for unit in _UNITS:
        if value < 1024 or unit == _UNITS[-1]:
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


_PARSE_UNITS = {
    "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
    "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """Parse ``'10GiB'``, ``'512 MiB'``, ``'16GB'`` (decimal) or ``'1024'`` into bytes."""
    s = str(text).strip().lower().replace(" ", "").replace("_", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):] or "b"
    if unit not in _PARSE_UNITS or not num:
        raise ValueError(
            f"cannot read {text!r} as a size; write it like '10GiB', '512MiB' or '16GB'"
        )
    try:
        value = float(num)
    except ValueError:
        raise ValueError(
            f"cannot read {text!r} as a size; write it like '10GiB', '512MiB' or '16GB'"
        ) from None
    if value < 0:
        raise ValueError(f"a size cannot be negative: {text!r}")
    return int(value * _PARSE_UNITS[unit])


class Note(str):
    """One note on a report: its text (the note is that string) and its ``kind``, what it is
    about, for code that selects notes (never by their wording). Kinds in use: "general",
    "card" (the simulated card's size, as the backend or the options name it), "setting"
    (the what-if setting of a run), "knob" (how memmagic applied a knob), "handled" (knobs
    the cell handles itself), "backend" (which backend ran and why)."""

    kind: str

    def __new__(cls, text: str, kind: str = "general") -> "Note":
        note = super().__new__(cls, text)
        note.kind = getattr(text, "kind", kind) if kind == "general" else kind
        return note

    def __reduce__(self):
        return (Note, (str(self), self.kind))


def notes_of(notes: Any) -> tuple[Note, ...]:
    """``notes`` (strings or :class:`Note`) as a tuple of Notes; plain strings are general."""
    return tuple(n if isinstance(n, Note) else Note(n) for n in notes)


def needed(peak: int | None, reserved_peak: int | None) -> int | None:
    """What a run needs of a card, the one rule: the allocator's reserved peak where it is
    known (what the card must hold), else the peak of live tensors. Bytes."""
    return reserved_peak if reserved_peak is not None else peak


# One colour per category, shared by the HTML table and the matplotlib chart.
COLORS = {
    Category.PARAMETERS.value: "#4c78a8",
    Category.BUFFERS.value: "#9ecae9",
    Category.GRADIENTS.value: "#f58518",
    Category.OPTIMIZER_STATE.value: "#e45756",
    Category.ACTIVATIONS.value: "#54a24b",
    Category.KV_CACHE.value: "#72b7b2",
    Category.WORKSPACES.value: "#b279a2",
    Category.OTHER.value: "#bab0ac",
}

# categories a breakdown lists only when they hold bytes
_SHOWN_WHEN_HELD = (Category.WORKSPACES.value, Category.KV_CACHE.value)

BACKENDS = ("cuda", "cpu", "sim")

_SOURCE = {
    "cuda": "CUDA caching allocator",
    "cpu": "live tensor storage, tracked op by op on the CPU",
    "sim": "simulated CUDA run on fake tensors",
}


def _op_name(op: str | None) -> str | None:
    """``aten._foreach_sqrt.default`` / ``div.Tensor`` -> ``_foreach_sqrt`` / ``div``."""
    if not op:
        return None
    name = op[len("aten."):] if op.startswith("aten.") else op
    return name.split(".", 1)[0]


def _frozen_breakdown(values: Mapping[str, int] | None) -> Mapping[str, int]:
    out = {c.value: 0 for c in Category}
    for key, value in (values or {}).items():
        key = Category(key).value
        out[key] = int(value)
    return MappingProxyType(out)


# how a rank ended, in the order that decides a job: ran, ran out of memory, failed
_RAN, _OUT_OF_MEMORY, _FAILED = 0, 1, 2


@dataclass(frozen=True)
class RankRow:
    """One rank of a job run rank by rank: how it ended and what it needed. Bytes."""

    rank: int
    peak: int
    reserved_peak: int | None
    fits: bool | None
    failed_request: int | None = None
    live_at_failure: int | None = None
    error: str | None = None
    # the most activations (tensors saved for backward) live at once in the run: a pipeline
    # stage's micro-batches in flight; None where the run kept no trace
    activations_held: int | None = None
    need: int = 0  # what the rank needs of its card (MemoryReport.card_need)

    @classmethod
    def of(cls, rank: int, report: "MemoryReport") -> "RankRow":
        held = (report.trace.most(Category.ACTIVATIONS.value)
                if report.trace is not None else None)
        return cls(rank, report.peak, report.reserved_peak, report.fits, report.failed_request,
                   report.live_at_failure, report.error, held, report.card_need)

    @property
    def demand(self) -> tuple[int, int]:
        """How much the rank asks of the job, in the order that decides it: one that failed
        first (the job fails with it), then one that ran out of memory (the live bytes and
        the request that failed), then what it needs of its card."""
        if self.failed_request is not None:
            return _OUT_OF_MEMORY, (self.live_at_failure or self.peak) + self.failed_request
        if self.error is not None:
            return _FAILED, self.need
        return _RAN, self.need

    @property
    def line(self) -> str:
        """The rank's outcome in words."""
        if self.failed_request is not None:
            return (f"out of memory asking for {format_bytes(self.failed_request)} with "
                    f"{format_bytes(self.live_at_failure or self.peak)} live")
        if self.error is not None:
            return f"failed: {self.error}"[:120]
        verdict = {True: ": fits", False: ": does not fit", None: ""}[self.fits]
        reserved = (f", reserved {format_bytes(self.reserved_peak)}"
                    if self.reserved_peak is not None else "")
        return f"peak {format_bytes(self.peak)}{reserved}{verdict}"

    def to_dict(self) -> dict[str, Any]:
        return {"peak": self.peak, "reserved_peak": self.reserved_peak, "fits": self.fits,
                "failed_request": self.failed_request, "error": self.error,
                "activations_held": self.activations_held}


@dataclass(frozen=True)
class JobRanks:
    """The ranks of a job, each run (``--ranks``): their rows and the rank whose report
    this is, the one that decides whether the job fits (memmagic.jobs)."""

    world_size: int
    rows: tuple[RankRow, ...]
    shown: int  # the rank whose report this is

    @property
    def deciding(self) -> int:
        """The rank that decides whether the job fits: one that failed, else one that ran
        out of memory, else the one that needs the most of its card."""
        return max(self.rows, key=lambda r: r.demand).rank

    @property
    def heading(self) -> str:
        deciding = self.deciding
        row = next(r for r in self.rows if r.rank == deciding)
        why = "failed" if row.demand[0] == _FAILED else "needs the most"
        if deciding == self.shown:
            return (f"the {self.world_size} ranks of the job, each run; this report is rank "
                    f"{deciding}'s, the rank that {why}:")
        return (f"the {self.world_size} ranks of the job, each run; the rank that {why} is "
                f"rank {deciding} (this report is rank {self.shown}'s):")

    def grouped(self) -> list[tuple[str, str]]:
        """(``rank 3`` or ``ranks 1-7``, line) for runs of consecutive ranks with one line."""
        out: list[tuple[str, str]] = []
        rows = sorted(self.rows, key=lambda r: r.rank)
        start = 0
        for i in range(1, len(rows) + 1):
            if (i == len(rows) or rows[i].line != rows[start].line
                    or rows[i].rank != rows[i - 1].rank + 1):
                a, b = rows[start].rank, rows[i - 1].rank
                out.append((f"rank {a}" if a == b else f"ranks {a}-{b}", rows[start].line))
                start = i
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "deciding_rank": self.deciding,
                "rank": self.shown, "ranks": {str(r.rank): r.to_dict() for r in self.rows}}


@dataclass(frozen=True)
class MemoryReport:
    """What one measured cell (or callable) did to memory. All sizes in bytes.

    ``before``, ``peak`` and ``after`` are bytes of live tensor memory on the measured
    device at the start, at the highest point, and at the end. On ``cuda`` they come from
    the caching allocator (``memory_allocated``), so they include the 512-byte rounding
    and any workspace torch allocates through it; they never include the CUDA context
    or memory of other processes. On ``cpu`` they are tensor storages tracked op by op:
    buffers a kernel allocates and frees internally are not seen. On ``sim`` they are
    what the simulated CUDA allocator would hold.

    ``breakdown`` maps each :class:`Category` value to bytes at the moment of the peak;
    for the tracker-based backends (``cpu``, ``sim``) it sums to ``peak``.
    """

    # a run's report (a sweep's value read off a line between runs is a sweep.Interpolated)
    interpolated: ClassVar[bool] = False

    backend: str
    device: str
    before: int
    peak: int
    after: int
    wall_s: float
    breakdown: Mapping[str, int] = field(default_factory=dict)
    reserved_peak: int | None = None
    reserved_after: int | None = None
    peak_op: str | None = None
    peak_module: str | None = None
    host_peak: int | None = None
    gpu_name: str | None = None
    gpu_memory: int | None = None
    # the CUDA context the verdict counts on the card beside the allocator's figures (a
    # published figure, named in a note; None where not counted)
    context: int | None = None
    error: str | None = None
    notes: tuple[str, ...] = ()
    # (op index, live device bytes) through the run, thinned; empty where not tracked
    timeline: tuple[tuple[int, int], ...] = field(default=(), repr=False, compare=False)
    # bytes per category at the start (tensors made before the cell); empty where unknown
    breakdown_before: Mapping[str, int] = field(default_factory=dict)
    # out of memory: the request that failed (never counted in peak or reserved, which
    # stay within the card) and the bytes live when it failed; None when none failed
    failed_request: int | None = None
    live_at_failure: int | None = None
    # forward / backward / recompute / optimizer / other (tracker-based runs)
    peak_phase: str | None = None
    # the autograd node at a backward peak ("softmax backward"), the optimizer at a step's
    # ("Adam, foreach")
    peak_label: str | None = None
    # per module (full dotted paths): activations saved by its ops live at the peak, the
    # most it held, parameters and gradients it owns; largest first (see modules_at)
    modules: tuple["ModuleRow", ...] = field(default=(), repr=False)
    # the full record of the run (tracker-based backends): storages, ops, events in order
    trace: "Trace | None" = field(default=None, repr=False, compare=False)
    # cuda with snapshot=True: the caching allocator's own snapshot of the cell (segments,
    # events with Python stacks), as torch.cuda.memory._snapshot() returns it
    cuda_snapshot: dict | None = field(default=None, repr=False, compare=False)
    # the memory doctor's advice on this cell (memmagic.doctor.Advice), when asked for
    # (--advise) or after a failed cell
    advice: Any = field(default=None, repr=False, compare=False)
    # what ran, in the report's words: "cell" (the magic, the API), "script" (the command line)
    unit: str = field(default="cell", repr=False, compare=False)
    # a job run rank by rank (--ranks): every rank's figures; this report is the deciding
    # rank's
    job: JobRanks | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {self.backend!r}")
        object.__setattr__(self, "breakdown", _frozen_breakdown(self.breakdown))
        object.__setattr__(self, "breakdown_before", _frozen_breakdown(self.breakdown_before))
        object.__setattr__(self, "notes", notes_of(self.notes))
        object.__setattr__(self, "timeline", tuple(tuple(p) for p in self.timeline))
        object.__setattr__(self, "modules", tuple(self.modules))

    def __getstate__(self) -> dict[str, Any]:
        # pickled (a re-run in a forked child sends its report back): the breakdowns as
        # plain dicts, frozen again on the way in
        state = dict(self.__dict__)
        state["breakdown"], state["breakdown_before"] = (dict(self.breakdown),
                                                         dict(self.breakdown_before))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for name in ("breakdown", "breakdown_before"):
            object.__setattr__(self, name, _frozen_breakdown(state[name]))

    # -- derived numbers ---------------------------------------------------------------
    @property
    def increment(self) -> int:
        """Peak above the starting point: what decides an out-of-memory."""
        return self.peak - self.before

    @property
    def retained(self) -> int:
        """Memory the cell left allocated (after - before); negative if it freed some."""
        return self.after - self.before

    @property
    def breakdown_increment(self) -> dict[str, int]:
        """Per category, the peak's bytes above those at the start: what the cell added."""
        return {k: v - self.breakdown_before[k] for k, v in self.breakdown.items()}

    @property
    def unattributed(self) -> int:
        """Peak bytes that no category explains (allocator rounding, workspaces)."""
        return self.peak - sum(self.breakdown.values())

    @property
    def fits(self) -> bool | None:
        """Whether the peak (reserved where known) fits the target GPU; None if no target.
        A cell that ran out of memory does not fit, whatever it reached before."""
        if self.gpu_memory is None:
            return None
        if self.failed_request is not None:
            return False
        return self.card_need <= self.gpu_memory

    @property
    def card_need(self) -> int:
        """What the run needs of the whole card, as ``nvidia-smi`` would show it: the
        allocator's figure (:attr:`need`) and the CUDA context where it is counted."""
        return self.need + (self.context or 0)

    def need_of(self, card: bool) -> int:
        """What the run needs of a limit: of the whole card (:attr:`card_need`) where the
        limit is the card's size, else the allocator's figure (:attr:`need`), where it is a
        budget for PyTorch's allocator."""
        return self.card_need if card else self.need

    @property
    def need(self) -> int:
        """What the run needs of a card: the reserved peak where known, else the peak."""
        return needed(self.peak, self.reserved_peak)

    @property
    def source(self) -> str:
        """Where the numbers come from, in words."""
        return _SOURCE[self.backend]

    def to_dict(self) -> dict[str, Any]:
        """Plain-data view (JSON-ready) including the derived numbers."""
        return {
            "backend": self.backend, "device": self.device, "before": self.before,
            "peak": self.peak, "after": self.after, "increment": self.increment,
            "retained": self.retained, "reserved_peak": self.reserved_peak,
            "reserved_after": self.reserved_after, "wall_s": self.wall_s,
            "breakdown": dict(self.breakdown), "breakdown_before": dict(self.breakdown_before),
            "peak_op": self.peak_op,
            "peak_module": self.peak_module, "host_peak": self.host_peak,
            "gpu_name": self.gpu_name, "gpu_memory": self.gpu_memory, "context": self.context,
            "error": self.error, "notes": [str(n) for n in self.notes],
            "failed_request": self.failed_request, "live_at_failure": self.live_at_failure,
            "peak_phase": self.peak_phase, "peak_label": self.peak_label,
            "peak_words": self.peak_words,
            "advice": self.advice.to_dict() if self.advice is not None else None,
            "modules": [dict(module=r.module, activations=r.activations,
                             activations_max=r.activations_max, share=r.share,
                             parameters=r.parameters, gradients=r.gradients)
                        for r in self.modules],
            **(self.job.to_dict() if self.job is not None else {}),
        }

    def modules_at(self, depth: int | None = 2) -> list["ModuleRow"]:
        """The per-module table summed to ``depth`` levels of the module tree (1: the root
        modules, 2: their children, None: every module on its own), largest activations
        first. The rows' activations sum to the activations category at the peak."""
        if depth is not None and depth < 1:
            raise ValueError(f"depth must be 1 or more (or None for every module), not {depth!r}")
        return module_rows_at(self.modules, depth, self.peak)

    # -- rendering ---------------------------------------------------------------------
    def __str__(self) -> str:
        parts = [
            f"peak {format_bytes(self.peak)} ({format_bytes(self.increment, signed=True)})",
            f"retained {format_bytes(self.retained, signed=True)}",
        ]
        if self.reserved_peak is not None:
            parts.append(f"reserved {format_bytes(self.reserved_peak)}")
        line = ", ".join(parts) + f" [{self.backend}: {self.device}]"
        if self.fits is not None:
            verdict = "fits" if self.fits else "DOES NOT FIT"
            line += f" {verdict} {self.gpu_name or 'GPU'} ({format_bytes(self.gpu_memory)})"
        if self.error:
            err = self.error if len(self.error) <= 90 else self.error[:89] + "…"
            line += f" ({self.unit} failed: {err})"
        return line

    def _rows(self) -> list[tuple[str, str]]:
        rows = [
            ("before", format_bytes(self.before)),
            ("peak", f"{format_bytes(self.peak)} ({format_bytes(self.increment, signed=True)})"),
            ("after", f"{format_bytes(self.after)} (retained {format_bytes(self.retained, signed=True)})"),
        ]
        if self.reserved_peak is not None:
            rows.append(("reserved peak", format_bytes(self.reserved_peak)))
        if self.host_peak is not None:
            rows.append(("host (CPU) peak", format_bytes(self.host_peak)))
        if self.gpu_memory is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            ctx = f" (with the CUDA context, {format_bytes(self.context)})" if self.context else ""
            rows.append(("target GPU", f"{self.gpu_name} {format_bytes(self.gpu_memory)}: {verdict}{ctx}"))
        if self.failed_request is not None:
            rows.append(("out of memory", f"a request of {format_bytes(self.failed_request)} failed "
                                          f"with {format_bytes(self.live_at_failure)} live"))
        words = self.peak_words
        if words:
            rows.append(("peak reached", words))
        return rows

    @property
    def peak_words(self) -> str | None:
        """Where the peak was, as a student reads it: "during loss.backward() in
        `model.blocks.3.attn` (softmax backward)", "during optimizer.step() (Adam,
        foreach: _foreach_sqrt)"; None if unknown. Internal op names only follow in
        parentheses."""
        op = _op_name(self.peak_op)
        module = self.peak_module
        phase = self.peak_phase
        label = self.peak_label
        if phase is None and module is None and op is None:
            return None
        if phase == "optimizer":
            text = "during optimizer.step()"
        elif phase == "backward":
            text = "during loss.backward()"
            if op and op.endswith("_backward"):
                op = op[: -len("_backward")].lstrip("_") + " backward"
        elif phase == "recompute":
            text = "while loss.backward() recomputed a checkpointed forward"
        elif phase == "forward":
            text = "during forward"
        else:
            text = "outside forward, backward and optimizer steps"
        if module:
            text += f" in `{module}`"
        same = bool(label and op and label.replace("_", " ") == op.replace("_", " "))
        if label:
            detail = label if same or not op else f"{label}: {op}"
        else:
            detail = op
        if detail:
            text += f" ({detail})"
        return text

    @property
    def frozen_parameters(self) -> int | None:
        """Bytes of the peak's parameters that do not require grad (a frozen base model
        under LoRA: no gradients, no optimizer state); None without a trace."""
        if self.trace is None:
            return None
        return self.trace.frozen_parameters_at()

    def parameters_text(self) -> str:
        """'' or "(trainable 8.00 MiB, frozen 2.46 GiB)" for the peak's parameters."""
        frozen = self.frozen_parameters
        total = self.breakdown.get(Category.PARAMETERS.value, 0)
        if not frozen or not total:
            return ""
        return f"(trainable {format_bytes(total - frozen)}, frozen {format_bytes(frozen)})"

    def breakdown_rows(self) -> list[tuple[str, int, float]]:
        """(category, bytes, share of peak) for every category, in Category order
        (workspaces only where there are some: only a GPU, real or simulated, has them;
        the KV cache only where a model kept one)."""
        total = self.peak or 1
        return [(k, v, v / total) for k, v in self.breakdown.items()
                if v or k not in _SHOWN_WHEN_HELD]

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(f"<MemoryReport : {self}>")

    def footer(self) -> "Footer":
        """One line for a cell run with a notebook-wide simulated GPU (``%gpusim on``)."""
        parts = [f"allocated {format_bytes(self.after)}",
                 f"peak {format_bytes(self.peak)} in this cell"]
        if self.reserved_peak is not None:
            now = self.reserved_after if self.reserved_after is not None else self.reserved_peak
            text = f"reserved {format_bytes(now)}"
            if self.reserved_peak > now:  # empty_cache() (or an OOM's retry) released some
                text += f" (peak {format_bytes(self.reserved_peak)})"
            parts.append(text)
        if self.fits is not None:
            verdict = "fits" if self.fits else "DOES NOT FIT"
            parts.append(f"{verdict} {self.gpu_name or 'GPU'} ({format_bytes(self.gpu_memory)})")
        if self.failed_request is not None:
            parts.append(f"out of memory on a request of {format_bytes(self.failed_request)}")
        return Footer(f"[{self.backend}: {self.device}] " + " · ".join(parts), self.fits)

    def summary(self) -> str:
        """A multi-line text table: the numbers, the breakdown and the notes."""
        lines = [f"memmagic [{self.backend}] {self.device}: {self.source}"]
        if self.job is not None:
            lines.append(f"  {self.job.heading}")
            lines += [f"    {ranks:<16} {line}" for ranks, line in self.job.grouped()]
        width = max(len(k) for k, _ in self._rows())
        lines += [f"  {k:<{width}}  {v}" for k, v in self._rows()]
        lines.append("  breakdown at peak:")
        for name, value, share in self.breakdown_rows():
            more = f"  {self.parameters_text()}" if name == Category.PARAMETERS.value else ""
            lines.append(f"    {name:<16}{format_bytes(value):>12}  {share:6.1%}{more}".rstrip())
        if self.backend == "cuda" and self.unattributed:
            lines.append(f"    {'unattributed':<16}{format_bytes(self.unattributed):>12}")
        rows = self._module_rows()
        if rows:
            lines.append("  activations by module at peak:")
            for r in rows:
                lines.append(f"    {r.module:<28}{format_bytes(r.activations):>12}  {r.share:6.1%}")
        if self.error:
            lines.append(f"  {self.unit} failed: {self.error}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _module_rows(self, top: int = 5) -> list["ModuleRow"]:
        """The display's per-module rows: the deepest level (up to 3) that splits the
        activations into more than one row, top ``top`` by activations at the peak."""
        if not self.modules or not self.breakdown.get(Category.ACTIVATIONS.value):
            return []
        best = self.modules_at(1)
        for depth in (2, 3):
            rows = self.modules_at(depth)
            if len([r for r in rows if r.activations]) > len([r for r in best if r.activations]):
                best = rows
        return [r for r in best if r.activations][:top]

    def _repr_html_(self) -> str:
        esc = html.escape
        head = (
            f"<b>memmagic</b> <code>{esc(self.backend)}</code> {esc(self.device)}"
            f" <span style='{_MUTED}'>({esc(self.source)})</span>"
        )
        rows = "".join(
            f"<tr><th style='text-align:left'>{esc(k)}</th><td style='text-align:left'>{esc(v)}</td></tr>"
            for k, v in self._rows()
        )
        bars = []
        for name, value, share in self.breakdown_rows():
            if not value:
                continue  # the text report lists every category; the table only what holds bytes
            pct = max(0.0, min(share, 1.0)) * 100
            more = self.parameters_text() if name == Category.PARAMETERS.value else ""
            more = f" <span style='{_MUTED}'>{esc(more)}</span>" if more else ""
            bars.append(
                f"<tr><td style='text-align:left'>{esc(name.replace('_', ' '))}{more}</td>"
                f"<td style='text-align:right'>{esc(format_bytes(value))}</td>"
                f"<td style='text-align:right'>{share:.1%}</td>"
                f"<td style='width:12em'><div style='background:{COLORS[name]};height:0.8em;width:{pct:.1f}%'></div></td></tr>"
            )
        mods = "".join(
            f"<tr><td><code>{esc(r.module)}</code></td><td style='text-align:right'>{esc(format_bytes(r.activations))}</td>"
            f"<td style='text-align:right'>{r.share:.1%}</td></tr>" for r in self._module_rows())
        if mods:
            mods = ("<table><tr><th style='text-align:left'>activations by module (at peak)</th>"
                    f"<th>bytes</th><th>share</th></tr>{mods}</table>")
        notes = ""
        if self.notes:
            items = "".join(f"<li>{esc(n)}</li>" for n in self.notes)
            count = len(self.notes)
            notes = (f"<details style='{_MUTED}'><summary>{count} note{'s' if count != 1 else ''}: "
                     f"where these numbers come from and what they leave out</summary>"
                     f"<ul>{items}</ul></details>")
        err = f"<p style='{_ERROR}'>{self.unit} failed: {esc(self.error)}</p>" if self.error else ""
        return (
            f"<div class='memmagic-report'>{head}{err}{self._job_html()}"
            f"<table>{rows}</table>"
            f"<table><tr><th style='text-align:left'>at the peak</th><th>bytes</th><th>share</th><th></th></tr>{''.join(bars)}</table>"
            + mods + notes + "</div>"
        )


    def _job_html(self) -> str:
        if self.job is None:
            return ""
        esc = html.escape
        rows = "".join(f"<tr><td style='text-align:left'>{esc(ranks)}</td>"
                       f"<td style='text-align:left'>{esc(line)}</td></tr>"
                       for ranks, line in self.job.grouped())
        return f"<p>{esc(self.job.heading)}</p><table>{rows}</table>"


# Colours that follow the notebook's theme (JupyterLab's and VS Code's CSS variables),
# with fallbacks readable on a light background.
_MUTED = "color:var(--jp-ui-font-color2, var(--vscode-descriptionForeground, #555))"
_ERROR = "color:var(--jp-error-color1, var(--vscode-errorForeground, #c62828));font-weight:bold"


class Footer:
    """A report in one line (text and HTML)."""

    def __init__(self, text: str, fits: bool | None) -> None:
        self.text = text
        self.fits = fits

    def __repr__(self) -> str:
        return self.text

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text)

    def _repr_html_(self) -> str:
        style = _ERROR if self.fits is False else _MUTED
        return (f"<div class='memmagic-footer' style='{style};font-size:85%'>"
                f"{html.escape(self.text)}</div>")
