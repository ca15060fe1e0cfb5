from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from memmagic.core.tracking import StorageTracker, Tracking, scan_existing
from memmagic.report import Category


def on_cpu(t):
    return "device" if t.device.type == "cpu" else None


def test_views_share_one_storage():
    with Tracking(on_cpu, seed=False) as tr:
        a = torch.ones(1000)
        b = a.view(10, 100)[1:3]
        c = a.t() if a.dim() == 2 else a[::2]
    assert tr.result.after == 4000
    del a, b, c


def test_frees_are_seen():
    with Tracking(on_cpu, seed=False) as tr:
        a = torch.ones(1000)
        del a
        b = torch.ones(10)
    assert tr.result.peak == 4000 and tr.result.after == 40
    del b


def test_rounding_is_applied_per_storage():
    with Tracking(on_cpu, lambda n: -(-n // 512) * 512, seed=False) as tr:
        a = torch.ones(3)  # 12 bytes -> 512
        b = torch.ones(200)  # 800 -> 1024
    assert tr.result.after == 512 + 1024
    del a, b


def test_resize_is_seen():
    with Tracking(on_cpu, seed=False) as tr:
        a = torch.empty(0)
        torch.ones(100, out=a)
    assert tr.result.after == 400
    del a


def test_checkpoint_keeps_fewer_activations():
    lin = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    x = torch.randn(1024, 256, requires_grad=True)

    def run(ck):
        lin.zero_grad(set_to_none=True)
        x.grad = None
        with Tracking(on_cpu) as tr:
            y = checkpoint(lin, x, use_reentrant=False) if ck else lin(x)
            y.sum().backward()
        return tr.result
    plain, ck = run(False), run(True)
    assert ck.peak - ck.before < plain.peak - plain.before
    assert ck.breakdown["activations"] < plain.breakdown["activations"]


def test_torch_func_transforms_run_while_tracked(clean_state):
    """torch.func's grad, vjp, jacrev and hessian refuse to run under any saved-tensor
    hooks (pytorch/tutorials' per_sample_grads and neural_tangent_kernels stopped there):
    the tracker's are lifted while one runs, where they are the only ones, and autograd's
    saved tensors are tracked again after it; the user's own hooks still refuse it, as
    without memmagic; torch's function is its own again after."""
    from torch.func import functional_call, grad, vmap

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(16, 32)

    def loss(p, xi):
        return functional_call(model, p, (xi.unsqueeze(0),)).sum()

    original = torch.autograd.graph.disable_saved_tensors_hooks
    with Tracking(on_cpu) as tr:
        per_sample = vmap(grad(loss), in_dims=(None, 0))(params, x)
        model(torch.randn(8192, 32)).sum().backward()  # autograd's saved tensors, tracked
    assert per_sample["0.weight"].shape == (16, 64, 32)
    assert torch.allclose(per_sample["0.weight"],
                          vmap(grad(loss), in_dims=(None, 0))(params, x)["0.weight"])
    assert tr.result.breakdown["activations"] >= 8192 * 64 * 4
    with Tracking(on_cpu), torch.autograd.graph.save_on_cpu():
        with pytest.raises(RuntimeError, match="saved tensor hooks"):
            grad(loss)(params, x[0])
    assert torch.autograd.graph.disable_saved_tensors_hooks is original


def test_control_flow_operators_run_as_without_tracking(clean_state):
    """torch.cond, while_loop, scan and map are higher-order operators, which a dispatch
    mode must let through (torch stopped each with "no rule registered for
    HigherOrderOperator ... StorageTracker"): they give what they give without memmagic,
    and what they return is tracked."""
    from torch._higher_order_ops.map import map as hop_map
    from torch._higher_order_ops.scan import scan
    from torch._higher_order_ops.while_loop import while_loop

    x = torch.randn(64, 256)

    def program():
        return (torch.cond(x.sum() > 0, lambda t: t.cos(), lambda t: t.sin(), (x,)),
                while_loop(lambda i, s: i < 5, lambda i, s: (i + 1, s + x), (torch.tensor(0), x))[1],
                scan(lambda c, v: (c + v, c * 2), x[0], x, dim=0)[1], hop_map(lambda v: v * 2, x))

    plain = program()
    with Tracking(on_cpu) as tr:
        got = program()
    assert all(torch.equal(a, b) for a, b in zip(plain, got))
    assert tr.result.after >= 4 * 64 * 256 * 4
    del got


def test_scan_finds_params_grads_buffers_optimizer_state():
    m = torch.nn.BatchNorm1d(4)
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    found = {}
    for t, cat in scan_existing():
        found.setdefault(cat, set()).add(t.untyped_storage()._cdata)
    assert m.weight.untyped_storage()._cdata in found[Category.PARAMETERS]
    assert m.weight.grad.untyped_storage()._cdata in found[Category.GRADIENTS]
    assert m.running_mean.untyped_storage()._cdata in found[Category.BUFFERS]
    assert opt.state[m.weight]["exp_avg"].untyped_storage()._cdata in found[Category.OPTIMIZER_STATE]


@pytest.mark.parametrize("exc", [ValueError, KeyboardInterrupt])
def test_tracking_restores_global_state_on_error(clean_state, exc):
    with pytest.raises(exc):
        with Tracking(on_cpu):
            m = torch.nn.Linear(3, 3)
            m(torch.ones(1, 3)).sum().backward()
            raise exc()


def test_breakdown_sums_to_peak():
    with Tracking(on_cpu) as tr:
        m = torch.nn.Linear(64, 64)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        m(torch.randn(8, 64)).relu().sum().backward()
        opt.step()
    assert sum(tr.result.breakdown.values()) == tr.result.peak


def test_timeline_reaches_the_peak():
    with Tracking(on_cpu, seed=False) as tr:
        a = torch.ones(1000)
        b = a * 2
        del a, b
    tl = tr.result.timeline
    assert max(v for _, v in tl) == tr.result.peak == 8000
    assert tl[-1][1] == 0


class Holder:
    def __init__(self, t):
        self.t = t
        self.more = {"nested": [t * 2]}


def _keys(found, cat=None):
    return {t.untyped_storage()._cdata for t, c in found if cat is None or c == cat}


def test_namespace_walk_finds_what_the_full_scan_finds():
    from memmagic.core.tracking import reachable_existing

    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(4, 8)).sum().backward()
    opt.step()
    x = torch.randn(4, 8, requires_grad=True)
    loss = torch.sigmoid(x).sum()  # sigmoid saves its output: only the graph holds it
    ns = {"m": m, "opt": opt, "loss": loss, "x": x, "h": Holder(torch.ones(3)),
          "batches": [(torch.zeros(2), torch.ones(2))], "torch": torch, "n": 3}
    walked = reachable_existing([ns])
    full = [(t, c) for t, c in scan_existing()]
    for cat in Category:
        assert _keys(walked, cat) <= _keys(full, cat), cat
    expect = {t.untyped_storage()._cdata for t in
              [*m.parameters(), *m.buffers(), *(p.grad for p in m.parameters()), x,
               ns["h"].t, ns["h"].more["nested"][0], *ns["batches"][0],
               *(v for s in opt.state.values() for v in s.values())]}
    assert expect <= _keys(walked)
    saved = _keys(walked, Category.ACTIVATIONS)
    assert len(saved) == 1 and saved <= _keys(full, Category.ACTIVATIONS)
    loss.backward()


def test_namespace_walk_gives_up_when_too_large():
    from memmagic.core.tracking import reachable_existing

    assert reachable_existing([{"xs": [[i] for i in range(100)]}], max_objects=50) is None


def test_namespace_walk_skips_the_shell():
    from memmagic.core.tracking import reachable_existing

    class FakeShell:  # anything from IPython is skipped by its module
        pass
    FakeShell.__module__ = "IPython.core.interactiveshell"
    sh = FakeShell()
    sh.secret = torch.ones(5)
    assert reachable_existing([{"get_ipython": sh}]) == []


def test_timeline_is_one_point_per_op_whatever_the_order_of_its_frees():
    from memmagic.core.tracking import StorageTracker

    def timeline(events):
        tr = StorageTracker(lambda t: "device")
        tr.pool_of = {1: "device", 2: "device", 3: "device", 4: "host"}
        tr.events = events  # (serial, delta bytes, op index)
        return tr.timeline()

    a = timeline([(1, 100, 1), (2, 50, 1), (3, 10, 2), (1, -100, 3), (2, -50, 3), (4, 999, 3)])
    b = timeline([(1, 100, 1), (2, 50, 1), (3, 10, 2), (2, -50, 3), (1, -100, 3), (4, 999, 3)])
    assert a == b == [(0, 0), (1, 150), (2, 160), (3, 10)]
    # an op that allocates and frees keeps its high-water mark before its end value
    assert timeline([(1, 100, 1), (1, -100, 1)]) == [(0, 0), (1, 100), (1, 0)]


def test_output_captured_keeps_what_is_printed_and_puts_the_streams_back_after_an_error():
    import sys

    import pytest

    from memmagic.core.patching import output_captured

    out, err = sys.stdout, sys.stderr
    with pytest.raises(KeyError):
        with output_captured() as printed:
            print("said in a re-run")
            print("warned", file=sys.stderr)
            raise KeyError("x")
    assert sys.stdout is out and sys.stderr is err
    assert printed.getvalue() == "said in a re-run\nwarned\n"
