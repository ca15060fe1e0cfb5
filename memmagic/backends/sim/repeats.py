"""Forward passes with gradients off that repeat, done on the allocator model instead of op
by op.

An evaluation loop calls the model again and again on batches of one shape (nanoGPT's
``estimate_loss`` makes 2 x 200 such calls before its first step; a test loop one per
batch). Each call makes the same allocations and frees in the same order, of the same sizes,
and leaves only its output. Simulating every op of every call is most of such a script's
time; this module runs calls op by op until two in a row did the same things, then
**evaluates** the next ones of that kind:

* a call's kind: the model (its parameters' and buffers' shapes, dtypes and devices, its
  modules' training flags), the shapes, strides, dtypes and devices of the tensors it is
  given and its other arguments' values, autocast and inference mode;
* an evaluated call does that kind's allocations and frees, in order, on the allocator
  model (its allocated and reserved bytes, segments and cache move exactly as the call's
  would), and makes its output as simulated tensors of the same shapes, in the same
  structure; its module's hooks and the run's global hooks (the per-module rows, a script's
  forward count) see one call of the outermost module;
* a call runs op by op as a check after 16 evaluated ones, then after 32, 64, ...; it must do
  what the two before did (a note says whether it did), else that kind is run again until
  two calls agree;
* an evaluated call's buffers are storages the tracker counts (its events, the categories and
  the snapshot stacks of the call that ran), so the trace, the what-if planes and the
  doctor's lines read the run as if every call ran;
* a call that would raise the run's peak, or might not fit the card, runs op by op (the
  peak keeps its op and module; an out of memory is the op's own).

Calls of one kind but for their sizes, which grow at each call (a decode loop written by
hand: nanoGPT's ``generate`` calls the model on all the tokens so far; Meta's Llama
reference tells its model ``start_pos``), are read off a curve instead (:class:`_Curve`):
each size a quadratic in the call's place, through three calls that ran in a row and
checked by the fourth; a call whose inputs are the curve's is evaluated from it, checked as
above. Such a call may raise the run's peak (a sampling script's last call holds the most):
the peak is then said to be in the op and module where the calls that ran reached theirs.

A call is never evaluated where it could do something else than the calls that ran: one
that reads a tensor's values into Python (``.item()``, ``if mask.any():``, ``tolist``) or
runs an op whose output's shape depends on values (``nonzero``); one that keeps memory past
its call (a cache in the model, a first matmul's cuBLAS workspace; autocast's cached weight
casts are kept to its exit and freed there), frees memory made before it, or keeps host
memory; one whose modules carry hooks, or remove an attribute, or set one to anything but a
new tensor of its own or a plain value (llama2.c's ``self.last_loss = loss`` is such a new
tensor: an evaluated call sets it, after its buffers, where the tensor it replaces is held
elsewhere too; else the call runs, as it would free that tensor inside the call);
one whose output holds anything but new tensors of their own and plain values (a
transformers cache object, a view, a tensor carrying values); one with gradients on. What an
evaluated call leaves out: its ops (the op count, the trace and the timeline show the
tensors it returns, not its transient buffers), the values a GPU run would compute, and
any Python side effect of its code (a print, a counter kept outside its modules).
``SimBackend(decode="run")`` runs every call op by op.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from ...core import _torch_private as _priv
from ...core.interrupts import atomic
from ...core.patching import Patches
from .allocator import round_request, segment_size
from .decode import whole

if TYPE_CHECKING:
    from .state import SimState
    from .tracker import SimTracker

__all__ = ["install_repeats"]

_FIRST_CHECK = 16  # evaluated calls of a kind before one runs as a check (then 32, 64, ...)
_UNSAID = 32  # calls that all ran op by op: fewer get no note on why none was evaluated
_EMPTY = torch.ops.aten.empty.memory_format  # an output an evaluated call makes
# ops whose output's shape follows from tensor values (the trace's op names)
_VALUE_SHAPED = frozenset({"nonzero", "nonzero_static", "masked_select", "unique_dim",
                           "_unique", "_unique2", "unique_consecutive", "repeat_interleave",
                           "_assert_async", "argwhere"})
_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


class _NotRepeatable(Exception):
    """A call that may do something else than the calls of its kind (the reason)."""


@dataclass(frozen=True)
class _Pass:
    """What one call did: its allocator actions as codes (``("a", i)`` / ``("f", i)``: a
    transient buffer's alloc and free; ``("o", j)``: the alloc of output tensor j; ``("k", i)``:
    autocast's cast of a weight, cached until autocast exits), each alloc's requested
    bytes, per buffer and per cast the (role, frames) the tracker kept for it (its category,
    the stack a memory snapshot shows), each output tensor's (shape, dtype, device), the
    output's structure (its pytree spec, and per leaf ``("o", j)`` or ``("v", value)``; the
    output is the call's return value and the new values of the attributes it set, in
    ``attrs``: (the module's place in ``model.modules()``, the name); ``starts``: what those
    held before it, :func:`_describe`), the most
    bytes it holds at once above what it began with, the bytes of segments it could add at
    most, and the most host bytes it holds at once (buffers torch's kernels make on the
    host, all freed before it returns)."""

    codes: tuple
    sizes: tuple
    made: tuple
    outs: tuple
    spec: Any
    leaves: tuple
    rise: int
    bound: int
    host: int
    attrs: tuple = ()
    starts: tuple = ()
    peak: tuple | None = None  # (op, (phase, module, label)) of the alloc at its rise

    def same(self, other: "_Pass | None") -> bool:
        return other is not None and (self.codes, self.sizes, self.outs, self.spec,
                                      self.leaves, self.attrs, self.starts) == (
            other.codes, other.sizes, other.outs, other.spec, other.leaves, other.attrs,
            other.starts)


@dataclass
class _Checked:
    """When the evaluated calls of a kind (or a growth) are checked: a call runs once
    ``left`` reaches 0, after 16 evaluated calls, then 32, 64, ..."""

    name: str
    gap: int = _FIRST_CHECK
    left: int = 0
    evaluated: int = 0

    def held(self) -> None:
        """A call that ran did what the line says: a check that was due doubles the gap."""
        if self.left <= 0:
            self.gap *= 2
            self.left = self.gap


@dataclass
class _Kind(_Checked):
    """The calls of one kind: the last that ran, the one evaluated calls repeat (once two in
    a row agree), and how many evaluated calls are left before the next check."""

    last: _Pass | None = None
    line: _Pass | None = None


def _fit(a: tuple, b: tuple, c: tuple) -> tuple:
    """Each number of three consecutive calls as (its value at the first, its first and second
    differences): the quadratic through them (:func:`_value`)."""
    return tuple((x, y - x, z - 2 * y + x) for x, y, z in zip(a, b, c))


def _value(curve: tuple, k: int) -> int:
    x, d1, d2 = curve
    return x + k * d1 + k * (k - 1) // 2 * d2


class _Curve:
    """Calls of one model whose sizes grow at each call: a decode loop without a cache (the
    tokens so far, nanoGPT's and minGPT's ``generate``), or one whose model keeps its cache
    and is told its position (``start_pos``). Each call makes the same allocations and frees
    in the same order; its inputs' sizes, its allocations' sizes and its outputs' shapes are
    quadratics in the call's place ``k`` (attention's scores grow with the square of the
    context), drawn through three calls in a row and checked, byte for byte, by the fourth.
    A call at place ``k`` whose inputs are the curve's is evaluated as :meth:`at` says."""

    def __init__(self, ran: list[tuple[tuple, _Pass]]) -> None:
        (n0, p0), (n1, p1), (n2, p2) = ran[:3]
        same = [(p.codes, p.made, p.spec, p.leaves, p.attrs, p.starts, p.peak,
                 tuple((dt, dev, len(shape)) for shape, dt, dev in p.outs)) for p in (p0, p1, p2)]
        if same[0] != same[1] or same[0] != same[2] or len({n0, n1, n2}) < 3:
            raise _NotRepeatable("its calls differ in more than their sizes")
        self.base, self.inputs = p0, _fit(n0, n1, n2)
        self.sizes = _fit(p0.sizes, p1.sizes, p2.sizes)
        self.host = _fit((p0.host,), (p1.host,), (p2.host,))[0]
        self.shapes = tuple(_fit(a[0], b[0], c[0]) for a, b, c in zip(p0.outs, p1.outs, p2.outs))

    def inputs_at(self, k: int) -> tuple:
        return tuple(_value(c, k) for c in self.inputs)

    def at(self, k: int) -> _Pass:
        """What the call at place ``k`` does, by the curve."""
        sizes = tuple(_value(c, k) for c in self.sizes)
        outs = tuple((tuple(_value(c, k) for c in shape), dt, dev)
                     for shape, (_, dt, dev) in zip(self.shapes, self.base.outs))
        rise, bound, _ = _rise(self.base.codes, sizes)
        return dataclasses.replace(self.base, sizes=sizes, outs=outs, rise=rise, bound=bound,
                                   host=_value(self.host, k))

    def matches(self, k: int, numbers: tuple, done: _Pass) -> bool:
        """Whether a call that ran at place ``k`` was the curve's."""
        return numbers == self.inputs_at(k) and self.at(k).same(done)


