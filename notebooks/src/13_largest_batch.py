# %% [markdown]
# # The largest batch that fits a card
#
# "What batch size can I use on a T4?" is the first question of every project. The
# usual answer is trial and error on the GPU (Lightning's `BatchSizeFinder`,
# accelerate's `find_executable_batch_size`): double the batch until it runs out
# of memory, then back off. On the simulated GPU the same search takes seconds,
# needs no GPU, and shows *why* each size fails.
#
# **You will learn** to sweep the batch size for several strategies, to find the
# largest batch that fits with a safety margin, and why a margin is needed.

# %%
# %load_ext memmagic
# %matplotlib inline
import torch
from torch import nn
import matplotlib.pyplot as plt
torch.manual_seed(0)
from memmagic import format_bytes

# %% [markdown]
# ## A cell that reads its batch size
#
# memmagic's what-if engine re-runs a cell's code with knobs. A cell that reads the
# plain variable `batch_size` receives each value tried. The cell trains one AdamW
# step of the zoo's small transformer on a simulated T4.

# %%
from memmagic import zoo
from memmagic.whatif import Cell
from memmagic.whatif import sweep, find_batch_size

STEP = """
model, _ = zoo.build("transformer", device="cuda")
opt = torch.optim.AdamW(model.parameters())
tokens = torch.randint(0, 1000, (batch_size, 128), device="cuda")
loss = model.loss(tokens, tokens)
loss.backward()
opt.step()
"""
cell = Cell(STEP, globals(), backend="sim", backend_options={"gpu": "T4"},
            defaults={"batch_size": 8})
print(cell.run())

# %% [markdown]
# ## Sweep the batch size, for four strategies
#
# `sweep` runs the cell for each batch size under each combination of AMP and
# activation checkpointing, and marks the largest batch that fits the card.

# %%
result = sweep(cell, "batch_size", [64, 256, 1024, 2048, 4096, 8192])
for strategy, largest in result.largest_fitting().items():
    print(f"{strategy:<18} largest that fits: {largest}")

# %%
result.chart()

# %% [markdown]
# Memory grows almost linearly with the batch here: activations dominate. A strategy
# that cuts activations moves the whole line down, so the same card fits a larger
# batch; one that does not (read the chart: which lines coincide?) buys nothing for
# this model on this card. The what-if notes on each report say what was applied.
#
# ## The largest batch, with a safety margin
#
# A batch whose simulated peak is exactly the card's size will not fit in practice.
# The CUDA context (a published figure of about 400 MB, named in the report's notes)
# is already counted: each run must fit beside it. Other processes and fragmentation
# that grows over a long run take their share too, so `find_batch_size` keeps a margin
# (10% by default) and says how it searched.

# %%
found = find_batch_size(cell, margin=0.10)
print(found.how)

# %%
tight = find_batch_size(cell, margin=0.0)
print(f"largest batch with no margin: {tight.batch_size}, with 10%: {found.batch_size}")

# %% [markdown]
# ## Fact-check: "just double the batch until it crashes"
#
# Doubling finds a power of two; the largest batch that fits lies between the last
# success and the first failure, and bisection finds it in a few more runs. On a
# real GPU each failed trial leaves cached blocks behind, so a finder must empty
# the cache after every trial (memmagic's `method="trials"` does), or later trials
# fail for the wrong reason.

# %% tags=["gpu-only", "nbval-ignore-output"]
# On a real GPU only: the same search by real trials.
if torch.cuda.is_available():
    real = Cell(STEP, globals(), backend="cuda", defaults={"batch_size": 8})
    print(find_batch_size(real, method="trials", margin=0.10).how)
else:
    print("no GPU here: method='trials' runs real steps on a GPU machine")

# %% [markdown]
# ## What we measured

# %%
for strategy, largest in result.largest_fitting().items():
    print(f"{strategy:<18} fits up to batch {largest} of those tried")
print(f"largest batch with a 10% margin (fp32): {found.batch_size}; with none: {tight.batch_size}")
