# %% [markdown]
# # 09 · Offloading activations to the CPU: `save_on_cpu`
#
# `torch.autograd.graph.save_on_cpu()` moves every tensor autograd saves for backward
# to CPU memory during the forward pass and copies it back when backward needs it. In
# this notebook you will:
#
# - measure a transformer step with and without it on a simulated T4: GPU memory, and
#   the CPU (host) memory it takes instead;
# - see what stays on the GPU, and combine offloading with a smaller batch to find what
#   limits it;
# - count the bytes that cross the PCIe bus, the cost you pay in time.

# %%
# %load_ext memmagic
# %matplotlib inline
import torch
from torch import nn
import matplotlib.pyplot as plt
torch.manual_seed(0)
from memmagic import format_bytes

# %%
from torch.autograd.graph import save_on_cpu

def make_model():
    layer = nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=4)

def train_step(batch_size, offload):
    model = make_model().cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(batch_size, 256, 512, device="cuda")
    with save_on_cpu(pin_memory=True) if offload else torch.enable_grad():
        loss = model(x).square().mean()
    loss.backward()
    opt.step()


# %% [markdown]
# Each run on a fresh simulated T4 (`memmagic.measure`, notebook 03). The report's
# `host_peak` is the most CPU memory the run's tensors held: with offloading, the
# saved activations live there.

# %%
import memmagic
runs = {}
for b in [8, 32]:
    for offload in [False, True]:
        runs[b, offload] = memmagic.measure(lambda: train_step(b, offload), backend="sim", gpu="T4")
for (b, offload), r in runs.items():
    print(f"batch {b:>2}, save_on_cpu={offload!s:<5}: GPU peak {format_bytes(r.peak):>11}, "
          f"CPU peak {format_bytes(r.host_peak):>11}, activations on the GPU {format_bytes(r.breakdown['activations']):>10}")


# %%
def bars(reports, title):
    """One bar per report: its peak in MiB, split by category."""
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.45 * len(reports)))
    for i, report in enumerate(reports.values()):
        left = 0.0
        for j, (category, nbytes) in enumerate(report.breakdown.items()):
            ax.barh(i, nbytes / 2**20, left=left, color=f"C{j}", label=category if i == 0 else None)
            left += nbytes / 2**20
    ax.set_yticks(range(len(reports)), list(reports))
    ax.invert_yaxis()
    ax.set_xlabel("MiB at the peak")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1, 1), frameon=False)
    plt.show()


# %%
bars({f"batch {b}, save_on_cpu={o}": runs[b, o] for b in [8, 32] for o in [False, True]},
     "GPU memory with and without save_on_cpu (simulated T4)")

# %% [markdown]
# ## What stays on the GPU
#
# The activations leave, everything else stays: weights, gradients, optimizer state,
# and in backward the tensors being copied back for the layer at hand, with that
# layer's temporaries. So the peak moves to wherever those are largest:

# %%
for (b, offload), r in runs.items():
    if offload:
        saved = 1 - r.peak / runs[b, False].peak
        print(f"batch {b}: GPU peak {saved:.0%} lower; the peak is now {r.peak_words}")

# %% [markdown]
# At the small batch the peak was already in the optimizer step, which offloading does
# not touch. At the large one the saving is large, and what remains grows with the
# batch too: temporaries of the forward and backward passes are never offloaded.
#
# ## The price: PCIe traffic
#
# Every saved tensor crosses the bus twice, to the CPU in forward and back in backward.
# With offloading, the CPU peak is those saved tensors. It is a little more than the
# activations of the plain run: `save_on_cpu` copies *every* tensor autograd saves, and
# a `Linear` saves its weight as well as its input, so the weights travel too, every
# step (and a tensor saved by two ops is copied twice).

# %%
weights = runs[8, False].breakdown["parameters"]
for b in [8, 32]:
    offloaded = runs[b, True].host_peak
    print(f"batch {b}: CPU peak {format_bytes(offloaded)} = plain run's activations "
          f"{format_bytes(runs[b, False].breakdown['activations'])} {format_bytes(offloaded - runs[b, False].breakdown['activations'], signed=True)}"
          f" (the weights are {format_bytes(weights)}); over PCIe per step: {format_bytes(2 * offloaded)}")

# %% [markdown]
# The bytes are measured; the time they take depends on the machine's bus, so it is
# timed only on a real GPU, below.

# %% [markdown]
# `pin_memory=True` allocates the CPU copies in page-locked memory, which the GPU can
# copy to and from faster (and asynchronously); it is RAM the operating system cannot
# swap out, so the CPU needs that much free.
#
# **GPU only.** On a machine with CUDA, this cell times the real step with and without
# offloading (a CPU-only runner skips it):

# %% tags=["gpu-only", "nbval-ignore-output"]
if torch.cuda.is_available():
    import time
    def timed(offload, repeats=3):
        train_step(32, offload)                          # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            train_step(32, offload)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / repeats
    print(f"save_on_cpu step time / plain: {timed(True) / timed(False):.1f}x (wall time)")
else:
    print("skipped: no CUDA GPU on this machine")

# %% [markdown]
# ## Fact-check: "offloading activations to the CPU frees the GPU of them"
#
# **Holds:** the saved activations leave the GPU (the activations category is empty in
# the forward pass and through most of backward), and at a large batch the peak falls
# a lot.
#
# **Does not hold:** it frees the *saved* tensors only. Weights, gradients, optimizer
# state and each layer's temporaries stay, so the peak does not fall to zero and may not
# move at all if it is in the optimizer step. The CPU must hold all the activations,
# and the bus must carry them twice per step. Checkpointing (notebook 08) trades the
# same memory for compute instead of bandwidth; the two can be combined.
#
# ## What we measured

# %%
print(f"{'':<24}{'GPU peak':>11}{'CPU peak':>11}")
for (b, offload), r in runs.items():
    name = f"batch {b}, {'save_on_cpu' if offload else 'plain'}"
    print(f"{name:<24}{format_bytes(r.peak):>11}{format_bytes(r.host_peak):>11}")
