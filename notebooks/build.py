"""Write the tutorial notebooks from the cell lists below, then execute them in place so
their stored outputs are real measurements (nbval checks them in CI).

    python notebooks/build.py            # all notebooks
    python notebooks/build.py 01         # the ones whose name contains 01
"""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).parent
M, C = new_markdown_cell, new_code_cell


def md(text: str):
    """A markdown cell; the text is dedented, so cell lists can be indented."""
    return new_markdown_cell(textwrap.dedent(text).strip("\n"))


def code(text: str, *tags: str):
    """A code cell (dedented). Tags: "raises-exception" (the cell fails on purpose),
    "gpu-only" (runs its body only where CUDA is usable; nbval ignores its output)."""
    cell = new_code_cell(textwrap.dedent(text).strip("\n"))
    tags = list(tags)
    if "gpu-only" in tags:
        tags.append("nbval-ignore-output")
    if tags:
        cell.metadata["tags"] = tags
    return cell


# The first cell of every course notebook (02 on).
SETUP = """
    %load_ext memmagic
    %matplotlib inline
    import torch
    from torch import nn
    import matplotlib.pyplot as plt
    torch.manual_seed(0)
    from memmagic import format_bytes
"""

# A chart of several reports side by side: one stacked bar per report (MiB by category
# at its peak). Kept in the notebook so a student can read and change it.
BARS = """
    def bars(reports, title):
        \"\"\"One bar per report: its peak in MiB, split by category.\"\"\"
        fig, ax = plt.subplots(figsize=(8, 1.2 + 0.45 * len(reports)))
        for i, report in enumerate(reports.values()):
            left = 0.0
            for j, (category, nbytes) in enumerate(report.breakdown.items()):
                ax.barh(i, nbytes / 2**20, left=left, color=f"C{j}", label=category if i == 0 else None)
                left += nbytes / 2**20
        ax.set_yticks(range(len(reports)), list(reports))
        ax.invert_yaxis()
        ax.set_xlabel("MiB at the peak")
        ax.set_title(title)
        ax.legend(loc="upper left", bbox_to_anchor=(1, 1), frameon=False)
        plt.show()
"""

NOTEBOOKS = {
    "01_first_steps.ipynb": [
        M("# First steps with memmagic\n\n"
          "`%%gpumem` runs a cell and shows what it did to memory: the **peak**, what the cell "
          "left allocated (**retained**), and a breakdown at the peak into parameters, buffers, "
          "gradients, optimizer state, activations (tensors autograd saved for backward) and "
          "other (inputs, outputs, temporaries).\n\n"
          "This notebook runs on any laptop: `--backend cpu` runs the cell for real on the CPU "
          "and tracks every tensor op by op. On a machine with a GPU, drop `--backend cpu` and "
          "the same magic reads the CUDA caching allocator instead."),
        C("%load_ext memmagic\nimport torch\ntorch.manual_seed(0)\n"
          "device = \"cuda\" if torch.cuda.is_available() else \"cpu\""),
        M("## One training step\n\nA 4096x4096 linear layer has 16.8 M parameters: 64 MiB in fp32. "
          "Adam keeps two more tensors of that size per parameter, and backward makes the gradients."),
        C("%%gpumem --backend cpu\n"
          "model = torch.nn.Linear(4096, 4096, device=device)\n"
          "opt = torch.optim.Adam(model.parameters())\n"
          "loss = model(torch.randn(64, 4096, device=device)).sum()\n"
          "loss.backward(); opt.step()"),
        M("The peak came inside `opt.step()`: parameters, gradients, the freshly made Adam state "
          "and the step's temporaries were live together. The report is an object: `-o` returns it, "
          "`-v NAME` stores it, `-q` prints nothing."),
        C("%%gpumem --backend cpu -q -v second_step\nloss = model(torch.randn(64, 4096, device=device)).sum()\n"
          "loss.backward(); opt.step(); opt.zero_grad()"),
        C("print(second_step.summary())"),
        C("{k: f\"{v / 2**20:.2f} MiB\" for k, v in second_step.breakdown.items()}"),
        M("## Evaluation without a graph\n\nUnder `torch.no_grad()` autograd saves nothing for "
          "backward, so activations do not pile up."),
        C("x = torch.randn(256, 4096, device=device)\n"
          "deep = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, device=device) for _ in range(4)])"),
        C("%%gpumem --backend cpu -q -v without_grad\nwith torch.no_grad():\n    out = deep(x).relu()"),
        C("%%gpumem --backend cpu -q -v with_grad\ndel out\nout = deep(x).relu()"),
        C("from memmagic import format_bytes\n"
          "print('activations under no_grad:', format_bytes(without_grad.breakdown['activations']))\n"
          "print('activations with grad:   ', format_bytes(with_grad.breakdown['activations']))\n"
          "print('4 layers x 256 x 4096 fp32 inputs + the relu output:', format_bytes(5 * 256 * 4096 * 4))"),
        M("## No GPU? Simulate one\n\n`--backend sim` runs code written for a GPU (`device=\"cuda\"`, "
          "`.cuda()`, `torch.autocast(\"cuda\")`) on *fake* tensors: shapes and dtypes, no data, so it "
          "is fast and needs no memory. It predicts what the CUDA caching allocator would hold, "
          "including **reserved** memory (what `nvidia-smi` shows, minus the CUDA context). "
          "`--gpu NAME` checks the prediction against a card. Nothing real is touched: `model` and "
          "`opt` from the cells above are exactly as they were afterwards."),
        C("%%gpumem --backend sim --gpu T4 --no-chart\n"
          "gpu_model = torch.nn.Linear(4096, 4096, device=\"cuda\")\n"
          "gpu_opt = torch.optim.Adam(gpu_model.parameters())\n"
          "loss = gpu_model(torch.randn(64, 4096, device=\"cuda\")).sum()\n"
          "loss.backward(); gpu_opt.step()"),
        C("print(model.weight.device, model.weight.dtype)  # still the real CPU model from above"),
        M("The simulated GPU lasts the whole notebook, like a real one: what a simulated cell "
          "leaves referenced (`gpu_model`, its gradients, Adam's state, `loss`) stays on it, and the "
          "next simulated cell starts from there (`before`). A real cell cannot use those objects "
          "(they have no data): it gets a one-line message saying so. `%gpusim reset` empties the "
          "simulated GPU; `%gpusim on` would run every following cell on it."),
        C("%%gpumem --backend sim --gpu T4 -q -v t4_next\n"
          "print(format_bytes(torch.cuda.memory_allocated()), gpu_model.weight.device)"),
        C("print('before:', format_bytes(t4_next.before))\n%gpusim reset"),
        M("A GPT-2-small training step (124 M parameters, batch 8, 1024 tokens, mixed precision) "
          "simulates in about half a second (faster once the simulator has seen its ops). On a 6 GB laptop GPU it stops where a real run would, "
          "with the same kind of error, naming the op and the module:"),
        C("%%gpumem --backend sim --gpu laptop-6GB -v gpt2_laptop --no-chart\n"
          "from memmagic import zoo\n"
          "gpt, batch = zoo.build(\"gpt2_small\", device=\"cuda\")\n"
          "gpt_opt = torch.optim.AdamW(gpt.parameters())\n"
          "zoo.train_step(gpt, gpt_opt, batch, amp=True)",
          metadata={"tags": ["raises-exception"]}),
        M("On a T4 (16 GB) the same step fits. The laptop's failed cell left `gpt` on the "
          "simulated GPU (as a real failed cell would), so empty it first:"),
        C("%gpusim reset"),
        C("%%gpumem --backend sim --gpu T4 -q -v gpt2_t4\n"
          "gpt, batch = zoo.build(\"gpt2_small\", device=\"cuda\")\n"
          "gpt_opt = torch.optim.AdamW(gpt.parameters())\n"
          "zoo.train_step(gpt, gpt_opt, batch, amp=True)"),
        C("print(gpt2_t4.summary())"),
        M("## In a script\n\n`memmagic.measure(fn)` and `with memmagic.track():` return the same report."),
        C("import memmagic\nr = memmagic.measure(lambda: deep(x).sum().backward(), backend=\"cpu\")\nr"),
    ],
}


