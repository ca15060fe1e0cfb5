# %% [markdown]
# Gradient accumulation written by hand, as training-loop guides show it: the effective
# batch split into `accum_steps` micro-batches, each loss divided by `accum_steps` before
# `backward()`, one optimizer step and `zero_grad()` at the end.

# %% tags=["setup"]
import torch
from torch import nn

device = "cuda"
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                      nn.Linear(1024, 10)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loss_fn = nn.CrossEntropyLoss()
batch_size, accum_steps = 8192, 2

# %% tags=["step"]
micro = batch_size // accum_steps
for i in range(accum_steps):
    x = torch.randn(micro, 256, device=device)
    y = torch.randint(0, 10, (micro,), device=device)
    loss = loss_fn(model(x), y) / accum_steps
    loss.backward()
optimizer.step()
optimizer.zero_grad()

# %% tags=["check"]
params = sum(rnd(n * 4) for n in [256 * 1024, 1024, 1024 * 1024, 1024, 1024 * 10, 10])
assert r.breakdown["parameters"] == params
assert r.before == params
# SGD with momentum: one buffer per parameter, made at the step
assert r.breakdown["optimizer_state"] in (0, params)
# left: the momentum buffers (zero_grad frees the gradients), the last micro-batch, its
# labels, the loss
kept = params + rnd(4096 * 256 * 4) + rnd(4096 * 8) + rnd(4)
assert kept <= r.after - r.before <= kept + 2 * CUBLAS + 2 * MiB, (r.after - r.before, kept)
# saved by one micro-batch of 4096: x (4 MiB), the two 4096x1024 ReLU outputs (16 MiB
# each, which the next Linear saves too), and cross entropy's 4096x10 log-softmax: one
# micro-batch's worth at most, never two (the first graph is freed by its backward; the
# peak can fall inside a backward, at a bias gradient's reduction buffer, after part of
# it is freed)
saved = 4096 * 256 * 4 + 2 * 4096 * 1024 * 4
assert r.breakdown["activations"] <= saved + 2 * MiB, r.breakdown["activations"]

# %% tags=["corpus"]
# the cell reads batch_size and accum_steps itself: more micro-steps shrink each micro-batch;
# a bigger effective batch grows it; bf16 weights halve the saved activations too
WHATIF = [("accum_steps", 4, "down"), ("batch_size", 16384, "up"), ("weights_dtype", "bf16", "down")]
