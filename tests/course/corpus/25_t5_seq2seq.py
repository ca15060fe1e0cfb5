# %% [markdown]
# A sequence-to-sequence model (T5 from a T5Config, no download) trained the way the
# course's translation / summarization chapter does: `input_ids`, `attention_mask` and
# `labels` with -100 on padding, `model(**batch).loss`, AdamW.

# %% tags=["setup"]
import torch
from transformers import T5Config, T5ForConditionalGeneration

config = T5Config(vocab_size=4000, d_model=256, d_kv=32, d_ff=1024, num_layers=3, num_decoder_layers=3,
                  num_heads=8, feed_forward_proj="relu", decoder_start_token_id=0, pad_token_id=0)
model = T5ForConditionalGeneration(config).to("cuda")
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
src = torch.randint(1, 4000, (16, 96), device="cuda")
tgt = torch.randint(1, 4000, (16, 48), device="cuda")
tgt[:, 40:] = -100                                      # ignored by the loss
batch = {"input_ids": src, "attention_mask": torch.ones_like(src), "labels": tgt}

# %% tags=["step"]
model.train()
loss = model(**batch).loss
loss.backward()
optimizer.step()
optimizer.zero_grad()

# %% tags=["check"]
V, d, I, L, H, B = 4000, 256, 1024, 3, 8, 32   # inner dim = heads x d_kv = 256; 32 buckets
attn = [d * d] * 4                              # q, k, v, o (T5 has no biases)
ff = [I * d, d * I]                             # wi, wo
enc = L * (attn + [d] + ff + [d]) + [B * H] + [d]                     # + rel. bias, final LN
dec = L * (attn + [d] + attn + [d] + ff + [d]) + [B * H] + [d]
params = sum(rnd(n * 4) for n in [V * d] + enc + dec)   # lm_head is tied to the embedding
assert r.breakdown["parameters"] == params
# the batch: input_ids and attention_mask 16 x 96, labels 16 x 48, all int64
assert r.before == params + 2 * rnd(16 * 96 * 8) + rnd(16 * 48 * 8)
assert r.breakdown["optimizer_state"] in (0, 2 * params)
assert 2 * params <= r.after - r.before <= 2 * params + 2 * CUBLAS + 4 * MiB, (r.after - r.before, 2 * params)
# the logits (16 x 48 x 4000 fp32 = 12.3 MB) and their log-softmax for the loss are alive
# in the forward's end; with the encoder's and decoder's saved maps the step needs more
# than 2 x 12.3 MB above what it keeps
assert r.peak - r.before >= 2 * params + 2 * 16 * 48 * 4000 * 4

# %% tags=["corpus"]
# bf16 weights halve the weights and what the graph saves; checkpointing the T5 blocks
# keeps only their inputs; twice the batch doubles the activations. (bf16 autocast raised
# the peak here, 271 -> 275 MB: T5 computes its softmax and norms in fp32 and the loss in
# fp32; not verified by hand, so not a move.)
WHATIF = [("weights_dtype", "bf16", "down"), ("checkpointing", True, "down"), ("batch_size", 32, "up")]
