"""Real values a simulation carries: small tensors whose values follow from their
arguments alone.

A factory whose values follow from its arguments (``arange``, ``zeros``, ``full``,
``ones_like``...) computes a small output for real and carries it as the fake tensor's
constant, so FakeTensorMode propagates real values through ops on such constants (up to
:data:`CONSTANT_NUMEL` elements) and reads give real numbers: control flow on masks,
step counts and shapes made from them takes the GPU's path. Outputs keep values only
where every input had them (:func:`propagate`, run by the tracker after every op).
"""

from __future__ import annotations

import torch

from ...core import _torch_private as _priv
from .state import CPU

__all__ = ["CONSTANT_NUMEL", "INDEX_NUMEL", "numel_bound", "propagate", "drop_unfounded_in_place",
           "seed_gpu_draws"]

_aten = torch.ops.aten

# Factories whose values follow from their arguments alone: a small output is computed
# for real and carried as the fake tensor's constant, so FakeTensorMode propagates real
# values through ops on such constants (up to CONSTANT_NUMEL) and reads give real numbers.
CONSTANT_NUMEL = 4096
# integer and bool values (positions, indices, masks) up to this many: transformers decides
# whether attention needs a mask from them (``find_packed_sequence_indices``: a diff and a
# cumsum of the position ids over batch x context, then ``.all()``); past 4096 elements a
# placeholder's False built a mask a GPU does not, and took another attention kernel
INDEX_NUMEL = 1 << 20


def numel_bound(dtype: torch.dtype) -> int:
    """How many elements a tensor of ``dtype`` may have and still carry its values."""
    return CONSTANT_NUMEL if dtype.is_floating_point or dtype.is_complex else INDEX_NUMEL

_VALUE_FACTORIES = {
    _aten.arange.default, _aten.arange.start, _aten.arange.start_step, _aten.linspace.default,
    _aten.logspace.default, _aten.zeros.default, _aten.ones.default, _aten.full.default,
    _aten.eye.default, _aten.eye.m, _aten.scalar_tensor.default, _aten.tril_indices.default,
    _aten.triu_indices.default,
}


# Factories from another tensor whose values are one fill value: (op, the fill from args)
_FILL_FACTORIES = {
    _aten.ones_like.default: lambda a, k: 1, _aten.zeros_like.default: lambda a, k: 0,
    _aten.full_like.default: lambda a, k: a[1], _aten.new_ones.default: lambda a, k: 1,
    _aten.new_zeros.default: lambda a, k: 0, _aten.new_full.default: lambda a, k: a[2],
}
_VALUE_FACTORIES = _VALUE_FACTORIES | set(_FILL_FACTORIES)
# random indices (nanoGPT's ``ix = torch.randint(len(data) - block_size, (batch_size,))``,
# a shuffle's ``randperm``): drawn for real when small, so slicing by them
# (``data[i:i + block_size]``) takes the GPU's shapes. A host tensor's draw comes from the
# host generator (or the one passed), advancing it as the real run does; a GPU tensor's
# from a generator of the simulation's own (a GPU run would not touch the host's).
_RANDOM_INDICES = {_aten.randint.default, _aten.randint.low, _aten.randint.generator,
                   _aten.randint.low_generator, _aten.randperm.default,
                   _aten.randperm.generator}
_VALUE_FACTORIES = _VALUE_FACTORIES | _RANDOM_INDICES
# a permutation is indices whatever its size (a dataset's shuffle: random_split's,
# DistributedSampler's ``randperm(len(dataset)).tolist()``): real up to INDEX_NUMEL, where
# random ints past CONSTANT_NUMEL are taken for data (a batch of token ids)
_PERMUTATIONS = {_aten.randperm.default, _aten.randperm.generator}
_WITH_GENERATOR = {_aten.randint.default: _aten.randint.generator,
                   _aten.randint.low: _aten.randint.low_generator,
                   _aten.randperm.default: _aten.randperm.generator}
