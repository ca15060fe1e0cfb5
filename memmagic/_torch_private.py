"""Every private PyTorch API memmagic relies on, in one place (tested in tests/test_torch_private.py).

If a torch upgrade breaks memmagic, this is the module to look at first.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.modules.module as _module_mod
import torch.optim.optimizer as _optim_mod

__all__ = [
    "in_backward",
    "dispatch_mode_depth",
    "function_mode_enabled",
    "saved_tensors_hooks_top",
    "made_by_newest_node",
    "global_module_hook_counts",
    "global_optimizer_hook_counts",
    "storage_key",
]


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def dispatch_mode_depth() -> int:
    """How many TorchDispatchModes are on this thread's stack."""
    return torch._C._len_torch_dispatch_stack()


def function_mode_enabled() -> bool:
    """Whether any TorchFunctionMode is active."""
    return bool(torch._C._is_torch_function_mode_enabled())


def saved_tensors_hooks_top() -> object:
    """The innermost default saved-tensor hooks (None when none are installed)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def made_by_newest_node(t: torch.Tensor) -> bool:
    """Whether ``t`` is an output of the autograd node created last on this thread.

    Inside a saved-tensor pack hook this tells an op's *output* (saved by the node that
    made it: holding it from the node closes a reference cycle) from an input (made by an
    earlier node). Nodes are numbered in creation order; the next number is not yet used.
    """
    fn = t.grad_fn
    return fn is not None and fn._sequence_nr() == torch._C._autograd._get_sequence_nr() - 1


def next_sequence_nr() -> int:
    """The number the next autograd node made on this thread will get (nodes are numbered
    in creation order; inside an op's dispatch its own node already has the one before)."""
    return torch._C._autograd._get_sequence_nr()


def current_autograd_node() -> tuple[int, str] | None:
    """(sequence number, class name) of the autograd node whose backward runs now on this
    thread, e.g. ``(41, "SoftmaxBackward0")``; None outside backward. The number is the one
    the node got when its forward op ran (compare :func:`next_sequence_nr`)."""
    node = torch._C._current_autograd_node()
    return None if node is None else (node._sequence_nr(), type(node).__name__)


def global_module_hook_counts() -> dict[str, int]:
    """Sizes of nn.Module's global hook registries (all 0 when nobody installed any)."""
    names = (
        "_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_hooks",
        "_global_backward_pre_hooks", "_global_parameter_registration_hooks",
        "_global_buffer_registration_hooks", "_global_module_registration_hooks",
    )
    return {n: len(getattr(_module_mod, n)) for n in names}


def global_optimizer_hook_counts() -> dict[str, int]:
    return {
        "pre": len(_optim_mod._global_optimizer_pre_hooks),
        "post": len(_optim_mod._global_optimizer_post_hooks),
    }


# storage_key(storage) -> int: a key for a storage that is unique while the storage lives
# (its StorageImpl address). An attrgetter, not a def: it runs for every tensor of every
# tracked op, and a C-level getter costs a fraction of a Python call.
storage_key = operator.attrgetter("_cdata")


# --- simulated device ---
# Private PyTorch APIs the simulated CUDA device (memmagic.backends.sim) relies on.
# Tested in tests/test_torch_private_sim.py.

import torch.utils._device as _device_mod  # noqa: E402
from torch._subclasses.fake_tensor import (  # noqa: E402
    CONSTANT_NUMEL_LIMIT as _CONSTANT_NUMEL_LIMIT,
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)

__all__ += [
    "FakeTensor", "FakeTensorMode", "DataDependentOutputException",
    "DynamicOutputShapeException", "UnsupportedOperatorException", "is_fake", "new_fake_mode",
    "fake_copy", "forget_fake_memo", "exclude_autocast_cpu", "has_kernel", "parse_to",
    "device_constructors", "function_mode_depth", "optimizer_modules_with_default_foreach",
    "single_process_loader_iter", "autocast_cpu_excluded",
]


def is_fake(t: object) -> bool:
    """Whether ``t`` is a FakeTensor (a tensor with metadata but no data)."""
    return isinstance(t, FakeTensor)


def new_fake_mode() -> FakeTensorMode:
    """A FakeTensorMode that also accepts real tensors (they are fakeified on use)."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_copy(mode: FakeTensorMode, t: torch.Tensor, constant_numel: int = 1) -> torch.Tensor:
    """A fake twin of a real tensor (same sizes, strides, dtype, requires_grad, .grad,
    Parameter-ness). Tensors of at most ``constant_numel`` elements that own their whole
    storage (a step count, a tokenizer's attention mask) keep their values as a constant,
    so reading them gives the real numbers."""
    if (t.numel() <= constant_numel and t.device.type == "cpu" and not t.requires_grad
            and t.layout == torch.strided and not isinstance(t, torch.nn.Parameter)
            and (t.numel() <= 1 or (t._base is None and t.is_contiguous()
                                    and t.untyped_storage().nbytes() == t.numel() * t.element_size()))):
        # the constant is updated in place by in-place ops: give it a copy, never ``t``
        return mode.fake_tensor_converter.from_real_tensor(mode, t.clone(), make_constant=True)
    return mode.from_tensor(t)


def forget_fake_memo(mode: FakeTensorMode) -> None:
    """Drop the real->fake memo of ``mode`` so fake copies live only as long as their users
    (otherwise ``del x`` of a fake copy would never free it in the simulation)."""
    conv = mode.fake_tensor_converter
    conv.tensor_memo.clear()
    conv.meta_converter.tensor_memo.clear()
    conv.meta_converter.storage_memo.clear()


def exclude_autocast_cpu():
    """Context manager: the AutocastCPU dispatch key is skipped (to call the op below it)."""
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU))


def autocast_cpu_excluded() -> bool:
    return torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutocastCPU)


def has_kernel(op_name: str, dispatch_key: str) -> bool:
    """Whether ``op_name`` (``'aten::softmax.int'``) has a kernel for ``dispatch_key``."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op_name, dispatch_key)


def parse_to(*args, **kwargs):
    """``Tensor.to``'s argument parser: (device, dtype, non_blocking, memory_format)."""
    return torch._C._nn._parse_to(*args, **kwargs)


def device_constructors() -> set:
    """The torch functions that take a ``device=`` and create a tensor (factories)."""
    return set(_device_mod._device_constructors())


def function_mode_depth() -> int:
    """How many TorchFunctionModes are on this thread's stack."""
    return torch._C._len_torch_function_stack()


_OPTIM_MODULES: tuple[int, list] = (-1, [])


def optimizer_modules_with_default_foreach() -> list:
    """torch.optim modules whose ``_default_to_fused_or_foreach`` decides foreach/fused
    (the scan of ``sys.modules`` is redone only when modules were imported since)."""
    import sys

    import torch.optim  # noqa: F401

    global _OPTIM_MODULES
    n = len(sys.modules)
    if _OPTIM_MODULES[0] != n:
        _OPTIM_MODULES = (n, [m for name, m in sorted(sys.modules.items())
                              if name.startswith("torch.optim") and m is not None
                              and hasattr(m, "_default_to_fused_or_foreach")])
    return list(_OPTIM_MODULES[1])


def single_process_loader_iter(loader):
    """The iterator a DataLoader with ``num_workers=0`` uses."""
    from torch.utils.data.dataloader import _SingleProcessDataLoaderIter

    return _SingleProcessDataLoaderIter(loader)


def call_composite(op, *args, **kwargs):
    """Run ``op``'s C++ CompositeImplicitAutograd kernel (not a Python decomposition that
    ``OpOverload.decompose`` would prefer): the behaviour the op has on the CPU."""
    return op._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, *args, **kwargs)


__all__ += ["call_composite"]


def no_python_modes():
    """Context manager: no dispatch or function modes (to run a real op inside a mode)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


__all__ += ["no_python_modes"]


def fake_device(t: torch.Tensor) -> torch.device | None:
    """The device a FakeTensor stands for (None for other tensors), without going through
    the ``device`` property."""
    return getattr(t, "fake_device", None)


def fake_constant(t: torch.Tensor) -> torch.Tensor | None:
    """The real value a FakeTensor carries when the fake mode knows it (a tensor made from a
    constant and changed only by ops on constants), else None."""
    return getattr(t, "constant", None)


def constant_fake(mode: FakeTensorMode, real: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A FakeTensor of ``mode`` carrying ``real`` (a plain CPU tensor) as its constant, with
    the fake device of ``like``; FakeTensorMode then computes ops on it for real while the
    result stays within ``torch._subclasses.fake_tensor.CONSTANT_NUMEL_LIMIT``."""
    fake = mode.fake_tensor_converter.from_real_tensor(mode, real, make_constant=True)
    fake.fake_device = like.fake_device
    return fake


def constant_numel_limit_holder():
    """(module, name) of FakeTensorMode's bound on constant propagation (a module global)."""
    from torch._subclasses import fake_tensor

    return fake_tensor, "CONSTANT_NUMEL_LIMIT"


def drop_constant(t: torch.Tensor) -> None:
    """Forget the constant of a fake tensor (and of its aliases): its values are unknown.
    FakeTensorMode computes ops on constants for real, uninitialized ones too
    (``new_empty`` of a constant is a constant of garbage that later indexes memory)."""
    const = getattr(t, "constant", None)
    mode = getattr(t, "fake_mode", None)
    if const is None or mode is None:
        return
    mode.fake_tensor_converter.invalidate_constant_aliases(const)
    t.constant = None


__all__ += ["fake_device", "fake_constant", "constant_fake", "constant_numel_limit_holder",
            "drop_constant"]


def fake_mode_deepcopy(mode: FakeTensorMode, memo: dict) -> FakeTensorMode:
    """``FakeTensorMode.__deepcopy__`` for a simulated run: the mode itself.

    ``Tensor.__deepcopy__`` copies a FakeTensor's ``__dict__``, and with it its
    ``fake_mode`` (torch 2.13; pytorch issue 104465). The copied mode holds copies of the
    ``StorageWeakRef`` keys of its ``constant_storage_mapping``: objects that own a raw
    c10 weak reference (an int), so the original and the copy both release it. After a
    fake constant (``torch.tensor(0)``, BatchNorm's ``num_batches_tracked``) and a
    ``copy.deepcopy`` of a fake tensor (``nn.TransformerEncoder`` clones its layer) the
    heap is corrupted and the process dies at exit (SIGSEGV/SIGABRT)."""
    return mode


__all__ += ["fake_mode_deepcopy"]


class FakeOutputCache:
    """Outputs of fake ops from their inputs' metadata, without FakeTensorMode's dispatch.

    FakeTensorMode spends ~100 us on every op, even on a hit of its own dispatch cache
    (two thirds of it building that cache's key). This cache sits in front of it, in the
    simulation's dispatch mode: the key is the op, the default dtype, inference mode and,
    for each argument, a tensor's dtype/sizes/strides/offset/device or a plain value with
    its type; the entry is what FakeTensorMode returned: the metadata of fresh outputs, the
    geometry of views of the first argument, or that an in-place op returns its first
    argument (or nothing). On a hit the outputs are made directly (``empty_strided`` on
    meta wrapped in a FakeTensor), as FakeTensorMode's own cache does. Errors are never
    stored (a key is stored only after FakeTensorMode ran the op). ``torch.tensor(x)`` of
    one element becomes a fake constant without FakeTensorMode's converter. Everything
    else falls through to FakeTensorMode: ops whose output sizes depend on values, ops
    that resize or restride their arguments or mutate more than their first argument,
    tensors carrying a constant (their values matter), complex tensors (conj/neg bits),
    SymInts, real tensors and any argument the key does not know.
    """

    __slots__ = ("mode", "entries", "rules", "hits", "misses", "template")

    def __init__(self, mode: FakeTensorMode, entries: dict | None = None) -> None:
        """``entries``: a dict to share between runs of one configuration (the entries
        depend on the op implementations installed, not on the fake mode)."""
        self.mode = mode
        self.entries: dict = {} if entries is None else entries
        if len(self.entries) > FAKE_CACHE_MAX_ENTRIES:
            self.entries.clear()
        self.rules = _FAKE_CACHE_RULES  # func -> _fake_cache_rule(func)
        self.hits = 0
        self.misses = 0
        self.template = _fake_template(mode)

    def __call__(self, func, args, kwargs):
        rule = self.rules.get(func, 0)
        if rule == 0:
            rule = self.rules[func] = _fake_cache_rule(func)
        if rule is None:
            return func(*args, **kwargs)
        if rule == "lift":
            out = _fast_lift(self.mode, func, args, kwargs)
            if out is None:
                return func(*args, **kwargs)
            self.hits += 1
            return out
        key = _fake_cache_key(func, args, kwargs)
        if key is None:
            return func(*args, **kwargs)
        entry = self.entries.get(key)
        if entry is None:
            self.misses += 1
            out = func(*args, **kwargs)
            self.entries[key] = _fake_cache_entry(rule, args, kwargs, out)
            return out
        kind = entry[0]
        if kind == "bypass":
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


FAKE_CACHE_MAX_ENTRIES = 200_000
_FAKE_CACHE_RULES: dict = {}
_NO_CACHE_TAGS = frozenset({torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output,
                            torch.Tag.inplace_view})
_NO_CACHE_NAMES = frozenset({"resize_", "resize_as_", "set_", "_resize_output_", "as_strided_",
                             "_local_scalar_dense", "item", "lift_fresh", "lift_fresh_copy"})


_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


def _fast_lift(mode: FakeTensorMode, func, args, kwargs) -> FakeTensor | None:
    """``torch.tensor(0.0)`` under FakeTensorMode without its meta converter (~200 us): a
    real tensor of at most one element becomes a fake tensor carrying a copy of it as its
    constant, registered as FakeTensorMode registers constants (writes to an alias make it
    forget the value) and memoized as it memoizes them. None for anything else
    (FakeTensorMode then converts it)."""
    if kwargs or len(args) != 1:
        return None
    t = args[0]
    if (type(t) is not torch.Tensor or t.numel() > _CONSTANT_NUMEL_LIMIT or t.requires_grad
            or t.layout is not torch.strided or t.device.type != "cpu" or t.is_quantized
            or t.dtype.is_complex or t.is_neg() or t.is_conj()):
        return None
    with torch._C._DisableTorchDispatch():
        const = func(t).clone()
        meta = torch.empty_strided(const.shape, const.stride(), dtype=const.dtype, device="meta")
    out = FakeTensor(mode, meta, const.device, constant=const)
    conv = mode.fake_tensor_converter
    conv.add_constant_storage_mapping(out)
    # memoized like from_real_tensor: an in-place op on the constant (``step += 1``) then
    # finds this fake tensor again instead of making a new one
    conv.set_tensor_memo(const, out)
    return out


def _alias_set(x) -> frozenset | None:
    info = x.alias_info
    return None if info is None else frozenset(info.before_set)


def _fake_cache_rule(func):
    """How FakeOutputCache treats ``func``: None (never cached), "fresh" (returns new
    tensors), "view" (returns one view of its first argument), "views" (a list of them),
    "self" (in place: returns its first argument), "void" (in place, returns nothing) or
    "lift" (``torch.tensor``'s lift of a real tensor)."""
    if not isinstance(func, torch._ops.OpOverload):
        return None
    if _NO_CACHE_TAGS.intersection(func.tags):
        return None
    if func in _LIFTS:
        return "lift"
    schema = func._schema
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


def _fake_cache_part(a):
    if isinstance(a, FakeTensor):
        dtype = a.dtype
        if a.constant is not None or dtype.is_complex or a.layout is not torch.strided:
            return None  # a value that matters, or conj/neg bits: not keyed
        return (dtype, a.shape, a.stride(), a.storage_offset(), a.fake_device)
    cls = a.__class__
    if cls is int or cls is float or cls is bool or cls is str or a is None:
        return (cls, a)  # 1, 1.0 and True hash alike but promote differently
    if cls is list or cls is tuple:
        parts = []
        for x in a:
            p = _fake_cache_part(x)
            if p is None:
                return None
            parts.append(p)
        return (cls, tuple(parts))
    if cls is torch.dtype or cls is torch.device or cls is torch.layout or cls is torch.memory_format:
        return a
    if cls is torch.Generator:
        return cls  # which generator does not change an output's sizes (fake ops draw nothing)
    return None  # a real tensor, a SymInt, anything else: not keyed


def _fake_cache_key(func, args, kwargs):
    parts = [func, torch.get_default_dtype(), torch.is_inference_mode_enabled()]
    append = parts.append
    for a in args:
        p = _fake_cache_part(a)
        if p is None:
            return None
        append(p)
    if kwargs:
        for k, a in kwargs.items():
            p = _fake_cache_part(a)
            if p is None:
                return None
            append(k)
            append(p)
    return tuple(parts)


def _fake_meta(t, seen: set):
    """(sizes, strides, dtype, device) of a fresh fake output, or None when it cannot be
    rebuilt from metadata (not fake, a constant, a view into a larger or shared storage)."""
    if not isinstance(t, FakeTensor) or t.constant is not None or t.layout is not torch.strided:
        return None
    if t.storage_offset() != 0 or t.dtype.is_complex or t.requires_grad:
        return None
    st = t.untyped_storage()
    key = st._cdata
    if key in seen:
        return None
    seen.add(key)
    shape, stride = tuple(t.shape), t.stride()
    need = 0 if 0 in shape else (1 + sum((n - 1) * s for n, s in zip(shape, stride))) * t.element_size()
    if st.nbytes() != need:
        return None
    return (shape, stride, t.dtype, t.fake_device)


def _same_storage(a, b) -> bool:
    if not (isinstance(a, FakeTensor) and isinstance(b, FakeTensor)):
        return False
    try:
        return a.untyped_storage()._cdata == b.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _view_geometry(out, base):
    """(sizes, strides, offset, dtype, device) of ``out``, a plain fake view of ``base``'s
    storage, or None when it cannot be rebuilt from that."""
    if (not isinstance(out, FakeTensor) or out.constant is not None
            or out.layout is not torch.strided or out.dtype.is_complex or out.requires_grad
            or not _same_storage(out, base)):
        return None
    return (tuple(out.shape), out.stride(), out.storage_offset(), out.dtype, out.fake_device)


def _fake_cache_entry(rule, args, kwargs, out) -> tuple:
    """What FakeOutputCache stores for one key: ("one", meta), ("list"|"tuple", metas with
    None for outputs not computed), ("view", geometry), ("views", geometries), ("self",),
    ("void",) or ("bypass",) when the output cannot be rebuilt from metadata."""
    bypass = ("bypass",)
    if rule == "view" or (rule == "fresh" and args and _same_storage(out, args[0])):
        # a view of the first argument (also an op that says it returns a new tensor but
        # returns its input's storage, like _unsafe_view)
        g = _view_geometry(out, args[0])
        return bypass if g is None else ("view", g)
    if rule == "views":
        if not isinstance(out, list):
            return bypass
        geoms = [_view_geometry(o, args[0]) for o in out]
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
                    seen.add(t.untyped_storage()._cdata)
                except (RuntimeError, NotImplementedError, TypeError):
                    return bypass
    if isinstance(out, torch.Tensor):
        m = _fake_meta(out, seen)
        return bypass if m is None else ("one", m)
    if isinstance(out, (list, tuple)):
        metas = []
        for o in out:
            if o is None:  # an output not asked for (convolution_backward's output_mask)
                metas.append(None)
                continue
            m = _fake_meta(o, seen)
            if m is None:
                return bypass
            metas.append(m)
        return ("list" if isinstance(out, list) else "tuple", tuple(metas))
    return bypass


def _fake_from_meta(mode: FakeTensorMode, meta, template: dict | None) -> FakeTensor:
    """A fresh FakeTensor of ``meta``'s sizes, strides, dtype and device. With a
    ``template`` (the ``__dict__`` of a FakeTensor made by its constructor), the
    constructor's Python work is replaced by copying that dict: see _fake_template."""
    shape, stride, dtype, device = meta
    with torch._C._DisableTorchDispatch():
        empty = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return _wrap_fake(mode, empty, device, template)


def _wrap_fake(mode: FakeTensorMode, empty: torch.Tensor, device, template: dict | None) -> FakeTensor:
    if template is None:
        return FakeTensor(mode, empty, device)
    t = torch.Tensor._make_subclass(FakeTensor, empty, False, dispatch_device=True,
                                    device_for_backend_keys=device)
    if mode._allow_unsafe_data_ptr_access:  # what FakeTensor.__new__ does
        torch._C._set_warn_deprecated_on_mutable_data_ptr(t)
    else:
        torch._C._set_throw_on_mutable_data_ptr(t)
    t.__dict__.update(template)
    if device != template["_fake_device"]:
        t.fake_device = device
    return t


def _fake_view(mode: FakeTensorMode, base: FakeTensor, meta, template: dict | None) -> FakeTensor:
    """A FakeTensor viewing ``base``'s storage with ``meta``'s geometry (what
    FakeTensorMode's cache does for a view op)."""
    shape, stride, offset, dtype, device = meta
    with torch._C._DisableTorchDispatch():
        empty = torch.empty((0,), dtype=dtype, device="meta")
        empty.set_(base.untyped_storage(), offset, shape, stride)
    return _wrap_fake(mode, empty, device, template)


def _fake_template(mode: FakeTensorMode) -> dict | None:
    """The attributes FakeTensor's constructor gives a fresh CPU fake tensor, or None when
    a tensor made by the fast path would differ from one made by the constructor (then
    FakeOutputCache uses the constructor)."""
    if _fake_debug():
        return None
    cpu = torch.device("cpu")
    with torch._C._DisableTorchDispatch():
        e1 = torch.empty_strided((2, 3), (3, 1), dtype=torch.float32, device="meta")
    ref = FakeTensor(mode, e1, cpu)
    template = dict(ref.__dict__)
    if template.get("_fake_device") != cpu:  # where FakeTensor keeps its device
        return None
    fast = _fake_from_meta(mode, ((2, 3), (3, 1), torch.float32, cpu), template)
    same = (type(fast) is type(ref) and fast.__dict__ == ref.__dict__
            and torch._C._dispatch_keys(fast) == torch._C._dispatch_keys(ref)
            and fast.device == ref.device and fast.requires_grad == ref.requires_grad)
    return template if same else None


def _fake_debug() -> bool:
    from torch._subclasses.fake_tensor import FakeTensorConfig

    return bool(FakeTensorConfig.debug)


def clear_fake_dispatch_cache() -> None:
    """Empty FakeTensorMode's own (class-wide) dispatch cache."""
    FakeTensorMode.cache_clear()


__all__ += ["FakeOutputCache", "clear_fake_dispatch_cache"]


# --- scaled dot product attention's backend order ---
_SDP_NAMES = {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient", "MATH": "math",
              "CUDNN_ATTENTION": "cudnn", "OVERRIDEABLE": "overrideable"}


def sdp_priority_order() -> list[str]:
    """The order in which CUDA's SDPA dispatcher tries its backends ("flash", "efficient",
    "math", "cudnn", "overrideable"), as ``sdpa_kernel(..., set_priority=True)`` leaves it;
    torch's default order when this torch does not expose it."""
    from torch.nn.attention import SDPBackend

    names = {int(getattr(SDPBackend, k)): v for k, v in _SDP_NAMES.items() if hasattr(SDPBackend, k)}
    get = getattr(torch._C, "_get_sdp_priority_order", None)
    if get is None:
        return ["flash", "efficient", "math", "cudnn"]
    return [names[int(b)] for b in get() if int(b) in names]


__all__ += ["sdp_priority_order"]
