# %% [markdown]
# An exponential moving average of the weights kept in a `copy.deepcopy` of the model (the
# trick of diffusion and self-supervised training scripts): frozen, updated after every
# optimizer step under `torch.no_grad()`, SGD with momentum.

# %% tags=["setup"]
import copy
import torch
from torch import nn

device = "cuda"
model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(),
                      nn.Linear(2048, 512)).to(device)
ema = copy.deepcopy(model).eval()
for p in ema.parameters():
    p.requires_grad_(False)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
decay = 0.999

# %% tags=["step"]
for _ in range(3):
    x = torch.randn(256, 512, device=device)
    loss = (model(x) - x).pow(2).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.mul_(decay).add_(p, alpha=1 - decay)

# %% tags=["check"]
one = sum(rnd(n * 4) for n in [512 * 2048, 2048, 2048 * 2048, 2048, 2048 * 512, 512])
# the model and its copy: two sets of weights
assert r.breakdown["parameters"] == 2 * one
assert r.before == 2 * one
# momentum for the trained model only (the copy has no gradients, no state)
assert r.breakdown["optimizer_state"] in (0, one)
# left: momentum, the last step's gradients (set_to_none comes before backward), x, loss
kept = 2 * one + rnd(256 * 512 * 4) + rnd(4)
assert kept <= r.after - r.before <= kept + 2 * CUBLAS + 2 * MiB, (r.after - r.before, kept)
# the EMA update is in place: it adds nothing; what is saved for backward is at most the
# input, each Linear's output and each GELU's output (512 + 4 x 2048 + 512 floats a row)
assert r.breakdown["activations"] <= 256 * (512 + 4 * 2048 + 512) * 4

# %% tags=["corpus"]
# bf16 weights halve both copies of the weights; no_grad has no backward and no step;
# save_on_cpu packs every saved tensor, the Linear weights included, and the backward
# unpacks a GPU copy of each while the weights stay (the 2048x2048 one is 16 MiB): up
WHATIF = [("weights_dtype", "bf16", "down"), ("grad_mode", "no_grad", "down"), ("offload", True, "up")]