@dataclass
class _Growth(_Checked):
    """The calls of one kind but for their sizes: the last that ran in a row, the curve
    through them once four agree, the place of the next call on it, and the evaluated calls
    left before the next check."""

    ran: list = field(default_factory=list)  # (numbers, _Pass) of calls that ran in a row
    line: _Curve | None = None
    at: int = 0

    def ran_one(self, numbers: tuple, done: _Pass | None) -> bool | None:
        """A call ran (None: it could not be read): whether it was the curve's (None: there
        was no curve); a curve that ended is drawn again from the calls that follow."""
        if self.line is not None and numbers != self.line.inputs_at(self.at):
            self.line, self.ran, self.gap = None, [], _FIRST_CHECK  # the loop changed: no check
        if self.line is not None:
            ok = done is not None and self.line.at(self.at).same(done)
            if ok:
                self.at += 1
                self.held()
                return True
            self.line, self.ran, self.gap = None, [], _FIRST_CHECK
            return False
        if done is None:
            self.ran = []
            return None
        self.ran = (self.ran + [(numbers, done)])[-4:]
        if len(self.ran) == 4:
            try:
                curve = _Curve(self.ran)
            except _NotRepeatable:
                return None
            if curve.matches(3, *self.ran[3]):
                self.line, self.at, self.left, self.ran = curve, 4, self.gap, []
        return None


