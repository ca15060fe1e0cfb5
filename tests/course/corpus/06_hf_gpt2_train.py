# %% [markdown]
# The Hugging Face course's manual training loop on a GPT-2 built from a config (no
# download): a dict batch, `model(**batch).loss`, AdamW, a linear schedule, zero_grad.

# %% tags=["setup"]
import torch
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

config = GPT2Config(vocab_size=8000, n_positions=256, n_embd=256, n_layer=4, n_head=4,
                    bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config).to("cuda")
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=0, num_training_steps=100)
ids = torch.randint(0, 8000, (8, 256), device="cuda")
batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

# %% tags=["step"]
model.train()
outputs = model(**batch)
loss = outputs.loss
loss.backward()
optimizer.step()
scheduler.step()
optimizer.zero_grad()

# %% tags=["check"]
V, P, d, L = 8000, 256, 256, 4
# wte, wpe; per block ln_1, c_attn, c_proj, ln_2, c_fc, c_proj (weights and biases); ln_f;
# lm_head is tied to wte (no tensor of its own)
block = [d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d]
params = rnd(V * d * 4) + rnd(P * d * 4) + L * sum(rnd(n * 4) for n in block) + 2 * rnd(d * 4)
assert r.breakdown["parameters"] == params
# AdamW's moments stay, the gradients go (zero_grad), and the loss with its outputs
assert r.after - r.before >= 2 * params
# the logits alone are 8 x 256 x 8000 fp32 = 65.5 MB, with their log-softmax saved for the
# loss as much again: the activations at the peak are 60 MiB to 1 GiB
assert 60 * MiB <= r.peak - r.before - 2 * params

# %% tags=["corpus"]
WHATIF = [("amp", "bf16", "down"), ("checkpointing", True, "down"), ("batch_size", 16, "up")]