# ---- course notebooks ----
NOTEBOOKS["02_where_memory_goes.ipynb"] = [
    md("""
        # 02 · Where the memory goes

        A training step keeps five kinds of tensors on the GPU: **parameters**, their
        **gradients**, the **optimizer state**, the **activations** autograd saves for the
        backward pass, and short-lived **temporaries**. In this notebook you will:

        - estimate each of them for a small network with pen-and-paper arithmetic;
        - measure each one, phase by phase, on a simulated T4 (no GPU needed);
        - see what the estimate misses (optimizer temporaries, the cuBLAS workspace) and how
          far the popular "training needs 4x the model size" rule is off.
    """),
    code(SETUP),
    md("""
        ## Estimate first

        The model: three linear layers, 1024 → 4096 → 4096 → 10, with ReLU in between, trained
        with Adam on batches of 256. Every number is float32: 4 bytes.

        - **parameters**: weights and biases;
        - **gradients**: one per parameter;
        - **optimizer state**: Adam keeps two running averages per parameter (`exp_avg`, `exp_avg_sq`);
        - **activations**: what backward needs. A `Linear` saves its input, a `ReLU` its output;
          the ReLU's output *is* the next Linear's input, so it is stored once.
    """),
    code("""
        batch, d_in, hidden, classes = 256, 1024, 4096, 10
        n_params = (d_in * hidden + hidden) + (hidden * hidden + hidden) + (hidden * classes + classes)
        FP32 = 4  # bytes per number
        estimate = {
            "parameters": n_params * FP32,
            "gradients": n_params * FP32,
            "optimizer_state": 2 * n_params * FP32,
            "activations": batch * (d_in + hidden + hidden) * FP32,  # x, relu1 out, relu2 out
        }
        print(f"{n_params:,} parameters")
        for name, nbytes in estimate.items():
            print(f"  {name:<16}{format_bytes(nbytes):>11}")
    """),
    md("""
        ## Measure, one phase per cell

        Each cell below runs on the notebook's simulated GPU (`--backend sim --gpu T4`): code
        written for CUDA runs on fake tensors that have shapes but no data, and memmagic
        predicts what a real T4 would hold. Like a real GPU, the simulated one keeps what a
        cell leaves behind, so each cell starts where the previous one stopped. `-q -v NAME`
        stores the report in `NAME` without printing it.
    """),
    code("""
        %%gpumem --backend sim --gpu T4 -q -v built
        model = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(),
                              nn.Linear(hidden, hidden), nn.ReLU(),
                              nn.Linear(hidden, classes)).cuda()
    """),
    code("""
        %%gpumem --backend sim --gpu T4 -q -v forward
        x = torch.randn(batch, d_in, device="cuda")
        y = torch.randint(classes, (batch,), device="cuda")
        loss = nn.functional.cross_entropy(model(x), y)
    """),
    code("""
        %%gpumem --backend sim --gpu T4 -q -v backward
        loss.backward()
    """),
    md("The first optimizer step creates Adam's state. This time the full report is shown:"),
    code("""
        %%gpumem --backend sim --gpu T4 -v step
        opt = torch.optim.Adam(model.parameters())
        opt.step()
    """),
    md("""
        ## Check the estimate

        Each category is read at the peak of the phase that makes it: `report.breakdown` maps a
        category to bytes at that cell's peak.
    """),
    code("""
        measured = {
            "parameters": built.breakdown["parameters"],
            "gradients": backward.breakdown["gradients"],
            "optimizer_state": step.breakdown["optimizer_state"],
            "activations": forward.breakdown["activations"],
        }
        print(f"{'':<16}{'by hand':>11}{'measured':>11}  ratio")
        for name in estimate:
            ratio = measured[name] / estimate[name]
            print(f"{name:<16}{format_bytes(estimate[name]):>11}{format_bytes(measured[name]):>11}  {ratio:.4f}")
    """),
    md("""
        The four estimates hold. (The CUDA allocator rounds every tensor up to a multiple of
        512 bytes; for tensors this size that is invisible in the ratios.)

        ## What the estimate missed

        Two categories had no line in the estimate:

        - **workspaces**: the first matrix multiply on a thread makes cuBLAS allocate a
          workspace through PyTorch's allocator, and it stays. Backward runs on a second
          thread, which gets its own.
        - **other**: temporaries. In the forward pass the output of each `Linear` lives until
          the ReLU has made its own output. In the optimizer step, the foreach (multi-tensor)
          Adam that CUDA uses computes intermediate results for all parameters at once.
    """),
    code("""
        for name, report in [("forward", forward), ("backward", backward), ("optimizer step", step)]:
            print(f"{name:<15} workspaces {format_bytes(report.breakdown['workspaces']):>10}"
                  f"   other {format_bytes(report.breakdown['other']):>10}   peak {report.peak_words}")
        print(f"Adam's temporaries are {step.breakdown['other'] / estimate['parameters']:.2f}x the parameters")
    """),
    code(BARS),
    code("""bars({"built": built, "forward": forward, "backward": backward, "optimizer step": step},
     "Each phase's peak on a simulated T4")"""),
    md("""
        ## The "4x the model size" rule

        A common rule of thumb says training with Adam needs 4x the parameter memory
        (weights, gradients, two Adam moments). Compare it with the whole step's peak:
    """),
    code("""
        rule = 4 * estimate["parameters"]
        print(f"4x the parameters:   {format_bytes(rule)}")
        print(f"measured step peak:  {format_bytes(step.peak)}  ({step.peak / rule - 1:+.0%} over the rule)")
        print(f"activations at batch {batch}: {format_bytes(estimate['activations'])}, "
              f"{estimate['activations'] / rule:.1%} of the rule")
    """),
    md("""
        At this batch size the activations are small next to the weights, so the peak comes
        in the optimizer step, and the rule misses only the temporaries and workspaces. With
        bigger batches or longer sequences the activations grow and take over: notebook 03
        measures where that happens.

        ## What we measured
    """),
    code("""
        print(f"{'phase':<16}{'peak':>11}{'added':>11}   largest category at the peak")
        for name, r in [("build", built), ("forward", forward), ("backward", backward), ("optimizer step", step)]:
            top = max(r.breakdown, key=r.breakdown.get)
            print(f"{name:<16}{format_bytes(r.peak):>11}{format_bytes(r.increment):>11}   {top}")
    """),
]


CNN = """
    def make_cnn():
        return nn.Sequential(
            nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(128 * 8 * 8, 512), nn.ReLU(), nn.Linear(512, 10))
"""

NOTEBOOKS["03_batch_size.ipynb"] = [
    md("""
        # 03 · Batch size: why halving it rarely halves memory

        "Out of memory? Halve the batch size." It is the first advice anyone gives, and it
        works, but the saving is not proportional. In this notebook you will:

        - measure a training step's peak at seven batch sizes on a simulated T4;
        - split the peak into a part that grows with the batch and a part that does not;
        - find the batch size below which a smaller batch saves **nothing at all**;
        - fact-check the claim *"a smaller batch is a linear saving"*.
    """),
    code(SETUP),
    md("""
        A small CNN for 32x32 images (CIFAR-sized), trained with Adam. `train_step` is
        ordinary CUDA code; the model is built inside, so every call starts from an empty GPU.
    """),
    code(CNN + """
    def train_step(batch_size):
        model = make_cnn().cuda()
        opt = torch.optim.Adam(model.parameters())
        x = torch.randn(batch_size, 3, 32, 32, device="cuda")
        y = torch.randint(10, (batch_size,), device="cuda")
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    """),
    md("""
        To run the same step at many sizes, `memmagic.measure(fn, backend="sim", gpu="T4")`
        calls `fn` on a simulated T4 and returns the same report as `%%gpumem`. Each call starts
        from an empty simulated GPU, as a fresh process would.
    """),
    code("""
        import memmagic
        batch_sizes = [8, 16, 32, 64, 128, 256, 512]
        runs = {}
        for b in batch_sizes:
            runs[b] = memmagic.measure(lambda: train_step(b), backend="sim", gpu="T4")
        for b, r in runs.items():
            print(f"batch {b:>3}: peak {format_bytes(r.peak):>11}, {r.peak_words}")
    """),
    md("""
        Two regimes show up. For large batches the peak comes during `loss.backward()`, when
        the activations saved for every layer are still alive. For small ones it comes in the
        optimizer step, where the batch plays no part: parameters, gradients, Adam's two
        moments and its temporaries are all the size of the model.
    """),
    code("""
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.plot(batch_sizes, [runs[b].peak / 2**20 for b in batch_sizes], "o-", label="measured peak")
        big = batch_sizes[-1]
        ax.plot(batch_sizes, [runs[big].peak / 2**20 * b / big for b in batch_sizes], "--",
                label="'linear saving' from the largest batch")
        ax.set_xscale("log", base=2)
        ax.set_xticks(batch_sizes, batch_sizes)
        ax.set_xlabel("batch size")
        ax.set_ylabel("peak (MiB)")
        ax.legend()
        plt.show()
    """),
    md("""
        ## The part that grows and the part that does not

        In the backward regime the peak is close to a straight line, `peak ≈ fixed + per_sample × batch`.
        Two measurements fix the line; the others check it.
    """),
    code("""
        per_sample = (runs[512].peak - runs[256].peak) / (512 - 256)
        fixed = runs[512].peak - 512 * per_sample
        print(f"per sample: {format_bytes(int(per_sample))}, fixed part: {format_bytes(int(fixed))}")
        for b in batch_sizes:
            line = fixed + per_sample * b
            print(f"batch {b:>3}: line predicts {format_bytes(int(line)):>11}, measured {format_bytes(runs[b].peak):>11}")
    """),
    md("""
        The line holds for the large batches and fails for the small ones, where the optimizer
        step's peak (flat) takes over. Below that crossing, no batch size helps: the model,
        its gradients and its optimizer state have to fit anyway.

        ## Fact-check: "a smaller batch is a linear saving"
    """),
    code("""
        for big, small in [(512, 256), (128, 64), (64, 32), (16, 8)]:
            saved = 1 - runs[small].peak / runs[big].peak
            print(f"batch {big:>3} -> {small:>3}: the peak drops by {saved:4.0%} (a linear saving would be 50%)")
    """),
    md("""
        **Where the claim holds:** only the activation part scales with the batch. When
        activations dominate (large batches, long sequences, big images), halving the batch
        comes close to halving the peak.

        **Where it fails:** the fixed part (weights, gradients, optimizer state, workspaces)
        never shrinks, so each halving saves less, and once the optimizer step holds the peak,
        nothing. To go lower you need the tools of the next notebooks: mixed precision,
        checkpointing, or a smaller optimizer state.

        ## Reserved memory moves in steps

        What the card must really have free is the allocator's **reserved** memory (what
        `nvidia-smi` shows, minus the CUDA context). It is rounded up to whole segments
        (notebook 11), so it is always above the peak, and it does not even move in step with
        the batch: how tensors pack into segments depends on their sizes. These reserved
        figures come from the simulator's model of the CUDA caching allocator.
    """),
    code("""
        for b, r in runs.items():
            print(f"batch {b:>3}: peak {format_bytes(r.peak):>11}   reserved {format_bytes(r.reserved_peak):>11}"
                  f"   (+{r.reserved_peak / r.peak - 1:.0%})")
    """),
    md("## What we measured"),
    code("""
        print(f"{'batch':>5}{'peak':>12}{'activations':>13}  peak reached during")
        for b, r in runs.items():
            phase = "optimizer.step()" if "optimizer" in r.peak_words else "loss.backward()"
            print(f"{b:>5}{format_bytes(r.peak):>12}{format_bytes(r.breakdown['activations']):>13}  {phase}")
    """),
]


