"""Figure 3g: ``generate()`` on a 1.1B Llama on the simulated GPU, at 128 and 512 new tokens.

The cell builds a Llama with TinyLlama-1.1B's shape (22 layers, hidden 2048, 32 heads, 4
key/value heads, vocabulary 32000) from its config in fp16 on the GPU and calls
``generate()`` greedily on a 64-token prompt for ``max_new_tokens`` tokens (and at least as
many), on a simulated T4. Each case runs in a fresh process: the wall time of the cell's
simulated run and the process's peak RSS. Three decode steps run op by op (about 2,400 ops
each at this size), most of the others are read off the line through them
(:mod:`memmagic.backends.sim.decode`): what grows with the tokens is generate()'s own loop
and each evaluated step's allocations on the allocator model.

Beside it, a decode loop written by hand: the nanoGPT-style training script of
``tests/course/scripts`` at GPT-2-124M's sizes, one training step, then sampling 8 and 512
tokens as nanoGPT's ``sample.py`` does (each call of the model on all the tokens so far;
:mod:`memmagic.backends.sim.repeats` reads the growing calls off a curve).
"""

from __future__ import annotations

import time
from typing import Any

from .common import Figure, status_of

__all__ = ["generate_scale_figure", "generate_row", "sample_row", "GENERATE_CELL", "TOKENS",
           "SAMPLE_TOKENS"]

GENERATE_CELL = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                     num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                     max_position_embeddings=2048)
with torch.device("cuda"):
    model = LlamaForCausalLM._from_config(config, torch_dtype=torch.float16)
ids = torch.randint(0, 32000, (1, 64), device="cuda")
out = model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                     do_sample=False)
"""
TOKENS = (8, 128, 512)
# a decode loop written by hand: the nanoGPT-style script (tests/course/scripts) at GPT-2-124M's
# sizes, trained one step, then sampling as nanoGPT's sample.py does (each call of the model
# on all the tokens so far, no cache)
SAMPLE_TOKENS = (8, 512)
SAMPLE_ARGS = ["--batch_size=1", "--block_size=1024", "--vocab_size=50304", "--n_layer=12",
               "--n_head=12", "--n_embd=768", "--max_iters=1", "--eval_interval=1",
               "--eval_iters=1", "--gradient_accumulation_steps=1", "--compile=False"]
# the aim: 512 new tokens cost about what a few do (here: at most 2x the 8-token run)
RATIO_TARGET = 2.0


def generate_row(tokens: int) -> dict[str, Any]:
    """The simulated run of :data:`GENERATE_CELL` at ``tokens`` new tokens, in this process."""
    import resource

    from memmagic import Cell

    cell = Cell(GENERATE_CELL, {"max_new_tokens": tokens}, backend_options={"gpu": "T4"})
    t0 = time.perf_counter()
    r = cell.run()
    wall = time.perf_counter() - t0
    return {"case": f"{tokens} new tokens", "tokens": tokens, "wall_s": wall,
            "per_token_s": wall / tokens, "peak": r.peak, "error": r.error,
            "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def sample_row(tokens: int) -> dict[str, Any]:
    """``python -m memmagic run --gpu T4`` of the nanoGPT-style script sampling ``tokens``
    tokens after one training step (:data:`SAMPLE_ARGS`), in this process."""
    import resource

    from .figures import DOCTOR_SCRIPT, cli_run

    code, wall, text = cli_run(["run", "--gpu", "T4", str(DOCTOR_SCRIPT), *SAMPLE_ARGS,
                                f"--sample_tokens={tokens}"])
    sampled = f"sampled {tokens} tokens" in text
    return {"case": f"nanoGPT-style sampling, GPT-2-124M, {tokens} new tokens", "tokens": tokens,
            "sample": True, "wall_s": wall, "per_token_s": wall / tokens,
            "error": None if code == 0 and sampled else f"exit {code}",
            "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def generate_scale_figure(threads: int = 1, against: Any = None) -> Figure:
    """Figure 3g: each token count's wall time beside the 8-token run's; ``against``
    (benchmarks.against.Against): each also with that commit's memmagic, in a process of
    its own beside this tree's."""
    from .figures import _beside, _threads_note

    fig = Figure(
        "g_generate_scale", "3g. generate() at 1.1B scale: 8, 128 and 512 new tokens",
        "a cell that builds a Llama of TinyLlama-1.1B's shape in fp16 from its config and "
        "calls generate() greedily on a 64-token prompt, exactly max_new_tokens tokens, on a "
        "simulated T4: the simulated run's wall time (model build included) and the "
        "process's peak RSS, each in a fresh process; and the nanoGPT-style training script "
        "(tests/course/scripts) at GPT-2-124M's sizes, one step at batch 1 x 1024, then "
        "sampling as nanoGPT's sample.py does (the model called on all the tokens so far), "
        "python -m memmagic run on a simulated T4, the whole command"
        + (against.method if against else ""),
        f"512 new tokens within {RATIO_TARGET:.0f}x the 8-token run (the issue's aim: "
        "512 tokens cost about what a few do)",
        [("case", "case", "text"), ("wall_s", "wall", "s"), ("per_token_s", "per token", "s"),
         ("ratio", "vs 8 tokens", "x"), ("peak", "peak", "text"),
         ("rss_mib", "peak RSS MiB", "text")]
        + ([("prev_wall_s", f"wall ({against.label})", "s"),
            ("prev_rss_mib", f"peak RSS MiB ({against.label})", "text")] if against else [])
        + [("status", "target", "text")],
        metric=("wall_s", "s"),
        notes=[_threads_note()],
    )
    for fn, tokens in (("generate_row", TOKENS), ("sample_row", SAMPLE_TOKENS)):
        _rows(fig, _beside(against, f"generate_scale:{fn}", [{"tokens": n} for n in tokens],
                           threads=threads), tokens[-1])
    return fig


def _rows(fig: Figure, pairs, last: int) -> None:
    """The rows of one case's token counts (each beside ``against``'s, where there is one):
    each wall time against the fewest tokens'; the target on ``last``'s."""
    rows = []
    for row, prev in pairs:
        if prev is not None:
            row.update(prev_wall_s=prev.get("wall_s", prev.get("median_s")),
                       prev_rss_mib=prev.get("rss_mib"))
        rows.append(row)
    base = rows[0].get("wall_s", rows[0].get("median_s"))
    for row in rows:
        wall = row.get("wall_s", row.get("median_s"))
        row["wall_s"] = wall
        if isinstance(wall, float) and isinstance(base, float):
            row["ratio"] = wall / base
        if isinstance(row.get("peak"), int):
            row["peak"] = f"{row['peak'] / 2 ** 30:.2f} GiB"
        for key in ("rss_mib", "prev_rss_mib"):
            if isinstance(row.get(key), float):
                row[key] = f"{row[key]:.0f}"
        row["status"] = ("n/a" if row.get("tokens") != last or "ratio" not in row
                         else status_of(row["ratio"] <= RATIO_TARGET))
        fig.rows.append(row)
