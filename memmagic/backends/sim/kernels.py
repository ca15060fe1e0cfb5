"""CUDA kernel behaviour where the CPU kernels use memory differently.

Installed for ``kernels="cuda"`` only, and removed in ``finally``:

* **dropout**: CUDA's ``dropout`` runs the fused ``native_dropout`` kernel, which saves a
  *bool* mask (1 byte per element); the CPU composite multiplies by a mask in the input's
  dtype (4 bytes per element in fp32). Registered as the ``AutogradCPU`` kernel of
  ``aten::dropout`` so it also applies inside backward and checkpoint recompute.
* **scaled_dot_product_attention**: on CUDA the flash kernel (fp16/bf16 on sm_80+) or the
  memory-efficient kernel runs; both save the output and a log-sum-exp of ``B x H x L``
  floats, never the ``L x L`` attention matrix the CPU math path (taken with dropout)
  saves. The choice follows torch's ``sdp_utils`` rules, simplified, and the
  ``torch.backends.cuda.*_sdp_enabled`` switches.
* **optimizers**: with every parameter on a CUDA device, torch's optimizers default to
  the ``foreach`` implementation (which briefly holds about one extra copy of the
  parameters); on the CPU they default to the single-tensor loop.

Kernels registered here run the original CPU behaviour for real (non-fake) tensors, so a
thread doing real work during a simulation is not affected.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ... import _torch_private as _priv
from .patching import Patches

__all__ = ["install_cuda_kernels", "choose_sdpa_backend"]

_aten = torch.ops.aten
_DROPOUT = _aten.dropout.default
_SDPA = _aten.scaled_dot_product_attention.default


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# -- dropout --------------------------------------------------------------------------------
def _dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    if _priv.is_fake(input) and train and 0 < p < 1 and input.numel() > 0:
        return torch.native_dropout(input, p, train)[0]
    return _priv.call_composite(_DROPOUT, input, p, train)


# -- scaled dot product attention -----------------------------------------------------------
def choose_sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        attn_mask: torch.Tensor | None, dropout_p: float,
                        capability: tuple[int, int]) -> str:
    """"flash", "efficient" or "math": what CUDA's SDPA dispatcher would pick (simplified)."""
    b = torch.backends.cuda
    four_d = q.dim() == 4 and k.dim() == 4 and v.dim() == 4
    d = q.shape[-1]
    same_head = k.shape[-1] == d and v.shape[-1] == d
    if (b.flash_sdp_enabled() and four_d and attn_mask is None and same_head
            and q.dtype in (torch.float16, torch.bfloat16) and capability >= (8, 0) and d <= 256):
        return "flash"
    align = 4 if q.dtype == torch.float32 else 8
    if (b.mem_efficient_sdp_enabled() and four_d and q.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and (q.dtype != torch.bfloat16 or capability >= (8, 0)) and capability >= (5, 0)
            and d % align == 0 and v.shape[-1] % align == 0):
        return "efficient"
    return "math"


class _FusedAttention(torch.autograd.Function):
    """Memory-equivalent stand-in for CUDA's flash / memory-efficient attention kernels:
    the same outputs, saved tensors and backward temporaries, with no values."""

    @staticmethod
    def forward(ctx, q, k, v, mask, backend: str):
        *batch, L, _ = q.shape
        heads = q.shape[1] if q.dim() == 4 else 1
        bsz = q.shape[0]
        out = q.new_empty((*batch, L, v.shape[-1]))
        lse_len = L if backend == "flash" else _round_up(L, 32)
        lse = q.new_empty((bsz, heads, lse_len), dtype=torch.float32)
        ctx.backend = backend
        ctx.mask_needs_grad = mask is not None and mask.requires_grad
        ctx.save_for_backward(q, k, v, out, lse, mask)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, mask = ctx.saved_tensors
        if grad_out.stride(-1) != 1:
            grad_out = grad_out.contiguous()
        bsz, heads, L, d = q.shape
        if ctx.backend == "flash":
            # dq is accumulated in fp32 in a padded (B, L, H, D) buffer; softmax_d per row
            tmp = [q.new_empty((bsz, _round_up(L, 128), heads, _round_up(d, 32)), dtype=torch.float32),
                   q.new_empty((bsz, heads, _round_up(L, 128)), dtype=torch.float32)]
        else:
            tmp = [q.new_empty((bsz, heads, L), dtype=torch.float32)]  # delta
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dmask = torch.empty_like(mask) if ctx.mask_needs_grad else None
        del tmp
        return dq, dk, dv, dmask, None


