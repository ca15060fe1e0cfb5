# %% [markdown]
# A custom `torch.autograd.Function` (the "extending PyTorch" tutorial): a squared ReLU
# whose forward saves only its ReLU output with `ctx.save_for_backward` and whose backward
# computes the gradient from it, used as a module in an MLP trained with Adam.

# %% tags=["setup"]
import torch
from torch import nn

class SquaredReLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.relu(x)
        ctx.save_for_backward(y)
        return y * y
    @staticmethod
    def backward(ctx, grad_out):
        (y,) = ctx.saved_tensors
        return grad_out * 2 * y

class SquaredReLU(nn.Module):
    def forward(self, x):
        return SquaredReLUFn.apply(x)

device = "cuda"
model = nn.Sequential(nn.Linear(512, 2048), SquaredReLU(), nn.Linear(2048, 2048), SquaredReLU(),
                      nn.Linear(2048, 10)).to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
x = torch.randn(1024, 512, device=device)
y = torch.randint(0, 10, (1024,), device=device)

# %% tags=["step"]
loss = nn.functional.cross_entropy(model(x), y)
loss.backward()
optimizer.step()
optimizer.zero_grad()

# %% tags=["check"]
params = sum(rnd(n * 4) for n in [512 * 2048, 2048, 2048 * 2048, 2048, 2048 * 10, 10])
assert r.breakdown["parameters"] == params
assert r.before == params + rnd(1024 * 512 * 4) + rnd(1024 * 8)
assert r.breakdown["optimizer_state"] in (0, 2 * params)
assert 2 * params <= r.after - r.before <= 2 * params + 2 * CUBLAS + 2 * MiB + rnd(4)
# saved at the end of the forward: x by the first Linear (2 MiB), each function's ReLU
# output (1024x2048 fp32 = 8 MiB, ctx.save_for_backward), each squared output that the
# next Linear saves (8 MiB), the log-softmax (40 KiB): 2 + 4 x 8 MiB = 34 MiB
saved = 1024 * 512 * 4 + 4 * 1024 * 2048 * 4
assert r.breakdown["activations"] <= saved + MiB, (r.breakdown["activations"], saved)
assert r.peak - r.before >= saved - 1024 * 512 * 4   # x was there before the step

# %% tags=["corpus"]
WHATIF = [("batch_size", 2048, "up"), ("weights_dtype", "bf16", "down"), ("grad_mode", "no_grad", "down")]
