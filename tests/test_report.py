from __future__ import annotations

import subprocess
import sys

import pytest

from memmagic.report import Category, MemoryReport, format_bytes, parse_bytes


def make(**kw):
    base = dict(backend="cpu", device="cpu", before=1000, peak=5000, after=3000, wall_s=0.5,
                breakdown={"parameters": 1000, "other": 4000})
    base.update(kw)
    return MemoryReport(**base)


def test_derived_numbers():
    r = make()
    assert r.increment == 4000
    assert r.retained == 2000
    assert set(r.breakdown) == {c.value for c in Category}
    assert r.breakdown["gradients"] == 0
    assert r.unattributed == 0


def test_report_is_frozen():
    r = make()
    with pytest.raises(AttributeError):
        r.peak = 1
    with pytest.raises(TypeError):
        r.breakdown["other"] = 1


def test_bad_backend_and_category_are_rejected():
    with pytest.raises(ValueError, match="backend must be one of"):
        make(backend="tpu")
    with pytest.raises(ValueError):
        make(breakdown={"weights": 1})


def test_str_and_pretty_are_one_deterministic_line():
    r = make(wall_s=0.1)
    r2 = make(wall_s=9.9)
    assert str(r) == str(r2) == "peak 4.88 KiB (+3.91 KiB), retained +1.95 KiB [cpu: cpu]"
    from IPython.lib.pretty import pretty

    assert pretty(r) == f"<MemoryReport : {r}>"
    assert r._repr_html_() == r2._repr_html_()
    assert "<table>" in r._repr_html_()


def test_fits_uses_reserved_when_known():
    r = make(backend="sim", reserved_peak=8000, gpu_name="tiny", gpu_memory=6000)
    assert r.fits is False
    assert "DOES NOT FIT tiny" in str(r)
    assert make(backend="sim", gpu_memory=6000).fits is True


@pytest.mark.parametrize("n,text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"),
                                     (3 * 2**20, "3.00 MiB"), (-2048, "-2.00 KiB"),
                                     (5 * 2**30, "5.00 GiB")])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize("text,n", [("10GiB", 10 * 2**30), ("512 MiB", 512 * 2**20),
                                     ("16GB", 16 * 10**9), ("1024", 1024), ("1.5g", int(1.5 * 2**30))])
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("bad", ["", "ten GiB", "10XB", "-1GiB"])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError):
        parse_bytes(bad)


def _loaded_by(imports: str, modules: tuple[str, ...]) -> str:
    """Which of ``modules`` a fresh interpreter has loaded after ``import sys, <imports>``."""
    code = f"import sys, {imports}; print([m for m in {modules!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_reading_a_report_needs_no_torch_ipython_or_matplotlib():
    assert _loaded_by("memmagic, memmagic.report",
                      ("torch", "IPython", "ipywidgets", "matplotlib")) == "[]"


def test_core_layers_do_not_import_presentation():
    assert _loaded_by("memmagic.core.tracking, memmagic.backends.cpu, memmagic.api",
                      ("IPython", "ipywidgets", "matplotlib")) == "[]"


def test_the_peak_in_words():
    base = dict(backend="cpu", device="cpu", before=0, peak=1, after=0, wall_s=0.0)
    r = MemoryReport(**base, peak_op="_foreach_sqrt.default", peak_phase="optimizer")
    assert r.peak_words == "during optimizer.step() (_foreach_sqrt)"
    r = MemoryReport(**base, peak_op="gelu_backward.default", peak_phase="backward")
    assert r.peak_words == "during loss.backward() (gelu backward)"
    r = MemoryReport(**base, peak_op="aten.mm.default", peak_phase="backward")
    assert r.peak_words == "during loss.backward() (mm)"
    r = MemoryReport(**base, peak_op="addmm.default", peak_module="GPT.blocks.3.attn",
                     peak_phase="forward")
    assert r.peak_words == "during forward in `GPT.blocks.3.attn` (addmm)"
    assert "during forward in `GPT.blocks.3.attn` (addmm)" in r.summary()
    assert r.to_dict()["peak_words"] == r.peak_words
    assert MemoryReport(**base).peak_words is None


def test_modules_in_a_module_list_are_named_by_their_path():
    import torch
    import torch.nn as nn

    import memmagic

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                                        for _ in range(3))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    m, x = Net(), torch.randn(512, 64)
    with torch.no_grad():
        r = memmagic.measure(lambda: m(x), backend="cpu")
    assert r.peak_phase == "forward" and r.peak_module.startswith("Net.blocks.")
    assert r.peak_words.startswith("during forward in `Net.blocks.")
