"""The cuBLAS and cuBLASLt workspaces a GPU run allocates through the caching allocator.

torch allocates a cuBLAS workspace the first time a cuBLAS handle is used on a stream
(``setWorkspaceForHandle`` in ATen/cuda/CublasHandlePool.cpp) and a cuBLASLt workspace the
first time a cuBLASLt matmul runs (``getCUDABlasLtWorkspace``); both come from the caching
allocator, so ``memory_allocated()`` counts them, and both are kept for the life of the
process. Handles are per thread: the autograd engine runs CUDA backward on a thread of its
own, so the first backward matmul takes a second pair. Sizes, as torch computes them:

* cuBLAS: ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KiB:COUNT`` pairs, summed) or the default,
  ``4096 KiB * 2 + 16 KiB * 8`` = 8,519,680 B, and 32 MiB on Hopper (compute capability 9.0);
* cuBLASLt: ``CUBLASLT_WORKSPACE_SIZE`` KiB (default 1024), capped at the cuBLAS size unless
  ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` is set false; set true, cuBLASLt shares the cuBLAS
  workspace and takes none of its own.

Which ops use cuBLASLt: ``addmm`` with a 1-D bias (``nn.Linear`` with bias) on 2-D inputs
larger than 1 along every dimension, and ``_addmm_activation``; other matmuls use cuBLAS.

Reductions also take scratch memory from the caching allocator: a ``sum`` or ``mean`` over
a tensor's outer dimensions (the bias gradient of a ``Linear``: ``grad.sum(0)`` over every
token) splits each output's inputs across thread blocks, which meet in a staging buffer of
``4 x outputs x blocks per output x 128`` bytes plus a 4-byte semaphore per block column,
both freed when the kernel is queued (``setReductionConfig`` in ATen's ``Reduce.cuh``). On
an H100 that is 96 MiB for BERT-base's 3072-wide bias over 4096 tokens; measured there to
the byte on eight shapes (:func:`reduction_scratch`).
"""

from __future__ import annotations

import math
import os
import re
from typing import Mapping

import torch

__all__ = ["cublas_workspace_size", "cublaslt_workspace_size", "Workspaces", "BLAS_OPS",
           "REDUCTION_OPS", "reduction_scratch", "max_threads_per_sm"]

_aten = torch.ops.aten
BLAS_OPS = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten.addbmm.default, _aten.addmv.default, _aten.mv.default, _aten.dot.default,
    _aten.vdot.default, _aten._addmm_activation.default,
})
_LT_TYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
REDUCTION_OPS = frozenset({_aten.sum.dim_IntList, _aten.mean.dim})
_ACC_BYTES = {torch.float32: 4, torch.float16: 4, torch.bfloat16: 4, torch.float64: 8}
_PAIR = re.compile(r":([0-9]+):([0-9]+)")


