"""Independent simulated runs side by side: :func:`run_all` calls a function on each item
in forked children, several at once, and brings each result back pickled.

The doctor's re-runs (one per fix) differ only in a knob and share nothing: each is the
cell run again from its start. On a machine with more than one core they can run at the
same time, each in a child forked from this process, which sees the cell, its namespace
and the warm caches as they are here, runs, sends its report back through a pipe and
ends without running any of this process's exit code. Whatever the run changes in its
child (a script's scratch disk, torch's global state) ends with the child: this process
is left as it was, but for what a caller's ``carry`` brings back (the simulation's op-cache
entries, so that later runs here find them).

Forks only where it is safe and worth it: on Linux, from the main thread, with no CUDA
context made (a forked child cannot use the parent's), outside a forked child, for two
items or more, with more than one core available to this process. ``MEMMAGIC_WORKERS``
sets how many children at once (``1``: everything in this process). Elsewhere, and for an
item whose child ended without a result (killed, out of host memory, a result that does
not pickle), the call runs here, as it would have without children.

Ctrl-C (or any exception) while children run stops them (the wait takes an interrupt
that memmagic's guard held, there being no frame of the user's here to raise it in): each is asked to stop (SIGINT:
its run then undoes what it installed and removes its scratch disk, as an interrupted run
does), and killed if it has not ended within :data:`STOP_GRACE_S`; all are reaped before
the exception goes on.
"""

from __future__ import annotations

import io
import os
import pickle
import selectors
import signal
import sys
import threading
import time
from typing import Any, Callable, Sequence

from .interrupts import take_pending

__all__ = ["run_all", "workers"]

# seconds a child asked to stop (SIGINT) has before it is killed
STOP_GRACE_S = 3.0
# items quicker than this run here: a child costs its fork, its exit and its result's way
# back (about 40 ms for a 350 MB process on the 2-core development machine)
FORK_WORTH_S = 0.2
# how often a wait for children looks for a held Ctrl-C (core.interrupts.take_pending)
_POLL_S = 0.05
# set in a forked child: it forks no children of its own
_IN_CHILD = False


def workers(items: int) -> int:
    """How many children :func:`run_all` would run at once for ``items`` items (1: none,
    everything here). See the module docstring."""
    if items < 2 or _IN_CHILD or sys.platform != "linux" or not hasattr(os, "fork"):
        return 1
    if threading.current_thread() is not threading.main_thread():
        return 1
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return 1
    asked = os.environ.get("MEMMAGIC_WORKERS", "").strip()
    if asked:
        try:
            n = int(asked)
        except ValueError:
            raise ValueError(f"MEMMAGIC_WORKERS={asked!r}: give a whole number of children "
                             "(1 runs everything in this process)") from None
    else:
        n = len(os.sched_getaffinity(0))
    return max(1, min(n, items))


def run_all(fn: Callable[[Any], Any], items: Sequence[Any], warm: int = 0,
            each_s: float | None = None, carry: Any = None) -> list[tuple[bool, Any]]:
    """``fn(item)`` for each item, in order: ``(True, value)``, or ``(False, exception)``
    where it raised an Exception (a KeyboardInterrupt, SystemExit... goes on). In forked
    children, :func:`workers` at once, where that is possible and worth it; else here.
    ``warm``: the first items, run here before any child is forked (what a first run
    fills, the simulation's caches and the imports of the cell, the children then find
    filled); ``each_s``: about how long one item takes (else the warm items' mean, else
    unknown). Items quicker than :data:`FORK_WORTH_S` all run here. ``carry``: what a
    child's run adds to state this process keeps for later runs (the simulation's op
    caches, :data:`memmagic.backends.sim.OP_CACHES`): ``mark()`` in the child before the
    run, ``since(mark)`` after it (bytes), ``merge(bytes)`` here."""
    results: list[tuple[bool, Any] | None] = [None] * len(items)
    n = workers(len(items) - warm)
    if n > 1:
        t0 = time.perf_counter()
        results[:warm] = [_called(fn, item) for item in items[:warm]]
        if each_s is None and warm:
            each_s = (time.perf_counter() - t0) / warm
        if each_s is None or each_s >= FORK_WORTH_S:
            _forked(fn, items, n, results, carry)
    return [r if r is not None else _called(fn, item) for r, item in zip(results, items)]