class _SDPAKernel:
    def __init__(self, capability: tuple[int, int]) -> None:
        self.capability = capability
        self.counts: dict[str, int] = {}

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                 scale=None, enable_gqa=False):
        if not _priv.is_fake(query):
            return _priv.call_composite(_SDPA, query, key, value, attn_mask, dropout_p, is_causal,
                                   scale=scale, enable_gqa=enable_gqa)
        backend = choose_sdpa_backend(query, key, value, attn_mask, dropout_p, self.capability)
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            backend = "math" if backend != "flash" else backend
        self.counts[backend] = self.counts.get(backend, 0) + 1
        if backend == "math":
            return _aten._scaled_dot_product_attention_math.default(
                query, key, value, attn_mask, dropout_p, is_causal, None,
                scale=scale, enable_gqa=enable_gqa)[0]
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            rep = query.shape[-3] // key.shape[-3]
            key = key.repeat_interleave(rep, -3)
            value = value.repeat_interleave(rep, -3)
        return _FusedAttention.apply(query, key, value, attn_mask, backend)


# -- optimizers -----------------------------------------------------------------------------
def _cuda_default_to_fused_or_foreach(params, differentiable, use_fused=False):
    if torch.jit.is_scripting() or differentiable:
        return False, False
    return False, True


def install_cuda_kernels(patches: Patches, capability: tuple[int, int]) -> dict[str, Any]:
    """Register the CUDA-behaviour kernels; returns {"library": lib, "sdpa": counter}.
    The caller destroys the library (``lib._destroy()``) and restores ``patches``."""
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901
    sdpa = _SDPAKernel(capability)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lib.impl("dropout", _dropout, "AutogradCPU")
            lib.impl("scaled_dot_product_attention", sdpa, "AutogradCPU")
        for mod in _priv.optimizer_modules_with_default_foreach():
            patches.set(mod, "_default_to_fused_or_foreach", _cuda_default_to_fused_or_foreach)
    except BaseException:
        lib._destroy()
        raise
    return {"library": lib, "sdpa": sdpa}


# -- oneDNN LSTM workspace ------------------------------------------------------------------
_PAGE = 4096


def _page(n: int) -> int:
    return -(-n // _PAGE) * _PAGE


def _good_ld(d: int, itemsize: int = 4) -> int:
    """oneDNN's leading dimension: 64-byte aligned, never a multiple of 256 elements."""
    step = 64 // itemsize
    ld = _round_up(d, step)
    return ld + step if ld % 256 == 0 else ld


def _lstm_workspace_fp32(T: int, B: int, I: int, H: int) -> int:
    """oneDNN's training workspace for one fp32 LSTM layer and direction (rnn_utils
    set_conf/set_offsets: gates, ht, states and diff states, each page-aligned); checked
    against the real kernel to the byte."""
    M = max(I, H)
    return (_page(T * B * _good_ld(4 * H) * 4) + _page(T * B * _good_ld(H) * 4)
            + 3 * _page(2 * (T + 1) * B * _good_ld(M) * 4) + 2 * _page(2 * (T + 1) * B * H * 4))


def _lstm_workspace_half(T: int, B: int, I: int, H: int) -> int:
    """The same workspace for bf16 (and fp16) inputs: gates, ht, the layer states and one
    iteration state are kept in the 16-bit type, the other states and all diff states in
    fp32. Checked against the real bf16 kernel to the byte on 34 shapes (T 1-128, B 1-40,
    I and H 1-600); fp16 LSTMs have no oneDNN CPU kernel to check against."""
    M = max(I, H)
    return (_page(T * B * _good_ld(4 * H, 2) * 2) + _page(T * B * _good_ld(H, 2) * 2)
            + _page(2 * (T + 1) * B * _good_ld(M, 2) * 2)
            + 2 * _page(2 * (T + 1) * B * _good_ld(M) * 4)
            + _page(2 * (T + 1) * B * H * 2) + _page(2 * (T + 1) * B * H * 4))


def mkldnn_rnn_workspace(args: tuple, kwargs: dict) -> int:
    """Bytes of the workspace the real ``mkldnn_rnn_layer`` returns for one layer and
    direction (its meta kernel returns an empty one), by oneDNN's formula for the dtype."""
    x = args[0]
    hidden, train = args[10], args[15]
    if not train:
        return 0
    T, B = x.shape[0], x.shape[1]  # the input is time-major whatever batch_first says
    I = x.shape[-1]
    if x.dtype in (torch.bfloat16, torch.float16):
        return _lstm_workspace_half(T, B, I, hidden)
    return _lstm_workspace_fp32(T, B, I, hidden)
