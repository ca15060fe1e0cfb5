"""The field's own torch.cuda snippets in a simulated cell: memory statistics and
summary, the memory-history snapshot, events and streams, card queries.

Each snippet is written as it appears in PyTorch's documentation and tutorials; in the
simulation it must run, take the path it takes on a GPU, and answer from the simulated
allocator (marked where nothing can be known, as with timings)."""

from __future__ import annotations

import pickle

import pytest
import torch

from memmagic.backends.sim import SimBackend, SimulationUnsupported
from memmagic import format_bytes
from memmagic.backends.sim.gpus import GPUS
from test_sim import Recorder, run
from test_sim_session import Notebook
from tests.core.test_snapshot import check_viewer_reads


def test_memory_stats_and_summary_are_the_allocators():
    seen: dict = {}
    out, _ = run("""
        import torch
        a = torch.empty(1000, dtype=torch.uint8, device="cuda")        # small pool
        b = torch.empty(30 * 2**20, dtype=torch.uint8, device="cuda")  # large pool
        del b
        s = torch.cuda.memory_stats()
        seen["stats"] = dict(s)
        seen["allocated"] = torch.cuda.memory_allocated()
        seen["summary"] = torch.cuda.memory_summary()
        seen["short"] = torch.cuda.memory_summary(abbreviated=True)
        torch.cuda.reset_accumulated_memory_stats()
        seen["after_reset"] = torch.cuda.memory_stats()["allocation.all.allocated"]
    """, {"seen": Recorder(seen)}, gpu="T4")
    assert out.error is None, out.error
    s = seen["stats"]
    assert s["allocated_bytes.all.current"] == seen["allocated"] == 1024
    assert s["allocated_bytes.all.peak"] == 1024 + (30 << 20)
    assert s["allocated_bytes.large_pool.freed"] == 30 << 20
    assert s["segment.small_pool.current"] == 1 and s["segment.large_pool.current"] == 1
    assert s["reserved_bytes.all.current"] == (2 << 20) + (30 << 20)
    assert s["inactive_split_bytes.small_pool.current"] == (2 << 20) - 1024
    assert s["requested_bytes.all.current"] == 1000 and s["num_ooms"] == 0
    # torch's own table, fed by the simulated statistics, and said to be simulated
    summary = seen["summary"]
    assert summary.startswith("simulated T4 (memmagic's model of the CUDA caching allocator")
    assert "PyTorch CUDA memory summary, device ID 0" in summary
    assert "from large pool" in summary and "from large pool" not in seen["short"]
    row = next(line for line in summary.splitlines() if line.startswith("| GPU reserved memory"))
    assert row.split("|")[2].strip() == "32768 KiB"  # 2 MiB small + 30 MiB large, as torch writes it
    assert seen["after_reset"] == 0


def test_the_documented_snapshot_snippet_writes_the_simulated_history(tmp_path):
    # https://pytorch.org/docs/stable/torch_cuda_memory.html, on the simulated GPU
    path = tmp_path / "snap.pickle"
    seen: dict = {}
    out, _ = run(f"""
        import torch
        before = torch.empty(3 * 2**20, dtype=torch.uint8, device="cuda")  # before recording
        torch.cuda.memory._record_memory_history(max_entries=100000)
        x = torch.randn(1024, 1024, device="cuda")
        y = (x @ x).relu()
        del x
        torch.cuda.memory._dump_snapshot({str(path)!r})
        seen["live"] = torch.cuda.memory._snapshot()
        seen["segments"] = torch.cuda.memory_snapshot()
        seen["allocated"] = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(enabled=None)
        seen["off"] = torch.cuda.memory._snapshot()["device_traces"]
    """, {"seen": Recorder(seen)}, gpu="T4")
    assert out.error is None, out.error
    data = pickle.loads(path.read_bytes())
    check_viewer_reads(path, data)
    trace = data["device_traces"][0]
    allocs = [e["size"] for e in trace if e["action"] == "alloc"]
    assert 3 << 20 not in allocs  # made before the recording started
    assert allocs.count(4 << 20) >= 3  # x, x @ x, its relu (4 MiB each)
    assert any(e["action"] == "free_completed" and e["size"] == 4 << 20 for e in trace)  # del x
    assert all(isinstance(f["name"], str) for e in trace for f in e["frames"])
    # the segments hold every block live now, the earlier one too (a block may be larger
    # than its tensor: the allocator splits off no remainder under 1 MiB, and
    # memory_allocated() counts the block)
    live = sorted(b["size"] for seg in data["segments"] for b in seg["blocks"]
                  if b["state"] == "active_allocated")
    assert (3 << 20) in live and sum(live) == seen["allocated"] >= out.report.after
    assert seen["segments"] == seen["live"]["segments"]
    assert seen["off"] == [[]]


