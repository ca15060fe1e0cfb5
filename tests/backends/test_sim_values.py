"""Values a simulation can know: what follows from shapes, literals and constants is real.

A GPU program reads values (a loop bound, a mask, ``.tolist()`` of an index range): where
they do not depend on data, the simulated run must take the path the GPU run takes.
"""

from __future__ import annotations

import copy
import textwrap

import torch

from memmagic.core import _torch_private as priv
from memmagic.backends.sim.constants import CONSTANT_NUMEL, INDEX_NUMEL
from test_sim import Recorder, run


def test_factories_carry_their_values():
    seen = {}
    out, _ = run("""
        import torch
        seen["lin"] = torch.linspace(0, 1, 5, device="cuda").tolist()
        seen["eye"] = torch.eye(3, device="cuda").sum().item()
        seen["full"] = torch.full((2, 2), 7, device="cuda").numpy().tolist()
        seen["tri"] = torch.triu_indices(3, 3, device="cuda").shape
        seen["causal"] = torch.ones(4, 4, device="cuda").tril().bool()[1].tolist()
        seen["lit"] = torch.tensor([3, 1, 2], device="cuda").sort().values.tolist()
    """, {"seen": Recorder(seen)})
    assert out.error is None, out.error
    assert seen["lin"] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert seen["eye"] == 3.0
    assert seen["full"] == [[7, 7], [7, 7]]
    assert seen["tri"] == (2, 6)
    assert seen["causal"] == [True, True, False, False]
    assert seen["lit"] == [1, 2, 3]
    assert "depend on data were read" not in " ".join(out.report.notes)   # no placeholder was read


def test_control_flow_on_constants_takes_the_gpu_path():
    seen = {}
    out, _ = run("""
        import torch
        n = torch.tensor(10, device="cuda")
        steps = 0
        while n > 0:          # a GPU run stops after 10 steps; a placeholder would loop
            n -= 3
            steps += 1
        seen["steps"] = steps
        x = torch.arange(12, device="cuda").view(3, 4)
        seen["branch"] = "big" if x.max() > 10 else "small"
    """, {"seen": Recorder(seen)}, max_ops=5_000)
    assert out.error is None, out.error
    assert seen["steps"] == 4 and seen["branch"] == "big"


def test_host_indices_drawn_for_real_slice_numpy_data_as_on_a_gpu():
    # nanoGPT's get_batch: for each index drawn on the host, a slice of a numpy array made a
    # tensor; the index arithmetic and the lift of each slice keep their values
    seen = {}
    out, _ = run("""
        import numpy as np
        import torch
        data = np.arange(1000, dtype=np.uint16)
        ix = torch.tensor([3, 500, 990])
        x = torch.stack([torch.from_numpy(data[i:i + 8].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + 8].astype(np.int64)) for i in ix])
        seen["x"], seen["y"] = x[:, 0].tolist(), (y - x).unique().tolist()
        seen["ends"] = [int(i + 8) for i in ix]
        x, y = x.to("cuda"), y.to("cuda")
    """, {"seen": Recorder(seen)})
    assert out.error is None, out.error
    assert seen == {"x": [3, 500, 990], "y": [1], "ends": [11, 508, 998]}
    assert "depend on data were read" not in " ".join(out.report.notes)


def test_data_dependent_values_stay_placeholders():
    seen = {}
    out, _ = run("""
        import torch
        r = torch.randn(3, device="cuda")
        seen["r"] = r.tolist()
        seen["mix"] = (torch.arange(3, device="cuda") + r).tolist()   # a constant meets data
        big = torch.arange(%d, device="cuda")                          # too big to carry
        seen["big"] = big[-1].item()
    """ % (INDEX_NUMEL + 1), {"seen": Recorder(seen)})
    assert out.error is None, out.error
    assert seen["r"] == [1.0, 1.0, 1.0] and seen["mix"] == [1.0, 1.0, 1.0]
    assert seen["big"] == 0
    notes = " ".join(out.report.notes)
    assert "depend on data were read" in notes


