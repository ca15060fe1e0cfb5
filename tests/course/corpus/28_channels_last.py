# %% [markdown]
# A CNN in the channels_last memory format (the performance guide's advice for tensor
# cores): the model and the input moved with `memory_format=torch.channels_last`, AdamW.
# The layout changes strides, not sizes: the memory is that of the contiguous model.

# %% tags=["setup"]
import torch
from torch import nn

device = "cuda"
model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                      nn.MaxPool2d(2), nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 100))
model = model.to(device, memory_format=torch.channels_last)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(32, 3, 64, 64, device=device).to(memory_format=torch.channels_last)
y = torch.randint(0, 100, (32,), device=device)

# %% tags=["step"]
out = model(x)
loss = nn.functional.cross_entropy(out, y)
loss.backward()
optimizer.step()
optimizer.zero_grad(set_to_none=True)

# %% tags=["check"]
params = sum(rnd(n * 4) for n in [64 * 27, 64, 64 * 64 * 9, 64, 128 * 64 * 9, 128, 100 * 128, 100])
assert r.breakdown["parameters"] == params
assert r.before == params + rnd(32 * 3 * 64 * 64 * 4) + rnd(32 * 8)
assert r.breakdown["optimizer_state"] in (0, 2 * params)
kept = 2 * params + rnd(32 * 100 * 4) + rnd(4)     # AdamW's moments, out, loss
assert kept <= r.after - r.before <= kept + 2 * CUBLAS + 2 * MiB, (r.after - r.before, kept)
# saved: x (1.5 MiB), the two 32x64x64x64 relu outputs (32 MiB each; conv2 and the pool
# save them), the pool's int64 indices of 32x64x32x32 (16 MiB), the pool's output that
# conv3 saves (8 MiB) and the 32x128x32x32 relu output (16 MiB): 105.5 MiB at the end of
# the forward (the Linear's 32x128 input and the 32x100 log-softmax are a few KiB)
saved = 32 * 3 * 64 * 64 * 4 + 2 * 32 * 64 * 64 * 64 * 4 + 32 * 64 * 32 * 32 * 8 \
    + 32 * 64 * 32 * 32 * 4 + 32 * 128 * 32 * 32 * 4
assert r.breakdown["activations"] <= saved + MiB, (r.breakdown["activations"], saved)
assert r.peak - r.before >= saved                  # the backward starts with all of them

# %% tags=["corpus"]
WHATIF = [("amp", "fp16", "down"), ("batch_size", 64, "up"), ("inplace", True, "same")]
