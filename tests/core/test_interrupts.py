"""Ctrl-C, honoured at once and never inside memmagic's bookkeeping: a weakref callback,
the allocator model's update, torch's Python under fake tensors or an import in progress
(memmagic.core.interrupts), with real SIGINTs to a real kernel."""

from __future__ import annotations

import gc
import queue
import random
import signal
import sys
import textwrap
import threading
import time
import weakref

import pytest

from memmagic.core.interrupts import atomic, guarded, held

from kernel_support import Kernel


def _sigint() -> None:
    signal.raise_signal(signal.SIGINT)


def test_held_finishes_the_block_then_raises():
    done = []
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with held():
            _sigint()
            done.append("after the signal")
    assert done == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is before


@atomic
def _keep_books(log: list) -> None:
    log.append("first half")
    _sigint()
    log.append("second half")


def test_an_interrupt_in_a_marked_function_lands_at_the_callers_next_line():
    log: list = []
    with pytest.raises(KeyboardInterrupt):
        with guarded():
            _keep_books(log)
            log.append("caller's next line")
    assert log == ["first half", "second half"]
    assert sys.gettrace() is None


_OWN_CODE = """
import contextlib, signal

def keep_books(log):
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: (signal.raise_signal(signal.SIGINT), log.append("callback")))
    log.append("after the with")
"""


def test_the_standard_library_that_memmagic_calls_counts_as_memmagic():
    """contextlib's ``__exit__`` run by memmagic's (or, under a simulation, torch's) ``with``
    is their code: an interrupt there would leave the ``with`` half undone (torch's mode
    stack half popped: "trying to pop from empty mode stack")."""
    ns = {"__name__": "memmagic.owned_by_a_test"}
    exec(compile(_OWN_CODE, "<memmagic's code>", "exec"), ns)
    log: list = []
    with pytest.raises(KeyboardInterrupt):
        with guarded():
            ns["keep_books"](log)
            log.append("caller's next line")
    assert log == ["callback", "after the with"]


def test_an_interrupt_in_a_weakref_callback_is_not_lost(monkeypatch):
    ignored = []
    monkeypatch.setattr(sys, "unraisablehook", ignored.append)
    freed = []

    class Obj:
        pass

    @atomic
    def on_free(_ref):
        _sigint()
        freed.append(True)

    obj = Obj()
    ref = weakref.ref(obj, on_free)
    with pytest.raises(KeyboardInterrupt):
        with guarded():
            del obj  # the callback runs here
            freed.append("after")
    assert freed == [True] and not ignored and ref() is None


