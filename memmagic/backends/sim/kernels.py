"""CUDA kernel behaviour where the CPU kernels use memory differently.

Installed for ``kernels="cuda"`` only, and removed in ``finally``:

* **dropout**: CUDA's ``dropout`` runs the fused ``native_dropout`` kernel, which saves a
  *bool* mask (1 byte per element); the CPU composite multiplies by a mask in the input's
  dtype (4 bytes per element in fp32). Registered as the ``AutogradCPU`` kernel of
  ``aten::dropout`` so it also applies inside backward and checkpoint recompute.
* **scaled_dot_product_attention**: on CUDA the flash kernel (fp16/bf16 on sm_80+) or the
  memory-efficient kernel runs; both save the output and a log-sum-exp of ``B x H x L``
  floats, never the ``L x L`` attention matrix the CPU math path (taken with dropout)
  saves. The choice follows torch's ``sdp_utils`` rules, simplified, its backend
  priority order and the ``torch.backends.cuda.*_sdp_enabled`` switches (which
  ``torch.nn.attention.sdpa_kernel`` sets); when no enabled backend can take the inputs
  (``sdpa_kernel(FLASH_ATTENTION)`` on fp32 inputs, a head dim over 256, an explicit
  mask) it raises CUDA's "No available kernel. Aborting execution." as a GPU would.
* **RNNs**: an LSTM, GRU or plain RNN stack runs as one cuDNN call, with its buffers
  (:mod:`.cudnn_rnn`), and ``.cuda()`` flattens its weights into one buffer.
* **optimizers**: with every parameter on a CUDA device, torch's optimizers default to
  the ``foreach`` implementation (which briefly holds about one extra copy of the
  parameters); on the CPU they default to the single-tensor loop.

Kernels registered here run the original CPU behaviour for real (non-fake) tensors, so a
thread doing real work during a simulation is not affected.

In every simulated run (CUDA or CPU kernels), :func:`fix_outputs` corrects the outputs of
the ops whose fake (meta) kernel allocates differently from the real kernel: oneDNN's
LSTM workspace, the two bias gradients of its backward, batch norm's fp32 saved
statistics for half inputs.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from typing import Any

import torch

from ...core import _torch_private as _priv
from ...core.patching import Patches
from .cudnn_rnn import RNN_MODES, CudnnRNNKernel

__all__ = ["install_cuda_kernels", "choose_sdpa_backend", "mkldnn_rnn_workspace", "fix_outputs",
           "attention_backward_scratch", "FIXED_OUTPUT_OPS"]

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
NO_KERNEL = "No available kernel. Aborting execution."
NO_BACKEND = ("No viable backend for scaled_dot_product_attention was found. This is likely due "
              "to turning off both the math kernel and the fused kernels.")


def _flash_problems(q, k, v, attn_mask, dropout_p, is_causal, capability) -> list[str]:
    """Why CUDA's flash kernel cannot take these inputs (torch's ``can_use_flash_attention``
    filters, dense inputs); empty when it can."""
    out = []
    d = q.shape[-1]
    if not (q.dim() == 4 and k.dim() == 4 and v.dim() == 4):
        out.append(f"flash attention needs 4-D query, key and value (got {q.dim()}-D)")
        return out
    if attn_mask is not None:
        out.append("flash attention does not take an explicit attn_mask")
    if not (k.shape[-1] == d and v.shape[-1] == d and d <= 256):
        out.append(f"flash attention needs one head dim of at most 256 for q, k, v "
                   f"(got {d}, {k.shape[-1]}, {v.shape[-1]})")
    if not (8, 0) <= capability <= (12, 1):
        out.append(f"flash attention needs sm80 to sm121 (the card is sm{capability[0]}{capability[1]})")
    elif ((8, 6) <= capability <= (8, 9) or (12, 0) <= capability <= (12, 1)) and any(
            t.requires_grad for t in (q, k, v)) and torch.is_grad_enabled():
        if not (d <= 192 or (dropout_p == 0 and d > 224)):
            out.append(f"flash attention cannot train with head dim {d} on sm{capability[0]}{capability[1]}")
    if is_causal and q.shape[-2] != k.shape[-2]:
        out.append("flash attention does not take is_causal with seqlen_q != seqlen_k")
    if q.dtype not in (torch.float16, torch.bfloat16):
        out.append(f"flash attention needs float16 or bfloat16 inputs (got {_dtype_name(q.dtype)})")
    return out


def _efficient_problems(q, k, v, attn_mask, dropout_p, is_causal, capability) -> list[str]:
    """Why the memory-efficient kernel cannot take these inputs (simplified filters)."""
    out = []
    if not (5, 0) <= capability <= (12, 1):
        out.append(f"memory-efficient attention needs sm50 to sm121 (the card is sm{capability[0]}{capability[1]})")
    if not (q.dim() == 4 and k.dim() == 4 and v.dim() == 4):
        out.append(f"memory-efficient attention needs 4-D query, key and value (got {q.dim()}-D)")
        return out
    # torch's minimum_gemm_alignment: tensor cores on sm80+, and on sm7x for 16-bit inputs
    half = q.dtype in (torch.float16, torch.bfloat16)
    align = 4 if capability >= (8, 0) else 1
    if capability >= (8, 0) or (capability >= (7, 0) and half):
        align = max(align, 8 if half else 4)
    d = q.shape[-1]
    if not (k.shape[-1] == d and d % align == 0 and v.shape[-1] % align == 0):
        out.append(f"memory-efficient attention needs head dims divisible by {align} "
                   f"(got {d}, {k.shape[-1]}, {v.shape[-1]})")
    dtypes = (torch.float32, torch.float16, torch.bfloat16) if capability >= (8, 0) else (torch.float32, torch.float16)
    if q.dtype not in dtypes:
        out.append(f"memory-efficient attention on sm{capability[0]}{capability[1]} does not take "
                   f"{_dtype_name(q.dtype)} inputs")
    return out


def _cudnn_problems(q, k, v, attn_mask, dropout_p, is_causal, capability) -> list[str]:
    """Why cuDNN attention cannot take these inputs (simplified filters)."""
    out = []
    if not (8, 0) <= capability <= (12, 1):
        out.append(f"cuDNN attention needs sm80 to sm121 (the card is sm{capability[0]}{capability[1]})")
    if not (q.dim() == 4 and k.dim() == 4 and v.dim() == 4):
        out.append(f"cuDNN attention needs 4-D query, key and value (got {q.dim()}-D)")
        return out
    if q.dtype not in (torch.float16, torch.bfloat16):
        out.append(f"cuDNN attention needs float16 or bfloat16 inputs (got {_dtype_name(q.dtype)})")
    limit = 256 if capability[0] in (9, 10) else 128
    d, dv = q.shape[-1], v.shape[-1]
    if not (d <= limit and dv <= limit and d % 8 == 0 and dv % 8 == 0):
        out.append(f"cuDNN attention needs head dims that are multiples of 8 and at most {limit} "
                   f"(got {d}, {dv})")
    if k.shape[-2] == 1:
        out.append("cuDNN attention does not take key/value sequence length 1")
    if dropout_p * 16 != int(dropout_p * 16):
        out.append("cuDNN attention needs a dropout probability that is a multiple of 1/16")
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        out.append("cuDNN attention is not deterministic")
    return out


_INSIDE = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


def _outside_stacklevel() -> int:
    """The ``stacklevel`` of the innermost caller outside torch and memmagic, counted from
    the function that calls this one (1)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    return level


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# backend: (why it cannot run, torch's warning header, the backend's name in torch's words)
_CHECKS = {"flash": (_flash_problems, "Flash attention kernel", "Flash attention"),
           "efficient": (_efficient_problems, "Memory efficient kernel", "Memory efficient attention"),
           "cudnn": (_cudnn_problems, "cuDNN attention kernel", "cuDNN attention")}


