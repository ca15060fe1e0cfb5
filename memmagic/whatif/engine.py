"""The what-if engine: a cell's code held as an object that re-runs under a backend with a
set of knobs and returns a :class:`~memmagic.report.MemoryReport`.

The magic, the what-if panel, the sweep and the batch-size finder all run code through
:class:`Cell`; nothing else re-runs it. Knows nothing of IPython or widgets.

How a cell receives knobs (the convention): a cell that reads one of the plain variables
``batch_size``, ``accum_steps``, ``micro_batch_size``, ``amp``, ``checkpointing``,
``weights_dtype``, ``grad_mode``, ``offload``, ``optimizer_name``, ``inplace``,
``gpu_name`` (and does not assign it itself) handles that knob: the variable holds the
setting's value while the cell runs (``amp`` is None, ``torch.float16`` or
``torch.bfloat16``; ``weights_dtype`` a torch dtype or None; ``batch_size`` the effective
batch, or the micro-batch when memmagic applies the accumulation). A Python function
cell receives the same names as keyword arguments it declares. Every other knob memmagic
applies itself (see :mod:`memmagic.whatif.knobs`).

>>> cell = Cell("x = torch.randn(batch_size, 1024, device='cuda', requires_grad=True)\\n"
...             "(x * 2).sum().backward()", {"torch": torch}, defaults={"batch_size": 8})
>>> cell.run(batch_size=64).peak > cell.run().peak
True
"""

from __future__ import annotations

import ast
import inspect
import re
import traceback
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from ..backends import Outcome, get_backend
from ..core.failures import release_own_frames, strip_own_frames
from ..core.interrupts import guarded, is_interrupt
from ..core.patching import output_captured
from .apply import Applier
from .literals import Numbers, module_scope
from .knobs import (BATCH_DIM, KNOBS, SEQ_DIM, Knob, KnobError, Setting, accumulating,
                    knob_value, resizing, setting_of)
from ..report import MemoryReport, Note

__all__ = ["Cell", "RunInfo", "KnobError", "Setting", "EXTRA_VARIABLES", "source_names",
           "assigned_names", "compile_cell"]

# variables a cell may read beside the knobs' own: the batch of one micro-step
MICRO_BATCH = "micro_batch_size"
EXTRA_VARIABLES = (MICRO_BATCH,)
_MISSING = object()


@dataclass
class RunInfo:
    """What one run of a cell did (which knobs can apply to it)."""

    models: list[str] = field(default_factory=list)      # class names of models called
    blocks: int = 0                                      # blocks checkpointing can wrap
    inplace_modules: int = 0
    quantized: bool = False                              # a model holds quantized weights
    optimizers_built: list[str] = field(default_factory=list)
    backward_calls: int = 0
    steps_begun: int = 0                                 # optimizer steps that started
    generate_calls: int = 0                              # transformers generate() calls
    # (enabled, dtype) of autocast at the models' outermost calls, by the cell's own code
    autocast_at_calls: frozenset = frozenset()
    built: list[str] = field(default_factory=list)       # names bound to models/optimizers it made
    batch_names: tuple[str, ...] = ()                    # namespace batch tensors it resized
    seq_names: tuple[str, ...] = ()                      # namespace token tensors it resized
    sim: bool = False
    reads: frozenset[str] = frozenset()                  # knob variables the cell reads
    batch_known: bool = False                            # a batch size to start from exists
    seq_known: bool = False                              # a sequence length to start from exists
    notes: list[str] = field(default_factory=list)       # how memmagic applied the knobs
    module_classes: set[str] = field(default_factory=set)  # classes of the models' modules