def test_an_interrupt_during_an_import_waits_for_the_import(tmp_path, monkeypatch):
    (tmp_path / "slow_mod_for_interrupts.py").write_text(textwrap.dedent("""
        import signal
        signal.raise_signal(signal.SIGINT)
        FIRST = 1
        SECOND = 2
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        with guarded():
            import slow_mod_for_interrupts  # noqa: F401
    mod = sys.modules.pop("slow_mod_for_interrupts")
    assert mod.SECOND == 2  # imported whole, then interrupted


def test_a_plain_interrupt_raises_at_once_and_the_handler_comes_back():
    before = signal.getsignal(signal.SIGINT)
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with guarded():
            _sigint()
            reached.append(True)
    assert not reached and signal.getsignal(signal.SIGINT) is before


def test_no_handler_is_installed_outside_the_main_thread():
    seen = []

    def other():
        with guarded():
            seen.append(signal.getsignal(signal.SIGINT))

    before = signal.getsignal(signal.SIGINT)
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == [before]


def test_ctrl_c_while_the_whatif_panel_is_built_stops_the_cell(ip):
    pytest.importorskip("ipywidgets")
    result = ip.run_cell(textwrap.dedent("""\
        %%gpumem --backend sim --whatif --var panel
        import signal
        batch_size = 8
        m = torch.nn.Linear(64, 64).cuda()
        loss = m(torch.randn(batch_size, 64, device="cuda")).sum()
        signal.raise_signal(signal.SIGINT)
        loss.backward()
    """))
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    assert "panel" not in ip.user_ns  # no panel was made from the interrupted run
    # the traceback IPython keeps holds the user's frames, not the simulation's
    gc.collect()
    card = getattr(getattr(ip, "_memmagic_sim_session", None), "card", None)
    assert not [o for o in gc.get_objects() if type(o).__name__ == "SimTracker"
                and o is not getattr(card, "tracker", None)]


def test_a_ctrl_c_in_a_panel_rerun_stops_it(ip):
    pytest.importorskip("ipywidgets")
    runs = []

    def step():
        runs.append(1)
        if len(runs) == 2:  # the first re-run after the baseline
            _sigint()

    ip.user_ns.update(step=step, batch_size=8)
    ip.run_cell(textwrap.dedent("""\
        %%gpumem --backend sim --whatif --var panel --quiet
        m = torch.nn.Linear(64, 64).cuda()
        loss = m(torch.randn(batch_size, 64, device="cuda")).sum()
        step()
        loss.backward()
    """))
    panel = ip.user_ns["panel"]
    with pytest.raises(KeyboardInterrupt):
        panel.cell.run(batch_size=16)
    assert len(runs) == 2


# -- a real kernel, real SIGINTs -----------------------------------------------------------
_MODEL = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU())
                              for _ in range(6)]).cuda()
opt = torch.optim.AdamW(model.parameters())
"""
_LOOP = """
print("looping", flush=True)
for i in range(10**6):
    xb = torch.randn(64, 256, device="cuda")
    loss = model(xb).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    tmp = [torch.empty(1000 * (j + 1), device="cuda") for j in range(4)]
    del tmp
"""
_CLEAR = "xb = loss = tmp = None\nopt.zero_grad(set_to_none=True)\n"
# the card's books, read for real: the tracker's count, the allocator model's, its blocks'
_BOOKS = """%gpusim off
import gc, sys
for _name in ("last_type", "last_value", "last_traceback", "last_exc"):
    setattr(sys, _name, None)
gc.collect()
from memmagic.backends.sim.session import shell_session
_card = shell_session(get_ipython()).card
_tr, _al = _card.tracker, _card.tracker.allocator
print("BOOKS", _tr.current["device"], _al.allocated, sum(b.size for b in _al._live.values()),
      sorted(_al._live) == sorted(_tr.alloc_bytes))
"""


def _read_books(kernel: Kernel) -> str:
    reply = kernel.run(_BOOKS)
    kernel.run("%gpusim on")
    lines = [ln for ln in reply.out.splitlines() if ln.startswith("BOOKS")]
    assert lines, reply.err
    return lines[0]


@pytest.fixture
def kernel(tmp_path):
    k = Kernel(cwd=str(tmp_path))
    yield k
    k.close()


def test_real_sigints_at_random_moments_are_all_honoured_and_the_card_stays_exact(kernel):
    """120 Ctrl-Cs at random moments of a simulated training loop: each stops the cell
    with KeyboardInterrupt within seconds, none is printed as "Exception ignored", and
    after each the card's books agree with each other and with the card before."""
    for code in ("%load_ext memmagic\n%gpusim on --gpu T4", _MODEL):
        reply = kernel.run(code)
        assert reply.error is None, reply.err
    rng = random.Random(36)
    base = None
    waits = []
    for i in range(120):
        msg_id = kernel.send(_LOOP)
        kernel.printed(msg_id, "looping")
        time.sleep(rng.uniform(0.0, 0.25))
        sent = time.monotonic()
        kernel.interrupt()
        try:
            reply = kernel.reply(msg_id, timeout=10)
        except queue.Empty:
            pytest.fail(f"interrupt {i} was not honoured within 10 s")
        waits.append(time.monotonic() - sent)
        assert reply.error == "KeyboardInterrupt", (i, reply.err[-2000:])
        assert "Exception ignored" not in reply.err, (i, reply.err[-2000:])
        assert kernel.run(_CLEAR).error is None
        books = _read_books(kernel)
        _, tracked, allocated, blocks, same_keys = books.split()
        assert tracked == allocated == blocks and same_keys == "True", (i, books)
        if i == 2:
            base = books
        elif i > 2:
            assert books == base, (i, books, base)
        assert kernel.alive()
    waits.sort()
    assert waits[len(waits) // 2] < 1.0, waits  # the median: honoured at once


_FIRST_USE = [
    "%load_ext memmagic",
    "%gpusim on --gpu T4",
    "import torch\nm = torch.nn.Linear(64, 64).cuda()\nm(torch.randn(8, 64, device='cuda')).sum().backward()",
    "%%gpumem --var r\nloss = m(torch.randn(8, 64, device='cuda')).sum()",
    "%gpusim off",
    "from memmagic.charts.plots import timeline_figure, breakdown_figure\n"
    "fig, fig2 = timeline_figure(r), breakdown_figure(r)\nprint('charts drawn')",
]


@pytest.mark.parametrize("delay", [0.4, 1.2, 2.2])
def test_a_ctrl_c_during_first_use_leaves_a_kernel_that_works(tmp_path, delay):
    """Ctrl-C while memmagic is first loaded and first used (torch._prims, sympy and
    matplotlib imported for the first time): the same cells run again work."""
    kernel = Kernel(cwd=str(tmp_path))
    try:
        ids = [kernel.send(code) for code in _FIRST_USE]
        time.sleep(delay)
        kernel.interrupt()
        for msg_id in ids:
            kernel.reply(msg_id)
        for code in _FIRST_USE:
            reply = kernel.run(code)
            assert reply.error is None, (code, reply.err[-3000:])
        assert "charts drawn" in reply.out
    finally:
        kernel.close()


def test_a_half_imported_module_gets_one_line_saying_restart(_shell, monkeypatch, capsys):
    import memmagic

    def broken(_ip):
        raise AttributeError("partially initialized module 'torch' has no attribute 'distributed'")

    monkeypatch.setattr(memmagic, "_load", broken)
    _shell.run_line_magic("unload_ext", "memmagic")
    _shell.run_cell("%load_ext memmagic")
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "restart the kernel" in err and "partially initialized" in err
    monkeypatch.undo()
    _shell.run_line_magic("load_ext", "memmagic")
    _shell.run_line_magic("unload_ext", "memmagic")


def test_a_programs_own_sigint_handler_is_called_where_the_interrupt_lands():
    calls = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(frame.f_code.co_name))
    try:
        log: list = []
        with guarded():
            _keep_books(log)  # held through the marked frame, then given to the handler
            log.append("went on")
    finally:
        signal.signal(signal.SIGINT, old)
    assert log == ["first half", "second half", "went on"]
    assert calls == ["test_a_programs_own_sigint_handler_is_called_where_the_interrupt_lands"]


def test_ctrl_c_stops_a_script_run_from_the_command_line(tmp_path):
    import subprocess

    (tmp_path / "loop.py").write_text(textwrap.dedent("""
        import torch
        m = torch.nn.Linear(256, 256).cuda()
        print("started", flush=True)
        while True:
            m(torch.randn(64, 256, device="cuda")).sum().backward()
    """))
    proc = subprocess.Popen([sys.executable, "-m", "memmagic", "run", "--gpu", "T4", "loop.py"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "started"
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted (Ctrl-C)" in err and "Exception ignored" not in err
    assert "peak" in out  # the report of the run until then
