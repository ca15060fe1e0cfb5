"""The simulation's op cache: outputs of fake ops built from their inputs' metadata.

An engine, not a shim: it lives with its user (the simulated device) and reaches torch's
private APIs only through :mod:`memmagic.core._torch_private` (the primitives it needs there:
``no_dispatch``, ``op_schema``, ``fake_from_template``, ``register_fake_constant``,
``constant_fake``, ``constant_view``, ``may_turn_const``, ``fake_constant``,
``dispatch_keys``, ``FAKE_DEVICE_ATTR``, ``fake_debug_enabled``, ``storage_key``,
``fake_dispatch_cache_size``, ``clear_fake_dispatch_cache``).
Tested in tests/core/test_torch_private_sim.py (the op-cache section).
"""

from __future__ import annotations

import math

import torch

from ...core import _torch_private as _priv
from ...core._torch_private import FakeTensor, FakeTensorMode

__all__ = ["FakeOutputCache", "FAKE_CACHE_MAX_ENTRIES", "FAKE_MODE_CACHE_MAX_ENTRIES",
           "bound_caches"]

_storage_key = _priv.storage_key
# torch's generator class, as imported (during a simulation ``torch.Generator`` is the
# simulated GPU's stand-in, whose instances of the host's kind are also this class's)
_GENERATOR = torch.Generator


