"""The code students really write, on the notebook's simulated GPU (issue 23): a failed
step's memory after an out of memory, a GradScaler in what-if runs and the doctor,
``torch.cuda._clear_cublas_workspaces()``, and FSDP2 rows for a model of an earlier cell.

Cells run through a real IPython shell (``ip.run_cell``), so IPython keeps the last error
(``sys.last_traceback``, its traceback formatter) as a notebook does."""

from __future__ import annotations

import gc

import pytest
import torch

from memmagic.core import _torch_private as priv
from memmagic.backends.sim.session import shell_session

MLP = "mlp = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda()"
MLP_BYTES = 8 * (4096 * 4096 * 4 + 4096 * 4)       # 537,001,984 B of fp32 weights and biases
WORKSPACES = 8_519_680 + 1_048_576                  # cuBLAS + cuBLASLt (T4), kept for good
STEP = 'x = torch.randn({batch}, 4096, device="cuda"); mlp(x).sum().backward()'


@pytest.fixture
def gpusim(ip):
    """``%gpusim on --gpu T4`` for the test; off (and an empty card) afterwards."""
    ip.run_line_magic("gpusim", "on --gpu T4")
    try:
        yield ip
    finally:
        ip.run_line_magic("gpusim", "off")
        ip.run_line_magic("gpusim", "reset")


def _allocated(ip) -> int:
    res = ip.run_cell("_allocated = torch.cuda.memory_allocated()")
    assert res.error_in_exec is None, res.error_in_exec
    return ip.user_ns.pop("_allocated")


# -- 1. a failed step's memory ------------------------------------------------------------
def test_an_out_of_memory_frees_the_failed_step_as_a_gpu_does(gpusim):
    ip = gpusim
    assert ip.run_cell(MLP).error_in_exec is None
    res = ip.run_cell(STEP.format(batch=131072))   # 2 GiB activations each: out of memory
    assert isinstance(res.error_in_exec, torch.OutOfMemoryError)
    del res
    # what stays is what a GPU keeps: the model, the batch the cell bound (x), the
    # workspaces; not the activations of the failed forward (14.51 GiB before the fix)
    x_bytes = 131072 * 4096 * 4
    assert _allocated(ip) == MLP_BYTES + x_bytes + WORKSPACES
    # the next, smaller attempt runs (it failed too while the leftover stayed)
    res = ip.run_cell(STEP.format(batch=1024))
    assert res.error_in_exec is None, res.error_in_exec
    grads, backward_cublas = MLP_BYTES, 8_519_680  # backward's thread has a workspace of its own
    assert _allocated(ip) == MLP_BYTES + grads + 1024 * 4096 * 4 + WORKSPACES + backward_cublas


def test_gpumem_cells_free_the_failed_step_too(ip):
    magic = "%%gpumem --backend sim --gpu T4 -q --no-chart\n"
    assert ip.run_cell(magic + MLP).error_in_exec is None
    res = ip.run_cell(magic + STEP.format(batch=131072))
    assert isinstance(res.error_in_exec, torch.OutOfMemoryError)
    del res
    assert ip.run_cell(magic + "_allocated = torch.cuda.memory_allocated()").error_in_exec is None
    assert ip.user_ns["_allocated"] == MLP_BYTES + 131072 * 4096 * 4 + WORKSPACES


def _fakes() -> set[int]:
    gc.collect()
    return {id(t) for t in gc.get_objects() if isinstance(t, torch.Tensor) and priv.is_fake(t)}


def test_reset_after_a_failed_cell_leaves_no_fake_tensor(ip):
    """A model of a real cell moved to the simulated GPU by a cell that then fails: the
    error IPython keeps holds simulated tensors; ``%gpusim reset`` lets them go."""
    before = _fakes()
    assert ip.run_cell("model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),"
                       " torch.nn.Linear(256, 256))").error_in_exec is None
    res = ip.run_cell("%%gpumem --backend sim --gpu T4 -q --no-chart\n"
                      "model.cuda()\n"
                      "y = model(torch.randn(4, 100, device='cuda'))\n")  # wrong width
    assert isinstance(res.error_in_exec, RuntimeError)
    del res
    assert _fakes() - before  # the card keeps the model (and the frames their inputs)
    ip.run_line_magic("gpusim", "reset")
    assert not _fakes() - before
    # the real model is untouched
    assert isinstance(ip.user_ns["model"], torch.nn.Module)
    assert not priv.is_fake(ip.user_ns["model"][0].weight)


# -- 2. a used GradScaler in the namespace --------------------------------------------------
AMP_SETUP = """\
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10)).cuda()
opt = torch.optim.AdamW(model.parameters())
scaler = torch.amp.GradScaler("cuda")
"""
AMP_STEP = """\
x = torch.randn(batch_size, 512, device="cuda")
with torch.autocast("cuda", dtype=torch.float16):
    loss = model(x).float().pow(2).mean()
scaler.scale(loss).backward()
scaler.step(opt)
scaler.update()
opt.zero_grad()
"""


