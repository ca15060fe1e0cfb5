"""What-if knobs: the settings a cell can be re-run under, each with how it is applied.

A :class:`Knob` is data: its name (the plain variable a cell reads to handle the knob
itself, see :mod:`memmagic.cell`), its values, its default (the cell as written) and how
memmagic applies it to a cell that does not read the variable. A :class:`Setting` is one
choice of values. Adding a knob is one entry in :data:`KNOBS` (and, when memmagic can
apply it, one small ``apply`` function over an :class:`Applier`).

Knobs and how memmagic applies them where the cell does not read the variable:

================  ============================  =================================================
knob (variable)   values                        applied by memmagic as
================  ============================  =================================================
``amp``           off / fp16 / bf16             autocast from each outermost module call until
                                                the backward (the forward and the loss); fp16
                                                adds a GradScaler (scale, unscale_, update)
``batch_size``    int (effective batch)         tensors of the namespace the cell names whose
                                                first dimension is the batch, resized
``seq_len``       int (tokens per sample)       the token tensors of the namespace the cell
                                                names (integer or bool, [batch, seq, ...]: input
                                                ids, masks, labels) cut or repeated along dim 1
``new_tokens``    int (``max_new_tokens``)      each ``generate()`` call's ``max_new_tokens`` (a
                                                transformers model's)
``accum_steps``   int                           the cell repeated per micro-step on
                                                batch_size / accum_steps, optimizer steps held
                                                back and gradients kept until the last one
``checkpointing`` on / off                      the repeated blocks of each model (children of a
                                                ModuleList / Sequential, or a named module type)
                                                run through torch.utils.checkpoint
``weights_dtype`` fp32 / bf16 / fp16            each model the cell names converted
                                                (``model.to(bfloat16)``) before the measurement, as
                                                if loaded so (put back after the run); a model the
                                                cell makes, at its first call; inputs cast to match
``grad_mode``     train / no_grad /             the cell under torch.no_grad() or
                  inference_mode                torch.inference_mode(), models in eval(), its
                                                backward() calls and optimizer steps skipped
``offload``       on / off                      torch.autograd.graph.save_on_cpu around the cell
``optimizer``     sgd / sgd-momentum / adam /   the optimizer the cell builds (any torch.optim
                  adamw / adafactor             class) replaced by this one, same parameters
``inplace``       on / off                      ``inplace=True`` on activation and dropout
                                                modules that have the flag
``gpu``           a card of the simulated       the simulated backend's target: fits or not
                  device's table
================  ============================  =================================================
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from .patching import Patches
from .report import Note

__all__ = ["Knob", "KNOBS", "NEEDS", "Fixes", "Setting", "Applier", "KnobError", "make_optimizer",
           "AMP_CHOICES", "WEIGHT_DTYPES", "GRAD_MODES", "OPTIMIZERS", "knob_value",
           "setting_of"]

AMP_CHOICES = ("off", "fp16", "bf16")
WEIGHT_DTYPES = ("fp32", "bf16", "fp16")
GRAD_MODES = ("train", "no_grad", "inference_mode")
OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw", "adafactor")
_AS_WRITTEN = "as written"


class KnobError(ValueError):
    """A knob value the cell cannot be run with; the message says what to do instead."""


def _dtype(name: str | None):
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, None: None,
            "off": None}[name]


# -- the knobs --------------------------------------------------------------------------
# What a run of the cell must show for memmagic to apply a knob (``Knob.needs``), judged
# from what the run did (:class:`memmagic.cell.RunInfo`).
NEEDS: dict[str, Callable[[Any], bool]] = {
    "model": lambda info: bool(info.models),                  # a module was called
    "batch": lambda info: info.batch_known,                   # a batch size to start from
    "seq": lambda info: info.seq_known,                       # a sequence length to start from
    "generate": lambda info: info.generate_calls > 0,         # a transformers generate() ran
    "accum": lambda info: info.batch_known and info.backward_calls > 0 and not info.built,
    "blocks": lambda info: info.blocks > 0,                   # repeated blocks to wrap
    "backward": lambda info: info.backward_calls > 0,
    "optimizer": lambda info: bool(info.optimizers_built),    # the cell builds one
    "inplace": lambda info: info.inplace_modules > 0,
    "sim": lambda info: info.sim,                             # the simulated backend
}


@dataclass(frozen=True)
class Fixes:
    """What the memory doctor knows of the cell when it proposes fixes: the batch size and
    the sequence length as written (None: unknown) and the optimizer the cell builds
    (lower-case class name)."""

    batch: int | None = None
    optimizer: str | None = None
    seq: int | None = None


@dataclass(frozen=True)
class Knob:
    """One what-if knob: everything memmagic does with it comes from this entry.

    ``name`` is both the :class:`Setting` field and the variable a cell reads to handle
    the knob itself (``variable`` when they differ); ``default`` is the baseline (the cell
    as written; None means "whatever the cell does"). ``kind`` is "choice", "int" or
    "bool"; ``choices`` the allowed values of a choice (None allowed as the default);
    ``low``/``high`` an int's range. ``how`` says in words how memmagic applies it where
    the cell does not read the variable; ``apply(applier, value)`` does it (None: the
    engine itself applies it: batch size, accumulation, target GPU). ``cell_value`` maps a
    setting's value to what the cell's variable holds (``amp="fp16"`` -> ``torch.float16``).
    ``needs`` names what a run must show for memmagic to apply it (a key of :data:`NEEDS`).

    The front ends read the rest: ``help``/``metavar`` make the magic's ``--flag`` option
    (``help=None``: no option); ``short`` names a set value in a setting's label;
    ``panel`` is the what-if control ("slider", "buttons", "menu", "checkbox"; None: none),
    ``panel_range`` an integer control's (lo, hi), widened to the cell's own value with
    ``panel_grow``; ``unset_label`` names the default None in a menu; ``fixes(Fixes)``
    gives the doctor's candidates as (label, {knob: value}); ``strategy`` (label off,
    label on, value) makes it an axis of a sweep's default strategies.
    """

    name: str
    label: str
    kind: str
    default: Any
    how: str
    choices: tuple = ()
    low: int | None = None
    high: int | None = None
    apply: Callable[["Applier", Any], None] | None = field(default=None, repr=False)
    cell_value: Callable[[Any], Any] | None = field(default=None, repr=False)
    variable: str | None = None
    needs: str = "model"
    help: str | None = None
    metavar: str | None = None
    short: str = ""
    panel: str | None = None
    panel_range: tuple[int, int] | None = None
    panel_grow: bool = False
    unset_label: str = "as written"
    fixes: Callable[[Fixes], list[tuple[str, dict[str, Any]]]] | None = field(default=None, repr=False)
    strategy: tuple[str, str, Any] | None = None
    parse_option: Callable[[str], tuple[Any, dict[str, Any]]] | None = field(default=None, repr=False)

    @property
    def var(self) -> str:
        """The variable a cell reads to handle this knob itself."""
        return self.variable or self.name

    @property
    def flag(self) -> str:
        """The magic's option: ``--batch-size`` for ``batch_size``."""
        return "--" + self.name.replace("_", "-")

    def applies(self, info: Any) -> bool:
        """Whether memmagic can apply this knob to a run that did what ``info`` says."""
        return NEEDS[self.needs](info)

    def values(self) -> tuple:
        """The values a menu offers (the target GPU's: the simulated device's table)."""
        return _gpu_names() if self.name == "gpu" else self.choices

    def argument(self) -> tuple[tuple[str, ...], dict[str, Any]]:
        """(flags, keyword arguments) of the magic's option for this knob."""
        kwargs: dict[str, Any] = dict(default=None, help=self.help)
        if self.parse_option is not None:
            kwargs.update(nargs="?", const="on", metavar=self.metavar)
        elif self.kind == "bool":
            kwargs.update(action="store_true")
        else:
            kwargs.update(metavar=self.metavar or self.name.upper())
        return (self.flag,), kwargs

    def from_option(self, text: Any) -> tuple[Any, dict[str, Any]]:
        """The magic option's text as (value, options for the cell); KnobError names the
        option."""
        if self.parse_option is not None and isinstance(text, str):
            return self.parse_option(text)  # its errors name the option
        try:
            return self.check(text), {}
        except KnobError as exc:
            raise KnobError(f"{self.flag}: {exc}") from None

    def span(self, value: int | None) -> tuple[int, int]:
        """An integer control's range for a cell whose own value is ``value``."""
        lo, hi = self.panel_range or (self.low or 1, self.high or 1)
        if self.panel_grow and value is not None:
            lo, hi = min(lo, value), max(hi, 4 * value)
        return lo, hi

    def check(self, value: Any) -> Any:
        """``value`` validated (and normalised: "on" -> True, "32" -> 32) for this knob."""
        if value is None and self.default is None:
            return None
        if self.kind == "bool":
            if isinstance(value, str) and value.lower() in ("on", "true", "1", "yes"):
                return True
            if isinstance(value, str) and value.lower() in ("off", "false", "0", "no"):
                return False
            if isinstance(value, bool):
                return value
            raise KnobError(f"{self.name} is on or off (True/False), not {value!r}")
        if self.kind == "int":
            try:
                n = int(value)
            except (TypeError, ValueError):
                n = None
            if n is None or isinstance(value, bool) or (isinstance(value, float) and n != value):
                raise KnobError(f"{self.name} needs a whole number, not {value!r}")
            if (self.low is not None and n < self.low) or (self.high is not None and n > self.high):
                raise KnobError(f"{self.name} must be between {self.low} and {self.high}, not {n}")
            return n
        v = value.lower() if isinstance(value, str) else value
        if self.name == "gpu":
            return _check_gpu(value)
        if v not in self.choices:
            raise KnobError(f"{self.name} must be one of {', '.join(map(str, self.choices))}, "
                            f"not {value!r}")
        return v

    def show(self, value: Any) -> str:
        """The value in words, for labels."""
        if value is None:
            return _AS_WRITTEN
        if self.kind == "bool":
            return "on" if value else "off"
        return str(value)


