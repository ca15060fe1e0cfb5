"""The caching-allocator model (pure Python)."""

from __future__ import annotations

import pytest

from memmagic.backends.sim.allocator import (
    AllocatorFull,
    CachingAllocatorModel,
    round_request,
    segment_size,
)

MiB = 1 << 20


def test_rounding_and_segment_sizes():
    assert round_request(0) == 0
    assert round_request(1) == 512
    assert round_request(513) == 1024
    assert segment_size(512) == 2 * MiB
    assert segment_size(MiB) == 2 * MiB
    assert segment_size(MiB + 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB
    assert segment_size(11 * MiB + 1) == 12 * MiB


def test_small_requests_share_a_2mib_segment():
    a = CachingAllocatorModel()
    for i in range(4):
        a.malloc(i, 1000)
    assert a.reserved == 2 * MiB and a.allocated == 4 * 1024


def test_best_fit_reuses_freed_block_and_merges_neighbours():
    a = CachingAllocatorModel()
    a.malloc("a", 3 * MiB)   # 20 MiB segment, split
    a.malloc("b", 3 * MiB)
    assert a.reserved == 20 * MiB
    a.free("a")
    a.free("b")               # merges back into one 20 MiB block
    a.malloc("c", 15 * MiB)   # 15 MiB >= 10 MiB fits the merged cached block
    assert a.reserved == 20 * MiB


def test_large_pool_does_not_split_small_remainders():
    a = CachingAllocatorModel()
    a.malloc("x", 12 * MiB)   # exactly a 12 MiB segment
    a.free("x")
    a.malloc("y", 11 * MiB + 512)  # remainder < 1 MiB: not split, whole 12 MiB block used
    assert a.size_of("y") == 12 * MiB
    assert a.reserved == 12 * MiB


def test_empty_cache_releases_only_free_segments():
    a = CachingAllocatorModel()
    a.malloc("a", 12 * MiB)
    a.malloc("b", 100)
    a.free("a")
    assert a.empty_cache() == 12 * MiB
    assert a.reserved == 2 * MiB


def test_out_of_memory_after_releasing_cache():
    a = CachingAllocatorModel(capacity=30 * MiB)
    a.malloc("a", 12 * MiB)
    a.free("a")
    a.malloc("b", 16 * MiB)   # fits next to the cached 12 MiB segment
    assert a.reserved == 28 * MiB
    with pytest.raises(AllocatorFull) as info:
        a.malloc("c", 16 * MiB)  # releases the cached 12 MiB first; 32 MiB still > 30
    assert info.value.size == 16 * MiB
    # the cache was released and retried, as CUDA does; the failed request is not recorded
    assert a.reserved == 16 * MiB and a.allocated == 16 * MiB and a.num_alloc_retries == 1
    assert (info.value.allocated, info.value.reserved, info.value.capacity) == (16 * MiB, 16 * MiB, 30 * MiB)


def test_a_copy_has_the_same_blocks_under_new_keys_and_frees_the_rest():
    a = CachingAllocatorModel(capacity=1 << 30)
    for k, n in ((1, 3 << 20), (2, 1000), (3, 12 << 20), (4, 5000)):
        a.malloc(k, n)
    a.free(3)  # a cached free block
    b = a.copy({1: 11, 2: 12})  # 4 is not copied: freed in the copy
    assert b.reserved == a.reserved and b.segments == a.segments
    assert b.allocated == a.allocated - a.size_of(4)
    assert b.size_of(11) == a.size_of(1) and b.size_of(1) == 0 and b.size_of(4) == 0
    la, lb = a.take_log(), b.take_log()
    assert [s["address"] for s in la.segments] == [s["address"] for s in lb.segments]
    # the copy and the original go on alike, apart from each other
    assert a.malloc(5, 12 << 20) == b.malloc(5, 12 << 20) and a.reserved == b.reserved
    b.free(11)
    b.free(5)
    assert a.size_of(1) > 0 and a.size_of(5) > 0
    assert b.empty_cache() == 20 * MiB and b.reserved == a.reserved - 20 * MiB