class FakeOutputCache:
    """Outputs of fake ops from their inputs' metadata, without FakeTensorMode's dispatch.

    FakeTensorMode spends ~100 us on every op, even on a hit of its own dispatch cache
    (two thirds of it building that cache's key). This cache sits in front of it, in the
    simulation's dispatch mode: the key is the op, the default dtype, inference mode and,
    for each argument, a tensor's dtype/sizes/strides/offset/device or a plain value with
    its type (a float where the op takes a number beside a tensor, which cannot shape the
    outputs, only by its sign: Adam's step sizes change at every step, see _number_args);
    the entry is what FakeTensorMode returned: the metadata of fresh outputs, the
    geometry of views of the first argument, or that an in-place op returns its first
    argument (or nothing). On a hit the outputs are made directly (``empty_strided`` on
    meta wrapped in a FakeTensor), as FakeTensorMode's own cache does. Errors are never
    stored (a key is stored only after FakeTensorMode ran the op). ``torch.tensor(x)`` of
    one element becomes a fake constant without FakeTensorMode's converter. Everything
    else falls through to FakeTensorMode: ops whose output sizes depend on values, ops
    that resize or restride their arguments or mutate more than their first argument,
    tensors carrying a constant (their values matter), complex tensors (conj/neg bits),
    SymInts, real tensors and any argument the key does not know.

    A key not seen yet (a new batch size) need not cost FakeTensorMode's dispatch either
    (~0.3-10 ms on a miss, where it runs torch's Python decompositions: ``gelu_backward``
    takes 6.6 ms): its entry is derived from the op's own Meta kernel (the C++ structured
    kernel the CUDA kernel shares its shape logic with, or torch's Python meta
    registration), run on the fake inputs as FakeTensorMode runs a kernel
    (:func:`memmagic.core._torch_private.meta_kernels`). Only for a *class* of calls where the
    two were seen to agree: the first miss of each class (the op, and each argument's
    dtype, device, rank, size-0/1 dims, stride order, contiguity and offset, its plain
    values, its int lists' length and -1/0/1 entries) runs FakeTensorMode as before and the
    Meta kernel beside it; the class is trusted when the entries are equal, never
    otherwise. (Checked on the GPU check's 63 cells: new batch sizes give the uncached
    run's reports to the byte.) A derived entry that cannot be rebuilt from metadata, or a
    Meta kernel that raises, falls through to FakeTensorMode (whose error the user sees).
    """

    __slots__ = ("mode", "entries", "rules", "hits", "misses", "passes", "derived", "template")

    def __init__(self, mode: FakeTensorMode, entries: dict | None = None) -> None:
        """``entries``: a dict to share between runs of one configuration (the entries
        depend on the op implementations installed, not on the fake mode); it also holds
        the classes' verdicts (keys starting with "class")."""
        self.mode = mode
        self.entries: dict = {} if entries is None else entries
        bound_caches(self.entries)
        self.rules = _FAKE_CACHE_RULES  # func -> _fake_cache_rule(func)
        self.hits = 0
        self.misses = 0
        self.passes = 0  # calls left to FakeTensorMode without a key (or a "bypass" entry)
        self.derived = 0  # entries derived from Meta kernels (counted in hits too)
        self.template = _fake_template(mode)

    def __call__(self, func, args, kwargs):
        rule = self.rules.get(func, 0)
        if rule == 0:
            rule = self.rules[func] = _fake_cache_rule(func)
        if rule is None:
            self.passes += 1
            return func(*args, **kwargs)
        if rule == "lift":
            out = _fast_lift(self.mode, func, args, kwargs, self.template)
            if out is None:
                self.passes += 1
                return func(*args, **kwargs)
            self.hits += 1
            return out
        key = _cache_key(func, args, kwargs)
        if key is None:
            # every input carrying a constant (``i + block_size``): computed on them; else
            # (inputs of unknown values too) keyed by metadata
            out = _on_constants(self.mode, rule, func, args, kwargs, self.template)
            if out is not None:
                self.hits += 1
                return out
            key = _cache_key(func, args, kwargs, loose=True)
            if key is None:
                self.passes += 1
                return func(*args, **kwargs)
        entries = self.entries
        entry = entries.get(key)
        if entry is None:
            cls = _class_key(func, args, kwargs, rule == "view")
            verdict = None if cls is None else entries.get(cls)
            if verdict:
                entry = _meta_entry(rule, self.mode, func, args, kwargs, verdict)
            if entry is None:
                self.misses += 1
                out = func(*args, **kwargs)
                entry = entries[key] = _fake_cache_entry(rule, args, kwargs, out)
                if cls is not None and verdict is None:
                    entries[cls] = _judge(rule, self.mode, func, args, kwargs, entry)
                return out
            entries[key] = entry
            self.derived += 1
        kind = entry[0]
        if kind == "bypass":
            self.passes += 1
            return func(*args, **kwargs)
        self.hits += 1
        if kind == "one":
            return _fake_from_meta(self.mode, entry[1], self.template)
        if kind == "self":
            return args[0]
        if kind == "view":
            return _fake_view(self.mode, args[0], entry[1], self.template)
        if kind == "void":
            return None
        mode, template = self.mode, self.template
        if kind == "views":
            base = args[0]
            return [_fake_view(mode, base, g, template) for g in entry[1]]
        outs = [None if m is None else _fake_from_meta(mode, m, template) for m in entry[1]]
        return outs if kind == "list" else tuple(outs)


# bounds of the op cache's entries and of FakeTensorMode's own dispatch cache: a safety net
# (a notebook makes a few hundred entries for each model and batch size it runs; a key made
# from a value that changes every step would be a bug). An entry takes 2-3 KB (a foreach
# op's over many parameters more), so a full cache holds about 0.5 GB
FAKE_CACHE_MAX_ENTRIES = 200_000
FAKE_MODE_CACHE_MAX_ENTRIES = 200_000


def bound_caches(entries: dict | None = None) -> None:
    """Keep the op cache's ``entries`` and FakeTensorMode's own (class-wide) dispatch cache
    within their bounds: each is emptied once past it (the next calls fill it again from
    FakeTensorMode). Called when a card is made and before each of its cells, never
    during a run."""
    if entries is not None and len(entries) > FAKE_CACHE_MAX_ENTRIES:
        entries.clear()
    if _priv.fake_dispatch_cache_size() > FAKE_MODE_CACHE_MAX_ENTRIES:
        _priv.clear_fake_dispatch_cache()


_FAKE_CACHE_RULES: dict = {}
_NO_CACHE_TAGS = frozenset({torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output,
                            torch.Tag.inplace_view})