def _check_gpu(value: Any) -> str | None:
    if value is None or (isinstance(value, str) and value.lower() in ("", "none")):
        return None
    from .backends.sim import GPUS

    key = str(value).lower()
    if key not in GPUS:
        raise KnobError(f"gpu must be one of {', '.join(g.name for g in GPUS.values())}, "
                        f"not {value!r}")
    return GPUS[key].name


def _gpu_names() -> tuple[str, ...]:
    try:
        from .backends.sim import GPUS
    except ImportError:  # pragma: no cover
        return ()
    return tuple(g.name for g in GPUS.values())


# -- applying knobs -----------------------------------------------------------------------
class Applier:
    """Installs the knobs memmagic applies around one run of a cell, and takes every
    change away again in :meth:`close` (also after an exception).

    Knob ``apply`` functions call :meth:`around` (a context for the whole run),
    :meth:`at_call` (at each outermost module call: a model), :meth:`patch`,
    :meth:`gate_steps` and :meth:`note`. The applier also records what the run did
    (models called, blocks found, optimizers built, backward calls): the engine uses it to
    tell which knobs apply to a cell."""

    def __init__(self, device_type: str, *, checkpoint_module: str | None = None) -> None:
        self.device_type = device_type  # autocast's device: "cuda" (cuda, sim) or "cpu"
        self.checkpoint_module = checkpoint_module
        self.notes: list[str] = []
        self._undo = Patches()  # every hook, patch and context, undone by close()
        self._at_call: list[tuple[Callable[[Any, tuple], tuple | None], bool]] = []
        self._on_backward: list[Callable[[Any], Any]] = []
        self._depth = 0
        self._seen_roots: set[int] = set()
        self._inside: set[int] = set()  # ids of modules under a root already called
        self._closed = False
        # what the run did
        self.models: list[str] = []          # class names of the models called
        self.blocks = 0                      # blocks checkpointing could wrap
        self.module_classes: set[str] = set()  # classes of the models' modules
        self.inplace_modules = 0             # modules with an inplace flag
        self.optimizers_built: list[str] = []
        self.backward_calls = 0
        self.generate_calls = 0              # transformers generate() calls
        self.steps_run = 0
        self.steps_skipped = 0
        # step gates: an optimizer step runs when every gate says so
        self._gates: list[Callable[[], bool]] = []
        self._zero_gate = False
        self._grads_pending = False  # a backward ran since the last optimizer step that ran
        self._scaler_factory: Callable[[], Any] | None = None
        self._scaler = None
        self._on_leave_forward: list[Callable[[], None]] = []
        self._before_step: list[Callable[[Any], None]] = []
        self._before_run: list[Callable[[dict], None]] = []
        self.on_copy = False  # the run's objects are copies, dropped after it (nothing to undo)
        self.made_in_run: set[int] = set()  # ids of the modules the run made

    # -- the API knobs use ------------------------------------------------------------------
    def note(self, text: str) -> None:
        """Say how a knob was applied (a note of kind "knob" on the run's report), once."""
        if text not in self.notes:
            self.notes.append(Note(text, "knob"))

    def around(self, cm: contextlib.AbstractContextManager) -> None:
        """Enter ``cm`` now, for the whole run; exited by :meth:`close`."""
        self._undo.enter(cm)

    def at_call(self, fn: Callable[[Any, tuple], tuple | None], *, every: bool = False) -> None:
        """Call ``fn(module, args)`` at the first outermost call of each model (not one of
        its submodules), or at every such call with ``every``; it may return new
        positional ``args``."""
        self._at_call.append((fn, every))

    def on_backward(self, fn: Callable[[Any], Any]) -> None:
        """Call ``fn(tensor)`` before each ``backward()``; it returns the tensor to
        differentiate (a GradScaler's scaled loss) or None to skip the backward."""
        self._on_backward.append(fn)

    def before_step(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(optimizer)`` before each optimizer step that runs."""
        self._before_step.append(fn)

    def on_leave_forward(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` where a forward pass ends: at backward, at an optimizer step, and
        at the end of the run."""
        self._on_leave_forward.append(fn)

    def patch(self, obj: Any, attr: str, value: Any) -> None:
        """Set ``obj.attr = value`` until :meth:`close` (an instance attribute is removed
        again if there was none)."""
        self._undo.set(obj, attr, value)

    def before_run(self, fn: Callable[[dict], None]) -> None:
        """Call ``fn(values)`` before the run's measurement starts, with the namespace's
        values the cell names (name -> object): a knob's setup that a user does before
        the cell (the model converted to another dtype)."""
        self._before_run.append(fn)

    def prepare(self, values: dict) -> None:
        """Run the :meth:`before_run` functions (the backend calls this before measuring)."""
        for fn in self._before_run:
            fn(values)

    def undo_later(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` when :meth:`close` undoes the run's changes, in reverse order."""
        self._undo.call_on_restore(fn)

    def gate_steps(self, gate: Callable[[], bool], *, zero_grad: bool = False) -> None:
        """Let an optimizer step run only when ``gate()`` is true; with ``zero_grad``,
        ``zero_grad()`` calls only clear gradients when no backward ran since the last step
        that ran (accumulated gradients are kept)."""
        self._gates.append(gate)
        self._zero_gate = self._zero_gate or zero_grad

    def use_grad_scaler(self, factory: Callable[[], Any]) -> None:
        """Scale each backward's tensor with a GradScaler made (once, in the run) by
        ``factory``; unscale before each optimizer step and update after it."""
        self._scaler_factory = factory

    # -- installation -------------------------------------------------------------------------
    def install(self) -> None:
        """Install the hooks and patches every run needs (the knobs add theirs before)."""
        import torch
        from torch.nn.modules import module as _module_mod

        # the modules the run makes (their parameters are registered during it)
        made = self.made_in_run
        self.undo_later(_module_mod.register_module_parameter_registration_hook(
            lambda m, name, p: made.add(id(m))).remove)
        self.undo_later(_module_mod.register_module_module_registration_hook(
            lambda m, name, child: made.add(id(m))).remove)
        self.undo_later(_module_mod.register_module_forward_pre_hook(self._pre).remove)
        self.undo_later(_module_mod.register_module_forward_hook(self._post, always_call=True).remove)
        applier = self
        orig_backward = torch.autograd.backward

        def backward(tensors, *args, **kwargs):
            # loss.backward() comes here too (Tensor.backward calls torch.autograd.backward)
            if isinstance(tensors, torch.Tensor):
                tensors = applier._before_backward(tensors)
                if tensors is None:
                    return None
            else:
                applier._leave_forward()
                applier.backward_calls += 1
                applier._grads_pending = True
            return orig_backward(tensors, *args, **kwargs)

        backward.__doc__ = orig_backward.__doc__
        self.patch(torch.autograd, "backward", backward)
        self._patch_optimizers()

    def _patch_optimizers(self) -> None:
        import torch

        applier = self
        for cls in _optimizer_classes():
            step = cls.__dict__.get("step")
            if step is not None:
                self.patch(cls, "step", _gated_step(step, applier))
        zero = torch.optim.Optimizer.zero_grad
        mzero = torch.nn.Module.zero_grad

        def zero_grad(opt, *args, **kwargs):
            if applier._zero_gate and applier._grads_pending:
                return None
            return zero(opt, *args, **kwargs)

        def module_zero_grad(mod, *args, **kwargs):
            if applier._zero_gate and applier._grads_pending:
                return None
            return mzero(mod, *args, **kwargs)

        self.patch(torch.optim.Optimizer, "zero_grad", zero_grad)
        self.patch(torch.nn.Module, "zero_grad", module_zero_grad)
        init = torch.optim.Optimizer.__init__

        def opt_init(opt, *args, **kwargs):
            applier.optimizers_built.append(type(opt).__name__)
            return init(opt, *args, **kwargs)

        self.patch(torch.optim.Optimizer, "__init__", opt_init)

    def close(self) -> None:
        """Take every hook, patch and context away (idempotent; raises the first error only
        after trying all)."""
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        for fn in (self._leave_forward,):
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - restore everything first
                errors.append(exc)
        try:
            self._undo.restore()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        self._at_call.clear()
        self._on_backward.clear()
        self._on_leave_forward.clear()
        self._scaler = None
        self._scaler_factory = None
        self._seen_roots.clear()
        self._inside.clear()
        if errors:
            raise errors[0]

    # -- hooks ----------------------------------------------------------------------------------
    def _pre(self, module, args):
        from . import _torch_private as priv

        self._depth += 1
        if self._depth != 1 or id(module) in self._inside or priv.in_backward():
            return None
        first = id(module) not in self._seen_roots
        if first:
            self._seen_roots.add(id(module))
            self.models.append(type(module).__name__)
            for m in module.modules():
                self._inside.add(id(m))
            self._inside.discard(id(module))
            self.blocks += len(find_blocks(module, self.checkpoint_module))
            self.module_classes.update(type(m).__name__ for m in module.modules()
                                       if m is not module)
            self.inplace_modules += sum(1 for m in module.modules()
                                        if isinstance(getattr(m, "inplace", None), bool))
        for fn, every in self._at_call:
            if first or every:
                out = fn(module, args)
                if out is not None:
                    args = out
        return args

    def _post(self, module, args, output):
        self._depth = max(0, self._depth - 1)
        return None

    def _before_backward(self, tensor):
        self._leave_forward()
        for fn in self._on_backward:
            tensor = fn(tensor)
            if tensor is None:
                return None
        if self._scaler_factory is not None:
            if self._scaler is None:
                self._scaler = self._scaler_factory()
            tensor = self._scaler.scale(tensor)
        self.backward_calls += 1
        self._grads_pending = True
        return tensor

    def _leave_forward(self) -> None:
        for fn in self._on_leave_forward:
            fn()


def _gated_step(step: Callable, applier: Applier) -> Callable:
    """An optimizer class's ``step`` that runs only when the applier's gate allows, with
    the GradScaler's unscale_/update around it when one is in use."""

    def gated(opt, *args, **kwargs):
        applier._leave_forward()
        if not all(g() for g in applier._gates):
            applier.steps_skipped += 1
            return None
        for fn in applier._before_step:
            fn(opt)
        scaler = applier._scaler
        if scaler is not None:
            scaler.unscale_(opt)
        out = step(opt, *args, **kwargs)
        if scaler is not None:
            scaler.update()
        applier.steps_run += 1
        applier._grads_pending = False
        return out

    gated.__wrapped__ = step  # type: ignore[attr-defined]
    if getattr(step, "hooked", False):  # torch's profile/hook wrapper is inside: keep it
        gated.hooked = True  # type: ignore[attr-defined]
    return gated


def _optimizer_classes() -> list[type]:
    import torch

    out, todo = [], [torch.optim.Optimizer]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def find_blocks(model: Any, type_name: str | None = None) -> list[Any]:
    """The modules checkpointing wraps in ``model``: with ``type_name``, the outermost
    modules of that class name; otherwise the children of the outermost ModuleList /
    Sequential containers that hold at least two modules of one class that has
    submodules of its own (a model's repeated blocks)."""
    import torch.nn as nn

    found: list = []
    stack = [model]
    while stack:
        m = stack.pop(0)
        if type_name is not None:
            if m is not model and type(m).__name__ == type_name:
                found.append(m)
                continue
        elif isinstance(m, (nn.ModuleList, nn.Sequential)):
            kids = list(m.children())
            kinds: dict[type, int] = {}
            for k in kids:
                if any(True for _ in k.children()):
                    kinds[type(k)] = kinds.get(type(k), 0) + 1
            if any(n >= 2 for n in kinds.values()):
                found.extend(k for k in kids if kinds.get(type(k), 0) >= 2)
                continue
        stack.extend(m.children())
    return found


# -- apply functions ------------------------------------------------------------------------
def _apply_amp(a: Applier, value: str) -> None:
    if value == "off":
        return
    import torch

    dtype = _dtype(value)
    active: list = []

    def enter(module, args):
        if not active:
            cm = torch.autocast(a.device_type, dtype=dtype)
            cm.__enter__()
            active.append(cm)
        return None

    def leave() -> None:
        while active:
            active.pop().__exit__(None, None, None)

    a.at_call(enter, every=True)
    a.on_leave_forward(leave)
    if value == "fp16":
        a.use_grad_scaler(lambda: torch.amp.GradScaler(a.device_type))
    a.note(f"amp {value}: autocast({a.device_type!r}, {str(dtype).replace('torch.', '')}) "
           "from each model call until its backward (the forward and the loss)"
           + ("; a GradScaler scales the loss and unscales before each step" if value == "fp16" else ""))


def _apply_new_tokens(a: Applier, value: int | None) -> None:
    """Count the run's transformers ``generate()`` calls (the knob applies to a run that
    made some) and, with a value, give each call ``max_new_tokens=value`` (a simulation
    reads no end-of-sequence token: every call makes all of them, the most a GPU would)."""
    import functools
    import sys

    mixin = getattr(sys.modules.get("transformers"), "GenerationMixin", None)
    if mixin is None:  # transformers not imported: no generate() to count
        return
    original = mixin.generate

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        a.generate_calls += 1
        if value is not None:
            kwargs["max_new_tokens"] = value
            kwargs.pop("max_length", None)
            if kwargs.get("min_new_tokens") is not None:
                kwargs["min_new_tokens"] = min(kwargs["min_new_tokens"], value)
        return original(self, *args, **kwargs)

    a.patch(mixin, "generate", generate)
    if value is not None:
        a.note(f"new_tokens {value}: each generate() call ran with max_new_tokens={value}")


def _apply_checkpointing(a: Applier, value: bool) -> None:
    if not value:
        return
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    wrapped: list = []
    how = ["torch.utils.checkpoint (use_reentrant=False)"]

    def wrap(module, args):
        if a.checkpoint_module is None:
            switch = _library_checkpointing(a, module, wrapped)
            if switch is not None:
                how[0] = switch
                return None
        for block in find_blocks(module, a.checkpoint_module):
            if "forward" in block.__dict__:
                continue
            fwd = type(block).forward.__get__(block)
            a.patch(block, "forward", partial(_checkpointed, checkpoint, fwd))
            wrapped.append(type(block).__name__)
        return None

    def describe() -> None:
        if wrapped:
            kinds = sorted(set(wrapped))
            a.note(f"checkpointing: {len(wrapped)} block(s) ({', '.join(kinds)}) run through "
                   f"{how[0]}")
    a.at_call(wrap)
    a.on_leave_forward(describe)


def _library_checkpointing(a: Applier, model: Any, wrapped: list) -> str | None:
    """A transformers model checkpoints through its own switch, as its users turn it on:
    ``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` before
    transformers 5) also turns the KV cache off in training, which a block wrapped from
    outside would fill again in its recompute. Undone by the run's close. Returns how the
    blocks run (for the note), or None for a model without such a switch."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        return None
    for prefix in ("activation", "gradient"):
        enable = getattr(model, f"{prefix}_checkpointing_enable", None)
        if enable is not None:
            break
    else:
        return None
    if not getattr(model, f"is_{prefix}_checkpointing", False):  # else the cell turned it on
        enable(**{f"{prefix}_checkpointing_kwargs": {"use_reentrant": False}})
        a.undo_later(getattr(model, f"{prefix}_checkpointing_disable"))
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False) and model.training:
        # as the transformers docs do with checkpointing (else each layer warns on stderr)
        a.patch(config, "use_cache", False)
    # the repeated layers it checkpoints (transformers' GradientCheckpointingLayer)
    wrapped.extend(type(m).__name__ for m in model.modules()
                   if getattr(m, "gradient_checkpointing", False)
                   and any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__))
    return (f"transformers' {prefix}_checkpointing_enable() (use_reentrant=False; the KV "
            "cache is off in training)")