# -- the kind of a call -------------------------------------------------------------------------
def _model_key(module: torch.nn.Module) -> tuple | None:
    """The model's part of a call's kind (None: a module carries hooks)."""
    flags, tensors = [], []
    for m in module.modules():
        if _priv.has_forward_hooks(m):
            return None
        flags.append(m.training)
        for own in (_priv.own_parameters(m), _priv.own_buffers(m)):
            for t in own.values():
                if t is not None:
                    tensors.append((id(t), t.shape, t.dtype, t.device))
    return id(module), tuple(flags), tuple(tensors)


def _leaf_key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        # (a dimension of size 1 has any stride: a row of a wider tensor is one of its own)
        strides = tuple(s if n != 1 else 0 for n, s in zip(x.shape, x.stride()))
        return tuple(x.shape), strides, x.dtype, x.device, x.requires_grad, type(x)
    if isinstance(x, _PLAIN):
        return type(x), x
    raise _NotRepeatable(f"it is given a {type(x).__name__}")


def _call_key(model: tuple, args: tuple, kwargs: dict) -> tuple[tuple, tuple, tuple]:
    """A call's kind; its kind but for its sizes (a growing call's: see :class:`_Curve`); and
    those sizes: each tensor's shape and strides, each int argument's value."""
    leaves, spec = _priv.tree_flatten((args, kwargs))
    flags = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
             torch.is_inference_mode_enabled())
    loose, numbers = [], []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            loose.append((x.dim(), x.dtype, x.device, x.requires_grad, type(x)))
            numbers += x.shape
            numbers += (s if n != 1 else 0 for n, s in zip(x.shape, x.stride()))
        elif type(x) is int:
            loose.append(int)
            numbers.append(x)
        else:
            loose.append(_leaf_key(x))
    return ((model, spec, tuple(_leaf_key(x) for x in leaves), *flags),
            (model, spec, tuple(loose), *flags), tuple(numbers))


