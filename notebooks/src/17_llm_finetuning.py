# %% [markdown]
# # Fine-tuning an LLM: full, LoRA, LoRA + checkpointing, QLoRA
#
# "Will this 1B model fine-tune on my card, and with which settings?" The web
# calculators answer with a formula. Here the answer comes from running the training
# step itself on the simulated GPU: a model with TinyLlama-1.1B's shape, built from a
# `transformers` config (nothing is downloaded), fine-tuned four ways, and judged
# against a T4 (16 GB), an RTX 4090 (24 GB) and an A100 (80 GB).
#
# **You will learn** where the memory of full fine-tuning goes, what LoRA removes
# (gradients and optimizer state of the frozen base), what checkpointing adds on top,
# what a 4-bit base (QLoRA) takes off the weights, and how the largest batch and the
# longest context follow.

# %%
# %load_ext memmagic
# %matplotlib inline
import torch
from torch import nn
import matplotlib.pyplot as plt
torch.manual_seed(0)
from memmagic import format_bytes

# %%
import warnings
# peft 0.21 reads a transformers attribute that transformers 5 renamed: a FutureWarning per model
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*gradient_checkpointing_enable.*", category=FutureWarning)
from memmagic import Cell, Setting
from memmagic.whatif import sweep
from memmagic.backends.sim.gpus import resolve_target

CARDS = {name: resolve_target(name).total_memory for name in ("T4", "RTX4090", "A100-80GB")}

# %% [markdown]
# ## 1. The model and the four recipes
#
# Full fine-tuning keeps fp32 master weights and runs the forward under bf16 autocast
# (the usual mixed-precision recipe): 4 bytes of weights, 4 of gradients and 8 of
# AdamW's two moments for each of the 1.1 B parameters, 16 bytes in all, before any
# activation. LoRA loads the base in bf16, freezes it, and trains rank-16 adapters on
# the attention projections. QLoRA stores the base's linear layers in 4-bit NF4 with
# bitsandbytes (half a byte a weight, plus the quantization state), as
# `from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))` does
# on loading; with no checkpoint to load, the cell swaps the layers itself and `.to("cuda")`
# packs them. `prepare_model_for_kbit_training` then casts the embeddings, the head and
# the norms to fp32, and it runs with checkpointing, as the QLoRA recipe does. The cells
# read `batch_size` and `seq_len`, so the what-if engine can move them.

# %%
SETUP = """
from transformers import LlamaConfig, LlamaForCausalLM
from peft import LoraConfig, get_peft_model
cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                  num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                  max_position_embeddings=8192, use_cache=False)
"""
FULL = SETUP + """
model = LlamaForCausalLM(cfg).to("cuda")                       # fp32 master weights
opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
"""
LORA = SETUP + """
model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)       # the frozen base, bf16
model = get_peft_model(model, LoraConfig(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
"""
QLORA = SETUP + """
import bitsandbytes as bnb
from peft import prepare_model_for_kbit_training
model = LlamaForCausalLM(cfg).to(torch.bfloat16)
for block in model.model.layers:              # the linear layers a 4-bit load replaces
    for parent in (block.self_attn, block.mlp):
        for name, lin in list(parent.named_children()):
            if isinstance(lin, nn.Linear):
                q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False,
                                      compute_dtype=torch.bfloat16, quant_type="nf4",
                                      compress_statistics=True)
                q.weight = bnb.nn.Params4bit(lin.weight.data, quant_type="nf4",
                                             compress_statistics=True, module=q)
                setattr(parent, name, q)
model = prepare_model_for_kbit_training(model.to("cuda"))    # .to("cuda") packs the 4-bit weights
model = get_peft_model(model, LoraConfig(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
"""
STEP = """
ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len), device="cuda")
with torch.autocast("cuda", dtype=torch.bfloat16):
    loss = model(input_ids=ids, labels=ids).loss
loss.backward()
opt.step()
opt.zero_grad(set_to_none=True)
"""
batch_size, seq_len = 4, 512
full = Cell(FULL + STEP, globals(), backend="sim", backend_options={"gpu": "A100-80GB"})
lora = Cell(LORA + STEP, globals(), backend="sim", backend_options={"gpu": "A100-80GB"})
qlora = Cell(QLORA + STEP, globals(), backend="sim", backend_options={"gpu": "A100-80GB"})
recipes = {"full fine-tuning": (full, Setting()), "LoRA": (lora, Setting()),
           "LoRA + checkpointing": (lora, Setting(checkpointing=True)),
           "QLoRA (+ checkpointing)": (qlora, Setting(checkpointing=True))}