def _checkpointed(checkpoint, fwd, *args, **kwargs):
    import torch

    if not torch.is_grad_enabled():
        return fwd(*args, **kwargs)
    return checkpoint(fwd, *args, use_reentrant=False, **kwargs)


def _apply_weights(a: Applier, value: str | None) -> None:
    if value is None:
        return
    import torch

    dtype = _dtype(value)
    short = str(dtype).replace("torch.", "")

    def convert(module, args):
        if _convert_undoably(a, module, dtype):
            a.note(f"weights {value}: {type(module).__name__} (not a name the cell uses) "
                   f"converted with .to({short}) at its first call, floating inputs cast to match")
        return None

    def convert_before(values: dict) -> None:
        names = [k for k, m in values.items() if isinstance(m, torch.nn.Module)
                 and _convert_undoably(a, m, dtype)]
        if names:
            a.note(f"weights {value}: {', '.join(names)} converted with .to({short}) before the "
                   "measurement, as if loaded in that dtype"
                   + ("" if a.on_copy else " (put back after the run)")
                   + "; floating inputs cast to match")

    def cast(module, args):
        return tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point()
                     and x.dtype != dtype else x for x in args)

    def cast_state(opt):
        # state an optimizer built before the conversion (an earlier cell's steps) follows
        # its weights, as after optimizer.load_state_dict() of a converted model
        cast = 0
        for group in opt.param_groups:
            for p in group["params"]:
                st = opt.state.get(p)
                if not isinstance(st, dict):
                    continue
                for k, v in list(st.items()):
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and \
                            v.shape == p.shape and v.dtype != p.dtype:
                        st[k] = v.to(p.dtype)
                        cast += 1
        if cast:
            a.note(f"weights {value}: {cast} optimizer state tensors made before the "
                   f"conversion were cast to {short} with them")

    a.before_run(convert_before)
    a.at_call(convert)
    a.at_call(cast, every=True)
    a.before_step(cast_state)