NOTEBOOKS["04_gradient_accumulation.ipynb"] = [
    md("""
        # 04 · Gradient accumulation

        Gradient accumulation trains with an *effective* batch of `k × micro_batch` while only
        one micro-batch's activations are alive at a time: run `k` forward/backward passes,
        let the gradients add up, then take one optimizer step. In this notebook you will:

        - check on a real (CPU) run that the accumulated gradient equals the big batch's,
          and what goes wrong without the loss scaling or with `zero_grad` in the wrong place;
        - measure the memory of an effective batch of 256 done three ways on a simulated T4;
        - fact-check *"gradient accumulation gives the same memory as the small batch"*.
    """),
    code(SETUP),
    md("""
        ## Getting the loop right

        A tiny linear model on 64 samples, small enough to run for real. The reference is the
        gradient of the whole batch at once.
    """),
    code("""
        X, Y = torch.randn(64, 20), torch.randn(64, 1)
        model = nn.Linear(20, 1)
        loss_fn = nn.MSELoss()  # a mean over the batch

        model.zero_grad()
        loss_fn(model(X), Y).backward()
        full = model.weight.grad.clone()
    """),
    md("""
        The usual loop: divide each micro-batch's loss by the number of micro-batches `k`
        (the loss is a *mean*, and `k` means of 16 samples summed are `k` times the mean of 64),
        call `backward()` on every micro-batch, and zero the gradients only after the step.
    """),
    code("""
        def accumulated_grad(k, scale=True, zero_every_micro_batch=False):
            model.zero_grad()
            for xb, yb in zip(X.chunk(k), Y.chunk(k)):
                if zero_every_micro_batch:
                    model.zero_grad()           # the bug: wipes what was accumulated
                loss = loss_fn(model(xb), yb)
                (loss / k if scale else loss).backward()
            return model.weight.grad.clone()    # opt.step(); opt.zero_grad() would go here

        good = accumulated_grad(4)
        print("loss / k, zero_grad after the step:", torch.allclose(good, full, atol=1e-6))
        unscaled = accumulated_grad(4, scale=False)
        print(f"without / k: the gradient is {unscaled.norm() / full.norm():.2f}x the full batch's")
        wrong = accumulated_grad(4, zero_every_micro_batch=True)
        print("zero_grad every micro-batch: matches the full batch:", torch.allclose(wrong, full, atol=1e-6))
    """),
    md("""
        Without the division the gradient is `k` times too large: with SGD that is a learning
        rate `k` times too high (Adam mostly normalises it away, gradient clipping does not).
        With `zero_grad` inside the loop, only the last micro-batch counts.

        (Layers that look at the whole batch, such as `BatchNorm`, see micro-batches: their
        statistics follow the micro-batch, so accumulation is not exactly the big batch there.)

        ## Memory at a fixed effective batch of 256

        The CNN of notebook 03, two optimizer steps, three ways to reach 256 samples per step,
        each measured on a fresh simulated T4 by `memmagic.measure` (notebook 03).
    """),
    code(CNN + """
    def train(micro_batch, k, steps=2):
        model = make_cnn().cuda()
        opt = torch.optim.Adam(model.parameters())
        for _ in range(steps):
            for _ in range(k):
                x = torch.randn(micro_batch, 3, 32, 32, device="cuda")
                y = torch.randint(10, (micro_batch,), device="cuda")
                loss = nn.functional.cross_entropy(model(x), y) / k
                loss.backward()
            opt.step()
            opt.zero_grad()
    """),
    code("""
        import memmagic
        big = memmagic.measure(lambda: train(256, k=1), backend="sim", gpu="T4")
        accum = memmagic.measure(lambda: train(64, k=4), backend="sim", gpu="T4")
        small = memmagic.measure(lambda: train(64, k=1), backend="sim", gpu="T4")
        for name, r in [("batch 256", big), ("4 x 64, accumulated", accum), ("batch 64 (a smaller step)", small)]:
            print(f"{name:<26} peak {format_bytes(r.peak):>11}   {r.peak_words}")
    """),
    code(BARS),
    code("""bars({"batch 256": big, "4 x 64 accumulated": accum, "batch 64": small},
     "An effective batch of 256, three ways (simulated T4)")"""),
    md("""
        ## Fact-check: "accumulation gives the same memory as the small batch"

        Compare the accumulated run with plain training at the micro-batch size:
    """),
    code("""
        extra = accum.peak - small.peak
        print(f"accumulation vs batch 64: {format_bytes(extra, signed=True)} ({extra / small.peak:+.1%})")
        print(f"accumulation vs batch 256: {1 - accum.peak / big.peak:.0%} lower peak")
        for name, r in [("accumulated", accum), ("batch 64", small)]:
            print(f"  {name:<12} at the peak: gradients {format_bytes(r.breakdown['gradients']):>10}, "
                  f"activations {format_bytes(r.breakdown['activations']):>10}, other {format_bytes(r.breakdown['other']):>10}")
    """),
    md("""
        **Where the claim holds:** the activations are the micro-batch's, so the peak is close
        to the small batch's and far below the big batch's.

        **Where it is not exact:** with plain training, `zero_grad()` (which sets gradients to
        `None`) frees the gradients before the next forward pass, and backward builds them
        layer by layer. With accumulation, the gradients of earlier micro-batches are alive
        during every later pass, and each new gradient is first computed in a temporary
        ("other") and then added to the stored one. Look at where each run peaked (above):
        the accumulated run peaks at the start of backward, where all of the micro-batch's
        activations, all of the stored gradients and the new gradient of the largest layer
        are alive together. The difference is bounded by about one set of gradients, so it
        matters most for models whose weights are large next to their activations.

        Accumulation costs time, not memory: `k` smaller passes use the GPU less efficiently
        than one big one.

        ## What we measured
    """),
    code("""
        print(f"{'effective batch 256 as':<26}{'peak':>11}{'reserved':>11}")
        for name, r in [("one batch of 256", big), ("4 x 64, accumulated", accum), ("(batch 64 alone)", small)]:
            print(f"{name:<26}{format_bytes(r.peak):>11}{format_bytes(r.reserved_peak):>11}")
    """),
]


NOTEBOOKS["05_mixed_precision.ipynb"] = [
    md("""
        # 05 · Mixed precision: autocast, GradScaler, fp16 and bf16

        "Mixed precision cuts memory by 50%" is repeated everywhere. In this notebook you will:

        - measure a transformer's training step in fp32, with `autocast` to fp16 (plus
          `GradScaler`) and to bf16, at a small and a large batch, on a simulated A100;
        - see which tensors autocast makes smaller and which it leaves alone;
        - see why fp16 needs a `GradScaler` and bf16 does not;
        - measure what storing the *weights* in fp16 or bf16 (`model.half()`) saves, and what it
          costs in accuracy on a small real training run on the CPU.
    """),
    code(SETUP),
    md("""
        A 4-layer transformer encoder (d=512, sequences of 256), trained with AdamW. One
        function covers every variant: `precision` picks autocast's dtype, and the
        `GradScaler` is switched on for fp16 only (disabled, it passes everything through).
    """),
    code("""
        def make_model():
            layer = nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, batch_first=True)
            return nn.TransformerEncoder(layer, num_layers=4)

        def train_step(batch_size, precision="fp32", use_scaler=True):
            model = make_model().cuda()
            opt = torch.optim.AdamW(model.parameters())
            scaler = torch.amp.GradScaler("cuda", enabled=use_scaler and precision == "fp16")
            x = torch.randn(batch_size, 256, 512, device="cuda")
            dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
            with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                loss = model(x).square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    """),
    md("""
        Each variant on a fresh simulated A100 (`memmagic.measure`, as in notebook 03), at
        batch 4 and batch 32:
    """),
    code("""
        import memmagic
        runs = {}
        for precision in ["fp32", "fp16", "bf16"]:
            for b in [4, 32]:
                runs[precision, b] = memmagic.measure(lambda: train_step(b, precision), backend="sim", gpu="A100-40GB")
        for b in [4, 32]:
            print(f"batch {b}:")
            for precision in ["fp32", "fp16", "bf16"]:
                r = runs[precision, b]
                change = r.peak / runs["fp32", b].peak - 1
                print(f"  {precision}: peak {format_bytes(r.peak):>11} ({change:+6.1%})  {r.peak_words}")
    """),
    code(BARS),
    code("""bars({f"{p}, batch {b}": runs[p, b] for b in [4, 32] for p in ["fp32", "fp16"]},
     "autocast changes the activations, not the model's state (simulated A100)")"""),
    md("""
        ## What autocast changes

        Autocast runs matrix multiplies (and convolutions) in fp16/bf16, so their outputs, and
        the activations saved from them, are half the size. It does **not** touch:

        - the parameters, gradients and optimizer state: they stay fp32 (autocast casts a copy
          of each weight on the fly);
        - ops CUDA's autocast keeps in fp32 for accuracy: `layer_norm`, `softmax`, losses,
          reductions.
    """),
    code("""
        for b in [4, 32]:
            fp32, fp16 = runs["fp32", b], runs["fp16", b]
            print(f"batch {b}: activations {format_bytes(fp32.breakdown['activations'])} -> {format_bytes(fp16.breakdown['activations'])}, "
                  f"parameters {format_bytes(fp32.breakdown['parameters'])} -> {format_bytes(fp16.breakdown['parameters'])}")
    """),
    md("""
        At batch 4 the peak comes in the optimizer step, where autocast has nothing to halve.
        At batch 32 the activations dominate and the saving is large, but still short of 50%:
        the fp32 parts do not shrink.

        ## Why fp16 needs a GradScaler

        fp16 has 5 exponent bits: its largest number is 65504 and anything below about 6e-8
        becomes zero. Small gradients underflow. bf16 has fp32's 8 exponent bits (same range)
        but only 8 bits of precision. A few real tensors on the CPU:
    """),
    code("""
        print("70000 in fp16:", torch.tensor(70000.0).half().item())
        print("1e-8 in fp16: ", torch.tensor(1e-8).half().item(), "  in bf16:", torch.tensor(1e-8).bfloat16().item())
        print("1e-8 x 65536 in fp16:", torch.tensor(1e-8 * 65536).half().item())
        one = torch.tensor(1.0, dtype=torch.bfloat16)
        print("1 + 0.001 in bf16:", (one + 0.001).item(), "  in fp32:", (torch.tensor(1.0) + 0.001).item())
    """),
    md("""
        `GradScaler` multiplies the loss by a large factor (65536 to start) before `backward()`,
        so small gradients survive in fp16, divides the gradients back before `optimizer.step()`,
        and skips a step whose gradients overflowed. Its own state is a scale factor and a
        flag per device. The same fp16 step with and without it:
    """),
    code("""
        no_scaler = memmagic.measure(lambda: train_step(32, "fp16", use_scaler=False), backend="sim", gpu="A100-40GB")
        print("GradScaler's cost at batch 32:", format_bytes(runs["fp16", 32].peak - no_scaler.peak, signed=True))
    """),
    md("""
        ## Half-precision weights: `model.half()`

        Storing the model itself in fp16 or bf16 halves the parameters, the gradients and
        Adam's state as well:
    """),
    code("""
        def half_step(batch_size, dtype):
            model = make_model().cuda().to(dtype)
            opt = torch.optim.AdamW(model.parameters())
            x = torch.randn(batch_size, 256, 512, device="cuda", dtype=dtype)
            model(x).square().mean().backward()
            opt.step()

        for b in [4, 32]:
            runs["bf16 weights", b] = memmagic.measure(lambda: half_step(b, torch.bfloat16), backend="sim", gpu="A100-40GB")
            saved = 1 - runs["bf16 weights", b].peak / runs["fp32", b].peak
            print(f"batch {b}: bf16 weights, peak {format_bytes(runs['bf16 weights', b].peak)} (saved {saved:.0%})")
    """),
    md("""
        The memory saving is real. The price is paid in the optimizer: a weight update is
        often far smaller than the weight, and with 8 bits of precision (bf16) it is rounded
        away; in fp16, Adam's `eps=1e-8` rounds to 0 and divisions by zero follow.

        ## What it costs in accuracy (a real run on the CPU)

        A small classifier on synthetic data, 300 Adam steps, four ways. This runs for real, so
        the numbers are actual training results (rounded: they may differ in the last digit
        on another CPU). Tensors this small run faster on one CPU thread than on several.
    """),
    code("""
        g = torch.Generator().manual_seed(0)
        X = torch.randn(4096, 32, generator=g)
        Y = (X @ torch.randn(32, 4, generator=g)).argmax(1)  # labels from a hidden linear "teacher"

        torch.set_num_threads(1)

        def train_small(weights=torch.float32, autocast_dtype=None, steps=300, lr=3e-4):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4)).to(weights)
            opt = torch.optim.Adam(model.parameters(), lr=lr)
            for i in range(steps):
                rows = slice(i * 128 % 4096, i * 128 % 4096 + 128)
                with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
                    loss = nn.functional.cross_entropy(model(X[rows].to(weights)).float(), Y[rows])
                opt.zero_grad()
                loss.backward()
                opt.step()
            with torch.no_grad():
                accuracy = (model(X.to(weights)).argmax(1) == Y).float().mean().item()
            return loss.item(), accuracy
    """),
    code("""
        results = {
            "fp32": train_small(),
            "autocast bf16": train_small(autocast_dtype=torch.bfloat16),
            "bf16 weights": train_small(weights=torch.bfloat16),
            "fp16 weights": train_small(weights=torch.float16),
        }
        for name, (loss, accuracy) in results.items():
            print(f"{name:<14} final loss {loss:5.2f}   accuracy {accuracy:4.0%}")
    """),
    md("""
        Autocast trains like fp32: the weights and the optimizer stay fp32. bf16 weights learn
        more slowly (updates lost to rounding); fp16 weights with Adam break down (`nan`).
        That is why large models trained in bf16 keep an fp32 copy of the weights ("master
        weights") in the optimizer, or use optimizers written for low precision.

        ## Fact-check: "mixed precision cuts memory by 50%"
    """),
    code("""
        for b in [4, 32]:
            for name in ["fp16", "bf16", "bf16 weights"]:
                saved = 1 - runs[name, b].peak / runs["fp32", b].peak
                print(f"batch {b:>2}, {name:<12}: {saved:5.1%} of the fp32 peak saved")
    """),
    md("""
        **Where it holds:** autocast roughly halves the activations of matmul-heavy layers, so
        when activations dominate the peak (large batches, long sequences) the saving
        approaches, but does not reach, 50%.

        **Where it fails:** weights, gradients and optimizer state stay fp32, so with small
        batches, or with a peak in the optimizer step, autocast saves little or nothing.
        Halving *everything* takes half-precision weights, which cost accuracy unless the
        optimizer keeps fp32 master weights (and then the saving shrinks again).

        An aside on hardware: on a T4 (no bf16 attention kernels) bf16 falls back to a
        slower attention path that saves the full attention matrix. Measured:
    """),
    code("""
        for precision in ["fp16", "bf16"]:
            r = memmagic.measure(lambda: train_step(32, precision), backend="sim", gpu="T4")
            print(f"T4, {precision}, batch 32: activations {format_bytes(r.breakdown['activations'])}")
    """),
    md("## What we measured"),
    code("""
        print(f"{'':<14}{'batch 4':>12}{'batch 32':>12}")
        for name in ["fp32", "fp16", "bf16", "bf16 weights"]:
            print(f"{name:<14}{format_bytes(runs[name, 4].peak):>12}{format_bytes(runs[name, 32].peak):>12}")
        print()
        for name, (loss, accuracy) in results.items():
            print(f"{name:<14} accuracy after 300 steps: {accuracy:.0%}")
    """),
]