# a draw of one random value decides a path (peft's LoHa adds its adapter when
# ``torch.rand(1) > module_dropout``, LayerDrop skips a layer when ``torch.rand([]) <
# layerdrop``): drawn for real, from the same generators as random indices; larger random
# tensors are data, whose values a simulation does not have
_RANDOM_DRAWS = {_aten.rand.default: torch.rand, _aten.rand.generator: torch.rand,
                 _aten.rand_like.default: torch.rand, _aten.randn.default: torch.randn,
                 _aten.randn.generator: torch.randn, _aten.randn_like.default: torch.randn}
_DRAW_NUMEL = 1
_VALUE_FACTORIES = _VALUE_FACTORIES | set(_RANDOM_DRAWS)
# draws into a tensor, in place: a DataLoader's seeds (``torch.empty((), dtype=torch.int64)
# .random_().item()``, at each iter() and in a shuffling sampler) are drawn for real from
# the host's generator, as a GPU run draws them: the loader's order is the GPU run's, and
# later draws (nanoGPT's batch indices) take the same values. Integers up to
# CONSTANT_NUMEL, one float (as _RANDOM_DRAWS)
_RANDOM_INTS = {_aten.random_.default, _aten.random_.to, getattr(_aten.random_, "from")}
_RANDOM_FILLS = _RANDOM_INTS | {_aten.uniform_.default, _aten.normal_.default}
_GPU_DRAWS = torch.Generator().manual_seed(0)
# samples from probabilities the simulation knows (a temperature demo's softmax of a
# literal): drawn for real, from the same generators; from a model's probabilities
# (generate()'s sampling) they are data
_MULTINOMIAL = _aten.multinomial.default
# ops whose result a known operand decides alone: x | True, x & False, x * 0 (a GPU's
# stopping criteria: ``unfinished & ~(max_len_done | eos_hit)``)
_OR_OPS = {_aten.bitwise_or.Tensor, _aten.logical_or.default}
# ops whose outputs hold no values (uninitialized memory): never constants
_UNINITIALIZED = {_aten.empty.memory_format, _aten.empty_like.default, _aten.new_empty.default,
                  _aten.new_empty_strided.default, _aten.empty_strided.default,
                  _aten.empty_permuted.default}
_AND_OPS = {_aten.bitwise_and.Tensor, _aten.logical_and.default, _aten.mul.Tensor}


def seed_gpu_draws(seed: int | None) -> None:
    """``torch.manual_seed(seed)`` (which seeds the GPU's generators too) or
    ``torch.cuda.manual_seed``: the simulated GPU's draws start again from ``seed``, so a
    seeded cell draws the same values at every run, as on a GPU (not the GPU's own values:
    its generator is another); None: from a seed of its own (``torch.cuda.seed()``)."""
    if seed is None:
        _GPU_DRAWS.seed()
    else:
        _GPU_DRAWS.manual_seed(int(seed))


def propagate(func, args: tuple, kwargs: dict, out, on_gpu: bool = False):
    """``out`` of ``func`` with the values it may carry: real values for a small value
    factory's output or where one known operand decides them, none for uninitialized
    memory or where an input had none. ``on_gpu``: the op runs on the simulated GPU (its
    random draws leave the host's generator alone)."""
    if func in _VALUE_FACTORIES:
        return _with_values(func, args, kwargs, out, on_gpu)
    if func in _RANDOM_FILLS:
        return _drawn_into(func, args, kwargs, out, on_gpu)
    if func is _MULTINOMIAL:
        return _sampled(args, kwargs, out, on_gpu)
    if func in _OR_OPS or func in _AND_OPS:
        return _absorbed(func, args, out)
    if func in _UNINITIALIZED and isinstance(out, torch.Tensor):
        _priv.drop_constant(out)
        return out
    _drop_unfounded(args, kwargs, out)
    if func in _VIEW_OPS or (func not in _NOT_VIEWS and _is_view(func)):
        return _realias(args, out)
    return out


_VIEW_OPS: set = set()
_NOT_VIEWS: set = set()


def _is_view(func) -> bool:
    view = bool(getattr(func, "is_view", False))
    (_VIEW_OPS if view else _NOT_VIEWS).add(func)
    return view


