# %% [markdown]
# # 05 · Mixed precision: autocast, GradScaler, fp16 and bf16
#
# "Mixed precision cuts memory by 50%" is repeated everywhere. In this notebook you will:
#
# - measure a transformer's training step in fp32, with `autocast` to fp16 (plus
#   `GradScaler`) and to bf16, at a small and a large batch, on a simulated A100;
# - see which tensors autocast makes smaller and which it leaves alone;
# - see why fp16 needs a `GradScaler` and bf16 does not;
# - measure what storing the *weights* in fp16 or bf16 (`model.half()`) saves, and what it
#   costs in accuracy on a small real training run on the CPU.

# %%
# %load_ext memmagic
# %matplotlib inline
import torch
from torch import nn
import matplotlib.pyplot as plt
torch.manual_seed(0)
from memmagic import format_bytes


# %% [markdown]
# A 4-layer transformer encoder (d=512, sequences of 256), trained with AdamW. One
# function covers every variant: `precision` picks autocast's dtype, and the
# `GradScaler` is switched on for fp16 only (disabled, it passes everything through).

# %%
def make_model():
    layer = nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=4)

def train_step(batch_size, precision="fp32", use_scaler=True):
    model = make_model().cuda()
    opt = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cuda", enabled=use_scaler and precision == "fp16")
    x = torch.randn(batch_size, 256, 512, device="cuda")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
        loss = model(x).square().mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


# %% [markdown]
# Each variant on a fresh simulated A100 (`memmagic.measure`, as in notebook 03), at
# batch 4 and batch 32:

# %%
import memmagic
runs = {}
for precision in ["fp32", "fp16", "bf16"]:
    for b in [4, 32]:
        runs[precision, b] = memmagic.measure(lambda: train_step(b, precision), backend="sim", gpu="A100-40GB")
for b in [4, 32]:
    print(f"batch {b}:")
    for precision in ["fp32", "fp16", "bf16"]:
        r = runs[precision, b]
        change = r.peak / runs["fp32", b].peak - 1
        print(f"  {precision}: peak {format_bytes(r.peak):>11} ({change:+6.1%})  {r.peak_words}")


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
bars({f"{p}, batch {b}": runs[p, b] for b in [4, 32] for p in ["fp32", "fp16"]},
     "autocast changes the activations, not the model's state (simulated A100)")

# %% [markdown]
# ## What autocast changes
#
# Autocast runs matrix multiplies (and convolutions) in fp16/bf16, so their outputs, and
# the activations saved from them, are half the size. It does **not** touch:
#
# - the parameters, gradients and optimizer state: they stay fp32 (autocast casts a copy
#   of each weight on the fly);
# - ops CUDA's autocast keeps in fp32 for accuracy: `layer_norm`, `softmax`, losses,
#   reductions.

# %%
for b in [4, 32]:
    fp32, fp16 = runs["fp32", b], runs["fp16", b]
    print(f"batch {b}: activations {format_bytes(fp32.breakdown['activations'])} -> {format_bytes(fp16.breakdown['activations'])}, "
          f"parameters {format_bytes(fp32.breakdown['parameters'])} -> {format_bytes(fp16.breakdown['parameters'])}")

# %% [markdown]
# At batch 4 the peak comes in the optimizer step, where autocast has nothing to halve.
# At batch 32 the activations dominate and the saving is large, but still short of 50%:
# the fp32 parts do not shrink.
#
# ## Why fp16 needs a GradScaler
#
# fp16 has 5 exponent bits: its largest number is 65504 and anything below about 6e-8
# becomes zero. Small gradients underflow. bf16 has fp32's 8 exponent bits (same range)
# but only 8 bits of precision. A few real tensors on the CPU:

# %%
print("70000 in fp16:", torch.tensor(70000.0).half().item())
print("1e-8 in fp16: ", torch.tensor(1e-8).half().item(), "  in bf16:", torch.tensor(1e-8).bfloat16().item())
print("1e-8 x 65536 in fp16:", torch.tensor(1e-8 * 65536).half().item())
one = torch.tensor(1.0, dtype=torch.bfloat16)
print("1 + 0.001 in bf16:", (one + 0.001).item(), "  in fp32:", (torch.tensor(1.0) + 0.001).item())

# %% [markdown]
# `GradScaler` multiplies the loss by a large factor (65536 to start) before `backward()`,
# so small gradients survive in fp16, divides the gradients back before `optimizer.step()`,
# and skips a step whose gradients overflowed. Its own state is a scale factor and a
# flag per device. The same fp16 step with and without it:

# %%
no_scaler = memmagic.measure(lambda: train_step(32, "fp16", use_scaler=False), backend="sim", gpu="A100-40GB")
print("GradScaler's cost at batch 32:", format_bytes(runs["fp16", 32].peak - no_scaler.peak, signed=True))


# %% [markdown]
# ## Half-precision weights: `model.half()`
#
# Storing the model itself in fp16 or bf16 halves the parameters, the gradients and
# Adam's state as well:

# %%
def half_step(batch_size, dtype):
    model = make_model().cuda().to(dtype)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(batch_size, 256, 512, device="cuda", dtype=dtype)
    model(x).square().mean().backward()
    opt.step()

for b in [4, 32]:
    runs["bf16 weights", b] = memmagic.measure(lambda: half_step(b, torch.bfloat16), backend="sim", gpu="A100-40GB")
    saved = 1 - runs["bf16 weights", b].peak / runs["fp32", b].peak
    print(f"batch {b}: bf16 weights, peak {format_bytes(runs['bf16 weights', b].peak)} (saved {saved:.0%})")

# %% [markdown]
# The memory saving is real. The price is paid in the optimizer: a weight update is
# often far smaller than the weight, and with 8 bits of precision (bf16) it is rounded
# away; in fp16, Adam's `eps=1e-8` rounds to 0 and divisions by zero follow.
#
# ## What it costs in accuracy (a real run on the CPU)
#
# A small classifier on synthetic data, 300 Adam steps, four ways. This runs for real, so
# the numbers are actual training results (rounded: they may differ in the last digit
# on another CPU). Tensors this small run faster on one CPU thread than on several.

# %%
g = torch.Generator().manual_seed(0)
X = torch.randn(4096, 32, generator=g)
Y = (X @ torch.randn(32, 4, generator=g)).argmax(1)  # labels from a hidden linear "teacher"

torch.set_num_threads(1)

def train_small(weights=torch.float32, autocast_dtype=None, steps=300, lr=3e-4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4)).to(weights)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for i in range(steps):
        rows = slice(i * 128 % 4096, i * 128 % 4096 + 128)
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            loss = nn.functional.cross_entropy(model(X[rows].to(weights)).float(), Y[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        accuracy = (model(X.to(weights)).argmax(1) == Y).float().mean().item()
    return loss.item(), accuracy


# %%
results = {
    "fp32": train_small(),
    "autocast bf16": train_small(autocast_dtype=torch.bfloat16),
    "bf16 weights": train_small(weights=torch.bfloat16),
    "fp16 weights": train_small(weights=torch.float16),
}
for name, (loss, accuracy) in results.items():
    print(f"{name:<14} final loss {loss:5.2f}   accuracy {accuracy:4.0%}")

# %% [markdown]
# Autocast trains like fp32: the weights and the optimizer stay fp32. bf16 weights learn
# more slowly (updates lost to rounding); fp16 weights with Adam break down (`nan`).
# That is why large models trained in bf16 keep an fp32 copy of the weights ("master
# weights") in the optimizer, or use optimizers written for low precision.
#
# ## Fact-check: "mixed precision cuts memory by 50%"

# %%
for b in [4, 32]:
    for name in ["fp16", "bf16", "bf16 weights"]:
        saved = 1 - runs[name, b].peak / runs["fp32", b].peak
        print(f"batch {b:>2}, {name:<12}: {saved:5.1%} of the fp32 peak saved")

# %% [markdown]
# **Where it holds:** autocast roughly halves the activations of matmul-heavy layers, so
# when activations dominate the peak (large batches, long sequences) the saving
# approaches, but does not reach, 50%.
#
# **Where it fails:** weights, gradients and optimizer state stay fp32, so with small
# batches, or with a peak in the optimizer step, autocast saves little or nothing.
# Halving *everything* takes half-precision weights, which cost accuracy unless the
# optimizer keeps fp32 master weights (and then the saving shrinks again).
#
# An aside on hardware: on a T4 (no bf16 attention kernels) bf16 falls back to a
# slower attention path that saves the full attention matrix. Measured:

# %%
for precision in ["fp16", "bf16"]:
    r = memmagic.measure(lambda: train_step(32, precision), backend="sim", gpu="T4")
    print(f"T4, {precision}, batch 32: activations {format_bytes(r.breakdown['activations'])}")

# %% [markdown]
# ## What we measured

# %%
print(f"{'':<14}{'batch 4':>12}{'batch 32':>12}")
for name in ["fp32", "fp16", "bf16", "bf16 weights"]:
    print(f"{name:<14}{format_bytes(runs[name, 4].peak):>12}{format_bytes(runs[name, 32].peak):>12}")
print()
for name, (loss, accuracy) in results.items():
    print(f"{name:<14} accuracy after 300 steps: {accuracy:.0%}")
