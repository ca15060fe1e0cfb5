"""The command line for multi-GPU jobs and packaged trainers: ``python -m memmagic run
--world-size N`` runs a script written for torchrun unchanged, as rank 0, and
``-m package.module args`` runs a module as ``python -m`` does; ``--rank`` and ``--ranks``
run the job as other ranks, on the command line and in ``%%gpumem``."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from memmagic.frontends import cli

# a trainer as torchrun launches it: it reads its rank from the environment, checks the
# GPUs it was given, starts NCCL, and shards a model made on the meta device
TORCHRUN_TRAINER = textwrap.dedent('''
    import argparse, os
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=512)
    args = p.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    if torch.cuda.device_count() < world:
        raise SystemExit(f"this job needs {world} GPUs")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(args.width, args.width, bias=False),
                                    torch.nn.Linear(args.width, args.width, bias=False))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cuda")
    for layer in model:
        layer.reset_parameters()
    print("rank", dist.get_rank(), "of", dist.get_world_size(), "on", torch.cuda.device_count(), "GPUs")
    print("shard", sum(p.to_local().numel() for p in model.parameters()))
    dist.destroy_process_group()
''')


def test_a_torchrun_script_runs_unchanged_as_rank_zero(tmp_path, capsys, clean_state):
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_TRAINER)
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: os.environ.get(k) for k in keys}
    out = tmp_path / "r.json"
    rc = cli.main(["run", "--gpu", "H100", "--world-size", "4", "--json", str(out), str(script),
                   "--width", "1024"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "rank 0 of 4 on 4 GPUs" in text
    assert "shard 524288" in text  # two 1024 x 1024 weights over 4 GPUs
    report = json.loads(out.read_text())
    # what stays on rank 0's GPU: its quarter of each weight, 1 MiB each
    assert report["after"] == 2 * 1024 * 1024 // 4 * 4
    assert {k: os.environ.get(k) for k in keys} == env and not dist.is_initialized()


def test_without_world_size_the_same_script_stops_as_on_one_gpu(tmp_path, capsys, clean_state):
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_TRAINER)
    os.environ.pop("WORLD_SIZE", None)
    rc = cli.main(["run", "--gpu", "H100", str(script)])
    assert rc == 1 and "KeyError: 'WORLD_SIZE'" in capsys.readouterr().err


def test_a_module_runs_as_python_dash_m_runs_it(tmp_path, capsys, clean_state, monkeypatch):
    pkg = tmp_path / "trainer"
    pkg.mkdir()
    # the package reads its arguments when imported, as a default value (torchtitan 0.2's
    # ConfigManager.parse_args(args=sys.argv[1:])): python -m imports it with the module's
    (pkg / "__init__.py").write_text("import sys\nARGV_AT_IMPORT = sys.argv[1:]\n")
    (pkg / "config.py").write_text("WIDTH = 256\n")
    (pkg / "train.py").write_text(textwrap.dedent('''
        import sys
        import torch
        from .config import WIDTH   # a relative import: the module runs in its package
        from trainer import ARGV_AT_IMPORT
        print("argv", sys.argv[1:], "main", __name__, __spec__.name, "on import", ARGV_AT_IMPORT)
        x = torch.zeros(int(sys.argv[2]), WIDTH, device="cuda")
    '''))
    (pkg / "__main__.py").write_text("import torch\nprint('package main')\n"
                                     "y = torch.zeros(1024, device='cuda')\n")
    monkeypatch.chdir(tmp_path)
    path = list(sys.path)
    out = tmp_path / "r.json"
    rc = cli.main(["run", "--gpu", "T4", "--json", str(out), "-m", "trainer.train", "--rows", "64"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "argv ['--rows', '64'] main __main__ trainer.train on import ['--rows', '64']" in text
    assert json.loads(out.read_text())["after"] == 64 * 256 * 4
    assert cli.main(["run", "--gpu", "T4", "-m", "trainer"]) == 0
    assert "package main" in capsys.readouterr().out
    assert sys.path == path


@pytest.mark.parametrize("argv, words", [
    (["run", "--world-size", "8", "--gpus-per-node", "3", "-m", "json.tool"],
     "--gpus-per-node 3: 8 GPUs do not split into nodes of 3"),
    (["run", "--gpus-per-node", "4", "-m", "json.tool"],
     "--gpus-per-node K is the size of a job's nodes: give --world-size N too"),
    (["run", "-m", "no_such_module_here"], "-m no_such_module_here: no Python module of that name"),
    (["run"], "give the script to run"),
    (["run", "--backend", "cpu", "--world-size", "2", "-m", "json.tool"],
     "--world-size makes the simulated GPU one rank of a job: add --backend sim"),
    (["run", "--world-size", "1", "-m", "json.tool"], "--world-size is a number of GPUs, 2 or more"),
    (["run", "--backend", "cpu", "--decode-steps", "run", "-m", "json.tool"],
     "--decode-steps says how the simulated GPU runs generate()'s decode steps: add --backend sim"),
    (["run", "--rank", "1", "-m", "json.tool"], "--rank R needs --world-size N"),
    (["run", "--world-size", "4", "--rank", "4", "-m", "json.tool"],
     "--rank is one of the job's ranks, 0 to 3, not 4"),
    (["run", "--ranks", "all", "-m", "json.tool"], "--ranks needs --world-size N"),
    (["run", "--world-size", "4", "--ranks", "0,9", "-m", "json.tool"],
     "--ranks takes all or ranks of the job, 0 to 3"),
    (["run", "--world-size", "4", "--rank", "1", "--ranks", "all", "-m", "json.tool"],
     "give --rank R (one rank) or --ranks (several), not both"),
    (["run", "--world-size", "128", "--ranks", "all", "-m", "json.tool"],
     "with 128 ranks, name the ones to run (--ranks 0,1,127)"),
])
def test_bad_jobs_get_one_line(argv, words, capsys, clean_state):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("memmagic: ") and words in err and len(err.strip().splitlines()) == 1


RANK_ZERO_KEEPS = textwrap.dedent('''
    import os
    import torch
    import torch.distributed as dist
    dist.init_process_group("nccl")
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    shard = torch.empty(64 * 2**20 // dist.get_world_size(), device="cuda")  # 64 Mi floats
    if rank == 0:  # the rank that logs keeps a copy of everything it gathers
        gathered = torch.empty(64 * 2**20, device="cuda")
    print("rank", rank, "of", dist.get_world_size(), "on GPU", torch.cuda.current_device())
''')


def test_another_rank_runs_the_script_as_that_rank(tmp_path, capsys, clean_state):
    script = tmp_path / "job.py"
    script.write_text(RANK_ZERO_KEEPS)
    reports = {}
    for rank in (0, 5):
        out = tmp_path / f"r{rank}.json"
        argv = ["run", "--gpu", "H100", "--world-size", "16", "--json", str(out), str(script)]
        if rank:
            argv[5:5] = ["--rank", str(rank)]
        assert cli.main(argv) == 0
        text = capsys.readouterr().out
        reports[rank] = json.loads(out.read_text())
        assert f"rank {rank} of 16 on GPU {rank % 8}" in text
        assert f"rank {rank} of 16 GPUs" in text
    # a shard of 64 Mi floats over 16 ranks on every rank; the whole of it on rank 0 only
    assert reports[5]["after"] == 4 * 2**20 * 4
    assert reports[0]["after"] == reports[5]["after"] + 64 * 2**20 * 4


def test_every_rank_is_run_and_the_one_that_needs_the_most_decides(tmp_path, capsys, clean_state):
    script = tmp_path / "job.py"
    script.write_text(RANK_ZERO_KEEPS)
    out = tmp_path / "ranks.json"
    assert cli.main(["run", "--gpu", "H100", "--world-size", "4", "--ranks", "all", "--json",
                     str(out), str(script)]) == 0
    text = capsys.readouterr().out
    quarter = 16 * 2**20 * 4  # each rank's shard: 64 Mi floats over 4 ranks
    assert "    rank 0           peak 320.00 MiB, reserved 320.00 MiB: fits" in text
    assert "    ranks 1-3        peak 64.00 MiB, reserved 64.00 MiB: fits" in text
    assert ("the 4 ranks of the job, each run; this report is rank 0's, the rank that "
            "needs the most") in text
    data = json.loads(out.read_text())
    assert data["deciding_rank"] == 0 and data["after"] == quarter + 64 * 2**20 * 4
    assert data["world_size"] == 4
    assert [data["ranks"][str(r)]["peak"] for r in range(4)] == [5 * quarter] + [quarter] * 3
    # on a card where only rank 0 runs out: the job does not fit, and its fixes are ranked
    assert cli.main(["run", "--gpu-memory", "256MiB", "--world-size", "4", "--ranks", "1,0",
                     str(script)]) == 1
    captured = capsys.readouterr()
    assert "    rank 0           out of memory asking for 256.00 MiB with 64.00 MiB live" in \
        captured.out
    assert "    rank 1           peak 64.00 MiB, reserved 64.00 MiB: fits" in captured.out
    assert "this report is rank 0's" in captured.out
    # a rank that fails decides: the job fails with it
    script.write_text(RANK_ZERO_KEEPS + "assert rank != 2, 'rank 2 has no data'\n")
    assert cli.main(["run", "--gpu", "H100", "--world-size", "4", "--ranks", "all",
                     str(script)]) == 1
    failed = capsys.readouterr()
    assert "    rank 2           failed: AssertionError: rank 2 has no data" in failed.out
    assert "this report is rank 2's, the rank that failed" in failed.out
    # the doctor ranked fixes for rank 0 (none applies to this script: it says why)
    assert "note: no smaller batch was tried: the script does not take its batch size" in \
        captured.out


# a transformers Trainer's data and model, small (the trainers below add their arguments)
LLAMA = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4)
TRAINER_MODEL = textwrap.dedent(f'''
    import torch
    from torch.utils.data import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    class Tokens(Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            ids = torch.randint(0, 1000, (64,))
            return {{"input_ids": ids, "labels": ids.clone()}}

    config = LlamaConfig(**{LLAMA!r})
''')
TRAINER_FSDP = TRAINER_MODEL + textwrap.dedent('''
    args = TrainingArguments(output_dir="out", per_device_train_batch_size=4, max_steps=2,
                             report_to=[], save_strategy="no", fsdp="full_shard",
                             fsdp_config={"fsdp_version": 2,
                                          "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=Tokens()).train()
''')


def test_a_transformers_trainer_with_fsdp2_runs_unchanged_on_two_ranks(tmp_path, capsys, clean_state):
    """transformers' Trainer with ``fsdp="full_shard"`` (accelerate's FSDP2) as torchrun
    would launch it. Hand check: every weight of the Llama is split in two along its first
    dimension, so AdamW's two moments on rank 0 are twice its halves (512-byte blocks)."""
    transformers = pytest.importorskip("transformers")
    script = tmp_path / "train.py"
    script.write_text(TRAINER_FSDP)
    out = tmp_path / "r.json"
    rc = cli.main(["run", "--gpu", "H100", "--world-size", "2", "--json", str(out), str(script)])
    assert rc == 0, capsys.readouterr()
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4))
    params = list(model.parameters())                       # 21 tensors, 1,824,000 values
    halves = sum(-(-p.numel() // 2 * 4 // 512) * 512 for p in params)        # 3,648,000 B
    report = json.loads(out.read_text())
    # the Trainer's default AdamW on CUDA is the fused one: its step count is a tensor on
    # the GPU too, one 512-byte block a parameter
    assert report["breakdown"]["optimizer_state"] == 2 * halves + len(params) * 512
    capsys.readouterr()


def test_the_magic_runs_a_cell_as_another_rank_and_as_every_rank(ip):
    """``%%gpumem --rank R`` / ``--ranks``: the same job as the command line's, on a cell;
    the deciding rank's report carries every rank's row, and the names stay as they were."""
    cell = RANK_ZERO_KEEPS.replace("gathered =", "held =")
    ip.run_cell(f"%%gpumem --gpu H100 --world-size 16 --rank 9 -q -v one\n{cell}")
    one = ip.user_ns["one"]
    assert "rank 9 of 16 GPUs" in one.device and "cuda:1" in one.device
    assert one.after == 4 * 2**20 * 4 and one.job is None
    result = ip.run_cell(f"%%gpumem --gpu-memory 256MiB --world-size 4 --ranks all -q -v job\n"
                         f"{cell}")
    assert result.error_in_exec is not None  # rank 0 ran out of memory: the job does not fit
    job = ip.user_ns["job"]
    assert job.job.deciding == 0 and job.failed_request == 64 * 2**20 * 4 and job.fits is False
    assert [r.rank for r in job.job.rows] == [0, 1, 2, 3]
    assert job.job.grouped()[1] == ("ranks 1-3", "peak 64.00 MiB, reserved 64.00 MiB: fits")
    assert "ranks 1-3" in job._repr_html_() and job.to_dict()["deciding_rank"] == 0
    assert "shard" not in ip.user_ns and "rank" not in ip.user_ns
    for line, words in [("--ranks all", "--ranks needs --world-size N"),
                        ("--world-size 4 --ranks all --sweep batch_size=1:4", "--ranks runs the "
                         "cell once per rank: give it without --whatif"),
                        ("--world-size 4 --ranks 7", "--ranks takes all or ranks of the job")]:
        result = ip.run_cell(f"%%gpumem {line}\nx = 1\n")
        assert words in str(result.error_in_exec), (line, result.error_in_exec)


# each rank of a real job keeps its own amount; the script may leave its group up or make none
REAL_JOB = textwrap.dedent('''
    import os
    import torch
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    if JOIN:
        dist.init_process_group("gloo")  # left up: memmagic gathers over it
    kept = torch.zeros((rank + 1) * 2**20)  # rank r keeps (r + 1) Mi floats
''')


def _torchrun(tmp_path, k: int, *argv: str):
    import subprocess

    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(k), "-m", "memmagic", "run", *argv],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("join", [True, False])
def test_a_real_torchrun_job_gathers_every_ranks_figures_on_rank_zero(tmp_path, join):
    """``torchrun --nproc-per-node K -m memmagic run --backend cpu|cuda script.py``: each rank
    measures its own run for real, and rank 0's report heads with every rank's figures,
    gathered over the job's own process group (or a gloo group made for it); each rank
    writes its own JSON."""
    script = tmp_path / "job.py"
    script.write_text(f"JOIN = {join}\n" + REAL_JOB)
    out = tmp_path / "out.json"
    done = _torchrun(tmp_path, 2, "--backend", "cpu", "--json", str(out), str(script))
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("the 2 ranks of the job, each run; the rank that needs the most is rank 1 (this "
            "report is rank 0's):") in done.stdout
    assert "    rank 1           peak 8.00 MiB" in done.stdout
    zero = json.loads(out.read_text())
    one = json.loads((tmp_path / "out.rank1.json").read_text())
    assert zero["rank"] == 0 and zero["deciding_rank"] == 1
    assert {r: v["peak"] for r, v in zero["ranks"].items()} == {"0": 4 * 2**20, "1": 8 * 2**20}
    assert one["peak"] == 8 * 2**20 and "ranks" not in one


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_real_torchrun_job_on_one_gpu_gathers_over_nccl(tmp_path):
    """The same on a GPU (K=1 is enough: the script's own NCCL group, rows over gloo)."""
    script = tmp_path / "job.py"
    script.write_text(REAL_JOB.replace("JOIN", "True").replace('"gloo"', '"nccl"').replace(
        "torch.zeros((rank + 1) * 2**20)", "torch.zeros((rank + 1) * 2**20, device='cuda')"))
    out = tmp_path / "out.json"
    done = _torchrun(tmp_path, 1, "--backend", "cuda", "--json", str(out), str(script))
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["backend"] == "cuda" and data["ranks"]["0"]["peak"] == 4 * 2**20


# a 2-D job as PyTorch's FSDP + TP examples write one: attention heads split by tensor
# parallel on DTensors (q, k, v kept as DTensors into scaled_dot_product_attention), the
# norms sequence parallel, FSDP2 across the pairs
TWO_D_ATTENTION = textwrap.dedent('''
import warnings
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)
from torch.distributed.fsdp import fully_shard
warnings.filterwarnings("ignore")
D, H = 256, 4

class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.wo = nn.Linear(D, D, bias=False)

    def forward(self, h):
        b, t, _ = h.shape
        q, k, v = (w(h).view(b, t, H, D // H).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, D))

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.attn = Attention()

    def forward(self, x):
        return x + self.attn(self.norm(x))

mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
model = nn.Sequential(Block(), Block()).cuda()
for i, block in enumerate(model):
    parallelize_module(block, mesh["tp"], {
        "norm": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
        "attn.wq": ColwiseParallel(use_local_output=False),
        "attn.wk": ColwiseParallel(use_local_output=False),
        "attn.wv": ColwiseParallel(use_local_output=False),
        "attn.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})
    fully_shard(block, mesh=mesh["dp"])
parallelize_module(model, mesh["tp"], PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_output=False))
fully_shard(model, mesh=mesh["dp"])
x = torch.randn(4, 64, D, device="cuda")
model(x).to_local().sum().backward()
''')


def test_a_2d_attention_job_runs_as_every_rank(tmp_path, capsys, clean_state):
    """SDPA on DTensors runs CUDA's own attention op (the one DTensor has sharding rules
    for; the CPU composite's has none), and each rank's run starts with no sharding decision
    cached by the rank before (DTensor's caches compare meshes by shape and names: the next
    rank got the first rank's process groups, "Could not resolve the process group")."""
    script = tmp_path / "two_d.py"
    script.write_text(TWO_D_ATTENTION)
    assert cli.main(["run", "--gpu", "H100", "--world-size", "4", "--ranks", "all",
                     str(script)]) == 0
    out = capsys.readouterr().out
    assert "    ranks 0-3        peak " in out
    assert "scaled_dot_product_attention ran as CUDA would pick it: efficient 2x" in out