def test_history_lasts_across_cells_and_keeps_max_entries(tmp_path):
    nb = Notebook()
    assert nb.sim("import torch\ntorch.cuda.memory._record_memory_history(max_entries=5)\n"
                  "a = torch.ones(256, 256, device='cuda')").error is None
    assert nb.sim("b = [torch.ones(128, 128, device='cuda') for _ in range(4)]").error is None
    path = tmp_path / "s.pickle"
    assert nb.sim(f"torch.cuda.memory._dump_snapshot({str(path)!r})").error is None
    data = pickle.loads(path.read_bytes())
    trace = data["device_traces"][0]
    assert len(trace) == 5  # a ring buffer of the last 5 entries
    assert [e["size"] for e in trace if e["action"] == "alloc"][-4:] == [128 * 128 * 4] * 4
    check_viewer_reads(path, data)
    nb.session.reset()


def test_events_and_streams_run_as_one_stream():
    seen: dict = {}
    out, _ = run("""
        import torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        x = torch.randn(1024, 1024, device="cuda") @ torch.randn(1024, 1024, device="cuda")
        end.record()
        torch.cuda.synchronize()
        seen["ms"] = start.elapsed_time(end)
        seen["query"] = end.query()
        # the prefetch pattern: copy the next batch on a side stream
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            nxt = torch.randn(64, 1024).pin_memory().to("cuda", non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)
        nxt.record_stream(torch.cuda.current_stream())
        seen["device"] = nxt.device
        seen["same"] = torch.cuda.current_stream() is torch.cuda.default_stream()
        try:
            torch.cuda.Event().elapsed_time(end)
        except RuntimeError as e:
            seen["untimed"] = str(e)
    """, {"seen": Recorder(seen)}, gpu="T4")
    assert out.error is None, out.error
    assert type(seen["ms"]).__name__ == "SimulatedFloat" and "simulated" in repr(seen["ms"])
    assert seen["query"] is True and seen["device"] == torch.device("cuda", 0) and seen["same"]
    assert "enable_timing=True" in seen["untimed"]
    notes = " ".join(out.report.notes)
    assert "events time nothing" in notes and "elapsed_time" in notes


@pytest.mark.parametrize("sync", ["torch.cuda.synchronize()", "torch.accelerator.synchronize()",
                                  None])
def test_a_script_timing_around_synchronize_is_told_the_time_is_the_simulations(sync):
    # llm.c's train_gpt2.py: t0 = time.time(); a step; torch.cuda.synchronize();
    # print(f"({(t1 - t0) * 1000:.2f} ms | {tokens_per_second:.0f} tok/s)")
    out, _ = run(f"""
        import time, torch
        t0 = time.time()
        x = torch.randn(256, 256, device="cuda") @ torch.randn(256, 256, device="cuda")
        {sync or "pass"}
        print(f"{{(time.time() - t0) * 1000:.2f}} ms")
    """, {}, gpu="T4")
    assert out.error is None, out.error
    said = [n for n in out.report.notes if "host's clock" in n]
    assert len(said) == (sync is not None)
    if sync:
        assert "not a GPU's" in said[0] and "synchronize" in said[0]


