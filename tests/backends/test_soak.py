"""A notebook that trains for a long time on the simulated GPU keeps the host's memory flat
(issue 36, item 5): after a warm-up, a thousand AdamW steps under ``%gpusim on`` and two
hundred ``%%gpumem`` re-runs of a step leave every cache and table of the simulation at its
size, and the Python heap where it was.

Before, each step keyed two ops by Adam's step sizes (new op-cache entries, each a miss
through FakeTensorMode, whose own cache grew too), the fake mode kept an entry for every
fake constant it ever made (the step counts), and the card's tracker kept pool, role and
saver entries for every storage it ever made: 16,000 more Python objects for each cell of
50 steps, 250 for each ``%%gpumem`` run.

What is measured: the sizes of those tables (exact: they do not depend on the machine); the
number of objects Python holds (``sys.getallocatedblocks()``: free to read, so over the whole
soak); and the bytes it holds (``tracemalloc``, which makes the simulation 4-5 times slower:
over 100 steps and 30 cells). Not the process's RSS: on a shared machine it moves with
glibc's arenas and torch's own allocator, and a leak of a few KiB a run is below its noise
(measured by hand: flat within 3 KiB a cell of 50 steps over 4,000 steps once warm, where it
grew 1.4 MiB a cell before). IPython's own record of every cell's display outputs
(``history_manager.outputs``: a footer's 200 B a cell) is emptied before each reading: a
notebook kernel keeps it too, and it is not the simulation's.
"""

from __future__ import annotations

import gc
import sys
import tracemalloc

import pytest

from memmagic.core import _torch_private as priv
from memmagic.backends.sim.session import shell_session

SETUP = """\
import torch, torch.nn as nn
model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)]).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(4, 16, device="cuda")
def step():
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
STEPS = "for _ in range({n}):\n    step()\n"
GPUMEM = "%%gpumem -q --no-chart\nstep()\n"
MAX_BLOCKS = 100        # Python objects a run (a cell) may add after the warm-up
MAX_BYTES = 10 * 1024   # bytes a run may add after the warm-up


def _tables(ip) -> dict[str, int]:
    """The sizes of what the notebook's simulated GPU keeps between cells."""
    card = shell_session(ip).card
    tracker = card.tracker
    return {"op cache": len(card.fast.entries),
            "FakeTensorMode's cache": priv.fake_dispatch_cache_size(),
            "fake constants": priv.fake_constant_storages(card.fake_mode),
            "blocks on the card": len(tracker.alloc_bytes),
            **{name: len(getattr(tracker, name))
               for name in ("pool_of", "roles", "saver", "owner", "frozen")},
            "zero_read_serials": len(tracker.s.zero_read_serials)}


def _held(ip, measure) -> int:
    ip.history_manager.outputs.clear()
    gc.collect()
    return measure()


def _soak(ip, cell: str, runs: int, measure, warm: int = 3
          ) -> tuple[dict[str, int], dict[str, int], float]:
    """Run ``cell`` ``runs`` times after ``warm`` runs; (the tables before, after, what
    ``measure()`` grew by a run)."""
    for _ in range(warm):
        _run(ip, cell)
    before, held = _tables(ip), _held(ip, measure)
    for _ in range(runs):
        _run(ip, cell)
    return before, _tables(ip), (_held(ip, measure) - held) / runs


def _run(ip, cell: str) -> None:
    res = ip.run_cell(cell)
    assert res.error_in_exec is None, res.error_in_exec


def _traced_bytes() -> int:
    return tracemalloc.get_traced_memory()[0]


@pytest.mark.slow
def test_a_thousand_steps_and_two_hundred_cells_leave_the_host_memory_flat(ip):
    ip.run_line_magic("gpusim", "on --gpu T4")
    try:
        _run(ip, SETUP)
        for cell, runs in ((STEPS.format(n=50), 20), (GPUMEM, 200)):
            before, after, objects = _soak(ip, cell, runs, sys.getallocatedblocks)
            assert after == before
            assert objects < MAX_BLOCKS, f"{objects:.0f} objects a run of {cell!r}"
        tracing = tracemalloc.is_tracing()  # (python -X tracemalloc: left running)
        tracemalloc.start()
        try:
            # warm-up under tracing too: until the long-lived objects that the runs replace
            # now and then were made under it, replacing them reads as growth
            for cell, runs in ((STEPS.format(n=10), 10), (GPUMEM, 30)):
                before, after, growth = _soak(ip, cell, runs, _traced_bytes, warm=10)
                assert after == before
                assert growth < MAX_BYTES, f"{growth:.0f} B a run of {cell!r}"
        finally:
            if not tracing:
                tracemalloc.stop()
    finally:
        ip.run_line_magic("gpusim", "off")
        ip.run_line_magic("gpusim", "reset")
