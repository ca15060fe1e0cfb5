# %% [markdown]
# # 10 · Leaks in training loops
#
# Memory that grows step after step, or that will not go away after `del`, is usually a
# reference someone still holds. In this notebook you will measure:
#
# - `epoch_loss += loss` against `epoch_loss += loss.item()`, in a training loop and in
#   an evaluation loop;
# - outputs kept in a list, and in Jupyter's own `Out` history;
# - `del` and `gc.collect()` on an object that refers to itself;
# - what `torch.cuda.empty_cache()` frees, and what it does not.

# %%
# %load_ext memmagic
# %matplotlib inline
import torch
from torch import nn
import matplotlib.pyplot as plt
torch.manual_seed(0)
from memmagic import format_bytes


# %% [markdown]
# Two loops over one batch: `train` takes optimizer steps, `evaluate` only computes the
# loss (and forgets `torch.no_grad()`). `keep` says how the running total is kept.

# %%
def train(steps, keep):
    total = 0
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += loss if keep == "tensor" else loss.item()
    return total

def evaluate(steps, keep):   # note: no torch.no_grad()
    total = 0
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        total += loss if keep == "tensor" else loss.item()
    return total


# %% [markdown]
# A small classifier, its optimizer and one batch go on the notebook's simulated T4,
# where they stay (as on a real GPU) for the cells below. One training step first, so
# that the gradients and the cuBLAS workspaces exist before anything is measured.

# %%
# %%gpumem --backend sim --gpu T4 -q
model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(512, 1024, device="cuda")
y = torch.randint(10, (512,), device="cuda")
train(1, "item")

# %% [markdown]
# ## `epoch_loss += loss`
#
# `loss` is a tensor with a graph behind it. Adding it to a running total builds a new
# graph that links every step's loss. `retained` is what a cell left on the GPU.

# %%
leaks = {}
for loop in [train, evaluate]:
    for keep in ["tensor", "item"]:
        leaks[loop.__name__, keep] = %gpumem --backend sim --gpu T4 -q -o epoch_loss = loop(20, keep)
        del epoch_loss
for (loop, keep), r in leaks.items():
    how = "total += loss       " if keep == "tensor" else "total += loss.item()"
    print(f"{loop:<8} 20 steps, {how}: the total holds {format_bytes(r.retained):>11}")


# %% [markdown]
# - In the **training** loop the GPU keeps only the total itself, one scalar:
#   `backward()` already freed the tensors each step's graph had saved. What does pile
#   up is the graph's bookkeeping (a few autograd nodes per step, in CPU memory), until
#   the total is dropped.
# - In the **evaluation** loop there is no `backward()`: each step's whole graph, with
#   every activation it saved, stays alive until the total is dropped. That is the leak
#   people hit. `loss.item()` (or `torch.no_grad()`, notebook 06) fixes both.
#
# (`.item()` copies the value to the CPU, and waits for the GPU to get there: call it
# every few steps if that wait matters.)
#
# ## Outputs kept in a list
#
# Keeping outputs for later (to compute a metric at the end of the epoch) keeps their
# graphs too, unless they are detached:

# %%
def collect(steps, detach):
    outputs = []
    for _ in range(steps):
        out = model(x)
        outputs.append(out.detach() if detach else out)
    return outputs

kept = {}
for detach in [False, True]:
    kept[detach] = %gpumem --backend sim --gpu T4 -q -o outputs = collect(20, detach)
    del outputs
print(f"20 outputs kept as they are: {format_bytes(kept[False].retained)}")
print(f"20 outputs kept detached:    {format_bytes(kept[True].retained)}")

# %% [markdown]
# ## Jupyter's `Out` keeps what a cell showed
#
# A cell whose last line is an expression shows its value, and IPython keeps that value
# in `Out[n]`, `_` and `_n`. If the value is a tensor with a graph, the graph stays
# too. This part runs for real on the CPU (`--backend cpu` counts every tensor the
# notebook can still reach, `Out` included):

# %%
torch.manual_seed(0)
layer = nn.Linear(2000, 2000)
data = torch.randn(1000, 2000)

# %%
# %%gpumem --backend cpu -q -v before_show
pass

# %%
layer(data).relu().mean()   # shown, so kept in Out, with its graph

# %%
# %%gpumem --backend cpu -q -v after_show
pass