def test_a_tensor_made_from_a_placeholder_reads_as_a_placeholder():
    """nanoGPT's estimate_loss stores ``loss.item()`` in a tensor and logs its mean: the
    numbers a run reads back from such a tensor are marked too, never the placeholder's 1.0
    passed off as a result; a tensor of real constants keeps its values."""
    seen = {}
    out, _ = run("""
        import torch
        loss = torch.randn(4, device="cuda").sum()
        losses = torch.zeros(3)
        for k in range(3):
            losses[k] = loss.item()
        seen["mean"] = f"{losses.mean():.4f}"
        seen["made"] = torch.tensor([loss.item(), 2.0]).sum().item()
        total = torch.zeros(())
        total += loss.item()
        seen["added"] = repr(total.item())
        seen["scaled"] = repr((torch.ones(2) * loss.item()).sum().item())
        seen["real"] = torch.arange(4).sum().item()
    """, {"seen": Recorder(seen)})
    assert out.error is None, out.error
    assert seen["mean"] == "1.0000(simulated)"
    assert repr(seen["made"]).endswith("(simulated)")
    assert seen["added"].endswith("(simulated)") and seen["scaled"].endswith("(simulated)")
    assert seen["real"] == 6 and not repr(seen["real"]).endswith("(simulated)")


def test_memory_is_the_same_with_values():
    # carrying a value never changes what the GPU would hold
    src = """
        import torch
        a = torch.arange(1000, device="cuda", dtype=torch.float32)
        m = torch.ones(64, 64, device="cuda").triu(1).bool()
        b = a * 2
        del a
    """
    out, _ = run(src)
    assert out.error is None, out.error
    # 1000 fp32 = 4000 B -> 4096 B blocks; 64*64 fp32 ones (16 KiB) freed after triu; bool 4096 B
    assert out.report.retained == 4096 + 4096


def test_deepcopy_of_a_constant_is_a_constant():
    seen = {}
    out, _ = run("""
        import copy, torch
        t = torch.arange(4, device="cuda")
        t.tag = "mine"
        c = copy.deepcopy(t)
        seen["c"] = (c.tolist(), c.tag, c is t, c.is_cuda)
        m = torch.nn.BatchNorm1d(3).cuda()     # num_batches_tracked is a constant
        m2 = copy.deepcopy(m)
        seen["nbt"] = m2.num_batches_tracked.item()
    """, {"seen": Recorder(seen)})
    assert out.error is None, out.error
    assert seen["c"] == ([0, 1, 2, 3], "mine", False, True)
    assert seen["nbt"] == 0


def test_the_constant_limit_is_restored():
    holder = priv.constant_numel_limit_holder()
    before = getattr(*holder)
    seen = {}
    out, _ = run("""
        seen["limit"] = limit()
    """, {"seen": Recorder(seen), "limit": lambda: getattr(*holder)})
    assert out.error is None, out.error
    assert seen["limit"] == INDEX_NUMEL
    assert getattr(*holder) == before


def test_positions_and_masks_keep_their_values_at_long_contexts_floats_only_when_small():
    """transformers decides whether attention needs a mask from the position ids (a diff
    and a cumsum over batch x context, then ``.all()``): integer and bool values keep their
    values up to INDEX_NUMEL elements, floats (an optimizer's zero-filled moments) only up
    to CONSTANT_NUMEL (computing them for real would cost every step)."""
    seen = {}
    cls, name = priv.may_turn_const_holder()
    before = getattr(cls, name)
    out, _ = run("""
        import torch
        pos = torch.arange(4096, device="cuda").expand(16, 4096)       # 65536 positions
        d = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1)
        packed = (d != 1).cumsum(-1)
        seen["no packing"] = bool((packed[:, -1] == 0).all())
        seen["ones"] = bool(torch.ones(16, 4096, dtype=torch.long, device="cuda").all())
        w = torch.zeros(CONSTANT_NUMEL + 1, device="cuda")
        seen["float"] = w.sum().item()
    """.replace("CONSTANT_NUMEL", str(CONSTANT_NUMEL)), {"seen": Recorder(seen)})
    assert out.error is None, out.error
    assert seen["no packing"] is True and seen["ones"] is True
    assert seen["float"] == 1.0  # a placeholder: a float tensor that large carries no values
    assert getattr(cls, name) is before


def test_constant_fake_contract(monkeypatch):
    mode = priv.new_fake_mode()
    with mode:
        like = torch.empty(3)
    fake = priv.constant_fake(mode, torch.tensor([1.0, 2.0, 3.0]), like.fake_device)
    assert priv.is_fake(fake) and fake.fake_mode is mode
    assert priv.fake_constant(fake).tolist() == [1.0, 2.0, 3.0]
    module, name = priv.constant_numel_limit_holder()
    assert isinstance(getattr(module, name), int)
    with mode:
        assert priv.fake_constant(fake * 2) is None    # over torch's default limit (1)
    monkeypatch.setattr(module, name, 8)
    with mode:
        doubled = fake * 2
    assert priv.fake_constant(doubled).tolist() == [2.0, 4.0, 6.0]
    assert copy.copy(priv.fake_constant(fake)).dtype == torch.float32


