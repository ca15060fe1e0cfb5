"""The CUDA backend's peak logic against a scripted allocator, and on a real GPU when present."""
from __future__ import annotations

import pytest
import torch

from memmagic.backends.cuda import CUDABackend, replay_peak


class FakeProbe:
    """Plays a scripted allocator: counters at start and end, and a trace of events."""

    def __init__(self, start, end, events, *, overflow=False):
        self.device = 0
        self.start, self.end, self.events, self.overflow = start, end, events, overflow
        self.calls = []
        self._n = 0

    def name(self):
        return "Fake GPU"

    def synchronize(self):
        self.calls.append("sync")

    def counters(self):
        self._n += 1
        return self.start if self._n == 1 else self.end

    def start_trace(self):
        self.calls.append("start_trace")

    def stop_trace(self):
        self.calls.append("stop_trace")
        return None if self.overflow else list(self.events)


MiB = 2**20


def run(probe, fn=lambda: None, **kw):
    return CUDABackend(probe=probe, breakdown=False, **kw).measure(fn)


def test_new_all_time_peak_comes_from_the_counter():
    probe = FakeProbe((10 * MiB, 10 * MiB, 20 * MiB, 20 * MiB), (12 * MiB, 50 * MiB, 60 * MiB, 60 * MiB), [])
    r = run(probe).report
    assert (r.before, r.peak, r.after, r.reserved_peak) == (10 * MiB, 50 * MiB, 12 * MiB, 60 * MiB)
    assert r.increment == 40 * MiB and r.retained == 2 * MiB


def test_peak_below_an_earlier_one_is_replayed_from_the_trace():
    # max_memory_allocated was 100 MiB before the cell and stays: the counter cannot tell
    events = [("alloc", 8 * MiB), ("segment_alloc", 20 * MiB), ("alloc", 4 * MiB),
              ("free_requested", 8 * MiB), ("free_completed", 8 * MiB), ("alloc", 2 * MiB),
              ("segment_free", 20 * MiB)]
    probe = FakeProbe((10 * MiB, 100 * MiB, 30 * MiB, 120 * MiB), (16 * MiB, 100 * MiB, 30 * MiB, 120 * MiB), events)
    r = run(probe).report
    assert r.peak == 10 * MiB + 12 * MiB
    assert r.reserved_peak == 50 * MiB
    assert "start_trace" in probe.calls and "stop_trace" in probe.calls


def test_overflowed_trace_is_said_in_the_notes():
    probe = FakeProbe((10 * MiB, 100 * MiB, 30 * MiB, 120 * MiB), (10 * MiB, 100 * MiB, 30 * MiB, 120 * MiB), [],
                      overflow=True)
    r = run(probe).report
    assert any("trace overflowed" in n for n in r.notes)


def test_failure_still_reports_and_stops_the_trace():
    probe = FakeProbe((0, 0, 0, 0), (MiB, 2 * MiB, 2 * MiB, 2 * MiB), [])

    def boom():
        raise ValueError("x")
    out = run(probe, boom)
    assert isinstance(out.error, ValueError) and out.report.error == "ValueError: x"
    assert probe.calls[-1] == "stop_trace"


def test_replay_peak():
    assert replay_peak(5, [("alloc", 3), ("free_completed", 3), ("alloc", 1)], {"alloc"}, {"free_completed"}) == 8


def test_cuda_backend_never_resets_the_peak_counters(monkeypatch):
    called = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: called.append(1))
    probe = FakeProbe((0, 0, 0, 0), (0, 0, 0, 0), [])
    run(probe)
    assert called == []


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_real_gpu_peak_and_outer_reading_stay_right():
    from memmagic import measure

    torch.cuda.reset_peak_memory_stats()
    big = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    del big
    outer_peak = torch.cuda.max_memory_allocated()
    r = measure(lambda: torch.ones(1 * MiB, dtype=torch.uint8, device="cuda").sum(), backend="cuda")
    assert torch.cuda.max_memory_allocated() == outer_peak  # the user's reading survives
    assert r.increment >= MiB and r.peak < outer_peak


@cuda
def test_real_gpu_nested_measurements():
    from memmagic import measure

    def inner():
        x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        return measure(lambda: torch.empty(32 * MiB, dtype=torch.uint8, device="cuda"), backend="cuda"), x

    outer = measure(lambda: inner(), backend="cuda")
    assert outer.increment >= 96 * MiB