_NO_CACHE_NAMES = frozenset({"resize_", "resize_as_", "set_", "_resize_output_", "as_strided_",
                             "_local_scalar_dense", "item", "lift_fresh", "lift_fresh_copy"})


_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


def _fast_lift(mode: FakeTensorMode, func, args, kwargs, template: dict | None = None
               ) -> FakeTensor | None:
    """``torch.tensor(0.0)`` (``torch.from_numpy(a)`` in the simulation) under
    FakeTensorMode without its meta converter (~0.3 ms): a real tensor the mode keeps as a
    constant (:func:`memmagic.core._torch_private.may_turn_const`: one element as torch
    ships it, more in the simulation) becomes a fake tensor carrying a copy of it as its
    constant, registered as FakeTensorMode registers constants (writes to an alias make it
    forget the value) and memoized as it memoizes them. None for anything else
    (FakeTensorMode then converts it). ``template``: see :func:`_fake_template`."""
    if kwargs or len(args) != 1:
        return None
    with _priv.no_function_modes():  # its attribute reads and meta tensor: not the run's
        return _lift(mode, func, args[0], template)


def _lift(mode: FakeTensorMode, func, t, template: dict | None) -> FakeTensor | None:
    if (type(t) is not torch.Tensor or t.requires_grad or t.layout is not torch.strided
            or t.device.type != "cpu" or t.is_quantized or t.dtype.is_complex or t.is_neg()
            or t.is_conj() or not _priv.may_turn_const(mode, t)):
        return None
    with _priv.no_dispatch():
        const = func(t).clone()
    return _priv.constant_fake(mode, const, const.device, template)


def _on_constants(mode: FakeTensorMode, rule, func, args, kwargs, template: dict | None = None):
    """An op on fake tensors that all carry a constant (on the CPU FakeTensorMode sees: the
    simulated GPU's tensors too), as FakeTensorMode computes it:
    on the constants, for real, its output a constant again where the mode keeps it. One
    fresh tensor (``i + block_size`` of an index drawn for real), or views of the first
    argument (``for i in ix``: ``unbind``) on its storage. None where it is anything else
    (FakeTensorMode then runs it). Without its converter's description of each output
    (~0.5 ms). ``template``: see :func:`_fake_template`."""
    if rule not in ("fresh", "view", "views") or torch.Tag.nondeterministic_seeded in func.tags:
        return None
    real_args, real_kwargs, fakes = [], {}, 0
    for k, a in [(None, a) for a in args] + list((kwargs or {}).items()):
        if isinstance(a, torch.Tensor):
            a = _real_constant(a)
            if a is None:
                return None
            fakes += 1
        elif isinstance(a, (list, tuple)):
            # sizes (``view(1, -1)``, ``new_ones((b, 1))``) or tensors (``cat``, ``stack``)
            if all(type(x) is int for x in a):
                pass
            elif a and all(isinstance(x, torch.Tensor) for x in a):
                a = [_real_constant(x) for x in a]
                if any(x is None for x in a):
                    return None
                fakes += len(a)
            else:
                return None  # a SymInt, a mixed list: FakeTensorMode's
        elif not isinstance(a, _PLAIN_ARGS):
            return None  # a SymInt, a generator: FakeTensorMode's
        if k is None:
            real_args.append(a)
        else:
            real_kwargs[k] = a
    if not fakes or rule != "fresh" and (fakes > 1 or not isinstance(args[0], FakeTensor)):
        return None
    try:
        with _priv.no_dispatch():
            out = func(*real_args, **real_kwargs)
    except Exception:  # FakeTensorMode raises it, where the user's traceback is made
        return None
    if (rule == "views") != isinstance(out, (list, tuple)):
        return None
    outs = list(out) if rule == "views" else [out]
    if any(type(o) is not torch.Tensor or not _priv.may_turn_const(mode, o) for o in outs):
        return None
    if rule == "fresh":
        return _priv.constant_fake(mode, out, out.device, template)
    views = [_priv.constant_view(args[0], o, template=template) for o in outs]
    return views if rule == "views" else views[0]