def test_placeholders_print_as_placeholders_and_the_note_names_lines():
    seen = {}
    out, _ = run("""
        import torch
        model = torch.nn.Linear(8, 2).cuda()
        total = 0.0
        for i in range(6):
            loss = model(torch.randn(4, 8, device="cuda")).pow(2).mean()
            total += loss.item()
        seen["text"] = f"loss {loss.item():.4f}"
        seen["total"] = repr(total)
        seen["int"] = str(model(torch.randn(4, 8, device="cuda")).argmax().item())
        seen["draw"] = torch.randint(0, 9, (), device="cuda").item()  # drawn for real
        seen["real"] = repr(torch.arange(3, device="cuda").sum().item())
    """, {"seen": Recorder(seen)})
    assert out.error is None, out.error
    assert seen["text"] == "loss 1.0000(simulated)"
    assert seen["total"] == "6.0(simulated)"      # arithmetic keeps the mark
    assert seen["int"] == "0(simulated)"
    assert type(seen["draw"]) is int and 0 <= seen["draw"] < 9  # random indices are real
    assert seen["real"] == "3"                    # a value the simulation has is plain
    note = next(n for n in out.report.notes if "depend on data were read" in n)
    # lines of the cell, not internal reads: three lines read placeholders
    assert note.count("line ") == 3 and "line 7 (item)" in note


def test_values_a_known_operand_decides_and_fills_and_real_small_tensors():
    seen = {}
    host = torch.ones(2, 16, dtype=torch.long)     # a tokenizer's mask from a real cell
    out, ns = run("""
        import torch
        ids = torch.randint(0, 128, (2, 16), device="cuda")
        seen["fills"] = (torch.ones_like(ids).all().item(), torch.zeros_like(ids).any().item(),
                         torch.full_like(ids, 3).max().item(), ids.new_zeros(2).tolist())
        # (random indices are drawn for real: data is what a model computes)
        hit = torch.nn.Linear(16, 2).cuda()(ids.float()) > 5
        done = torch.full((2,), True, device="cuda") | hit[:, 0]   # True | data
        none = torch.zeros(2, dtype=torch.bool, device="cuda") & hit[:, 0]
        seen["decided"] = (done.all().item(), none.any().item())
        seen["mixed"] = (hit[:, 0] | hit[:, 1]).tolist()   # data | data: unknown
        seen["host"] = host.to("cuda").all().item()
        host.zero_()                                  # the cell's copy, not the real tensor
    """, {"seen": Recorder(seen), "host": host})
    assert out.error is None, out.error
    assert seen["fills"] == (True, False, 3, [0, 0])
    assert seen["decided"] == (True, False)
    assert seen["mixed"] == [False, False]            # placeholders
    assert seen["host"] is True and int(host.sum()) == 32


def test_values_written_from_unknown_data_are_forgotten():
    """A small buffer that starts as a known constant (Adam's zero moments, BatchNorm's
    running stats) holds data-dependent values once an op writes data into it: reading it
    gives a placeholder, as on a GPU it gives numbers the simulation cannot know, on every
    run (also when the op cache or FakeTensorMode's own cache answers)."""
    for _ in range(2):  # cold, then warm caches
        seen = {}
        out, _ = run("""
            import torch, torch.nn as nn
            model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).cuda()
            opt = torch.optim.Adam(model.parameters())
            loss = model(torch.randn(4, 8, device="cuda")).square().mean()
            loss.backward()
            opt.step()
            bias = model[0].bias
            seen["moment"] = opt.state[bias]["exp_avg_sq"].sum().item()
            seen["steps"] = opt.state[bias]["step"].item()   # written from constants only
            seen["mean"] = model[1].running_mean.sum().item()
            seen["tracked"] = model[1].num_batches_tracked.item()
        """, {"seen": Recorder(seen)})
        assert out.error is None, out.error
        assert type(seen["moment"]).__name__ == "SimulatedFloat"
        assert type(seen["mean"]).__name__ == "SimulatedFloat"
        assert seen["steps"] == 1.0 and type(seen["steps"]) is float
        assert seen["tracked"] == 1 and type(seen["tracked"]) is int


