"""The course notebooks on tools beyond one report: the timeline next to torch.profiler and
PyTorch's snapshot viewer (12), the largest batch that fits a card (13), and sharding over
several GPUs (14). ``build.py`` adds them to its list: ``notebooks(md, code, setup)``
returns {file name: cells}, made with build.py's own cell helpers.
"""

from __future__ import annotations

import textwrap
from typing import Callable

__all__ = ["notebooks"]

def notebooks(md: Callable, code: Callable, setup: str) -> dict[str, list]:
    return {
        "12_timeline_profiler_snapshot.ipynb": _timeline(md, code, setup),
        "13_largest_batch.ipynb": _largest_batch(md, code, setup),
        "14_sharding.ipynb": _sharding(md, code, setup),
        "15_whatif_playground.ipynb": _playground(md, code, setup),
        "16_your_own_model.ipynb": _your_model(md, code, setup),
    }


# PyTorch's documented snapshot snippet around a transformer step: the same lines run on
# the simulated GPU and, in a GPU-only cell, on a real one
_SNAPSHOT_SNIPPET = """\
torch.cuda.memory._record_memory_history(max_entries=100_000)
model, _ = zoo.build("transformer", device="cuda")
opt = torch.optim.AdamW(model.parameters())
tokens = torch.randint(0, 1000, (8, 128), device="cuda")
model.loss(tokens, tokens).backward()
opt.step()
torch.cuda.memory._dump_snapshot("{path}")
torch.cuda.memory._record_memory_history(None)
"""