def _default_cublas(capability: tuple[int, int]) -> int:
    return 4096 * 8 * 1024 if tuple(capability) == (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8


def cublas_workspace_size(capability: tuple[int, int], env: Mapping[str, str] | None = None) -> int:
    """Bytes of one cuBLAS workspace on a card of this compute capability."""
    env = os.environ if env is None else env
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    if not config:
        return _default_cublas(capability)
    pairs = _PAIR.findall(config)
    if not pairs:  # torch warns and takes the default
        return _default_cublas(capability)
    return sum(int(size) * 1024 * int(count) for size, count in pairs)


def _env_flag(value: str | None) -> bool | None:
    if value is None:
        return None
    return value.strip().lower() in ("1", "true", "on", "yes", "y")


def cublaslt_workspace_size(capability: tuple[int, int], env: Mapping[str, str] | None = None) -> int:
    """Bytes of one cuBLASLt workspace of its own (0 when it shares cuBLAS's)."""
    env = os.environ if env is None else env
    unified = _env_flag(env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE"))
    if unified:
        return 0
    try:
        size = int(env.get("CUBLASLT_WORKSPACE_SIZE", "1024")) * 1024
    except ValueError:  # torch warns and takes the default
        size = 1024 * 1024
    if unified is None:
        size = min(size, cublas_workspace_size(capability, env))
    return size


def _uses_lt(func, args: tuple, kwargs: dict) -> bool:
    if func is _aten._addmm_activation.default:
        return True
    if func is not _aten.addmm.default or len(args) < 3:
        return False
    bias, m1, m2 = args[:3]
    if kwargs.get("beta", args[3] if len(args) > 3 else 1) != 1:
        return False
    if not all(isinstance(t, torch.Tensor) for t in (bias, m1, m2)):
        return False
    return (bias.dim() == 1 and m1.dim() == 2 and m2.dim() == 2 and bias.dtype in _LT_TYPES
            and bias.shape[0] == m2.shape[1] and m1.shape[0] > 1 and m1.shape[1] > 1
            and m2.shape[1] > 1)


def _last_pow2(n: int) -> int:
    return max(1, 1 << (max(1, n).bit_length() - 1))


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def max_threads_per_sm(capability: tuple[int, int]) -> int:
    """``maxThreadsPerMultiProcessor`` of a compute capability (CUDA's programming guide):
    1024 on Turing (7.5), 1536 on the consumer Ampere, Ada and Blackwell parts (8.6, 8.7,
    8.9, 12.x), 2048 elsewhere."""
    cap = tuple(capability)
    if cap == (7, 5):
        return 1024
    if cap in ((8, 6), (8, 7), (8, 9)) or cap[0] == 12:
        return 1536
    return 2048


def reduction_scratch(shape: tuple[int, ...], strides: tuple[int, ...], dims: set[int],
                      acc_bytes: int, sms: int, max_threads_per_sm: int = 2048) -> list[int]:
    """Bytes a CUDA reduction of a tensor of ``shape``/``strides`` over ``dims`` allocates
    for its cross-block staging buffer and semaphores ([] when it takes none): the
    ``setReductionConfig`` of ATen's ``Reduce.cuh`` for a reduction over the outer
    dimensions (outputs vectorized by up to 4 along the innermost kept dimension, at most
    512 / 4 threads a block, as many blocks per output as keep every SM busy). A reduction
    over the innermost dimension stages a few bytes per output at most: not counted."""
    kept = [(st, n) for i, (n, st) in enumerate(zip(shape, strides)) if i not in dims and n != 1]
    reduced = [(st, n) for i, (n, st) in enumerate(zip(shape, strides)) if i in dims and n != 1]
    if not kept or not reduced or sms <= 0:
        return []
    inner = min(kept)
    if min(reduced) < inner or inner[0] != 1:
        return []  # over the innermost dimension, or outputs not contiguous
    num_outputs = math.prod(n for _st, n in kept)
    inputs = math.prod(n for _st, n in reduced)
    vec = 4
    while inner[1] % vec:
        vec //= 2
    max_threads = 512 // vec
    dim0, dim1 = inner[1] // vec, inputs
    p0 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    p1 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    width = min(p0, 32)
    height = min(p1, max_threads // width)
    width = min(p0, max_threads // height)
    step_in, step_out = 1, width
    per_thread = _div_up(inputs, step_in)
    if not (per_thread >= height * 16 or per_thread >= 256):
        return []  # each warp takes outputs of its own: no global reduction
    step_in *= height
    per_thread = _div_up(inputs, step_in)
    grid_x = _div_up(num_outputs // vec, step_out)
    target = sms * (max_threads_per_sm // (width * height))
    if per_thread < 256 or grid_x > target:
        return []
    ctas = max(min(_div_up(target, grid_x), _div_up(per_thread, 16)), _div_up(per_thread, 256))
    if ctas <= 1:
        return []
    return [acc_bytes * num_outputs * ctas * width * vec, 4 * grid_x]


class Workspaces:
    """Which workspaces the simulated GPU has allocated (they last as long as it does)."""

    def __init__(self, capability: tuple[int, int], env: Mapping[str, str] | None = None,
                 sms: int = 0) -> None:
        self.sms = sms  # the card's multiprocessors (0: unknown, reductions stage nothing)
        self.threads_per_sm = max_threads_per_sm(capability)
        self.cublas = cublas_workspace_size(capability, env)
        self.cublaslt = cublaslt_workspace_size(capability, env)
        self.held: dict[tuple[str, str], int] = {}  # (library, thread) -> bytes
        # convolution shapes whose engine cudnn.benchmark chose (torch's plan cache): see
        # .cudnn.conv_workspaces
        self.conv_plans: set = set()

    @classmethod
    def of_card(cls, capability: tuple[int, int], target) -> "Workspaces":
        """The workspaces of a simulated card (``target``: its CardSpec, None for no card)."""
        return cls(capability, sms=target.multi_processor_count if target is not None else 0)

    def needed(self, func, args: tuple, kwargs: dict, thread: str) -> list[tuple[tuple[str, str], int]]:
        """The workspaces ``func`` allocates now, on ``thread`` ("main" or "backward")."""
        out = []
        key = ("cuBLAS", thread)
        if key not in self.held and self.cublas:
            out.append((key, self.cublas))
        if self.cublaslt and _uses_lt(func, args, kwargs):
            key = ("cuBLASLt", thread)
            if key not in self.held:
                out.append((key, self.cublaslt))
        return out

    def scratch(self, func, args: tuple, kwargs: dict) -> tuple[list[int], tuple | None]:
        """Bytes of the transient buffers ``func`` (a reduction) allocates and frees, and
        the recipe they come from: ``reduction_scratch(*recipe)`` gives them again (a run
        at other sizes recomputes them from its sizes, see memmagic.whatif.fitmap)."""
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or x.dtype not in _ACC_BYTES or x.dim() < 2:
            return [], None
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        if dims is None or (isinstance(dims, (list, tuple)) and not dims):
            return [], None
        dims = {int(d) % x.dim() for d in (dims if isinstance(dims, (list, tuple)) else (dims,))}
        recipe = (tuple(x.shape), tuple(x.stride()), frozenset(dims), _ACC_BYTES[x.dtype],
                  self.sms, self.threads_per_sm)
        return reduction_scratch(*recipe), recipe

    def describe(self) -> str | None:
        if not self.held:
            return None
        from ...report import format_bytes

        parts = [f"{lib} {format_bytes(n)} ({'autograd thread' if th == 'backward' else 'main thread'})"
                 for (lib, th), n in sorted(self.held.items())]
        return ("workspaces torch allocates through the caching allocator at the first matmul "
                "of each thread and keeps: " + ", ".join(parts)
                + " (sizes from CUBLAS_WORKSPACE_CONFIG / CUBLASLT_WORKSPACE_SIZE and the card)")
