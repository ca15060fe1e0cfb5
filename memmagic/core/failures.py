"""Failures, written once: is it an out of memory, how many bytes it asked for, which
frames of a traceback are memmagic's own, and taking those frames out of what the user
sees and keeps.

Every module that looks at a failed run asks here: the magic, the what-if engine, the
doctor, the FSDP2 rows, the backends and the simulated device. Knows nothing of IPython.
"""

from __future__ import annotations

import functools
import gc
import os
import re
import sys
import traceback
import types
from typing import Any

from ..report import parse_bytes

__all__ = ["PACKAGE_DIR", "GENERATOR_FLAGS", "frames_of", "release_call_closures", "is_machinery", "is_user_file", "torch_dir", "is_out_of_memory",
           "requested_bytes", "requested_text", "release_own_frames", "strip_own_frames",
           "needs_missing_cuda", "add_note_once", "NO_GPU_HINT", "simulated_error_types",
           "register_simulated_errors", "clear_frame",
           "error_text", "user_line_in", "out_of_memory_behind"]

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# model code a cell calls (memmagic.zoo): the user's code, not memmagic's machinery
_SHARED_WITH_USERS = (os.path.join(PACKAGE_DIR, "zoo.py"),)
_STDLIB = os.path.dirname(os.__file__) + os.sep


def is_machinery(filename: str) -> bool:
    """Whether code in ``filename`` is memmagic's own measuring code (the backends, the
    tracker, the magic), whose frames hold the measurement's objects, not the user's.
    The model zoo is not: it is model code a cell calls."""
    return filename.startswith(PACKAGE_DIR) and filename not in _SHARED_WITH_USERS


@functools.lru_cache(maxsize=None)
def torch_dir() -> str:
    """The directory torch's Python code is in (with a trailing separator)."""
    import torch

    return os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def is_user_file(filename: str) -> bool:
    """Whether code in ``filename`` is the user's (a cell, their own module), not torch's,
    memmagic's, the standard library's or an installed package's."""
    return not (filename.startswith((torch_dir(), PACKAGE_DIR, _STDLIB))
                or "site-packages" in filename or "dist-packages" in filename)


# -- out of memory ------------------------------------------------------------------------
# torch's CUDA message, and the CPU allocator's ("DefaultCPUAllocator: can't allocate memory")
_OOM_TEXT = re.compile(r"out of memory|can't allocate memory", re.I)
# "Tried to allocate 2.00 GiB" (CUDA, the simulated card), "you tried to allocate 8 bytes" (CPU)
_REQUESTED = re.compile(r"(?:Tried to allocate|you tried to allocate)\s+([\d.]+\s*[KMGTP]?i?B|\d+ bytes)",
                        re.I)


def is_out_of_memory(error: BaseException | None) -> bool:
    """Whether ``error`` is an out of memory: torch's OutOfMemoryError (the simulated
    card's included), or a RuntimeError saying so (the CPU allocator, older torch)."""
    if error is None:
        return False
    import torch

    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and bool(_OOM_TEXT.search(str(error))))


def out_of_memory_behind(error: BaseException) -> BaseException | None:
    """The out of memory ``error`` was raised on, through its causes and contexts (hydra's
    main catches a job's error, prints it and calls ``sys.exit(1)``), None where none was."""
    seen = {id(error)}
    e = error.__cause__ or error.__context__
    while e is not None and id(e) not in seen:
        if is_out_of_memory(e):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def requested_text(error: BaseException) -> str | None:
    """The size the failed allocation asked for, as the message writes it ("2.00 GiB")."""
    m = _REQUESTED.search(str(error))
    return m.group(1) if m else None


def requested_bytes(error: BaseException) -> int | None:
    """The bytes the failed allocation asked for (the simulated error's exact size, else
    read from the message; None when it does not say)."""
    size = getattr(error, "size", None)
    if isinstance(size, int) and size > 0:
        return size
    text = requested_text(error)
    if text is None:
        return None
    try:
        return parse_bytes(text.replace("bytes", "B"))
    except ValueError:
        return None


# -- releasing a failed run's frames ------------------------------------------------------
# A GPU frees a failed step's tensors once the exception's frames are released. Two things
# keep them past ``frame.clear()``: the frames' variables (cleared by the callers), and
# closures made for one call: with any module hook installed (memmagic's trackers install
# global ones), ``nn.Module._call_impl`` calls the module through a nested ``inner``
# function whose closure cells hold ``args``; the finished frame keeps that function, so
# the input of the module that failed, and the autograd graph of the whole forward behind
# it, stayed alive. :func:`release_call_closures` empties such call-private cells.
GENERATOR_FLAGS = 0x20 | 0x80 | 0x100 | 0x200  # CO_GENERATOR, COROUTINE, ITERABLE_COROUTINE, ASYNC_GENERATOR