_PLAIN_ARGS = (int, float, bool, str, torch.dtype, torch.device, torch.memory_format,
               torch.layout, type(None))


def _real_constant(t: torch.Tensor) -> torch.Tensor | None:
    """The real tensor a fake tensor carries as its constant (on the CPU FakeTensorMode
    sees), or None (not fake, no constant)."""
    const = _priv.fake_constant(t) if isinstance(t, FakeTensor) else None
    return None if const is None or t.fake_device.type != "cpu" else const


def _alias_set(x) -> frozenset | None:
    info = x.alias_info
    return None if info is None else frozenset(info.before_set)


def _fake_cache_rule(func):
    """How FakeOutputCache treats ``func``: None (never cached), "fresh" (returns new
    tensors), "view" (returns one view of its first argument), "views" (a list of them),
    "self" (in place: returns its first argument), "void" (in place, returns nothing) or
    "lift" (``torch.tensor``'s lift of a real tensor)."""
    if not isinstance(func, _priv.OpOverload):
        return None
    if _NO_CACHE_TAGS.intersection(func.tags):
        return None
    if func in _LIFTS:
        return "lift"
    schema = _priv.op_schema(func)
    if schema.name.split("::")[-1] in _NO_CACHE_NAMES:
        return None
    rets, params = schema.returns, schema.arguments
    if not params or not rets and not schema.is_mutable:
        return None
    first = _alias_set(params[0]) if params else None
    if func.is_view:
        # views of the first argument: one (t, view, detach, transpose, ...) or a list of
        # them (split, chunk, unbind)
        if (len(rets) == 1 and first is not None
                and sum(_alias_set(p) is not None for p in params) == 1):
            kind = str(rets[0].type)
            if (kind == "Tensor" and _alias_set(rets[0]) == first
                    and not rets[0].alias_info.is_write):
                return "view"
            if kind == "List[Tensor]":  # Tensor(a)[]: the alias is on the elements
                return "views"
        return None
    if schema.is_mutable:
        # in place on the first argument only (``add_``, ``_foreach_mul_``): an ``out=``
        # argument may be resized, other mutated arguments are not ours to reason about
        mutated = [p for p in params if p.alias_info is not None and p.alias_info.is_write]
        if len(mutated) != 1 or mutated[0] is not params[0] or params[0].kwarg_only:
            return None
        if not rets:
            return "void"
        if (len(rets) == 1 and _alias_set(rets[0]) == first
                and str(rets[0].type) == str(params[0].type) == "Tensor"):
            return "self"
        return None
    for r in rets:
        if r.alias_info is not None or str(r.type) not in ("Tensor", "List[Tensor]"):
            return None
    return "fresh"


def _cache_part(a, unknown: list | None):
    """The key part of argument ``a``, or None when it is not keyed. Strict (``unknown``
    None): a tensor carrying a constant is not keyed, its values matter. Loose (a list):
    it is keyed by its metadata, and ``unknown`` gets True for each fake tensor without
    one (see :func:`_cache_key`)."""
    if isinstance(a, FakeTensor):
        constant = a.constant
        if constant is not None and unknown is None:
            return None  # its values matter
        dtype = a.dtype
        if dtype.is_complex or a.layout is not torch.strided:
            return None  # conj/neg bits: not keyed
        meta = (dtype, a.shape, a.stride(), a.storage_offset(), a.fake_device)
        if constant is None:
            if unknown is not None:
                unknown.append(True)
            return meta
        return meta + ("constant",)
    cls = a.__class__
    if cls is int or cls is float or cls is bool or cls is str or a is None:
        return (cls, a)  # 1, 1.0 and True hash alike but promote differently
    if cls is list or cls is tuple:
        parts = _each(a, _cache_part, unknown)
        return None if parts is None else (cls, parts)
    if cls is torch.dtype or cls is torch.device or cls is torch.layout or cls is torch.memory_format:
        return a
    if isinstance(a, _GENERATOR):  # (one for the GPU too: torch.Generator is its stand-in)
        return _GENERATOR  # which generator does not change an output's sizes (fake ops draw nothing)
    return None  # a real tensor, a SymInt, anything else: not keyed


