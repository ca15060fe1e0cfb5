"""A failed cell's traceback under ``%gpusim on`` (or ``%%gpumem``) starts at the user's
code: not at the ``run_cell_magic('gpumem', ...)`` call the cell became, which would show
the whole cell again as one string."""

from __future__ import annotations

import pytest

BAD = "x = torch.ones(4, 4, device='cuda')\ny = x @ torch.ones(5, 5, device='cuda')\n"


def _shown(ip, capsys, cell: str) -> str:
    capsys.readouterr()
    result = ip.run_cell(cell)
    assert result.error_in_exec is not None
    return capsys.readouterr().out


@pytest.mark.parametrize("xmode", ["Context", "Plain", "Verbose"])
def test_a_simulated_cells_traceback_starts_at_the_users_line(ip, capsys, xmode):
    ip.run_line_magic("xmode", xmode)
    try:
        ip.run_line_magic("gpusim", "on --gpu T4")
        out = _shown(ip, capsys, BAD)
        # (Verbose mode shows IPython's own run_cell_magic frame, as for any cell magic)
        assert "get_ipython().run_cell_magic(" not in out and "--footer" not in out
        assert "y = x @ torch.ones(5, 5, device='cuda')" in out and "RuntimeError" in out
        ip.run_line_magic("gpusim", "off")
        out = _shown(ip, capsys, "%%gpumem --backend sim -q --no-chart\n" + BAD)
        assert "get_ipython().run_cell_magic(" not in out and "y = x @ torch.ones(5, 5" in out
    finally:
        ip.run_line_magic("gpusim", "off")
        ip.run_line_magic("xmode", "Context")


def test_other_cells_keep_their_whole_traceback_and_unloading_restores_the_formatter(ip, capsys):
    out = _shown(ip, capsys, "def f():\n    raise KeyError('k')\nf()\n")
    assert "----> 3 f()" in out and "KeyError" in out
    formatter = ip.InteractiveTB
    assert "structured_traceback" in vars(formatter)   # memmagic's, while loaded
    ip.run_line_magic("unload_ext", "memmagic")
    try:
        assert "structured_traceback" not in vars(formatter)
    finally:
        ip.run_line_magic("load_ext", "memmagic")
