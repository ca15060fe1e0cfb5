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
# largest batch that fits with a safety margin, why a margin is needed, and, for a
# language model, which pairs of batch size and context length fit (the fit map).

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
# (10% by default) and says how it searched. On the simulated GPU it needs few runs: once
# two batches made the same allocations, each allocation's size lies on a line through
# theirs, and replaying the allocator at the sizes the line gives names the largest batch
# that fits. That batch and the one after it are then run: the answer is theirs.

# %%
found = find_batch_size(cell, margin=0.10)
print(found.how)

# %%
tight = find_batch_size(cell, margin=0.0)
print(f"largest batch with no margin: {tight.batch_size}, with 10%: {found.batch_size}")

# %% [markdown]
# ## Batch and context together: the fit map
#
# A language model's step has two sizes: how many sequences (the batch) and how long
# each is (the context). Its memory is a polynomial in the two: the weights, gradients
# and optimizer state are constants, most activations grow with batch x context, and
# attention's scores (where the kernel keeps them) with batch x context². So four runs on
# a 2 x 2 grid of sizes (six on a 2 x 3 grid where scores grow with the context²) fix
# every allocation's size at *every* pair, and the simulated allocator replays them for
# each pair instead of running the model again. `fit_map` does that, checks the result
# against real runs of the cell (at the far corner, and at the boundary it found), and
# falls back to running pair by pair where a check fails (a kernel that rounds its sizes
# down, a path that changes with size).

# %%
from memmagic import fit_map

LM_STEP = """
from transformers import GPT2Config, GPT2LMHeadModel
lm = GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=512, n_head=8, vocab_size=16384,
                                n_positions=2048, bos_token_id=0, eos_token_id=0,
                                loss_type="ForCausalLM")).cuda()
lm_opt = torch.optim.AdamW(lm.parameters())
ids = torch.randint(0, 16384, (batch_size, seq_len), device="cuda")
lm(ids, labels=ids).loss.backward()
lm_opt.step()
"""
lm_cell = Cell(LM_STEP, globals(), backend="sim", backend_options={"gpu": "T4"},
               defaults={"batch_size": 8, "seq_len": 512})
fm = fit_map(lm_cell, batch=(1, 64), seq=(128, 2048))
print(fm.method, "-", fm.source)
print(f"{fm.runs} runs for {len(fm.seqs)} contexts x every batch from 1 to 64")
for s in (128, 256, 512, 1024, 2048):
    print(f"context {s:>4}: the largest batch that fits is {fm.largest_batch(s)}")

# %%
fm.chart()

# %% [markdown]
# Past the contexts where every batch fits, the boundary follows a constant number of
# tokens per step: 51 x 512, 25 x 1024 and 12 x 2048 are all about 25,000 tokens. Here the
# activations and the logits (batch x context x vocabulary) grow with the tokens, and the
# attention kernel a T4 runs keeps no context x context scores; the weights and AdamW's
# state are the same at every pair. Halving the context doubles the batch. The checks are
# runs of the cell on the T4 itself; each says whether that pair fits:

# %%
for b, s, ok in fm.checks:
    print(f"run at batch {b:>2}, context {s:>4}: {'fits' if ok else 'does not fit'}")

# %% [markdown]
# ## Fact-check: "just double the batch until it crashes"
#
# Doubling finds a power of two; the largest batch that fits lies between the last
# success and the first failure, and bisection finds it in a few more runs (by real
# trials there is no line to read: each size is a run). On a real GPU each failed trial leaves cached blocks behind, so a finder must empty
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
print(f"fit map on the T4: batch {fm.largest_batch(512)} at context 512, "
      f"{fm.largest_batch(2048)} at 2048 ({fm.runs} runs)")
