"""Every private PyTorch API memmagic relies on, in one place (tested in tests/test_torch_private.py).

If a torch upgrade breaks memmagic, this is the module to look at first.
"""

from __future__ import annotations

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


def storage_key(storage: torch.UntypedStorage) -> int:
    """A key for a storage that is unique while the storage lives (its StorageImpl address)."""
    return storage._cdata
