# %% [markdown]
# A training loop over `for step, batch in enumerate(loader)` that logs every other step
# with `loss.item()` and stops early at `max_steps` with `break` (the "quick sanity run"
# of training scripts); the Dataset returns dicts, the default collate stacks them.

# %% tags=["setup"]
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

device = "cuda"

class Tabular(Dataset):
    def __init__(self, n=4096):
        self.x, self.y = torch.randn(n, 64), torch.randn(n, 1)
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return {"features": self.x[i], "target": self.y[i]}

loader = DataLoader(Tabular(), batch_size=64, shuffle=True)
model = nn.Sequential(nn.Linear(64, 4096), nn.ReLU(), nn.Dropout(0.1), nn.Linear(4096, 4096), nn.ReLU(),
                      nn.Dropout(0.1), nn.Linear(4096, 1)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
max_steps = 3

# %% tags=["step"]
model.train()
for step, batch in enumerate(loader):
    features, target = batch["features"].to(device), batch["target"].to(device)
    loss = nn.functional.mse_loss(model(features), target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if step % 2 == 0:
        print(f"step {step}: loss {loss.item():.4f}")
    if step + 1 == max_steps:
        break

# %% tags=["check"]
params = sum(rnd(n * 4) for n in [64 * 4096, 4096, 4096 * 4096, 4096, 4096, 1])
assert r.breakdown["parameters"] == params
assert r.before == params                     # the data is on the host
assert r.breakdown["optimizer_state"] in (0, params)
# left: momentum and gradients (zero_grad comes before backward), the last batch (64x64
# and 64x1 fp32), the loss
kept = 2 * params + rnd(64 * 64 * 4) + rnd(64 * 4) + rnd(4)
assert kept <= r.after - r.before <= kept + 2 * CUBLAS + 2 * MiB, (r.after - r.before, kept)
# saved by one step: the input, two 64x4096 ReLU outputs and their dropout outputs (1 MiB
# each), two bool dropout masks (256 KiB each): about 4.6 MiB at most
assert r.breakdown["activations"] <= 64 * 64 * 4 + 4 * 64 * 4096 * 4 + 2 * 64 * 4096 + 4096

# %% tags=["corpus"]
# bf16 weights halve weights, gradients and momentum; no_grad has no backward and no step;
# save_on_cpu packs the Linear weights too and the backward unpacks a GPU copy of each
# while the weights stay (the 4096x4096 one is 64 MiB): up
WHATIF = [("weights_dtype", "bf16", "down"), ("grad_mode", "no_grad", "down"), ("offload", True, "up")]