# floats a number argument keeps in its key (see _number_args): values code branches on (a
# decomposition's ``alpha == 1``, ``exponent == 2`` or ``0.5``; a Meta kernel's check of
# ``p > 0`` or of an infinite norm's order); other floats count by their sign
_KEPT_FLOATS = frozenset({0.0, 1.0, -1.0, 2.0, 0.5, math.inf, -math.inf})
# Scalar, Scalar?, Scalar[] as a schema spells them, and a tensor that may be a number
_NUMBER_TYPES = frozenset({"number", "Optional[number]", "List[number]", "Tensor",
                           "Optional[Tensor]"})
_NUMBER_ARGS: dict = {}  # func -> _number_args(func)


def _number_args(func) -> frozenset:
    """Positions and names of ``func``'s arguments where a Python float is a number that
    never shapes the outputs, when it takes a tensor (empty otherwise): a ``Scalar``
    (``Scalar?``, ``Scalar[]``), or a ``Tensor`` given a Python number (``t / 0.5`` is
    ``div.Tensor(t, 0.5)``: a 0-d "wrapped number"). Sizes, strides and dtype follow from
    the tensors and the numbers' types, so :func:`_number_part` keys a float by its sign.
    Without a tensor argument a Scalar may well shape them (``arange(end)``); a ``float``
    argument is left keyed by value (``upsample``'s scale factors). Adam's bias-corrected
    step sizes (``_foreach_addcdiv_``'s ``scalars``, or ``denom / bias_correction2_sqrt``)
    and a scheduler's learning rate (``alpha=-lr``) change at every step: keyed by value,
    every step made new entries, each a miss through FakeTensorMode (whose own cache grew
    too)."""
    schema = _priv.op_schema(func)
    if schema is None:
        return frozenset()
    types = [str(p.type) for p in schema.arguments]
    if not any("Tensor" in t for t in types):
        return frozenset()
    out: set = set()
    for i, (p, t) in enumerate(zip(schema.arguments, types)):
        if t in _NUMBER_TYPES:
            out.update((i, p.name))  # passed by position or by keyword
    return frozenset(out)


def _numbers_of(func) -> frozenset:
    numbers = _NUMBER_ARGS.get(func)
    if numbers is None:
        numbers = _NUMBER_ARGS[func] = _number_args(func)
    return numbers


def _float_kind(x: float):
    return x if x in _KEPT_FLOATS else "nan" if x != x else "+" if x > 0 else "-"


def _number_part(a, part, arg, item_arg):
    """``part(a, arg)`` for an argument at a position of :func:`_number_args`, but a Python
    float keyed by its sign (or by its value when it is one of ``_KEPT_FLOATS``; NaN as
    NaN), in a list too (its other items: ``part(x, item_arg)``). Ints and bools stay keyed
    by value: they rarely change from step to step, and code branches on more of them."""
    cls = a.__class__
    if cls is float:
        return (float, _float_kind(a))
    if (cls is list or cls is tuple) and any(x.__class__ is float for x in a):
        parts = []
        for x in a:
            p = (float, _float_kind(x)) if x.__class__ is float else part(x, item_arg)
            if p is None:
                return None
            parts.append(p)
        return (cls, tuple(parts))
    return part(a, arg)


def _each(items, part, arg) -> tuple | None:
    """``part(x, arg)`` of each item of a list argument, or None when one is not keyed."""
    parts = []
    for x in items:
        p = part(x, arg)
        if p is None:
            return None
        parts.append(p)
    return tuple(parts)


