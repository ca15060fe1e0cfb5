"""A model of the CUDA caching allocator's default configuration ("reserved" memory).

Pure Python, no torch. It replays the allocations and frees a simulated run makes and
keeps the segments (``cudaMalloc`` calls) the real allocator would hold, following the
constants and rules of c10's ``CUDACachingAllocator.cpp`` with default settings (no
``expandable_segments``, no ``max_split_size_mb``, no ``garbage_collection_threshold``):

* a request rounds up to a multiple of 512 B (at least 512 B);
* requests of at most 1 MiB come from the small pool, whose segments are 2 MiB;
* larger requests come from the large pool: below 10 MiB a new segment is 20 MiB,
  from 10 MiB on the request is rounded up to a multiple of 2 MiB;
* a free block is found best-fit (smallest block that is large enough, then lowest
  address); it is split when the rest is at least 512 B (small pool) or more than 1 MiB
  (large pool); freed blocks merge with free neighbours in the same segment;
* when a new segment would not fit the card, every fully free cached segment is
  released first (what ``empty_cache`` does) and the allocation is retried.

It does not model streams, CUDA graphs, or memory other processes or the CUDA context
(hundreds of MiB) take on the card.

While a log is on (:meth:`CachingAllocatorModel.start_log`), every action is recorded as
the CUDA allocator's history records it (``torch.cuda.memory._record_memory_history``):
"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free" and "oom",
with the model's addresses; :meth:`~CachingAllocatorModel.take_log` returns them with
the segments and blocks held at that moment (what ``torch.cuda.memory._snapshot()``
calls "segments"). :mod:`memmagic.snapshot` writes both as a memory_viz snapshot.

:meth:`~CachingAllocatorModel.memory_stats` keeps the allocator's own statistics under
``torch.cuda.memory_stats()``'s names ("allocated_bytes.all.current",
"inactive_split.small_pool.peak", "num_alloc_retries", ...), updated where
``CUDACachingAllocator.cpp`` updates them, so ``torch.cuda.memory_summary()`` can print
its table from them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["CachingAllocatorModel", "AllocatorLog", "round_request", "segment_size", "AllocatorFull",
           "STAT_NAMES",
           "MIN_BLOCK", "SMALL_SIZE", "SMALL_BUFFER", "LARGE_BUFFER", "MIN_LARGE_ALLOC",
           "ROUND_LARGE"]

MIN_BLOCK = 512                 # kMinBlockSize: every request rounds up to this multiple
SMALL_SIZE = 1 << 20            # kSmallSize: largest request served by the small pool
SMALL_BUFFER = 2 << 20          # kSmallBuffer: small-pool segment size
LARGE_BUFFER = 20 << 20         # kLargeBuffer: segment size for requests below 10 MiB
MIN_LARGE_ALLOC = 10 << 20      # kMinLargeAlloc
ROUND_LARGE = 2 << 20           # kRoundLarge: larger segments round up to this


# the per-pool statistics of torch.cuda.memory_stats(), each with current, peak, allocated
# (sum of increases) and freed (sum of decreases) for the pools all, small_pool, large_pool
STAT_NAMES = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
              "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
_POOLS = ("all", "small_pool", "large_pool")
_FIELDS = ("current", "peak", "allocated", "freed")
_EVENT_COUNTS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
                 "num_device_free")
# where each statistic's four fields start in a pool's row; with one stream "active"
# blocks are the allocated ones, so active and active_bytes read allocation's fields
_ALLOCATION, _ALLOCATED_BYTES, _REQUESTED, _SEGMENT, _RESERVED, _SPLIT, _SPLIT_BYTES = range(0, 28, 4)
_ROW = 28
_STAT_AT = {"allocation": _ALLOCATION, "active": _ALLOCATION, "allocated_bytes": _ALLOCATED_BYTES,
            "active_bytes": _ALLOCATED_BYTES, "requested_bytes": _REQUESTED, "segment": _SEGMENT,
            "reserved_bytes": _RESERVED, "inactive_split": _SPLIT,
            "inactive_split_bytes": _SPLIT_BYTES}


def round_request(nbytes: int) -> int:
    """Bytes the allocator hands out for a request of ``nbytes`` (0 stays 0)."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    """Size of the segment ``cudaMalloc``-ed for a (rounded) request that found no block."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class AllocatorFull(Exception):
    """A request does not fit on the card even after releasing the cached segments."""

    def __init__(self, size: int, allocated: int, reserved: int, capacity: int) -> None:
        super().__init__(size)
        self.size, self.allocated, self.reserved, self.capacity = size, allocated, reserved, capacity


