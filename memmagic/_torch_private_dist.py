"""Private PyTorch distributed APIs memmagic relies on (FSDP2 under a fake process group),
each behind a small function. Tested in tests/test_torch_private_dist.py.

To be merged into :mod:`memmagic._torch_private` (kept apart while that module is being
reorganised). If a torch upgrade breaks the sharding simulation, look here first.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

__all__ = ["fake_process_group", "device_mesh", "fsdp_device_handle_without_streams",
           "fsdp_storage_resize_hook", "wrapper_inner_tensors", "is_wrapper_subclass",
           "FSDP_MODULES"]

# FSDP2's modules that look the device handle up by name (``from ... import _get_device_handle``)
FSDP_MODULES = ("_fsdp_collectives", "_fsdp_init", "_fsdp_param_group", "_fsdp_state")
_FSDP_PKG = "torch.distributed.fsdp._fully_shard."


@contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A default process group of ``world_size`` ranks in which this process is rank 0 and
    every collective returns at once with outputs of the right shape (torch's "fake"
    backend, made for tests: no GPUs, no network, no other processes). Destroyed on exit.

    Raises RuntimeError when a process group exists already (a real distributed run)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if int(world_size) < 1:
        raise ValueError(f"world_size must be 1 or more, not {world_size!r}")
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group is already initialized in this "
                           "process: the sharding simulation needs one of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=int(world_size))
    try:
        yield
    finally:
        dist.destroy_process_group()


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
