"""One cell, from a request to a report: the path every front end takes.

:func:`run_cell` picks the backend, applies the knobs, runs the cell, adds the notes on
what the options made of the run, asks the memory doctor, and handles a failure (the
frames an out of memory holds are released, memmagic's frames are cut from the
traceback). :func:`make_cell` gives the what-if engine of the same request (the panel,
the sweep and the doctor's re-runs use it). The magic, the panel, the sweep and scripts
call these; nothing here knows IPython.

>>> result = run_cell(CellRequest("y = torch.ones(1024, device='cuda')", {"torch": torch},
...                               backend="sim", gpu="T4"))
>>> result.report.peak
4096
"""

from __future__ import annotations

import gc
import sys
import traceback
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from . import doctor
from .backends import BACKEND_NAMES, BackendUnavailable, Outcome, get_backend
from .core.failures import (NO_GPU_HINT, add_note_once, cuda_usable, is_out_of_memory,
                       needs_missing_cuda, release_own_frames, requested_text, strip_own_frames)
from .core.interrupts import guarded, is_interrupt
from .whatif.knobs import KNOBS, KnobError
from .report import MemoryReport, Note, format_bytes

__all__ = ["CellRequest", "CellResult", "RequestError", "run_cell", "make_cell", "knob_values",
           "ranking_engine"]


class RequestError(ValueError):
    """A request that cannot run as asked; the one-line message says what to do (the magic
    shows it as a UsageError)."""


@dataclass(frozen=True)
class CellRequest:
    """What to run and how: the magic's line, as data.

    ``source`` runs in ``namespace``; ``run`` is its compiled form (the magic passes one
    compiled with IPython's transforms; default: plain Python). ``backend`` is one of
    ``BACKEND_NAMES`` ("auto": cuda when a GPU is usable, else cpu); ``gpu``/``gpu_memory``
    the simulated card; ``device``/``breakdown`` the CUDA backend's options; ``session``
    the notebook's simulated GPU that sim cells run on (None: a fresh card per run).
    ``knobs``: knob name -> value or option text (``{"amp": "fp16"}``); ``advise``: the
    memory doctor's full advice, also after a cell that ran; ``world_size``: the simulated
    GPU is rank 0 (or ``rank``) of that many (the cell's tensor parallel, FSDP2, DTensors),
    the cell runs on a copy of the notebook's simulated GPU. ``backend_options`` go to the backend as
    they are (the Python API's keyword arguments); ``simulate`` is how the front end says
    "run it on the simulated GPU" in its notes; ``unit``, what it runs in its words ("cell",
    "script"); ``rank_fixes``: after an out of memory the doctor ranks fixes (False: its
    short advice only, for the runs of a job's other ranks); ``mailbox``: what the job's
    ranks run before sent the later ones (its pipeline stages' metadata; memmagic.jobs)."""

    source: str
    namespace: dict = field(default_factory=dict, repr=False)
    backend: str = "auto"
    gpu: str | None = None
    gpu_memory: str | None = None
    device: int | None = None
    breakdown: bool = True
    session: Any = field(default=None, repr=False)
    knobs: Mapping[str, Any] = field(default_factory=dict)
    advise: bool = False
    run: Callable[[dict], Any] | None = field(default=None, repr=False)
    world_size: int | None = None
    rank: int | None = None
    gpus_per_node: int | None = None
    decode_steps: str | None = None  # generate()'s decode steps on the simulated GPU: evaluate | run
    max_seconds: float | None = None  # how long a simulated run may take (SimBackend's bound)
    backend_options: Mapping[str, Any] = field(default_factory=dict)
    simulate: str = "--backend sim"
    unit: str = "cell"
    rank_fixes: bool = True
    mailbox: dict | None = field(default=None, repr=False)


@dataclass
class CellResult:
    """A cell's run: its report (with the doctor's advice when there is any), the value of
    its last expression, and its exception (never swallowed: the caller raises it; an out
    of memory's frames are already released, memmagic's own frames cut)."""

    report: MemoryReport
    value: Any = None
    error: BaseException | None = None

    @property
    def out_of_memory(self) -> bool:
        return is_out_of_memory(self.error)

    def oom_message(self) -> str | None:
        """The line a front end shows after an out of memory (None when there was none)."""
        if not self.out_of_memory:
            return None
        r = self.report
        return (f"memmagic: out of memory on {r.device}: tried to allocate "
                f"{requested_text(self.error) or 'an unknown amount'} while "
                f"{format_bytes(r.after)} of tensors were live (peak {format_bytes(r.peak)}). "
                f"The failed {r.unit}'s local variables were released." + _left_text(r))


