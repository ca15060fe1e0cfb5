# %% [markdown]
# A fully connected autoencoder on MNIST-shaped images (the "build an autoencoder"
# tutorial): an encoder to a 32-d code, a decoder with a sigmoid, MSE against the input,
# Adam, a few epochs over a TensorDataset.

# %% tags=["setup"]
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

device = "cuda"

class AutoEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(),
                                     nn.Linear(256, 32))
        self.decoder = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1024), nn.ReLU(),
                                     nn.Linear(1024, 784), nn.Sigmoid())
    def forward(self, x):
        return self.decoder(self.encoder(x))

model = AutoEncoder().to(device)
criterion = nn.MSELoss()
loader = DataLoader(TensorDataset(torch.rand(256, 784)), batch_size=128, shuffle=True)

# %% tags=["step"]
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for epoch in range(2):
    for (img,) in loader:
        img = img.to(device)
        recon = model(img)
        loss = criterion(recon, img)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

# %% tags=["check"]
layers = [(784, 1024), (1024, 256), (256, 32), (32, 256), (256, 1024), (1024, 784)]
params = sum(rnd(i * o * 4) + rnd(o * 4) for i, o in layers)
assert r.breakdown["parameters"] == params
assert r.before == params
# gradients stay (zero_grad comes before backward) with Adam's two moments
assert r.breakdown["optimizer_state"] in (0, 2 * params)
kept = 3 * params + rnd(128 * 784 * 4) + rnd(128 * 784 * 4) + rnd(4)   # + img, recon, loss
assert kept <= r.after - r.before <= kept + 2 * CUBLAS + 2 * MiB, (r.after - r.before, kept)
# saved for backward in one step of 128 images: the input and every layer's output
# (784 + 1024 + 1024 + 256 + 256 + 32 + 256 + 256 + 1024 + 1024 + 784 + 784 floats a row,
# counting each ReLU's output and the Sigmoid's) = 7,504 x 128 x 4 B = 3.7 MiB at most
assert r.breakdown["activations"] <= 7504 * 128 * 4

# %% tags=["corpus"]
WHATIF = [("weights_dtype", "bf16", "down"), ("optimizer", "sgd", "down"), ("grad_mode", "no_grad", "down")]
