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
from memmagic.sharding import shard_memory

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
# ## What we measured

# %%
base = one_gpu.peak
for name, r in rows:
    print(f"{name:<14} peak {format_bytes(r.peak):>11}  ({r.peak / base:.0%} of one GPU's)")
