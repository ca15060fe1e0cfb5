# %% [markdown]
# # 11 · The caching allocator: allocated vs reserved
#
# PyTorch does not ask the CUDA driver for memory each time it makes a tensor. Its
# **caching allocator** takes large *segments* from the driver and cuts tensors out of
# them; a freed tensor's block goes back to PyTorch's cache, not to the driver. In this
# notebook you will:
#
# - watch **allocated** (bytes in live tensors) and **reserved** (bytes held from the
#   driver) move apart, on the notebook's simulated T4;
# - learn the rounding and segment rules that make them differ;
# - build a case of **fragmentation**: free memory that cannot be used;
# - see what `empty_cache()` can and cannot release, what `PYTORCH_CUDA_ALLOC_CONF` changes,
#   what `memory_summary()` shows, and the cuBLAS workspace that never goes away.

# %%
# %load_ext memmagic
# %matplotlib inline
import torch
from torch import nn
import matplotlib.pyplot as plt
torch.manual_seed(0)
from memmagic import format_bytes


# %% [markdown]
# Two helpers, written once here and used inside the simulated cells below (there,
# `torch.cuda` answers for the simulated GPU):

# %%
def alloc(mib):   # a tensor of `mib` MiB on the GPU (made of bytes, so the size is exact)
    return torch.empty(int(mib * 2**20), dtype=torch.uint8, device="cuda")

history = {}
def show(what):
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    history[what] = (allocated, reserved)
    print(f"{what:<34} allocated {format_bytes(allocated):>11}   reserved {format_bytes(reserved):>11}")


# %% [markdown]
# ## Rounding and segments
#
# The rules, from PyTorch's `CUDACachingAllocator.cpp` (default settings):
#
# | request | rounded to | comes from |
# |---|---|---|
# | any | a multiple of 512 bytes | |
# | up to 1 MiB | | the *small pool*: 2 MiB segments |
# | 1 to 10 MiB | | the *large pool*: 20 MiB segments |
# | 10 MiB or more | | a segment of its own size, rounded up to 2 MiB |
#
# A free block is reused for any request it can hold (best fit), and split if enough is
# left over. Watch a 1-byte tensor and two slightly-over-a-boundary ones:

# %%
# %%gpumem --backend sim --gpu T4 -q
tiny = alloc(1 / 2**20)
show("1 byte")
medium = alloc(1 + 1 / 2**20)
show("+ 1 MiB and 1 byte")
big = alloc(100 + 1 / 2**20)
show("+ 100 MiB and 1 byte")

# %% [markdown]
# One byte costs 512 bytes of *allocated* memory and a 2 MiB segment of *reserved*; just
# over 1 MiB takes a 20 MiB segment. Freeing does not return segments:

# %%
# %%gpumem --backend sim --gpu T4 -q
del tiny, medium, big
show("after del")
torch.cuda.empty_cache()
show("after empty_cache()")

# %% [markdown]
# ## Fragmentation
#
# Twenty tensors of 6 MiB (three fit in each 20 MiB segment), then every other one is
# freed: 60 MiB are free in the cache. A 12 MiB tensor still needs a new segment,
# because no free *contiguous* block is 12 MiB long:

# %%
# %%gpumem --backend sim --gpu T4 -q
blocks = [alloc(6) for _ in range(20)]
show("20 x 6 MiB")
del blocks[::2]
show("every other one freed")
twelve = alloc(12)
show("+ one 12 MiB tensor")
torch.cuda.empty_cache()
show("empty_cache()")

# %%
allocated, reserved = history["empty_cache()"]
print(f"{format_bytes(reserved - allocated)} reserved but not allocated: "
      f"{1 - allocated / reserved:.0%} of what PyTorch holds on the GPU, in pieces too small for the 12 MiB tensor")

# %% [markdown]
# `empty_cache()` released nothing this time: it only returns segments that are entirely
# free, and every segment still holds one of the remaining tensors.
#
# In training, fragmentation comes from tensors of many sizes being made and freed in
# turn (activations, gradients, temporaries). The sign: `reserved` well above
# `allocated`, and an out-of-memory error whose message says a lot is "reserved by
# PyTorch but unallocated".

# %%
names = list(history)
fig, ax = plt.subplots(figsize=(8, 3.5))
ax.bar(range(len(names)), [history[n][1] / 2**20 for n in names], color="#bbbbbb", label="reserved")
ax.bar(range(len(names)), [history[n][0] / 2**20 for n in names], color="C0", width=0.5, label="allocated")
ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
ax.set_ylabel("MiB")
ax.legend()
plt.show()

# %% [markdown]
# ## `PYTORCH_CUDA_ALLOC_CONF`
#
# An environment variable, read once when CUDA starts (set it before the first CUDA
# call, best before starting Python). Its main options:
#
# - `expandable_segments:True`: segments can grow in place (virtual memory mapping), so
#   blocks of different sizes end up adjacent instead of stranded in separate segments.
#   Usually the most effective cure for fragmentation.
# - `max_split_size_mb:N`: blocks larger than N MiB are never split, so large free
#   blocks stay whole for large requests (at the cost of more reserved memory).
# - `garbage_collection_threshold:0.8`: when reserved memory passes 80% of the card,
#   cached blocks are released proactively instead of only after a failed allocation.
#
# **What the simulator models:** 512-byte rounding, the two pools and their segment
# sizes, best-fit reuse, splitting and merging, `empty_cache()`, the release-and-retry
# before an out-of-memory error, and of the options above `max_split_size_mb` (with
# `max_non_split_rounding_mb`) and `garbage_collection_threshold` (which torch applies
# only once `torch.cuda.set_per_process_memory_fraction` is set), read from the
# environment when a simulated GPU is made. **It does not model** `expandable_segments`
# (a simulated cell run with it set says so in its notes), streams (each stream has its
# own cached blocks), CUDA graphs' private pools, the CUDA context (hundreds of MiB that
# `nvidia-smi` counts too), or other processes. The model follows the allocator's
# source code; in this project it has not yet been checked against a real GPU.
#
# Where `max_split_size_mb` helps: a 100 MiB tensor is freed, then a 30 MiB and an
# 85 MiB one are made. By default the 30 MiB tensor is cut out of the cached 100 MiB
# block, and the 85 MiB one no longer fits in the 70 MiB left: a new segment. With
# `max_split_size_mb:64` the 100 MiB block is never split for a smaller request, so it
# stays whole for the 85 MiB tensor. Each run below is on a fresh simulated T4 made
# with the setting (`memmagic.measure`):