def _describe(value: Any) -> tuple:
    """What a call starts from in an attribute it sets: a tensor's shape and dtype, a plain
    value, else its type."""
    if isinstance(value, torch.Tensor):
        return "t", tuple(value.shape), value.dtype
    if isinstance(value, _PLAIN):
        return "v", type(value), value
    return "x", type(value)


def _attributes(module: torch.nn.Module) -> list[tuple[Any, dict]]:
    """Each module's attributes as they are now: name -> (identity, :func:`_describe`) (no
    reference to the values: holding one would keep a tensor the call replaces alive past
    its place)."""
    return [(m, {k: (id(v), _describe(v)) for k, v in vars(m).items()})
            for m in module.modules()]


def _starts(modules: list[torch.nn.Module], attrs: tuple) -> tuple:
    """What the attributes ``attrs`` of ``modules`` (the model's, in order) hold now
    (:func:`_describe`; ``None``: absent)."""
    out = []
    for i, k in attrs:
        now = vars(modules[i])
        out.append(_describe(now[k]) if k in now else None)
    return tuple(out)


def _set_attributes(before: list[tuple[Any, dict]]) -> tuple[tuple, list, tuple]:
    """The attributes a call set, as (module's place, name), their new values, and what
    they held before it (:func:`_starts`); a call that removed one is no repeat."""
    places, values, starts = [], [], []
    for i, (m, attrs) in enumerate(before):
        now = vars(m)
        if any(k not in now for k in attrs):
            raise _NotRepeatable("it removes an attribute of its modules")
        for k, v in now.items():
            old = attrs.get(k)
            if old is None or id(v) != old[0]:
                places.append((i, k))
                values.append(v)
                starts.append(None if old is None else old[1])
    return tuple(places), values, tuple(starts)


def _sole_holder(modules: list[torch.nn.Module], attrs: tuple) -> bool:
    """Whether an attribute a call of this kind sets (of ``modules``, the model's in order)
    holds the only reference to its tensor now: the call that ran freed it where it set the
    attribute (inside the call), which an evaluated call, setting it once its buffers are
    done, would not."""
    for i, k in attrs:
        old = vars(modules[i]).get(k)
        # the module's __dict__, ``old`` and getrefcount's argument
        if isinstance(old, torch.Tensor) and sys.getrefcount(old) <= 3:
            return True
    return False


# -- what a call did --------------------------------------------------------------------------------
def _output(tracker: SimTracker, out: Any) -> tuple[dict[int, int], tuple, Any, tuple]:
    """serial -> output slot, each slot's (shape, dtype, device), the output's pytree spec
    and its leaves as ``("o", slot)`` / ``("v", value)``."""
    leaves, spec = _priv.tree_flatten(out)
    slots: dict[int, int] = {}
    outs, marks = [], []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            serial = tracker.serial_of(leaf)
            if (type(leaf) is not _priv.FakeTensor or serial is None or serial in slots
                    or not whole(leaf) or leaf.requires_grad):
                raise _NotRepeatable("its output holds a tensor that is not a new one of its own")
            if _priv.fake_constant(leaf) is not None:
                raise _NotRepeatable("its output carries values")
            slots[serial] = len(outs)
            marks.append(("o", len(outs)))
            outs.append((tuple(leaf.shape), leaf.dtype, leaf.device))
        elif isinstance(leaf, _PLAIN):
            marks.append(("v", leaf))
        else:
            raise _NotRepeatable(f"its output holds a {type(leaf).__name__}")
    return slots, tuple(outs), spec, tuple(marks)


