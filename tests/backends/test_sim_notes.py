"""The notes of a simulated report do not contradict each other."""

from __future__ import annotations

import torch

import memmagic


def test_a_named_cards_notes_agree_on_the_cuda_context():
    """The allocator's figures leave the CUDA context out; the verdict of a named card
    counts it beside them. No note may say there is none."""
    r = memmagic.measure(lambda: torch.ones(1024, device="cuda"), backend="sim", gpu="T4")
    context = [n for n in r.notes if "CUDA context" in n]
    assert not [n for n in context if "no CUDA context" in n]
    assert any("figures leave out the CUDA context" in n for n in context)
    assert sum("the verdict counts the CUDA context" in n for n in context) == 1
    bare = memmagic.measure(lambda: torch.ones(1024, device="cuda"), backend="sim")
    assert not any("the verdict counts" in n for n in bare.notes)
