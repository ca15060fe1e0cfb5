# %% [markdown]
# # 08 · Activation checkpointing
#
# Checkpointing trades compute for memory: a checkpointed block keeps only its input
# during the forward pass and runs its forward again during backward to get the
# activations back. In this notebook you will:
#
# - measure the activations and the peak of a 16-block network with no checkpointing,
#   with `checkpoint` on every block, and with `checkpoint_sequential` at several
#   segment counts, on a simulated A100;
# - see where the O(√n) rule comes from, when it holds and when it does not;
# - see why `use_reentrant=False` is the one to use;
# - count the extra compute (FLOPs) and time it on the CPU.

# %%
# %load_ext memmagic
# %matplotlib inline
import torch
from torch import nn
import matplotlib.pyplot as plt
torch.manual_seed(0)
from memmagic import format_bytes

# %%
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

def make_blocks(n=16, d=1024):
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.LayerNorm(d))
                           for _ in range(n)])

def step(how, segments=4):
    stem, blocks = nn.Linear(1024, 1024).cuda(), make_blocks().cuda()
    h = stem(torch.randn(16, 256, 1024, device="cuda"))   # from here on, h requires grad
    if how == "none":
        out = blocks(h)
    elif how == "sequential":
        out = checkpoint_sequential(blocks, segments, h, use_reentrant=False)
    else:
        for block in blocks:
            h = checkpoint(block, h, use_reentrant=(how == "each block, reentrant"))
        out = h
    out.square().mean().backward()


# %% [markdown]
# Each variant on a fresh simulated A100 (`memmagic.measure`, as in notebook 03):

# %%
import memmagic
def measure(how, segments=4):
    return memmagic.measure(lambda: step(how, segments), backend="sim", gpu="A100-40GB")

runs = {"none": measure("none"), "each block": measure("each block"),
        "each block, reentrant": measure("each block, reentrant")}
for name, r in runs.items():
    print(f"{name:<22} peak {format_bytes(r.peak):>10}   activations at the peak {format_bytes(r.breakdown['activations']):>10}")

# %% [markdown]
# ## Fact-check: "checkpointing cuts activation memory by 70%"

# %%
none, each = runs["none"], runs["each block"]
print(f"activations at the peak: {1 - each.breakdown['activations'] / none.breakdown['activations']:.0%} less")
print(f"peak:                    {1 - each.peak / none.peak:.0%} less")
print(f"where the peak is now:   {each.peak_words}")


# %% [markdown]
# The saving depends on the block: a checkpointed block keeps its *input* (1024 numbers
# per token here) instead of everything its layers save (the 4096-wide hidden layer,
# the GELU's input, the LayerNorm's input and statistics). The wider the inside of a
# block compared with its input, the bigger the saving, so any fixed percentage is
# folklore. The peak falls by less than the activations: weights, gradients, and the
# one block being recomputed in backward remain.
#
# ## `checkpoint_sequential` and the O(√n) rule
#
# `checkpoint_sequential(layers, segments, x)` splits the layers into `segments` runs and
# checkpoints each run but the last. During backward it holds every segment boundary,
# plus the activations of one segment (the last one, stored normally, or one being
# recomputed). With `n` layers whose boundary costs as much as what a layer saves,
# that is `segments + n / segments` layers' worth, lowest at `segments = √n`: the
# O(√n) rule.
#
# Two networks, each over its own range of segment counts: the 16 wide blocks above, and
# a chain of 64 thin layers (`Linear(512, 512)` + ReLU), where a boundary costs as much
# as a layer saves.

# %%
def chain_step(segments, n=64):
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(n)]).cuda()
    h = nn.Linear(512, 512).cuda()(torch.randn(64, 256, 512, device="cuda"))
    out = checkpoint_sequential(layers, segments, h, use_reentrant=False)
    out.square().mean().backward()

blocks16 = {s: measure("sequential", s) for s in [1, 2, 4, 8, 16]}
chain64 = {s: memmagic.measure(lambda: chain_step(s), backend="sim", gpu="A100-40GB")
           for s in [1, 2, 4, 8, 16, 32, 64]}
for name, sweep in [("16 wide blocks", blocks16), ("64 thin layers", chain64)]:
    best = min(sweep, key=lambda s: sweep[s].peak)
    print(f"{name}: lowest peak at {best} segments; " +
          ", ".join(f"{s}: {format_bytes(r.peak)}" for s, r in sweep.items()))

