# %% [markdown]
# # 04 · Gradient accumulation
#
# Gradient accumulation trains with an *effective* batch of `k × micro_batch` while only
# one micro-batch's activations are alive at a time: run `k` forward/backward passes,
# let the gradients add up, then take one optimizer step. In this notebook you will:
#
# - check on a real (CPU) run that the accumulated gradient equals the big batch's,
#   and what goes wrong without the loss scaling or with `zero_grad` in the wrong place;
# - measure the memory of an effective batch of 256 done three ways on a simulated T4;
# - fact-check *"gradient accumulation gives the same memory as the small batch"*.

# %%
# %load_ext memmagic
# %matplotlib inline
import torch
from torch import nn
import matplotlib.pyplot as plt
torch.manual_seed(0)
from memmagic import format_bytes

# %% [markdown]
# ## Getting the loop right
#
# A tiny linear model on 64 samples, small enough to run for real. The reference is the
# gradient of the whole batch at once.

# %%
X, Y = torch.randn(64, 20), torch.randn(64, 1)
model = nn.Linear(20, 1)
loss_fn = nn.MSELoss()  # a mean over the batch

model.zero_grad()
loss_fn(model(X), Y).backward()
full = model.weight.grad.clone()


# %% [markdown]
# The usual loop: divide each micro-batch's loss by the number of micro-batches `k`
# (the loss is a *mean*, and `k` means of 16 samples summed are `k` times the mean of 64),
# call `backward()` on every micro-batch, and zero the gradients only after the step.

# %%
def accumulated_grad(k, scale=True, zero_every_micro_batch=False):
    model.zero_grad()
    for xb, yb in zip(X.chunk(k), Y.chunk(k)):
        if zero_every_micro_batch:
            model.zero_grad()           # the bug: wipes what was accumulated
        loss = loss_fn(model(xb), yb)
        (loss / k if scale else loss).backward()
    return model.weight.grad.clone()    # opt.step(); opt.zero_grad() would go here

good = accumulated_grad(4)
print("loss / k, zero_grad after the step:", torch.allclose(good, full, atol=1e-6))
unscaled = accumulated_grad(4, scale=False)
print(f"without / k: the gradient is {unscaled.norm() / full.norm():.2f}x the full batch's")
wrong = accumulated_grad(4, zero_every_micro_batch=True)
print("zero_grad every micro-batch: matches the full batch:", torch.allclose(wrong, full, atol=1e-6))


# %% [markdown]
# Without the division the gradient is `k` times too large: with SGD that is a learning
# rate `k` times too high (Adam mostly normalises it away, gradient clipping does not).
# With `zero_grad` inside the loop, only the last micro-batch counts.
#
# (Layers that look at the whole batch, such as `BatchNorm`, see micro-batches: their
# statistics follow the micro-batch, so accumulation is not exactly the big batch there.)
#
# ## Memory at a fixed effective batch of 256
#
# The CNN of notebook 03, two optimizer steps, three ways to reach 256 samples per step,
# each measured on a fresh simulated T4 by `memmagic.measure` (notebook 03).

# %%
def make_cnn():
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(128 * 8 * 8, 512), nn.ReLU(), nn.Linear(512, 10))

def train(micro_batch, k, steps=2):
    model = make_cnn().cuda()
    opt = torch.optim.Adam(model.parameters())
    for _ in range(steps):
        for _ in range(k):
            x = torch.randn(micro_batch, 3, 32, 32, device="cuda")
            y = torch.randint(10, (micro_batch,), device="cuda")
            loss = nn.functional.cross_entropy(model(x), y) / k
            loss.backward()
        opt.step()
        opt.zero_grad()


# %%
import memmagic
big = memmagic.measure(lambda: train(256, k=1), backend="sim", gpu="T4")
accum = memmagic.measure(lambda: train(64, k=4), backend="sim", gpu="T4")
small = memmagic.measure(lambda: train(64, k=1), backend="sim", gpu="T4")
for name, r in [("batch 256", big), ("4 x 64, accumulated", accum), ("batch 64 (a smaller step)", small)]:
    print(f"{name:<26} peak {format_bytes(r.peak):>11}   {r.peak_words}")


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
bars({"batch 256": big, "4 x 64 accumulated": accum, "batch 64": small},
     "An effective batch of 256, three ways (simulated T4)")

# %% [markdown]
# ## Fact-check: "accumulation gives the same memory as the small batch"
#
# Compare the accumulated run with plain training at the micro-batch size:

# %%
extra = accum.peak - small.peak
print(f"accumulation vs batch 64: {format_bytes(extra, signed=True)} ({extra / small.peak:+.1%})")
print(f"accumulation vs batch 256: {1 - accum.peak / big.peak:.0%} lower peak")
for name, r in [("accumulated", accum), ("batch 64", small)]:
    print(f"  {name:<12} at the peak: gradients {format_bytes(r.breakdown['gradients']):>10}, "
          f"activations {format_bytes(r.breakdown['activations']):>10}, other {format_bytes(r.breakdown['other']):>10}")

# %% [markdown]
# **Where the claim holds:** the activations are the micro-batch's, so the peak is close
# to the small batch's and far below the big batch's.
#
# **Where it is not exact:** with plain training, `zero_grad()` (which sets gradients to
# `None`) frees the gradients before the next forward pass, and backward builds them
# layer by layer. With accumulation, the gradients of earlier micro-batches are alive
# during every later pass, and each new gradient is first computed in a temporary
# ("other") and then added to the stored one. Look at where each run peaked (above):
# the accumulated run peaks at the start of backward, where all of the micro-batch's
# activations, all of the stored gradients and the new gradient of the largest layer
# are alive together. The difference is bounded by about one set of gradients, so it
# matters most for models whose weights are large next to their activations.
#
# Accumulation costs time, not memory: `k` smaller passes use the GPU less efficiently
# than one big one.
#
# ## What we measured

# %%
print(f"{'effective batch 256 as':<26}{'peak':>11}{'reserved':>11}")
for name, r in [("one batch of 256", big), ("4 x 64, accumulated", accum), ("(batch 64 alone)", small)]:
    print(f"{name:<26}{format_bytes(r.peak):>11}{format_bytes(r.reserved_peak):>11}")
