"""Every private PyTorch API memmagic relies on, in one place (tested in tests/core/test_torch_private.py).

If a torch upgrade breaks memmagic, this is the module to look at first.
"""

from __future__ import annotations

import operator
from contextlib import contextmanager as _contextmanager

from typing import Any, Callable, Iterator

import torch
import torch.nn.modules.module as _module_mod
import torch.optim.optimizer as _optim_mod
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "dtensor_fake_args_on",
    "in_backward",
    "dispatch_mode_depth",
    "function_mode_enabled",
    "dispatch_plumbing_files",
    "saved_tensors_hooks_top", "saved_tensors_hooks_lifted", "functorch_unwrapped",
    "made_by_newest_node",
    "next_sequence_nr",
    "current_autograd_node",
    "global_module_hook_counts",
    "global_optimizer_hook_counts",
    "storage_key",
    "TorchDispatchMode",
    "TrackerMode",
    "tensor_version",
    "op_schema",
    "node_saved_values",
    "own_parameters",
    "own_buffers",
    "child_modules",
    "compiled_inner",
    "dynamo_stance_callback_slot",
    "memory_snapshot",
    "record_memory_history",
    "zipfile_writer_slot",
]

# TorchDispatchMode (torch.utils._python_dispatch): the base of memmagic's trackers, through
# TrackerMode below.


class TrackerMode(TorchDispatchMode):
    """A TorchDispatchMode whose subclasses' ``__torch_dispatch__`` runs as written.

    TorchDispatchMode wraps a subclass's ``__torch_dispatch__`` in
    ``torch._disable_dynamo(recursive=True)`` (its ``__init_subclass__``, unless the class's
    ``_should_skip_dynamo()`` says False), so that Dynamo does not trace into the mode:
    8 us a call on this machine, 15% of a simulated training step. memmagic's trackers run
    ``torch.compile``'d code eagerly while they track (``tracking.EagerCompiled``), so
    Dynamo never traces under them and the wrapper buys nothing."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def dispatch_mode_depth() -> int:
    """How many TorchDispatchModes are on this thread's stack."""
    return torch._C._len_torch_dispatch_stack()


def dispatch_plumbing_files() -> tuple[str, ...]:
    """The files of torch's Python code that stand between an op's call and a dispatch mode's
    ``__torch_dispatch__`` (``OpOverload.__call__``, the modes' plumbing, the wrappers that
    keep dynamo out of it), as absolute paths."""
    import os

    import torch._compile
    import torch._dynamo.eval_frame
    import torch._ops
    import torch.utils._python_dispatch

    return tuple(os.path.abspath(m.__file__) for m in (
        torch._ops, torch.utils._python_dispatch, torch._compile, torch._dynamo.eval_frame))


def function_mode_enabled() -> bool:
    """Whether any TorchFunctionMode is active."""
    return bool(torch._C._is_torch_function_mode_enabled())


def saved_tensors_hooks_top() -> object:
    """The innermost default saved-tensor hooks (None when none are installed)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


@_contextmanager
def saved_tensors_hooks_lifted(pack_hook: Callable) -> Iterator[None]:
    """While active, the default saved-tensor hooks whose pack hook is ``pack_hook`` are off
    torch's stack of them, where they are the only ones installed (a feature that refuses
    any, torch.func's ``grad``, ``vjp``, ``jacrev`` and ``hessian``, then runs as without
    them), and back on it after; with other hooks installed too, nothing changes."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None or top[0] != pack_hook:
        yield
        return
    torch._C._autograd._pop_saved_tensors_default_hooks()
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        torch._C._autograd._push_saved_tensors_default_hooks(*top)  # the user's below: as is
        yield
        return
    try:
        yield
    finally:
        torch._C._autograd._push_saved_tensors_default_hooks(*top)


def functorch_unwrapped(t: torch.Tensor) -> torch.Tensor:
    """``t``'s innermost tensor under torch.func's wrappers (vmap's batched tensors, grad's
    and jvp's tracking tensors), which hold no storage of their own; ``t`` itself when it
    wraps nothing."""
    f = torch._C._functorch
    while f.is_functorch_wrapped_tensor(t):
        t = f.get_unwrapped(t)
    return t


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

# tensor_version(t) -> int: the counter autograd bumps on every in-place write to ``t``'s
# storage (``Tensor._version``); per saved tensor, hence an attrgetter.
tensor_version = operator.attrgetter("_version")

# A module's own registries (``nn.Module._parameters``, ``_buffers``, ``_modules``): the live
# dicts name -> tensor/module (values may be None), without recursing into children. Read in
# every module's forward pre-hook, hence attrgetters.
own_parameters = operator.attrgetter("_parameters")
own_buffers = operator.attrgetter("_buffers")
child_modules = operator.attrgetter("_modules")


def op_schema(func: object) -> Any:
    """The ``torch._C.FunctionSchema`` of an op overload (``torch.ops.aten.add.Tensor``):
    ``.arguments``, ``.returns``, ``.is_mutable``, ``.name``; None for anything else."""
    return getattr(func, "_schema", None)


def node_saved_values(node: object) -> Iterator[Any]:
    """The values an autograd node saved for its backward (its ``_saved_*`` attributes: a
    tensor, a tuple/list of them, or a plain value such as a dim); the ones that cannot be
    read (freed by an earlier backward, refused by a hook) are skipped."""
    for name in dir(node):
        if name.startswith("_saved_"):
            try:
                yield getattr(node, name)
            except Exception:  # freed by an earlier backward, or a hook refused
                continue


