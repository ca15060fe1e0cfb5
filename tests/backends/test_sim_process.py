"""A simulated cell must never crash the process (a notebook kernel) — not even at exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from memmagic.core import _torch_private as priv
from memmagic.backends.sim import SimBackend

# The cell that crashed the interpreter at exit (SIGSEGV/SIGABRT): a fake constant
# (BatchNorm's num_batches_tracked) and a deepcopy of fake tensors (TransformerEncoder
# clones its layer) made torch release its storage weakrefs twice.
CRASH_CELL = """\
import torch, torch.nn as nn
from torch.utils.checkpoint import checkpoint
m = nn.Sequential(nn.Conv2d(3,8,3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8*14*14, 10)).cuda()
x = torch.randn(4,3,16,16).cuda().requires_grad_(); y = torch.randint(0,10,(4,)).cuda()
out = checkpoint(m, x, use_reentrant=True)
loss = nn.CrossEntropyLoss(label_smoothing=0.1)(out, y); loss.backward()
acc = (out.argmax(1) == y).float().mean().item()
t = torch.tensor([1.0, 2.0]); s = t.sum()
m2 = nn.GRU(8, 8, 2, bidirectional=True, batch_first=True).cuda()
o, h = m2(torch.randn(2, 5, 8, device='cuda')); o.sum().backward()
emb = nn.EmbeddingBag(10, 4, mode='mean').cuda()
emb(torch.tensor([1,2,3], device='cuda'), torch.tensor([0,1], device='cuda')).sum().backward()
tr = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 2).cuda()
tr(torch.randn(2,5,16,device='cuda'), src_key_padding_mask=torch.zeros(2,5,dtype=torch.bool,device='cuda')).sum().backward()
"""

# The smallest cell that crashed: a fake constant, then a deepcopy of a fake tensor.
SMALL_CELL = """\
import copy, torch
c = torch.tensor(0)
d = copy.deepcopy(torch.zeros(3))
"""

_RUNNER = """\
import sys
from memmagic.backends.sim import SimBackend
for src in sys.argv[1:]:
    code = compile(src, "<cell>", "exec")
    out = SimBackend().execute(lambda ns: exec(code, ns), {})
    if out.error is not None:
        print("cell error:", repr(out.error))
        sys.exit(3)
print("done")
"""


def _run_cells(*cells: str) -> subprocess.CompletedProcess:
    """Run the cells under the simulator in a fresh interpreter, through its exit."""
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    return subprocess.run([sys.executable, "-c", _RUNNER, *cells], capture_output=True,
                          text=True, timeout=600, env=env)


def _describe(proc: subprocess.CompletedProcess) -> str:
    code = proc.returncode
    sig = f" ({signal.Signals(-code).name})" if code < 0 else ""
    return f"exit code {code}{sig}; stdout: {proc.stdout[-500:]!r}; stderr: {proc.stderr[-2000:]!r}"


@pytest.mark.slow
def test_crash_cell_exits_cleanly():
    # the crash was a corrupted heap, noticed at exit on most runs, not all: run it twice
    # (the small cell crashed 9 runs in 10 before the fix, this one every run)
    for _ in range(2):
        proc = _run_cells(CRASH_CELL, SMALL_CELL)
        assert proc.returncode == 0 and "done" in proc.stdout, _describe(proc)


@pytest.mark.slow
def test_zoo_cells_exit_cleanly():
    from memmagic import zoo

    cells = [zoo.step_source(name, device="cuda", amp=amp, checkpointing=ckpt)
             for name in zoo.SMALL for amp, ckpt in ((False, False), (True, True))]
    proc = _run_cells(*cells)
    assert proc.returncode == 0 and "done" in proc.stdout, _describe(proc)


def test_deepcopy_keeps_the_fake_mode():
    # the root cause, checked in this process: a deepcopy inside a simulated cell must not
    # copy the FakeTensorMode (no fake constant here, so a copied mode could not crash us)
    seen: dict = {}

    def cell(ns):
        exec(compile(textwrap.dedent("""
            import copy, torch, torch.nn as nn
            enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2).cuda()
            lin = nn.Linear(3, 3).cuda()
            twin = copy.deepcopy(lin)
        """), "<cell>", "exec"), ns)
        modes = {id(t.fake_mode) for t in (ns["lin"].weight, ns["twin"].weight, ns["twin"].bias,
                                          *ns["enc"].parameters())}
        seen["modes"] = len(modes)
        seen["copied"] = ns["twin"].weight is not ns["lin"].weight
        seen["device"] = str(ns["twin"].weight.device)

    out = SimBackend().execute(cell, {})
    assert out.error is None, out.error
    assert seen == {"modes": 1, "copied": True, "device": "cuda:0"}
    # the copy is a new allocation on the simulated GPU, as on a real one
    assert out.report.peak >= 2 * 512 + 2 * 512  # lin and twin: weight and bias each
    assert "__deepcopy__" not in priv.FakeTensorMode.__dict__  # restored after the run

