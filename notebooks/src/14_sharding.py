# %% [markdown]
# # More GPUs: data parallel, ZeRO and FSDP
#
# With more than one GPU there are two ways to train. **Data parallel** (DDP) keeps a
# full copy of the model, its gradients and its optimizer state on every GPU, and
# splits the batch. **Sharding** (ZeRO stages 1-3, PyTorch's FSDP) splits those
# copies: stage 1 shards the optimizer state, stage 2 the gradients too, stage 3
# (FSDP) the parameters as well, gathering each layer's parameters just when it runs.
#
# **You will learn** what each stage saves per GPU, on paper and measured by running
# a model under PyTorch's own FSDP2 on simulated GPUs, and what sharding does not
# shard: the activations.

# %%
# %load_ext memmagic
# %matplotlib inline
import torch
from torch import nn
import matplotlib.pyplot as plt
torch.manual_seed(0)
from memmagic import format_bytes

# %% [markdown]
# ## On paper: 16 bytes per parameter
#
# Mixed-precision training with Adam keeps, per parameter, fp32 weights (4 B),
# gradients (4 B) and two Adam moments (8 B): 16 B. For a GPT-2-small-sized model
# (124 M parameters):

# %%
params = 124_000_000
weights, grads, adam = 4 * params, 4 * params, 8 * params
print(f"{'GPUs':>4} {'DDP':>10} {'ZeRO-1':>10} {'ZeRO-2':>10} {'ZeRO-3/FSDP':>12}")
for n in (1, 2, 4, 8):
    ddp = weights + grads + adam
    z1 = weights + grads + adam // n
    z2 = weights + (grads + adam) // n
    z3 = (weights + grads + adam) // n
    print(f"{n:>4} {format_bytes(ddp):>10} {format_bytes(z1):>10} "
          f"{format_bytes(z2):>10} {format_bytes(z3):>12}")

# %% [markdown]
# These are the model's *states* only. The activations depend on the batch each GPU
# runs, and no ZeRO stage shards them.
#
# ## Measured: FSDP2 on simulated GPUs
#
# `shard_memory` runs a training cell as rank 0 of N simulated GPUs with PyTorch's
# fake process group (no GPUs, no network), shards the cell's model with FSDP2's
# `fully_shard` when the cell makes its optimizer, and reports rank 0's memory.

# %%
from memmagic import zoo
from memmagic.whatif.sharding import shard_memory

STEP = """
model, batch = zoo.build("transformer", device="cuda")
opt = torch.optim.AdamW(model.parameters())
loss = model.loss(*batch)
loss.backward()
opt.step()
"""

# %%
# %%gpumem --backend sim -q -v one_gpu
model, batch = zoo.build("transformer", device="cuda")
opt = torch.optim.AdamW(model.parameters())
loss = model.loss(*batch)
loss.backward()
opt.step()

# %%
sharded = shard_memory(STEP, globals(), world_sizes=(2, 4))
rows = [("1 GPU", one_gpu)] + [(f"FSDP2 over {r.world_size}", r.report) for r in sharded]
print(f"{'':<14}{'peak':>11}{'activations at peak':>21}{'after the step':>16}")
for name, r in rows:
    print(f"{name:<14}{format_bytes(r.peak):>11}"
          f"{format_bytes(r.breakdown['activations']):>21}{format_bytes(r.after):>16}")

# %% [markdown]
# After the step, each GPU keeps its shard of the parameters, the gradients and
# AdamW's two moments: that part shrinks with N (what stays is cuBLAS's workspaces).
# The peak does not: it is in backward, where the activations dominate.
#
# ## Fact-check: "FSDP over N GPUs divides memory by N"
#
# Only the model's states are divided, and not exactly: FSDP2 gathers a layer's full
# parameters while that layer runs, so a layer's worth stays unsharded at a time,
# and the activations of each GPU's share of the batch do not shrink at all. For a
# small model with a large batch, sharding hardly helps; for a large model with a
# small batch it is what makes training fit.

