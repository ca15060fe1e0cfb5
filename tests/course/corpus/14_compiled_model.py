# %% [markdown]
# A torch.compile'd model in a training loop (the torch.compile tutorial's pattern:
# `opt_model = torch.compile(model)`, then the usual step); memmagic runs it eagerly.

# %% tags=["setup"]
import torch
from torch import nn
model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 1024)).cuda()
opt_model = torch.compile(model)
optimizer = torch.optim.Adam(model.parameters())
x = torch.randn(256, 1024, device="cuda")

# %% tags=["step"]
loss = opt_model(x).pow(2).mean()
loss.backward()
optimizer.step()
optimizer.zero_grad()

# %% tags=["check"]
params = rnd(1024 * 4096 * 4) + rnd(4096 * 4) + rnd(4096 * 4096 * 4) + rnd(4096 * 4) + rnd(4096 * 1024 * 4) + rnd(1024 * 4)
assert r.breakdown["parameters"] == params
assert r.before == params + rnd(256 * 1024 * 4)
assert r.breakdown["optimizer_state"] in (0, 2 * params)
assert 2 * params <= r.after - r.before <= 2 * params + 2 * CUBLAS + 2 * MiB

# %% tags=["corpus"]
WHATIF = [("batch_size", 512, "up"), ("weights_dtype", "bf16", "down"), ("grad_mode", "no_grad", "down")]