def compiled_inner(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module a ``torch.compile(module)`` wrapper (``OptimizedModule``) wraps, else None."""
    if type(module).__name__ != "OptimizedModule":
        return None
    inner = module.__dict__.get("_orig_mod") or module._modules.get("_orig_mod")
    return inner if isinstance(inner, torch.nn.Module) else None


def dynamo_stance_callback_slot() -> tuple[Any, str] | None:
    """(module, attribute name) of the function dynamo asks, once per call of a compiled
    function or module, for the callback to run (``torch._dynamo.eval_frame.
    _callback_from_stance``): wrapping it counts compiled calls. None when this torch has
    none. Imports dynamo (about a second the first time)."""
    import torch._dynamo.eval_frame as eval_frame

    name = "_callback_from_stance"
    return (eval_frame, name) if callable(getattr(eval_frame, name, None)) else None


def memory_snapshot(device: int) -> dict:
    """The CUDA caching allocator's snapshot (``torch.cuda.memory._snapshot``): a dict with
    "segments" and "device_traces" (one list of events per device, each event a dict with
    "action" and "size" in bytes)."""
    return torch.cuda.memory._snapshot(device)


def record_memory_history(enabled: str | None, *, device: int, max_entries: int = 0,
                          stacks: str = "python", clear_history: bool = False,
                          context: str | None = None) -> None:
    """Switch the caching allocator's event recording on (``enabled="all"``, no stack
    capture unless ``context`` asks for it: "alloc", "state" or "all", with ``stacks``
    "python" or "all"), a ring of ``max_entries`` events, or off (``enabled=None``) for
    ``device`` (``torch.cuda.memory._record_memory_history``)."""
    if enabled is None:
        torch.cuda.memory._record_memory_history(None, device=device)
        return
    torch.cuda.memory._record_memory_history(
        enabled, context=context, stacks=stacks, max_entries=max_entries, device=device,
        clear_history=clear_history)


# --- simulated device ---
# Private PyTorch APIs the simulated CUDA device (memmagic.backends.sim) relies on.
# Tested in tests/core/test_torch_private_sim.py.

import torch.utils._device as _device_mod  # noqa: E402
from torch._subclasses.fake_tensor import (  # noqa: E402
    CONSTANT_NUMEL_LIMIT as _CONSTANT_NUMEL_LIMIT,
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)

from torch._ops import OpOverload  # noqa: E402

# FakeTensorMode's bound on constant propagation as this torch ships it (the module global
# the simulation raises during a run: see constant_numel_limit_holder)
DEFAULT_CONSTANT_NUMEL_LIMIT: int = _CONSTANT_NUMEL_LIMIT

# The key of a FakeTensor's ``__dict__`` that holds the device it stands for.
FAKE_DEVICE_ATTR = "_fake_device"

# ``torch._C._nn._parse_to``: ``Tensor.to``/``nn.Module.to``'s argument parser as the function
# object a TorchFunctionMode receives (a handler table is keyed by it).
PARSE_TO_FUNCTION: Callable = torch._C._nn._parse_to

# ``torch._VF._pack_padded_sequence`` / ``_pad_packed_sequence``: what ``pack_padded_sequence``
# and ``pad_packed_sequence`` call, as the function objects a TorchFunctionMode receives.
PACK_PADDED_FUNCTION: Callable = torch._pack_padded_sequence
PAD_PACKED_FUNCTION: Callable = torch._pad_packed_sequence

# no_dispatch(): context manager, the Python dispatch key (modes, tensor subclasses) is
# skipped: ``torch.empty(..., device="meta")`` inside it makes a plain meta tensor.
no_dispatch = torch._C._DisableTorchDispatch

__all__ += [
    "OpOverload", "DEFAULT_CONSTANT_NUMEL_LIMIT", "FAKE_DEVICE_ATTR", "PARSE_TO_FUNCTION",
    "PACK_PADDED_FUNCTION", "PAD_PACKED_FUNCTION",
    "no_dispatch", "dispatch_keys", "bare_fake", "make_subclass_slot", "make_wrapper_subclass_slot", "accelerator_slot", "fake_as_subclass", "register_fake_constant", "fake_alias", "fake_debug_enabled",
    "fake_tensor_device_getter", "dataloader_iterator_slot", "destroy_library",
    "default_foreach_slots", "module_call_slot", "has_forward_hooks", "tree_flatten",
    "tree_unflatten", "ddp_param_check_slot", "register_reducer_comm_hook",
]


def dispatch_keys(t: torch.Tensor) -> object:
    """``t``'s dispatch key set (comparable with ``==``; ``str()`` lists the keys)."""
    return torch._C._dispatch_keys(t)


def bare_fake(mode: FakeTensorMode, meta: torch.Tensor, device: torch.device) -> FakeTensor:
    """A FakeTensor over the meta tensor ``meta`` standing for ``device``, made the way
    ``FakeTensor.__new__`` makes it at the C level but with none of its Python attributes:
    the caller gives it the ``__dict__`` of a tensor the constructor made (fake_mode, device,
    constant...). Costs a fraction of the constructor."""
    t = torch.Tensor._make_subclass(FakeTensor, meta, False, dispatch_device=True,
                                    device_for_backend_keys=device)
    if mode._allow_unsafe_data_ptr_access:  # what FakeTensor.__new__ does
        torch._C._set_warn_deprecated_on_mutable_data_ptr(t)
    else:
        torch._C._set_throw_on_mutable_data_ptr(t)
    return t


