"""FSDP2 over N simulated GPUs: rank 0's memory against the arithmetic of sharding."""

from __future__ import annotations

import torch
import torch.distributed as dist

from memmagic import sharding, tracking
from memmagic.backends.sim.tracker import SimTracker

# four 512x512 weights without bias: 1 MiB each, so every shard is a multiple of the
# simulated allocator's 512-byte rounding for 2 and 4 ranks (no padding, no rounding)
STEP = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(512, 512, bias=False) for _ in range(4))
    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return x

model = Net().cuda()
opt = torch.optim.Adam(model.parameters())
x = torch.randn(8, 512, device="cuda")
model(x).sum().backward()
opt.step()
"""
P = 4 * 512 * 512 * 4  # parameter bytes


def _at_end(report):
    trace = report.trace
    return trace.breakdown_at(len(trace.events) - 1)


def test_rank_memory_is_the_arithmetic_of_sharded_parameters_gradients_and_adam_state():
    for n in (2, 4):
        r = sharding.simulate_fsdp(STEP, world_size=n)
        assert r.report is not None, r.reason
        assert r.sharded == ("model.blocks.0", "model.blocks.1", "model.blocks.2",
                             "model.blocks.3", "model")
        end = _at_end(r.report)
        assert end["parameters"] == P // n
        assert end["gradients"] == P // n
        assert end["optimizer_state"] == 2 * P // n  # exp_avg, exp_avg_sq (steps on the host)


def test_the_peak_counts_the_all_gathered_block_not_the_whole_model():
    r2 = sharding.simulate_fsdp(STEP, world_size=2)
    r4 = sharding.simulate_fsdp(STEP, world_size=4)
    # sharding over more GPUs lowers rank 0's peak by (1/2 - 1/4) of params+grads+state at least
    assert r4.peak < r2.peak
    assert r2.peak - r4.peak >= (P // 2 - P // 4) * 3
    # parameters at the peak: the shards plus at most two all-gathered blocks, never the model
    block = P // 4
    params_at_peak = r4.report.breakdown["parameters"]
    assert P // 4 <= params_at_peak <= P // 4 + 2 * block


def test_a_cell_without_an_optimizer_says_why():
    r = sharding.simulate_fsdp("import torch\nx = torch.ones(4, device='cuda')\n", world_size=2)
    assert r.report is None and r.peak is None
    assert "optimizer" in r.reason and "FSDP2" in r.reason
    assert "not simulated" in str(r)


def test_world_size_one_is_refused():
    import pytest

    with pytest.raises(ValueError, match="2 or more"):
        sharding.simulate_fsdp(STEP, world_size=1)


def test_everything_installed_is_restored_also_after_the_cell_fails(clean_state):
    methods = {n: tracking.StorageTracker.__dict__[n] for n in ("track", "note", "serial_of", "recheck_size")}
    pool = SimTracker.__dict__["pool_from_inputs"]
    init = torch.optim.Optimizer.__dict__["__init__"]
    r = sharding.simulate_fsdp(STEP + "raise ValueError('boom')\n", world_size=2)
    assert r.report is None and "boom" in r.reason
    assert {n: tracking.StorageTracker.__dict__[n] for n in methods} == methods
    assert SimTracker.__dict__["pool_from_inputs"] is pool
    assert torch.optim.Optimizer.__dict__["__init__"] is init
    assert not dist.is_initialized()


def test_the_namespace_given_is_not_changed():
    ns = {"keep": 1}
    sharding.simulate_fsdp(STEP, ns, world_size=2)
    assert ns == {"keep": 1}