_DEFAULT_ORDER = ["flash", "efficient", "math", "cudnn"]
_CUDNN_FIRST = ["cudnn", "flash", "efficient", "math"]


def _cudnn_preferred(capability: tuple[int, int]) -> bool:
    """torch's ``check_prefer_cudnn_attention``: on sm90 and sm100 (H100, H200, B200) with
    a recent cuDNN, cuDNN attention goes first unless the environment says otherwise
    (``TORCH_CUDNN_SDPA_PREFERRED=0``, or ``TORCH_CUDNN_SDPA_DEPRIORITIZED=1`` in newer
    torch). Measured: torch 2.11 with cuDNN 9.19 on an H100 picks it for fp16 and bf16."""
    if tuple(capability) not in ((9, 0), (10, 0)):
        return False
    preferred = os.environ.get("TORCH_CUDNN_SDPA_PREFERRED", "").strip().lower()
    deprioritized = os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").strip().lower()
    return preferred not in ("0", "false", "off", "no", "n") and deprioritized not in (
        "1", "true", "on", "yes", "y")


def _device_priority_order(capability: tuple[int, int]) -> list[str]:
    """The order CUDA's dispatcher tries the backends in on this card: the order
    ``sdpa_kernel(..., set_priority=True)`` set, else torch's default, with cuDNN first
    where torch puts it first (:func:`_cudnn_preferred`)."""
    order = _priv.sdp_priority_order()
    if order[:4] == _DEFAULT_ORDER and _cudnn_preferred(capability):
        return _CUDNN_FIRST + order[4:]
    return order