@dataclass(eq=False)
class _Block:
    addr: int
    size: int
    segment: "_Segment"
    free: bool = True
    prev: "_Block | None" = None
    next: "_Block | None" = None
    requested: int = 0          # bytes asked for (while allocated)
    key: object = None          # who holds it (while allocated)


@dataclass(frozen=True)
class AllocatorLog:
    """What the model did while its log was on, and what it held when the log was taken.

    ``entries``: one dict per action, in order: ``action`` ("alloc", "free_requested",
    "free_completed", "segment_alloc", "segment_free", "oom"), ``addr`` (absent for
    "oom"), ``size`` (bytes requested for an alloc or free, the segment's size, or the
    failed request), ``key`` (who the block is for: the tracker's storage serial; None
    for segments), ``op`` (the log's clock when it happened: the op index in a simulated
    run) and, for "oom", ``device_free`` (capacity less reserved bytes).
    ``segments``: one dict per segment held at the end: ``address``, ``total_size``,
    ``small`` and ``blocks`` (``address``, ``size``, ``requested``, ``key``, ``allocated``)
    in address order. All sizes in bytes.
    """

    entries: list[dict]
    segments: list[dict]


@dataclass(eq=False)
class _Segment:
    addr: int
    size: int
    small: bool
    blocks_in_use: int = 0
    head: _Block | None = field(default=None, repr=False)