# %%
import os
import memmagic

def mixed_sizes():
    big = alloc(100)
    del big
    a, b = alloc(30), alloc(85)

saved = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
try:
    for conf in ["", "max_split_size_mb:64"]:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
        r = memmagic.measure(mixed_sizes, backend="sim", gpu="T4")
        print(f"{conf or 'default':<22} allocated peak {format_bytes(r.peak)}, reserved peak {format_bytes(r.reserved_peak)}")
finally:
    if saved is None:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    else:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = saved

# %% [markdown]
# It does not help the fragmentation case above: those blocks are 6 MiB, below any
# allowed `max_split_size_mb` (at least 20). That is `expandable_segments`' job.
#
# **GPU only.** On a machine with CUDA, this cell runs both cases in fresh processes
# with three settings (a CPU-only runner skips it):

# %% tags=["gpu-only", "nbval-ignore-output"]
script = '''
import torch
def alloc(mib):
    return torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda")
blocks = [alloc(6) for _ in range(20)]
del blocks[::2]
twelve = alloc(12)
print("fragmentation:", torch.cuda.memory_allocated() // 2**20, "MiB allocated,", torch.cuda.memory_reserved() // 2**20, "MiB reserved")
del blocks, twelve
torch.cuda.empty_cache()
big = alloc(100)
del big
a, b = alloc(30), alloc(85)
print("mixed sizes:", torch.cuda.max_memory_reserved() // 2**20, "MiB reserved at the peak")
'''
if torch.cuda.is_available():
    import os, subprocess, sys, textwrap
    for conf in ["", "expandable_segments:True", "max_split_size_mb:64"]:
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf}
        run = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True)
        print(f"{conf or 'default':<26} {run.stdout.strip() or run.stderr.strip()[-200:]}")
else:
    print("skipped: no CUDA GPU on this machine")

# %% [markdown]
# ## `memory_summary()` and `memory_stats()`
#
# On a real GPU, `torch.cuda.memory_summary()` prints a table of allocated, active and
# reserved memory, split into the small and large pools, with counts of allocations,
# frees, segments and allocation retries (a retry means the allocator had to free its
# cache to satisfy a request: a sign you are close to the limit). On the simulated GPU
# it is the same table: torch's own code prints it from `memory_stats()`, which the
# simulated allocator keeps under the same keys. "Non-releasable memory" is the free
# space inside segments that still hold a live block: `empty_cache()` cannot give it
# back, and it is what fragmentation costs:

# %%
# %%gpumem --backend sim --gpu T4 -q
print(torch.cuda.memory_summary(abbreviated=True))
stats = torch.cuda.memory_stats()
print("non-releasable:", format_bytes(stats["inactive_split_bytes.all.current"]),
      "| cudaMalloc retries:", stats["num_alloc_retries"])

# %% [markdown]
# **GPU only.** The real table (a CPU-only runner skips it):

# %% tags=["gpu-only", "nbval-ignore-output"]
if torch.cuda.is_available():
    print(torch.cuda.memory_summary())
else:
    print("skipped: no CUDA GPU on this machine")

# %% [markdown]
# ## The cuBLAS workspace
#
# The first matrix multiply on a thread makes cuBLAS allocate a *workspace* through
# PyTorch's allocator (about 8 MiB by default, 32 MiB on H100; `CUBLAS_WORKSPACE_CONFIG`
# sets it), and it is kept for the life of the process. It shows in
# `memory_allocated()` even when every tensor is gone. Backward runs on a thread of its
# own, which gets a second one. Measured on the simulated T4, starting from an empty card:

# %%
# %gpusim reset

# %%
# %%gpumem --backend sim --gpu T4 -q -v first_matmul
a = torch.randn(64, 64, device="cuda", requires_grad=True)
(a @ a).sum().backward()
del a
show("after a matmul, a backward, del")

# %%
print("kept as workspaces:", format_bytes(first_matmul.breakdown["workspaces"]))
print("tensors left:      ", format_bytes(first_matmul.after - first_matmul.breakdown["workspaces"]))

# %% [markdown]
# Real GPU tools see the workspaces too: they are why a "clean" GPU after one training
# step still shows some megabytes allocated.
#
# ## Fact-check: "`nvidia-smi` shows how much memory my tensors use"
#
# It shows what the process holds from the driver: PyTorch's *reserved* memory (tensors,
# cached free blocks, fragmentation) plus the CUDA context. Measured above, reserved
# ran well above allocated: the gap is memory no tensor uses. `memory_allocated()` is
# what your tensors use; `memory_reserved()` is what PyTorch holds.
#
# ## What we measured

# %%
print(f"{'':<34}{'allocated':>12}{'reserved':>12}")
for what, (allocated, reserved) in history.items():
    print(f"{what:<34}{format_bytes(allocated):>12}{format_bytes(reserved):>12}")
