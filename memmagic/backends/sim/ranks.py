"""The simulated GPU as one rank of a multi-GPU job: torch's fake process group (every
collective returns at once with outputs of the right shape), FSDP2's storage resizes counted
and its streams run as one. Used by ``%%gpumem --world-size N`` (the sim backend's
``world_size``) and by :mod:`memmagic.whatif.sharding`'s FSDP2 and tensor-parallel rows."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator

from ...core import _torch_private as dist_priv
from ...core import tracking
from ...core.patching import Patches
from .state import set_local_gpu

__all__ = ["rank_of", "node_gpus", "local_rank", "torchrun_environment", "check_gpus_per_node"]

# GPUs on one node of a job (torchrun's --nproc-per-node on an 8-GPU machine, the common case)
GPUS_PER_NODE = 8


def node_gpus(world_size: int, per_node: int | None = None) -> int:
    """The GPUs a node of the job has (what ``torch.cuda.device_count()`` answers there):
    ``per_node`` (torchrun's --nproc-per-node), by default the job's up to GPUS_PER_NODE."""
    if per_node is not None:
        return check_gpus_per_node(world_size, per_node)
    return max(1, min(int(world_size), GPUS_PER_NODE))


def check_gpus_per_node(world_size: int, per_node: Any) -> int:
    """``per_node`` when a job of ``world_size`` ranks can have nodes of that many GPUs;
    ValueError says what to give otherwise."""
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
        raise ValueError(f"gpus per node is a number of GPUs, 1 or more, not {per_node!r}")
    if world_size % per_node:
        raise ValueError(f"{world_size} GPUs do not split into nodes of {per_node}: give a GPUs "
                         f"per node that divides the world size (torchrun's nodes x "
                         f"--nproc-per-node)")
    return per_node


def local_rank(world_size: int, rank: int, per_node: int | None = None) -> int:
    """``rank``'s GPU on its node (LOCAL_RANK): ranks are numbered node by node."""
    return rank % node_gpus(world_size, per_node)


def torchrun_environment(world_size: int, rank: int = 0,
                         per_node: int | None = None) -> dict[str, str]:
    """The environment torchrun gives ``rank`` of a ``world_size`` job (its nodes of
    :func:`node_gpus` GPUs each, ranks numbered node by node)."""
    local = node_gpus(world_size, per_node)
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank(world_size, rank, per_node)),
            "GROUP_RANK": str(rank // local),
            "ROLE_RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(local),
            "ROLE_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500"}


@contextmanager
def _as_torchrun(world_size: int, rank: int, per_node: int | None) -> Iterator[None]:
    """While active, the process looks like ``rank`` of a torchrun job: torchrun's
    environment variables (put back after), and the job's own ``init_process_group`` /
    ``destroy_process_group`` accepted on the fake group that is already there (whatever
    backend they name: NCCL has no GPUs to talk to here)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    patches = Patches()
    try:
        for key, value in torchrun_environment(world_size, rank, per_node).items():
            patches.set_item(os.environ, key, value)
        # the simulated GPU is this rank's own: cuda:LOCAL_RANK, as set_device picks it
        old = set_local_gpu(local_rank(world_size, rank, per_node))
        patches.call_on_restore(lambda: set_local_gpu(old))
        init = c10d.init_process_group

        def init_process_group(*args, **kwargs):
            return None if dist.is_initialized() else init(*args, **kwargs)

        for module in (dist, c10d):
            patches.set(module, "init_process_group", init_process_group)
            patches.set(module, "destroy_process_group", lambda group=None: None)
        yield
    finally:
        patches.restore()


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
def rank_of(world_size: int, rank: int = 0,
            mailbox: dict[tuple[int, int], bytes] | None = None,
            per_node: int | None = None) -> Iterator[None]:
    """While active, this process is ``rank`` of ``world_size`` ranks on a fake process group
    (collectives return at once with outputs of the right shape), as torchrun starts it
    (its environment; the job's own ``init_process_group`` accepted): a simulated cell's
    ``init_device_mesh``, ``parallelize_module`` (tensor parallel), ``fully_shard`` (FSDP2)
    and DTensors run as on one GPU of the job, FSDP2's storage resizes counted; pipeline
    stages exchange their metadata through ``mailbox`` (what the job's ranks run before this
    one sent; see ``_torch_private.pipeline_mailbox``); ``per_node``: the GPUs of a node
    (:func:`node_gpus`). Raises RuntimeError when a process group exists already."""
    with dist_priv.fake_process_group(world_size, rank), _fsdp_tracking(), \
            _as_torchrun(world_size, rank, per_node), \
            dist_priv.pipeline_mailbox({} if mailbox is None else mailbox), \
            dist_priv.dtensor_fake_args_on("cpu"):  # the simulation's CUDA fakes are CPU ones
        yield
