"""Each private torch API memmagic relies on still behaves as assumed."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memmagic import _torch_private as priv


def test_in_backward():
    seen = []

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(priv.in_backward())
            return x * 1

        @staticmethod
        def backward(ctx, g):
            seen.append(priv.in_backward())
            return g
    F.apply(torch.ones(1, requires_grad=True)).sum().backward()
    assert seen == [False, True]


def test_dispatch_depth_and_function_mode():
    assert priv.dispatch_mode_depth() == 0
    with TorchDispatchMode():
        assert priv.dispatch_mode_depth() == 1
    assert priv.function_mode_enabled() is False


def test_saved_tensors_hooks_top():
    assert priv.saved_tensors_hooks_top() is None
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert priv.saved_tensors_hooks_top() is not None
    assert priv.saved_tensors_hooks_top() is None


def test_global_hook_counts():
    before = priv.global_module_hook_counts()
    h = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, a: None)
    assert priv.global_module_hook_counts()["_global_forward_pre_hooks"] == before["_global_forward_pre_hooks"] + 1
    h.remove()
    assert priv.global_module_hook_counts() == before
    assert set(priv.global_optimizer_hook_counts()) == {"pre", "post"}


def test_storage_key_is_shared_by_views_and_weakref_fires_on_free():
    import weakref

    a = torch.ones(10)
    assert priv.storage_key(a.untyped_storage()) == priv.storage_key(a[2:].untyped_storage())
    fired = []
    weakref.ref(a.untyped_storage(), lambda r: fired.append(1))
    ref = weakref.ref(a.untyped_storage(), lambda r: fired.append(1))
    del a
    assert fired and ref() is None