def _codes(entries: list[dict], slots: dict[int, int], cached: bool
           ) -> tuple[tuple, tuple, list, list, list]:
    """A call's allocator entries as codes and alloc sizes (see :class:`_Pass`), the keys of
    its transient buffers (by number), the keys it keeps, and the op (the tracker's count)
    of each code; ``cached``: autocast may keep weight casts (to its exit)."""
    freed = {e["key"] for e in entries if e["action"] == "free_completed"}
    transient: dict[Any, int] = {}
    codes, sizes, kept, ops = [], [], [], []
    for e in entries:
        action, key = e["action"], e["key"]
        if action in ("alloc", "free_completed"):
            ops.append(e.get("op"))
        if action == "alloc":
            if key in freed:
                codes.append(("a", transient.setdefault(key, len(transient))))
            elif key in slots:
                codes.append(("o", slots[key]))
            elif cached:  # autocast's weight cast, held in its cache until autocast exits
                codes.append(("k", len(kept)))
                kept.append(key)
            else:
                raise _NotRepeatable("it keeps memory past its call (in the model, a cache, "
                                     "a library's workspace)")
            sizes.append(e["size"])
        elif action == "free_completed":
            if key not in transient:
                raise _NotRepeatable("it frees memory made before it")
            codes.append(("f", transient[key]))
        elif action == "oom":
            raise _NotRepeatable("it ran out of memory")
    if sum(c[0] == "o" for c in codes) != len(slots):
        raise _NotRepeatable("its output holds a tensor made before it")
    return tuple(codes), tuple(sizes), list(transient), kept, ops


def _rise(codes: tuple, sizes: tuple) -> tuple[int, int, int]:
    """The most bytes a call holds at once above what it began with (as the tracker counts
    them), the bytes of segments it could add at most, and the code that first holds the
    most."""
    held = rise = bound = at = 0
    size_of: dict[int, int] = {}
    it = iter(sizes)
    for i, (kind, x) in enumerate(codes):
        if kind == "f":
            held -= size_of.pop(x)
            continue
        n = round_request(next(it))
        bound += segment_size(n)
        held += n
        if kind == "a":
            size_of[x] = n
        if held > rise:  # ("o" and "k": held past the call)
            rise, at = held, i
    return rise, bound, at


def _steps(line: _Pass):
    """A call's allocs and frees as :meth:`CachingAllocatorModel.would_fit` takes them."""
    it = iter(line.sizes)
    for code, x in line.codes:
        yield ((code, x), next(it)) if code != "f" else (("a", x), None)


def _cast_cache_on() -> bool:
    """Whether autocast may cache weight casts now (they live until it exits)."""
    return torch.is_autocast_enabled("cuda") and torch.is_autocast_cache_enabled()


def _host_rise(tracker: SimTracker, events: list) -> int:
    """The most host bytes a call's events hold at once; it must free them all."""
    held = rise = 0
    for serial, delta, _ in events:
        if tracker.pool_of.get(serial) != "device":
            held += delta
            rise = max(rise, held)
    if held:
        raise _NotRepeatable("it keeps host memory past its call")
    return rise


