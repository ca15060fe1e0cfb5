"""Packed sequences (``torch.nn.utils.rnn.pack_padded_sequence`` and back) on the simulated GPU.

How many rows a packed batch has follows from the lengths' values, which a fake tensor has
only when they are constants: lengths made from Python numbers (``torch.tensor([len(s) for s
in batch])``, a collate function's) are. Then :class:`_PackPadded` and :class:`_PadPacked`
make what the real kernels make: the packed rows (the sum of the lengths) and the batch
sizes (one per step, on the CPU), or the padded batch (the longest length, or
``total_length``, x the batch) and the lengths (on the CPU); backward, a gradient of the
input's size. Lengths that depend on data raise the simulation's "output size depends on
tensor values" error, as before.
"""

from __future__ import annotations

import torch

from ...core import _torch_private as _priv

__all__ = ["pack_padded", "pad_packed", "known_ints"]

_aten = torch.ops.aten


def known_ints(t: torch.Tensor, op) -> list[int]:
    """The values of a CPU tensor of lengths or batch sizes, which the simulation must know
    to size ``op``'s outputs (else the error of an output size that depends on values)."""
    real = _priv.fake_constant(t) if _priv.is_fake(t) else t
    if real is None:
        raise _priv.DynamicOutputShapeException(op)
    return [int(v) for v in real.tolist()]


def _transposed(counts: list[int], n: int) -> list[int]:
    """For i < n, how many of ``counts`` exceed i: lengths (one per sample) to batch sizes
    (one per step), and batch sizes back to lengths."""
    return [sum(1 for c in counts if c > i) for i in range(n)]


def _check(input, lengths: list[int], batch_first: bool) -> None:
    """What torch's kernel checks of the input and the lengths, with its messages."""
    batch = input.shape[0 if batch_first else 1]
    if input.numel() == 0:
        raise RuntimeError("Cannot pack empty tensors.")
    if len(lengths) != batch:
        raise RuntimeError(f"Expected `len(lengths)` to be equal to batch_size, but got "
                           f"{len(lengths)} (batch_size={batch})")
    if any(a < b for a, b in zip(lengths, lengths[1:])):
        raise RuntimeError(
            "`lengths` array must be sorted in decreasing order when `enforce_sorted` is True. You "
            "can pass `enforce_sorted=False` to pack_padded_sequence and/or pack_sequence to "
            "sidestep this requirement if you do not need ONNX exportability.")
    if not lengths or lengths[-1] <= 0:
        raise RuntimeError("Length of all samples has to be greater than 0, but found an element "
                           "in 'lengths' that is <= 0")


class _PackPadded(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, lengths: list[int], batch_first: bool):
        _check(input, lengths, batch_first)
        steps = max(lengths)
        sizes = _transposed(lengths, steps)
        ctx.input_shape = input.shape
        data = input.new_empty((sum(lengths), *input.shape[2:]))
        batch_sizes = torch.tensor(sizes, dtype=torch.int64)
        ctx.mark_non_differentiable(batch_sizes)
        return data, batch_sizes

    @staticmethod
    def backward(ctx, grad, _grad_sizes):
        return grad.new_zeros(ctx.input_shape), None, None


class _PadPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, data, sizes: list[int], batch_first: bool, padding_value, total_length: int):
        steps = max(len(sizes), total_length)
        ctx.data_shape = data.shape
        out = data.new_full((steps, sizes[0], *data.shape[1:]), padding_value)
        lengths = torch.tensor(_transposed(sizes, sizes[0]), dtype=torch.int64)
        ctx.mark_non_differentiable(lengths)
        return (out.transpose(0, 1) if batch_first else out), lengths

    @staticmethod
    def backward(ctx, grad, _grad_lengths):
        return grad.new_empty(ctx.data_shape), None, None, None, None


def pack_padded(func, args: tuple, kwargs: dict):
    """``torch._VF._pack_padded_sequence`` (what ``pack_padded_sequence`` calls) on a fake
    input: :class:`_PackPadded`; on a real one, torch's."""
    input, lengths, batch_first = _bound(args, kwargs, ("input", "lengths", "batch_first"))
    if not _priv.is_fake(input):
        return func(*args, **kwargs)
    lengths = known_ints(lengths, _aten._pack_padded_sequence.default)
    return _PackPadded.apply(input, lengths, batch_first)


def pad_packed(func, args: tuple, kwargs: dict):
    """``torch._VF._pad_packed_sequence`` (what ``pad_packed_sequence`` calls) on fake data:
    :class:`_PadPacked`; on real data, torch's."""
    names = ("data", "batch_sizes", "batch_first", "padding_value", "total_length")
    data, batch_sizes, batch_first, padding_value, total_length = _bound(args, kwargs, names)
    if not _priv.is_fake(data):
        return func(*args, **kwargs)
    sizes = known_ints(batch_sizes, _aten._pad_packed_sequence.default)
    return _PadPacked.apply(data, sizes, batch_first, padding_value, total_length)


def _bound(args: tuple, kwargs: dict, names: tuple[str, ...]) -> list:
    return [*args, *(kwargs[n] for n in names[len(args):])]
