"""A simulated rank of a multi-GPU job looks like rank 0 as torchrun starts it: its
environment, the GPUs of its node, the job's own ``init_process_group("nccl")``, and the
meta-device initialisation of FSDP2 (``with torch.device("meta")``, ``fully_shard``,
``to_empty(device="cuda")``, ``reset_parameters()``). Also: simulated tensors have data
pointers of their own, as on a GPU, where a fake tensor's is 0."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

import memmagic

MiB = 2**20


def _inside(world_size: int, fn):
    """``fn()``'s value, run on a simulated H100 as rank 0 of ``world_size`` GPUs."""
    box = {}
    memmagic.measure(lambda: box.setdefault("v", fn()), backend="sim", gpu="H100",
                     world_size=world_size)
    return box["v"]


def test_the_job_looks_like_torchrun_rank_zero_and_the_environment_comes_back():
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    before = {k: os.environ.get(k) for k in keys}
    hook = sys.excepthook  # init_process_group wraps it ("[rank0]:" on every line), for good

    def seen():
        return ({k: os.environ[k] for k in keys}, torch.cuda.device_count(),
                torch.cuda.get_device_properties(1).name, dist.get_world_size())

    env, count, name, world = _inside(16, seen)
    assert env["RANK"] == env["LOCAL_RANK"] == "0" and env["WORLD_SIZE"] == "16"
    assert env["LOCAL_WORLD_SIZE"] == "8" and env["MASTER_PORT"].isdigit()
    assert (count, world) == (8, 16)          # an 8-GPU node of a 16-GPU job
    assert name.startswith("H100")            # the node's other GPUs are the same card
    assert _inside(2, lambda: torch.cuda.device_count()) == 2
    assert {k: os.environ.get(k) for k in keys} == before
    assert not dist.is_initialized()
    assert sys.excepthook is hook


def test_the_jobs_own_init_and_destroy_of_the_process_group_are_accepted():
    def script():
        dist.init_process_group("nccl")       # as a torchrun script does
        rank, world = dist.get_rank(), dist.get_world_size()
        dist.destroy_process_group()
        return rank, world, dist.is_initialized()

    assert _inside(4, script) == (0, 4, True)  # the job's group lasts the run
    assert not dist.is_initialized()
    assert dist.init_process_group is torch.distributed.distributed_c10d.init_process_group


class _Layer(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width, bias=False)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x):
        return x + self.proj(self.norm(x))

    def reset_parameters(self) -> None:
        self.proj.reset_parameters()
        self.norm.reset_parameters()