def _cache_key(func, args, kwargs, loose: bool = False):
    """The op cache's key of a call, or None when an argument is not keyed.

    ``loose``: for an op whose inputs mix tensors carrying a constant with tensors of
    unknown values (Adam's first ``_foreach_addcmul_`` on small zero-filled moments, the
    backward seed of ``nll_loss_backward``). FakeTensorMode computes on constants only when
    every input has one, so there it runs the meta kernel, whose outputs follow from
    metadata alone (ops whose output sizes depend on values are never cached); None when
    no input is of unknown value."""
    unknown: list | None = [] if loose else None
    parts = [func, torch.get_default_dtype(), torch.is_inference_mode_enabled()]
    if loose:
        parts.append("loose")
    append = parts.append
    numbers = _numbers_of(func)
    if not numbers:
        for a in args:
            p = _cache_part(a, unknown)
            if p is None:
                return None
            append(p)
    else:
        for i, a in enumerate(args):
            p = (_number_part(a, _cache_part, unknown, unknown) if i in numbers
                 else _cache_part(a, unknown))
            if p is None:
                return None
            append(p)
    if kwargs:
        for k, a in kwargs.items():
            p = (_number_part(a, _cache_part, unknown, unknown) if k in numbers
                 else _cache_part(a, unknown))
            if p is None:
                return None
            append(k)
            append(p)
    if loose and not unknown:
        return None
    return tuple(parts)


def _stands_for(t, device) -> torch.device | None:
    """The device output ``t`` stands for: a fake tensor's own (``device`` None), or
    ``device`` for a plain meta tensor a Meta kernel made; None when ``t`` is neither (or
    a fake tensor carrying a constant)."""
    if device is None:
        if isinstance(t, FakeTensor) and t.constant is None:
            return t.fake_device
        return None
    return device if type(t) is torch.Tensor and t.is_meta else None


def _fake_meta(t, seen: set, device=None):
    """(sizes, strides, dtype, device) of a fresh fake output, or None when it cannot be
    rebuilt from metadata (not fake, a constant, a view into a larger or shared storage).
    ``device``: ``t`` is a Meta kernel's output standing for that device."""
    dev = _stands_for(t, device)
    if dev is None or t.layout is not torch.strided:
        return None
    if t.storage_offset() != 0 or t.dtype.is_complex or t.requires_grad:
        return None
    st = t.untyped_storage()
    key = _storage_key(st)
    if key in seen:
        return None
    seen.add(key)
    shape, stride = tuple(t.shape), t.stride()
    need = 0 if 0 in shape else (1 + sum((n - 1) * s for n, s in zip(shape, stride))) * t.element_size()
    if st.nbytes() != need:
        return None
    return (shape, stride, t.dtype, dev)


def _same_storage(a, b) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    try:
        return _storage_key(a.untyped_storage()) == _storage_key(b.untyped_storage())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _view_geometry(out, base, device=None):
    """(sizes, strides, offset, dtype, device) of ``out``, a plain fake view of ``base``'s
    storage, or None when it cannot be rebuilt from that (``device``: as in _fake_meta)."""
    dev = _stands_for(out, device)
    if (dev is None or out.layout is not torch.strided or out.dtype.is_complex
            or out.requires_grad or not _same_storage(out, base)):
        return None
    return (tuple(out.shape), out.stride(), out.storage_offset(), out.dtype, dev)