def _convert_undoably(a: Applier, module: Any, dtype: Any) -> bool:
    """``module.to(dtype)``, undone when the run closes: the same Parameter objects get
    their old data and gradients back, the buffers their old tensors (the notebook's model
    is left as it was, on every backend). Keeping the old weights to put back keeps them in
    memory during the run, which a note says; a run on a copy (the what-if panel's) keeps
    none. False when it already had that dtype."""
    import torch

    floating = {p.dtype for p in module.parameters() if p.is_floating_point()}
    if not floating or floating == {dtype}:
        return False
    if a.on_copy or id(module) in a.made_in_run:  # nothing of the notebook's to put back
        module.to(dtype)
        return True
    kept = sum(p.untyped_storage().nbytes() for p in module.parameters() if p.is_floating_point())
    a.note(f"weights: the {type(module).__name__}'s own weights ({kept / 2**20:,.1f} MiB) stay in "
           "memory during the run, to be put back after it, and count in it: the what-if "
           "panel (--whatif) runs on a copy and shows the model as if loaded in that dtype")
    saved = []
    for m in module.modules():
        saved.extend((m, k, p, p.data, p.grad) for k, p in m.named_parameters(recurse=False))
        saved.extend((m, k, b, None, None) for k, b in m.named_buffers(recurse=False))

    def undo() -> None:
        with torch.no_grad():
            for m, k, obj, data, grad in saved:
                setattr(m, k, obj)  # a registered name: the registration (and persistence) stays
                if data is not None:
                    obj.data = data
                    obj.grad = grad
    a.undo_later(undo)
    module.to(dtype)
    return True