def register_fake_constant(mode: FakeTensorMode, const: torch.Tensor, fake: FakeTensor) -> None:
    """Register ``fake`` (made with ``constant=const``) with ``mode`` as its converter
    registers constants: a write to an alias of the constant makes the mode forget its
    value, and ``const`` maps back to ``fake`` (an in-place op on it, ``step += 1``, finds
    this fake tensor again instead of making a new one)."""
    conv = mode.fake_tensor_converter
    conv.add_constant_storage_mapping(fake)
    conv.set_tensor_memo(const, fake)


def fake_alias(base: FakeTensor, out: FakeTensor) -> FakeTensor:
    """``out`` (a FakeTensor carrying a constant, on a storage of its own) remade on
    ``base``'s storage with its sizes, strides, offset, fake device and constant, and
    registered as a constant."""
    return constant_view(base, out.constant, out)


def constant_view(base: FakeTensor, constant: torch.Tensor, like: torch.Tensor | None = None,
                  template: dict | None = None) -> FakeTensor:
    """A FakeTensor on ``base``'s storage (``base`` carries a constant laid out as it is)
    with the dtype, sizes, strides and offset of ``like`` (``constant``, a real view of
    base's constant, where None), standing for ``like``'s fake device (base's), carrying
    ``constant`` and registered as a constant: what FakeTensorMode makes of a view op on
    a constant, without its converter (``template``: see :func:`fake_from_template`)."""
    mode = base.fake_mode
    like = constant if like is None else like
    # a view is an inference tensor where its base is one (in inference mode, a view of a
    # normal tensor is a normal tensor, whose storage an inference tensor cannot take)
    with no_dispatch(), torch.inference_mode(base.is_inference()):
        meta = torch.empty((0,), dtype=like.dtype, device="meta")
        meta.set_(base.untyped_storage(), like.storage_offset(), like.shape, like.stride())
        fake = fake_from_template(mode, meta, getattr(like, "fake_device", base.fake_device),
                                  template, constant)
    register_fake_constant(mode, constant, fake)
    return fake


def make_subclass_slot() -> tuple[type, str]:
    """(class, attribute) of ``torch.Tensor._make_subclass``, with which a library makes its
    own Parameter subclass over a tensor (bitsandbytes' ``Params4bit`` and ``Int8Params``).
    Dynamo registers a polyfill for the function it finds there when it is imported: it is
    imported here, so that a replacement installed after this call is never the one it
    registers."""
    import torch._dynamo  # noqa: F401

    return torch.Tensor, "_make_subclass"


def accelerator_slot() -> tuple[Any, str]:
    """(module, attribute) of ``torch._C._get_accelerator(check=False)``, the accelerator
    torch's own Python code asks for (FSDP2's default mesh, c10d's default device): the
    simulation answers "cuda" there, as ``torch.accelerator`` does."""
    return torch._C, "_get_accelerator"


def zipfile_writer_slot() -> tuple[Any, str]:
    """(module, attribute) of ``torch.serialization._open_zipfile_writer_file``, the class
    ``torch.save`` opens a path with (its C++ writer opens the file itself, past Python's
    ``open``); every ``torch.save`` to a path, however the caller bound the function,
    looks it up there."""
    import torch.serialization as serialization

    return serialization, "_open_zipfile_writer_file"


def make_wrapper_subclass_slot() -> tuple[type, str]:
    """(class, attribute) of ``torch.Tensor._make_wrapper_subclass``, with which a wrapper
    tensor subclass (DTensor, torchao's quantized tensors) makes its storage-less outer
    tensor with the device it is given."""
    return torch.Tensor, "_make_wrapper_subclass"


def module_call_slot() -> tuple[type, str]:
    """(class, attribute) of ``nn.Module._call_impl``: what every module call runs
    (``_wrapped_call_impl`` looks it up on the module), which reads ``self.forward`` before
    it runs the global and the module's forward pre-hooks and calls it after them."""
    return torch.nn.Module, "_call_impl"


