"""Fixes ranked: the cell re-run with each knob that applies (and FSDP2 / tensor-parallel
rows), smallest peak first; the re-runs go through the engine the doctor is given."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

from ..backends.sim import OP_CACHES
from ..core.forked import run_all
from ..report import format_bytes, needed
from ..trace import PHASES
from .oom import failure_words
from ..whatif.knobs import (BATCH_DIM, BATCH_HINT, KNOBS, SEQ_DIM, Fixes, KnobError, Setting,
                             resizing)

# BATCH_HINT: the batch size knob's note when it does not apply (``Doctor.untried``)
__all__ = ["Strategy", "fits_text", "rank", "ranking_rows", "BATCH_HINT"]


# -- strategies --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Strategy:
    """One row of the ranking: a knob setting and the peak a re-run with it gave. Bytes."""

    label: str
    knobs: Mapping[str, Any]
    peak: int | None
    reserved_peak: int | None = None
    fits: bool | None = None
    reason: str | None = None  # why it could not be measured, or where it ran out
    out_of_memory: bool = False  # the re-run ran out of memory on the target card
    # out of memory: how far it got (whether it reached the optimizer, the backward, the
    # modules it had entered, then the ops it ran: runs with other knobs run other ops, the
    # same modules)
    progress: tuple[int, int, int, int] | None = None

    @property
    def need(self) -> int | None:
        """What decides fitting (:func:`memmagic.report.needed`)."""
        return needed(self.peak, self.reserved_peak)


def fits_text(s: Strategy) -> str:
    if s.out_of_memory:
        return f"does not fit ({s.reason})"
    return {True: "fits", False: "does not fit", None: ""}[s.fits]


def _order(s: Strategy) -> tuple:
    """Ranking order: measured peaks (live tensor bytes), smallest first; the reserved
    peak decides whether a row fits. Runs that ran out of memory (their
    peak is only what they reached) after them; unmeasured last."""
    return (s.peak is None, s.out_of_memory, s.peak or 0, s.label)


def _candidates(applicable: Sequence[str], known: Fixes) -> list[tuple[str, dict[str, Any]]]:
    """(label, knobs) of every single fix that applies to the cell (each knob's
    ``Doctor.fixes``)."""
    return [fix for name in applicable if KNOBS[name].doctor.fixes is not None
            for fix in KNOBS[name].doctor.fixes(known)]


def _measure(cell: Any, label: str, knobs: Mapping[str, Any],
             ran: dict[Setting, Any] | None = None) -> Strategy:
    """The row of a re-run of ``cell`` with ``knobs`` (its report kept in ``ran``, by
    its setting)."""
    return _measure_all(cell, [(label, knobs)], ran)[0]


def _measure_all(cell: Any, fixes: Sequence[tuple[str, Mapping[str, Any]]],
                 ran: dict[Setting, Any] | None) -> list[Strategy]:
    """The rows of re-runs of ``cell``, one per (label, knobs) of ``fixes``, as
    :func:`_measure` makes them; side by side in forked children where the machine has
    the cores and the runs in ``ran`` took long enough for a child to be worth it
    (:func:`memmagic.core.forked.run_all`: each re-run starts from the cell as it is here,
    so they do not depend on each other; what they add to the op caches comes back)."""
    each_s = max((r.wall_s for r in ran.values()), default=None) if ran else None
    done = run_all(lambda knobs: cell.run(**knobs), [knobs for _, knobs in fixes],
                   each_s=each_s, carry=OP_CACHES)
    rows = []
    for (label, knobs), (ok, r) in zip(fixes, done):
        if not ok:
            if not isinstance(r, (KnobError, ValueError, TypeError)):
                raise r
            rows.append(Strategy(label, dict(knobs), None, reason=str(r)))
            continue
        if ran is not None:
            ran[cell.setting(**knobs)] = r
        rows.append(_row(label, knobs, r))
    return rows


def _row(label: str, knobs: Mapping[str, Any], r: Any) -> Strategy:
    """The row of a run's report ``r`` (a re-run's, a sharded run's): its peak, reserved
    peak, verdict, error and, after an out of memory, what was live, the failed request
    and where it ran out."""
    if r.error and r.failed_request is None:
        return Strategy(label, dict(knobs), None, reason=f"failed: {r.error}")
    if r.failed_request is not None:  # ran out of memory: it needs more than what was live
        # and the request the card could not give (its peak so far says less)
        least = (r.live_at_failure if r.live_at_failure is not None else r.peak) + r.failed_request
        where = failure_words(r)
        # where it ran out says how far it got: lower bounds of runs that stopped at
        # different places do not compare
        return Strategy(label, dict(knobs), least, None, False,
                        reason=f"out of memory asking for {format_bytes(r.failed_request)}"
                               + (f" {where}" if where else ""),
                        out_of_memory=True, progress=_progress(r))
    return Strategy(label, dict(knobs), r.peak, r.reserved_peak, r.fits)


def rank(engine: Any, namespace: Mapping[str, Any] | None = None, *, gpu: Any = None,
         gpu_memory: int | str | None = None, world_sizes: Sequence[int] = (),
         combine: bool = True, knobs: Sequence[str] | None = None, unit: str = "cell"
         ) -> tuple[Strategy, tuple[Strategy, ...], list[str]]:
    """Re-run ``engine`` (the what-if engine of a cell, :class:`memmagic.Cell`: for source
    text, :func:`memmagic.pipeline.ranking_engine` builds the one the doctor uses) with each
    fix that applies to it, and rank them by the peak each gives (reserved where known;
    smallest first). With a target card (``gpu``/``gpu_memory``, or the engine's), when no single fix fits, the smallest combination that fits is
    searched (greedy: the best fixes of different knobs added one at a time, at most 4).
    ``world_sizes`` adds FSDP2 rows (:func:`memmagic.whatif.sharding.simulate_fsdp`); ``knobs``
    limits the fixes tried to these knobs (names of :data:`memmagic.whatif.knobs.KNOBS`).
    ``unit``: what ran, in the front end's words ("cell", "script": the notes say how to
    let the doctor try a smaller batch). Returns (the cell as written, the ranked fixes,
    notes)."""
    if isinstance(engine, str) or not callable(getattr(engine, "run", None)):
        raise TypeError(f"rank() re-runs a what-if engine, not {type(engine).__name__}: pass "
                        "memmagic.pipeline.ranking_engine(source, namespace, gpu=...) or a "
                        "memmagic.Cell")
    c = engine
    notes: list[str] = []
    ran: dict[Setting, Any] = {}  # the re-runs' reports, by setting
    baseline = _measure(c, _as_run(c.asked), {}, ran)
    applicable = c.applicable()
    if knobs is not None:
        applicable = [k for k in applicable if k in knobs]
    info = c.last_info
    optimizer = None
    if info is not None and info.optimizers_built:
        optimizer = info.optimizers_built[0].lower()
    notes += [k.doctor.untried[unit] for k in KNOBS.values() if k.doctor.untried is not None
              and k.name not in applicable and (knobs is None or k.name in knobs)]
    known = Fixes(c.baseline.effective_batch, optimizer,
                  getattr(c.baseline, resizing(SEQ_DIM).name))
    applicable = _worth_running(applicable, baseline, info, unit, notes)
    candidates = _not_done(_candidates(applicable, known), info, unit, notes)
    rows = _measure_all(c, [(label, knobs) for label, knobs in candidates  # not what ran
                            if any(getattr(c.baseline, k) != v for k, v in knobs.items())], ran)
    read = _read_off(c, ran, unit, notes)
    sizes = [dict(s.knobs) for s in read]  # a size read off replaces its plain row
    rows = [s for s in _without_repeats(rows, baseline, unit, notes)
            if dict(s.knobs) not in sizes] + read
    targeted = baseline.fits is not None or any(s.fits is not None for s in rows)
    if combine and targeted and not baseline.fits and not any(s.fits for s in rows):
        combo = _combine(c, baseline, rows)
        if combo is not None:
            rows.append(combo)
    if world_sizes:
        source = getattr(c, "source", None)
        if source is None:
            notes.append("FSDP2 rows need the cell's source text (a function cell has none)")
        else:
            options = c.backend_options
            rows += _shard_rows(source, c.namespace, world_sizes, options.get("gpu", gpu),
                                options.get("gpu_memory", gpu_memory))
            notes += _SHARD_NOTES
    rows.sort(key=_order)
    return baseline, tuple(rows), notes


# the contexts the doctor reads off: multiples of this many tokens
_CONTEXT_STEP = 64
# why no size between the runs that fit and the one that ran out is read off: too few fit
# for a line (a batch of 1 takes another path, so is never one of them), or they are on none
_UNREAD = ("no {most} that fits was read off between {fits} (fit) and {out} (runs out): ",
           "one run that fits draws no line (a {noun} of 1 takes another path)",
           "the {unit}'s runs at these sizes made allocations that are not on one line (as "
           "where its own code changes with the {noun}: an accumulation count derived from "
           "it, data trimmed to a multiple of it)")
# runs that halve such a gap, one after another: at most the first, then on while the gap
# is wider than an eighth of the size that fits, up to the second
_HALVINGS = (3, 5)


def _read_off(cell: Any, ran: dict[Setting, Any], unit: str, notes: list[str]
              ) -> list[Strategy]:
    """Where the run as written did not fit and the re-runs at smaller batches (contexts)
    lie on one line that the runs which ran out check up to where they stopped
    (:mod:`memmagic.whatif.evaluated`): what the run as written needs as a whole (a note,
    evaluated), and the largest batch (longest context) that fits by the line, run to
    confirm it (a cell may round a size the line cannot see). Where too few smaller runs
    fit for a line (the context: a parabola, for attention scores), smaller ones are run
    first (at most two per size). Where the runs are on no line, runs halve the gap
    between the largest that fits and the smallest that ran out (:func:`_halved`)."""
    from ..whatif.evaluated import evaluate, largest_fitting, run_wanted, unread_gap

    setting = cell.setting()
    own = ran.get(setting)
    if own is None or own.fits is not False or getattr(own.trace, "allocator_log", None) is None:
        return []  # it fits, or no simulated allocator logged the runs (a real GPU's)
    planes: dict = {}  # the lines found, each checked once (evaluated.evaluate)
    # smaller runs that fit, for a line (or a parabola): both sizes' at once; where none
    # fits yet, halvings first (a batch far too big), up to two more rounds
    for _ in range(4):
        wanted = [(dim, n) for dim in (BATCH_DIM, SEQ_DIM)
                  if (n := run_wanted(ran, setting, dim, planes)) is not None]
        if not wanted:
            break
        _measure_all(cell, [("", {resizing(dim).name: n}) for dim, n in wanted], ran)
    whole = evaluate(ran, setting, planes) if own.failed_request is not None else None
    if whole is not None:
        notes.append(f"as written the {unit} needs {format_bytes(whole.card_need)} of the "
                     f"card's {format_bytes(whole.gpu_memory)} (evaluated, not run: "
                     f"{whole.read_off})")
    found = []  # (plain label, step, line, the row's label, knobs) per size read off
    halved: list[Strategy] = []  # rows of runs that halved a gap no line reads off
    made: list[Strategy] = []  # rows of runs made before that the line reads as the largest
    for dim, step, noun, most in ((BATCH_DIM, 1, "batch", "largest"),
                                  (SEQ_DIM, _CONTEXT_STEP, "context", "longest")):
        got = largest_fitting(ran, setting, dim, step, planes)
        gap = unread_gap(ran, setting, dim, step, planes) if got is None else None
        if gap is not None:
            unread = (_UNREAD[0] + _UNREAD[1 if len(gap[0]) < 2 else 2]).format(
                noun=noun, most=most, fits=", ".join(map(str, gap[0])), out=gap[1], unit=unit)
            halved += _halved(cell, ran, setting, dim, step, gap, notes, (noun, most, unread))
        if got is not None:
            (n, line), knob = got, resizing(dim)
            plain = f"{noun} {n} (from {getattr(setting, knob.name)})"
            if line is None:  # a run made before: the next does not fit by the line
                run = ran.get(cell.setting(**{knob.name: n}))
                if run is not None:
                    made.append(_row(f"{plain}, the {most} that fits", {knob.name: n}, run))
                    notes.append(f"{made[-1].label}: a re-run's, and the next does not fit by "
                                 "the line through the re-runs")
                continue
            found.append((plain, step, line, f"{plain}, the {most} that fits", {knob.name: n}))
    return _confirmed(cell, found, ran, notes) + made + halved


def _confirmed(cell: Any, found: list[tuple], ran: dict[Setting, Any], notes: list[str]
               ) -> list[Strategy]:
    """The rows of the sizes read off the lines (``found``: (plain label, step, line, the
    row's label, knobs) each), each run to confirm it: the row of the largest that fits
    where the run gives the line's figures, else a plain row; a note each says which."""
    rows = []
    measured = _measure_all(cell, [(label, knobs) for *_, label, knobs in found], ran)
    for (plain, step, line, _, _), row in zip(found, measured):
        if (row.peak, row.reserved_peak, row.fits) == (line.peak, line.reserved_peak, True):
            notes.append(f"{row.label}: read off the re-runs, then run ({line.read_off}; "
                         f"{'a multiple of ' + str(step) + ', ' if step > 1 else ''}the next "
                         "does not fit by the same reading)")
        else:  # the run disagrees with the line: a plain row, and why
            row = replace(row, label=plain)
            notes.append(f"{row.label}: read off the re-runs, it fits with "
                         f"{format_bytes(line.reserved_peak)} reserved; its run gave other "
                         f"figures (the cell's sizes are not on that line there: {line.read_off})")
        rows.append(row)
    return rows


def _halved(cell: Any, ran: dict[Setting, Any], setting: Setting, dim: int, step: int,
            gap: tuple[list[int], int], notes: list[str], words: tuple[str, str, str]
            ) -> list[Strategy]:
    """Where no line reads the largest size that fits off the runs (``gap``: the values
    that fit, the smallest that ran out): runs halving the gap, one after another, at
    most :data:`_HALVINGS`, until it is one ``step`` (of whole micro-batches) wide. The
    row of the largest that fits among them (none where every one ran out), and a note
    of what they found and why they ran (``words``: the size's noun, "largest" or
    "longest", and why no line reads it off)."""
    (noun, most, unread), knob = words, resizing(dim)
    grain = step * (setting.micro_steps if dim == BATCH_DIM else 1)
    good, bad = max(gap[0]), gap[1]
    best, tried, unmeasured = None, [], ""
    while bad - good > grain and len(tried) < _HALVINGS[(bad - good) * 8 > good]:
        mid = (good + bad) // 2 // grain * grain
        if mid <= good:
            break
        row, = _measure_all(cell, [("", {knob.name: mid})], ran)
        tried.append(mid)
        if row.fits is None and not row.out_of_memory:  # nothing more to halve by
            unmeasured = f"; the run at {mid} could not be measured ({row.reason})"
            break
        if row.fits:
            good, best = mid, row
        else:
            bad = mid
    if not tried:
        notes.append(f"{noun}: {unread}")
        return []
    exact = bad - good <= grain
    found = (f"the {most} that fits is {good} ({bad} runs out)" if exact
             else f"{good} fits and {bad} runs out")
    notes.append(f"{noun}: {found}, found by {len(tried)} run{'s' * (len(tried) > 1)} "
                 f"halving the gap one after another ({', '.join(map(str, tried))}){unmeasured}: "
                 f"{unread}")
    plain = f"{noun} {good} (from {getattr(setting, knob.name)})"
    earlier = ran.get(cell.setting(**{knob.name: good}))
    if best is None and earlier is not None:
        # no halving fit (each ran out, or one could not be measured): the largest that
        # fits is a run made before them, a row of its own even where the gap stays open
        best = _row(plain, {knob.name: good}, earlier)
    if best is None:
        return []
    return [replace(best, label=f"{plain}, the {most} that fits" if exact else plain)]


def _worth_running(applicable: list[str], baseline: Strategy, info: Any, unit: str,
                   notes: list[str]) -> list[str]:
    """``applicable`` less the knobs whose re-runs would run out where the run did: those
    that change nothing before the first optimizer step, when none began (a note says so)."""
    if not (baseline.out_of_memory and info is not None and info.steps_begun == 0):
        return applicable
    late = [k for k in applicable if KNOBS[k].doctor.from_first_step]
    if late:
        notes.append(f"{', '.join(late)}: not re-run, the {unit} ran out of memory before its "
                     "first optimizer step began (where an optimizer makes its state), so it "
                     "would run out at the same place")
    return [k for k in applicable if k not in late]


def _not_done(candidates: list[tuple[str, dict[str, Any]]], info: Any, unit: str,
              notes: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """``candidates`` less the fixes the run already makes by its own code (each knob's
    ``Doctor.already``): a note instead of a re-run that would give the same figures."""
    if info is None:
        return candidates
    out = []
    for label, knobs in candidates:
        words = [w for name, value in knobs.items() if KNOBS[name].doctor.already is not None
                 and (w := KNOBS[name].doctor.already(info, value))]
        if words and len(words) == len(knobs):
            notes.append(f"{label}: not re-run, the {unit} {'; '.join(words)}")
        else:
            out.append((label, knobs))
    return out


def _without_repeats(rows: list[Strategy], baseline: Strategy, unit: str,
                     notes: list[str]) -> list[Strategy]:
    """``rows`` less those that gave the baseline's own figures (a fix the cell already
    makes, its own autocast; or one that ran out exactly where it did): a note instead."""
    same = [s for s in rows if s.peak is not None and s.out_of_memory == baseline.out_of_memory
            and (s.peak, s.reserved_peak, s.reason)
            == (baseline.peak, baseline.reserved_peak, baseline.reason)]
    if not same:
        return rows
    labels = ", ".join(s.label for s in same)
    if baseline.out_of_memory:
        notes.append(f"{labels}: ran out of memory exactly as the \"{baseline.label}\" row did "
                     "(the same tensors live, the same request): they change nothing before "
                     "that point")
    else:
        notes.append(f"{labels}: the same figures as the \"{baseline.label}\" row (the {unit} "
                     "already does this, or it changes nothing here)")
    return [s for s in rows if s not in same]


def _as_run(asked: Setting) -> str:
    """The baseline row's label: "as written", or the setting the run was asked for
    (``--batch-size 64``: the doctor ranks fixes for what ran)."""
    ran = {name: value for name, value in asked.changed().items()
           if KNOBS[name].backend is None}  # the card is where it ran, not how
    return "as written" if not ran else f"as run ({Setting(**ran).label()})"


def _combine(cell: Any, baseline: Strategy, rows: Sequence[Strategy]) -> Strategy | None:
    """The smallest combination of fixes (one value per knob) that fits, found greedily:
    the fixes that helped most first (those that ran, by what they need; then those that
    ran out of memory, by how far they got: their lower bounds do not compare)."""
    if baseline.need is None:
        return None
    best_per_family: dict[str, Strategy] = {}
    for s in rows:
        if s.need is None or len(s.knobs) != 1 or not _helped(s, baseline):
            continue
        knob = KNOBS[next(iter(s.knobs))]
        if any(other in best_per_family for other in knob.doctor.excluded_by):
            continue
        cur = best_per_family.get(knob.family)
        if cur is None or _promise(s) < _promise(cur):
            best_per_family[knob.family] = s
    ordered = sorted(best_per_family.values(), key=_promise)
    knobs: dict[str, Any] = {}
    labels: list[str] = []
    last = None
    for s in ordered[:4]:
        knobs.update(s.knobs)
        labels.append(s.label)
        if len(labels) < 2:
            continue
        last = _measure(cell, " + ".join(labels), knobs)
        if last.fits:
            return last
    return last


def _progress(r: Any) -> tuple[int, int, int, int] | None:
    """How far a run got before it ran out of memory: (reached the optimizer, reached the
    backward, modules entered, ops run)."""
    trace = r.trace
    if trace is None or not trace.ops:
        return None
    _forward, backward, recompute, step, _other = PHASES
    ran = trace.ops[:trace.failure_op] if trace.failure_op else trace.ops  # not the unwinding
    phases = {phase for _, _, phase, _ in ran}
    modules = {module for _, module, _, _ in ran if module}
    return (int(step in phases), int(bool(phases & {backward, recompute})), len(modules),
            len(ran))


def _helped(s: Strategy, baseline: Strategy) -> bool:
    """Whether fix ``s`` did better than the run as written: it needs less, or it ran
    out of memory later (or not at all) where that run ran out."""
    if not s.out_of_memory:
        return baseline.out_of_memory or s.need < baseline.need  # type: ignore[operator]
    if not baseline.out_of_memory:
        return False
    if s.progress is None or baseline.progress is None:
        return s.need < baseline.need  # type: ignore[operator]
    return s.progress > baseline.progress


def _promise(s: Strategy) -> tuple:
    """The order fixes join a combination: those that ran, by what they need; then those
    that ran out of memory, furthest first."""
    if not s.out_of_memory:
        return (0, s.need)
    return (1, tuple(-x for x in s.progress or ()), s.need)


def ranking_rows(engine: Callable[[], Any] | None, namespace: Mapping[str, Any] | None, *,
                 strategies: bool, world_sizes: Sequence[int], gpu: Any, gpu_memory: Any,
                 unit: str = "cell") -> tuple[Strategy | None, tuple[Strategy, ...], list[str]]:
    """The ranked rows :func:`memmagic.doctor.advise` shows: the fixes re-run through the
    engine the factory ``engine`` builds (asked once, here), or only the sharded rows."""
    if engine is None:
        return None, (), ["the strategies need the cell's code to re-run (engine=)"]
    c = engine()
    if strategies:
        return rank(c, namespace, gpu=gpu, gpu_memory=gpu_memory, world_sizes=world_sizes,
                    unit=unit)
    rows = _shard_rows(c, namespace, world_sizes, gpu, gpu_memory)
    rows.sort(key=_order)
    return None, tuple(rows), list(_SHARD_NOTES) if rows else []


# What the FSDP2 rows leave out: the simulation runs them on a fake process group (no NCCL)
_NCCL_NOTE = ("FSDP2 and tensor-parallel rows leave out NCCL's own buffers on each GPU "
              "(outside PyTorch's allocator, they grow with channels and peers: about 1.06 GB "
              "per GPU on 8 H100s "
              "before an all-to-all, NVIDIA/nccl#1685; about 1.6 GB with one communicator after "
              "an all-reduce, NVIDIA/nccl#864): leave that room beside the rows' figures")


# What the rows of a job over several GPUs are, and what they leave out
_SHARD_NOTES = (
    _NCCL_NOTE,
    "the FSDP2 rows are ZeRO-3 (parameters, gradients and optimizer state sharded); the "
    "ZeRO-1 and ZeRO-2 rows are simulated at the most GPUs tried only (fewer GPUs hold more). "
    "The ZeRO-1 row leaves out DDP's gradient buckets (a second copy of the gradients, none "
    "with DistributedDataParallel(gradient_as_bucket_view=True)); DeepSpeed's own ZeRO "
    "adds its buckets (reduce_bucket_size): run the DeepSpeed script with --world-size N "
    "for those",
    "pipeline stages: not re-run by the doctor, since a pipeline replaces the cell's forward "
    "and backward by a schedule's step(); write the step with "
    "torch.distributed.pipelining and run it with --world-size N --ranks all (each stage's "
    "peak, its micro-batches in flight counted)")


def _shard_rows(cell: Any, namespace: Mapping[str, Any] | None, world_sizes: Sequence[int],
                gpu: Any, gpu_memory: Any) -> list[Strategy]:
    """FSDP2 (ZeRO-3) rows for each of ``world_sizes``, tensor-parallel rows where the
    notebook's model carries its own TP plan (a transformers model's ``tp_plan``), and
    ZeRO-2 and ZeRO-1 rows at the most GPUs of ``world_sizes``."""
    from ..whatif import sharding

    source = getattr(cell, "source", cell)
    runs = [(sharding.simulate_fsdp, world_sizes)]
    if _has_tp_plan(namespace):
        runs.append((sharding.simulate_tp, world_sizes))
    most = (max(world_sizes),) if world_sizes else ()
    runs += [(functools.partial(sharding.simulate_zero, stage=stage), most) for stage in (2, 1)]
    out = []
    for simulate, sizes in runs:
        for n in sizes:
            r = simulate(source, namespace, world_size=n, gpu=gpu, gpu_memory=gpu_memory)
            knobs = {f"{r.style}_world_size": n}
            out.append(Strategy(r.label(), knobs, None, reason=r.reason) if r.report is None
                       else _row(r.label(), knobs, r.report))
    return out


def _has_tp_plan(namespace: Mapping[str, Any] | None) -> bool:
    """Whether a model the namespace names (on the notebook's simulated GPU too) carries a
    tensor-parallel plan."""
    import torch

    from ..backends.sim import session_of

    ns = dict(namespace or {})
    session = session_of(ns)
    shadow = session.card.shadow if session is not None and session.card is not None else {}
    for key, value in ns.items():
        sh = shadow.get(key)
        if sh is not None and sh.shown is value:
            value = sh.value
        if isinstance(value, torch.nn.Module) and getattr(value, "tp_plan", None):
            return True
    return False