def _apply_grad_mode(a: Applier, value: str) -> None:
    if value == "train":
        return
    import torch

    a.around(torch.inference_mode() if value == "inference_mode" else torch.no_grad())
    skipped: list[int] = []

    def skip_backward(tensor):
        skipped.append(1)
        return None

    def to_eval(module, args):
        flags = [(m, m.training) for m in module.modules()]
        module.eval()

        def undo() -> None:
            for m, t in flags:
                m.training = t
        a.undo_later(undo)
        return None

    a.on_backward(skip_backward)
    a.at_call(to_eval)
    a.gate_steps(lambda: False)
    # the cell's own GradScaler: no backward ran, so it has nothing to unscale or update
    a.patch(torch.amp.GradScaler, "step", _skipped_scaler_step)
    a.patch(torch.amp.GradScaler, "update", _skipped_scaler_update)
    a.note(f"grad_mode {value}: the cell ran under torch.{value}() with its models in eval(); "
           "backward() calls, optimizer steps and GradScaler steps were skipped")


def _skipped_scaler_step(scaler, optimizer, *args, **kwargs):
    return None


def _skipped_scaler_update(scaler, new_scale=None):
    return None


def _apply_offload(a: Applier, value: bool) -> None:
    if not value:
        return
    import torch

    a.around(torch.autograd.graph.save_on_cpu(pin_memory=a.device_type == "cuda"))
    a.note("offload: tensors saved for backward kept on the CPU "
           "(torch.autograd.graph.save_on_cpu) and copied back for backward")


