"""The fit map: sizes read off six runs as polynomials in batch and context, equal to real
runs byte for byte where it answers, checked by runs, and a run per pair where it cannot."""

from __future__ import annotations

import pytest

from memmagic import Cell
from memmagic.backends.sim import resolve_target
from memmagic.whatif import fitmap as F

pytest.importorskip("transformers")

GPT2 = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1024,
                                   n_positions=4096)).cuda()
opt = torch.optim.AdamW(model.parameters())
x = torch.randint(0, 1024, (batch_size, seq_len), device="cuda")
model(x, labels=x).loss.backward()
opt.step()
"""

LLAMA = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
model = LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     vocab_size=1024, max_position_embeddings=4096)).cuda()
x = torch.randint(0, 1024, (batch_size, seq_len), device="cuda")
model(x, labels=x).loss.backward()
"""

BERT = """
import torch
from transformers import BertConfig, BertForMaskedLM
model = BertForMaskedLM(BertConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, vocab_size=1024,
                                   max_position_embeddings=4096)).cuda()
x = torch.randint(0, 1024, (batch_size, seq_len), device="cuda")
model(input_ids=x, labels=x).loss.backward()
"""

# attention written out: scores of batch x heads x context x context (a size in s**2)
MANUAL = """
import torch
import torch.nn.functional as F
torch.manual_seed(0)
w = torch.nn.Linear(64, 3 * 64).cuda()
x = torch.randn(batch_size, seq_len, 64, device="cuda", requires_grad=True)
q, k, v = w(x).view(batch_size, seq_len, 3, 4, 16).unbind(2)
scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
out.float().pow(2).mean().backward()
"""

BS, SS = (4, 8), (128, 256, 384)


def _plane(source: str, card: str = "A100-80GB", ss=SS, **defaults):
    cell = Cell(source, {"batch_size": 2, "seq_len": 64}, backend_options={"gpu": card},
                defaults=defaults)
    roomy = F._roomy(cell, resolve_target(card))
    runs = {(b, s): roomy.run(batch_size=b, seq_len=s, strict=True) for b in BS for s in ss}
    return F.SizePlane(runs, BS, ss), roomy


@pytest.mark.parametrize("source, card, defaults", [
    (GPT2, "A100-80GB", {}),
    (GPT2, "T4", {"amp": "fp16"}),
    (GPT2, "A100-80GB", {"amp": "bf16", "checkpointing": True}),
    (LLAMA, "H100-80GB", {}),
    (LLAMA, "A100-80GB", {"checkpointing": True}),
    (BERT, "A100-80GB", {"amp": "bf16"}),
    (MANUAL, "T4", {}),
], ids=["gpt2", "gpt2-t4-amp-fp16", "gpt2-amp-ckpt", "llama-gqa", "llama-ckpt", "bert-amp",
        "manual-attention"])
def test_the_plane_gives_what_a_run_gives_byte_for_byte(source, card, defaults):
    plane, roomy = _plane(source, card, **defaults)
    assert plane.ok, plane.reason
    for b, s in ((6, 640), (12, 1024), (3, 128)):  # between, beyond and below the lattice
        run = roomy.run(batch_size=b, seq_len=s, strict=True)
        assert plane.checked_by(b, s, run), (b, s)
        # the allocator's reserved peak of the run, to the byte
        assert plane.at(b, s)[1] == run.reserved_peak


def test_a_reductions_staging_buffer_comes_from_its_recipe():
    # on a T4 (40 SMs) the bias gradients' sums stage through a buffer whose size is capped:
    # the lattice's sizes lie on a line that the far corner leaves
    plane, roomy = _plane(GPT2, "T4")
    assert plane.ok and plane.sites
    run = roomy.run(batch_size=32, seq_len=2048, strict=True)
    assert plane.checked_by(32, 2048, run)


def test_sizes_that_are_no_such_polynomial_are_found_out():
    # a size rounded down: no whole-number coefficients through the lattice
    rounded = "import torch\nx = torch.empty(seq_len // 3 * batch_size, device='cuda')\n"
    plane, _ = _plane(rounded)
    assert not plane.ok
    assert "not a polynomial in the batch and the context" in plane.reason
    # cubic in the batch: through two batch sizes any size is a line, so the lattice cannot
    # tell; a run off it can
    cubic = "import torch\nx = torch.empty(batch_size ** 3 * seq_len, device='cuda')\n"
    plane, roomy = _plane(cubic)
    assert plane.ok
    assert not plane.checked_by(12, 1024, roomy.run(batch_size=12, seq_len=1024, strict=True))