@pytest.mark.parametrize("gpu,emulated,native", [("T4", True, False), ("A100", True, True)])
def test_bf16_support_answers_as_torch_does_on_the_card(gpu, emulated, native):
    seen: dict = {}
    out, _ = run("""
        import torch
        seen["default"] = torch.cuda.is_bf16_supported()
        seen["native"] = torch.cuda.is_bf16_supported(including_emulation=False)
    """, {"seen": Recorder(seen)}, gpu=gpu)
    assert out.error is None, out.error
    assert (seen["default"], seen["native"]) == (emulated, native)


def test_the_real_api_is_back_after_the_run():
    import torch.cuda.memory as cmem

    names = ("memory_summary", "memory_stats", "_record_memory_history", "_snapshot",
             "_dump_snapshot", "memory_snapshot", "current_stream", "Event", "Stream", "stream",
             "is_available", "current_accelerator", "memory_allocated", "device_index")

    def api() -> dict:
        return {(mod.__name__, n): getattr(mod, n, None) for n in names
                for mod in (cmem, torch.cuda, torch.accelerator, torch.accelerator.memory)}

    before = api()
    out = SimBackend(gpu="T4").execute(lambda ns: exec(
        "import torch\ntorch.cuda.memory._record_memory_history()\n"
        "s = torch.cuda.Stream()\nraise KeyboardInterrupt", ns), {})
    assert isinstance(out.error, KeyboardInterrupt)
    assert api() == before
    assert torch.accelerator.is_available() is False  # this machine has none


def test_the_tutorials_accelerator_snippet_takes_the_gpu_path():
    # PyTorch's own tutorials (2.6 on) pick the device through torch.accelerator
    seen: dict = {}
    out, _ = run("""
        import torch
        device = torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else "cpu"
        model = torch.nn.Linear(1024, 1024).to(device)
        seen["device"] = device
        seen["allocated"] = torch.accelerator.memory_allocated()
        seen["index"] = torch.accelerator.current_device_index()
        with torch.accelerator.device_index(0):
            torch.accelerator.synchronize()
        seen["free_total"] = torch.accelerator.get_memory_info()
        torch.accelerator.empty_cache()
        from torch.utils.data import DataLoader
        seen["batches"] = len(list(DataLoader(torch.randn(8, 4), batch_size=4, pin_memory=True)))
    """, {"seen": Recorder(seen)}, gpu="T4")
    assert out.error is None, out.error
    assert seen["device"] == "cuda" and seen["index"] == 0 and seen["batches"] == 2
    weights = (1024 * 1024 + 1024) * 4
    assert seen["allocated"] == out.report.after >= weights
    free, total = seen["free_total"]
    # cudaMemGetInfo's free: the card less the CUDA context (400 MB, a published figure)
    # and what the allocator reserved
    assert total == GPUS["t4"].total_memory
    assert free == total - 400_000_000 - out.report.reserved_after and out.report.context == 400_000_000


def test_data_parallel_on_the_one_simulated_gpu():
    from memmagic.core import _torch_private as priv

    seen: dict = {}
    out, _ = run("""
        import torch, torch.nn as nn
        model = nn.DataParallel(nn.Linear(64, 64)).cuda()   # older code's habit, one GPU
        y = model(torch.randn(8, 64))                       # inputs scattered to cuda:0
        y.sum().backward()
        seen["y"] = (y.device, tuple(y.shape))
        seen["index"] = torch.device(0)
        with torch.cuda.device(0):
            seen["in_ctx"] = torch.ones(2, device="cuda").device
        seen["stream"] = torch.Stream(0).device
    """, {"seen": Recorder(seen)}, gpu="T4")
    assert out.error is None, out.error
    assert seen["y"] == (torch.device("cuda", 0), (8, 64))
    assert seen["index"] == seen["in_ctx"] == seen["stream"] == torch.device("cuda", 0)
    cache = priv.data_parallel_stream_cache()
    assert getattr(*cache) is None  # its cache of streams was not kept
    assert torch.Stream.__module__ == "torch" and torch.Event.__module__ == "torch"


