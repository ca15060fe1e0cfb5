"""Independent runs side by side in forked children (memmagic.core.forked): results come
back in order and as they would here, failures as values, a child that dies leaves its
item to this process, Ctrl-C stops and reaps every child after it cleaned up; the
doctor's re-runs and the fit map's runs give the same figures either way."""

from __future__ import annotations

import os
import pickle
import signal
import time

import pytest

from memmagic.core import forked
from memmagic.report import MemoryReport

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


@pytest.fixture
def two(monkeypatch):
    monkeypatch.setenv("MEMMAGIC_WORKERS", "2")
    monkeypatch.setattr(forked, "FORK_WORTH_S", 0.0)  # the tests' runs are quick
    if forked.workers(2) != 2:
        pytest.skip("this platform runs everything in one process")


def _no_children_left() -> bool:
    try:
        os.waitpid(-1, os.WNOHANG)  # a child running or a zombie: one is left
    except ChildProcessError:
        return True
    return False


def test_results_come_back_in_order_from_children(two):
    me = os.getpid()
    out = forked.run_all(lambda x: (x * x, os.getpid()), list(range(5)))
    assert [v for _, (v, _) in out] == [0, 1, 4, 9, 16]
    assert all(ok for ok, _ in out)
    assert all(pid != me for _, (_, pid) in out)  # each ran in a child
    assert _no_children_left()


def test_warm_items_run_here_first(two):
    me = os.getpid()
    out = forked.run_all(lambda x: os.getpid(), [0, 1, 2], warm=1)
    assert out[0] == (True, me) and all(pid != me for _, pid in out[1:])


def test_items_quicker_than_a_child_is_worth_run_here(two, monkeypatch):
    me = os.getpid()
    monkeypatch.setattr(forked, "FORK_WORTH_S", 0.2)
    assert forked.run_all(lambda x: os.getpid(), [0, 1], each_s=0.05) == [(True, me)] * 2
    # measured on the warm item: quick, so the rest run here too
    assert forked.run_all(lambda x: os.getpid(), [0, 1, 2], warm=1) == [(True, me)] * 3

    def slow(x):
        time.sleep(0.25)
        return os.getpid()
    out = forked.run_all(slow, [0, 1, 2], warm=1)
    assert out[0] == (True, me) and all(pid != me for _, pid in out[1:])


def test_an_exception_comes_back_as_a_value(two):
    def fn(x):
        if x == 1:
            raise ValueError(f"bad {x}")
        return x
    out = forked.run_all(fn, [0, 1, 2])
    assert out[0] == (True, 0) and out[2] == (True, 2)
    ok, exc = out[1]
    assert not ok and type(exc) is ValueError and str(exc) == "bad 1"


def test_an_item_whose_child_died_or_sent_nothing_runs_here(two):
    me = os.getpid()

    def fn(x):
        if os.getpid() != me and x == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # the child dies without a word
        if x == 1:
            return lambda: x, os.getpid()  # a result that does not pickle
        return x, os.getpid()
    out = forked.run_all(fn, [0, 1, 2])
    assert out[0] == (True, (0, me)) and out[1][1][1] == me  # both run here again
    assert out[2][1][0] == 2 and out[2][1][1] != me


def test_where_no_child_can_be_forked_the_items_run_here(two, monkeypatch):
    me, forks = os.getpid(), []

    def fork():
        forks.append(1)
        if len(forks) > 1:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        return real_fork()
    real_fork = os.fork
    monkeypatch.setattr(os, "fork", fork)
    out = forked.run_all(lambda x: (x, os.getpid()), [0, 1, 2])
    assert [v for _, (v, _) in out] == [0, 1, 2]
    assert out[0][1][1] != me and out[1][1][1] == me == out[2][1][1]
    assert _no_children_left()


def test_one_worker_or_one_item_runs_here(monkeypatch):
    me = os.getpid()
    monkeypatch.setenv("MEMMAGIC_WORKERS", "1")
    assert forked.run_all(lambda x: os.getpid(), [0, 1]) == [(True, me), (True, me)]
    monkeypatch.delenv("MEMMAGIC_WORKERS")
    assert forked.run_all(lambda x: os.getpid(), [0]) == [(True, me)]


def test_a_bad_worker_count_says_what_to_give(monkeypatch):
    monkeypatch.setenv("MEMMAGIC_WORKERS", "two")
    with pytest.raises(ValueError, match="MEMMAGIC_WORKERS='two': give a whole number"):
        forked.run_all(lambda x: x, [0, 1])


def test_ctrl_c_stops_every_child_after_its_cleanup_and_reaps_it(two, tmp_path):
    def fn(x):
        try:
            time.sleep(60)
        finally:  # an interrupted run undoes what it installed: it gets to do so
            (tmp_path / f"cleaned-{x}").write_text("yes")
    old = signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            forked.run_all(fn, [0, 1, 2])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert time.monotonic() - t0 < 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cleaned-0", "cleaned-1"]
    assert _no_children_left()