def _timeline(md, code, setup) -> list:
    return [
        md("""
            # Memory over time: the timeline, `torch.profiler` and PyTorch's snapshot viewer

            A report gives the peak. To see *how* memory rises and falls through a training
            step — the forward pass filling up with saved activations, backward handing them
            back while gradients appear, the optimizer's temporaries on top — you want a
            timeline. Three tools draw one:

            * memmagic's timeline (`--timeline`, or `timeline_chart(report)`), by category and phase;
            * `torch.profiler` with `profile_memory=True`, which logs every allocation and free;
            * PyTorch's memory snapshot viewer (https://pytorch.org/memory_viz), which draws the
              caching allocator's history from a pickle file.

            **You will learn** to read a step's memory over time, to find which module and
            which phase make the peak, and to check one tool against another.
        """),
        code(setup),
        md("""
            ## One real step on the CPU, measured op by op

            The zoo's small transformer (2 blocks, d=256, sequence 128, batch 8) trains one
            AdamW step for real on the CPU. `-v step` keeps the report.
        """),
        code("""
            from memmagic import zoo
            model, batch = zoo.build("transformer")
            opt = torch.optim.AdamW(model.parameters())
        """),
        code("""
            %%gpumem --backend cpu -q -v step
            loss = model.loss(*batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        """),
        code("""
            print(step)
            print("peak reached", step.peak_words)
        """),
        md("""
            ## The timeline

            Live bytes by category against the op index. Shaded bands mark the phases:
            forward, backward, the optimizer step. Watch the green activations grow through
            the forward pass and fall through backward while the gradients (orange) appear.
        """),
        code("""
            from memmagic.plots import timeline_chart
            timeline_chart(step)
        """),
        md("""
            The same record gives a per-module table: which block saved how much for backward.
            `modules_at(depth)` sums it at a depth of the module tree; the rows add up to the
            `activations` category at the peak.
        """),
        code("""
            for row in step.modules_at(3):
                if row.activations_max:
                    print(f"{row.module:<22} saved at most {format_bytes(row.activations_max):>11}")
        """),
        md("""
            ## The same step under `torch.profiler`

            The profiler logs an event for every allocation and free (`profile_memory=True`)
            and adds them up per op: `self_cpu_memory_usage` is what an op allocated minus
            what it freed itself. Its table names the ops that allocated most (we print only
            the memory columns: the times change from run to run).
        """),
        code("""
            import os
            from contextlib import contextmanager
            from torch.profiler import profile, ProfilerActivity

            @contextmanager
            def quiet_stderr():
                \"\"\"The profiler's C++ library logs start/stop lines to stderr: drop them.\"\"\"
                saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, 2)
                try:
                    yield
                finally:
                    os.dup2(saved, 2)
                    os.close(saved), os.close(null)

            with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                loss = model.loss(*batch)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            ops = sorted(prof.key_averages(), key=lambda e: (-e.self_cpu_memory_usage, e.key))
            print(f"{'op':<34}{'calls':>6}{'self memory':>14}")
            for e in ops[:6]:
                print(f"{e.key:<34}{e.count:>6}{format_bytes(e.self_cpu_memory_usage):>14}")
        """),
        md("""
            Compare with memmagic's view of the same step: which ops made the storages that
            were live at the peak, by category.
        """),
        code("""
            from collections import Counter
            at_peak = Counter()
            for storage, category in step.trace.live_at():  # the storages live at the peak
                op = (storage.op_name or "before the step").split(".")[0]
                at_peak[(op, category)] += storage.nbytes
            for (op, category), nbytes in at_peak.most_common(6):
                print(f"{op:<22}{category:<17}{format_bytes(nbytes):>12}")
        """),
        md("""
            Both count the same tensor allocations (memmagic's benchmarks check the peaks agree
            to within 0.01% on these models; the profiler also sees scratch buffers some CPU
            kernels allocate inside themselves, which no per-op tracker can see). What the
            profiler's table does not say is *what* the memory was for, or when it was live
            together: which bytes were gradients or saved activations at the peak. That is
            the part memmagic's trace adds.

            ## PyTorch's snapshot viewer

            On a GPU, `torch.cuda.memory._record_memory_history()` records the caching
            allocator's history and `torch.cuda.memory._dump_snapshot("file.pickle")` writes
            it; dropping the file on https://pytorch.org/memory_viz draws every block over
            time, with the Python stack that allocated it. memmagic writes the same file
            format from a simulated run, with the simulated allocator's segments and
            addresses, so you can explore it without a GPU.
        """),
        code("""
            %%gpumem --backend sim --gpu T4 -q -v sim_step
            model, _ = zoo.build("transformer", device="cuda")
            opt = torch.optim.AdamW(model.parameters())
            tokens = torch.randint(0, 1000, (8, 128), device="cuda")
            loss = model.loss(tokens, tokens)
            loss.backward()
            opt.step()
        """),
        code("""
            from memmagic.snapshot import write_snapshot, snapshot_dict
            path = write_snapshot(sim_step, "transformer_step.pickle")
            snap = snapshot_dict(sim_step)
            events = snap["device_traces"][0]
            print(f"wrote {path}: {len(snap['segments'])} segments, {len(events)} events")
            print("kinds of event:", sorted({e['action'] for e in events}))
        """),
        md("""
            PyTorch's own snippet for this also runs as written on the simulated GPU: there
            `_record_memory_history()` and `_dump_snapshot()` record and write the simulated
            allocator's history (and `memory_summary()`, `memory_stats()` read its counters):
        """),
        code("%%gpumem --backend sim --gpu T4 -q\n" + _SNAPSHOT_SNIPPET.format(path="snippet_step.pickle")),
        code("""
            import pickle
            with open("snippet_step.pickle", "rb") as f:
                snippet = pickle.load(f)
            def allocations(s):
                return sum(e["action"] == "alloc" for e in s["device_traces"][0])
            print("allocations recorded by the snippet:", allocations(snippet))
            print("allocations in memmagic's file:     ", allocations(snap))
            workspaces = sum(e["action"] == "alloc" and e.get("category") == "workspaces"
                             for e in snap["device_traces"][0])
            print("of which cuBLAS workspaces:         ", workspaces)
        """),
        md("""
            The same step, the same allocations, but for the cuBLAS workspaces: the first
            cell on this simulated GPU made them (the main thread's cuBLAS and cuBLASLt
            workspaces and the backward thread's), and as on a GPU they stay for the life of
            the process, so the second run did not allocate them again.
        """),
        md("""
            Drag `transformer_step.pickle` onto https://pytorch.org/memory_viz ("Active Memory
            Timeline"). Each allocation's "stack" says the module, the phase and the op that
            made it. The viewer and memmagic's timeline draw the same history:
        """),
        code("""
            timeline_chart(sim_step)
        """),
        code("# On a real GPU only: the allocator's own history, for the same viewer.\n"
             "if torch.cuda.is_available():\n"
             + textwrap.indent(_SNAPSHOT_SNIPPET.format(path="real_step.pickle")
                               + 'print("wrote real_step.pickle")\n', "    ")
             + "else:\n"
             + '    print("no GPU here: this cell records the real allocator on a GPU machine")',
             "gpu-only"),
        md("""
            ## What we measured
        """),
        code("""
            print(f"{'':<34}{'bytes':>12}")
            print(f"{'CPU step, memmagic increment':<34}{format_bytes(step.increment):>12}")
            print(f"{'CPU step, profiler: top op':<34}{format_bytes(ops[0].self_cpu_memory_usage):>12}")
            print(f"{'simulated T4 step, peak':<34}{format_bytes(sim_step.peak):>12}")
            print(f"{'simulated T4 step, reserved':<34}{format_bytes(sim_step.reserved_peak):>12}")
            print("CPU step's peak:", step.peak_words)
            print("T4 step's peak: ", sim_step.peak_words)
        """),
    ]


