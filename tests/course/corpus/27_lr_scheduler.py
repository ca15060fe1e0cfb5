# %% [markdown]
# A small residual CNN trained with SGD (momentum, Nesterov, weight decay) and a
# `OneCycleLR` schedule stepped every batch, the learning rate read back with
# `scheduler.get_last_lr()` for the progress line, as CIFAR training scripts do.

# %% tags=["setup"]
import torch
from torch import nn
import torch.nn.functional as F

device = "cuda"

class ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(out)))

model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                      ResBlock(32), ResBlock(32), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                      nn.Linear(32, 10)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
steps = 3
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=steps)
criterion = nn.CrossEntropyLoss()
inputs = torch.randn(64, 3, 32, 32, device=device)
targets = torch.randint(0, 10, (64,), device=device)

# %% tags=["step"]
model.train()
for step in range(steps):
    optimizer.zero_grad()
    loss = criterion(model(inputs), targets)
    loss.backward()
    optimizer.step()
    scheduler.step()
    print(f"step {step} lr {scheduler.get_last_lr()[0]:.4f} loss {loss.item():.3f}")

# %% tags=["check"]
# stem conv 32x3x3x3 and its BN; 2 blocks x (2 convs 32x32x3x3, 2 BNs); fc 10x32 + 10
sizes = [32 * 27, 32, 32] + 2 * [32 * 32 * 9, 32, 32, 32 * 32 * 9, 32, 32] + [320, 10]
params = sum(rnd(n * 4) for n in sizes)
assert r.breakdown["parameters"] == params
buffers = 5 * (2 * rnd(32 * 4) + rnd(8))            # 5 BNs: mean, var, int64 counter
assert r.breakdown["buffers"] == buffers
assert r.before == params + buffers + rnd(64 * 3 * 32 * 32 * 4) + rnd(64 * 8)
# SGD's momentum: 1x the parameters; the scheduler keeps Python floats, no tensors
assert r.breakdown["optimizer_state"] in (0, params)
kept = 2 * params + rnd(4)                           # momentum, gradients, loss
assert kept <= r.after - r.before <= kept + 2 * CUBLAS + 2 * MiB, (r.after - r.before, kept)
# one 64x32x32x32 fp32 map is 8 MiB; the stem and each block save about 3 (stem: conv in,
# BN in, relu out) and 6-7 (two convs' inputs, two BNs' inputs, relus' outputs, the sum):
# 3 + 2 x 7 = 17 maps at most, at least the 8 convolution and BN inputs a block pair saves
unit = 64 * 32 * 32 * 32 * 4
assert 8 * unit <= r.breakdown["activations"] <= 17 * unit + MiB, r.breakdown["activations"] / unit

# %% tags=["corpus"]
# memmagic resizes `inputs` and `targets`: twice the batch doubles the saved maps; bf16
# autocast halves the convolutions' outputs; no_grad saves nothing (inference_mode would
# meet the .item() defect of case 18 at the progress line)
WHATIF = [("batch_size", 128, "up"), ("amp", "bf16", "down"), ("grad_mode", "no_grad", "down")]
