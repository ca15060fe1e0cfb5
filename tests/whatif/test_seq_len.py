"""Sequence length as a what-if knob (issue 24, item 1): the panel, --sweep seq_len=,
the longest context that fits, the doctor's fixes. All on the simulated GPU, tiny
configs, no downloads."""

from __future__ import annotations

import pytest
import torch

from memmagic import Cell, Setting
from memmagic.whatif.knobs import KnobError
from memmagic.whatif.sweeps import find_seq_len, sweep

MiB = 1 << 20

GPT2 = """
from transformers import GPT2Config, GPT2LMHeadModel
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000,
                                   n_positions=4096, attn_pdrop=0.0, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_implementation=impl)).cuda()
"""
STEP = """
out = model(input_ids=ids, attention_mask=mask, labels=ids)
out.loss.backward()
"""


def _ns(**more):
    return {"torch": torch, "nn": torch.nn, **more}


def _gpt2_cell(impl: str = "sdpa", seq: int = 256) -> Cell:
    """The model and its batch made in the cell from ``seq_len`` (read by the cell)."""
    src = GPT2 + ('ids = torch.randint(0, 1000, (2, seq_len), device="cuda")\n'
                  "mask = torch.ones_like(ids)\n") + STEP
    return Cell(src, _ns(impl=impl, seq_len=seq), backend="sim", backend_options={"gpu": "T4"})


def test_a_cell_that_reads_seq_len_starts_from_its_value():
    cell = _gpt2_cell(seq=256)
    assert cell.baseline.seq_len == 256 and "seq_len" in cell.reads
    assert cell.run(seq_len=512).peak > cell.run().peak
    assert cell.namespace["seq_len"] == 256  # the notebook's variable is put back


def test_token_tensors_the_cell_names_are_cut_or_repeated_along_dim_1():
    ns = _ns()
    ns["ids"] = torch.randint(0, 1000, (2, 64))
    ns["mask"] = torch.ones(2, 64, dtype=torch.long)
    ns["emb"] = torch.nn.Embedding(1000, 32)
    src = "h = emb(ids) * mask.unsqueeze(-1)\ntuple(h.shape)"
    cell = Cell(src, ns, backend="cpu")
    assert cell.baseline.seq_len == 64 and cell.baseline.batch_size == 2
    r = cell.run(seq_len=160)
    assert any("seq_len 160: ids, mask resized along dim 1 (from 64)" in n for n in r.notes)
    assert ns["ids"].shape == (2, 64)  # put back after the run
    out = cell.execute(seq_len=16, batch_size=4)
    assert out.value == (4, 16, 32)  # both knobs at once: [batch, seq] cut and repeated
    assert ns["ids"].shape == (2, 64) and ns["mask"].shape == (2, 64)


def test_the_peak_grows_linearly_with_context_without_attention():
    # an embedding and a loss on its output: every tensor is [B, T, ...], so the peak's
    # growth per added token is the same for every T: a whole number of fp32 [B, D] rows
    # (5, measured) plus the int64 ids, B x 8 bytes a token. B = 4, D = 256: 4,096 B a row.
    src = ("ids = torch.randint(0, 1000, (4, seq_len), device='cuda')\n"
           "h = emb(ids)\nh.pow(2).mean().backward()")
    ns = _ns(seq_len=128)
    exec("emb = None", ns)
    cell = Cell("emb = nn.Embedding(1000, 256).cuda()\n" + src, ns, backend="sim",
                backend_options={"gpu": "T4"})
    p = {t: cell.run(seq_len=t).peak for t in (256, 512, 1024)}
    assert p[1024] - p[512] == 2 * (p[512] - p[256])
    per_256_tokens = p[512] - p[256]
    assert per_256_tokens == 5 * (4 * 256 * 256 * 4) + 4 * 256 * 8  # 5,251,072 B


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_attention_that_materialises_scores_grows_quadratically(impl):
    # peak(T) = a + b T + c T^2: with T, 2T, 4T, c = (p4 - 3 p2 + 2 p1) / (6 T^2).
    # Eager attention keeps each layer's softmax output [B, H, T, T] fp32 for backward:
    # c >= B x H x L x 4 = 2 x 4 x 2 x 4 = 64 bytes. SDPA's kernel materialises no scores.
    cell = _gpt2_cell(impl)
    t = 256
    p1, p2, p4 = (cell.run(seq_len=n).peak for n in (t, 2 * t, 4 * t))
    c = (p4 - 3 * p2 + 2 * p1) / (6 * t * t)
    if impl == "eager":
        assert c >= 64, c
    else:
        assert c < 64, c


