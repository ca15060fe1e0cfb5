"""What a failed cell's traceback keeps alive (IPython keeps it for ``%debug``), and the
one call that frees it."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from ..core.failures import clear_frame, is_machinery, release_call_closures
from ..report import format_bytes
from .holders import found_in, graph_of, namespace_roots, storage_of


FREE_CALL = "memmagic.doctor.free_traceback()"


# -- a failed cell ------------------------------------------------------------------------------
@dataclass(frozen=True)
class TracebackHold:
    """What a failed cell's traceback keeps alive beyond the namespace. Bytes.

    ``names`` are the frame variables holding them (``step:x``: variable ``x`` of function
    ``step``); ``freed`` is set once the frames were cleared (bytes released)."""

    nbytes: int
    names: tuple[str, ...] = ()
    freed: int | None = None
    out_of_memory: bool = False

    @property
    def fix(self) -> str:
        return FREE_CALL

    def __str__(self) -> str:
        if self.freed is not None:
            return (f"the failed cell's local variables were released ({format_bytes(self.freed)} "
                    "of tensors freed)")
        if not self.nbytes:
            return "the traceback keeps no tensors alive"
        names = ", ".join(self.names[:4]) + (" ..." if len(self.names) > 4 else "")
        return (f"the traceback (kept for %debug) holds {format_bytes(self.nbytes)} of tensors "
                f"({names}); {FREE_CALL} frees it")

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def _frames(tb: Any) -> Iterator[Any]:
    while tb is not None:
        yield tb.tb_frame
        tb = tb.tb_next


def _tb_of(error_or_tb: Any) -> Any:
    if isinstance(error_or_tb, BaseException):
        return error_or_tb.__traceback__
    return error_or_tb


def _machinery(frame: Any) -> bool:
    """A frame of memmagic's own measuring code (the backends, the tracker): what it holds
    is the measurement's, released by the backend, not the user's."""
    return is_machinery(frame.f_code.co_filename)


def traceback_holdings(error: BaseException | Any, namespace: Mapping[str, Any] | None = None
                       ) -> TracebackHold:
    """Bytes of tensors (and the autograd graphs they keep) that only the failed cell's
    traceback holds: its function frames' variables, minus what ``namespace`` holds."""
    tb = _tb_of(error)
    ns_keys: set[int] = set()
    if namespace is not None:
        ns_found = found_in(namespace_roots(namespace))
        ns_keys = set(ns_found.tensors)
        for t in list(ns_found.tensors.values()):
            for s in graph_of(t)[0]:
                info = storage_of(s)
                if info is not None:
                    ns_keys.add(info[0])
    roots = []
    for f in _frames(tb):
        if f.f_locals is f.f_globals or _machinery(f):
            continue  # the cell's own (module) frame: its variables are the namespace
        code = f.f_code.co_name
        for k, v in list(f.f_locals.items()):
            roots.append((f"{code}:{k}", v))
    found = found_in(roots)
    total = 0
    names: list[str] = []
    counted = set(ns_keys)
    for key, t in found.tensors.items():
        if key in counted:
            continue
        counted.add(key)
        total += storage_of(t)[1]
        names.extend(p for p in found.paths[key] if p not in names)
        for s in graph_of(t)[0]:
            info = storage_of(s)
            if info is not None and info[0] not in counted:
                counted.add(info[0])
                total += info[1]
    return TracebackHold(total, tuple(names))


def free_traceback(error: BaseException | None = None) -> int:
    """Clear the local variables of the frames of ``error``'s traceback (default: the
    last error, ``sys.last_exc`` / ``sys.last_traceback``, which IPython keeps for
    ``%debug``), so the tensors only they hold are freed. ``%debug`` still opens, without
    those variables. Returns how many frames were cleared."""
    import gc

    tbs = []
    if error is not None:
        tbs.append(_tb_of(error))
    else:
        exc = getattr(sys, "last_exc", None)
        if exc is not None:
            tbs.append(exc.__traceback__)
        tbs.append(getattr(sys, "last_traceback", None))
    cleared = 0
    seen: set[int] = set()
    for tb in tbs:
        release_call_closures(tb)
        for f in _frames(tb):
            if id(f) in seen or f.f_locals is f.f_globals:
                continue
            seen.add(id(f))
            if clear_frame(f):
                cleared += 1
    gc.collect()
    return cleared


def release_failed_cell(error: BaseException, namespace: Mapping[str, Any] | None = None
                        ) -> TracebackHold:
    """After an out of memory: clear the failed cell's frames (the next cell needs the
    memory; ``%debug`` then shows no variables) and say how many bytes that freed."""
    hold = traceback_holdings(error, namespace)
    release_call_closures(_tb_of(error))
    for f in _frames(_tb_of(error)):
        if f.f_locals is not f.f_globals:
            clear_frame(f)
    import gc

    gc.collect()
    return TracebackHold(hold.nbytes, hold.names, freed=hold.nbytes, out_of_memory=True)


