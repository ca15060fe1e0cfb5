# %% [markdown]
# An evaluation loop as image-classification courses write it: `model.eval()` and
# `torch.inference_mode()`, batches moved to the GPU one at a time, accuracy from argmax
# summed with `.item()`, on a small conv net with batch norm.

# %% tags=["setup"]
import torch
from torch import nn

device = "cuda"
model = nn.Sequential(
    nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
    nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
    nn.Flatten(), nn.Linear(64, 10)).to(device)
val_batches = [(torch.randn(256, 3, 32, 32), torch.randint(0, 10, (256,))) for _ in range(3)]

# %% tags=["step"]
model.eval()
correct = total = 0
with torch.inference_mode():
    for images, labels in val_batches:
        images, labels = images.to(device), labels.to(device)
        logits = model(images)
        correct += (logits.argmax(dim=1) == labels).sum().item()
        total += labels.size(0)
accuracy = correct / total

# %% tags=["check"]
# conv1 32x3x3x3 + 32, bn1 2 x 32, conv2 64x32x3x3 + 64, bn2 2 x 64, fc 10x64 + 10 (fp32)
params = sum(rnd(n * 4) for n in [32 * 27, 32, 32, 32, 64 * 288, 64, 64, 64, 640, 10])
assert r.breakdown["parameters"] == params
# batch norm's running mean and var (fp32) and num_batches_tracked (one int64) per layer
buffers = 2 * rnd(32 * 4) + rnd(8) + 2 * rnd(64 * 4) + rnd(8)
assert r.breakdown["buffers"] == buffers
assert r.before == params + buffers          # the batches are on the host until the loop
# inference mode: nothing saved, no gradients
assert r.breakdown["activations"] == r.breakdown["gradients"] == r.breakdown["optimizer_state"] == 0
# the largest moment: a 256x32x32x32 fp32 map (32 MiB) going into the next layer's output
# of the same size (conv1 -> bn1 -> relu), with the batch (256x3x32x32x4 = 3 MiB) and the
# previous batch's labels and logits; the cuBLAS workspaces the first batch's Linear made
# stay from then on: 2 x 32 MiB + 3 MiB <= peak - before <= that + 3 MiB + workspaces + 2 MiB
act = 2 * 256 * 32 * 32 * 32 * 4
assert act + rnd(256 * 3 * 32 * 32 * 4) <= r.peak - r.before <= act + 6 * MiB + CUBLAS + 3 * MiB, r.peak - r.before
# left: the last batch, its labels and logits, the workspaces
kept = rnd(256 * 3 * 32 * 32 * 4) + rnd(256 * 8) + rnd(256 * 10 * 4)
assert kept <= r.after - r.before <= kept + CUBLAS + MiB, (r.after - r.before, kept)

# %% tags=["corpus"]
# bf16 weights make every feature map bf16 (half the 16 MiB maps); fp16 autocast makes the
# convolutions' outputs fp16; a bigger GPU changes nothing the cell allocates
WHATIF = [("weights_dtype", "bf16", "down"), ("amp", "fp16", "down"), ("gpu", "A100-40GB", "same")]
