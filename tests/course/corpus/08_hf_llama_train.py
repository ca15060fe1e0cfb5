# %% [markdown]
# A small Llama from a LlamaConfig (grouped-query attention, no download) trained one step
# the way the course's causal-LM chapter does: labels = input_ids, AdamW, grad clipping.

# %% tags=["setup"]
import torch
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(vocab_size=4000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
model = LlamaForCausalLM(config).to("cuda")
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
input_ids = torch.randint(0, 4000, (4, 512), device="cuda")

# %% tags=["step"]
loss = model(input_ids=input_ids, labels=input_ids).loss
loss.backward()
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
optimizer.step()
optimizer.zero_grad(set_to_none=True)

# %% tags=["check"]
V, d, I, L, kv = 4000, 256, 688, 4, 2 * 32   # 2 key/value heads of 256 / 8 = 32 dims
# q, k, v, o (no biases), gate, up, down, two RMSNorms per layer; embed, final norm and an
# untied lm_head
layer = [d * d, d * kv, d * kv, d * d, d * I, d * I, I * d, d, d]
params = rnd(V * d * 4) + L * sum(rnd(n * 4) for n in layer) + rnd(d * 4) + rnd(V * d * 4)
assert r.breakdown["parameters"] == params
assert r.after - r.before >= 2 * params   # AdamW's moments

# %% tags=["corpus"]
WHATIF = [("amp", "bf16", "down"), ("checkpointing", True, "down"), ("batch_size", 8, "up")]