class CachingAllocatorModel:
    """Replays alloc/free calls; ``reserved`` and ``reserved_peak`` are in bytes.

    ``capacity`` (bytes, or None for no limit) is the card's memory: a request that would
    need more first releases the cached free segments and retries, as the CUDA allocator
    does, then raises :class:`AllocatorFull` with nothing recorded (a failed request never
    counts in ``allocated`` or ``reserved``, which stay within the card).
    """

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self._free: dict[bool, list[tuple[int, int, _Block]]] = {True: [], False: []}
        self._segments: list[_Segment] = []
        self._live: dict[object, _Block] = {}
        self._next_addr = 1 << 40
        self.allocated = 0
        self.reserved = 0
        self.allocated_peak = 0
        self.reserved_peak = 0
        self.segments_peak = 0
        self.num_alloc_retries = 0
        self._log: list[dict] | None = None
        self._clock: Callable[[], int] | None = None
        # torch.cuda.memory_stats(): one row of ints per pool (all, small, large), each
        # statistic's [current, peak, allocated, freed] at its offset (_STAT_AT)
        self._rows: list[list[int]] = [[0] * _ROW for _ in _POOLS]
        self._counts: dict[str, int] = dict.fromkeys(_EVENT_COUNTS, 0)

    # -- torch.cuda.memory_stats() --------------------------------------------------------
    # (on every malloc and free: kept to a few list operations)
    def _bump(self, at: int, small: bool, delta: int) -> None:
        rows = self._rows
        for r in (rows[0], rows[1] if small else rows[2]):
            v = r[at] + delta
            r[at] = v
            if delta > 0:
                r[at + 2] += delta
                if v > r[at + 1]:
                    r[at + 1] = v
            else:
                r[at + 3] -= delta

    def _count_block(self, small: bool, size: int, requested: int) -> None:
        """A block of ``size`` bytes (``requested`` asked for) was handed out."""
        rows = self._rows
        for r in (rows[0], rows[1] if small else rows[2]):
            v = r[0] + 1
            r[0] = v
            r[2] += 1
            if v > r[1]:
                r[1] = v
            v = r[4] + size
            r[4] = v
            r[6] += size
            if v > r[5]:
                r[5] = v
            v = r[8] + requested
            r[8] = v
            r[10] += requested
            if v > r[9]:
                r[9] = v

    def _uncount_block(self, small: bool, size: int, requested: int) -> None:
        rows = self._rows
        for r in (rows[0], rows[1] if small else rows[2]):
            r[0] -= 1
            r[3] += 1
            r[4] -= size
            r[7] += size
            r[8] -= requested
            r[11] += requested

    def _split_free(self, b: _Block, sign: int) -> None:
        """Count ``b`` (free, in a segment of several blocks) in or out of inactive_split."""
        small = b.segment.small
        self._bump(_SPLIT, small, sign)
        self._bump(_SPLIT_BYTES, small, sign * b.size)

    def memory_stats(self) -> dict[str, int]:
        """The model's statistics as ``torch.cuda.memory_stats()`` names them (sorted keys,
        as torch returns them); "oversize_*" are 0 (no ``max_split_size_mb``)."""
        out: dict[str, int] = {}
        for name in STAT_NAMES:
            at = _STAT_AT[name]
            for pool, row in zip(_POOLS, self._rows):
                for i, fld in enumerate(_FIELDS):
                    out[f"{name}.{pool}.{fld}"] = row[at + i]
        for name in ("oversize_allocations", "oversize_segments"):
            for fld in _FIELDS:
                out[f"{name}.{fld}"] = 0
        out.update(self._counts)
        out["max_split_size"] = -1
        return dict(sorted(out.items()))

    def reset_peak_stats(self) -> None:
        """``torch.cuda.reset_peak_memory_stats()``: every peak becomes its current value."""
        for row in self._rows:
            for at in range(0, _ROW, 4):
                row[at + 1] = row[at]

    def reset_accumulated_stats(self) -> None:
        """``torch.cuda.reset_accumulated_memory_stats()``: the allocated and freed sums and
        the event counts start again from 0."""
        for row in self._rows:
            for at in range(0, _ROW, 4):
                row[at + 2] = row[at + 3] = 0
        self._counts = dict.fromkeys(_EVENT_COUNTS, 0)

    # -- history --------------------------------------------------------------------------
    def start_log(self, clock: Callable[[], int] | None = None) -> None:
        """Record every action from now on in a fresh log; ``clock()`` (if given) stamps
        each entry's ``op``."""
        self._log, self._clock = [], clock

    def stop_log(self) -> None:
        """Stop recording and drop the log."""
        self._log, self._clock = None, None

    @property
    def logging(self) -> bool:
        return self._log is not None

    def take_log(self, *, keep_logging: bool = False) -> AllocatorLog:
        """The log so far and the segments held now; the log stops unless
        ``keep_logging`` (then the entries are a copy and recording goes on)."""
        entries = list(self._log or ())
        if not keep_logging:
            self.stop_log()
        segments = []
        for seg in sorted(self._segments, key=lambda g: g.addr):
            blocks = []
            b = seg.head
            while b is not None:
                blocks.append({"address": b.addr, "size": b.size,
                               "requested": 0 if b.free else b.requested,
                               "key": None if b.free else b.key, "allocated": not b.free})
                b = b.next
            segments.append({"address": seg.addr, "total_size": seg.size, "small": seg.small,
                             "blocks": blocks})
        return AllocatorLog(entries, segments)

    def _record(self, action: str, addr: int | None, size: int, key: object = None,
                **extra: int) -> None:
        entry = {"action": action, "addr": addr, "size": size, "key": key,
                 "op": self._clock() if self._clock is not None else None}
        if addr is None:
            del entry["addr"]
        entry.update(extra)
        self._log.append(entry)  # type: ignore[union-attr]

    # -- free lists ---------------------------------------------------------------------
    def _insert_free(self, b: _Block) -> None:
        b.free = True
        bisect.insort(self._free[b.segment.small], (b.size, b.addr, b))

    def _remove_free(self, b: _Block) -> None:
        lst = self._free[b.segment.small]
        i = bisect.bisect_left(lst, (b.size, b.addr))
        while lst[i][2] is not b:
            i += 1
        del lst[i]

    # -- public -------------------------------------------------------------------------
    def malloc(self, key: object, nbytes: int, requested: int | None = None) -> int:
        """Allocate ``nbytes`` for ``key``; return the rounded size handed out.
        ``requested``: the bytes the caller asked for when ``nbytes`` is already rounded
        (what the history and "requested_bytes" record; ``nbytes`` by default)."""
        size = round_request(nbytes)
        if size == 0:
            return 0
        if requested is None:
            requested = nbytes
        small = size <= SMALL_SIZE
        lst = self._free[small]
        i = bisect.bisect_left(lst, (size, -1))
        if i < len(lst):
            block = lst[i][2]
            del lst[i]
            if block.prev is not None or block.next is not None:
                self._split_free(block, -1)
        else:
            seg_size = segment_size(size)
            if self.capacity is not None and self.reserved + seg_size > self.capacity:
                self.empty_cache()
                self.num_alloc_retries += 1
                self._counts["num_alloc_retries"] += 1
                if self.reserved + seg_size > self.capacity:
                    self._counts["num_ooms"] += 1
                    if self._log is not None:
                        self._record("oom", None, nbytes,
                                     device_free=max(self.capacity - self.reserved, 0))
                    raise AllocatorFull(size, self.allocated, self.reserved, self.capacity)
            block = self._new_segment(seg_size, small)
        block.free = False
        rest = block.size - size
        if (small and rest >= MIN_BLOCK) or (not small and rest > SMALL_SIZE):
            tail = _Block(block.addr + size, rest, block.segment, True, block, block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            block.size = size
            self._insert_free(tail)
            self._split_free(tail, 1)
        block.segment.blocks_in_use += 1
        block.requested, block.key = requested, key
        self._live[key] = block
        if self._log is not None:
            self._record("alloc", block.addr, requested, key)
        self._count_block(small, block.size, requested)
        self.allocated += block.size
        self.allocated_peak = max(self.allocated_peak, self.allocated)
        return block.size

    def free(self, key: object) -> None:
        """Return ``key``'s block to the cache (no-op for unknown keys)."""
        block = self._live.pop(key, None)
        if block is None:
            return
        if self._log is not None:
            self._record("free_requested", block.addr, block.requested, key)
            self._record("free_completed", block.addr, block.requested, key)
        small = block.segment.small
        self._uncount_block(small, block.size, block.requested)
        block.requested, block.key = 0, None
        self.allocated -= block.size
        block.segment.blocks_in_use -= 1
        for nb in (block.prev, block.next):  # merge with free neighbours
            if nb is not None and nb.free:
                self._remove_free(nb)
                self._split_free(nb, -1)
                if nb is block.prev:
                    nb.size += block.size
                    nb.next = block.next
                    if block.next is not None:
                        block.next.prev = nb
                    block = nb
                else:
                    block.size += nb.size
                    block.next = nb.next
                    if nb.next is not None:
                        nb.next.prev = block
        self._insert_free(block)
        if block.prev is not None or block.next is not None:
            self._split_free(block, 1)

    def copy(self, rekey: dict) -> "CachingAllocatorModel":
        """A copy with the same segments, blocks and addresses (no log): the block of each
        key in ``rekey`` is held by ``rekey[key]`` in the copy; blocks of other keys are
        freed there (cached, as a free would leave them)."""
        new = CachingAllocatorModel(self.capacity)
        new._next_addr = self._next_addr
        new.allocated, new.reserved = self.allocated, self.reserved
        new.allocated_peak, new.reserved_peak = self.allocated, self.reserved
        new.segments_peak = len(self._segments)
        blocks: dict[int, _Block] = {}  # id(old block) -> its copy
        segments: list[_Segment] = []
        for seg in self._segments:
            s2 = _Segment(seg.addr, seg.size, seg.small, seg.blocks_in_use)
            segments.append(s2)
            prev, b = None, seg.head
            while b is not None:
                c = _Block(b.addr, b.size, s2, b.free, prev, None, b.requested, b.key)
                if prev is None:
                    s2.head = c
                else:
                    prev.next = c
                blocks[id(b)] = prev = c
                b = b.next
        new._adopt(segments)
        # the statistics as they stand now, peaks at their current values, no history
        new._rows = [[row[at] if i < 2 else 0 for at in range(0, _ROW, 4) for i in range(4)]
                     for row in self._rows]
        for small, lst in self._free.items():
            new._free[small] = [(size, addr, blocks[id(b)]) for size, addr, b in lst]
        unmapped = []
        for key, b in self._live.items():
            c = blocks[id(b)]
            if key in rekey:
                c.key = rekey[key]
                new._live[c.key] = c
            else:
                new._live[key] = c
                unmapped.append(key)
        for key in unmapped:
            new.free(key)
        return new

    def _adopt(self, segments: list[_Segment]) -> None:
        self._segments = segments

    def size_of(self, key: object) -> int:
        block = self._live.get(key)
        return 0 if block is None else block.size

    def empty_cache(self) -> int:
        """Release every segment with no block in use; return the bytes released."""
        released = 0
        keep = []
        for seg in self._segments:
            if seg.blocks_in_use == 0:
                self._remove_free(seg.head)
                released += seg.size
                self._bump(_SEGMENT, seg.small, -1)
                self._bump(_RESERVED, seg.small, -seg.size)
                self._counts["num_device_free"] += 1
                if self._log is not None:
                    self._record("segment_free", seg.addr, seg.size)
            else:
                keep.append(seg)
        self._segments = keep
        self.reserved -= released
        return released

    @property
    def segments(self) -> int:
        return len(self._segments)

    def _new_segment(self, seg_size: int, small: bool) -> _Block:
        seg = _Segment(self._next_addr, seg_size, small)
        self._next_addr += seg_size + (1 << 21)
        block = _Block(seg.addr, seg_size, seg, True)
        seg.head = block
        self._segments.append(seg)
        if self._log is not None:
            self._record("segment_alloc", seg.addr, seg_size)
        self._bump(_SEGMENT, small, 1)
        self._bump(_RESERVED, small, seg_size)
        self._counts["num_device_alloc"] += 1
        self.reserved += seg_size
        self.reserved_peak = max(self.reserved_peak, self.reserved)
        self.segments_peak = max(self.segments_peak, len(self._segments))
        return block