# %%
print(f"showing one value kept {format_bytes(after_show.before - before_show.before)} alive "
      f"(the ReLU's saved output alone is {format_bytes(1000 * 2000 * 4)})")

# %% [markdown]
# Ending such a line with `;` shows nothing and keeps nothing. To drop what was already
# shown, `%reset -f out` empties `Out` and the numbered `_` variables. (Tools that run
# notebooks may keep the value elsewhere: nbval, which tests these notebooks, runs cells
# without history, so a shown value lands in `_0`, and `;` does not hide it there.)

# %% [markdown]
# ## `del` and `gc.collect()`
#
# `del name` removes a name; the object goes when its last reference does. An object
# that refers to itself (a cycle) is only freed by Python's cycle collector, which runs
# from time to time, or at once with `gc.collect()`:

# %%
# %%gpumem --backend sim --gpu T4 -q
import gc

class Holder:
    def __init__(self):
        self.buffer = torch.empty(256, 2**20, dtype=torch.uint8, device="cuda")  # 256 MiB
        self.me = self                                                        # a cycle

before = torch.cuda.memory_allocated()
holder = Holder()
del holder
print("after del:         ", format_bytes(torch.cuda.memory_allocated() - before, signed=True))
gc.collect()
print("after gc.collect():", format_bytes(torch.cuda.memory_allocated() - before, signed=True))


# %% [markdown]
# Cycles are common: an exception's traceback refers to the frames that hold your
# tensors (Jupyter keeps the last one in `sys.last_traceback`), closures, objects with
# back-references. `gc.collect()` is worth a try when memory does not come back after
# `del`.
#
# ## What `torch.cuda.empty_cache()` frees
#
# PyTorch's caching allocator keeps freed GPU memory **reserved** for the next tensors
# instead of returning it to the driver (notebook 11). `empty_cache()` returns the
# cached blocks that hold no tensor. It does not free any tensor you still hold:

# %%
# %%gpumem --backend sim --gpu T4 -q
def show(when):
    print(f"{when:<28} allocated {format_bytes(torch.cuda.memory_allocated()):>11}, "
          f"reserved {format_bytes(torch.cuda.memory_reserved()):>11}")

del model, opt, x, y            # everything from the start of the notebook
torch.cuda.empty_cache()
show("start")
a = torch.empty(512, 2**20, dtype=torch.uint8, device="cuda")
b = torch.empty(512, 2**20, dtype=torch.uint8, device="cuda")
show("two 512 MiB tensors")
del a
show("del a")
torch.cuda.empty_cache()
show("empty_cache()")
del b
show("del b")
torch.cuda.empty_cache()
show("empty_cache()")

# %% [markdown]
# After `del a` its memory is free *for PyTorch* (the next tensor reuses it) but still
# reserved, which is what `nvidia-smi` and other processes see. `empty_cache()` gave that
# back, and could not touch `b`, which was still referenced.
#
# ## Fact-checks
#
# - **"`epoch_loss += loss` leaks memory"**: in an evaluation loop without `no_grad()`,
#   badly, a whole graph per step; in a training loop, not on the GPU (one scalar, measured
#   above), only the graph's nodes in CPU memory.
# - **"`empty_cache()` frees memory"**: it frees *cached* memory, which your own process
#   would have reused anyway. It helps other processes on the same GPU, and it makes
#   `nvidia-smi` agree with `memory_allocated()`. It never frees a tensor that is still
#   referenced; for that, find the reference (`del`, `gc.collect()`, `%reset -f out`).
#
# ## What we measured

# %%
rows = [(f"{loop}, total += {'loss' if keep == 'tensor' else 'loss.item()'}", r.retained)
        for (loop, keep), r in leaks.items()]
rows += [("20 outputs, kept", kept[False].retained), ("20 outputs, detached", kept[True].retained),
         ("a tensor shown in Out", after_show.before - before_show.before)]
for name, nbytes in rows:
    print(f"{name:<32}{format_bytes(nbytes):>12}")

# %%
fig, ax = plt.subplots(figsize=(7, 3))
ax.barh([name for name, _ in rows], [max(nbytes, 1) for _, nbytes in rows], color="C3")
ax.set_xscale("log")
ax.invert_yaxis()
ax.set_xlabel("bytes left on the GPU (log scale)")
ax.set_title("What each habit leaves behind")
plt.show()
