from __future__ import annotations

import pickle
import pickletools
from collections import Counter

import pytest
import torch
from torch.cuda import _memory_viz

from memmagic.api import measure
from memmagic.backends.sim.allocator import CachingAllocatorModel, round_request
from memmagic.report import MemoryReport
from memmagic.core.snapshot import BUMP_BASE, snapshot_dict, write_snapshot

MiB = 2**20

# the opcodes the memory_viz page's own unpickler (torch/utils/viz/MemoryViz.js) reads
VIEWER_OPCODES = {"PROTO", "APPEND", "APPENDS", "LIST", "TUPLE", "NEWFALSE", "NEWTRUE", "NONE",
                  "BINGET", "BININT", "BININT1", "BININT2", "EMPTY_DICT", "EMPTY_LIST", "FRAME",
                  "LONG1", "LONG_BINGET", "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "SETITEMS",
                  "SETITEM", "DICT", "SHORT_BINUNICODE", "BINUNICODE", "STOP", "EMPTY_TUPLE",
                  "TUPLE1", "TUPLE2", "TUPLE3", "BINFLOAT"}


def train(device: str, steps: int = 2):
    def run():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 10)).to(device)
        opt = torch.optim.Adam(model.parameters())
        for _ in range(steps):
            model(torch.randn(64, 256, device=device)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return model
    return run


@pytest.fixture(scope="module")
def cpu_report() -> MemoryReport:
    return measure(train("cpu"), backend="cpu")


@pytest.fixture(scope="module")
def sim_report() -> MemoryReport:
    return measure(train("cuda"), backend="sim", gpu="T4")


def events(snap):
    return snap["device_traces"][0]


def replay(snap, blocks: bool = False) -> list[int]:
    """Live bytes after each history entry, relative to the start. The history records
    the bytes asked for, as torch's does; ``blocks``: count them as the caching
    allocator's blocks hold them (rounded to 512 B)."""
    size = round_request if blocks else int
    live, out = 0, []
    for e in events(snap):
        if e["action"] == "alloc":
            live += size(e["size"])
        elif e["action"] == "free_completed":
            live -= size(e["size"])
        out.append(live)
    return out


def trace_allocs(trace) -> tuple[Counter, Counter]:
    """(op, bytes) of every device allocation and free the trace implies: a storage that
    changes size frees its old bytes and allocates the new."""
    size = dict(trace.seed)
    allocs, frees = Counter(), Counter()
    for serial, delta, op in trace.events:
        if trace.pool_of.get(serial) != "device":
            continue
        old = size.get(serial, 0)
        new = old + delta
        if old > 0:
            frees[(op, old)] += 1
        if new > 0:
            allocs[(op, new)] += 1
        size[serial] = new
    return allocs, frees


def snapshot_allocs(snap, blocks: bool = False) -> tuple[Counter, Counter]:
    size = round_request if blocks else int
    allocs = Counter((e["frames"][0]["line"], size(e["size"])) for e in events(snap)
                     if e["action"] == "alloc")
    frees = Counter((e["frames"][0]["line"], size(e["size"])) for e in events(snap)
                    if e["action"] == "free_completed")
    return allocs, frees


def check_viewer_reads(path, snap) -> None:
    data = pickle.loads(path.read_bytes())
    assert data == snap
    used = {op.name for op, _, _ in pickletools.genops(path.read_bytes())}
    assert used <= VIEWER_OPCODES, used - VIEWER_OPCODES
    for plot in (_memory_viz.trace_plot, _memory_viz.segment_plot):
        html = plot(data)
        assert isinstance(html, str) and "add_local_files" in html
    # the text views parse every entry and check the segments' accounting
    assert "total_reserved" in _memory_viz.segsum(data)
    assert _memory_viz.trace(data).startswith("Device 0")
    _memory_viz.segments(data, format_flamegraph=lambda lines: lines)


# -- cpu ----------------------------------------------------------------------------------------
def test_cpu_snapshot_opens_in_memory_viz(cpu_report, tmp_path):
    path = write_snapshot(cpu_report, tmp_path / "cpu.pickle")
    assert path == tmp_path / "cpu.pickle"
    check_viewer_reads(path, snapshot_dict(cpu_report))


def test_cpu_history_matches_the_trace(cpu_report):
    snap = snapshot_dict(cpu_report)
    assert snapshot_allocs(snap) == trace_allocs(cpu_report.trace)
    live = replay(snap)
    assert max(live) == cpu_report.peak - cpu_report.before
    assert live[-1] == cpu_report.after - cpu_report.before
    # malloc-like: every storage its own segment, at a fresh address
    acts = [e["action"] for e in events(snap)]
    assert acts.count("segment_alloc") == acts.count("alloc")
    addrs = [e["addr"] for e in events(snap) if e["action"] == "alloc"]
    assert len(set(addrs)) == len(addrs) and min(addrs) >= BUMP_BASE
    # the model was returned: what is live at the end is in the segments
    assert sum(s["allocated_size"] for s in snap["segments"]) == cpu_report.after


def test_frames_say_op_phase_and_module(cpu_report):
    snap = snapshot_dict(cpu_report)
    trace = cpu_report.trace
    for e in events(snap):
        if e["action"] == "alloc":
            f = e["frames"][0]
            name, module, phase, _ = trace.op(f["line"])
            assert f["name"].startswith(f"{phase}: aten::{name.split('.')[0]}")
            assert f["filename"] == (module or "<cell>")
    cats = {e["category"] for e in events(snap) if e["action"] == "alloc"}
    assert {"parameters", "gradients", "optimizer_state", "activations"} <= cats


# -- sim ----------------------------------------------------------------------------------------
def test_sim_snapshot_opens_in_memory_viz(sim_report, tmp_path):
    path = write_snapshot(sim_report, str(tmp_path / "sim.pickle"))
    check_viewer_reads(path, snapshot_dict(sim_report))


def test_sim_history_is_the_allocator_models(sim_report):
    snap = snapshot_dict(sim_report)
    assert snapshot_allocs(snap, blocks=True) == trace_allocs(sim_report.trace)
    # sizes asked for, as torch records them: the last layer's bias is 40 B (a 512 B block)
    assert 40 in {e["size"] for e in events(snap) if e["action"] == "alloc"}
    live = replay(snap, blocks=True)
    assert max(live) == sim_report.peak - sim_report.before
    assert live[-1] == sim_report.after - sim_report.before
    # segments at the end are what the model reserves; every alloc lies in a segment
    # that exists at that moment (replayed from the end state backwards is the viewer's
    # job; forwards here, from the segments made in the history)
    assert sum(s["total_size"] for s in snap["segments"]) == sim_report.reserved_after
    segs: dict[int, int] = {}
    for e in events(snap):
        if e["action"] == "segment_alloc":
            segs[e["addr"]] = e["size"]
        elif e["action"] == "segment_free":
            del segs[e["addr"]]
        elif e["action"] == "alloc":
            assert any(a <= e["addr"] and e["addr"] + e["size"] <= a + n for a, n in segs.items())
    assert set(segs) == {s["address"] for s in snap["segments"]}
    # a 2 MiB small-pool segment holds several blocks: the model's splits, not one per tensor
    assert any(len([b for b in s["blocks"] if b["state"] == "active_allocated"]) > 1
               or s["segment_type"] == "small" for s in snap["segments"])
    for s in snap["segments"]:
        assert sum(b["size"] for b in s["blocks"]) == s["total_size"]


def test_sim_out_of_memory_is_in_the_history():
    def fill():
        keep = [torch.ones(10 * MiB, device="cuda", dtype=torch.uint8) for _ in range(3)]
        keep.append(torch.ones(40 * MiB, device="cuda", dtype=torch.uint8))

    with pytest.raises(torch.OutOfMemoryError) as info:
        measure(fill, backend="sim", gpu_memory="64MiB")
    report = info.value.memmagic_report
    snap = snapshot_dict(report)
    ooms = [e for e in events(snap) if e["action"] == "oom"]
    assert len(ooms) == 1 and ooms[0]["size"] == report.failed_request == 40 * MiB
    assert ooms[0]["device_free"] == 64 * MiB - 30 * MiB
    assert max(replay(snap)) == report.peak - report.before


def test_sim_cpu_kernels_fall_back_to_one_segment_per_storage():
    report = measure(train("cpu", steps=1), backend="sim", kernels="cpu")
    snap = snapshot_dict(report)
    assert report.trace.allocator_log is None
    assert max(replay(snap)) == report.peak - report.before


def test_a_report_without_a_trace_is_a_clear_error(tmp_path):
    cuda = MemoryReport(backend="cuda", device="cuda:0", before=0, peak=MiB, after=0, wall_s=0.0)
    with pytest.raises(ValueError, match="no trace"):
        write_snapshot(cuda, tmp_path / "x.pickle")
    assert not (tmp_path / "x.pickle").exists()


# -- the allocator model's log ---------------------------------------------------------------
def test_allocator_log_records_addresses_segments_and_stops():
    a = CachingAllocatorModel(capacity=64 * MiB)
    a.malloc("before", 1000)          # not logged: before start_log
    clock = iter(range(100))
    a.start_log(clock=lambda: next(clock))
    a.malloc("x", 3 * MiB)            # a new 20 MiB large segment
    a.malloc("y", 100)                # the small segment of "before"
    a.free("x")
    log = a.take_log()
    assert [e["action"] for e in log.entries] == [
        "segment_alloc", "alloc", "alloc", "free_requested", "free_completed"]
    assert [e["op"] for e in log.entries] == [0, 1, 2, 3, 4]
    seg_addr = log.entries[0]["addr"]
    assert log.entries[0]["size"] == 20 * MiB and log.entries[1]["addr"] == seg_addr
    assert log.entries[2]["size"] == 100 and log.entries[3]["key"] == "x"
    assert not a.logging
    a.malloc("z", 10)
    assert len(log.entries) == 5      # stopped: nothing more recorded
    by_addr = {s["address"]: s for s in log.segments}
    assert by_addr[seg_addr]["blocks"] == [{"address": seg_addr, "size": 20 * MiB, "requested": 0,
                                            "key": None, "allocated": False}]
    small = [s for s in log.segments if s["small"]][0]
    assert [(b["key"], b["requested"]) for b in small["blocks"] if b["allocated"]] == [
        ("before", 1000), ("y", 100)]


def test_allocator_log_records_empty_cache_and_oom():
    a = CachingAllocatorModel(capacity=40 * MiB)
    a.start_log()
    a.malloc("x", 3 * MiB)
    a.free("x")                        # the 20 MiB segment stays cached
    a.malloc("y", 30 * MiB)            # needs 30 MiB: release the cached one first
    with pytest.raises(Exception):
        a.malloc("z", 30 * MiB)
    acts = [e["action"] for e in a.take_log(keep_logging=True).entries]
    assert acts == ["segment_alloc", "alloc", "free_requested", "free_completed",
                    "segment_free", "segment_alloc", "alloc", "oom"]
    assert a.logging
    a.stop_log()
    assert not a.logging


def test_each_cell_on_a_lasting_simulated_gpu_gets_its_own_history(ip):
    first = ip.run_cell_magic("gpumem", "--backend sim --gpu T4 -o -q",
                              "x = torch.ones(3 * 2**20, device='cuda')\n"
                              "y = torch.ones(1000, device='cuda')")
    second = ip.run_cell_magic("gpumem", "--backend sim --gpu T4 -o -q", "z = x * 2\ndel y")
    assert second.before == first.after
    snap = snapshot_dict(second)
    acts = [(e["action"], e["size"]) for e in events(snap)]
    # only this cell's actions; x (an earlier cell's block) is in the segments, not the history
    assert acts == [("segment_alloc", 12 * MiB), ("alloc", 12 * MiB), ("free_requested", 4000),
                    ("free_completed", 4000), ("snapshot", second.after)]
    held = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert sorted(b["size"] for b in held) == [12 * MiB, 12 * MiB]
    assert max(replay(snap, blocks=True)) == second.peak - second.before


def test_an_evaluated_key_says_where_it_comes_from():
    from memmagic.core.snapshot import evaluated_keys, key_frames

    keys = evaluated_keys("<a step, evaluated>", 70, "step at length", 13)
    assert all(type(k) is int and k < 0 for k in keys)  # a storage's key is its serial: 0 up
    others = (evaluated_keys("<a step, evaluated>", 71, "step at length", 13)
              + evaluated_keys("<another, evaluated>", 70, "step at length", 13))
    assert len(set(keys + others)) == 39
    assert key_frames(keys[12]) == [{"filename": "<a step, evaluated>", "line": 70,
                                     "name": "step at length 70, evaluated, not run: buffer 12"}]
    assert key_frames(others[0])[0]["line"] == 71
    assert key_frames(0) is None and key_frames(41) is None and key_frames("x") is None
    with pytest.raises(ValueError, match="out of range"):
        evaluated_keys("<a step, evaluated>", 70, "step at length", (1 << 24) + 1)
