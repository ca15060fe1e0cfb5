"""The simulated device raises where a GPU would: an op mixing CPU and CUDA tensors.

CUDA accepts a 0-dim CPU tensor (a "CPU scalar") in any op, and CPU index tensors in
indexing (``x[idx]``, ``x[idx] = v``); everything else that mixes the devices raises
``Expected all tensors to be on the same device``. The simulation must never raise where
a GPU would not: the second half of this file is cells that run on a GPU.
"""

from __future__ import annotations

import itertools
import linecache
import textwrap

import pytest

from memmagic import zoo
from memmagic.backends.sim import SimBackend, SimulatedDeviceMismatchError, SimulationError

CUDA_MESSAGE = "Expected all tensors to be on the same device, but found at least two devices"


def compile_cell(src: str):
    """Compile like IPython does: the source is in linecache, so tracebacks show lines."""
    src = textwrap.dedent(src)
    name = f"<cell-{abs(hash(src))}>"
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)
    return compile(src, name, "exec")


def run(src: str, **options):
    code = compile_cell(src)
    return SimBackend(**options).execute(lambda ns: exec(code, ns), {})


# -- cells that fail on a GPU -----------------------------------------------------------------
MISMATCHES = {
    "cpu input to a cuda model": ("""
        import torch
        model = torch.nn.Linear(8, 4).cuda()
        x = torch.randn(2, 8)
        y = model(x)
    """, "y = model(x)", "cuda:0 and cpu", "mat1"),
    "cpu operand first": ("""
        import torch
        w = torch.randn(8, 8, device="cuda")
        y = torch.randn(2, 8) @ w
    """, "y = torch.randn(2, 8) @ w", "cpu and cuda:0", "mat2"),
    "cpu targets": ("""
        import torch
        logits = torch.randn(4, 3, device="cuda", requires_grad=True)
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 2, 0]))
    """, "loss = ", "cuda:0 and cpu", "target"),
    "cpu positions into a cuda embedding": ("""
        import torch
        pos = torch.nn.Embedding(16, 8).cuda()
        p = pos(torch.arange(16))
    """, "p = pos(torch.arange(16))", "cuda:0 and cpu", "indices"),
    "cpu index for index_select": ("""
        import torch
        w = torch.randn(8, 8, device="cuda")
        rows = w.index_select(0, torch.tensor([1, 3]))
    """, "rows = ", "cuda:0 and cpu", "index"),
    "cat across devices": ("""
        import torch
        both = torch.cat([torch.ones(4, device="cuda"), torch.ones(4)])
    """, "both = ", "cuda:0 and cpu", "tensors"),
    "elementwise with a 1-element cpu tensor": ("""
        import torch
        x = torch.randn(4, device="cuda")
        y = x * torch.tensor([2.0])
    """, "y = x * ", "cuda:0 and cpu", "other"),
    "a tensor from an earlier cell": ("""
        model = torch.nn.Linear(8, 4).cuda()
        out = model(old_batch)
    """, "out = model(old_batch)", "cuda:0 and cpu", "mat1"),
}


@pytest.mark.parametrize("case", list(MISMATCHES), ids=list(MISMATCHES))
def test_mixing_devices_fails_as_on_a_gpu(case):
    import torch

    src, line, devices, argument = MISMATCHES[case]
    code = compile_cell(src)
    ns = {"torch": torch, "old_batch": torch.randn(2, 8)}
    out = SimBackend().execute(lambda n: exec(code, n), ns)
    err = out.error
    assert isinstance(err, SimulatedDeviceMismatchError), repr(err)
    assert isinstance(err, RuntimeError) and isinstance(err, SimulationError)
    msg = str(err)
    assert msg.startswith("line ") and line in msg, msg
    assert "would fail on a GPU: " + CUDA_MESSAGE in msg
    assert f"{devices}!" in msg and err.argument == argument
    assert "\n" not in msg and ".cuda()" in msg  # one line that says what to do
    assert out.report is not None and out.report.error  # the run still reports what it saw


def test_optimizer_state_left_on_the_cpu_fails():
    # an optimizer that stepped on the CPU keeps its state there when the model moves
    import torch

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    code = compile_cell("""
        model.cuda()
        model(torch.randn(2, 4, device="cuda")).sum().backward()
        opt.step()
    """)
    out = SimBackend().execute(lambda n: exec(code, n), {"torch": torch, "model": model, "opt": opt})
    assert isinstance(out.error, SimulatedDeviceMismatchError), out.error
    assert "(`opt.step()`)" in str(out.error) and "_foreach_" in str(out.error)


def test_cpu_tensor_indexed_by_cuda_indices_fails():
    out = run("""
        import torch
        x = torch.randn(8, 4)
        y = x[torch.tensor([0, 2], device="cuda")]
    """)
    assert isinstance(out.error, SimulatedDeviceMismatchError)
    assert "indices should be either on cpu or on the same device as the indexed tensor" in str(out.error)
    assert "line 4 (`y = x[" in str(out.error)


def test_mismatch_inside_a_module_names_the_users_line():
    out = run("""
        import torch
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(4, 4)
                self.scale = torch.ones(4)  # a plain attribute: .cuda() does not move it
            def forward(self, x):
                return self.fc(x) * self.scale
        net = Net().cuda()
        y = net(torch.randn(2, 4, device="cuda"))
    """)
    assert isinstance(out.error, SimulatedDeviceMismatchError)
    assert "line 9 (`return self.fc(x) * self.scale`)" in str(out.error)


