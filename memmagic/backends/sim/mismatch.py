"""Ops that mix devices: where CUDA raises "Expected all tensors to be on the same device".

An op mixing a tensor on the simulated GPU with a CPU tensor that is not a 0-dim scalar
raises :class:`SimulatedDeviceMismatchError` (indexing with CPU indices, copies and the
other ops CUDA lets cross devices are allowed). Only devices the simulation knows count:
the tracker's ``device_of`` answers None for a tensor whose device it guessed. Backward is
not checked (its ops follow a forward that passed the check).
"""

from __future__ import annotations

from typing import Callable

import torch

from ...core import _torch_private as _priv
from .errors import SimulatedDeviceMismatchError

__all__ = ["device_rule", "check_same_device"]

# Ops that take tensors on different devices on CUDA (device_check: NoCheck in
# native_functions.yaml, not TensorIterator-based): copies, views of another tensor's
# shape, storage swaps, the CTC losses (targets and lengths may stay on the CPU), packing.
_ANY_DEVICE = {"copy_", "copy", "_copy_from", "_copy_from_and_resize", "_to_copy", "to",
               "lift", "lift_fresh", "lift_fresh_copy", "set_", "is_set_to", "is_same_size",
               "_has_same_storage_numel", "expand_as", "view_as", "reshape_as",
               "broadcast_tensors", "empty_like", "resize_as_", "_foreach_copy_", "_foreach_copy",
               "ctc_loss", "_ctc_loss", "_ctc_loss_backward", "_cudnn_ctc_loss",
               "_use_cudnn_ctc_loss", "record_stream", "_resize_output_",
               # packed sequences: their lengths and batch sizes stay on the CPU
               "_pack_padded_sequence", "_pad_packed_sequence", "_pack_padded_sequence_backward",
               # a metadata question (module.cuda() asks it; in inference mode it reaches
               # the modes)
               "_has_compatible_shallow_copy_type"}
_INDEX_OPS = {"index", "_unsafe_index", "index_put", "index_put_", "_index_put_impl_",
              "_unsafe_index_put"}

DeviceOf = Callable[[torch.Tensor], "str | None"]


def device_rule(func) -> str:
    """How CUDA checks the devices of ``func``'s inputs: "any" (no check), "index" (indices
    on the CPU or on the indexed tensor's device), "lists" (foreach and fused optimizer
    ops: the tensor lists agree; scalar and lr tensors may stay on the CPU) or "same"."""
    packet = getattr(func, "overloadpacket", None)
    name = getattr(packet, "__name__", "") or str(func)
    if getattr(func, "namespace", "aten") != "aten" or name in _ANY_DEVICE:
        return "any"
    if name in _INDEX_OPS:
        return "index"
    if name.startswith(("_foreach_", "_fused_")):
        return "lists"
    return "same"


def check_same_device(func, args: tuple, kwargs: dict, rule: str, device_of: DeviceOf) -> None:
    """Raise what CUDA raises when an op gets a CPU tensor and a CUDA tensor (a 0-dim
    CPU tensor is a scalar CUDA accepts). ``rule``: :func:`device_rule` of ``func``;
    ``device_of(t)``: "device", "host" or None (not known, or a CPU scalar). Ops that move
    tensors between devices, and backward, are not checked."""
    if rule == "any" or _priv.in_backward():
        return
    if rule == "index":
        _check_indices(func, args, device_of)
        return
    found = _pools_by_argument(func, args, kwargs, rule, device_of)
    pools = {p for p, _ in found}
    if len(pools) < 2:
        return
    first = found[0][0]
    other = next(n for p, n in found if p != first)
    devs = ("cuda:0", "cpu") if first == "device" else ("cpu", "cuda:0")
    raise SimulatedDeviceMismatchError(
        f"would fail on a GPU: Expected all tensors to be on the same device, but found at "
        f"least two devices, {devs[0]} and {devs[1]}! (argument '{other}' of "
        f"aten.{func.__name__}); move the CPU tensor with .cuda() or .to(device)",
        op=func.__name__, argument=other)


def _check_indices(func, args: tuple, device_of: DeviceOf) -> None:
    """Indices may be on the CPU or on the indexed tensor's device."""
    if len(args) > 1 and isinstance(args[0], torch.Tensor) and device_of(args[0]) == "host":
        for t in args[1] if isinstance(args[1], (list, tuple)) else ():
            if isinstance(t, torch.Tensor) and device_of(t) == "device":
                raise SimulatedDeviceMismatchError(
                    "would fail on a GPU: indices should be either on cpu or on the same "
                    "device as the indexed tensor (cpu); move the indexed tensor or the "
                    "indices with .cuda() or .to(device)", op=func.__name__, argument="indices")


def _pools_by_argument(func, args: tuple, kwargs: dict, rule: str,
                       device_of: DeviceOf) -> list[tuple[str, str]]:
    """(pool, argument name) of every tensor input whose device is known, in argument
    order."""
    schema = _priv.op_schema(func)
    names = [a.name for a in schema.arguments] if schema is not None else []
    found: list[tuple[str, str]] = []
    for name, a in list(zip(names, args)) + list(kwargs.items()):
        if rule == "lists" and not isinstance(a, (list, tuple)):
            continue  # foreach/fused scalars and lr tensors may stay on the CPU
        for t in (a,) if isinstance(a, torch.Tensor) else a if isinstance(a, (list, tuple)) else ():
            if isinstance(t, torch.Tensor):
                pool = device_of(t)
                if pool is not None:
                    found.append((pool, name))
    return found