NOTEBOOKS["06_evaluation.ipynb"] = [
    md("""
        # 06 · Evaluation: `model.eval()`, `torch.no_grad()`, `torch.inference_mode()`

        Three switches are used when a model is evaluated, and they are often confused. In
        this notebook you will:

        - measure one forward pass of a transformer four ways on a simulated T4: training mode,
          `model.eval()`, `eval()` + `no_grad()`, `eval()` + `inference_mode()`;
        - see which switch saves memory, and why `model.eval()` alone does not;
        - see what `inference_mode()` forbids that `no_grad()` allows;
        - measure the classic validation-loop leak: predictions kept with their graphs.
    """),
    code(SETUP),
    md("""
        `model.eval()` changes how some layers *compute* (dropout stops dropping, batch norm
        uses its running statistics). Whether autograd records a graph and saves activations
        is decided by the grad mode: `torch.no_grad()` or `torch.inference_mode()` turn it off.

        The model: the transformer encoder of notebook 05 (it has dropout), a batch of 64
        sequences of 256 tokens. Model and batch go on the notebook's simulated T4 first.
    """),
    code("""
        %%gpumem --backend sim --gpu T4 -q -v built
        layer = nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, batch_first=True)
        model = nn.TransformerEncoder(layer, num_layers=4).cuda()
        x = torch.randn(64, 256, 512, device="cuda")
    """),
    md("""
        Each of the next cells runs one forward pass and then drops the output. `increment`
        is how far the cell's peak rose above what was already on the card.
    """),
    code("""
        %%gpumem --backend sim --gpu T4 -q -v train_mode
        model.train()
        out = model(x)
        del out
    """),
    code("""
        %%gpumem --backend sim --gpu T4 -q -v eval_mode
        model.eval()
        out = model(x)
        del out
    """),
    code("""
        %%gpumem --backend sim --gpu T4 -q -v eval_no_grad
        model.eval()
        with torch.no_grad():
            out = model(x)
        del out
    """),
    code("""
        %%gpumem --backend sim --gpu T4 -q -v eval_inference
        model.eval()
        with torch.inference_mode():
            out = model(x)
        del out
    """),
    code("""
        forward = {"train()": train_mode, "eval()": eval_mode,
                   "eval() + no_grad()": eval_no_grad, "eval() + inference_mode()": eval_inference}
        for name, r in forward.items():
            print(f"{name:<26} peak above the model {format_bytes(r.increment):>11}   "
                  f"activations {format_bytes(r.breakdown['activations']):>11}")
        print(f"eval() alone saved {1 - eval_mode.increment / train_mode.increment:.0%}; "
              f"no_grad() saved {1 - eval_no_grad.increment / train_mode.increment:.0%}")
    """),
    code(BARS),
    code("""bars(forward, "One forward pass, batch 64 (simulated T4)")"""),
    md("""
        - `eval()` alone keeps the graph: every layer still saves its inputs for a backward
          pass that will never come. What it does save comes from dropout, which is the
          identity in eval mode: no masks and no dropped copies are stored.
        - `no_grad()` saves nothing for backward: what is left is the weights, the input and
          the few temporaries of the layer being computed.
        - `inference_mode()` uses the same memory as `no_grad()`: its gain is speed (no version
          counters, no view tracking), not bytes.

        ## What `inference_mode()` forbids

        Tensors made under `inference_mode()` can never take part in autograd later. With
        `no_grad()` they can. A real run on the CPU:
    """),
    code("""
        weight = torch.ones(3, requires_grad=True)
        for mode in [torch.no_grad, torch.inference_mode]:
            with mode():
                features = torch.randn(3)
            try:
                (weight * features).sum().backward()   # multiplying saves `features` for backward
                print(f"{mode.__name__}: the tensor works in a later backward")
            except RuntimeError as error:
                print(f"{mode.__name__}: RuntimeError: {str(error).splitlines()[0]}")
    """),
    md("""
        So use `inference_mode()` for pure inference (serving, computing metrics), and
        `no_grad()` when what you compute may feed a later training step (targets from a
        teacher model, EMA updates).

        ## The validation-loop leak

        A validation loop that forgets `no_grad()` and keeps its outputs in a list keeps
        every batch's graph, with all its saved activations, alive until the list goes:
    """),
    code("""
        def validate(batches, grad_off):
            model.eval()
            predictions = []
            with torch.set_grad_enabled(not grad_off):
                for _ in range(batches):
                    predictions.append(model(x))
            return predictions
    """),
    code("""
        %%gpumem --backend sim --gpu T4 -q -v kept_graphs
        predictions = validate(3, grad_off=False)
    """),
    md("Deleting the list frees it all, graphs included (a plain cell: `del` works on the simulated GPU too):"),
    code("del predictions"),
    code("""
        %%gpumem --backend sim --gpu T4 -q -v kept_outputs
        predictions = validate(3, grad_off=True)
    """),
    code("""
        print(f"3 batches without no_grad(): the list holds {format_bytes(kept_graphs.retained)}")
        print(f"3 batches with no_grad():    the list holds {format_bytes(kept_outputs.retained)}")
        print(f"(one batch of outputs, 64 x 256 x 512 floats, is {format_bytes(64 * 256 * 512 * 4)})")
    """),
    md("""
        Without `no_grad()` each kept prediction holds its graph: the whole forward pass's
        activations, batch after batch, until an out-of-memory error. With it, the list holds
        just the outputs. (`out.detach()` or `out.cpu()` before keeping also cut the graph.)

        ## Fact-check: "`model.eval()` saves memory during evaluation"

        Only through dropout: measured above, `eval()` alone left most of the activations in
        place. The memory saving comes from turning off autograd with
        `no_grad()` or `inference_mode()`, which are equal in memory.

        ## What we measured
    """),
    code("""
        print(f"{'forward pass, batch 64':<28}{'peak above model':>17}")
        for name, r in forward.items():
            print(f"{name:<28}{format_bytes(r.increment):>17}")
        print(f"{'3 kept predictions, grad on':<28}{format_bytes(kept_graphs.retained):>17}")
    """),
]


