# %% [markdown]
# LoRA written by hand (no peft): a frozen base Linear plus trainable A (r x in) and B
# (out x r) scaled by alpha / r, wrapped around the attention projections of a small
# transformer; only the adapters go to AdamW.

# %% tags=["setup"]
import torch
from torch import nn

class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, r=8, alpha=16):
        super().__init__()
        self.base = base
        self.base.weight.requires_grad_(False)
        if self.base.bias is not None:
            self.base.bias.requires_grad_(False)
        self.A = nn.Parameter(torch.randn(r, base.in_features) * 0.01)
        self.B = nn.Parameter(torch.zeros(base.out_features, r))
        self.scale = alpha / r
    def forward(self, x):
        return self.base(x) + (x @ self.A.t() @ self.B.t()) * self.scale

class Block(nn.Module):
    def __init__(self, d=1024):
        super().__init__()
        self.q, self.v = nn.Linear(d, d), nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
    def forward(self, x):
        a = torch.softmax(self.q(x) @ x.transpose(1, 2) / 32, dim=-1) @ self.v(x)
        return x + self.ff(x + a)

model = nn.Sequential(*[Block() for _ in range(4)])
for p in model.parameters():
    p.requires_grad_(False)
for blk in model:
    blk.q, blk.v = LoRALinear(blk.q), LoRALinear(blk.v)
model = model.cuda()
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
x = torch.randn(8, 256, 1024, device="cuda")

# %% tags=["step"]
loss = model(x).pow(2).mean()
loss.backward()
optimizer.step()
optimizer.zero_grad()

# %% tags=["check"]
d, rank = 1024, 8
block = [d * d, d, d * d, d, d * 4 * d, 4 * d, 4 * d * d, d]    # frozen: q, v, ff
lora = [rank * d, d * rank] * 2                                  # A and B for q and v
params = 4 * sum(rnd(n * 4) for n in block + lora)
assert r.breakdown["parameters"] == params
# AdamW's state is for the adapters only: 2 x 4 blocks x 2 x (8x1024 + 1024x8) fp32
assert r.after - r.before >= 2 * 4 * sum(rnd(n * 4) for n in lora)
assert r.breakdown["gradients"] <= 4 * sum(rnd(n * 4) for n in lora)

# %% tags=["corpus"]
WHATIF = [("amp", "bf16", "down"), ("checkpointing", True, "down"), ("batch_size", 16, "up")]
