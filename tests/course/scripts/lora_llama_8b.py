"""LoRA fine-tuning of a Llama 3 8B built from its config, in the style of the short peft
training loops of model cards and blog posts (written here, in our own words): the base
model in bf16 (``_from_config(..., torch_dtype=torch.bfloat16)`` on the GPU), LoRA adapters
on the attention projections from ``get_peft_model``, AdamW over the adapters only, a
causal-LM loss on random token ids, an f-string log of the loss each step.

Its sizes are flags (Llama 3 8B's by default; the tests pass a small model), and so are the
batch and the context, so that the memory doctor can try smaller ones.

Run: ``python -m memmagic run --gpu RTX4090 --steps 2 lora_llama_8b.py --batch_size 1
--seq_len 8192`` (out of memory as written: the doctor ranks the fixes)."""

import argparse

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--batch_size", type=int, default=1)
p.add_argument("--seq_len", type=int, default=8192)
p.add_argument("--layers", type=int, default=32)
p.add_argument("--hidden", type=int, default=4096)
p.add_argument("--ffn", type=int, default=14336)
p.add_argument("--heads", type=int, default=32)
p.add_argument("--kv_heads", type=int, default=8)
p.add_argument("--vocab", type=int, default=128256)
p.add_argument("--rank", type=int, default=16)
p.add_argument("--steps", type=int, default=100)
args = p.parse_args()

config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.ffn,
                     num_hidden_layers=args.layers, num_attention_heads=args.heads,
                     num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                     max_position_embeddings=max(8192, args.seq_len))
with torch.device("cuda"):
    model = LlamaForCausalLM._from_config(config, torch_dtype=torch.bfloat16)
model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank,
                                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
model.print_trainable_parameters()
optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)

for step in range(args.steps):
    ids = torch.randint(0, args.vocab, (args.batch_size, args.seq_len), device="cuda")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"step {step}: loss {loss:.4f}")