def test_a_constant_follows_data_assignment():
    """``module.to("cuda", torch.bfloat16)`` swaps each CPU parameter's data (``p.data =
    new``): the parameter then holds the new values and dtype. A parameter made from a
    constant (``torch.ones``, an RMSNorm weight) kept its float32 constant, so ops on it
    alone came out float32: a checkpointed transformers Llama failed its recompute check
    ("Recomputed values ... have different metadata")."""
    seen = {}
    out, _ = run("""
        import torch, torch.nn as nn
        from torch.utils.checkpoint import checkpoint
        class Norm(nn.Module):
            def __init__(self):
                super().__init__()
                self.weight = nn.Parameter(torch.ones(64))
            def forward(self, h):
                return self.weight * h
        norm = Norm().to("cuda", dtype=torch.bfloat16)
        seen["detached"] = norm.weight.detach().dtype
        seen["sum"] = norm.weight.sum().item()       # still known: 64 ones
        x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        checkpoint(norm, x, use_reentrant=False).sum().backward()
        w = torch.zeros(8)
        w.data = torch.randn(8)                      # unknown values now
        seen["unknown"] = w.sum().item()
    """, {"seen": Recorder(seen)})
    assert out.error is None, out.error
    assert seen["detached"] == torch.bfloat16
    assert seen["sum"] == 64.0 and type(seen["sum"]) is float
    assert type(seen["unknown"]).__name__ == "SimulatedFloat"


def test_adopt_constant_contract():
    mode = priv.new_fake_mode()
    with mode:
        c = torch.empty(4)  # no values
    a = priv.constant_fake(mode, torch.ones(4), c.fake_device)
    b = priv.constant_fake(mode, torch.zeros(4, dtype=torch.bfloat16), c.fake_device)
    a_const = priv.fake_constant(a)
    assert a_const is not None and priv.fake_constant(b) is not None
    priv.adopt_constant(a, b)
    assert priv.fake_constant(a) is priv.fake_constant(b)
    priv.adopt_constant(a, c)  # no values: none kept
    assert priv.fake_constant(a) is None


def test_one_random_draw_decides_a_path_for_real_and_gpu_draws_leave_the_host_generator():
    """``torch.rand(1) > p`` (peft's LoHa adapters, LayerDrop) is drawn for real: a
    placeholder (False) would skip the adapter a GPU run adds. A draw on the GPU takes the
    simulation's own generator, so the host's draws that follow are the GPU run's."""
    seen = {}
    out, _ = run("""
        import torch
        torch.manual_seed(0)
        seen["add"] = bool(torch.rand(1, device="cuda") > 0.0)
        seen["scalar"] = 0.0 <= torch.rand([], device="cuda").item() < 1.0
        i = torch.randint(0, 10, (4,), device="cuda")
        seen["host"] = torch.randint(0, 100, (4,)).tolist()
    """, {"seen": Recorder(seen)})
    assert out.error is None, out.error
    assert seen["add"] is True and seen["scalar"] is True
    torch.manual_seed(0)
    assert seen["host"] == torch.randint(0, 100, (4,)).tolist()
    assert "depend on data were read" not in " ".join(out.report.notes)


def test_a_shuffled_loader_draws_the_gpu_runs_order_and_leaves_the_generator_as_it_would():
    """Every ``iter(DataLoader)`` draws its seed with ``torch.empty((), dtype=torch.int64)
    .random_()``, a shuffling sampler another: drawn for real from the host's generator, a
    loader that pads each batch to its longest sequence makes the GPU run's batches, and the
    draws after it (nanoGPT's ``randint`` batch indices) take the GPU run's values."""
    code = """
        import torch
        torch.manual_seed(0)
        rows = [list(range(n)) for n in (3, 40, 7, 25, 12, 60, 5, 33)]
        def pad(batch):
            t = max(len(r) for r in batch)
            return torch.tensor([r + [0] * (t - len(r)) for r in batch])
        loader = torch.utils.data.DataLoader(rows, batch_size=2, shuffle=True, collate_fn=pad)
        seen["shapes"] = [tuple(b.to(DEVICE).shape) for b in loader]
        seen["after"] = torch.randint(0, 1000, (3,)).tolist()
        seen["seed"] = torch.empty((), dtype=torch.int64).random_(generator=torch.Generator().manual_seed(1)).item()
    """
    real = {}
    exec(textwrap.dedent(code), {"seen": real, "DEVICE": "cpu"})
    seen = {}
    out, _ = run(code, {"seen": Recorder(seen), "DEVICE": "cuda"})
    assert out.error is None, out.error
    assert seen == real
    assert "depend on data were read" not in " ".join(out.report.notes)


