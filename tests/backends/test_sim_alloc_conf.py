"""PYTORCH_CUDA_ALLOC_CONF in the caching-allocator model (pure Python) and the simulated
backend.

Every expected number below is derived by hand from the C++ rules (c10's
CUDACachingAllocator.cpp and AllocatorConfig.cpp); the derivation is in the comments.
Reminders: a large-pool request below 10 MiB gets a 20 MiB segment, from 10 MiB on one
rounded up to 2 MiB; the best fit is the smallest cached block at least as large; a
large-pool block is split when more than 1 MiB would be left (and, with max_split_size,
only for a request below it).
"""

from __future__ import annotations

import textwrap

import pytest

from memmagic.backends.sim import SimBackend
from memmagic.backends.sim.allocator import (
    LARGE_BUFFER,
    SIZE_MAX,
    AllocatorConfig,
    AllocatorFull,
    CachingAllocatorModel,
    alloc_conf_from_env,
    parse_alloc_conf,
)
from memmagic.backends.sim.session import SimSession
from test_sim_allocator import random_ops

MiB = 1 << 20


def model(conf: str = "", capacity: int | None = None) -> CachingAllocatorModel:
    return CachingAllocatorModel(capacity, parse_alloc_conf(conf))


# -- parsing ----------------------------------------------------------------------------------
def test_parse_reads_values_as_torch_does():
    c = parse_alloc_conf("")
    assert c == AllocatorConfig() and c.is_default and c.source == ""
    # MB is 1024 * 1024 (kMB); spaces are dropped by the tokenizer
    c = parse_alloc_conf("max_split_size_mb:128, garbage_collection_threshold:0.6")
    assert c.max_split_size == 128 * MiB and c.garbage_collection_threshold == 0.6
    assert c.max_non_split_rounding_size == LARGE_BUFFER and not c.is_default
    assert c.modelled == ("max_split_size_mb:128", "garbage_collection_threshold:0.6")
    assert c.unmodelled == ()
    # 20 (kLargeBuffer / kMB) is the smallest max_split_size_mb torch takes
    assert parse_alloc_conf("max_split_size_mb:20").max_split_size == 20 * MiB
    assert parse_alloc_conf("max_non_split_rounding_mb:64").max_non_split_rounding_size == 64 * MiB
    # expandable_segments:False is the default; True, other options and unknown keys are
    # named as not modelled (their values skipped as ConfigTokenizer::skipKey does)
    c = parse_alloc_conf("expandable_segments:False,backend:native,release_lock_on_cudamalloc:True")
    assert c.is_default and c.unmodelled == ()
    c = parse_alloc_conf("expandable_segments:True,roundup_power2_divisions:[256:1,>:4],"
                         "max_split_size_mb:40,bogus:3")
    assert c.expandable_segments and c.max_split_size == 40 * MiB
    assert c.unmodelled == ("expandable_segments:True", "roundup_power2_divisions:[256:1,>:4]",
                            "bogus:3 (unknown to torch)")
    assert parse_alloc_conf("backend:cudaMallocAsync").unmodelled == ("backend:cudaMallocAsync",)


@pytest.mark.parametrize("text, words", [
    ("max_split_size_mb:19", "CachingAllocator option max_split_size_mb too small, must be >= 20"),
    ("max_non_split_rounding_mb:8", "max_non_split_rounding_mb too small, must be >= 20"),
    # large_segment_size_mb is read first and raises the smallest max_split_size_mb
    ("large_segment_size_mb:30,max_split_size_mb:25", "max_split_size_mb too small, must be >= 30"),
    ("large_segment_size_mb:10", "large_segment_size_mb must be > 10 MB"),
    ("garbage_collection_threshold:1.0", "garbage_collect_threshold is invalid, set it in (0.0, 1.0)"),
    ("garbage_collection_threshold:0", "garbage_collect_threshold is invalid"),
    ("expandable_segments:true", "Expected 'True' or 'False'"),
    ("backend:cuda", "Unknown allocator backend"),
    ("max_split_size_mb:lots", "expected a whole number"),
    ("max_split_size_mb", "end too early"),
    ("max_split_size_mb=64", "end too early"),
    ("max_split_size_mb:64;garbage_collection_threshold:0.5", "expected ','"),
])
def test_parse_refuses_what_torch_refuses(text, words):
    with pytest.raises(ValueError) as info:
        parse_alloc_conf(text)
    msg = str(info.value)
    assert words in msg and msg.startswith("PYTORCH_CUDA_ALLOC_CONF=") and "\n" not in msg


