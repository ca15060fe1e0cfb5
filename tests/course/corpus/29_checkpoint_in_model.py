# %% [markdown]
# Activation checkpointing written into the model, as large-model repositories do it:
# `torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)` around each residual
# MLP block while training, plain calls in eval; AdamW.

# %% tags=["setup"]
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

device = "cuda"
d, n_blocks = 256, 6

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)
    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.ln(x))))

class DeepMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.head = nn.Linear(d, 1)
    def forward(self, x):
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=False) if self.training else blk(x)
        return self.head(x)

model = DeepMLP().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(64, 128, d, device=device)

# %% tags=["step"]
model.train()
loss = model(x).pow(2).mean()
loss.backward()
optimizer.step()
optimizer.zero_grad()

# %% tags=["check"]
block = [d, d, 4 * d * d, 4 * d, 4 * d * d, d]        # LayerNorm, fc1, fc2
params = n_blocks * sum(rnd(n * 4) for n in block) + rnd(d * 4) + rnd(4)
assert r.breakdown["parameters"] == params
assert r.before == params + rnd(64 * 128 * d * 4)
assert r.breakdown["optimizer_state"] in (0, 2 * params)
assert 2 * params <= r.after - r.before <= 2 * params + 2 * CUBLAS + 4 * MiB + rnd(4)
# a 64x128x256 fp32 map is 8 MiB (one unit); without checkpointing each block saves ~11
# units (LN in, fc1 in, fc1 out and GELU out at 4 units each, fc2 in is GELU out); with it
# only each block's input is kept (6 units, the first is x itself), and one block's
# ~11 units are recomputed at a time in backward: at most 6 + 11 + 1 units at the peak,
# far below the 66 units the blocks would save without it
unit = 64 * 128 * d * 4
assert r.breakdown["activations"] <= 18 * unit, r.breakdown["activations"] / unit
assert r.peak - r.before <= 2 * params + 24 * unit, (r.peak - r.before) / unit

# %% tags=["corpus"]
# the model is already checkpointed: memmagic's checkpointing on top changes nothing it
# saves; a bigger batch of x and bf16 weights move it as usual
WHATIF = [("batch_size", 128, "up"), ("weights_dtype", "bf16", "down"), ("grad_mode", "no_grad", "down")]
