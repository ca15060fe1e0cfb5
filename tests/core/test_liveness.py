"""Measuring must not change what the program keeps alive.

Each program below runs plain and measured (cpu backend, nested cpu measurements, the
simulated device); a probe records, at chosen points, which of the tensors it watches
(every layer's output, through forward hooks) are still alive: the Python tensor object
and its storage, each through a weakref. Measured runs must give the same record as the
plain run, and leave nothing of memmagic holding the program's tensors.
"""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch

from memmagic.backends import cuda_usable, get_backend
from memmagic.backends.sim import SimBackend
from memmagic.core import tracking


class Probe:
    """Watches tensors by weakref; ``point(label)`` records which are alive."""

    def __init__(self) -> None:
        self.refs: dict[str, tuple[weakref.ref, weakref.ref]] = {}
        self.log: list[tuple[str, frozenset, frozenset]] = []
        self.failed: str | None = None  # what the program's backward raised
        self._n = 0

    def __deepcopy__(self, memo):  # the simulation's sandbox keeps the probe itself
        return self

    def watch(self, name: str, t: torch.Tensor) -> None:
        self._n += 1
        self.refs[f"{name}#{self._n}"] = (weakref.ref(t), weakref.ref(t.untyped_storage()))

    def hook(self, name: str):
        def h(module, args, out):
            self.watch(name, out)
        return h

    def point(self, label: str) -> None:
        gc.collect()
        objs = frozenset(n for n, (r, _) in self.refs.items() if r() is not None)
        stores = frozenset(n for n, (_, s) in self.refs.items() if s() is not None)
        self.log.append((label, objs, stores))


SETUP = """
import torch, torch.nn as nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                      nn.Linear(256, 8)).to(device)
for i, layer in enumerate(model):
    layer.register_forward_hook(probe.hook(f"L{i}"))
data = [torch.randn(32, 64, device=device) for _ in range(4)]
"""

PROGRAMS = {
    "forward loop, .item()": """
total = 0.0
for i, x in enumerate(data):
    out = model(x)
    total += out.sum().item()
    probe.point(f"iter {i}")
""",
    "forward loop, epoch_loss += loss": """
epoch_loss = 0
for i, x in enumerate(data):
    loss = model(x).sum()
    epoch_loss += loss
    probe.point(f"iter {i}")
del loss
probe.point("after del loss")
""",
    "forward loop under no_grad": """
with torch.no_grad():
    for i, x in enumerate(data):
        out = model(x)
        probe.point(f"iter {i}")
""",
    "outputs kept in a list": """
outs = []
for i, x in enumerate(data):
    outs.append(model(x))
    probe.point(f"iter {i}")
del outs[:2]
probe.point("dropped two")
""",
    "graph dropped without backward": """
y = model(data[0])
probe.point("forward")
del y
probe.point("dropped")
""",
    "training steps, zero_grad(set_to_none=True)": """
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for i, x in enumerate(data[:3]):
    opt.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    probe.point(f"forward {i}")
    loss.backward()
    probe.point(f"backward {i}")
    opt.step()
""",
    "training steps, zero_grad(set_to_none=False)": """
opt = torch.optim.Adam(model.parameters())
for i, x in enumerate(data[:3]):
    opt.zero_grad(set_to_none=False)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    probe.point(f"step {i}")
""",
    "checkpoint, non-reentrant": """
for i, x in enumerate(data[:2]):
    y = checkpoint(model, x, use_reentrant=False)
    probe.point(f"forward {i}")
    y.sum().backward()
    probe.point(f"backward {i}")
z = checkpoint(model, data[2], use_reentrant=False)
del z
probe.point("dropped")
""",
    "checkpoint_sequential, reentrant": """
for i, x in enumerate(data[:2]):
    x = x.clone().requires_grad_()
    y = checkpoint_sequential(model, 2, x, use_reentrant=True)
    probe.point(f"forward {i}")
    y.sum().backward()
    probe.point(f"backward {i}")
""",
    "gradient accumulation": """
opt = torch.optim.SGD(model.parameters(), lr=0.1)
opt.zero_grad()
for i, x in enumerate(data):
    loss = model(x).square().mean() / len(data)
    loss.backward()
    probe.point(f"micro-step {i}")
opt.step()
""",
    "model called twice": """
y1 = model(data[0])
y2 = model(data[1])
probe.point("two forwards")
(y1 + y2).sum().backward()
probe.point("backward")
del y1
probe.point("dropped y1")
""",
    "in-place op on a saved tensor": """
h = model[0](data[0]).sigmoid()
h.mul_(2)
try:
    h.sum().backward()
except RuntimeError as exc:
    probe.failed = str(exc)
probe.point("after")
""",
}


