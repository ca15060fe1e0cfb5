# %% [markdown]
# A validation loop with the classic leak: `total_loss += loss` (a tensor with its graph)
# instead of `loss.item()`, outside no_grad, plus argmax accuracy.

# %% tags=["setup"]
import torch
from torch import nn
model = nn.Sequential(nn.Linear(512, 8192), nn.ReLU(), nn.Linear(8192, 10)).cuda()
val = [(torch.randn(256, 512, device="cuda"), torch.randint(0, 10, (256,), device="cuda")) for _ in range(4)]
criterion = nn.CrossEntropyLoss()

# %% tags=["step"]
model.eval()
total_loss, correct = 0, 0
for xb, yb in val:
    out = model(xb)
    loss = criterion(out, yb)
    total_loss += loss
    correct += (out.argmax(dim=1) == yb).sum().item()
acc = correct / (4 * 256)

# %% tags=["check"]
params = rnd(512 * 8192 * 4) + rnd(8192 * 4) + rnd(8192 * 10 * 4) + rnd(40)
assert r.breakdown["parameters"] == params
# each of the 4 graphs kept by total_loss holds its 256x8192 ReLU output (8 MiB: saved by
# the ReLU and by the second Linear), and cross entropy's 256x10 log-softmax: 32 MiB or
# more remain, and no more than the 4 graphs' hidden tensors with a pre-ReLU copy each
assert r.after - r.before >= 4 * 256 * 8192 * 4
assert r.after - r.before <= 4 * 2 * 256 * 8192 * 4 + 2 * CUBLAS + 2 * MiB

# %% tags=["corpus"]
# no backward in the cell: no grad_mode control. bf16 weights and bf16 autocast halve the
# hidden tensors the leaked graphs keep; another card changes nothing allocated
WHATIF = [("weights_dtype", "bf16", "down"), ("amp", "bf16", "down"), ("gpu", "A100-40GB", "same")]