def _fake_cache_entry(rule, args, kwargs, out, device=None) -> tuple:
    """What FakeOutputCache stores for one key: ("one", meta), ("list"|"tuple", metas with
    None for outputs not computed), ("view", geometry), ("views", geometries), ("self",),
    ("void",) or ("bypass",) when the output cannot be rebuilt from metadata. ``device``:
    ``out`` is what the op's Meta kernel returned, standing for that device."""
    bypass = ("bypass",)
    if rule == "view" or (rule == "fresh" and args and _same_storage(out, args[0])):
        # a view of the first argument (also an op that says it returns a new tensor but
        # returns its input's storage, like _unsafe_view)
        g = _view_geometry(out, args[0], device)
        return bypass if g is None else ("view", g)
    if rule == "views":
        if not isinstance(out, list):
            return bypass
        geoms = [_view_geometry(o, args[0], device) for o in out]
        return bypass if None in geoms else ("views", tuple(geoms))
    if rule == "self":
        return ("self",) if out is args[0] else bypass
    if rule == "void":
        return ("void",) if out is None else bypass
    seen: set = set()  # storages of the inputs and of earlier outputs: a fresh output owns its own
    for a in (*args, *kwargs.values()):
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, torch.Tensor):
                try:
                    seen.add(_storage_key(t.untyped_storage()))
                except (RuntimeError, NotImplementedError, TypeError):
                    return bypass
    if isinstance(out, torch.Tensor):
        m = _fake_meta(out, seen, device)
        return bypass if m is None else ("one", m)
    if isinstance(out, (list, tuple)):
        metas = []
        for o in out:
            if o is None:  # an output not asked for (convolution_backward's output_mask)
                metas.append(None)
                continue
            m = _fake_meta(o, seen, device)
            if m is None:
                return bypass
            metas.append(m)
        return ("list" if isinstance(out, list) else "tuple", tuple(metas))
    return bypass


# -- entries derived from Meta kernels ----------------------------------------------------------
def _class_part(a, in_list: bool = False):
    """The class-key part of argument ``a`` (see FakeOutputCache), or None when calls with
    it are never derived: a fake tensor's dtype (FakeTensorMode's decompositions and the
    Meta kernels part on dtypes: ``native_layer_norm`` of bf16 gives bf16 statistics in the
    former, float32 in the latter), device, rank, which dims have 0 or 1 elements or
    stride 0, the order of the others' strides, contiguity, offset 0 and whether it
    carries a constant (not its sizes; calls whose tensors all carry one never get here:
    FakeTensorMode computes their values); a plain value itself, but in a list an int by
    -1/0/1/other."""
    if isinstance(a, FakeTensor):
        if a.dtype.is_complex or a.layout is not torch.strided:
            return None
        shape, stride = a.shape, a.stride()
        small = tuple(n if n < 2 else 2 for n in shape)
        zero = tuple(x == 0 for x in stride)
        order = tuple(sorted((i for i, n in enumerate(shape) if n > 1), key=lambda i: -stride[i]))
        return (a.dtype, a.fake_device, small, zero, order, a.is_contiguous(),
                a.storage_offset() == 0, a.constant is None)
    cls = a.__class__
    if cls is int and in_list:
        return (int, a if -1 <= a <= 1 else "n")
    if cls is list or cls is tuple:
        parts = _each(a, _class_part, True)
        return None if parts is None else (cls, parts)
    if cls is torch.device:
        return None  # a factory's: where it places its outputs
    return _cache_part(a, None)  # other values as the op key has them (None: real tensors...)


def _class_key(func, args, kwargs, view: bool = False):
    """The class of a call whose outputs a Meta kernel may derive, or None (no fake tensor
    argument, or an argument _class_part does not know). Never equal to an op key.
    ``view``: a view of the first argument, whose ints (where a slice starts and ends, a
    dim, an index) place the view and shape it but choose no kernel: each is keyed by
    -1/0/1/other, as in a list. (A data loader slices a token tensor at a random start
    per sample, ``data[i:i + block_size]``: each start is a new key, and the class's Meta
    kernel gives its view without FakeTensorMode's dispatch.)"""
    parts = ["class", func, torch.get_default_dtype(), torch.is_inference_mode_enabled()]
    fake = False
    numbers = _numbers_of(func)
    for k, a in (*enumerate(args), *kwargs.items()):
        p = (_number_part(a, _class_part, False, True) if k in numbers
             else _class_part(a, view and a.__class__ is int))
        if p is None:
            return None
        fake = fake or isinstance(a, FakeTensor) or (isinstance(a, (list, tuple)) and any(
            isinstance(x, FakeTensor) for x in a))
        parts.append(k)
        parts.append(p)
    return tuple(parts) if fake else None


