# %% [markdown]
# Mixed precision the way the AMP recipe writes it: torch.autocast fp16 and
# torch.amp.GradScaler("cuda"), scaler.scale(loss).backward(), scaler.step, scaler.update.

# %% tags=["setup"]
import torch
from torch import nn
device = "cuda"
model = nn.Sequential(*[nn.Sequential(nn.Linear(2048, 2048), nn.GELU()) for _ in range(6)], nn.Linear(2048, 100)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cuda")
x = torch.randn(512, 2048, device=device)
y = torch.randint(0, 100, (512,), device=device)

# %% tags=["step"]
for _ in range(2):
    with torch.autocast(device_type="cuda", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

# %% tags=["check"]
params = 6 * (rnd(2048 * 2048 * 4) + rnd(2048 * 4)) + rnd(2048 * 100 * 4) + rnd(400)
assert r.breakdown["parameters"] == params
assert r.breakdown["optimizer_state"] == 0          # plain SGD keeps nothing
# fp16 copies of the weights (half the parameters) live while the forward's graph holds them
assert r.peak - r.before >= params // 2

# %% tags=["corpus"]
# a bigger batch grows the activations; bf16 weights halve the 96 MiB of weights and their
# gradients; no_grad has no backward and no step. (Checkpointing is no move here: under
# autocast the recompute casts each block's weight to fp16 again, 8 MiB, as much as the
# 512x2048 activations it saves: the peak barely moves.)
WHATIF = [("batch_size", 1024, "up"), ("weights_dtype", "bf16", "down"), ("grad_mode", "no_grad", "down")]
