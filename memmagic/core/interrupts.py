"""Ctrl-C while memmagic keeps its books: delivered after the bookkeeping, never inside it.

Python runs a SIGINT's handler between two bytecodes of whatever the main thread runs: in
a weakref callback (where Python prints "Exception ignored in" and carries on), in a
``__torch_dispatch__`` that C++ called (where a KeyboardInterrupt can end the process), in
the middle of the allocator model's update (which then stays half-made). On a GPU, Ctrl-C
lands between two lines of the user's Python and never inside a kernel; this module makes
the simulation behave the same:

- :func:`atomic` marks functions and classes (every function in them, lambdas and nested
  functions included) whose frames an interrupt must not land in;
- :func:`guarded` installs, for a cell's run, a SIGINT handler that looks at the frames the
  signal found: in the user's own frame it raises KeyboardInterrupt at once, as Python's
  handler would; in a marked frame, an import in progress or memmagic's code (in a
  simulated run, torch's code too, for up to a second), it holds the interrupt and raises
  it at the next line of the user's frame that called them (a held interrupt still
  pending when the run ends is raised there);
- :func:`held` holds every interrupt for a block (imports that cannot be undone halfway)
  and raises it at the end of the block.

The handler is installed only from the main thread, only over a Python-level handler
(ipykernel's ``default_int_handler`` while a cell runs), and put back in ``finally``.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from types import CodeType, FrameType
from typing import Any, Callable, Iterator, TypeVar

from .patching import Patches

__all__ = ["atomic", "guarded", "guard_cells", "held", "is_interrupt", "take_pending"]

T = TypeVar("T")

_ATOMIC: set[CodeType] = set()
_RETRY_S = 0.005  # how soon a held interrupt is sent again
_RETRY_TRACED_S = 0.25  # the same, while a trace function waits for the user's frame


def _register(code: CodeType) -> None:
    _ATOMIC.add(code)
    for const in code.co_consts:  # lambdas, comprehensions, nested functions
        if isinstance(const, CodeType):
            _register(const)


def _codes_of(obj: Any) -> Iterator[CodeType]:
    fn = getattr(obj, "__func__", obj)  # classmethod / staticmethod / bound method
    if isinstance(fn, property):
        for part in (fn.fget, fn.fset, fn.fdel):
            if part is not None:
                yield from _codes_of(part)
        return
    fn = getattr(fn, "__wrapped__", fn)
    code = getattr(fn, "__code__", None)
    if isinstance(code, CodeType):
        yield code


def atomic(obj: T) -> T:
    """Mark a function, or every function of a class body, as a frame no interrupt lands
    in (returns ``obj`` unchanged: it costs nothing per call)."""
    members = vars(obj).values() if isinstance(obj, type) else (obj,)
    for member in members:
        for code in _codes_of(member):
            _register(code)
    return obj


_IMPORTING = "<frozen importlib"  # an import in progress: Python cannot undo half of one
_LIBRARY_HOLD_S = 1.0  # how long a strict guard holds an interrupt found in torch's code


def _package(frame: FrameType) -> str:
    return (frame.f_globals.get("__name__") or "").partition(".")[0]


def _holds(frame: FrameType) -> bool:
    code = frame.f_code
    return code in _ATOMIC or code.co_filename.startswith(_IMPORTING)


def _owners(chain: list[FrameType]) -> list[str]:
    """The package each frame of ``chain`` (innermost first) runs for: its own, or for the
    standard library's, its caller's (contextlib's ``__exit__`` in a ``with`` of torch's
    mode stack is torch's code: an interrupt there leaves the stack half popped)."""
    owners = [""] * len(chain)
    caller = ""
    for i in range(len(chain) - 1, -1, -1):
        own = _package(chain[i])
        caller = owners[i] = caller if own in sys.stdlib_module_names else own
    return owners


def _landing(frame: FrameType | None, strict: bool) -> FrameType | None:
    """Where an interrupt that found ``frame`` running raises: the innermost frame outside
    every marked frame and every import in progress that is not memmagic's (``strict``:
    nor torch's, whose Python that C++ calls back, such as the dispatcher's rules under
    fake tensors, cannot pass an exception on), the standard library counted as its
    caller's; None when there is none."""
    chain = []
    while frame is not None:
        chain.append(frame)
        frame = frame.f_back
    outer = max((i for i, f in enumerate(chain) if _holds(f)), default=-1)
    skip = ("memmagic", "torch") if strict else ("memmagic",)
    owners = _owners(chain)
    return next((f for f, owner in zip(chain[outer + 1:], owners[outer + 1:])
                 if owner not in skip), None)


def _no_trace(frame: FrameType, event: str, arg: Any) -> None:
    """The thread's trace function while an interrupt waits: new frames are not traced."""
    return None


class _Guard:
    """The one SIGINT handler of the process while memmagic runs something (re-entrant:
    the outermost :func:`guarded` installs it and puts the previous one back).

    An interrupt that finds the user's frame running raises at once. One that finds a
    frame :func:`_landing` passes over is held: the user's frame they were called from
    gets a trace function (as pdb sets one) that raises it at that frame's next line, or
    when it returns; where another tracer runs (a debugger, coverage), the interrupt is
    sent again every few milliseconds until it finds a frame of the user's."""

    def __init__(self) -> None:
        self.depth = 0
        self.hold = 0  # >0 inside held(): every interrupt is held
        self.pending = False
        self.previous: Any = None
        self.lock = threading.Lock()
        self.timer: threading.Timer | None = None
        self.armed: FrameType | None = None  # the frame whose trace raises the interrupt
        self.strict = 0  # >0 inside guarded(strict=True)
        self.since = 0.0  # when the pending interrupt came
        self.undo = Patches()  # the handler installed, the trace function armed

    def handler(self, signum: int, frame: FrameType | None) -> None:
        __tracebackhide__ = True  # the user's traceback ends at their line, as Python's would
        if self.hold:
            self.pending = True
            return
        now = time.monotonic()
        if not self.pending:
            self.since = now
        strict = self.strict > 0 and now - self.since < _LIBRARY_HOLD_S
        target = _landing(frame, strict)
        if target is not None and target is frame:
            self.pending = False
            self._disarm()
            if self.own_handler():
                return self.previous(signum, frame)  # the program's own handler decides
            raise KeyboardInterrupt
        self.pending = True
        if target is None or not self._arm(target):
            self._retry(_RETRY_S)
        else:
            self._retry(_RETRY_TRACED_S)  # in case the frame never runs again

    def own_handler(self) -> bool:
        """Whether the handler under this one is the program's own (not Python's default,
        which raises KeyboardInterrupt): it is called instead, where the interrupt lands."""
        prev = self.previous
        return callable(prev) and prev is not signal.default_int_handler

    def _arm(self, target: FrameType) -> bool:
        if self.armed is target:
            return True
        if sys.gettrace() not in (None, _no_trace):
            return False  # a debugger's or coverage's tracer: not ours to replace
        self._disarm()

        def trace(f: FrameType, event: str, arg: Any):
            __tracebackhide__ = True
            if event not in ("line", "return"):
                return trace
            self._disarm()
            if self.pending:
                self.pending = False
                if self.own_handler():
                    return self.previous(signal.SIGINT, f)
                raise KeyboardInterrupt
            return None

        target.f_trace = trace
        self.armed = target
        sys.settrace(_no_trace)
        return True

    def _disarm(self) -> None:
        target, self.armed = self.armed, None
        if target is not None:
            target.f_trace = None
            if sys.gettrace() is _no_trace:
                sys.settrace(None)

    def _retry(self, delay: float) -> None:
        """Send the held interrupt again after ``delay`` seconds."""
        with self.lock:
            if self.depth == 0 or self.timer is not None:
                return
            self.timer = threading.Timer(delay, self._resend)
            self.timer.daemon = True
            self.timer.start()

    def _resend(self) -> None:
        with self.lock:
            self.timer = None
            if self.depth == 0 or not self.pending:
                return
            _signal_main_thread()

    def enter(self) -> bool:
        """Install the handler (outermost call); False where none can be (not the main
        thread, or SIGINT ignored or left to the OS)."""
        if self.depth:
            self.depth += 1
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        prev = signal.getsignal(signal.SIGINT)
        if not callable(prev):
            return False
        self.previous, self.pending = prev, False
        self.undo = Patches()
        self.undo.call_on_restore(lambda: signal.signal(signal.SIGINT, prev))
        signal.signal(signal.SIGINT, self.handler)
        self.undo.call_on_restore(self._disarm)
        self.depth = 1
        return True

    def leave(self) -> bool:
        """Put the previous handler back (outermost call); whether an interrupt is pending
        for the caller to raise."""
        with self.lock:
            self.depth -= 1
            outermost = self.depth == 0
            if outermost and self.timer is not None:
                self.timer.cancel()
                self.timer = None
        if not outermost:
            return False
        self.undo.restore()
        self.previous = None
        pending, self.pending = self.pending, False
        return pending


def _signal_main_thread() -> None:
    """A real SIGINT to the main thread (it wakes a sleep, as Ctrl-C does)."""
    if hasattr(signal, "pthread_kill"):
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    else:  # pragma: no cover - Windows
        import _thread

        _thread.interrupt_main()


_GUARD = _Guard()


@contextlib.contextmanager
def guarded(strict: bool = False) -> Iterator[None]:
    """While the block runs, an interrupt that finds memmagic's marked frames or an import
    running waits for them to end (``strict``, a simulated run: for torch's code too, up to
    a second); one still held when the block ends is raised as KeyboardInterrupt there."""
    installed = _GUARD.enter()
    if installed and strict:
        _GUARD.strict += 1
    try:
        yield
    finally:
        if installed:
            if strict:
                _GUARD.strict -= 1
            if _GUARD.leave():
                raise KeyboardInterrupt


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Hold every interrupt while the block runs (an import that must not stop halfway);
    one that came is raised when the block ends."""
    installed = _GUARD.enter()
    if installed:
        _GUARD.hold += 1
    try:
        yield
    finally:
        if installed:
            _GUARD.hold -= 1
            pending = _GUARD.pending and not _GUARD.hold  # an outer held() raises it
            if pending:
                _GUARD.pending = False
            if _GUARD.leave() or pending:
                raise KeyboardInterrupt


def take_pending() -> bool:
    """Whether an interrupt is held that memmagic's own code should raise now, taken (no
    longer pending): for a wait with no frame of the user's to land in (the doctor waiting
    for its re-runs in child processes), which checks between waits and raises
    KeyboardInterrupt itself. False inside :func:`held`."""
    g = _GUARD
    with g.lock:
        if not g.pending or g.hold:
            return False
        g.pending = False
        if g.timer is not None:
            g.timer.cancel()
            g.timer = None
    g._disarm()
    return True


def guard_cells(shell: Any) -> Callable[[], None]:
    """Guard every cell ``shell`` runs (IPython's ``pre_run_cell`` / ``post_run_cell``
    events), so that no Ctrl-C leaves an import or memmagic's books half-made, in a plain
    cell either; returns the function that stops it (``%unload_ext``)."""
    entered: list[bool] = []

    def pre(*_: Any) -> None:
        entered.append(_GUARD.enter())

    def post(*_: Any) -> None:
        if entered and entered.pop():
            _GUARD.leave()  # (one held past the cell's end is dropped: the cell ended)

    shell.events.register("pre_run_cell", pre)
    shell.events.register("post_run_cell", post)

    def stop() -> None:
        shell.events.unregister("pre_run_cell", pre)
        shell.events.unregister("post_run_cell", post)
        while entered:
            post()

    return stop


def is_interrupt(error: BaseException | None) -> bool:
    """Whether ``error`` is a Ctrl-C (it stops whoever asked for the run, never a report's
    verdict)."""
    return isinstance(error, KeyboardInterrupt)


# this module's own bookkeeping is no place for an interrupt either
atomic(_Guard)
atomic(guarded)
atomic(held)
atomic(guard_cells)
atomic(Patches)  # the one undo log: no interrupt stops it halfway through putting things back
