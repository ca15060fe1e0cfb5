"""Autocast for the simulated GPU.

``torch.autocast("cuda")`` is disabled when CUDA is unavailable, so the simulation maps
it onto CPU autocast (the tensors are CPU tensors) with CUDA's default dtype (fp16).
CPU autocast casts a different set of ops than CUDA autocast does, so for
``kernels="cuda"`` the CUDA op policy (aten/src/ATen/autocast_mode.h of the installed
torch) is installed on the ``AutocastCPU`` dispatch key for the run:

* ``lower_precision_fp`` ops CUDA casts and the CPU does not (einsum, addmv, mv, addr,
  conv/RNN cells, ...) cast their floating inputs to the autocast dtype;
* ``fp32`` ops (layer_norm, group_norm, exp, log, pow, the losses, ...) run in fp32;
* ``fp32_set_opt_dtype`` ops (softmax, log_softmax, sum, cumsum, prod, norms) get
  ``dtype=torch.float32`` when none is given, so their outputs are fp32;
* ``promote`` ops cast to the widest floating input;
* ops only the CPU policy lists (cross_entropy_loss, cat, stack, ...) fall through;
* ``binary_cross_entropy`` raises, as on CUDA.

The casts run on the autocast key, above autograd, so autograd saves the cast tensors
(a dispatch-mode cast would save the fp32 ones). The CUDA weight-cast cache is kept for
the ops both policies cast (linear, matmul, conv, ...), where the native CPU kernel
runs; ops only CUDA casts (einsum, ...) cast their weights again at every call.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.amp.autocast_mode as _amp_mode

from ...core import _torch_private as _priv

__all__ = ["make_autocast_classes", "install_cuda_autocast_policy", "CUDA_POLICY"]

_CPU_AUTOCAST_DTYPES = (torch.float16, torch.bfloat16)  # what CPU autocast's check takes

# (op name, overload) -> policy; mirrors AT_FORALL_* in ATen/autocast_mode.h (torch 2.13).
_LOWER = ["_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
          "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
          "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot",
          "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
          "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
          "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention",
          "scaled_dot_product_attention"]
_FP32 = ["acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
         "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
         "pow.Scalar", "softplus", "layer_norm", "native_layer_norm", "rms_norm", "group_norm",
         "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
         "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
         "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
         "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
         "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
         "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d",
         "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d",
         "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
         "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
         "_upsample_bicubic2d_aa"]
_FP32_SET_OPT_DTYPE = ["prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod",
                       "cumsum", "linalg_vector_norm", "linalg_matrix_norm",
                       "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList"]
_FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype",
                      "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
_PROMOTE = ["addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
            "index_put", "tensordot", "scatter_add"]
CUDA_POLICY: dict[str, str] = {
    **{n: "lower_precision_fp" for n in _LOWER}, **{n: "fp32" for n in _FP32},
    **{n: "fp32_set_opt_dtype" for n in _FP32_SET_OPT_DTYPE},
    **{n: "fp32_append_dtype" for n in _FP32_APPEND_DTYPE}, **{n: "promote" for n in _PROMOTE},
}
# What CPU autocast casts to lower precision (ATen/autocast_mode.cpp): same policy as CUDA.
_CPU_LOWER = {"conv1d", "conv1d.padding", "conv2d", "conv2d.padding", "conv3d", "conv3d.padding",
              "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm", "_addmm_activation", "addbmm",
              "linear", "_convolution.deprecated", "matmul", "conv_tbc", "mkldnn_rnn_layer",
              "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "prelu",
              "scaled_dot_product_attention", "_native_multi_head_attention"}
# Ops with a CPU autocast kernel that CUDA autocast leaves alone: they fall through.
_CPU_ONLY = [
    "conv1d.padding", "conv2d.padding", "conv3d.padding", "_addmm_activation", "mkldnn_rnn_layer",
    "_native_multi_head_attention", "avg_pool3d", "binary_cross_entropy", "grid_sampler", "polar",
    "quantile", "quantile.scalar", "nanquantile", "nanquantile.scalar", "stft", "stft.center",
    "grid_sampler_2d", "_grid_sampler_2d_cpu_fallback", "grid_sampler_3d", "trace",
    "view_as_complex", "cholesky", "cholesky_inverse", "cholesky_solve", "inverse", "lu_solve",
    "orgqr", "ormqr", "pinverse", "max_pool3d", "max_unpool2d", "max_unpool3d",
    "adaptive_avg_pool3d", "reflection_pad1d", "reflection_pad2d", "replication_pad1d",
    "replication_pad2d", "replication_pad3d", "cross_entropy_loss", "ctc_loss.IntList",
    "ctc_loss.Tensor", "fft_fft", "fft_ifft", "fft_fft2", "fft_ifft2", "fft_fftn", "fft_ifftn",
    "fft_rfft", "fft_irfft", "fft_rfft2", "fft_irfft2", "fft_rfftn", "fft_irfftn", "fft_hfft",
    "fft_ihfft", "linalg_cond", "linalg_cond.p_str", "linalg_matrix_rank",
    "linalg_matrix_rank.tol_tensor", "linalg_matrix_rank.atol_rtol_tensor",
    "linalg_matrix_rank.atol_rtol_float", "linalg_solve", "linalg_cholesky", "linalg_svdvals",
    "linalg_eigvals", "linalg_eigvalsh", "linalg_inv", "linalg_householder_product",
    "linalg_tensorinv", "linalg_tensorsolve", "fake_quantize_per_tensor_affine", "geqrf",
    "_lu_with_info", "qr", "svd", "triangular_solve", "fractional_max_pool2d",
    "fractional_max_pool3d", "adaptive_max_pool3d", "multilabel_margin_loss_forward", "linalg_qr",
    "linalg_cholesky_ex", "linalg_svd", "linalg_eig", "linalg_eigh", "linalg_lstsq",
    "linalg_inv_ex", "stack", "cat", "index_copy", "index_copy.dimname",
]


def _op(name: str):
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _eligible(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _cast_all(args, kwargs, to: torch.dtype):
    def c(a):
        if _eligible(a) and a.dtype != to:
            return a.to(to)
        if isinstance(a, (list, tuple)) and a and any(isinstance(x, torch.Tensor) for x in a):
            return type(a)(c(x) for x in a)
        return a
    return tuple(c(a) for a in args), {k: c(v) for k, v in kwargs.items()}


def _casting(op, to: torch.dtype | None) -> Callable:
    """``op`` with its floating inputs cast to ``to`` (None: the autocast dtype) first."""
    def kernel(*args, **kwargs):
        args, kwargs = _cast_all(args, kwargs, to or torch.get_autocast_dtype("cpu"))
        with _priv.exclude_autocast_cpu():
            return op(*args, **kwargs)
    return kernel


def _set_opt_dtype(op) -> Callable:
    arguments = _priv.op_schema(op).arguments
    idx = next(i for i, a in enumerate(arguments) if a.name == "dtype")
    kw_only = arguments[idx].kwarg_only

    def kernel(*args, **kwargs):
        if _eligible(args[0]):
            if kw_only:
                if kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            elif len(args) > idx:
                if args[idx] is None:
                    args = args[:idx] + (torch.float32,) + args[idx + 1:]
            elif kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
        with _priv.exclude_autocast_cpu():
            return op(*args, **kwargs)
    return kernel


def _append_dtype(op, dtype_op) -> Callable:
    def kernel(*args, **kwargs):
        with _priv.exclude_autocast_cpu():
            if _eligible(args[0]):
                return dtype_op(*args, **kwargs, dtype=torch.float32)
            return op(*args, **kwargs)
    return kernel


def _promote(op) -> Callable:
    def kernel(*args, **kwargs):
        widest = None
        for a in list(args) + list(kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if _eligible(t):
                    widest = t.dtype if widest is None else torch.promote_types(widest, t.dtype)
        if widest is not None:
            args, kwargs = _cast_all(args, kwargs, widest)
        with _priv.exclude_autocast_cpu():
            return op(*args, **kwargs)
    return kernel


def _bce_banned(*args, **kwargs):
    raise RuntimeError(
        "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
        "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
        "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
        "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
        "safe to autocast.")


_POLICY_KERNELS: list[tuple[str, Callable]] | None = None


def _policy_kernels() -> list[tuple[str, Callable]]:
    """(op name, AutocastCPU kernel) pairs of the CUDA policy, resolved once per process."""
    global _POLICY_KERNELS
    if _POLICY_KERNELS is not None:
        return _POLICY_KERNELS
    kernels: list[tuple[str, Callable]] = []
    for name, policy in CUDA_POLICY.items():
        if not _schema_exists(name):
            continue
        op = _op(name)
        if policy == "lower_precision_fp":
            if name in _CPU_LOWER:
                continue  # same policy: keep the native kernel (and its weight cache)
            kernel = _casting(op, None)
        elif policy == "fp32":
            kernel = _casting(op, torch.float32)
        elif policy == "fp32_set_opt_dtype":
            kernel = _set_opt_dtype(op)
        elif policy == "fp32_append_dtype":
            kernel = _append_dtype(op, _op(_FP32_APPEND_DTYPE[name]))
        else:
            kernel = _promote(op)
        kernels.append((name, kernel))
    for name in _CPU_ONLY:
        if name in CUDA_POLICY or not _schema_exists(name):
            continue
        if name == "binary_cross_entropy":
            kernels.append((name, _bce_banned))
        elif _priv.has_kernel(f"aten::{name}", "AutocastCPU"):
            kernels.append((name, torch.library.fallthrough_kernel))
    _POLICY_KERNELS = kernels
    return kernels


def install_cuda_autocast_policy() -> torch.library.Library:
    """Register the CUDA autocast policy on the AutocastCPU key; destroy the returned
    library (``_torch_private.destroy_library``) to put the CPU policy back."""
    kernels = _policy_kernels()
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name, kernel in kernels:
                lib.impl(name, kernel, "AutocastCPU")
    except BaseException:
        _priv.destroy_library(lib)
        raise
    return lib


def _schema_exists(name: str) -> bool:
    try:
        _op(name)
        return True
    except (AttributeError, RuntimeError):
        return False


def make_autocast_classes(cuda: bool, on_enter: Callable[[], None] | None = None) -> dict[str, Any]:
    """Replacements for ``torch.autocast`` / ``torch.cuda.amp.autocast`` and the autocast
    queries, mapping the "cuda" device type onto CPU autocast. With ``cuda=True`` the
    default dtype is CUDA's (fp16); with ``cuda=False`` (kernels="cpu") the CPU's.
    ``on_enter()`` runs before an autocast region is entered (the simulation installs the
    CUDA policy then, so cells without autocast do not pay for it)."""
    base = _amp_mode.autocast

    class autocast(base):  # noqa: N801 - same name as torch's
        __doc__ = base.__doc__

        def __init__(self, device_type: str, dtype: torch.dtype | None = None,
                     enabled: bool = True, cache_enabled: bool | None = None) -> None:
            wide = None
            if device_type == "cuda":
                device_type = "cpu"
                if dtype is None:
                    dtype = torch.float16 if cuda else torch.get_autocast_dtype("cpu")
                if enabled and dtype not in _CPU_AUTOCAST_DTYPES:
                    # CUDA autocast takes any dtype as its target (llm.c's train_gpt2.py
                    # enters it with float32 by default: ops cast to or stay in fp32); CPU
                    # autocast's check would warn and disable itself, which a GPU never
                    # does. Its kernels take the dtype once the check is passed.
                    wide, dtype = dtype, torch.bfloat16
            super().__init__(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
            if wide is not None:
                self.fast_dtype = wide

        def __enter__(self):
            if on_enter is not None:
                on_enter()
            return super().__enter__()

    class cuda_amp_autocast(autocast):  # noqa: N801
        def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16,
                     cache_enabled: bool = True) -> None:
            super().__init__("cuda", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    is_enabled = torch.is_autocast_enabled
    get_dtype = torch.get_autocast_dtype

    def is_autocast_enabled(device_type: str | None = None) -> bool:
        if device_type is None or device_type == "cuda":
            device_type = "cpu"
        return is_enabled(device_type)

    def get_autocast_dtype(device_type: str) -> torch.dtype:
        return get_dtype("cpu" if device_type == "cuda" else device_type)

    return {"autocast": autocast, "cuda_amp_autocast": cuda_amp_autocast,
            "is_autocast_enabled": is_autocast_enabled, "get_autocast_dtype": get_autocast_dtype,
            "get_autocast_gpu_dtype": lambda: get_dtype("cpu")}