# -- the run's calls -----------------------------------------------------------------------------------
@atomic
class _Repeats:
    """The outermost module calls of one run with gradients off (see the module's
    docstring)."""

    def __init__(self, tracker: SimTracker, state: SimState) -> None:
        self.tracker, self.state = tracker, state
        self.depth = 0  # module calls under way
        self.kinds: dict[tuple, _Kind] = {}
        self.growths: dict[tuple, _Growth] = {}  # by kind but for the sizes
        self.calls = 0  # evaluated calls, for their buffers' keys
        self.ran = 0  # calls that ran op by op
        self.reasons: dict[str, str] = {}  # model -> why its calls all ran
        self.checks: list[tuple[str, bool]] = []
        # autocast's weight casts an evaluated call made: freed when autocast exits; and the
        # casts calls that ran kept, which must be freed then too
        self.pending: dict[Any, Any] = {}
        self.unconfirmed: list[tuple[_Kind, list]] = []

    def call(self, original: Callable, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        """An outermost call with gradients off: through torch's own call (its hooks) to
        :meth:`forward` in place of the module's forward."""
        __tracebackhide__ = True
        a = self.tracker.allocator
        with _priv.no_function_modes():  # (each tensor attribute read would pass the run's mode)
            model = _model_key(module) if a is not None and a.logging else None
        if model is None:
            return original(module, *args, **kwargs)
        patches = Patches()
        patches.set(module, "forward", functools.partial(self.forward, module, model,
                                                         module.forward))
        try:
            return original(module, *args, **kwargs)
        finally:
            patches.restore()

    def forward(self, module: torch.nn.Module, model: tuple, forward: Callable, *args: Any,
                **kwargs: Any) -> Any:
        __tracebackhide__ = True
        name = type(module).__name__
        try:
            with _priv.no_function_modes():
                key, loose, numbers = _call_key(model, args, kwargs)
        except _NotRepeatable as e:
            self.reasons.setdefault(name, str(e))
            self.ran += 1
            return forward(*args, **kwargs)
        kind = self.kinds.get(key)
        if kind is None:
            kind = self.kinds[key] = _Kind(name)
        if kind.line is not None and kind.left > 0:
            out = self._evaluate(kind, module, kind.line)
            if out is not _RUN:
                return out
        grow = self.growths.get(loose)
        if grow is None:
            grow = self.growths[loose] = _Growth(name)
        if (grow.line is not None and grow.left > 0
                and grow.line.inputs_at(grow.at) == numbers):
            out = self._evaluate(grow, module, grow.line.at(grow.at), grows=True)
            if out is not _RUN:
                grow.at += 1
                return out
        return self._run(kind, module, forward, args, kwargs, grow, numbers)

    def _run(self, kind: _Kind, module: torch.nn.Module, forward: Callable, args: tuple,
             kwargs: dict, grow: _Growth, numbers: tuple) -> Any:
        tracker, state = self.tracker, self.state
        a = tracker.allocator
        start, ops, reads = a.log_length, len(tracker.op_log), state.value_reads
        events = len(tracker.events)
        before = _attributes(module)
        self.ran += 1
        out = forward(*args, **kwargs)
        try:
            if state.value_reads != reads:
                raise _NotRepeatable("it reads tensor values into Python (.item(), a condition "
                                     "on a tensor, tolist)")
            if not tracker.trace_ops:
                raise _NotRepeatable("the run keeps no op log")
            shaped = {op[0] for op in tracker.op_log[ops:]} & _VALUE_SHAPED
            if shaped:
                raise _NotRepeatable(f"it runs {min(shaped)}, whose output's shape follows "
                                     "from tensor values")
            host = _host_rise(tracker, tracker.events[events:])
            attrs, values, starts = _set_attributes(before)
            slots, outs, spec, leaves = _output(tracker, (out, values))
            codes, sizes, transient, kept, at = _codes(a.log_since(start), slots,
                                                       _cast_cache_on())
            made = tuple((tracker.roles.get(k), tracker.frames.get(k)) for k in transient + kept)
            rise, bound, top = _rise(codes, sizes)
            peak = None  # (op, (phase, module, label)) where the call reached its rise
            if codes and at[top]:
                op, where, phase, label = tracker.op_log[at[top] - 1]
                peak = op, (phase, where, label)
            done = _Pass(codes, sizes, made, outs, spec, leaves, rise, bound, host, attrs,
                         starts, peak)
        except _NotRepeatable as e:
            self.reasons.setdefault(kind.name, str(e))
            kind.last = kind.line = None
            self._grew(grow, numbers, None)
            return out
        self._ran(kind, done)
        self._grew(grow, numbers, None if kept else done)
        if kept:  # confirmed once autocast frees them (see autocast_cleared)
            self.unconfirmed.append((kind, kept))
        return out

    def _said(self, kind: _Checked, ok: bool, due: bool) -> None:
        """A call of ``kind`` that a line could say ran: counted as a check where one was due
        after evaluated calls, or where it did not do what the line says."""
        if kind.evaluated and (due or not ok):
            self.checks.append((kind.name, ok))

    def _grew(self, grow: _Growth, numbers: tuple, done: _Pass | None) -> None:
        """A call ran: a check of its growth's curve, or one more call towards one."""
        due = grow.left <= 0
        ok = grow.ran_one(numbers, done)
        if ok is not None:
            self._said(grow, ok, due)

    def _ran(self, kind: _Kind, done: _Pass) -> None:
        """A call ran: a check of its kind's line (which then holds to the next one, or
        ends), or one more call towards two that agree."""
        if kind.line is not None:  # a check, or a call the line could not evaluate
            ok = kind.line.same(done)
            self._said(kind, ok, kind.left <= 0)
            if ok:
                kind.held()
                return
            kind.line, kind.gap = None, _FIRST_CHECK
        if done.same(kind.last):
            kind.line, kind.left = done, kind.gap
        kind.last = done

    def _evaluate(self, kind: _Checked, module: torch.nn.Module, line: _Pass,
                  grows: bool = False) -> Any:
        """A call of ``kind`` evaluated as ``line`` says (see the module's docstring); _RUN: it
        must run. ``grows``: a growing call's (see :class:`_Curve`), which may raise the run's
        peak: the peak then takes the op and module of the call that ran at that place."""
        tracker = self.tracker
        a = tracker.allocator
        modules = list(module.modules()) if line.attrs else []
        if line.attrs and (_starts(modules, line.attrs) != line.starts
                           or _sole_holder(modules, line.attrs)):
            # it starts from other attributes (code outside the calls set them), or frees
            # what its attribute held inside the call
            return _RUN
        raises = tracker.current["device"] + line.rise > tracker.peak["device"]
        if (raises and not (grows and line.peak is not None)
                or tracker.current["host"] + line.host > tracker.peak["host"]):
            return _RUN  # it would raise the run's peak: run, so the peak has its op
        if not a.would_fit(_steps(line), line.bound):
            return _RUN  # it does not fit: the out of memory is the op's own
        if (self.pending or self.unconfirmed) and any(c == "k" for c, _ in line.codes):
            return _RUN  # autocast still holds the casts of a call before: this one's differ
        kind.left -= 1
        kind.evaluated += 1
        with tracker.standing_in(line.peak if raises else None):
            made = self._replay(line)
        self.calls += 1
        leaves = [made[v] if code == "o" else v for code, v in line.leaves]
        out, values = _priv.tree_unflatten(leaves, line.spec)
        for (i, name), value in zip(line.attrs, values):
            setattr(modules[i], name, value)
        return out

    def _replay(self, line: _Pass) -> dict[int, torch.Tensor]:
        """An evaluated call's allocs and frees as ``line`` says: its buffers as storages the
        tracker counts, its outputs as simulated tensors (by output slot)."""
        tracker = self.tracker
        made: dict[int, torch.Tensor] = {}
        todo: list[tuple[Any, int | None, Any]] = []
        live: dict = {}
        buffers = sum(code == "a" for code, _ in line.codes)  # (the casts follow them in made)
        it = iter(line.sizes)
        try:
            for code, x in line.codes:
                if code == "o":
                    tracker.replay_storages(todo, live)
                    todo = []
                    next(it)
                    shape, dtype, device = line.outs[x]
                    made[x] = _EMPTY(shape, dtype=dtype, device=device)
                elif code == "f":
                    todo.append((("a", x), None, None))
                else:
                    like = line.made[x if code == "a" else buffers + x]
                    todo.append(((code, x), next(it), like))
            tracker.replay_storages(todo, live)
            for x in [k for k in live if k[0] == "k"]:
                self.pending[(self.calls, x)] = live.pop(x)
        finally:
            if live:  # an interrupt or an error: the call's buffers are freed, as on a GPU
                tracker.replay_storages([(k, None, None) for k in list(live)], live)
        return made

    def autocast_cleared(self) -> None:
        """Autocast exited and freed its weight casts: those of evaluated calls are freed
        too; a call that ran and kept memory autocast did not free is no repeat."""
        if self.pending:
            self.tracker.replay_storages([(k, None, None) for k in list(self.pending)],
                                         self.pending)
        a = self.tracker.allocator
        for kind, kept in self.unconfirmed:
            if a is not None and any(a.size_of(k) for k in kept):
                self.reasons.setdefault(kind.name, "it keeps memory past its call (in the "
                                                   "model, a cache, a library's workspace)")
                kind.last = kind.line = None
        self.unconfirmed = []

    def note(self) -> str | None:
        """The report's note on the calls evaluated, the checks, and why calls all ran."""
        done = sum(k.evaluated for k in self.kinds.values())
        grew = sum(g.evaluated for g in self.growths.values())
        if not done and not grew:
            if self.ran < _UNSAID or not self.reasons:
                return None
            why = "; ".join(f"{name}: {reason}" for name, reason in sorted(self.reasons.items()))
            return (f"{self.ran} forward passes with gradients off ran op by op, none evaluated "
                    f"from the calls before it ({why}; the module's docstring, "
                    "memmagic.backends.sim.repeats, says which calls can be)")
        parts = []
        if done:
            models = sorted({k.name for k in self.kinds.values() if k.evaluated})
            parts.append(f"{done} forward passes with gradients off ({', '.join(models)}) were "
                         "evaluated, not run: each one did the allocations and frees of the two "
                         "calls of its kind before it (the same model, inputs of the same "
                         "shapes), in order on the allocator model")
        if grew:
            models = sorted({g.name for g in self.growths.values() if g.evaluated})
            parts.append(f"{grew} forward passes with gradients off ({', '.join(models)}) whose "
                         "sizes grew at each call (a decode loop: the tokens so far, a cache's "
                         "position) were evaluated, not run: each one did the allocations and "
                         "frees of the calls of its kind, sized by the quadratic in its place "
                         "through three calls that ran in a row and checked byte for byte by a "
                         "fourth, in order on the allocator model; a peak reached in one is "
                         "said to be in the op and module where the calls that ran reached it")
        text = "; ".join(parts) + (
            "; an evaluated call's output was made as simulated tensors; the timeline shows "
            "those tensors, not their transient buffers, and no Python code of the model ran "
            "in them (SimBackend(decode='run') runs every call)")
        good = sum(ok for _, ok in self.checks)
        bad = len(self.checks) - good
        if good:
            text += (f"; {good} call{'s' * (good > 1)} ran op by op as "
                     f"{'checks' if good > 1 else 'a check'} and did the same")
        if bad:
            text += (f"; {bad} check{'s' * (bad > 1)} did NOT do what the calls before did: "
                     "the calls evaluated before them may be off")
        return text


class _Run:
    """Marks an evaluated call's place: it must run op by op."""


_RUN = _Run()


def install_repeats(patches: Patches, tracker: SimTracker, state: SimState,
                    notes: list) -> None:
    """Evaluate the run's repeated forward passes with gradients off (see the module's
    docstring): ``nn.Module._call_impl`` replaced for the run; the report's note added
    when the run ends."""
    repeats = _Repeats(tracker, state)
    cls, slot = _priv.module_call_slot()
    original = getattr(cls, slot)

    @atomic  # (no interrupt lands between a count and its try)
    def _call_impl(module, *args, **kwargs):
        __tracebackhide__ = True
        if repeats.depth or torch.is_grad_enabled():
            repeats.depth += 1
            try:
                return original(module, *args, **kwargs)
            finally:
                repeats.depth -= 1
        repeats.depth += 1
        try:
            return repeats.call(original, module, args, kwargs)
        finally:
            repeats.depth -= 1

    patches.set(cls, slot, _call_impl)
    clear = torch.clear_autocast_cache

    def clear_autocast_cache() -> None:
        clear()
        repeats.autocast_cleared()

    patches.set(torch, "clear_autocast_cache", clear_autocast_cache)

    def add_note() -> None:
        repeats.autocast_cleared()  # (a run that ends inside autocast keeps no casts)
        text = repeats.note()
        if text:
            notes.append(text)

    patches.call_on_restore(add_note)
