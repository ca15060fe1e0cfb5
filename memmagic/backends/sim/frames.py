"""What a failed simulated cell's frames keep on the simulated GPU, and letting it go.

A GPU frees a failed step's tensors once the exception's frames are released (IPython
keeps them for ``%debug`` in ``sys.last_traceback`` and in its traceback formatter until
memmagic clears them after an out of memory). Two things keep them past ``frame.clear()``:

* closures made for one call: with any module hook installed (the tracker installs
  global ones), ``nn.Module._call_impl`` calls its input through a nested ``inner``
  function whose closure cells hold ``args``; ``frame.clear()`` drops the frame's
  variables, not the cells the function object (which the finished frame keeps) still
  holds, so the input of the module that failed, and with it the autograd graph of the
  whole forward, stayed on the card. :func:`release_call_closures` empties the cells of
  such call-private closures (a closure referenced by nothing but the traceback's frames);
* tracebacks kept after ``%gpusim reset`` (the last error's): :func:`release_tracebacks`
  clears the finished frames that still reach simulated tensors of a card being emptied.
"""

from __future__ import annotations

import gc
import sys
import types
from typing import Any, Callable, Iterator

from ...core.failures import GENERATOR_FLAGS, frames_of, release_call_closures

__all__ = ["release_call_closures", "release_tracebacks"]

def _tracebacks() -> Iterator[Any]:
    """The tracebacks the process keeps (the last error's first)."""
    seen: set[int] = set()
    for tb in (getattr(getattr(sys, "last_exc", None), "__traceback__", None),
               getattr(sys, "last_traceback", None)):
        if tb is not None:
            seen.add(id(tb))
            yield tb
    for o in gc.get_objects():
        if type(o) is types.TracebackType and id(o) not in seen:
            yield o


def release_tracebacks(holds: Callable[[Any], bool]) -> int:
    """Clear the finished function frames of kept tracebacks whose variables ``holds``
    (a simulated GPU's objects that are going away), and their call-private closures;
    returns how many frames were cleared. Running and generator frames stay."""
    cleared = 0
    done: set[int] = set()
    for tb in _tracebacks():
        frames = frames_of(tb)
        if not any(id(f) not in done for f in frames):
            continue
        hit = []
        for f in frames:
            if id(f) in done:
                continue
            done.add(id(f))
            if f.f_code.co_flags & GENERATOR_FLAGS or f.f_locals is f.f_globals:
                continue
            try:
                values = list(f.f_locals.values())
            except Exception:
                continue
            if any(holds(v) for v in values):
                hit.append(f)
        if not hit:
            continue
        release_call_closures(tb)
        for f in hit:
            try:
                f.clear()
            except RuntimeError:  # still running
                continue
            try:
                f.f_locals  # re-synced: the snapshot drops its entries (Python < 3.13)
            except Exception:
                pass
            cleared += 1
    return cleared