class SnapshotProbe(FakeProbe):
    """A scripted allocator that also hands over its own snapshot, as the real probe does."""

    keep_snapshot = False
    snapshot = None

    def stop_trace(self):
        if self.keep_snapshot:
            self.snapshot = {"segments": [{"device": 0, "address": 0, "total_size": 2 * MiB,
                                           "blocks": []}],
                             "device_traces": [[{"action": "alloc", "addr": 0, "size": 512,
                                                 "frames": [], "stream": 0}]]}
        return super().stop_trace()


def test_the_cuda_report_carries_the_trace_and_on_request_the_allocators_snapshot(tmp_path):
    import pickle

    from memmagic.core.snapshot import write_snapshot

    probe = SnapshotProbe((0, 0, 0, 0), (0, 0, 0, 0), [])
    model = torch.nn.Linear(8, 8)
    out = CUDABackend(probe=probe, breakdown=True, snapshot=True).measure(
        lambda: model(torch.randn(2, 8)).sum().backward())
    r = out.report
    assert r.trace is not None and len(r.trace.ops) > 0  # the tracker ran: its trace is there
    assert r.cuda_snapshot is probe.snapshot
    path = write_snapshot(r, tmp_path / "cell.pickle")
    assert pickle.loads(path.read_bytes()) == probe.snapshot
    plain = CUDABackend(probe=SnapshotProbe((0, 0, 0, 0), (0, 0, 0, 0), []), breakdown=False)
    r2 = plain.measure(lambda: None).report
    assert r2.cuda_snapshot is None and r2.trace is None


# -- on a real GPU: the magic end to end, and the simulation beside the real allocator ----
STEP = (
    "model = torch.nn.Linear(1024, 1024, device='cuda')\n"
    "opt = torch.optim.Adam(model.parameters())\n"
    "model(torch.randn(64, 1024, device='cuda')).sum().backward()\n"
    "opt.step()\n"
)


@cuda
def test_real_gpu_magic_breakdown_counts_the_step_to_the_byte(ip):
    r = ip.run_cell_magic("gpumem", "--backend cuda -o -q", STEP)
    params = 1024 * 1024 * 4 + 1024 * 4  # both multiples of 512: the allocator's own sizes
    assert r.backend == "cuda" and r.error is None
    assert r.breakdown["parameters"] == params
    assert r.breakdown["optimizer_state"] >= 2 * params  # Adam's two moments (+ step counts)
    assert r.after - r.before >= 4 * params  # weights, gradients, two moments stay
    assert r.reserved_peak >= r.peak >= r.after


@cuda
def test_real_gpu_out_of_memory_is_reported_and_leaves_nothing_behind(ip):
    before = torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory
    r = ip.run_cell_magic("gpumem", "--backend cuda --no-raise -o -q",
                          f"keep = torch.empty(1 << 20, device='cuda')\n"
                          f"big = torch.empty({2 * total}, dtype=torch.uint8, device='cuda')\n")
    assert r.error is not None and "out of memory" in r.error.lower()
    ip.run_cell("del keep")
    import gc

    gc.collect()
    assert torch.cuda.memory_allocated() == before  # the failed cell's frames were let go


@cuda
def test_real_gpu_snapshot_is_the_allocators_own(ip, tmp_path):
    import pickle

    path = tmp_path / "cell.pickle"
    ip.run_cell_magic("gpumem", f"--backend cuda -q --snapshot {path}", STEP)
    snap = pickle.loads(path.read_bytes())
    assert snap["segments"] and snap["device_traces"][0]
    sizes = {e["size"] for e in snap["device_traces"][0] if e["action"] == "alloc"}
    assert 1024 * 1024 * 4 in sizes  # the weight's block


@cuda
def test_real_gpu_and_the_simulated_card_agree_on_a_training_step():
    """The GPU check's first row (python -m benchmarks.gpu_check --real) as a test: the same
    cell on the real GPU and on the simulated card told the same GPU, the allocated peak
    within 2% and the reserved peak within 5%."""
    from benchmarks.gpu_check import Check, card_for, real_run, sim_run

    check = Check("zoo", "mlp", "fp32", False)
    real = real_run(check, trace=False, strings={})
    p = torch.cuda.get_device_properties(0)
    sim = sim_run(check, card_for((p.major, p.minor), p.total_memory))
    assert real.get("error") is None and sim.get("error") is None, (real, sim)
    assert abs(sim["step_max_alloc"] / real["step_max_alloc"] - 1) <= 0.02, (real, sim)
    assert abs(sim["step_max_reserved"] / real["step_max_reserved"] - 1) <= 0.05, (real, sim)
