# %% [markdown]
# A CNN classifier as the CIFAR-10 tutorial writes it: conv / pool / fc layers, SGD with
# momentum, a few mini-batches of 3x32x32 images.

# %% tags=["setup"]
import torch
import torch.nn as nn
import torch.nn.functional as F

device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(64, 128, 5)
        self.fc1 = nn.Linear(128 * 5 * 5, 1024)
        self.fc2 = nn.Linear(1024, 512)
        self.fc3 = nn.Linear(512, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)

net = Net().to(device)
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(net.parameters(), lr=0.001, momentum=0.9)
batch_size = 256

# %% tags=["step"]
running_loss = 0.0
for i in range(3):
    inputs = torch.randn(batch_size, 3, 32, 32, device=device)
    labels = torch.randint(0, 10, (batch_size,), device=device)
    optimizer.zero_grad()
    outputs = net(inputs)
    loss = criterion(outputs, labels)
    loss.backward()
    optimizer.step()
    running_loss += loss.item()

# %% tags=["check"]
sizes = [64 * 3 * 25, 64, 128 * 64 * 25, 128, 3200 * 1024, 1024, 1024 * 512, 512, 512 * 10, 10]
params = sum(rnd(n * 4) for n in sizes)
assert r.before == r.breakdown["parameters"] == params
# SGD with momentum keeps one momentum buffer per parameter
assert r.breakdown["optimizer_state"] in (0, params)
# zero_grad() sets the gradients to None at the start of each step, so after the loop the
# gradients, the momentum buffers, the last batch and its labels remain
kept = 2 * params + rnd(256 * 3 * 32 * 32 * 4) + rnd(256 * 8)
assert kept <= r.after - r.before <= kept + 2 * CUBLAS + 2 * MiB, (r.after - r.before, kept)
# activations of a 256-image batch: conv1's 256x64x28x28 output alone is 51.4 MB, saved
# (relu's output, which the pool saves too, and the pool's int64 indices: 25.7 MB); the
# peak comes in backward, once some are freed: 40-250 MiB
assert 40 * MiB <= r.breakdown["activations"] <= 250 * MiB, r.breakdown["activations"]

# %% tags=["corpus"]
# a larger batch grows the activations; fp16 autocast halves them; bf16 weights halve
# parameters, gradients and momentum
WHATIF = [("batch_size", 512, "up"), ("amp", "fp16", "down"), ("weights_dtype", "bf16", "down")]
