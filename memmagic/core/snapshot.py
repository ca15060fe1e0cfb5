"""memory_viz snapshots of a measured run: the pickle that PyTorch's memory viewer
(https://pytorch.org/memory_viz, ``torch.cuda._memory_viz``) opens.

The format is what ``torch.cuda.memory._snapshot()`` returns with the allocator history
on: ``{"segments": [...], "device_traces": [[...]]}``. ``segments`` is the allocator's
state when the snapshot was taken (here: the end of the run), each with its ``blocks``;
``device_traces[0]`` is the history: "alloc", "free_requested", "free_completed",
"segment_alloc", "segment_free", "oom", then a final "snapshot" entry. The viewer rebuilds
earlier states by walking the history back from the segments, so the two agree.

Where the numbers come from:

* ``sim`` with a simulated GPU: the CUDA caching allocator model
  (:mod:`memmagic.backends.sim.allocator`) logs its own actions, so addresses, segments,
  block splits, cached free blocks, ``empty_cache`` on pressure and a simulated
  out-of-memory are the model's.
* ``cpu`` (and ``sim`` with CPU kernels): there is no caching allocator. Each storage is
  written as its own segment holding one block (like ``malloc``), at addresses handed
  out by a bump allocator (512-byte aligned, never reused): the live bytes over time are
  the tracker's, the addresses and segments are not a real device's.

Every entry's ``frames`` say what the trace knows of it, innermost first: a frame
``{"filename": module path or "<cell>", "line": op index, "name": "phase: aten::op"}``
for the op that made (or freed) it, followed by the storage's own Python frames where the
trace recorded them. Allocation entries also carry ``category`` (parameters, gradients,
activations, ...), which the viewer colours by. Sizes are bytes.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..report import Category, MemoryReport

if TYPE_CHECKING:
    from ..trace import Storage, Trace

__all__ = ["snapshot_dict", "write_snapshot", "allocator_history", "allocator_segments",
           "evaluated_keys", "key_frames", "BUMP_BASE", "BUMP_ALIGN"]

BUMP_BASE = 0x7F00_0000_0000  # first address of the cpu writer's bump allocator
BUMP_ALIGN = 512
SMALL_SEGMENT = 1 << 20       # a segment of at most 1 MiB is "small" (the CUDA allocator's pool)
PICKLE_PROTOCOL = 4           # the viewer's unpickler reads protocols 2 to 4
# the places evaluated_keys' keys name: (filename, name) by number (a key holds its number)
_PLACES: list[tuple[str, str]] = []
_INDEX_BITS, _PLACE_BITS = 24, 8


def evaluated_keys(filename: str, line: int, name: str, count: int) -> list[int]:
    """The allocator model's keys of ``count`` buffers that a step evaluated, not run, stands
    for: the frame of key ``i`` in a snapshot is {"filename": ``filename``, "line": ``line``,
    "name": "``name`` ``line``, evaluated, not run: buffer ``i``"} (:func:`key_frames`).

    Negative ints (a storage's key is its serial, from 0 up), each holding the place's
    number, its index and ``line``: Python's garbage collector tracks no int, nor the
    allocator log's entries that hold only ints and strings. 512 evaluated decode steps log
    millions of entries; with keys the collector tracks, each entry was tracked and its
    full passes took a fifth of the run."""
    place = (filename, name)
    try:
        number = _PLACES.index(place)
    except ValueError:
        number = len(_PLACES)
        _PLACES.append(place)
    if number >> _PLACE_BITS or count > 1 << _INDEX_BITS or line < 0:
        raise ValueError(f"evaluated_keys: {count} buffers of {place} at {line} are out of range")
    first = -1 - (number | line << (_PLACE_BITS + _INDEX_BITS))
    return [first - (i << _PLACE_BITS) for i in range(count)]


def key_frames(key: object) -> list[dict] | None:
    """The frames an :func:`evaluated_keys` key says it comes from; None for other keys."""
    if type(key) is not int or key >= 0:
        return None
    n = -1 - key
    place = n & ((1 << _PLACE_BITS) - 1)
    if place >= len(_PLACES):
        return None
    filename, name = _PLACES[place]
    index = (n >> _PLACE_BITS) & ((1 << _INDEX_BITS) - 1)
    line = n >> (_PLACE_BITS + _INDEX_BITS)
    return [{"filename": filename, "line": line,
             "name": f"{name} {line}, evaluated, not run: buffer {index}"}]


def snapshot_dict(report: MemoryReport) -> dict[str, Any]:
    """The memory_viz snapshot of ``report`` as a plain dict (see the module docstring).

    Raises ValueError for a report without a trace and without a raw CUDA snapshot."""
    raw = getattr(report, "cuda_snapshot", None)
    if isinstance(raw, dict) and "segments" in raw:
        return raw  # a real CUDA allocator's own snapshot: written as it is
    trace = report.trace
    if trace is None:
        raise ValueError(
            f"this {report.backend} report has no trace to write a snapshot from: the cpu and "
            "sim backends record one (measure with backend='sim' to see a simulated GPU's "
            "allocator)")
    log = getattr(trace, "allocator_log", None)
    if isinstance(log, dict) and "segments" in log:
        return log
    writer = _Writer(trace)
    if log is not None:
        return writer.from_allocator_log(log)
    return writer.from_trace()


def write_snapshot(report: MemoryReport, path: str | Path) -> Path:
    """Write :func:`snapshot_dict` of ``report`` to ``path`` as a pickle that
    https://pytorch.org/memory_viz opens (drag the file onto the page); return the path."""
    path = Path(path)
    data = snapshot_dict(report)
    with open(path, "wb") as f:
        pickle.dump(data, f, protocol=PICKLE_PROTOCOL)
    return path


def allocator_history(trace: "Trace", log_entries: list[dict]) -> list[dict]:
    """memory_viz ``device_traces`` entries of the simulated allocator's log entries
    (:class:`~memmagic.backends.sim.allocator.AllocatorLog`), framed from ``trace``: what a
    simulated ``torch.cuda.memory._snapshot()`` returns as its history."""
    return _Writer(trace).history(log_entries)


def allocator_segments(trace: "Trace", log_segments: list[dict]) -> list[dict]:
    """memory_viz ``segments`` of the simulated allocator's segments, framed from ``trace``."""
    return _Writer(trace).segments(log_segments)


class _Writer:
    def __init__(self, trace: "Trace") -> None:
        self.trace = trace
        self.storages: dict[int, "Storage"] = {s.serial: s for s in trace.storages()}
        self._op_frames: dict[tuple[int, bool], dict] = {}
        self._made_frames: dict[int, list[dict]] = {}

    # -- frames and categories ------------------------------------------------------------
    def op_frame(self, op: int | None, freed: bool = False) -> list[dict]:
        """The one frame of op ``op`` (none for op 0, before the run)."""
        info = self.trace.op(op) if op else None
        if info is None:
            return []
        key = (op, freed)
        frame = self._op_frames.get(key)
        if frame is None:
            name, module, phase, label = info
            text = f"{phase}: aten::{name.split('.', 1)[0]}"
            if label:
                text += f" ({label})"
            if freed:
                text += " frees"
            frame = {"filename": module or "<cell>", "line": int(op), "name": text}
            self._op_frames[key] = frame
        return [frame]

    def made_frames(self, serial: object) -> list[dict]:
        """Frames of the op that made storage ``serial`` and the Python frames recorded
        with it (innermost first); [] for a storage the trace does not know."""
        if not isinstance(serial, int):
            return []
        frames = self._made_frames.get(serial)
        if frames is None:
            s = self.storages.get(serial)
            frames = [] if s is None else self.op_frame(s.op) + [
                {"filename": str(f), "line": int(line), "name": str(fn)} for f, line, fn in s.frames]
            self._made_frames[serial] = frames
        return frames

    def category(self, serial: object) -> str:
        s = self.storages.get(serial) if isinstance(serial, int) else None
        if s is None:
            return "unknown"
        if s.category == Category.OTHER.value and serial in self.trace.saver:
            return Category.ACTIVATIONS.value  # held by autograd for backward
        return s.category

    @staticmethod
    def _snapshot_entry(entries: list[dict], live: int) -> None:
        # the allocator's own marker for "a snapshot was taken here", with the bytes live
        # then; its category ("unknown": blocks older than the history) completes the
        # viewer's category list
        entries.append({"action": "snapshot", "addr": 0, "size": live,
                        "stream": 0, "frames": [], "category": "unknown"})

    # -- sim: the caching allocator model's own history ------------------------------------
    def from_allocator_log(self, log: Any) -> dict[str, Any]:
        entries = self.history(log.entries)
        # history sizes are the bytes asked for, as torch records them; the marker holds
        # what the blocks hold now (rounded sizes)
        held = sum(b["size"] for seg in log.segments for b in seg["blocks"] if b["allocated"])
        self._snapshot_entry(entries, held)
        return {"segments": self.segments(log.segments), "device_traces": [entries]}

    def history(self, log_entries: list[dict]) -> list[dict]:
        """The memory_viz trace entries of the allocator model's log entries (an
        :func:`evaluated_keys` key, an evaluated decode step's buffer, shows its own frames)."""
        entries: list[dict] = []
        for e in log_entries:
            action, op, key = e["action"], e.get("op"), e.get("key")
            own = key_frames(key)  # a key that says where it comes from
            if action == "alloc":
                frames = own or (self.made_frames(key) if self._made_by(key, op)
                                 else self.op_frame(op))
                entries.append({"action": action, "addr": e["addr"], "size": e["size"],
                                "stream": 0, "frames": frames, "category": self.category(key)})
            elif action in ("free_requested", "free_completed"):
                entries.append({"action": action, "addr": e["addr"], "size": e["size"],
                                "stream": 0, "frames": own or self.op_frame(op, freed=True),
                                "category": self.category(key)})
            elif action in ("segment_alloc", "segment_free"):
                entries.append({"action": action, "addr": e["addr"], "size": e["size"],
                                "stream": 0, "frames": self.op_frame(op)})
            elif action == "oom":
                entries.append({"action": "oom", "size": e["size"], "stream": 0,
                                "device_free": e["device_free"], "frames": self.op_frame(op)})
        return entries

    def segments(self, log_segments: list[dict]) -> list[dict]:
        """The memory_viz segments of the allocator model's segments and blocks."""
        segments = []
        for seg in log_segments:
            blocks = []
            for b in seg["blocks"]:
                if b["allocated"]:
                    blocks.append({"address": b["address"], "size": b["size"],
                                   "requested_size": b["requested"], "state": "active_allocated",
                                   "frames": self.made_frames(b["key"])})
                else:
                    blocks.append({"address": b["address"], "size": b["size"],
                                   "requested_size": 0, "state": "inactive", "frames": []})
            segments.append(_segment(seg["address"], seg["total_size"], seg["small"], blocks))
        return segments

    def _made_by(self, key: object, op: int | None) -> bool:
        """Whether op ``op`` is the one that made storage ``key`` (a storage resized later
        gets a new block from a later op: its frames are that op's alone)."""
        s = self.storages.get(key) if isinstance(key, int) else None
        return s is not None and s.op == op

    # -- cpu: no caching allocator, one segment per storage ---------------------------------
    def from_trace(self) -> dict[str, Any]:
        trace = self.trace
        device = {s for s, pool in trace.pool_of.items() if pool == "device"}
        nxt = BUMP_BASE
        addr: dict[int, int] = {}
        size: dict[int, int] = {}

        def bump(n: int) -> int:
            nonlocal nxt
            a = nxt
            nxt += -(-max(n, 1) // BUMP_ALIGN) * BUMP_ALIGN
            return a

        for serial in sorted(trace.seed):
            n = trace.seed[serial]
            if serial in device and n > 0:
                addr[serial], size[serial] = bump(n), n
        entries: list[dict] = []
        live = 0
        for serial, delta, op in trace.events:
            if serial not in device:
                continue
            old = size.get(serial, 0)
            new = old + delta
            cat = self.category(serial)
            if old > 0:
                a = addr.pop(serial)
                frames = self.op_frame(op, freed=True)
                entries.append({"action": "free_requested", "addr": a, "size": old, "stream": 0,
                                "frames": frames, "category": cat})
                entries.append({"action": "free_completed", "addr": a, "size": old, "stream": 0,
                                "frames": frames, "category": cat})
                entries.append({"action": "segment_free", "addr": a, "size": old, "stream": 0,
                                "frames": frames})
                live -= old
            if new > 0:
                a = bump(new)
                addr[serial] = a
                frames = (self.made_frames(serial) if self._made_by(serial, op)
                          else self.op_frame(op))
                entries.append({"action": "segment_alloc", "addr": a, "size": new, "stream": 0,
                                "frames": frames})
                entries.append({"action": "alloc", "addr": a, "size": new, "stream": 0,
                                "frames": frames, "category": cat})
                live += new
                size[serial] = new
            else:
                size.pop(serial, None)
        self._snapshot_entry(entries, trace.before + live)
        segments = []
        for serial in sorted(addr, key=addr.__getitem__):
            n = size[serial]
            block = {"address": addr[serial], "size": n, "requested_size": n,
                     "state": "active_allocated", "frames": self.made_frames(serial)}
            segments.append(_segment(addr[serial], n, n <= SMALL_SEGMENT, [block]))
        return {"segments": segments, "device_traces": [entries]}


def _segment(address: int, total: int, small: bool, blocks: list[dict]) -> dict[str, Any]:
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    requested = sum(b["requested_size"] for b in blocks if b["state"] == "active_allocated")
    return {"device": 0, "address": address, "total_size": total, "stream": 0,
            "segment_type": "small" if small else "large", "segment_pool_id": (0, 0),
            "allocated_size": allocated, "active_size": allocated, "requested_size": requested,
            "is_expandable": False, "frames": [], "blocks": blocks}