def _apply_inplace(a: Applier, value: bool) -> None:
    if not value:
        return

    def set_inplace(module, args):
        n = 0
        for m in module.modules():
            if isinstance(getattr(m, "inplace", None), bool) and not m.inplace:
                a.patch(m, "inplace", True)
                n += 1
        if n:
            a.note(f"inplace: inplace=True on {n} activation/dropout module(s) "
                   "(functional calls in forward code are unchanged)")
        return None

    a.at_call(set_inplace)


def make_optimizer(name: str, params: Iterable, lr: float = 1e-3, **kwargs: Any):
    """A torch optimizer by knob name: "sgd", "sgd-momentum" (0.9), "adam", "adamw",
    "adafactor" (torch.optim.Adafactor: factored second moments, no first moment)."""
    import torch

    name = KNOBS["optimizer"].check(name)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, **kwargs)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, **kwargs)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, **kwargs)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, **kwargs)
    return torch.optim.Adafactor(params, lr=lr, **kwargs)


def _apply_optimizer(a: Applier, value: str | None) -> None:
    if value is None:
        return
    import torch

    chosen = {"sgd": torch.optim.SGD, "sgd-momentum": torch.optim.SGD, "adam": torch.optim.Adam,
              "adamw": torch.optim.AdamW, "adafactor": torch.optim.Adafactor}[value]
    replaced: list[str] = []
    building: list[int] = []

    def factory(cls):
        def build(params, *args, **kwargs):
            if building:  # make_optimizer itself, or a subclass's super().__init__
                return cls(params, *args, **kwargs)
            lr = kwargs.get("lr", args[0] if args and isinstance(args[0], (int, float)) else 1e-3)
            replaced.append(cls.__name__)
            building.append(1)
            try:
                opt = make_optimizer(value, params, lr=lr)
            finally:
                building.pop()
            a.note(f"optimizer {value}: {', '.join(sorted(set(replaced)))} built by the cell "
                   f"replaced by {type(opt).__name__}"
                   + (" (momentum 0.9)" if value == "sgd-momentum" else "")
                   + " with the same parameters and learning rate")
            return opt
        return build

    for name in ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam",
                 "RMSprop", "Rprop", "ASGD", "LBFGS", "SparseAdam", "Adafactor"):
        cls = getattr(torch.optim, name, None)
        if cls is not None:
            a.patch(torch.optim, name, factory(cls))
    del chosen


def _amp_value(v: str):
    return _dtype(v)


