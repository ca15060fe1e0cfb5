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


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is usable: CUDA code runs")
@pytest.mark.parametrize("backend", ["auto", "cpu"])
def test_cuda_code_without_a_gpu_hints_the_sim_backend(backend):
    with pytest.raises(AssertionError, match="not compiled with CUDA") as info:
        memmagic.measure(lambda: torch.zeros(3, device="cuda"), backend=backend)
    hint, = info.value.__notes__
    assert 'backend="sim"' in hint and "\n" not in hint
    r = memmagic.measure(lambda: torch.zeros(3, device="cuda"), backend="sim")
    assert r.peak == 512


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is usable: CUDA code runs")
def test_track_hints_the_sim_backend_too():
    with pytest.raises(AssertionError) as info:
        with memmagic.track(backend="cpu"):
            torch.ones(3).cuda()
    assert any('backend="sim"' in n for n in info.value.__notes__)


def test_gpu_memory_in_bytes_below_the_minimum_is_an_error():
    with pytest.raises(ValueError, match=r"gpu_memory=6 is 6 B, below .*64.00 MiB.*'6GiB'"):
        memmagic.measure(lambda: None, backend="sim", gpu_memory=6)
    r = memmagic.measure(lambda: None, backend="sim", gpu_memory=6 << 30)
    assert r.gpu_memory == 6 << 30


def test_nested_cpu_measure_keeps_the_outer_peak(clean_state):
    def outer():
        a = torch.ones(1000)
        inner = memmagic.measure(lambda: torch.ones(2000).sum(), backend="cpu")
        return a, inner

    r = memmagic.measure(outer, backend="cpu")
    assert r.increment >= 4000 + 8000 + 4


def test_track_reads_like_the_report_after_the_block():
    import torch

    import memmagic

    with memmagic.track(backend="cpu") as m:
        with pytest.raises(AttributeError, match="once the with-block has ended"):
            m.peak
        y = torch.ones(1024)
    assert m.report is not None
    assert m.increment == m.report.increment >= 4096
    assert m.breakdown == m.report.breakdown and "peak" in m.summary()
    assert repr(m).startswith("<Measurement : peak")
    del y
