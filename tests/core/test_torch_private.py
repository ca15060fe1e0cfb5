"""Each private torch API memmagic relies on still behaves as assumed."""
from __future__ import annotations

import pytest
import torch

from memmagic.core import _torch_private as priv


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
    with priv.TorchDispatchMode():
        assert priv.dispatch_mode_depth() == 1
    assert priv.function_mode_enabled() is False


def test_saved_tensors_hooks_lifted_only_when_ours_are_the_only_ones():
    def pack(t):
        return t

    def unpack(t):
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        with priv.saved_tensors_hooks_lifted(pack):
            assert priv.saved_tensors_hooks_top() is None
            with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
                pass
        assert priv.saved_tensors_hooks_top() is not None
        with priv.saved_tensors_hooks_lifted(unpack):  # not ours: nothing changes
            assert priv.saved_tensors_hooks_top() is not None
    with torch.autograd.graph.save_on_cpu():
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            with priv.saved_tensors_hooks_lifted(pack):  # the user's below: kept as they are
                assert priv.saved_tensors_hooks_top()[0] == pack
    assert priv.saved_tensors_hooks_top() is None


def test_functorch_unwrapped_reaches_the_tensor_inside_vmap_and_grad():
    from torch.func import grad, vmap

    seen = []

    def inner(r):
        seen.append(priv.functorch_unwrapped(r))
        return r.sum()

    x = torch.randn(2, 3, 4)
    vmap(vmap(inner))(x)
    grad(inner)(torch.randn(3))
    assert seen[0] is x and tuple(seen[1].shape) == (3,)
    assert priv.functorch_unwrapped(x) is x


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


