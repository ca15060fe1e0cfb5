from __future__ import annotations

import pytest
import torch

import memmagic
from memmagic import MemoryReport


def test_measure_a_function():
    r = memmagic.measure(lambda: torch.nn.Linear(10, 10), backend="cpu")
    assert isinstance(r, MemoryReport)
    assert r.increment == (100 + 10) * 4


def test_track_a_with_block():
    with memmagic.track(backend="cpu") as m:
        keep = torch.ones(1000)
    assert m.report.retained == 4000
    del keep


def test_measure_reraises_with_the_report_attached(clean_state):
    def boom():
        _t = torch.ones(10)
        raise KeyError("k")
    with pytest.raises(KeyError) as info:
        memmagic.measure(boom, backend="cpu")
    assert info.value.memmagic_report.error == "KeyError: 'k'"


def test_track_reraises_keyboard_interrupt(clean_state):
    with pytest.raises(KeyboardInterrupt) as info:
        with memmagic.track(backend="cpu"):
            raise KeyboardInterrupt
    assert info.value.memmagic_report.error == "KeyboardInterrupt"


def test_bad_backend_names_the_choices():
    with pytest.raises(ValueError, match="auto, cuda, cpu, sim"):
        memmagic.measure(lambda: None, backend="gpu")


def test_measure_needs_a_callable():
    with pytest.raises(TypeError, match="function"):
        memmagic.measure(torch.ones(3), backend="cpu")