NOTEBOOKS["07_inplace_activations.ipynb"] = [
    md("""
        # 07 · In-place activations: `ReLU(inplace=True)`

        An in-place operation writes its result into its input's memory instead of a new
        tensor. `nn.ReLU(inplace=True)` is the best-known one. In this notebook you will:

        - measure what `inplace=True` saves in inference and in training, on a simulated T4;
        - see why the saving is one temporary, not the activations;
        - see when autograd refuses an in-place operation, and why.
    """),
    code(SETUP),
    md("""
        Two MLPs, four blocks each, batch 2048, built with `ReLU()` or `ReLU(inplace=True)`:

        - **flat**: every layer is `Linear(4096, 4096)`;
        - **expanding**: each block widens 8x and narrows back, `Linear(1024, 8192) -> ReLU ->
          Linear(8192, 1024)`, as the MLP of a transformer block does.
    """),
    code("""
        def make_mlp(shape, inplace):
            layers = []
            for _ in range(4):
                if shape == "flat":
                    layers += [nn.Linear(4096, 4096), nn.ReLU(inplace=inplace)]
                else:
                    layers += [nn.Linear(1024, 8192), nn.ReLU(inplace=inplace), nn.Linear(8192, 1024)]
            return nn.Sequential(*layers)

        def run(shape, inplace, training):
            model = make_mlp(shape, inplace).cuda()
            x = torch.randn(2048, 4096 if shape == "flat" else 1024, device="cuda")
            with torch.set_grad_enabled(training):
                out = model(x)
            if training:
                out.mean().backward()
    """),
    code("""
        import memmagic
        runs = {}
        for shape in ["flat", "expanding"]:
            for training in [False, True]:
                for inplace in [False, True]:
                    runs[shape, training, inplace] = memmagic.measure(
                        lambda: run(shape, inplace, training), backend="sim", gpu="T4")
        for (shape, training, inplace), r in runs.items():
            if inplace:
                saved = runs[shape, training, False].peak - r.peak
                mode = "training " if training else "inference"
                print(f"{shape:<9} {mode}: inplace=True saved {format_bytes(saved):>10} of {format_bytes(r.peak + saved):>10}")
    """),
    code(BARS),
    code("""bars({f"{shape}, {'training' if t else 'inference'}, inplace={i}": runs[shape, t, i]
      for shape in ["flat", "expanding"] for t in [False, True] for i in [False, True]},
     "ReLU() vs ReLU(inplace=True), simulated T4")"""),
    md("""
        ## One temporary, and only if it is the peak

        Without `inplace`, a `Linear` writes its output, then the ReLU writes a second tensor
        of the same size; for a moment both are alive, then the first one goes. With
        `inplace=True` the second tensor is never made. That is the whole saving: one layer's
        output, for a moment. It lowers the peak only if that moment *was* the peak:

        - **flat**: the next `Linear` also needs its input and its output alive together, and
          they are just as large, so the peak does not move;
        - **expanding**: the ReLU's moment holds two wide (8192) tensors, the next `Linear`'s
          one wide and one narrow; removing one wide tensor lowers the peak.

        The activations do not change: the ReLU saves its output for backward and the next
        `Linear` saves its input, the same tensor either way, stored once.
    """),
    code("""
        wide = 2048 * 8192 * 4
        print(f"one wide tensor (2048 x 8192 floats): {format_bytes(wide)}")
        for training in [False, True]:
            off, on = runs["expanding", training, False], runs["expanding", training, True]
            print(f"expanding, {'training' if training else 'inference'}: activations "
                  f"{format_bytes(off.breakdown['activations'])} -> {format_bytes(on.breakdown['activations'])}; "
                  f"peak {off.peak_words}")
    """),
    md("""
        ## When autograd refuses

        An in-place op overwrites a tensor. Autograd counts every tensor's in-place changes
        (its *version*) and refuses at backward time when a tensor it saved has changed since.
        Real tensors on the CPU:
    """),
    code("""
        def attempt(name, fn):
            try:
                fn()
                print(f"{name}: ok")
            except RuntimeError as error:
                print(f"{name}: RuntimeError: {str(error).split('. Hint')[0]}")

        x = torch.randn(4, 3)
        relu_after_linear = nn.Sequential(nn.Linear(3, 3), nn.ReLU(inplace=True))
        relu_after_sigmoid = nn.Sequential(nn.Linear(3, 3), nn.Sigmoid(), nn.ReLU(inplace=True))
        attempt("Linear -> ReLU(inplace)", lambda: relu_after_linear(x).sum().backward())
        attempt("Sigmoid -> ReLU(inplace)", lambda: relu_after_sigmoid(x).sum().backward())
    """),
    md("""
        `Linear` saves its *input*, not its output, so the ReLU may overwrite the output.
        `Sigmoid` saves its *output* (its gradient is `s * (1 - s)`), so overwriting it would
        make the gradient wrong: autograd detects the change and stops. The same holds after
        `tanh`, `exp`, `softmax`, and anything else whose backward needs its result.

        A leaf tensor that requires grad cannot be changed in place at all, since autograd
        would lose the value it needs:
    """),
    code("""
        weight = torch.randn(3, requires_grad=True)
        attempt("weight.relu_()", lambda: weight.relu_())
        with torch.no_grad():
            weight.mul_(0.5)   # in-place updates of weights belong under no_grad (optimizers do this)
        print("under no_grad: ok, version", weight._version)
    """),
    md("""
        ## Fact-check: "in-place activations save memory"

        They save one temporary, at the moment the ReLU runs, and never the activations.
        Whether that lowers the peak depends on the shapes around it and on where the peak
        is: the measurements above show both cases. They are not free either: an in-place op
        in the wrong place is an error at backward time.

        ## What we measured
    """),
    code("""
        print(f"{'':<22}{'ReLU()':>12}{'inplace=True':>14}")
        for (shape, training, inplace), r in runs.items():
            if not inplace:
                name = f"{shape}, {'training' if training else 'inference'}"
                print(f"{name:<22}{format_bytes(r.peak):>12}{format_bytes(runs[shape, training, True].peak):>14}")
    """),
]

