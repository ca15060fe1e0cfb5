"""Contract tests for the distributed part of memmagic/core/_torch_private.py: the private torch distributed APIs
the sharding simulation relies on behave as it assumes."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist

from memmagic.core import _torch_private as priv


def test_fake_process_group_is_rank0_of_n_and_is_destroyed():
    with priv.fake_process_group(4):
        assert dist.is_initialized()
        assert (dist.get_rank(), dist.get_world_size()) == (0, 4)
        out = [torch.empty(3) for _ in range(4)]
        dist.all_gather(out, torch.ones(3))  # returns at once, shapes kept
        assert [t.shape for t in out] == [torch.Size([3])] * 4
    assert not dist.is_initialized()


def test_fake_process_group_destroyed_after_an_exception():
    with pytest.raises(KeyError):
        with priv.fake_process_group(2):
            raise KeyError("x")
    assert not dist.is_initialized()


def test_init_process_group_wraps_the_excepthook_and_the_fake_group_puts_it_back():
    import sys

    hook = sys.excepthook
    with priv.fake_process_group(2):
        # torch's contract as the fake group meets it: a "[rank0]:" prefixing hook
        assert sys.excepthook is not hook
        assert "distributed_excepthook" in sys.excepthook.__name__
    assert sys.excepthook is hook
    with pytest.raises(KeyError):
        with priv.fake_process_group(2):
            raise KeyError("x")
    assert sys.excepthook is hook


def test_fake_process_group_refuses_a_second_group_and_bad_sizes():
    with priv.fake_process_group(2):
        with pytest.raises(RuntimeError, match="already initialized"):
            with priv.fake_process_group(2):
                pass
    with pytest.raises(ValueError, match="world_size"):
        with priv.fake_process_group(0):
            pass


def test_device_mesh_shards_a_dtensor_by_rank():
    from torch.distributed.tensor import Shard, distribute_tensor

    with priv.fake_process_group(4):
        mesh = priv.device_mesh("cpu", 4)
        assert mesh.size() == 4
        d = distribute_tensor(torch.randn(64, 8), mesh, [Shard(0)])
        assert priv.is_wrapper_subclass(d)
        inner = priv.wrapper_inner_tensors(d)
        assert [t.shape for t in inner] == [torch.Size([16, 8])]
        assert not priv.is_wrapper_subclass(inner[0])
    plain = torch.ones(2)
    assert priv.wrapper_inner_tensors(plain) == [plain] and not priv.is_wrapper_subclass(plain)


def _handles():
    return {m: importlib.import_module(priv._FSDP_PKG + m)._get_device_handle for m in priv.FSDP_MODULES
            if hasattr(importlib.import_module(priv._FSDP_PKG + m), "_get_device_handle")}


def test_fsdp_modules_bind_the_device_handle_by_name_and_it_is_restored():
    before = _handles()
    assert set(before) == set(priv.FSDP_MODULES)  # FSDP2 still looks it up in these modules
    with pytest.raises(ZeroDivisionError):
        with priv.fsdp_device_handle_without_streams():
            handle = importlib.import_module(priv._FSDP_PKG + "_fsdp_param_group")._get_device_handle("cuda")
            s = handle.Stream(priority=-1)  # what FSDP2's comm context makes
            with handle.stream(s):
                handle.current_stream().wait_stream(s)
            assert handle.Event().record() is None
            assert handle.current_device is torch.cuda.current_device
            1 / 0
    assert _handles() == before


def test_fsdp_frees_unsharded_storage_through_the_hooked_functions_and_they_are_restored():
    fp = importlib.import_module(priv._FSDP_PKG + "_fsdp_param")
    pg = importlib.import_module(priv._FSDP_PKG + "_fsdp_param_group")
    free, alloc = fp.free_storage, fp.alloc_storage
    assert pg.alloc_storage is alloc  # bound by name there too
    seen = []
    t = torch.empty(256)
    with priv.fsdp_storage_resize_hook(lambda x: seen.append(x.untyped_storage().nbytes())):
        fp.free_storage(t)
        pg.alloc_storage(t)
    assert seen == [0, 1024]
    assert (fp.free_storage, fp.alloc_storage, pg.alloc_storage) == (free, alloc, alloc)


def test_fully_shard_on_a_fake_group_makes_local_shards():
    from torch.distributed.fsdp import fully_shard

    with priv.fake_process_group(4):
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
        fully_shard(model, mesh=priv.device_mesh("cpu", 4))
        w = model[0].weight
        assert priv.is_wrapper_subclass(w) and tuple(w.shape) == (32, 16)
        assert tuple(priv.wrapper_inner_tensors(w)[0].shape) == (8, 16)



def test_dtensor_propagation_builds_its_fake_arguments_on_the_device_asked():
    """The contract the simulation's DTensor ops rely on: an op's fake arguments for
    sharding propagation (``OpSchema.gen_fake_args``) come from the module function that
    ``dtensor_fake_args_on`` replaces, with the spec's shape, stride and dtype; the
    function is put back after, also after an exception."""
    import torch.distributed.tensor._op_schema as op_schema
    from torch.distributed.tensor import Shard, distribute_tensor

    before = op_schema._rebuild_tensor_from_dtensor_meta
    with priv.fake_process_group(2):
        mesh = priv.device_mesh("cpu", 2)
        d = distribute_tensor(torch.zeros(8, 6, dtype=torch.float16).t(), mesh, [Shard(0)])
        schema = op_schema.OpSchema(torch.ops.aten.uniform_.default, (d._spec, -1.0, 1.0), {})
        with priv.dtensor_fake_args_on("meta"):
            fake, low, high = schema.gen_fake_args()
        assert (fake.device.type, fake.shape, fake.stride(), fake.dtype) == \
            ("meta", (6, 8), (1, 6), torch.float16)
        assert (low, high) == (-1.0, 1.0)
        assert schema.gen_fake_args()[0].device.type == "cpu"  # torch's again: the mesh's
        with pytest.raises(KeyError):
            with priv.dtensor_fake_args_on("meta"):
                raise KeyError("x")
    assert op_schema._rebuild_tensor_from_dtensor_meta is before


def _stage(rank: int, world: int):
    from torch.distributed.pipelining import PipelineStage

    return PipelineStage(torch.nn.Linear(8, 8), rank, world, torch.device("cpu"))


def test_pipeline_stages_exchange_their_metadata_through_the_mailbox_and_it_is_restored():
    """torch 2.13's PipelineStage sends its metadata with ``_send_meta`` and receives it with
    ``_recv_meta`` (pickled ``_StageForwardMeta`` / ``_StageBackwardMeta``), which a fake
    group cannot carry: both go through the mailbox, and come back after."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from torch.distributed.pipelining._utils import _StageForwardMeta

    before = (PipelineStage._recv_meta, PipelineStage._send_meta)
    mailbox: dict = {}
    with priv.fake_process_group(2, rank=0), priv.pipeline_mailbox(mailbox):
        ScheduleGPipe(_stage(0, 2), n_microbatches=2).step(torch.randn(4, 8))
    sent = mailbox[(0, 1)]  # stage 0's outputs, as stage 1 receives them
    assert list(mailbox) == [(0, 1)]
    with priv.fake_process_group(2, rank=1), priv.pipeline_mailbox(mailbox):
        stage = _stage(1, 2)
        losses: list = []
        ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda o, t: (o - t).pow(2).mean()).step(
            target=torch.zeros(4, 8), losses=losses)
        assert isinstance(stage._recv_meta(0), _StageForwardMeta)
    assert len(losses) == 2 and mailbox[(1, 0)] and mailbox[(0, 1)] == sent
    assert (PipelineStage._recv_meta, PipelineStage._send_meta) == before


