# %% [markdown]
# # First steps with memmagic
#
# `%%gpumem` runs a cell and shows what it did to memory: the **peak**, what the cell left allocated (**retained**), and a breakdown at the peak into parameters, buffers, gradients, optimizer state, activations (tensors autograd saved for backward) and other (inputs, outputs, temporaries).
#
# This notebook runs on any laptop: `--backend cpu` runs the cell for real on the CPU and tracks every tensor op by op. On a machine with a GPU, drop `--backend cpu` and the same magic reads the CUDA caching allocator instead.

# %%
# %load_ext memmagic
import torch
torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"

# %% [markdown]
# ## One training step
#
# A 4096x4096 linear layer has 16.8 M parameters: 64 MiB in fp32. Adam keeps two more tensors of that size per parameter, and backward makes the gradients.

# %%
# %%gpumem --backend cpu
model = torch.nn.Linear(4096, 4096, device=device)
opt = torch.optim.Adam(model.parameters())
loss = model(torch.randn(64, 4096, device=device)).sum()
loss.backward(); opt.step()

# %% [markdown]
# The peak came inside `opt.step()`: parameters, gradients, the freshly made Adam state and the step's temporaries were live together. The report is an object: `-o` returns it, `-v NAME` stores it, `-q` prints nothing.

# %%
# %%gpumem --backend cpu -q -v second_step
loss = model(torch.randn(64, 4096, device=device)).sum()
loss.backward(); opt.step(); opt.zero_grad()

# %%
print(second_step.summary())

# %%
{k: f"{v / 2**20:.2f} MiB" for k, v in second_step.breakdown.items()}

# %% [markdown]
# ## Evaluation without a graph
#
# Under `torch.no_grad()` autograd saves nothing for backward, so activations do not pile up.

# %%
x = torch.randn(256, 4096, device=device)
deep = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, device=device) for _ in range(4)])

# %%
# %%gpumem --backend cpu -q -v without_grad
with torch.no_grad():
    out = deep(x).relu()

# %%
# %%gpumem --backend cpu -q -v with_grad
del out
out = deep(x).relu()

# %%
from memmagic import format_bytes
print('activations under no_grad:', format_bytes(without_grad.breakdown['activations']))
print('activations with grad:   ', format_bytes(with_grad.breakdown['activations']))
print('4 layers x 256 x 4096 fp32 inputs + the relu output:', format_bytes(5 * 256 * 4096 * 4))

# %% [markdown]
# ## No GPU? Simulate one
#
# `--backend sim` runs code written for a GPU (`device="cuda"`, `.cuda()`, `torch.autocast("cuda")`) on *fake* tensors: shapes and dtypes, no data, so it is fast and needs no memory. It predicts what the CUDA caching allocator would hold, including **reserved** memory (what `nvidia-smi` shows, minus the CUDA context). `--gpu NAME` checks the prediction against a card. Nothing real is touched: `model` and `opt` from the cells above are exactly as they were afterwards.

# %%
# %%gpumem --backend sim --gpu T4 --no-chart
gpu_model = torch.nn.Linear(4096, 4096, device="cuda")
gpu_opt = torch.optim.Adam(gpu_model.parameters())
loss = gpu_model(torch.randn(64, 4096, device="cuda")).sum()
loss.backward(); gpu_opt.step()

# %%
print(model.weight.device, model.weight.dtype)  # still the real CPU model from above

# %% [markdown]
# The simulated GPU lasts the whole notebook, like a real one: what a simulated cell leaves referenced (`gpu_model`, its gradients, Adam's state, `loss`) stays on it, and the next simulated cell starts from there (`before`). A real cell cannot use those objects (they have no data): it gets a one-line message saying so. `%gpusim reset` empties the simulated GPU; `%gpusim on` would run every following cell on it.

# %%
# %%gpumem --backend sim --gpu T4 -q -v t4_next
print(format_bytes(torch.cuda.memory_allocated()), gpu_model.weight.device)

# %%
print('before:', format_bytes(t4_next.before))
# %gpusim reset

# %% [markdown]
# A GPT-2-small training step (124 M parameters, batch 8, 1024 tokens, mixed precision) simulates in about half a second (faster once the simulator has seen its ops). On a 6 GB laptop GPU it stops where a real run would, with the same kind of error, naming the op and the module:

# %% tags=["raises-exception"]
# %%gpumem --backend sim --gpu laptop-6GB -v gpt2_laptop --no-chart
from memmagic import zoo
gpt, batch = zoo.build("gpt2_small", device="cuda")
gpt_opt = torch.optim.AdamW(gpt.parameters())
zoo.train_step(gpt, gpt_opt, batch, amp=True)

# %% [markdown]
# On a T4 (16 GB) the same step fits. The laptop's failed cell left `gpt` on the simulated GPU (as a real failed cell would), so empty it first:

# %%
# %gpusim reset

# %%
# %%gpumem --backend sim --gpu T4 -q -v gpt2_t4
gpt, batch = zoo.build("gpt2_small", device="cuda")
gpt_opt = torch.optim.AdamW(gpt.parameters())
zoo.train_step(gpt, gpt_opt, batch, amp=True)

# %%
print(gpt2_t4.summary())

# %% [markdown]
# ## In a script
#
# `memmagic.measure(fn)` and `with memmagic.track():` return the same report.

# %%
import memmagic
r = memmagic.measure(lambda: deep(x).sum().backward(), backend="cpu")
r