NOTEBOOKS["08_activation_checkpointing.ipynb"] = [
    md("""
        # 08 · Activation checkpointing

        Checkpointing trades compute for memory: a checkpointed block keeps only its input
        during the forward pass and runs its forward again during backward to get the
        activations back. In this notebook you will:

        - measure the activations and the peak of a 16-block network with no checkpointing,
          with `checkpoint` on every block, and with `checkpoint_sequential` at several
          segment counts, on a simulated A100;
        - see where the O(√n) rule comes from, when it holds and when it does not;
        - see why `use_reentrant=False` is the one to use;
        - count the extra compute (FLOPs) and time it on the CPU.
    """),
    code(SETUP),
    code("""
        from torch.utils.checkpoint import checkpoint, checkpoint_sequential

        def make_blocks(n=16, d=1024):
            return nn.Sequential(*[nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.LayerNorm(d))
                                   for _ in range(n)])

        def step(how, segments=4):
            stem, blocks = nn.Linear(1024, 1024).cuda(), make_blocks().cuda()
            h = stem(torch.randn(16, 256, 1024, device="cuda"))   # from here on, h requires grad
            if how == "none":
                out = blocks(h)
            elif how == "sequential":
                out = checkpoint_sequential(blocks, segments, h, use_reentrant=False)
            else:
                for block in blocks:
                    h = checkpoint(block, h, use_reentrant=(how == "each block, reentrant"))
                out = h
            out.square().mean().backward()
    """),
    md("Each variant on a fresh simulated A100 (`memmagic.measure`, as in notebook 03):"),
    code("""
        import memmagic
        def measure(how, segments=4):
            return memmagic.measure(lambda: step(how, segments), backend="sim", gpu="A100-40GB")

        runs = {"none": measure("none"), "each block": measure("each block"),
                "each block, reentrant": measure("each block, reentrant")}
        for name, r in runs.items():
            print(f"{name:<22} peak {format_bytes(r.peak):>10}   activations at the peak {format_bytes(r.breakdown['activations']):>10}")
    """),
    md("""
        ## Fact-check: "checkpointing cuts activation memory by 70%"
    """),
    code("""
        none, each = runs["none"], runs["each block"]
        print(f"activations at the peak: {1 - each.breakdown['activations'] / none.breakdown['activations']:.0%} less")
        print(f"peak:                    {1 - each.peak / none.peak:.0%} less")
        print(f"where the peak is now:   {each.peak_words}")
    """),
    md("""
        The saving depends on the block: a checkpointed block keeps its *input* (1024 numbers
        per token here) instead of everything its layers save (the 4096-wide hidden layer,
        the GELU's input, the LayerNorm's input and statistics). The wider the inside of a
        block compared with its input, the bigger the saving, so any fixed percentage is
        folklore. The peak falls by less than the activations: weights, gradients, and the
        one block being recomputed in backward remain.

        ## `checkpoint_sequential` and the O(√n) rule

        `checkpoint_sequential(layers, segments, x)` splits the layers into `segments` runs and
        checkpoints each run but the last. During backward it holds every segment boundary,
        plus the activations of one segment (the last one, stored normally, or one being
        recomputed). With `n` layers whose boundary costs as much as what a layer saves,
        that is `segments + n / segments` layers' worth, lowest at `segments = √n`: the
        O(√n) rule.

        Two networks, each over its own range of segment counts: the 16 wide blocks above, and
        a chain of 64 thin layers (`Linear(512, 512)` + ReLU), where a boundary costs as much
        as a layer saves.
    """),
    code("""
        def chain_step(segments, n=64):
            layers = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(n)]).cuda()
            h = nn.Linear(512, 512).cuda()(torch.randn(64, 256, 512, device="cuda"))
            out = checkpoint_sequential(layers, segments, h, use_reentrant=False)
            out.square().mean().backward()

        blocks16 = {s: measure("sequential", s) for s in [1, 2, 4, 8, 16]}
        chain64 = {s: memmagic.measure(lambda: chain_step(s), backend="sim", gpu="A100-40GB")
                   for s in [1, 2, 4, 8, 16, 32, 64]}
        for name, sweep in [("16 wide blocks", blocks16), ("64 thin layers", chain64)]:
            best = min(sweep, key=lambda s: sweep[s].peak)
            print(f"{name}: lowest peak at {best} segments; " +
                  ", ".join(f"{s}: {format_bytes(r.peak)}" for s, r in sweep.items()))
    """),
    code("""
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for name, sweep in [("16 wide blocks", blocks16), ("64 thin layers", chain64)]:
            counts = list(sweep)
            ax.plot(counts, [sweep[s].peak / sweep[1].peak for s in counts], "o-", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(chain64), list(chain64))
        ax.set_xlabel("segments")
        ax.set_ylabel("peak / peak without checkpointing")
        ax.legend()
        plt.show()
    """),
    md("""
        Read the chart for three things:

        - `segments=1` is *no* checkpointing: the last segment is never checkpointed, and with
          one segment that is all of them;
        - the thin chain follows the O(√n) rule: its minimum is at √64 = 8, and more segments
          make it worse again (too many boundaries to hold);
        - the wide blocks do not: a boundary (1024 numbers per token) is small next to what a
          block saves inside, so more segments keep helping, and checkpointing every block
          on its own is best.

        ## Reentrant or not

        `use_reentrant=True` is the older implementation. Its peak here, next to the
        non-reentrant one:
    """),
    code("""
        reentrant = runs["each block, reentrant"]
        print(f"reentrant: {format_bytes(reentrant.peak)}, non-reentrant: {format_bytes(each.peak)} "
              f"({format_bytes(reentrant.peak - each.peak, signed=True)})")
    """),
    md("""
        Close; its real pitfall is elsewhere: when no *input* of the checkpointed function requires grad, it
        records no graph at all, so the parameters inside get no gradient. A real run on the CPU:
    """),
    code("""
        import warnings
        for reentrant in [True, False]:
            block = nn.Linear(8, 8)
            data = torch.randn(4, 8)   # plain data: requires_grad is False
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = checkpoint(block, data, use_reentrant=reentrant)
            said = f" (warning: {caught[0].message})" if caught else ""
            print(f"use_reentrant={reentrant}: output requires grad: {out.requires_grad}{said}")
    """),
    md("""
        With the reentrant version, checkpointing the first layer of a network (whose input
        is the data) silently freezes it. `use_reentrant=False` also supports
        `torch.autograd.grad`, keyword arguments and nested checkpoints, and PyTorch asks you
        to choose explicitly: pass `use_reentrant=False` unless you know why not.

        ## What it costs: compute

        Every checkpointed block runs its forward twice. A forward pass is roughly a third
        of a training step's arithmetic (backward is about twice the forward), so expect about
        a third more. `FlopCounterMode` counts the floating-point operations exactly, on a
        smaller copy of the network run for real on the CPU:
    """),
    code("""
        from torch.utils.flop_counter import FlopCounterMode

        small = make_blocks(n=4, d=256)
        x_small = torch.randn(8, 128, 256, requires_grad=True)

        def cpu_step(checkpointed):
            h = x_small
            for block in small:
                h = checkpoint(block, h, use_reentrant=False) if checkpointed else block(h)
            h.square().mean().backward()

        flops = {}
        for checkpointed in [False, True]:
            with FlopCounterMode(display=False) as counter:
                cpu_step(checkpointed)
            flops[checkpointed] = counter.get_total_flops()
        print(f"GFLOPs per step: {flops[False] / 1e9:.2f} -> {flops[True] / 1e9:.2f} with checkpointing "
              f"({flops[True] / flops[False]:.2f}x)")
    """),
    md("""
        And the wall time of the same steps (best of five each, on one CPU thread, which is
        steadier on a shared machine). Timings vary from machine to machine and run to run, so
        this ratio is shown but not checked by the notebook tests.
    """),
    code("""
        import time

        def best_time(fn, repeats=5):
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return min(times)

        torch.set_num_threads(1)
        ratio = best_time(lambda: cpu_step(True)) / best_time(lambda: cpu_step(False))
        print(f"step time with checkpointing / without: {ratio:.1f}x (wall time)")
    """),
    md("## What we measured"),
    code("""
        table = {**runs, **{f"16 blocks, {s} segments": r for s, r in blocks16.items()},
                 "64 layers, no checkpoint": chain64[1], "64 layers, 8 segments": chain64[8]}
        print(f"{'':<26}{'peak':>11}{'activations':>13}")
        for name, r in table.items():
            print(f"{name:<26}{format_bytes(r.peak):>11}{format_bytes(r.breakdown['activations']):>13}")
        print(f"extra compute with checkpointing: {flops[True] / flops[False] - 1:+.0%} FLOPs")
    """),
]


NOTEBOOKS["09_cpu_offload.ipynb"] = [
    md("""
        # 09 · Offloading activations to the CPU: `save_on_cpu`

        `torch.autograd.graph.save_on_cpu()` moves every tensor autograd saves for backward
        to CPU memory during the forward pass and copies it back when backward needs it. In
        this notebook you will:

        - measure a transformer step with and without it on a simulated T4: GPU memory, and
          the CPU (host) memory it takes instead;
        - see what stays on the GPU, and combine offloading with a smaller batch to find what
          limits it;
        - count the bytes that cross the PCIe bus, the cost you pay in time.
    """),
    code(SETUP),
    code("""
        from torch.autograd.graph import save_on_cpu

        def make_model():
            layer = nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, batch_first=True)
            return nn.TransformerEncoder(layer, num_layers=4)

        def train_step(batch_size, offload):
            model = make_model().cuda()
            opt = torch.optim.AdamW(model.parameters())
            x = torch.randn(batch_size, 256, 512, device="cuda")
            with save_on_cpu(pin_memory=True) if offload else torch.enable_grad():
                loss = model(x).square().mean()
            loss.backward()
            opt.step()
    """),
    md("""
        Each run on a fresh simulated T4 (`memmagic.measure`, notebook 03). The report's
        `host_peak` is the most CPU memory the run's tensors held: with offloading, the
        saved activations live there.
    """),
    code("""
        import memmagic
        runs = {}
        for b in [8, 32]:
            for offload in [False, True]:
                runs[b, offload] = memmagic.measure(lambda: train_step(b, offload), backend="sim", gpu="T4")
        for (b, offload), r in runs.items():
            print(f"batch {b:>2}, save_on_cpu={offload!s:<5}: GPU peak {format_bytes(r.peak):>11}, "
                  f"CPU peak {format_bytes(r.host_peak):>11}, activations on the GPU {format_bytes(r.breakdown['activations']):>10}")
    """),
    code(BARS),
    code("""bars({f"batch {b}, save_on_cpu={o}": runs[b, o] for b in [8, 32] for o in [False, True]},
     "GPU memory with and without save_on_cpu (simulated T4)")"""),
    md("""
        ## What stays on the GPU

        The activations leave, everything else stays: weights, gradients, optimizer state,
        and in backward the tensors being copied back for the layer at hand, with that
        layer's temporaries. So the peak moves to wherever those are largest:
    """),
    code("""
        for (b, offload), r in runs.items():
            if offload:
                saved = 1 - r.peak / runs[b, False].peak
                print(f"batch {b}: GPU peak {saved:.0%} lower; the peak is now {r.peak_words}")
    """),
    md("""
        At the small batch the peak was already in the optimizer step, which offloading does
        not touch. At the large one the saving is large, and what remains grows with the
        batch too: temporaries of the forward and backward passes are never offloaded.

        ## The price: PCIe traffic

        Every saved tensor crosses the bus twice, to the CPU in forward and back in backward.
        With offloading, the CPU peak is those saved tensors. It is a little more than the
        activations of the plain run: `save_on_cpu` copies *every* tensor autograd saves, and
        a `Linear` saves its weight as well as its input, so the weights travel too, every
        step (and a tensor saved by two ops is copied twice).
    """),
    code("""
        weights = runs[8, False].breakdown["parameters"]
        for b in [8, 32]:
            offloaded = runs[b, True].host_peak
            print(f"batch {b}: CPU peak {format_bytes(offloaded)} = plain run's activations "
                  f"{format_bytes(runs[b, False].breakdown['activations'])} {format_bytes(offloaded - runs[b, False].breakdown['activations'], signed=True)}"
                  f" (the weights are {format_bytes(weights)}); over PCIe per step: {format_bytes(2 * offloaded)}")
    """),
    md("""
        The bytes are measured; the time they take depends on the machine's bus, so it is
        timed only on a real GPU, below.
    """),
    md("""
        `pin_memory=True` allocates the CPU copies in page-locked memory, which the GPU can
        copy to and from faster (and asynchronously); it is RAM the operating system cannot
        swap out, so the CPU needs that much free.

        **GPU only.** On a machine with CUDA, this cell times the real step with and without
        offloading (a CPU-only runner skips it):
    """),
    code("""
        if torch.cuda.is_available():
            import time
            def timed(offload, repeats=3):
                train_step(32, offload)                          # warm-up
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(repeats):
                    train_step(32, offload)
                torch.cuda.synchronize()
                return (time.perf_counter() - start) / repeats
            print(f"save_on_cpu step time / plain: {timed(True) / timed(False):.1f}x (wall time)")
        else:
            print("skipped: no CUDA GPU on this machine")
    """, "gpu-only"),
    md("""
        ## Fact-check: "offloading activations to the CPU frees the GPU of them"

        **Holds:** the saved activations leave the GPU (the activations category is empty in
        the forward pass and through most of backward), and at a large batch the peak falls
        a lot.

        **Does not hold:** it frees the *saved* tensors only. Weights, gradients, optimizer
        state and each layer's temporaries stay, so the peak does not fall to zero and may not
        move at all if it is in the optimizer step. The CPU must hold all the activations,
        and the bus must carry them twice per step. Checkpointing (notebook 08) trades the
        same memory for compute instead of bandwidth; the two can be combined.

        ## What we measured
    """),
    code("""
        print(f"{'':<24}{'GPU peak':>11}{'CPU peak':>11}")
        for (b, offload), r in runs.items():
            name = f"batch {b}, {'save_on_cpu' if offload else 'plain'}"
            print(f"{name:<24}{format_bytes(r.peak):>11}{format_bytes(r.host_peak):>11}")
    """),
]


