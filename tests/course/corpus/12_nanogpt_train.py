# %% [markdown]
# nanoGPT's training loop in miniature, written out: a GPT with causal self-attention
# (F.scaled_dot_product_attention), AdamW with weight-decay groups (2-D tensors decay,
# biases and norms do not), torch.autocast bf16, grad clipping, set_to_none.

# %% tags=["setup"]
import math
import torch
import torch.nn as nn
import torch.nn.functional as F

block_size, vocab_size, n_layer, n_head, n_embd, batch_size = 256, 8192, 4, 4, 256, 16
device = "cuda"

class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight   # weight tying
    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

model = GPT().to(device)
param_dict = {pn: p for pn, p in model.named_parameters() if p.requires_grad}
decay = [p for p in param_dict.values() if p.dim() >= 2]
nodecay = [p for p in param_dict.values() if p.dim() < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                               {"params": nodecay, "weight_decay": 0.0}], lr=6e-4, betas=(0.9, 0.95))
data = torch.randint(0, vocab_size, (100_000,))

def get_batch():
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x.to(device), y.to(device)

# %% tags=["step"]
X, Y = get_batch()
with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
    logits, loss = model(X, Y)
loss.backward()
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
optimizer.step()
optimizer.zero_grad(set_to_none=True)

# %% tags=["check"]
C, V, T, L = 256, 8192, 256, 4
# tied wte/lm_head counted once; wpe; per block two LNs, c_attn, c_proj, the MLP; ln_f
block = [C, C, C * 3 * C, 3 * C, C * C, C, C, C, C * 4 * C, 4 * C, 4 * C * C, C]
params = rnd(V * C * 4) + rnd(T * C * 4) + L * sum(rnd(n * 4) for n in block) + 2 * rnd(C * 4)
assert r.breakdown["parameters"] == params
assert r.after - r.before >= 2 * params   # AdamW's moments
# the forward's end: the bf16 logits, 16 x 256 x 8192 x 2 B = 64 MiB, and the log-softmax
# cross entropy saves from them (the same shape, bf16 or fp32: 64 MiB at least) are alive
# at once, on top of the parameters: the step needs 128 MiB more than it starts with
assert r.peak - r.before >= 2 * 16 * 256 * 8192 * 2, r.peak - r.before

# %% tags=["corpus"]
WHATIF = [("grad_mode", "no_grad", "down"), ("checkpointing", True, "down"), ("weights_dtype", "bf16", "down")]