def test_torch_dispatch_mode_sees_ops_and_leaves_the_stack():
    seen = []

    class M(priv.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with M():
        torch.ones(2) + 1
    assert torch.ops.aten.add.Tensor in seen and priv.dispatch_mode_depth() == 0


def test_tracker_mode_keeps_its_subclasses_dispatch_unwrapped():
    """TorchDispatchMode wraps a subclass's __torch_dispatch__ in torch._disable_dynamo
    unless ``_should_skip_dynamo()`` is False: TrackerMode's subclasses keep the function
    they define, and still see every op."""
    seen = []

    def dispatch(self, func, types, args=(), kwargs=None):
        seen.append(func)
        return func(*args, **(kwargs or {}))

    Plain = type("Plain", (priv.TorchDispatchMode,), {"__torch_dispatch__": dispatch})
    Tracker = type("Tracker", (priv.TrackerMode,), {"__torch_dispatch__": dispatch})
    assert Plain.__dict__["__torch_dispatch__"] is not dispatch  # torch's wrapper
    assert Tracker.__dict__["__torch_dispatch__"] is dispatch
    with Tracker():
        torch.ones(2) + 1
    assert torch.ops.aten.add.Tensor in seen and priv.dispatch_mode_depth() == 0


def test_tensor_version_counts_in_place_writes_to_the_storage():
    a = torch.zeros(4)
    v = priv.tensor_version(a)
    a.add_(1)
    assert priv.tensor_version(a) == v + 1
    a[1:].mul_(2)  # through a view: the same counter
    assert priv.tensor_version(a) == v + 2
    a + 1  # out of place: unchanged
    assert priv.tensor_version(a) == v + 2


def test_op_schema():
    aten = torch.ops.aten
    assert priv.op_schema(aten.add_.Tensor).is_mutable
    s = priv.op_schema(aten.add.Tensor)
    assert not s.is_mutable and [a.name for a in s.arguments][:2] == ["self", "other"]
    assert len(s.returns) == 1
    assert priv.op_schema(torch.add) is None and priv.op_schema(aten.add) is None


def test_node_saved_values():
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    y = x * w
    saved = [v for v in priv.node_saved_values(y.grad_fn) if isinstance(v, torch.Tensor)]
    assert len(saved) == 2 and any(v is x for v in saved) and any(v is w for v in saved)
    s = x.sum(0, keepdim=True)
    plain = list(priv.node_saved_values(s.grad_fn))  # SumBackward1: dim, keepdim, sizes
    assert (0,) in plain and (3,) in plain and True in plain
    y.sum().backward()  # frees the saved tensors: reading them raises, they are skipped
    assert [v for v in priv.node_saved_values(y.grad_fn) if isinstance(v, torch.Tensor)] == []


def test_own_registries_are_live_and_not_recursive():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    assert list(priv.child_modules(net)) == ["0", "1"] and priv.own_parameters(net) == {}
    bn = net[1]
    assert set(priv.own_parameters(bn)) == {"weight", "bias"}
    assert set(priv.own_buffers(bn)) == {"running_mean", "running_var", "num_batches_tracked"}
    bn.register_buffer("extra", None)
    assert priv.own_buffers(bn)["extra"] is None  # None entries are kept
    params = priv.own_parameters(bn)
    bn.scale = torch.nn.Parameter(torch.ones(1))
    assert "scale" in params  # the live dict


def test_compiled_inner():
    m = torch.nn.Linear(2, 2)
    compiled = torch.compile(m)
    assert priv.compiled_inner(compiled) is m
    assert priv.compiled_inner(m) is None


def test_dynamo_stance_callback_slot_is_asked_once_per_compiled_call():
    slot = priv.dynamo_stance_callback_slot()
    assert slot is not None
    module, name = slot
    original = getattr(module, name)
    asked = []

    def counting(callback):
        asked.append(callback)
        return original(callback)

    f = torch.compile(lambda x: x + 1)
    setattr(module, name, counting)
    try:
        with torch.compiler.set_stance("force_eager"):
            for _ in range(3):
                f(torch.ones(1))
    finally:
        setattr(module, name, original)
    assert len([c for c in asked if c is not None and c is not False]) == 3


def test_cuda_memory_history_signatures():
    """CPU check of the arguments memmagic passes (the GPU check runs where there is one)."""
    import inspect

    inspect.signature(torch.cuda.memory._record_memory_history).bind(
        "all", context=None, stacks="python", max_entries=10, device=0, clear_history=True)
    inspect.signature(torch.cuda.memory._record_memory_history).bind(None, device=0)
    inspect.signature(torch.cuda.memory._snapshot).bind(0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_memory_history_records_alloc_and_free():
    priv.record_memory_history("all", stacks="python", max_entries=1000, device=0, clear_history=True)
    try:
        x = torch.empty(1 << 20, device="cuda")
        del x
        traces = priv.memory_snapshot(0)["device_traces"][0]
    finally:
        priv.record_memory_history(None, device=0)
    actions = [e["action"] for e in traces if int(e["size"]) >= 4 << 20]
    assert "alloc" in actions and "free_requested" in actions


def test_version_error_style_is_this_torchs():
    """The in-place error names the node as this torch's autograd does (torch 2.13: the
    forward op, "output 0 of Sigmoid"; torch 2.11 on the GPU check: "SigmoidBackward0")."""
    x = torch.ones(1, requires_grad=True)
    h = x.sigmoid()
    h.mul_(2)
    with pytest.raises(RuntimeError) as info:
        h.sum().backward()
    assert priv.version_error_names_forward_op() == ("SigmoidBackward" not in str(info.value))


def test_zipfile_writer_slot_opens_every_path_torch_save_writes(tmp_path):
    """torch.save hands a path to the class in the slot, also when called as a function
    bound before (transformers' save_function=torch.save default)."""
    from memmagic.core.patching import Patches

    module, name = priv.zipfile_writer_slot()
    original, seen = getattr(module, name), []
    save = torch.save
    patches = Patches()
    patches.set(module, name, lambda f: seen.append(f) or original(f))
    try:
        save({"step": 1}, tmp_path / "a.pt")
    finally:
        patches.restore()
    assert [str(f) for f in seen] == [str(tmp_path / "a.pt")]
    assert torch.load(tmp_path / "a.pt") == {"step": 1}


def test_module_call_slot_is_what_a_call_runs_and_reads_forward_after_the_hooks():
    """The repeats of a simulation (backends/sim/repeats.py) replace ``_call_impl`` and swap
    the outermost module's ``forward`` for one call: the global hooks still see that call."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    cls, slot = priv.module_call_slot()
    m = torch.nn.Linear(2, 2)
    original, seen = getattr(cls, slot), []

    def wrapped(module, *args, **kwargs):
        seen.append(("call", type(module).__name__))
        return original(module, *args, **kwargs)

    handle = register_module_forward_pre_hook(lambda mod, args: seen.append(("hook", None)))
    setattr(cls, slot, wrapped)
    try:
        m.forward = lambda x: "swapped"
        assert m(torch.zeros(2)) == "swapped"
    finally:
        setattr(cls, slot, original)
        handle.remove()
        del m.forward
    assert seen == [("call", "Linear"), ("hook", None)]
    assert m(torch.zeros(2)).shape == (2,)


def test_has_forward_hooks_sees_the_modules_own_hooks_only():
    m = torch.nn.Linear(2, 2)
    assert not priv.has_forward_hooks(m)
    h = m.register_forward_pre_hook(lambda mod, args: None)
    assert priv.has_forward_hooks(m)
    h.remove()
    h = m.register_forward_hook(lambda mod, args, out: None)
    assert priv.has_forward_hooks(m)
    h.remove()
    assert not priv.has_forward_hooks(m)


def test_tree_flatten_round_trips_nested_outputs():
    t = torch.zeros(2)
    leaves, spec = priv.tree_flatten(((t, None), {"a": 1.5, "b": [t]}))
    assert leaves[0] is t and leaves[1] is None and len(leaves) == 4
    again = priv.tree_unflatten(leaves, spec)
    assert again[0][0] is t and again[1]["b"][0] is t and again[1]["a"] == 1.5
    transformers = pytest.importorskip("transformers")
    out = transformers.modeling_outputs.CausalLMOutput(loss=t, logits=t)
    leaves, spec = priv.tree_flatten(out)
    assert [x is t for x in leaves] == [True, True]
    assert type(priv.tree_unflatten(leaves, spec)) is type(out)


def test_dispatch_plumbing_files_stand_between_an_op_and_a_dispatch_mode():
    """An op called from Python reaches a dispatch mode's ``__torch_dispatch__`` through
    frames of these files only (the simulation tells torch's C++ code from Python by them)."""
    import os
    import sys

    files = priv.dispatch_plumbing_files()
    assert files and all(os.path.isfile(f) for f in files)
    seen: list[list[str]] = []

    class Mode(priv.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            f, names = sys._getframe(1), []
            while f is not None and f.f_code is not caller:
                names.append(os.path.abspath(f.f_code.co_filename))
                f = f.f_back
            seen.append(names)
            return func(*args, **(kwargs or {}))

    def call():
        return torch.ops.aten.add.Tensor(torch.ones(2), torch.ones(2))

    caller = call.__code__
    x = torch.ones(2)
    with Mode():
        call()
    assert seen and all(name in files for name in seen[-1]), (seen[-1], files)