NOTEBOOKS["10_leaks.ipynb"] = [
    md("""
        # 10 · Leaks in training loops

        Memory that grows step after step, or that will not go away after `del`, is usually a
        reference someone still holds. In this notebook you will measure:

        - `epoch_loss += loss` against `epoch_loss += loss.item()`, in a training loop and in
          an evaluation loop;
        - outputs kept in a list, and in Jupyter's own `Out` history;
        - `del` and `gc.collect()` on an object that refers to itself;
        - what `torch.cuda.empty_cache()` frees, and what it does not.
    """),
    code(SETUP),
    md("""
        Two loops over one batch: `train` takes optimizer steps, `evaluate` only computes the
        loss (and forgets `torch.no_grad()`). `keep` says how the running total is kept.
    """),
    code("""
        def train(steps, keep):
            total = 0
            for _ in range(steps):
                loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += loss if keep == "tensor" else loss.item()
            return total

        def evaluate(steps, keep):   # note: no torch.no_grad()
            total = 0
            for _ in range(steps):
                loss = nn.functional.cross_entropy(model(x), y)
                total += loss if keep == "tensor" else loss.item()
            return total
    """),
    md("""
        A small classifier, its optimizer and one batch go on the notebook's simulated T4,
        where they stay (as on a real GPU) for the cells below. One training step first, so
        that the gradients and the cuBLAS workspaces exist before anything is measured.
    """),
    code("""
        %%gpumem --backend sim --gpu T4 -q
        model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 10)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(512, 1024, device="cuda")
        y = torch.randint(10, (512,), device="cuda")
        train(1, "item")
    """),
    md("""
        ## `epoch_loss += loss`

        `loss` is a tensor with a graph behind it. Adding it to a running total builds a new
        graph that links every step's loss. `retained` is what a cell left on the GPU.
    """),
    code("""
        leaks = {}
        for loop in [train, evaluate]:
            for keep in ["tensor", "item"]:
                leaks[loop.__name__, keep] = %gpumem --backend sim --gpu T4 -q -o epoch_loss = loop(20, keep)
                del epoch_loss
        for (loop, keep), r in leaks.items():
            how = "total += loss       " if keep == "tensor" else "total += loss.item()"
            print(f"{loop:<8} 20 steps, {how}: the total holds {format_bytes(r.retained):>11}")
    """),
    md("""
        - In the **training** loop the GPU keeps only the total itself, one scalar:
          `backward()` already freed the tensors each step's graph had saved. What does pile
          up is the graph's bookkeeping (a few autograd nodes per step, in CPU memory), until
          the total is dropped.
        - In the **evaluation** loop there is no `backward()`: each step's whole graph, with
          every activation it saved, stays alive until the total is dropped. That is the leak
          people hit. `loss.item()` (or `torch.no_grad()`, notebook 06) fixes both.

        (`.item()` copies the value to the CPU, and waits for the GPU to get there: call it
        every few steps if that wait matters.)

        ## Outputs kept in a list

        Keeping outputs for later (to compute a metric at the end of the epoch) keeps their
        graphs too, unless they are detached:
    """),
    code("""
        def collect(steps, detach):
            outputs = []
            for _ in range(steps):
                out = model(x)
                outputs.append(out.detach() if detach else out)
            return outputs

        kept = {}
        for detach in [False, True]:
            kept[detach] = %gpumem --backend sim --gpu T4 -q -o outputs = collect(20, detach)
            del outputs
        print(f"20 outputs kept as they are: {format_bytes(kept[False].retained)}")
        print(f"20 outputs kept detached:    {format_bytes(kept[True].retained)}")
    """),
    md("""
        ## Jupyter's `Out` keeps what a cell showed

        A cell whose last line is an expression shows its value, and IPython keeps that value
        in `Out[n]`, `_` and `_n`. If the value is a tensor with a graph, the graph stays
        too. This part runs for real on the CPU (`--backend cpu` counts every tensor the
        notebook can still reach, `Out` included):
    """),
    code("""
        torch.manual_seed(0)
        layer = nn.Linear(2000, 2000)
        data = torch.randn(1000, 2000)
    """),
    code("""
        %%gpumem --backend cpu -q -v before_show
        pass
    """),
    code("layer(data).relu().mean()   # shown, so kept in Out, with its graph"),
    code("""
        %%gpumem --backend cpu -q -v after_show
        pass
    """),
    code("""
        print(f"showing one value kept {format_bytes(after_show.before - before_show.before)} alive "
              f"(the ReLU's saved output alone is {format_bytes(1000 * 2000 * 4)})")
    """),
    md("""
        Ending such a line with `;` shows nothing and keeps nothing. To drop what was already
        shown, `%reset -f out` empties `Out` and the numbered `_` variables. (Tools that run
        notebooks may keep the value elsewhere: nbval, which tests these notebooks, runs cells
        without history, so a shown value lands in `_0`, and `;` does not hide it there.)
    """),
    md("""
        ## `del` and `gc.collect()`

        `del name` removes a name; the object goes when its last reference does. An object
        that refers to itself (a cycle) is only freed by Python's cycle collector, which runs
        from time to time, or at once with `gc.collect()`:
    """),
    code("""
        %%gpumem --backend sim --gpu T4 -q
        import gc

        class Holder:
            def __init__(self):
                self.buffer = torch.empty(256, 2**20, dtype=torch.uint8, device="cuda")  # 256 MiB
                self.me = self                                                        # a cycle

        before = torch.cuda.memory_allocated()
        holder = Holder()
        del holder
        print("after del:         ", format_bytes(torch.cuda.memory_allocated() - before, signed=True))
        gc.collect()
        print("after gc.collect():", format_bytes(torch.cuda.memory_allocated() - before, signed=True))
    """),
    md("""
        Cycles are common: an exception's traceback refers to the frames that hold your
        tensors (Jupyter keeps the last one in `sys.last_traceback`), closures, objects with
        back-references. `gc.collect()` is worth a try when memory does not come back after
        `del`.

        ## What `torch.cuda.empty_cache()` frees

        PyTorch's caching allocator keeps freed GPU memory **reserved** for the next tensors
        instead of returning it to the driver (notebook 11). `empty_cache()` returns the
        cached blocks that hold no tensor. It does not free any tensor you still hold:
    """),
    code("""
        %%gpumem --backend sim --gpu T4 -q
        def show(when):
            print(f"{when:<28} allocated {format_bytes(torch.cuda.memory_allocated()):>11}, "
                  f"reserved {format_bytes(torch.cuda.memory_reserved()):>11}")

        del model, opt, x, y            # everything from the start of the notebook
        torch.cuda.empty_cache()
        show("start")
        a = torch.empty(512, 2**20, dtype=torch.uint8, device="cuda")
        b = torch.empty(512, 2**20, dtype=torch.uint8, device="cuda")
        show("two 512 MiB tensors")
        del a
        show("del a")
        torch.cuda.empty_cache()
        show("empty_cache()")
        del b
        show("del b")
        torch.cuda.empty_cache()
        show("empty_cache()")
    """),
    md("""
        After `del a` its memory is free *for PyTorch* (the next tensor reuses it) but still
        reserved, which is what `nvidia-smi` and other processes see. `empty_cache()` gave that
        back, and could not touch `b`, which was still referenced.

        ## Fact-checks

        - **"`epoch_loss += loss` leaks memory"**: in an evaluation loop without `no_grad()`,
          badly, a whole graph per step; in a training loop, not on the GPU (one scalar, measured
          above), only the graph's nodes in CPU memory.
        - **"`empty_cache()` frees memory"**: it frees *cached* memory, which your own process
          would have reused anyway. It helps other processes on the same GPU, and it makes
          `nvidia-smi` agree with `memory_allocated()`. It never frees a tensor that is still
          referenced; for that, find the reference (`del`, `gc.collect()`, `%reset -f out`).

        ## What we measured
    """),
    code("""
        rows = [(f"{loop}, total += {'loss' if keep == 'tensor' else 'loss.item()'}", r.retained)
                for (loop, keep), r in leaks.items()]
        rows += [("20 outputs, kept", kept[False].retained), ("20 outputs, detached", kept[True].retained),
                 ("a tensor shown in Out", after_show.before - before_show.before)]
        for name, nbytes in rows:
            print(f"{name:<32}{format_bytes(nbytes):>12}")
    """),
    code("""
        fig, ax = plt.subplots(figsize=(7, 3))
        ax.barh([name for name, _ in rows], [max(nbytes, 1) for _, nbytes in rows], color="C3")
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set_xlabel("bytes left on the GPU (log scale)")
        ax.set_title("What each habit leaves behind")
        plt.show()
    """),
]