def test_the_environment_is_read_as_torch_reads_it():
    # AcceleratorAllocatorConfig::instance(): the first variable that is set wins, even ""
    assert alloc_conf_from_env({}) == AllocatorConfig()
    c = alloc_conf_from_env({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"})
    assert c.max_split_size == 64 * MiB and c.source == "PYTORCH_ALLOC_CONF=max_split_size_mb:64"
    c = alloc_conf_from_env({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:32",
                             "PYTORCH_ALLOC_CONF": "max_split_size_mb:64"})
    assert c.max_split_size == 32 * MiB
    assert alloc_conf_from_env({"PYTORCH_CUDA_ALLOC_CONF": "",
                                "PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}).is_default
    with pytest.raises(ValueError, match="PYTORCH_ALLOC_CONF="):
        alloc_conf_from_env({"PYTORCH_ALLOC_CONF": "max_split_size_mb:1"})


# -- max_split_size_mb ------------------------------------------------------------------------
def _fragment(a: CachingAllocatorModel) -> None:
    for i in range(20):
        a.malloc(i, 6 * MiB)
    for i in range(0, 20, 2):
        a.free(i)
    a.malloc("twelve", 12 * MiB)


@pytest.mark.parametrize("conf", ["", "max_split_size_mb:20"])
def test_fragmentation_case(conf):
    # Each 6 MiB request (< 10 MiB) makes a 20 MiB segment when no cached block fits and
    # splits it: 6 + 14 free, then 6 + 8 free, then 6 + 2 free (2 > 1 MiB: split). So 20
    # blocks take 7 segments (6 full ones of 3 blocks, the last 2 blocks + 8 MiB free):
    # 140 MiB. Freeing blocks 0, 2, ..., 18 leaves cached blocks of 6, 8 and 2 MiB (6 next
    # to 2 merge to 8 at a segment's end), none of 12 MiB: 12 MiB gets a segment of its own
    # (12 MiB, already a multiple of 2 MiB): 152 MiB reserved, 10 x 6 + 12 = 72 allocated.
    # max_split_size_mb:20 changes nothing here: every request is below 20 MiB and every
    # cached block too (the 20 MiB segments are oversize, but only whole free segments are
    # oversize blocks, and none is free), so the same blocks are found and split.
    a = model(conf)
    _fragment(a)
    assert a.reserved == 152 * MiB and a.allocated == 72 * MiB and a.segments == 8
    s = a.memory_stats()
    if conf:
        # alloc_block: the seven 20 MiB segments are >= max_split_size (oversize_segments);
        # no block handed out is (oversize_allocations)
        assert s["oversize_segments.current"] == 7 and s["oversize_allocations.peak"] == 0
        assert s["max_split_size"] == 20 * MiB
    else:
        assert s["oversize_segments.current"] == 0 and s["max_split_size"] == -1


def test_a_smaller_request_does_not_take_an_oversize_block():
    # a 30 MiB segment (30 >= max_split_size 20: oversize, not split), freed: a cached
    # 30 MiB block. get_free_block: 12 MiB < max_split_size and the best fit 30 MiB >= it:
    # refused, so 12 MiB gets a 12 MiB segment: 42 MiB. By default the 12 MiB request
    # takes the 30 MiB block and splits it (18 MiB left): 30 MiB.
    for conf, reserved, segments in (("", 30, 1), ("max_split_size_mb:20", 42, 2)):
        a = model(conf)
        a.malloc("big", 30 * MiB)
        a.free("big")
        assert a.malloc("x", 12 * MiB) == 12 * MiB
        assert a.reserved == reserved * MiB and a.segments == segments


def test_an_oversize_request_takes_a_cached_block_within_the_rounding_limit():
    # a cached 50 MiB block. A 30 MiB request (>= max_split_size 20) may take a cached
    # block only if it is smaller than 30 + max_non_split_rounding_size (20 by default) =
    # 50: it is not, so a 30 MiB segment: 80 MiB. A 31 MiB request: 50 < 51, it takes the
    # whole 50 MiB block (should_split: no split for a request >= max_split_size).
    a = model("max_split_size_mb:20")
    a.malloc("b", 50 * MiB)
    a.free("b")
    assert a.malloc("x", 30 * MiB) == 30 * MiB and a.reserved == 80 * MiB
    a.free("x")
    a = model("max_split_size_mb:20")
    a.malloc("b", 50 * MiB)
    a.free("b")
    assert a.malloc("y", 31 * MiB) == 50 * MiB and a.reserved == 50 * MiB
    # max_non_split_rounding_mb:40: 50 < 30 + 40, the 30 MiB request takes the 50 MiB block
    a = model("max_split_size_mb:20,max_non_split_rounding_mb:40")
    a.malloc("b", 50 * MiB)
    a.free("b")
    assert a.malloc("x", 30 * MiB) == 50 * MiB and a.reserved == 50 * MiB
    # by default the 30 MiB request takes the 50 MiB block and splits it (20 MiB left)
    a = model()
    a.malloc("b", 50 * MiB)
    a.free("b")
    assert a.malloc("x", 30 * MiB) == 30 * MiB and a.reserved == 50 * MiB


def test_release_available_cached_blocks_frees_oversize_blocks_before_everything():
    # capacity 100 MiB; segments of 40, 30 and 24 MiB (94 MiB), 40 and 30 freed (cached,
    # oversize). A 64 MiB request: no cached block fits, 94 + 64 > 100.
    # release_available_cached_blocks: no single block >= 64, so oversize blocks from the
    # largest down until 64 MiB are freed: 40 (40 < 64), then 30 (70 >= 64); 24 + 64 = 88
    # fits: no retry (num_alloc_retries 0). By default release_cached_blocks frees both
    # (empty_cache) and counts a retry.
    for conf, retries in (("max_split_size_mb:20", 0), ("", 1)):
        a = model(conf, capacity=100 * MiB)
        for k, n in (("a", 40), ("b", 30), ("c", 24)):
            a.malloc(k, n * MiB)
        a.free("a")
        a.free("b")
        a.malloc("d", 64 * MiB)
        s = a.memory_stats()
        assert a.reserved == 88 * MiB and s["num_alloc_retries"] == retries
        assert s["num_device_free"] == 2 and a.segments == 2
    # the single-block case: cached 12, 30 and 40 MiB (82 MiB reserved), capacity 90 MiB.
    # A 14 MiB request may not take the 30 MiB block (oversize, 14 < 20), 82 + 14 > 90.
    # release_available_cached_blocks frees the smallest cached block >= max(14, 20): the
    # 30 MiB one; 52 + 14 = 66 fits. The 12 and 40 MiB blocks stay cached.
    a = model("max_split_size_mb:20", capacity=90 * MiB)
    for k, n in (("a", 12), ("b", 30), ("c", 40)):
        a.malloc(k, n * MiB)
    for k in "abc":
        a.free(k)
    a.malloc("d", 14 * MiB)
    assert a.reserved == 66 * MiB and a.segments == 3 and a.num_alloc_retries == 0
    assert sorted(seg["total_size"] for seg in a.take_log().segments) == [12 * MiB, 14 * MiB, 40 * MiB]


def test_oversize_statistics():
    a = model("max_split_size_mb:20")
    a.malloc("big", 30 * MiB)   # a 30 MiB segment and block: both oversize
    a.malloc("mid", 6 * MiB)    # a 20 MiB segment (>= 20: oversize), a 6 MiB block (not)
    s = a.memory_stats()
    assert (s["oversize_segments.current"], s["oversize_allocations.current"]) == (2, 1)
    a.free("big")                # free(): the 30 MiB block is no longer allocated
    assert a.empty_cache() == 30 * MiB  # release_block: one oversize segment less
    s = a.memory_stats()
    assert [s[f"oversize_allocations.{f}"] for f in ("current", "peak", "allocated", "freed")] == [0, 1, 1, 1]
    assert [s[f"oversize_segments.{f}"] for f in ("current", "peak", "allocated", "freed")] == [1, 2, 2, 1]
    a.reset_peak_stats()
    a.reset_accumulated_stats()
    s = a.memory_stats()
    assert [s[f"oversize_segments.{f}"] for f in ("current", "peak", "allocated", "freed")] == [1, 1, 0, 0]


def _recount(a: CachingAllocatorModel) -> tuple[int, int, int, int]:
    """(allocated blocks >= max_split_size, segments >= it, allocated bytes, reserved)."""
    ms = a.config.max_split_size
    segs = a.take_log(keep_logging=a.logging).segments
    blocks = [b for seg in segs for b in seg["blocks"] if b["allocated"]]
    return (sum(b["size"] >= ms for b in blocks), sum(seg["total_size"] >= ms for seg in segs),
            sum(b["size"] for b in blocks), sum(seg["total_size"] for seg in segs))


@pytest.mark.parametrize("conf", ["max_split_size_mb:20", "max_split_size_mb:33",
                                  "max_split_size_mb:24,garbage_collection_threshold:0.4"])
def test_random_runs_keep_the_counts_right(conf):
    a = model(conf, capacity=300 * MiB)
    a.capacity = 300 * MiB  # set_per_process_memory_fraction: garbage collection may run
    for _key, _live in random_ops(a, 1, 2000, 60 << 20):
        s = a.memory_stats()
        over_alloc, over_seg, allocated, reserved = _recount(a)
        assert (s["oversize_allocations.current"], s["oversize_segments.current"]) == (over_alloc, over_seg)
        assert (a.allocated, a.reserved) == (allocated, reserved) and reserved <= 300 * MiB
        assert s["reserved_bytes.all.current"] == reserved
        assert s["num_device_alloc"] - s["num_device_free"] == a.segments
    assert s["num_ooms"] > 0


# -- garbage_collection_threshold ---------------------------------------------------------------
def _aged(conf: str, fraction: bool) -> CachingAllocatorModel:
    """Capacity 100 MiB. Segments A 24, B 16, R 12 MiB (each exactly its request: no
    split), 52 MiB reserved. Each malloc is one get_free_block call on the large pool
    (counts 1, 2, 3). A is freed at count 3; R is freed and taken back twice (counts 4, 5:
    the best fit for 12 MiB is R itself), then freed at 5, and B freed at 5. Ages (count -
    count when cached) are then A 2, B 0, R 0."""
    a = model(conf, capacity=100 * MiB)
    if fraction:
        a.capacity = 100 * MiB  # set_per_process_memory_fraction: allowed_memory_maximum
    a.malloc("A", 24 * MiB)
    a.malloc("B", 16 * MiB)
    a.malloc("R", 12 * MiB)
    a.free("A")
    for _ in range(2):
        a.free("R")
        a.malloc("R", 12 * MiB)
    a.free("R")
    a.free("B")
    assert a.reserved == 52 * MiB and a.segments == 3
    return a


def test_garbage_collection_frees_the_oldest_cached_blocks_first():
    # threshold 0.5 x 100 MiB = 50 MiB. A 26 MiB request: get_free_block (count 6: ages
    # A 3, B 1, R 1) finds no block >= 26. garbage_collect_cached_blocks: 52 > 50, target
    # 2 MiB; average age 5/3: only A (3) is at least that old: A freed (24 >= 2, done).
    # 28 + 26 = 54 MiB reserved; B and R stay cached.
    a = _aged("garbage_collection_threshold:0.5", fraction=True)
    a.malloc("X", 26 * MiB)
    assert a.reserved == 54 * MiB and a.segments == 3
    assert sorted(s["total_size"] for s in a.take_log().segments) == [12 * MiB, 16 * MiB, 26 * MiB]
    # without the setting, or without a memory fraction (set_fraction is false), nothing
    # is collected: 52 + 26 = 78 MiB fits in 100
    for conf, fraction in (("", True), ("garbage_collection_threshold:0.5", False)):
        a = _aged(conf, fraction)
        a.malloc("X", 26 * MiB)
        assert a.reserved == 78 * MiB and a.segments == 4


def test_garbage_collection_goes_on_pass_after_pass():
    # threshold 0.25 x 100 MiB = 25 MiB. A 30 MiB request: 52 > 25, target 27 MiB. Pass 1
    # (average 5/3) frees A: 24 < 27. Pass 2: the average of B and R is (1 + 1) / 2 = 1,
    # both are that old: both freed (52 >= 27). 0 + 30 = 30 MiB reserved.
    a = _aged("garbage_collection_threshold:0.25", fraction=True)
    a.malloc("X", 30 * MiB)
    assert a.reserved == 30 * MiB and a.segments == 1
    assert a.memory_stats()["num_device_free"] == 3 and a.num_alloc_retries == 0


# -- copies and the simulated backend -----------------------------------------------------------
def test_a_copy_keeps_the_settings():
    # _aged with max_split_size_mb:20 too: A (24 MiB) is an oversize segment. "big" (30
    # MiB, count 6): no cached block >= 30; GC (52 > 50, ages A 3, B 1, R 1, average 5/3)
    # frees A; a 30 MiB segment: 58 MiB, one oversize segment and allocation.
    a = _aged("max_split_size_mb:20,garbage_collection_threshold:0.5", fraction=True)
    a.malloc("big", 30 * MiB)
    assert a.reserved == 58 * MiB
    b = a.copy({"big": "big2"})
    assert b.config == a.config and b.fraction_set and b.capacity == a.capacity
    sa, sb = a.memory_stats(), b.memory_stats()
    assert sb["max_split_size"] == 20 * MiB
    assert sb["oversize_allocations.current"] == sa["oversize_allocations.current"] == 1
    assert sb["oversize_segments.current"] == sa["oversize_segments.current"] == 1
    # both go on alike, with the same ages: X (26 MiB, count 7) finds no cached block; GC
    # (58 > 50, B and R both of age 2, the average) frees both: 30 + 26 = 56. X freed
    # (cached at count 7), Y (14 MiB, count 8) may not take it (oversize, 14 < 20); GC
    # (56 > 50) frees it (age 1, the average): 30 + 14 = 44 MiB.
    for m in (a, b):
        m.malloc("X", 26 * MiB)
        assert m.reserved == 56 * MiB
        m.free("X")
        m.malloc("Y", 14 * MiB)
        assert m.reserved == 44 * MiB
        assert sorted(s["total_size"] for s in m.take_log().segments) == [14 * MiB, 30 * MiB]


SRC = textwrap.dedent("""
    import torch
    a = torch.empty(30 * 2**20, dtype=torch.uint8, device="cuda")
    del a
    b = torch.empty(12 * 2**20, dtype=torch.uint8, device="cuda")
""")


def _sim(src: str, **options):
    return SimBackend(**options).execute(lambda ns: exec(src, ns), {})


def test_the_simulated_backend_follows_max_split_size(monkeypatch):
    # 30 MiB cached, then 12 MiB: by default it takes the cached block (30 MiB reserved);
    # with max_split_size_mb:20 it may not (an oversize block): 30 + 12 = 42 MiB
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    out = _sim(SRC, gpu="T4")
    assert out.error is None and out.report.reserved_peak == 30 * MiB
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:20")
    out = _sim(SRC, gpu="T4")
    assert out.error is None, out.error
    assert out.report.reserved_peak == 42 * MiB
    assert not any("ALLOC_CONF" in n or "not modelled" in n for n in out.report.notes)
    # an option the model does not follow is named, alone
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:20,roundup_power2_divisions:4")
    out = _sim(SRC, gpu="T4")
    assert out.report.reserved_peak == 42 * MiB
    note = [n for n in out.report.notes if "not modelled" in n]
    assert note == ["PYTORCH_CUDA_ALLOC_CONF=roundup_power2_divisions:4 is not modelled: reserved "
                    "memory follows max_split_size_mb:20 and the default configuration otherwise "
                    "(allocated memory does not depend on it)"]
    # the newer name works too; a value torch refuses stops the run, in torch's words
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:20")
    assert _sim(SRC, gpu="T4").report.reserved_peak == 42 * MiB
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:8")
    with pytest.raises(ValueError, match="max_split_size_mb too small, must be >= 20"):
        _sim(SRC, gpu="T4")


def test_the_simulated_backend_follows_garbage_collection(monkeypatch):
    # a 1 GiB card, set_per_process_memory_fraction(0.5): 512 MiB allowed. 150 + 120 MiB
    # segments (270), the 150 MiB one cached, then 160 MiB (no cached block fits). Default:
    # 270 + 160 = 430 <= 512. garbage_collection_threshold:0.5 (256 MiB): 270 > 256, the
    # one cached block (age 1, the average) is freed first: 120 + 160 = 280 MiB.
    src = textwrap.dedent("""
        import torch
        torch.cuda.set_per_process_memory_fraction(0.5)
        MiB = 2**20
        a = torch.empty(150 * MiB, dtype=torch.uint8, device="cuda")
        b = torch.empty(120 * MiB, dtype=torch.uint8, device="cuda")
        del a
        c = torch.empty(160 * MiB, dtype=torch.uint8, device="cuda")
    """)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    for conf, reserved in (("", 430), ("garbage_collection_threshold:0.5", 280)):
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
        out = _sim(src, gpu="T4", gpu_memory="1GiB")
        assert out.error is None, out.error
        assert out.report.reserved_peak == out.report.reserved_after == reserved * MiB


def test_a_notebook_card_keeps_the_settings_it_was_made_with(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:20")
    session = SimSession()
    _sim("import torch\n", gpu="T4", session=session)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")  # torch read it once, when CUDA started
    out = _sim(SRC, gpu="T4", session=session)
    assert out.report.reserved_peak == 42 * MiB
    assert session.card.alloc_config.max_split_size == 20 * MiB
    # what-if runs start from a copy with the same settings
    # (the copy holds b and the cached 30 MiB block: 42 MiB; 14 MiB may not take that
    # oversize block: 42 + 14 = 56 MiB)
    out = SimBackend(gpu="T4", start_from=session).execute(lambda ns: exec(
        "import torch\nc = torch.empty(14 * 2**20, dtype=torch.uint8, device='cuda')\n", ns), {})
    assert out.error is None, out.error
    assert out.report.reserved_peak == 56 * MiB
    session.reset()  # %gpusim reset: a new card reads the environment again
    _sim("import torch\n", gpu="T4", session=session)
    assert session.card.alloc_config.is_default and session.card.alloc_config.max_split_size == SIZE_MAX


def test_a_refused_setting_is_one_line_in_the_notebook(ip, monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:8")
    from IPython.core.error import UsageError

    r = ip.run_cell("%%gpumem --backend sim --gpu T4 -q\nx = torch.ones(3, device='cuda')")
    err = r.error_in_exec
    assert isinstance(err, UsageError), err
    assert "\n" not in str(err) and str(err).startswith(
        "PYTORCH_CUDA_ALLOC_CONF='max_split_size_mb:8': CachingAllocator option max_split_size_mb too small")
    assert "fix or unset the variable" in str(err)
    assert "x" not in ip.user_ns  # nothing ran
