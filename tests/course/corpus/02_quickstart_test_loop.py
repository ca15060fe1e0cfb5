# %% [markdown]
# The quickstart's test loop: model.eval(), torch.no_grad(), the loss summed with .item()
# and accuracy from argmax, over a DataLoader of a TensorDataset.

# %% tags=["setup"]
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

device = "cuda" if torch.cuda.is_available() else "cpu"
test_data = TensorDataset(torch.randn(512, 1, 28, 28), torch.randint(0, 10, (512,)))
test_loader = DataLoader(test_data, batch_size=128)
model = nn.Sequential(nn.Flatten(), nn.Linear(784, 4096), nn.ReLU(), nn.Linear(4096, 4096),
                      nn.ReLU(), nn.Linear(4096, 10)).to(device)
loss_fn = nn.CrossEntropyLoss()

# %% tags=["step"]
model.eval()
test_loss, correct = 0.0, 0
with torch.no_grad():
    for X, y in test_loader:
        X, y = X.to(device), y.to(device)
        pred = model(X)
        test_loss += loss_fn(pred, y).item()
        correct += (pred.argmax(1) == y).type(torch.float).sum().item()
test_loss /= len(test_loader)
accuracy = correct / len(test_loader.dataset)

# %% tags=["check"]
# 784x4096 + 4096 + 4096x4096 + 4096 + 4096x10 + 10 fp32 (the 10-float bias rounds to 512 B)
params = rnd(784 * 4096 * 4) + rnd(4096 * 4) + rnd(4096 * 4096 * 4) + rnd(4096 * 4) + rnd(40960 * 4) + rnd(40)
assert r.before == r.breakdown["parameters"] == params
# no_grad: nothing saved, no gradients, no optimizer
assert r.breakdown["activations"] == r.breakdown["gradients"] == r.breakdown["optimizer_state"] == 0
# at most a batch in, two 128x4096 hidden tensors and the logits at once: under 6 MiB of
# tensors above the parameters (128x784x4 + 2x128x4096x4 = 4.6 MB), plus the workspace
assert r.peak - r.before <= 6 * MiB + CUBLAS + MiB
assert r.after - r.before <= 1 * MiB + CUBLAS + MiB   # the last batch and outputs, the workspace

# %% tags=["corpus"]
# bf16 weights halve the parameters; fp16 autocast makes a half copy of each fp32 weight
# as it runs (the 4096x4096 one is 32 MiB) on top of them; an in-place ReLU writes into
# the Linear output, but the next Linear still holds its input and output at once
WHATIF = [("weights_dtype", "bf16", "down"), ("amp", "fp16", "up"), ("inplace", True, "same")]