def test_the_longest_context_that_fits_a_budget():
    cell = _gpt2_cell("eager")
    found = find_seq_len(cell, budget=128 * MiB)
    assert found.knob == "seq_len" and found.value == found.seq_len and found.value % 16 == 0
    fits = {t: ok for t, _need, ok in found.trials}
    assert fits[found.value] and not fits.get(found.value + 16, False)
    assert found.report.need <= found.limit
    assert "is the largest sequence length" in str(found)
    # eager attention's scores grow as the context's square: the parabola through three
    # runs that fit names the answer, and it and the next context bear it out
    assert found.guessed == found.value and "parabola through theirs" in str(found)
    assert [t for t, _n, _ok in found.trials][-2:] == [found.value, found.value + 16]
    # the longest context of bf16 autocast is longer: its activations are half the size
    amp = find_seq_len(cell, budget=128 * MiB, setting=Setting(amp="bf16"))
    assert amp.value > found.value


def test_a_sweep_over_context_lengths():
    cell = _gpt2_cell("eager")
    sw = sweep(cell, "seq_len", "128:512", strategies={"as written": Setting()})
    peaks = [r.peak for _t, r in sw.curves["as written"]]
    assert [t for t, _r in sw.curves["as written"]] == [128, 256, 512]
    assert peaks == sorted(peaks) and len(set(peaks)) == 3


def test_a_cell_without_token_tensors_gets_a_one_line_error():
    ns = _ns(x=torch.randn(8, 32))
    cell = Cell("y = (x * 2).sum()", ns, backend="cpu")
    assert cell.baseline.seq_len is None
    assert "names no token tensor" in cell.run(seq_len=64).error  # as for the batch size
    with pytest.raises(KnobError, match="names no token tensor"):
        cell.run(seq_len=64, strict=True)  # what the sweep and the finders ask for
    with pytest.raises(KnobError, match="names no token tensor"):
        find_seq_len(Cell("y = (x * 2).sum()", ns, backend="sim"), budget="1GiB")


def test_float_and_image_tensors_are_not_taken_for_tokens():
    ns = _ns(images=torch.randint(0, 255, (4, 3, 8, 8), dtype=torch.uint8),
             x=torch.randn(4, 16), labels=torch.randint(0, 10, (4,)))
    cell = Cell("y = images.float().mean() + x.sum() + labels.sum()", ns, backend="cpu")
    assert cell.baseline.seq_len is None and cell.baseline.batch_size == 4


def test_the_magic_takes_seq_len_as_option_sweep_and_panel_control(ip):
    ip.run_line_magic("gpusim", "on --gpu T4")
    ip.run_cell("impl = 'eager'\n" + GPT2 + 'ids = torch.randint(0, 1000, (2, 256), device="cuda")\n'
                "mask = torch.ones_like(ids)")
    r = ip.run_cell_magic("gpumem", "--seq-len 512 -o -q --no-chart", STEP)
    base = ip.run_cell_magic("gpumem", "-o -q --no-chart", STEP)
    assert r.error is None and r.peak > base.peak
    assert any("seq_len 512: ids, mask resized along dim 1 (from 256)" in n for n in r.notes)
    panel = ip.run_cell_magic("gpumem", "--whatif -o -q", STEP)
    assert "seq_len" in panel.controls and panel.baseline.seq_len == 256
    panel.set(seq_len=128)
    assert panel.error is None and panel.report.peak < panel.baseline_report.peak
    ip.run_line_magic("gpusim", "off")
    sw = ip.run_cell_magic("gpumem", "--sweep seq_len=128,256 -o -q --no-chart", STEP)
    assert sw.knob == "seq_len" and sw.values == (128, 256)


def test_the_doctor_proposes_a_shorter_context_after_an_out_of_memory(ip):
    ip.run_line_magic("gpusim", "on --gpu T4")
    ip.run_cell("impl = 'eager'\n" + GPT2 + 'ids = torch.randint(0, 1000, (2, 1024), device="cuda")\n'
                "mask = torch.ones_like(ids)")
    need = ip.run_cell_magic("gpumem", "-o -q --no-chart", STEP).peak
    oom = ip.run_cell_magic("gpumem", f"--gpu-memory {need * 3 // 4 // MiB}MiB --no-raise -o -q",
                            STEP)
    rows = {s.label: s for s in oom.advice.strategies}
    assert "context 512 (from 1024)" in rows and rows["context 512 (from 1024)"].fits
    assert rows["context 512 (from 1024)"].peak < need
