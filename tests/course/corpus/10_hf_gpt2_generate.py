# %% [markdown]
# Sampling from a GPT-2 built from a config with `model.generate()` (the course's
# text-generation pipeline, minus the download): eval mode, a KV cache, no gradients.

# %% tags=["setup"]
import torch
from transformers import GPT2Config, GPT2LMHeadModel

config = GPT2Config(vocab_size=8000, n_positions=512, n_embd=384, n_layer=6, n_head=6,
                    bos_token_id=0, eos_token_id=0, pad_token_id=0)
model = GPT2LMHeadModel(config).to("cuda").eval()
prompt = torch.randint(1, 8000, (4, 32), device="cuda")

# %% tags=["step"]
out = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)

# %% tags=["check"]
V, P, d, L = 8000, 512, 384, 6
block = [d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d]
params = rnd(V * d * 4) + rnd(P * d * 4) + L * sum(rnd(n * 4) for n in block) + 2 * rnd(d * 4)
assert r.breakdown["parameters"] == params
# generate() runs under no_grad: nothing saved, no gradients
assert r.breakdown["activations"] == r.breakdown["gradients"] == 0
# the KV cache at its largest: 6 layers x (k, v) x 4 x 40 x 384 fp32 = 2.9 MB; with the
# last logits (4 x 8000 fp32) and the temporaries of a forward: well under 64 MiB
assert r.peak - r.before <= 64 * MiB
assert r.after - r.before <= rnd(4 * 40 * 8) + 2 * CUBLAS + 2 * MiB   # the ids kept in `out`

# %% tags=["corpus"]
WHATIF = [("weights_dtype", "bf16", "down"), ("amp", "fp16", "up"), ("batch_size", 8, "up")]
REFUSES = {}