def _realias(args: tuple, out):
    """A view op's outputs, on its input's storage. On constants FakeTensorMode computes a
    view for real and converts the result; its real->fake memo (which would find the input
    again) is emptied at each cell's start, so a view of a constant made in an earlier cell
    came out on a storage of its own: ``x = text[:, :32]`` took memory a GPU does not
    spend."""
    base = args[0] if args else None
    if not (_priv.is_fake(base) and base.constant is not None):
        return out
    outs = out if isinstance(out, (tuple, list)) else (out,)
    key = _priv.storage_key(base.untyped_storage())
    real = base.constant.untyped_storage().data_ptr()
    fixed = []
    for o in outs:
        c = getattr(o, "constant", None)
        if (c is None or _priv.storage_key(o.untyped_storage()) == key
                or c.untyped_storage().data_ptr() != real):
            fixed.append(o)
            continue
        fixed.append(_priv.fake_alias(base, o))
    if not isinstance(out, (tuple, list)):
        return fixed[0]
    return type(out)(fixed)


def _with_values(func, args, kwargs, out, on_gpu: bool):
    """``out`` (a fake factory output) with its real values as its constant, when small
    (random ints up to CONSTANT_NUMEL whatever their dtype: a batch of token ids is data,
    not positions; a permutation up to INDEX_NUMEL)."""
    if not isinstance(out, torch.Tensor):
        return out
    bound = (CONSTANT_NUMEL if func in _RANDOM_INDICES and func not in _PERMUTATIONS
             else numel_bound(out.dtype))
    if out.numel() > bound or out.dtype.is_complex or _priv.fake_constant(out) is not None:
        return out
    mode = getattr(out, "fake_mode", None)
    if mode is None or out.fake_device.type == "meta":  # a meta tensor has no values
        return out
    fill = _FILL_FACTORIES.get(func)
    draw = _RANDOM_DRAWS.get(func)
    if draw is not None and (out.numel() > _DRAW_NUMEL or not out.dtype.is_floating_point):
        return out
    with _priv.no_python_modes():
        if draw is not None:
            real = draw(tuple(out.shape), dtype=out.dtype, generator=_generator(kwargs, on_gpu))
        elif fill is not None:
            real = torch.full(tuple(out.shape), fill(args, kwargs), dtype=out.dtype)
        elif func in _RANDOM_INDICES and on_gpu and kwargs.get("generator") is None:
            func = _WITH_GENERATOR.get(func, func)
            real = func(*args, **{**kwargs, "device": CPU, "generator": _GPU_DRAWS})
        else:
            real = func(*args, **{**kwargs, "device": CPU})
    return _priv.constant_fake(mode, real, out.fake_device)


def _drawn_into(func, args, kwargs, out, on_gpu: bool):
    """``out`` (the fake tensor a random fill wrote into) carrying the values drawn for
    real, from the host's generator (or the one passed; the simulation's own for a GPU
    tensor), when small (see _RANDOM_FILLS); else unknown, as FakeTensorMode leaves it."""
    if not _priv.is_fake(out) or out.dtype.is_complex or out.fake_device.type == "meta":
        return out
    if out.numel() > (CONSTANT_NUMEL if func in _RANDOM_INTS else _DRAW_NUMEL):
        return out
    gen = _generator(kwargs, on_gpu)
    return _carrying(out, lambda: func(torch.empty(tuple(out.shape), dtype=out.dtype),
                                       *args[1:], **{**kwargs, "generator": gen}))


def _sampled(args, kwargs, out, on_gpu: bool):
    """``out`` of ``multinomial`` carrying the samples drawn for real where its
    probabilities carry values (see _MULTINOMIAL) and it is small; else unknown."""
    probs = _priv.fake_constant(args[0]) if _priv.is_fake(args[0]) else None
    if probs is None or not _priv.is_fake(out) or out.numel() > CONSTANT_NUMEL:
        return out
    gen = _generator(kwargs, on_gpu)
    return _carrying(out, lambda: torch.multinomial(probs, *args[1:],
                                                    **{**kwargs, "generator": gen}))


def _generator(kwargs: dict, on_gpu: bool):
    """The generator a draw takes: the one passed, else the host's (None) or, on the GPU,
    the simulation's own."""
    return kwargs.get("generator") or (_GPU_DRAWS if on_gpu else None)


