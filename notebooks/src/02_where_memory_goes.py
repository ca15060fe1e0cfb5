# %% [markdown]
# # 02 · Where the memory goes
#
# A training step keeps five kinds of tensors on the GPU: **parameters**, their
# **gradients**, the **optimizer state**, the **activations** autograd saves for the
# backward pass, and short-lived **temporaries**. In this notebook you will:
#
# - estimate each of them for a small network with pen-and-paper arithmetic;
# - measure each one, phase by phase, on a simulated T4 (no GPU needed);
# - see what the estimate misses (optimizer temporaries, the cuBLAS workspace) and how
#   far the popular "training needs 4x the model size" rule is off.

# %%
# %load_ext memmagic
# %matplotlib inline
import torch
from torch import nn
import matplotlib.pyplot as plt
torch.manual_seed(0)
from memmagic import format_bytes

# %% [markdown]
# ## Estimate first
#
# The model: three linear layers, 1024 → 4096 → 4096 → 10, with ReLU in between, trained
# with Adam on batches of 256. Every number is float32: 4 bytes.
#
# - **parameters**: weights and biases;
# - **gradients**: one per parameter;
# - **optimizer state**: Adam keeps two running averages per parameter (`exp_avg`, `exp_avg_sq`);
# - **activations**: what backward needs. A `Linear` saves its input, a `ReLU` its output;
#   the ReLU's output *is* the next Linear's input, so it is stored once.

# %%
batch, d_in, hidden, classes = 256, 1024, 4096, 10
n_params = (d_in * hidden + hidden) + (hidden * hidden + hidden) + (hidden * classes + classes)
FP32 = 4  # bytes per number
estimate = {
    "parameters": n_params * FP32,
    "gradients": n_params * FP32,
    "optimizer_state": 2 * n_params * FP32,
    "activations": batch * (d_in + hidden + hidden) * FP32,  # x, relu1 out, relu2 out
}
print(f"{n_params:,} parameters")
for name, nbytes in estimate.items():
    print(f"  {name:<16}{format_bytes(nbytes):>11}")

# %% [markdown]
# ## Measure, one phase per cell
#
# Each cell below runs on the notebook's simulated GPU (`--backend sim --gpu T4`): code
# written for CUDA runs on fake tensors that have shapes but no data, and memmagic
# predicts what a real T4 would hold. Like a real GPU, the simulated one keeps what a
# cell leaves behind, so each cell starts where the previous one stopped. `-q -v NAME`
# stores the report in `NAME` without printing it.

# %%
# %%gpumem --backend sim --gpu T4 -q -v built
model = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(),
                      nn.Linear(hidden, hidden), nn.ReLU(),
                      nn.Linear(hidden, classes)).cuda()

# %%
# %%gpumem --backend sim --gpu T4 -q -v forward
x = torch.randn(batch, d_in, device="cuda")
y = torch.randint(classes, (batch,), device="cuda")
loss = nn.functional.cross_entropy(model(x), y)

# %%
# %%gpumem --backend sim --gpu T4 -q -v backward
loss.backward()

# %% [markdown]
# The first optimizer step creates Adam's state. This time the full report is shown:

# %%
# %%gpumem --backend sim --gpu T4 -v step
opt = torch.optim.Adam(model.parameters())
opt.step()

# %% [markdown]
# ## Check the estimate
#
# Each category is read at the peak of the phase that makes it: `report.breakdown` maps a
# category to bytes at that cell's peak.

# %%
measured = {
    "parameters": built.breakdown["parameters"],
    "gradients": backward.breakdown["gradients"],
    "optimizer_state": step.breakdown["optimizer_state"],
    "activations": forward.breakdown["activations"],
}
print(f"{'':<16}{'by hand':>11}{'measured':>11}  ratio")
for name in estimate:
    ratio = measured[name] / estimate[name]
    print(f"{name:<16}{format_bytes(estimate[name]):>11}{format_bytes(measured[name]):>11}  {ratio:.4f}")

# %% [markdown]
# The four estimates hold. (The CUDA allocator rounds every tensor up to a multiple of
# 512 bytes; for tensors this size that is invisible in the ratios.)
#
# ## What the estimate missed
#
# Two categories had no line in the estimate:
#
# - **workspaces**: the first matrix multiply on a thread makes cuBLAS allocate a
#   workspace through PyTorch's allocator, and it stays. Backward runs on a second
#   thread, which gets its own.
# - **other**: temporaries. In the forward pass the output of each `Linear` lives until
#   the ReLU has made its own output. In the optimizer step, the foreach (multi-tensor)
#   Adam that CUDA uses computes intermediate results for all parameters at once.

# %%
for name, report in [("forward", forward), ("backward", backward), ("optimizer step", step)]:
    print(f"{name:<15} workspaces {format_bytes(report.breakdown['workspaces']):>10}"
          f"   other {format_bytes(report.breakdown['other']):>10}   peak {report.peak_words}")
print(f"Adam's temporaries are {step.breakdown['other'] / estimate['parameters']:.2f}x the parameters")


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
bars({"built": built, "forward": forward, "backward": backward, "optimizer step": step},
     "Each phase's peak on a simulated T4")

# %% [markdown]
# ## The "4x the model size" rule
#
# A common rule of thumb says training with Adam needs 4x the parameter memory
# (weights, gradients, two Adam moments). Compare it with the whole step's peak:

# %%
rule = 4 * estimate["parameters"]
print(f"4x the parameters:   {format_bytes(rule)}")
print(f"measured step peak:  {format_bytes(step.peak)}  ({step.peak / rule - 1:+.0%} over the rule)")
print(f"activations at batch {batch}: {format_bytes(estimate['activations'])}, "
      f"{estimate['activations'] / rule:.1%} of the rule")

# %% [markdown]
# At this batch size the activations are small next to the weights, so the peak comes
# in the optimizer step, and the rule misses only the temporaries and workspaces. With
# bigger batches or longer sequences the activations grow and take over: notebook 03
# measures where that happens.
#
# ## What we measured

# %%
print(f"{'phase':<16}{'peak':>11}{'added':>11}   largest category at the peak")
for name, r in [("build", built), ("forward", forward), ("backward", backward), ("optimizer step", step)]:
    top = max(r.breakdown, key=r.breakdown.get)
    print(f"{name:<16}{format_bytes(r.peak):>11}{format_bytes(r.increment):>11}   {top}")
