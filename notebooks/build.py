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


def build(name: str, cells) -> None:
    from run import execute  # noqa: E402  (same folder)

    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    path = HERE / name
    nbformat.write(nb, path)
    execute(str(path), write=True)
    print(f"wrote and executed {path}")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    wanted = sys.argv[1:]
    for name, cells in NOTEBOOKS.items():
        if not wanted or any(w in name for w in wanted):
            build(name, cells)