def test_allclose_is_a_known_answer_or_taken_to_hold():
    """``torch.allclose`` of two computations (a tutorial's check that vmap gives what a
    loop does) is taken to hold, as on a GPU that runs the code as its author meant, said
    in the report; of values the simulation knows it is their answer. Its tensors are made
    on the way, as ATen's ``isclose(...).all()`` makes them."""
    seen = {}
    out, _ = run("""
        import torch
        x = torch.randn(64, 256, device="cuda")
        w = torch.randn(256, 256, device="cuda")
        assert torch.allclose(x @ w, torch.stack([r @ w for r in x]), atol=1e-4)
        seen["same"] = torch.allclose(x, x * 1.0)
        seen["known"] = (torch.allclose(torch.ones(3), torch.ones(3) * 2),
                         torch.allclose(torch.arange(4.0), torch.arange(4.0) + 1e-9))
    """, {"seen": Recorder(seen)})
    assert out.error is None, out.error
    assert seen == {"same": True, "known": (False, True)}
    read, = [n for n in out.report.notes if "depend on data were read" in n]
    assert read.count("(allclose, taken to hold)") == 2, read


def test_tensors_inside_torch_func_transforms_are_on_the_gpu_they_wrap():
    """Inside ``vmap``, ``grad`` and ``jvp`` a tensor is torch.func's wrapper: its device is
    the wrapped tensor's, the simulated GPU, so a tensor made on ``output.device`` there
    (pytorch/tutorials' neural_tangent_kernels: ``torch.eye(..., device=output.device)``
    under a vmap of a vmap, with vjp and jvp) is on the GPU too, and the NTK is computed."""
    seen = {}
    out, _ = run("""
        import torch
        from torch.func import functional_call, jvp, vjp, vmap
        net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).cuda()
        params = {k: v.detach() for k, v in net.named_parameters()}
        def f(p, x):
            return functional_call(net, p, (x.unsqueeze(0),)).squeeze(0)
        def ntk(x1, x2):
            out, vjp_fn = vjp(lambda p: f(p, x1), params)
            seen["inside"] = (str(out.device), out.is_cuda)
            basis = torch.eye(out.numel(), dtype=out.dtype, device=out.device)
            return vmap(lambda v: jvp(lambda p: f(p, x2), (params,), vjp_fn(v))[1])(basis)
        k = vmap(vmap(ntk, (None, 0)), (0, None))(torch.randn(2, 6, device="cuda"),
                                                   torch.randn(3, 6, device="cuda"))
        seen["ntk"] = (tuple(k.shape), str(k.device))
    """, {"seen": Recorder(seen)})
    assert out.error is None, out.error
    assert seen == {"inside": ("cuda:0", True), "ntk": ((2, 3, 3, 3), "cuda:0")}


def test_control_flow_operators_run_on_the_simulated_gpu():
    """``torch.cond``, ``scan`` and ``map`` (higher-order operators, pytorch/tutorials'
    torch_controlflow) stopped with torch's "no rule registered for HigherOrderOperator":
    they run as one op, their outputs on the simulated GPU and tracked."""
    seen = {}
    out, _ = run("""
        import torch
        from torch._higher_order_ops.map import map as hop_map
        from torch._higher_order_ops.scan import scan
        x = torch.randn(256, 1024, device="cuda")
        y = torch.cond(x.sum() > 0, lambda t: t.cos(), lambda t: t.sin(), (x,))
        c, ys = scan(lambda c, v: (c + v, c * 2), x[0], x, dim=0)
        m = hop_map(lambda v: v * 2, x)
        seen["out"] = [(tuple(t.shape), str(t.device)) for t in (y, c, ys, m)]
    """, {"seen": Recorder(seen)})
    assert out.error is None, out.error
    assert seen["out"] == [((256, 1024), "cuda:0"), ((1024,), "cuda:0"),
                           ((256, 1024), "cuda:0"), ((256, 1024), "cuda:0")]
    assert out.report.after >= 4 << 20  # x, y, ys and m: 1 MiB each


