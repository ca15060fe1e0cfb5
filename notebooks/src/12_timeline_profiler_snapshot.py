# %% [markdown]
# # Memory over time: the timeline, `torch.profiler` and PyTorch's snapshot viewer
#
# A report gives the peak. To see *how* memory rises and falls through a training
# step — the forward pass filling up with saved activations, backward handing them
# back while gradients appear, the optimizer's temporaries on top — you want a
# timeline. Three tools draw one:
#
# * memmagic's timeline (`--timeline`, or `timeline_chart(report)`), by category and phase;
# * `torch.profiler` with `profile_memory=True`, which logs every allocation and free;
# * PyTorch's memory snapshot viewer (https://pytorch.org/memory_viz), which draws the
#   caching allocator's history from a pickle file.
#
# **You will learn** to read a step's memory over time, to find which module and
# which phase make the peak, and to check one tool against another.

# %%
# %load_ext memmagic
# %matplotlib inline
import torch
from torch import nn
import matplotlib.pyplot as plt
torch.manual_seed(0)
from memmagic import format_bytes

# %% [markdown]
# ## One real step on the CPU, measured op by op
#
# The zoo's small transformer (2 blocks, d=256, sequence 128, batch 8) trains one
# AdamW step for real on the CPU. `-v step` keeps the report.

# %%
from memmagic import zoo
model, batch = zoo.build("transformer")
opt = torch.optim.AdamW(model.parameters())

# %%
# %%gpumem --backend cpu -q -v step
loss = model.loss(*batch)
loss.backward()
opt.step()
opt.zero_grad(set_to_none=True)

# %%
print(step)
print("peak reached", step.peak_words)

# %% [markdown]
# ## The timeline
#
# Live bytes by category against the op index. Shaded bands mark the phases:
# forward, backward, the optimizer step. Watch the green activations grow through
# the forward pass and fall through backward while the gradients (orange) appear.

# %%
from memmagic.charts.plots import timeline_chart
timeline_chart(step)

# %% [markdown]
# The same record gives a per-module table: which block saved how much for backward.
# `modules_at(depth)` sums it at a depth of the module tree; the rows add up to the
# `activations` category at the peak.

# %%
for row in step.modules_at(3):
    if row.activations_max:
        print(f"{row.module:<22} saved at most {format_bytes(row.activations_max):>11}")

# %% [markdown]
# ## The same step under `torch.profiler`
#
# The profiler logs an event for every allocation and free (`profile_memory=True`)
# and adds them up per op: `self_cpu_memory_usage` is what an op allocated minus
# what it freed itself. Its table names the ops that allocated most (we print only
# the memory columns: the times change from run to run).

# %%
import os
from contextlib import contextmanager
from torch.profiler import profile, ProfilerActivity

@contextmanager
def quiet_stderr():
    """The profiler's C++ library logs start/stop lines to stderr: drop them."""
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved), os.close(null)