# %% [markdown]
# ## Measured: ZeRO stages 1, 2 and 3
#
# `simulate_zero` runs the same cell with each stage as PyTorch itself provides it:
# stage 1 steps the cell's optimizer through `ZeroRedundancyOptimizer` (each GPU keeps
# the Adam moments of its part of the parameters), stage 2 is FSDP2 with
# `reshard_after_forward=False` (the gradients and moments sharded; the gathered weights
# kept from forward to backward), stage 3 is FSDP2 as it comes. After the step, next to
# the paper's figures for this model on 4 GPUs:

# %%
from memmagic.whatif.sharding import simulate_zero

del model, opt, loss, batch  # the 1-GPU transformer above leaves the simulated GPU
n_model = sum(p.numel() for p in zoo.build("transformer", device="meta")[0].parameters())
paper = {1: (4, 4, 8 / 4), 2: (4, 4 / 4, 8 / 4), 3: (4 / 4, 4 / 4, 8 / 4)}  # bytes/parameter
print(f"{'4 GPUs':<8}{'weights':>20}{'gradients':>20}{'Adam moments':>20}   (measured / paper)")
zero = {}
for stage in (1, 2, 3):
    zero[stage] = r = simulate_zero(STEP, globals(), world_size=4, stage=stage)
    end = r.report.trace.breakdown_at(len(r.report.trace.events) - 1)
    got = (end["parameters"], end["gradients"], end["optimizer_state"])
    cells = [f"{format_bytes(g)} / {format_bytes(b * n_model)}" for g, b in zip(got, paper[stage])]
    print(f"ZeRO-{stage:<3}" + "".join(f"{c:>20}" for c in cells))

# %% [markdown]
# Stages 1 and 3 are the paper's figures (`ZeroRedundancyOptimizer` splits by whole
# parameters, so rank 0's part of the moments is a little over a quarter). Stage 2 ends the step with a quarter of the
# weights where the paper keeps them whole: PyTorch's ZeRO-2 frees the gathered weights
# after backward and gathers them again at the next forward (DeepSpeed's keeps them);
# from forward to backward it holds them all, as DeepSpeed's does.
#
# The peaks tell the fact-check's story again: this small model's activations decide
# them, and the FSDP2 stages add the buffers they gather and reduce-scatter through, so
# sharding more shrinks the states but not the peak:

# %%
for name, r in [("1 GPU", one_gpu)] + [(f"ZeRO-{s}", zero[s].report) for s in (1, 2, 3)]:
    print(f"{name:<6} peak {format_bytes(r.peak):>10}, reserved {format_bytes(r.reserved_peak):>10}")

# %% [markdown]
# The memory doctor offers these rows too, beside FSDP2 over 2, 4 and 8 GPUs, after a
# cell runs out of memory (`%%gpumem --advise`).
#
# ## Tensor parallel: splitting each layer
#
# FSDP splits the model's states and gathers a whole layer to run it. **Tensor
# parallelism** (TP) splits the layer itself: each GPU holds a slice of every weight
# and computes with it. In an MLP the first linear layer is split by its output
# features (`ColwiseParallel`), the second by its input features (`RowwiseParallel`):
# the hidden activation between them stays split, and one all-reduce makes the output
# whole again on every GPU.
#
# `%%gpumem --world-size 4` runs a cell as rank 0 of 4 GPUs on the fake process group:
# the cell's own `init_device_mesh` and `parallelize_module` run as in a `torchrun`
# job, and the report is one GPU's memory. (The cell runs on a copy of the notebook's
# simulated GPU: its names do not land here.)

# %%
class MLP(nn.Module):
    def __init__(self, d=1024, hidden=4096):
        super().__init__()
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))

with torch.device("meta"):
    n_params = sum(p.numel() for p in nn.Sequential(*[MLP() for _ in range(4)]).parameters())