def test_a_stage_whose_sender_has_not_run_raises_stage_not_run():
    with priv.fake_process_group(3, rank=1), priv.pipeline_mailbox({}):
        with pytest.raises(priv.StageNotRun, match="stage 1 takes the shapes of its inputs "
                                                   "from stage 0"):
            from torch.distributed.pipelining import ScheduleGPipe

            ScheduleGPipe(_stage(1, 3), n_microbatches=3).step()


def test_dtensor_sharding_caches_are_cleared_when_a_fake_group_ends():
    """torch's debug functions clear DTensor's sharding caches (the C++ fast path's counts
    its hits and misses); a fake group's end calls them, so a rank run after another meets
    none of its decisions (and none of its meshes' process groups)."""
    from torch.distributed.tensor import Replicate, Shard, debug, distribute_tensor

    def add_twice() -> tuple[int, int]:
        with priv.fake_process_group(2):
            mesh = priv.device_mesh("cpu", 2)
            a = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
            b = distribute_tensor(torch.randn(4, 4), mesh, [Replicate()])
            for _ in range(2):
                (a + b).to_local()
            return debug._get_fast_path_sharding_prop_cache_stats()

    assert add_twice() == (1, 1)  # the second add was a hit
    assert add_twice() == (1, 1)  # and the first of the next group a miss again


def test_ddp_param_check_slot_and_the_reducers_comm_hook():
    """DDP's shape check is looked up where the slot says; a hook installed on its Reducer
    is called with each bucket in backward (the simulation's in-place all-reduce)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    module, name = priv.ddp_param_check_slot()
    assert getattr(module, name).__name__ == "_verify_param_shape_across_processes"
    assert "_verify_param_shape_across_processes" in DDP.__init__.__code__.co_names
    seen = []

    def hook(state, bucket):
        seen.append(bucket.buffer().numel())
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    with priv.fake_process_group(2):
        ddp = DDP(torch.nn.Linear(4, 3))
        priv.register_reducer_comm_hook(ddp.reducer, hook)
        ddp(torch.randn(2, 4)).sum().backward()
    assert seen == [4 * 3 + 3]
