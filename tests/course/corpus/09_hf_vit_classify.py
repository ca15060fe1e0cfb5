# %% [markdown]
# Image classification with a ViT from a ViTConfig (the course's vision chapter, no
# download): pixel_values and labels, `model(**batch).loss`, AdamW.

# %% tags=["setup"]
import torch
from transformers import ViTConfig, ViTForImageClassification

config = ViTConfig(image_size=224, patch_size=16, hidden_size=192, num_hidden_layers=4,
                   num_attention_heads=3, intermediate_size=768, num_labels=10)
model = ViTForImageClassification(config).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
batch = {"pixel_values": torch.randn(32, 3, 224, 224, device="cuda"),
         "labels": torch.randint(0, 10, (32,), device="cuda")}

# %% tags=["step"]
model.train()
loss = model(**batch).loss
loss.backward()
optimizer.step()
optimizer.zero_grad()

# %% tags=["check"]
d, I, L, N = 192, 768, 4, (224 // 16) ** 2
emb = [d, (N + 1) * d, d * 3 * 16 * 16, d]            # cls token, positions, patch conv
layer = [d * d, d] * 4 + [d * I, I, I * d, d] + [d, d, d, d]   # q k v o, mlp, two LNs
params = sum(rnd(n * 4) for n in emb + L * layer + [d, d, d * 10, 10])   # final LN, head
assert r.breakdown["parameters"] == params
assert r.before == params + rnd(32 * 3 * 224 * 224 * 4) + rnd(32 * 8)
assert r.after - r.before >= 2 * params   # AdamW's moments

# %% tags=["corpus"]
WHATIF = [("amp", "fp16", "down"), ("checkpointing", True, "down"), ("batch_size", 64, "up")]