def choose_sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        attn_mask: torch.Tensor | None, dropout_p: float,
                        capability: tuple[int, int], is_causal: bool = False) -> str:
    """"flash", "efficient", "cudnn" or "math": what CUDA's SDPA dispatcher would pick
    (simplified), trying the backends in torch's priority order and honouring the switches
    that ``torch.nn.attention.sdpa_kernel`` and ``torch.backends.cuda.enable_*_sdp`` set.

    Raises CUDA's ``RuntimeError`` when no enabled backend can take the inputs ("No
    available kernel. Aborting execution.", after a warning per backend saying why, as
    torch does, attributed to the caller's line) or when every backend is switched off."""
    b = torch.backends.cuda
    enabled = {"flash": b.flash_sdp_enabled(), "efficient": b.mem_efficient_sdp_enabled(),
               "math": b.math_sdp_enabled(), "cudnn": b.cudnn_sdp_enabled()}
    if not any(enabled.values()):
        raise RuntimeError(NO_BACKEND)
    args = (q, k, v, attn_mask, dropout_p, is_causal, capability)
    for backend in _device_priority_order(capability):
        if backend not in enabled or not enabled[backend]:
            continue
        if backend == "math" or not _CHECKS[backend][0](*args):
            return backend
    for backend in ("efficient", "flash", "cudnn"):  # torch warns in this order
        check, header, name = _CHECKS[backend]
        why = check(*args) if enabled[backend] else [f"{name} has been runtime disabled"]
        warnings.warn(f"{header} not used because: {'; '.join(why)}.", UserWarning,
                      stacklevel=_outside_stacklevel())
    raise RuntimeError(NO_KERNEL)