def _carrying(out, draw):
    """``out`` carrying what ``draw()`` makes for real (outside the run's modes) as its
    constant; ``out`` as it is where the draw fails (a generator of another device: the
    values are unknown; FakeTensorMode ran the op and says what is wrong with it)."""
    try:
        with _priv.no_python_modes():
            real = draw()
    except (RuntimeError, TypeError):
        return out
    _priv.give_constant(out, real)
    return out


def _drop_unfounded(args, kwargs, out) -> None:
    """Outputs may carry values only when every tensor input did: the meta kernels of ops
    on unknown data (``_embedding_bag``) make their outputs with ``new_empty`` on a known
    input, which FakeTensorMode turns into constants of uninitialized memory."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if not any(getattr(o, "constant", None) is not None for o in outs if isinstance(o, torch.Tensor)):
        return
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (tuple, list)) else (a,)):
            if _priv.is_fake(t) and t.constant is None:  # real tensors are known
                for o in outs:
                    if isinstance(o, torch.Tensor):
                        _priv.drop_constant(o)
                return


_WRITTEN: dict = {}


def _written_args(func) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments ``func`` writes to, from its schema (cached)."""
    w = _WRITTEN.get(func)
    if w is None:
        schema = _priv.op_schema(func)
        w = tuple((i, p.name) for i, p in enumerate(schema.arguments if schema else ())
                  if p.alias_info is not None and p.alias_info.is_write)
        _WRITTEN[func] = w
    return w


def drop_unfounded_in_place(func, args, kwargs) -> None:
    """After an in-place op (``add_``, ``native_batch_norm``'s running stats,
    ``_foreach_lerp_``): a written tensor keeps its values only when every tensor it was
    computed from had values. FakeTensorMode forgets the constant of a tensor an op writes
    to, but not of tensors inside a list argument (Adam's small moment buffers would stay
    zeros forever), not on a hit of its own dispatch cache, and not when the op cache
    answered instead of it."""
    for i, name in _written_args(func):
        target = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(target, torch.Tensor):
            target = (target,)
        elif not isinstance(target, (list, tuple)):
            continue
        if not any(getattr(t, "constant", None) is not None for t in target):
            continue
        lists, singles = _other_inputs(args, kwargs, target)
        unknown = any(_priv.is_fake(t) and t.constant is None for t in singles)
        for j, t in enumerate(target):
            if getattr(t, "constant", None) is None:
                continue
            if unknown or any(isinstance(lst[j], torch.Tensor) and _priv.is_fake(lst[j])
                              and lst[j].constant is None for lst in lists):
                _priv.drop_constant(t)


def _other_inputs(args, kwargs, target) -> tuple[list, list]:
    """The inputs an in-place op computed ``target`` from: (tensor lists as long as it,
    whose j-th element made its j-th; single tensors, which made every element)."""
    lists, singles = [], []
    for a in (*args, *kwargs.values()):
        if a is target:
            continue
        if isinstance(a, (list, tuple)) and len(a) == len(target) and len(target) > 1:
            lists.append(a)
        elif isinstance(a, torch.Tensor):
            singles.append(a)
        elif isinstance(a, (list, tuple)):
            singles.extend(t for t in a if isinstance(t, torch.Tensor))
    return lists, singles


def _absorbed(func, args, out):
    """``out`` with its values where one known operand decides them (all-True for or,
    all-False or zero for and/mul); ``out`` unchanged otherwise."""
    if (not isinstance(out, torch.Tensor) or out.numel() > CONSTANT_NUMEL
            or _priv.fake_constant(out) is not None or len(args) < 2):
        return out
    mode = getattr(out, "fake_mode", None)
    if mode is None:
        return out
    for a in args[:2]:
        const = _priv.fake_constant(a) if isinstance(a, torch.Tensor) else None
        if const is None:
            continue
        with _priv.no_python_modes():
            if func in _OR_OPS and out.dtype == torch.bool and bool(const.all()):
                return _priv.constant_fake(mode, torch.ones(tuple(out.shape), dtype=torch.bool),
                                         out.fake_device)
            if func in _AND_OPS and not bool(const.any()) and not out.dtype.is_floating_point:
                return _priv.constant_fake(mode, torch.zeros(tuple(out.shape), dtype=out.dtype),
                                         out.fake_device)
    return out