def _largest_batch(md, code, setup) -> list:
    return [
        md("""
            # The largest batch that fits a card

            "What batch size can I use on a T4?" is the first question of every project. The
            usual answer is trial and error on the GPU (Lightning's `BatchSizeFinder`,
            accelerate's `find_executable_batch_size`): double the batch until it runs out
            of memory, then back off. On the simulated GPU the same search takes seconds,
            needs no GPU, and shows *why* each size fails.

            **You will learn** to sweep the batch size for several strategies, to find the
            largest batch that fits with a safety margin, and why a margin is needed.
        """),
        code(setup),
        md("""
            ## A cell that reads its batch size

            memmagic's what-if engine re-runs a cell's code with knobs. A cell that reads the
            plain variable `batch_size` receives each value tried. The cell trains one AdamW
            step of the zoo's small transformer on a simulated T4.
        """),
        code('''
            from memmagic import zoo
            from memmagic.cell import Cell
            from memmagic.sweep import sweep, find_batch_size

            STEP = """
            model, _ = zoo.build("transformer", device="cuda")
            opt = torch.optim.AdamW(model.parameters())
            tokens = torch.randint(0, 1000, (batch_size, 128), device="cuda")
            loss = model.loss(tokens, tokens)
            loss.backward()
            opt.step()
            """
            cell = Cell(STEP, globals(), backend="sim", backend_options={"gpu": "T4"},
                        defaults={"batch_size": 8})
            print(cell.run())
        '''),
        md("""
            ## Sweep the batch size, for four strategies

            `sweep` runs the cell for each batch size under each combination of AMP and
            activation checkpointing, and marks the largest batch that fits the card.
        """),
        code("""
            result = sweep(cell, "batch_size", [64, 256, 1024, 2048, 4096, 8192])
            for strategy, largest in result.largest_fitting().items():
                print(f"{strategy:<18} largest that fits: {largest}")
        """),
        code("""
            result.chart()
        """),
        md("""
            Memory grows almost linearly with the batch here: activations dominate. A strategy
            that cuts activations moves the whole line down, so the same card fits a larger
            batch; one that does not (read the chart: which lines coincide?) buys nothing for
            this model on this card. The what-if notes on each report say what was applied.

            ## The largest batch, with a safety margin

            A batch whose simulated peak is exactly the card's size will not fit in practice:
            the CUDA context (several hundred MiB), other processes and fragmentation that
            grows over a long run take their share. `find_batch_size` keeps a margin (10% by
            default) and says how it searched.
        """),
        code("""
            found = find_batch_size(cell, margin=0.10)
            print(found.how)
        """),
        code("""
            tight = find_batch_size(cell, margin=0.0)
            print(f"largest batch with no margin: {tight.batch_size}, with 10%: {found.batch_size}")
        """),
        md("""
            ## Fact-check: "just double the batch until it crashes"

            Doubling finds a power of two; the largest batch that fits lies between the last
            success and the first failure, and bisection finds it in a few more runs. On a
            real GPU each failed trial leaves cached blocks behind, so a finder must empty
            the cache after every trial (memmagic's `method="trials"` does), or later trials
            fail for the wrong reason.
        """),
        code("""
            # On a real GPU only: the same search by real trials.
            if torch.cuda.is_available():
                real = Cell(STEP, globals(), backend="cuda", defaults={"batch_size": 8})
                print(find_batch_size(real, method="trials", margin=0.10).how)
            else:
                print("no GPU here: method='trials' runs real steps on a GPU machine")
        """, "gpu-only"),
        md("## What we measured"),
        code("""
            for strategy, largest in result.largest_fitting().items():
                print(f"{strategy:<18} fits up to batch {largest} of those tried")
            print(f"largest batch with a 10% margin (fp32): {found.batch_size}; with none: {tight.batch_size}")
        """),
    ]


