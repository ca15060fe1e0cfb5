"""FlexAttention (``torch.nn.attention.flex_attention``) on the simulated GPU: the higher-order
operator reaches the tracker as an op, and its outputs are the fused kernel's (what
``torch.compile(flex_attention)`` runs on a GPU): the output and a float log-sum-exp row per
query are kept for backward, no batch x heads x queries x keys score matrix is made."""

from __future__ import annotations

import torch

import memmagic

B, H, L, D = 2, 8, 1024, 64
MiB = 2**20


def _attend(backward: bool):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def causal(b, h, q, kv):
        return q >= kv

    def cell():
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        mask = create_block_mask(causal, B=None, H=None, Q_LEN=L, KV_LEN=L, device="cuda")
        out = flex_attention(q, k, v, block_mask=mask)
        if backward:
            out.sum().backward()
        return out

    return memmagic.measure(cell, backend="sim", gpu="H100")


def test_flex_attention_keeps_the_fused_kernels_tensors_by_hand():
    report = _attend(backward=False)
    assert report.error is None, report.error
    qkv = 3 * B * H * L * D * 2  # bf16
    out = B * H * L * D * 2
    lse = B * H * L * 4  # float32, one per query row
    # the inputs, the output and its log-sum-exp (and the row maxima the kernel also
    # returns), and the block mask's small index tensors: no L x L scores
    assert qkv + out + lse <= report.peak < qkv + out + 3 * lse + MiB // 4
    assert any("flex_attention ran as its fused kernel" in n for n in report.notes)


def test_flex_attention_backward_makes_the_three_gradients():
    report = _attend(backward=True)
    assert report.error is None, report.error
    scores = B * H * L * L * 4  # what the eager, uncompiled path would hold at once
    grads = 3 * B * H * L * D * 2
    assert report.peak < scores  # no score matrix
    assert report.peak >= 2 * grads + B * H * L * D * 2  # q, k, v and their gradients, out