# %%
fig, ax = plt.subplots(figsize=(7, 3.5))
for name, sweep in [("16 wide blocks", blocks16), ("64 thin layers", chain64)]:
    counts = list(sweep)
    ax.plot(counts, [sweep[s].peak / sweep[1].peak for s in counts], "o-", label=name)
ax.set_xscale("log", base=2)
ax.set_xticks(list(chain64), list(chain64))
ax.set_xlabel("segments")
ax.set_ylabel("peak / peak without checkpointing")
ax.legend()
plt.show()

# %% [markdown]
# Read the chart for three things:
#
# - `segments=1` is *no* checkpointing: the last segment is never checkpointed, and with
#   one segment that is all of them;
# - the thin chain follows the O(√n) rule: its minimum is at √64 = 8, and more segments
#   make it worse again (too many boundaries to hold);
# - the wide blocks do not: a boundary (1024 numbers per token) is small next to what a
#   block saves inside, so more segments keep helping, and checkpointing every block
#   on its own is best.
#
# ## Reentrant or not
#
# `use_reentrant=True` is the older implementation. Its peak here, next to the
# non-reentrant one:

# %%
reentrant = runs["each block, reentrant"]
print(f"reentrant: {format_bytes(reentrant.peak)}, non-reentrant: {format_bytes(each.peak)} "
      f"({format_bytes(reentrant.peak - each.peak, signed=True)})")

# %% [markdown]
# Close; its real pitfall is elsewhere: when no *input* of the checkpointed function requires grad, it
# records no graph at all, so the parameters inside get no gradient. A real run on the CPU:

# %%
import warnings
for reentrant in [True, False]:
    block = nn.Linear(8, 8)
    data = torch.randn(4, 8)   # plain data: requires_grad is False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = checkpoint(block, data, use_reentrant=reentrant)
    said = f" (warning: {caught[0].message})" if caught else ""
    print(f"use_reentrant={reentrant}: output requires grad: {out.requires_grad}{said}")

# %% [markdown]
# With the reentrant version, checkpointing the first layer of a network (whose input
# is the data) silently freezes it. `use_reentrant=False` also supports
# `torch.autograd.grad`, keyword arguments and nested checkpoints, and PyTorch asks you
# to choose explicitly: pass `use_reentrant=False` unless you know why not.
#
# ## What it costs: compute
#
# Every checkpointed block runs its forward twice. A forward pass is roughly a third
# of a training step's arithmetic (backward is about twice the forward), so expect about
# a third more. `FlopCounterMode` counts the floating-point operations exactly, on a
# smaller copy of the network run for real on the CPU:

# %%
from torch.utils.flop_counter import FlopCounterMode

small = make_blocks(n=4, d=256)
x_small = torch.randn(8, 128, 256, requires_grad=True)

def cpu_step(checkpointed):
    h = x_small
    for block in small:
        h = checkpoint(block, h, use_reentrant=False) if checkpointed else block(h)
    h.square().mean().backward()

flops = {}
for checkpointed in [False, True]:
    with FlopCounterMode(display=False) as counter:
        cpu_step(checkpointed)
    flops[checkpointed] = counter.get_total_flops()
print(f"GFLOPs per step: {flops[False] / 1e9:.2f} -> {flops[True] / 1e9:.2f} with checkpointing "
      f"({flops[True] / flops[False]:.2f}x)")

# %% [markdown]
# And the wall time of the same steps (best of five each, on one CPU thread, which is
# steadier on a shared machine). Timings vary from machine to machine and run to run, so
# this ratio is shown but not checked by the notebook tests.

# %%
import time

def best_time(fn, repeats=5):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)

torch.set_num_threads(1)
ratio = best_time(lambda: cpu_step(True)) / best_time(lambda: cpu_step(False))
print(f"step time with checkpointing / without: {ratio:.1f}x (wall time)")

# %% [markdown]
# ## What we measured

# %%
table = {**runs, **{f"16 blocks, {s} segments": r for s, r in blocks16.items()},
         "64 layers, no checkpoint": chain64[1], "64 layers, 8 segments": chain64[8]}
print(f"{'':<26}{'peak':>11}{'activations':>13}")
for name, r in table.items():
    print(f"{name:<26}{format_bytes(r.peak):>11}{format_bytes(r.breakdown['activations']):>13}")
print(f"extra compute with checkpointing: {flops[True] / flops[False] - 1:+.0%} FLOPs")