def compile_cell(source: str, *, filename: str = "<what-if cell>",
                 parse: Callable[..., ast.Module] | None = None,
                 transform: Callable[[ast.Module], ast.Module] | None = None,
                 compiler: Callable[..., Any] = compile,
                 recompile: Callable[[str], Any] | None = None) -> Callable[[dict], Any]:
    """``run(ns)`` for a cell's source: exec it in ``ns``; the last expression is the value.

    Raises SyntaxError before running any of it. ``parse``, ``transform`` and ``compiler``
    default to plain Python; the magic passes IPython's (its AST transformers, its cache
    of cell sources for tracebacks), and ``recompile``, kept as ``run.recompile``: how
    other text is compiled the same way (the cell with a number set, for a what-if)."""
    tree = parse(source, filename=filename) if parse is not None else ast.parse(source, filename)
    if transform is not None:
        tree = transform(tree)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    body = compiler(tree, filename, "exec")
    tail = compiler(last, filename, "eval") if last is not None else None

    def run(ns: dict) -> Any:
        __tracebackhide__ = True
        exec(body, ns)
        return eval(tail, ns) if tail is not None else None

    if recompile is not None:
        run.recompile = recompile  # type: ignore[attr-defined]
    return run


def source_names(source: str) -> tuple[set[str], set[str]]:
    """(names the code loads, names it assigns); a regex guess where it does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        words = set(re.findall(r"(?<![\w.])([A-Za-z_]\w*)", source))
        stored = set(re.findall(r"(?<![\w.])([A-Za-z_]\w*)\s*=(?!=)", source))
        return words, stored
    loads, stores = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loads if isinstance(node.ctx, ast.Load) else stores).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stores.add(node.name)
        elif isinstance(node, ast.arg):
            stores.add(node.arg)
    return loads, stores


def namespace_reads(source: str) -> set[str]:
    """The names the code reads from the namespace it runs in: loaded in its own (module)
    scope or as globals inside its functions, classes and comprehensions, less those it
    binds there itself; a function's parameters and locals are not (``def f(model): ...``
    then ``f(model)`` reads ``model``). SyntaxError where it does not parse."""
    import symtable

    top = symtable.symtable(source, "<cell>", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    reads: set[str] = set()
    tables = [top]
    while tables:
        table = tables.pop()
        for sym in table.get_symbols():
            if sym.is_referenced() and (table is top or sym.is_global()):
                reads.add(sym.get_name())
        tables.extend(table.get_children())
    return reads - bound


def assigned_names(source: str) -> set[str]:
    """The names the code binds in its own (module) scope: what is left in the namespace
    after it ran, not a function's locals or a comprehension's variables; the regex guess
    of :func:`source_names` where it does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source_names(source)[1]
    out: set[str] = set()
    for node in module_scope(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            out.add(node.id)
    return out


def _code_names(fn: Callable) -> set[str]:
    out: set[str] = set()
    todo = [getattr(inspect.unwrap(fn), "__code__", None)]
    while todo:
        code = todo.pop()
        if code is None:
            continue
        out.update(code.co_names)
        todo.extend(c for c in code.co_consts if inspect.iscode(c))
    return out


def _batch_tensors(value: Any) -> list:
    """The tensors of a batch-like value (a tensor, or a tuple/list/dict of tensors)."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value] if value.dim() >= 1 else []
    if isinstance(value, (tuple, list)):
        items = list(value)
    elif isinstance(value, dict):
        items = list(value.values())
    else:
        return []
    if not items or not all(isinstance(t, torch.Tensor) for t in items):
        return []
    return [t for t in items if t.dim() >= 1]


def _sized_tensors(value: Any, dim: int) -> list:
    """The tensors of a batch-like value that have dimension ``dim``: for the batch (0)
    every tensor, for the sequence (1) the token tensors (integer or bool, [batch, seq]:
    ids, masks, labels; float tensors and images are not tokens)."""
    ts = _batch_tensors(value)
    return ts if dim == 0 else [t for t in ts if _is_tokens(t)]


def _is_tokens(t: Any) -> bool:
    """Whether ``t`` looks like token ids, a mask or labels: integer or bool, [batch, seq]."""
    return t.dim() == 2 and not t.is_floating_point() and not t.is_complex()


def _resize(value: Any, size: int, n: int, dim: int = 0) -> Any:
    """``value`` with its tensors whose dimension ``dim`` is ``size`` resized to ``n``
    along it (cut, or repeated cyclically when growing)."""
    import torch

    def one(t):
        if (not isinstance(t, torch.Tensor) or t.dim() <= dim or t.shape[dim] != size
                or n == size or (dim and not _is_tokens(t))):
            return t
        idx = torch.arange(n, device=t.device) % size
        return t.index_select(dim, idx)

    if isinstance(value, torch.Tensor):
        return one(value)
    if isinstance(value, tuple):
        return type(value)(*map(one, value)) if hasattr(value, "_fields") else tuple(map(one, value))
    if isinstance(value, list):
        return [one(t) for t in value]
    out = type(value)(value) if isinstance(value, dict) else value
    for k, v in value.items():
        out[k] = one(v)
    return out


def _backend_options(options: Mapping[str, Any] | None, gpu: str | None) -> dict[str, Any]:
    """A Cell's ``backend_options`` with its ``gpu=`` in them."""
    out = dict(options or {})
    if gpu is not None:
        if out.get("gpu", gpu) != gpu:
            raise ValueError(f"Cell was given gpu={gpu!r} and backend_options with gpu="
                             f"{out['gpu']!r}: give the card once")
        out["gpu"] = gpu
    return out


class Cell:
    """A cell's code (source text or a Python function) that re-runs under a backend with
    knobs: :meth:`run` returns the :class:`MemoryReport` of one setting.

    ``namespace``: the globals the code runs in (a notebook's ``user_ns``; a function's
    own globals by default). ``backend``: "sim" (default: a simulated CUDA GPU, fast,
    touches nothing real), "cpu", "cuda" or "auto"; ``backend_options`` go to it
    (``gpu=``, ``gpu_memory=``, ``session=``; ``start_from=`` a notebook's simulated GPU
    that every run starts from a copy of, for cells that use objects earlier simulated
    cells left there). ``defaults``: the baseline setting (a
    :class:`Setting` or a dict of knob values; the magic line's options). ``isolated``
    (default): every run leaves the namespace's names as it found them (names the cell
    makes are removed afterwards); on a real backend the objects the cell works on are
    still changed for real (a training step trains the model). ``compile``: turns
    source into ``run(ns)`` (the magic passes IPython's, with its transforms).
    ``checkpoint_module``: the class name of the blocks checkpointing wraps (default:
    the repeated children of a ModuleList / Sequential). ``gpu``: the card, as
    ``backend_options={"gpu": ...}`` (``fit_map(cell, gpu=...)`` takes it so too).
    """

    def __init__(self, code: str | Callable[..., Any], namespace: dict | None = None, *,
                 backend: str = "sim", backend_options: Mapping[str, Any] | None = None,
                 defaults: Setting | Mapping[str, Any] | None = None, isolated: bool = True,
                 compile: Callable[[str], Callable[[dict], Any]] | None = None,
                 checkpoint_module: str | None = None, gpu: str | None = None) -> None:
        if isinstance(code, str):
            if not code.strip():
                raise ValueError("a Cell needs code to run")
            self.source: str | None = code
            self.function: Callable[..., Any] | None = None
            self._compile = compile or compile_cell
            self._run = self._compile(code)
            loads, stores = source_names(code)
            self.names = loads
            self.namespace = namespace if namespace is not None else {}
        elif callable(code):
            self.source, self.function = None, code
            self._run = self._compile = None
            try:
                params = set(inspect.signature(code).parameters)
            except (TypeError, ValueError):
                params = set()
            loads, stores = params, set()
            self.names = _code_names(code)
            if namespace is None:
                g = getattr(inspect.unwrap(code), "__globals__", None)
                namespace = g if isinstance(g, dict) else {}
            self.namespace = namespace
        else:
            raise TypeError(f"a Cell runs source text or a function, not {type(code).__name__}")
        variables = {k.var for k in KNOBS.values()} | set(EXTRA_VARIABLES)
        # a variable the cell assigns itself is the cell's, not a knob; a compiled run may
        # name the variables it takes in other ways (a script: from its command line)
        extra = set(getattr(self._run, "knob_reads", ()))
        # a size the cell sets once to a number written out (batch_size = 64) is a knob it
        # takes there: a run at another value runs the cell with that number replaced; not
        # where ``compile`` is ``fixed`` (a run of its own, a script's, sets its own)
        fixed = self.source is None or getattr(self._compile, "fixed", False)
        self.numbers = Numbers(None if fixed else self.source, self._compile, self.namespace)
        self.assigned = self.numbers.at
        self.reads: frozenset[str] = frozenset(
            ((loads - stores) | extra | set(self.assigned)) & variables)
        self.backend_name = backend
        self.backend_options = _backend_options(backend_options, gpu)
        self.isolated = bool(isolated)
        self.checkpoint_module = checkpoint_module
        if isinstance(defaults, Setting):
            base = defaults
        else:
            base = Setting(**dict(defaults or {}))
        self.asked = base  # the setting the caller asked for (the magic's knob options)
        for knob in KNOBS.values():
            if knob.resize is not None and getattr(base, knob.name) is None:
                size = self._default_size(knob)
                if size is not None:
                    base = base.replace(**{knob.name: size})
        self.baseline: Setting = self._option_settings(self._own_settings(base))
        self.last_info: RunInfo | None = None
        self.last_output = ""  # what the last run printed (a re-run's output is kept here)
        self.fallback_note: Note | None = None

    def _own_settings(self, base: Setting) -> Setting:
        """``base`` with the knobs the cell handles itself at what its own variables say
        (``amp = True`` in the namespace: the cell as written runs with AMP), where the
        baseline does not set them."""
        if self.function is not None:
            return base
        given = base.changed()
        own = {}
        # a compiled run may say the values it starts from (a script: its command line's),
        # which come before the namespace's
        start = getattr(self._run, "initial_values", None)
        values = {var: value for var, (_, value) in self.assigned.items()}
        values.update(start() if start is not None else {})
        for knob in KNOBS.values():
            var = knob.var
            if var in self.reads and knob.name not in given and (var in values
                                                                 or var in self.namespace):
                value = setting_of(knob.name, values[var] if var in values
                                   else self.namespace[var])
                if value is not None:
                    own[knob.name] = value
        return base.replace(**own) if own else base

    def _option_settings(self, base: Setting) -> Setting:
        """``base`` with the knobs that stand for a backend option at the option's value
        (``gpu="T4"``: the target GPU knob starts at T4), where the baseline does not set
        them and no option they replace is given (``gpu_memory``)."""
        options = self.backend_options
        for knob in KNOBS.values():
            given = options.get(knob.backend.option) if knob.backend is not None else None
            if not isinstance(given, str) or knob.name in base.changed() or \
                    any(o in options for o in knob.backend.replaces):
                continue
            try:
                base = base.replace(**{knob.name: given})
            except KnobError:
                pass
        return base

    # -- public ---------------------------------------------------------------------------
    def applying_knobs(self, why: str) -> "Cell":
        """A copy of this cell in which memmagic applies the knobs whose variables the cell
        reads (its batch size and accumulation steps excepted): for a cell that fails with
        its own variables set to a setting's values. ``why`` goes into its runs' notes."""
        import copy

        other = copy.copy(self)
        keep = {resizing(BATCH_DIM).var, MICRO_BATCH, accumulating().var}
        other.reads = frozenset(self.reads & keep)
        dropped = sorted(k.name for k in KNOBS.values() if k.var in self.reads - keep)
        other.baseline = Setting(**{k: v for k, v in self.baseline.changed().items()
                                    if k not in dropped})
        other.fallback_note = Note(f"memmagic applies {', '.join(dropped)} itself: {why}", "knob")
        other.last_info = None
        return other

    def setting(self, setting: Setting | Mapping[str, Any] | None = None, **knobs: Any) -> Setting:
        """The full setting of a run: ``setting`` when it is a :class:`Setting` (complete:
        a knob it leaves at its default is at its default, whatever the baseline says),
        else the baseline updated with ``setting`` (a mapping); then ``knobs``."""
        if isinstance(setting, Setting):
            values = setting.changed()
        else:
            values = self.baseline.changed()
            values.update(setting or {})
        values.update(knobs)
        return Setting(**values)

    def run(self, setting: Setting | Mapping[str, Any] | None = None, *, strict: bool = False,
            **knobs: Any) -> MemoryReport:
        """Re-run the cell under ``setting`` (and/or knob keywords) and return its report.

        The cell's own exception never propagates: the report says it failed
        (``report.error``; an out-of-memory run has ``fits`` False); a Ctrl-C does. A setting that cannot
        apply raises :class:`KnobError` (with ``strict``, also one found only in the run:
        the cell names no batch or token tensor to resize)."""
        outcome = self.execute(setting, **knobs)
        error = outcome.error
        if error is not None:
            release_own_frames(error.__traceback__)
            if is_interrupt(error):  # a Ctrl-C stops whoever asked for the run
                del outcome
                raise error.with_traceback(strip_own_frames(error.__traceback__, error))
            traceback.clear_frames(error.__traceback__)
        report = outcome.report
        cannot = str(error) if strict and isinstance(error, KnobError) else None
        del outcome, error
        if cannot is not None:  # found in the run: the cell names no batch, no token tensor
            raise KnobError(cannot)
        return report

    def execute(self, setting: Setting | Mapping[str, Any] | None = None, *, quiet: bool = True,
                **knobs: Any) -> Outcome:
        """Run once: the backend's :class:`~memmagic.backends.Outcome` (report, the cell's
        value, its exception, for the caller to re-raise). ``quiet``: what the run prints
        is kept in :attr:`last_output`, not shown (a re-run for a what-if, a sweep or the
        doctor, which the user did not run); False for the user's own run."""
        full = self.setting(setting, **knobs)
        full.check_batch()
        if full.micro_steps > 1 and full.effective_batch is None:
            raise KnobError(accumulating().sizes.missing)
        backend = self._backend(full)

        def known(dim: int) -> bool:  # a size to start from
            name = resizing(dim).name
            return getattr(self.baseline, name) is not None or getattr(full, name) is not None

        info = RunInfo(sim=backend.name == "sim", reads=self.reads, batch_known=known(BATCH_DIM),
                       seq_known=known(SEQ_DIM))
        ns = self.namespace
        saved = dict(ns) if self.isolated else None
        run = self._runner(full, info, "cpu" if backend.name == "cpu" else "cuda")
        try:
            with guarded(strict=backend.name == "sim"), ExitStack() as stack:
                printed = stack.enter_context(output_captured()) if quiet else None
                outcome = backend.execute(run, ns)
            self.last_output = printed.getvalue() if printed is not None else ""
        finally:
            if saved is not None:
                _restore_names(ns, saved)
            del saved
        self.last_info = info
        self._check_checkpoint_module(full, info, outcome)
        notes = list(info.notes)
        handled = sorted(k.name for k in KNOBS.values() if k.var in self.reads)
        if full != Setting():
            notes.insert(0, Note(f"what-if setting: {full.label()}", "setting"))
        if handled:
            notes.append(Note("handled by the cell itself: " + ", ".join(handled), "handled"))
        if self.fallback_note is not None:
            notes.append(self.fallback_note)
        if notes:
            outcome.report = replace(outcome.report, notes=outcome.report.notes + tuple(notes))
        return outcome

    def _check_checkpoint_module(self, setting: Setting, info: RunInfo, outcome: Outcome) -> None:
        """KnobError when the module class checkpointing was told to wrap is in none of
        the models the run called (a typo must not pass for a setting that changed nothing)."""
        name = self.checkpoint_module
        if name is None or not setting.checkpointing or not info.models or info.blocks:
            return
        if outcome.error is not None:
            release_own_frames(outcome.error.__traceback__)
        classes = ", ".join(sorted(info.module_classes)) or "none"
        raise KnobError(f"--checkpointing {name}: no module of class {name} in "
                        f"{', '.join(sorted(set(info.models)))}; its module classes: {classes}")

    def applicable(self, info: RunInfo | None = None, *,
                   setting: Setting | Mapping[str, Any] | None = None) -> list[str]:
        """The knobs that apply to this cell, judged from a run (``info``; else the last
        run; else a run of ``setting``, the baseline by default): those whose variable the
        cell reads, and those memmagic can apply to what the run did."""
        info = info or (self.last_info if setting is None else None)
        if info is None:
            self.run(setting)
            info = self.last_info
        assert info is not None
        return [k.name for k in KNOBS.values() if k.var in self.reads or k.applies(info)]

    # -- internals ----------------------------------------------------------------------------
    def _default_size(self, knob: Knob) -> int | None:
        """The size a knob that resizes the cell's tensors (the batch size, the sequence
        length) has as written: the namespace's variable when the cell reads it, else the
        size of the tensors it names (the batch's first dimension, the token tensors'
        second)."""
        ns = self.namespace
        if knob.var in self.reads:
            v = ns.get(knob.var)
            return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None
        names = self._sized_names(knob)
        return names[1] if names else None

    def _sized_names(self, knob: Knob) -> tuple[tuple[str, ...], int] | None:
        """(names, size) of the namespace values the cell names that look like the data
        ``knob`` resizes: its batch (``BATCH_DIM``: tensors, or tuples/lists/dicts of them,
        sharing the most common first dimension) or its tokens (``SEQ_DIM``: integer or
        bool tensors sharing the most common second dimension); sizes above the knob's
        highest value are not its."""
        ns = self.namespace
        dim = knob.resize
        assert dim is not None
        start = self.backend_options.get("start_from")
        sim = start.visible(ns) if start is not None else {}
        for name in self.backend_options.get("leave_out", ()):
            sim.pop(name, None)  # not on the copy the runs start from
        if sim:  # outside a run: the simulated objects stand for their placeholders
            ns = {**ns, **sim}
        firsts: Counter = Counter()
        cands: dict[str, list] = {}
        for name in sorted(self.names):
            if name.startswith("_") or name not in ns:
                continue
            high = knob.high or 0
            ts = [t for t in _sized_tensors(ns[name], dim) if t.shape[dim] <= high]
            if ts:
                cands[name] = ts
                firsts.update({t.shape[dim] for t in ts})
        if not firsts:
            return None
        size = firsts.most_common(1)[0][0]
        names = tuple(n for n, ts in cands.items() if any(t.shape[dim] == size for t in ts))
        return names, size

    def _backend(self, setting: Setting):
        """The backend of a run, with the options the setting's knobs stand for (the target
        card) set, or taken away where the setting leaves them as written."""
        options = dict(self.backend_options)
        for knob in KNOBS.values():
            by = knob.backend
            if by is None:
                continue
            value, base = getattr(setting, knob.name), getattr(self.baseline, knob.name)
            if value is not None and self.backend_name != by.backend:
                raise KnobError(by.elsewhere)
            if value is not None and (value != base or by.option not in options):
                options[by.option] = value
            elif value is None and base is not None:
                options.pop(by.option, None)
            else:
                continue
            for other in by.replaces:
                options.pop(other, None)
        return get_backend(self.backend_name, **options)

    def _runner(self, setting: Setting, info: RunInfo, device_type: str) -> Callable[[dict], Any]:
        """The run of this cell with ``setting``: ``run(ns)``, and ``run.prepare(ns)``,
        which a backend calls before its measurement starts (the knobs' setup that a user
        does before the cell, such as weights loaded in another dtype); a run whose
        backend did not call it prepares at its start."""
        cell = self
        prepared: list[Applier] = []

        def prepare(ns: dict) -> None:
            applier = Applier(device_type, checkpoint_module=cell.checkpoint_module)
            # a run on a copy of the notebook's simulated GPU changes nothing it must put back
            applier.on_copy = cell.backend_options.get("start_from") is not None
            prepared.append(applier)
            try:
                for knob in KNOBS.values():
                    if knob.apply is not None and knob.var not in cell.reads:
                        knob.apply(applier, getattr(setting, knob.name))
                applier.prepare({k: ns[k] for k in sorted(cell.names) if k in ns})
            except BaseException:
                applier.close()
                raise

        def run(ns: dict) -> Any:
            __tracebackhide__ = True
            if not prepared:
                prepare(ns)
            applier = prepared[-1]
            changed: dict[str, Any] = {}
            try:
                return cell._run_with(ns, setting, applier, changed, info)
            finally:
                for k, old in changed.items():
                    if old is _MISSING:
                        ns.pop(k, None)
                    else:
                        ns[k] = old
                changed.clear()
                info.models = list(applier.models)
                info.blocks = applier.blocks
                info.module_classes = set(applier.module_classes)
                info.inplace_modules = applier.inplace_modules
                info.quantized = applier.quantized_models > 0
                info.optimizers_built = list(applier.optimizers_built)
                info.backward_calls = applier.backward_calls
                info.steps_begun = applier.steps_begun
                info.generate_calls = applier.generate_calls
                info.autocast_at_calls = frozenset(applier.autocast_at_calls)
                try:
                    applier.close()
                finally:
                    info.notes = list(applier.notes)

        run.prepare = prepare  # type: ignore[attr-defined]
        return run

    def _run_with(self, ns: dict, setting: Setting, applier: Applier, changed: dict,
                  info: RunInfo) -> Any:
        __tracebackhide__ = True
        reads = self.reads
        k = setting.micro_steps
        engine_accum = k > 1 and accumulating().var not in reads
        batch = setting.micro_batch if engine_accum else setting.effective_batch
        applier.install()
        values = self._variables(setting, batch)
        for var, value in self.numbers.changed(values).items():
            line = self.assigned[var][0]
            applier.note(f"{var} {value}: set where the cell sets it (line {line}: "
                         f"{self.numbers.written(var)} as written)")
        if self.function is None:
            for name, v in values.items():
                changed.setdefault(name, ns.get(name, _MISSING))
                ns[name] = v
        # the sizes the cell does not make itself: the namespace's tensors it names
        seq, batch_knob = resizing(SEQ_DIM), resizing(BATCH_DIM)
        seq_len = getattr(setting, seq.name)
        if seq_len is not None and seq.var not in reads:
            info.seq_names = self._resize_sized(ns, seq, seq_len, applier, changed)
        if batch is not None and not reads & {batch_knob.var, MICRO_BATCH}:
            info.batch_names = self._resize_sized(ns, batch_knob, batch, applier, changed)
        if not engine_accum:
            before = _existing(ns)
            try:
                return self._call(ns, values)
            finally:  # a run that failed (out of memory) built them too
                info.built = _built(ns, before)
        return self._accumulate(ns, values, setting, applier, info)

    def _accumulate(self, ns: dict, values: dict[str, Any], setting: Setting, applier: Applier,
                    info: RunInfo) -> Any:
        """Run the cell once per micro-step, the optimizer's steps held back until the last
        and the gradients kept between them."""
        __tracebackhide__ = True
        accum, k = accumulating(), setting.micro_steps
        current = [0]
        applier.gate_steps(lambda: current[0] == k, zero_grad=True)
        applier.note(f"{accum.name} {k}: the cell ran {k} times on micro-batches of "
                     f"{setting.micro_batch} (effective batch {setting.effective_batch}); "
                     "optimizer steps held back and gradients kept until the last micro-step")
        value = None
        for i in range(1, k + 1):
            current[0] = i
            if i > 1:
                value = self._call(ns, values)
                continue
            before = _existing(ns)
            try:
                value = self._call(ns, values)
            finally:  # a first micro-step that failed built them too
                info.built = built = _built(ns, before)
            if built:
                raise KnobError(
                    f"{accum.name}: the cell builds {', '.join(built)} itself, so repeating "
                    f"it per micro-step would build it again: read {accum.var} in the cell "
                    f"(for _ in range({accum.var}): ...) or build it in an earlier cell")
        return value

    def _variables(self, setting: Setting, batch: int | None) -> dict[str, Any]:
        """The values of the knob variables the cell reads, as the cell's variables hold
        them (``batch``: the batch one run of the cell sees)."""
        values: dict[str, Any] = {}
        for knob in KNOBS.values():
            if knob.var in self.reads:
                v = batch if knob.resize == BATCH_DIM else getattr(setting, knob.name)
                if v is None and knob.resize is not None:
                    continue  # as written: the namespace's own batch size / sequence length
                values[knob.var] = knob_value(knob.name, v, self.namespace.get(knob.var))
        if MICRO_BATCH in self.reads and setting.effective_batch is not None:
            values[MICRO_BATCH] = setting.micro_batch
        return values

    def _resize_sized(self, ns: dict, knob: Knob, n: int, applier: Applier, changed: dict
                      ) -> tuple[str, ...]:
        """Resize the namespace's tensors the cell names that ``knob`` sizes (the batch, the
        tokens) to ``n`` along the knob's dimension (the old values go into ``changed``, to
        be put back); their names."""
        dim = knob.resize
        assert dim is not None and knob.sizes is not None
        found = self._sized_names(knob)
        if found is None:
            raise KnobError(knob.sizes.missing)
        names, n0 = found
        if n != n0:
            for name in names:
                changed.setdefault(name, ns[name])
                ns[name] = _resize(ns[name], n0, n, dim)
            applier.note(f"{knob.name} {n}: {', '.join(names)} resized along dim {dim} (from {n0})")
        return names

    def _call(self, ns: dict, values: dict[str, Any]) -> Any:
        __tracebackhide__ = True
        if self.function is not None:
            return self.function(**values)
        assert self._run is not None
        return (self.numbers.compiled(values) or self._run)(ns)


def _existing(ns: dict) -> set[int]:
    """The ids of what the namespace holds before a run: its values, and the modules inside
    them (a model's layers, the items of a ModuleList or of a plain list, tuple or dict of
    modules), so that a loop variable bound to one of those (``for layer in layers:``)
    is not taken for a model the cell built."""
    import torch

    out: set[int] = set()
    for value in ns.values():
        out.add(id(value))
        items = value.values() if isinstance(value, dict) else \
            value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if isinstance(item, torch.nn.Module):
                out.update(id(m) for m in item.modules())
    return out


def _built(ns: dict, before: set[int]) -> list[str]:
    """Names bound to modules or optimizers that were not in the namespace before (see
    :func:`_existing`)."""
    import torch

    return sorted(k for k, v in ns.items() if id(v) not in before
                  and isinstance(v, (torch.nn.Module, torch.optim.Optimizer)))


def _restore_names(ns: dict, saved: dict) -> None:
    """Put the namespace's names back as they were (names made since are removed)."""
    for k in [k for k in ns if k not in saved]:
        del ns[k]
    for k, v in saved.items():
        if ns.get(k, _MISSING) is not v:
            ns[k] = v