with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    loss = model.loss(*batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

ops = sorted(prof.key_averages(), key=lambda e: (-e.self_cpu_memory_usage, e.key))
print(f"{'op':<34}{'calls':>6}{'self memory':>14}")
for e in ops[:6]:
    print(f"{e.key:<34}{e.count:>6}{format_bytes(e.self_cpu_memory_usage):>14}")

# %% [markdown]
# Compare with memmagic's view of the same step: which ops made the storages that
# were live at the peak, by category.

# %%
from collections import Counter
at_peak = Counter()
for storage, category in step.trace.live_at():  # the storages live at the peak
    op = (storage.op_name or "before the step").split(".")[0]
    at_peak[(op, category)] += storage.nbytes
for (op, category), nbytes in at_peak.most_common(6):
    print(f"{op:<22}{category:<17}{format_bytes(nbytes):>12}")

# %% [markdown]
# Both count the same tensor allocations (memmagic's benchmarks check the peaks agree
# to within 0.01% on these models; the profiler also sees scratch buffers some CPU
# kernels allocate inside themselves, which no per-op tracker can see). What the
# profiler's table does not say is *what* the memory was for, or when it was live
# together: which bytes were gradients or saved activations at the peak. That is
# the part memmagic's trace adds.
#
# ## PyTorch's snapshot viewer
#
# On a GPU, `torch.cuda.memory._record_memory_history()` records the caching
# allocator's history and `torch.cuda.memory._dump_snapshot("file.pickle")` writes
# it; dropping the file on https://pytorch.org/memory_viz draws every block over
# time, with the Python stack that allocated it. memmagic writes the same file
# format from a simulated run, with the simulated allocator's segments and
# addresses, so you can explore it without a GPU.

# %%
# %%gpumem --backend sim --gpu T4 -q -v sim_step
model, _ = zoo.build("transformer", device="cuda")
opt = torch.optim.AdamW(model.parameters())
tokens = torch.randint(0, 1000, (8, 128), device="cuda")
loss = model.loss(tokens, tokens)
loss.backward()
opt.step()

# %%
from memmagic.core.snapshot import write_snapshot, snapshot_dict
path = write_snapshot(sim_step, "transformer_step.pickle")
snap = snapshot_dict(sim_step)
events = snap["device_traces"][0]
print(f"wrote {path}: {len(snap['segments'])} segments, {len(events)} events")
print("kinds of event:", sorted({e['action'] for e in events}))

# %% [markdown]
# PyTorch's own snippet for this also runs as written on the simulated GPU: there
# `_record_memory_history()` and `_dump_snapshot()` record and write the simulated
# allocator's history (and `memory_summary()`, `memory_stats()` read its counters):

# %%
# %%gpumem --backend sim --gpu T4 -q
torch.cuda.memory._record_memory_history(max_entries=100_000)
model, _ = zoo.build("transformer", device="cuda")
opt = torch.optim.AdamW(model.parameters())
tokens = torch.randint(0, 1000, (8, 128), device="cuda")
model.loss(tokens, tokens).backward()
opt.step()
torch.cuda.memory._dump_snapshot("snippet_step.pickle")
torch.cuda.memory._record_memory_history(None)

# %%
import pickle
with open("snippet_step.pickle", "rb") as f:
    snippet = pickle.load(f)
def allocations(s):
    return sum(e["action"] == "alloc" for e in s["device_traces"][0])
print("allocations recorded by the snippet:", allocations(snippet))
print("allocations in memmagic's file:     ", allocations(snap))
workspaces = sum(e["action"] == "alloc" and e.get("category") == "workspaces"
                 for e in snap["device_traces"][0])
print("of which cuBLAS workspaces:         ", workspaces)

# %% [markdown]
# The same step, the same allocations, but for the cuBLAS workspaces: the first
# cell on this simulated GPU made them (the main thread's cuBLAS and cuBLASLt
# workspaces and the backward thread's), and as on a GPU they stay for the life of
# the process, so the second run did not allocate them again.

# %% [markdown]
# Drag `transformer_step.pickle` onto https://pytorch.org/memory_viz ("Active Memory
# Timeline"). Each allocation's "stack" says the module, the phase and the op that
# made it. The viewer and memmagic's timeline draw the same history:

# %%
timeline_chart(sim_step)

# %% tags=["gpu-only", "nbval-ignore-output"]
# On a real GPU only: the allocator's own history, for the same viewer.
if torch.cuda.is_available():
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    model, _ = zoo.build("transformer", device="cuda")
    opt = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, 1000, (8, 128), device="cuda")
    model.loss(tokens, tokens).backward()
    opt.step()
    torch.cuda.memory._dump_snapshot("real_step.pickle")
    torch.cuda.memory._record_memory_history(None)
    print("wrote real_step.pickle")
else:
    print("no GPU here: this cell records the real allocator on a GPU machine")

# %% [markdown]
# ## What we measured

# %%
print(f"{'':<34}{'bytes':>12}")
print(f"{'CPU step, memmagic increment':<34}{format_bytes(step.increment):>12}")
print(f"{'CPU step, profiler: top op':<34}{format_bytes(ops[0].self_cpu_memory_usage):>12}")
print(f"{'simulated T4 step, peak':<34}{format_bytes(sim_step.peak):>12}")
print(f"{'simulated T4 step, reserved':<34}{format_bytes(sim_step.reserved_peak):>12}")
print("CPU step's peak:", step.peak_words)
print("T4 step's peak: ", sim_step.peak_words)
