"""The simulated GPU as one rank of a multi-GPU job: torch's fake process group (every
collective returns at once with outputs of the right shape), FSDP2's storage resizes counted
and its streams run as one. Used by ``%%gpumem --world-size N`` (the sim backend's
``world_size``) and by :mod:`memmagic.sharding`'s FSDP2 and tensor-parallel rows."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from ... import _torch_private as dist_priv
from ... import tracking

__all__ = ["rank_zero_of"]


@contextmanager
def _fsdp_tracking() -> Iterator[None]:
    """While active, FSDP2's storage resizes of unsharded parameters (which bypass the
    dispatcher) are counted, and FSDP2 runs on one stream. (The trackers themselves count a
    wrapper subclass, FSDP2's DTensor parameters, by its inner tensors.)"""

    def resized(t) -> None:
        tr = tracking.innermost_tracker()
        if tr is None:
            return
        entry = tr.entry_of(t)
        if entry is None:
            return
        s = getattr(tr, "s", None)  # the simulation rounds by the pool of the op running
        old = getattr(s, "pending", None)
        if s is not None:
            s.pending = entry.pool
        try:
            tr.recheck_size(t)
        finally:
            if s is not None:
                s.pending = old

    with dist_priv.fsdp_storage_resize_hook(resized), \
            dist_priv.fsdp_device_handle_without_streams():
        yield


@contextmanager
def rank_zero_of(world_size: int) -> Iterator[None]:
    """While active, this process is rank 0 of ``world_size`` ranks on a fake process group
    (collectives return at once with outputs of the right shape): a simulated cell's
    ``init_device_mesh``, ``parallelize_module`` (tensor parallel), ``fully_shard`` (FSDP2)
    and DTensors run as on one GPU of the job, FSDP2's storage resizes counted. Raises
    RuntimeError when a process group exists already."""
    with dist_priv.fake_process_group(world_size), _fsdp_tracking():
        yield