def _batch_fixes(f: Fixes) -> list[tuple[str, dict[str, Any]]]:
    b = f.batch
    return [(f"batch {b // d} (from {b})", {"batch_size": b // d})
            for d in (2, 4) if b and b // d >= 1 and b // d != b]


def _seq_fixes(f: Fixes) -> list[tuple[str, dict[str, Any]]]:
    s = f.seq
    return [(f"context {s // d} (from {s})", {"seq_len": s // d})
            for d in (2, 4) if s and s // d >= 1 and s // d != s]


def _accum_fixes(f: Fixes) -> list[tuple[str, dict[str, Any]]]:
    b = f.batch
    return [(f"accumulate {n} x {b // n} (batch {b})", {"accum_steps": n})
            for n in (2, 4) if b and b % n == 0 and b // n >= 1]


def _optimizer_fixes(f: Fixes) -> list[tuple[str, dict[str, Any]]]:
    return [(f"optimizer: {label}", {"optimizer": name})
            for name, label in (("sgd-momentum", "SGD with momentum (1 state)"),
                                ("adafactor", "Adafactor (factored state)"))
            if name != f.optimizer]


_ON = ("on", "true", "yes", "1")
_OFF = ("off", "false", "no", "0")


def _checkpointing_option(text: str) -> tuple[bool, dict[str, Any]]:
    """``--checkpointing`` [on|off|MODULE]: a module class name wraps the modules of that
    class instead of the repeated blocks."""
    low = text.lower()
    if low in _ON + _OFF:
        return low in _ON, {}
    if text.isidentifier():
        return True, {"checkpoint_module": text}
    raise KnobError(f"--checkpointing takes on, off or a module class name (TransformerBlock), "
                    f"not {text!r}")


KNOBS: dict[str, Knob] = {k.name: k for k in [
    Knob("amp", "AMP", "choice", "off", "autocast from each model call until its backward; "
         "fp16 with a GradScaler", choices=AMP_CHOICES, apply=_apply_amp, cell_value=_amp_value,
         needs="model", short="amp", panel="buttons", metavar="{off,fp16,bf16}",
         help="What-if knob: autocast around each model call and its loss (fp16 with a "
              "GradScaler), unless the cell reads the variable amp itself.",
         fixes=lambda f: [("AMP fp16", {"amp": "fp16"}), ("AMP bf16", {"amp": "bf16"})],
         strategy=("fp32", "amp bf16", "bf16")),
    Knob("batch_size", "batch size", "int", None, "the namespace's batch tensors the cell "
         "names, resized along their first dimension", low=1, high=1 << 20, needs="batch",
         panel="slider", panel_range=(1, 512), panel_grow=True, metavar="N",
         help="What-if knob: the (effective) batch size; the cell reads batch_size, or "
              "memmagic resizes the batch tensors of the namespace the cell names.",
         fixes=_batch_fixes),
    Knob("seq_len", "sequence length", "int", None, "the namespace's token tensors the cell "
         "names (integer or bool [batch, seq, ...]: ids, masks, labels), cut or repeated along "
         "their second dimension", low=1, high=1 << 20, needs="seq", short="seq",
         panel="slider", panel_range=(16, 2048), panel_grow=True, metavar="T",
         help="What-if knob: the sequence length (tokens per sample); the cell reads seq_len, "
              "or memmagic cuts or repeats the token tensors of the namespace the cell names.",
         fixes=_seq_fixes),
    Knob("new_tokens", "new tokens", "int", None, "each generate() call's max_new_tokens",
         low=1, high=1 << 17, apply=_apply_new_tokens, variable="max_new_tokens",
         needs="generate", short="new tokens", panel="slider", panel_range=(1, 1024),
         panel_grow=True, metavar="N",
         help="What-if knob: the new tokens each generate() call makes (max_new_tokens); the "
              "cell reads max_new_tokens, or memmagic sets it on each call."),
    Knob("accum_steps", "accumulation steps", "int", 1, "the cell repeated per micro-step on "
         "batch_size / accum_steps, optimizer steps held back until the last", low=1, high=1024,
         needs="accum", panel="buttons", panel_range=(1, 16), metavar="K",
         help="What-if knob: gradient accumulation over K micro-batches of "
              "batch_size / K (the cell reads accum_steps, or memmagic repeats it per "
              "micro-step with the optimizer step held back).",
         fixes=_accum_fixes),
    Knob("checkpointing", "checkpointing", "bool", False, "the models' repeated blocks run "
         "through torch.utils.checkpoint", apply=_apply_checkpointing, needs="blocks",
         short="ckpt", panel="checkbox", metavar="MODULE",
         help="What-if knob: activation checkpointing of the model's repeated blocks "
              "(children of a ModuleList/Sequential), or of the modules of class MODULE.",
         parse_option=_checkpointing_option,
         fixes=lambda f: [("activation checkpointing", {"checkpointing": True})],
         strategy=("", "ckpt", True)),
    Knob("weights_dtype", "weights dtype", "choice", None, "each model converted before the "
         "measurement, as if loaded in that dtype (.to(bfloat16) / .half())",
         choices=WEIGHT_DTYPES, apply=_apply_weights,
         cell_value=_dtype, needs="model", short="weights", panel="buttons",
         metavar="{fp32,bf16,fp16}",
         help="What-if knob: convert the model's weights (model.half()).",
         fixes=lambda f: [("bf16 weights", {"weights_dtype": "bf16"}),
                          ("fp16 weights", {"weights_dtype": "fp16"})]),
    Knob("grad_mode", "mode", "choice", "train", "the cell under no_grad / inference_mode, "
         "models in eval(), backward and steps skipped", choices=GRAD_MODES,
         apply=_apply_grad_mode, needs="backward", panel="buttons",
         metavar="{train,no_grad,inference_mode}",
         help="What-if knob: a training step, or a forward under no_grad / inference_mode."),
    Knob("offload", "offload activations", "bool", False, "save_on_cpu around the cell",
         apply=_apply_offload, needs="backward", short="offload", panel="checkbox",
         help="What-if knob: keep tensors saved for backward on the CPU (save_on_cpu).",
         fixes=lambda f: [("offload saved activations to CPU", {"offload": True})]),
    Knob("optimizer", "optimizer", "choice", None, "the optimizer the cell builds replaced",
         choices=OPTIMIZERS, apply=_apply_optimizer, variable="optimizer_name",
         needs="optimizer", panel="menu", unset_label="as in the cell",
         metavar="{sgd,sgd-momentum,adam,adamw,adafactor}",
         help="What-if knob: replace the optimizer the cell builds.", fixes=_optimizer_fixes),
    Knob("inplace", "in-place activations", "bool", False, "inplace=True on activation and "
         "dropout modules", apply=_apply_inplace, needs="inplace", short="inplace",
         panel="checkbox",
         help="What-if knob: inplace=True on activation and dropout modules."),
    Knob("gpu", "target GPU", "choice", None, "the simulated card: fits or not",
         choices=(), variable="gpu_name", needs="sim", short="on", panel="menu",
         unset_label="no card"),
]}


# a setting's values that mean "off" to a cell whose variable is a flag (amp = False)
_OFF = (None, False, 0, "off", "fp32", "train")


def knob_value(name: str, value: Any, like: Any = None) -> Any:
    """What a cell's variable for knob ``name`` holds when the setting is ``value``.

    ``like`` is the variable's own value in the namespace, whose type the knob's value
    takes: a flag (``amp = False``, for ``autocast(enabled=amp)``) gets True or False, a
    name (``amp = "bf16"``) the setting's name, a dtype the dtype; otherwise the knob's
    own form (``amp="fp16"`` -> ``torch.float16``). A setting left "as written" (None)
    keeps the cell's own value."""
    knob = KNOBS[name]
    if value is None and like is not None:
        return like
    if isinstance(like, bool):
        return value not in _OFF
    if isinstance(like, str) and isinstance(value, str):
        return value
    return knob.cell_value(value) if knob.cell_value is not None else value


def setting_of(name: str, own: Any) -> Any:
    """The knob setting that a cell's own variable ``own`` stands for (the inverse of
    :func:`knob_value`): ``amp = False`` is "off", ``amp = True`` the first of its
    choices that is on, a dtype its name; None when it says nothing the knob knows."""
    knob = KNOBS[name]
    if knob.kind == "bool" or knob.kind == "int":
        try:
            return knob.check(own)
        except KnobError:
            return None
    if isinstance(own, bool):
        if not own:
            return knob.default if knob.default in _OFF else None
        return next((c for c in knob.choices if c not in _OFF), None)
    names = {str(_dtype(c)): c for c in knob.choices if c in ("fp32", "fp16", "bf16")}
    if str(own) in names:
        return names[str(own)]
    try:
        return knob.check(own)
    except (KnobError, TypeError):
        return None


# -- settings ------------------------------------------------------------------------------
class Setting:
    """One choice of knob values; unset knobs are at their default (the cell as written).

    Immutable and hashable: ``Setting(amp="fp16", batch_size=64)``,
    ``s.replace(accum_steps=4)``, ``s.amp``. ``batch_size`` is the effective batch (samples
    per optimizer step); :attr:`micro_batch` is what one forward sees."""

    __slots__ = ("_items",)

    def __init__(self, **values: Any) -> None:
        items = {}
        for name, value in values.items():
            knob = KNOBS.get(name)
            if knob is None:
                raise TypeError(f"unknown knob {name!r}; knobs: {', '.join(KNOBS)}")
            v = knob.check(value)
            if v != knob.default or (v is None) != (knob.default is None):
                items[name] = v
        object.__setattr__(self, "_items", tuple((k, items[k]) for k in KNOBS if k in items))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        knob = KNOBS.get(name)
        if knob is None:
            raise AttributeError(f"no knob {name!r}; knobs: {', '.join(KNOBS)}")
        return dict(object.__getattribute__(self, "_items")).get(name, knob.default)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a Setting is immutable: use setting.replace(...)")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Setting) and self._items == other._items

    def __hash__(self) -> int:
        return hash(self._items)

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        """(knob, value) for the knobs set away from their default."""
        return iter(self._items)

    def changed(self) -> dict[str, Any]:
        return dict(self._items)

    def replace(self, **values: Any) -> "Setting":
        merged = dict(self._items)
        merged.update(values)
        return Setting(**merged)

    @property
    def micro_batch(self) -> int | None:
        """The batch of one forward: batch_size / accum_steps (None without a batch size)."""
        if self.batch_size is None:
            return None
        return self.batch_size // self.accum_steps

    def check_batch(self) -> None:
        """KnobError when the batch does not split into accum_steps equal micro-batches."""
        b, k = self.batch_size, self.accum_steps
        if b is not None and b % k:
            raise KnobError(f"batch_size {b} does not split into {k} equal micro-batches: "
                            f"pick a multiple of {k} (e.g. {max(k, math.ceil(b / k) * k)})")

    def label(self) -> str:
        """Short and deterministic: "amp fp16, batch 64 (4 x 16), ckpt" ("as written" when
        nothing is set)."""
        parts = []
        for name, value in self._items:
            if name == "batch_size":
                continue
            if name == "accum_steps":
                continue
            knob = KNOBS[name]
            short = knob.short
            if knob.kind == "bool":
                parts.append(short if value else f"no {short}")
            else:
                parts.append(f"{short} {value}".strip())
        if self.batch_size is not None or self.accum_steps != 1:
            b = self.batch_size
            if self.accum_steps != 1:
                parts.insert(0, f"batch {b if b is not None else '?'} "
                                f"({self.accum_steps} x {self.micro_batch if b is not None else '?'})")
            else:
                parts.insert(0, f"batch {b}")
        return ", ".join(parts) if parts else _AS_WRITTEN

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._items)
        return f"Setting({inner})"
