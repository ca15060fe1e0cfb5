"""``DistributedDataParallel`` on the simulated GPU (a rank of a job on a fake process group).

DDP keeps, beside the model's gradients, its **buckets**: flat buffers as large as all the
gradients together (in buckets of ``bucket_cap_mb``), into which each gradient is copied
for the all-reduce and from which it is copied back; with ``gradient_as_bucket_view=True``
the gradients are views of the buckets instead (one copy, not two). Its C++ ``Reducer``
allocates them; the simulation lets it, and puts them on the simulated GPU (the Reducer
makes them on the host device the simulation runs on). Three steps of DDP read and write
tensor data on the host in C++, which simulated tensors do not have, and are replaced:

* the check that every rank has parameters of the same shapes (an all-gather) is skipped:
  one simulated rank is each rank;
* the all-reduce of a bucket is done in place, as NCCL does it (the fake process group's
  all-reduce gives the Reducer nothing back), with the same division by the world size;
* the Reducer does not rebuild its buckets after the first step (in the order gradients
  became ready: the same buffers, in another order); the same total stays allocated.

A communication hook the script registers (``register_comm_hook``, fp16 compression) is not
installed: a note says so (its buffers, such as a compressed copy of a bucket, are not
counted).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from ...core import _torch_private as _priv
from ...core.patching import Patches

if TYPE_CHECKING:
    from .state import SimState

__all__ = ["install_ddp"]


def _all_reduce_in_place(state: Any, bucket: Any) -> torch.futures.Future:
    """DDP's default hook as NCCL runs it, without the collective: the bucket divided by the
    world size in place, handed back at once."""
    import torch.distributed as dist

    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(buffer)
    return done


class _Reducer:
    """The DDP Reducer, as DDP's Python code calls it, that does not rebuild its buckets."""

    def __init__(self, reducer: Any) -> None:
        object.__setattr__(self, "_reducer", reducer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        return False


def install_ddp(patches: Patches, state: SimState, notes: list) -> None:
    """Replace the steps of ``DistributedDataParallel`` the simulation cannot run (see the
    module's docstring) for one run; the report's note when a script registered a hook."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    module, name = _priv.ddp_param_check_slot()
    patches.set(module, name, lambda *args, **kwargs: None)
    init = DDP.__init__

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        before, state.target = state.target, "device"  # its buckets, on the simulated GPU
        try:
            init(self, *args, **kwargs)
        finally:
            state.target = before
        _priv.register_reducer_comm_hook(self.reducer, _all_reduce_in_place)
        self.reducer = _Reducer(self.reducer)

    hooks: list[str] = []

    def register_comm_hook(self: Any, state: object, hook: Any) -> None:
        hooks.append(getattr(hook, "__name__", type(hook).__name__))

    def register_builtin(self: Any, comm_hook_type: Any) -> None:
        hooks.append(str(comm_hook_type))

    patches.set(DDP, "__init__", __init__)
    patches.set(DDP, "register_comm_hook", register_comm_hook)
    patches.set(DDP, "_register_builtin_comm_hook", register_builtin)

    def note() -> None:
        if hooks:
            notes.append(f"DistributedDataParallel's communication hook ({', '.join(hooks)}) was "
                         "not installed: its all-reduce ran as the default one, in place, and "
                         "buffers of its own (a compressed copy of a bucket) are not counted")

    patches.call_on_restore(note)