# -- cells that run on a GPU: no error ------------------------------------------------------------
ALLOWED = {
    "cpu scalar tensors": """
        import torch
        x = torch.randn(4, 4, device="cuda")
        y = x * torch.tensor(2.0) + torch.tensor(1.0)
        z = torch.where(x > 0, x, torch.tensor(0.0)).clamp(min=torch.tensor(0.0))
    """,
    "indexing with cpu indices": """
        import torch
        x = torch.randn(8, 4, device="cuda")
        idx = torch.tensor([0, 2])
        y = x[idx] + x[idx, idx].sum()
        x[idx] = 0.0
        x[:, torch.tensor([1])] += 1
    """,
    "moves and conversions": """
        import torch
        w = torch.randn(4, 4, device="cuda")
        a = torch.ones(4, 4).type_as(w) + w
        b = w.new_tensor([1.0, 2.0, 3.0, 4.0]) + w + w.new_zeros(4)
        c = torch.ones(4).to(w) + torch.ones(4).cuda() + torch.ones(4).to("cuda", non_blocking=True)
        d = (w.cpu() + torch.ones(4, 4)).sum().item()
        e = torch.as_tensor(w, dtype=torch.float16) + w.half()
    """,
    "default device cuda": """
        import torch
        torch.set_default_device("cuda")
        m = torch.nn.Linear(4, 4)
        y = m(torch.randn(2, 4)) + torch.zeros(4, dtype=torch.float32) + torch.tensor([1.0, 2.0, 3.0, 4.0])
        y.sum().backward()
        torch.set_default_device("cpu")
    """,
    "a cpu model next to a gpu model": """
        import torch
        cpu_model, gpu_model = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4).cuda()
        gpu_model(torch.ones(2, 4, device="cuda")).sum().backward()
        cpu_model(torch.tensor([1, 2])).sum().backward()
        torch.optim.SGD(cpu_model.parameters(), lr=0.1, momentum=0.9).step()
        torch.optim.AdamW(gpu_model.parameters()).step()
    """,
    "a factory inside a custom backward": """
        import torch
        class Double(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * 2
            @staticmethod
            def backward(ctx, g):
                return torch.full((4,), 2.0)  # no device: the simulation cannot tell which
        gpu = torch.nn.Linear(4, 4).cuda()
        gpu(torch.ones(2, 4, device="cuda")).sum().backward()
        w = torch.randn(4, requires_grad=True)
        Double.apply(w).sum().backward()
        torch.optim.SGD([w], lr=0.1, momentum=0.9).step()
        with torch.no_grad():
            w.add_(w.grad.abs())
    """,
    "amp, grad scaler, clipping, fused and capturable optimizers, tensor lr": """
        import torch
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2)).cuda()
        opts = [torch.optim.Adam(m.parameters(), fused=True), torch.optim.Adam(m.parameters(), capturable=True),
                torch.optim.AdamW(m.parameters(), lr=torch.tensor(1e-3)), torch.optim.SGD(m.parameters(), lr=0.1, fused=True)]
        scaler = torch.amp.GradScaler("cuda")
        for opt in opts:
            with torch.autocast("cuda"):
                loss = torch.nn.functional.cross_entropy(m(torch.randn(4, 8, device="cuda")),
                                                         torch.randint(0, 2, (4,)).cuda())
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    """,
    "dataloader batches moved to the gpu, checkpointing, rnn": """
        import torch
        from torch.utils.checkpoint import checkpoint
        from torch.utils.data import DataLoader, TensorDataset
        rnn = torch.nn.GRU(4, 4, 2, bidirectional=True, batch_first=True).cuda()
        head = torch.nn.Linear(8, 2).cuda()
        data = TensorDataset(torch.randn(8, 3, 4), torch.randint(0, 2, (8,)))
        for x, y in DataLoader(data, batch_size=4):
            x, y = x.cuda(), y.cuda()
            h = checkpoint(lambda t: rnn(t)[0], x, use_reentrant=False)
            loss = torch.nn.functional.cross_entropy(head(h[:, -1]), y)
            loss.backward()
    """,
}


@pytest.mark.parametrize("case", list(ALLOWED), ids=list(ALLOWED))
def test_what_a_gpu_accepts_runs(case):
    out = run(ALLOWED[case])
    assert out.error is None, out.error


@pytest.mark.parametrize(("name", "amp", "checkpointing"),
                         list(itertools.product(zoo.SMALL, (False, True), (False, True))))
def test_zoo_has_no_false_mismatch(name, amp, checkpointing):
    out = run(zoo.step_source(name, device="cuda", amp=amp, checkpointing=checkpointing, steps=2))
    assert out.error is None, out.error


def test_cpu_kernels_do_not_check_devices():
    # kernels="cpu" simulates the CPU as the device (to compare with --backend cpu)
    out = run(MISMATCHES["cpu input to a cuda model"][0], kernels="cpu")
    assert out.error is None, out.error


def test_a_composite_kernels_own_buffers_are_on_the_gpu_of_its_inputs():
    """SDPA's math kernel (a T4 in bf16: neither flash nor memory-efficient attention takes
    it) makes its causal mask with the query's options, on the GPU: the L x S bool mask and
    the float mask made from it count there, not on the host."""
    src = """
        import torch, torch.nn.functional as F
        q = torch.randn(1, 6, 256, 64, device="cuda")
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            y = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        """
    out = run(src, gpu="T4")
    assert out.error is None
    report = out.report
    assert any("math 1x" in str(n) for n in report.notes), report.notes
    assert report.host_peak == 0
    trace = report.trace
    device = [n for s, n, _ in trace.events if n > 0 and trace.pool_of.get(s) == "device"]
    assert 256 * 256 in device and 256 * 256 * 4 in device  # the bool mask, then a float one
