"""DistributedDataParallel on a simulated rank (:mod:`memmagic.backends.sim.ddp`): a torchrun
script that wraps its model in DDP runs, and its gradient buckets are on the simulated GPU
(a second copy of the gradients, or the gradients themselves with
``gradient_as_bucket_view=True``)."""

from __future__ import annotations

import textwrap

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from memmagic.frontends import cli

MiB = 2**20
SCRIPT = """
import os, torch, torch.nn as nn, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("nccl")
rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(4)]).cuda(rank)
model = DDP(model, device_ids=[rank]{options})
{extra}
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    model(torch.randn(32, 1024, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
print("after", torch.cuda.memory_allocated() // 2**20, "MiB")
dist.destroy_process_group()
"""
WEIGHTS = 4 * 1024 * 1024 * 4  # four 1024 x 1024 fp32 layers: 16 MiB


def run(tmp_path, capsys, options: str = "", extra: str = "") -> tuple[int, str, dict]:
    import json

    script = tmp_path / "ddp_train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(options=options, extra=extra)))
    out = tmp_path / "r.json"
    rc = cli.main(["run", "--gpu", "T4", "--world-size", "2", "--json", str(out), str(script)])
    return rc, capsys.readouterr().out, json.loads(out.read_text())


def test_ddp_keeps_its_buckets_on_the_gpu_beside_the_gradients(tmp_path, capsys):
    rc, text, report = run(tmp_path, capsys)
    assert rc == 0, text
    # after zero_grad(): the weights and the buckets (one copy of the gradients), and
    # cuBLAS's workspaces (two threads, 16.25 MiB, whatever the model)
    after = int(text.split("after ")[1].split()[0])
    assert after == 2 * WEIGHTS // MiB + 16, text
    # at the peak, in backward: the weights, the gradients and the buckets
    assert report["peak"] >= 3 * WEIGHTS
    assert report["breakdown"]["gradients"] >= WEIGHTS


def test_gradients_as_views_of_the_buckets_take_no_memory_of_their_own(tmp_path, capsys):
    rc, text, copies = run(tmp_path, capsys)
    rc2, text2, views = run(tmp_path, capsys, options=", gradient_as_bucket_view=True")
    assert rc == rc2 == 0, text2
    # (a layer's gradient is still made, then copied into its view: 4 MiB at a time)
    assert copies["peak"] - views["peak"] >= WEIGHTS - WEIGHTS // 4 - MiB


def test_a_comm_hook_is_said_not_installed_and_torch_is_put_back(tmp_path, capsys):
    init, register = DDP.__init__, DDP.register_comm_hook
    rc, text, report = run(tmp_path, capsys, extra=(
        "from torch.distributed.algorithms.ddp_comm_hooks import default_hooks\n"
        "model.register_comm_hook(None, default_hooks.fp16_compress_hook)"))
    assert rc == 0, text
    assert any("communication hook (fp16_compress_hook) was not installed" in n
               for n in report["notes"])
    assert DDP.__init__ is init and DDP.register_comm_hook is register
    assert not dist.is_initialized()
    assert torch.nn.parallel.distributed._verify_param_shape_across_processes.__module__ == \
        "torch.distributed.utils"