def _used_scaler(ip) -> None:
    ip.run_cell("batch_size = 64")
    assert ip.run_cell(AMP_SETUP).error_in_exec is None
    res = ip.run_cell(AMP_STEP)  # the scaler now holds its scale on the simulated GPU
    assert res.error_in_exec is None, res.error_in_exec


def test_whatif_runs_with_a_used_grad_scaler(gpusim):
    ip = gpusim
    _used_scaler(ip)
    card = shell_session(ip).card
    panel = ip.run_cell_magic("gpumem", "--whatif -o -q", AMP_STEP)
    assert panel.baseline_report.error is None, panel.baseline_report.error
    # the copy of the card holds all the notebook's does: the scaler's scale too
    assert panel.baseline_report.before == card.live_bytes()
    assert not any("could not be copied" in str(n) for n in panel.baseline_report.notes)
    panel.set(batch_size=256)
    assert panel.report.error is None and panel.report.peak > panel.baseline_report.peak


def test_a_cell_that_imports_memmagic_to_use_its_api_runs_it_under_gpusim(gpusim):
    """``import memmagic`` then ``memmagic.find_batch_size(panel.cell)`` in a cell of a
    notebook under %gpusim on: the cell uses memmagic's own objects only, so it runs for
    real and the finder's runs simulate themselves (wrapped, they were refused as "a
    simulated measurement inside another"). A cell that imports anything else stays a
    simulated one."""
    ip = gpusim
    ip.run_cell(MLP)
    ip.run_cell("batch_size = 64")
    ip.user_ns["panel"] = ip.run_cell_magic("gpumem", "--whatif -o -q",
                                            STEP.format(batch="batch_size"))
    res = ip.run_cell("import memmagic\n"
                      "from memmagic import find_batch_size\n"
                      "found = find_batch_size(panel.cell, gpu='T4')")
    assert res.error_in_exec is None, res.error_in_exec
    assert ip.user_ns["found"].batch_size > 64
    res = ip.run_cell("import memmagic, math\nx = torch.ones(4, device='cuda')")
    assert res.error_in_exec is None, res.error_in_exec
    assert "x" in shell_session(ip).card.shadow  # on the simulated card


def test_the_doctor_ranks_fixes_with_a_used_grad_scaler(gpusim, capsys):
    ip = gpusim
    _used_scaler(ip)
    ip.run_cell("batch_size = 1 << 20")  # 2 GiB of inputs, 4 GiB fp16 activations each: out of memory
    r = ip.run_cell_magic("gpumem", "--no-raise -o -q --no-chart", AMP_STEP)
    assert r.failed_request is not None
    assert "could not advise" not in capsys.readouterr().err
    assert r.advice is not None and r.advice.strategies, "the fixes were re-run"
    assert any(s.fits for s in r.advice.strategies)


def test_a_copy_of_the_card_copies_an_object_whose_pickle_reads_a_value(ip):
    """An object of the user's whose ``__getstate__`` reads a simulated value is copied
    from its attributes; one that cannot be copied at all is left out with a note."""
    from memmagic.backends.sim import SimBackend
    from memmagic.backends.sim.session import SimSession

    class Reads:  # like GradScaler: pickles a tensor's value
        def __init__(self, t):
            self.t = t

        def __getstate__(self):
            return {"v": self.t.sum().item()}

    class Never:  # refuses to be copied, and needs an argument to be built
        def __new__(cls, t):
            self = super().__new__(cls)
            self.t = t
            return self

        def __deepcopy__(self, memo):
            raise TypeError("no copies")

    ns = {"torch": torch, "Reads": Reads, "Never": Never}
    session = SimSession()
    out = SimBackend(gpu="T4", session=session).execute(lambda n: exec(
        "r = Reads(torch.randn(1024, device='cuda'))\nkeep = {'r': r}\n"
        "nv = Never(torch.ones(1024, device='cuda'))", n), ns)
    assert out.error is None, out.error
    copy, notes = session.card.copy()
    try:
        r = copy.shadow["r"].value
        assert copy.shadow["keep"].value["r"] is r  # aliases stay aliases
        assert priv.is_fake(r.t) and r.t.shape == (1024,)
        assert r.t is not session.card.shadow["r"].value.t
        assert "nv" not in copy.shadow
        assert any("`nv`" in n and "could not be copied" in n for n in notes), notes
        assert copy.live_bytes() == session.card.live_bytes() - 4096
    finally:
        copy.discard()
        session.reset()


# -- 3. torch.cuda._clear_cublas_workspaces() ---------------------------------------------
def test_clear_cublas_workspaces_frees_them_until_the_next_matmul(gpusim):
    ip = gpusim
    res = ip.run_cell(
        "m = torch.nn.Linear(64, 64).cuda()\n"
        "y = m(torch.randn(8, 64, device='cuda'))\n"
        "a, ra = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()\n"
        "torch.cuda._clear_cublas_workspaces()\n"
        "b, rb = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()\n"
        "y2 = m(y)\n"
        "c = torch.cuda.memory_allocated()\n")
    assert res.error_in_exec is None, res.error_in_exec
    a, b, c = (ip.user_ns[k] for k in "abc")
    assert a - b == WORKSPACES                 # cuBLAS and cuBLASLt, as the real call frees
    assert ip.user_ns["ra"] == ip.user_ns["rb"]  # their blocks stay cached
    assert c - b == WORKSPACES + 8 * 64 * 4  # taken again by the next matmul, and y2
    assert not hasattr(torch.cuda, "_clear_cublas_workspaces") or torch.cuda.is_available()