def _sharding(md, code, setup) -> list:
    return [
        md("""
            # More GPUs: data parallel, ZeRO and FSDP

            With more than one GPU there are two ways to train. **Data parallel** (DDP) keeps a
            full copy of the model, its gradients and its optimizer state on every GPU, and
            splits the batch. **Sharding** (ZeRO stages 1-3, PyTorch's FSDP) splits those
            copies: stage 1 shards the optimizer state, stage 2 the gradients too, stage 3
            (FSDP) the parameters as well, gathering each layer's parameters just when it runs.

            **You will learn** what each stage saves per GPU, on paper and measured by running
            a model under PyTorch's own FSDP2 on simulated GPUs, and what sharding does not
            shard: the activations.
        """),
        code(setup),
        md("""
            ## On paper: 16 bytes per parameter

            Mixed-precision training with Adam keeps, per parameter, fp32 weights (4 B),
            gradients (4 B) and two Adam moments (8 B): 16 B. For a GPT-2-small-sized model
            (124 M parameters):
        """),
        code("""
            params = 124_000_000
            weights, grads, adam = 4 * params, 4 * params, 8 * params
            print(f"{'GPUs':>4} {'DDP':>10} {'ZeRO-1':>10} {'ZeRO-2':>10} {'ZeRO-3/FSDP':>12}")
            for n in (1, 2, 4, 8):
                ddp = weights + grads + adam
                z1 = weights + grads + adam // n
                z2 = weights + (grads + adam) // n
                z3 = (weights + grads + adam) // n
                print(f"{n:>4} {format_bytes(ddp):>10} {format_bytes(z1):>10} "
                      f"{format_bytes(z2):>10} {format_bytes(z3):>12}")
        """),
        md("""
            These are the model's *states* only. The activations depend on the batch each GPU
            runs, and no ZeRO stage shards them.

            ## Measured: FSDP2 on simulated GPUs

            `shard_memory` runs a training cell as rank 0 of N simulated GPUs with PyTorch's
            fake process group (no GPUs, no network), shards the cell's model with FSDP2's
            `fully_shard` when the cell makes its optimizer, and reports rank 0's memory.
        """),
        code('''
            from memmagic import zoo
            from memmagic.sharding import shard_memory

            STEP = """
            model, batch = zoo.build("transformer", device="cuda")
            opt = torch.optim.AdamW(model.parameters())
            loss = model.loss(*batch)
            loss.backward()
            opt.step()
            """
        '''),
        code("""
            %%gpumem --backend sim -q -v one_gpu
            model, batch = zoo.build("transformer", device="cuda")
            opt = torch.optim.AdamW(model.parameters())
            loss = model.loss(*batch)
            loss.backward()
            opt.step()
        """),
        code("""
            sharded = shard_memory(STEP, globals(), world_sizes=(2, 4))
            rows = [("1 GPU", one_gpu)] + [(f"FSDP2 over {r.world_size}", r.report) for r in sharded]
            print(f"{'':<14}{'peak':>11}{'activations at peak':>21}{'after the step':>16}")
            for name, r in rows:
                print(f"{name:<14}{format_bytes(r.peak):>11}"
                      f"{format_bytes(r.breakdown['activations']):>21}{format_bytes(r.after):>16}")
        """),
        md("""
            After the step, each GPU keeps its shard of the parameters, the gradients and
            AdamW's two moments: that part shrinks with N (what stays is cuBLAS's workspaces).
            The peak does not: it is in backward, where the activations dominate.

            ## Fact-check: "FSDP over N GPUs divides memory by N"

            Only the model's states are divided, and not exactly: FSDP2 gathers a layer's full
            parameters while that layer runs, so a layer's worth stays unsharded at a time,
            and the activations of each GPU's share of the batch do not shrink at all. For a
            small model with a large batch, sharding hardly helps; for a large model with a
            small batch it is what makes training fit.
        """),
        md("## What we measured"),
        code("""
            base = one_gpu.peak
            for name, r in rows:
                print(f"{name:<14} peak {format_bytes(r.peak):>11}  ({r.peak / base:.0%} of one GPU's)")
        """),
    ]