def test_the_meta_device_recipe_of_fsdp2_runs_and_shards_exactly():
    """The recipe of PyTorch's FSDP2 example, written here: the model made on the meta
    device, each layer and the whole sharded, then materialised on the GPU and initialised
    in place. Hand arithmetic: 3 layers of a 1024 x 1024 weight (4 MiB fp32) and a
    LayerNorm (8 KiB), sharded over 4 GPUs: 3 x (1 MiB + 2 KiB) of parameters per GPU, and
    AdamW's two moments of the same."""
    from torch.distributed.fsdp import fully_shard

    def script():
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        with torch.device("meta"):
            model = torch.nn.Sequential(*(_Layer(1024) for _ in range(3)))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        model.to_empty(device="cuda")
        for layer in model:
            layer.reset_parameters()
        shard = sum(p.to_local().numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters())
        before = torch.cuda.memory_allocated()
        model(torch.randn(2, 64, 1024, device="cuda")).sum().backward()
        opt.step()
        moments = sum(s[k].to_local().numel() for s in opt.state.values()
                      for k in ("exp_avg", "exp_avg_sq"))
        return shard, moments, before

    shard, moments, before = _inside(4, script)
    assert shard * 4 == 3 * (1024 * 1024 + 2 * 1024)
    assert moments == 2 * shard
    # what the GPU holds before the step: a quarter of each weight and of the LayerNorm's
    # weight and bias (256 fp32 each, 1 KiB: whole 512-byte blocks), nothing else
    assert before == 3 * (1024 * 1024 // 4 * 4 + 2 * (1024 // 4 * 4))
    report = memmagic.measure(script, backend="sim", gpu="H100", world_size=4)
    assert report.error is None and not dist.is_initialized()
    # rows named by the user's classes, not by FSDP2's FSDPSequential / FSDP_Layer
    assert report.modules and report.peak_module.startswith("Sequential")
    assert all(r.module.startswith("Sequential") for r in report.modules)


def test_tensors_on_the_meta_device_hold_no_memory_and_stay_there():
    """``device="meta"`` (torchtitan's and FSDP2's model init, ``torch.empty(...,
    device="meta")``): a meta tensor, counted nowhere, as on a GPU. It was a CPU tensor of
    the same size, counted in the host peak (1 GiB here)."""
    def meta():
        t = torch.empty(2**28, device="meta")
        with torch.device("meta"):
            layer = torch.nn.Linear(4096, 4096)
        return t.device.type, t.is_meta, layer.weight.device.type

    box = {}
    report = memmagic.measure(lambda: box.setdefault("v", meta()), backend="sim", gpu="T4")
    assert box["v"] == ("meta", True, "meta")
    assert report.host_peak == 0 and report.peak == 0


def test_simulated_tensors_have_pointers_of_their_own_and_no_warning_blames_the_user():
    def pointers():
        a = torch.zeros(1000, device="cuda")
        b = torch.zeros(1000, device="cuda")
        host = torch.zeros(10)
        tied = torch.nn.Linear(8, 8).cuda()
        other = torch.nn.Linear(8, 8).cuda()
        other.weight = tied.weight
        return (a.data_ptr(), b.data_ptr(), a[10:].data_ptr(), a.untyped_storage().data_ptr(),
                host.data_ptr(), torch.empty(0, device="cuda").data_ptr(),
                len({p.data_ptr() for p in (*tied.parameters(), *other.parameters())}))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        box = {}
        memmagic.measure(lambda: box.setdefault("v", pointers()), backend="sim", gpu="T4")
    a, b, view, storage, host, empty, distinct = box["v"]
    assert a != b and 0 not in (a, b, host)
    assert view == a + 10 * 4 and storage == a
    assert b - a == 4096                  # the allocator model's blocks: 4000 B rounds to 4096
    assert empty == 0 and distinct == 3   # tied weights share their pointer, as on a GPU
    assert not [w for w in caught if "data pointer of FakeTensor" in str(w.message)]


def test_what_a_rank_cannot_simulate_is_not_sent_to_the_cpu_backend():
    """--backend cpu takes no --world-size: the one line says what to do instead."""
    def script():
        x = torch.randn(64, device="cuda")
        return x[x > 0].sum()

    with pytest.raises(Exception) as info:
        memmagic.measure(script, backend="sim", world_size=2)
    text = str(info.value)
    assert "cannot be simulated" in text and "as one rank of 2 GPUs" in text
    assert "--backend cpu" not in text and "torchrun" in text
    with pytest.raises(Exception) as plain:
        memmagic.measure(script, backend="sim")
    assert "--backend cpu" in str(plain.value)


def test_another_rank_of_the_job_sees_its_own_environment_and_group():
    def seen():
        return ({k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE")},
                dist.get_rank(), dist.get_world_size(), torch.cuda.device_count())

    box = {}
    r = memmagic.measure(lambda: box.setdefault("v", seen()), backend="sim", gpu="H100",
                         world_size=16, rank=9)
    env, rank, world, count = box["v"]
    # rank 9 of 16 on 8-GPU nodes: the second node's second GPU
    assert env == {"RANK": "9", "LOCAL_RANK": "1", "GROUP_RANK": "1", "WORLD_SIZE": "16"}
    assert (rank, world, count) == (9, 16, 8)
    assert "rank 9 of 16 GPUs" in r.device and any(n.startswith("rank 9 of 16 GPUs")
                                                   for n in map(str, r.notes))
    assert not dist.is_initialized() and "RANK" not in os.environ
    # its GPU was cuda:1 of its node (LOCAL_RANK), for the run only
    seen = {}
    memmagic.measure(lambda: seen.update(dev=torch.cuda.current_device(),
                                         x=torch.ones(2, device="cuda:1").sum().item(),
                                         on=str(torch.ones(2, device="cuda").device)),
                     backend="sim", world_size=16, rank=9)
    # its tensors say they are on it (FSDP2 checks a parameter's device against the rank's)
    assert seen == {"dev": 1, "x": 2.0, "on": "cuda:1"}
    from memmagic.backends.sim.errors import SimulationUnsupported
    with pytest.raises(SimulationUnsupported, match="one GPU, cuda:0"):
        memmagic.measure(lambda: torch.ones(2, device="cuda:1"), backend="sim")
    with pytest.raises(ValueError, match="rank takes one of the job's ranks"):
        memmagic.measure(lambda: None, backend="sim", world_size=4, rank=4)
    with pytest.raises(ValueError, match="rank takes one of the job's ranks"):
        memmagic.measure(lambda: None, backend="sim", rank=1)


def test_nodes_of_another_size_as_torchruns_nproc_per_node_gives_them():
    """16 GPUs on nodes of 4: rank 6 is the second node's third GPU; the node answers 4
    GPUs. A size that does not split the job is refused in one line that says what to give."""
    def seen():
        return ({k: os.environ[k] for k in ("LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE")},
                torch.cuda.device_count(), torch.cuda.current_device())

    box = {}
    r = memmagic.measure(lambda: box.setdefault("v", seen()), backend="sim", gpu="H100",
                         world_size=16, rank=6, gpus_per_node=4)
    env, count, device = box["v"]
    assert env == {"LOCAL_RANK": "2", "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    assert (count, device) == (4, 2) and r.device.startswith("simulated cuda:2 ")
    assert "LOCAL_WORLD_SIZE" not in os.environ
    with pytest.raises(ValueError, match="16 GPUs do not split into nodes of 3: give a GPUs per node that divides"):
        memmagic.measure(lambda: None, backend="sim", world_size=16, gpus_per_node=3)
    with pytest.raises(ValueError, match="give world_size too"):
        memmagic.measure(lambda: None, backend="sim", gpus_per_node=4)


def test_a_mesh_larger_than_the_job_says_which_size_to_change():
    def cell():
        from torch.distributed.device_mesh import init_device_mesh
        init_device_mesh("cuda", (3, 2), mesh_dim_names=("dp", "tp"))

    with pytest.raises(RuntimeError) as info:
        memmagic.measure(cell, backend="sim", world_size=4)
    text = str(info.value)
    assert "run it with --world-size 6, or give init_device_mesh sizes that multiply to 4" in text
    assert len(text.splitlines()) == 1 and not dist.is_initialized()