def test_torch_testing_assert_close_takes_values_to_hold_and_checks_shapes():
    """``torch.testing.assert_close`` of two computations passes as on a GPU that runs the
    code as its author meant (its values read as True, noted), while its checks of what
    the simulation knows still fail: other shapes, a known mismatch."""
    seen = {}
    out, _ = run("""
        import torch
        a = torch.randn(64, 64, device="cuda")
        torch.testing.assert_close(a @ a, (a.T @ a.T).T)
        failed = []
        for b in (torch.randn(64, 32, device="cuda"), torch.zeros(2)):
            try:
                torch.testing.assert_close(a if b.shape[0] == 64 else torch.ones(2), b)
            except AssertionError as e:
                failed.append(str(e).splitlines()[0])
        seen["failed"] = failed
    """, {"seen": Recorder(seen)})
    assert out.error is None, out.error
    assert seen["failed"][0].startswith("The values for attribute 'shape' do not match")
    assert seen["failed"][1].startswith("Tensor-likes are not close")
    read, = [n for n in out.report.notes if "depend on data were read" in n]
    assert "(torch.testing.assert_close, taken to hold)" in read


def test_pinned_host_tensors_are_host_memory_and_say_so():
    """pytorch/tutorials' pinmem_nonblock makes ``torch.randn(..., pin_memory=True)``,
    which FakeTensorMode refuses: a pinned tensor is host memory, ``is_pinned()`` is True
    for it and its views (and after ``pin_memory()``), False for others; a copy to the GPU
    is the GPU's."""
    seen = {}
    out, _ = run("""
        import torch
        p = torch.randn(1 << 20, pin_memory=True)
        e = torch.empty(4, 4, pin_memory=True)
        q = torch.randn(8).pin_memory()
        seen["pinned"] = [t.is_pinned() for t in (p, p[10:], e, q, torch.randn(8))]
        g = p.to("cuda", non_blocking=True)
        seen["gpu"] = (str(g.device), g.is_pinned())
    """, {"seen": Recorder(seen)})
    assert out.error is None, out.error
    assert seen == {"pinned": [True, True, True, True, False], "gpu": ("cuda:0", False)}
    assert out.report.peak == 4 << 20 and out.report.host_peak >= (4 << 20) + 64


def test_a_datasets_shuffle_is_the_gpu_runs_whatever_its_size():
    """pytorch/examples' minGPT-ddp splits 55,641 samples with ``random_split`` and its
    DistributedSampler shuffles them with ``randperm(len(dataset)).tolist()``: a
    permutation is drawn for real past the 4,096 elements of other random ints (up to
    2**20), so the split and the shards are the GPU run's, no placeholder is read, and the
    draws after it are the GPU run's too."""
    code = """
        import torch
        from torch.utils.data import random_split
        torch.manual_seed(0)
        n = 55641
        train, test = random_split(range(n), [n - n // 10, n // 10])
        seen["split"] = (sorted(train.indices + test.indices) == list(range(n)),
                         train.indices[:8], test.indices[-8:])
        g = torch.Generator()
        g.manual_seed(3)
        seen["shard"] = torch.randperm(len(train), generator=g).tolist()[0::2][:8]
        seen["after"] = torch.randint(0, 1000, (3,)).tolist()
    """
    real = {}
    exec(textwrap.dedent(code), {"seen": real})
    seen = {}
    out, _ = run(code, {"seen": Recorder(seen)})
    assert out.error is None, out.error
    assert seen == real and seen["split"][0] is True
    assert "depend on data were read" not in " ".join(out.report.notes)


def test_samples_from_known_probabilities_are_drawn_as_on_a_gpu():
    """A temperature demo samples a softmax of literal logits a thousand times and counts
    the draws (``bincount``, whose size follows from the values): drawn for real from the
    host's generator, the counts are the GPU run's and the cell runs; samples from a
    model's probabilities stay data."""
    code = """
        import torch
        torch.manual_seed(123)
        probas = torch.softmax(torch.tensor([4.51, 0.89, -1.90, 6.75, 1.63]) / 0.5, dim=0)
        sample = [torch.multinomial(probas, num_samples=1).item() for _ in range(200)]
        seen["counts"] = torch.bincount(torch.tensor(sample), minlength=len(probas)).tolist()
        seen["after"] = torch.randint(0, 1000, (2,)).tolist()
    """
    real = {}
    exec(textwrap.dedent(code), {"seen": real})
    seen = {}
    out, _ = run(code + """
        model = torch.nn.Linear(4, 5).cuda()
        seen["model"] = torch.multinomial(model(torch.ones(1, 4, device="cuda")).softmax(-1), 1).item()
    """, {"seen": Recorder(seen)})
    assert out.error is None, out.error
    assert seen["counts"] == real["counts"] and seen["after"] == real["after"]
    assert seen["model"] == 0 and "depend on data were read" in " ".join(out.report.notes)