def _playground(md, code, setup) -> list:
    return [
        md("""
            # The what-if playground

            Every strategy of this course in one place: put `--whatif` on a cell and a panel
            of controls appears under it. Move the batch-size slider, switch AMP or activation
            checkpointing, pick another card: the cell re-runs on the simulated GPU (it
            touches nothing real) and the chart shows the baseline and the new setting side
            by side, with the saving and whether it fits.

            **You will learn** to ask "what would this change do to memory?" of your own cell,
            in seconds, before you try it on a GPU.

            *The panel is a widget: in JupyterLab, Notebook 7, VS Code or Colab you can move
            its controls. The cells after it set the same controls from code, so the numbers
            below are stored in the notebook.*
        """),
        code(setup),
        md("""
            ## A training cell that reads its knobs

            The cell reads the plain variables `batch_size` and `accum_steps` and handles
            them itself (a micro-batch loop, as in notebook 04); memmagic applies the other
            knobs (autocast around the forward for AMP, checkpointing of the repeated blocks,
            another optimizer, the weights' dtype). `-v panel` keeps the panel so later cells
            can drive it.
        """),
        code("""
            from memmagic import zoo
            batch_size, accum_steps = 16, 1
        """),
        code("""
            %%gpumem --backend sim --gpu T4 --whatif -v panel
            model, _ = zoo.build("transformer", device="cuda")
            opt = torch.optim.AdamW(model.parameters())
            for _ in range(accum_steps):
                tokens = torch.randint(0, 1000, (batch_size // accum_steps, 128), device="cuda")
                loss = model.loss(tokens, tokens) / accum_steps
                loss.backward()
            opt.step()
        """),
        md("""
            ## Moving the controls from code

            `panel.set(...)` does what moving a control does. Each line below is one move;
            `panel.report` is the report of the current setting.
        """),
        code("""
            def show(what):
                r = panel.report
                change = r.peak / panel.baseline_report.peak - 1
                print(f"{what:<36} peak {format_bytes(r.peak):>11}  {change:+.0%} vs the baseline")

            show("baseline")
            panel.set(batch_size=64); show("batch 64")
            panel.set(amp="fp16"); show("batch 64, AMP fp16")
            panel.set(checkpointing=True); show("batch 64, AMP fp16, checkpointing")
        """),
        code("""
            panel.set(amp="off", checkpointing=False, batch_size=16, accum_steps=4)
            show("batch 16 as 4 micro-batches of 4")
            panel.set(accum_steps=1, optimizer="sgd"); show("batch 16, plain SGD")
        """),
        md("""
            The panel under the cell above now shows the last setting. Its text form (what a
            notebook stores) says the setting and the peak in one line:
        """),
        code("""
            panel
        """),
        md("""
            ## Try it

            Move the controls yourself. Before each move, guess: up or down, and by how much?
            Which knob helps most at batch 16, and which at batch 64? (The activations grow
            with the batch; the model's states do not.)

            ## What we measured
        """),
        code("""
            for what, setting in [("baseline", {}), ("batch 64", {"batch_size": 64}),
                                  ("batch 64, AMP fp16", {"batch_size": 64, "amp": "fp16"}),
                                  ("batch 64, AMP + ckpt", {"batch_size": 64, "amp": "fp16",
                                                            "checkpointing": True})]:
                r = panel.cell.run(**setting)
                print(f"{what:<24}{format_bytes(r.peak):>12}  {r.peak_words}")
        """),
    ]


