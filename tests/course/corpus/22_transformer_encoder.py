# %% [markdown]
# A text classifier on `nn.TransformerEncoder` (the PyTorch transformer tutorial's
# building block): token embeddings plus a learned position table, `batch_first=True`
# encoder layers with a key padding mask, a masked mean over the sequence, AdamW.

# %% tags=["setup"]
import torch
from torch import nn

device = "cuda"
V, T, d, heads, ff, L = 10000, 128, 256, 4, 1024, 3

class TextTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, d, padding_idx=0)
        self.pos = nn.Parameter(torch.zeros(1, T, d))
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, L, enable_nested_tensor=False)
        self.head = nn.Linear(d, 2)
    def forward(self, x):
        pad = x == 0
        h = self.encoder(self.emb(x) + self.pos, src_key_padding_mask=pad)
        h = h.masked_fill(pad.unsqueeze(-1), 0.0).sum(1) / (~pad).sum(1, keepdim=True)
        return self.head(h)

model = TextTransformer().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
tokens = torch.randint(1, V, (32, T), device=device)
tokens[:, 100:] = 0                                   # padding at the end
labels = torch.randint(0, 2, (32,), device=device)

# %% tags=["step"]
model.train()
logits = model(tokens)
loss = nn.functional.cross_entropy(logits, labels)
optimizer.zero_grad()
loss.backward()
optimizer.step()

# %% tags=["check"]
# per layer: in_proj 3d x d + 3d, out_proj d x d + d, linear1 ff x d + ff, linear2 d x ff + d,
# two LayerNorms (weight, bias)
layer = [3 * d * d, 3 * d, d * d, d, ff * d, ff, d * ff, d, d, d, d, d]
params = rnd(V * d * 4) + rnd(T * d * 4) + L * sum(rnd(n * 4) for n in layer) + rnd(2 * d * 4) + rnd(2 * 4)
assert r.breakdown["parameters"] == params
assert r.before == params + rnd(32 * T * 8) + rnd(32 * 8)   # tokens, labels (int64)
assert r.breakdown["optimizer_state"] in (0, 2 * params)
# gradients (zero_grad comes before backward) and AdamW's two moments stay
assert 3 * params <= r.after - r.before <= 3 * params + 2 * CUBLAS + 4 * MiB, (r.after - r.before, 3 * params)
# saved per layer for a 32 x 128 batch, in units of one 32x128x256 fp32 map (4 MiB): the
# layer's input, q/k/v and the attention output (the fused qkv in, its output 3 units, the
# attention's output and log-sum-exp), the out-projection's input, two bool dropout masks
# (1 B an element), the residual sums, both norms' inputs, the FFN's 4x-wide input of relu
# and of linear2 and its dropout mask: at least 8 units a layer, at most 24; three layers
unit = 32 * T * d * 4
assert 3 * 8 * unit <= r.breakdown["activations"] + r.breakdown["other"], r.breakdown
assert r.breakdown["activations"] <= 3 * 24 * unit + 2 * unit, r.breakdown["activations"]

# %% tags=["corpus"]
WHATIF = [("amp", "bf16", "down"), ("checkpointing", True, "down"), ("batch_size", 64, "up")]