def frames_of(tb: Any) -> list[types.FrameType]:
    """The frames of a traceback, outermost first."""
    out = []
    while tb is not None:
        out.append(tb.tb_frame)
        tb = tb.tb_next
    return out


def _frame_refs(frames: list[types.FrameType], obj: Any) -> int:
    """How many references ``frames`` hold to ``obj`` (their variables, their function,
    the snapshot of their variables that reading ``f_locals`` leaves)."""
    n = 0
    for f in frames:
        for r in gc.get_referents(f):
            if r is obj:
                n += 1
            elif type(r) is dict and r is not f.f_globals and r is not f.f_builtins:
                n += sum(1 for v in r.values() if v is obj)
    return n


def _function_of(frame: types.FrameType) -> types.FunctionType | None:
    for r in gc.get_referents(frame):
        if isinstance(r, types.FunctionType) and r.__code__ is frame.f_code:
            return r
    return None


def release_call_closures(tb: Any) -> int:
    """Empty the closure cells that only ``tb``'s finished frames hold (see the module
    docstring); returns how many cells were emptied. A closure or a cell that anything
    else references (a function stored elsewhere, a sibling closure) is left alone."""
    frames = frames_of(tb)
    emptied = 0
    for f in frames:
        if f.f_code.co_flags & GENERATOR_FLAGS or not f.f_code.co_freevars:
            continue
        fn = _function_of(f)
        if fn is None or not fn.__closure__:
            continue
        # references: the frames', this variable's and getrefcount's argument
        if sys.getrefcount(fn) - 2 != _frame_refs(frames, fn):
            fn = None
            continue
        for cell in fn.__closure__:
            # the closure tuple's, the loop variable's, getrefcount's argument
            if sys.getrefcount(cell) - 3 != _frame_refs(frames, cell):
                continue
            try:
                del cell.cell_contents
            except ValueError:  # already empty
                continue
            emptied += 1
        fn = None
    return emptied


# -- the user's view of a failure -----------------------------------------------------------
def release_own_frames(tb: Any) -> None:
    """Clear the locals of memmagic's finished frames in a failed run's traceback.

    The traceback of an exception from measured code runs through the backend's frames
    (and the user's frames point back at them): kept for ``%debug`` or in
    ``sys.last_traceback``, they would keep the tracker, the simulation's sandbox and the
    fake tensors alive. The user's own frames are left as they are."""
    while tb is not None:
        f = tb.tb_frame
        if is_machinery(f.f_code.co_filename):
            try:
                f.clear()
            except RuntimeError:  # still running: the caller re-raising
                pass
        tb = tb.tb_next


_DISPATCH_MACHINERY = ("/torch/_compile.py", "/torch/_dynamo/", "/torch/_subclasses/",
                       "/torch/_ops.py", "/torch/overrides.py", "/torch/utils/_python_dispatch.py",
                       "/torch/utils/_stats.py", "/torch/_prims_common/", "/torch/_refs/",
                       "/torch/_decomp/", "/torch/_meta_registrations.py")


_FAKE_TENSORS = "/torch/_subclasses/fake_tensor.py"  # a frame there: the op ran on fake tensors


def _own(tb: Any) -> bool:
    return tb.tb_frame.f_code.co_filename.startswith(PACKAGE_DIR)


def strip_own_frames(tb: Any, error: BaseException) -> Any:
    """The traceback without memmagic's frames, so the user sees their code and torch's.

    Frames after the last frame of the user's (where memmagic itself raised) are kept,
    except for a Ctrl-C (raised where memmagic had held it), the simulator's own errors, which stand for an error of the code being run,
    and errors an op raised on fake tensors (a simulated op: a shape that does not match),
    which a GPU raises from C++ under the op: the frames cut below the user's are cleared
    (still held elsewhere, by a logging handler's record of the error, they would keep the
    op's simulated tensors alive).
    """
    frames = []
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    simulated = isinstance(error, simulated_error_types()) or any(
        _FAKE_TENSORS in t.tb_frame.f_code.co_filename for t in frames)
    # a Ctrl-C raised where memmagic held it (memmagic.core.interrupts) came at the user's line
    keep_tail = not simulated and not isinstance(error, KeyboardInterrupt)
    last_user = max((i for i, t in enumerate(frames) if not _own(t)), default=-1)
    kept = [t for i, t in enumerate(frames) if not _own(t) or (keep_tail and i > last_user)]
    if simulated:
        # the error stands for one a GPU raises from C++ under the op: the user's code and
        # torch's Python (nn modules, optim) stay, the machinery the simulation runs through
        # (dispatch modes, dynamo's wrappers, fake tensors) is cut below the user's last frame
        # (a user's own function that the machinery called stays)
        users = [i for i, t in enumerate(kept) if is_user_file(t.tb_frame.f_code.co_filename)]
        for i, t in enumerate(kept):
            name = t.tb_frame.f_code.co_filename
            if (i > max(users, default=-1) and (name.startswith(PACKAGE_DIR)
                                                or any(m in name for m in _DISPATCH_MACHINERY))):
                kept = kept[:i]
                break
        if kept:
            _clear_finished(frames[frames.index(kept[-1]) + 1:])
    for a, b in zip(kept, kept[1:] + [None]):
        a.tb_next = b
    return kept[0] if kept else None