# -- 4. FSDP2 rows for a model built in an earlier simulated cell --------------------------
NET = """\
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(512, 512, bias=False) for _ in range(4))
    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return x

model = Net().cuda()
opt = torch.optim.Adam(model.parameters())
"""
TRAIN = """\
x = torch.randn(8, 512, device="cuda")
model(x).sum().backward()
opt.step()
opt.zero_grad()
"""
P = 4 * 512 * 512 * 4  # parameter bytes


BIG_NET = NET.replace("512, 512", "8192, 8192").replace("range(4)", "range(16)")
BIG_P = 16 * 8192 * 8192 * 4  # 4 GiB of fp32 weights: with gradients and Adam, 16 GiB


def test_fsdp_rows_shard_the_model_of_an_earlier_cell(gpusim):
    """The model and its optimizer fit a T4; the training step (gradients, Adam's two
    moments) does not: --advise's FSDP2 rows shard the notebook's model and fit."""
    ip = gpusim
    assert ip.run_cell(BIG_NET).error_in_exec is None
    r = ip.run_cell_magic("gpumem", "--advise --no-raise -o -q --no-chart",
                          TRAIN.replace("512", "8192"))
    assert r.failed_request is not None  # out of memory
    rows = {s.knobs["fsdp_world_size"]: s for s in r.advice.strategies
            if "fsdp_world_size" in s.knobs}
    assert sorted(rows) == [2, 4, 8]
    for n, s in rows.items():
        assert s.reason is None and s.peak is not None, (n, s.reason)
        assert s.fits, n
    assert rows[8].peak < rows[4].peak < rows[2].peak
    # rank 0 holds its shards of the parameters, gradients and Adam's two moments, and
    # the foreach step's copy of a shard (10.02 GiB over 2 GPUs): never the whole model
    for n, s in rows.items():
        assert 5 * BIG_P // n <= s.peak <= 5 * BIG_P // n + (64 << 20), n


def test_simulate_fsdp_from_the_notebooks_card_leaves_it_alone(gpusim):
    from memmagic.whatif import sharding

    ip = gpusim
    assert ip.run_cell(NET).error_in_exec is None
    session = shell_session(ip)
    card = session.card
    held, names = card.live_bytes(), sorted(card.shadow)
    shown = {k: ip.user_ns[k] for k in names}
    res = sharding.simulate_fsdp(TRAIN, ip.user_ns, world_size=4)
    assert res.report is not None, res.reason
    assert res.sharded[-1] == "model" and len(res.sharded) == 5
    assert session.card is card and card.live_bytes() == held and sorted(card.shadow) == names
    assert all(ip.user_ns[k] is v for k, v in shown.items())
    assert "x" not in ip.user_ns


def test_item_under_inference_mode_reads_a_placeholder_as_under_no_grad():
    import torch

    from memmagic.pipeline import CellRequest, run_cell

    src = ("x = torch.randn(8, device='cuda')\n"
           "with torch.inference_mode():\n    v = x.sum().item()\n"
           "with torch.no_grad():\n    w = x.sum().item()\n"
           "(type(v).__name__, type(w).__name__)")
    r = run_cell(CellRequest(src, {"torch": torch}, backend="sim"))
    assert r.error is None and r.value == ("SimulatedFloat", "SimulatedFloat")


def test_a_module_that_keeps_the_simulated_stream_class_keeps_no_run_alive():
    """transformers' continuous batching, imported during a simulated cell, keeps
    ``torch.cuda.Stream | None`` in its annotations for the process's life: the simulated
    classes it keeps must hold no run (tracker, allocator, sandbox)."""
    import gc
    import types

    import torch

    from memmagic.core import tracking
    from memmagic.pipeline import CellRequest, run_cell

    def trackers() -> set[int]:
        gc.collect()
        return {id(o) for o in gc.get_objects() if isinstance(o, tracking.StorageTracker)}

    earlier = trackers()  # other tests' (a shell's notebook card keeps its own)
    kept = types.ModuleType("kept")  # a module, as transformers is: the sandbox leaves it
    src = ("kept.annotations = {'s': torch.cuda.Stream | None, 'e': torch.cuda.Event}\n"
           "e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True)\n"
           "e0.record(); x = torch.ones(8, device='cuda'); e1.record()\n"
           "e0.elapsed_time(e1)")
    r = run_cell(CellRequest(src, {"torch": torch, "kept": kept}, backend="sim"))
    assert r.error is None and str(r.value) == "1.0(simulated)"
    del r
    assert kept.annotations["e"].__name__ == "SimEvent"
    assert trackers() <= earlier
