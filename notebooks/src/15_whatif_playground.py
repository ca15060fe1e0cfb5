# %% [markdown]
# # The what-if playground
#
# Every strategy of this course in one place: put `--whatif` on a cell and a panel
# of controls appears under it. Move the batch-size slider, switch AMP or activation
# checkpointing, pick another card: the cell re-runs on the simulated GPU (it
# touches nothing real) and the chart shows the baseline and the new setting side
# by side, with the saving and whether it fits.
#
# **You will learn** to ask "what would this change do to memory?" of your own cell,
# in seconds, before you try it on a GPU.
#
# *The panel is a widget: in JupyterLab, Notebook 7, VS Code or Colab you can move
# its controls. The cells after it set the same controls from code, so the numbers
# below are stored in the notebook.*

# %%
# %load_ext memmagic
# %matplotlib inline
import torch
from torch import nn
import matplotlib.pyplot as plt
torch.manual_seed(0)
from memmagic import format_bytes

# %% [markdown]
# ## A training cell that reads its knobs
#
# The cell reads the plain variables `batch_size` and `accum_steps` and handles
# them itself (a micro-batch loop, as in notebook 04); memmagic applies the other
# knobs (autocast around the forward for AMP, checkpointing of the repeated blocks,
# another optimizer, the weights' dtype). `-v panel` keeps the panel so later cells
# can drive it.

# %%
from memmagic import zoo
batch_size, accum_steps = 16, 1

# %%
# %%gpumem --backend sim --gpu T4 --whatif -v panel
model, _ = zoo.build("transformer", device="cuda")
opt = torch.optim.AdamW(model.parameters())
for _ in range(accum_steps):
    tokens = torch.randint(0, 1000, (batch_size // accum_steps, 128), device="cuda")
    loss = model.loss(tokens, tokens) / accum_steps
    loss.backward()
opt.step()


# %% [markdown]
# ## Moving the controls from code
#
# `panel.set(...)` does what moving a control does. Each line below is one move;
# `panel.report` is the report of the current setting.

# %%
def show(what):
    r = panel.report
    change = r.peak / panel.baseline_report.peak - 1
    print(f"{what:<36} peak {format_bytes(r.peak):>11}  {change:+.0%} vs the baseline")

show("baseline")
panel.set(batch_size=64); show("batch 64")
panel.set(amp="fp16"); show("batch 64, AMP fp16")
panel.set(checkpointing=True); show("batch 64, AMP fp16, checkpointing")

# %%
panel.set(amp="off", checkpointing=False, batch_size=16, accum_steps=4)
show("batch 16 as 4 micro-batches of 4")
panel.set(accum_steps=1, optimizer="sgd"); show("batch 16, plain SGD")

# %% [markdown]
# The panel under the cell above now shows the last setting. Its text form (what a
# notebook stores) says the setting and the peak in one line:

# %%
panel

# %% [markdown]
# ## Sizes read off runs
#
# The panel keeps its runs. Once three of them differ only in the batch size, a new
# batch size is read off them instead of run: each allocation's size lies on the
# straight line through the runs (every run of the three must agree with it, to the
# byte), and the simulated allocator replays the run at those sizes on the card. The
# report says so in its source and in the chart ("evaluated, not run"). Below, the
# first move is a run, the others are read off; the last line checks one against a run.

# %%
panel.set(optimizer=None)  # back to the cell's own AdamW, batch 16 (the baseline)
for b in (8, 32, 48, 128):
    panel.set(batch_size=b)
    how = "read off runs" if panel.report.interpolated else "run"
    show(f"batch {b} ({how})")
print(panel.report.source)
run = panel.cell.run(panel.setting)
print("equal to a run:", (run.peak, run.reserved_peak, dict(run.breakdown)) ==
      (panel.report.peak, panel.report.reserved_peak, dict(panel.report.breakdown)))

# %% [markdown]
# ## Try it
#
# Move the controls yourself. Before each move, guess: up or down, and by how much?
# Which knob helps most at batch 16, and which at batch 64? (The activations grow
# with the batch; the model's states do not.)
#
# ## What we measured

# %%
for what, setting in [("baseline", {}), ("batch 64", {"batch_size": 64}),
                      ("batch 64, AMP fp16", {"batch_size": 64, "amp": "fp16"}),
                      ("batch 64, AMP + ckpt", {"batch_size": 64, "amp": "fp16",
                                                "checkpointing": True})]:
    r = panel.cell.run(**setting)
    print(f"{what:<24}{format_bytes(r.peak):>12}  {r.peak_words}")
