"""A model of the CUDA caching allocator ("reserved" memory).

Pure Python, no torch. It replays the allocations and frees a simulated run makes and
keeps the segments (``cudaMalloc`` calls) the real allocator would hold, following the
constants and rules of c10's ``CUDACachingAllocator.cpp``. With default settings:

* a request rounds up to a multiple of 512 B (at least 512 B);
* requests of at most 1 MiB come from the small pool, whose segments are 2 MiB;
* larger requests come from the large pool: below 10 MiB a new segment is 20 MiB,
  from 10 MiB on the request is rounded up to a multiple of 2 MiB;
* a free block is found best-fit (smallest block that is large enough, then lowest
  address); it is split when the rest is at least 512 B (small pool) or more than 1 MiB
  (large pool); freed blocks merge with free neighbours in the same segment;
* when a new segment would not fit the card, every fully free cached segment is
  released first (what ``empty_cache`` does) and the allocation is retried;
* segments lie where the CUDA driver puts ``cudaMalloc``'s memory (:class:`_AddressSpace`):
  newer segments at lower addresses, so that best fit's tie-break (the lowest address among
  blocks of the same size) takes the newest segment's block, as on a GPU.

Of the settings ``PYTORCH_CUDA_ALLOC_CONF`` takes (:func:`parse_alloc_conf`,
:class:`AllocatorConfig`) it follows ``max_split_size_mb``, ``max_non_split_rounding_mb``
and ``garbage_collection_threshold`` as the C++ does (see :class:`CachingAllocatorModel`);
``expandable_segments:True``, ``roundup_power2_divisions``, ``large_segment_size_mb``,
``backend:cudaMallocAsync`` and the pinned-memory options are not modelled (the config
names them in :attr:`AllocatorConfig.unmodelled`).

It does not model streams, CUDA graphs, or memory other processes or the CUDA context
(hundreds of MiB) take on the card.

While a log is on (:meth:`CachingAllocatorModel.start_log`), every action is recorded as
the CUDA allocator's history records it (``torch.cuda.memory._record_memory_history``):
"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free" and "oom",
with the model's addresses; :meth:`~CachingAllocatorModel.take_log` returns them with
the segments and blocks held at that moment (what ``torch.cuda.memory._snapshot()``
calls "segments"). :mod:`memmagic.core.snapshot` writes both as a memory_viz snapshot.

:meth:`~CachingAllocatorModel.memory_stats` keeps the allocator's own statistics under
``torch.cuda.memory_stats()``'s names ("allocated_bytes.all.current",
"inactive_split.small_pool.peak", "num_alloc_retries", ...), updated where
``CUDACachingAllocator.cpp`` updates them, so ``torch.cuda.memory_summary()`` can print
its table from them.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from ...core.interrupts import atomic

__all__ = ["CachingAllocatorModel", "AllocatorLog", "round_request", "segment_size", "AllocatorFull",
           "STAT_NAMES", "AllocatorConfig", "parse_alloc_conf", "alloc_conf_from_env",
           "ALLOC_CONF_VARS", "SIZE_MAX",
           "MIN_BLOCK", "SMALL_SIZE", "SMALL_BUFFER", "LARGE_BUFFER", "MIN_LARGE_ALLOC",
           "ROUND_LARGE"]

MIN_BLOCK = 512                 # kMinBlockSize: every request rounds up to this multiple
SMALL_SIZE = 1 << 20            # kSmallSize: largest request served by the small pool
SMALL_BUFFER = 2 << 20          # kSmallBuffer: small-pool segment size
LARGE_BUFFER = 20 << 20         # kLargeBuffer: segment size for requests below 10 MiB
MIN_LARGE_ALLOC = 10 << 20      # kMinLargeAlloc
ROUND_LARGE = 2 << 20           # kRoundLarge: larger segments round up to this
SIZE_MAX = (1 << 64) - 1        # std::numeric_limits<size_t>::max(): max_split_size unset
ADDRESS_TOP = 1 << 47           # the model's address space ends here and grows down
ADDRESS_STEP = 32 << 20         # the driver reserves new address space in 32 MiB steps
_MB = 1 << 20                   # kMB of c10/core/AllocatorConfig.cpp


# -- PYTORCH_CUDA_ALLOC_CONF ---------------------------------------------------------------
# AcceleratorAllocatorConfig::instance() (c10/core/AllocatorConfig.cpp) reads the first of
# these that is set (even when set to ""), once, when the allocator is first used
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
# every key torch's parsers accept (AcceleratorAllocatorConfig::getKeys() and the CUDA
# hook's CUDAAllocatorConfig::getKeys(), torch 2.13); any other key makes torch refuse the
# settings ("Unrecognized key ... in Accelerator allocator config.")
_TORCH_KEYS = frozenset((
    "large_segment_size_mb", "max_split_size_mb", "max_non_split_rounding_mb",
    "garbage_collection_threshold", "roundup_power2_divisions", "expandable_segments",
    "pinned_use_background_threads", "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb",
    "backend", "release_lock_on_cudamalloc", "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
    "graph_capture_record_stream_reuse", "pinned_reserve_segment_size_mb",
    "pinned_num_register_threads", "per_process_memory_fraction", "pinned_free_catch_all",
    "throw_on_cudamalloc_oom"))


@dataclass(frozen=True)
class AllocatorConfig:
    """The allocator settings of ``PYTORCH_CUDA_ALLOC_CONF`` the model follows (sizes in
    bytes), as c10's ``AcceleratorAllocatorConfig::parseArgs`` reads them.

    ``max_split_size``: blocks of this size or more are "oversize" (``SIZE_MAX``: unset);
    ``max_non_split_rounding_size``: how much larger than an oversize request a cached
    oversize block may be; ``garbage_collection_threshold``: 0 (off) or the share of the
    allowed memory above which cached blocks are released before a new segment (only once
    ``set_per_process_memory_fraction`` was called, as in torch). ``source``: the text the
    settings came from ("NAME=value", "" for the defaults). ``unmodelled``: the settings
    given that the model does not follow, each as written ("key:value"), unknown keys
    marked so; ``modelled``: the others.
    """

    max_split_size: int = SIZE_MAX
    max_non_split_rounding_size: int = LARGE_BUFFER
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    source: str = ""
    unmodelled: tuple[str, ...] = ()
    modelled: tuple[str, ...] = ()

    @property
    def is_default(self) -> bool:
        """True when the model behaves exactly as with no settings."""
        return (self.max_split_size == SIZE_MAX and self.garbage_collection_threshold == 0.0
                and self.max_non_split_rounding_size == LARGE_BUFFER)


def _tokens(text: str) -> list[str]:
    """c10's ConfigTokenizer: ',', ':', '[' and ']' are tokens of their own, whitespace
    is dropped, anything else runs together into one token."""
    out: list[str] = []
    buf: list[str] = []
    for ch in text:
        if ch in ",:[]":
            if buf:
                out.append("".join(buf))
                buf = []
            out.append(ch)
        elif not ch.isspace():
            buf.append(ch)
    if buf:
        out.append("".join(buf))
    return out


class _ConfigTokens:
    """The tokens of an allocator configuration, read as c10's ``ConfigTokenizer`` reads
    them; every refusal is a one-line ValueError naming ``where`` (the variable)."""

    def __init__(self, text: str, where: str) -> None:
        self.tok = _tokens(text)
        self.where = where
        self.large = LARGE_BUFFER  # large_segment_size_mb (see megabytes)

    def __len__(self) -> int:
        return len(self.tok)

    def fail(self, msg: str) -> ValueError:
        return ValueError(f"{self.where}: {msg}")

    def at(self, i: int) -> str:
        if i >= len(self.tok):
            raise self.fail("the settings end too early (Index out of bounds in ConfigTokenizer)")
        return self.tok[i]

    def colon(self, i: int) -> int:  # checkToken(++i, ":")
        if self.at(i + 1) != ":":
            raise self.fail(f"expected ':' after {self.tok[i]!r}")
        return i + 1

    def size_t(self, i: int) -> int:  # ConfigTokenizer::toSizeT: std::stoull
        m = re.match(r"\+?\d+", self.at(i))
        if m is None:
            raise self.fail(f"expected a whole number, not {self.tok[i]!r}")
        return int(m.group())

    def double(self, i: int) -> float:  # ConfigTokenizer::toDouble: std::stod
        m = re.match(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", self.at(i))
        if m is None:
            raise self.fail(f"expected a number, not {self.tok[i]!r}")
        return float(m.group())

    def boolean(self, i: int) -> bool:  # ConfigTokenizer::toBool
        v = self.at(i)
        if v not in ("True", "False"):
            raise self.fail(f"Expected 'True' or 'False' at index {i} in ConfigTokenizer but got '{v}'")
        return v == "True"

    def skip(self, i: int) -> int:  # ConfigTokenizer::skipKey: to the value, or the closing ']'
        tok = self.tok
        i = self.colon(i) + 1
        if self.at(i) == "[":
            while i + 1 < len(tok) and tok[i + 1] != "]":
                i += 1
            i += 1
            if i >= len(tok):
                raise self.fail("Expected closing bracket ']' in ConfigTokenizer but reached end of config")
        return i

    def megabytes(self, i: int) -> tuple[int, int]:
        """"key:N" in MB, at least the large segment size: (the value's index, bytes)."""
        j = self.colon(i) + 1
        v = self.size_t(j)
        if v < self.large // _MB:
            raise self.fail(f"CachingAllocator option {self.tok[i]} too small, must be >= {self.large // _MB}")
        return j, min(v, SIZE_MAX // _MB) * _MB

    def read_large_segment_size(self) -> None:
        """large_segment_size_mb is read first: the smallest max_split_size_mb and the
        default max_non_split_rounding_mb follow it (parseLargeSegmentSize)."""
        tok, i = self.tok, 0
        while i < len(tok):
            if tok[i] == "large_segment_size_mb":
                i = self.colon(i)
                v = self.size_t(i + 1)
                if not v > MIN_LARGE_ALLOC // _MB:
                    raise self.fail(f"CachingAllocator option large_segment_size_mb must be > "
                                    f"{MIN_LARGE_ALLOC // _MB} MB")
                self.large = min(v, SIZE_MAX // _MB) * _MB
                i += 1
            i += 1


def parse_alloc_conf(text: str, source: str = "PYTORCH_CUDA_ALLOC_CONF") -> AllocatorConfig:
    """The settings of an allocator configuration string ("max_split_size_mb:128,
    garbage_collection_threshold:0.6"), checked as c10's ``AcceleratorAllocatorConfig::
    parseArgs`` checks them. A value torch refuses raises a one-line ValueError with
    torch's words (``source`` names the variable in it). Keys torch does not know, and
    options the model does not follow, are kept in ``unmodelled``, not refused."""
    t = _ConfigTokens(text, f"{source}={text!r}" if text else source)
    t.read_large_segment_size()
    values = {"max_split": SIZE_MAX, "rounding": t.large, "gc": 0.0, "expandable": False}
    unmodelled: list[str] = []
    modelled: list[str] = []
    tok, i = t.tok, 0
    while i < len(tok):
        key, start = tok[i], i
        i, follows = _parse_option(t, i, values)
        text_kv = "".join(tok[start:i + 1])
        if follows:
            modelled.append(text_kv)
        else:
            unmodelled.append(text_kv if key in _TORCH_KEYS else f"{text_kv} (unknown to torch)")
        if i + 1 < len(tok):
            if tok[i + 1] != ",":
                raise t.fail(f"expected ',' after {text_kv!r}")
            i += 1
        i += 1
    return AllocatorConfig(values["max_split"], values["rounding"], values["gc"],
                           values["expandable"],
                           f"{source}={text}" if (unmodelled or modelled) else "",
                           tuple(unmodelled), tuple(modelled))


def _parse_option(t: _ConfigTokens, i: int, values: dict[str, Any]) -> tuple[int, bool]:
    """Read the option at token ``i`` into ``values``: (the index of its last token,
    whether the model follows it)."""
    key, tok = t.tok[i], t.tok
    follows = True
    if key == "max_split_size_mb":  # parseMaxSplitSize
        i, values["max_split"] = t.megabytes(i)
    elif key == "max_non_split_rounding_mb":  # parseMaxNonSplitRoundingSize
        i, values["rounding"] = t.megabytes(i)
    elif key == "garbage_collection_threshold":  # parseGarbageCollectionThreshold
        i = t.colon(i) + 1
        v = t.double(i)
        if not 0 < v < 1.0:
            raise t.fail("garbage_collect_threshold is invalid, set it in (0.0, 1.0)")
        values["gc"] = v
    elif key == "expandable_segments":  # parseExpandableSegments
        i = t.colon(i) + 1
        values["expandable"] = t.boolean(i)
        follows = not values["expandable"]  # growing segments are not modelled
    elif key == "backend":  # CUDAAllocatorConfig::parseAllocatorConfig
        i = t.colon(i) + 1
        if t.at(i) not in ("native", "cudaMallocAsync"):
            raise t.fail("Unknown allocator backend, options are native and cudaMallocAsync")
        follows = tok[i] == "native"  # cudaMallocAsync: CUDA's own pool, not modelled
    elif key in ("release_lock_on_cudamalloc", "release_lock_on_hipmalloc"):
        i = t.colon(i) + 1
        t.boolean(i)  # only whether the lock is held around cudaMalloc: no memory effect
    elif key in (",", ":", "[", "]"):
        raise t.fail(f"unexpected {key!r} at index {i}")
    else:  # roundup_power2_divisions, large_segment_size_mb, the pinned-memory options,
        # per_process_memory_fraction, ... and keys torch does not know
        i = t.skip(i)
        follows = False
    return i, follows



def alloc_conf_from_env(environ=None) -> AllocatorConfig:
    """The allocator settings of the environment, as torch reads them when CUDA starts:
    the first of :data:`ALLOC_CONF_VARS` that is set. Raises ValueError for values torch
    refuses."""
    import os

    env = os.environ if environ is None else environ
    for name in ALLOC_CONF_VARS:
        value = env.get(name)
        if value is not None:
            return parse_alloc_conf(value, name)
    return AllocatorConfig()


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


def _stat_add(row: list[int], at: int, delta: int) -> None:
    """The statistic at ``row[at:at + 4]`` (current, peak, allocated, freed) changes by
    ``delta``, as c10's ``Stat::increase`` / ``decrease`` count it."""
    v = row[at] + delta
    row[at] = v
    if delta > 0:
        row[at + 2] += delta
        if v > row[at + 1]:
            row[at + 1] = v
    else:
        row[at + 3] -= delta


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
@atomic
class _Block:
    addr: int
    size: int
    segment: "_Segment"
    free: bool = True
    prev: "_Block | None" = None
    next: "_Block | None" = None
    requested: int = 0          # bytes asked for (while allocated)
    key: object = None          # who holds it (while allocated)
    # the pool's get_free_block count when it was last put in the free list (Block::
    # gc_count_base); a class default, set on the instance only while garbage collection
    # is on (the counts stay 0 until then, so 0 is every earlier block's base)
    gc_base = 0


@dataclass(frozen=True)
@atomic
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
    # the model as the log began (a copy) and the entry from which the peaks count (a
    # what-if knob's setup before it): what replay() starts from
    start: "CachingAllocatorModel | None" = None
    restart: int = 0

    def replay(self, sizes: Sequence[int], capacity: int | None = None,
               entries: Sequence[dict] | None = None, restart: int | None = None
               ) -> tuple[int, int] | None:
        """The allocated and reserved peaks (from entry ``restart`` on) of this log's allocs
        and frees done again on a copy of the model it began from, the allocs' sizes
        replaced by ``sizes`` (one per "alloc" entry, in order); None when the log cannot
        be replayed (no start, an out of memory, or a request that does not fit).
        ``capacity``: the bytes the copy may reserve instead of the model's (a card of
        that size: cached blocks are released before a request fails, as on a GPU).
        ``entries`` and ``restart``: other actions to replay from the same start (a run's
        at other sizes, with other transient buffers)."""
        model = self.replayed(sizes, capacity, entries, restart)
        return None if model is None else (model.allocated_peak, model.reserved_peak)

    def replayed(self, sizes: Sequence[int], capacity: int | None = None,
                 entries: Sequence[dict] | None = None, restart: int | None = None
                 ) -> "CachingAllocatorModel | None":
        """The copy of the model :meth:`replay` ends with (its peaks, what it holds at the
        end; it keeps no ``memory_stats()``, whose counts are a third of a replay's time),
        or None where it returns None."""
        if self.start is None:
            return None
        model = self.start.clone(stats=False)  # read for its peaks and what it holds only
        if capacity is not None:
            model.set_capacity(capacity, fraction=False)
        if entries is None:
            entries, restart = self.entries, self.restart
        elif restart is None:
            restart = len(entries)
        sizes_it = iter(sizes)
        try:
            for n, e in enumerate(entries):
                if n == restart:
                    model.restart_peaks()
                action = e["action"]
                if action == "alloc":
                    model.malloc(e["key"], next(sizes_it))
                elif action == "free_completed":
                    model.free(e["key"])
                elif action == "oom":
                    return None
        except AllocatorFull:
            return None
        if restart >= len(entries):
            model.restart_peaks()
        return model


@atomic
class _AddressSpace:
    """Where ``cudaMalloc`` puts a segment: the CUDA driver's virtual addresses, as the
    H100's allocation histories show them (driver 580, ``results/gpu-check-traces-*``).

    A new segment takes the lowest free range, inside the space already in use, that
    holds it; without one the space grows down by the segment's size rounded up to
    :data:`ADDRESS_STEP`, the segment at the bottom and the rest of the step free for later
    (smaller) segments. A released segment's range is free again (merged with free
    neighbours; free space at the bottom is given back). So a newer segment mostly lies
    below the older ones, and the caching allocator, which breaks best fit's ties by the
    lower address, takes the newest of several cached blocks of the same size: with the
    opposite order, replaying the H100's own allocations and frees of the llama fp16
    check kept one 500 MiB segment fewer at its reserved peak (5.41 GiB against the
    H100's 5.90).
    """

    __slots__ = ("bottom", "free")

    def __init__(self) -> None:
        self.bottom = ADDRESS_TOP
        self.free: list[list[int]] = []  # [start, end) ranges below ADDRESS_TOP, by address

    def clone(self) -> "_AddressSpace":
        new = _AddressSpace()
        new.bottom = self.bottom
        new.free = [list(r) for r in self.free]
        return new

    def take(self, size: int) -> int:
        """The address of a new segment of ``size`` bytes."""
        free = self.free
        for i, r in enumerate(free):
            if r[1] - r[0] >= size:
                addr = r[0]
                if r[1] - addr == size:
                    del free[i]
                else:
                    r[0] = addr + size
                return addr
        step = -(-size // ADDRESS_STEP) * ADDRESS_STEP
        self.bottom -= step
        if step > size:
            self.free.insert(0, [self.bottom + size, self.bottom + step])
        return self.bottom

    def give(self, addr: int, size: int) -> None:
        """A segment at ``addr`` of ``size`` bytes was released."""
        free = self.free
        i = bisect.bisect_left(free, [addr, addr])
        end = addr + size
        if i < len(free) and free[i][0] == end:  # merge with the range above
            end = free.pop(i)[1]
        if i > 0 and free[i - 1][1] == addr:  # and the one below
            free[i - 1][1] = end
        else:
            free.insert(i, [addr, end])
        if free[0][0] == self.bottom:  # free at the bottom: the space shrinks
            self.bottom = free.pop(0)[1]


@dataclass(eq=False)
@atomic
class _Segment:
    addr: int
    size: int
    small: bool
    blocks_in_use: int = 0
    head: _Block | None = field(default=None, repr=False)


_DEFAULT_CONFIG = AllocatorConfig()


@atomic
class CachingAllocatorModel:
    """Replays alloc/free calls; ``reserved`` and ``reserved_peak`` are in bytes.

    ``capacity`` (bytes, or None for no limit) is the card's memory: a request that would
    need more first releases the cached free segments and retries, as the CUDA allocator
    does, then raises :class:`AllocatorFull` with nothing recorded (a failed request never
    counts in ``allocated`` or ``reserved``, which stay within the card). Assigning
    ``capacity`` later is what ``torch.cuda.set_per_process_memory_fraction`` does (the
    C++ ``setMemoryFraction``: ``allowed_memory_maximum`` and ``set_fraction``);
    :meth:`set_capacity` sets it with or without that.

    ``config`` (:class:`AllocatorConfig`, the defaults when None) adds, as
    ``DeviceCachingAllocator`` in CUDACachingAllocator.cpp does:

    * ``max_split_size``: blocks of at least this size are "oversize". ``get_free_block``:
      a smaller request never takes an oversize cached block, an oversize request takes
      one only if it is less than ``max_non_split_rounding_size`` (20 MiB) larger.
      ``should_split``: a large-pool block is split only for a request below
      max_split_size. When a new segment does not fit, ``release_available_cached_blocks``
      first frees the smallest oversize cached block at least max(request,
      max_split_size) large, else oversize blocks from the largest down until that much is
      freed, and retries before ``release_cached_blocks`` (what ``empty_cache`` does).
      memory_stats' "oversize_allocations" and "oversize_segments" count them.
    * ``garbage_collection_threshold`` (only once a memory fraction is set, as in torch):
      each free-list search ages the pool's cached blocks by one (``get_free_block``
      counts ``get_free_blocks_call_count``); before a new segment, while reserved is
      above threshold x allowed memory, ``garbage_collect_cached_blocks`` frees the
      unsplit large-pool cached blocks at least as old as their average age, pass after
      pass, until that excess is reclaimed.
    """

    def __init__(self, capacity: int | None = None, config: AllocatorConfig | None = None) -> None:
        self._capacity = capacity
        self.fraction_set = False  # set_per_process_memory_fraction was called
        self.config = config = config if config is not None else _DEFAULT_CONFIG
        self._max_split = config.max_split_size
        self._round_limit = config.max_non_split_rounding_size
        self._gc_threshold = config.garbage_collection_threshold
        self._gc_on = False  # set_fraction && garbage_collection_threshold() > 0
        self._gc_calls = {True: 0, False: 0}  # each pool's get_free_blocks_call_count
        # oversize_allocations, then oversize_segments: current, peak, allocated, freed
        self._oversize = [0] * 8
        self._free: dict[bool, list[tuple[int, int, _Block]]] = {True: [], False: []}
        self._segments: list[_Segment] = []
        self._live: dict[object, _Block] = {}
        self._addresses = _AddressSpace()
        self.allocated = 0
        self.reserved = 0
        self.allocated_peak = 0
        self.reserved_peak = 0
        self.segments_peak = 0
        self.num_alloc_retries = 0
        self._log: list[dict] | None = None
        self._clock: Callable[[], int] | None = None
        self._log_start: CachingAllocatorModel | None = None
        self._log_restart = 0
        # torch.cuda.memory_stats(): one row of ints per pool (all, small, large), each
        # statistic's [current, peak, allocated, freed] at its offset (_STAT_AT)
        self._rows: list[list[int]] = [[0] * _ROW for _ in _POOLS]
        # False: a replay's copy (AllocatorLog.replayed), read for its peaks and what it
        # holds; its mallocs and frees skip memory_stats()' counts, which it then refuses
        self._stats = True
        self._counts: dict[str, int] = dict.fromkeys(_EVENT_COUNTS, 0)

    @property
    def capacity(self) -> int | None:
        return self._capacity

    @capacity.setter
    def capacity(self, value: int | None) -> None:
        self.set_capacity(value, fraction=True)

    def set_capacity(self, value: int | None, *, fraction: bool) -> None:
        """The bytes the allocator may reserve; ``fraction``: they are a share of the card
        set by ``set_per_process_memory_fraction`` (which garbage collection needs)."""
        self._capacity = value
        self.fraction_set = fraction
        self._gc_on = fraction and value is not None and self._gc_threshold > 0

    # -- torch.cuda.memory_stats() --------------------------------------------------------
    # (on every malloc and free: kept to a few list operations)
    def _bump_oversize(self, at: int, delta: int) -> None:
        _stat_add(self._oversize, at, delta)

    def _bump(self, at: int, small: bool, delta: int) -> None:
        rows = self._rows
        _stat_add(rows[0], at, delta)
        _stat_add(rows[1] if small else rows[2], at, delta)

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
        """Count ``b`` (free, in a segment of several blocks) in or out of inactive_split:
        :func:`_stat_add` of ``sign`` and of ``sign * b.size`` at _SPLIT and _SPLIT_BYTES,
        written out (it runs on most mallocs and frees)."""
        if not self._stats:
            return
        rows, n = self._rows, b.size
        for r in (rows[0], rows[1] if b.segment.small else rows[2]):
            if sign > 0:
                v = r[_SPLIT] + 1
                r[_SPLIT] = v
                r[_SPLIT + 2] += 1
                if v > r[_SPLIT + 1]:
                    r[_SPLIT + 1] = v
                v = r[_SPLIT_BYTES] + n
                r[_SPLIT_BYTES] = v
                r[_SPLIT_BYTES + 2] += n
                if v > r[_SPLIT_BYTES + 1]:
                    r[_SPLIT_BYTES + 1] = v
            else:
                r[_SPLIT] -= 1
                r[_SPLIT + 3] += 1
                r[_SPLIT_BYTES] -= n
                r[_SPLIT_BYTES + 3] += n

    def memory_stats(self) -> dict[str, int]:
        """The model's statistics as ``torch.cuda.memory_stats()`` names them (sorted keys,
        as torch returns them); "oversize_*" stay 0 without ``max_split_size_mb``."""
        if not self._stats:
            raise RuntimeError("this copy of the allocator model (a replay's) keeps no "
                               "statistics: read memory_stats() off the model it copies")
        out: dict[str, int] = {}
        for name in STAT_NAMES:
            at = _STAT_AT[name]
            for pool, row in zip(_POOLS, self._rows):
                for i, fld in enumerate(_FIELDS):
                    out[f"{name}.{pool}.{fld}"] = row[at + i]
        for name, at in (("oversize_allocations", 0), ("oversize_segments", 4)):
            for i, fld in enumerate(_FIELDS):
                out[f"{name}.{fld}"] = self._oversize[at + i]
        out.update(self._counts)
        # DeviceStats::max_split_size = static_cast<int64_t>(max_split_size()): -1 unset
        ms = self._max_split
        out["max_split_size"] = ms if ms < 1 << 63 else ms - (1 << 64)
        return dict(sorted(out.items()))

    def reset_peak_stats(self) -> None:
        """``torch.cuda.reset_peak_memory_stats()``: every peak becomes its current value."""
        for row in self._rows + [self._oversize]:
            for at in range(0, len(row), 4):
                row[at + 1] = row[at]

    def reset_accumulated_stats(self) -> None:
        """``torch.cuda.reset_accumulated_memory_stats()``: the allocated and freed sums and
        the event counts start again from 0."""
        for row in self._rows + [self._oversize]:
            for at in range(0, len(row), 4):
                row[at + 2] = row[at + 3] = 0
        self._counts = dict.fromkeys(_EVENT_COUNTS, 0)

    # -- history --------------------------------------------------------------------------
    def start_log(self, clock: Callable[[], int] | None = None) -> None:
        """Record every action from now on in a fresh log; ``clock()`` (if given) stamps
        each entry's ``op``. The log keeps a copy of the model as it begins (for
        :meth:`AllocatorLog.replay`)."""
        self._log, self._clock = [], clock
        self._log_start, self._log_restart = self.clone(), 0

    @property
    def log_length(self) -> int | None:
        """How many entries the log holds now (None: no log)."""
        return None if self._log is None else len(self._log)

    def log_since(self, n: int) -> list[dict]:
        """The log's entries from the ``n``-th on (empty: no log)."""
        return list((self._log or ())[n:])

    def stop_log(self) -> None:
        """Stop recording and drop the log."""
        self._log, self._clock = None, None
        self._log_start, self._log_restart = None, 0

    def restart_peaks(self) -> None:
        """The peaks start again from what is held now (the log notes where)."""
        self.reserved_peak = self.reserved
        self.allocated_peak = self.allocated
        self._log_restart = len(self._log or ())

    def would_fit(self, steps: Iterable[tuple[object, int | None]], most: int) -> bool:
        """Whether ``steps`` (key, bytes to allocate or None to free, in turn) fit the
        capacity: surely where ``most`` more bytes of segments do; else by doing them on a
        copy (``steps`` is only read then)."""
        if self._capacity is None or self.reserved + most <= self._capacity:
            return True
        model = self.clone(stats=False)  # read for whether it fits only
        try:
            for key, n in steps:
                if n is None:
                    model.free(key)
                else:
                    model.malloc(key, n)
        except AllocatorFull:
            return False
        return True

    def clone(self, stats: bool = True) -> "CachingAllocatorModel":
        """A copy with every block held by the same key (no log); ``stats=False``: one that
        keeps no ``memory_stats()`` (its mallocs and frees skip the counts, a third of
        their time), read for its peaks and what it holds."""
        new = self.copy({key: key for key in self._live})
        new._stats = stats and self._stats
        return new

    @property
    def logging(self) -> bool:
        return self._log is not None

    def take_log(self, *, keep_logging: bool = False) -> AllocatorLog:
        """The log so far and the segments held now; the log stops unless
        ``keep_logging`` (then the entries are a copy and recording goes on)."""
        entries = list(self._log or ())
        start, restart = self._log_start, self._log_restart
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
        return AllocatorLog(entries, segments, start, restart)

    def _record(self, action: str, addr: int | None, size: int, key: object = None,
                **extra: int) -> None:
        op = self._clock() if self._clock is not None else None
        if addr is None:
            entry = {"action": action, "size": size, "key": key, "op": op, **extra}
        else:
            entry = {"action": action, "addr": addr, "size": size, "key": key, "op": op}
            if extra:
                entry.update(extra)
        self._log.append(entry)  # type: ignore[union-attr]

    # -- free lists ---------------------------------------------------------------------
    def _insert_free(self, b: _Block) -> None:
        b.free = True
        if self._gc_on:  # BlockPool::insert_into_blocks: gc_count_base
            b.gc_base = self._gc_calls[b.segment.small]
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
        block = self._free_block(size, small)
        if block is None:
            block = self._alloc_block(size, small, nbytes)
        block.free = False
        rest = block.size - size
        # should_split: small pool at 512 B left; large pool at more than 1 MiB left, and
        # only for a request below max_split_size
        if (small and rest >= MIN_BLOCK) or (not small and rest > SMALL_SIZE and size < self._max_split):
            self._split(block, size, rest)
        block.segment.blocks_in_use += 1
        block.requested, block.key = requested, key
        self._live[key] = block
        if self._log is not None:
            self._record("alloc", block.addr, requested, key)
        if self._stats:
            self._count_block(small, block.size, requested)
        if block.size >= self._max_split:  # alloc_found_block
            self._bump_oversize(0, 1)
        self.allocated += block.size
        if self.allocated > self.allocated_peak:
            self.allocated_peak = self.allocated
        return block.size

    def _free_block(self, size: int, small: bool) -> _Block | None:
        """get_free_block: the best-fitting cached block for ``size``, taken off its free
        list, or None."""
        lst = self._free[small]
        if self._gc_on:  # get_free_block: ++pool.get_free_blocks_call_count
            self._gc_calls[small] += 1
        ms = self._max_split  # SIZE_MAX unless max_split_size_mb is set
        i = bisect.bisect_left(lst, (size, -1))
        if i >= len(lst):
            return None
        b = lst[i][2]
        # a request below max_split_size takes no oversize block; an oversize one takes a
        # block less than max_non_split_rounding_size larger
        if not ((b.size < ms) if size < ms else (b.size < size + self._round_limit)):
            return None
        del lst[i]
        if b.prev is not None or b.next is not None:
            self._split_free(b, -1)
        return b

    def _alloc_block(self, size: int, small: bool, nbytes: int) -> _Block:
        """alloc_block: a new segment for ``size``, after freeing cached blocks when the
        card's capacity requires it; raises :class:`AllocatorFull` when it cannot fit."""
        seg_size = segment_size(size)
        if self._gc_on:  # malloc: before alloc_block, with set_fraction
            self._garbage_collect()
        cap = self._capacity
        if cap is not None and self.reserved + seg_size > cap and not (
                # alloc_block failed: release_available_cached_blocks && alloc_block
                self._max_split != SIZE_MAX and self._release_available(size, small)
                and self.reserved + seg_size <= cap):
            # release_cached_blocks && alloc_block(isRetry=true)
            self.empty_cache()
            self.num_alloc_retries += 1
            self._counts["num_alloc_retries"] += 1
            if self.reserved + seg_size > cap:
                self._counts["num_ooms"] += 1
                if self._log is not None:
                    self._record("oom", None, nbytes, device_free=max(cap - self.reserved, 0))
                raise AllocatorFull(size, self.allocated, self.reserved, cap)
        return self._new_segment(seg_size, small)

    def _split(self, block: _Block, size: int, rest: int) -> None:
        """Cut ``block`` to ``size``; its ``rest`` bytes become a free block after it."""
        tail = _Block(block.addr + size, rest, block.segment, True, block, block.next)
        if block.next is not None:
            block.next.prev = tail
        block.next = tail
        block.size = size
        self._insert_free(tail)
        self._split_free(tail, 1)

    def free(self, key: object) -> None:
        """Return ``key``'s block to the cache (no-op for unknown keys)."""
        block = self._live.pop(key, None)
        if block is None:
            return
        if self._log is not None:
            self._record("free_requested", block.addr, block.requested, key)
            self._record("free_completed", block.addr, block.requested, key)
        small = block.segment.small
        if self._stats:
            self._uncount_block(small, block.size, block.requested)
        if block.size >= self._max_split:  # free()
            self._bump_oversize(0, -1)
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
        new = CachingAllocatorModel(self._capacity, self.config)
        new.set_capacity(self._capacity, fraction=self.fraction_set)
        new._gc_calls = dict(self._gc_calls)
        new._addresses = self._addresses.clone()
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
                c.gc_base = b.gc_base
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
        o = self._oversize
        new._oversize = [o[0], o[0], 0, 0, o[4], o[4], 0, 0]
        new._stats = self._stats
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

    def address_of(self, key: object) -> int | None:
        """The address of ``key``'s block (what ``data_ptr()`` gives on the card); None
        for a key with no block."""
        block = self._live.get(key)
        return None if block is None else block.addr

    def empty_cache(self) -> int:
        """Release every segment with no block in use; return the bytes released."""
        released = 0
        keep = []
        for seg in self._segments:
            if seg.blocks_in_use == 0:
                self._drop_segment(seg)
                released += seg.size
            else:
                keep.append(seg)
        self._segments = keep
        return released

    def _drop_segment(self, seg: _Segment) -> None:
        """release_block: ``cudaFree`` a segment whose one block is free (the caller
        takes it out of ``_segments``)."""
        self._remove_free(seg.head)
        self._bump(_SEGMENT, seg.small, -1)
        self._bump(_RESERVED, seg.small, -seg.size)
        self._counts["num_device_free"] += 1
        if seg.size >= self._max_split:
            self._bump_oversize(4, -1)
        if self._log is not None:
            self._record("segment_free", seg.addr, seg.size)
        self._addresses.give(seg.addr, seg.size)
        self.reserved -= seg.size

    def _release_block(self, b: _Block) -> None:
        # a cached block of at least max_split_size is always a whole segment: a segment
        # is split only for a request below max_split_size (should_split), which leaves
        # less than max_split_size free beside it
        assert b.prev is None and b.next is None, "only whole segments are released"
        self._drop_segment(b.segment)
        self._segments.remove(b.segment)

    def _release_available(self, size: int, small: bool) -> bool:
        """release_available_cached_blocks (with max_split_size set): free the smallest
        cached block of at least max(size, max_split_size); without one, free oversize
        blocks from the largest down until that much is freed. True when it was."""
        ms = self._max_split
        lst = self._free[small]
        key = size if size >= ms else ms
        j = bisect.bisect_left(lst, (key, -1))
        if j < len(lst):
            self._release_block(lst[j][2])
            return True
        if j == 0:
            return False
        released = 0
        j -= 1  # the largest block
        while released < key and lst[j][2].size >= ms:
            b = lst[j][2]
            released += b.size
            self._release_block(b)  # takes lst[j] out: the next largest is at j - 1
            if j == 0:
                break
            j -= 1
        return released >= key

    def _garbage_collect(self) -> None:
        """garbage_collect_cached_blocks: while reserved is above threshold x allowed,
        free the unsplit large-pool cached blocks whose age (free-list searches of their
        pool since they were cached) is at least the average, pass after pass."""
        gc_threshold = int(self._gc_threshold * self._capacity)  # static_cast<size_t>
        if self.reserved <= gc_threshold:
            return
        target = self.reserved - gc_threshold
        lst = self._free[False]
        calls = self._gc_calls[False]
        ages = [calls - b.gc_base for _, _, b in lst if b.prev is None and b.next is None]
        if not ages:
            return
        total_age, count = sum(ages), len(ages)
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            # every block at least that old goes, even past the target (so that GC does
            # not run again soon)
            for _, _, b in list(lst):
                age = calls - b.gc_base
                if b.prev is None and b.next is None and age >= age_threshold:
                    freed = True
                    reclaimed += b.size
                    total_age -= age
                    count -= 1
                    self._release_block(b)

    @property
    def segments(self) -> int:
        return len(self._segments)

    def _new_segment(self, seg_size: int, small: bool) -> _Block:
        seg = _Segment(self._addresses.take(seg_size), seg_size, small)
        block = _Block(seg.addr, seg_size, seg, True)
        seg.head = block
        self._segments.append(seg)
        if self._log is not None:
            self._record("segment_alloc", seg.addr, seg_size)
        self._bump(_SEGMENT, small, 1)
        self._bump(_RESERVED, small, seg_size)
        if seg_size >= self._max_split:  # alloc_block
            self._bump_oversize(4, 1)
        self._counts["num_device_alloc"] += 1
        self.reserved += seg_size
        self.reserved_peak = max(self.reserved_peak, self.reserved)
        self.segments_peak = max(self.segments_peak, len(self._segments))
        return block