def test_a_number_rounded_from_a_placeholder_keeps_its_mark():
    """A throughput log (``round(tokens / elapsed)`` with CUDA events' elapsed time, which a
    simulation does not have) prints marked, never as a measured rate."""
    seen = {}
    out, _ = run("""
        import math
        import torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(); end.record(); torch.cuda.synchronize()
        tps = 32768 / (start.elapsed_time(end) / 1000)
        seen["log"] = f"tok/sec: {round(tps)} {round(tps, 1)} {math.floor(tps)} {math.ceil(tps)}"
        seen["parts"] = divmod(tps, 7)
    """, {"seen": Recorder(seen)})
    assert out.error is None, out.error
    assert seen["log"] == ("tok/sec: 32768000(simulated) 32768000.0(simulated) "
                           "32768000(simulated) 32768000(simulated)")
    assert all("simulated" in repr(x) for x in seen["parts"])


def test_a_seeded_cell_draws_the_same_gpu_indices_at_every_run():
    """``torch.manual_seed`` seeds the GPU's generator too: random indices drawn on the
    simulated GPU after it are the same at every run of the cell (whatever ran between),
    as on a GPU; unseeded draws go on."""
    code = """
        import torch
        torch.manual_seed(7)
        seen["a"] = torch.randint(0, 10**6, (4,), device="cuda").tolist()
        torch.cuda.manual_seed(8)
        seen["b"] = torch.randint(0, 10**6, (4,), device="cuda").tolist()
        seen["c"] = torch.randint(0, 10**6, (4,), device="cuda").tolist()
    """
    first, again = {}, {}
    out, _ = run(code, {"seen": Recorder(first)})
    run("import torch\nx = torch.randint(0, 9, (8,), device='cuda')\n")
    run(code, {"seen": Recorder(again)})
    assert out.error is None, out.error
    assert first == again and first["b"] != first["c"]


def test_a_tensor_formats_as_torch_formats_it():
    """``f"{loss:.4f}"`` (nanoGPT's and build-nanogpt's logging): a 0-d tensor formats its
    value, a placeholder with its mark; ``f"{t}"`` prints as ``print(t)`` does."""
    seen = {}
    out, _ = run("""
        import torch
        model = torch.nn.Linear(8, 1).cuda()
        loss = model(torch.randn(4, 8, device="cuda")).pow(2).mean()
        three = torch.ones((), device="cuda") * 3
        seen["spec"] = f"{loss:.4f} {three:.2f} {three.long():>3d}"
        seen["plain"] = f"{loss} {three} {torch.ones(2, device='cuda')}"
        try:
            f"{torch.ones(2, device='cuda'):.2f}"
        except TypeError as exc:  # as torch: a spec on a tensor of several values
            seen["many"] = type(exc).__name__
    """, {"seen": Recorder(seen)})
    assert out.error is None, out.error
    assert seen["spec"] == "1.0000(simulated) 3.00   3"
    assert seen["plain"] == "1.0(simulated) 3.0 tensor([1., 1.], device='cuda:0')"
    assert seen["many"] == "TypeError"


def test_views_of_constants_in_inference_mode_are_what_torch_makes():
    """In inference mode a view of a normal tensor is a normal tensor and a view of an
    inference tensor an inference tensor (the op cache's views of constants failed there:
    'Cannot set version_counter for inference tensor')."""
    seen = {}
    out, _ = run("""
        import torch
        x = torch.randint(0, 100, (8, 32), device="cuda")
        with torch.inference_mode():
            v = x.view(-1)
            y = torch.arange(12, device="cuda")
            w = y.view(3, 4)
        seen["normal"] = (v.is_inference(), v[:3].tolist() == x.view(-1)[:3].tolist())
        seen["inference"] = (y.is_inference(), w.is_inference(), w[1].tolist())
    """, {"seen": Recorder(seen)})
    assert out.error is None, out.error
    assert seen["normal"] == (False, True)
    assert seen["inference"] == (True, True, [4, 5, 6, 7])


