# %% [markdown]
# A Hugging Face classifier (DistilBERT from a config, no download) trained in a plain
# PyTorch loop with bf16 autocast around the forward, as the "mixed precision without the
# Trainer" snippets write it: batches as dicts, AdamW, gradient clipping.

# %% tags=["setup"]
import torch
from transformers import DistilBertConfig, DistilBertForSequenceClassification

config = DistilBertConfig(vocab_size=6000, dim=256, n_layers=3, n_heads=4, hidden_dim=1024,
                          max_position_embeddings=256, num_labels=4)
model = DistilBertForSequenceClassification(config).to("cuda")
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
batches = [{"input_ids": torch.randint(0, 6000, (16, 128)),
            "attention_mask": torch.ones(16, 128, dtype=torch.long),
            "labels": torch.randint(0, 4, (16,))} for _ in range(2)]

# %% tags=["step"]
model.train()
for batch in batches:
    batch = {k: v.to("cuda") for k, v in batch.items()}
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        outputs = model(**batch)
    outputs.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()

# %% tags=["check"]
V, P, d, I, L = 6000, 256, 256, 1024, 3
emb = [V * d, P * d, d, d]                                      # words, positions, LayerNorm
layer = [d * d, d] * 4 + [d, d] + [I * d, I, d * I, d] + [d, d]   # q k v out, LN, ffn, LN
head = [d * d, d, 4 * d, 4]                                     # pre_classifier, classifier
params = sum(rnd(n * 4) for n in emb + L * layer + head)
assert r.breakdown["parameters"] == params
assert r.breakdown["buffers"] == rnd(P * 8)          # position_ids, int64
assert r.before == params + rnd(P * 8)
assert r.breakdown["optimizer_state"] in (0, 2 * params)
# AdamW's two moments stay (zero_grad frees the gradients), with the last batch
kept = 2 * params + 2 * rnd(16 * 128 * 8) + rnd(16 * 8)
assert kept <= r.after - r.before <= kept + 2 * CUBLAS + 4 * MiB, (r.after - r.before, kept)
# autocast keeps a bf16 copy of each weight a Linear used while its graph lives: the
# matmul weights are d*d*(4 + 1) + 2*I*d per layer, plus pre_classifier and classifier, in
# 2 B each; they are in `other` or `activations` at the peak, and one step's graph at most
bf16_weights = sum(rnd(n * 2) for n in L * [d * d] * 4 + L * [I * d] * 2 + [d * d, 4 * d])
assert r.peak - r.before >= 2 * params - bf16_weights   # Adam's first step, or the backward

# %% tags=["corpus"]
# the peak is in the second batch's forward (AdamW's state from the first step is there):
# bf16 weights halve weights and state, no_grad saves nothing, and save_on_cpu moves the
# saved activations (most of the peak) to the host
WHATIF = [("weights_dtype", "bf16", "down"), ("grad_mode", "no_grad", "down"), ("offload", True, "down")]