def _clear_finished(tbs: list[Any]) -> None:
    """Clear the variables of the finished frames of ``tbs`` (not generators': clearing one
    would close it). A deeper frame still held (a logging handler's record of the error
    holds the frame that logged it) keeps them alive through ``f_back``."""
    for t in tbs:
        if not t.tb_frame.f_code.co_flags & GENERATOR_FLAGS:
            clear_frame(t.tb_frame)


def clear_frame(f: Any) -> bool:
    """Clear a finished frame's variables, and the dict snapshot of them that reading
    ``f_locals`` leaves on the frame (Python < 3.13 keeps it, with its references); False
    for a frame still running."""
    try:
        f.clear()
    except RuntimeError:  # a frame still running
        return False
    try:
        f.f_locals  # re-synced from the cleared frame: the snapshot drops its entries
    except Exception:
        pass
    return True


_SIMULATED_ERRORS: list[type[BaseException]] = []


def register_simulated_errors(*types: type[BaseException]) -> None:
    """The simulator names the exception types it raises in place of an error of the
    simulated code (it imports this module; this module never imports the simulator)."""
    _SIMULATED_ERRORS.extend(t for t in types if t not in _SIMULATED_ERRORS)


def simulated_error_types() -> tuple[type[BaseException], ...]:
    """Exception types the simulator raises in place of an error of the simulated code
    (none before the simulator is imported: none can have been raised)."""
    return tuple(_SIMULATED_ERRORS)


# torch's errors for CUDA code on a machine without a usable CUDA GPU (a CPU-only build,
# no driver, no device)
_NO_CUDA = re.compile(r"not compiled with CUDA enabled|no NVIDIA driver|No CUDA GPUs are available|"
                      r"CUDA driver initialization failed", re.I)

NO_GPU_HINT = ("memmagic: this code needs a CUDA GPU, which this machine lacks; "
               "{how} runs it on a simulated one")


def cuda_usable() -> bool:
    """Whether a real CUDA GPU can be used here."""
    import torch

    try:
        return bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0
    except Exception:
        return False


def needs_missing_cuda(error: BaseException) -> bool:
    """Whether ``error`` is torch saying the code needs a CUDA GPU this machine lacks (the
    sim backend runs such code on a simulated one)."""
    return (isinstance(error, (AssertionError, RuntimeError)) and bool(_NO_CUDA.search(str(error)))
            and not cuda_usable())


def add_note_once(error: BaseException, note: str) -> None:
    """Add ``note`` to the exception's notes (shown under its message), once."""
    if note not in getattr(error, "__notes__", ()):
        error.add_note(note)


def error_text(error: BaseException | None) -> str | None:
    """``'Type: message'`` (first line only) for a report, None when there was no error; an
    exception with no message (a bare ``assert``) says where instead: ``'AssertionError at
    line 623 (`assert ...`)'``, the innermost line of the user's code it went through."""
    if error is None:
        return None
    msg = str(error).strip().splitlines()
    if msg:
        return f"{type(error).__name__}: {msg[0]}"
    where = user_line_in(error.__traceback__) if isinstance(error, Exception) else None
    if where is None:  # (a Ctrl-C stays "KeyboardInterrupt")
        return type(error).__name__
    return f"{type(error).__name__} at {where}"


def user_line_in(tb: Any) -> str | None:
    """'line N (`source`)' of the innermost frame of the user's code in the traceback
    ``tb`` (None: none of its frames is)."""
    best = None
    for fs in traceback.extract_tb(tb):
        if is_user_file(fs.filename):
            best = fs
    if best is None:
        return None
    src = (best.line or "").strip()
    return f"line {best.lineno or 0}" + (f" (`{src}`)" if src else "")