def test_inference_mode_keeps_the_values_a_gpu_run_decides_on():
    """In inference mode ``|``, ``&`` and ``bool()`` reach the dispatch level as their own
    composite ops (``__or__``, ``__and__``, ``is_nonzero``): a known operand still decides
    ``x | True``, and ``bool()`` of a tensor without values reads a placeholder instead of
    failing (transformers' stopping criteria under ``torch.inference_mode()``)."""
    seen = {}
    out, _ = run("""
        import torch
        with torch.inference_mode():
            unfinished = torch.ones(2, dtype=torch.long, device="cuda")
            tokens = torch.randn(2, 50, device="cuda").argmax(-1)       # no values
            done = torch.full((2,), True, dtype=torch.bool, device="cuda")
            eos = torch.isin(tokens, torch.tensor([0], device="cuda"))
            unfinished = unfinished & ~(done | eos)
            seen["stop"] = bool(unfinished.max() == 0)
            seen["unknown"] = bool(eos.any())
    """, {"seen": Recorder(seen)})
    assert out.error is None, out.error
    assert seen == {"stop": True, "unknown": False}


def test_inference_mode_simulates_what_no_grad_does():
    """In inference mode the autograd keys are off, so composite ops (linear, matmul,
    scaled_dot_product_attention, dropout) reach the simulation whole: they run as their
    parts and through the run's CUDA kernels, as under no_grad (same memory on a GPU)."""
    from memmagic.backends.sim import SimBackend

    reports = {}
    for ctx in ("torch.no_grad()", "torch.inference_mode()"):
        src = f"""
import torch, torch.nn as nn, torch.nn.functional as F
m = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Dropout(0.1), nn.Linear(2048, 512)).cuda()
x = torch.randn(64, 128, 512, device="cuda")
with {ctx}:
    y = m(x)
    q = x.view(64, 8, 128, 64)
    a = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    z = (y @ y.transpose(1, 2)).softmax(-1).sum()
"""
        out = SimBackend(gpu="T4").execute(lambda n: exec(src, n), {})
        assert out.error is None, out.error
        reports[ctx] = out.report
    a, b = reports.values()
    for field in ("peak", "reserved_peak", "after", "breakdown"):
        assert getattr(a, field) == getattr(b, field), field
    # (matmul's composite kernel reshapes with _unsafe_view where autograd is on)
    assert [op[0].replace("_unsafe_view", "view") for op in a.trace.ops] == \
        [op[0] for op in b.trace.ops]
    assert a.breakdown["workspaces"] > 0  # cuBLAS's, at the first matmul: in both
    assert [str(n) for n in a.notes if "scaled_dot" in str(n)] == \
        [str(n) for n in b.notes if "scaled_dot" in str(n)] != []


def test_the_test_of_an_assert_on_values_is_taken_to_hold():
    """A script's sanity checks on values (gpt-fast's quantize.py: ``assert
    torch.isnan(to_quant).sum() == 0``) hold on a GPU that runs it as meant; the placeholder
    of a bool read, False, failed them. The test of an ``assert`` (a tensor's truth, a call
    whose result it tests, ``assert not ...``) is taken to hold, with the read noted; a
    bool read anywhere else stays the placeholder, False, an assert inside a helper too.
    ``torch.equal`` (which raised "cannot be simulated") reads as CUDA's kernel does."""
    seen = {}
    out, _ = run("""
        import torch
        w = torch.randn(64, 64, device="cuda")
        assert torch.isnan(w).sum() == 0
        assert torch.equal(w, w.clone()), "a copy is equal"
        assert not torch.isinf(w).any()
        assert (w.abs() < 1e9).all(), f"out of range: {w.abs().max()}"
        seen["flag"] = bool((w > 0).all())
        seen["if"] = "taken" if torch.isnan(w).any() else "skipped"
        def check(t):
            return bool(t.isfinite().all())
        try:
            assert check(w)
        except AssertionError:
            seen["helper"] = "failed"
        # torch.equal as CUDA computes it: sizes, one view, constants, else a read
        seen["equal"] = [torch.equal(w, w[:2]), torch.equal(w, w),
                         torch.equal(torch.arange(3, device="cuda"), torch.arange(3, device="cuda")),
                         torch.equal(w, w + 1)]
    """, {"seen": Recorder(seen)})
    assert out.error is None, out.error
    assert seen == {"flag": False, "if": "skipped", "helper": "failed",
                    "equal": [False, True, True, False]}
    note = next(n for n in out.report.notes if "depend on data were read" in n)
    assert note.count("(the test of an assert, taken to hold)") == 4, note
