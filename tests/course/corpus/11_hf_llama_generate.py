# %% [markdown]
# Greedy decoding with `generate()` on a Llama built from a LlamaConfig, in bf16 weights as
# model cards load them (`torch_dtype=torch.bfloat16`, here `.to(torch.bfloat16)`).

# %% tags=["setup"]
import torch
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(vocab_size=16000, hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
                     num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2)
model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
input_ids = torch.randint(3, 16000, (2, 32), device="cuda")

# %% tags=["step"]
generated = model.generate(input_ids, max_new_tokens=8, do_sample=False)

# %% tags=["check"]
V, d, I, L = 16000, 512, 1376, 6
layer = [d * d] * 4 + [d * I] * 3 + [d, d]
params = rnd(V * d * 2) + L * sum(rnd(n * 2) for n in layer) + rnd(d * 2) + rnd(V * d * 2)   # bf16
assert r.breakdown["parameters"] == params
assert r.breakdown["activations"] == r.breakdown["gradients"] == 0
assert r.peak - r.before <= 64 * MiB

# %% tags=["corpus"]
WHATIF = [("weights_dtype", "fp32", "up"), ("batch_size", 8, "up"), ("amp", "bf16", "same")]
# generate() needs 10 MiB over the 67 MiB of weights, and the setup's segments (86 MiB
# reserved, the cache emptied) hold it: the allocator reuses the newest segments first, as on
# a GPU, so no card the setup fits on runs out at the step
XFAIL = {"oom": "the step fits in the free parts of the setup's segments: no card between them runs out"}
