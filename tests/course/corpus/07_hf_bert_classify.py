# %% [markdown]
# Fine-tuning a BERT sequence classifier from a BertConfig (the course's "train a
# classifier" chapter without a download): tokenized batch dict with labels, AdamW.

# %% tags=["setup"]
import torch
from transformers import BertConfig, BertForSequenceClassification

config = BertConfig(vocab_size=6000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                    intermediate_size=1024, max_position_embeddings=256, num_labels=3)
model = BertForSequenceClassification(config).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
batch = {"input_ids": torch.randint(0, 6000, (16, 128)).cuda(),
         "attention_mask": torch.ones(16, 128, dtype=torch.long).cuda(),
         "token_type_ids": torch.zeros(16, 128, dtype=torch.long).cuda(),
         "labels": torch.randint(0, 3, (16,)).cuda()}

# %% tags=["step"]
outputs = model(**batch)
outputs.loss.backward()
optimizer.step()
optimizer.zero_grad()

# %% tags=["check"]
V, P, d, I, L = 6000, 256, 256, 1024, 4
emb = [V * d, P * d, 2 * d, d, d]                     # word, position, token type, LayerNorm
layer = [d * d, d] * 4 + [d, d] + [d * I, I, I * d, d, d, d]   # q k v o, LN, ffn, LN
head = [d * d, d, 3 * d, 3]                            # pooler, classifier
params = sum(rnd(n * 4) for n in emb + L * layer + head)
assert r.breakdown["parameters"] == params
assert r.after - r.before >= 2 * params   # AdamW's moments

# %% tags=["corpus"]
WHATIF = [("amp", "fp16", "down"), ("weights_dtype", "bf16", "down"), ("grad_mode", "no_grad", "down")]