def _left_text(report: MemoryReport) -> str:
    """The sentence on what the failed cell's names still hold ('' when nothing)."""
    oom = getattr(report.advice, "oom", None)
    if oom is None or not oom.left:
        return ""
    text = oom.left_text()
    return f" {text[0].upper()}{text[1:]}."


# -- the request's parts --------------------------------------------------------------------
def knob_values(raw: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The knob values of a request, checked: (values, options for the what-if engine such
    as the checkpointed module's class). RequestError names the option."""
    values: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for name, value in raw.items():
        knob = KNOBS.get(name)
        if knob is None:
            raise RequestError(f"unknown knob {name!r}; knobs: {', '.join(KNOBS)}")
        if value is None:
            continue
        try:
            values[name], more = knob.from_option(value)
        except KnobError as exc:
            raise RequestError(str(exc)) from None
        options.update(more)
    return values, options


def _uses_real_cuda(request: CellRequest) -> bool:
    return request.backend == "cuda" or (request.backend == "auto" and cuda_usable())


def _sim_run_options(request: CellRequest, name: str) -> dict[str, Any]:
    """The options of how a simulated run goes (generate()'s decode steps, its time bound);
    one-line errors for another backend or a bound that is not a positive time."""
    options: dict[str, Any] = {}
    if request.decode_steps is not None:
        if name != "sim":
            raise RequestError("--decode-steps says how the simulated GPU runs generate()'s "
                               "decode steps: add --backend sim, or leave it out")
        options["decode"] = request.decode_steps
    if request.max_seconds is not None:
        if name != "sim":
            raise RequestError("--max-seconds bounds a simulated run: add --backend sim, or "
                               "leave it out")
        if not request.max_seconds > 0:
            raise RequestError(f"--max-seconds needs a positive number of seconds, not "
                               f"{request.max_seconds:g}")
        options["max_seconds"] = request.max_seconds
    return options


def backend_spec(request: CellRequest, *, persistent: bool = True) -> tuple[str, dict[str, Any]]:
    """The backend's name and options; ``persistent``: a sim cell runs on the notebook's
    simulated GPU (``request.session``; what-if re-runs start from a copy of it)."""
    name = request.backend
    if name not in BACKEND_NAMES:
        raise RequestError(f"backend must be one of {', '.join(BACKEND_NAMES)}, not {name!r}")
    if name != "sim" and (request.gpu or request.gpu_memory):
        raise RequestError("--gpu and --gpu-memory pick a target for the simulation: add --backend sim")
    real_cuda = _uses_real_cuda(request)
    if request.device is not None and not real_cuda:
        raise RequestError("--device picks a CUDA device: use it with --backend cuda on a GPU machine")
    options: dict[str, Any] = {}
    if name == "sim" and (request.gpu or request.gpu_memory):
        from .backends.sim import option_spelling, resolve_target

        try:  # errors name the options as typed
            options["gpu"] = resolve_target(request.gpu, request.gpu_memory, spell=option_spelling)
        except (ValueError, TypeError) as exc:
            raise RequestError(str(exc)) from None
    if request.gpus_per_node is not None and request.world_size is None:
        raise RequestError("--gpus-per-node K is the size of a job's nodes: give --world-size N "
                           "too")
    if request.world_size is not None:
        if name != "sim":
            raise RequestError("--world-size makes the simulated GPU one rank of a job: "
                               "add --backend sim")
        if request.world_size < 2:
            raise RequestError(f"--world-size is a number of GPUs, 2 or more, not "
                               f"{request.world_size}")
        options["world_size"] = request.world_size
        if request.rank is not None:
            if not 0 <= request.rank < request.world_size:
                raise RequestError(f"--rank is one of the job's ranks, 0 to "
                                   f"{request.world_size - 1}, not {request.rank}")
            options["rank"] = request.rank
        if request.gpus_per_node is not None:
            from .backends.sim import check_gpus_per_node

            try:
                options["gpus_per_node"] = check_gpus_per_node(request.world_size,
                                                               request.gpus_per_node)
            except ValueError as exc:
                raise RequestError(f"--gpus-per-node {request.gpus_per_node}: {exc}") from None
        if request.mailbox is not None:
            options["mailbox"] = request.mailbox
        persistent = False  # its process group ends with the run: on a copy of the card
    if name == "sim" and request.session is not None:
        options["session" if persistent else "start_from"] = request.session
    options.update(_sim_run_options(request, name))
    if real_cuda:
        if request.device is not None:
            options["device"] = request.device
        if not request.breakdown:
            options["breakdown"] = False
    elif not request.breakdown:
        raise RequestError("--no-breakdown applies to --backend cuda only")
    return name, {**options, **request.backend_options}


def _backend(request: CellRequest):
    name, options = backend_spec(request)
    try:
        return get_backend(name, **options)
    except (BackendUnavailable, ValueError, TypeError) as exc:  # the cause: the backend's own
        raise RequestError(str(exc)) from exc


def make_cell(request: CellRequest, *, isolated: bool = True, leave_out: tuple[str, ...] = ()):
    """The what-if engine (:class:`memmagic.whatif.engine.Cell`) of this request: its knobs are the
    baseline; ``isolated`` runs leave the namespace's names as they were and start from a
    copy of the notebook's simulated GPU (``leave_out``: names whose simulated objects that
    copy goes without)."""
    from .whatif.engine import Cell
    from .whatif.knobs import Setting, for_backend_option

    values, cell_options = knob_values(request.knobs)
    name, options = backend_spec(request, persistent=not isolated)
    if leave_out and "start_from" in options:
        options["leave_out"] = leave_out
    card = for_backend_option("gpu")  # the knob that stands for the sim backend's gpu=
    if isolated and name == "sim" and request.gpu and not request.gpu_memory and card:
        try:  # a card of the table: the panel's target GPU knob starts there
            Setting(**{card.name: request.gpu})
        except KnobError:
            pass
        else:
            values[card.name] = request.gpu
            options.pop("gpu", None)
    try:
        return Cell(request.source, request.namespace, backend=name, backend_options=options,
                    defaults=values, isolated=isolated, compile=_compiled(request),
                    **cell_options)
    except (KnobError, ValueError, TypeError) as exc:
        raise RequestError(str(exc)) from None


def _compiled(request: CellRequest) -> Callable[[str], Callable[[dict], Any]] | None:
    """How the engine compiles the request's source: to its run, and other text (the cell
    with a number set, :mod:`memmagic.whatif.literals`) as that run was compiled (the
    magic's: IPython's transforms, its ``recompile``); ``fixed`` where the run is not the
    source's to recompile (a script's, which sets its knobs itself)."""
    run = request.run
    if run is None:
        return None
    again = getattr(run, "recompile", None)

    def compiled(source: str) -> Callable[[dict], Any]:
        return run if again is None or source == request.source else again(source)

    compiled.fixed = again is None  # type: ignore[attr-defined]
    return compiled


# -- one run --------------------------------------------------------------------------------
def run_cell(request: CellRequest) -> CellResult:
    """Run the request's cell once and return its :class:`CellResult`.

    Raises :class:`RequestError` when the request cannot run as asked (a bad option, a
    measurement inside a simulated one, a card too small to start); the cell's own
    exception is returned, never raised (a Ctrl-C too, with no advice: the caller raises
    it). While it runs, a Ctrl-C waits for memmagic's bookkeeping to end
    (:mod:`memmagic.core.interrupts`)."""
    with guarded(strict=request.backend == "sim"):
        return _run_cell(request)


def _run_cell(request: CellRequest) -> CellResult:
    from .backends.sim import SimulationError

    values, cell_options = knob_values(request.knobs)
    backend = _backend(request)
    before = _doctor_snapshot(request)
    # a rank of a job runs on a copy of the notebook's card: its names do not land (they
    # would name objects of a card and a process group that end with the run)
    isolated = request.world_size is not None
    try:
        if values or cell_options:
            outcome = make_cell(request, isolated=isolated).execute(quiet=False)  # the user's
        else:
            ns = dict(request.namespace) if isolated else request.namespace
            outcome = backend.execute(_runner(request), ns)
    except (KnobError, SimulationError) as exc:  # refused before the cell ran
        raise RequestError(str(exc)) from exc
    if isinstance(outcome.error, KnobError):  # memmagic's, in the run: a knob that cannot
        release_own_frames(outcome.error.__traceback__)  # apply to this cell
        raise RequestError(str(outcome.error)) from None
    report = replace(_with_notes(outcome, request, backend), unit=request.unit)
    error = outcome.error
    if error is not None:  # before the doctor reads the traceback's frames
        release_own_frames(error.__traceback__)
    advice = None if is_interrupt(error) else _advise(request, report, error, before)
    if advice is not None:
        report = replace(report, advice=advice)
    if error is not None:
        if is_out_of_memory(error):
            _release_failed_cell(error)
        error = error.with_traceback(strip_own_frames(error.__traceback__, error))
    return CellResult(report, outcome.value, error)


def _runner(request: CellRequest) -> Callable[[dict], Any]:
    if request.run is not None:
        return request.run
    from .whatif.engine import compile_cell

    return compile_cell(request.source)


def _with_notes(outcome: Outcome, request: CellRequest, backend: Any) -> MemoryReport:
    """The report with the notes on what the options made of the run (data: a kind each)."""
    report, error = outcome.report, outcome.error
    notes: list[Note] = []
    if request.backend == "auto" and backend.name == "cpu":
        notes.append(Note("auto picked the cpu backend: no usable CUDA GPU here "
                          f"(use {request.simulate} to predict what a GPU would use)", "backend"))
    target = getattr(backend, "target", None)
    card = getattr(target, "resized_from", None)
    if request.gpu and request.gpu_memory and card is not None:
        notes.append(Note(f"--gpu-memory {request.gpu_memory} replaced the {card.name}'s "
                          f"{format_bytes(card.total_memory)}: simulated as {target.name}, "
                          f"with the {card.name}'s kernels", "card"))
    if error is not None and backend.name != "sim" and needs_missing_cuda(error):
        notes.append(Note("the cell needs a CUDA GPU, which this machine lacks: "
                          f"{request.simulate} runs it on a simulated one", "backend"))
        add_note_once(error, NO_GPU_HINT.format(how=request.simulate))
    if not notes:
        return report
    own = report.notes
    if any(n.kind == "card" for n in notes):  # said with the options as typed instead
        own = tuple(n for n in own if n.kind != "card")
    return replace(report, notes=own + tuple(notes))


def _release_failed_cell(error: BaseException) -> None:
    """Free what the failed cell's frames hold so that the next cell can run."""
    doctor.release_failed_cell(error)  # clears the frames (and f_locals snapshots)
    traceback.clear_frames(error.__traceback__)
    gc.collect()


# -- the memory doctor ------------------------------------------------------------------------
def _sim_session(request: CellRequest) -> Any:
    return request.session if request.backend == "sim" else None


def _doctor_snapshot(request: CellRequest):
    """What the namespace holds before the cell (--advise lists what the cell left)."""
    return doctor.before_cell(request.namespace, _sim_session(request)) if request.advise else None


def _advise(request: CellRequest, report: MemoryReport, error: BaseException | None,
            before: Any) -> Any:
    """The doctor's advice: with ``advise`` always; after a failed cell, the short one (an
    out of memory on the simulated GPU is ranked too: its re-runs are cheap, through the
    engine :func:`ranking_engine` gives)."""
    ranked = request.rank_fixes and bool(request.source) and (request.advise
                                                               or request.backend == "sim")
    try:
        return doctor.after_cell(request.namespace, report, error, full=request.advise,
                                 session=_sim_session(request), since=before,
                                 engine=(lambda: _ranking_cell(request)) if ranked else None,
                                 bound=_bound_names(request) if error is not None else (),
                                 unit=request.unit)
    except RequestError:
        return None
    except Exception as exc:  # the doctor never hides the cell's own outcome
        print(f"memmagic: the memory doctor could not advise on this cell "
              f"({type(exc).__name__}: {exc})", file=sys.stderr)
        return None


def ranking_engine(source: str, namespace: Mapping[str, Any] | None = None, *,
                   gpu: str | None = None, gpu_memory: int | str | None = None):
    """The what-if engine the doctor ranks fixes of ``source`` with: the cell on the
    simulated GPU (``gpu``/``gpu_memory``: its card), leaving ``namespace`` as it was."""
    request = CellRequest(source, dict(namespace or {}), backend="sim", gpu=gpu,
                          gpu_memory=None if gpu_memory is None else str(gpu_memory))
    return make_cell(request, isolated=True)


def _bound_names(request: CellRequest) -> list[str]:
    """The names the cell's source binds in the notebook's namespace (none for a function
    run)."""
    from .whatif.engine import assigned_names

    return sorted(assigned_names(request.source)) if request.source else []


def _ranking_cell(request: CellRequest):
    """The engine the doctor ranks fixes with: the cell as it ran on the simulated GPU (a
    card of the real one's size after a real out of memory), from the state before the cell
    ran (what it bound before failing, a model it builds, stays out of the copy)."""
    sim = request
    if request.backend != "sim":
        sim = replace(request, backend="sim", gpu=None, gpu_memory=_real_card_memory(request),
                      device=None, breakdown=True)
    # with the request's knobs: the fixes are for what ran (--batch-size 64), not the text
    return make_cell(sim, isolated=True, leave_out=tuple(_bound_names(request)))


def _real_card_memory(request: CellRequest) -> str | None:
    import torch

    try:
        if torch.cuda.is_available():
            dev = request.device if request.device is not None else torch.cuda.current_device()
            return str(torch.cuda.get_device_properties(dev).total_memory)
    except Exception:
        pass
    return None