STEP_GPT2 = """
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=6, n_embd=512, n_head=8, n_positions=1024, vocab_size=50257)
    model = GPT2LMHeadModel(config).to("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), device="cuda")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
"""


def _your_model(md, code, setup) -> list:
    step = "\n".join(line[4:] for line in STEP_GPT2.strip("\n").splitlines())
    return [
        md("""
            # Your own model

            A template: replace the model, the batch and the card with yours, run all, and
            read what would happen on that GPU, and which strategy would make it fit. It runs
            on the simulated GPU, so you need no GPU to try a model that would not fit yours.

            **You will learn** to go from "CUDA out of memory" to a measured plan.
        """),
        code(setup),
        md("""
            ## 1. Your model and batch

            Build the model as your code does (here a small GPT-2 from a `transformers`
            config; any `nn.Module` works), on `device="cuda"`: in a simulated cell that is the
            simulated GPU.
        """),
        code("""
            GPU = "T4"           # the card you want to train on: T4, A10G, A100-40GB, RTX4090, ...
            batch_size = 8
            seq_len = 512
        """),
        code("%%gpumem --backend sim --gpu $GPU -v report --timeline\n" + step),
        md("""
            ## 2. Where does the memory go?

            The report above gives the breakdown at the peak and the timeline shows when.
            Which modules saved the most for backward:
        """),
        code("""
            for row in report.modules_at(3)[:6]:
                print(f"{row.module:<32}{format_bytes(row.activations):>12}  {row.share:6.1%} of the peak")
        """),
        md("""
            ## 3. Which strategy helps, and by how much?

            The same cell re-run with each knob, on the same card (`Cell` is the what-if
            engine under the panel). `STEP` is the cell above, as text.
        """),
        code('from memmagic.cell import Cell\n\nSTEP = """\n' + step + '\n"""\n'
             'cell = Cell(STEP, globals(), backend="sim", backend_options={"gpu": GPU},\n'
             '            defaults={"batch_size": batch_size})'),
        code("""
            for what, knobs in [("as written", {}), ("AMP fp16", {"amp": "fp16"}),
                                ("checkpointing", {"checkpointing": True}),
                                ("AMP fp16 + checkpointing", {"amp": "fp16", "checkpointing": True}),
                                ("half the batch", {"batch_size": batch_size // 2})]:
                r = cell.run(**knobs)
                verdict = "fits" if r.fits else "does not fit"
                print(f"{what:<26}{format_bytes(r.peak):>11}  reserved {format_bytes(r.reserved_peak):>11}  {verdict} {GPU}")
        """),
        md("""
            ## 4. The largest batch that fits

            With a 10% margin for the CUDA context and fragmentation:
        """),
        code("""
            from memmagic.sweep import find_batch_size
            print(find_batch_size(cell, margin=0.10, high=256).how)
        """),
        md("""
            ## What we measured

            Change the model, `GPU`, `batch_size` and `seq_len` at the top and run all again.
        """),
        code("""
            print(report)
            print("peak:", report.peak_words)
        """),
    ]
