# %% [markdown]
# PyTorch's quickstart, in our words: an MLP over 28x28 images (FashionMNIST-shaped random
# data in a TensorDataset), a DataLoader, SGD-free Adam, one epoch of the train loop.

# %% tags=["setup"]
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

device = torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else "cpu"
train_data = TensorDataset(torch.randn(256, 1, 28, 28), torch.randint(0, 10, (256,)))
loader = DataLoader(train_data, batch_size=64, shuffle=True)

class NeuralNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.stack = nn.Sequential(nn.Linear(28 * 28, 2048), nn.ReLU(),
                                   nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))
    def forward(self, x):
        return self.stack(self.flatten(x))

model = NeuralNetwork().to(device)
loss_fn = nn.CrossEntropyLoss()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

# %% tags=["step"]
model.train()
for batch, (X, y) in enumerate(loader):
    X, y = X.to(device), y.to(device)
    loss = loss_fn(model(X), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()

# %% tags=["check"]
# parameters: 784x2048 + 2048 + 2048x2048 + 2048 + 2048x10 + 10, fp32, each tensor rounded
# up to 512 B by the allocator (the 10-float bias is 40 B -> 512 B)
params = rnd(784 * 2048 * 4) + rnd(2048 * 4) + rnd(2048 * 2048 * 4) + rnd(2048 * 4) + rnd(2048 * 10 * 4) + rnd(10 * 4)
assert r.breakdown["parameters"] == params
assert r.before == params                    # only the model is on the GPU before the step
# Adam keeps exp_avg and exp_avg_sq per parameter: 2x; zero_grad() frees the gradients
assert r.breakdown["optimizer_state"] == 2 * params
# the step leaves Adam's state, the last batch (64x784 fp32 and 64 int64), the loss, and
# the cuBLAS workspaces of the first matmuls (forward thread + cuBLASLt, backward thread)
kept = 2 * params + rnd(64 * 784 * 4) + rnd(64 * 8) + rnd(4) + 2 * CUBLAS + MiB
assert kept <= r.after - r.before <= kept + 4 * MiB, (r.after - r.before, kept)
# activations of a 64-sample batch: under 2 MiB (64 x (784 + 4 x 2048) x 4 B = 2.2 MB at most)
assert r.breakdown["activations"] < 3 * MiB

# %% tags=["corpus"]
# the peak is Adam's first step (state being made): bf16 weights halve everything, no_grad
# has no step at all, and offloading saved activations cannot change a peak where none is saved
WHATIF = [("weights_dtype", "bf16", "down"), ("grad_mode", "no_grad", "down"), ("offload", True, "same")]