def test_the_profiler_is_refused_in_one_line():
    from memmagic.core import _torch_private as priv

    before = [getattr(cls, name) for cls, name in priv.profiler_entry_slots()]
    out, _ = run("""
        import torch
        from torch.profiler import profile, ProfilerActivity
        x = torch.ones(4, 4, device="cuda")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True):
            y = x @ x
    """, gpu="T4")
    assert isinstance(out.error, SimulationUnsupported)
    msg = str(out.error)
    assert msg.startswith("line 5: torch.profiler cannot profile a simulated GPU") and "\n" not in msg
    assert "--timeline" in msg and "--backend cpu" in msg
    assert [getattr(cls, name) for cls, name in priv.profiler_entry_slots()] == before


def test_a_memory_fraction_makes_a_smaller_card():
    # the field's way to try a smaller GPU on a big one: the allocator refuses to reserve
    # more than the fraction, and the error says why
    seen: dict = {}
    out, _ = run("""
        import torch
        torch.cuda.set_per_process_memory_fraction(0.25)
        seen["fraction"] = torch.cuda.get_per_process_memory_fraction()
        a = torch.empty(3 * 2**30, dtype=torch.uint8, device="cuda")   # fits in a quarter of 16 GB
        try:
            b = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError as e:
            seen["error"] = str(e)
        try:
            torch.cuda.set_per_process_memory_fraction(1.5)
        except ValueError as e:
            seen["bad"] = str(e)
    """, {"seen": Recorder(seen)}, gpu="V100")
    assert out.error is None, out.error
    assert seen["fraction"] == 0.25
    v100 = GPUS["v100-16gb"].total_memory
    assert "Tried to allocate 2.00 GiB" in seen["error"]
    assert f"total capacity of {format_bytes(v100)} " in seen["error"]
    assert f"{format_bytes(int(0.25 * v100))} allowed; " in seen["error"]  # torch's words
    assert "Allowed range: 0~1" in seen["bad"]


