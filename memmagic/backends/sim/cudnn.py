"""What cuDNN allocates for itself beside a kernel's outputs, as a real GPU's caching
allocator recorded it: the workspace of each convolution pass and of an RNN's forward and
backward. Each is a buffer torch allocates through the caching allocator before the kernel
and frees once it is queued, so it counts towards the peak but not after the op.

No formula gives them: cuDNN picks an engine per shape (by its heuristics, or by timing
them when ``torch.backends.cudnn.benchmark`` is on) and each engine asks for its own
workspace. So the sizes come from a table measured on a real GPU
(:mod:`.cudnn_tables`, made by ``python -m benchmarks.gpu_check --tables`` from what
``python -m benchmarks.gpu_check --real --conv --probe`` read off the allocator's history),
keyed by the convolution's geometry and dtype:

* a shape in the table: the line through the two batches measured, its slope and
  intercept rounded to 512 bytes (``measured`` at those batches, to within 512 bytes a
  sample; ``interpolated`` at others), so that the bytes are a polynomial in the batch as
  the what-if planes need;
* a shape not in the table: the nearest one measured (same pass and dtype, then the same
  kernel size and stride, then channels and image size), its line scaled by the tensor the
  pass works through (``nearest``);
* grouped, transposed and 3-D convolutions, and dtypes the table lacks: none (``none``).

The table was taken with ``cudnn.benchmark`` off on one card (:data:`.cudnn_tables.SOURCE`);
other cards' cuDNN may pick other engines, and the report says where the figures come from.
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import lru_cache
from typing import Any

import torch

from . import cudnn_tables as _tables

__all__ = ["conv_workspaces", "rnn_workspace", "rnn_reserve", "cudnn_note", "rnn_how", "CONV_OPS",
           "PASSES", "SOURCE"]

_aten = torch.ops.aten
CONV_OPS = frozenset({_aten.convolution.default, _aten.convolution_backward.default})
PASSES = ("forward", "backward_data", "backward_filter")
SOURCE = _tables.SOURCE
_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# (kh, kw, stride h, stride w) mismatch weighs more than any channel or size ratio
_KERNEL_MISMATCH = 10.0


def _ints(v: Any, n: int) -> tuple[int, ...]:
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return tuple(int(x) for x in (v * n if len(v) == 1 else v))


def _geometry(x: torch.Tensor, w: torch.Tensor, stride, padding, dilation, transposed: bool,
              groups: int) -> tuple[int, ...] | None:
    """(C_in, H, W, C_out, kh, kw, sh, sw, ph, pw, dh, dw) of a 2-D convolution (a 1-D one
    as cuDNN runs it: height 1), None for what the table does not cover."""
    if transposed or int(groups) != 1 or x.dim() not in (3, 4) or w.dim() != x.dim():
        return None
    if x.dim() == 3:
        C, L = x.shape[1], x.shape[2]
        k = w.shape[2]
        s, p, d = _ints(stride, 1)[0], _ints(padding, 1)[0], _ints(dilation, 1)[0]
        return (int(C), 1, int(L), int(w.shape[0]), 1, int(k), 1, s, 0, p, 1, d)
    _n, C, H, W = (int(v) for v in x.shape)
    return (C, H, W, int(w.shape[0]), int(w.shape[2]), int(w.shape[3]), *_ints(stride, 2),
            *_ints(padding, 2), *_ints(dilation, 2))


def _per_sample(pass_: str, geo: tuple[int, ...]) -> int:
    """Elements per sample of the tensor a pass works through: the output (forward), the
    input (backward data and filter)."""
    C, H, W, K, kh, kw, sh, sw, ph, pw, dh, dw = geo
    if pass_ != "forward":
        return C * H * W
    ho = (H + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    wo = (W + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    return K * max(ho, 1) * max(wo, 1)


def _line(points: tuple[tuple[int, int], ...], scale: tuple[int, int] = (1, 1)) -> tuple[int, int]:
    """(A, B), multiples of 512, of the workspace ``A + B * batch`` through the (batch, bytes)
    points measured (one point: through zero), times ``scale`` (a fraction). Multiples of
    512 are what the allocator rounds a request up to, so the bytes at any batch are a
    polynomial in it (the what-if planes fit sizes so) and each measured point is met to
    within 512 bytes a sample."""
    num, den = scale
    (b0, v0), (b1, v1) = points[0], points[-1]
    slope = Fraction(v0, b0) if b0 == b1 else Fraction(v1 - v0, b1 - b0)
    intercept = v0 - slope * b0
    r = lambda x: int(round(x * num / den / 512)) * 512  # noqa: E731
    return r(intercept), r(slope)


def _at(points: tuple[tuple[int, int], ...], n: int, scale: tuple[int, int] = (1, 1)) -> int:
    a, b = _line(points, scale)
    return max(0, a + b * n)


@lru_cache(maxsize=4096)
def _nearest(pass_: str, dtype: str, geo: tuple[int, ...]) -> tuple[int, ...] | None:
    best, score = None, math.inf
    for key in _tables.CONV:
        if key[0] != pass_ or key[1] != dtype:
            continue
        other = key[2:]
        s = _KERNEL_MISMATCH * (other[4:8] != geo[4:8])
        s += abs(math.log(other[0] / geo[0])) + abs(math.log(other[3] / geo[3]))
        s += abs(math.log((other[1] * other[2]) / (geo[1] * geo[2])))
        if s < score:
            best, score = other, s
    return best


def _workspace(pass_: str, dtype: str, geo: tuple[int, ...], n: int) -> tuple[int, str]:
    points = _tables.CONV.get((pass_, dtype, *geo))
    if points is not None:
        return _at(points, n), "measured" if any(b == n for b, _v in points) else "interpolated"
    near = _nearest(pass_, dtype, geo)
    if near is None:
        return 0, "none"
    scale = (_per_sample(pass_, geo), max(1, _per_sample(pass_, near)))
    return _at(_tables.CONV[(pass_, dtype, *near)], n, scale), "nearest"


def _benchmarked(pass_: str, dtype: str, geo: tuple[int, ...], n: int,
                 plans: set) -> list[tuple[int, str]]:
    """With ``cudnn.benchmark`` on: the first call of a shape (per process: torch caches the
    plan) times cuDNN's engines with the search's buffers, empties the allocator's cache
    (torch frees the cached blocks the search's "few GBs" leave: an entry ``(0, "benchmark
    empty cache")``), then runs the fastest; later calls run it with its own workspace.
    From the table's shape at its batch, in proportion to the batch; a shape it lacks falls
    back to the heuristics' workspace."""
    row = _tables.BENCHMARK.get((pass_, dtype, *geo))
    if row is None:
        nbytes, _how = _workspace(pass_, dtype, geo, n)
        return [(nbytes, "benchmark not measured")]
    batch, first, then = row
    key = (pass_, dtype, geo, n)
    run = [(_at(((batch, then),), n), "benchmark")]
    if key in plans:
        return run
    plans.add(key)
    # the measured first call: the search's buffers, then the chosen engine's workspace
    search = first[:-1] if then and first and first[-1] == then else first
    return [*((_at(((batch, v),), n), "benchmark search") for v in search),
            (0, "benchmark empty cache"), *(run if then else ())]


def conv_workspaces(func, args: tuple, plans: set | None = None) -> list[tuple[int, str]]:
    """The workspaces (bytes, how the size was found) cuDNN takes for ``func``
    (``aten.convolution`` or ``aten.convolution_backward``) on ``args``, in the order the
    passes run: forward; or backward data, then backward filter, as the output mask asks.
    ``plans``: the shapes whose engine ``cudnn.benchmark`` has chosen on this GPU (added
    to); with it given and ``torch.backends.cudnn.benchmark`` on, a shape's first call
    takes the search's buffers (:func:`_benchmarked`)."""
    if func is _aten.convolution.default:
        x, w = args[0], args[1]
        stride, padding, dilation, transposed, _op, groups = args[3:9]
        passes = ("forward",)
    else:
        x, w = args[1], args[2]
        stride, padding, dilation, transposed, _op, groups, mask = args[4:11]
        passes = tuple(p for p, on in zip(PASSES[1:], mask[:2]) if on)
    dtype = _DTYPES.get(getattr(x, "dtype", None))
    if dtype is None or not isinstance(w, torch.Tensor):
        return []
    geo = _geometry(x, w, stride, padding, dilation, bool(transposed), groups)
    if geo is None:
        return [(0, "none")]
    n = int(x.shape[0])
    if plans is not None and torch.backends.cudnn.benchmark:
        return [found for p in passes for found in _benchmarked(p, dtype, geo, n, plans)]
    return [_workspace(p, dtype, geo, n) for p in passes]


def rnn_workspace(mode: str, dtype: torch.dtype, layers: int, bidirectional: bool, T: int,
                  B: int, I: int, H: int) -> tuple[int, str]:
    """The workspace cuDNN takes for an RNN stack's forward, and again for each of its two
    backward passes (data, weights), and how it was found: the table's (``measured``), or
    the nearest shape measured of the same mode and dtype scaled by steps x batch x hidden
    x layers x directions (``nearest``); (0, "none") where the table has no such mode."""
    name = _DTYPES.get(dtype)
    key = (mode, name, int(layers), bool(bidirectional), int(T), int(B), int(I), int(H))
    if key in _tables.RNN:
        return _tables.RNN[key], "measured"
    size = lambda k: k[4] * k[5] * k[7] * k[2] * (2 if k[3] else 1)  # noqa: E731
    same = [k for k in _tables.RNN if k[0] == mode and k[1] == name]
    if not same and name == "bf16":  # not measured: cuDNN's fp16 figures, the same width
        same = [k for k in _tables.RNN if k[0] == mode and k[1] == "fp16"]
    if not same:
        return 0, "none"
    near = min(same, key=lambda k: abs(math.log(size(k) / size(key))) + abs(math.log(k[6] / key[6])))
    # per step and sample, a multiple of 512 (a polynomial in the batch and the steps)
    per = round(Fraction(_tables.RNN[near] * size(key), size(near) * key[4] * key[5]) / 512) * 512
    return per * key[4] * key[5], "nearest"


# hidden-size vectors cuDNN's training reserve keeps per step, layer and direction
_RESERVE_VECTORS = {"LSTM": 5, "GRU": 6, "RNN": 1}
_RESERVE_PAD = 256  # a stack's reserve is 256 bytes over its layers' (H100 and H200)


def rnn_reserve(mode: str, layers: int, bidirectional: bool, T: int, B: int, H: int,
                itemsize: int) -> int:
    """Bytes of cuDNN's training reserve for an RNN stack: per step and direction, each
    layer's gate vectors (5 for an LSTM, 6 for a GRU, 1 for a plain RNN, of the hidden
    size) and each inner layer's output, in the input's dtype, and 256 bytes. Measured on
    an H100 and an H200 (cuDNN 9.19) to the byte on 72 shapes (1-2 layers, one or two
    directions, fp32 and fp16)."""
    steps = T * B * H * itemsize * (2 if bidirectional else 1)
    return steps * (_RESERVE_VECTORS[mode] * layers + layers - 1) + _RESERVE_PAD


_HOW = (("measured", "as measured"), ("interpolated", "interpolated between the batches measured"),
        ("nearest", "scaled from the nearest shape measured"), ("none", "none taken (not covered)"),
        ("benchmark search", "buffers of cudnn.benchmark's search, at a shape's first call"),
        ("benchmark empty cache", "search(es) followed by torch emptying the allocator's cache"),
        ("benchmark search skipped", "engines the search skipped, their workspace not fitting the card"),
        ("benchmark", "the workspace of the engine cudnn.benchmark chose"),
        ("benchmark not measured", "cudnn.benchmark on for a shape not measured so: the "
                                   "heuristics' workspace"))


def _counted(counts: dict[str, int], unit: str) -> list[str]:
    return [f"{counts[k]}{unit}{'s' * (bool(unit) and counts[k] != 1)} {words}"
            for k, words in _HOW if counts.get(k)]


def cudnn_note(counts: dict[str, int]) -> str:
    """The report's note on the convolution passes' workspaces, by how they were sized."""
    return ("cuDNN's convolution workspaces (allocated beside each pass and freed after it) from a "
            f"table measured on {SOURCE}: " + "; ".join(_counted(counts, "")) + " (passes); another "
            "card or cudnn.benchmark on can pick other algorithms and workspaces")


def rnn_how(counts: dict[str, int]) -> str:
    """How the RNN calls' workspaces were sized, for the report's note."""
    parts = _counted(counts, " call")
    return (f"from a table measured on {SOURCE}: " + "; ".join(parts)) if parts else \
        f"from a table measured on {SOURCE}"
