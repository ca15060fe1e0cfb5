"""The private torch APIs the simulated device relies on (memmagic/_torch_private.py,
below '# --- simulated device ---')."""

from __future__ import annotations

import torch

from memmagic import _torch_private as priv


def test_fake_mode_and_copies():
    mode = priv.new_fake_mode()
    p = torch.nn.Parameter(torch.randn(3, 4))
    p.grad = torch.ones(3, 4)
    f = priv.fake_copy(mode, p)
    assert priv.is_fake(f) and isinstance(f, torch.nn.Parameter) and f.grad is not None
    step = torch.tensor(5.0)
    c = priv.fake_copy(mode, step)
    with mode:
        c.add_(1)
        assert c.item() == 6.0
    assert step.item() == 5.0  # the real tensor is untouched
    assert priv.fake_constant(c).item() == 6.0 and priv.fake_device(c) == torch.device("cpu")
    assert priv.fake_constant(f) is None and priv.fake_device(p) is None
    priv.forget_fake_memo(mode)
    assert len(mode.fake_tensor_converter.tensor_memo) == 0


def test_fake_errors_are_exceptions():
    for e in (priv.DataDependentOutputException, priv.DynamicOutputShapeException,
              priv.UnsupportedOperatorException):
        assert issubclass(e, Exception)
    mode = priv.new_fake_mode()
    with mode:
        t = torch.ones(3)
        try:
            t.sum().item()
        except priv.DataDependentOutputException:
            pass
        else:
            raise AssertionError("a fake tensor's value should be unknown")


def test_dispatch_helpers():
    assert priv.has_kernel("aten::linear", "AutocastCPU")
    assert not priv.has_kernel("aten::softmax.int", "AutocastCPU")
    assert priv.parse_to("cuda", torch.float16)[:2] == (torch.device("cuda"), torch.float16)
    assert torch.zeros in priv.device_constructors()
    assert priv.function_mode_depth() == 0
    with torch.autocast("cpu"):
        assert not priv.autocast_cpu_excluded()
        with priv.exclude_autocast_cpu():
            assert priv.autocast_cpu_excluded()
    names = [m.__name__ for m in priv.optimizer_modules_with_default_foreach()]
    assert "torch.optim.adam" in names and "torch.optim.sgd" in names


def test_call_composite_is_the_cpu_behaviour():
    x = torch.ones(16, requires_grad=True)
    y = priv.call_composite(torch.ops.aten.dropout.default, x, 0.5, True)
    assert type(y.grad_fn).__name__ == "MulBackward0"  # CPU composite: float mask


def test_no_python_modes_and_loader_iter():
    mode = priv.new_fake_mode()
    with mode:
        with priv.no_python_modes():
            assert not priv.is_fake(torch.ones(2))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(4)), batch_size=2)
    assert len(list(priv.single_process_loader_iter(loader))) == 2


def test_fake_tensor_device_property_exists():
    # the simulation patches FakeTensor.device (a Python property) during a run
    assert isinstance(priv.FakeTensor.__dict__["device"], property)


def test_mkldnn_rnn_layer_signature():
    # the workspace fix reads hidden_size (10) and train (15) by position
    args = [a.name for a in torch.ops.aten.mkldnn_rnn_layer.default._schema.arguments]
    assert args[10] == "hidden_size" and args[15] == "train"


def test_fake_mode_deepcopy_is_patchable():
    # the simulation sets FakeTensorMode.__deepcopy__ for a run and deletes it afterwards:
    # torch must not define its own (if it does, the copied-mode crash may be fixed upstream)
    assert "__deepcopy__" not in priv.FakeTensorMode.__dict__
    mode = priv.new_fake_mode()
    assert priv.fake_mode_deepcopy(mode, {}) is mode
