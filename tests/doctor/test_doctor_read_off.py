"""The doctor reads sizes off its re-runs: after an out of memory, the batch and context
halvings it re-ran (and one more run where only one fits) draw a line that the runs which
ran out check up to where they stopped; the largest batch and the longest context that
fit by that line are then run to confirm them, and the cell as written gets what it
needs as a whole (evaluated)."""

from __future__ import annotations

import pytest

from memmagic import Cell, doctor
from memmagic.report import format_bytes
from memmagic.backends.sim import resolve_target
from memmagic.whatif import fitmap as F
from tests.whatif.test_fitmap import GPT2, MANUAL

pytest.importorskip("transformers")


def _cell(source: str, batch: int, seq: int, card: str = "1GiB") -> Cell:
    return Cell(source, {"batch_size": batch, "seq_len": seq},
                backend_options={"gpu_memory": card})


@pytest.fixture(scope="module")
def ranked():
    cell = _cell(GPT2, 64, 1024)
    return cell, doctor.rank(cell)


def _read(rows) -> dict:
    return {next(iter(s.knobs)): s for s in rows if "the l" in s.label}


def test_the_largest_batch_and_longest_context_that_fit_are_found_on_the_line(ranked):
    cell, (base, rows, notes) = ranked
    assert base.out_of_memory
    read = _read(rows)
    assert {k: s.label.split(",")[1] for k, s in read.items()} == {
        "batch_size": " the largest that fits", "seq_len": " the longest that fits"}
    for knob, step in (("batch_size", 1), ("seq_len", 64)):
        s = read[knob]
        n = s.knobs[knob]
        run = cell.run(**{knob: n})
        assert s.fits and (s.peak, s.reserved_peak) == (run.peak, run.reserved_peak)
        assert cell.run(**{knob: n + step}).fits is False  # the next one does not fit
        # more than any size of the halvings that fits: the line says something new
        assert n > max(x.knobs[knob] for x in rows if x.fits and set(x.knobs) == {knob}
                       and x is not s)
        found = [m for m in notes if m.startswith(s.label + ": read off the re-runs, then run")]
        assert len(found) == 1 and "checked by the runs at" in found[0]


def test_the_cell_as_written_gets_what_it_needs_whole(ranked):
    cell, (base, rows, notes) = ranked
    need = [n for n in notes if n.startswith("as written the cell needs")]
    assert len(need) == 1 and "evaluated, not run" in need[0]
    # what a run on a card without this one's limit needs
    whole = F._roomy(cell, resolve_target("T4")).run(strict=True)
    assert f"needs {format_bytes(whole.reserved_peak)} of the card's 1.00 GiB" in need[0]


def test_no_read_off_where_the_cell_fits_or_the_runs_give_no_line():
    # it fits: nothing to read off
    _, rows, notes = doctor.rank(_cell(GPT2, 2, 128))
    assert not _read(rows) and not any("line" in n for n in notes)
    # batch 2 fits and 4 does not: a line needs two batches that fit, and batch 1 takes
    # another path, so nothing is read off; a run halves the gap: batch 3
    cell = _cell(MANUAL, 8, 2048)
    _, rows, notes = doctor.rank(cell)
    assert [s.knobs for s in rows if s.fits and set(s.knobs) == {"batch_size"}] == [
        {"batch_size": 2}, {"batch_size": 3}]
    said, = [n for n in notes if n.startswith("batch: ")]
    assert said.startswith("batch: the largest that fits is 3 (4 runs out), found by 1 run "
                           "halving the gap one after another (3): no largest that fits was "
                           "read off between 2 (fit) and 4 (runs out): one run that fits "
                           "draws no line"), said
    s = _read(rows)["batch_size"]
    assert s.label == "batch 3 (from 8), the largest that fits"
    assert (s.peak, s.reserved_peak) == (cell.run(batch_size=3).peak,
                                         cell.run(batch_size=3).reserved_peak)


def test_a_batch_far_too_big_is_halved_until_one_fits_then_read_off():
    """Batch 256 where its halvings 128 and 64 run out too: the doctor halves on (32, 16,
    8) until two fit, and reads the largest batch that fits off their line."""
    cell = _cell(MANUAL, 256, 1024)
    _, rows, notes = doctor.rank(cell)
    s = _read(rows)["batch_size"]
    n = s.knobs["batch_size"]
    assert n < 64 and not any(x.fits for x in rows if x.knobs in ({"batch_size": 128},
                                                                   {"batch_size": 64}))
    run = cell.run(batch_size=n)
    assert (s.peak, s.reserved_peak, s.fits) == (run.peak, run.reserved_peak, True)
    assert cell.run(batch_size=n + 1).fits is False


def test_a_context_with_scores_in_its_square_is_read_off_a_parabola():
    # the contexts 256 and 512 fit and draw a line the run at 1024 does not bear out:
    # the doctor runs 128 too, and the parabola through the three holds up to where the
    # runs at 1024 and 2048 ran out
    cell = _cell(MANUAL, 32, 1024)
    _, rows, notes = doctor.rank(cell)
    read = _read(rows)
    assert set(read) == {"batch_size", "seq_len"}
    s = read["seq_len"]
    n = s.knobs["seq_len"]
    run = cell.run(seq_len=n)
    assert (s.peak, s.reserved_peak, s.fits) == (run.peak, run.reserved_peak, True)
    assert cell.run(seq_len=n + 64).fits is False
    found = [m for m in notes if m.startswith(s.label)]
    assert "parabola through the simulated runs at sequence length 128, 256, 512" in found[0]