def attention_backward_scratch(backend: str, bsz: int, heads: int, L: int, d: int,
                               out_bytes: int) -> list[int]:
    """Bytes of the temporaries a fused attention kernel's backward allocates beside dq,
    dk and dv (``out_bytes``: the size of the attention output)."""
    if backend == "flash":
        # dq is accumulated in fp32 in a padded (B, L, H, D) buffer; softmax_d per row
        return [bsz * _round_up(L, 128) * heads * _round_up(d, 32) * 4,
                bsz * heads * _round_up(L, 128) * 4]
    if backend == "cudnn":
        # one workspace: dq accumulated in fp32 and a float per row, + 256 bytes (measured
        # on an H100, torch 2.11 / cuDNN 9.19, to the byte on 7 shapes)
        return [bsz * heads * L * (d + 1) * 4 + 256]
    # the memory-efficient kernel, measured the same way: delta and a second row statistic,
    # a copy the size of the output, and a workspace over L and D padded to 64
    lp, dp = _round_up(L, 64), _round_up(d, 64)
    return [bsz * heads * L * 4, bsz * heads * L * 4, out_bytes,
            bsz * heads * lp * dp * 4 + bsz * heads * lp // 4]


class _FusedAttention(torch.autograd.Function):
    """Memory-equivalent stand-in for CUDA's flash / memory-efficient attention kernels:
    the same outputs, saved tensors and backward temporaries, with no values."""

    @staticmethod
    def forward(ctx, q, k, v, mask, backend: str):
        *batch, L, _ = q.shape
        heads = q.shape[1] if q.dim() == 4 else 1
        bsz = q.shape[0]
        if q.dim() == 4:
            # the kernels write (B, L, H, Dv) and return it transposed: a caller's
            # out.transpose(1, 2).reshape(B, L, H * Dv) is a view on a GPU, not a copy
            out = q.new_empty((bsz, L, heads, v.shape[-1])).transpose(1, 2)
        else:
            out = q.new_empty((*batch, L, v.shape[-1]))
        lse_len = L if backend in ("flash", "cudnn") else _round_up(L, 32)
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
        tmp = [q.new_empty((n,), dtype=torch.uint8) for n in attention_backward_scratch(
            ctx.backend, bsz, heads, L, d, out.numel() * out.element_size())]
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
        sharded = _priv.is_wrapper_subclass(query)  # DTensors (tensor parallel attention)
        if not (_priv.is_fake(query) or sharded and all(
                _priv.is_fake(t) for t in _priv.wrapper_inner_tensors(query))):
            return _priv.call_composite(_SDPA, query, key, value, attn_mask, dropout_p, is_causal,
                                   scale=scale, enable_gqa=enable_gqa)
        backend = choose_sdpa_backend(query, key, value, attn_mask, dropout_p, self.capability,
                                      is_causal=is_causal)
        if (enable_gqa and key.shape[-3] != query.shape[-3] and backend == "efficient"
                and torch.backends.cuda.math_sdp_enabled()):
            backend = "math"
        self.counts[backend] = self.counts.get(backend, 0) + 1
        if sharded and not enable_gqa:
            # DTensor shards the CUDA kernels' own ops (their sharding rules), which run on
            # the local fake shards from their meta kernels; the CPU composite's op has none
            return _sharded_attention(backend, query, key, value, attn_mask, dropout_p,
                                      is_causal, scale)
        if backend == "math":
            return _aten._scaled_dot_product_attention_math.default(
                query, key, value, attn_mask, dropout_p, is_causal, None,
                scale=scale, enable_gqa=enable_gqa)[0]
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            rep = query.shape[-3] // key.shape[-3]
            key = key.repeat_interleave(rep, -3)
            value = value.repeat_interleave(rep, -3)
        return _FusedAttention.apply(query, key, value, attn_mask, backend)


def _sharded_attention(backend: str, q, k, v, mask, dropout_p: float, is_causal: bool, scale):
    """SDPA on DTensors as CUDA runs it: the flash or memory-efficient kernel's aten op
    (what DTensor has sharding rules for), or the math path."""
    if backend == "flash":  # (the flash kernel takes no mask: choose_sdpa_backend knows)
        return _aten._scaled_dot_product_flash_attention.default(
            q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    if backend == "cudnn":
        return _aten._scaled_dot_product_cudnn_attention.default(
            q, k, v, mask, True, dropout_p, is_causal, False, scale=scale)[0]
    if backend == "efficient":
        return _aten._scaled_dot_product_efficient_attention.default(
            q, k, v, mask, True, dropout_p, is_causal, scale=scale)[0]
    return _aten._scaled_dot_product_attention_math.default(
        q, k, v, mask, dropout_p, is_causal, None, scale=scale)[0]


# -- optimizers -----------------------------------------------------------------------------
def _cuda_default_to_fused_or_foreach(params: list[torch.Tensor], differentiable: bool,
                                      use_fused: bool = False) -> tuple[bool, bool]:
    # annotated as torch's own: TorchScript compiles callers (torch.distributed.optim's
    # functional optimizers, scripted when that package is imported) against this signature
    if torch.jit.is_scripting() or differentiable:
        return False, False
    return False, True


def install_cuda_kernels(patches: Patches, capability: tuple[int, int], tracker) -> dict[str, Any]:
    """Register the CUDA-behaviour kernels (cuDNN's LSTM, GRU and RNN stacks:
    :mod:`.cudnn_rnn`, their buffers through ``tracker``, and the flattening of their
    weights); returns {"library": lib, "sdpa": counter,
    "kernels": {op: kernel}} (what inference mode, which skips the autograd key they are
    registered for, runs through :attr:`SimTracker.own_kernels`).
    ``patches.restore()`` destroys the library and undoes the rest (also when this
    function fails part way)."""
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901
    patches.call_on_restore(functools.partial(_priv.destroy_library, lib))
    sdpa = _SDPAKernel(capability)
    rnn = CudnnRNNKernel(tracker)
    kernels = {_DROPOUT: _dropout, _SDPA: sdpa, **{op: rnn.kernel(op) for op in RNN_MODES}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op, kernel in kernels.items():
            lib.impl(op, kernel, "AutogradCPU")
    for mod, attr in _priv.default_foreach_slots():
        patches.set(mod, attr, _cuda_default_to_fused_or_foreach)
    patches.set(torch.nn.RNNBase, "flatten_parameters",
                rnn.flattening(torch.nn.RNNBase.flatten_parameters))
    return {"library": lib, "sdpa": sdpa, "kernels": kernels}


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


# -- meta kernels whose memory differs from the real kernels' (every run) -----------------------
_RNN_LAYER = _aten.mkldnn_rnn_layer.default  # an LSTM layer on the CPU kernels
_RNN_LAYER_BACKWARD = _aten.mkldnn_rnn_layer_backward.default
_BATCH_NORMS = {_aten.native_batch_norm.default, _aten._native_batch_norm_legit.default,
                _aten._native_batch_norm_legit_functional.default,
                _aten._native_batch_norm_legit.no_stats}
_BN_UPDATES = {_aten.native_batch_norm.default, _aten._native_batch_norm_legit.default}
_HALF = (torch.float16, torch.bfloat16)
# the ops whose outputs fix_outputs corrects
FIXED_OUTPUT_OPS = frozenset({_RNN_LAYER, _RNN_LAYER_BACKWARD, *_BATCH_NORMS})


def fix_outputs(func, args, kwargs, out):
    """Outputs where the fake (meta) kernel differs from the real kernel's memory."""
    if func is _RNN_LAYER:
        if out[3].numel() == 0:
            ws = mkldnn_rnn_workspace(args, kwargs)
            if ws:
                out = (*out[:3], args[0].new_empty((ws,), dtype=torch.uint8))
    elif func is _RNN_LAYER_BACKWARD:
        if out[3] is out[4]:
            # the meta kernel returns one bias gradient twice; the real kernel returns two
            out = (*out[:4], torch.empty_like(out[3]), *out[5:])
    else:  # batch norms
        if func in _BN_UPDATES and len(args) > 5 and args[5] is True:
            # training updates the running stats (the schema does not say it writes them,
            # so nothing else forgets their values)
            for t in args[3:5]:
                if isinstance(t, torch.Tensor):
                    _priv.drop_constant(t)
        if out[1].dtype in _HALF:
            # the CPU and CUDA kernels keep the saved mean/invstd in fp32 for half inputs
            out = (out[0], *(o.new_empty(o.shape, dtype=torch.float32) for o in out[1:3]),
                   *out[3:])
    # made below the simulation's dispatch: FakeTensorMode keeps new_empty of a tensor that
    # carries a constant as a constant of uninitialized memory
    for o in out:
        if isinstance(o, torch.Tensor):
            _priv.drop_constant(o)
    return out