def test_ctrl_c_under_memmagics_guard_is_taken_by_the_wait(two, tmp_path):
    """In a cell or a script's run memmagic's guard holds an interrupt that finds only its
    own frames; the wait for children has no user frame, so it takes the interrupt."""
    import threading

    from memmagic.core.interrupts import guarded

    def fn(x):
        try:
            time.sleep(60)
        finally:
            (tmp_path / f"cleaned-{x}").write_text("yes")
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    t0 = time.monotonic()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            with guarded(strict=True):
                forked.run_all(fn, [0, 1, 2])
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cleaned-0", "cleaned-1"]
    assert _no_children_left()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_a_report_pickles_with_its_breakdowns_frozen():
    r = MemoryReport("sim", "cuda:0", 0, 1024, 512, 0.1, breakdown={"parameters": 1024},
                     notes=("a note",))
    back = pickle.loads(pickle.dumps(r))
    assert back == r and back.breakdown["parameters"] == 1024
    with pytest.raises(TypeError):
        back.breakdown["parameters"] = 0  # still read-only


def _counting(monkeypatch) -> list:
    spawned, spawn = [], forked._spawn
    monkeypatch.setattr(forked, "_spawn", lambda *a: spawned.append(1) or spawn(*a))
    return spawned


def _rows(workers: str, monkeypatch, cell_source: str) -> tuple:
    from memmagic import Cell, doctor

    monkeypatch.setenv("MEMMAGIC_WORKERS", workers)
    cell = Cell(cell_source, {"batch_size": 64, "seq_len": 1024},
                backend_options={"gpu_memory": "1GiB"})
    base, rows, notes = doctor.rank(cell)
    return (base, rows, notes), [(s.label, s.peak, s.reserved_peak, s.fits, s.reason)
                                 for s in (base, *rows)]


def test_the_doctor_ranks_the_same_rows_with_its_reruns_side_by_side(two, monkeypatch):
    from tests.whatif.test_fitmap import MANUAL

    (base, rows, notes), serial = _rows("1", monkeypatch, MANUAL)
    assert base.out_of_memory and len(rows) >= 3  # re-runs to spread
    spawned = _counting(monkeypatch)
    (_, _, notes2), side = _rows("2", monkeypatch, MANUAL)
    assert side == serial and notes2 == notes
    assert len(spawned) >= 3  # the re-runs did run in children
    assert _no_children_left()


def test_the_fit_map_is_the_same_with_its_runs_side_by_side(two, monkeypatch):
    from memmagic import Cell
    from memmagic.whatif.fitmap import fit_map
    from tests.whatif.test_fitmap import MANUAL

    maps, spawned = [], _counting(monkeypatch)
    for workers in ("1", "2"):
        monkeypatch.setenv("MEMMAGIC_WORKERS", workers)
        cell = Cell(MANUAL, {"batch_size": 2, "seq_len": 64}, backend_options={"gpu": "T4"})
        fm = fit_map(cell, batch=(1, 64), seq=(128, 2048), step=128)
        maps.append((fm.method, fm.largest, fm.runs, fm.checks, fm.notes))
    assert maps[0][0] == "plane" and maps[0] == maps[1]
    assert len(spawned) >= 4


def test_what_a_childs_run_adds_to_the_op_caches_comes_back(two):
    """A run in a child fills the op caches for its new sizes; those entries come back, so
    the same run here afterwards finds every op in the caches (none derived or missed)."""
    from memmagic.backends.sim import OP_CACHES, SimBackend, backend as sim_backend_mod
    from tests.whatif.test_fitmap import MANUAL

    def stats_after(carry) -> dict:
        on = SimBackend(gpu="T4")

        def run(b: int) -> int:
            ns = {"batch_size": b, "seq_len": 64}
            return on.execute(lambda n: exec(compile(MANUAL, "<cell>", "exec"), n), ns).report.peak
        sim_backend_mod._FAST_ENTRIES.clear()
        run(2)  # the cell's own sizes, here
        done = forked.run_all(run, [3, 5], carry=carry)
        assert all(ok for ok, _ in done)
        run(3)
        return on.last_run_stats

    saved = dict(sim_backend_mod._FAST_ENTRIES)
    try:
        without, brought = stats_after(None), stats_after(OP_CACHES)
    finally:
        sim_backend_mod._FAST_ENTRIES.clear()
        sim_backend_mod._FAST_ENTRIES.update(saved)
    assert without["cache_misses"] + without["cache_derived"] > 0  # new sizes: new entries
    assert brought["cache_misses"] == brought["cache_derived"] == 0, brought  # they came back
    assert brought["cache_hits"] > 0
