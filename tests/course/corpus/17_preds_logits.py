# %% [markdown]
# Collecting a transformers model's outputs in a list (issue 23, item 9):
# `preds.append(model(x).logits)` without no_grad keeps each graph alive.

# %% tags=["setup"]
import torch
from transformers import GPT2Config, GPT2LMHeadModel
model = GPT2LMHeadModel(GPT2Config(vocab_size=4000, n_positions=128, n_embd=128, n_layer=2, n_head=4,
                                   bos_token_id=0, eos_token_id=0)).cuda()
x = torch.randint(0, 4000, (8, 128), device="cuda")

# %% tags=["step"]
preds = []
for _ in range(4):
    preds.append(model(x).logits)

# %% tags=["check"]
# each logits tensor: 8 x 128 x 4000 fp32 = 16,384,000 B; four of them, and their graphs
assert r.after - r.before >= 4 * 8 * 128 * 4000 * 4
V, P, d, L = 4000, 128, 128, 2
block = [d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d]
assert r.breakdown["parameters"] == rnd(V * d * 4) + rnd(P * d * 4) + L * sum(rnd(n * 4) for n in block) + 2 * rnd(d * 4)

# %% tags=["corpus"]
# no backward in the cell: no grad_mode control. bf16 autocast makes the kept logits bf16;
# bf16 weights halve the graphs' tensors too; twice the batch doubles the kept logits
WHATIF = [("amp", "bf16", "down"), ("weights_dtype", "bf16", "down"), ("batch_size", 16, "up")]
