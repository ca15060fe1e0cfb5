# %% [markdown]
# # 07 · In-place activations: `ReLU(inplace=True)`
#
# An in-place operation writes its result into its input's memory instead of a new
# tensor. `nn.ReLU(inplace=True)` is the best-known one. In this notebook you will:
#
# - measure what `inplace=True` saves in inference and in training, on a simulated T4;
# - see why the saving is one temporary, not the activations;
# - see when autograd refuses an in-place operation, and why.

# %%
# %load_ext memmagic
# %matplotlib inline
import torch
from torch import nn
import matplotlib.pyplot as plt
torch.manual_seed(0)
from memmagic import format_bytes


# %% [markdown]
# Two MLPs, four blocks each, batch 2048, built with `ReLU()` or `ReLU(inplace=True)`:
#
# - **flat**: every layer is `Linear(4096, 4096)`;
# - **expanding**: each block widens 8x and narrows back, `Linear(1024, 8192) -> ReLU ->
#   Linear(8192, 1024)`, as the MLP of a transformer block does.

# %%
def make_mlp(shape, inplace):
    layers = []
    for _ in range(4):
        if shape == "flat":
            layers += [nn.Linear(4096, 4096), nn.ReLU(inplace=inplace)]
        else:
            layers += [nn.Linear(1024, 8192), nn.ReLU(inplace=inplace), nn.Linear(8192, 1024)]
    return nn.Sequential(*layers)

def run(shape, inplace, training):
    model = make_mlp(shape, inplace).cuda()
    x = torch.randn(2048, 4096 if shape == "flat" else 1024, device="cuda")
    with torch.set_grad_enabled(training):
        out = model(x)
    if training:
        out.mean().backward()


# %%
import memmagic
runs = {}
for shape in ["flat", "expanding"]:
    for training in [False, True]:
        for inplace in [False, True]:
            runs[shape, training, inplace] = memmagic.measure(
                lambda: run(shape, inplace, training), backend="sim", gpu="T4")
for (shape, training, inplace), r in runs.items():
    if inplace:
        saved = runs[shape, training, False].peak - r.peak
        mode = "training " if training else "inference"
        print(f"{shape:<9} {mode}: inplace=True saved {format_bytes(saved):>10} of {format_bytes(r.peak + saved):>10}")


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
bars({f"{shape}, {'training' if t else 'inference'}, inplace={i}": runs[shape, t, i]
      for shape in ["flat", "expanding"] for t in [False, True] for i in [False, True]},
     "ReLU() vs ReLU(inplace=True), simulated T4")

# %% [markdown]
# ## One temporary, and only if it is the peak
#
# Without `inplace`, a `Linear` writes its output, then the ReLU writes a second tensor
# of the same size; for a moment both are alive, then the first one goes. With
# `inplace=True` the second tensor is never made. That is the whole saving: one layer's
# output, for a moment. It lowers the peak only if that moment *was* the peak:
#
# - **flat**: the next `Linear` also needs its input and its output alive together, and
#   they are just as large, so the peak does not move;
# - **expanding**: the ReLU's moment holds two wide (8192) tensors, the next `Linear`'s
#   one wide and one narrow; removing one wide tensor lowers the peak.
#
# The activations do not change: the ReLU saves its output for backward and the next
# `Linear` saves its input, the same tensor either way, stored once.

# %%
wide = 2048 * 8192 * 4
print(f"one wide tensor (2048 x 8192 floats): {format_bytes(wide)}")
for training in [False, True]:
    off, on = runs["expanding", training, False], runs["expanding", training, True]
    print(f"expanding, {'training' if training else 'inference'}: activations "
          f"{format_bytes(off.breakdown['activations'])} -> {format_bytes(on.breakdown['activations'])}; "
          f"peak {off.peak_words}")


# %% [markdown]
# ## When autograd refuses
#
# An in-place op overwrites a tensor. Autograd counts every tensor's in-place changes
# (its *version*) and refuses at backward time when a tensor it saved has changed since.
# Real tensors on the CPU:

# %%
def attempt(name, fn):
    try:
        fn()
        print(f"{name}: ok")
    except RuntimeError as error:
        print(f"{name}: RuntimeError: {str(error).split('. Hint')[0]}")

x = torch.randn(4, 3)
relu_after_linear = nn.Sequential(nn.Linear(3, 3), nn.ReLU(inplace=True))
relu_after_sigmoid = nn.Sequential(nn.Linear(3, 3), nn.Sigmoid(), nn.ReLU(inplace=True))
attempt("Linear -> ReLU(inplace)", lambda: relu_after_linear(x).sum().backward())
attempt("Sigmoid -> ReLU(inplace)", lambda: relu_after_sigmoid(x).sum().backward())

# %% [markdown]
# `Linear` saves its *input*, not its output, so the ReLU may overwrite the output.
# `Sigmoid` saves its *output* (its gradient is `s * (1 - s)`), so overwriting it would
# make the gradient wrong: autograd detects the change and stops. The same holds after
# `tanh`, `exp`, `softmax`, and anything else whose backward needs its result.
#
# A leaf tensor that requires grad cannot be changed in place at all, since autograd
# would lose the value it needs:

# %%
weight = torch.randn(3, requires_grad=True)
attempt("weight.relu_()", lambda: weight.relu_())
with torch.no_grad():
    weight.mul_(0.5)   # in-place updates of weights belong under no_grad (optimizers do this)
print("under no_grad: ok, version", weight._version)

# %% [markdown]
# ## Fact-check: "in-place activations save memory"
#
# They save one temporary, at the moment the ReLU runs, and never the activations.
# Whether that lowers the peak depends on the shapes around it and on where the peak
# is: the measurements above show both cases. They are not free either: an in-place op
# in the wrong place is an error at backward time.
#
# ## What we measured

# %%
print(f"{'':<22}{'ReLU()':>12}{'inplace=True':>14}")
for (shape, training, inplace), r in runs.items():
    if not inplace:
        name = f"{shape}, {'training' if training else 'inference'}"
        print(f"{name:<22}{format_bytes(r.peak):>12}{format_bytes(runs[shape, training, True].peak):>14}")