def _run_plain(src: str, ns: dict) -> None:
    exec(compile(src, "<cell>", "exec"), ns)


def _measured(backend_factory):
    def run(src: str, ns: dict) -> None:
        code = compile(src, "<cell>", "exec")
        out = backend_factory().execute(lambda n: exec(code, n), ns)
        if out.error is not None:
            raise out.error
    return run


def _nested(src: str, ns: dict) -> None:
    code = compile(src, "<cell>", "exec")

    def inner(n):
        out = get_backend("cpu").execute(lambda m: exec(code, m), n)
        if out.error is not None:
            raise out.error

    out = get_backend("cpu").execute(inner, ns)
    if out.error is not None:
        raise out.error


def _record(runner, name: str, device: str = "cpu") -> tuple[list, dict]:
    probe = Probe()
    ns: dict = {"probe": probe, "device": device}
    gc.collect()
    runner(SETUP + PROGRAMS[name], ns)
    probe.point("after the run")  # what the namespace keeps
    ns.clear()
    probe.point("namespace cleared")  # nothing: no cycle outlives its names
    return probe.log, probe.failed


@pytest.fixture(scope="module")
def plain_logs():
    return {name: _record(_run_plain, name) for name in PROGRAMS}


@pytest.mark.parametrize("name", list(PROGRAMS))
@pytest.mark.parametrize("how", ["cpu", "nested cpu"])
def test_measured_keeps_alive_what_plain_keeps_alive(plain_logs, name, how, clean_state):
    runner = _measured(lambda: get_backend("cpu")) if how == "cpu" else _nested
    log, failed = _record(runner, name)
    plain_log, plain_failed = plain_logs[name]
    assert log == plain_log
    assert failed == plain_failed  # the in-place check raises the same error, word for word


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_usable(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_cuda_backend_keeps_alive_what_plain_keeps_alive(name, clean_state):
    plain_log, plain_failed = _record(_run_plain, name, device="cuda")
    log, failed = _record(_measured(lambda: get_backend("cuda")), name, device="cuda")
    assert log == plain_log
    assert failed == plain_failed


@pytest.mark.parametrize("name", list(PROGRAMS))
@pytest.mark.parametrize("kernels", ["cpu", "cuda"])
def test_simulated_keeps_alive_what_plain_keeps_alive(plain_logs, name, kernels):
    from memmagic.core import _torch_private as priv

    gc.collect()  # fakes other code keeps (torch.compile's example inputs) are not the run's
    others = {id(o) for o in gc.get_objects() if isinstance(o, torch.Tensor) and priv.is_fake(o)}
    log, failed = _record(_measured(lambda: SimBackend(kernels=kernels)), name, device="cuda")
    plain_log, plain_failed = plain_logs[name]
    # inside the run the simulated program holds what the real one holds; after it, the
    # sandbox has turned the cell's names into placeholders: no fake object is alive
    assert log[:-2] == plain_log[:-2]
    assert all(objs == stores == frozenset() for _, objs, stores in log[-2:])
    assert failed == plain_failed
    gc.collect()
    assert not [o for o in gc.get_objects()
                if isinstance(o, torch.Tensor) and priv.is_fake(o) and id(o) not in others]


def test_the_measurement_leaves_no_tracker_behind():
    probe = Probe()
    ns = {"probe": probe, "device": "cpu"}
    _measured(lambda: get_backend("cpu"))(SETUP + PROGRAMS["forward loop, epoch_loss += loss"], ns)
    gc.collect()
    kinds = (tracking.StorageTracker, tracking.Tracking, tracking.RoleHooks)
    assert not [o for o in gc.get_objects() if isinstance(o, kinds)]
    # the graph the program kept (epoch_loss) holds our saved-tensor stand-ins, cut off
    saved = [o for o in gc.get_objects() if isinstance(o, tracking._Saved)]
    assert all(ch.tracker is None for s in saved for ch, _ in s.marks)


def test_a_failed_measurement_keeps_no_memmagic_object_alive():
    def boom():
        big = torch.ones(1 << 20)  # noqa: F841 - kept by the traceback, as without memmagic
        raise ValueError("boom")

    from memmagic import measure

    try:
        measure(boom, backend="cpu")
    except ValueError:
        tb = sys.exc_info()[2]
    gc.collect()
    kinds = (tracking.StorageTracker, tracking.Tracking, tracking.RoleHooks)
    assert not [o for o in gc.get_objects() if isinstance(o, kinds)]
    assert tb is not None
    del tb


def test_version_check_message_matches_autograd(plain_logs):
    _, plain = plain_logs["in-place op on a saved tensor"]
    assert plain.startswith("one of the variables needed for gradient computation")
    _, measured = _record(_measured(lambda: get_backend("cpu")), "in-place op on a saved tensor")
    assert measured == plain
    with torch.autograd.set_detect_anomaly(True):
        _, plain_anomaly = _record(_run_plain, "in-place op on a saved tensor")
        _, measured_anomaly = _record(_measured(lambda: get_backend("cpu")),
                                      "in-place op on a saved tensor")
    assert measured_anomaly == plain_anomaly != plain


# -- the classic leak, as a student meets it in a notebook -------------------------------------
B, D_IN, H, N_ITER = 256, 512, 2048, 4
LOOP_SETUP = f"""
import torch, torch.nn as nn
model = nn.Sequential(nn.Linear({D_IN}, {H}), nn.ReLU(), nn.Linear({H}, {H}), nn.ReLU(),
                      nn.Linear({H}, 10)).to(device)
data = [torch.randn({B}, {D_IN}, device=device) for _ in range({N_ITER})]
"""
ITEM_LOOP = """
epoch_loss = 0.0
for x in data:
    out = model(x)
    epoch_loss += out.sum().item()
"""
LEAK_LOOP = """
epoch_loss = 0
for x in data:
    out = model(x)
    epoch_loss += out.sum()
"""
# By hand: each iteration's graph saves the two ReLU outputs (B x H fp32 each; the Linear
# layers save their inputs, which are those outputs or the batch, and their weights).
# After the loop `out` (B x 10) is alive and holds the last graph; the tensor epoch_loss
# holds every graph.
PER_ITER = 2 * B * H * 4
OUT = B * 10 * 4


def _round512(n: int) -> int:
    return -(-n // 512) * 512


def test_item_loop_retains_one_graph_and_the_leak_retains_all_on_cpu(ip):
    ip.run_cell("device = 'cpu'\n" + LOOP_SETUP).raise_error()
    item = ip.run_cell_magic("gpumem", "--backend cpu -o -q", ITEM_LOOP)
    leak = ip.run_cell_magic("gpumem", "--backend cpu -o -q", LEAK_LOOP)
    assert item.retained == PER_ITER + OUT
    # the leak cell starts with the item cell's `out` (one graph) alive and replaces it
    assert leak.after - item.before == N_ITER * PER_ITER + OUT + 4  # + the 0-dim epoch_loss


def test_item_loop_retains_one_graph_and_the_leak_retains_all_on_sim(ip):
    ip.run_line_magic("gpusim", "reset")  # each cell on an empty simulated GPU
    item = ip.run_cell_magic("gpumem", "--backend sim -o -q", "device = 'cuda'\n" + LOOP_SETUP + ITEM_LOOP)
    ip.run_line_magic("gpusim", "reset")
    leak = ip.run_cell_magic("gpumem", "--backend sim -o -q", "device = 'cuda'\n" + LOOP_SETUP + LEAK_LOOP)
    ip.run_line_magic("gpusim", "reset")
    params = sum(_round512(n) for n in (D_IN * H * 4, H * 4, H * H * 4, H * 4, H * 10 * 4, 10 * 4))
    batches = N_ITER * B * D_IN * 4
    ws = 8_519_680 + 1_048_576  # the first matmul's cuBLAS and cuBLASLt workspaces, kept
    assert item.retained == params + batches + PER_ITER + OUT + ws
    assert leak.retained == params + batches + N_ITER * PER_ITER + OUT + 512 + ws  # + epoch_loss
    assert leak.retained - item.retained == (N_ITER - 1) * PER_ITER + 512


def test_failed_simulated_cell_keeps_only_the_users_frames(ip):
    from memmagic.core import _torch_private as priv
    from memmagic.backends.sim.tracker import SimTracker

    gc.collect()
    others = {id(o) for o in gc.get_objects() if isinstance(o, torch.Tensor) and priv.is_fake(o)}
    ip.run_cell("def f(n):\n    t = torch.ones(n, device='cuda')\n    raise ValueError('boom')")
    result = ip.run_cell("%%gpumem --backend sim -q\nf(1000)")
    assert isinstance(result.error_in_exec, ValueError)
    gc.collect()
    # the notebook's simulated GPU (its tracker) lasts; nothing else of the run does
    card = ip._memmagic_sim_session.card
    assert [o for o in gc.get_objects() if isinstance(o, (SimTracker, tracking.Tracking))] == [card.tracker]
    del card
    # %debug still sees the user's frame as it was: its fake tensor is there, and it is the
    # only fake tensor alive (IPython keeps the traceback, as it does for any failed cell)
    tb = sys.last_traceback
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert tb.tb_frame.f_code.co_name == "f"
    t = tb.tb_frame.f_locals["t"]
    del tb, result
    gc.collect()
    fakes = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and priv.is_fake(o)
             and id(o) not in others]
    assert fakes == [t]
