"""How memmagic applies a knob to a cell that does not read the knob's variable.

An :class:`Applier` installs what the knobs change around one run of a cell (autocast,
patches, hooks, step gates) and takes every change away again when the run ends; each
knob's ``apply`` function (``apply_amp``, ``apply_checkpointing``, ...) says what to
install for its value. The knob table (:data:`memmagic.whatif.knobs.KNOBS`) names these
functions; the engine calls them. The knobs the engine applies itself (the sizes of the
data, gradient accumulation, the target card) have none.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable

from ..core.patching import Patches
from ..report import Note

__all__ = ["Applier", "KnobError", "find_blocks", "make_optimizer", "torch_dtype", "OPTIMIZERS",
           "apply_amp", "apply_new_tokens", "apply_checkpointing", "apply_weights",
           "apply_grad_mode", "apply_offload", "apply_inplace", "apply_optimizer"]

# the optimizers memmagic builds (the optimizer knob's choices)
OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw", "adafactor")


class KnobError(ValueError):
    """A knob value the cell cannot be run with; the message says what to do instead."""


def torch_dtype(name: str | None):
    """The torch dtype a knob's value names ("fp16" -> ``torch.float16``; "off", None -> None)."""
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, None: None,
            "off": None}[name]


# -- the applier ----------------------------------------------------------------------------
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
        self.quantized_models = 0            # models holding quantized (integer) weights
        self.optimizers_built: list[str] = []
        self.backward_calls = 0
        self.generate_calls = 0              # transformers generate() calls
        # (enabled, dtype) of autocast on the device at each outermost model call, as the
        # cell's own code left it (before the knobs' hooks)
        self.autocast_at_calls: set[tuple[bool, Any]] = set()
        self.steps_run = 0
        self.steps_begun = 0  # steps that passed the gates (one that fails counts here)
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
    def _note_autocast(self) -> None:
        import torch

        dev = self.device_type
        on = torch.is_autocast_enabled(dev)
        self.autocast_at_calls.add((on, torch.get_autocast_dtype(dev) if on else None))

    def _pre(self, module, args):
        from ..core import _torch_private as priv

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
            self.quantized_models += any(_quantized(p) for p in module.parameters())
        self._note_autocast()
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
        applier.steps_begun += 1
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


def _quantized(p: Any) -> bool:
    """Whether a parameter is a quantized weight: integer data (bitsandbytes' packed 4-bit
    and 8-bit weights), or one carrying a quantization state."""
    return not p.is_floating_point() or any(
        getattr(p, attr, None) is not None for attr in ("quant_state", "SCB"))


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
def apply_amp(a: Applier, value: str) -> None:
    if value == "off":
        return
    import torch

    dtype = torch_dtype(value)
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


def apply_new_tokens(a: Applier, value: int | None) -> None:
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


def apply_checkpointing(a: Applier, value: bool) -> None:
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


def apply_weights(a: Applier, value: str | None) -> None:
    if value is None:
        return
    import torch

    dtype = torch_dtype(value)
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


def apply_grad_mode(a: Applier, value: str) -> None:
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


def apply_offload(a: Applier, value: bool) -> None:
    if not value:
        return
    import torch

    a.around(torch.autograd.graph.save_on_cpu(pin_memory=a.device_type == "cuda"))
    a.note("offload: tensors saved for backward kept on the CPU "
           "(torch.autograd.graph.save_on_cpu) and copied back for backward")


def apply_inplace(a: Applier, value: bool) -> None:
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

    given, name = name, name.lower() if isinstance(name, str) else name
    if name not in OPTIMIZERS:
        raise KnobError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, not {given!r}")
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, **kwargs)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, **kwargs)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, **kwargs)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, **kwargs)
    return torch.optim.Adafactor(params, lr=lr, **kwargs)


def apply_optimizer(a: Applier, value: str | None) -> None:
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