@pytest.mark.parametrize("card, amp, tile", [("T4", None, 64), ("A100-80GB", "bf16", 128)])
def test_a_kernel_that_pads_the_context_to_its_tile_is_read_off_the_padded_context(card, amp,
                                                                                   tile):
    # contexts that are odd multiples of 32: memory-efficient attention's backward (a T4)
    # pads its workspace's context to 64, flash attention's (an A100, bf16) to 128; those
    # sizes are polynomials in the padded context, not in the context
    ss = (608, 1088, 1568)
    plane, roomy = _plane(GPT2, card, ss=ss, **({"amp": amp} if amp else {}))
    assert plane.ok, plane.reason
    assert tile in plane.rounding.values()
    for b, s in ((6, 992), (12, 2016), (3, 160)):  # none a multiple of 64
        run = roomy.run(batch_size=b, seq_len=s, strict=True)
        assert plane.checked_by(b, s, run), (b, s)
        assert plane.at(b, s)[1] == run.reserved_peak


def test_a_size_rounded_up_coarser_than_the_step_is_read_off_the_rounded_context():
    # rounded up to a multiple of 256 while the map steps by 128: the lattice mixes odd and
    # even multiples of the step, so no polynomial in the context passes through it, one in
    # the context rounded up to 256 does, and the far corner (an odd multiple) checks it
    src = ("import torch\nx = torch.empty(batch_size * ((seq_len + 255) // 256 * 256) * 1024, "
           "device='cuda')\n")
    cell = Cell(src, {"batch_size": 2, "seq_len": 256}, backend_options={"gpu_memory": "1GiB"})
    fm = F.fit_map(cell, batch=(1, 64), seq=(128, 2048))
    assert fm.method == "plane", fm.notes
    for s in fm.seqs:  # 4 KiB a token of the rounded context: 2**30 bytes hold 2**18 tokens
        top = fm.largest[s]
        rounded = (s + 255) // 256 * 256
        assert top == min(64, 2 ** 30 // (rounded * 4096))
    # rounded down: no rounding up fits it either, so the pairs are run
    down = src.replace("(seq_len + 255) // 256 * 256", "seq_len // 3")
    fm = F.fit_map(Cell(down, {"batch_size": 2, "seq_len": 256},
                        backend_options={"gpu_memory": "1GiB"}), batch=(1, 64), seq=(128, 2048))
    assert fm.method == "runs"
    assert any("nor in the context rounded up" in n for n in fm.notes)


def test_the_allocated_floor_is_under_the_replay_and_over_the_card_means_no_fit():
    plane, roomy = _plane(GPT2, "T4", amp="fp16")
    for b, s in ((6, 640), (12, 1024), (3, 128)):
        floor = plane.allocated_floor(b, s)
        allocated, _reserved = plane.at(b, s)
        assert 0 < floor <= allocated
        # a card with less room than the floor: the replay fails too
        assert plane.at(b, s, capacity=floor - 1) is None
        assert plane.overflows(b, s, floor - 1) and not plane.overflows(b, s, floor)


def test_the_fit_map_is_read_off_the_plane_and_its_boundary_holds_in_runs():
    cell = Cell(GPT2, {"batch_size": 2, "seq_len": 256}, backend_options={"gpu_memory": "1GiB"})
    fm = F.fit_map(cell, batch=(1, 64), seq=(128, 2048))
    assert fm.method == "plane", fm.notes
    assert fm.runs <= 6 + 1 + 6 and fm.evaluated > 3 * len(fm.seqs)
    assert len(fm.seqs) == 16 and fm.seqs[0] == 128 and fm.seqs[-1] == 2048
    tops = [fm.largest[s] for s in fm.seqs]
    assert all(a >= b for a, b in zip(tops, tops[1:]))  # longer contexts fit fewer
    # a context the checks did not run: its boundary is the runs' boundary
    real = F._on_card(cell, resolve_target(None, "1GiB"))
    s = fm.seqs[5]
    top = fm.largest[s]
    assert top is not None and top < 64
    assert real.run(batch_size=top, seq_len=s, strict=True).fits
    assert not real.run(batch_size=top + 1, seq_len=s, strict=True).fits
    assert fm.fits(top, s) and not fm.fits(top + 1, s) and fm.fits(1, s)
    assert fm.largest_batch(s) == top and fm.longest_context(top) >= s
    assert str(fm).startswith("fit map on GPU with 1.00 GiB (1.00 GiB): batch 1..64 x context "
                              "128..2048 (16 contexts, ")
    assert "evaluated from the runs at (16, " in fm.source
    chart = fm.chart()
    assert repr(chart) == ("<memmagic chart: fit map on GPU with 1.00 GiB, batch 1..64 x "
                           "context 128..2048>")
    assert chart._repr_png_()[0][:8] == b"\x89PNG\r\n\x1a\n"


def test_four_runs_where_sizes_are_linear_in_the_context_six_where_scores_are_squared():
    # GPT-2 on a T4 takes memory-efficient attention: no b*s*s scores, a 2 x 2 lattice
    # holds; the hand-written attention keeps its scores, so the far corner disagrees with
    # that lattice and a third context is run
    cell = Cell(GPT2, {"batch_size": 2, "seq_len": 256}, backend_options={"gpu_memory": "1GiB"})
    fm = F.fit_map(cell, batch=(1, 64), seq=(128, 2048))
    assert fm.method == "plane" and len(fm.lattice) == 4, fm.notes
    cell = Cell(MANUAL, {"batch_size": 2, "seq_len": 256}, backend_options={"gpu": "T4"})
    fm = F.fit_map(cell, batch=(1, 64), seq=(128, 2048))
    assert fm.method == "plane" and len(fm.lattice) == 6, fm.notes
    assert len({s for _, s in fm.lattice}) == 3
    # the runs: the 2 x 2 lattice, its far corner, the third context's two, the boundary's
    assert fm.runs == 4 + 1 + 2 + sum(1 for c in fm.checks[1:])
    real = F._on_card(cell, resolve_target("T4"))
    s = fm.seqs[-1]
    top = fm.largest[s]
    assert real.run(batch_size=top, seq_len=s, strict=True).fits
    assert not real.run(batch_size=top + 1, seq_len=s, strict=True).fits


def test_the_batch_above_the_boundary_is_not_run_where_its_sizes_alone_overflow_the_card():
    cell = Cell(GPT2, {"batch_size": 2, "seq_len": 256}, backend_options={"gpu_memory": "1GiB"})
    fm = F.fit_map(cell, batch=(1, 64), seq=(128, 2048))
    skipped = [n for n in fm.notes if n.startswith("not run: ")]
    assert skipped and "above the boundary" in skipped[0], fm.notes
    real = F._on_card(cell, resolve_target(None, "1GiB"))
    ran = 0
    for s in (fm.seqs[len(fm.seqs) // 2], fm.seqs[-1]):
        b = fm.largest[s] + 1
        if (b, s) not in {(c[0], c[1]) for c in fm.checks}:  # not run by the map: run it here
            assert f"({b}, {s})" in skipped[0]
            assert not real.run(batch_size=b, seq_len=s, strict=True).fits
            ran += 1
    assert ran


def test_a_check_on_the_card_whose_sizes_differ_from_the_plane_sends_the_map_to_runs():
    # a cell that sizes a buffer by the card's memory: on the roomy card of the lattice it
    # is another size than on the card itself; the verdicts at the boundary agree, the
    # sizes do not, byte for byte
    src = GPT2 + ("free = torch.cuda.get_device_properties(0).total_memory\n"
                  "extra = torch.empty(4096 if free < 2 ** 40 else 8192, device='cuda')\n")
    cell = Cell(src, {"batch_size": 2, "seq_len": 256}, backend_options={"gpu_memory": "1GiB"})
    fm = F.fit_map(cell, batch=(1, 32), seq=(128, 1024))
    assert fm.method == "runs"
    assert any("disagrees with the plane" in n for n in fm.notes), fm.notes


def test_where_the_plane_cannot_be_used_each_pair_is_run():
    cubic = ("import torch\nx = torch.empty(batch_size ** 3 * seq_len, device='cuda')\n"
             "y = x * 2\n")
    cell = Cell(cubic, {"batch_size": 2, "seq_len": 64}, backend_options={"gpu_memory": "1GiB"})
    fm = F.fit_map(cell, batch=(1, 32), seq=(128, 1024))
    assert fm.method == "runs" and fm.evaluated == 0 and fm.lattice == ()
    assert len(fm.seqs) == F.FALLBACK_CONTEXTS
    assert any("differs from the plane through the runs at" in n for n in fm.notes)
    assert "so each tried pair was run, at 8 contexts" in fm.notes
    # x and y: 8 * b**3 * s bytes, within 1 GiB up to the boundary the runs found
    for s in fm.seqs:
        top = fm.largest[s]
        assert top is not None and 8 * top ** 3 * s <= 2 ** 30
        assert top == 32 or 8 * (top + 1) ** 3 * s > 2 ** 30 * 0.9


def test_a_short_context_gets_a_map_of_finer_contexts():
    """The default contexts run from the step to twice the cell's own; where that holds
    fewer than four multiples of the step (a 128-step RNN), the step is halved."""
    flat = "import torch\nx = torch.empty(batch_size * seq_len * 65536, device='cuda')\ny = x * 2\n"
    cell = Cell(flat, {"batch_size": 2, "seq_len": 128}, backend_options={"gpu_memory": "1GiB"})
    fm = F.fit_map(cell, batch=(1, 32))
    assert fm.seqs == (64, 128, 192, 256)
    # x and y: 2 x 4 B x 65536 x batch x context, within 1 GiB
    for s in fm.seqs:
        assert fm.largest[s] == min(32, (2 ** 30) // (8 * 65536 * s))


def test_bad_input_gets_one_line():
    cell = Cell(GPT2, {"batch_size": 2, "seq_len": 256})
    with pytest.raises(ValueError, match="a fit map needs a card"):
        F.fit_map(cell)
    with pytest.raises(ValueError, match="batch takes"):
        F.fit_map(cell, gpu="T4", batch=(8, 4))
    for bad in ("batch=1-64", "step=0", "step=x", "seq=1:8,seq=1:9"):
        with pytest.raises(ValueError, match="--fitmap takes batch=LO:HI, seq=LO:HI and step=N"):
            F.run_fitmap_option(cell, bad)
    with pytest.raises(ValueError, match="--fitmap needs a card"):
        F.run_fitmap_option(cell, "")


def test_the_magic_draws_the_fit_map(ip):
    ip.run_cell("batch_size, seq_len = 2, 128")
    fm = ip.run_cell_magic("gpumem", "--fitmap batch=1:16,seq=128:512 --gpu-memory 512MiB -o "
                           "--no-chart", GPT2)
    assert isinstance(fm, F.FitMap) and fm.batch == (1, 16) and fm.seqs == (128, 256, 384, 512)
    fm = ip.run_cell_magic("gpumem", "--fitmap batch=1:16,seq=96:512,step=32 --gpu-memory 512MiB "
                           "-o --no-chart", GPT2)
    assert fm.seqs == tuple(range(96, 513, 32)) and fm.method == "plane", fm.notes
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="--fitmap is a view of the cell of its own"):
        ip.run_cell_magic("gpumem", "--fitmap --whatif --gpu T4", GPT2)
    with pytest.raises(UsageError, match="--fitmap needs a card"):
        ip.run_cell_magic("gpumem", "--fitmap", GPT2)
    with pytest.raises(UsageError, match="on a %%gpumem cell, not a line"):
        ip.run_line_magic("gpumem", "--fitmap --gpu T4 x = 1")


def test_the_panel_draws_the_fit_map_of_its_setting(ip):
    pytest.importorskip("ipywidgets")
    ip.run_cell("batch_size, seq_len = 2, 128")
    panel = ip.run_cell_magic("gpumem", "--whatif --gpu-memory 1GiB -o --range batch_size=1:32 "
                              "--range seq_len=128:1024", GPT2)
    assert panel.fit_map_button in [c for row in panel.box.children[0].children
                                    for c in row.children]
    panel.controls["amp"].value = "bf16"  # the map is of the panel's setting
    fm = panel.run_fit_map()
    assert panel.fit_map_result is fm and fm.batch == (1, 32)
    assert fm.seqs == (128, 256, 384, 512, 640, 768, 896, 1024) and fm.method == "plane"
    assert panel.sweep_image.value[:8] == b"\x89PNG\r\n\x1a\n"
    assert panel.sweep_text.value.startswith("fit map on GPU with 1.00 GiB")
    # under AMP the activations are half as large: more fits than in fp32
    plain = F.fit_map(Cell(GPT2, {"batch_size": 2, "seq_len": 128},
                           backend_options={"gpu_memory": "1GiB"}), batch=(1, 32),
                      seq=(128, 1024))
    assert all(fm.largest[s] >= plain.largest[s] for s in fm.seqs)
    assert any(fm.largest[s] > plain.largest[s] for s in fm.seqs)