def has_forward_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` itself carries forward or forward pre-hooks (not the global ones)."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


def tree_flatten(tree: Any) -> tuple[list, Any]:
    """torch's pytree flatten: the leaves of nested tuples, lists, dicts, namedtuples and
    registered classes (transformers' ``ModelOutput``), and the spec to rebuild it."""
    from torch.utils import _pytree

    return _pytree.tree_flatten(tree)


def tree_unflatten(leaves: list, spec: Any) -> Any:
    from torch.utils import _pytree

    return _pytree.tree_unflatten(leaves, spec)


def ddp_param_check_slot() -> tuple[Any, str]:
    """(module, attribute) of ``_verify_param_shape_across_processes`` as
    ``DistributedDataParallel.__init__`` calls it: an all-gather of every parameter's shape
    through the process group, written and read on the host in C++ (fake tensors have no
    data there)."""
    import torch.nn.parallel.distributed as ddp

    return ddp, "_verify_param_shape_across_processes"


def register_reducer_comm_hook(reducer: Any, hook: Callable) -> None:
    """Install ``hook(state, bucket) -> Future`` as the communication hook of a DDP
    ``Reducer`` (what ``DistributedDataParallel.register_comm_hook`` does, with no state)."""
    import torch.distributed as dist

    dist._register_comm_hook(reducer, None, hook)


def swap_held_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """What ``torch.utils.swap_tensors(t1, t2)`` does (the classes, ``__dict__``, slots and
    the ``at::Tensor`` each points to are exchanged), without its refusal of a tensor that
    weakrefs point at: FakeTensorMode's converter memo holds one to every fake tensor it
    made, so ``nn.Module.to_empty`` of a model built on the meta device (whose fake meta
    parameters ``param.data = ...`` cannot take a tensor of another device) can swap
    nothing else. The weakrefs then reach the swapped-in contents, as the object is the
    same."""
    import copyreg

    slots = set(copyreg._slotnames(t1.__class__))  # type: ignore[attr-defined]
    if slots != set(copyreg._slotnames(t2.__class__)):  # type: ignore[attr-defined]
        raise RuntimeError("Cannot swap t1 and t2 if they have different slots")
    for name in ("__class__", "__dict__"):
        a, b = getattr(t1, name), getattr(t2, name)
        setattr(t1, name, b)
        setattr(t2, name, a)
    for slot in slots:
        has1, has2 = hasattr(t1, slot), hasattr(t2, slot)
        a, b = getattr(t1, slot, None), getattr(t2, slot, None)
        for t, held, value in ((t1, has2, b), (t2, has1, a)):
            if held:
                setattr(t, slot, value)
            elif hasattr(t, slot):
                delattr(t, slot)
    torch._C._swap_tensor_impl(t1, t2)


def can_set_data(t1: torch.Tensor, t2: torch.Tensor) -> bool:
    """Whether ``t1.data = t2`` is allowed (``nn.Module._apply``'s own test: the tensors'
    implementations are of one kind; a meta tensor's and a CPU one's are not)."""
    return torch._has_compatible_shallow_copy_type(t1, t2)


__all__ += ["swap_held_tensors", "can_set_data"]


_STAND_INS: dict[type, type] = {}


def _detach_keeping_class(self: FakeTensor) -> FakeTensor:
    """``detach()`` of a stand-in: the same class and attributes (``nn.Module._apply`` makes a
    Parameter of a fake one through ``detach()`` and swaps it in, where a GPU's run assigns
    ``param.data``: the library's attributes must survive the swap)."""
    out = torch.Tensor.detach(self)
    attrs = {k: v for k, v in self.__dict__.items() if k not in out.__dict__ and k != "_is_param"}
    out.__class__ = type(self)
    out.__dict__.update(attrs)
    return out


def _deepcopy_stand_in(self: FakeTensor, memo: dict) -> FakeTensor:
    """``copy.deepcopy`` of a stand-in (a copy of the simulated card): the tensor copied as
    any FakeTensor is, the library's attributes (a quantization state) deep-copied onto a
    stand-in of the same class. The library's own ``__deepcopy__`` would make its instance
    over a real empty tensor."""
    import copy

    data = copy.deepcopy(torch.Tensor.detach(self), memo)
    out = fake_as_subclass(type(self).__mro__[1], data, self.requires_grad)
    memo[id(self)] = out
    for k, v in self.__dict__.items():
        if k not in out.__dict__ and k != "_is_param":
            out.__dict__[k] = copy.deepcopy(v, memo)
    return out


def fake_as_subclass(cls: type, fake: FakeTensor, requires_grad: bool) -> FakeTensor:
    """What ``torch.Tensor._make_subclass(cls, fake, requires_grad)`` makes on a GPU, for a
    FakeTensor ``fake`` (where torch refuses: the tensor already has a Python object): a
    FakeTensor aliasing ``fake`` whose class derives from ``cls`` and FakeTensor, so that it
    is an instance of ``cls`` (its methods and attributes) and dispatches as a FakeTensor."""
    stand_in = _STAND_INS.get(cls)
    if stand_in is None:
        stand_in = _STAND_INS[cls] = type(cls.__name__, (cls, FakeTensor), {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "detach": _detach_keeping_class, "__deepcopy__": _deepcopy_stand_in})
    out = torch.Tensor.detach(fake)
    out.requires_grad_(requires_grad)
    out.__class__ = stand_in
    return out


def fake_debug_enabled() -> bool:
    """Whether FakeTensorMode's debug mode is on (fake tensors then record a traceback)."""
    from torch._subclasses.fake_tensor import FakeTensorConfig

    return bool(FakeTensorConfig.debug)


def fake_tensor_device_getter() -> Callable[[FakeTensor], torch.device]:
    """The getter of ``FakeTensor.device`` (the class's own Python property): call this
    before patching the property, the patched one is what it returns afterwards."""
    return FakeTensor.__dict__["device"].fget


def dataloader_iterator_slot() -> tuple[type, str]:
    """(class, attribute name) of the method ``iter(DataLoader)`` calls to make its iterator
    (``DataLoader._get_iterator``): replacing it changes what every loader iterates with."""
    import torch.utils.data as tud

    return tud.DataLoader, "_get_iterator"


def destroy_library(lib: torch.library.Library) -> None:
    """Take out every kernel ``lib`` registered (``Library._destroy``): the dispatcher then
    runs the kernels it had before."""
    lib._destroy()


def default_foreach_slots() -> list[tuple[Any, str]]:
    """(module, attribute name) of every loaded ``torch.optim`` module's
    ``_default_to_fused_or_foreach``: the function an optimizer asks whether to use the
    foreach/fused implementation when the user chose none."""
    return [(m, "_default_to_fused_or_foreach") for m in optimizer_modules_with_default_foreach()]


__all__ += [
    "FakeTensor", "FakeTensorMode", "DataDependentOutputException",
    "DynamicOutputShapeException", "UnsupportedOperatorException", "is_fake", "new_fake_mode",
    "fake_copy", "forget_fake_memo", "exclude_autocast_cpu", "has_kernel", "parse_to",
    "device_constructors", "function_mode_depth", "optimizer_modules_with_default_foreach",
    "single_process_loader_iter", "autocast_cpu_excluded",
]


def profiler_entry_slots() -> list[tuple[type, str]]:
    """(class, method) pairs through which every torch profiler starts: ``with
    torch.profiler.profile(...)``, ``prof.start()`` (its private base class
    ``_KinetoProfile`` too) and the legacy ``torch.autograd.profiler.profile``."""
    import torch.autograd.profiler as legacy
    import torch.profiler.profiler as prof

    return [(prof.profile, "start"), (prof._KinetoProfile, "start"),
            (legacy.profile, "__enter__")]


def data_parallel_stream_cache() -> tuple[Any, str] | None:
    """(module, name) of the global list in which ``nn.DataParallel``'s scatter keeps one
    stream per device (``torch.nn.parallel._functions._streams``), or None."""
    import torch.nn.parallel._functions as parallel_functions

    return (parallel_functions, "_streams") if hasattr(parallel_functions, "_streams") else None


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


def no_function_modes():
    """Context manager: no torch function modes nor subclasses' ``__torch_function__``
    (memmagic's own bookkeeping inside a dispatch mode, where each tensor attribute read
    would otherwise pass through the run's function mode)."""
    return torch._C.DisableTorchFunction()


__all__ += ["no_function_modes"]


def _probe_version_error_style() -> bool:
    x = torch.ones(1, requires_grad=True)
    h = x.sigmoid()
    h.mul_(2)
    try:
        h.sum().backward()
    except RuntimeError as exc:
        return "SigmoidBackward" not in str(exc)
    return True  # saved-tensor hooks of the caller hid the check: take the newer wording


_VERSION_ERROR_STYLE: list[bool] = []


def version_error_names_forward_op() -> bool:
    """Whether this torch's in-place version error names a saved output's node by its
    forward op ("output 0 of Sigmoid", torch 2.13) rather than by the node itself ("output
    0 of SigmoidBackward0", torch 2.11). Read once, from autograd's own message on a
    one-element tensor, with no mode of anyone's in the way."""
    if not _VERSION_ERROR_STYLE:
        with no_python_modes():
            _VERSION_ERROR_STYLE.append(_probe_version_error_style())
    return _VERSION_ERROR_STYLE[0]


__all__ += ["version_error_names_forward_op"]


def fake_device(t: torch.Tensor) -> torch.device | None:
    """The device a FakeTensor stands for (None for other tensors), without going through
    the ``device`` property."""
    return getattr(t, "fake_device", None)


def fake_constant(t: torch.Tensor) -> torch.Tensor | None:
    """The real value a FakeTensor carries when the fake mode knows it (a tensor made from a
    constant and changed only by ops on constants), else None."""
    return getattr(t, "constant", None)


def constant_fake(mode: FakeTensorMode, real: torch.Tensor, device: torch.device,
                  template: dict | None = None) -> torch.Tensor:
    """A FakeTensor of ``mode`` carrying ``real`` (a plain CPU tensor that owns its storage)
    as its constant, standing for ``device``; FakeTensorMode then computes ops on it for real
    while the result stays within ``torch._subclasses.fake_tensor.CONSTANT_NUMEL_LIMIT``.

    What ``from_real_tensor(make_constant=True)`` makes of such a tensor (its meta twin with
    the same geometry, the constant registered with the converter: an in-place op on it,
    Adam's ``step += 1``, finds this fake tensor again instead of a new storage), without
    describing the tensor through meta_utils (0.3 ms a call). ``template``: see
    :func:`fake_from_template`."""
    with no_dispatch():
        meta = torch.empty_strided(tuple(real.shape), real.stride(), dtype=real.dtype,
                                   device="meta")
    fake = fake_from_template(mode, meta, device, template, real)
    register_fake_constant(mode, real, fake)
    return fake


def fake_from_template(mode: FakeTensorMode, meta: torch.Tensor, device: torch.device,
                       template: dict | None, constant: torch.Tensor | None = None
                       ) -> FakeTensor:
    """``FakeTensor(mode, meta, device, constant=constant)``; with ``template`` (the
    ``__dict__`` of a CPU FakeTensor the constructor made, as :func:`bare_fake` takes it)
    without the constructor's Python work."""
    if template is None:
        return FakeTensor(mode, meta, device, constant=constant)
    fake = bare_fake(mode, meta, device)
    fake.__dict__.update(template)
    if device != template[FAKE_DEVICE_ATTR]:
        fake.fake_device = device
    if constant is not None:
        fake.constant = constant
    return fake


def may_turn_const(mode: FakeTensorMode, t: torch.Tensor) -> bool:
    """Whether FakeTensorMode ``mode`` keeps real tensor ``t`` (an op's output computed on
    constants, or what ``torch.tensor`` lifts) as a constant: its own test, with the bound
    the simulation sets during a run (:func:`may_turn_const_holder`)."""
    return mode.may_turn_const(t)


def may_turn_const_holder():
    """(class, name) of FakeTensorMode's test of whether an op's real output on constants
    becomes a constant again (it bounds it by :func:`constant_numel_limit_holder`'s global)."""
    return FakeTensorMode, "may_turn_const"


def constant_numel_limit_holder():
    """(module, name) of FakeTensorMode's bound on constant propagation (a module global)."""
    from torch._subclasses import fake_tensor

    return fake_tensor, "CONSTANT_NUMEL_LIMIT"


def adopt_constant(t: torch.Tensor, source: object) -> None:
    """After ``t.data = source``: ``t`` holds ``source``'s values, so it carries
    ``source``'s constant (or none). FakeTensorMode keeps the constant on the Python object,
    which ``.data =`` does not touch: a CPU parameter moved with ``module.to("cuda",
    torch.bfloat16)`` kept its float32 constant, and ops computed on it (``detach`` in a
    checkpoint's saved-tensor hook) came out float32."""
    if getattr(t, "constant", None) is None:
        return
    t.constant = getattr(source, "constant", None) if is_fake(source) else None


def give_constant(t: torch.Tensor, real: torch.Tensor) -> None:
    """Make fake tensor ``t`` carry ``real`` (a plain CPU tensor of its geometry that owns
    its storage) as its constant, registered as :func:`constant_fake` registers one: what an
    in-place op computed for real wrote into it (a DataLoader's ``random_()`` seed)."""
    drop_constant(t)
    t.constant = real
    register_fake_constant(t.fake_mode, real, t)


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


__all__ += ["fake_device", "fake_constant", "constant_fake", "constant_view", "may_turn_const",
            "fake_from_template",
            "constant_numel_limit_holder",
            "may_turn_const_holder",
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


def clear_fake_dispatch_cache() -> None:
    """Empty FakeTensorMode's own (class-wide) dispatch cache."""
    FakeTensorMode.cache_clear()


def fake_cache_off(mode: FakeTensorMode):
    """Context manager: ``mode``'s dispatch cache neither read nor filled."""
    from torch._subclasses.fake_tensor import disable_fake_tensor_cache

    return disable_fake_tensor_cache(mode)


def fake_dispatch_cache_size() -> int:
    """Entries in FakeTensorMode's own (class-wide) dispatch cache (``cache_info().size``)."""
    return FakeTensorMode.cache_info().size


def forget_dead_constants(mode: FakeTensorMode) -> int:
    """Drop what ``mode``'s converter keeps for fake constants that are gone; the number
    of storages dropped. The converter maps each constant's storage to weak references to
    the fake tensors carrying it (so that a write through an alias makes them forget their
    value) and never drops an entry while the mode lives: a simulated GPU that lasts a
    notebook kept about 2 KB for each training step (Adam's step counts, ``torch.tensor``
    of a Python number)."""
    mapping = mode.fake_tensor_converter.constant_storage_mapping
    dropped = 0
    for weak_st, refs in list(mapping.items()):
        alive = [r for r in refs if r() is not None]
        if not alive:
            del mapping[weak_st]
            dropped += 1
        elif len(alive) < len(refs):
            mapping[weak_st] = alive
    return dropped


def fake_constant_storages(mode: FakeTensorMode) -> int:
    """Constant storages ``mode``'s converter maps to fake tensors (see
    :func:`forget_dead_constants`)."""
    return len(mode.fake_tensor_converter.constant_storage_mapping)


__all__ += ["clear_fake_dispatch_cache", "fake_cache_off", "fake_dispatch_cache_size",
            "forget_dead_constants", "fake_constant_storages"]


def meta_kernels(mode: FakeTensorMode):
    """Context manager: ops called inside it on ``mode``'s fake tensors run their Meta
    kernels (C++ structured kernels, or torch's Python meta registrations) directly, as
    FakeTensorMode itself runs a kernel (``in_kernel_invocation_manager``): no mode sees
    them, no decomposition runs, outputs are plain meta tensors (views share their input's
    storage) and ``device`` reads ``meta``."""
    from torch._subclasses.fake_tensor import in_kernel_invocation_manager

    return in_kernel_invocation_manager(mode)


__all__ += ["meta_kernels"]


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


# --- distributed (FSDP2 on simulated GPUs: memmagic.whatif.sharding) ---
# Tested in tests/core/test_torch_private_dist.py. Imports of torch.distributed are lazy.
__all__ += ["fake_process_group", "device_mesh", "fsdp_device_handle_without_streams",
            "fsdp_storage_resize_hook", "is_wrapper_subclass", "wrapper_inner_tensors",
            "FSDP_MODULES", "pipeline_mailbox", "StageNotRun", "clear_dtensor_sharding_caches"]
import importlib  # noqa: E402
from contextlib import contextmanager  # noqa: E402

# FSDP2's modules that look the device handle up by name (``from ... import _get_device_handle``)
FSDP_MODULES = ("_fsdp_collectives", "_fsdp_init", "_fsdp_param_group", "_fsdp_state")
_FSDP_PKG = "torch.distributed.fsdp._fully_shard."


@contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """A default process group of ``world_size`` ranks in which this process is ``rank`` and
    every collective returns at once with outputs of the right shape (torch's "fake"
    backend, made for tests: no GPUs, no network, no other processes). Destroyed on exit.

    Raises RuntimeError when a process group exists already (a real distributed run).
    ``init_process_group`` wraps ``sys.excepthook`` to prefix "[rank0]:" to every line of
    an uncaught exception's traceback and never puts it back (torch 2.13's
    distributed_c10d.py): the hook it found is put back on exit."""
    import sys

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if int(world_size) < 1:
        raise ValueError(f"world_size must be 1 or more, not {world_size!r}")
    if not 0 <= int(rank) < int(world_size):
        raise ValueError(f"rank must be from 0 to world_size - 1, not {rank!r}")
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group is already initialized in this "
                           "process: the sharding simulation needs one of its own")
    hook = sys.excepthook  # (this bottom layer imports no memmagic: no Patches here)
    try:
        dist.init_process_group("fake", store=FakeStore(), rank=int(rank),
                                world_size=int(world_size))
        try:
            yield
        finally:
            dist.destroy_process_group()
    finally:
        sys.excepthook = hook
        clear_dtensor_sharding_caches()


def clear_dtensor_sharding_caches() -> None:
    """Forget DTensor's cached sharding decisions (its Python and C++ fast-path caches,
    ``torch.distributed.tensor.debug``'s clearing functions). They are keyed by a mesh's
    shape and dimension names, not by its process groups: a decision cached while this
    process was one rank hands the next rank's equal-looking mesh the first rank's groups
    ("Could not resolve the process group registered under the name 3"). One process is one
    rank on a GPU; a simulation that runs several in turn starts each with none cached."""
    from torch.distributed.tensor import debug

    debug._clear_python_sharding_prop_cache()
    debug._clear_fast_path_sharding_prop_cache()


@contextmanager
def dtensor_fake_args_on(device: str) -> Iterator[None]:
    """While active, DTensor's sharding propagation builds the fake arguments it runs an op
    on (to learn the output's shape, stride and dtype) on ``device``, whatever its mesh's
    device type. A simulation's CUDA tensors are CPU fakes underneath: a fake tensor made
    on a real "cuda" device of a CPU build cannot take a random op (``reset_parameters()``
    after ``to_empty(device="cuda")``: no CUDA generator). Only the device differs; the
    shape, stride and dtype come from the spec, as torch builds them
    (``torch.distributed.tensor._op_schema._rebuild_tensor_from_dtensor_meta``)."""
    import torch.distributed.tensor._op_schema as op_schema

    name = "_rebuild_tensor_from_dtensor_meta"
    torchs = getattr(op_schema, name)

    def rebuild(arg):
        meta = arg.tensor_meta
        if meta is None:
            return torchs(arg)  # torch's own error
        return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=device)

    setattr(op_schema, name, rebuild)
    try:
        yield
    finally:
        setattr(op_schema, name, torchs)


def device_mesh(device_type: str, world_size: int) -> Any:
    """A 1-D ``DeviceMesh`` over ranks 0..world_size-1 of the default group, built without
    asking the device for its count (``init_device_mesh`` would)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(device_type, torch.arange(int(world_size)))


class _NoStreamHandle:
    """``torch.cuda`` as FSDP2 uses it, with the CPU's stream stand-ins (streams and events
    that do nothing) in place of CUDA streams: a simulated GPU runs every op in order."""

    _CPU = ("Stream", "Event", "stream", "current_stream", "StreamContext")

    def __getattr__(self, name: str) -> Any:
        if name in self._CPU:
            return getattr(torch.cpu, name)
        return getattr(torch.cuda, name)  # looked up at call time (the simulation's)


@contextmanager
def fsdp_device_handle_without_streams() -> Iterator[None]:
    """While active, FSDP2 gets :class:`_NoStreamHandle` for device type "cuda" (FSDP2's
    modules bind ``_get_device_handle`` by name; each binding is replaced and restored)."""
    from torch.distributed import device_mesh as dm

    handle = _NoStreamHandle()
    original = dm._get_device_handle

    def get(device_type: str = "cuda") -> Any:
        return handle if device_type == "cuda" else original(device_type)

    undo: list[tuple[Any, Any]] = []
    try:
        for name in FSDP_MODULES:
            mod = importlib.import_module(_FSDP_PKG + name)
            if hasattr(mod, "_get_device_handle"):
                undo.append((mod, mod._get_device_handle))
                mod._get_device_handle = get
        yield
    finally:
        for mod, fn in reversed(undo):
            mod._get_device_handle = fn


@contextmanager
def fsdp_storage_resize_hook(after: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Call ``after(tensor)`` each time FSDP2 frees (``storage.resize_(0)``) or re-allocates
    an unsharded parameter's storage. Those resizes do not go through the dispatcher, so a
    dispatch-level tracker never sees them otherwise."""
    fp = importlib.import_module(_FSDP_PKG + "_fsdp_param")
    pg = importlib.import_module(_FSDP_PKG + "_fsdp_param_group")
    free, alloc = fp.free_storage, fp.alloc_storage

    def free_storage(tensor: torch.Tensor) -> None:
        free(tensor)
        after(tensor)

    def alloc_storage(tensor: torch.Tensor) -> None:
        alloc(tensor)
        after(tensor)

    undo = [(fp, "free_storage", free), (fp, "alloc_storage", alloc)]
    if getattr(pg, "alloc_storage", None) is alloc:
        undo.append((pg, "alloc_storage", alloc))
    try:
        fp.free_storage = free_storage
        fp.alloc_storage = alloc_storage
        if len(undo) == 3:
            pg.alloc_storage = alloc_storage
        yield
    finally:
        for mod, name, fn in reversed(undo):
            setattr(mod, name, fn)


class StageNotRun(RuntimeError):
    """A pipeline stage asked for what an earlier stage of the job sends it (the shapes of
    its inputs), and no run of this job has run that stage yet."""

    def __init__(self, stage: int, source: int) -> None:
        super().__init__(f"pipeline stage {stage} takes the shapes of its inputs from stage "
                         f"{source}, which this job has not run")
        self.stage, self.source = stage, source


@contextmanager
def pipeline_mailbox(mailbox: dict[tuple[int, int], bytes]) -> Iterator[None]:
    """While active, the stages of ``torch.distributed.pipelining`` exchange the metadata of
    the tensors they send each other (torch 2.13's ``PipelineStage._send_meta`` /
    ``_recv_meta``: pickled ``_StageForwardMeta`` / ``_StageBackwardMeta`` over
    ``send_object_list``, which a fake process group cannot carry) through ``mailbox``,
    keyed by (sending stage, receiving stage): a job's ranks run one after another in stage
    order (memmagic.jobs) hand each later stage what the earlier ones sent. A stage's
    gradient metadata from the next stage, not run yet, is derived from its own outputs, as
    torch derives it (``_derive_grad_metas``: the outputs' shape, stride and dtype; None
    where an output needs no gradient). Raises :class:`StageNotRun` for a stage whose
    inputs come from a stage no run has sent them."""
    import pickle

    from torch.distributed.pipelining import stage as stage_mod
    from torch.distributed.pipelining._utils import _derive_grad_metas, _StageBackwardMeta

    cls = stage_mod.PipelineStage
    recv, send = cls.__dict__["_recv_meta"], cls.__dict__["_send_meta"]

    def recv_meta(self, src_stage: int) -> Any:
        sent = mailbox.get((src_stage, self.stage_index))
        if sent is not None:
            return pickle.loads(sent)
        if src_stage == self.stage_index + 1 and self._stage_meta.outputs is not None:
            return _StageBackwardMeta(backward_metas=_derive_grad_metas(self._stage_meta.outputs))
        raise StageNotRun(self.stage_index, src_stage)

    def send_meta(self, meta: Any, dst_stage: int) -> None:
        mailbox[(self.stage_index, dst_stage)] = pickle.dumps(meta)

    cls._recv_meta, cls._send_meta = recv_meta, send_meta
    try:
        yield
    finally:
        cls._recv_meta, cls._send_meta = recv, send


def is_wrapper_subclass(t: object) -> bool:
    """Whether ``t`` is a traceable wrapper tensor subclass (DTensor): a tensor with no
    memory of its own whose data are inner tensors (a DTensor's local shard)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return isinstance(t, torch.Tensor) and is_traceable_wrapper_subclass(t)


def wrapper_inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The inner tensors of a wrapper subclass (``__tensor_flatten__``), recursively: the
    tensors that hold its memory. A plain tensor is its own inner tensor."""
    if not is_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    out: list[torch.Tensor] = []
    for name in names:
        inner = getattr(t, name, None)
        if isinstance(inner, torch.Tensor):
            out.extend(wrapper_inner_tensors(inner))
    return out


# --- higher-order operators (flex_attention) ---
# Tested in tests/core/test_torch_private_sim.py.
__all__ += ["attention_hops", "hops_through_mode", "while_loop_hop", "build_dynamo_rules"]


def build_dynamo_rules() -> None:
    """Build dynamo's map of torch's functions to how it traces them (cached for the
    process) from torch's own objects: built while a run has replaced some of them
    (``torch.nested.nested_tensor``), it would key the stand-ins, and miss the originals
    after the run."""
    from torch._dynamo.trace_rules import get_torch_obj_rule_map

    get_torch_obj_rule_map()


def while_loop_hop() -> Any:
    """torch's ``while_loop`` higher-order operator (``torch._higher_order_ops``)."""
    from torch._higher_order_ops.while_loop import while_loop_op

    return while_loop_op


def attention_hops() -> tuple[Any, ...]:
    """torch's flex_attention operator and its backward (``torch._higher_order_ops``)."""
    from torch._higher_order_ops.flex_attention import flex_attention, flex_attention_backward

    return flex_attention, flex_attention_backward


@contextmanager
def hops_through_mode(mode_cls: type, hops: tuple[Any, ...]) -> Iterator[None]:
    """While active, each higher-order operator of ``hops`` called under a dispatch mode of
    ``mode_cls`` goes through that mode's ``__torch_dispatch__`` as an op does (torch's own
    ``redirect_to_mode``, which its caching modes use); without it torch raises "There was
    no rule registered for HigherOrderOperator". The entries come out on exit."""
    added = [hop for hop in hops if mode_cls not in hop.python_key_table]
    try:
        for hop in added:
            @hop.py_impl(mode_cls)
            def _through(mode, *args, _hop=hop, **kwargs):
                return mode.__torch_dispatch__(_hop, [], args, kwargs)
        yield
    finally:
        for hop in added:
            hop.python_key_table.pop(mode_cls, None)
            hop._dispatch_cache.clear()


# --- symbolic sizes (measured by benchmarks: why the fit map reads a plane off runs) ---
# Tested in tests/core/test_torch_private_sim.py.
__all__ += ["symbolic_fake_mode", "symbolic_fake", "python_dispatcher", "shape_guards"]


def symbolic_fake_mode() -> FakeTensorMode:
    """A FakeTensorMode over a fresh ShapeEnv: its tensors may have symbolic sizes."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(shape_env=ShapeEnv())


def symbolic_fake(mode: FakeTensorMode, real: torch.Tensor, name: str) -> FakeTensor:
    """``real`` as a fake tensor of ``mode`` (a :func:`symbolic_fake_mode`) with every size
    a symbol (its value ``real``'s size, for the guards to compare with); ``name`` names it
    in the guards."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * real.dim())
    return mode.from_tensor(real, source=ConstantSource(name), symbolic_context=context)


def python_dispatcher():
    """torch's Python dispatcher, entered (as make_fx and dynamo do): composite ops take
    their Python decompositions, which keep sizes symbolic where the C++ ones read them as
    ints."""
    from torch._dispatch.python import enable_python_dispatcher

    return enable_python_dispatcher()


def shape_guards(mode: FakeTensorMode) -> list[str]:
    """The guards a :func:`symbolic_fake_mode` took on its symbols so far, as text, and the
    symbols it specialized (``s0 == 8``)."""
    env = mode.shape_env
    return ([str(g.expr) for g in env.guards]
            + [f"{s} == {v}" for s, v in env.replacements.items() if v.is_number])
