"""Figure 3p: the what-if panel on a Llama 3 8B with LoRA, with sizes read off its runs and
without.

The cell builds a Llama 3 8B from its config in bf16 on the GPU, wraps its attention
projections in LoRA adapters (peft, r=16) and trains one AdamW step over the adapters, at
1 x 1024 tokens on a simulated A100 80GB (it fits as written). A user's moves, in order, go
to a panel that reads batch sizes and context lengths off its earlier runs
(``WhatIfPanel(evaluate=True)``, the default) and to one that runs every setting
(``evaluate=False``, what every panel did before), each in a fresh process. Each move is
timed from setting the control to the redrawn panel. Where both answer a setting by a run,
or the evaluated one fits, the numbers must be equal to the byte.
"""

from __future__ import annotations

import time
from typing import Any

from .common import Figure, median, status_of

__all__ = ["panel_scale_figure", "panel_scale_row", "LORA_8B_CELL", "MOVES"]

LORA_8B_CELL = """
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                     max_position_embeddings=8192)
with torch.device("cuda"):
    model = LlamaForCausalLM._from_config(config, torch_dtype=torch.bfloat16)
model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32,
                                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
ids = torch.randint(0, 128256, (batch_size, seq_len), device="cuda")
loss = model(input_ids=ids, labels=ids).loss
loss.backward()
opt.step()
"""
CARD = "A100-80GB"
# a user's moves: the context up and down, the batch up (batch 1 takes a path of its own:
# no copy where a dimension of 1 makes a tensor contiguous), then other knobs
MOVES = [("seq_len", 2048), ("seq_len", 4096), ("seq_len", 8192), ("seq_len", 512),
         ("seq_len", 3072), ("seq_len", 1024), ("batch_size", 2), ("batch_size", 3),
         ("batch_size", 4), ("batch_size", 6), ("batch_size", 8), ("batch_size", 1),
         ("checkpointing", True), ("optimizer", "sgd")]
SIZE_TARGET_S, OTHER_TARGET_S = 0.5, 2.0  # the issue's: batch and context, the other knobs


def panel_scale_row(evaluate: bool) -> dict[str, Any]:
    """The moves of :data:`MOVES` on a panel of :data:`LORA_8B_CELL`: per move, its time,
    how it was answered and the numbers."""
    import resource

    from memmagic import Cell, WhatIfPanel

    cell = Cell(LORA_8B_CELL, {"batch_size": 1, "seq_len": 1024}, backend_options={"gpu": CARD})
    t0 = time.perf_counter()
    panel = WhatIfPanel(cell, debounce_s=0, evaluate=evaluate)
    moves = [{"move": "baseline", "s": time.perf_counter() - t0, "how": "run"}]
    for name, value in MOVES:
        runs = panel.runs
        t0 = time.perf_counter()
        panel.set(**{name: value})
        wall = time.perf_counter() - t0
        r = panel.report
        how = ("evaluated" if r.interpolated else "run" if panel.runs > runs else "cached")
        moves.append({"move": f"{name}={value}", "s": wall, "how": how, "peak": r.peak,
                      "reserved": r.reserved_peak, "fits": r.fits,
                      "ran_out": r.failed_request is not None})
    return {"evaluate": evaluate, "moves": moves,
            "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _same(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Whether two answers of one move agree: equal numbers where both are whole answers;
    'n/a' where one run ran out of memory (it stopped there: the evaluated need is the
    whole step's)."""
    if a.get("ran_out") or b.get("ran_out"):
        return "n/a (a run ran out)" if a.get("fits") == b.get("fits") else "NO"
    keys = ("peak", "reserved", "fits")
    return "yes" if all(a.get(k) == b.get(k) for k in keys) else "NO"


def panel_scale_figure(threads: int = 1, against: Any = None) -> Figure:
    """Figure 3p: each move's time with sizes read off runs, beside every move run;
    ``against`` (benchmarks.against.Against): the panel as shipped also with that commit's
    memmagic, in a process of its own."""
    from .figures import _beside, _threads_note

    fig = Figure(
        "p_panel_scale", "3p. The what-if panel at 8B scale: sizes read off runs",
        "a WhatIfPanel on a cell that builds Llama 3 8B in bf16 from its config, LoRA r=16 on "
        "the attention projections (peft), one AdamW step over the adapters, 1 x 1024 tokens, "
        f"on a simulated {CARD}; the moves in order (context 2048, 4096, 8192, 512, 3072, "
        "1024; batch 2, 3, 4, 6, 8, 1; checkpointing on; SGD), each timed from setting the "
        "control to the redrawn panel; 'read off runs': the panel as shipped "
        "(evaluate=True), 'every move run': evaluate=False; each panel in a fresh process"
        + (against.method if against else ""),
        f"a batch or context move answered off runs under {SIZE_TARGET_S} s; other knobs "
        f"under {OTHER_TARGET_S:.0f} s; the same numbers where both are whole answers",
        [("move", "move", "text"), ("off_s", "every move run", "s"), ("off_how", "how", "text"),
         ("on_s", "read off runs", "s"), ("on_how", "how", "text")]
        + ([("prev_s", f"read off runs ({against.label})", "s"),
            ("prev_how", f"how ({against.label})", "text")] if against else [])
        + [("need", "needs", "text"), ("same", "same numbers", "text"),
           ("status", "target", "text")],
        metric=("on_s", "s"),
        notes=[_threads_note()],
    )
    jobs = [{"evaluate": False}, {"evaluate": True}]
    (off, _), (on, prev) = _beside(against, "panel_scale:panel_scale_row", jobs, threads=threads)
    prev_moves = (prev or {}).get("moves") or []
    if "moves" not in off or "moves" not in on:
        fig.rows.append({"move": "failed", "off_s": off.get("median_s"), "on_s": on.get("median_s")})
        return fig
    for i, (a, b) in enumerate(zip(off["moves"], on["moves"])):
        row = {"move": a["move"], "off_s": a["s"], "off_how": a["how"], "on_s": b["s"],
               "on_how": b["how"], "same": _same(a, b) if a["move"] != "baseline" else "",
               "need": _need(b)}
        if len(prev_moves) == len(on["moves"]):
            row.update(prev_s=prev_moves[i]["s"], prev_how=prev_moves[i]["how"])
        size = a["move"].split("=")[0] in ("batch_size", "seq_len")
        if b["how"] == "evaluated":
            row["status"] = status_of(b["s"] < SIZE_TARGET_S and row["same"] != "NO")
        elif not size and a["move"] != "baseline":
            row["status"] = status_of(b["s"] < OTHER_TARGET_S)
        else:
            row["status"] = "n/a"
        fig.rows.append(row)
    fig.notes.append(f"peak RSS: {off.get('rss_mib', 0):.0f} MiB every move run, "
                     f"{on.get('rss_mib', 0):.0f} MiB read off runs; evaluated moves "
                     f"median {median([m['s'] for m in on['moves'] if m['how'] == 'evaluated'] or [0]):.2f} s")
    return fig


def _need(move: dict[str, Any]) -> str:
    if "reserved" not in move:
        return ""
    need = move["reserved"] or move["peak"]
    verdict = "fits" if move["fits"] else "does not fit"
    more = "more than " if move["ran_out"] else ""
    return f"{more}{need / 2 ** 30:.2f} GiB, {verdict}"