def _called(fn: Callable[[Any], Any], item: Any) -> tuple[bool, Any]:
    try:
        return True, fn(item)
    except Exception as exc:  # noqa: BLE001 - handed back to the caller, as a child does
        return False, exc


def _forked(fn: Callable[[Any], Any], items: Sequence[Any], n: int,
            results: list, carry: Any = None) -> None:
    """Fill ``results`` from children, ``n`` at once; an item whose child gave no result
    stays None (the caller runs it here)."""
    todo = [i for i in range(len(items)) if results[i] is None][::-1]
    live: dict[int, tuple[int, int, list[bytes]]] = {}  # read end -> (item, pid, data)
    sel = selectors.DefaultSelector()
    try:
        while todo or live:
            while todo and len(live) < n:
                i = todo.pop()
                try:
                    fd, pid = _spawn(fn, items[i], carry)
                except OSError:  # no process to be had (a limit, memory): the rest run here
                    todo.clear()
                    break
                live[fd] = (i, pid, [])
                sel.register(fd, selectors.EVENT_READ)
            if not live:
                break
            if take_pending():  # Ctrl-C, held while memmagic's code ran: no user frame here
                raise KeyboardInterrupt
            for key, _ in sel.select(_POLL_S):
                fd = key.fd
                chunk = os.read(fd, 1 << 20)
                if chunk:
                    live[fd][2].append(chunk)
                    continue
                sel.unregister(fd)
                os.close(fd)
                i, pid, data = live.pop(fd)
                _, status = os.waitpid(pid, 0)
                results[i] = _decoded(b"".join(data), status, carry)
    except BaseException:
        _stop(live)
        raise
    finally:
        sel.close()


def _spawn(fn: Callable[[Any], Any], item: Any, carry: Any = None) -> tuple[int, int]:
    """A child running ``fn(item)``: (the read end of its pipe, its pid); OSError where
    none can be forked (the pipe closed again)."""
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        raise
    if pid == 0:  # the child: never returns
        os.close(r)
        _child(fn, item, w, carry)
    os.close(w)
    return r, pid


def _child(fn: Callable[[Any], Any], item: Any, w: int, carry: Any) -> None:
    """In a forked child: run, write the pickled result to ``w``, end without this
    process's exit code (its atexit handlers, its buffers, the kernel's sockets)."""
    global _IN_CHILD
    code = 1
    try:
        _IN_CHILD = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # what the run prints goes nowhere (the parent's output is the
        os.dup2(devnull, 2)  # user's: a notebook's, a terminal's)
        sys.stdout = sys.stderr = io.StringIO()
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_num_threads(1)  # one core each (the parent's thread pool is not here)
        mark = carry.mark() if carry is not None else None
        out = _called(fn, item)
        try:
            extra = carry.since(mark) if carry is not None else None
        except Exception:  # noqa: BLE001 - nothing brought back: the parent's state as it is
            extra = None
        try:
            data = pickle.dumps((out, extra), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - no result: the parent runs the item itself
            data = b""
        with os.fdopen(w, "wb") as f:
            f.write(data)
        code = 0
    finally:
        os._exit(code)


def _decoded(data: bytes, status: int, carry: Any) -> tuple[bool, Any] | None:
    if not data or not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        return None
    try:
        out, extra = pickle.loads(data)
    except Exception:  # noqa: BLE001 - no result: the parent runs the item itself
        return None
    if extra is not None:
        try:
            carry.merge(extra)
        except Exception:  # noqa: BLE001 - what it brought is dropped; the result stands
            pass
    return out


def _stop(live: dict[int, tuple[int, int, list[bytes]]]) -> None:
    """Ask every running child to stop, kill those that do not in time, reap all."""
    pids = [pid for _, pid, _ in live.values()]
    for fd in live:
        os.close(fd)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGINT)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STOP_GRACE_S
    for pid in pids:
        while True:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        if not done:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