print(f"4 MLP blocks: {n_params / 1e6:.1f} M parameters, {format_bytes(4 * n_params)} in fp32")

# %%
# %%gpumem --backend sim -q -v mlp_1
model = nn.Sequential(*[MLP() for _ in range(4)]).cuda()
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(64, 1024, device="cuda")).sum().backward()
opt.step()

# %%
del model, opt  # each GPU of a job starts empty: the 1-GPU model leaves the simulated GPU

# %%
# %%gpumem --world-size 4 -q -v mlp_tp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel
model = nn.Sequential(*[MLP() for _ in range(4)]).cuda()
mesh = init_device_mesh("cuda", (4,))
for block in model:
    parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(64, 1024, device="cuda")).sum().backward()
opt.step()

# %% [markdown]
# **2-D parallelism** combines both on a mesh of 2 x 2 GPUs: TP inside each pair, FSDP2
# across the pairs, so each weight is split by TP and its slice sharded again by FSDP2.

# %%
# %%gpumem --world-size 4 -q -v mlp_2d
import warnings  # FSDP2 warns that each block returns a view (RowwiseParallel's local
warnings.filterwarnings("ignore", "FSDP2-wrapped module")  # output): nothing edits it in place
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel
from torch.distributed.fsdp import fully_shard
model = nn.Sequential(*[MLP() for _ in range(4)]).cuda()
mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
for block in model:
    parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(block, mesh=mesh["dp"])
fully_shard(model, mesh=mesh["dp"])
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(64, 1024, device="cuda")).sum().backward()
opt.step()

# %%
def at_end(r, category):
    return r.trace.breakdown_at(len(r.trace.events) - 1)[category]

print(f"{'':<22}{'params':>11}{'grads':>11}{'Adam':>11}{'peak':>11}")
for name, r in [("1 GPU", mlp_1), ("TP over 4", mlp_tp), ("2-D: TP 2 x FSDP2 2", mlp_2d)]:
    print(f"{name:<22}" + "".join(f"{format_bytes(at_end(r, c)):>11}"
                                  for c in ("parameters", "gradients", "optimizer_state"))
          + f"{format_bytes(r.peak):>11}")

# %% [markdown]
# Both split every weight, its gradient and Adam's moments 4 ways: a quarter per GPU.
# What differs is the traffic (TP all-reduces activations in every layer, forward and
# backward, so it stays inside a node's fast links; FSDP all-gathers weights) and the
# activations: TP splits the hidden activation inside each MLP, FSDP splits none.
# A transformers model carries its own TP plan (`model.tp_plan`), and `--advise`
# adds rows for it beside FSDP2's.

# %% [markdown]
# ## Pipeline parallel: splitting the model by layers
#
# **Pipeline parallelism** (PP) gives each GPU a *stage*: a run of consecutive layers.
# The batch is cut into micro-batches that flow stage to stage; a stage keeps each
# micro-batch's activations from its forward until its backward. How many micro-batches
# a stage holds at once (**in flight**) is the schedule's doing:
#
# - **GPipe** runs every forward, then every backward: each stage holds all `n`.
# - **1F1B** starts the backward as soon as it can: stage `s` of `p` runs `p - s`
#   forwards, then alternates, so it holds `min(n, p - s)`: the first stage the most.
# - **Interleaved 1F1B** gives each GPU `v` smaller stages (GPU `r` holds stages `r`
#   and `r + p`); its warm-up is `(v - 1) p + 2 (p - 1 - r)` forwards, then one more
#   before the first backward, each holding a stage's smaller share.
#
# `%%gpumem --world-size 4 --ranks all` runs a cell as each of the 4 ranks, in stage
# order, with `torch.distributed.pipelining`'s own stages and schedules on the fake
# process group (each later stage gets the shapes the earlier ones send it). The report
# is the rank that needs the most; `r.job.rows` has every rank, with the most
# activations it held at once. Eight MLP blocks from above, 512 rows cut into 8
# micro-batches:

# %%
import torch.distributed as dist
from torch.distributed import pipelining as pp

def pipeline_step(schedule, stages_per_gpu=1, n_microbatches=8):
    """One training step of 8 MLP blocks over the job's GPUs: this rank's stages run
    their part of ``schedule``."""
    rank, gpus = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank)
    n_stages = gpus * stages_per_gpu
    stages = [pp.PipelineStage(nn.Sequential(*[MLP() for _ in range(8 // n_stages)]).to(device),
                               rank + gpus * v, n_stages, device) for v in range(stages_per_gpu)]
    step = schedule(stages if stages_per_gpu > 1 else stages[0], n_microbatches=n_microbatches,
                    loss_fn=lambda out, y: (out - y).pow(2).mean())
    x = torch.randn(512, 1024, device=device)
    last = {"target": x, "losses": []} if rank == gpus - 1 else {}
    step.step(x, **last) if rank == 0 else step.step(**last)

# %%
# %%gpumem --world-size 4 --ranks all -q -v pp_gpipe
pipeline_step(pp.ScheduleGPipe)

# %%
# %%gpumem --world-size 4 --ranks all -q -v pp_1f1b
pipeline_step(pp.Schedule1F1B)

# %%
# %%gpumem --world-size 4 --ranks all -q -v pp_interleaved
pipeline_step(pp.ScheduleInterleaved1F1B, stages_per_gpu=2)

# %% [markdown]
# By hand, one micro-batch (64 rows) through one MLP block keeps its input (64 x 1024
# floats, 0.25 MiB) and its ReLU output (64 x 4096, 1 MiB). Two details: the first
# stage's input is the batch itself, cut into views, so all of it (2 MiB) is held from
# the first micro-batch and no block input beyond it; the last stage's loss keeps
# `out - y` (0.25 MiB) per micro-batch until its backward.

# %%
MiB = 2**20
block, row_in, batch, loss = 1.25 * MiB, 0.25 * MiB, 2 * MiB, 0.25 * MiB

def by_hand(in_flight, rank, blocks, losses):
    held = in_flight * blocks * block
    if rank == 0:   # the batch itself, not each micro-batch's input
        held += batch - in_flight * row_in
    if rank == 3:   # the loss of each micro-batch in flight on the last stage
        held += losses * loss
    return held

n, p, v = 8, 4, 2
print(f"{'rank':<6}{'GPipe':>18}{'1F1B':>18}{'interleaved':>18}   (measured / by hand, MiB)")
for r in range(p):
    gpipe = by_hand(n, r, 2, losses=n)
    one_f = by_hand(min(n, p - r), r, 2, losses=1)
    inter = by_hand((v - 1) * p + 2 * (p - 1 - r) + 1, r, 1, losses=1)
    if r == 0:  # 7 of its 11 on stage 0 (input: the batch), 4 on stage 4 (inputs received)
        inter = batch + 7 * (block - row_in) + 4 * block
    measured = [job.job.rows[r].activations_held for job in (pp_gpipe, pp_1f1b, pp_interleaved)]
    print(f"{r:<6}" + "".join(f"{format_bytes(m):>10} / {h / MiB:<5.2f}"
                              for m, h in zip(measured, (gpipe, one_f, inter))))

# %% [markdown]
# GPipe holds every micro-batch on every stage. 1F1B holds 4, 3, 2 and 1 micro-batches
# on stages 0 to 3: same bubble, much less memory, and the first stage is the one to
# watch. Interleaved 1F1B halves each stage (one block) but keeps more micro-batches in
# flight (11, 9, 7, 5): a smaller bubble for a little more memory than 1F1B. More
# micro-batches shrink the bubble without changing 1F1B's memory.

# %% [markdown]
# ## What we measured

# %%
base = one_gpu.peak
for name, r in rows:
    print(f"{name:<14} peak {format_bytes(r.peak):>11}  ({r.peak / base:.0%} of one GPU's)")