NOTEBOOKS["11_caching_allocator.ipynb"] = [
    md("""
        # 11 · The caching allocator: allocated vs reserved

        PyTorch does not ask the CUDA driver for memory each time it makes a tensor. Its
        **caching allocator** takes large *segments* from the driver and cuts tensors out of
        them; a freed tensor's block goes back to PyTorch's cache, not to the driver. In this
        notebook you will:

        - watch **allocated** (bytes in live tensors) and **reserved** (bytes held from the
          driver) move apart, on the notebook's simulated T4;
        - learn the rounding and segment rules that make them differ;
        - build a case of **fragmentation**: free memory that cannot be used;
        - see what `empty_cache()` can and cannot release, what `PYTORCH_CUDA_ALLOC_CONF` changes,
          what `memory_summary()` shows, and the cuBLAS workspace that never goes away.
    """),
    code(SETUP),
    md("""
        Two helpers, written once here and used inside the simulated cells below (there,
        `torch.cuda` answers for the simulated GPU):
    """),
    code("""
        def alloc(mib):   # a tensor of `mib` MiB on the GPU (made of bytes, so the size is exact)
            return torch.empty(int(mib * 2**20), dtype=torch.uint8, device="cuda")

        history = {}
        def show(what):
            allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
            history[what] = (allocated, reserved)
            print(f"{what:<34} allocated {format_bytes(allocated):>11}   reserved {format_bytes(reserved):>11}")
    """),
    md("""
        ## Rounding and segments

        The rules, from PyTorch's `CUDACachingAllocator.cpp` (default settings):

        | request | rounded to | comes from |
        |---|---|---|
        | any | a multiple of 512 bytes | |
        | up to 1 MiB | | the *small pool*: 2 MiB segments |
        | 1 to 10 MiB | | the *large pool*: 20 MiB segments |
        | 10 MiB or more | | a segment of its own size, rounded up to 2 MiB |

        A free block is reused for any request it can hold (best fit), and split if enough is
        left over. Watch a 1-byte tensor and two slightly-over-a-boundary ones:
    """),
    code("""
        %%gpumem --backend sim --gpu T4 -q
        tiny = alloc(1 / 2**20)
        show("1 byte")
        medium = alloc(1 + 1 / 2**20)
        show("+ 1 MiB and 1 byte")
        big = alloc(100 + 1 / 2**20)
        show("+ 100 MiB and 1 byte")
    """),
    md("""
        One byte costs 512 bytes of *allocated* memory and a 2 MiB segment of *reserved*; just
        over 1 MiB takes a 20 MiB segment. Freeing does not return segments:
    """),
    code("""
        %%gpumem --backend sim --gpu T4 -q
        del tiny, medium, big
        show("after del")
        torch.cuda.empty_cache()
        show("after empty_cache()")
    """),
    md("""
        ## Fragmentation

        Twenty tensors of 6 MiB (three fit in each 20 MiB segment), then every other one is
        freed: 60 MiB are free in the cache. A 12 MiB tensor still needs a new segment,
        because no free *contiguous* block is 12 MiB long:
    """),
    code("""
        %%gpumem --backend sim --gpu T4 -q
        blocks = [alloc(6) for _ in range(20)]
        show("20 x 6 MiB")
        del blocks[::2]
        show("every other one freed")
        twelve = alloc(12)
        show("+ one 12 MiB tensor")
        torch.cuda.empty_cache()
        show("empty_cache()")
    """),
    code("""
        allocated, reserved = history["empty_cache()"]
        print(f"{format_bytes(reserved - allocated)} reserved but not allocated: "
              f"{1 - allocated / reserved:.0%} of what PyTorch holds on the GPU, in pieces too small for the 12 MiB tensor")
    """),
    md("""
        `empty_cache()` released nothing this time: it only returns segments that are entirely
        free, and every segment still holds one of the remaining tensors.

        In training, fragmentation comes from tensors of many sizes being made and freed in
        turn (activations, gradients, temporaries). The sign: `reserved` well above
        `allocated`, and an out-of-memory error whose message says a lot is "reserved by
        PyTorch but unallocated".
    """),
    code("""
        names = list(history)
        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.bar(range(len(names)), [history[n][1] / 2**20 for n in names], color="#bbbbbb", label="reserved")
        ax.bar(range(len(names)), [history[n][0] / 2**20 for n in names], color="C0", width=0.5, label="allocated")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_ylabel("MiB")
        ax.legend()
        plt.show()
    """),
    md("""
        ## `PYTORCH_CUDA_ALLOC_CONF`

        An environment variable, read once when CUDA starts (set it before the first CUDA
        call, best before starting Python). Its main options:

        - `expandable_segments:True`: segments can grow in place (virtual memory mapping), so
          blocks of different sizes end up adjacent instead of stranded in separate segments.
          Usually the most effective cure for fragmentation.
        - `max_split_size_mb:N`: blocks larger than N MiB are never split, so large free
          blocks stay whole for large requests (at the cost of more reserved memory).
        - `garbage_collection_threshold:0.8`: when reserved memory passes 80% of the card,
          cached blocks are released proactively instead of only after a failed allocation.

        **What the simulator models:** 512-byte rounding, the two pools and their segment
        sizes, best-fit reuse, splitting and merging, `empty_cache()`, the release-and-retry
        before an out-of-memory error, and of the options above `max_split_size_mb` (with
        `max_non_split_rounding_mb`) and `garbage_collection_threshold` (which torch applies
        only once `torch.cuda.set_per_process_memory_fraction` is set), read from the
        environment when a simulated GPU is made. **It does not model** `expandable_segments`
        (a simulated cell run with it set says so in its notes), streams (each stream has its
        own cached blocks), CUDA graphs' private pools, the CUDA context (hundreds of MiB that
        `nvidia-smi` counts too), or other processes. The model follows the allocator's
        source code; in this project it has not yet been checked against a real GPU.

        Where `max_split_size_mb` helps: a 100 MiB tensor is freed, then a 30 MiB and an
        85 MiB one are made. By default the 30 MiB tensor is cut out of the cached 100 MiB
        block, and the 85 MiB one no longer fits in the 70 MiB left: a new segment. With
        `max_split_size_mb:64` the 100 MiB block is never split for a smaller request, so it
        stays whole for the 85 MiB tensor. Each run below is on a fresh simulated T4 made
        with the setting (`memmagic.measure`):
    """),
    code("""
        import os
        import memmagic

        def mixed_sizes():
            big = alloc(100)
            del big
            a, b = alloc(30), alloc(85)

        saved = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        try:
            for conf in ["", "max_split_size_mb:64"]:
                os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
                r = memmagic.measure(mixed_sizes, backend="sim", gpu="T4")
                print(f"{conf or 'default':<22} allocated peak {format_bytes(r.peak)}, reserved peak {format_bytes(r.reserved_peak)}")
        finally:
            if saved is None:
                os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
            else:
                os.environ["PYTORCH_CUDA_ALLOC_CONF"] = saved
    """),
    md("""
        It does not help the fragmentation case above: those blocks are 6 MiB, below any
        allowed `max_split_size_mb` (at least 20). That is `expandable_segments`' job.

        **GPU only.** On a machine with CUDA, this cell runs both cases in fresh processes
        with three settings (a CPU-only runner skips it):
    """),
    code("""
        script = '''
        import torch
        def alloc(mib):
            return torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda")
        blocks = [alloc(6) for _ in range(20)]
        del blocks[::2]
        twelve = alloc(12)
        print("fragmentation:", torch.cuda.memory_allocated() // 2**20, "MiB allocated,", torch.cuda.memory_reserved() // 2**20, "MiB reserved")
        del blocks, twelve
        torch.cuda.empty_cache()
        big = alloc(100)
        del big
        a, b = alloc(30), alloc(85)
        print("mixed sizes:", torch.cuda.max_memory_reserved() // 2**20, "MiB reserved at the peak")
        '''
        if torch.cuda.is_available():
            import os, subprocess, sys, textwrap
            for conf in ["", "expandable_segments:True", "max_split_size_mb:64"]:
                env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf}
                run = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True)
                print(f"{conf or 'default':<26} {run.stdout.strip() or run.stderr.strip()[-200:]}")
        else:
            print("skipped: no CUDA GPU on this machine")
    """, "gpu-only"),
    md("""
        ## `memory_summary()` and `memory_stats()`

        On a real GPU, `torch.cuda.memory_summary()` prints a table of allocated, active and
        reserved memory, split into the small and large pools, with counts of allocations,
        frees, segments and allocation retries (a retry means the allocator had to free its
        cache to satisfy a request: a sign you are close to the limit). On the simulated GPU
        it is the same table: torch's own code prints it from `memory_stats()`, which the
        simulated allocator keeps under the same keys. "Non-releasable memory" is the free
        space inside segments that still hold a live block: `empty_cache()` cannot give it
        back, and it is what fragmentation costs:
    """),
    code("""
        %%gpumem --backend sim --gpu T4 -q
        print(torch.cuda.memory_summary(abbreviated=True))
        stats = torch.cuda.memory_stats()
        print("non-releasable:", format_bytes(stats["inactive_split_bytes.all.current"]),
              "| cudaMalloc retries:", stats["num_alloc_retries"])
    """),
    md("**GPU only.** The real table (a CPU-only runner skips it):"),
    code("""
        if torch.cuda.is_available():
            print(torch.cuda.memory_summary())
        else:
            print("skipped: no CUDA GPU on this machine")
    """, "gpu-only"),
    md("""
        ## The cuBLAS workspace

        The first matrix multiply on a thread makes cuBLAS allocate a *workspace* through
        PyTorch's allocator (about 8 MiB by default, 32 MiB on H100; `CUBLAS_WORKSPACE_CONFIG`
        sets it), and it is kept for the life of the process. It shows in
        `memory_allocated()` even when every tensor is gone. Backward runs on a thread of its
        own, which gets a second one. Measured on the simulated T4, starting from an empty card:
    """),
    code("%gpusim reset"),
    code("""
        %%gpumem --backend sim --gpu T4 -q -v first_matmul
        a = torch.randn(64, 64, device="cuda", requires_grad=True)
        (a @ a).sum().backward()
        del a
        show("after a matmul, a backward, del")
    """),
    code("""
        print("kept as workspaces:", format_bytes(first_matmul.breakdown["workspaces"]))
        print("tensors left:      ", format_bytes(first_matmul.after - first_matmul.breakdown["workspaces"]))
    """),
    md("""
        Real GPU tools see the workspaces too: they are why a "clean" GPU after one training
        step still shows some megabytes allocated.

        ## Fact-check: "`nvidia-smi` shows how much memory my tensors use"

        It shows what the process holds from the driver: PyTorch's *reserved* memory (tensors,
        cached free blocks, fragmentation) plus the CUDA context. Measured above, reserved
        ran well above allocated: the gap is memory no tensor uses. `memory_allocated()` is
        what your tensors use; `memory_reserved()` is what PyTorch holds.

        ## What we measured
    """),
    code("""
        print(f"{'':<34}{'allocated':>12}{'reserved':>12}")
        for what, (allocated, reserved) in history.items():
            print(f"{what:<34}{format_bytes(allocated):>12}{format_bytes(reserved):>12}")
    """),
]


# Notebooks 12 on (timeline and profiler, largest batch, sharding, the what-if playground,
# your own model) are in course_tools.py, made with the helpers above.
sys.path.insert(0, str(HERE))
from course_tools import notebooks as _more_notebooks  # noqa: E402

NOTEBOOKS.update(_more_notebooks(md, code, SETUP))


def build(name: str, cells) -> float:
    """Write notebook ``name`` and execute it in a fresh kernel; return the seconds it took."""
    from run import execute  # noqa: E402  (same folder)

    nb = new_notebook(cells=[dict(cell) for cell in cells])
    for i, cell in enumerate(nb.cells):
        nb.cells[i] = nbformat.from_dict(cell)
        nb.cells[i]["id"] = f"cell-{i:02d}"  # stable ids: a rebuild changes only what ran differently
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    path = HERE / name
    nbformat.write(nb, path)
    start = time.perf_counter()
    execute(str(path), write=True)
    took = time.perf_counter() - start
    print(f"wrote and executed {path} in {took:.0f} s")
    return took


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    wanted = sys.argv[1:]
    for name, cells in NOTEBOOKS.items():
        if not wanted or any(w in name for w in wanted):
            build(name, cells)