# %% [markdown]
# ## 2. One step at batch 4 x 512 tokens
#
# The peak of each recipe, and what it is made of. `parameters` splits into what is
# trained and what is frozen.

# %%
reports = {}
for name, (cell, setting) in recipes.items():
    r = reports[name] = cell.run(setting)
    print(f"{name:<25} peak {format_bytes(r.peak):>10}  reserved {format_bytes(r.reserved_peak):>10}")
    for cat, nbytes, share in r.breakdown_rows():
        extra = r.parameters_text() if cat == "parameters" else ""
        print(f"    {cat:<16}{format_bytes(nbytes):>11}  {extra}".rstrip())

# %% [markdown]
# Full fine-tuning's gradients and optimizer state are the weights' size once and twice
# over; LoRA keeps a bf16 base (half the fp32 weights) with no gradient and no optimizer
# state, and its adapters are a fraction of a percent. What is left is activations,
# which checkpointing trades for a second forward per layer. QLoRA's frozen part is the
# 4-bit layers (a quarter of the bf16 base's bytes, with their quantization state) and the
# fp32 embeddings and head that `prepare_model_for_kbit_training` keeps; the note under a
# report names the bitsandbytes kernels that ran.

# %% [markdown]
# ## 3. The largest batch and the longest context each card allows
#
# A sweep runs each recipe across batch sizes (at 512 tokens) and across context
# lengths (at batch 1). A run fits a card when what it needs of the whole card, its
# reserved peak plus the CUDA context (`r.card_need`; the context is a published figure
# the report names), stays within the card's memory. The runs do not depend on the card,
# so each is judged against all three.

# %%
def largest(curve, card_bytes):
    """The largest value whose run fits the card ("16+": every value tried fits; "-": none)."""
    fits = [v for v, r in curve if r.error is None and r.card_need <= card_bytes]
    if not fits:
        return "-"
    return f"{max(fits)}+" if len(fits) == len(curve) else str(max(fits))

rows = []
for name, (cell, setting) in recipes.items():
    by_batch = sweep(cell, "batch_size", "1:16", {name: setting},
                     setting=setting.replace(seq_len=512)).curves[name]
    by_context = sweep(cell, "seq_len", "512:8192", {name: setting},
                       setting=setting.replace(batch_size=1)).curves[name]
    for card, nbytes in CARDS.items():
        rows.append((name, card, largest(by_batch, nbytes), largest(by_context, nbytes)))

print(f"{'recipe':<25}{'card':<11}{'batch @512':>11}{'context @1':>12}")
for name, card, b, t in rows:
    print(f"{name:<25}{card:<11}{b:>11}{t:>12}")

# %% [markdown]
# A dash: not even the smallest value tried fits; "16+": every value tried fits (the
# sweep stopped there, not the card). Powers of two only: the sweep's values
# (`find_batch_size` and `find_seq_len` bisect further, one card at a time). Full
# fine-tuning does not fit a T4 at all: 16 bytes a parameter are 16.4 GiB before the
# first activation.
#
# ## What is not here
#
# bitsandbytes' CUDA kernels may allocate buffers inside themselves; the simulation counts
# what their registered fake kernels return (the report's note says so). The CUDA context
# is a published figure (about 400 MB with lazy module loading), not one measured on these
# cards, and fragmentation beyond the allocator model's is not counted: leave some room.
