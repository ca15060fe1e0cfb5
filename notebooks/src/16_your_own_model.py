# %% [markdown]
# # Your own model
#
# A template: replace the model, the batch and the card with yours, run all, and
# read what would happen on that GPU, and which strategy would make it fit. It runs
# on the simulated GPU, so you need no GPU to try a model that would not fit yours.
#
# **You will learn** to go from "CUDA out of memory" to a measured plan.

# %%
# %load_ext memmagic
# %matplotlib inline
import torch
from torch import nn
import matplotlib.pyplot as plt
torch.manual_seed(0)
from memmagic import format_bytes

# %% [markdown]
# ## 1. Your model and batch
#
# Build the model as your code does (here a small GPT-2 from a `transformers`
# config; any `nn.Module` works), on `device="cuda"`: in a simulated cell that is the
# simulated GPU.

# %%
GPU = "T4"           # the card you want to train on: T4, A10G, A100-40GB, RTX4090, ...
batch_size = 8
seq_len = 512

# %%
# %%gpumem --backend sim --gpu $GPU -v report --timeline
from transformers import GPT2Config, GPT2LMHeadModel
config = GPT2Config(n_layer=6, n_embd=512, n_head=8, n_positions=1024, vocab_size=50257)
model = GPT2LMHeadModel(config).to("cuda")
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), device="cuda")
loss = model(input_ids=ids, labels=ids).loss
loss.backward()
opt.step()
opt.zero_grad(set_to_none=True)

# %% [markdown]
# ## 2. Where does the memory go?
#
# The report above gives the breakdown at the peak and the timeline shows when.
# Which modules saved the most for backward:

# %%
for row in report.modules_at(3)[:6]:
    print(f"{row.module:<32}{format_bytes(row.activations):>12}  {row.share:6.1%} of the peak")

# %% [markdown]
# ## 3. Which strategy helps, and by how much?
#
# The same cell re-run with each knob, on the same card (`Cell` is the what-if
# engine under the panel). `STEP` is the cell above, as text.

# %%
from memmagic.whatif import Cell

STEP = """
from transformers import GPT2Config, GPT2LMHeadModel
config = GPT2Config(n_layer=6, n_embd=512, n_head=8, n_positions=1024, vocab_size=50257)
model = GPT2LMHeadModel(config).to("cuda")
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), device="cuda")
loss = model(input_ids=ids, labels=ids).loss
loss.backward()
opt.step()
opt.zero_grad(set_to_none=True)
"""
cell = Cell(STEP, globals(), backend="sim", backend_options={"gpu": GPU},
            defaults={"batch_size": batch_size})

# %%
for what, knobs in [("as written", {}), ("AMP fp16", {"amp": "fp16"}),
                    ("checkpointing", {"checkpointing": True}),
                    ("AMP fp16 + checkpointing", {"amp": "fp16", "checkpointing": True}),
                    ("half the batch", {"batch_size": batch_size // 2})]:
    r = cell.run(**knobs)
    verdict = "fits" if r.fits else "does not fit"
    print(f"{what:<26}{format_bytes(r.peak):>11}  reserved {format_bytes(r.reserved_peak):>11}  {verdict} {GPU}")

# %% [markdown]
# ## 4. The largest batch that fits
#
# Each run counts the CUDA context beside its reserved peak; a 10% margin on top is for
# fragmentation and other processes:

# %%
from memmagic.whatif import find_batch_size
print(find_batch_size(cell, margin=0.10, high=256).how)

# %% [markdown]
# ## What we measured
#
# Change the model, `GPU`, `batch_size` and `seq_len` at the top and run all again.

# %%
print(report)
print("peak:", report.peak_words)
