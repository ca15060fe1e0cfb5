"""LSTM, GRU and plain RNN stacks on the simulated GPU as cuDNN runs them (``_cudnn_rnn``).

On the CPU, ``torch.lstm`` runs oneDNN's layer kernels and ``torch.gru`` / ``torch.rnn_tanh``
/ ``torch.rnn_relu`` run gate by gate and step by step, saving every step's gates for
backward. On a GPU one cuDNN call runs the whole stack. Its allocations, read off an
H200's allocator history for 72 shapes (``results/gpu-check-nvidia-h200.json``
``kernels.rnn``: LSTM, GRU and RNN, 1-2 layers, one or two directions, fp32 and fp16), are
what :class:`_CudnnRNN` makes, in the same order (checked to the byte on all 72):

* forward: a time-major contiguous copy of the input (when it is not one already), the
  output, the last hidden state (and an LSTM's last cell state), cuDNN's workspace
  (:func:`.cudnn.rnn_workspace`), its training reserve (:func:`.cudnn.rnn_reserve`; in
  training mode only); then the workspace and the copy are freed. The input, the initial
  states, the output and the reserve are saved for backward;
* backward: the gradients of the last states (zeros when they were not used), a copy of
  the input and a time-major copy of the output's gradient, the input's and the initial
  states' gradients, the workspace; both copies freed; then, when the weights need
  gradients, another copy of the input, one flat buffer of the weights' gradients (each
  weight's gradient a view of it) and the workspace again. cuDNN runs the data pass even
  when the input needs no gradient (it updates the reserve).

``.cuda()`` / ``.to()`` flatten a module's weights into one buffer (``flatten_parameters``),
as a CUDA build does.

Under CUDA autocast, cuDNN's RNNs run in fp16 whatever the autocast dtype (ATen's
``_cudnn_rnn_cast_reflatten``): the input, the states and the weights are cast (cuDNN
reflattens the fp16 weights into one buffer; here one copy per weight, the same bytes).
A packed sequence (:mod:`.packed`) runs the same way on its rows, its reserve and
workspace sized as its padded batch (cuDNN's packed figures were not measured; the note
says so). LSTMs with projections, ``torch.backends.cudnn.enabled = False`` and empty inputs
keep the composite (CPU) kernels, as the report's note says. cuDNN's dropout state between
layers is not counted.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ...core import _torch_private as _priv
from .cudnn import rnn_reserve, rnn_workspace
from .packed import known_ints

__all__ = ["CudnnRNNKernel", "RNN_MODES"]

_aten = torch.ops.aten
# op -> cuDNN's mode as the measured tables name it
RNN_MODES = {_aten.lstm.input: "LSTM", _aten.gru.input: "GRU", _aten.rnn_tanh.input: "RNN",
             _aten.rnn_relu.input: "RNN", _aten.lstm.data: "LSTM", _aten.gru.data: "GRU",
             _aten.rnn_tanh.data: "RNN", _aten.rnn_relu.data: "RNN"}
# the overloads that take a packed sequence (its rows, then its batch sizes)
_PACKED = frozenset({_aten.lstm.data, _aten.gru.data, _aten.rnn_tanh.data, _aten.rnn_relu.data})


class _CudnnRNN(torch.autograd.Function):
    """Memory-equivalent stand-in for ``_cudnn_rnn`` and its backward (see the module
    docstring): the same outputs, saved tensors and buffers, with no values."""

    @staticmethod
    def forward(ctx, call: "_Call", x, hx, cx, *weights):
        xt = (x.transpose(0, 1) if call.batch_first else x).contiguous()
        y = xt.new_empty((*xt.shape[:-1], call.directions * hx.shape[-1]))
        hy = hx.new_empty(hx.shape)
        cy = None if cx is None else cx.new_empty(cx.shape)
        held = call.hold(call.workspace)
        try:  # (a reserve that does not fit raises with the workspace let go, as on a GPU)
            reserve = xt.new_empty((call.reserve,), dtype=torch.uint8) if call.reserve else None
        finally:
            call.release(held)
        del xt
        out = y.transpose(0, 1) if call.batch_first else y
        ctx.call = call
        ctx.save_for_backward(x, hx, cx, out, reserve)
        return out, hy, cy

    @staticmethod
    def backward(ctx, grad_out, grad_hy, grad_cy):
        call = ctx.call
        x, hx, cx, _out, _reserve = ctx.saved_tensors
        time_major = (lambda t: t.transpose(0, 1)) if call.batch_first else (lambda t: t)
        xt = time_major(x).contiguous()
        dyt = time_major(grad_out).contiguous()
        dx, dhx = xt.new_empty(xt.shape), hx.new_empty(hx.shape)
        dcx = None if cx is None else cx.new_empty(cx.shape)
        call.release(call.hold(call.workspace))
        del dyt, xt
        dws: list[torch.Tensor | None] = [None] * len(call.shapes)
        if any(ctx.needs_input_grad[4:]):
            xt = time_major(x).contiguous()
            flat = hx.new_zeros((sum(n for n, _ in call.shapes),), dtype=call.weight_dtype)
            call.release(call.hold(call.workspace))
            del xt
            offset = 0
            for i, (n, shape) in enumerate(call.shapes):
                dws[i] = flat[offset:offset + n].view(shape)
                offset += n
        return None, time_major(dx), dhx, dcx, *dws


class _Call:
    """One cuDNN RNN call's settings and sizes, and the tracker's transient buffers (held
    weakly: a graph kept after the run keeps no tracker alive)."""

    def __init__(self, tracker, mode: str, x, hx, weights, layers: int, train: bool,
                 bidirectional: bool, batch_first: bool, counts: dict[str, int],
                 steps: tuple[int, int] | None = None) -> None:
        self.tracker = weakref.ref(tracker)
        self.batch_first = batch_first
        self.directions = 2 if bidirectional else 1
        self.shapes = [(w.numel(), w.shape) for w in weights]
        self.weight_dtype = weights[0].dtype if weights else x.dtype
        # (a packed sequence's ``steps``: its steps and its first step's batch)
        T, B = steps or ((x.shape[1], x.shape[0]) if batch_first else (x.shape[0], x.shape[1]))
        H, I = hx.shape[-1], x.shape[-1]
        self.workspace, how = rnn_workspace(mode, x.dtype, layers, bidirectional, T, B, I, H)
        counts[how] = counts.get(how, 0) + 1
        self.reserve = (rnn_reserve(mode, layers, bidirectional, T, B, H, x.element_size())
                        if train else 0)

    def hold(self, nbytes: int) -> int:
        tracker = self.tracker()
        return tracker.hold_scratch(nbytes, "_cudnn_rnn") if nbytes > 0 and tracker is not None else 0

    def release(self, serial: int) -> None:
        tracker = self.tracker()
        if serial and tracker is not None:
            tracker.release_scratch(serial)


class CudnnRNNKernel:
    """The ``AutogradCPU`` kernel of ``lstm``, ``gru``, ``rnn_tanh`` and ``rnn_relu`` (their
    ``.input`` overloads, and ``.data`` for a packed sequence) for a run with CUDA kernels: cuDNN's memory (:class:`_CudnnRNN`) for
    a stack on the simulated GPU; the composite (CPU) kernel for real tensors, stacks on
    the host, and where CUDA would not take cuDNN (the run's state counts the calls taken,
    by mode)."""

    def __init__(self, tracker) -> None:
        self._tracker = weakref.ref(tracker)  # (torch may keep a kernel after its library)

    def kernel(self, op) -> Any:
        mode, packed = RNN_MODES[op], op in _PACKED

        def run(*args):
            # (input, hx, params, has_biases, layers, dropout, train, bidirectional, batch_first),
            # or (data, batch_sizes, hx, params, ..., bidirectional) for a packed sequence
            x, rest = args[0], args[2:] if packed else args[1:]
            hx, params, _bias, layers, _dropout, train, bidirectional = rest[:7]
            h, c = (hx[0], hx[1]) if mode == "LSTM" else (hx, None)
            tracker = self._tracker()
            if (tracker is None or not self._takes(tracker, x, packed)
                    or (c is not None and c.shape[-1] != h.shape[-1])):
                # (an LSTM with projections: cuDNN's reserve for them was not measured)
                return _priv.call_composite(op, *args)
            steps = None
            if packed:  # sized as the padded batch (cuDNN's packed figures were not measured)
                sizes = known_ints(args[1], op)
                steps = (len(sizes), sizes[0])
            calls = tracker.s.cudnn_rnn_calls
            for key in (mode, "packed") if packed else (mode,):
                calls[key] = calls.get(key, 0) + 1
            weights = list(params)
            if (torch.is_autocast_enabled("cpu") and not _priv.autocast_cpu_excluded()
                    and x.is_floating_point()):
                # CUDA's autocast wrapper of cuDNN's RNNs: fp16 whatever the autocast dtype
                with _priv.exclude_autocast_cpu():
                    x, h = x.to(torch.float16), h.to(torch.float16)
                    c = None if c is None else c.to(torch.float16)
                    weights = [w.to(torch.float16) for w in weights]
            call = _Call(tracker, mode, x, h, weights, layers, train, bidirectional,
                         not packed and rest[7], tracker.s.cudnn_rnn_workspaces, steps)
            out, hy, cy = _CudnnRNN.apply(call, x, h, c, *weights)
            return (out, hy) if c is None else (out, hy, cy)

        return run

    @staticmethod
    def _takes(tracker, x, packed: bool) -> bool:
        """Whether CUDA would run this stack through cuDNN and it is on the simulated GPU."""
        return (x.dim() == (2 if packed else 3) and x.numel() > 0 and _on_gpu(tracker, x)
                and torch.backends.cudnn.enabled)

    def flattening(self, original) -> Any:
        """``nn.RNNBase.flatten_parameters`` (which ``.cuda()`` and ``.to()`` call) as a CUDA
        build runs it for a module on the simulated GPU: the weights copied into one buffer
        that each then views (``_cudnn_rnn_flatten_weight``), their own storages freed; the
        original (a no-op without cuDNN) elsewhere."""

        def flatten_parameters(module) -> None:
            ws, tracker = module._flat_weights, self._tracker()
            if not (tracker is not None and ws and len(ws) == len(module._flat_weights_names)
                    and all(isinstance(w, torch.Tensor) and _on_gpu(tracker, w) for w in ws)
                    and len({w.dtype for w in ws}) == 1 and torch.backends.cudnn.enabled
                    and len({_priv.storage_key(w.untyped_storage()) for w in ws}) == len(ws)):
                return original(module)
            with torch.no_grad():
                flat = ws[0].new_empty((sum(w.numel() for w in ws),))
                offset = 0
                for w in ws:
                    w.set_(flat.untyped_storage(), offset, w.shape)
                    offset += w.numel()
            return None

        return flatten_parameters


def _on_gpu(tracker, t) -> bool:
    s = tracker.s
    return _priv.is_fake(t) and s.cuda and s.pool_of(t) == "device"