def _meta_entry(rule, mode: FakeTensorMode, func, args, kwargs, device) -> tuple | None:
    """The entry of a call derived from ``func``'s Meta kernel run on the fake inputs
    (outputs standing for ``device``), or None when the kernel raised or the outputs
    cannot be rebuilt from metadata."""
    try:
        with _priv.meta_kernels(mode):
            out = func(*args, **kwargs)
    except Exception:  # noqa: BLE001 - FakeTensorMode then runs it, and raises its own error
        return None
    entry = _fake_cache_entry(rule, args, kwargs, out, device)
    return None if entry[0] == "bypass" else entry


def _entry_device(entry: tuple):
    """The one device every output of ``entry`` stands for (``True`` when it has no
    output tensors), or None (none, or several)."""
    kind = entry[0]
    if kind in ("self", "void"):
        return True
    if kind == "bypass":
        return None
    body = entry[1]
    if kind == "one":
        devs = {body[3]}
    elif kind == "view":
        devs = {body[4]}
    elif kind == "views":
        devs = {g[4] for g in body}
    else:
        devs = {m[3] for m in body if m is not None}
    return devs.pop() if len(devs) == 1 else None


def _judge(rule, mode: FakeTensorMode, func, args, kwargs, entry: tuple):
    """A class's verdict after FakeTensorMode made ``entry`` for a call of it: the device
    its outputs stand for when the Meta kernel derives the same entry (the class is then
    trusted), else False."""
    device = _entry_device(entry)
    if device is None:
        return False
    derived = _meta_entry(rule, mode, func, args, kwargs, device)  # (True: no outputs to place)
    return device if derived == entry else False


def _fake_from_meta(mode: FakeTensorMode, meta, template: dict | None) -> FakeTensor:
    """A fresh FakeTensor of ``meta``'s sizes, strides, dtype and device. With a
    ``template`` (the ``__dict__`` of a FakeTensor made by its constructor), the
    constructor's Python work is replaced by copying that dict: see _fake_template."""
    shape, stride, dtype, device = meta
    with _priv.no_dispatch():
        empty = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return _priv.fake_from_template(mode, empty, device, template)


def _fake_view(mode: FakeTensorMode, base: FakeTensor, meta, template: dict | None) -> FakeTensor:
    """A FakeTensor viewing ``base``'s storage with ``meta``'s geometry (what
    FakeTensorMode's cache does for a view op)."""
    shape, stride, offset, dtype, device = meta
    # an inference tensor where the base is one (in inference mode a view of a normal
    # tensor is a normal tensor: autograd then shares the base's version counter with it)
    with _priv.no_dispatch(), torch.inference_mode(base.is_inference()):
        empty = torch.empty((0,), dtype=dtype, device="meta")
        empty.set_(base.untyped_storage(), offset, shape, stride)
        return _priv.fake_from_template(mode, empty, device, template)


def _fake_template(mode: FakeTensorMode) -> dict | None:
    """The attributes FakeTensor's constructor gives a fresh CPU fake tensor, or None when
    a tensor made by the fast path would differ from one made by the constructor (then
    FakeOutputCache uses the constructor)."""
    if _priv.fake_debug_enabled():
        return None
    cpu = torch.device("cpu")
    with _priv.no_dispatch():
        e1 = torch.empty_strided((2, 3), (3, 1), dtype=torch.float32, device="meta")
    ref = FakeTensor(mode, e1, cpu)
    template = dict(ref.__dict__)
    if template.get(_priv.FAKE_DEVICE_ATTR) != cpu:  # where FakeTensor keeps its device
        return None
    fast = _fake_from_meta(mode, ((2, 3), (3, 1), torch.float32, cpu), template)
    same = (type(fast) is type(ref) and fast.__dict__ == ref.__dict__
            and _priv.dispatch_keys(fast) == _priv.dispatch_keys(ref)
            and fast.device == ref.device and fast.requires_grad == ref.requires_grad)
    return template if same else None
