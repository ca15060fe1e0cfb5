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


def fake_copy(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    """A fake twin of a real tensor (same sizes, strides, dtype, requires_grad, .grad,
    Parameter-ness). Tensors of at most one element keep their value as a constant, so
    reading them (an optimizer's step count) gives the real number."""
    if t.numel() <= 1 and t.device.type == "cpu" and not t.requires_grad and t.layout == torch.strided:
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


__all__ += ["fake_device", "fake_constant"]


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
