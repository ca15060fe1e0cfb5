# %% [markdown]
# Variable-length token sequences through a DataLoader with a collate function that pads
# them (`pad_sequence`), a masked mean of the embeddings into an MLP classifier, Adam: the
# text-classification pattern of NLP courses before transformers.

# %% tags=["setup"]
import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

device = "cuda"
vocab, dim, hidden, classes = 20000, 128, 512, 5
lengths = [10 + (7 * i) % 50 for i in range(96)]          # 10 to 59 tokens
dataset = [(torch.randint(1, vocab, (n,)), torch.tensor(i % classes)) for i, n in enumerate(lengths)]

def collate(batch):
    seqs, ys = zip(*batch)
    return pad_sequence(seqs, batch_first=True, padding_value=0), torch.stack(ys)

loader = DataLoader(dataset, batch_size=32, shuffle=False, collate_fn=collate)

class BagClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, classes))
    def forward(self, x):
        mask = (x != 0).unsqueeze(-1).float()
        h = (self.emb(x) * mask).sum(1) / mask.sum(1).clamp(min=1)
        return self.mlp(h)

model = BagClassifier().to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
loss_fn = nn.CrossEntropyLoss()

# %% tags=["step"]
model.train()
for x, y in loader:
    x, y = x.to(device), y.to(device)
    loss = loss_fn(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

# %% tags=["check"]
# embedding 20000x128 (10.24 MB), Linear 128->512, Linear 512->5 (fp32)
params = sum(rnd(n * 4) for n in [vocab * dim, dim * hidden, hidden, hidden * classes, classes])
assert r.breakdown["parameters"] == params
assert r.before == params                    # the data is on the host
# zero_grad() comes before backward: the last step's gradients stay, and Adam's two moments
assert r.breakdown["optimizer_state"] in (0, 2 * params)
# the last batch: 32 sequences padded to the longest; lengths 10 + 7i mod 50 for i = 64..95
T = max(lengths[64:96])
kept = 3 * params + rnd(32 * T * 8) + rnd(32 * 8) + rnd(4)
assert kept <= r.after - r.before <= kept + 2 * CUBLAS + 2 * MiB, (r.after - r.before, kept)
# the embedding's output 32 x T x 128 fp32 (and the mask product, as much) is what is saved:
# a few hundred KiB a batch; the peak is Adam's first step (its state being made, 2x params)
assert r.breakdown["activations"] <= 4 * 32 * T * dim * 4 + MiB

# %% tags=["corpus"]
# bf16 weights halve the parameters, gradients and Adam state; no_grad has no backward and
# no step; the peak is Adam's first step, where no saved activation is left to offload
WHATIF = [("weights_dtype", "bf16", "down"), ("grad_mode", "no_grad", "down"), ("offload", True, "same")]
