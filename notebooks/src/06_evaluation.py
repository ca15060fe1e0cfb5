# %% [markdown]
# # 06 · Evaluation: `model.eval()`, `torch.no_grad()`, `torch.inference_mode()`
#
# Three switches are used when a model is evaluated, and they are often confused. In
# this notebook you will:
#
# - measure one forward pass of a transformer four ways on a simulated T4: training mode,
#   `model.eval()`, `eval()` + `no_grad()`, `eval()` + `inference_mode()`;
# - see which switch saves memory, and why `model.eval()` alone does not;
# - see what `inference_mode()` forbids that `no_grad()` allows;
# - measure the classic validation-loop leak: predictions kept with their graphs.

# %%
# %load_ext memmagic
# %matplotlib inline
import torch
from torch import nn
import matplotlib.pyplot as plt
torch.manual_seed(0)
from memmagic import format_bytes

# %% [markdown]
# `model.eval()` changes how some layers *compute* (dropout stops dropping, batch norm
# uses its running statistics). Whether autograd records a graph and saves activations
# is decided by the grad mode: `torch.no_grad()` or `torch.inference_mode()` turn it off.
#
# The model: the transformer encoder of notebook 05 (it has dropout), a batch of 64
# sequences of 256 tokens. Model and batch go on the notebook's simulated T4 first.

# %%
# %%gpumem --backend sim --gpu T4 -q -v built
layer = nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, batch_first=True)
model = nn.TransformerEncoder(layer, num_layers=4).cuda()
x = torch.randn(64, 256, 512, device="cuda")

# %% [markdown]
# Each of the next cells runs one forward pass and then drops the output. `increment`
# is how far the cell's peak rose above what was already on the card.

# %%
# %%gpumem --backend sim --gpu T4 -q -v train_mode
model.train()
out = model(x)
del out

# %%
# %%gpumem --backend sim --gpu T4 -q -v eval_mode
model.eval()
out = model(x)
del out

# %%
# %%gpumem --backend sim --gpu T4 -q -v eval_no_grad
model.eval()
with torch.no_grad():
    out = model(x)
del out

# %%
# %%gpumem --backend sim --gpu T4 -q -v eval_inference
model.eval()
with torch.inference_mode():
    out = model(x)
del out

# %%
forward = {"train()": train_mode, "eval()": eval_mode,
           "eval() + no_grad()": eval_no_grad, "eval() + inference_mode()": eval_inference}
for name, r in forward.items():
    print(f"{name:<26} peak above the model {format_bytes(r.increment):>11}   "
          f"activations {format_bytes(r.breakdown['activations']):>11}")
print(f"eval() alone saved {1 - eval_mode.increment / train_mode.increment:.0%}; "
      f"no_grad() saved {1 - eval_no_grad.increment / train_mode.increment:.0%}")


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
bars(forward, "One forward pass, batch 64 (simulated T4)")

# %% [markdown]
# - `eval()` alone keeps the graph: every layer still saves its inputs for a backward
#   pass that will never come. What it does save comes from dropout, which is the
#   identity in eval mode: no masks and no dropped copies are stored.
# - `no_grad()` saves nothing for backward: what is left is the weights, the input and
#   the few temporaries of the layer being computed.
# - `inference_mode()` uses the same memory as `no_grad()`: its gain is speed (no version
#   counters, no view tracking), not bytes.
#
# ## What `inference_mode()` forbids
#
# Tensors made under `inference_mode()` can never take part in autograd later. With
# `no_grad()` they can. A real run on the CPU:

# %%
weight = torch.ones(3, requires_grad=True)
for mode in [torch.no_grad, torch.inference_mode]:
    with mode():
        features = torch.randn(3)
    try:
        (weight * features).sum().backward()   # multiplying saves `features` for backward
        print(f"{mode.__name__}: the tensor works in a later backward")
    except RuntimeError as error:
        print(f"{mode.__name__}: RuntimeError: {str(error).splitlines()[0]}")


# %% [markdown]
# So use `inference_mode()` for pure inference (serving, computing metrics), and
# `no_grad()` when what you compute may feed a later training step (targets from a
# teacher model, EMA updates).
#
# ## The validation-loop leak
#
# A validation loop that forgets `no_grad()` and keeps its outputs in a list keeps
# every batch's graph, with all its saved activations, alive until the list goes:

# %%
def validate(batches, grad_off):
    model.eval()
    predictions = []
    with torch.set_grad_enabled(not grad_off):
        for _ in range(batches):
            predictions.append(model(x))
    return predictions


# %%
# %%gpumem --backend sim --gpu T4 -q -v kept_graphs
predictions = validate(3, grad_off=False)

# %% [markdown]
# Deleting the list frees it all, graphs included (a plain cell: `del` works on the simulated GPU too):

# %%
del predictions

# %%
# %%gpumem --backend sim --gpu T4 -q -v kept_outputs
predictions = validate(3, grad_off=True)

# %%
print(f"3 batches without no_grad(): the list holds {format_bytes(kept_graphs.retained)}")
print(f"3 batches with no_grad():    the list holds {format_bytes(kept_outputs.retained)}")
print(f"(one batch of outputs, 64 x 256 x 512 floats, is {format_bytes(64 * 256 * 512 * 4)})")

# %% [markdown]
# Without `no_grad()` each kept prediction holds its graph: the whole forward pass's
# activations, batch after batch, until an out-of-memory error. With it, the list holds
# just the outputs. (`out.detach()` or `out.cpu()` before keeping also cut the graph.)
#
# ## Fact-check: "`model.eval()` saves memory during evaluation"
#
# Only through dropout: measured above, `eval()` alone left most of the activations in
# place. The memory saving comes from turning off autograd with
# `no_grad()` or `inference_mode()`, which are equal in memory.
#
# ## What we measured

# %%
print(f"{'forward pass, batch 64':<28}{'peak above model':>17}")
for name, r in forward.items():
    print(f"{name:<28}{format_bytes(r.increment):>17}")
print(f"{'3 kept predictions, grad on':<28}{format_bytes(kept_graphs.retained):>17}")
