# %% [markdown]
# A GRU sentence classifier as course notebooks write it: padded token ids, an embedding,
# a bidirectional GRU, the last hidden states into a linear head, AdamW.

# %% tags=["setup"]
import torch
from torch import nn

device = "cuda"

class GRUClassifier(nn.Module):
    def __init__(self, vocab=20000, dim=256, hidden=512, classes=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.gru = nn.GRU(dim, hidden, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, tokens):
        _, h = self.gru(self.emb(tokens))
        return self.head(torch.cat([h[0], h[1]], dim=1))

model = GRUClassifier().to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
tokens = torch.randint(1, 20000, (64, 48), device=device)
labels = torch.randint(0, 4, (64,), device=device)

# %% tags=["step"]
logits = model(tokens)
loss = nn.functional.cross_entropy(logits, labels)
loss.backward()
opt.step()
opt.zero_grad()

# %% tags=["check"]
# embedding 20000x256; per direction: w_ih 1536x256, w_hh 1536x512, two 1536 biases; head
sizes = [20000 * 256] + 2 * [1536 * 256, 1536 * 512, 1536, 1536] + [4 * 1024, 4]
params = sum(rnd(n * 4) for n in sizes)
assert r.breakdown["parameters"] == params
assert r.before == params + rnd(64 * 48 * 8) + rnd(64 * 8)
# AdamW's two moments are what the step leaves (zero_grad frees the gradients)
assert 2 * params <= r.after - r.before <= 2 * params + 2 * CUBLAS + 2 * MiB
# the embedding's output (64x200x256 fp32 = 13.1 MB) and the GRU's saved gates: 13-300 MiB
assert 13 * MiB <= r.breakdown["activations"] + r.breakdown["other"] <= 300 * MiB

# %% tags=["corpus"]
# memmagic resizes the batch tensors the cell names (tokens, labels) along their first dim
WHATIF = [("weights_dtype", "bf16", "down"), ("grad_mode", "inference_mode", "down"), ("batch_size", 128, "up")]
