# %% [markdown]
# # 03 · Batch size: why halving it rarely halves memory
#
# "Out of memory? Halve the batch size." It is the first advice anyone gives, and it
# works, but the saving is not proportional. In this notebook you will:
#
# - measure a training step's peak at seven batch sizes on a simulated T4;
# - split the peak into a part that grows with the batch and a part that does not;
# - find the batch size below which a smaller batch saves **nothing at all**;
# - fact-check the claim *"a smaller batch is a linear saving"*.

# %%
# %load_ext memmagic
# %matplotlib inline
import torch
from torch import nn
import matplotlib.pyplot as plt
torch.manual_seed(0)
from memmagic import format_bytes


# %% [markdown]
# A small CNN for 32x32 images (CIFAR-sized), trained with Adam. `train_step` is
# ordinary CUDA code; the model is built inside, so every call starts from an empty GPU.

# %%
def make_cnn():
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(128 * 8 * 8, 512), nn.ReLU(), nn.Linear(512, 10))

def train_step(batch_size):
    model = make_cnn().cuda()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(batch_size, 3, 32, 32, device="cuda")
    y = torch.randint(10, (batch_size,), device="cuda")
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


# %% [markdown]
# To run the same step at many sizes, `memmagic.measure(fn, backend="sim", gpu="T4")`
# calls `fn` on a simulated T4 and returns the same report as `%%gpumem`. Each call starts
# from an empty simulated GPU, as a fresh process would.

# %%
import memmagic
batch_sizes = [8, 16, 32, 64, 128, 256, 512]
runs = {}
for b in batch_sizes:
    runs[b] = memmagic.measure(lambda: train_step(b), backend="sim", gpu="T4")
for b, r in runs.items():
    print(f"batch {b:>3}: peak {format_bytes(r.peak):>11}, {r.peak_words}")

# %% [markdown]
# Two regimes show up. For large batches the peak comes during `loss.backward()`, when
# the activations saved for every layer are still alive. For small ones it comes in the
# optimizer step, where the batch plays no part: parameters, gradients, Adam's two
# moments and its temporaries are all the size of the model.

# %%
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(batch_sizes, [runs[b].peak / 2**20 for b in batch_sizes], "o-", label="measured peak")
big = batch_sizes[-1]
ax.plot(batch_sizes, [runs[big].peak / 2**20 * b / big for b in batch_sizes], "--",
        label="'linear saving' from the largest batch")
ax.set_xscale("log", base=2)
ax.set_xticks(batch_sizes, batch_sizes)
ax.set_xlabel("batch size")
ax.set_ylabel("peak (MiB)")
ax.legend()
plt.show()

# %% [markdown]
# ## The part that grows and the part that does not
#
# In the backward regime the peak is close to a straight line, `peak ≈ fixed + per_sample × batch`.
# Two measurements fix the line; the others check it.

# %%
per_sample = (runs[512].peak - runs[256].peak) / (512 - 256)
fixed = runs[512].peak - 512 * per_sample
print(f"per sample: {format_bytes(int(per_sample))}, fixed part: {format_bytes(int(fixed))}")
for b in batch_sizes:
    line = fixed + per_sample * b
    print(f"batch {b:>3}: line predicts {format_bytes(int(line)):>11}, measured {format_bytes(runs[b].peak):>11}")

# %% [markdown]
# The line holds for the large batches and fails for the small ones, where the optimizer
# step's peak (flat) takes over. Below that crossing, no batch size helps: the model,
# its gradients and its optimizer state have to fit anyway.
#
# ## Fact-check: "a smaller batch is a linear saving"

# %%
for big, small in [(512, 256), (128, 64), (64, 32), (16, 8)]:
    saved = 1 - runs[small].peak / runs[big].peak
    print(f"batch {big:>3} -> {small:>3}: the peak drops by {saved:4.0%} (a linear saving would be 50%)")

# %% [markdown]
# **Where the claim holds:** only the activation part scales with the batch. When
# activations dominate (large batches, long sequences, big images), halving the batch
# comes close to halving the peak.
#
# **Where it fails:** the fixed part (weights, gradients, optimizer state, workspaces)
# never shrinks, so each halving saves less, and once the optimizer step holds the peak,
# nothing. To go lower you need the tools of the next notebooks: mixed precision,
# checkpointing, or a smaller optimizer state.
#
# ## Reserved memory moves in steps
#
# What the card must really have free is the allocator's **reserved** memory (what
# `nvidia-smi` shows, minus the CUDA context). It is rounded up to whole segments
# (notebook 11), so it is always above the peak, and it does not even move in step with
# the batch: how tensors pack into segments depends on their sizes. These reserved
# figures come from the simulator's model of the CUDA caching allocator.

# %%
for b, r in runs.items():
    print(f"batch {b:>3}: peak {format_bytes(r.peak):>11}   reserved {format_bytes(r.reserved_peak):>11}"
          f"   (+{r.reserved_peak / r.peak - 1:.0%})")

# %% [markdown]
# ## What we measured

# %%
print(f"{'batch':>5}{'peak':>12}{'activations':>13}  peak reached during")
for b, r in runs.items():
    phase = "optimizer.step()" if "optimizer" in r.peak_words else "loss.backward()"
    print(f"{b:>5}{format_bytes(r.peak):>12}{format_bytes(r.breakdown['activations']):>13}  {phase}")