def test_allocator_settings_the_model_does_not_follow_are_named(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    out, _ = run("import torch\nx = torch.ones(4, device='cuda')\n", gpu="T4")
    assert out.error is None, out.error
    assert any(n.startswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True is not modelled")
               for n in out.report.notes)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    out, _ = run("import torch\nx = torch.ones(4, device='cuda')\n", gpu="T4")
    assert not any("ALLOC_CONF" in n for n in out.report.notes)


def test_a_memory_fraction_follows_the_card_to_another_card():
    seen: dict = {}
    nb = Notebook(gpu="T4")
    assert nb.sim("import torch\ntorch.cuda.set_per_process_memory_fraction(0.25)").error is None
    nb.ns["seen"] = Recorder(seen)
    out = nb.sim("try:\n    x = torch.empty(5 * 2**30, dtype=torch.uint8, device='cuda')\n"
                 "except torch.OutOfMemoryError as e:\n    seen['error'] = str(e)\n", gpu="V100")
    assert out.error is None, out.error
    v100 = GPUS["v100-16gb"].total_memory
    assert f"total capacity of {format_bytes(v100)} " in seen["error"]
    assert f"{format_bytes(int(0.25 * v100))} allowed; " in seen["error"]
    nb.session.reset()


# -- the CUDA context: the verdict counts the whole card (issue 24, item 5) -------------------
def test_the_cuda_context_takes_room_the_allocator_cannot_reserve(monkeypatch):
    from memmagic.backends.sim.gpus import cuda_context, resolve_target

    t4 = GPUS["t4"]
    assert cuda_context(t4, {}).nbytes == 400_000_000
    assert "pytorch/pytorch#109888" in cuda_context(t4, {}).basis
    assert cuda_context(t4, {"CUDA_MODULE_LOADING": "EAGER"}).nbytes == 1_000_000_000
    # a bare size is a budget for the allocator: no context is taken from it
    assert cuda_context(resolve_target(gpu_memory="6GiB"), {}) is None
    assert cuda_context(resolve_target("T4", gpu_memory="6GiB"), {}) is None
    assert cuda_context(None, {}) is None
    room = t4.total_memory - 400_000_000
    # a tensor that fits the card but not beside the context runs out, as on a T4
    big = (room // 2**20 + 1) * 2**20
    out, _ = run(f"import torch\nx = torch.empty({big}, dtype=torch.uint8, device='cuda')", gpu="T4")
    assert out.report.failed_request == big and out.report.fits is False
    assert "GPU 0 has a total capacity of 14.74 GiB of which 14.37 GiB is free" in str(out.error)
    out, _ = run(f"import torch\nx = torch.empty({big - 64 * 2**20}, dtype=torch.uint8, device='cuda')", gpu="T4")
    r = out.report
    assert out.error is None and r.fits is True and r.card_need == r.reserved_peak + 400_000_000
    assert "target GPU       T4 14.74 GiB: fits (with the CUDA context, 381.47 MiB)" in r.summary()
    assert any(str(n).startswith("the verdict counts the CUDA context, 381.47 MiB") for n in r.notes)
    # a memory fraction still leaves the context out
    out, _ = run(f"import torch\ntorch.cuda.set_per_process_memory_fraction(1.0)\n"
                 f"x = torch.empty({big}, dtype=torch.uint8, device='cuda')", gpu="T4")
    assert out.report.failed_request == big
    # with every kernel loaded at start the context is larger
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    out, _ = run(f"import torch\nx = torch.empty({big - 64 * 2**20}, dtype=torch.uint8, device='cuda')", gpu="T4")
    assert out.report.failed_request is not None and out.report.context == 1_000_000_000


def test_nvtx_ranges_are_markers_that_answer_their_depth():
    """torch.cuda.nvtx (DeepSpeed marks every step with it) raises "NVTX functions not
    installed" on a CPU build; on the simulated GPU its ranges hold no memory and answer the
    zero-based depth, as CUDA's do, counted per run."""
    for _ in range(2):  # a run starts at depth 0 whatever the one before left open
        out, ns = run("""
            import torch
            depths = [torch.cuda.nvtx.range_push("a"), torch.cuda.nvtx.range_push("b"),
                      torch.cuda.nvtx.range_pop()]
            with torch.cuda.nvtx.range("step"):
                torch.cuda.nvtx.mark("here")
            x = torch.zeros(256, device="cuda")
            assert depths == [0, 1, 1], depths
        """, gpu="T4")
        assert out.error is None, out.error



def test_code_outside_torch_reads_a_cuda_build_and_transformers_lets_it_use_tf32(tmp_path):
    """``torch.version.cuda`` says a CUDA build's to code outside torch in a simulated run:
    transformers' ``TrainingArguments(tf32=True)`` asks it and refused a simulated A100. On
    a simulated T4 (no TF32) it refuses as on the card, with transformers' own error. torch's
    own modules, imported in the run, read the CPU build's None (they would take the CUDA
    path for good), and so does everyone after the run, a kept reference too."""
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from memmagic.backends.sim.cuda_api import SIMULATED_CUDA_VERSION

    real = torch.version.cuda
    seen: dict = {}
    code = """
        seen["torch's"] = eval("torch.version.cuda", {"__name__": "torch.utils.x", "torch": torch})
        seen["kept"] = torch.version
        args = TrainingArguments(output_dir=OUT, tf32=True, report_to=[])
        seen["cuda"], seen["tf32"] = torch.version.cuda, torch.backends.cuda.matmul.fp32_precision
    """
    ns = {"seen": Recorder(seen), "TrainingArguments": TrainingArguments, "torch": torch,
          "OUT": str(tmp_path)}
    out, _ = run(code, dict(ns), gpu="A100-40GB")
    assert out.error is None, out.error
    assert (seen["cuda"], seen["tf32"], seen["torch's"]) == (SIMULATED_CUDA_VERSION, "tf32", real)
    assert torch.version.cuda == seen["kept"].cuda == real
    assert torch.version.__version__ == torch.__version__
    out, _ = run(code, dict(ns), gpu="T4")
    assert type(out.error).__name__ == "ValueError", out.error
    assert "--tf32 requires Ampere" in str(out.error)


def test_code_outside_torch_reads_cudnn_as_on_a_cuda_build():
    """``torch.backends.cudnn.version()`` and ``is_available()`` answer the recorded build's
    cuDNN to code outside torch (pytorch/tutorials' memory_format compares the version with
    7603; the CPU build's None stopped it), torch's own modules the CPU build's, and
    everyone after the run."""
    from memmagic.backends.sim.cuda_api import SIMULATED_CUDNN_VERSION

    real = (torch.backends.cudnn.version(), torch.backends.cudnn.is_available())
    seen: dict = {}
    out, _ = run("""
        seen["user"] = (torch.backends.cudnn.version(), torch.backends.cudnn.is_available())
        seen["torch's"] = eval("(torch.backends.cudnn.version(), torch.backends.cudnn.is_available())",
                               {"__name__": "torch.nn.x", "torch": torch})
        if torch.backends.cudnn.version() >= 7603:
            x = torch.randn(8, 3, 32, 32, device="cuda").to(memory_format=torch.channels_last)
    """, {"seen": Recorder(seen), "torch": torch})
    assert out.error is None, out.error
    assert seen == {"user": (SIMULATED_CUDNN_VERSION, True), "torch's": real}
    assert (torch.backends.cudnn.version(), torch.backends.cudnn.is_available()) == real


@pytest.mark.parametrize("reads", [True, False])
def test_a_run_that_reads_its_peak_is_told_how_torchs_count_differs(reads):
    """llm.c prints ``max_memory_allocated()``, which counts the allocator's blocks: a
    19.5 MiB request takes a whole 20 MiB segment's block (what is left is too small to
    split off in the large pool), where the report's peak counts the storage's 19.5 MiB."""
    seen: dict = {}
    out, _ = run(f"""
        import torch
        x = torch.empty(39 * 2**19, dtype=torch.uint8, device="cuda")
        if {reads}:
            seen["max"] = torch.cuda.max_memory_allocated()
    """, {"seen": Recorder(seen)}, gpu="T4")
    assert out.error is None, out.error
    assert out.report.peak == 39 * 2**19
    said = [n for n in out.report.notes if "counts the allocator's blocks" in n]
    if reads:
        assert seen["max"] == 20 * 2**20
        assert len(said) == 1 and "20.00 MiB at the run's peak, 512.00 KiB above" in said[0]
    else:
        assert not said


def test_what_nvidia_smi_reads_answers_from_the_card():
    """``torch.cuda.list_gpu_processes()`` and ``device_memory_used()`` (NVML's used memory:
    the CUDA context and what the allocator reserved) answer from the simulated card; NVML's
    readings of the device (utilization, temperature, power, clock) are marked placeholders
    counted as reads of values a simulation has not. A CPU build without nvidia-ml-py
    raised ModuleNotFoundError for each, ending the script."""
    out, _ = run("""
        import os, torch
        x = torch.empty(2**28, dtype=torch.uint8, device="cuda")
        used = torch.cuda.device_memory_used()
        assert used == 400_000_000 + torch.cuda.memory_reserved() == 668_435_456, used
        listing = torch.cuda.list_gpu_processes()
        assert listing == (f"GPU:0\\nprocess {os.getpid():>10d} uses "
                           f"{used / 2**20:>12.3f} MB GPU memory"), listing
        readings = [torch.cuda.utilization(), torch.cuda.temperature(), torch.cuda.power_draw(),
                    torch.cuda.memory_usage(), torch.cuda.clock_rate()]
        assert readings == [0] * 5, readings
        assert f"{torch.cuda.utilization()}%" == "0(simulated)%"
    """, {}, gpu="T4")
    assert out.error is None, out.error
    read = [n for n in out.report.notes if "torch.cuda.utilization (a simulation measures no "
            "device)" in n]
    assert len(read) == 1
